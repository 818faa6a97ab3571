"""What every listener of one proxy shares (ztunnel's ProxyInputs), and the socket factory.

One `ProxyInputs` serves one workload in dedicated mode (or one pod in shared mode): its
configuration, the shared state, the certificate manager and TLS contexts, metrics, its own
HBONE pool, the authorization of its inbound connections (`ConnectionManager`) and the
connections it has open (`OpenConnections`, for draining and for /config_dump).
"""

from __future__ import annotations

import asyncio
import errno
import os
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..config import ZtunnelConfig
from ..host.sockets import (
    KeepaliveSettings,
    SocketFactory,
    bind_source,
    new_socket,
    plain_socket,
    set_transparent,
)
from ..identity.manager import SecretManager
from ..identity.spiffe import Identity
from ..metrics import Metrics
from ..net import IPAddress, SocketAddr, ip_text
from ..state.model import Workload
from ..state.store import StateReader
from ..tls.context import TlsContext, TlsContextCache
from .connection_manager import ConnectionManager
from .open_connections import OpenConnections
from .pool import HbonePool

WORKLOAD_WAIT_S = 5.0
# Source addresses remembered as not local (a bind that failed with EADDRNOTAVAIL), and how long
# before one is tried again (an address can be added to the namespace later).
NOT_LOCAL_SOURCES_MAX_ENTRIES = 4096
NOT_LOCAL_RECHECK_S = 10.0


@dataclass(eq=False)
class LocalSourceBinder:
    """Use a workload's own address as a socket's source when it is an address of this host.

    In a pod network namespace that is the pod IP anyway; when several workloads share one host
    (loopback tests, the demo) it keeps source addresses telling which workload called. An
    address the kernel refused as not local (EADDRNOTAVAIL: a client on another node, the usual
    inbound case) is not tried again for NOT_LOCAL_RECHECK_S: that bind was a failing syscall and
    an exception per inbound connection (docs/performance.md, "The per-connection path"). Any other bind error
    is ignored as before, and not remembered.
    """

    not_local: dict[str, float] = field(default_factory=dict)  # address text -> when to retry

    def bind(self, sock: socket.socket, src: IPAddress, now: float) -> bool:
        """Bind `sock` to `src` port 0 if `src` is local; True when it was bound."""
        text = ip_text(src)
        retry_at = self.not_local.get(text)
        if retry_at is not None:
            if now < retry_at:
                return False
            del self.not_local[text]
        try:
            bind_source(sock, src)
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                if len(self.not_local) >= NOT_LOCAL_SOURCES_MAX_ENTRIES:
                    self.not_local.clear()
                self.not_local[text] = now + NOT_LOCAL_RECHECK_S
            return False
        return True


@dataclass(eq=False, kw_only=True)
class ProxyInputs:
    config: ZtunnelConfig
    state: StateReader
    cert_manager: SecretManager
    tls: TlsContextCache
    metrics: Metrics
    pool: HbonePool | None = None
    connection_manager: ConnectionManager = field(init=False)  # over `state`, built here
    connections: OpenConnections = field(default_factory=OpenConnections)
    rng: random.Random = field(default_factory=random.Random)
    transparent: bool = False  # original-source preservation available
    socket_factory: SocketFactory = plain_socket  # in-pod: sockets are created in the pod's netns
    # The proxy's own ports and addresses, refused as targets (routing step 1): the configured
    # ones, then what the listeners actually bound (port 0 in tests, a specific IP in dedicated
    # mode). Set by `set_listener_addresses` once the listeners are bound.
    illegal_ports: frozenset[int] = frozenset()
    self_ips: frozenset[IPAddress] = frozenset()
    keepalive: KeepaliveSettings | None = None  # from the config unless given
    # Binds the client's address as source when it is local here (the sockets of one
    # ProxyInputs are all made in one network namespace, so its memo holds there).
    local_sources: LocalSourceBinder = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.local_sources = LocalSourceBinder()
        self.connection_manager = ConnectionManager(
            self.state, info_logging=self.config.authz_policy_info_logging
        )
        if self.keepalive is None:
            self.keepalive = KeepaliveSettings.from_config(self.config)
        if not self.illegal_ports:
            self.illegal_ports = self.config.illegal_ports

    def set_listener_addresses(self, addresses: list[SocketAddr]) -> None:
        self.illegal_ports = self.config.illegal_ports | {a.port for a in addresses}
        self.self_ips = frozenset(a.ip for a in addresses if not a.ip.is_unspecified)

    @property
    def mark(self) -> int | None:
        return self.config.packet_mark

    async def client_context(self, identity: Identity) -> TlsContext:
        cert = await self.cert_manager.fetch_certificate(identity)
        return self.tls.client(cert)

    async def server_context(self, identity: Identity) -> TlsContext:
        cert = await self.cert_manager.fetch_certificate(identity)
        return self.tls.server(cert)

    def start_connect(self, dst: SocketAddr, src: IPAddress | None = None) -> tuple[socket.socket, bool]:
        """`connect`'s first half, without waiting: a marked TCP socket (TCP_NODELAY, keepalive
        as configured) whose connect() to `dst` is issued, from `src` when original source is
        kept, and whether the handshake is done already (`connect_started`); OSError, the
        socket closed, when refused at once. `finish_connect` waits for the rest."""
        sock = new_socket(dst.family, mark=self.mark, factory=self.socket_factory)
        try:
            if src is not None and src.version == dst.ip.version:
                if self.transparent:
                    set_transparent(sock, dst.family)
                    bind_source(sock, src)
                else:
                    self.local_sources.bind(sock, src, time.monotonic())
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.keepalive is not None:  # set in __post_init__ from the config
                self.keepalive.apply(sock)
            return sock, connect_started(sock, dst.sockaddr())
        except BaseException:
            sock.close()
            raise

    async def finish_connect(
        self, sock: socket.socket, dst: SocketAddr, timeout_s: float | None = None
    ) -> None:
        """Wait for the handshake `start_connect` began (`wait_connected`); the socket is closed
        when it fails, times out (TimeoutError) or the wait is cancelled."""
        try:
            await wait_connected(sock, dst.sockaddr(), timeout_s)
        except BaseException:
            sock.close()
            raise

    async def connect(
        self,
        dst: SocketAddr,
        src: IPAddress | None = None,
        *,
        timeout_s: float | None = None,
    ) -> socket.socket:
        """A marked TCP socket connected to `dst` (TCP_NODELAY, keepalive as configured), from
        `src` when original source is kept; TimeoutError after `timeout_s`."""
        sock, connected = self.start_connect(dst, src)
        if not connected:
            await self.finish_connect(sock, dst, timeout_s)
        return sock

    async def wait_for_workload(self, find: Callable[[], Workload | None]) -> Workload | None:
        """Look a workload up, waiting up to 5 s for it to arrive (ztunnel fetch_workload)."""
        found = find()
        if found is not None:
            return found
        event = asyncio.Event()
        remove = self.state.add_listener(lambda *_: event.set())
        try:
            deadline = asyncio.get_running_loop().time() + WORKLOAD_WAIT_S
            while found is None:
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    return None
                event.clear()
                try:
                    await asyncio.wait_for(event.wait(), remaining)
                except TimeoutError:
                    return find()
                found = find()
            return found
        finally:
            remove()


# What a non-blocking connect() answers while the handshake goes on (BlockingIOError's errnos, and
# EINTR, as the event loops' sock_connect take them).
_CONNECT_PENDING = frozenset({errno.EINPROGRESS, errno.EALREADY, errno.EAGAIN, errno.EINTR})


def connect_started(sock: socket.socket, address: tuple[Any, ...]) -> bool:
    """Issue a non-blocking socket's connect() to a numeric address: True when it is connected
    already, False while the handshake goes on (`wait_connected`); OSError when refused at once.
    Together they connect as `loop.sock_connect` does (same errors and messages) but without its
    name resolution, and with the deadline as one timer: uvloop's sock_connect resolves even a
    numeric address (getaddrinfo, IDNA-encoding the host) and, with asyncio.timeout around it,
    took about twice the CPU per connection (docs/performance.md, "The per-connection path").

    To an address of this host (the app behind an inbound stream, over loopback or into the
    pod's namespace) the kernel has usually finished the handshake before connect() returns:
    then it is done, without a writer, a timer and a turn of the event loop (about 20 µs per
    connection; docs/performance.md, "The per-connection path"), and the caller can go on without awaiting
    anything (inbound.py serves such a stream without a task)."""
    err = sock.connect_ex(address)
    if err == 0:
        return True
    if err not in _CONNECT_PENDING:
        raise OSError(err, os.strerror(err))
    # Not connected yet, or refused: `wait_connected` reports the error as before.
    try:
        sock.getpeername()
    except OSError:
        return False
    return True


async def wait_connected(
    sock: socket.socket, address: tuple[Any, ...], timeout_s: float | None = None
) -> None:
    """Wait until the connect() `connect_started` issued has finished: OSError when it failed,
    TimeoutError after `timeout_s`."""
    loop = asyncio.get_running_loop()
    writable: asyncio.Future[None] = loop.create_future()
    loop.add_writer(sock, _set_done, writable)
    timer = loop.call_later(timeout_s, _set_timed_out, writable) if timeout_s is not None else None
    try:
        await writable
    finally:
        loop.remove_writer(sock)
        if timer is not None:
            timer.cancel()
    err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if err:
        raise OSError(err, f"Connect call failed {address}")


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _set_timed_out(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_exception(TimeoutError())
