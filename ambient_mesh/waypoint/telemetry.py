"""Istio's HTTP metrics for a stock-Envoy waypoint, from Envoy's gRPC access log.

Counterpart: istio/proxy's `istio.stats` filter with `reporter: SERVER_GATEWAY` (printed as
`reporter="waypoint"`), which stock Envoy does not have. Envoy sends one HTTPAccessLogEntry per
request of every inbound HTTP chain (`envoy.access_loggers.http_grpc`, configured by the control
plane) to this agent over a unix socket (`envoy.service.accesslog.v3`); the agent labels it as
ztunnel labels its TCP metrics (proxy/telemetry.py `connection_labels`), from the workloads it
keeps by subscribing to the same workload discovery the node proxies use:

  source       the HBONE peer's identity (`io.istio.peer_principal`, logged filter state) and
               the workload at the connection's remote address (the client's node proxy put the
               pod's address there)
  destination  the service of the route's cluster (`inbound-vip|<port>|http[/<subset>]|<host>`
               or `outbound|<port>|<subset>|<host>`), as WDS has it, and the workload at the
               endpoint Envoy chose (its internal address's endpoint id, `<pod ip>:<port>`),
               whose service account is the destination principal

A request the waypoint answers itself (an L7 DENY's 403, a fault abort, a direct response) has
no endpoint, so, as Istio's waypoint, every destination workload label is `unknown`; its service
is still the route's cluster's (Envoy logs no `upstream_cluster` without an upstream host, so
the control plane adds the route's cluster as the custom tag `route_cluster`), and `unknown`
when the route has no cluster (a direct response: Istio's waypoint does not fall back to the
Host header). Response flags are Envoy's short names in its order (`FI` for a fault abort,
`DI` for a delay; the RBAC filter sets none).

and serves `istio_requests_total`, `istio_request_duration_milliseconds`, `istio_request_bytes`
and `istio_response_bytes` on the pod's 15020 `/stats/prometheus`, followed by Envoy's own
(from its admin socket), as pilot-agent merges them. Bytes are the request's and the
response's bytes on the downstream connection (the entry's wire bytes), as Istio's stats filter
counts them; a gRPC request's `grpc_response_status` is read as Istio's stats filter reads it
(`grpc_response_status`). Series are bounded (`MAX_SERIES`); entries past it are counted,
not kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from google.protobuf import wrappers_pb2

from ..config import AuthKind, AuthToken, RootCert, RootCertKind, ZtunnelConfig
from ..errors import IdentityError
from ..identity.spiffe import Identity
from ..metrics import UNKNOWN
from ..proxy.telemetry import connection_labels
from ..state.store import ProxyState, StateReader
from ..xds.client import XdsClient
from ..xds.updater import StateUpdater

log = logging.getLogger(__name__)

PEER_PRINCIPAL_KEY = "io.istio.peer_principal"
# The access log's custom tag with the route's cluster (control/waypoint_l7.py ROUTE_CLUSTER_TAG).
ROUTE_CLUSTER_TAG = "route_cluster"
# The cluster of workload-addressed HTTP (direct-http: control/waypoint_envoy.py ENCAP). Its
# upstream is the internal connect_originate listener, which names no pod; the pod is the
# original destination main_internal restored as the request's local address.
ENCAP_CLUSTER = "encap"
REPORTER = "waypoint"
MAX_SERIES = 10_000
ALS_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
METRICS_REQUEST_MAX_BYTES = 8 * 1024
METRICS_READ_TIMEOUT_S = 5.0
ENVOY_STATS_MAX_BYTES = 16 * 1024 * 1024

# Istio's label set for HTTP metrics, in its order.
HTTP_LABEL_NAMES: tuple[str, ...] = (
    "reporter",
    "source_workload",
    "source_workload_namespace",
    "source_principal",
    "source_app",
    "source_version",
    "source_canonical_service",
    "source_canonical_revision",
    "source_cluster",
    "destination_workload",
    "destination_workload_namespace",
    "destination_principal",
    "destination_app",
    "destination_version",
    "destination_service",
    "destination_service_name",
    "destination_service_namespace",
    "destination_canonical_service",
    "destination_canonical_revision",
    "destination_cluster",
    "request_protocol",
    "response_flags",
    "connection_security_policy",
    "response_code",
    "grpc_response_status",
)
# Istio's default buckets.
DURATION_BUCKETS_MS = (
    0.5,
    1,
    5,
    10,
    25,
    50,
    100,
    250,
    500,
    1000,
    2500,
    5000,
    10000,
    30000,
    60000,
    300000,
    600000,
    1800000,
    3600000,
)
BYTES_BUCKETS = (1, 10, 100, 1000, 10000, 100000, 1000000, 10000000, 100000000, 1000000000)

# gRPC status codes Envoy knows (0 OK to 16 UNAUTHENTICATED); another value is INVALID (-1).
GRPC_MAX_KNOWN_STATUS = 16
GRPC_INVALID_STATUS = -1
# The gRPC status a response without one stands for, by its HTTP status (the mapping gRPC
# publishes, as Envoy applies it); any other status is UNKNOWN.
_GRPC_STATUS_OF_HTTP = {400: 13, 401: 16, 403: 7, 404: 12, 429: 14, 502: 14, 503: 14, 504: 14}
_GRPC_UNKNOWN = 2


def is_grpc_content_type(content_type: str) -> bool:
    """A gRPC request, as Envoy and Istio's stats tell: `application/grpc`, or
    `application/grpc+<codec>` (gRPC-Web is not gRPC)."""
    return content_type == "application/grpc" or content_type.startswith("application/grpc+")


def grpc_response_status(entry: accesslog_pb2.HTTPAccessLogEntry) -> str:
    """The `grpc_response_status` label of a gRPC request: the `grpc-status` of the trailers,
    else of the headers (a trailers-only reply, as Envoy's own local replies to gRPC are), else
    the status the HTTP code stands for; empty when there was no response. A value that is not
    a known code is -1, as Envoy's INVALID."""
    for found in (
        entry.response.response_trailers.get("grpc-status", ""),
        entry.response.response_headers.get("grpc-status", ""),
    ):
        if found:
            code = int(found) if found.isascii() and found.isdigit() else GRPC_INVALID_STATUS
            return str(code if code <= GRPC_MAX_KNOWN_STATUS else GRPC_INVALID_STATUS)
    if not entry.response.HasField("response_code"):
        return ""
    return str(_GRPC_STATUS_OF_HTTP.get(entry.response.response_code.value, _GRPC_UNKNOWN))


# Envoy's ResponseFlags fields and their short names (%RESPONSE_FLAGS%), in Envoy's order
# (`unauthorized_details` is UnauthorizedExternalService, UAEX).
_FLAGS = (
    ("failed_local_healthcheck", "LH"),
    ("no_healthy_upstream", "UH"),
    ("upstream_request_timeout", "UT"),
    ("local_reset", "LR"),
    ("upstream_remote_reset", "UR"),
    ("upstream_connection_failure", "UF"),
    ("upstream_connection_termination", "UC"),
    ("upstream_overflow", "UO"),
    ("no_route_found", "NR"),
    ("delay_injected", "DI"),
    ("fault_injected", "FI"),
    ("rate_limited", "RL"),
    ("unauthorized_details", "UAEX"),
    ("rate_limit_service_error", "RLSE"),
    ("downstream_connection_termination", "DC"),
    ("upstream_retry_limit_exceeded", "URX"),
    ("stream_idle_timeout", "SI"),
    ("invalid_envoy_request_headers", "IH"),
    ("downstream_protocol_error", "DPE"),
    ("upstream_max_stream_duration_reached", "UMSDR"),
    ("response_from_cache_filter", "RFCF"),
    ("no_filter_config_found", "NFCF"),
    ("duration_timeout", "DT"),
    ("upstream_protocol_error", "UPE"),
    ("no_cluster_found", "NC"),
    ("overload_manager", "OM"),
    ("dns_resolution_failure", "DF"),
    ("downstream_remote_reset", "DR"),
)


def response_flags(flags: accesslog_pb2.ResponseFlags) -> str:
    short = [
        name
        for attr, name in _FLAGS
        if (flags.HasField(attr) if attr == "unauthorized_details" else getattr(flags, attr, False))
    ]
    return ",".join(short) or "-"


def cluster_host(cluster: str) -> str:
    """The service host of a route's cluster (`inbound-vip|<port>|http[/<subset>]|<host>`,
    `outbound|<port>|<subset>|<host>`); "" for any other cluster (`encap`, `UnknownService`)."""
    parts = cluster.split("|")
    if len(parts) != 4 or parts[0] not in ("inbound-vip", "outbound") or not parts[1].isdigit():
        return ""
    return parts[3]


def _ip_of(address: Any) -> str:
    """The IP of a logged address: a socket address, or an internal one whose endpoint id is
    `<ip>:<port>` (`[<ip>]:<port>` for IPv6)."""
    kind = address.WhichOneof("address")
    if kind == "socket_address":
        return str(address.socket_address.address)
    if kind == "envoy_internal_address":
        endpoint = str(address.envoy_internal_address.endpoint_id)
        return endpoint.rpartition(":")[0].strip("[]")
    return ""


def _ms(duration: Any) -> float:
    return float(duration.seconds * 1000 + duration.nanos / 1e6)


@dataclass(slots=True)
class _Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * len(self.buckets)
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.count += 1


@dataclass(slots=True)
class _Series:
    requests: int = 0
    duration: _Histogram = field(default_factory=lambda: _Histogram(DURATION_BUCKETS_MS))
    request_bytes: _Histogram = field(default_factory=lambda: _Histogram(BYTES_BUCKETS))
    response_bytes: _Histogram = field(default_factory=lambda: _Histogram(BYTES_BUCKETS))


class HttpMetrics:
    """Istio's HTTP metrics of one waypoint, recorded from access log entries (sans-IO)."""

    def __init__(self, state: StateReader, *, trust_domain: str = "cluster.local", network: str = "") -> None:
        self.state = state
        self.trust_domain = trust_domain
        self.network = network
        self.series: dict[tuple[str, ...], _Series] = {}
        self.entries = 0
        self.dropped = 0

    def __repr__(self) -> str:
        return f"HttpMetrics({len(self.series)} series, {self.entries} entries, {self.dropped} dropped)"

    def _workload(self, ip: str) -> Any:
        try:
            addr = ipaddress.ip_address(ip)
        except ValueError:
            return None
        return self.state.workloads.find_address(self.network, addr)

    def _service(self, cluster: str) -> tuple[str, str, str]:
        """(destination_service, _name, _namespace) of a route's cluster: the service WDS has
        for its host; a host WDS does not know is named by its first two labels, as Istio
        names a Kubernetes service's host; `unknown` without a service cluster."""
        host = cluster_host(cluster)
        if not host:
            return UNKNOWN, UNKNOWN, UNKNOWN
        service = self.state.services.find_hostname(host)
        if service is not None:
            return host, service.name or UNKNOWN, service.namespace or UNKNOWN
        parts = host.split(".")
        if len(parts) > 1:
            return host, parts[0], parts[1]
        return host, UNKNOWN, UNKNOWN

    def labels(self, entry: accesslog_pb2.HTTPAccessLogEntry) -> tuple[str, ...]:
        common = entry.common_properties
        source_identity = None
        state = common.filter_state_objects.get(PEER_PRINCIPAL_KEY)
        if state is not None:
            text = wrappers_pb2.StringValue()
            if state.Unpack(text):
                with contextlib.suppress(IdentityError):
                    source_identity = Identity.parse(text.value)
        source = self._workload(_ip_of(common.downstream_remote_address))
        upstream = (
            common.downstream_local_address
            if common.upstream_cluster == ENCAP_CLUSTER
            else common.upstream_remote_address
        )
        destination = self._workload(_ip_of(upstream))
        destination_identity = (
            Identity(self.trust_domain, destination.namespace, destination.service_account)
            if destination is not None and destination.service_account
            else None
        )
        base = connection_labels(
            "destination",
            source_workload=source,
            source_identity=source_identity,
            destination_workload=destination,
            destination_identity=destination_identity,
            mtls=True,
        )
        service, service_name, service_namespace = self._service(
            common.upstream_cluster or common.custom_tags.get(ROUTE_CLUSTER_TAG, "")
        )
        is_grpc = is_grpc_content_type(entry.request.request_headers.get("content-type", ""))
        values = {
            **{name: getattr(base, name) for name in HTTP_LABEL_NAMES if hasattr(base, name)},
            "reporter": REPORTER,
            "destination_service": service,
            "destination_service_name": service_name,
            "destination_service_namespace": service_namespace,
            "request_protocol": "grpc" if is_grpc else "http",
            "response_flags": response_flags(common.response_flags),
            "response_code": str(entry.response.response_code.value)
            if entry.response.HasField("response_code")
            else "0",
            "grpc_response_status": grpc_response_status(entry) if is_grpc else "",
        }
        return tuple(values[name] for name in HTTP_LABEL_NAMES)

    def record(self, entry: accesslog_pb2.HTTPAccessLogEntry) -> None:
        self.entries += 1
        key = self.labels(entry)
        series = self.series.get(key)
        if series is None:
            if len(self.series) >= MAX_SERIES:
                self.dropped += 1
                return
            series = self.series[key] = _Series()
        common = entry.common_properties
        series.requests += 1
        last = common.time_to_last_downstream_tx_byte
        series.duration.observe(_ms(last) if common.HasField("time_to_last_downstream_tx_byte") else 0.0)
        series.request_bytes.observe(common.downstream_wire_bytes_received)
        series.response_bytes.observe(common.downstream_wire_bytes_sent)

    def render(self) -> str:
        """The Prometheus text exposition of the four metrics."""
        out: list[str] = []
        items = sorted(self.series.items())
        out.append("# TYPE istio_requests_total counter")
        for key, s in items:
            out.append(f"istio_requests_total{{{_label_text(key)}}} {s.requests}")
        for metric, attr in (
            ("istio_request_duration_milliseconds", "duration"),
            ("istio_request_bytes", "request_bytes"),
            ("istio_response_bytes", "response_bytes"),
        ):
            out.append(f"# TYPE {metric} histogram")
            for key, s in items:
                h: _Histogram = getattr(s, attr)
                labels = _label_text(key)
                for bound, count in zip(h.buckets, h.counts or [0] * len(h.buckets), strict=True):
                    out.append(f'{metric}_bucket{{{labels},le="{_num(bound)}"}} {count}')
                out.append(f'{metric}_bucket{{{labels},le="+Inf"}} {h.count}')
                out.append(f"{metric}_sum{{{labels}}} {_num(h.total)}")
                out.append(f"{metric}_count{{{labels}}} {h.count}")
        return "\n".join(out) + "\n"


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _label_text(values: Sequence[str]) -> str:
    return ",".join(f'{name}="{_escape(v)}"' for name, v in zip(HTTP_LABEL_NAMES, values, strict=True))


class WorkloadWatch:
    """The mesh's workloads, from the control plane's workload discovery, as a node proxy keeps
    them (the same xDS client and state; this agent only reads them)."""

    def __init__(self, config: ZtunnelConfig) -> None:
        self.state = ProxyState()
        self.client = XdsClient(config, StateUpdater(self.state))

    @classmethod
    def for_pod(
        cls,
        *,
        xds_address: str,
        root_cert: str,
        token_file: str | None,
        pod_name: str,
        namespace: str,
        pod_ip: str,
        cluster_id: str,
        trust_domain: str,
        alt_hostname: str | None,
    ) -> WorkloadWatch:
        return cls(
            ZtunnelConfig(
                xds_address=xds_address,
                xds_root_ca=RootCert(kind=RootCertKind.FILE, value=root_cert),
                auth_token=(
                    AuthToken(kind=AuthKind.TOKEN_FILE, value=token_file)
                    if token_file is not None
                    else AuthToken(kind=AuthKind.NONE)
                ),
                pod_name=pod_name,
                pod_namespace=namespace,
                instance_ip=ipaddress.ip_address(pod_ip),
                cluster_id=cluster_id,
                trust_domain=trust_domain,
                alt_xds_hostname=alt_hostname,
            )
        )

    def start(self) -> None:
        self.client.start()

    async def close(self) -> None:
        await self.client.close()


class AccessLogReceiver(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    """Envoy's gRPC access log stream, each HTTP entry recorded in `metrics`."""

    def __init__(self, metrics: HttpMetrics) -> None:
        self.metrics = metrics
        self.streams = 0

    def serve(self, server: grpc.aio.Server) -> None:
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(self, server)

    async def StreamAccessLogs(  # noqa: N802 - the gRPC method's name
        self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage], context: Any
    ) -> als_pb2.StreamAccessLogsResponse:
        self.streams += 1
        async for message in request_iterator:
            if message.WhichOneof("log_entries") == "http_logs":
                for entry in message.http_logs.log_entry:
                    try:
                        self.metrics.record(entry)
                    except Exception:  # one bad entry must not end Envoy's stream
                        log.exception("access log entry not recorded")
        return als_pb2.StreamAccessLogsResponse()


ALS_SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", ALS_MAX_MESSAGE_BYTES),
    ("grpc.max_concurrent_streams", 16),
)


async def serve_metrics(
    host: str, port: int, render: Callable[[], str], envoy_stats: Callable[[], Awaitable[bytes]]
) -> asyncio.Server:
    """15020 `/stats/prometheus`: the agent's metrics, then Envoy's."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), METRICS_READ_TIMEOUT_S)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, OSError):
            writer.close()
            return
        parts = head.split(b"\r\n", 1)[0].split()
        path = parts[1].decode(errors="replace").split("?", 1)[0] if len(parts) >= 2 else ""
        if path in ("/stats/prometheus", "/metrics"):
            body = render().encode()
            with contextlib.suppress(OSError, TimeoutError):
                body += await asyncio.wait_for(envoy_stats(), METRICS_READ_TIMEOUT_S)
            status = "200 OK"
        else:
            status, body = "404 Not Found", b"not found\n"
        writer.write(
            f"HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n".encode()
            + body
        )
        with contextlib.suppress(OSError):
            await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, host, port, limit=METRICS_REQUEST_MAX_BYTES)


async def envoy_prometheus(admin_socket: str) -> bytes:
    """Envoy's own `/stats/prometheus`, from its admin unix socket."""
    reader, writer = await asyncio.open_unix_connection(admin_socket)
    try:
        writer.write(b"GET /stats/prometheus HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n")
        await writer.drain()
        data = b""
        while chunk := await reader.read(65536):
            data += chunk
            if len(data) > ENVOY_STATS_MAX_BYTES:
                break
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        body = _dechunk(body)
    return body


def _dechunk(body: bytes) -> bytes:
    out = b""
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        try:
            size = int(size_line.split(b";")[0], 16)
        except ValueError:
            break
        if size == 0:
            break
        out += rest[:size]
        body = rest[size + 2 :]
    return out
