"""Endpoint selection (docs/istio-behaviour.md, "Load balancing"): candidates, port mapping, STRICT and
FAILOVER locality ranking with the NETWORK gate, and weighted random choice by capacity."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from ambient_mesh.net import ip_address
from ambient_mesh.state.model import (
    ApplicationTunnel,
    AppTunnelProtocol,
    Endpoint,
    GatewayAddress,
    LoadBalancing,
    LoadBalancingMode,
    LoadBalancingScope,
    Locality,
    NamespacedHostname,
    NetworkAddress,
    Service,
    Workload,
)
from ambient_mesh.state.store import ProxyState, load_balance, locality_rank, target_port
from tests.helpers.state_writes import load

SVC_KEY = "default/echo.default.svc.cluster.local"
R, Z, SZ, N, C, NET = (
    LoadBalancingScope.REGION,
    LoadBalancingScope.ZONE,
    LoadBalancingScope.SUBZONE,
    LoadBalancingScope.NODE,
    LoadBalancingScope.CLUSTER,
    LoadBalancingScope.NETWORK,
)

SOURCE = Workload(
    uid="src",
    name="src",
    namespace="default",
    workload_ips=(ip_address("127.0.0.2"),),
    node="node-a",
    cluster_id="c1",
    locality=Locality(region="r1", zone="z1", subzone="s1"),
)


def backend(name: str, ip: str = "10.0.0.1", *, ports: dict[int, int] | None = None, **kwargs) -> Workload:
    return Workload(
        uid=name,
        name=name,
        namespace="default",
        workload_ips=(ip_address(ip),) if ip else (),
        services={SVC_KEY: ports if ports is not None else {}},
        **kwargs,
    )


def make_state(*backends: Workload, **service_kwargs) -> tuple[ProxyState, Service]:
    state = ProxyState()
    service_kwargs.setdefault("ports", {80: 8080})
    load(
        state,
        backends,
        [
            Service(
                name="echo",
                namespace="default",
                hostname="echo.default.svc.cluster.local",
                vips=(NetworkAddress(network="", address=ip_address("127.10.0.1")),),
                **service_kwargs,
            )
        ],
        [],
    )
    svc = state.services.get(SVC_KEY)
    assert svc is not None
    return state, svc


def pick(state: ProxyState, svc: Service, *, seed: int = 1, port: int = 80, **kwargs):
    return load_balance(state, svc, SOURCE, port=port, node="node-a", rng=random.Random(seed), **kwargs)


def picks(state: ProxyState, svc: Service, count: int = 400) -> Counter[str]:
    rng = random.Random(7)
    result: Counter[str] = Counter()
    for _ in range(count):
        upstream = load_balance(state, svc, SOURCE, port=80, node="node-a", rng=rng)
        assert upstream is not None
        result[upstream.workload.uid] += 1
    return result


# -- candidates and ports ------------------------------------------------------------------------


def test_standard_mode_uses_every_candidate() -> None:
    state, svc = make_state(backend("a", "10.0.0.1"), backend("b", "10.0.0.2"), backend("c", "10.0.0.3"))
    assert set(picks(state, svc)) == {"a", "b", "c"}


def test_same_seed_same_choice() -> None:
    state, svc = make_state(*(backend(f"w{i}", f"10.0.0.{i + 1}") for i in range(10)))
    assert pick(state, svc, seed=42) == pick(state, svc, seed=42)


def test_target_port_endpoint_map_first_then_service_map() -> None:
    state, svc = make_state(backend("a", ports={80: 9090}))
    upstream = pick(state, svc)
    assert upstream is not None and upstream.port == 9090
    state, svc = make_state(backend("a"))
    upstream = pick(state, svc)
    assert upstream is not None and upstream.port == 8080


def test_unmapped_port_has_no_candidate() -> None:
    state, svc = make_state(backend("a"))
    assert pick(state, svc, port=81) is None
    # A zero target port means "named port": only the endpoint's own map can resolve it.
    state, svc = make_state(backend("a"), backend("b", "10.0.0.2", ports={80: 7070}), ports={80: 0})
    upstream = pick(state, svc)
    assert upstream is not None and (upstream.workload.uid, upstream.port) == ("b", 7070)


def test_application_tunnel_keeps_service_port() -> None:
    tunnel = ApplicationTunnel(protocol=AppTunnelProtocol.PROXY, port=15088)
    state, svc = make_state(backend("a", application_tunnel=tunnel), ports={80: 0})
    upstream = pick(state, svc)
    assert upstream is not None and upstream.port == 80


def test_target_port_helper() -> None:
    svc = Service(name="s", namespace="n", hostname="h", ports={80: 8080, 81: 0})
    wl = backend("a")
    assert target_port(svc, Endpoint(workload_uid="a", port={80: 1}), wl, 80) == 1
    assert target_port(svc, Endpoint(workload_uid="a"), wl, 80) == 8080
    assert target_port(svc, Endpoint(workload_uid="a"), wl, 81) is None
    assert target_port(svc, Endpoint(workload_uid="a"), wl, 82) is None


def test_waypoint_resolution_skips_port_check_for_app_tunnel() -> None:
    tunnel = ApplicationTunnel(protocol=AppTunnelProtocol.NONE)
    state, svc = make_state(backend("wp", application_tunnel=tunnel), ports={})
    assert pick(state, svc, port=15008) is None
    upstream = pick(state, svc, port=15008, for_waypoint=True)
    assert upstream is not None and upstream.port == 15008


def test_missing_workload_and_addressless_workloads_are_skipped() -> None:
    state, svc = make_state(
        backend("noip", ""),
        endpoints={"ghost": Endpoint(workload_uid="ghost")},
    )
    assert set(svc.endpoints) == {"ghost", "noip"}
    assert pick(state, svc) is None


def test_addressless_workload_behind_remote_gateway_is_a_candidate() -> None:
    gateway = GatewayAddress(destination=NamespacedHostname(namespace="istio-system", hostname="ew.example"))
    state, svc = make_state(backend("remote", "", network="net2", network_gateway=gateway))
    upstream = pick(state, svc)
    assert upstream is not None and upstream.workload.uid == "remote"


# -- weights -------------------------------------------------------------------------------------


def test_capacity_weights_spread() -> None:
    state, svc = make_state(backend("small", "10.0.0.1", capacity=1), backend("big", "10.0.0.2", capacity=3))
    counts = picks(state, svc, count=4000)
    # Expected 1000 / 3000; the seed is fixed, the bounds are wide.
    assert 800 < counts["small"] < 1200
    assert 2800 < counts["big"] < 3200


def test_zero_capacity_never_chosen_unless_all_zero() -> None:
    state, svc = make_state(backend("zero", "10.0.0.1", capacity=0), backend("one", "10.0.0.2"))
    assert set(picks(state, svc)) == {"one"}
    state, svc = make_state(backend("a", "10.0.0.1", capacity=0), backend("b", "10.0.0.2", capacity=0))
    assert set(picks(state, svc)) == {"a", "b"}


# -- locality ranking ----------------------------------------------------------------------------


def near(name: str, ip: str, *, region="r1", zone="z1", subzone="s1", **kwargs) -> Workload:
    return backend(name, ip, locality=Locality(region=region, zone=zone, subzone=subzone), **kwargs)


def test_locality_rank_counts_leading_matches_only() -> None:
    same_region_other_zone = near("x", "10.0.0.1", zone="z2")
    assert locality_rank((R, Z, SZ), SOURCE, same_region_other_zone, "node-a") == 1
    assert locality_rank((Z, R), SOURCE, same_region_other_zone, "node-a") == 0
    assert locality_rank((R, SZ), SOURCE, near("y", "10.0.0.1", zone="z2"), "node-a") == 2
    assert locality_rank((), SOURCE, same_region_other_zone, "node-a") == 0


def test_network_first_is_a_gate() -> None:
    local = near("l", "10.0.0.1", region="r9")
    remote = near("r", "10.0.0.2", network="net2")
    prefs = (NET, R, Z)
    assert locality_rank(prefs, SOURCE, local, "node-a") == 1 + 2
    assert locality_rank(prefs, SOURCE, near("m", "10.0.0.3"), "node-a") == 3 + 2
    assert locality_rank(prefs, SOURCE, remote, "node-a") == 0
    assert locality_rank((R, NET), SOURCE, near("m", "10.0.0.3"), "node-a") == 2


def test_node_and_cluster_scopes() -> None:
    other_node = near("n2", "10.0.0.1", node="node-b", cluster_id="c1")
    assert locality_rank((C, N), SOURCE, other_node, "node-a") == 1
    assert (
        locality_rank((C, N), SOURCE, near("n1", "10.0.0.2", node="node-a", cluster_id="c1"), "node-a") == 2
    )
    # Without a node on the source workload, the proxy's own node stands in.
    anonymous = Workload(uid="s", namespace="default")
    assert locality_rank((N,), anonymous, near("n1", "10.0.0.2", node="node-a"), "node-a") == 1


def failover(mode: LoadBalancingMode, prefs: tuple[LoadBalancingScope, ...]) -> LoadBalancing:
    return LoadBalancing(routing_preferences=prefs, mode=mode)


def test_failover_keeps_only_the_best_rank_and_falls_back() -> None:
    same_zone = near("same-zone", "10.0.0.1")
    same_region = near("same-region", "10.0.0.2", zone="z2")
    far = near("far", "10.0.0.3", region="r2")
    lb = failover(LoadBalancingMode.FAILOVER, (R, Z))
    state, svc = make_state(same_zone, same_region, far, load_balancer=lb)
    assert set(picks(state, svc)) == {"same-zone"}
    state, svc = make_state(same_region, far, load_balancer=lb)
    assert set(picks(state, svc)) == {"same-region"}
    state, svc = make_state(far, load_balancer=lb)
    assert set(picks(state, svc)) == {"far"}


def test_strict_drops_partial_matches() -> None:
    lb = failover(LoadBalancingMode.STRICT, (R, Z))
    state, svc = make_state(
        near("same-zone", "10.0.0.1"), near("same-region", "10.0.0.2", zone="z2"), load_balancer=lb
    )
    assert set(picks(state, svc)) == {"same-zone"}
    state, svc = make_state(near("same-region", "10.0.0.2", zone="z2"), load_balancer=lb)
    assert pick(state, svc) is None


def test_strict_with_network_gate() -> None:
    lb = failover(LoadBalancingMode.STRICT, (NET, R))
    state, svc = make_state(
        near("local", "10.0.0.1"), near("remote", "10.0.0.2", network="net2"), load_balancer=lb
    )
    assert set(picks(state, svc)) == {"local"}


@pytest.mark.parametrize("mode", [LoadBalancingMode.STANDARD, LoadBalancingMode.FAILOVER])
def test_empty_preferences_rank_everyone_equal(mode: LoadBalancingMode) -> None:
    state, svc = make_state(
        near("a", "10.0.0.1"), near("b", "10.0.0.2", region="r2"), load_balancer=failover(mode, ())
    )
    assert set(picks(state, svc)) == {"a", "b"}
