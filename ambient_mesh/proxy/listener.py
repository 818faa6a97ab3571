"""A TCP listener: bind as ztunnel binds, accept, and run one handler task per connection.

Counterpart: ztunnel src/socket.rs (`Listener`) and the accept loops in src/proxy/*.rs.

Each connection task has a crash barrier: an unexpected exception is logged with the listener's
name and the socket is closed; CancelledError always propagates. Errors the network hands us
(a client that reset before its handler ran, a peer gone mid-handshake) are not bugs: they are
one line at debug level, never a traceback. Draining stops accepting first; the caller then
waits for (or aborts) the connections.

Out of file descriptors (EMFILE, ENFILE) or kernel memory (ENOBUFS, ENOMEM), accept() fails
while the clients wait in the backlog. The loop then (1) sheds the backlog: it frees one spare
descriptor it holds for this moment, accepts each waiting client and closes it at once with a
reset, so clients fail fast instead of hanging until their own timeout (the libev/nginx
technique); (2) backs off, doubling from ACCEPT_BACKOFF_MIN_S to ACCEPT_BACKOFF_MAX_S; and (3)
says so in one warning per ACCEPT_ERROR_LOG_INTERVAL_S, with the count of failures and shed
clients since the previous line.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import select
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Protocol

from ..errors import BindError
from ..host.cpython import raw_accept
from ..host.sockets import (
    IntKindSocket,
    KeepaliveSettings,
    SocketFactory,
    configure_listener,
    listen_socket,
    plain_socket,
)
from ..net import SocketAddr
from .open_connections import OpenConnections

log = logging.getLogger("ambient_mesh.proxy.listener")

Handler = Callable[[socket.socket], Awaitable[None]]


class AcceptShare(Protocol):
    """How loaded this worker is against the others that share a listening socket."""

    def busier_than_another(self) -> bool: ...

    def deferring(self, delta: int) -> None: ...


ACCEPT_BACKOFF_MIN_S = 0.01
ACCEPT_BACKOFF_MAX_S = 1.0
ACCEPT_ERROR_LOG_INTERVAL_S = 10.0
# Clients shed per failed accept(): the whole backlog (LISTEN_BACKLOG) drains in a few rounds,
# and one round never holds the event loop for long.
MAX_SHED_PER_ROUND = 256
# Connections accepted per readiness callback: a full backlog is taken in a few turns of the
# event loop, and the other connections' callbacks run between them.
MAX_ACCEPTS_PER_WAKEUP = 64
# A listening socket that worker processes share (ZTUNNEL_WORKER_THREADS, `adopt`): one connection
# per readiness callback. Every worker's event loop is woken by the same readiness, so a burst is
# spread over the workers, and a worker busy with its connections comes back for the next one
# later than an idle one; taking up to MAX_ACCEPTS_PER_WAKEUP gave a burst of 8 bulk connections
# to one worker (docs/performance.md, "Workers").
SHARED_ACCEPTS_PER_WAKEUP = 1
# A worker that carries more connections than another (workers/loads.py BUSIER_SHARE_DIVISOR)
# leaves a waiting connection to it (`AcceptShare`): it stops watching the socket for
# ACCEPT_DEFER_S, at most MAX_ACCEPT_DEFERRALS times in a row, then takes the connection itself
# (a stalled worker delays a connection by at most 3 ms; 2 ms five times was no better balanced).
ACCEPT_DEFER_S = 0.001
MAX_ACCEPT_DEFERRALS = 3

# accept() failures that mean "this process or host is out of a resource", not "this client".
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# accept() failures that concern only the one connection being accepted (accept(2): "Linux
# accept() passes already-pending network errors on the new socket as an error code").
CLIENT_ERRNOS = frozenset(
    {
        errno.ECONNABORTED,
        errno.ECONNRESET,
        errno.EPROTO,
        errno.EPERM,
        errno.ENETDOWN,
        errno.ENOPROTOOPT,
        errno.EHOSTDOWN,
        errno.ENONET,
        errno.EHOSTUNREACH,
        errno.EOPNOTSUPP,
        errno.ENETUNREACH,
        errno.ETIMEDOUT,
        errno.EAGAIN,
    }
)
# What a client that went away does to a handler: a network event, not a proxy bug.
PEER_GONE_ERRNOS = frozenset(
    {errno.ENOTCONN, errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EBADF}
)


class SpareDescriptor:
    """One file descriptor held in reserve, so a listener out of descriptors can still accept
    (and then close) the clients waiting in its backlog.

    One per process: descriptors are a per-process resource, and the event loop runs one
    accept at a time, so one spare serves every listener (shared mode has hundreds).
    """

    def __init__(self) -> None:
        self._fd: int | None = None
        self.reserve()

    def reserve(self) -> bool:
        if self._fd is None:
            try:
                self._fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return False
        return True

    def release(self) -> bool:
        if self._fd is None:
            return False
        os.close(self._fd)
        self._fd = None
        return True

    def __repr__(self) -> str:
        return f"SpareDescriptor({'held' if self._fd is not None else 'not held'})"


_PROCESS_SPARE: SpareDescriptor | None = None


def process_spare() -> SpareDescriptor:
    global _PROCESS_SPARE
    if _PROCESS_SPARE is None:
        _PROCESS_SPARE = SpareDescriptor()
    return _PROCESS_SPARE


def _reset(conn: socket.socket) -> None:
    """Close with RST (SO_LINGER 0): the client learns at once, and we keep no TIME_WAIT."""
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    conn.close()


class AcceptErrorLog:
    """At most one warning per interval about failing accepts, with counts since the last one."""

    __slots__ = ("name", "interval_s", "failures", "shed", "_last_logged", "_last_error", "lines")

    def __init__(self, name: str, interval_s: float = ACCEPT_ERROR_LOG_INTERVAL_S) -> None:
        self.name = name
        self.interval_s = interval_s
        self.failures = 0  # since the last line
        self.shed = 0  # since the last line
        self._last_logged: float | None = None
        self._last_error: OSError | None = None
        self.lines = 0

    def note(self, error: OSError, shed: int, now: float) -> None:
        self.failures += 1
        self.shed += shed
        self._last_error = error
        self.flush(now)

    def flush(self, now: float) -> None:
        """Log the failures counted since the last line, if any and if the interval has passed."""
        if not self.failures:
            return
        if self._last_logged is not None and now - self._last_logged < self.interval_s:
            return
        e = self._last_error
        name = errno.errorcode.get(e.errno, str(e.errno)) if e is not None and e.errno else "error"
        what = e.strerror if e is not None and e.strerror else str(e)
        hint = (
            "raise the file descriptor limit (ulimit -n / LimitNOFILE) or find what holds descriptors"
            if e is not None and e.errno in (errno.EMFILE, errno.ENFILE)
            else "the host is short of memory for sockets"
        )
        log.warning(
            "%s listener: accept failed %d times (%s: %s); closed %d waiting clients; backing off (%s)",
            self.name,
            self.failures,
            name,
            what,
            self.shed,
            hint,
        )
        self.lines += 1
        self._last_logged = now
        self.failures = 0
        self.shed = 0


class Listener:
    def __init__(
        self,
        name: str,
        address: SocketAddr,
        handler: Handler,
        tracker: OpenConnections,
        *,
        mark: int | None = None,
        transparent: bool = False,
        reuse_port: bool = False,
        socket_factory: SocketFactory = plain_socket,
        keepalive: KeepaliveSettings | None = None,
        spare: SpareDescriptor | None = None,
    ) -> None:
        self.name = name
        self.address = address
        self._handler = handler
        self._tracker = tracker
        self._mark = mark
        self._transparent = transparent
        self._reuse_port = reuse_port
        self._socket_factory = socket_factory
        self._keepalive = keepalive
        self._spare = spare
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start()
        self._accepted_kind = (0, 0, 0)  # family, type, proto of accepted sockets: set by start()
        self._backlog: select.poll | None = None  # the listening socket, polled: set by start()
        self._backoff_timer: asyncio.TimerHandle | None = None
        self._backoff_s = ACCEPT_BACKOFF_MIN_S
        self._accepts_per_wakeup = MAX_ACCEPTS_PER_WAKEUP
        self._share: AcceptShare | None = None  # set by adopt() in a worker
        self._deferrals = 0  # accepts left to another worker in a row
        self._deferring = False  # counted in the share's deferring listeners
        self._errors = AcceptErrorLog(name)
        self.accepted = 0
        self.shed = 0  # clients closed unserved because the process ran out of descriptors
        self.accept_failures = 0

    def __repr__(self) -> str:
        where = self.bound_address if self._sock else self.address
        shed = f", {self.shed} shed" if self.shed else ""
        return f"Listener({self.name} on {where}, {self.accepted} accepted{shed})"

    def adopt(self, sock: socket.socket, share: AcceptShare | None = None) -> None:
        """Serve a socket that is already bound and listening (a worker process is handed the
        owner's, which every worker accepts from); `bind()` then keeps it. With `share`, a
        connection waits for a less loaded worker (ACCEPT_DEFER_S, MAX_ACCEPT_DEFERRALS)."""
        sock.setblocking(False)
        self._sock = sock
        self._accepts_per_wakeup = SHARED_ACCEPTS_PER_WAKEUP
        self._share = share

    def bind(self) -> None:
        if self._sock is not None:
            return  # adopted
        try:
            self._sock = listen_socket(
                self.address,
                mark=self._mark,
                transparent=self._transparent,
                reuse_port=self._reuse_port,
                factory=self._socket_factory,
                keepalive=self._keepalive,  # set before listen(): see listen_socket
            )
        except OSError as e:
            raise BindError(self.name, str(self.address), e) from None

    @property
    def bound_address(self) -> SocketAddr:
        assert self._sock is not None, "listener is not bound"
        return SocketAddr.from_sockaddr(self._sock.getsockname())

    def start(self) -> None:
        if self._sock is None:
            self.bind()
        if self._spare is None:
            self._spare = process_spare()
        sock = self._sock
        assert sock is not None
        # Not per accepted socket: accepted sockets inherit them (configure_listener). Set in
        # listen_socket before listen() for a socket bound here; again here for an adopted one
        # (its owner sets them before listen() too, see workers/owner.py), where it is a no-op.
        configure_listener(sock, keepalive=self._keepalive)
        # As ints: socket.accept() reads the listener's family and type as enums for every
        # accepted socket (two Python-level conversions per connection).
        self._accepted_kind = (int(sock.family), int(sock.type), sock.proto)
        self._backlog = select.poll()
        self._backlog.register(sock.fileno(), select.POLLIN)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(sock, self._on_readable)

    def _on_readable(self) -> None:
        """Accept what waits in the backlog (up to MAX_ACCEPTS_PER_WAKEUP, or one on a socket
        shared with other workers) and start a handler task for each, from the event loop's
        readiness callback.

        A persistent reader, not `await loop.sock_accept()` in a task: that made a future and a
        task step per connection and registered and removed the listening socket with epoll
        around each accept (two epoll_ctl calls); about 20 µs of CPU per accepted connection in
        a uvloop microbenchmark (docs/performance.md, "The per-connection path").
        """
        sock, loop, backlog = self._sock, self._loop, self._backlog
        if sock is None or loop is None or backlog is None:
            return
        share = self._share
        if share is not None:
            if self._deferrals < MAX_ACCEPT_DEFERRALS and share.busier_than_another() and backlog.poll(0):
                # A connection waits and another worker carries fewer: the same readiness woke it.
                self._deferrals += 1
                if not self._deferring:
                    self._deferring = True
                    share.deferring(1)
                loop.remove_reader(sock)
                self._backoff_timer = loop.call_later(ACCEPT_DEFER_S, self._resume)
                return
            if self._deferring:
                self._deferring = False
                share.deferring(-1)
        family, type_, proto = self._accepted_kind
        accept = raw_accept(sock)  # socket.accept() without its enum reads (host/cpython.py)
        for _ in range(self._accepts_per_wakeup):
            try:
                fd, _addr = accept()
            except (BlockingIOError, InterruptedError):
                self._deferrals = 0
                return  # the backlog is empty: wait for the next readiness
            except OSError as e:
                if self._sock is None or sock.fileno() < 0:
                    return
                if e.errno in CLIENT_ERRNOS:
                    log.debug("%s listener: accept: %s (that client only)", self.name, e)
                    continue
                self.accept_failures += 1
                shed = self._shed_backlog(sock) if e.errno in RESOURCE_ERRNOS else 0
                self.shed += shed
                self._errors.note(e, shed, loop.time())
                # Stop watching the socket for a while: it stays readable while clients wait.
                loop.remove_reader(sock)
                self._backoff_timer = loop.call_later(self._backoff_s, self._resume)
                self._backoff_s = min(self._backoff_s * 2, ACCEPT_BACKOFF_MAX_S)
                return
            self._backoff_s = ACCEPT_BACKOFF_MIN_S
            self._deferrals = 0
            if self._errors.failures:
                self._errors.flush(loop.time())
            self.accepted += 1
            try:
                # IntKindSocket: the event loop's transport set-up reads family and type again.
                conn = IntKindSocket(family, type_, proto, fileno=fd)
            except BaseException:
                os.close(fd)
                raise
            # Non-blocking, as the handlers' event-loop calls need; TCP_NODELAY and keepalive
            # came with it from the listener (configure_listener).
            conn.setblocking(False)
            self._tracker.spawn(self._guard(conn))
            # Another client waiting? Asked with poll(0) (about 0.6 µs), not found out by an
            # accept that fails with EAGAIN: that costs 5-8 µs on Linux, which allocates a
            # socket and a file for the call and frees them, and it was the end of nearly every
            # wakeup, one connection per wakeup being the usual case
            # (docs/performance.md, "The per-connection path").
            if not backlog.poll(0):
                return

    def _resume(self) -> None:
        """The backoff after a failed accept, or a deferral, is over: watch the socket again."""
        self._backoff_timer = None
        if self._sock is not None and self._loop is not None:
            self._loop.add_reader(self._sock, self._on_readable)
            self._on_readable()

    def _shed_backlog(self, sock: socket.socket) -> int:
        """Accept and reset the clients we cannot serve, using the spare descriptor."""
        spare = self._spare
        if spare is None or not spare.release():
            if spare is not None:
                spare.reserve()
            return 0
        shed = 0
        try:
            while shed < MAX_SHED_PER_ROUND:
                try:
                    conn, _addr = sock.accept()
                except OSError:
                    break  # backlog empty (EAGAIN), or even the spare's slot was taken
                _reset(conn)
                shed += 1
        finally:
            spare.reserve()
        return shed

    async def _guard(self, conn: socket.socket) -> None:
        try:
            await self._handler(conn)
        except asyncio.CancelledError:
            # A handler that handed `conn` to a transport has closed that transport by now (the
            # transport closes this same socket object, so this is then a no-op): a socket
            # closed here under a live transport would leave the event loop watching its
            # descriptor number (inbound.py `handle`, relays aborted before a drain cancels).
            conn.close()
            raise
        except OSError as e:
            # The network, not a bug: a client that reset before or during its handler, or a
            # process out of descriptors while serving it. One line, no traceback.
            if e.errno in RESOURCE_ERRNOS:
                self._errors.note(e, 0, asyncio.get_running_loop().time())
            elif e.errno in PEER_GONE_ERRNOS:
                log.debug("%s listener: client gone: %s", self.name, e)
            else:
                log.info("%s listener: connection failed: %s", self.name, e)
            conn.close()
        except Exception:
            log.exception("%s listener: connection handler failed", self.name)
            conn.close()

    def close(self) -> None:
        """Stop accepting. Open connections are left to the caller's drain."""
        if self._deferring and self._share is not None:
            self._deferring = False
            self._share.deferring(-1)
        if self._backoff_timer is not None:
            self._backoff_timer.cancel()
            self._backoff_timer = None
        if self._sock is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._sock)
            self._sock.close()
            self._sock = None
        self._backlog = None
