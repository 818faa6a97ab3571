"""The one state writer: xDS pushes and local config through the same code (docs/istio-behaviour.md,
"Workloads and services", "Policy changes on live connections" and "Delta xDS")."""

from __future__ import annotations

import ipaddress

from ambient_mesh.rbac import Action, Authorization
from ambient_mesh.state.localconfig import parse_local_config
from ambient_mesh.state.model import NetworkAddress, Service, Workload, WorkloadStatus
from ambient_mesh.state.store import ProxyState
from ambient_mesh.xds.session import Added, Push, Rejected
from ambient_mesh.xds.updater import StateUpdater

ADDRESS = "type.googleapis.com/istio.workload.Address"
AUTHZ = "type.googleapis.com/istio.security.Authorization"
SVC = "ns/echo.ns.svc.cluster.local"


def wl(uid: str, ip: str, *, services: dict | None = None, status=WorkloadStatus.HEALTHY) -> Workload:
    return Workload(
        uid=uid,
        name=uid.rsplit("/", 1)[-1],
        namespace="ns",
        workload_ips=(ipaddress.ip_address(ip),),
        services=services or {},
        status=status,
    )


def svc(vip: str = "10.96.0.1") -> Service:
    return Service(
        name="echo",
        namespace="ns",
        hostname="echo.ns.svc.cluster.local",
        vips=(NetworkAddress(network="", address=ipaddress.ip_address(vip)),),
        ports={80: 8080},
    )


def address_push(*resources, removed=(), rejected=()) -> Push:
    added = tuple(Added(r.uid if isinstance(r, Workload) else r.key, "v", r) for r in resources)
    return Push(type_url=ADDRESS, added=added, removed=tuple(removed), rejected=tuple(rejected))


def policy_push(*policies, removed=(), rejected=()) -> Push:
    return Push(
        type_url=AUTHZ,
        added=tuple(Added(p.key, "", p) for p in policies),
        removed=tuple(removed),
        rejected=tuple(rejected),
    )


def recording(state: ProxyState) -> list[int]:
    versions: list[int] = []
    state.add_listener(lambda s: versions.append(s.version))
    return versions


def test_address_push_inserts_workloads_and_services_with_one_notification() -> None:
    state = ProxyState()
    versions = recording(state)
    updater = StateUpdater(state)
    summary = updater.apply_push(
        address_push(svc(), wl("c//Pod/ns/a", "10.0.0.1", services={SVC: {80: 8080}}))
    )
    assert str(summary) == "Address: 1 workloads, 1 services, 0 policies, 0 removed"
    assert versions == [1]
    assert state.workloads.find_address("", ipaddress.ip_address("10.0.0.1")).uid == "c//Pod/ns/a"
    assert list(state.services.get(SVC).endpoints) == ["c//Pod/ns/a"]


def test_endpoints_arriving_before_their_service_are_staged() -> None:
    state = ProxyState()
    updater = StateUpdater(state)
    updater.apply_push(address_push(wl("w1", "10.0.0.1", services={SVC: {80: 9090}})))
    assert [e.workload_uid for e in state.services.staged_endpoints(SVC)] == ["w1"]
    updater.apply_push(address_push(svc()))
    assert state.services.staged_endpoints(SVC) == []
    assert state.services.get(SVC).endpoints["w1"].port == {80: 9090}


def test_service_update_keeps_known_endpoints() -> None:
    state = ProxyState()
    updater = StateUpdater(state)
    updater.apply_push(address_push(svc(), wl("w1", "10.0.0.1", services={SVC: {}})))
    updater.apply_push(address_push(svc(vip="10.96.0.2")))
    stored = state.services.get(SVC)
    assert list(stored.endpoints) == ["w1"] and stored.vips[0].address == ipaddress.ip_address("10.96.0.2")
    assert state.services.find_vip("", ipaddress.ip_address("10.96.0.1")) is None


def test_removal_tries_workload_uid_then_service_key() -> None:
    state = ProxyState()
    updater = StateUpdater(state)
    updater.apply_push(address_push(svc(), wl("w1", "10.0.0.1", services={SVC: {}})))
    summary = updater.apply_push(address_push(removed=["w1", SVC, "never/heard-of"]))
    assert (summary.removed, summary.not_found) == (2, 1)
    assert len(state.workloads) == 0 and len(state.services) == 0
    assert "1 unknown removals" in str(summary)


def test_workload_reinsert_replaces_endpoints() -> None:
    state = ProxyState()
    updater = StateUpdater(state)
    updater.apply_push(address_push(svc(), wl("w1", "10.0.0.1", services={SVC: {80: 1}})))
    updater.apply_push(address_push(wl("w1", "10.0.0.2", services={})))
    assert state.services.get(SVC).endpoints == {}
    assert state.workloads.find_address("", ipaddress.ip_address("10.0.0.1")) is None


def test_authorization_pushes_replace_and_remove_policies() -> None:
    state = ProxyState()
    updater = StateUpdater(state)
    versions = recording(state)
    deny = Authorization(name="deny", namespace="ns", action=Action.DENY)
    summary = updater.apply_push(policy_push(deny))
    assert state.policies == {"ns/deny": deny} and versions == [1]
    assert str(summary) == "Authorization: 0 workloads, 0 services, 1 policies, 0 removed"
    # Partly rejected: the good part is applied.
    updater.apply_push(
        policy_push(Authorization(name="b", namespace="ns"), rejected=[Rejected("ns/x", "bad")])
    )
    assert sorted(state.policies) == ["ns/b", "ns/deny"] and versions == [1, 2]
    # Wholly rejected or empty: nothing changed, so no new version.
    updater.apply_push(policy_push(rejected=[Rejected("ns/x", "bad")]))
    updater.apply_push(policy_push())
    assert versions == [1, 2]
    updater.apply_push(policy_push(removed=["ns/deny"]))
    assert list(state.policies) == ["ns/b"] and versions == [1, 2, 3]


def test_ten_thousand_endpoints_of_one_service_in_one_push() -> None:
    # Each endpoint costs O(1) (per-service dicts, one notification per push), so this
    # completes quickly; an O(n^2) updater would take minutes at this size.
    state = ProxyState()
    versions = recording(state)
    updater = StateUpdater(state)
    n = 10_000
    workloads = [
        wl(f"c//Pod/ns/p{i}", str(ipaddress.IPv4Address(0x0A000000 + i)), services={SVC: {80: 8080}})
        for i in range(n)
    ]
    summary = updater.apply_push(address_push(*workloads, svc()))
    assert (summary.workloads, summary.services) == (n, 1)
    assert len(state.services.get(SVC).endpoints) == n
    assert versions == [1]
    summary = updater.apply_push(address_push(removed=[w.uid for w in workloads]))
    assert summary.removed == n and state.services.get(SVC).endpoints == {}
    assert versions == [1, 2]


def test_local_config_replaces_everything_through_the_same_path() -> None:
    state = ProxyState()
    updater = StateUpdater(state)
    updater.apply_push(address_push(wl("old", "10.9.9.9")))
    versions = recording(state)
    local = parse_local_config("""
workloads:
- uid: w1
  name: w1
  namespace: ns
  workloadIps: ["10.0.0.1"]
  services:
    "ns/echo.ns.svc.cluster.local": {80: 8080}
services:
- name: echo
  namespace: ns
  hostname: echo.ns.svc.cluster.local
  vips: ["/10.96.0.1"]
  ports: {80: 8080}
policies:
- name: p
  namespace: ns
  scope: Namespace
  action: Allow
  rules: []
  dryRun: false
""")
    summary = updater.apply_local_config(local)
    assert str(summary) == "local config: 1 workloads, 1 services, 1 policies, 0 removed"
    assert [w.uid for w in state.workloads] == ["w1"]
    assert list(state.services.get(SVC).endpoints) == ["w1"]
    assert list(state.policies) == ["ns/p"]
    assert versions == [2]


def test_unknown_type_push_changes_nothing() -> None:
    state = ProxyState()
    updater = StateUpdater(state)
    summary = updater.apply_push(Push(type_url="type.googleapis.com/other"))
    assert state.version == 0 and summary.source == "type.googleapis.com/other"


def test_repr() -> None:
    updater = StateUpdater(ProxyState())
    updater.apply_push(address_push(svc()))
    assert repr(updater) == (
        "<StateUpdater: 1 pushes applied, <ProxyState v1: 0 workloads, 1 services, 0 policies>>"
    )
