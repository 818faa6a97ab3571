"""Linux socket options the node proxy needs, in one place.

Counterparts: ztunnel src/socket.rs (orig_dst_addr, set_transparent, set_mark) and
src/proxy.rs (keepalive). Everything here is a thin, typed wrapper over setsockopt/getsockopt.
"""

from __future__ import annotations

import errno
import socket
import struct
from collections.abc import Callable

from ..errors import AmbientError
from ..net import SocketAddr, ip_address

# linux/netfilter_ipv4.h SO_ORIGINAL_DST and linux/netfilter_ipv6/ip6_tables.h IP6T_SO_ORIGINAL_DST
SO_ORIGINAL_DST = 80
IP6T_SO_ORIGINAL_DST = 80
SOL_IPV6 = getattr(socket, "SOL_IPV6", 41)
IP_TRANSPARENT = getattr(socket, "IP_TRANSPARENT", 19)
IPV6_TRANSPARENT = 75
IP_FREEBIND = getattr(socket, "IP_FREEBIND", 15)
SO_MARK = getattr(socket, "SO_MARK", 36)
TCP_USER_TIMEOUT = getattr(socket, "TCP_USER_TIMEOUT", 18)

LISTEN_BACKLOG = 1024


def original_destination(sock: socket.socket) -> SocketAddr:
    """The destination a REDIRECT rule rewrote, read from conntrack via SO_ORIGINAL_DST.

    Tries IPv4 then IPv6 (as ztunnel does) and falls back to the local address when the
    connection was not redirected (it arrived at the listener directly).
    """
    try:
        raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
        port = struct.unpack_from("!H", raw, 2)[0]
        return SocketAddr(ip_address(raw[4:8]), port)
    except OSError:
        pass
    try:
        raw = sock.getsockopt(SOL_IPV6, IP6T_SO_ORIGINAL_DST, 28)
        port = struct.unpack_from("!H", raw, 2)[0]
        return SocketAddr(ip_address(raw[8:24]), port)
    except OSError:
        return SocketAddr.from_sockaddr(sock.getsockname())


def set_mark(sock: socket.socket, mark: int) -> None:
    """Mark the socket so capture rules skip the proxy's own traffic (ztunnel PACKET_MARK)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_MARK, mark)
    except PermissionError as e:
        raise AmbientError(
            f"cannot set SO_MARK {mark} on a socket: {e.strerror}",
            hint="the node proxy needs CAP_NET_ADMIN to mark its sockets (run as root or unset PACKET_MARK)",
        ) from None


def set_transparent(sock: socket.socket, family: int) -> bool:
    """Allow binding a non-local source address (original-source preservation). Best effort."""
    try:
        if family == socket.AF_INET6:
            sock.setsockopt(SOL_IPV6, IPV6_TRANSPARENT, 1)
        else:
            sock.setsockopt(socket.SOL_IP, IP_TRANSPARENT, 1)
        return True
    except OSError as e:
        if e.errno in (errno.EPERM, errno.ENOPROTOOPT, errno.EACCES):
            return False
        raise


def configure_accepted(sock: socket.socket, *, keepalive: KeepaliveSettings | None) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if keepalive is not None:
        keepalive.apply(sock)


class KeepaliveSettings:
    """TCP keepalive on proxied sockets (ztunnel KEEPALIVE_* settings)."""

    __slots__ = ("time_s", "interval_s", "retries", "user_timeout")

    def __init__(self, time_s: int, interval_s: int, retries: int, user_timeout: bool = False) -> None:
        self.time_s = time_s
        self.interval_s = interval_s
        self.retries = retries
        self.user_timeout = user_timeout

    def apply(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, self.time_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, self.interval_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, self.retries)
        if self.user_timeout:
            ms = (self.time_s + self.retries * self.interval_s) * 1000
            sock.setsockopt(socket.IPPROTO_TCP, TCP_USER_TIMEOUT, ms)


SocketFactory = Callable[[int], socket.socket]
"""Creates a TCP socket of a family; in-pod proxies create theirs inside the pod's netns."""


def plain_socket(family: int, type: int = socket.SOCK_STREAM) -> socket.socket:
    return socket.socket(family, type)


def new_socket(family: int, *, mark: int | None, factory: SocketFactory = plain_socket) -> socket.socket:
    sock = factory(family)
    sock.setblocking(False)
    if mark is not None:
        set_mark(sock, mark)
    return sock


def listen_socket(
    addr: SocketAddr,
    *,
    mark: int | None = None,
    transparent: bool = False,
    reuse_port: bool = False,
    factory: SocketFactory = plain_socket,
) -> socket.socket:
    """A listening socket bound as ztunnel binds: `[::]` listeners are dual-stack."""
    sock = factory(addr.family)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if addr.family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        if mark is not None:
            set_mark(sock, mark)
        if transparent:
            set_transparent(sock, addr.family)
        sock.bind(addr.sockaddr())
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
