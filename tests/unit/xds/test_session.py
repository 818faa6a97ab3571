"""The sans-IO delta ADS session: initial requests, ACK/NACK, resume, readiness, on-demand
(docs/istio-behaviour.md, "Delta xDS"), played without sockets."""

from __future__ import annotations

import pytest
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import any_pb2, json_format

from ambient_mesh.config import ZtunnelConfig
from ambient_mesh.rbac import Authorization
from ambient_mesh.state.model import Service, Workload
from ambient_mesh.wire.istio.security import authorization_pb2 as A
from ambient_mesh.wire.istio.workload import workload_pb2 as W
from ambient_mesh.xds.session import (
    INITIAL_BACKOFF_S,
    MAX_BACKOFF_S,
    StreamEnd,
    XdsSession,
    build_node,
    reconnect_delay,
)

ADDRESS = "type.googleapis.com/istio.workload.Address"
AUTHZ = "type.googleapis.com/istio.security.Authorization"
Request = discovery_pb2.DeltaDiscoveryRequest
Response = discovery_pb2.DeltaDiscoveryResponse

ENV = {
    "INSTANCE_IP": "10.244.1.7",
    "POD_NAME": "ztunnel-abcde",
    "POD_NAMESPACE": "istio-system",
    "NODE_NAME": "node-1",
    "ISTIO_META_CLUSTER_ID": "c1",
    "ISTIO_META_NETWORK": "net1",
    "ISTIO_METAJSON_LABELS": '{"app": "ztunnel", "replicas": 2, "tags": ["a", true, null]}',
}


def config(**extra: str) -> ZtunnelConfig:
    return ZtunnelConfig.from_env(
        {**ENV, **extra}, ipv6_disabled_on_lo=lambda: False, path_exists=lambda _: False
    )


def session(on_demand: bool = False) -> XdsSession:
    env = {"XDS_ON_DEMAND": "true", "ISTIO_META_DNS_CAPTURE": "false"} if on_demand else {}
    return XdsSession.from_config(config(**env))


def workload_resource(uid: str, version: str = "v1", *, addresses=(b"\x0a\x00\x00\x01",), aliases=()):
    payload = any_pb2.Any()
    payload.Pack(W.Address(workload=W.Workload(uid=uid, namespace="ns", addresses=list(addresses))))
    return discovery_pb2.Resource(name=uid, version=version, resource=payload, aliases=list(aliases))


def service_resource(ns: str, host: str, version: str = "s1", aliases=()):
    payload = any_pb2.Any()
    payload.Pack(W.Address(service=W.Service(name=host.split(".")[0], namespace=ns, hostname=host)))
    return discovery_pb2.Resource(
        name=f"{ns}/{host}", version=version, resource=payload, aliases=list(aliases)
    )


def policy_resource(name: str, ns: str = "ns", **kwargs):
    payload = any_pb2.Any()
    payload.Pack(A.Authorization(name=name, namespace=ns, **kwargs))
    return discovery_pb2.Resource(name=f"{ns}/{name}", resource=payload)


# ------------------------------------------------------------------------------- node


def test_node_id_and_metadata() -> None:
    node = build_node(config())
    assert node.id == "ztunnel~10.244.1.7~ztunnel-abcde.istio-system~istio-system.svc.cluster.local"
    assert json_format.MessageToDict(node.metadata) == {
        "NAME": "ztunnel-abcde",
        "NAMESPACE": "istio-system",
        "INSTANCE_IPS": "10.244.1.7",
        "NODE_NAME": "node-1",
        "CLUSTER_ID": "c1",
        "NETWORK": "net1",
        "LABELS": {"app": "ztunnel", "replicas": 2, "tags": ["a", True, None]},
    }
    # Nothing else in Node is set (docs/istio-behaviour.md, "Delta xDS").
    assert [f.name for f, _ in node.ListFields()] == ["id", "metadata"]


def test_node_defaults_when_env_is_empty() -> None:
    node = build_node(
        ZtunnelConfig.from_env({}, ipv6_disabled_on_lo=lambda: False, path_exists=lambda _: False)
    )
    assert node.id == "ztunnel~1.1.1.1~.~.svc.cluster.local"
    assert json_format.MessageToDict(node.metadata) == {
        "NAME": "",
        "NAMESPACE": "",
        "INSTANCE_IPS": "1.1.1.1",
        "NODE_NAME": "",
    }


# ---------------------------------------------------------------------- initial requests


def test_initial_requests_wildcard() -> None:
    s = session()
    node = build_node(config())
    address, authz = s.initial_requests()
    assert address.SerializeToString(deterministic=True) == Request(
        node=node, type_url=ADDRESS
    ).SerializeToString(deterministic=True)
    assert authz.SerializeToString(deterministic=True) == Request(
        node=node, type_url=AUTHZ
    ).SerializeToString(deterministic=True)


def test_initial_requests_on_demand_subscribe_and_unsubscribe_the_wildcard() -> None:
    address, authz = session(on_demand=True).initial_requests()
    assert (list(address.resource_names_subscribe), list(address.resource_names_unsubscribe)) == (
        ["*"],
        ["*"],
    )
    assert address.type_url == ADDRESS and address.HasField("node")
    assert (list(authz.resource_names_subscribe), list(authz.resource_names_unsubscribe)) == ([], [])


# ---------------------------------------------------------------------------- ACK / NACK


def test_ack_is_type_and_nonce_only() -> None:
    s = session()
    outcome = s.handle_response(Response(type_url=ADDRESS, nonce="n1", resources=[workload_resource("w1")]))
    assert (
        outcome.reply.SerializeToString()
        == Request(type_url=ADDRESS, response_nonce="n1").SerializeToString()
    )
    assert not outcome.nack
    (added,) = outcome.push.added
    assert (added.name, added.version) == ("w1", "v1") and isinstance(added.resource, Workload)
    assert outcome.push.rejected == () and outcome.push.removed == ()


def test_nack_keeps_good_resources_and_does_not_record_rejected_versions() -> None:
    s = session()
    response = Response(
        type_url=ADDRESS,
        nonce="n2",
        resources=[
            workload_resource("good", "g1"),
            workload_resource("bad", "b1", addresses=[b"\x01\x02\x03"]),
            service_resource("ns", "svc.ns.svc.cluster.local"),
            discovery_pb2.Resource(name="empty", version="e1"),
        ],
    )
    outcome = s.handle_response(response)
    assert outcome.nack
    assert outcome.reply.type_url == ADDRESS and outcome.reply.response_nonce == "n2"
    assert outcome.reply.error_detail.code == 0
    assert outcome.reply.error_detail.message == (
        "bad: addresses: an IP address must be 4 or 16 bytes, got 3; empty: XDS payload without resource"
    )
    assert [(a.name, type(a.resource)) for a in outcome.push.added] == [
        ("good", Workload),
        ("ns/svc.ns.svc.cluster.local", Service),
    ]
    assert [r.name for r in outcome.push.rejected] == ["bad", "empty"]
    assert s.known[ADDRESS] == {"good": "g1", "ns/svc.ns.svc.cluster.local": "s1"}
    # Only accepted names and versions go into the resume map of the next stream.
    address, _ = s.initial_requests()
    assert dict(address.initial_resource_versions) == {"good": "g1", "ns/svc.ns.svc.cluster.local": "s1"}


def test_a_rejected_update_forgets_the_old_version() -> None:
    s = session()
    s.handle_response(Response(type_url=ADDRESS, nonce="a", resources=[workload_resource("w", "v1")]))
    s.handle_response(
        Response(type_url=ADDRESS, nonce="b", resources=[workload_resource("w", "v2", addresses=[b""])])
    )
    assert "w" not in s.known[ADDRESS]


def test_removals_drop_known_names_and_unknown_removals_are_fine() -> None:
    s = session()
    s.handle_response(
        Response(type_url=AUTHZ, nonce="a", resources=[policy_resource("p1"), policy_resource("p2")])
    )
    outcome = s.handle_response(Response(type_url=AUTHZ, nonce="b", removed_resources=["ns/p1", "ns/never"]))
    assert not outcome.nack and outcome.push.removed == ("ns/p1", "ns/never")
    assert s.known[AUTHZ] == {"ns/p2": ""}
    _, authz = s.initial_requests()
    assert dict(authz.initial_resource_versions) == {"ns/p2": ""}


def test_authorization_push_decodes_policies_and_rejects_unknown_action() -> None:
    s = session()
    outcome = s.handle_response(
        Response(
            type_url=AUTHZ,
            nonce="a",
            resources=[policy_resource("ok", action=A.DENY), policy_resource("odd", action=7)],
        )
    )
    assert isinstance(outcome.push.added[0].resource, Authorization)
    assert outcome.reply.error_detail.message == "ns/odd: unknown action value 7"


def test_unknown_type_is_acked_and_ignored() -> None:
    s = session()
    outcome = s.handle_response(
        Response(
            type_url="type.googleapis.com/istio.v1.Other",
            nonce="z",
            resources=[discovery_pb2.Resource(name="x")],
        )
    )
    assert not outcome.nack and not outcome.push.known_type
    assert outcome.push.added == () and outcome.reply.response_nonce == "z"


# ------------------------------------------------------------------------------ readiness


def test_ready_after_every_wildcard_type_was_acked() -> None:
    s = session()
    assert not s.ready
    s.handle_response(Response(type_url=ADDRESS, nonce="1"))
    assert not s.ready
    # A NACK does not count.
    s.handle_response(Response(type_url=AUTHZ, nonce="2", resources=[policy_resource("p", scope=9)]))
    assert not s.ready and "waiting for Authorization" in repr(s)
    s.handle_response(Response(type_url=AUTHZ, nonce="3"))
    assert s.ready


def test_on_demand_readiness_waits_for_authorization_only() -> None:
    s = session(on_demand=True)
    assert not s.ready
    s.handle_response(Response(type_url=AUTHZ, nonce="1"))
    assert s.ready


# ------------------------------------------------------------------------------ on demand


def test_demand_request_and_alias_correlation() -> None:
    s = session(on_demand=True)
    request = s.demand("/10.0.0.1")
    assert (
        request.SerializeToString()
        == Request(type_url=ADDRESS, resource_names_subscribe=["/10.0.0.1"]).SerializeToString()
    )
    assert s.demand("/10.0.0.1") is None  # already waiting: no second subscription
    assert s.known[ADDRESS] == {"/10.0.0.1": ""}
    # istiod names the answer by its uid and lists the requested key among the aliases.
    outcome = s.handle_response(
        Response(
            type_url=ADDRESS, nonce="n", resources=[workload_resource("c//Pod/ns/a", aliases=["/10.0.0.1"])]
        )
    )
    assert outcome.answered == ("/10.0.0.1",)
    assert s.pending == {}
    assert s.known[ADDRESS] == {"/10.0.0.1": "", "c//Pod/ns/a": "v1"}


def test_demand_answered_by_name_or_by_removal() -> None:
    s = session(on_demand=True)
    s.demand("ns/svc.ns.svc.cluster.local")
    s.demand("/10.9.9.9")
    outcome = s.handle_response(
        Response(
            type_url=ADDRESS,
            nonce="n",
            resources=[service_resource("ns", "svc.ns.svc.cluster.local")],
            removed_resources=["/10.9.9.9"],
        )
    )
    assert set(outcome.answered) == {"ns/svc.ns.svc.cluster.local", "/10.9.9.9"}
    assert "/10.9.9.9" not in s.known[ADDRESS]


def test_pending_demands_ride_in_the_next_initial_request() -> None:
    s = session(on_demand=True)
    s.demand("/10.0.0.5")
    address, _ = s.initial_requests()
    assert dict(address.initial_resource_versions) == {"/10.0.0.5": ""}
    assert list(address.resource_names_subscribe) == ["*"]


def test_demand_needs_on_demand_mode() -> None:
    with pytest.raises(ValueError):
        session().demand("/10.0.0.1")


def test_repr_says_what_it_holds() -> None:
    s = session(on_demand=True)
    s.demand("/10.0.0.1")
    s.handle_response(Response(type_url=AUTHZ, nonce="1", resources=[policy_resource("p")]))
    assert repr(s) == (
        "<XdsSession on-demand: 1 Address, 1 Authorization known, 1 pending on-demand, "
        "1 responses (0 NACKed), ready>"
    )


# ------------------------------------------------------------------------------ backoff


def test_reconnect_backoff_rules() -> None:
    b = INITIAL_BACKOFF_S
    delays = []
    for _ in range(3):
        delay, b = reconnect_delay(StreamEnd.CONNECTION_ERROR, b)
        delays.append(delay)
    assert delays == pytest.approx([0.02, 0.04, 0.08])
    assert reconnect_delay(StreamEnd.ERROR, 0.08) == pytest.approx((0.16, 0.16))
    assert reconnect_delay(StreamEnd.ERROR, 10.0) == (MAX_BACKOFF_S, MAX_BACKOFF_S)
    assert reconnect_delay(StreamEnd.RECONNECT, 5.0) == (INITIAL_BACKOFF_S, INITIAL_BACKOFF_S)
    assert reconnect_delay(StreamEnd.COMPLETE, 5.0) == (0.0, INITIAL_BACKOFF_S)
    assert reconnect_delay(StreamEnd.LOCAL_ERROR, 5.0) == (0.0, INITIAL_BACKOFF_S)
