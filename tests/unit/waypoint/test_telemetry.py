"""Istio's HTTP metrics from Envoy access log entries (waypoint/telemetry.py), without Envoy."""

from __future__ import annotations

import ipaddress

from envoy.data.accesslog.v3 import accesslog_pb2
from google.protobuf import any_pb2, wrappers_pb2

from ambient_mesh.control import waypoint_l7
from ambient_mesh.state.model import Service, Workload
from ambient_mesh.state.store import ProxyState
from ambient_mesh.waypoint import telemetry
from ambient_mesh.waypoint.telemetry import HTTP_LABEL_NAMES, HttpMetrics, cluster_host, response_flags


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
    # Istio's byte histograms count the wire (the downstream's bytes meter), not the header and
    # body sizes the entry also carries.
    e.request.request_headers_bytes = 100
    e.request.request_body_bytes = 20
    e.response.response_headers_bytes = 80
    e.response.response_body_bytes = 1000
    c.downstream_wire_bytes_received = 150
    c.downstream_wire_bytes_sent = 1100
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
        line.startswith("istio_response_bytes_sum{") and line.endswith(" 2200") for line in text.splitlines()
    )
    assert any(
        line.startswith("istio_request_bytes_sum{") and line.endswith(" 300") for line in text.splitlines()
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
    # UAEX (ext_authz's denial) sits between RL and RLSE in Envoy's order.
    flags = accesslog_pb2.ResponseFlags(rate_limited=True, rate_limit_service_error=True)
    flags.unauthorized_details.reason = accesslog_pb2.ResponseFlags.Unauthorized.EXTERNAL_SERVICE
    assert response_flags(flags) == "RL,UAEX,RLSE"
    assert response_flags(accesslog_pb2.ResponseFlags(delay_injected=True, fault_injected=True)) == "DI,FI"


def mesh_state() -> ProxyState:
    """A server pod behind `web` (in `shop`, whose host does not say so) and a client pod."""
    state = ProxyState()
    state.services.insert(Service(name="web", namespace="shop", hostname="web.example.internal"))
    for name, ip in (("client", "10.0.0.9"), ("server", "10.0.0.2")):
        state.workloads.insert(
            Workload(
                uid=f"Kubernetes//Pod/shop/{name}",
                name=name,
                namespace="shop",
                workload_ips=(ipaddress.ip_address(ip),),
                service_account=name,
                canonical_name=name,
                canonical_revision="v1",
                workload_name=name,
                cluster_id="Kubernetes",
            )
        )
    return state


def local_reply(code: int, *, route_cluster: str | None) -> accesslog_pb2.HTTPAccessLogEntry:
    """An entry as Envoy logs a request it answered itself: no upstream host, so no upstream
    address or cluster; the route's cluster (if the route has one) only in the custom tag."""
    e = entry(code, principal="spiffe://cluster.local/ns/shop/sa/client")
    c = e.common_properties
    c.ClearField("upstream_cluster")
    c.ClearField("upstream_remote_address")
    if route_cluster is not None:
        c.custom_tags[telemetry.ROUTE_CLUSTER_TAG] = route_cluster
    return e


def labels_of(m: HttpMetrics, e: accesslog_pb2.HTTPAccessLogEntry) -> dict[str, str]:
    return dict(zip(HTTP_LABEL_NAMES, m.labels(e), strict=True))


NO_ENDPOINT = dict.fromkeys(
    (
        "destination_workload",
        "destination_workload_namespace",
        "destination_principal",
        "destination_app",
        "destination_version",
        "destination_canonical_service",
        "destination_canonical_revision",
        "destination_cluster",
    ),
    "unknown",
)
CLIENT = {
    "reporter": "waypoint",
    "source_workload": "client",
    "source_workload_namespace": "shop",
    "source_principal": "spiffe://cluster.local/ns/shop/sa/client",
    "source_app": "client",
    "source_version": "v1",
    "source_canonical_service": "client",
    "source_canonical_revision": "v1",
    "source_cluster": "Kubernetes",
}


def test_a_local_reply_has_the_routes_service_and_no_endpoint() -> None:
    m = HttpMetrics(mesh_state())
    denied = local_reply(403, route_cluster="inbound-vip|80|http|web.example.internal")
    assert labels_of(m, denied) == {
        **CLIENT,
        **NO_ENDPOINT,
        # The service and its namespace as WDS has them, not guessed from the host.
        "destination_service": "web.example.internal",
        "destination_service_name": "web",
        "destination_service_namespace": "shop",
        "request_protocol": "http",
        "response_flags": "-",
        "connection_security_policy": "mutual_tls",
        "response_code": "403",
        "grpc_response_status": "",
    }
    # A fault abort on a subset's route: the same service, Envoy's FI flag.
    abort = local_reply(503, route_cluster="inbound-vip|80|http/v2|web.example.internal")
    abort.common_properties.response_flags.fault_injected = True
    got = labels_of(m, abort)
    assert (got["destination_service"], got["destination_service_namespace"], got["response_flags"]) == (
        "web.example.internal",
        "shop",
        "FI",
    )
    assert {k: got[k] for k in NO_ENDPOINT} == NO_ENDPOINT


def test_a_direct_response_has_no_service() -> None:
    m = HttpMetrics(mesh_state())
    # No cluster on the route: Envoy's formatter writes "-" (and the tag may be absent).
    for e in (local_reply(418, route_cluster="-"), local_reply(418, route_cluster=None)):
        got = labels_of(m, e)
        assert {k: v for k, v in got.items() if k.startswith("destination_")} == {
            **NO_ENDPOINT,
            "destination_service": "unknown",
            "destination_service_name": "unknown",
            "destination_service_namespace": "unknown",
        }
        assert {k: got[k] for k in CLIENT} == CLIENT


def test_an_upstream_request_has_the_endpoints_workload() -> None:
    m = HttpMetrics(mesh_state())
    e = entry(200, principal="spiffe://cluster.local/ns/shop/sa/client")
    e.common_properties.upstream_cluster = "inbound-vip|80|http|web.example.internal"
    e.common_properties.response_flags.delay_injected = True
    got = labels_of(m, e)
    assert got["destination_workload"] == "server"
    assert got["destination_workload_namespace"] == "shop"
    assert got["destination_principal"] == "spiffe://cluster.local/ns/shop/sa/server"
    assert got["destination_service_namespace"] == "shop"
    assert got["response_flags"] == "DI"


def test_cluster_hosts_and_hosts_wds_does_not_know() -> None:
    assert (
        cluster_host("outbound|8080|v1|other.default.svc.cluster.local") == "other.default.svc.cluster.local"
    )
    assert cluster_host("inbound-vip|80|http/v2|web.shop.svc.cluster.local") == "web.shop.svc.cluster.local"
    for other in ("encap", "UnknownService", "-", "", "inbound-vip|x|http|h", "a|1|b|c"):
        assert cluster_host(other) == ""
    m = HttpMetrics(ProxyState())
    e = local_reply(403, route_cluster="inbound-vip|80|http|gone.prod.svc.cluster.local")
    got = labels_of(m, e)
    assert (
        got["destination_service"],
        got["destination_service_name"],
        got["destination_service_namespace"],
    ) == (
        "gone.prod.svc.cluster.local",
        "gone",
        "prod",
    )


def test_the_route_cluster_tag_is_the_control_planes() -> None:
    (logger,) = waypoint_l7.ACCESS_LOG
    tags = logger["typed_config"]["common_config"]["custom_tags"]
    assert tags == [{"tag": telemetry.ROUTE_CLUSTER_TAG, "value": "%UPSTREAM_CLUSTER_RAW%"}]
    assert waypoint_l7.ROUTE_CLUSTER_TAG == telemetry.ROUTE_CLUSTER_TAG


def test_workload_addressed_http_has_the_pod_it_was_sent_to() -> None:
    """direct-http's cluster is `encap`, whose upstream (connect_originate) names no pod: the
    destination is the original destination main_internal restored as the local address; the
    route has no service (a pod address)."""
    m = HttpMetrics(mesh_state())
    e = entry(200, principal="spiffe://cluster.local/ns/shop/sa/client")
    c = e.common_properties
    c.upstream_cluster = telemetry.ENCAP_CLUSTER
    c.upstream_remote_address.envoy_internal_address.server_listener_name = "connect_originate"
    c.upstream_remote_address.envoy_internal_address.endpoint_id = ""
    c.downstream_local_address.socket_address.address = "10.0.0.2"
    c.downstream_local_address.socket_address.port_value = 8080
    got = labels_of(m, e)
    assert (got["destination_workload"], got["destination_principal"]) == (
        "server",
        "spiffe://cluster.local/ns/shop/sa/server",
    )
    assert got["destination_service"] == "unknown"
    assert {k: got[k] for k in CLIENT} == CLIENT
    # A local reply on that chain (a 403 by policy) picked no upstream: no workload, as Istio.
    denied = local_reply(403, route_cluster=telemetry.ENCAP_CLUSTER)
    denied.common_properties.downstream_local_address.socket_address.address = "10.0.0.2"
    assert {k: labels_of(m, denied)[k] for k in NO_ENDPOINT} == NO_ENDPOINT


def test_the_encap_cluster_is_the_control_planes() -> None:
    from ambient_mesh.control import waypoint_envoy

    assert telemetry.ENCAP_CLUSTER == waypoint_envoy.ENCAP


def _grpc(entry_: accesslog_pb2.HTTPAccessLogEntry, content_type: str = "application/grpc") -> dict[str, str]:
    entry_.request.request_headers["content-type"] = content_type
    m = HttpMetrics(ProxyState())
    return dict(zip(HTTP_LABEL_NAMES, m.labels(entry_), strict=True))


def test_grpc_response_status_is_istios() -> None:
    # The trailers' status first, then a trailers-only reply's headers.
    e = entry()
    e.response.response_trailers["grpc-status"] = "5"
    e.response.response_headers["grpc-status"] = "0"
    labels = _grpc(e)
    assert (labels["request_protocol"], labels["grpc_response_status"]) == ("grpc", "5")
    e = entry()
    e.response.response_headers["grpc-status"] = "14"
    assert _grpc(e)["grpc_response_status"] == "14"
    # None given: the status the HTTP code stands for (200 says nothing: UNKNOWN).
    assert [_grpc(entry(code))["grpc_response_status"] for code in (200, 403, 404, 503, 418)] == [
        "2",
        "7",
        "12",
        "14",
        "2",
    ]
    # Not a known code: INVALID, -1.
    for bad in ("17", "-3", "x", "١"):
        e = entry()
        e.response.response_trailers["grpc-status"] = bad
        assert _grpc(e)["grpc_response_status"] == "-1", bad
    # No response at all: empty.
    e = entry()
    e.response.ClearField("response_code")
    assert _grpc(e)["grpc_response_status"] == ""


def test_only_grpc_requests_carry_a_grpc_status() -> None:
    e = entry()
    e.response.response_headers["grpc-status"] = "3"
    for content_type in ("application/json", "application/grpc-web", "application/grpcx"):
        labels = _grpc(e, content_type)
        assert (labels["request_protocol"], labels["grpc_response_status"]) == ("http", ""), content_type
    assert _grpc(e, "application/grpc+proto")["grpc_response_status"] == "3"


def test_the_access_log_carries_grpc_status() -> None:
    config = waypoint_l7.ACCESS_LOG[0]["typed_config"]
    assert config["additional_response_headers_to_log"] == ["grpc-status"]
    assert config["additional_response_trailers_to_log"] == ["grpc-status"]
