"""istiod's delta xDS bookkeeping as playbooks: requests and snapshots in, responses out
(docs/istio-behaviour.md, "Workloads and services" and "Delta xDS")."""

from __future__ import annotations

import ipaddress

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import struct_pb2
from google.rpc import status_pb2
from hypothesis import given
from hypothesis import strategies as st

from ambient_mesh.control.ads_state import (
    AdsRefused,
    DeltaConnectionState,
    ProxyInfo,
    Snapshot,
    SubscriptionMode,
    address_aliases,
    address_name,
    check_connection_identity,
)
from ambient_mesh.errors import ProtocolError
from ambient_mesh.wire import ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL
from ambient_mesh.wire.istio.security import authorization_pb2
from ambient_mesh.wire.istio.workload import workload_pb2

A, AUTH = ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL
NODE_ID = "ztunnel~10.0.0.9~ztunnel-x1.istio-system~istio-system.svc.cluster.local"
SVC = "default/echo.default.svc.cluster.local"


def pod(name: str, ip: str, *, services: tuple[str, ...] = (), network: str = "", image: str = "v1"):
    uid = f"Kubernetes//Pod/default/{name}"
    wl = workload_pb2.Workload(
        uid=uid,
        name=name,
        namespace="default",
        network=network,
        addresses=[ipaddress.ip_address(ip).packed],
        canonical_revision=image,
        services={
            s: workload_pb2.PortList(ports=[workload_pb2.Port(service_port=80, target_port=8080)])
            for s in services
        },
    )
    return uid, workload_pb2.Address(workload=wl)


def service(vip: str = "10.96.0.1", *, hostname: str = "echo.default.svc.cluster.local"):
    svc = workload_pb2.Service(
        name=hostname.split(".")[0],
        namespace="default",
        hostname=hostname,
        addresses=[workload_pb2.NetworkAddress(network="", address=ipaddress.ip_address(vip).packed)],
        ports=[workload_pb2.Port(service_port=80, target_port=8080)],
    )
    return f"default/{hostname}", workload_pb2.Address(service=svc)


def policy(name: str, *, deny: bool = False):
    return f"default/{name}", authorization_pb2.Authorization(
        name=name,
        namespace="default",
        scope=authorization_pb2.NAMESPACE,
        action=authorization_pb2.DENY if deny else authorization_pb2.ALLOW,
    )


def world(version: str = "1", *extra, drop: tuple[str, ...] = (), policies=None) -> Snapshot:
    addresses = dict(
        [
            pod("a", "10.0.0.1", services=(SVC,)),
            pod("b", "10.0.0.2", services=(SVC,)),
            pod("c", "10.0.0.3"),
            service(),
        ]
    )
    addresses.update(dict(extra))
    for name in drop:
        addresses.pop(name)
    auths = dict(policies if policies is not None else [policy("allow-all")])
    return Snapshot.build(version=version, addresses=addresses, authorizations=auths)


def node(node_id: str = NODE_ID, **metadata: str) -> base_pb2.Node:
    md = {
        "NAME": "ztunnel-x1",
        "NAMESPACE": "istio-system",
        "NODE_NAME": "node-1",
        "CLUSTER_ID": "Kubernetes",
    }
    md.update(metadata)
    return base_pb2.Node(
        id=node_id,
        metadata=struct_pb2.Struct(fields={k: struct_pb2.Value(string_value=v) for k, v in md.items()}),
    )


def req(
    type_url: str = A, *, first: bool = False, sub=(), unsub=(), nonce: str = "", error: str = "", known=None
):
    r = discovery_pb2.DeltaDiscoveryRequest(
        type_url=type_url,
        resource_names_subscribe=list(sub),
        resource_names_unsubscribe=list(unsub),
        response_nonce=nonce,
        initial_resource_versions=dict(known or {}),
    )
    if first:
        r.node.CopyFrom(node())
    if error:
        r.error_detail.CopyFrom(status_pb2.Status(message=error))
    return r


def names(resp: discovery_pb2.DeltaDiscoveryResponse) -> list[str]:
    return [r.name for r in resp.resources]


def connected(snapshot: Snapshot | None = None, *, on_demand: bool = False) -> DeltaConnectionState:
    """A state past ztunnel's two initial requests, both ACKed."""
    conn = DeltaConnectionState(snapshot or world(), nonce_prefix=lambda: "t")
    first = req(first=True, sub=["*"], unsub=["*"]) if on_demand else req(first=True)
    for request in (first, req(AUTH)):
        (resp,) = conn.receive(request)
        assert conn.receive(req(request.type_url, nonce=resp.nonce)) == []
    return conn


# --- node ---------------------------------------------------------------------------------------


def test_node_is_parsed_from_id_and_metadata():
    conn = DeltaConnectionState(world())
    conn.receive(req(first=True))
    assert conn.proxy == ProxyInfo(
        node_id=NODE_ID,
        node_type="ztunnel",
        ip_addresses=("10.0.0.9",),
        proxy_id="ztunnel-x1.istio-system",
        dns_domain="istio-system.svc.cluster.local",
        pod_name="ztunnel-x1",
        namespace="istio-system",
        node_name="node-1",
        cluster_id="Kubernetes",
    )


def test_instance_ips_metadata_wins_when_valid():
    info = ProxyInfo.parse(NODE_ID, {"INSTANCE_IPS": "10.1.1.1,fd00::1"})
    assert info.ip_addresses == ("10.1.1.1", "fd00::1")
    assert ProxyInfo.parse(NODE_ID, {"INSTANCE_IPS": "nonsense"}).ip_addresses == ("10.0.0.9",)


def test_node_is_read_from_the_first_request_only():
    conn = DeltaConnectionState(world())
    conn.receive(req(first=True))
    later = req(AUTH)
    later.node.CopyFrom(node("ztunnel~1.2.3.4~other.ns~ns.svc.cluster.local"))
    conn.receive(later)
    assert conn.proxy.node_id == NODE_ID


@pytest.mark.parametrize(
    ("node_id", "needle"),
    [
        ("sidecar~10.0.0.1~app.default~default.svc.cluster.local", "serves only ztunnel"),
        ("router~10.0.0.1~gw.default~default.svc.cluster.local", "serves only ztunnel"),
        ("spaceship~10.0.0.1~x.y~y.svc.cluster.local", "unknown node type"),
        ("ztunnel~10.0.0.1", "four"),
    ],
)
def test_non_ztunnel_or_malformed_nodes_are_refused(node_id, needle):
    conn = DeltaConnectionState(world())
    r = req()
    r.node.CopyFrom(node(node_id))
    with pytest.raises(AdsRefused) as e:
        conn.receive(r)
    assert needle in str(e.value) and e.value.code == "INVALID_ARGUMENT"


def test_first_request_without_node_is_refused():
    with pytest.raises(AdsRefused, match="missing node"):
        DeltaConnectionState(world()).receive(req())


def test_caller_identity_must_match_the_proxy_namespace():
    ok = DeltaConnectionState(world(), identities=["spiffe://cluster.local/ns/istio-system/sa/ztunnel"])
    ok.receive(req(first=True))
    assert str(ok.verified_identity) == "spiffe://cluster.local/ns/istio-system/sa/ztunnel"
    bad = DeltaConnectionState(
        world(), identities=["spiffe://cluster.local/ns/default/sa/ztunnel", "garbage"]
    )
    with pytest.raises(AdsRefused) as e:
        bad.receive(req(first=True))
    assert e.value.code == "PERMISSION_DENIED" and bad.proxy is None


def test_identity_check_skips_unparseable_ids():
    proxy = ProxyInfo.parse(NODE_ID, {})
    ident = check_connection_identity(proxy, ["not-spiffe", "spiffe://td/ns/istio-system/sa/z"])
    assert ident.trust_domain == "td"


@given(node_id=st.text(max_size=80), instance_ips=st.text(max_size=40))
def test_node_parser_returns_info_or_protocol_error(node_id, instance_ips):
    try:
        info = ProxyInfo.parse(node_id, {"INSTANCE_IPS": instance_ips})
    except ProtocolError:
        return
    assert info.node_type == "ztunnel" and info.node_id == node_id


@given(
    st.lists(st.sampled_from(["ztunnel", "10.0.0.1", "a.b", "b.svc.cluster.local", "", "~", "."]), max_size=6)
)
def test_node_parser_on_near_valid_ids(parts):
    try:
        ProxyInfo.parse("~".join(parts), {})
    except ProtocolError:
        pass


# --- subscriptions ----------------------------------------------------------------------------


def test_empty_subscribe_is_wildcard_and_gets_everything():
    conn = DeltaConnectionState(world(), nonce_prefix=lambda: "t")
    (resp,) = conn.receive(req(first=True))
    assert resp.type_url == A and resp.system_version_info == "1"
    assert names(resp) == [
        "Kubernetes//Pod/default/a",
        "Kubernetes//Pod/default/b",
        "Kubernetes//Pod/default/c",
        SVC,
    ]
    assert all(r.version and not r.aliases for r in resp.resources)
    assert resp.resources[0].resource.type_url == A
    (auth,) = conn.receive(req(AUTH))
    assert names(auth) == ["default/allow-all"] and auth.resources[0].version == ""
    assert [s.mode for s in conn.status()] == [SubscriptionMode.WILDCARD, SubscriptionMode.WILDCARD]


def test_explicit_star_is_wildcard():
    conn = DeltaConnectionState(world())
    (resp,) = conn.receive(req(first=True, sub=["*"]))
    assert len(resp.resources) == 4


def test_star_subscribed_and_unsubscribed_means_nothing_yet_is_answered():
    conn = DeltaConnectionState(world())
    (resp,) = conn.receive(req(first=True, sub=["*"], unsub=["*"]))
    assert list(resp.resources) == [] and list(resp.removed_resources) == [] and resp.nonce
    assert conn.status()[0].mode is SubscriptionMode.ON_DEMAND


def test_initial_resource_versions_skip_current_and_remove_vanished():
    snap = world()
    current = snap.of(A)["Kubernetes//Pod/default/a"].version
    conn = DeltaConnectionState(snap)
    known = {
        "Kubernetes//Pod/default/a": current,
        "Kubernetes//Pod/default/b": "stale",
        "Kubernetes//Pod/default/gone": "x",
    }
    (resp,) = conn.receive(req(first=True, known=known))
    assert names(resp) == ["Kubernetes//Pod/default/b", "Kubernetes//Pod/default/c", SVC]
    assert list(resp.removed_resources) == ["Kubernetes//Pod/default/gone"]
    # The skipped resource counts as held: a later unchanged push does not send it either.
    assert conn.push(world("2")) == []


def test_authorization_has_no_versions_so_everything_is_resent_on_resume():
    conn = DeltaConnectionState(world())
    conn.receive(req(first=True))
    (resp,) = conn.receive(req(AUTH, known={"default/allow-all": "", "default/deleted": ""}))
    assert names(resp) == ["default/allow-all"]
    assert list(resp.removed_resources) == ["default/deleted"]


# --- ACK / NACK / nonces ----------------------------------------------------------------------


def test_pure_ack_gets_no_answer_and_is_counted():
    conn = DeltaConnectionState(world())
    (resp,) = conn.receive(req(first=True))
    assert conn.receive(req(nonce=resp.nonce)) == []
    st_a = conn.status()[0]
    assert (st_a.acks, st_a.resources_acked, st_a.last_nonce_acked) == (1, 4, resp.nonce)


def test_nack_is_recorded_not_answered():
    conn = connected()
    (push,) = conn.push(world("2", pod("d", "10.0.0.4")))
    assert conn.receive(req(nonce=push.nonce, error="Kubernetes//Pod/default/d: bad ip")) == []
    st_a = conn.status()[0]
    assert (st_a.nacks, st_a.resources_nacked, st_a.last_error) == (1, 1, "Kubernetes//Pod/default/d: bad ip")
    assert st_a.last_nonce_acked != push.nonce
    # Nothing is re-sent on the next push for an unchanged resource: the proxy kept what it could.
    assert conn.push(world("3", pod("d", "10.0.0.4"))) == []


def test_stale_nonce_is_ignored_even_with_a_subscription():
    conn = connected(on_demand=True)
    (first,) = conn.receive(req(sub=["/10.0.0.3"]))
    (second,) = conn.receive(req(sub=["/10.0.0.1"]))
    assert first.nonce != second.nonce
    assert conn.receive(req(nonce=first.nonce, sub=["/10.0.0.2"])) == []
    assert conn.status()[0].stale_nonces == 1
    assert "/10.0.0.2" not in conn.status()[0].subscribed_keys


def test_nonces_are_unique_across_responses_and_types():
    conn = DeltaConnectionState(world())
    seen = {r.nonce for r in conn.receive(req(first=True)) + conn.receive(req(AUTH))}
    for v in range(2, 6):
        seen.update(
            r.nonce for r in conn.push(world(str(v), pod("n", f"10.0.1.{v}"), policies=[policy(f"p{v}")]))
        )
    assert len(seen) == 2 + 4 * 2


def test_unserved_type_is_ignored():
    conn = DeltaConnectionState(world())
    assert conn.receive(req("type.googleapis.com/envoy.config.cluster.v3.Cluster", first=True)) == []
    assert conn.proxy is not None and conn.status() == ()


# --- on-demand lookups ------------------------------------------------------------------------


def test_lookup_by_uid():
    conn = connected(on_demand=True)
    (resp,) = conn.receive(req(sub=["Kubernetes//Pod/default/c"]))
    assert names(resp) == ["Kubernetes//Pod/default/c"]
    assert list(resp.resources[0].aliases) == ["/10.0.0.3"]
    assert list(resp.removed_resources) == []


def test_lookup_by_workload_ip_answers_with_the_primary_name_and_the_key_as_alias():
    conn = connected(on_demand=True)
    (resp,) = conn.receive(req(sub=["/10.0.0.3"]))
    assert names(resp) == ["Kubernetes//Pod/default/c"]
    assert "/10.0.0.3" in resp.resources[0].aliases


def test_lookup_by_vip_returns_the_service_and_its_endpoints():
    conn = connected(on_demand=True)
    (resp,) = conn.receive(req(sub=["/10.96.0.1"]))
    assert names(resp) == ["Kubernetes//Pod/default/a", "Kubernetes//Pod/default/b", SVC]
    assert list(resp.resources[2].aliases) == ["/10.96.0.1"]
    # Endpoints carry their own keys, not the VIP.
    assert list(resp.resources[0].aliases) == ["/10.0.0.1"]


def test_lookup_by_namespace_hostname():
    conn = connected(on_demand=True)
    (resp,) = conn.receive(req(sub=[SVC]))
    assert names(resp) == ["Kubernetes//Pod/default/a", "Kubernetes//Pod/default/b", SVC]


def test_not_found_keys_come_back_removed():
    conn = connected(on_demand=True)
    (resp,) = conn.receive(req(sub=["/10.9.9.9", "Kubernetes//Pod/default/c"]))
    assert names(resp) == ["Kubernetes//Pod/default/c"]
    assert list(resp.removed_resources) == ["/10.9.9.9"]


def test_on_demand_pushes_only_what_was_looked_up():
    conn = connected(on_demand=True)
    conn.receive(req(sub=["/10.0.0.3"]))
    # a and c change, d appears: only c concerns this proxy.
    changed = world(
        "2",
        pod("a", "10.0.0.1", services=(SVC,), image="v2"),
        pod("c", "10.0.0.3", image="v2"),
        pod("d", "10.0.0.4"),
    )
    (resp,) = conn.push(changed)
    assert names(resp) == ["Kubernetes//Pod/default/c"] and list(resp.resources[0].aliases) == ["/10.0.0.3"]


def test_on_demand_key_not_found_is_pushed_when_it_appears():
    conn = connected(on_demand=True)
    conn.receive(req(sub=["/10.0.0.4"]))
    (resp,) = conn.push(world("2", pod("d", "10.0.0.4")))
    assert names(resp) == ["Kubernetes//Pod/default/d"]


def test_on_demand_resource_deleted_is_removed():
    conn = connected(on_demand=True)
    conn.receive(req(sub=["/10.0.0.3"]))
    (resp,) = conn.push(world("2", drop=("Kubernetes//Pod/default/c",)))
    assert list(resp.resources) == [] and list(resp.removed_resources) == ["Kubernetes//Pod/default/c"]


def test_unsubscribe_stops_updates_without_answer():
    conn = connected(on_demand=True)
    conn.receive(req(sub=["/10.0.0.3"]))
    assert conn.receive(req(unsub=["/10.0.0.3"])) == []
    assert conn.push(world("2", pod("c", "10.0.0.3", image="v2"))) == []


def test_on_demand_resume_keeps_held_names_subscribed():
    snap = world()
    c = "Kubernetes//Pod/default/c"
    conn = DeltaConnectionState(snap)
    (resp,) = conn.receive(
        req(first=True, sub=["*"], unsub=["*"], known={c: snap.of(A)[c].version, "gone": ""})
    )
    assert list(resp.resources) == [] and list(resp.removed_resources) == ["gone"]
    (push,) = conn.push(world("2", pod("c", "10.0.0.3", image="v2")))
    assert names(push) == [c]


# --- wildcard pushes --------------------------------------------------------------------------


def test_push_sends_only_changed_and_new_resources():
    conn = connected()
    (resp,) = conn.push(world("2", pod("b", "10.0.0.2", services=(SVC,), image="v2"), pod("d", "10.0.0.4")))
    assert names(resp) == ["Kubernetes//Pod/default/b", "Kubernetes//Pod/default/d"]
    assert list(resp.removed_resources) == [] and resp.system_version_info == "2"


def test_push_of_an_identical_snapshot_sends_nothing():
    conn = connected()
    assert conn.push(world("2")) == []


def test_push_removals():
    conn = connected()
    (resp,) = conn.push(world("2", drop=("Kubernetes//Pod/default/a",)))
    assert resp.type_url == A and list(resp.resources) == []
    assert list(resp.removed_resources) == ["Kubernetes//Pod/default/a"]
    # Removed once: the next push has nothing left to say.
    assert conn.push(world("3", drop=("Kubernetes//Pod/default/a",))) == []


def test_authorization_changes_are_pushed_by_content():
    conn = connected()
    assert conn.push(world("2", policies=[policy("allow-all")])) == []
    (resp,) = conn.push(world("3", policies=[policy("allow-all", deny=True), policy("new")]))
    assert resp.type_url == AUTH and names(resp) == ["default/allow-all", "default/new"]


def test_policy_removal_is_pushed():
    conn = connected()
    responses = conn.push(world("2", policies=[]))
    assert [(r.type_url, list(r.removed_resources)) for r in responses] == [(AUTH, ["default/allow-all"])]


def test_pushes_before_the_type_is_subscribed_send_nothing_for_it():
    conn = DeltaConnectionState(world())
    conn.receive(req(first=True))
    (resp,) = conn.push(world("2", pod("d", "10.0.0.4"), policies=[policy("x")]))
    assert resp.type_url == A


def test_repr_says_what_the_connection_holds():
    conn = connected()
    assert repr(conn) == (
        f"DeltaConnectionState({NODE_ID}, snapshot v1; Address: wildcard, 4 held, sent 4 acked 4 nacked 0; "
        "Authorization: wildcard, 1 held, sent 1 acked 1 nacked 0)"
    )
    assert repr(world()) == "Snapshot(v1: 4 Address, 1 Authorization)"


# --- names and aliases ------------------------------------------------------------------------


def test_address_names_and_aliases():
    uid, wl = pod("a", "fd00::1", network="net1")
    assert address_name(wl) == uid and address_aliases(wl) == ["net1/fd00::1"]
    name, svc = service("10.96.0.7")
    svc.service.addresses.append(
        workload_pb2.NetworkAddress(network="n", address=bytes([10, 1, 0, 0]), length=16)
    )
    svc.service.addresses.append(
        workload_pb2.NetworkAddress(network="n", address=bytes([10, 2, 0, 1]), length=32)
    )
    assert address_name(svc) == name
    assert address_aliases(svc) == ["/10.96.0.7", "n/10.1.0.0/16", "n/10.2.0.1"]


def test_explicit_alias_index_overrides_derived_keys():
    uid, wl = pod("a", "10.0.0.1")
    snap = Snapshot.build(
        version="1", addresses={uid: wl}, authorizations={}, aliases={"custom/key": [uid, "missing"]}
    )
    assert snap.resolve(A, "custom/key") == (uid,)
    assert snap.resolve(A, "/10.0.0.1") == ()
    assert snap.of(A)[uid].aliases == ("custom/key",)


def test_versions_are_content_hashes():
    a1, a2 = world("1").of(A), world("2").of(A)
    assert a1 == a2
    changed = world("3", pod("a", "10.0.0.1", services=(SVC,), image="v2")).of(A)
    assert changed["Kubernetes//Pod/default/a"].version != a1["Kubernetes//Pod/default/a"].version


def test_envoy_snapshots_reuse_what_did_not_change(monkeypatch) -> None:
    """`Snapshot.of_messages`: the very same message object keeps its packed entry without being
    serialized again; an equal message keeps the entry too; a changed one is packed anew, and
    only it is named changed."""
    from envoy.config.route.v3 import route_pb2

    from ambient_mesh.control import ads_state

    serialized: list[str] = []
    real = ads_state._serialize

    def counting(message):  # type: ignore[no-untyped-def]
        serialized.append(message.name)
        return real(message)

    monkeypatch.setattr(ads_state, "_serialize", counting)
    url = ads_state.ROUTE_TYPE_URL
    a = route_pb2.RouteConfiguration(name="a")
    b = route_pb2.RouteConfiguration(name="b")
    first = Snapshot.of_messages(version="1", messages={url: {"a": a, "b": b}})
    assert serialized == ["a", "b"]
    same = Snapshot.of_messages(version="2", messages={url: {"a": a, "b": b}}, previous=first)
    assert serialized == ["a", "b"]  # the same objects: not serialized again
    assert same.of(url)["a"] is first.of(url)["a"]
    assert same.changed == {url: frozenset()}
    equal = route_pb2.RouteConfiguration(name="a")
    changed_b = route_pb2.RouteConfiguration(name="b", ignore_port_in_host_matching=True)
    second = Snapshot.of_messages(version="3", messages={url: {"a": equal, "b": changed_b}}, previous=same)
    assert second.of(url)["a"] is first.of(url)["a"]
    assert second.changed == {url: frozenset({"b"})}
    assert second.of(url)["b"].resource.value == changed_b.SerializeToString(deterministic=True)
