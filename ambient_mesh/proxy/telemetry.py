"""One proxied connection's metrics and access log (ztunnel src/proxy/metrics.rs ConnectionResult).

Created when a connection opens (counts `istio_tcp_connections_opened_total`), fed live byte
counts by the relay, and finished exactly once: `complete` after a relay ends, `fail` when the
upstream could not be reached. `failed` covers connections refused before they opened.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import time
from typing import TYPE_CHECKING, Any

from ..errors import ProxyError, ResponseFlag
from ..identity.spiffe import Identity
from ..logs import (
    MAX_DEFERRED_ACCESS_LINES,
    AccessLogFields,
    AccessPeers,
    access_lines_together,
    log_access_complete,
    log_connection_failed,
)
from ..metrics import (
    BEFORE_COLLECT,
    MUTUAL_TLS,
    REPORTER_DESTINATION,
    REPORTER_SOURCE,
    UNKNOWN,
    ByteCount,
    ConnectionLabels,
    or_unknown,
)
from ..net import SocketAddr
from ..state.memo import StateMemo
from ..state.model import Service, Workload
from .routing import Route, RouteKind

if TYPE_CHECKING:
    from ..transport.relay import Relay
    from .inputs import ProxyInputs


# Connections that ended cleanly are recorded (metrics, access line) in batches: `complete`
# keeps a relay's counts and end time, and within ENDED_RECORD_S the kept ones are recorded
# together, at most MAX_ENDED_KEPT at a time, their access lines then written in one write
# (logs.access_lines_together). One connection's metrics and line recorded on its own took
# about 65 µs of CPU per proxy in the running proxies, the same code run for one connection
# after another a fraction of that: on a busy core the proxies, the apps and the kernel take
# turns, and the code and data of the end of a connection are out of the CPU's caches by the
# next one's (docs/performance.md, "The per-connection path"). An error, a failure, a collection of the
# metrics (metrics.BEFORE_COLLECT: a scrape, a worker's stats), a drain and the exit (atexit,
# before logging's own flush) record what is kept first.
ENDED_RECORD_S = 0.02
MAX_ENDED_KEPT = MAX_DEFERRED_ACCESS_LINES


class _Ended:
    """The ended connections kept to be recorded, and the timer (on `loop`) that records them."""

    results: list[tuple[Any, ...]] = []
    timer: asyncio.TimerHandle | None = None
    loop: asyncio.AbstractEventLoop | None = None


def record_ended_connections() -> None:
    """Record the ended connections kept so far (ENDED_RECORD_S) and write their access lines."""
    if _Ended.timer is not None:
        _Ended.timer.cancel()
        _Ended.timer = None
    _Ended.loop = None
    results = _Ended.results
    if results:
        _Ended.results = []
        with access_lines_together():
            for result, *values in results:
                try:
                    result._record(*values)
                except Exception:  # one connection's record must not lose the others'
                    log.exception("recording the end of %r failed", result)


atexit.register(record_ended_connections)
BEFORE_COLLECT.append(record_ended_connections)  # a scrape sees every ended connection


log = logging.getLogger("ambient_mesh.proxy.telemetry")


def response_flag_of(error: BaseException) -> ResponseFlag:
    """The flag a failed connection records: the error's own, else CONNECT (refused, reset,
    timed out: ztunnel's catch-all for an upstream that could not be reached)."""
    if isinstance(error, ProxyError):
        return error.response_flag
    return ResponseFlag.CONNECT


# Label sets kept for reuse (workloads, services and identities repeat from one connection to the
# next): a StateMemo by state version and the peers by value, bounded.
LABELS_MAX_ENTRIES = 4096
# Each entry: [(source, destination, service) objects, their labels, their AccessPeers or None
# until the first connection between them ends].
_labels: StateMemo[tuple[object, ...], list[Any]] = StateMemo("connection labels", LABELS_MAX_ENTRIES)


def peer_labels(
    version: int,
    reporter: str,
    source_workload: Workload | None,
    source_identity: Identity | None,
    destination_workload: Workload | None,
    destination_service: Service | None,
    destination_identity: Identity | None,
    mtls: bool,
) -> list[Any]:
    """`connection_labels`, built once per set of peers while the state is at `version`: about 25
    label values and a dataclass per connection were a tenth of the per-connection CPU, and the
    metrics bind their series to the label object (docs/performance.md, "The per-connection
    path"). The entry also keeps the peers' part of the access line (`AccessPeers`), which the
    same values decide (the reporter follows the direction), once a connection between them has
    ended.

    Keyed by value (uids, the service's namespace and hostname, identities); an entry answers
    only for the very objects it was built from, so a caller holding an older copy of a workload
    gets labels of that copy, never another's.
    """
    src, dst, svc = source_workload, destination_workload, destination_service
    key = (
        reporter,
        mtls,
        src.uid if src is not None else None,
        dst.uid if dst is not None else None,
        svc.namespace if svc is not None else None,
        svc.hostname if svc is not None else None,
        source_identity,
        destination_identity,
    )
    hit = _labels.get(version, key)
    if hit is not None:
        objects = hit[0]
        if objects[0] is src and objects[1] is dst and objects[2] is svc:
            return hit
    labels = connection_labels(reporter, src, source_identity, dst, svc, destination_identity, mtls)
    return _labels.put(version, key, [(src, dst, svc), labels, None])


def connection_labels(
    reporter: str,
    source_workload: Workload | None = None,
    source_identity: Identity | None = None,
    destination_workload: Workload | None = None,
    destination_service: Service | None = None,
    destination_identity: Identity | None = None,
    mtls: bool = False,
) -> ConnectionLabels:
    """Labels for one connection, from what the proxy knows about its two ends.

    Identities are the ones proven by mTLS (or, for outbound, the identity the proxy
    presents for the source pod); pass None for a plaintext peer, never a guess.
    """
    src, dst, svc = source_workload, destination_workload, destination_service
    return ConnectionLabels(
        reporter=reporter,
        source_workload=or_unknown(src and (src.workload_name or src.name)),
        source_canonical_service=or_unknown(src and src.canonical_name),
        source_canonical_revision=or_unknown(src and src.canonical_revision),
        source_workload_namespace=or_unknown(src and src.namespace),
        source_principal=or_unknown(source_identity),
        source_app=or_unknown(src and src.canonical_name),
        source_version=or_unknown(src and src.canonical_revision),
        source_cluster=or_unknown(src and src.cluster_id),
        destination_service=or_unknown(svc and svc.hostname),
        destination_service_namespace=or_unknown(svc and svc.namespace),
        destination_service_name=or_unknown(svc and svc.name),
        destination_workload=or_unknown(dst and (dst.workload_name or dst.name)),
        destination_canonical_service=or_unknown(dst and dst.canonical_name),
        destination_canonical_revision=or_unknown(dst and dst.canonical_revision),
        destination_workload_namespace=or_unknown(dst and dst.namespace),
        destination_principal=or_unknown(destination_identity),
        destination_app=or_unknown(dst and dst.canonical_name),
        destination_version=or_unknown(dst and dst.canonical_revision),
        destination_cluster=or_unknown(dst and dst.cluster_id),
        connection_security_policy=MUTUAL_TLS if mtls else UNKNOWN,
        source_region=or_unknown(src and src.locality.region),
        source_zone=or_unknown(src and src.locality.zone),
        destination_region=or_unknown(dst and dst.locality.region),
        destination_zone=or_unknown(dst and dst.locality.zone),
    )


class ConnectionResult:
    __slots__ = (
        "pi",
        "direction",
        "src_addr",
        "dst_addr",
        "hbone_addr",
        "source",
        "source_identity",
        "destination",
        "service",
        "destination_identity",
        "mtls",
        "recorder",
        "started",
        "_done",
        "_peers",
    )

    def __init__(
        self,
        pi: ProxyInputs,
        *,
        direction: str,
        src_addr: SocketAddr,
        dst_addr: SocketAddr,
        hbone_addr: SocketAddr | str | None,
        source: Workload | None,
        source_identity: Identity | None,
        destination: Workload | None,
        service: Service | None,
        destination_identity: Identity | None,
        mtls: bool,
    ) -> None:
        self.pi = pi
        self.direction = direction
        self.src_addr = src_addr
        self.dst_addr = dst_addr
        self.hbone_addr = hbone_addr
        self.source = source
        self.source_identity = source_identity
        self.destination = destination
        self.service = service
        self.destination_identity = destination_identity
        self.mtls = mtls
        self.started = time.monotonic()
        self._done = False
        reporter = REPORTER_SOURCE if direction == "outbound" else REPORTER_DESTINATION
        self._peers = peer_labels(
            pi.state.version,
            reporter,
            source,
            source_identity,
            destination,
            service,
            destination_identity,
            mtls,
        )
        self.recorder = pi.metrics.connection_opened(self._peers[1])

    def __repr__(self) -> str:
        return f"ConnectionResult({self.direction} {self.src_addr} -> {self.dst_addr}, {self.recorder!r})"

    @classmethod
    def outbound(cls, pi: ProxyInputs, route: Route, peer: SocketAddr) -> ConnectionResult:
        hbone = route.kind in (RouteKind.DIRECT_HBONE, RouteKind.WAYPOINT)
        return cls(
            pi,
            direction="outbound",
            src_addr=peer,
            dst_addr=route.actual_destination,
            hbone_addr=route.hbone_target if hbone else None,
            source=route.source_workload,
            source_identity=route.source_workload.identity if hbone else None,
            destination=route.destination_workload,
            service=route.destination_service,
            destination_identity=(
                route.destination_workload.identity if hbone and route.destination_workload else None
            ),
            mtls=hbone,
        )

    def dump_info(self) -> dict[str, Any]:
        return {
            "direction": self.direction,
            "src": str(self.src_addr),
            "originalDst": str(self.hbone_addr or self.dst_addr),
            "actualDst": str(self.dst_addr),
            "protocol": "HBONE" if self.mtls else "TCP",
        }

    def complete(self, relay: Relay, error: BaseException | None) -> None:
        """The relay has ended: its metrics and access line are recorded with the next batch of
        ended connections (`record_ended_connections`), with this moment's time and counts; an
        error's at once."""
        if self._done:
            return
        self._done = True
        flag = ResponseFlag.NONE if error is None else response_flag_of(error)
        text = None if error is None else str(error) or type(error).__name__
        ended = (self, relay.bytes_up, relay.bytes_down, text, flag, time.monotonic(), time.time())
        loop = asyncio._get_running_loop() if error is None else None
        if loop is None:  # an error (a line at once, logs.py) or outside a loop: now, in order
            if _Ended.results:
                record_ended_connections()
            self._record(*ended[1:])
            return
        results = _Ended.results
        if results and _Ended.loop is not loop:
            record_ended_connections()  # kept for a loop that stopped: those go first
            results = _Ended.results
        results.append(ended)
        if len(results) >= MAX_ENDED_KEPT:
            record_ended_connections()
        elif _Ended.timer is None:
            _Ended.loop = loop
            _Ended.timer = loop.call_later(ENDED_RECORD_S, record_ended_connections)

    def fail(self, error: str, response_flag: ResponseFlag) -> None:
        if self._done:
            return
        self._done = True
        if _Ended.results:
            record_ended_connections()  # the kept ones first: lines stay in order
        self._record(0, 0, error, response_flag, time.monotonic(), time.time())

    def _record(
        self, up: int, down: int, error: str | None, flag: ResponseFlag, ended: float, created: float
    ) -> None:
        # The counts at the end (`complete`), not the relay's when the batch is recorded.
        self.recorder.follow(ByteCount(up, down))
        self.recorder.close(flag)
        peers: AccessPeers | None = self._peers[2]
        if peers is None:
            src, dst = self.source, self.destination
            peers = self._peers[2] = AccessPeers.of(
                AccessLogFields(
                    src_workload=(src.workload_name or src.name) if src else None,
                    src_namespace=src.namespace if src else None,
                    src_identity=self.source_identity,
                    src_cluster=src.cluster_id if src else None,
                    dst_service=self.service.hostname if self.service else None,
                    dst_workload=(dst.workload_name or dst.name) if dst else None,
                    dst_namespace=dst.namespace if dst else None,
                    dst_identity=self.destination_identity,
                    dst_cluster=dst.cluster_id if dst else None,
                    direction=self.direction,
                    mtls=self.mtls,
                )
            )
        log_access_complete(
            peers,
            src_addr=self.src_addr,
            dst_addr=self.dst_addr,
            hbone_addr=self.hbone_addr,
            bytes_sent=down,
            bytes_recv=up,
            duration_ms=int((ended - self.started) * 1000),
            error=error,
            created=created,
        )

    @staticmethod
    def failed(
        pi: ProxyInputs,
        *,
        src: SocketAddr,
        dst: SocketAddr,
        direction: str,
        error: str,
        source: Workload | None = None,
        destination: Workload | None = None,
        response_flag: ResponseFlag = ResponseFlag.CONNECT,
    ) -> None:
        reporter = REPORTER_SOURCE if direction == "outbound" else REPORTER_DESTINATION
        pi.metrics.connection_failed(connection_labels(reporter, source, None, destination), response_flag)
        log_connection_failed(src_addr=src, dst_addr=dst, direction=direction, error=error)
