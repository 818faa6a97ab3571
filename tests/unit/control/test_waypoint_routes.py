"""Waypoint routes: HTTPRoute and VirtualService -> each HTTP chain's Envoy RouteConfiguration.

Each tests/unit/golden/waypoint_routes/<case>/input/*.yaml is loaded and translated as
`ambient control` does; every HTTP chain's route configuration (its RDS resource) and HTTP
filters (from the internal listeners, as Envoy receives them) are compared with
<case>/expected.json.
`UPDATE_GOLDEN=1` rewrites the expected files: read each one before accepting it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from google.protobuf import json_format

from ambient_mesh.control.translate import MeshSettings, translate
from ambient_mesh.control.translate.http_routes import RouteTable, notes
from ambient_mesh.control.waypoint_index import WaypointIndex, waypoint_key
from ambient_mesh.kube.load import load_directory, parse_documents
from ambient_mesh.kube.store import KubeStore
from tests.helpers.paths import UNIT_GOLDEN

GOLDEN = UNIT_GOLDEN / "waypoint_routes"
UPDATE_GOLDEN = os.environ.get("UPDATE_GOLDEN") == "1"
CASES = sorted(p.name for p in GOLDEN.iterdir() if (p / "input").is_dir())
WAYPOINT = "default/waypoint.default.svc.cluster.local"


def _store(case: str) -> KubeStore:
    loaded = load_directory(GOLDEN / case / "input")
    assert loaded.errors == (), [str(e) for e in loaded.errors]
    return loaded.store


def _index(store: KubeStore) -> WaypointIndex:
    index = WaypointIndex(MeshSettings())
    index.update_l7(store)
    index.reset(translate(store, MeshSettings()).addresses)
    return index


def http_chains(index: WaypointIndex, key: str = WAYPOINT) -> dict[str, Any]:
    """Per chain: an HTTP chain's routes and HTTP filters, a TCP chain's network RBAC filters."""
    out: dict[str, Any] = {}
    resources = index.resources(key)
    for name, message in resources.listeners.items():
        if name == "connect_terminate":
            continue
        for chain in json_format.MessageToDict(message).get("filterChains", []):
            for f in chain["filters"]:
                if f["name"] == "envoy.filters.network.rbac":
                    out.setdefault(chain["name"], {"networkFilters": []})["networkFilters"].append(f)
                if f["name"] == "envoy.filters.network.http_connection_manager":
                    hcm = f["typedConfig"]
                    # The chain's routes come over RDS, under the chain's own name.
                    assert hcm["rds"]["routeConfigName"] == chain["name"], hcm["rds"]
                    out[chain["name"]] = {
                        "routeConfig": json_format.MessageToDict(resources.routes[chain["name"]]),
                        "httpFilters": hcm["httpFilters"],
                    }
    return out


@pytest.mark.parametrize("case", CASES)
def test_golden(case: str) -> None:
    store = _store(case)
    index = _index(store)
    doc = {
        waypoint_key(gw.metadata.namespace, gw.metadata.name, "cluster.local"): http_chains(
            index, waypoint_key(gw.metadata.namespace, gw.metadata.name, "cluster.local")
        )
        for gw in store.gateways
    }
    text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    path = GOLDEN / case / "expected.json"
    if UPDATE_GOLDEN:
        path.write_text(text)
    assert path.exists(), f"golden file {path} missing: run with UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(), f"route configuration differs from {path} (UPDATE_GOLDEN=1 regenerates)"


def test_unsupported_fields_are_reported() -> None:
    store = _store("routes")
    vs = store.get("VirtualService", "default", "echo")
    assert vs is not None
    assert notes(vs) == (
        "VirtualService default/echo: spec.http[1].match[0].sourceLabels: a waypoint cannot match on "
        "sourceLabels; this match is dropped",
    )


def test_a_typo_or_a_bad_duration_is_an_error_with_its_path() -> None:
    text = """
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: r, namespace: default}
spec:
  parentRefs: [{kind: Service, group: "", name: web}]
  rules: [{timeouts: {request: 5 seconds}, backendRefs: [{name: web, port: 80}]}]
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: v, namespace: default}
spec:
  hosts: [web]
  http: [{route: [{destination: {host: web}}], retry: {attempts: 1}}]
"""
    result = parse_documents(text, "r.yaml")
    assert result.objects == ()
    assert [(e.field, e.message) for e in result.errors] == [
        ("spec.rules[0].timeouts.request", "'5 seconds' is not a duration (for example 10s, 500ms, 1m30s)"),
        ("spec.http[0].retry", result.errors[1].message),
    ]
    assert result.errors[1].message.startswith("unknown field")


def test_a_route_change_rebuilds_only_the_waypoints_serving_its_host() -> None:
    store = _store("routes")
    index = _index(store)
    before = index.snapshot(WAYPOINT)
    assert index.apply({}) == set()
    objects = [o for o in store.all() if o.kind != "VirtualService"]
    changed = KubeStore(objects)
    index.update_l7(changed)
    assert index.apply({}) == {WAYPOINT}
    after = index.snapshot(WAYPOINT)
    assert after is not before
    chains = http_chains(index)
    routes = chains["inbound-vip|8000|http|echo.default.svc.cluster.local"]["routeConfig"]
    assert [r["name"] for r in routes["virtualHosts"][0]["routes"]] == ["default"]


def test_route_table_orders_by_gateway_precedence_then_age() -> None:
    text = """
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: young, namespace: default, creationTimestamp: "2026-02-01T00:00:00Z"}
spec:
  parentRefs: [{kind: Service, group: "", name: web}]
  rules: [{matches: [{path: {value: /a}}], backendRefs: [{name: web, port: 80}]}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: old, namespace: default, creationTimestamp: "2026-01-01T00:00:00Z"}
spec:
  parentRefs: [{kind: Service, group: "", name: web}]
  rules:
  - matches: [{path: {value: /a}}]
    backendRefs: [{name: web, port: 80}]
  - matches: [{path: {value: /a/b}}, {path: {type: Exact, value: /z}}, {path: {value: /a}, method: GET}]
    backendRefs: [{name: web, port: 80}]
"""
    result = parse_documents(text, "r.yaml")
    assert result.errors == ()
    table = RouteTable("cluster.local")
    assert table.update(KubeStore(result.objects)) == {"web.default.svc.cluster.local"}
    order = [
        (b.source, b.rule.matches[0].path.value if b.rule.matches[0].path else "", b.rule.matches[0].method)
        for b in table.rules("web.default.svc.cluster.local", 80, "default")
    ]
    assert order == [
        ("HTTPRoute default/old", "/z", ""),
        ("HTTPRoute default/old", "/a/b", ""),
        ("HTTPRoute default/old", "/a", "GET"),
        ("HTTPRoute default/old", "/a", ""),
        ("HTTPRoute default/young", "/a", ""),
    ]


def test_policies_bind_only_through_target_refs() -> None:
    from ambient_mesh.control.translate.l7_authz import Attachment, attachments

    text = """
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: a, namespace: default}
spec:
  targetRefs:
  - {group: gateway.networking.k8s.io, kind: Gateway, name: waypoint}
  - {group: "", kind: Service, name: web}
  - {group: gateway.networking.k8s.io, kind: GatewayClass, name: istio-waypoint}
  - {group: gateway.networking.k8s.io, kind: Gateway, name: other, namespace: elsewhere}
"""
    (policy,) = parse_documents(text, "p.yaml").objects
    # The GatewayClass binds only from the root namespace; a ref to another namespace never.
    assert attachments(policy, "istio-system", "cluster.local") == [  # type: ignore[arg-type]
        Attachment(waypoint=("default", "waypoint")),
        Attachment(service="web.default.svc.cluster.local"),
    ]
    store = _store("authz")
    chains = http_chains(_index(store))
    text_all = json.dumps(chains)
    assert "selector-only" not in text_all
    assert "deny-admin" in json.dumps(chains["inbound-vip|80|http|web.default.svc.cluster.local"])
    assert "deny-admin" not in json.dumps(chains["inbound-vip|80|http|v2.default.svc.cluster.local"])


def test_cached_rebuilds_equal_a_fresh_build() -> None:
    from ambient_mesh.control.waypoint_envoy import build_resources

    store = _store("authz")
    index = _index(store)
    index.snapshot(WAYPOINT)
    routes = _store("routes")
    objects = [o for o in store.all()] + [
        o for o in routes.all() if o.kind in ("HTTPRoute", "VirtualService")
    ]
    changed = KubeStore(objects)
    index.update_l7(changed)
    assert index.apply({}) == {WAYPOINT}
    cached = index.resources(WAYPOINT)
    fresh = build_resources(index.inputs(WAYPOINT))
    for kind in ("listeners", "clusters", "endpoints"):
        a, b = getattr(cached, kind), getattr(fresh, kind)
        assert {k: v.SerializeToString(deterministic=True) for k, v in a.items()} == {
            k: v.SerializeToString(deterministic=True) for k, v in b.items()
        }, kind
    assert index._parse_caches[WAYPOINT].hits > 0
