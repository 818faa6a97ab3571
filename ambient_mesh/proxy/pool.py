"""The HBONE connection pool: user connections multiplexed on shared mTLS connections.

Counterpart: ztunnel src/proxy/pool.rs. Connections are keyed by (source identity, expected
destination identities, destination socket address, source IP); a key has at most one
connection being established at a time (other callers wait for it), a connection is reused
while it has fewer open streams than min(POOL_MAX_STREAMS_PER_CONNECTION, the peer's
SETTINGS_MAX_CONCURRENT_STREAMS), a further connection is opened when every one is full,
connections that got GOAWAY or closed are dropped (never a new stream on them: the next caller
gets a fresh connection), a stream the peer's GOAWAY refused before processing it is retried
once on another connection (RFC 9113 8.7), and connections unused for
POOL_UNUSED_RELEASE_TIMEOUT are closed.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from ..errors import ResponseFlag
from ..identity.spiffe import Identity
from ..net import IPAddress, SocketAddr, ip_text
from ..tls.context import TlsContext
from ..tls.transport import start_tls
from .hbone import (
    DEFAULT_SETTINGS,
    ConnectResponse,
    HboneConnection,
    HboneError,
    HboneSettings,
    HboneStream,
    HboneStreamRefused,
)

log = logging.getLogger("ambient_mesh.pool")

DEFAULT_MAX_STREAMS_PER_CONNECTION = 100
DEFAULT_UNUSED_RELEASE_TIMEOUT_S = 300.0
CONNECT_TIMEOUT_S = 10.0
TLS_HANDSHAKE_TIMEOUT_S = 10.0
SWEEP_INTERVAL_S = 30.0


@dataclass(frozen=True, slots=True, eq=False)
class WorkloadKey:
    """What makes two HBONE connections interchangeable.

    Compared and hashed by `_flat`, the same values as plain strings and ints, worked out once:
    the pool looks a new key up for every connection, and the generated dataclass hash and
    equality went through Identity's, SocketAddr's and ipaddress's Python methods at each level
    (about 6 µs per lookup; docs/performance.md, "The per-connection path").
    """

    src_id: Identity
    dst_id: tuple[Identity, ...]  # sorted, so equal sets give equal keys
    dst: SocketAddr
    src: IPAddress | None
    _flat: tuple[object, ...] = field(init=False, repr=False)
    _hash: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        src_id, dst = self.src_id, self.dst
        flat: tuple[object, ...] = (
            src_id.trust_domain,
            src_id.namespace,
            src_id.service_account,
            # The text of an address is canonical (one text per address, IPv4 and IPv6 apart).
            ip_text(dst.ip),
            dst.port,
            None if self.src is None else ip_text(self.src),
        )
        for i in self.dst_id:
            flat += (i.trust_domain, i.namespace, i.service_account)
        object.__setattr__(self, "_flat", flat)
        object.__setattr__(self, "_hash", hash(flat))

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        if not isinstance(other, WorkloadKey):
            return NotImplemented
        return self._hash == other._hash and self._flat == other._flat

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    def of(
        cls, src_id: Identity, dst_ids: Iterable[Identity], dst: SocketAddr, src: IPAddress | None
    ) -> WorkloadKey:
        ids = dst_ids if isinstance(dst_ids, tuple) else tuple(dst_ids)
        if len(ids) > 1:  # one SAN (a workload) is the common case: no set, no sort
            ids = tuple(sorted(set(ids)))
        return cls(src_id, ids, dst, src)

    def __str__(self) -> str:
        ids = ",".join(str(i) for i in self.dst_id)
        return f"{self.src_id} -> {self.dst} [{ids}]"


Connector = Callable[[WorkloadKey], Awaitable[HboneConnection]]


class HbonePool:
    def __init__(
        self,
        connector: Connector,
        *,
        max_streams_per_connection: int = DEFAULT_MAX_STREAMS_PER_CONNECTION,
        unused_release_timeout_s: float = DEFAULT_UNUSED_RELEASE_TIMEOUT_S,
    ) -> None:
        self._connector = connector
        self.max_streams_per_connection = max_streams_per_connection
        self.unused_release_timeout_s = unused_release_timeout_s
        self._connections: dict[WorkloadKey, list[HboneConnection]] = {}
        self._connecting: dict[WorkloadKey, asyncio.Future[HboneConnection]] = {}
        self._sweeper: asyncio.TimerHandle | None = None
        self.connections_opened = 0

    def __repr__(self) -> str:
        conns = [c for cs in self._connections.values() for c in cs]
        active = sum(1 for c in conns if c.open_streams)
        streams = sum(c.open_streams for c in conns)
        return (
            f"HbonePool({len(self._connections)} keys, {active} active, {len(conns) - active} idle, "
            f"{streams} streams, {len(self._connecting)} connecting)"
        )

    def connections(self, key: WorkloadKey) -> list[HboneConnection]:
        return list(self._connections.get(key, ()))

    def _limit(self, conn: HboneConnection) -> int:
        return min(self.max_streams_per_connection, conn.max_streams)

    def _ready_connection(self, key: WorkloadKey) -> HboneConnection | None:
        conns = self._connections.get(key)
        if not conns:
            return None
        limit = self.max_streams_per_connection
        for conn in conns:
            if not conn.usable:
                break
            if conn.open_streams < min(limit, conn.max_streams):  # `_limit`, inlined: per CONNECT
                return conn  # every connection before it is usable: nothing to drop yet
        else:
            return None  # all usable, all full
        # Some connection is no longer usable (GOAWAY, closed): drop those, then look again.
        # Only then is the list rebuilt, not on every stream (docs/performance.md, "The per-connection path").
        conns[:] = [c for c in conns if c.usable]
        if not conns:
            del self._connections[key]
            return None
        for conn in conns:
            if conn.open_streams < self._limit(conn):
                return conn
        return None

    async def open_stream(
        self, key: WorkloadKey, authority: str, headers: list[tuple[str, str]], early: bytes = b""
    ) -> tuple[HboneStream, ConnectResponse]:
        """A CONNECT stream to `key.dst` on a pooled connection (a new one when all are full);
        `early`: the stream's first DATA, sent with the CONNECT (HboneConnection.open_stream)."""
        try:
            # A pooled connection with room: opened from here, one coroutine fewer per CONNECT
            # than through `_open_stream` (which does the same when it finds one).
            conn = self._ready_connection(key)
            if conn is not None:
                return await conn.open_stream(authority, headers, early)
            return await self._open_stream(key, authority, headers, early)
        except HboneStreamRefused:
            # The connection got GOAWAY before the peer saw our stream: it is out of the pool
            # now (not `usable`), and the request was never processed, so one retry is safe.
            log.debug("HBONE stream to %s refused by GOAWAY; retrying on another connection", key)
            return await self._open_stream(key, authority, headers, early)

    async def _open_stream(
        self, key: WorkloadKey, authority: str, headers: list[tuple[str, str]], early: bytes
    ) -> tuple[HboneStream, ConnectResponse]:
        while True:
            conn = self._ready_connection(key)
            if conn is not None:
                # No await between the capacity check and opening the stream: the count is exact.
                return await conn.open_stream(authority, headers, early)
            pending = self._connecting.get(key)
            if pending is not None:
                try:
                    await asyncio.shield(pending)
                except Exception:
                    pass  # the connecting caller reports the error; we try again
                continue
            conn = await self._connect(key)
            return await conn.open_stream(authority, headers, early)

    async def _connect(self, key: WorkloadKey) -> HboneConnection:
        future: asyncio.Future[HboneConnection] = asyncio.get_running_loop().create_future()
        self._connecting[key] = future
        try:
            conn = await self._connector(key)
        except BaseException as e:
            future.set_exception(e)
            future.exception()  # retrieved: waiters only use it as a wake-up
            raise
        finally:
            self._connecting.pop(key, None)
        self.connections_opened += 1
        self._connections.setdefault(key, []).append(conn)
        future.set_result(conn)
        self._schedule_sweep()
        return conn

    def _schedule_sweep(self) -> None:
        if self._sweeper is None:
            loop = asyncio.get_running_loop()
            self._sweeper = loop.call_later(min(SWEEP_INTERVAL_S, self.unused_release_timeout_s), self._sweep)

    def _sweep(self) -> None:
        """Close connections with no streams that have been unused for the release timeout."""
        self._sweeper = None
        now = asyncio.get_running_loop().time()
        for key in list(self._connections):
            keep = []
            for conn in self._connections[key]:
                if not conn.usable:
                    continue
                if conn.open_streams == 0 and now - conn.last_used >= self.unused_release_timeout_s:
                    conn.drain()
                    continue
                keep.append(conn)
            if keep:
                self._connections[key] = keep
            else:
                del self._connections[key]
        if self._connections:
            self._schedule_sweep()

    def expire_idle(self) -> None:
        """Run the idle sweep now (tests and shutdown)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self._sweep()

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conns in self._connections.values():
            for conn in conns:
                conn.drain()
        self._connections.clear()


class HboneConnector:
    """Opens one HBONE connection: TCP (marked), mTLS with the source workload's certificate,
    server identity checked against the expected SANs, then HTTP/2."""

    def __init__(
        self,
        *,
        fetch_client_context: Callable[[Identity], Awaitable[TlsContext]],
        verify_server: Callable[[object, tuple[Identity, ...]], Identity],
        open_socket: Callable[[SocketAddr, IPAddress | None], Awaitable[socket.socket]],
        settings: HboneSettings = DEFAULT_SETTINGS,
    ) -> None:
        self._fetch_client_context = fetch_client_context
        self._verify_server = verify_server
        self._open_socket = open_socket
        self.settings = settings

    async def __call__(self, key: WorkloadKey) -> HboneConnection:
        ctx = await self._fetch_client_context(key.src_id)
        try:
            sock = await asyncio.wait_for(self._open_socket(key.dst, key.src), CONNECT_TIMEOUT_S)
        except TimeoutError:
            raise HboneError(
                f"timed out connecting to {key.dst}",
                response_flag=ResponseFlag.NETWORK_POLICY,
                hint="is a NetworkPolicy blocking port 15008?",
            ) from None
        except OSError as e:
            raise HboneError(
                f"cannot connect to {key.dst}: {e.strerror or e}", response_flag=ResponseFlag.CONNECT
            ) from None

        def check_server(conn: HboneConnection) -> None:
            assert conn.transport is not None  # called from connection_made
            conn.peer_identity = self._verify_server(conn.transport.get_extra_info("ssl_object"), key.dst_id)

        conn = HboneConnection(client_side=True, settings=self.settings, on_connected=check_server)
        try:
            # HBONE's TLS on the socket itself (tls/transport.py); no SNI, as ztunnel.
            await start_tls(sock, ctx, conn, server_side=False, handshake_timeout_s=TLS_HANDSHAKE_TIMEOUT_S)
        except (ssl.SSLError, OSError, TimeoutError) as e:
            sock.close()
            raise HboneError(
                f"TLS handshake with {key.dst} failed: {e}", response_flag=ResponseFlag.TLS_FAILURE
            ) from None
        if conn.error is not None:
            raise HboneError(
                f"{key.dst} presented the wrong identity: {conn.error}",
                response_flag=ResponseFlag.TLS_FAILURE,
            )
        return conn
