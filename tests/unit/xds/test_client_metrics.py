"""xDS and workload manager metric families: ztunnel's names and labels, exact values on render."""

from __future__ import annotations

import pytest
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import any_pb2
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from ambient_mesh.metrics import TERMINATION_REASONS, Metrics
from ambient_mesh.xds.client import TERMINATION_REASON, resource_bytes
from ambient_mesh.xds.session import StreamEnd

ADDRESS = "type.googleapis.com/istio.workload.Address"
AUTHORIZATION = "type.googleapis.com/istio.security.Authorization"


def families(metrics: Metrics, accept: str = "text/plain") -> dict[str, list[tuple[str, dict, float]]]:
    body, _ = metrics.render(accept)
    text = body.decode()
    return {
        f.name: [(s.name, s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)
    }


def test_termination_reason_names_every_stream_end_as_ztunnel_does():
    assert set(TERMINATION_REASON) == set(StreamEnd)
    assert TERMINATION_REASON == {
        StreamEnd.CONNECTION_ERROR: "ConnectionError",
        StreamEnd.RECONNECT: "Reconnect",
        StreamEnd.ERROR: "Error",
        StreamEnd.LOCAL_ERROR: "Error",  # ztunnel counts its own failures mid-stream as Error
        StreamEnd.COMPLETE: "Complete",
    }
    assert set(TERMINATION_REASON.values()) == TERMINATION_REASONS


def test_xds_counters_render_with_ztunnel_names_and_exact_values():
    m = Metrics(process_metrics=False)
    assert families(m)["istio_xds_connection_terminations"] == []  # a reason appears once counted
    for reason in ("Error", "ConnectionError", "ConnectionError", "Complete"):
        m.xds.connection_terminated(reason)
    m.xds.message_received(ADDRESS, 120)
    m.xds.message_received(ADDRESS, 0)
    m.xds.message_received(AUTHORIZATION, 33)
    got = families(m)
    assert sorted(got["istio_xds_connection_terminations"], key=lambda s: s[1]["reason"]) == [
        ("istio_xds_connection_terminations_total", {"reason": "Complete"}, 1.0),
        ("istio_xds_connection_terminations_total", {"reason": "ConnectionError"}, 2.0),
        ("istio_xds_connection_terminations_total", {"reason": "Error"}, 1.0),
    ]
    assert sorted(got["istio_xds_message"], key=lambda s: s[1]["url"]) == [
        ("istio_xds_message_total", {"url": AUTHORIZATION}, 1.0),
        ("istio_xds_message_total", {"url": ADDRESS}, 2.0),
    ]
    assert sorted(got["istio_xds_message_bytes"], key=lambda s: s[1]["url"]) == [
        ("istio_xds_message_bytes_total", {"url": AUTHORIZATION}, 33.0),
        ("istio_xds_message_bytes_total", {"url": ADDRESS}, 120.0),
    ]
    assert repr(m.xds) == "<XdsMetrics: 3 messages (153 B), 4 stream terminations>"
    body, _ = m.render("text/plain")
    assert b"_created" not in body


def test_openmetrics_declares_the_bytes_unit():
    m = Metrics(process_metrics=False)
    m.xds.message_received(ADDRESS, 7)
    body, content_type = m.render("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    text = body.decode()
    assert "# UNIT istio_xds_message_bytes bytes\n" in text
    assert f'istio_xds_message_bytes_total{{url="{ADDRESS}"}} 7.0\n' in text
    assert f'istio_xds_message_total{{url="{ADDRESS}"}} 1.0\n' in text
    assert "_created" not in text


def test_unknown_reason_and_negative_size_are_refused():
    m = Metrics(process_metrics=False)
    with pytest.raises(ValueError, match="termination reason"):
        m.xds.connection_terminated("LocalError")  # our StreamEnd name, not one of ztunnel's labels
    with pytest.raises(ValueError, match="negative"):
        m.xds.message_received(ADDRESS, -1)
    assert repr(m.xds) == "<XdsMetrics: 0 messages (0 B), 0 stream terminations>"


def test_resource_bytes_counts_payloads_only():
    response = discovery_pb2.DeltaDiscoveryResponse(
        type_url=ADDRESS,
        nonce="n-1",
        system_version_info="a-long-version-string",
        removed_resources=["ns/removed-one"],
        resources=[
            discovery_pb2.Resource(
                name="a", version="v1", resource=any_pb2.Any(type_url=ADDRESS, value=b"x" * 10)
            ),
            discovery_pb2.Resource(name="no-payload", version="v1"),
            discovery_pb2.Resource(name="b", resource=any_pb2.Any(type_url=ADDRESS, value=b"y" * 5)),
        ],
    )
    assert resource_bytes(response) == 15


@given(st.lists(st.one_of(st.none(), st.binary(max_size=64)), max_size=8))
def test_resource_bytes_is_the_sum_of_payload_lengths(payloads):
    resources = [
        discovery_pb2.Resource(name=f"r{i}")
        if p is None
        else discovery_pb2.Resource(name=f"r{i}", resource=any_pb2.Any(type_url=ADDRESS, value=p))
        for i, p in enumerate(payloads)
    ]
    response = discovery_pb2.DeltaDiscoveryResponse(type_url=ADDRESS, resources=resources)
    assert resource_bytes(response) == sum(len(p) for p in payloads if p is not None)


def test_workload_manager_metrics_are_served_only_once_used():
    m = Metrics(process_metrics=False)
    body, _ = m.render()
    assert b"workload_manager_" not in body  # a dedicated-mode proxy has no workload manager
    wm = m.workload_manager
    assert m.workload_manager is wm  # registered once
    got = families(m)
    assert got["workload_manager_active_proxy_count"] == [("workload_manager_active_proxy_count", {}, 0.0)]
    assert got["workload_manager_pending_proxy_count"] == [("workload_manager_pending_proxy_count", {}, 0.0)]
    assert got["workload_manager_proxies_started"] == [("workload_manager_proxies_started_total", {}, 0.0)]
    assert got["workload_manager_proxies_stopped"] == [("workload_manager_proxies_stopped_total", {}, 0.0)]


def test_workload_manager_metrics_exact_values():
    m = Metrics(process_metrics=False)
    wm = m.workload_manager
    for _ in range(3):
        wm.proxy_started()
    wm.proxy_stopped()
    wm.set_active(2)
    wm.set_pending(4)
    wm.set_pending(1)
    got = families(m)
    assert got["workload_manager_active_proxy_count"][0][2] == 2.0
    assert got["workload_manager_pending_proxy_count"][0][2] == 1.0
    assert got["workload_manager_proxies_started"] == [("workload_manager_proxies_started_total", {}, 3.0)]
    assert got["workload_manager_proxies_stopped"] == [("workload_manager_proxies_stopped_total", {}, 1.0)]
    assert repr(wm) == "<WorkloadManagerMetrics: 2 active, 1 pending, 3 started, 1 stopped>"
    body, _ = m.render("application/openmetrics-text")
    assert b"_created" not in body


def test_registries_stay_independent():
    a, b = Metrics(process_metrics=False), Metrics(process_metrics=False)
    a.xds.message_received(ADDRESS, 5)
    a.workload_manager.proxy_started()
    assert b.registry.get_sample_value("istio_xds_message_total", {"url": ADDRESS}) is None
    assert b.registry.get_sample_value("workload_manager_proxies_started_total") is None  # not in use in b
    assert repr(b.workload_manager) == "<WorkloadManagerMetrics: 0 active, 0 pending, 0 started, 0 stopped>"
    assert b.registry.get_sample_value("workload_manager_proxies_started_total") == 0
