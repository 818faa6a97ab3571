"""Istio's HTTP metrics from Envoy access log entries (waypoint/telemetry.py), without Envoy."""

from __future__ import annotations

from envoy.data.accesslog.v3 import accesslog_pb2
from google.protobuf import any_pb2, wrappers_pb2

from ambient_mesh.state.store import ProxyState
from ambient_mesh.waypoint import telemetry
from ambient_mesh.waypoint.telemetry import HTTP_LABEL_NAMES, HttpMetrics, response_flags


def entry(
    code: int = 200, *, principal: str = "spiffe://cluster.local/ns/default/sa/client"
) -> accesslog_pb2.HTTPAccessLogEntry:
    e = accesslog_pb2.HTTPAccessLogEntry()
    c = e.common_properties
    c.upstream_cluster = "inbound-vip|80|http|web.default.svc.cluster.local"
    c.downstream_remote_address.socket_address.address = "10.0.0.9"
    c.upstream_remote_address.envoy_internal_address.endpoint_id = "10.0.0.2:8080"
    c.time_to_last_downstream_tx_byte.FromMilliseconds(12)
    state = any_pb2.Any()
    state.Pack(wrappers_pb2.StringValue(value=principal))
    c.filter_state_objects[telemetry.PEER_PRINCIPAL_KEY].CopyFrom(state)
    e.response.response_code.value = code
    e.request.request_headers_bytes = 100
    e.request.request_body_bytes = 20
    e.response.response_headers_bytes = 80
    e.response.response_body_bytes = 1000
    return e


def test_an_entry_is_labelled_and_rendered() -> None:
    m = HttpMetrics(ProxyState())
    m.record(entry())
    m.record(entry())
    m.record(entry(503))
    labels = dict(zip(HTTP_LABEL_NAMES, next(iter(sorted(m.series))), strict=True))
    assert labels["reporter"] == "waypoint"
    assert labels["source_principal"] == "spiffe://cluster.local/ns/default/sa/client"
    assert labels["destination_service"] == "web.default.svc.cluster.local"
    assert labels["destination_service_name"] == "web"
    assert labels["destination_service_namespace"] == "default"
    assert labels["connection_security_policy"] == "mutual_tls"
    assert labels["response_flags"] == "-"
    # Workloads unknown to the agent's state are `unknown`, as ztunnel writes them.
    assert labels["source_workload"] == labels["destination_workload"] == "unknown"
    text = m.render()
    lines = [line for line in text.splitlines() if line.startswith("istio_requests_total{")]
    assert [line.rsplit(" ", 1)[1] for line in lines] == ["2", "1"]
    assert 'response_code="200"' in lines[0] and 'response_code="503"' in lines[1]
    assert any(
        line.startswith("istio_request_duration_milliseconds_sum{") and line.endswith(" 24")
        for line in text.splitlines()
    )
    assert any(
        line.startswith("istio_response_bytes_sum{") and line.endswith(" 2160") for line in text.splitlines()
    )
    assert 'le="+Inf"} 2' in text


def test_series_are_bounded(monkeypatch) -> None:
    monkeypatch.setattr(telemetry, "MAX_SERIES", 2)
    m = HttpMetrics(ProxyState())
    for code in (200, 201, 202, 203):
        m.record(entry(code))
    assert len(m.series) == 2 and m.dropped == 2 and m.entries == 4


def test_response_flags_use_envoys_short_names() -> None:
    flags = accesslog_pb2.ResponseFlags(upstream_connection_failure=True, upstream_retry_limit_exceeded=True)
    assert response_flags(flags) == "UF,URX"
    assert response_flags(accesslog_pb2.ResponseFlags()) == "-"
