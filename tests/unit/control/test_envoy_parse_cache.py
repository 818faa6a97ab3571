"""The waypoint build memo (envoy_parse_cache.py, waypoint_envoy.py `_cached_build`, the
per-chain and per-service memos of waypoint_l7.py and waypoint_index.py) held to the uncached
path: after every change of a random sequence, the kept, incrementally updated waypoint builds
exactly the resources a build from nothing (no memo, no cache) gives for the same objects."""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format
from hypothesis import given, settings
from hypothesis import strategies as st

from ambient_mesh.control.ads_state import (
    CLUSTER_TYPE_URL,
    ENDPOINT_TYPE_URL,
    LISTENER_TYPE_URL,
    ROUTE_TYPE_URL,
)
from ambient_mesh.control.envoy_parse_cache import ParseCache
from ambient_mesh.control.translate import AmbientIndex, MeshSettings
from ambient_mesh.control.waypoint_envoy import EnvoyResources, build_resources
from ambient_mesh.control.waypoint_index import WaypointIndex
from ambient_mesh.kube.load import parse_documents
from ambient_mesh.kube.model import KubeObject, ObjectKey, object_key
from ambient_mesh.kube.store import KubeStore
from tests.helpers.waypoint_manifests import WAYPOINT_BASE

WAYPOINT = "default/waypoint.default.svc.cluster.local"
KINDS = {
    "listeners": LISTENER_TYPE_URL,
    "clusters": CLUSTER_TYPE_URL,
    "endpoints": ENDPOINT_TYPE_URL,
    "routes": ROUTE_TYPE_URL,
}
# For all traffic: pods that use it bring workload-addressed chains (direct-http, direct-tcp)
# whose ports take their protocols from the Services they serve.
BASE = WAYPOINT_BASE.replace("waypoint-for: service", "waypoint-for: all")
assert BASE != WAYPOINT_BASE

SERVICES = 4
PROTOCOLS = ("http", "tcp", "")


def service(i: int, protocol: str, uses_waypoint: bool) -> str:
    label = "{istio.io/use-waypoint: waypoint}" if uses_waypoint else "{}"
    proto = f", appProtocol: {protocol}" if protocol else ""
    return f"""apiVersion: v1
kind: Service
metadata: {{name: svc-{i}, namespace: default, labels: {label}}}
spec: {{selector: {{app: app-{i}}}, clusterIP: 10.97.0.{i + 1}, ports: [{{name: web, port: 80, targetPort: 8080{proto}}}]}}"""


def pod(i: int, n: int, ready: bool, uses_waypoint: bool = False) -> str:
    status = "True" if ready else "False"
    label = ", istio.io/use-waypoint: waypoint" if uses_waypoint else ""
    return f"""apiVersion: v1
kind: Pod
metadata: {{name: app-{i}-{n}, namespace: default, labels: {{app: app-{i}{label}}}}}
spec: {{nodeName: node-a, serviceAccountName: app-{i}}}
status: {{phase: Running, podIP: 10.1.{i}.{n + 1}, conditions: [{{type: Ready, status: "{status}"}}]}}"""


def route(i: int, parent: int, path: str, backend: int, kind: str) -> str:
    if kind == "HTTPRoute":
        return f"""apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {{name: route-{i}, namespace: default}}
spec:
  parentRefs: [{{group: "", kind: Service, name: svc-{parent}, port: 80}}]
  rules:
  - matches: [{{path: {{type: PathPrefix, value: {path}}}}}]
    backendRefs: [{{name: svc-{backend}, port: 80, weight: 3}}, {{name: svc-{parent}, port: 80, weight: 1}}]"""
    return f"""apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {{name: route-{i}, namespace: default}}
spec:
  hosts: [svc-{parent}.default.svc.cluster.local]
  http:
  - match: [{{uri: {{prefix: {path}}}}}]
    fault: {{abort: {{httpStatus: 418, percentage: {{value: 100}}}}}}
    route: [{{destination: {{host: svc-{backend}.default.svc.cluster.local}}}}]"""


def policy(i: int, target: int | None, path: str, action: str = "DENY") -> str:
    ref = (
        "{group: gateway.networking.k8s.io, kind: Gateway, name: waypoint}"
        if target is None
        else f'{{group: "", kind: Service, name: svc-{target}}}'
    )
    return f"""apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: policy-{i}, namespace: default}}
spec:
  targetRefs: [{ref}]
  action: {action}
  rules: [{{to: [{{operation: {{paths: ["{path}"]}}}}]}}]"""


PATHS = st.sampled_from(["/a", "/b", "/a/b", "/c"])
state = st.fixed_dictionaries(
    {
        "services": st.lists(
            st.tuples(st.sampled_from(PROTOCOLS), st.booleans()), min_size=SERVICES, max_size=SERVICES
        ),
        "pods": st.lists(
            st.tuples(st.integers(0, SERVICES - 1), st.integers(0, 1), st.booleans(), st.booleans()),
            max_size=5,
        ),
        "routes": st.lists(
            st.tuples(
                st.integers(0, 2),
                st.integers(0, SERVICES - 1),
                PATHS,
                st.integers(0, SERVICES - 1),
                st.sampled_from(["HTTPRoute", "VirtualService"]),
            ),
            max_size=4,
        ),
        "policies": st.lists(
            st.tuples(
                st.integers(0, 2),
                st.one_of(st.none(), st.integers(0, SERVICES - 1)),
                PATHS,
                st.sampled_from(["DENY", "ALLOW", "CUSTOM"]),
            ),
            max_size=3,
        ),
    }
)


def documents(s: dict[str, Any]) -> list[str]:
    docs = [service(i, proto, uses) for i, (proto, uses) in enumerate(s["services"])]
    docs += [pod(*p) for p in {(p[0], p[1]): p for p in s["pods"]}.values()]
    docs += [route(*r) for r in {r[0]: r for r in s["routes"]}.values()]
    docs += [policy(*p) for p in {p[0]: p for p in s["policies"]}.values()]
    return docs


class Objects:
    """Each document parsed once: an unchanged document is the same object, as the directory
    watcher hands on an unchanged file's objects."""

    def __init__(self) -> None:
        self._parsed: dict[str, KubeObject] = {}

    def __call__(self, docs: list[str]) -> dict[ObjectKey, KubeObject]:
        out = {}
        for text in docs:
            obj = self._parsed.get(text)
            if obj is None:
                loaded = parse_documents(text, "t.yaml")
                assert not loaded.errors, loaded.errors
                (obj,) = loaded.objects
                self._parsed[text] = obj
            out[object_key(obj)] = obj
        return out


def serialized(resources: EnvoyResources) -> dict[str, dict[str, bytes]]:
    return {
        kind: {k: v.SerializeToString(deterministic=True) for k, v in getattr(resources, kind).items()}
        for kind in KINDS
    }


def from_nothing(store: KubeStore) -> EnvoyResources:
    settings = MeshSettings()
    index, waypoints = AmbientIndex(settings), WaypointIndex(settings)
    delta = index.update(store, None)
    waypoints.update_l7(store, None)
    waypoints.apply(delta.addresses, delta.removed_addresses)
    return build_resources(waypoints.inputs(WAYPOINT))  # no ParseCache


@settings(max_examples=40, deadline=None)
@given(st.lists(state, min_size=2, max_size=6))
def test_incremental_cached_builds_equal_builds_from_nothing(states: list[dict[str, Any]]) -> None:
    parse = Objects()
    base = parse(BASE.split("\n---\n"))
    settings_ = MeshSettings()
    index, waypoints = AmbientIndex(settings_), WaypointIndex(settings_)
    objects: dict[ObjectKey, KubeObject] = {}
    first = True
    for s in states:
        new = base | parse(documents(s))
        changed = [k for k in set(objects) | set(new) if objects.get(k) is not new.get(k)]
        objects = new
        store = KubeStore(objects.values())
        delta = index.update(store, None if first else changed)
        waypoints.update_l7(store, None if first else changed)
        waypoints.apply(delta.addresses, delta.removed_addresses)
        if first:
            waypoints.snapshot(WAYPOINT)
            first = False
        fresh = serialized(from_nothing(store))
        assert serialized(waypoints.resources(WAYPOINT)) == fresh
        # What is pushed: the snapshot `apply` kept up to date, rebuilt only for the waypoints a
        # change touched (a Service's change reaches the waypoints of the pods serving it).
        snap = waypoints.snapshot(WAYPOINT)
        pushed = {kind: {n: v.resource.value for n, v in snap.of(url).items()} for kind, url in KINDS.items()}
        assert pushed == fresh


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2), st.integers(0, 2)), max_size=30))
def test_memo_gives_what_make_parses_to(calls: list[tuple[int, int, int]]) -> None:
    """Keys and held objects in any order across builds: the message is always the one the
    builder's JSON parses to, whatever was kept."""
    from envoy.config.cluster.v3 import cluster_pb2 as cpb

    held_objects = [object(), object(), object()]
    cache = ParseCache()
    for n, (key, held, value) in enumerate(calls):
        # The caller's promise: (key, held) determines the document.
        doc = {"name": f"c{key}-{held}", "connect_timeout": f"{(key * 3 + held) % 7 + 1}s"}
        got = cache.memo(("c", key), (held_objects[held],), lambda d=doc: d, cpb.Cluster)
        want = cpb.Cluster()
        json_format.ParseDict(doc, want)
        assert got == want
        if value == 0 or n % 5 == 4:
            cache.end_build()
