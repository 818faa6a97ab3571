"""Wire -> model conversion: full round trips, xDS defaults, and every rule ztunnel rejects on
(docs/istio-behaviour.md, "Workloads and services" and "Authorization")."""

from __future__ import annotations

import ipaddress

import pytest
from google.protobuf import empty_pb2, wrappers_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from ambient_mesh.errors import AmbientError
from ambient_mesh.rbac import (
    Action,
    Authorization,
    Clause,
    Match,
    Rule,
    Scope,
    ServiceAccountMatch,
    StringMatch,
)
from ambient_mesh.state.model import (
    ApplicationTunnel,
    AppTunnelProtocol,
    GatewayAddress,
    HealthPolicy,
    IpFamilies,
    LoadBalancing,
    LoadBalancingMode,
    LoadBalancingScope,
    Locality,
    NamespacedHostname,
    NetworkAddress,
    NetworkMode,
    Service,
    TunnelProtocol,
    Visibility,
    WeightedWaypoint,
    Workload,
    WorkloadStatus,
    WorkloadType,
)
from ambient_mesh.wire.istio.security import authorization_pb2 as A
from ambient_mesh.wire.istio.workload import workload_pb2 as W
from ambient_mesh.xds.convert import (
    XdsRejection,
    address_from_resource,
    authorization_from_proto,
    authorization_from_resource,
    service_from_proto,
    workload_from_proto,
)

IP1 = bytes([10, 0, 0, 1])
IP6 = ipaddress.IPv6Address("fd00::7").packed


def ip(text: str):
    return ipaddress.ip_address(text)


# ------------------------------------------------------------------------------ workloads


def full_workload_pb() -> W.Workload:
    return W.Workload(
        uid="cluster1//Pod/ns1/pod-a",
        name="pod-a",
        namespace="ns1",
        addresses=[IP1, IP6],
        hostname="pod-a.example",
        network="net1",
        tunnel_protocol=W.HBONE,
        trust_domain="td.example",
        service_account="sa1",
        waypoint=W.GatewayAddress(
            hostname=W.NamespacedHostname(namespace="ns1", hostname="wp.ns1.svc.cluster.local"),
            hbone_mtls_port=15008,
        ),
        network_gateway=W.GatewayAddress(
            address=W.NetworkAddress(network="net2", address=bytes([192, 168, 0, 9])), hbone_mtls_port=15009
        ),
        node="node-1",
        canonical_name="app",
        canonical_revision="v2",
        workload_type=W.POD,
        workload_name="pod-a",
        native_tunnel=True,
        application_tunnel=W.ApplicationTunnel(protocol=W.ApplicationTunnel.PROXY, port=15088),
        services={
            "ns1/svc.ns1.svc.cluster.local": W.PortList(
                ports=[W.Port(service_port=80, target_port=8080), W.Port(service_port=443, target_port=0)]
            )
        },
        authorization_policies=["ns1/allow-a", "istio-system/strict"],
        status=W.UNHEALTHY,
        cluster_id="cluster1",
        locality=W.Locality(region="r1", zone="z1", subzone="s1"),
        network_mode=W.HOST_NETWORK,
        extensions=[W.Extension(name="ignored")],
        capacity=wrappers_pb2.UInt32Value(value=3),
    )


def test_full_workload_round_trip() -> None:
    pb = W.Workload.FromString(full_workload_pb().SerializeToString())
    assert workload_from_proto(pb) == Workload(
        uid="cluster1//Pod/ns1/pod-a",
        name="pod-a",
        namespace="ns1",
        workload_ips=(ip("10.0.0.1"), ip("fd00::7")),
        hostname="pod-a.example",
        network="net1",
        protocol=TunnelProtocol.HBONE,
        network_mode=NetworkMode.HOST_NETWORK,
        trust_domain="td.example",
        service_account="sa1",
        waypoint=GatewayAddress(
            destination=NamespacedHostname(namespace="ns1", hostname="wp.ns1.svc.cluster.local"),
            hbone_mtls_port=15008,
        ),
        network_gateway=GatewayAddress(
            destination=NetworkAddress(network="net2", address=ip("192.168.0.9")), hbone_mtls_port=15009
        ),
        node="node-1",
        canonical_name="app",
        canonical_revision="v2",
        workload_type=WorkloadType.POD,
        workload_name="pod-a",
        native_tunnel=True,
        application_tunnel=ApplicationTunnel(protocol=AppTunnelProtocol.PROXY, port=15088),
        services={"ns1/svc.ns1.svc.cluster.local": {80: 8080, 443: 0}},
        authorization_policies=("ns1/allow-a", "istio-system/strict"),
        status=WorkloadStatus.UNHEALTHY,
        cluster_id="cluster1",
        locality=Locality(region="r1", zone="z1", subzone="s1"),
        capacity=3,
    )


def test_workload_defaults() -> None:
    w = workload_from_proto(W.Workload(uid="u", namespace="ns"))
    assert (w.trust_domain, w.service_account, w.cluster_id, w.capacity) == (
        "cluster.local",
        "default",
        "Kubernetes",
        1,
    )
    assert (w.protocol, w.status, w.network_mode, w.workload_type) == (
        TunnelProtocol.TCP,
        WorkloadStatus.HEALTHY,
        NetworkMode.STANDARD,
        WorkloadType.DEPLOYMENT,
    )
    assert w.waypoint is None and w.network_gateway is None and w.application_tunnel is None
    assert w.locality == Locality() and w.services == {}
    assert str(w.identity) == "spiffe://cluster.local/ns/ns/sa/default"


def test_capacity_wrapper_present_with_zero_is_zero() -> None:
    assert workload_from_proto(W.Workload(uid="u", capacity=wrappers_pb2.UInt32Value(value=0))).capacity == 0


def test_unknown_workload_type_falls_back_to_deployment() -> None:
    assert workload_from_proto(W.Workload(uid="u", workload_type=42)).workload_type is WorkloadType.DEPLOYMENT


def rejection(fn, pb) -> XdsRejection:
    with pytest.raises(XdsRejection) as info:
        fn(pb)
    assert isinstance(info.value, AmbientError)
    return info.value


@pytest.mark.parametrize(
    "pb, reason",
    [
        (
            W.Workload(uid="u", addresses=[b"\x0a\x00\x00"]),
            "addresses: an IP address must be 4 or 16 bytes, got 3",
        ),
        (W.Workload(uid="u", addresses=[b""]), "addresses: an IP address must be 4 or 16 bytes, got 0"),
        (
            W.Workload(uid="u", tunnel_protocol=W.LEGACY_ISTIO_MTLS),
            "tunnel protocol LEGACY_ISTIO_MTLS is not supported",
        ),
        (W.Workload(uid="u", tunnel_protocol=9), "unknown tunnel_protocol value 9"),
        (W.Workload(uid="u", network_mode=2), "unknown network_mode value 2"),
        (W.Workload(uid="u", status=5), "unknown status value 5"),
        (
            W.Workload(uid="u", application_tunnel=W.ApplicationTunnel(protocol=3)),
            "unknown application_tunnel.protocol value 3",
        ),
        (
            W.Workload(uid="u", services={"no-slash": W.PortList()}),
            "services key 'no-slash' is not of the form namespace/hostname",
        ),
        (
            W.Workload(uid="u", waypoint=W.GatewayAddress(hbone_mtls_port=15008)),
            "waypoint: gateway address has no destination",
        ),
        (
            W.Workload(uid="u", network_gateway=W.GatewayAddress()),
            "network_gateway: gateway address has no destination",
        ),
        (
            W.Workload(uid="u", waypoint=W.GatewayAddress(address=W.NetworkAddress(address=b"\x01\x02"))),
            "waypoint: an IP address must be 4 or 16 bytes, got 2",
        ),
    ],
)
def test_workload_rejections(pb: W.Workload, reason: str) -> None:
    err = rejection(workload_from_proto, pb)
    assert (err.name, err.reason, str(err)) == ("u", reason, f"u: {reason}")


# ------------------------------------------------------------------------------- services


def full_service_pb() -> W.Service:
    return W.Service(
        name="svc",
        namespace="ns1",
        hostname="svc.ns1.svc.cluster.local",
        addresses=[
            W.NetworkAddress(network="", address=bytes([10, 96, 0, 1])),
            W.NetworkAddress(network="net1", address=IP6, length=128),
            W.NetworkAddress(network="", address=bytes([10, 200, 7, 0]), length=24),
            W.NetworkAddress(network="net1", address=ipaddress.IPv6Address("fd00:1::").packed, length=64),
        ],
        ports=[W.Port(service_port=80, target_port=8080, app_protocol=W.HTTP11), W.Port(service_port=90)],
        subject_alt_names=["spiffe://td/ns/ns1/sa/x"],
        waypoint=W.GatewayAddress(
            address=W.NetworkAddress(address=bytes([10, 0, 0, 9])), hbone_mtls_port=15008
        ),
        load_balancing=W.LoadBalancing(
            routing_preference=[W.LoadBalancing.NETWORK, W.LoadBalancing.ZONE],
            mode=W.LoadBalancing.FAILOVER,
            health_policy=W.LoadBalancing.ALLOW_ALL,
        ),
        ip_families=W.DUAL,
        canonical=True,
        ingress_use_waypoint=True,
        weighted_waypoints=[
            W.WeightedWaypoint(
                destination=W.GatewayAddress(
                    hostname=W.NamespacedHostname(namespace="ns1", hostname="wp2"), hbone_mtls_port=15008
                ),
                weight=20,
            )
        ],
        visibility=W.Service.NAMESPACE,
    )


def test_full_service_round_trip() -> None:
    pb = W.Service.FromString(full_service_pb().SerializeToString())
    assert service_from_proto(pb) == Service(
        name="svc",
        namespace="ns1",
        hostname="svc.ns1.svc.cluster.local",
        vips=(
            NetworkAddress(network="", address=ip("10.96.0.1")),
            NetworkAddress(network="net1", address=ip("fd00::7")),
        ),
        cidr_vips=(
            ("", ipaddress.ip_network("10.200.7.0/24")),
            ("net1", ipaddress.ip_network("fd00:1::/64")),
        ),
        ports={80: 8080, 90: 0},
        subject_alt_names=("spiffe://td/ns/ns1/sa/x",),
        waypoint=GatewayAddress(
            destination=NetworkAddress(network="", address=ip("10.0.0.9")), hbone_mtls_port=15008
        ),
        weighted_waypoints=(
            WeightedWaypoint(
                destination=GatewayAddress(
                    destination=NamespacedHostname(namespace="ns1", hostname="wp2"), hbone_mtls_port=15008
                ),
                weight=20,
            ),
        ),
        load_balancer=LoadBalancing(
            routing_preferences=(LoadBalancingScope.NETWORK, LoadBalancingScope.ZONE),
            mode=LoadBalancingMode.FAILOVER,
            health_policy=HealthPolicy.ALLOW_ALL,
        ),
        ip_families=IpFamilies.DUAL,
        canonical=True,
        visibility=Visibility.NAMESPACE,
    )


def test_service_defaults_and_unknown_visibility() -> None:
    s = service_from_proto(W.Service(name="s", namespace="ns", hostname="h", visibility=7))
    assert s.visibility is Visibility.PUBLIC
    assert (s.load_balancer, s.waypoint, s.ip_families, s.vips, s.cidr_vips) == (
        None,
        None,
        IpFamilies.AUTOMATIC,
        (),
        (),
    )


def test_cidr_host_bits_are_masked() -> None:
    s = service_from_proto(
        W.Service(
            namespace="ns",
            hostname="h",
            addresses=[W.NetworkAddress(address=bytes([10, 1, 2, 3]), length=16)],
        )
    )
    assert s.cidr_vips == (("", ipaddress.ip_network("10.1.0.0/16")),)


@pytest.mark.parametrize(
    "pb, reason",
    [
        (
            W.Service(namespace="ns", hostname="h", addresses=[W.NetworkAddress(address=b"\x01" * 5)]),
            "addresses: an IP address must be 4 or 16 bytes, got 5",
        ),
        (
            W.Service(namespace="ns", hostname="h", addresses=[W.NetworkAddress(address=IP1, length=33)]),
            "addresses: prefix length 33 is too long for 10.0.0.1",
        ),
        (
            W.Service(namespace="ns", hostname="h", waypoint=W.GatewayAddress()),
            "waypoint: gateway address has no destination",
        ),
        (
            W.Service(namespace="ns", hostname="h", weighted_waypoints=[W.WeightedWaypoint(weight=1)]),
            "weighted_waypoints: entry has no destination",
        ),
        (
            W.Service(
                namespace="ns",
                hostname="h",
                weighted_waypoints=[W.WeightedWaypoint(destination=W.GatewayAddress(), weight=1)],
            ),
            "weighted_waypoints: gateway address has no destination",
        ),
        (
            W.Service(
                namespace="ns",
                hostname="h",
                load_balancing=W.LoadBalancing(routing_preference=[W.LoadBalancing.UNSPECIFIED_SCOPE]),
            ),
            "unknown load_balancing.routing_preference value 0",
        ),
        (
            W.Service(namespace="ns", hostname="h", load_balancing=W.LoadBalancing(routing_preference=[17])),
            "unknown load_balancing.routing_preference value 17",
        ),
        (
            W.Service(namespace="ns", hostname="h", load_balancing=W.LoadBalancing(mode=9)),
            "unknown load_balancing.mode value 9",
        ),
        (
            W.Service(namespace="ns", hostname="h", load_balancing=W.LoadBalancing(health_policy=2)),
            "unknown load_balancing.health_policy value 2",
        ),
        (W.Service(namespace="ns", hostname="h", ip_families=4), "unknown ip_families value 4"),
    ],
)
def test_service_rejections(pb: W.Service, reason: str) -> None:
    err = rejection(service_from_proto, pb)
    assert (err.name, err.reason) == ("ns/h", reason)


# -------------------------------------------------------------------------- authorization


def full_authorization_pb() -> A.Authorization:
    return A.Authorization(
        name="allow-a",
        namespace="ns1",
        scope=A.WORKLOAD_SELECTOR,
        action=A.DENY,
        dry_run=True,
        rules=[
            A.Rule(
                clauses=[
                    A.Clause(
                        matches=[
                            A.Match(
                                namespaces=[A.StringMatch(exact="ns2"), A.StringMatch()],
                                not_namespaces=[A.StringMatch(prefix="kube-")],
                                principals=[
                                    A.StringMatch(suffix="/sa/a"),
                                    A.StringMatch(presence=empty_pb2.Empty()),
                                ],
                                not_principals=[A.StringMatch(exact="td/ns/x/sa/y")],
                                source_ips=[
                                    A.Address(address=bytes([10, 1, 0, 0]), length=16),
                                    A.Address(address=b"\x01\x02\x03", length=8),
                                ],
                                not_source_ips=[A.Address(address=IP6, length=128)],
                                destination_ips=[
                                    A.Address(address=IP1, length=32),
                                    A.Address(address=IP1, length=40),
                                ],
                                not_destination_ips=[A.Address(address=bytes([10, 9, 9, 9]), length=8)],
                                destination_ports=[8080],
                                not_destination_ports=[22],
                                service_accounts=[A.ServiceAccountMatch(namespace="ns2", serviceAccount="b")],
                                not_service_accounts=[
                                    A.ServiceAccountMatch(namespace="ns3", serviceAccount="c")
                                ],
                            ),
                            A.Match(),
                        ]
                    ),
                    A.Clause(),
                ]
            ),
            A.Rule(),
        ],
    )


def test_full_authorization_round_trip() -> None:
    pb = A.Authorization.FromString(full_authorization_pb().SerializeToString())
    assert authorization_from_proto(pb) == Authorization(
        name="allow-a",
        namespace="ns1",
        scope=Scope.WORKLOAD_SELECTOR,
        action=Action.DENY,
        dry_run=True,
        rules=(
            Rule(
                clauses=(
                    Clause(
                        matches=(
                            Match(
                                # The StringMatch with no member is dropped, as are undecodable addresses.
                                namespaces=(StringMatch.exact("ns2"),),
                                not_namespaces=(StringMatch.prefix("kube-"),),
                                principals=(StringMatch.suffix("/sa/a"), StringMatch.presence()),
                                not_principals=(StringMatch.exact("td/ns/x/sa/y"),),
                                source_ips=(ipaddress.ip_network("10.1.0.0/16"),),
                                not_source_ips=(ipaddress.ip_network("fd00::7/128"),),
                                destination_ips=(ipaddress.ip_network("10.0.0.1/32"),),
                                not_destination_ips=(ipaddress.ip_network("10.0.0.0/8"),),
                                destination_ports=(8080,),
                                not_destination_ports=(22,),
                                service_accounts=(ServiceAccountMatch(namespace="ns2", service_account="b"),),
                                not_service_accounts=(
                                    ServiceAccountMatch(namespace="ns3", service_account="c"),
                                ),
                            ),
                            Match(),
                        )
                    ),
                    Clause(),
                )
            ),
            Rule(),
        ),
    )


def test_authorization_defaults_are_global_allow() -> None:
    policy = authorization_from_proto(A.Authorization(name="p", namespace="ns"))
    assert (policy.scope, policy.action, policy.rules, policy.key) == (Scope.GLOBAL, Action.ALLOW, (), "ns/p")


@pytest.mark.parametrize(
    "pb, reason",
    [
        (A.Authorization(name="p", namespace="ns", scope=3), "unknown scope value 3"),
        (A.Authorization(name="p", namespace="ns", action=2), "unknown action value 2"),
    ],
)
def test_authorization_rejections(pb: A.Authorization, reason: str) -> None:
    err = rejection(authorization_from_proto, pb)
    assert (err.name, err.reason) == ("ns/p", reason)


# ---------------------------------------------------------------------------- resources


def test_address_from_resource_uses_the_resource_name() -> None:
    value = W.Address(workload=W.Workload(uid="uid-1", addresses=[b"\x01"])).SerializeToString()
    with pytest.raises(XdsRejection) as info:
        address_from_resource("the-name", value)
    assert info.value.name == "the-name"
    service = address_from_resource(
        "ns/h", W.Address(service=W.Service(namespace="ns", hostname="h")).SerializeToString()
    )
    assert isinstance(service, Service) and service.key == "ns/h"


def test_address_with_neither_member_is_rejected() -> None:
    with pytest.raises(XdsRejection, match="unknown address type"):
        address_from_resource("x", b"")


def test_undecodable_payload_is_rejected() -> None:
    with pytest.raises(XdsRejection, match=r"^x: decode: "):
        address_from_resource("x", b"\x0a\xff")
    with pytest.raises(XdsRejection, match=r"^p: decode: "):
        authorization_from_resource("p", b"\x12\x05ab")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_address_parser_returns_a_model_or_rejects(data: bytes) -> None:
    try:
        result = address_from_resource("r", data)
    except XdsRejection as e:
        assert e.name == "r"
    else:
        assert isinstance(result, Workload | Service)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_authorization_parser_returns_a_model_or_rejects(data: bytes) -> None:
    try:
        result = authorization_from_resource("r", data)
    except XdsRejection as e:
        assert e.name == "r"
    else:
        assert isinstance(result, Authorization)


small_enum = st.integers(min_value=0, max_value=6)
ip_bytes = st.binary(min_size=0, max_size=17)


@settings(max_examples=200, deadline=None)
@given(
    addresses=st.lists(ip_bytes, max_size=3),
    tunnel=small_enum,
    mode=small_enum,
    status=small_enum,
    wtype=small_enum,
    keys=st.lists(st.text(max_size=8), max_size=3),
    gw=st.sampled_from(["none", "empty", "address", "hostname"]),
    gw_ip=ip_bytes,
)
def test_structured_workloads_convert_or_reject(
    addresses, tunnel, mode, status, wtype, keys, gw, gw_ip
) -> None:
    pb = W.Workload(
        uid="u",
        namespace="ns",
        addresses=addresses,
        tunnel_protocol=tunnel,
        network_mode=mode,
        status=status,
        workload_type=wtype,
        services={k: W.PortList() for k in keys},
    )
    if gw == "empty":
        pb.waypoint.SetInParent()
    elif gw == "address":
        pb.waypoint.address.address = gw_ip
    elif gw == "hostname":
        pb.waypoint.hostname.hostname = "wp"
    valid = (
        all(len(a) in (4, 16) for a in addresses)
        and tunnel <= 1
        and mode <= 1
        and status <= 1
        and all("/" in k for k in keys)
        and gw != "empty"
        and (gw != "address" or len(gw_ip) in (4, 16))
    )
    if valid:
        assert isinstance(workload_from_proto(pb), Workload)
    else:
        with pytest.raises(XdsRejection):
            workload_from_proto(pb)
