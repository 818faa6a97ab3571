"""The incremental translation (`AmbientIndex`) always equals the full one (`translate`).

Hypothesis drives sequences of puts and removals over a small universe of objects of every kind
the translation reads, with names, labels, selectors, hostnames and addresses drawn from small
pools so that objects keep selecting, shadowing and referencing each other (a ServiceEntry
taking a Service's hostname, two endpoints with one uid, a Gateway falling back to a Service's
name, policies in the root namespace, PeerAuthentications with port-level modes). After every
step the index's whole view is compared with `translate` of the same objects, and the step's
delta, applied to the previous view, must give the new one.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ambient_mesh.control.translate import AmbientIndex, MeshSettings, TranslationDelta, translate
from ambient_mesh.kube.labels import LabelSelector
from ambient_mesh.kube.model import (
    AuthorizationPolicy,
    AuthorizationRule,
    Condition,
    Container,
    ContainerPort,
    Gateway,
    GatewayAddress,
    GatewayListener,
    Namespace,
    Node,
    ObjectMeta,
    Operation,
    PeerAuthentication,
    Pod,
    PodCondition,
    Service,
    ServiceEntry,
    ServiceEntryPort,
    ServicePort,
    Source,
    WorkloadEntry,
    WorkloadEntrySpec,
    object_key,
)
from ambient_mesh.kube.store import KubeStore

ROOT = "istio-system"
NAMESPACES = ("ns-a", "ns-b", ROOT)
TIMESTAMPS = ("2024-01-01T00:00:00Z", "2024-02-01T00:00:00Z", "")

_labels = st.dictionaries(
    st.sampled_from(
        [
            "app",
            "version",
            "istio.io/use-waypoint",
            "istio.io/dataplane-mode",
            "gateway.networking.k8s.io/gateway-name",
            "istio.io/waypoint-for",
            "topology.kubernetes.io/zone",
        ]
    ),
    st.sampled_from(["a", "b", "wp", "none", "ambient", "workload", "all"]),
    max_size=3,
)
_selector_labels = st.dictionaries(
    st.sampled_from(["app", "version"]), st.sampled_from(["a", "b"]), max_size=2
)
_selector = st.one_of(st.none(), _selector_labels.map(lambda m: LabelSelector(match_labels=m)))
_ip = st.sampled_from(["10.0.0.1", "10.0.0.2", "10.0.0.3", "fd00::1", "not-an-ip"])


def _meta(kind_names: tuple[str, ...], *, namespaced: bool = True, annotations=None) -> st.SearchStrategy:
    return st.builds(
        ObjectMeta,
        name=st.sampled_from(kind_names),
        namespace=st.sampled_from(NAMESPACES) if namespaced else st.just(""),
        labels=_labels,
        annotations=annotations if annotations is not None else st.just({}),
        creation_timestamp=st.sampled_from(TIMESTAMPS),
    )


_namespaces = st.builds(
    Namespace,
    metadata=st.builds(
        ObjectMeta,
        name=st.sampled_from(NAMESPACES),
        labels=_labels,
        annotations=st.sampled_from([{}, {"networking.istio.io/traffic-distribution": "PreferClose"}]),
    ),
)
_nodes = st.builds(
    Node,
    metadata=st.builds(
        ObjectMeta,
        name=st.sampled_from(["n1", "n2"]),
        labels=st.sampled_from(
            [{}, {"topology.kubernetes.io/region": "r1", "topology.kubernetes.io/zone": "z"}]
        ),
    ),
)
_container = st.builds(
    Container,
    name=st.just("app"),
    ports=st.lists(
        st.builds(
            ContainerPort,
            name=st.sampled_from(["http", "grpc"]),
            container_port=st.sampled_from([8080, 9090]),
        ),
        max_size=2,
    ).map(tuple),
)
_pods = st.builds(
    Pod,
    metadata=_meta(("p1", "p2", "p3")),
    node_name=st.sampled_from(["n1", "n2", ""]),
    service_account_name=st.sampled_from(["", "sa"]),
    containers=st.lists(_container, max_size=1).map(tuple),
    pod_ip=_ip,
    phase=st.sampled_from(["Running", "Succeeded"]),
    conditions=st.sampled_from([(), (PodCondition(type="Ready", status="True"),)]),
)
_services = st.builds(
    Service,
    metadata=_meta(("s1", "s2", "wp")),
    selector=_selector_labels,
    cluster_ip=_ip,
    ports=st.lists(
        st.builds(
            ServicePort,
            name=st.sampled_from(["http", "tcp"]),
            port=st.sampled_from([80, 9090]),
            target_port=st.sampled_from([None, 8080, "http", "grpc"]),
        ),
        max_size=2,
        unique_by=lambda p: p.port,
    ).map(tuple),
    internal_traffic_policy=st.sampled_from(["", "Local"]),
)
_endpoint = st.builds(
    WorkloadEntrySpec,
    address=st.sampled_from(["10.1.0.1", "10.1.0.2", "db.example.com"]),
    ports=st.sampled_from([{}, {"http": 8081}]),
    labels=_selector_labels,
    locality=st.sampled_from(["", "r1/z1"]),
)
_service_entries = st.builds(
    ServiceEntry,
    metadata=_meta(("se1", "se2")),
    hosts=st.lists(
        st.sampled_from(["a.example.com", "b.example.com", "s1.ns-a.svc.cluster.local"]),
        min_size=1,
        max_size=2,
    ).map(tuple),
    addresses=st.sampled_from([(), ("240.0.0.1",), ("10.2.0.0/16",)]),
    ports=st.lists(
        st.builds(ServiceEntryPort, number=st.sampled_from([80, 443]), name=st.sampled_from(["http", "tls"])),
        max_size=2,
        unique_by=lambda p: p.number,
    ).map(tuple),
    resolution=st.sampled_from(["NONE", "STATIC", "DNS"]),
    endpoints=st.lists(_endpoint, max_size=2).map(tuple),
    workload_selector=_selector,
)
_workload_entries = st.builds(WorkloadEntry, metadata=_meta(("we1", "we2")), spec=_endpoint)
_gateways = st.builds(
    Gateway,
    metadata=_meta(("wp",)),
    listeners=st.lists(
        st.builds(
            GatewayListener,
            name=st.just("mesh"),
            port=st.just(15008),
            protocol=st.just("HBONE"),
            allowed_from=st.sampled_from(["", "All", "Same", "Selector"]),
            allowed_selector=_selector,
        ),
        max_size=1,
    ).map(tuple),
    status_addresses=st.sampled_from([(), (GatewayAddress(type="IPAddress", value="10.9.0.1"),)]),
)
_rules = st.lists(
    st.builds(
        AuthorizationRule,
        sources=st.lists(
            st.builds(
                Source, namespaces=st.sampled_from([(), ("ns-a",)]), principals=st.sampled_from([(), ("*",)])
            ),
            max_size=1,
        ).map(tuple),
        operations=st.lists(
            st.builds(
                Operation, ports=st.sampled_from([(), ("8080",)]), methods=st.sampled_from([(), ("GET",)])
            ),
            max_size=1,
        ).map(tuple),
        when=st.lists(
            st.builds(
                Condition,
                key=st.sampled_from(["source.ip", "request.headers[x]"]),
                values=st.just(("10.0.0.0/8",)),
            ),
            max_size=1,
        ).map(tuple),
    ),
    max_size=2,
).map(tuple)
_authorization_policies = st.builds(
    AuthorizationPolicy,
    metadata=_meta(("ap1", "ap2"), annotations=st.sampled_from([{}, {"istio.io/dry-run": "true"}])),
    selector=_selector,
    action=st.sampled_from(["ALLOW", "DENY", "AUDIT"]),
    rules=_rules,
)
_peer_authentications = st.builds(
    PeerAuthentication,
    metadata=_meta(("default", "pa1")),
    selector=_selector,
    mtls_mode=st.sampled_from([None, "STRICT", "PERMISSIVE", "DISABLE"]),
    port_level_mtls=st.dictionaries(
        st.sampled_from([8080, 9090]), st.sampled_from(["STRICT", "PERMISSIVE", "DISABLE"]), max_size=2
    ),
)
_objects = st.one_of(
    _namespaces,
    _nodes,
    _pods,
    _services,
    _service_entries,
    _workload_entries,
    _gateways,
    _authorization_policies,
    _peer_authentications,
)
_steps = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.lists(_objects, min_size=1, max_size=3)),
        st.tuples(st.just("remove"), st.integers(min_value=0, max_value=1000)),
    ),
    min_size=1,
    max_size=12,
)


def _check(index: AmbientIndex, objects: dict) -> None:
    full = translate(KubeStore(objects.values()), index.settings)
    assert index.addresses == full.addresses
    assert index.authorizations == full.authorizations
    assert sorted(index.notes) == sorted(full.notes)


def _applied(view: tuple[dict, dict], delta: TranslationDelta) -> tuple[dict, dict]:
    addresses = {k: v for k, v in view[0].items() if k not in delta.removed_addresses}
    addresses.update(delta.addresses)
    authorizations = {k: v for k, v in view[1].items() if k not in delta.removed_authorizations}
    authorizations.update(delta.authorizations)
    return addresses, authorizations


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_objects.flatmap(lambda first: st.just(first)), _steps)
def test_incremental_equals_full_after_any_changes(first, steps) -> None:
    index = AmbientIndex(MeshSettings(root_namespace=ROOT))
    objects: dict = {}
    view: tuple[dict, dict] = ({}, {})
    for op, arg in [("put", [first]), *steps]:
        if op == "put":
            for obj in arg:
                objects[object_key(obj)] = obj
            delta = index.apply(upserts=arg)
        else:
            if not objects:
                continue
            key = sorted(objects)[arg % len(objects)]
            del objects[key]
            delta = index.apply(removals=[key])
        _check(index, objects)
        view = _applied(view, delta)
        assert view == (index.addresses, index.authorizations)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(_objects, max_size=6), min_size=1, max_size=5), st.booleans())
def test_update_from_snapshots_equals_full(snapshots, name_changes) -> None:
    """`update(store)` (compare every key) and `update(store, changed)` (only the named keys)."""
    index = AmbientIndex(MeshSettings(root_namespace=ROOT))
    previous: dict = {}
    for snapshot in snapshots:
        objects = {object_key(o): o for o in snapshot}
        store = KubeStore(objects.values())
        if name_changes:
            changed = {k for k in set(objects) | set(previous) if objects.get(k) != previous.get(k)}
            index.update(store, changed)
        else:
            index.update(store)
        _check(index, objects)
        previous = objects


def test_unchanged_objects_produce_an_empty_delta() -> None:
    ns = Namespace(metadata=ObjectMeta(name="ns-a", labels={"istio.io/dataplane-mode": "ambient"}))
    pod = Pod(
        metadata=ObjectMeta(name="p1", namespace="ns-a", labels={"app": "a"}),
        pod_ip="10.0.0.1",
        conditions=(PodCondition(type="Ready", status="True"),),
    )
    svc = Service(
        metadata=ObjectMeta(name="s1", namespace="ns-a"), selector={"app": "a"}, cluster_ip="10.96.0.1"
    )
    index = AmbientIndex()
    first = index.apply([ns, pod, svc])
    assert set(first.addresses) == {"Kubernetes//Pod/ns-a/p1", "ns-a/s1.ns-a.svc.cluster.local"}
    assert not index.apply([ns, pod, svc])  # the same objects again: nothing to push
    relabelled = Pod(metadata=ObjectMeta(name="p1", namespace="ns-a", labels={"app": "b"}), pod_ip="10.0.0.1")
    delta = index.apply([relabelled])
    assert set(delta.addresses) == {"Kubernetes//Pod/ns-a/p1"}  # the service holds no endpoints
    assert not delta.removed_addresses and not delta.authorizations


def _small_mesh(pods: int, services: int) -> list:
    out: list = [Namespace(metadata=ObjectMeta(name=ROOT))]
    out += [
        Namespace(metadata=ObjectMeta(name=ns, labels={"istio.io/dataplane-mode": "ambient"}))
        for ns in ("ns-a", "ns-b")
    ]
    out.append(PeerAuthentication(metadata=ObjectMeta(name="default", namespace=ROOT), mtls_mode="STRICT"))
    for s in range(services):
        ns = ("ns-a", "ns-b")[s % 2]
        out.append(
            Service(
                metadata=ObjectMeta(name=f"s{s}", namespace=ns),
                selector={"app": f"s{s}"},
                cluster_ip=f"10.96.0.{s + 1}",
                ports=(ServicePort(name="http", port=80, target_port="http"),),
            )
        )
        out.append(
            AuthorizationPolicy(
                metadata=ObjectMeta(name=f"ap{s}", namespace=ns),
                selector=LabelSelector(match_labels={"app": f"s{s}"}),
                rules=(AuthorizationRule(sources=(Source(namespaces=(ns,)),)),),
            )
        )
    for k in range(pods):
        s = k % services
        out.append(
            Pod(
                metadata=ObjectMeta(name=f"p{k}", namespace=("ns-a", "ns-b")[s % 2], labels={"app": f"s{s}"}),
                node_name="n1",
                containers=(Container(ports=(ContainerPort(name="http", container_port=8080),)),),
                pod_ip=f"10.244.0.{k + 1}",
                conditions=(PodCondition(type="Ready", status="True"),),
            )
        )
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 10_000), _objects), min_size=1, max_size=6))
def test_a_large_start_then_single_changes(changes) -> None:
    """Start-up translates everything at once; later single changes follow the dependencies."""
    mesh = _small_mesh(pods=80, services=8)
    index = AmbientIndex(MeshSettings(root_namespace=ROOT))
    index.apply(mesh)
    objects = {object_key(o): o for o in mesh}
    _check(index, objects)
    for position, obj in changes:
        if position % 3 == 0:  # replace one of the mesh's objects by a generated one of its kind
            key = sorted(objects)[position % len(objects)]
            del objects[key]
            index.apply(removals=[key])
        objects[object_key(obj)] = obj
        index.apply([obj])
        _check(index, objects)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.booleans(), _pods), min_size=1, max_size=15))
def test_node_index_follows_changed_pods_as_a_rebuild_does(steps) -> None:
    """The CA's node index, updated with only the keys an apply changed, equals a full rebuild."""
    from ambient_mesh.control.plane import KubeNodeIndex

    index = AmbientIndex(MeshSettings(root_namespace=ROOT))
    nodes = KubeNodeIndex("cluster.local")
    objects: dict = {}
    for remove, pod in steps:
        key = object_key(pod)
        if remove and key in objects:
            del objects[key]
            delta = index.apply(removals=[key])
        else:
            objects[key] = pod
            delta = index.apply([pod])
        store = KubeStore(objects.values())
        nodes.update(store, delta.objects)
        fresh = KubeNodeIndex("cluster.local")
        fresh.update(store)
        assert nodes._pods == fresh._pods
        for node in ("n1", "n2", ""):
            assert nodes.identities_on_node(node) == fresh.identities_on_node(node)
