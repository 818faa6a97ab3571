"""host/sockets.py `IntKindSocket` and `new_socket`: the sockets the proxy hands to the event
loop read `family` and `type` as ints equal to socket's enums, and `new_socket` makes them
non-blocking from socket() itself."""

from __future__ import annotations

import fcntl
import os
import socket

from ambient_mesh.host.sockets import IntKindSocket, new_socket, plain_socket


def test_family_and_type_are_ints_equal_to_the_enums():
    with IntKindSocket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
        assert type(sock.family) is int and type(sock.type) is int
        assert sock.family == socket.AF_INET6 and sock.type == socket.SOCK_STREAM
        assert sock.proto == 0 and sock.fileno() >= 0
    assert sock.fileno() == -1  # closed by the context manager, as socket.socket is


def test_plain_socket_is_an_int_kind_socket_of_the_type_asked():
    with plain_socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        assert isinstance(sock, IntKindSocket) and sock.type == socket.SOCK_DGRAM


def test_new_socket_is_non_blocking_in_the_kernel_and_for_python():
    with new_socket(socket.AF_INET, mark=None) as sock:
        assert isinstance(sock, IntKindSocket)
        assert sock.type == socket.SOCK_STREAM  # SOCK_NONBLOCK is not part of the type
        assert sock.gettimeout() == 0.0
        assert fcntl.fcntl(sock.fileno(), fcntl.F_GETFL) & os.O_NONBLOCK


def test_new_socket_from_another_factory_is_non_blocking_from_socket_itself():
    """A factory (the in-pod one makes sockets in the pod's netns) is handed SOCK_NONBLOCK in
    the type, so its socket is non-blocking from socket(), with no FIONBIO ioctl after it."""
    made = []

    def factory(family: int, type: int) -> socket.socket:
        made.append(type)
        return socket.socket(family, type)

    with new_socket(socket.AF_INET, mark=None, factory=factory) as sock:
        assert made == [socket.SOCK_STREAM | socket.SOCK_NONBLOCK]
        assert sock.gettimeout() == 0.0
        assert fcntl.fcntl(sock.fileno(), fcntl.F_GETFL) & os.O_NONBLOCK
