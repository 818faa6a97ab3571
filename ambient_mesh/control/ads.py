"""The embedded control plane's delta ADS server: istiod's xDS port, for ztunnel only.

Counterpart: istiod pilot/pkg/xds/delta.go (`StreamDeltas`: authenticate, one receive loop, one
push loop per connection) and ads.go (the connection registry pushes go to). Every decision is
made by `ads_state.DeltaConnectionState`; this module only moves requests in and responses out
of gRPC (grpc.aio) and fans snapshot updates out to the connected proxies.

All methods run on the event loop thread that serves gRPC; `update` must be called from it.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from envoy.service.discovery.v3.discovery_pb2 import DeltaDiscoveryRequest, DeltaDiscoveryResponse

from ..identity.spiffe import Identity
from ..wire.istio.security import authorization_pb2
from ..wire.istio.workload import workload_pb2
from .ads_state import (
    SHORT_TYPE,
    WAYPOINT_NODE_TYPE,
    AdsRefused,
    DeltaConnectionState,
    ProxyInfo,
    Snapshot,
    TypeStatus,
)
from .caller_gate import MAX_RECEIVE_MESSAGE_BYTES
from .waypoint_index import WaypointIndex

log = logging.getLogger(__name__)

# ztunnel accepts messages up to 200 MiB (docs/istio-behaviour.md, "Delta xDS"); a full push of a large mesh
# can be that big. What we receive is istiod's 4 MiB (caller_gate.MAX_RECEIVE_MESSAGE_BYTES): requests are
# small.
MAX_SEND_MESSAGE_BYTES = 200 * 1024 * 1024
# ztunnel sends an HTTP/2 PING every 30 s even when idle; gRPC's server default (one per 5 min
# without data) would answer those with GOAWAY ENHANCE_YOUR_CALM and drop the stream.
MIN_CLIENT_PING_INTERVAL_MS = 10_000

SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_SEND_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
    ("grpc.http2.max_ping_strikes", 0),
)

# The server side of one delta ADS stream: requests in, responses out.
AdsContext = grpc.aio.ServicerContext[DeltaDiscoveryRequest, DeltaDiscoveryResponse]


@dataclass(frozen=True, slots=True, kw_only=True)
class Authenticated:
    """Who opened a stream, as the authenticator proved it: SPIFFE ids, as istiod's
    security.Caller carries them (a Kubernetes token for ns/sa becomes spiffe://<td>/ns/<ns>/sa/<sa>)."""

    identities: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Unauthenticated:
    """An authenticator's refusal; the stream ends with UNAUTHENTICATED and this reason."""

    reason: str


# Called with the call metadata (lower-case keys, e.g. `authorization: Bearer <jwt>`,
# `clusterid`); may be a plain function or a coroutine function.
Authenticator = Callable[
    [Mapping[str, str]], "Authenticated | Unauthenticated | Awaitable[Authenticated | Unauthenticated]"
]


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectionInfo:
    """One connected proxy and what it has been sent, for `ambient control` and /config_dump."""

    conn_id: str
    peer: str
    node_id: str
    node_name: str
    namespace: str
    cluster_id: str
    identity: str
    connected_since: float  # seconds since the epoch
    types: tuple[TypeStatus, ...]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["types"] = [
            {**asdict(t), "type": SHORT_TYPE.get(t.type_url, t.type_url), "mode": t.mode.value}
            for t in self.types
        ]
        return out


_END = object()


class _Connection:
    __slots__ = ("conn_id", "peer", "since", "state", "outbox", "waypoint")

    def __init__(self, conn_id: str, peer: str, since: float, state: DeltaConnectionState) -> None:
        self.conn_id = conn_id
        self.peer = peer
        self.since = since
        self.state = state
        self.waypoint = ""  # for a waypoint's Envoy: the waypoint key its snapshot is of
        # Unbounded on purpose: a push must not block the other proxies on a slow one, and
        # dropping a delta would desynchronise the proxy for good.
        self.outbox: asyncio.Queue[object] = asyncio.Queue()

    def send(self, responses: Sequence[discovery_pb2.DeltaDiscoveryResponse]) -> None:
        for response in responses:
            self.outbox.put_nowait(response)

    def info(self) -> ConnectionInfo:
        proxy = self.state.proxy
        return ConnectionInfo(
            conn_id=self.conn_id,
            peer=self.peer,
            node_id=proxy.node_id if proxy else "",
            node_name=proxy.node_name if proxy else "",
            namespace=proxy.namespace if proxy else "",
            cluster_id=proxy.cluster_id if proxy else "",
            identity=str(self.state.verified_identity or ""),
            connected_since=self.since,
            types=self.state.status(),
        )


# xds-protos has no type information, so the servicer base is Any to mypy.
class AdsServer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):  # type: ignore[misc]
    """Serves `istio.workload.Address` and `istio.security.Authorization` over delta ADS to
    ztunnel, and with `waypoints` each waypoint's Envoy its Listeners, Clusters and
    ClusterLoadAssignments (waypoint_envoy.py), built from the same Addresses."""

    def __init__(
        self,
        *,
        authenticate: Authenticator | None = None,
        clock: Callable[[], float] = time.time,
        waypoints: WaypointIndex | None = None,
    ) -> None:
        self._authenticate = authenticate
        self._clock = clock
        self.waypoints = waypoints
        self._snapshot = Snapshot.empty()
        self._push_version = 0
        self._connections: dict[str, _Connection] = {}
        self._ids = itertools.count(1)

    def __repr__(self) -> str:
        return f"AdsServer({len(self._connections)} connections, {self._snapshot!r})"

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    def serve(self, server: grpc.aio.Server) -> None:
        """Register on a grpc.aio server (create it with `options=SERVER_OPTIONS`)."""
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(self, server)

    def update(
        self,
        addresses: Mapping[str, workload_pb2.Address],
        authorizations: Mapping[str, authorization_pb2.Authorization],
        aliases: Mapping[str, Sequence[str]] | None = None,
    ) -> int:
        """Replace the served resources and push the differences to every connected proxy.

        Keys are the xDS names (docs/istio-behaviour.md, "Workloads and services": workload uid,
        `<ns>/<hostname>`, `<ns>/<policy>`).
        `aliases` maps an on-demand key to the names carrying it; by default it is derived from
        the resources. Returns how many responses were queued.
        """
        self._push_version += 1
        self._snapshot = Snapshot.build(
            version=str(self._push_version),
            addresses=addresses,
            authorizations=authorizations,
            aliases=aliases,
            # Unchanged resources keep their packed entry: one pod's change re-packs one Address.
            previous=self._snapshot,
        )
        changed = self.waypoints.reset(addresses) if self.waypoints is not None else set()
        return self._push(changed)

    def apply(
        self,
        *,
        addresses: Mapping[str, workload_pb2.Address] = {},
        removed_addresses: Iterable[str] = (),
        authorizations: Mapping[str, authorization_pb2.Authorization] = {},
        removed_authorizations: Iterable[str] = (),
    ) -> int:
        """Replace or remove some resources and push them: what changed, not the whole mesh
        (`AmbientIndex.apply` returns exactly these). Returns how many responses were queued."""
        self._push_version += 1
        self._snapshot = self._snapshot.patch(
            version=str(self._push_version),
            addresses=addresses,
            removed_addresses=removed_addresses,
            authorizations=authorizations,
            removed_authorizations=removed_authorizations,
        )
        changed = self.waypoints.apply(addresses, removed_addresses) if self.waypoints is not None else set()
        return self._push(changed)

    def _push(self, waypoints: set[str]) -> int:
        """Push the new Address snapshot to every ztunnel, and to each waypoint whose own
        snapshot changed (`waypoints`) that one."""
        queued = 0
        for conn in self._connections.values():
            if conn.waypoint:
                if conn.waypoint not in waypoints or self.waypoints is None:
                    continue
                responses = conn.state.push(self.waypoints.snapshot(conn.waypoint))
            elif conn.state.proxy is not None and conn.state.proxy.node_type == WAYPOINT_NODE_TYPE:
                continue  # a waypoint before its first request is answered from its snapshot then
            else:
                responses = conn.state.push(self._snapshot)
            conn.send(responses)
            queued += len(responses)
        log.info("push v%s: %r, %d responses queued", self._push_version, self._snapshot, queued)
        return queued

    def connections(self) -> tuple[ConnectionInfo, ...]:
        return tuple(conn.info() for conn in self._connections.values())

    # -- gRPC methods ---------------------------------------------------------------------------

    async def StreamAggregatedResources(
        self, request_iterator: AsyncIterator[DeltaDiscoveryRequest], context: AdsContext
    ) -> None:  # noqa: N802
        # ztunnel speaks delta only (docs/istio-behaviour.md, "Delta xDS"); state-of-the-world is refused
        # outright.
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "only DeltaAggregatedResources is served")

    async def DeltaAggregatedResources(
        self, request_iterator: AsyncIterator[DeltaDiscoveryRequest], context: AdsContext
    ) -> None:  # noqa: N802
        peer = context.peer() or "unknown"
        identities = await self._check_caller(context, peer)
        conn_id = f"{peer}-{next(self._ids)}"
        conn = _Connection(
            conn_id,
            peer,
            self._clock(),
            DeltaConnectionState(
                self._snapshot,
                identities=identities,
                waypoint_snapshot=(
                    (lambda proxy, identity: self._waypoint_snapshot(conn_id, proxy, identity))
                    if self.waypoints is not None
                    else None
                ),
            ),
        )
        self._connections[conn.conn_id] = conn
        log.info("ADS: new delta stream %s", conn.conn_id)
        outcome: object = None
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._receive(conn, request_iterator))
                outcome = await self._write(conn, context)
        except* Exception as group:
            # The crash barrier for this stream: log, then end only this stream.
            log.exception("ADS: stream %s failed", conn.conn_id, exc_info=group)
            outcome = group
        finally:
            del self._connections[conn.conn_id]
            log.info("ADS: stream %s closed (%r)", conn.conn_id, conn.state)
        if isinstance(outcome, AdsRefused):
            log.warning("ADS: refused %s: %s", conn.conn_id, outcome)
            await context.abort(grpc.StatusCode[outcome.code], str(outcome))
        if isinstance(outcome, BaseExceptionGroup):
            await context.abort(grpc.StatusCode.INTERNAL, "internal error handling the stream")

    def _waypoint_snapshot(self, conn_id: str, proxy: ProxyInfo, identity: Identity | None) -> Snapshot:
        """Called on a waypoint's first request: which waypoint it is, and its snapshot."""
        assert self.waypoints is not None
        key = self.waypoints.key_of(proxy, identity)
        conn = self._connections.get(conn_id)
        if conn is not None:
            conn.waypoint = key
        log.info("ADS: %s is waypoint %s", proxy.node_id, key)
        return self.waypoints.snapshot(key)

    async def _check_caller(self, context: AdsContext, peer: str) -> tuple[str, ...] | None:
        if self._authenticate is None:
            return None
        metadata = {k.lower(): v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        result = self._authenticate(metadata)
        if inspect.isawaitable(result):
            result = await result
        if isinstance(result, Authenticated):
            return result.identities
        reason = (
            result.reason if isinstance(result, Unauthenticated) else f"authenticator returned {result!r}"
        )
        log.warning("ADS: unauthenticated stream from %s: %s", peer, reason)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
        raise AssertionError("unreachable: abort raises")

    async def _receive(
        self, conn: _Connection, request_iterator: AsyncIterator[DeltaDiscoveryRequest]
    ) -> None:
        try:
            async for request in request_iterator:
                conn.send(conn.state.receive(request))
        except AdsRefused as e:
            conn.outbox.put_nowait(e)
            return
        conn.outbox.put_nowait(_END)

    @staticmethod
    async def _write(conn: _Connection, context: AdsContext) -> object:
        """Send queued responses in order until the receive side ends; returns why it ended."""
        while True:
            item = await conn.outbox.get()
            if item is _END or isinstance(item, AdsRefused):
                return item
            await context.write(item)
