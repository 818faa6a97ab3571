"""Linux sockets as the node proxy and its DNS proxy open them: options and factories, in one place.

Counterparts: ztunnel src/socket.rs (orig_dst_addr, set_transparent, set_mark) and
src/proxy.rs (keepalive and user timeout, `KeepaliveSettings`). Everything here is a thin, typed wrapper over setsockopt/getsockopt.
"""

from __future__ import annotations

import _socket
import errno
import math
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import ZtunnelConfig
from ..errors import AmbientError
from ..net import IPAddress, SocketAddr, ip_address, ip_text

# linux/netfilter_ipv4.h SO_ORIGINAL_DST and linux/netfilter_ipv6/ip6_tables.h IP6T_SO_ORIGINAL_DST
SO_ORIGINAL_DST = 80
IP6T_SO_ORIGINAL_DST = 80
SOL_IPV6 = getattr(socket, "SOL_IPV6", 41)
IP_TRANSPARENT = getattr(socket, "IP_TRANSPARENT", 19)
IPV6_TRANSPARENT = 75
IP_FREEBIND = getattr(socket, "IP_FREEBIND", 15)
SO_MARK = getattr(socket, "SO_MARK", 36)
TCP_USER_TIMEOUT = getattr(socket, "TCP_USER_TIMEOUT", 18)
IP_BIND_ADDRESS_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)  # linux/in.h, Linux 4.2

LISTEN_BACKLOG = 1024


# Original destinations by SO_ORIGINAL_DST's raw bytes: a pod's connections go to the same few
# services and pods, and the unpacking, address lookup and SocketAddr were a few µs of every
# captured connection (docs/performance.md, "The per-connection path"). Cleared when full.
ORIGINAL_DESTINATIONS_KEPT = 4096
_original_destinations: dict[bytes, SocketAddr] = {}


def original_destination(sock: socket.socket) -> SocketAddr:
    """The destination a REDIRECT rule rewrote, read from conntrack via SO_ORIGINAL_DST.

    Tries IPv4 then IPv6 (as ztunnel does) and falls back to the local address when the
    connection was not redirected (it arrived at the listener directly).
    """
    try:
        raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)  # struct sockaddr_in
        ip_at = slice(4, 8)
    except OSError:
        try:
            raw = sock.getsockopt(SOL_IPV6, IP6T_SO_ORIGINAL_DST, 28)  # struct sockaddr_in6
            ip_at = slice(8, 24)
        except OSError:
            return SocketAddr.from_sockaddr(sock.getsockname())
    # The two structs differ in length, so their raw bytes never meet as one key.
    found = _original_destinations.get(raw)
    if found is None:
        if len(_original_destinations) >= ORIGINAL_DESTINATIONS_KEPT:
            _original_destinations.clear()
        found = _original_destinations[raw] = SocketAddr(
            ip_address(raw[ip_at]), struct.unpack_from("!H", raw, 2)[0]
        )
    return found


def is_own_listener(sock: socket.socket, target: SocketAddr, listener_ports: frozenset[int]) -> bool:
    """`target` (the original destination of accepted `sock`) is the listener `sock` came
    from: the client dialed the capture listener itself, it was not redirected there.

    An accepted socket's local port is its listener's, so a target on any other port cannot be
    it: the local address (a getsockname call) is read only when `target.port` is one of the
    proxy's listener ports (`listener_ports`, ProxyInputs.illegal_ports once the listeners are
    bound), not for every redirected connection
    (docs/performance.md, "The per-connection path")."""
    return target.port in listener_ports and target == SocketAddr.from_sockaddr(sock.getsockname())


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


def bind_source(sock: socket.socket, ip: IPAddress) -> None:
    """Bind a socket about to connect to source address `ip`, its port left to `connect()`.

    A plain `bind((ip, 0))` picks a port no other socket on `ip` holds, whatever its peer, so
    at high connection rates the TIME_WAIT sockets of earlier connections use up the ephemeral
    range and every bind searches it (bench/workers_bench.py went from 1,400 to under 200 conn/s
    after one 5 s run). With IP_BIND_ADDRESS_NO_PORT the kernel picks the port at `connect()`,
    where a port needs only a free 4-tuple. The option applies to IPv6 sockets too.
    """
    sock.setsockopt(socket.SOL_IP, IP_BIND_ADDRESS_NO_PORT, 1)
    sock.bind((ip_text(ip), 0) if ip.version == 4 else (ip_text(ip), 0, 0, 0))


def configure_listener(sock: socket.socket, *, keepalive: KeepaliveSettings | None) -> None:
    """TCP_NODELAY and the keepalive and user-timeout options, set on a listening socket for the
    sockets it accepts: a Linux TCP socket made by accept() is a copy of its listener
    (inet_csk_clone_lock), so it inherits the options and, with SO_KEEPALIVE, starts with its
    keepalive timer armed (tcp_create_openreq_child). Set once here instead of five setsockopt
    calls per accepted socket (docs/performance.md, "The per-connection path"); test_socket_options reads them
    back from real accepted sockets."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if keepalive is not None:
        keepalive.apply(sock)


# Linux's bounds for the keepalive options (net/ipv4/tcp.c: MAX_TCP_KEEPIDLE, MAX_TCP_KEEPINTVL,
# MAX_TCP_KEEPCNT); a larger value would make setsockopt fail on every connection.
MAX_TCP_KEEPIDLE_S = 32767
MAX_TCP_KEEPINTVL_S = 32767
MAX_TCP_KEEPCNT = 127
MAX_TCP_USER_TIMEOUT_MS = 2**31 - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class KeepaliveSettings:
    """TCP keepalive and user timeout on the proxy's sockets (ztunnel's KEEPALIVE_* settings).

    As ztunnel's socket setup: with KEEPALIVE_ENABLED, SO_KEEPALIVE plus idle time, probe
    interval and probe count; with USER_TIMEOUT_ENABLED, TCP_USER_TIMEOUT = time + retries x
    interval, so unacknowledged data gives up when keepalive would have. Set on the proxy's
    listening sockets, whose accepted sockets inherit them (`configure_listener`), and on every
    socket the proxy connects (apps, peers on 15008).
    The kernel counts keepalive in whole seconds: durations round up, to at least one second.
    """

    enabled: bool = True
    time_s: float = 180.0
    interval_s: float = 180.0
    retries: int = 9
    user_timeout: bool = False
    # (level, option, value) for `apply`, worked out once: two sockets per proxied connection.
    options: tuple[tuple[int, int, int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        options = []
        if self.enabled:
            options += [
                (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
                (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, _whole_s(self.time_s, MAX_TCP_KEEPIDLE_S)),
                (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, _whole_s(self.interval_s, MAX_TCP_KEEPINTVL_S)),
                (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, max(1, min(self.retries, MAX_TCP_KEEPCNT))),
            ]
        if self.user_timeout:
            options.append((socket.IPPROTO_TCP, TCP_USER_TIMEOUT, self.user_timeout_ms))
        object.__setattr__(self, "options", tuple(options))

    @classmethod
    def from_config(cls, config: ZtunnelConfig) -> KeepaliveSettings:
        return cls(
            enabled=config.keepalive_enabled,
            time_s=config.keepalive_time_s,
            interval_s=config.keepalive_interval_s,
            retries=config.keepalive_retries,
            user_timeout=config.user_timeout_enabled,
        )

    @property
    def user_timeout_ms(self) -> int:
        ms = round((self.time_s + self.retries * self.interval_s) * 1000)
        return min(ms, MAX_TCP_USER_TIMEOUT_MS)

    def apply(self, sock: socket.socket) -> None:
        for level, option, value in self.options:
            sock.setsockopt(level, option, value)


def _whole_s(seconds: float, maximum: int) -> int:
    return max(1, min(math.ceil(seconds), maximum))


SocketFactory = Callable[[int, int], socket.socket]
"""Creates a socket of a family and type (socket()'s first two arguments, flags such as
SOCK_NONBLOCK included); in-pod proxies create theirs inside the pod's netns."""


class IntKindSocket(socket.socket):
    """A socket.socket whose `family` and `type` read as the C socket's ints.

    socket.socket's `family` and `type` are Python properties that convert the int to an enum
    (three Python calls per read), and the event loop's transport set-up reads both for every
    connection it is handed (uvloop's create_connection(sock=): `relay.wrap_socket`, once per
    proxied connection on each proxy; docs/performance.md, "The per-connection path"). The values compare
    equal to the enums; only their repr differs. Everything else is socket.socket's.
    """

    __slots__ = ()
    family = _socket.socket.family  # type: ignore[assignment]
    type = _socket.socket.type  # type: ignore[assignment]


def plain_socket(family: int, type: int = socket.SOCK_STREAM) -> socket.socket:
    return IntKindSocket(family, type)


def new_socket(family: int, *, mark: int | None, factory: SocketFactory = plain_socket) -> socket.socket:
    """A non-blocking TCP socket of `family` from `factory`, marked when `mark` is set.

    Non-blocking from socket() itself (SOCK_NONBLOCK in the type every factory is handed): no
    FIONBIO ioctl per socket, whichever namespace the factory makes it in."""
    sock = factory(family, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
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
    keepalive: KeepaliveSettings | None = None,
) -> socket.socket:
    """A listening socket bound as ztunnel binds: `[::]` listeners are dual-stack.

    TCP_NODELAY and `keepalive` are set before listen(): the kernel makes an accepted socket
    when its handshake completes, from the listener's options at that moment, so a client
    that connects before the listener is served (bound, not yet started) gets them too."""
    sock = factory(addr.family, socket.SOCK_STREAM)
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
        configure_listener(sock, keepalive=keepalive)
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
