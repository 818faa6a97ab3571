"""ProxyState, WorkloadStore and ServiceStore: indexes, staging, health policy, VIP and hostname ranking,
visibility, versions and listeners (docs/istio-behaviour.md, "Workloads and services")."""

from __future__ import annotations

import ipaddress

from ambient_mesh.identity.spiffe import Identity
from ambient_mesh.net import ip_address
from ambient_mesh.rbac import Authorization, Scope
from ambient_mesh.state.model import (
    Endpoint,
    HealthPolicy,
    LoadBalancing,
    NetworkAddress,
    NetworkMode,
    Service,
    TunnelProtocol,
    Visibility,
    Workload,
    WorkloadStatus,
)
from ambient_mesh.state.store import ProxyState, ServiceStore, WorkloadStore
from tests.helpers.state_writes import load, remove, upsert

SVC_KEY = "default/echo.default.svc.cluster.local"


def workload(name: str, ip: str | None = None, *, namespace: str = "default", **kwargs) -> Workload:
    kwargs.setdefault("uid", f"Kubernetes//Pod/{namespace}/{name}")
    ips = (ip_address(ip),) if ip else ()
    return Workload(name=name, namespace=namespace, workload_ips=ips, service_account=name, **kwargs)


def service(
    name: str = "echo", namespace: str = "default", *, vips: tuple[str, ...] = ("10.96.0.1",), **kwargs
) -> Service:
    return Service(
        name=name,
        namespace=namespace,
        hostname=kwargs.pop("hostname", f"{name}.{namespace}.svc.cluster.local"),
        vips=tuple(NetworkAddress(network="", address=ip_address(v)) for v in vips),
        ports=kwargs.pop("ports", {80: 8080}),
        **kwargs,
    )


# -- WorkloadStore -------------------------------------------------------------------------------


def test_workload_insert_replaces_same_uid_and_reindexes() -> None:
    store = WorkloadStore()
    store.insert(workload("a", "10.0.0.1"))
    replaced = store.insert(workload("a", "10.0.0.2"))
    assert replaced is not None and replaced.workload_ips == (ip_address("10.0.0.1"),)
    assert store.find_address("", ip_address("10.0.0.1")) is None
    found = store.find_address("", ip_address("10.0.0.2"))
    assert found is not None and found.name == "a"
    assert len(store) == 1
    assert repr(store) == "<WorkloadStore: 1 workloads, 1 addresses>"


def test_workload_remove_clears_every_index() -> None:
    store = WorkloadStore()
    wl = workload("a", "10.0.0.1")
    store.insert(wl)
    assert store.remove(wl.uid) == wl
    assert store.remove(wl.uid) is None
    assert store.find_uid(wl.uid) is None
    assert store.find_address("", ip_address("10.0.0.1")) is None
    assert store.find_by_identity(wl.identity) == []
    assert store.find_by_name("default", "a") == []
    assert repr(store) == "<WorkloadStore: 0 workloads, 0 addresses>"


def test_address_lookup_is_per_network() -> None:
    store = WorkloadStore()
    store.insert(workload("a", "10.0.0.1", network="net1"))
    assert store.find_address("", ip_address("10.0.0.1")) is None
    assert store.find_address("net1", ip_address("10.0.0.1")) is not None


def test_host_network_workloads_are_not_indexed_by_ip() -> None:
    store = WorkloadStore()
    store.insert(workload("host", "10.0.0.1", network_mode=NetworkMode.HOST_NETWORK))
    assert store.find_address("", ip_address("10.0.0.1")) is None
    assert store.find_uid("Kubernetes//Pod/default/host") is not None


def test_shared_ip_prefers_pod_then_hbone() -> None:
    store = WorkloadStore()
    entry = workload("vm", "10.0.0.1", uid="Kubernetes/networking.istio.io/WorkloadEntry/default/vm")
    tcp_pod = workload("tcp", "10.0.0.1")
    hbone_pod = workload("hbone", "10.0.0.1", protocol=TunnelProtocol.HBONE)
    store.insert(entry)
    assert store.find_address("", ip_address("10.0.0.1")) == entry
    store.insert(tcp_pod)
    assert store.find_address("", ip_address("10.0.0.1")) == tcp_pod
    store.insert(hbone_pod)
    assert store.find_address("", ip_address("10.0.0.1")) == hbone_pod
    store.remove(hbone_pod.uid)
    assert store.find_address("", ip_address("10.0.0.1")) == tcp_pod


def test_find_by_identity_and_name_and_iteration_order() -> None:
    store = WorkloadStore()
    b = workload("b", "10.0.0.2")
    a1 = workload("a", "10.0.0.1", uid="z/a1")
    a2 = workload("a", "10.0.0.3", uid="c/a2")
    for wl in (b, a1, a2):
        store.insert(wl)
    identity = Identity.parse("spiffe://cluster.local/ns/default/sa/a")
    assert store.find_by_identity(identity) == [a2, a1]
    assert store.find_by_name("default", "a") == [a2, a1]
    assert [w.uid for w in store] == ["Kubernetes//Pod/default/b", "c/a2", "z/a1"]
    assert "z/a1" in store and "nope" not in store


def test_workload_without_namespace_is_stored_but_has_no_identity_index() -> None:
    store = WorkloadStore()
    store.insert(Workload(uid="x", namespace="", workload_ips=(ip_address("10.0.0.9"),)))
    assert store.find_address("", ip_address("10.0.0.9")) is not None


# -- ServiceStore: endpoints ---------------------------------------------------------------------


def test_endpoints_staged_until_service_arrives() -> None:
    services = ServiceStore()
    wl = workload("a", "10.0.0.1", services={SVC_KEY: {80: 9090}})
    services.update_workload(wl)
    assert [e.workload_uid for e in services.staged_endpoints(SVC_KEY)] == [wl.uid]
    assert repr(services) == "<ServiceStore: 0 services, 0 endpoints, 1 staged>"
    stored = services.insert(service())
    assert stored.endpoints == {wl.uid: Endpoint(workload_uid=wl.uid, port={80: 9090})}
    assert services.staged_endpoints(SVC_KEY) == []
    assert repr(services) == "<ServiceStore: 1 services, 1 endpoints, 0 staged>"


def test_service_update_keeps_known_endpoints() -> None:
    services = ServiceStore()
    services.insert(service())
    services.update_workload(workload("a", "10.0.0.1", services={SVC_KEY: {}}))
    explicit = Endpoint(workload_uid="explicit", port={80: 1})
    services.insert(service(endpoints={"explicit": explicit}))
    updated = services.insert(service(ports={80: 8081}))  # xDS updates carry no endpoints
    assert set(updated.endpoints) == {"Kubernetes//Pod/default/a", "explicit"}
    assert updated.ports == {80: 8081}
    assert services.get(SVC_KEY) is updated


def test_workload_update_and_removal_update_endpoints() -> None:
    services = ServiceStore()
    stored = services.insert(service())
    wl = workload("a", "10.0.0.1", services={SVC_KEY: {80: 1}})
    services.update_workload(wl)
    assert stored.endpoints[wl.uid].port == {80: 1}
    services.update_workload(workload("a", "10.0.0.1", services={SVC_KEY: {80: 2}}))
    assert stored.endpoints[wl.uid].port == {80: 2}
    services.update_workload(workload("a", "10.0.0.1"))  # no longer backs the service
    assert stored.endpoints == {}
    services.update_workload(wl)
    services.remove_workload(wl.uid)
    assert stored.endpoints == {}


def test_unhealthy_endpoints_dropped_unless_allow_all() -> None:
    services = ServiceStore()
    sick = workload("sick", "10.0.0.1", status=WorkloadStatus.UNHEALTHY, services={SVC_KEY: {}})
    well = workload("well", "10.0.0.2", services={SVC_KEY: {}})
    services.update_workload(sick)
    services.update_workload(well)
    stored = services.insert(service())
    assert set(stored.endpoints) == {well.uid}
    allow_all = services.insert(service(load_balancer=LoadBalancing(health_policy=HealthPolicy.ALLOW_ALL)))
    assert set(allow_all.endpoints) == {well.uid, sick.uid}
    assert allow_all.endpoints[sick.uid].status is WorkloadStatus.UNHEALTHY
    # A workload turning unhealthy under ONLY_HEALTHY leaves the service.
    services.insert(service())
    services.update_workload(
        workload("well", "10.0.0.2", status=WorkloadStatus.UNHEALTHY, services={SVC_KEY: {}})
    )
    assert services.get(SVC_KEY).endpoints == {}


def test_service_removed_then_readded_gets_its_endpoints_back() -> None:
    services = ServiceStore()
    services.insert(service())
    services.update_workload(workload("a", "10.0.0.1", services={SVC_KEY: {}}))
    assert services.remove(SVC_KEY) is not None
    assert services.remove(SVC_KEY) is None
    assert services.find_vip("", ip_address("10.96.0.1")) is None
    assert len(services.staged_endpoints(SVC_KEY)) == 1
    assert set(services.insert(service()).endpoints) == {"Kubernetes//Pod/default/a"}


def test_services_for_workload() -> None:
    services = ServiceStore()
    services.insert(service("b"))
    services.insert(service("a", vips=("10.96.0.2",)))
    wl = workload(
        "w",
        "10.0.0.1",
        services={
            "default/b.default.svc.cluster.local": {},
            "default/a.default.svc.cluster.local": {},
            "x/y": {},
        },
    )
    services.update_workload(wl)
    assert [s.name for s in services.services_for_workload(wl.uid)] == ["a", "b"]
    assert services.services_for_workload("unknown") == []


def test_big_service_endpoint_updates_touch_only_one_entry() -> None:
    # 5000 endpoints: each update is a dict assignment on the stored service, not a rebuild,
    # so the stored object stays the same and sees every endpoint.
    services = ServiceStore()
    stored = services.insert(service())
    for i in range(5000):
        services.update_workload(
            workload(f"w{i}", str(ipaddress.ip_address("10.1.0.0") + i), services={SVC_KEY: {}})
        )
    assert services.get(SVC_KEY) is stored
    assert len(stored.endpoints) == 5000


# -- ServiceStore: lookups -----------------------------------------------------------------------


def test_vip_lookup_prefers_client_namespace_then_canonical_then_first() -> None:
    services = ServiceStore()
    first = services.insert(service("a", "ns1", hostname="shared.example.com"))
    canonical = services.insert(service("a", "ns2", hostname="shared.example.com", canonical=True))
    local = services.insert(service("a", "ns3", hostname="shared.example.com"))
    vip = ip_address("10.96.0.1")
    assert services.find_vip("", vip, "ns3") is local
    assert services.find_vip("", vip, "elsewhere") is canonical
    assert services.find_hostname("shared.example.com", "ns3") is local
    assert services.find_hostname("shared.example.com", "ns1") is first
    assert services.find_hostname("shared.example.com", None) is canonical
    services.remove(canonical.key)
    assert services.find_vip("", vip, "elsewhere") is first
    assert services.find_vip("other-network", vip, "ns3") is None
    assert services.find_hostname("missing.example.com") is None


def test_namespace_visibility() -> None:
    services = ServiceStore()
    private = services.insert(service("p", "ns1", visibility=Visibility.NAMESPACE))
    assert services.find_vip("", ip_address("10.96.0.1"), "ns1") is private
    assert services.find_vip("", ip_address("10.96.0.1"), "ns2") is None
    assert services.find_hostname(private.hostname, "ns2") is None
    public = services.insert(service("q", "ns2"))
    assert services.find_vip("", ip_address("10.96.0.1"), "ns3") is public


def test_cidr_vips_after_exact_and_ranked() -> None:
    services = ServiceStore()

    def cidr_service(name: str, namespace: str, cidr: str, **kwargs) -> Service:
        return services.insert(
            service(name, namespace, vips=(), cidr_vips=(("", ipaddress.ip_network(cidr)),), **kwargs)
        )

    wide = cidr_service("wide", "ns1", "10.0.0.0/8")
    narrow = cidr_service("narrow", "ns1", "10.1.0.0/16")
    canonical = cidr_service("canon", "ns1", "10.1.0.0/16", canonical=True)
    mine = cidr_service("mine", "ns2", "10.0.0.0/8")
    hidden = cidr_service("hidden", "ns3", "10.1.2.0/24", visibility=Visibility.NAMESPACE)
    target = ip_address("10.1.2.3")
    assert services.find_vip("", target, "ns2") is mine
    assert services.find_vip("", target, "ns1") is canonical
    services.remove(canonical.key)
    assert services.find_vip("", target, "ns1") is narrow
    assert services.find_vip("", target, "ns3") is hidden
    assert services.find_vip("", ip_address("10.200.0.1"), "ns1") is wide
    assert services.find_vip("", ip_address("fd00::1"), "ns1") is None
    assert services.find_vip("net2", target, "ns1") is None
    exact = services.insert(service("exact", "ns9", vips=("10.1.2.3",)))
    assert services.find_vip("", target, "ns2") is exact


# -- ProxyState ----------------------------------------------------------------------------------


def test_proxy_state_versions_and_listeners() -> None:
    # One version per applied push (a removal of an unknown name is still a push applied).
    state = ProxyState()
    seen: list[int] = []
    unsubscribe = state.add_listener(lambda s: seen.append(s.version))
    wl = workload("a", "10.0.0.1", services={SVC_KEY: {}})
    upsert(state, wl)
    upsert(state, service())
    policy = Authorization(name="p", namespace="default", scope=Scope.NAMESPACE)
    upsert(state, policy)
    assert state.policies == {"default/p": policy}
    assert seen == [1, 2, 3]
    assert repr(state) == "<ProxyState v3: 1 workloads, 1 services, 1 policies>"
    assert remove(state, "default/p", policies=True).removed == 1
    assert remove(state, "default/p", policies=True).not_found == 1
    assert remove(state, wl.uid).removed == 1
    assert state.services.get(SVC_KEY).endpoints == {}
    assert remove(state, SVC_KEY).removed == 1
    assert seen == [1, 2, 3, 4, 5, 6, 7]
    unsubscribe()
    upsert(state, wl)
    assert seen == [1, 2, 3, 4, 5, 6, 7] and state.version == 8


def test_remove_by_xds_name_tries_workload_then_service() -> None:
    state = ProxyState()
    upsert(state, workload("a", "10.0.0.1"), service())
    summary = remove(state, "Kubernetes//Pod/default/a", SVC_KEY, SVC_KEY)
    assert (summary.removed, summary.not_found) == (2, 1)
    assert repr(state) == "<ProxyState v2: 0 workloads, 0 services, 0 policies>"


def test_a_snapshot_drops_previous_state_and_notifies_once() -> None:
    state = ProxyState()
    upsert(state, workload("old", "10.0.0.9"), Authorization(name="old", namespace="default"))
    calls: list[str] = []
    state.add_listener(lambda s: calls.append(repr(s)))
    workloads, services = state.workloads, state.services
    load(
        state,
        [workload("a", "10.0.0.1", services={SVC_KEY: {}})],
        [service()],
        [Authorization(name="new", namespace="default")],
    )
    assert calls == ["<ProxyState v3: 1 workloads, 1 services, 1 policies>"]
    assert state.workloads.find_uid("Kubernetes//Pod/default/old") is None
    assert set(state.services.get(SVC_KEY).endpoints) == {"Kubernetes//Pod/default/a"}
    assert list(state.policies) == ["default/new"]
    # Cleared in place, so a reader holding the stores sees the new snapshot.
    assert state.workloads is workloads and state.services is services
