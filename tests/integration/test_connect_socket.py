"""inputs.connect_started and wait_connected: the proxy's connect to apps, without the event
loop's name resolution; errors and messages as loop.sock_connect gives them, and its deadline."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from ambient_mesh.proxy.inputs import connect_started, wait_connected


async def connect_socket(sock: socket.socket, address: tuple, timeout_s: float) -> None:
    """The two halves as ProxyInputs.connect and the inbound path use them."""
    if not connect_started(sock, address):
        await wait_connected(sock, address, timeout_s)


def _client() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    return sock


async def test_connects_to_a_listener():
    with socket.create_server(("127.0.0.1", 0)) as server, _client() as sock:
        await connect_socket(sock, server.getsockname(), 5.0)
        accepted, peer = server.accept()
        accepted.close()
        assert peer == sock.getsockname()


async def test_refused_like_sock_connect():
    with socket.create_server(("127.0.0.1", 0)) as server:
        closed = server.getsockname()
    loop = asyncio.get_running_loop()
    with _client() as ours, _client() as theirs:
        with pytest.raises(ConnectionRefusedError) as mine:
            await connect_socket(ours, closed, 5.0)
        with pytest.raises(ConnectionRefusedError) as loops:
            await loop.sock_connect(theirs, closed)
    assert str(mine.value) == str(loops.value) == f"[Errno 111] Connect call failed {closed}"


async def test_times_out_when_the_handshake_is_not_answered():
    """A listener with a full accept queue drops SYNs: the connect waits, then the deadline."""
    with socket.create_server(("127.0.0.1", 0), backlog=0) as server:
        address = server.getsockname()
        first = _client()
        await connect_socket(first, address, 5.0)  # fills the queue (backlog 0 holds one)
        with first, _client() as sock:
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                await connect_socket(sock, address, 0.3)
            assert 0.25 <= time.monotonic() - started < 3
            assert not asyncio.get_running_loop().remove_writer(sock)  # no writer left behind


async def test_cancelled_while_connecting_leaves_no_writer():
    with socket.create_server(("127.0.0.1", 0), backlog=0) as server:
        address = server.getsockname()
        first = _client()
        await connect_socket(first, address, 5.0)
        with first, _client() as sock:
            task = asyncio.ensure_future(connect_socket(sock, address, 30.0))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert not asyncio.get_running_loop().remove_writer(sock)


async def test_a_handshake_done_inside_connect_needs_no_wait(monkeypatch):
    """On loopback the kernel usually completes the handshake within connect(): no writer then
    (at least one of 20 connects on a loaded host; every one of them connected)."""
    loop = asyncio.get_running_loop()
    writers = []
    real_add_writer = loop.add_writer

    def add_writer(*args):
        writers.append(args)
        return real_add_writer(*args)

    monkeypatch.setattr(loop, "add_writer", add_writer)
    with socket.create_server(("127.0.0.1", 0), backlog=32) as server:
        for _ in range(20):
            with _client() as sock:
                await connect_socket(sock, server.getsockname(), 5.0)
                assert sock.getpeername() == server.getsockname()
            server.accept()[0].close()
    assert len(writers) < 20
