"""control/ads_state.py: a snapshot built on the previous one, or patched, equals a fresh build
and pushes the same; the ADS server builds each update on its previous snapshot."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ambient_mesh.control.ads import AdsServer
from ambient_mesh.control.ads_state import Snapshot
from ambient_mesh.wire import ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL
from ambient_mesh.wire.istio.security import authorization_pb2
from ambient_mesh.wire.istio.workload import workload_pb2

A, AUTH = ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL


# -- snapshot reuse -----------------------------------------------------------------------------------


def _pod(name: str, ip: str, revision: str = "v1") -> tuple[str, workload_pb2.Address]:
    uid = f"Kubernetes//Pod/default/{name}"
    w = workload_pb2.Workload(
        uid=uid,
        name=name,
        namespace="default",
        addresses=[ipaddress.ip_address(ip).packed],
        canonical_revision=revision,
        services={"default/web.default.svc.cluster.local": workload_pb2.PortList()},
    )
    return uid, workload_pb2.Address(workload=w)


def _policy(name: str, action: int = authorization_pb2.ALLOW) -> tuple[str, authorization_pb2.Authorization]:
    return f"default/{name}", authorization_pb2.Authorization(name=name, namespace="default", action=action)


def _mesh(revision_b: str = "v1", action: int = authorization_pb2.ALLOW):
    addresses = dict([_pod("a", "10.0.0.1"), _pod("b", "10.0.0.2", revision_b), _pod("c", "10.0.0.3")])
    authorizations = dict([_policy("allow"), _policy("other", action)])
    return addresses, authorizations


def test_build_on_previous_reuses_unchanged_entries_and_equals_a_fresh_build() -> None:
    addresses, authorizations = _mesh()
    first = Snapshot.build(version="1", addresses=addresses, authorizations=authorizations)
    addresses, authorizations = _mesh(revision_b="v2", action=authorization_pb2.DENY)
    del addresses["Kubernetes//Pod/default/c"]
    second = Snapshot.build(version="2", addresses=addresses, authorizations=authorizations, previous=first)

    assert second == Snapshot.build(version="2", addresses=addresses, authorizations=authorizations)
    reused = {
        (t, name) for t in (A, AUTH) for name, entry in second.of(t).items() if first.of(t).get(name) is entry
    }
    assert reused == {(A, "Kubernetes//Pod/default/a"), (AUTH, "default/allow")}
    b_before, b_after = first.of(A)["Kubernetes//Pod/default/b"], second.of(A)["Kubernetes//Pod/default/b"]
    assert b_after.version != b_before.version and b_after.digest != b_before.digest
    assert (
        second.of(A)["Kubernetes//Pod/default/a"].version == first.of(A)["Kubernetes//Pod/default/a"].version
    )
    assert second.resolve(A, "/10.0.0.1") == ("Kubernetes//Pod/default/a",)
    assert second.resolve(A, "/10.0.0.3") == ()


def test_build_on_previous_repacks_when_aliases_change() -> None:
    addresses, authorizations = _mesh()
    first = Snapshot.build(version="1", addresses=addresses, authorizations=authorizations)
    explicit = {"lookup-key": ["Kubernetes//Pod/default/a"]}
    second = Snapshot.build(
        version="2", addresses=addresses, authorizations=authorizations, aliases=explicit, previous=first
    )
    assert second == Snapshot.build(
        version="2", addresses=addresses, authorizations=authorizations, aliases=explicit
    )
    assert second.of(A)["Kubernetes//Pod/default/a"].aliases == ("lookup-key",)
    assert second.of(A)["Kubernetes//Pod/default/b"].aliases == ()
    assert not second.derived_aliases
    # Back to derived aliases: what the caller's mapping said must not carry over.
    third = Snapshot.build(version="3", addresses=addresses, authorizations=authorizations, previous=second)
    assert third == Snapshot.build(version="3", addresses=addresses, authorizations=authorizations)
    assert third.of(A)["Kubernetes//Pod/default/a"].aliases == ("/10.0.0.1",)
    assert third.resolve(A, "lookup-key") == ()


def test_ads_server_update_builds_on_its_previous_snapshot() -> None:
    ads = AdsServer()
    addresses, authorizations = _mesh()
    ads.update(addresses, authorizations)
    first = ads.snapshot
    addresses, authorizations = _mesh(revision_b="v2")
    ads.update(addresses, authorizations)
    second = ads.snapshot
    assert second.version == "2"
    assert second.of(A)["Kubernetes//Pod/default/a"] is first.of(A)["Kubernetes//Pod/default/a"]
    assert second.of(A)["Kubernetes//Pod/default/b"] is not first.of(A)["Kubernetes//Pod/default/b"]
    assert second.of(AUTH)["default/other"] is first.of(AUTH)["default/other"]
    assert repr(ads) == "AdsServer(0 connections, Snapshot(v2: 3 Address, 2 Authorization))"


# -- patched snapshots ------------------------------------------------------------------------------


_POD_NAMES = st.sampled_from(["a", "b", "c", "d"])
_IPS = st.sampled_from(["10.0.0.1", "10.0.0.2", "10.0.0.3"])
_SERVICES = st.sampled_from(["default/web.default.svc.cluster.local", "default/db.default.svc.cluster.local"])


def _workload(name: str, ip: str, services: list[str]) -> workload_pb2.Address:
    w = workload_pb2.Workload(
        uid=f"Kubernetes//Pod/default/{name}",
        name=name,
        namespace="default",
        addresses=[ipaddress.ip_address(ip).packed],
        services={s: workload_pb2.PortList() for s in services},
    )
    return workload_pb2.Address(workload=w)


_CHANGES = st.lists(
    st.one_of(
        st.tuples(st.just("workload"), _POD_NAMES, _IPS, st.lists(_SERVICES, max_size=2, unique=True)),
        st.tuples(st.just("service"), _SERVICES, _IPS),
        st.tuples(
            st.just("policy"), _POD_NAMES, st.sampled_from([authorization_pb2.ALLOW, authorization_pb2.DENY])
        ),
        st.tuples(st.just("remove"), st.integers(0, 100)),
    ),
    max_size=12,
)


def _subscribe(state) -> None:
    from envoy.config.core.v3 import base_pb2
    from envoy.service.discovery.v3 import discovery_pb2

    node = base_pb2.Node(id="ztunnel~10.0.0.9~ztunnel-1.istio-system~istio-system.svc.cluster.local")
    for type_url in (A, AUTH):
        state.receive(discovery_pb2.DeltaDiscoveryRequest(node=node, type_url=type_url))


def _sent(responses) -> list[tuple[str, list[tuple[str, str]], list[str]]]:
    return [
        (
            r.type_url,
            sorted((res.name, res.resource.value.hex()) for res in r.resources),
            sorted(r.removed_resources),
        )
        for r in responses
    ]


@settings(max_examples=150, deadline=None)
@given(_CHANGES)
def test_patch_equals_a_fresh_build_and_pushes_the_same(changes) -> None:
    """A chain of `Snapshot.patch` equals `Snapshot.build` of the same resources, and a stream that
    diffs only the patched names sends what a full comparison sends."""
    from ambient_mesh.control.ads_state import DeltaConnectionState

    addresses: dict[str, workload_pb2.Address] = {}
    authorizations: dict[str, authorization_pb2.Authorization] = {}
    patched = Snapshot.build(version="0", addresses={}, authorizations={})
    hinted = DeltaConnectionState(patched, nonce_prefix=lambda: "n")
    full = DeltaConnectionState(patched, nonce_prefix=lambda: "n")
    _subscribe(hinted)
    _subscribe(full)
    for version, change in enumerate(changes, start=1):
        changed_a: dict[str, workload_pb2.Address] = {}
        changed_p: dict[str, authorization_pb2.Authorization] = {}
        removed_a: list[str] = []
        removed_p: list[str] = []
        if change[0] == "workload":
            _, name, ip, services = change
            changed_a[f"Kubernetes//Pod/default/{name}"] = _workload(name, ip, services)
        elif change[0] == "service":
            _, key, ip = change
            namespace, hostname = key.split("/")
            svc = workload_pb2.Service(
                name=hostname.split(".")[0],
                namespace=namespace,
                hostname=hostname,
                addresses=[workload_pb2.NetworkAddress(address=ipaddress.ip_address(ip).packed)],
            )
            changed_a[key] = workload_pb2.Address(service=svc)
        elif change[0] == "policy":
            _, name, action = change
            changed_p[f"default/{name}"] = authorization_pb2.Authorization(
                name=name, namespace="default", action=action
            )
        else:
            names = sorted(addresses) + sorted(authorizations)
            if not names:
                continue
            name = names[change[1] % len(names)]
            (removed_a if name in addresses else removed_p).append(name)
        addresses.update(changed_a)
        authorizations.update(changed_p)
        for name in removed_a:
            del addresses[name]
        for name in removed_p:
            del authorizations[name]
        patched = patched.patch(
            version=str(version),
            addresses=changed_a,
            removed_addresses=removed_a,
            authorizations=changed_p,
            removed_authorizations=removed_p,
        )
        fresh = Snapshot.build(version=str(version), addresses=addresses, authorizations=authorizations)
        assert patched == fresh
        assert _sent(hinted.push(patched)) == _sent(full.push(fresh))


def test_patch_refuses_a_snapshot_with_explicit_aliases() -> None:
    addresses, authorizations = _mesh()
    explicit = Snapshot.build(
        version="1", addresses=addresses, authorizations=authorizations, aliases={"k": list(addresses)}
    )
    with pytest.raises(ValueError, match="explicit aliases"):
        explicit.patch(version="2")
