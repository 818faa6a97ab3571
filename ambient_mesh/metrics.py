"""Istio's standard node proxy metrics, kept in a prometheus-client registry of our own.

Counterparts: ztunnel src/proxy/metrics.rs (`Metrics`, `CommonTrafficLabels`,
`ConnectionResult`), src/metrics.rs (`istio_build`), src/xds/metrics.rs (`XdsMetrics`) and
src/inpod/metrics.rs (`WorkloadManagerMetrics`). Names and labels follow
docs/istio-behaviour.md, "Metrics", which is what Istio dashboards and Kiali query.

Each `Metrics` owns a `CollectorRegistry`; nothing touches prometheus-client's global registry,
so several proxies (or tests) can live in one process. Other packages register their own
collectors on `Metrics.registry`; the stats server only calls `render`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from .errors import ResponseFlag

UNKNOWN = "unknown"
NO_FLAG = ResponseFlag.NONE

REPORTER_SOURCE = "source"
REPORTER_DESTINATION = "destination"
REPORTERS = frozenset({REPORTER_SOURCE, REPORTER_DESTINATION})

# The response_flags values ztunnel reports; "-" means the connection ended normally.
RESPONSE_FLAGS = frozenset(ResponseFlag)

MUTUAL_TLS = "mutual_tls"
# Label sets whose bound counter children are kept for reuse (Metrics.bound_children).
BOUND_CHILDREN_MAX_ENTRIES = 4096
# Positions in a bound-children entry (Metrics.bound_children) after its five children.
_PENDING_OPENED, _PENDING_CLOSED, _PENDING_RECEIVED, _PENDING_SENT, _KEPT = 5, 6, 7, 8, 9

# istio_xds_connection_terminations_total{reason}: ztunnel's ConnectionTerminationReason values.
TERMINATION_CONNECTION_ERROR = "ConnectionError"  # no stream: connect failed, no response headers
TERMINATION_RECONNECT = "Reconnect"  # a benign gRPC status (istiod rotating the connection)
TERMINATION_ERROR = "Error"  # any other gRPC status, or a failure on our side
TERMINATION_COMPLETE = "Complete"  # the server ended the stream with OK
TERMINATION_REASONS = frozenset(
    {TERMINATION_CONNECTION_ERROR, TERMINATION_RECONNECT, TERMINATION_ERROR, TERMINATION_COMPLETE}
)


def or_unknown(value: object) -> str:
    """A label value: `unknown` for what the proxy does not know (Istio's convention)."""
    if value is None:
        return UNKNOWN
    text = str(value)
    return text if text else UNKNOWN


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectionLabels:
    """The labels every TCP traffic metric carries, apart from `response_flags`.

    Field order is the label order. Missing values are `unknown`, as in ztunnel.
    """

    reporter: str
    source_workload: str = UNKNOWN
    source_canonical_service: str = UNKNOWN
    source_canonical_revision: str = UNKNOWN
    source_workload_namespace: str = UNKNOWN
    source_principal: str = UNKNOWN
    source_app: str = UNKNOWN
    source_version: str = UNKNOWN
    source_cluster: str = UNKNOWN
    destination_service: str = UNKNOWN
    destination_service_namespace: str = UNKNOWN
    destination_service_name: str = UNKNOWN
    destination_workload: str = UNKNOWN
    destination_canonical_service: str = UNKNOWN
    destination_canonical_revision: str = UNKNOWN
    destination_workload_namespace: str = UNKNOWN
    destination_principal: str = UNKNOWN
    destination_app: str = UNKNOWN
    destination_version: str = UNKNOWN
    destination_cluster: str = UNKNOWN
    request_protocol: str = "tcp"
    connection_security_policy: str = UNKNOWN
    source_region: str = UNKNOWN
    source_zone: str = UNKNOWN
    destination_region: str = UNKNOWN
    destination_zone: str = UNKNOWN

    def __post_init__(self) -> None:
        if self.reporter not in REPORTERS:
            raise ValueError(f"reporter must be source or destination, not {self.reporter!r}")

    def values(self) -> tuple[str, ...]:
        return tuple(getattr(self, name) for name in CONNECTION_LABEL_NAMES)


CONNECTION_LABEL_NAMES: tuple[str, ...] = tuple(f.name for f in fields(ConnectionLabels))
# response_flags sits right after request_protocol, as in ztunnel's label set.
_FLAG_AT = CONNECTION_LABEL_NAMES.index("request_protocol") + 1
TRAFFIC_LABEL_NAMES: tuple[str, ...] = (
    *CONNECTION_LABEL_NAMES[:_FLAG_AT],
    "response_flags",
    *CONNECTION_LABEL_NAMES[_FLAG_AT:],
)


def _with_flag(labels: ConnectionLabels, flag: str) -> tuple[str, ...]:
    values = labels.values()
    return (*values[:_FLAG_AT], flag, *values[_FLAG_AT:])


class WithoutCreated(Collector):
    """Serves our counters without prometheus-client's `_created` series, which ztunnel lacks.
    `before_collect` runs first on every collection (the byte counters' catch-up)."""

    def __init__(
        self, collectors: Iterable[Collector], before_collect: Callable[[], None] | None = None
    ) -> None:
        self._collectors = tuple(collectors)
        self._before_collect = before_collect

    def collect(self) -> Iterator[Metric]:
        if self._before_collect is not None:
            self._before_collect()
        for collector in self._collectors:
            for metric in collector.collect():
                metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
                yield metric


# Called before every collection of a Metrics registry (a scrape, a worker's stats), on the
# event loop that renders it: proxy/telemetry.py records the connection ends it keeps for its
# next batch here, so what is read counts every connection that has ended.
BEFORE_COLLECT: list[Callable[[], None]] = []


class ByteTotals(Protocol):
    """Where a connection's byte counts are read: `bytes_up` from the client towards the
    server, `bytes_down` back (transport/relay.py's Relay is one). Read only: a recorder never
    writes them."""

    @property
    def bytes_up(self) -> int: ...

    @property
    def bytes_down(self) -> int: ...


@dataclass(slots=True)
class ByteCount:
    """A ByteTotals of its own (tests, and a recorder that follows nothing yet)."""

    bytes_up: int = 0
    bytes_down: int = 0


_NO_BYTES = ByteCount()  # shared, never written: a recorder follows it until `follow`


class ConnectionRecorder:
    """Counts one connection's bytes and records its end exactly once.

    The bytes are read from what carries them (`follow`: the relay's own counts), not reported
    per chunk: the byte counters catch up with every open recorder when the registry is
    collected (a scrape, a worker's stats) and with each recorder when it closes. A locked
    counter add per read and per write was about a tenth of a proxy's user time per small
    message, and a call per chunk into plain ints 4 of 18 Python calls per round trip
    (docs/performance.md, "The per-connection path")."""

    __slots__ = (
        "_metrics",
        "labels",
        "_bound",
        "_totals",
        "_counted_received",
        "_counted_sent",
        "response_flag",
    )

    def __init__(self, metrics: Metrics, labels: ConnectionLabels, bound: list[Any] | None = None) -> None:
        self._metrics = metrics
        self.labels = labels
        # Bound children (Metrics.bound_children): the hot path is one locked add, no label lookup.
        self._bound = bound if bound is not None else metrics.bound_children(labels)
        self._totals: ByteTotals = _NO_BYTES
        self._counted_received = 0  # what the byte counters already have
        self._counted_sent = 0
        self.response_flag: ResponseFlag | None = None

    @property
    def closed(self) -> bool:
        return self.response_flag is not None

    def follow(self, totals: ByteTotals) -> None:
        """Count the bytes `totals` counts from now on (its counts so far included)."""
        self._totals = totals

    @property
    def received_bytes(self) -> int:
        """Bytes from the client towards the server."""
        return self._totals.bytes_up

    @property
    def sent_bytes(self) -> int:
        """Bytes from the server back to the client."""
        return self._totals.bytes_down

    def count_bytes(self) -> None:
        """Bring the byte counters up to this connection's totals."""
        totals = self._totals
        received = totals.bytes_up - self._counted_received
        if received:
            self._bound[3].inc(received)
            self._counted_received = totals.bytes_up
        sent = totals.bytes_down - self._counted_sent
        if sent:
            self._bound[4].inc(sent)
            self._counted_sent = totals.bytes_down

    def close(self, response_flag: ResponseFlag = NO_FLAG) -> bool:
        """Record the end of the connection; later calls do nothing and return False."""
        if self.response_flag is not None:
            return False
        if response_flag not in RESPONSE_FLAGS:
            raise ValueError(f"unknown response flag {response_flag!r}")
        self.response_flag = response_flag
        # The bytes not counted yet wait in the label set's pending sums (see bound_children).
        bound, totals = self._bound, self._totals
        bound[_PENDING_RECEIVED] += totals.bytes_up - self._counted_received
        bound[_PENDING_SENT] += totals.bytes_down - self._counted_sent
        self._counted_received, self._counted_sent = totals.bytes_up, totals.bytes_down
        if not bound[_KEPT]:
            self._metrics._flush_pending(bound)
        self._metrics._live.pop(id(self), None)
        self._metrics._record_close(self.labels, response_flag, self._bound)
        return True

    def __repr__(self) -> str:
        state = f"closed {self.response_flag}" if self.closed else "open"
        return (
            f"<ConnectionRecorder {self.labels.reporter} {state}: "
            f"received {self.received_bytes} B, sent {self.sent_bytes} B>"
        )


# HBONE's TLS record-layer failures (tls/transport.py `record_failure`): records that failed
# authentication, oversized or malformed ones, unexpected messages; `reason` is the alert we
# answered with (bad_record_mac, record_overflow, unexpected_message, decode_error,
# illegal_parameter) or "openssl" for one OpenSSL's TLS 1.2 records refused. Not one of Istio's
# standard metrics: named in their style. One per process, served by every `Metrics` registry.
TLS_RECORD_FAILURES = Counter(
    "istio_tls_record_failures",
    "The total number of HBONE connections ended by a TLS record-layer failure",
    ("reason",),
    registry=None,
)


class XdsMetrics:
    """The xDS client's counters: stream ends by reason, and responses and their bytes by type URL.

    As ztunnel counts them: every response (known type or not) before it is handled, its bytes
    being the sum of its resources' payloads (`Resource.resource.value`), not the frame size.
    """

    __slots__ = ("terminations", "messages", "message_bytes", "_counts")

    def __init__(self) -> None:
        self.terminations = Counter(
            "istio_xds_connection_terminations",
            "The total number of completed connections to xds server (unstable)",
            ("reason",),
            registry=None,
        )
        self.messages = Counter(
            "istio_xds_message", "Total number of messages received (unstable)", ("url",), registry=None
        )
        # unit="bytes" names the family istio_xds_message_bytes and adds OpenMetrics' UNIT line,
        # as ztunnel's register_with_unit(.., Unit::Bytes, ..) does.
        self.message_bytes = Counter(
            "istio_xds_message",
            "Total number of bytes received (unstable)",
            ("url",),
            unit="bytes",
            registry=None,
        )
        self._counts = [0, 0, 0]  # terminations, messages, bytes: for repr only

    def collectors(self) -> tuple[Collector, ...]:
        return (self.terminations, self.messages, self.message_bytes)

    def connection_terminated(self, reason: str) -> None:
        if reason not in TERMINATION_REASONS:
            raise ValueError(f"unknown xDS termination reason {reason!r}")
        self.terminations.labels(reason).inc()
        self._counts[0] += 1

    def message_received(self, type_url: str, resource_bytes: int) -> None:
        """One DeltaDiscoveryResponse of `type_url` whose resource payloads add up to `resource_bytes`."""
        if resource_bytes < 0:
            raise ValueError(f"negative message size {resource_bytes}")
        self.messages.labels(type_url).inc()
        self.message_bytes.labels(type_url).inc(resource_bytes)
        self._counts[1] += 1
        self._counts[2] += resource_bytes

    def __repr__(self) -> str:
        terminations, messages, size = self._counts
        return f"<XdsMetrics: {messages} messages ({size} B), {terminations} stream terminations>"


class WorkloadManagerMetrics:
    """Shared (in-pod) mode: how many pod proxies run, wait for a retry, were started and stopped.

    ztunnel registers these under the `workload_manager` prefix (docs/istio-behaviour.md, "Metrics" notes
    that its README's `istio_*` spelling is wrong). Active and pending are set from the owner's
    own bookkeeping after every change, so they cannot drift from it.
    """

    __slots__ = ("active", "pending", "started", "stopped", "_counts")

    def __init__(self) -> None:
        self.active = Gauge(
            "workload_manager_active_proxy_count",
            "The total number current workloads with active proxies (unstable)",
            registry=None,
        )
        self.pending = Gauge(
            "workload_manager_pending_proxy_count",
            "The total number current workloads with pending proxies (unstable)",
            registry=None,
        )
        self.started = Counter(
            "workload_manager_proxies_started",
            "The total number of proxies that were started (unstable)",
            registry=None,
        )
        self.stopped = Counter(
            "workload_manager_proxies_stopped",
            "The total number of proxies that were stopped (unstable)",
            registry=None,
        )
        self._counts = [0, 0, 0, 0]  # active, pending, started, stopped: for repr only

    def collectors(self) -> tuple[Collector, ...]:
        return (self.active, self.pending, self.started, self.stopped)

    def set_active(self, count: int) -> None:
        self.active.set(count)
        self._counts[0] = count

    def set_pending(self, count: int) -> None:
        self.pending.set(count)
        self._counts[1] = count

    def proxy_started(self) -> None:
        self.started.inc()
        self._counts[2] += 1

    def proxy_stopped(self) -> None:
        self.stopped.inc()
        self._counts[3] += 1

    def __repr__(self) -> str:
        active, pending, started, stopped = self._counts
        return (
            f"<WorkloadManagerMetrics: {active} active, {pending} pending, "
            f"{started} started, {stopped} stopped>"
        )


class Metrics:
    """The node proxy's metrics registry."""

    def __init__(self, *, istio_version: str = UNKNOWN, process_metrics: bool = True) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # The open connections' recorders, by id: their bytes are counted at collection (set
        # before anything is registered: registering collects once).
        self._live: dict[int, ConnectionRecorder] = {}
        self._bound: dict[int, list[Any]] = {}  # bound_children; before the registry collects
        # ztunnel registers its xDS metrics whatever the mode, so they are always served.
        self.xds = XdsMetrics()
        self._workload_manager: WorkloadManagerMetrics | None = None
        self.connections_opened = Counter(
            "istio_tcp_connections_opened",
            "The total number of TCP connections opened",
            TRAFFIC_LABEL_NAMES,
            registry=None,
        )
        self.connections_closed = Counter(
            "istio_tcp_connections_closed",
            "The total number of TCP connections closed",
            TRAFFIC_LABEL_NAMES,
            registry=None,
        )
        self.connections_failed = Counter(
            "istio_tcp_connections_failed",
            "The total number of TCP connections that failed to establish or ended with a failure",
            TRAFFIC_LABEL_NAMES,
            registry=None,
        )
        self.received_bytes = Counter(
            "istio_tcp_received_bytes",
            "The size of total bytes received during request in case of a TCP connection",
            TRAFFIC_LABEL_NAMES,
            registry=None,
        )
        self.sent_bytes = Counter(
            "istio_tcp_sent_bytes",
            "The size of total bytes sent during response in case of a TCP connection",
            TRAFFIC_LABEL_NAMES,
            registry=None,
        )
        self.sockets_open = Gauge(
            "istio_tcp_sockets_open", "The number of TCP sockets currently open", ("reporter",), registry=None
        )
        self.build = Gauge("istio_build", "Istio component build info", ("component", "tag"), registry=None)
        self.build.labels("ztunnel", istio_version or UNKNOWN).set(1)
        self.registry.register(
            WithoutCreated(
                (
                    self.connections_opened,
                    self.connections_closed,
                    self.connections_failed,
                    self.received_bytes,
                    self.sent_bytes,
                    self.sockets_open,
                    self.build,
                    TLS_RECORD_FAILURES,
                    *self.xds.collectors(),
                ),
                before_collect=self._before_collect,
            )
        )
        if process_metrics:
            # No namespace: ztunnel exports process_open_fds / process_max_fds without a prefix.
            ProcessCollector(namespace="", registry=self.registry)
        self._open_count = dict.fromkeys(REPORTERS, 0)
        # The gauge reads the open count when scraped: no locked inc and dec per connection.
        for reporter in REPORTERS:
            self.sockets_open.labels(reporter).set_function(
                functools.partial(self._open_count.__getitem__, reporter)
            )

    def register(self, collector: Collector) -> None:
        """Add another package's collector (xDS, DNS, workload manager) to what /metrics serves."""
        self.registry.register(collector)

    @property
    def workload_manager(self) -> WorkloadManagerMetrics:
        """The in-pod manager's metrics, registered on first use: like ztunnel, a dedicated-mode
        proxy (which has no workload manager) does not serve them."""
        if self._workload_manager is None:
            self._workload_manager = WorkloadManagerMetrics()
            self.register(WithoutCreated(self._workload_manager.collectors()))
        return self._workload_manager

    def bound_children(self, labels: ConnectionLabels) -> list[Any]:
        """[labels, opened, closed, received, sent] children of `labels` with no response flag,
        then the counts those children have not been given yet (opened, closed, received bytes,
        sent bytes) and whether the entry is still kept here; `closed` is None until the first
        close (no series before a connection closed).

        Four `labels(*26 values)` lookups per connection were most of the metrics' cost; label
        sets repeat (proxy/telemetry.py reuses its ConnectionLabels objects), so they are kept,
        keyed by the object (held in the entry, so its id is not reused), and dropped when full
        (after their pending counts are given to the counters). A connection's open, its clean
        close and its last bytes add to the pending counts in plain ints, and the counters catch
        up when the registry is collected: four locked counter adds per connection were about
        1.2 µs each (docs/performance.md, "The per-connection path").
        """
        hit = self._bound.get(id(labels))
        if hit is not None and hit[0] is labels:
            return hit
        values = _with_flag(labels, NO_FLAG)
        hit = [
            labels,
            self.connections_opened.labels(*values),
            None,
            self.received_bytes.labels(*values),
            self.sent_bytes.labels(*values),
            0,
            0,
            0,
            0,
            True,
        ]
        if len(self._bound) >= BOUND_CHILDREN_MAX_ENTRIES:
            for entry in self._bound.values():
                self._flush_pending(entry)
                entry[_KEPT] = False  # its recorders still open give their counts at close
            self._bound.clear()
        self._bound[id(labels)] = hit
        return hit

    def _flush_pending(self, bound: list[Any]) -> None:
        """Give the counters what `bound` has counted in plain ints since the last flush."""
        if bound[_PENDING_OPENED]:
            bound[1].inc(bound[_PENDING_OPENED])
            bound[_PENDING_OPENED] = 0
        if bound[_PENDING_CLOSED]:
            bound[2].inc(bound[_PENDING_CLOSED])  # set by the close that made it pending
            bound[_PENDING_CLOSED] = 0
        if bound[_PENDING_RECEIVED]:
            bound[3].inc(bound[_PENDING_RECEIVED])
            bound[_PENDING_RECEIVED] = 0
        if bound[_PENDING_SENT]:
            bound[4].inc(bound[_PENDING_SENT])
            bound[_PENDING_SENT] = 0

    def _before_collect(self) -> None:
        for hook in BEFORE_COLLECT:
            hook()
        for bound in self._bound.values():
            self._flush_pending(bound)
        self.count_live_bytes()

    def connection_opened(self, labels: ConnectionLabels) -> ConnectionRecorder:
        bound = self.bound_children(labels)
        bound[_PENDING_OPENED] += 1
        if not bound[_KEPT]:
            self._flush_pending(bound)
        self._open_count[labels.reporter] += 1
        recorder = ConnectionRecorder(self, labels, bound)
        self._live[id(recorder)] = recorder
        return recorder

    def count_live_bytes(self) -> None:
        """Bring the byte counters up to every open connection's totals (before a collection)."""
        for recorder in list(self._live.values()):
            recorder.count_bytes()

    def connection_failed(self, labels: ConnectionLabels, response_flag: ResponseFlag) -> None:
        """A connection that failed before it was counted as opened (only the failure counter moves)."""
        if response_flag not in RESPONSE_FLAGS or response_flag == NO_FLAG:
            raise ValueError(f"{response_flag!r} is not a failure response flag")
        self.connections_failed.labels(*_with_flag(labels, response_flag)).inc()

    def _record_close(
        self, labels: ConnectionLabels, response_flag: ResponseFlag, bound: list[Any] | None = None
    ) -> None:
        if response_flag == NO_FLAG:
            if bound is None or bound[0] is not labels:
                bound = self.bound_children(labels)
            if bound[2] is None:
                bound[2] = self.connections_closed.labels(*_with_flag(labels, NO_FLAG))
            bound[_PENDING_CLOSED] += 1
            if not bound[_KEPT]:
                self._flush_pending(bound)
        else:
            values = _with_flag(labels, response_flag)
            self.connections_closed.labels(*values).inc()
            self.connections_failed.labels(*values).inc()
        self._open_count[labels.reporter] -= 1

    def render(self, accept_header: str | None = None) -> tuple[bytes, str]:
        """The exposition body and its content type: OpenMetrics when Accept asks for it."""
        encoder, content_type = choose_encoder(accept_header or "")
        return encoder(self.registry), content_type

    def __repr__(self) -> str:
        return (
            f"<Metrics: {self._open_count[REPORTER_SOURCE]} outbound "
            f"and {self._open_count[REPORTER_DESTINATION]} inbound connections open>"
        )
