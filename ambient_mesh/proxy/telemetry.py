"""One proxied connection's metrics and access log (ztunnel src/proxy/metrics.rs ConnectionResult).

Created when a connection opens (counts `istio_tcp_connections_opened_total`), fed live byte
counts by the relay, and finished exactly once: `complete` after a relay ends, `fail` when the
upstream could not be reached. `failed` covers connections refused before they opened.
"""

from __future__ import annotations

import time

from ..identity.spiffe import Identity
from ..logs import AccessLogFields, log_connection_complete, log_connection_failed
from ..metrics import ConnectionLabels
from ..net import SocketAddr
from ..state.model import Service, Workload
from .routing import Route, RouteKind

REPORTER_SOURCE = "source"
REPORTER_DESTINATION = "destination"


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
        "_add_received",
        "_add_sent",
    )

    def __init__(
        self,
        pi,
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
        labels = ConnectionLabels.build(
            reporter, source, source_identity, destination, service, destination_identity, mtls
        )
        self.recorder = pi.metrics.connection_opened(labels)
        self._add_received = self.recorder.add_received
        self._add_sent = self.recorder.add_sent

    def __repr__(self) -> str:
        return f"ConnectionResult({self.direction} {self.src_addr} -> {self.dst_addr}, {self.recorder!r})"

    @classmethod
    def outbound(cls, pi, route: Route, peer: SocketAddr) -> ConnectionResult:
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

    def progress(self, up: int, down: int) -> None:
        # client -> server bytes are "received" in Istio's metric vocabulary, the reverse "sent"
        if up:
            self._add_received(up)
        if down:
            self._add_sent(down)

    def dump_info(self) -> dict:
        return {
            "direction": self.direction,
            "src": str(self.src_addr),
            "originalDst": str(self.hbone_addr or self.dst_addr),
            "actualDst": str(self.dst_addr),
            "protocol": "HBONE" if self.mtls else "TCP",
        }

    def complete(self, relay, error: BaseException | None) -> None:
        flag = "-" if error is None else getattr(error, "response_flag", "CONNECT")
        self._finish(
            relay.bytes_up,
            relay.bytes_down,
            None if error is None else str(error) or type(error).__name__,
            flag,
        )

    def fail(self, error: str, response_flag: str) -> None:
        self._finish(0, 0, error, response_flag)

    def _finish(self, up: int, down: int, error: str | None, flag: str) -> None:
        if self._done:
            return
        self._done = True
        self.recorder.close(flag)
        src, dst = self.source, self.destination
        log_connection_complete(
            AccessLogFields(
                src_addr=self.src_addr,
                src_workload=src and (src.workload_name or src.name),
                src_namespace=src and src.namespace,
                src_identity=self.source_identity,
                src_cluster=src and src.cluster_id,
                dst_addr=self.dst_addr,
                dst_hbone_addr=self.hbone_addr,
                dst_service=self.service and self.service.hostname,
                dst_workload=dst and (dst.workload_name or dst.name),
                dst_namespace=dst and dst.namespace,
                dst_identity=self.destination_identity,
                dst_cluster=dst and dst.cluster_id,
                direction=self.direction,
                bytes_sent=down,
                bytes_recv=up,
                duration_ms=int((time.monotonic() - self.started) * 1000),
                error=error,
                mtls=self.mtls,
            )
        )

    @staticmethod
    def failed(
        pi,
        *,
        src: SocketAddr,
        dst: SocketAddr,
        direction: str,
        error: str,
        source: Workload | None = None,
        destination: Workload | None = None,
        response_flag: str = "CONNECT",
    ) -> None:
        reporter = REPORTER_SOURCE if direction == "outbound" else REPORTER_DESTINATION
        pi.metrics.connection_failed(
            ConnectionLabels.build(reporter, source, None, destination), response_flag
        )
        log_connection_failed(src_addr=src, dst_addr=dst, direction=direction, error=error)
