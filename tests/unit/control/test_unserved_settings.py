"""Istio settings a waypoint user may write that this mesh does not serve as written: each is
said where it is applied (`lab apply`, the control plane's log when it reads its directory, the
object's status), and the ones that still act (CUSTOM, mixing route kinds) act as stated."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from envoy.extensions.filters.http.rbac.v3 import rbac_pb2
from google.protobuf import json_format

from ambient_mesh.control.sources import DirectorySource
from ambient_mesh.control.status import compute_status
from ambient_mesh.control.translate import MeshSettings
from ambient_mesh.control.translate.l7_authz import policy_notes, rbac_filters
from ambient_mesh.control.unserved_kinds import UNSERVED_KINDS
from ambient_mesh.control.waypoint_l7 import WaypointL7
from ambient_mesh.errors import ConfigError
from ambient_mesh.kube.load import parse_documents
from ambient_mesh.kube.model import AuthorizationPolicy
from ambient_mesh.kube.store import KubeStore
from ambient_mesh.lab import apply as verbs
from tests.helpers.waypoint_manifests import ROUTE_STATUS_MESH as MESH

API_VERSIONS = {
    "RequestAuthentication": "security.istio.io/v1",
    "DestinationRule": "networking.istio.io/v1",
    "EnvoyFilter": "networking.istio.io/v1alpha3",
    "WasmPlugin": "extensions.istio.io/v1alpha1",
    "Telemetry": "telemetry.istio.io/v1",
    "Sidecar": "networking.istio.io/v1",
    "TCPRoute": "gateway.networking.k8s.io/v1alpha2",
    "TLSRoute": "gateway.networking.k8s.io/v1alpha2",
    "GRPCRoute": "gateway.networking.k8s.io/v1",
}


def doc(kind: str) -> str:
    return f"apiVersion: {API_VERSIONS[kind]}\nkind: {kind}\nmetadata: {{name: x, namespace: demo}}\nspec: {{}}\n"


@pytest.mark.parametrize("kind", sorted(UNSERVED_KINDS))
def test_lab_apply_refuses_each_unserved_kind_saying_what_it_means(kind: str) -> None:
    with pytest.raises(ConfigError) as raised:
        verbs.check(doc(kind), "x.yaml", default_namespace="demo", allow_pods=False)
    assert "not a kind the control plane serves: " + UNSERVED_KINDS[kind] in str(raised.value)


@pytest.mark.parametrize("kind", sorted(UNSERVED_KINDS))
def test_control_logs_each_unserved_kind_when_it_reads_its_directory(
    kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "x.yaml").write_text(doc(kind))
    source = DirectorySource(tmp_path, 1.0)
    caplog.set_level(logging.WARNING, logger="ambient_mesh.control.sources")
    asyncio.run(source.first())
    (line,) = [r.getMessage() for r in caplog.records]
    assert f"{kind} demo/x" in line and line.endswith(UNSERVED_KINDS[kind])
    caplog.clear()
    source._change(source.watcher.poll() or _unchanged(source))
    assert not caplog.records  # said once, not on every change


def _unchanged(source: DirectorySource):  # the watcher reports nothing when nothing moved
    from ambient_mesh.kube.watch import DirectoryChange

    assert source.watcher.last is not None
    return DirectoryChange(result=source.watcher.last, added=(), updated=(), removed=())


CUSTOM = """apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: ext, namespace: demo}
spec:
  targetRefs: [{group: gateway.networking.k8s.io, kind: Gateway, name: waypoint}]
  action: CUSTOM
  provider: {name: my-ext-authz}
  rules: [{to: [{operation: {paths: [/admin]}}]}]
"""


def policy(text: str) -> AuthorizationPolicy:
    (obj,) = parse_documents(text, "p.yaml").objects
    assert isinstance(obj, AuthorizationPolicy)
    return obj


def test_custom_fails_closed_as_istiod_with_a_missing_provider() -> None:
    (rbac,) = rbac_filters([policy(CUSTOM)])
    config = rbac["typed_config"]
    assert config["rules"]["action"] == "DENY"
    assert list(config["rules"]["policies"]) == [
        "istio-ext-authz-ns[demo]-policy[ext]-rule[0]-deny-due-to-bad-CUSTOM-action"
    ]
    json_format.ParseDict({k: v for k, v in config.items() if k != "@type"}, rbac_pb2.RBAC())  # as sent
    (note,) = policy_notes(policy(CUSTOM))
    assert note.startswith("AuthorizationPolicy demo/ext: CUSTOM (ext_authz) is not supported")
    assert "denied (403)" in note


def test_custom_and_request_principals_are_said_at_apply_and_in_status(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    jwt = (
        CUSTOM.replace("name: ext", "name: jwt")
        .replace("action: CUSTOM", "action: ALLOW")
        .replace("  provider: {name: my-ext-authz}\n", "")
        .replace("rules: [{to:", "rules: [{from: [{source: {requestPrincipals: ['*']}}], to:")
    )
    loaded = parse_documents(MESH + "---\n" + CUSTOM + "---\n" + jwt, "m.yaml")
    assert not loaded.errors, loaded.errors
    store = KubeStore(loaded.objects)
    caplog.set_level(logging.WARNING, logger="ambient_mesh.control.waypoint_l7")
    WaypointL7(MeshSettings()).update_policies(store)
    logged = " | ".join(r.getMessage() for r in caplog.records)
    assert "demo/ext: CUSTOM (ext_authz) is not supported" in logged
    assert "demo/jwt: requestPrincipals / trustDomains are not served by the waypoint" in logged
    status = compute_status(store)
    (ext,) = status[("AuthorizationPolicy", "demo", "ext")]
    assert (ext.type, ext.status, ext.reason) == ("WaypointAccepted", True, "UnsupportedValue")
    assert "CUSTOM (ext_authz) is not supported" in ext.message
    # `lab apply` prints it as a warning
    objects = tmp_path / "objects"
    objects.mkdir()
    manifests = verbs.check(MESH + "---\n" + CUSTOM, "m.yaml", default_namespace="demo", allow_pods=False)
    verbs.apply(objects, manifests)
    warnings = verbs.apply_warnings(objects, manifests)
    assert any(
        "AuthorizationPolicy demo/ext: WaypointAccepted=True (UnsupportedValue)" in w for w in warnings
    )


def test_mixing_httproute_and_virtualservice_is_said(caplog: pytest.LogCaptureFixture) -> None:
    routes = """apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: a, namespace: demo}
spec:
  parentRefs: [{group: "", kind: Service, name: web}]
  rules: [{backendRefs: [{name: web, port: 80}]}]
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: b, namespace: demo}
spec:
  hosts: [web]
  http: [{route: [{destination: {host: web}}]}]
"""
    loaded = parse_documents(MESH + "---\n" + routes, "r.yaml")
    assert not loaded.errors, loaded.errors
    caplog.set_level(logging.WARNING, logger="ambient_mesh.control.waypoint_l7")
    l7 = WaypointL7(MeshSettings())
    l7.update(KubeStore(loaded.objects))
    (line,) = [r.getMessage() for r in caplog.records]
    assert "web.demo.svc.cluster.local is routed by HTTPRoute demo/a, VirtualService demo/b" in line
    assert "HTTPRoute rules are tried first" in line
    # the HTTPRoute's catch-all comes first, so the VirtualService's rule is never reached
    (bound,) = l7.routes.rules("web.demo.svc.cluster.local", 80, "demo")
    assert bound.source == "HTTPRoute demo/a"


def test_a_route_to_a_subset_is_said_at_apply(tmp_path: Path) -> None:
    vs = """apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: canary, namespace: demo}
spec:
  hosts: [web]
  http: [{route: [{destination: {host: web, subset: v2}}]}]
"""
    objects = tmp_path / "objects"
    objects.mkdir()
    manifests = verbs.check(MESH + "---\n" + vs, "v.yaml", default_namespace="demo", allow_pods=False)
    lines = verbs.apply(objects, manifests)
    assert (
        "Warning: VirtualService demo/canary: destination web subset 'v2': subsets need a DestinationRule, "
        "not served" in lines
    )
