"""Istio TCP metrics: label sets, live byte counts, close semantics, exposition."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ambient_mesh.identity.spiffe import Identity
from ambient_mesh.metrics import (
    TRAFFIC_LABEL_NAMES,
    ByteCount,
    ConnectionLabels,
    ConnectionRecorder,
    Metrics,
)
from ambient_mesh.proxy.telemetry import connection_labels
from ambient_mesh.state.model import Locality, Service, Workload

SRC = Workload(
    uid="cluster1//Pod/default/sleep-7d9f",
    name="sleep-7d9f",
    namespace="default",
    workload_name="sleep",
    canonical_name="sleep",
    canonical_revision="v1",
    cluster_id="cluster1",
    locality=Locality(region="eu-west", zone="eu-west-1a"),
)
DST = Workload(
    uid="cluster1//Pod/apps/echo-5c4b",
    name="echo-5c4b",
    namespace="apps",
    canonical_name="echo",
    canonical_revision="v2",
    cluster_id="cluster1",
)
SVC = Service(name="echo", namespace="apps", hostname="echo.apps.svc.cluster.local")
SRC_ID = Identity("cluster.local", "default", "sleep")
DST_ID = Identity("cluster.local", "apps", "echo")


def sample(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def full(labels: ConnectionLabels, flag: str = "-") -> dict[str, str]:
    out = {name: getattr(labels, name) for name in TRAFFIC_LABEL_NAMES if name != "response_flags"}
    out["response_flags"] = flag
    return out


def test_build_labels_from_workloads():
    labels = connection_labels("source", SRC, SRC_ID, DST, SVC, DST_ID, mtls=True)
    assert full(labels) == {
        "reporter": "source",
        "source_workload": "sleep",
        "source_canonical_service": "sleep",
        "source_canonical_revision": "v1",
        "source_workload_namespace": "default",
        "source_principal": "spiffe://cluster.local/ns/default/sa/sleep",
        "source_app": "sleep",
        "source_version": "v1",
        "source_cluster": "cluster1",
        "destination_service": "echo.apps.svc.cluster.local",
        "destination_service_namespace": "apps",
        "destination_service_name": "echo",
        "destination_workload": "echo-5c4b",
        "destination_canonical_service": "echo",
        "destination_canonical_revision": "v2",
        "destination_workload_namespace": "apps",
        "destination_principal": "spiffe://cluster.local/ns/apps/sa/echo",
        "destination_app": "echo",
        "destination_version": "v2",
        "destination_cluster": "cluster1",
        "request_protocol": "tcp",
        "response_flags": "-",
        "connection_security_policy": "mutual_tls",
        "source_region": "eu-west",
        "source_zone": "eu-west-1a",
        "destination_region": "unknown",
        "destination_zone": "unknown",
    }


def test_missing_everything_is_unknown():
    labels = connection_labels("destination")
    values = full(labels)
    assert values.pop("reporter") == "destination"
    assert values.pop("request_protocol") == "tcp"
    assert values.pop("response_flags") == "-"
    assert set(values.values()) == {"unknown"}
    with pytest.raises(ValueError):
        connection_labels("sidecar")


def test_label_order_puts_response_flags_after_protocol():
    i = TRAFFIC_LABEL_NAMES.index("request_protocol")
    assert TRAFFIC_LABEL_NAMES[i + 1] == "response_flags"
    assert len(TRAFFIC_LABEL_NAMES) == len(set(TRAFFIC_LABEL_NAMES)) == 27


def followed(recorder: ConnectionRecorder) -> ByteCount:
    """Counts for `recorder` to follow, as it follows a relay's bytes_up and bytes_down."""
    totals = ByteCount()
    recorder.follow(totals)
    return totals


def test_bytes_are_counted_once_across_scrapes_and_the_close():
    """The data path counts in plain ints (the relay's), read by the recorder: each collection
    and the close add only what is new."""
    m = Metrics(process_metrics=False)
    labels = connection_labels("source", SRC, SRC_ID, DST, SVC, DST_ID, mtls=True)
    first, second = m.connection_opened(labels), m.connection_opened(labels)
    first_bytes, second_bytes = followed(first), followed(second)
    first_bytes.bytes_up += 10
    second_bytes.bytes_up += 5
    assert sample(m, "istio_tcp_received_bytes_total", **full(labels)) == 15
    assert sample(m, "istio_tcp_received_bytes_total", **full(labels)) == 15  # a second scrape adds nothing
    first_bytes.bytes_up += 1
    first_bytes.bytes_down += 4
    assert first.close() is True
    # counted at the close, with no scrape in between; a closed recorder is no longer followed
    assert m._live.keys() == {id(second)}
    first_bytes.bytes_up += 1000  # after the close: not counted
    assert sample(m, "istio_tcp_received_bytes_total", **full(labels)) == 16
    assert sample(m, "istio_tcp_sent_bytes_total", **full(labels)) == 4
    second.close()
    assert not m._live


def test_connection_lifecycle_counts():
    m = Metrics(process_metrics=False)
    labels = connection_labels("source", SRC, SRC_ID, DST, SVC, DST_ID, mtls=True)
    rec = m.connection_opened(labels)
    assert sample(m, "istio_tcp_connections_opened_total", **full(labels)) == 1
    assert sample(m, "istio_tcp_sockets_open", reporter="source") == 1
    assert sample(m, "istio_tcp_sockets_open", reporter="destination") == 0
    totals = followed(rec)
    totals.bytes_up += 100
    totals.bytes_up += 23
    totals.bytes_down += 7
    # Live: visible before the connection closes.
    assert sample(m, "istio_tcp_received_bytes_total", **full(labels)) == 123
    assert sample(m, "istio_tcp_sent_bytes_total", **full(labels)) == 7
    assert sample(m, "istio_tcp_connections_closed_total", **full(labels)) is None
    assert repr(rec) == "<ConnectionRecorder source open: received 123 B, sent 7 B>"
    assert repr(m) == "<Metrics: 1 outbound and 0 inbound connections open>"

    assert rec.close() is True
    assert rec.close() is False
    assert rec.close("DENY") is False
    assert sample(m, "istio_tcp_connections_closed_total", **full(labels)) == 1
    assert sample(m, "istio_tcp_connections_closed_total", **full(labels, "DENY")) is None
    assert sample(m, "istio_tcp_connections_failed_total", **full(labels)) is None
    assert sample(m, "istio_tcp_sockets_open", reporter="source") == 0
    assert repr(rec) == "<ConnectionRecorder source closed -: received 123 B, sent 7 B>"


def test_failed_close_counts_failure_with_flag():
    m = Metrics(process_metrics=False)
    labels = connection_labels("destination", None, None, DST, None, None, mtls=False)
    rec = m.connection_opened(labels)
    rec.close("DENY")
    rec.close("DENY")
    assert sample(m, "istio_tcp_connections_opened_total", **full(labels)) == 1
    assert sample(m, "istio_tcp_connections_closed_total", **full(labels, "DENY")) == 1
    assert sample(m, "istio_tcp_connections_failed_total", **full(labels, "DENY")) == 1
    assert sample(m, "istio_tcp_sockets_open", reporter="destination") == 0
    with pytest.raises(ValueError):
        m.connection_opened(labels).close("WHATEVER")


def test_connection_failed_before_open():
    m = Metrics(process_metrics=False)
    labels = connection_labels("source", SRC, SRC_ID)
    m.connection_failed(labels, "CONNECT")
    assert sample(m, "istio_tcp_connections_failed_total", **full(labels, "CONNECT")) == 1
    assert sample(m, "istio_tcp_connections_opened_total", **full(labels)) is None
    assert sample(m, "istio_tcp_sockets_open", reporter="source") == 0
    with pytest.raises(ValueError):
        m.connection_failed(labels, "-")


def test_gauge_tracks_many_connections():
    m = Metrics(process_metrics=False)
    out = connection_labels("source")
    inb = connection_labels("destination")
    recs = [m.connection_opened(out) for _ in range(3)] + [m.connection_opened(inb) for _ in range(2)]
    assert sample(m, "istio_tcp_sockets_open", reporter="source") == 3
    assert sample(m, "istio_tcp_sockets_open", reporter="destination") == 2
    for rec in recs[:2] + recs[3:4]:
        rec.close()
        rec.close()
    assert sample(m, "istio_tcp_sockets_open", reporter="source") == 1
    assert sample(m, "istio_tcp_sockets_open", reporter="destination") == 1
    assert sample(m, "istio_tcp_connections_opened_total", **full(out)) == 3
    assert sample(m, "istio_tcp_connections_closed_total", **full(out)) == 2


def test_build_info_and_process_metrics():
    m = Metrics(istio_version="1.26.0")
    assert sample(m, "istio_build", component="ztunnel", tag="1.26.0") == 1
    body, content_type = m.render()
    text = body.decode()
    assert content_type.startswith("text/plain")
    assert "\nprocess_open_fds " in text
    assert "\nprocess_max_fds " in text


def test_registries_are_independent():
    a, b = Metrics(process_metrics=False), Metrics(process_metrics=False)
    a.connection_opened(connection_labels("source"))
    assert sample(b, "istio_tcp_sockets_open", reporter="source") == 0


def test_render_prometheus_text_has_no_created_series():
    m = Metrics(process_metrics=False)
    labels = connection_labels("source", SRC, SRC_ID, DST, SVC, DST_ID, mtls=True)
    followed(m.connection_opened(labels)).bytes_up += 5
    body, _ = m.render("text/plain")
    text = body.decode()
    assert "_created" not in text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    opened = families["istio_tcp_connections_opened"]
    assert [(s.name, s.labels, s.value) for s in opened.samples] == [
        ("istio_tcp_connections_opened_total", full(labels), 1.0)
    ]
    assert families["istio_tcp_received_bytes"].samples[0].value == 5


def test_render_openmetrics_when_asked():
    m = Metrics(process_metrics=False)
    body, content_type = m.render("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n")
    assert b"_created" not in body


def test_counts_survive_label_sets_dropped_while_their_connections_are_open(monkeypatch):
    """Opens, clean closes and bytes wait in plain ints until a collection; a label set dropped
    from the bound-children cache (full) hands its counts over, and a connection still open on
    it gives its own at close."""
    from ambient_mesh import metrics as metrics_module

    monkeypatch.setattr(metrics_module, "BOUND_CHILDREN_MAX_ENTRIES", 2)
    m = Metrics(process_metrics=False)
    sets = [
        connection_labels("source", SRC, Identity("cluster.local", "default", f"sa{i}")) for i in range(5)
    ]
    recs = [m.connection_opened(labels) for labels in sets]  # each new set past 2 drops the others
    totals = [followed(rec) for rec in recs]
    for i, count in enumerate(totals):
        count.bytes_up += 10 + i
        count.bytes_down += i
    for rec in recs[:3]:
        rec.close()
    for i, labels in enumerate(sets):
        assert sample(m, "istio_tcp_connections_opened_total", **full(labels)) == 1
        assert sample(m, "istio_tcp_received_bytes_total", **full(labels)) == 10 + i
        closed = sample(m, "istio_tcp_connections_closed_total", **full(labels))
        assert closed == (1 if i < 3 else None)
    for count in totals[3:]:
        count.bytes_up += 1
    recs[3].close("CONNECT")  # a failure: its bytes still reach the dropped set's counter
    recs[4].close()
    m.connection_opened(sets[0]).close()  # a set seen again after it was dropped
    assert sample(m, "istio_tcp_connections_opened_total", **full(sets[0])) == 2
    assert sample(m, "istio_tcp_connections_closed_total", **full(sets[0])) == 2
    for i in (3, 4):
        assert sample(m, "istio_tcp_received_bytes_total", **full(sets[i])) == 11 + i
    assert sample(m, "istio_tcp_connections_closed_total", **full(sets[3], "CONNECT")) == 1
    assert sample(m, "istio_tcp_connections_closed_total", **full(sets[4])) == 1
    assert sample(m, "istio_tcp_sockets_open", reporter="source") == 0
