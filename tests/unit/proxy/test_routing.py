"""The outbound decision (`build_request`, docs/istio-behaviour.md, "Outbound (15001)"), without sockets.

Test IPs follow ztunnel's local test config: source 127.0.0.2, HBONE workload 127.0.0.3, TCP
workload 127.0.0.4, waypoint 127.0.0.5, service VIP 127.10.0.1.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest

from ambient_mesh.identity.spiffe import Identity
from ambient_mesh.net import SocketAddr, ip_address
from ambient_mesh.proxy.routing import Route, RouteKind, RouteRefused, build_request
from ambient_mesh.state.model import (
    ApplicationTunnel,
    GatewayAddress,
    HealthPolicy,
    IpFamilies,
    LoadBalancing,
    LoadBalancingMode,
    NamespacedHostname,
    NetworkAddress,
    Service,
    TunnelProtocol,
    Visibility,
    WeightedWaypoint,
    Workload,
    WorkloadStatus,
)
from ambient_mesh.state.store import ProxyState
from tests.helpers.state_writes import load

NODE = "local"
ILLEGAL_PORTS = frozenset({15001, 15006, 15008, 15080, 15000, 15020, 15021})
SVC_HOST = "local-vip.default.svc.cluster.local"
SVC_KEY = f"default/{SVC_HOST}"
WP_HOST = "waypoint.default.svc.cluster.local"


def addr(text: str) -> SocketAddr:
    return SocketAddr.parse(text)


def wl(name: str, *ips: str, protocol: TunnelProtocol = TunnelProtocol.TCP, **kwargs) -> Workload:
    kwargs.setdefault("namespace", "default")
    kwargs.setdefault("node", NODE)
    return Workload(
        uid=f"cluster1//Pod/{kwargs['namespace']}/{name}",
        name=name,
        workload_ips=tuple(ip_address(ip) for ip in ips),
        protocol=protocol,
        trust_domain="cluster.local",
        service_account=name,
        **kwargs,
    )


def svc(name: str = "local-vip", *vips: str, namespace: str = "default", **kwargs) -> Service:
    kwargs.setdefault("ports", {80: 8080})
    return Service(
        name=name,
        namespace=namespace,
        hostname=kwargs.pop("hostname", f"{name}.{namespace}.svc.cluster.local"),
        vips=tuple(NetworkAddress(network="", address=ip_address(v)) for v in (vips or ("127.10.0.1",))),
        **kwargs,
    )


SOURCE = wl("source", "127.0.0.2")
HBONE = wl("hbone", "127.0.0.3", protocol=TunnelProtocol.HBONE, services={SVC_KEY: {}})
TCP = wl("tcp", "127.0.0.4")
WAYPOINT = wl("waypoint", "127.0.0.5", protocol=TunnelProtocol.HBONE, services={f"default/{WP_HOST}": {}})
WP_BY_IP = GatewayAddress(destination=NetworkAddress(network="", address=ip_address("127.0.0.5")))
WP_BY_HOST = GatewayAddress(destination=NamespacedHostname(namespace="default", hostname=WP_HOST))


def make_state(workloads=(), services=()) -> ProxyState:
    state = ProxyState()
    load(state, [SOURCE, *workloads], services)
    return state


def route(
    state: ProxyState,
    target: str,
    *,
    source: Workload = SOURCE,
    network: str = "",
    seed: int = 1,
    illegal_ports: frozenset[int] = ILLEGAL_PORTS,
    self_ips: frozenset = frozenset(),
):
    return build_request(
        state,
        source,
        addr(target),
        network=network,
        node=NODE,
        illegal_ports=illegal_ports,
        self_ips=self_ips,
        rng=random.Random(seed),
    )


def identity(name: str, namespace: str = "default") -> Identity:
    return Identity("cluster.local", namespace, name)


def ok(result: Route | RouteRefused) -> Route:
    assert isinstance(result, Route), result
    return result


def refused(result: Route | RouteRefused) -> RouteRefused:
    assert isinstance(result, RouteRefused), result
    return result


# -- step 1: illegal ports ----------------------------------------------------------------------


@pytest.mark.parametrize("target", ["127.0.0.1:15001", "127.0.0.1:15008", "127.0.0.2:15006", "[::1]:15001"])
def test_loopback_to_illegal_port_is_refused(target: str) -> None:
    result = refused(route(make_state(), target))
    assert result.reason.startswith(f"self call to {target} refused: port ")
    assert result.response_flag == "CONNECT"
    assert result.self_call


def test_illegal_port_only_matters_on_the_proxys_own_addresses() -> None:
    assert ok(route(make_state(), "10.0.0.1:15001")).kind is RouteKind.PASSTHROUGH
    assert ok(route(make_state(), "127.0.0.1:8080")).kind is RouteKind.PASSTHROUGH


@pytest.mark.parametrize("target", ["0.0.0.0:15008", "0.0.0.0:8080", "[::]:15001", "[::]:80", "0.0.0.0:0"])
def test_unspecified_address_is_a_self_call_on_any_port(target: str) -> None:
    # connect() to 0.0.0.0 or :: reaches this host: SOCKS5 to 0.0.0.0:15008 reached our own HBONE
    # listener before.
    result = refused(route(make_state(), target))
    assert result.self_call
    assert "unspecified address" in result.reason and "real address" in result.reason
    assert result.response_flag == "CONNECT"


def test_the_workloads_own_address_on_a_proxy_port_is_a_self_call() -> None:
    source = wl("source", "10.1.0.7")
    result = refused(route(make_state(), "10.1.0.7:15008", source=source))
    assert result.self_call
    # Its own address on an application port is just a call to itself.
    assert ok(route(make_state(), "10.1.0.7:8080", source=source)).kind is RouteKind.PASSTHROUGH


def test_listener_addresses_and_ports_are_the_proxys_own() -> None:
    own_ip = frozenset({ip_address("10.9.9.9")})
    ports = ILLEGAL_PORTS | {40123}  # a listener bound to port 0 got 40123
    assert refused(route(make_state(), "10.9.9.9:40123", illegal_ports=ports, self_ips=own_ip)).self_call
    assert refused(route(make_state(), "127.0.0.1:40123", illegal_ports=ports)).self_call
    assert ok(route(make_state(), "10.9.9.8:40123", illegal_ports=ports, self_ips=own_ip))


# -- direct to a workload -----------------------------------------------------------------------


def test_workload_ip_hbone() -> None:
    r = ok(route(make_state([HBONE]), "127.0.0.3:8080"))
    assert r.kind is RouteKind.DIRECT_HBONE
    assert r.actual_destination == addr("127.0.0.3:15008")
    assert r.hbone_target == addr("127.0.0.3:8080")
    assert r.upstream_sans == (identity("hbone"),)
    assert r.destination_workload == HBONE and r.destination_service is None
    assert r.source_workload == SOURCE and r.same_node is True


def test_workload_ip_tcp_keeps_port() -> None:
    r = ok(route(make_state([TCP]), "127.0.0.4:9000"))
    assert r.kind is RouteKind.DIRECT_TCP
    assert r.actual_destination == addr("127.0.0.4:9000")
    assert r.hbone_target is None and r.upstream_sans == ()
    assert r.destination_workload == TCP


def test_other_node_is_not_same_node() -> None:
    remote = dataclasses.replace(TCP, node="elsewhere")
    assert ok(route(make_state([remote]), "127.0.0.4:9000")).same_node is False


def test_unknown_ip_is_passthrough() -> None:
    r = ok(route(make_state([HBONE]), "10.1.1.1:443"))
    assert r.kind is RouteKind.PASSTHROUGH
    assert r.actual_destination == addr("10.1.1.1:443")
    assert r.hbone_target is None and r.upstream_sans == ()
    assert r.destination_workload is None and r.destination_service is None


def test_workload_on_another_network_is_not_found_by_ip() -> None:
    remote = dataclasses.replace(TCP, network="net2")
    assert ok(route(make_state([remote]), "127.0.0.4:80")).kind is RouteKind.PASSTHROUGH


# -- service VIPs -------------------------------------------------------------------------------


def test_vip_to_hbone_endpoint_with_sans() -> None:
    service = svc(
        subject_alt_names=(
            "spiffe://cluster.local/ns/default/sa/extra",
            "not-spiffe",
            "spiffe://cluster.local/ns/default/sa/hbone",
        )
    )
    r = ok(route(make_state([HBONE], [service]), "127.10.0.1:80"))
    assert r.kind is RouteKind.DIRECT_HBONE
    assert r.actual_destination == addr("127.0.0.3:15008")
    assert r.hbone_target == addr("127.0.0.3:8080")
    assert r.upstream_sans == (identity("hbone"), identity("extra"))
    assert r.destination_service is not None and r.destination_service.key == SVC_KEY
    assert r.destination_workload == HBONE


def test_vip_to_tcp_endpoint() -> None:
    tcp = dataclasses.replace(TCP, services={SVC_KEY: {80: 9999}})
    r = ok(route(make_state([tcp], [svc()]), "127.10.0.1:80"))
    assert r.kind is RouteKind.DIRECT_TCP
    assert r.actual_destination == addr("127.0.0.4:9999")
    assert r.upstream_sans == ()


def test_passthrough_service_keeps_original_destination() -> None:
    service = svc(load_balancer=LoadBalancing(mode=LoadBalancingMode.PASSTHROUGH))
    r = ok(route(make_state([HBONE], [service]), "127.10.0.1:80"))
    assert r.kind is RouteKind.PASSTHROUGH
    assert r.actual_destination == addr("127.10.0.1:80")
    assert r.destination_service is not None and r.destination_workload is None


def test_service_without_endpoints_is_no_healthy_upstream() -> None:
    result = refused(route(make_state([], [svc()]), "127.10.0.1:80"))
    assert result.reason == f"no healthy upstream for {SVC_KEY}:80"
    # A port the service does not map is the same failure.
    assert refused(route(make_state([HBONE], [svc()]), "127.10.0.1:81")).reason.endswith(":81")


def test_unhealthy_endpoint_only_with_allow_all() -> None:
    sick = dataclasses.replace(HBONE, status=WorkloadStatus.UNHEALTHY)
    assert isinstance(route(make_state([sick], [svc()]), "127.10.0.1:80"), RouteRefused)
    allow_all = svc(load_balancer=LoadBalancing(health_policy=HealthPolicy.ALLOW_ALL))
    assert ok(route(make_state([sick], [allow_all]), "127.10.0.1:80")).destination_workload == sick


def test_vip_prefers_service_in_source_namespace() -> None:
    mine = svc("mine", "127.10.0.9")
    theirs = svc("theirs", "127.10.0.9", namespace="other", canonical=True)
    backend_mine = wl("m", "127.0.0.6", services={mine.key: {}})
    backend_theirs = wl("t", "127.0.0.7", namespace="other", services={theirs.key: {}})
    state = make_state([backend_mine, backend_theirs], [theirs, mine])
    assert ok(route(state, "127.10.0.9:80")).destination_workload == backend_mine
    outsider = wl("outsider", "127.0.0.8", namespace="third")
    assert ok(route(state, "127.10.0.9:80", source=outsider)).destination_workload == backend_theirs


def test_namespace_visible_service_is_invisible_to_other_namespaces() -> None:
    service = svc(visibility=Visibility.NAMESPACE)
    state = make_state([HBONE], [service])
    assert ok(route(state, "127.10.0.1:80")).kind is RouteKind.DIRECT_HBONE
    outsider = wl("outsider", "127.0.0.8", namespace="third")
    assert ok(route(state, "127.10.0.1:80", source=outsider)).kind is RouteKind.PASSTHROUGH


def test_service_endpoint_on_another_network_is_refused() -> None:
    remote = wl("remote", "10.9.0.1", network="net2", services={SVC_KEY: {}})
    result = refused(route(make_state([remote], [svc()]), "127.10.0.1:80"))
    assert "multi-network" in result.reason and "net2" in result.reason


def test_hostname_only_endpoint_is_refused() -> None:
    dns = wl("dns", hostname="db.example.com", services={SVC_KEY: {}})
    result = refused(route(make_state([dns], [svc()]), "127.10.0.1:80"))
    assert "hostname workloads not supported yet" in result.reason


# -- IP selection -------------------------------------------------------------------------------


def test_ip_selection_prefers_request_family() -> None:
    dual = wl("dual", "127.0.0.3", "fd00::3", services={SVC_KEY: {}})
    service = svc("local-vip", "127.10.0.1", "fd00:10::1", ip_families=IpFamilies.DUAL)
    state = make_state([dual], [service])
    assert ok(route(state, "127.10.0.1:80")).actual_destination == addr("127.0.0.3:8080")
    assert ok(route(state, "[fd00:10::1]:80")).actual_destination == addr("[fd00::3]:8080")


def test_ip_selection_exact_ip_wins_and_families_are_honoured() -> None:
    dual = wl("dual", "127.0.0.3", "fd00::3", "127.0.0.13", services={SVC_KEY: {}})
    assert ok(route(make_state([dual]), "[fd00::3]:7")).actual_destination == addr("[fd00::3]:7")
    assert ok(route(make_state([dual]), "127.0.0.13:7")).actual_destination == addr("127.0.0.13:7")
    v4_only = svc("local-vip", "127.10.0.1", "fd00:10::1", ip_families=IpFamilies.IPV4_ONLY)
    r = ok(route(make_state([dual], [v4_only]), "[fd00:10::1]:80"))
    assert r.actual_destination == addr("127.0.0.3:8080")
    v6_only_backend = wl("v6", "fd00::4", services={SVC_KEY: {}})
    result = refused(route(make_state([v6_only_backend], [v4_only]), "127.10.0.1:80"))
    assert "no IP usable" in result.reason


# -- service waypoints --------------------------------------------------------------------------


def test_service_waypoint_by_workload_ip() -> None:
    service = svc(waypoint=WP_BY_IP)
    r = ok(route(make_state([HBONE, WAYPOINT], [service]), "127.10.0.1:80"))
    assert r.kind is RouteKind.WAYPOINT
    assert r.actual_destination == addr("127.0.0.5:15008")
    assert r.hbone_target == addr("127.10.0.1:80")  # the waypoint sees what the client asked for
    assert r.upstream_sans == (identity("waypoint"),)
    assert r.destination_workload == WAYPOINT
    assert r.destination_service is not None and r.destination_service.key == SVC_KEY


def test_service_waypoint_by_hostname_with_port_and_sans() -> None:
    gateway = dataclasses.replace(WP_BY_HOST, hbone_mtls_port=15009)
    waypoint_svc = svc(
        "waypoint",
        "127.10.0.5",
        ports={15009: 15009},
        subject_alt_names=("spiffe://cluster.local/ns/default/sa/waypoint-extra",),
    )
    waypoint = dataclasses.replace(WAYPOINT, services={waypoint_svc.key: {}})
    r = ok(route(make_state([HBONE, waypoint], [svc(waypoint=gateway), waypoint_svc]), "127.10.0.1:80"))
    assert r.kind is RouteKind.WAYPOINT
    assert r.actual_destination == addr("127.0.0.5:15009")
    assert r.hbone_target == addr("127.10.0.1:80")
    assert r.upstream_sans == (identity("waypoint"), identity("waypoint-extra"))


def test_service_waypoint_by_waypoint_service_vip() -> None:
    waypoint_svc = svc("waypoint", "127.10.0.5", ports={15008: 15008})
    waypoint = dataclasses.replace(WAYPOINT, workload_ips=(ip_address("127.0.0.15"),))
    gateway = GatewayAddress(destination=NetworkAddress(network="", address=ip_address("127.10.0.5")))
    r = ok(route(make_state([HBONE, waypoint], [svc(waypoint=gateway), waypoint_svc]), "127.10.0.1:80"))
    assert r.kind is RouteKind.WAYPOINT
    assert r.actual_destination == addr("127.0.0.15:15008")


def test_service_waypoint_with_app_tunnel_ignores_port_map() -> None:
    waypoint_svc = svc("waypoint", "127.10.0.5", ports={})
    waypoint = dataclasses.replace(WAYPOINT, application_tunnel=ApplicationTunnel())
    r = ok(route(make_state([HBONE, waypoint], [svc(waypoint=WP_BY_HOST), waypoint_svc]), "127.10.0.1:80"))
    assert r.actual_destination == addr("127.0.0.5:15008")


def test_service_waypoint_missing_is_refused() -> None:
    result = refused(route(make_state([HBONE], [svc(waypoint=WP_BY_IP)]), "127.10.0.1:80"))
    assert result.reason == "waypoint /127.0.0.5 not found"
    result = refused(route(make_state([HBONE], [svc(waypoint=WP_BY_HOST)]), "127.10.0.1:80"))
    assert result.reason == f"waypoint default/{WP_HOST} not found"
    empty_waypoint_svc = svc("waypoint", "127.10.0.5", ports={15008: 15008})
    result = refused(
        route(make_state([HBONE], [svc(waypoint=WP_BY_HOST), empty_waypoint_svc]), "127.10.0.1:80")
    )
    assert result.reason == f"no healthy upstream for waypoint default/{WP_HOST}"


def test_service_waypoint_on_another_network_is_refused() -> None:
    gateway = GatewayAddress(destination=NetworkAddress(network="net2", address=ip_address("10.9.0.5")))
    remote_wp = wl("waypoint", "10.9.0.5", network="net2")
    result = refused(route(make_state([HBONE, remote_wp], [svc(waypoint=gateway)]), "127.10.0.1:80"))
    assert "multi-network" in result.reason


def test_weighted_waypoints_sampled_and_zero_weights_fall_back() -> None:
    wp2 = wl("waypoint2", "127.0.0.6", protocol=TunnelProtocol.HBONE)
    wp2_gateway = GatewayAddress(destination=NetworkAddress(network="", address=ip_address("127.0.0.6")))
    weighted = (
        WeightedWaypoint(destination=WP_BY_IP, weight=1),
        WeightedWaypoint(destination=wp2_gateway, weight=3),
    )
    state = make_state([HBONE, WAYPOINT, wp2], [svc(weighted_waypoints=weighted)])
    rng = random.Random(3)
    counts: Counter[str] = Counter()
    for _ in range(2000):
        r = ok(
            build_request(
                state,
                SOURCE,
                addr("127.10.0.1:80"),
                network="",
                node=NODE,
                illegal_ports=ILLEGAL_PORTS,
                rng=rng,
            )
        )
        assert r.kind is RouteKind.WAYPOINT
        counts[str(r.actual_destination)] += 1
    assert 400 < counts["127.0.0.5:15008"] < 600
    assert 1400 < counts["127.0.0.6:15008"] < 1600
    zero = tuple(dataclasses.replace(w, weight=0) for w in weighted)
    state = make_state([HBONE, WAYPOINT, wp2], [svc(weighted_waypoints=zero, waypoint=WP_BY_IP)])
    assert ok(route(state, "127.10.0.1:80")).actual_destination == addr("127.0.0.5:15008")
    state = make_state([HBONE, WAYPOINT, wp2], [svc(weighted_waypoints=zero)])
    assert ok(route(state, "127.10.0.1:80")).kind is RouteKind.DIRECT_HBONE


# -- workload waypoints -------------------------------------------------------------------------


def test_workload_waypoint_for_workload_addressed_traffic() -> None:
    behind = dataclasses.replace(HBONE, waypoint=WP_BY_IP)
    r = ok(route(make_state([behind, WAYPOINT]), "127.0.0.3:8080"))
    assert r.kind is RouteKind.WAYPOINT
    assert r.actual_destination == addr("127.0.0.5:15008")
    assert r.hbone_target == addr("127.0.0.3:8080")
    assert r.upstream_sans == (identity("waypoint"),)
    assert r.destination_workload == WAYPOINT and r.destination_service is None


def test_workload_waypoint_skipped_when_the_waypoint_is_calling() -> None:
    behind = dataclasses.replace(HBONE, waypoint=WP_BY_IP)
    state = make_state([behind, WAYPOINT])
    r = ok(route(state, "127.0.0.3:8080", source=WAYPOINT))
    assert r.kind is RouteKind.DIRECT_HBONE and r.destination_workload == behind
    # Same identity from another IP is not the waypoint: identity and IP must both agree.
    impostor = dataclasses.replace(
        WAYPOINT, uid="cluster1//Pod/default/impostor", workload_ips=(ip_address("127.0.0.9"),)
    )
    assert ok(route(state, "127.0.0.3:8080", source=impostor)).kind is RouteKind.WAYPOINT


def test_workload_waypoint_by_hostname_recognises_caller_among_endpoints() -> None:
    behind = dataclasses.replace(HBONE, waypoint=WP_BY_HOST)
    waypoint_svc = svc("waypoint", "127.10.0.5", ports={15008: 15008})
    state = make_state([behind, WAYPOINT], [waypoint_svc])
    assert ok(route(state, "127.0.0.3:8080")).kind is RouteKind.WAYPOINT
    assert ok(route(state, "127.0.0.3:8080", source=WAYPOINT)).kind is RouteKind.DIRECT_HBONE


def test_workload_waypoint_not_used_for_service_addressed_traffic() -> None:
    behind = dataclasses.replace(HBONE, waypoint=WP_BY_IP)
    r = ok(route(make_state([behind, WAYPOINT], [svc()]), "127.10.0.1:80"))
    assert r.kind is RouteKind.DIRECT_HBONE and r.destination_workload == behind


def test_workload_waypoint_missing_is_refused() -> None:
    behind = dataclasses.replace(HBONE, waypoint=WP_BY_IP)
    assert refused(route(make_state([behind]), "127.0.0.3:8080")).reason == "waypoint /127.0.0.5 not found"


# -- repeatable routes (kept by outbound.py per state version) ----------------------------------


def test_repeatable_routes_are_the_ones_no_choice_went_into() -> None:
    """`Route.repeatable`: the same state, source and target give the same route whatever the
    random choices; set for a workload addressed directly, never where a choice was made (a
    service's endpoints, weighted or load-balanced waypoints)."""
    second = wl("hbone-2", "127.0.0.6", protocol=TunnelProtocol.HBONE, services={SVC_KEY: {}})
    waypoint_2 = dataclasses.replace(
        WAYPOINT, uid="cluster1//Pod/default/waypoint-2", workload_ips=(ip_address("127.0.0.7"),)
    )
    waypoint_svc = svc("waypoint", "127.10.0.5", ports={15008: 15008})
    cases = [
        ("workload, HBONE", make_state([HBONE]), "127.0.0.3:8080", True),
        ("workload, TCP", make_state([TCP]), "127.0.0.4:9000", True),
        ("service, two endpoints", make_state([HBONE, second], [svc()]), "127.10.0.1:80", False),
        (
            "workload behind a waypoint service with two endpoints",
            make_state(
                [dataclasses.replace(HBONE, waypoint=WP_BY_HOST), WAYPOINT, waypoint_2], [waypoint_svc]
            ),
            "127.0.0.3:8080",
            False,
        ),
        ("service waypoint", make_state([HBONE, WAYPOINT], [svc(waypoint=WP_BY_IP)]), "127.10.0.1:80", False),
    ]
    for name, state, target, repeatable in cases:
        routes = [ok(route(state, target, seed=seed)) for seed in range(40)]
        assert {r.repeatable for r in routes} == {repeatable}, name
        if repeatable:
            assert all(r == routes[0] for r in routes), name
        else:
            # Where a choice was made, it shows: some seeds chose otherwise (or the route is
            # through a waypoint, which outbound.py never keeps either).
            assert len({r.actual_destination for r in routes}) > 1 or routes[0].kind is RouteKind.WAYPOINT, (
                name
            )
