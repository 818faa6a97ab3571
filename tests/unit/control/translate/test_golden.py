"""Golden tests for the control plane's translation (Kubernetes objects -> Address/Authorization).

Each tests/unit/golden/translate/<case>/input/*.yaml is translated and compared with
<case>/expected.json (json_format.MessageToDict per resource, keys sorted). `UPDATE_GOLDEN=1`
rewrites the expected files: read each one before accepting it.
"""

from __future__ import annotations

import ipaddress
import json
import os

import pytest
from google.protobuf import json_format

from ambient_mesh.control.translate import (
    MeshSettings,
    translate,
)
from ambient_mesh.kube.load import load_directory
from ambient_mesh.kube.store import KubeStore
from ambient_mesh.wire.istio.security import authorization_pb2 as sec
from ambient_mesh.wire.istio.workload import workload_pb2 as wl
from tests.helpers.paths import UNIT_GOLDEN

GOLDEN = UNIT_GOLDEN / "translate"
UPDATE_GOLDEN = os.environ.get("UPDATE_GOLDEN") == "1"
CASES = sorted(p.name for p in GOLDEN.iterdir() if (p / "input").is_dir())


def _render(case: str) -> str:
    loaded = load_directory(GOLDEN / case / "input")
    assert loaded.errors == (), [str(e) for e in loaded.errors]
    result = translate(loaded.store, MeshSettings())
    doc = {
        "addresses": {k: json_format.MessageToDict(v) for k, v in result.addresses.items()},
        "authorizations": {k: json_format.MessageToDict(v) for k, v in result.authorizations.items()},
        "notes": sorted(result.notes),
    }
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


@pytest.mark.parametrize("case", CASES)
def test_golden(case: str) -> None:
    text = _render(case)
    path = GOLDEN / case / "expected.json"
    if UPDATE_GOLDEN:
        path.write_text(text)
    assert path.exists(), f"golden file {path} missing: run with UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(), f"translation differs from {path} (UPDATE_GOLDEN=1 regenerates)"


def test_every_case_is_covered() -> None:
    assert set(CASES) >= {
        "workloads",
        "services",
        "waypoints",
        "serviceentry",
        "authorization",
        "peerauthentication",
    }


# Spot checks on the wire objects themselves, so the golden files are not the only guard.


def _case(case: str):
    return translate(load_directory(GOLDEN / case / "input").store)


def test_workload_fields_follow_istiod() -> None:
    t = _case("workloads")
    web = t.addresses["Kubernetes//Pod/ambient-ns/web-7d4f8b9c6-abcde"].workload
    assert web.tunnel_protocol == wl.HBONE
    assert web.workload_name == "web" and web.workload_type == wl.POD
    assert (web.canonical_name, web.canonical_revision) == ("web", "v2")
    assert web.addresses == [ipaddress.ip_address("10.0.0.5").packed]
    assert web.trust_domain == "" and web.cluster_id == "Kubernetes"
    assert (web.locality.region, web.locality.zone, web.locality.subzone) == (
        "eu-west",
        "eu-west-1a",
        "rack-3",
    )
    assert t.addresses["Kubernetes//Pod/ambient-ns/optout"].workload.tunnel_protocol == wl.NONE
    assert t.addresses["Kubernetes//Pod/ambient-ns/sidecar"].workload.tunnel_protocol == wl.NONE
    hostnet = t.addresses["Kubernetes//Pod/ambient-ns/hostnet"].workload
    assert hostnet.network_mode == wl.HOST_NETWORK and hostnet.status == wl.UNHEALTHY
    assert hostnet.service_account == "default"
    assert "Kubernetes//Pod/ambient-ns/finished" not in t.addresses
    assert "Kubernetes//Pod/ambient-ns/pending" not in t.addresses
    assert t.addresses["Kubernetes//Pod/ambient-ns/deleting"].workload.status == wl.UNHEALTHY
    cron = t.addresses["Kubernetes//Pod/plain-ns/report-28000000-xyz12"].workload
    assert cron.workload_name == "report" and len(cron.addresses) == 2
    native = t.addresses["Kubernetes//Pod/plain-ns/native"].workload
    assert native.tunnel_protocol == wl.HBONE and native.native_tunnel


def test_named_target_port_resolves_per_pod() -> None:
    t = _case("services")
    a = t.addresses["Kubernetes//Pod/shop/catalog-a"].workload.services["shop/catalog.shop.svc.cluster.local"]
    b = t.addresses["Kubernetes//Pod/shop/catalog-b"].workload.services["shop/catalog.shop.svc.cluster.local"]
    assert {(p.service_port, p.target_port) for p in a.ports} >= {(80, 8080), (9000, 9100), (7070, 7070)}
    assert 9000 not in {p.service_port for p in b.ports}  # its api-port is UDP
    svc = t.addresses["shop/catalog.shop.svc.cluster.local"].service
    assert {p.service_port: p.target_port for p in svc.ports}[9000] == 0
    assert "shop/external.shop.svc.cluster.local" not in t.addresses


def test_waypoint_attachment() -> None:
    t = _case("waypoints")
    svc = t.addresses["app-ns/svc-ns-waypoint.app-ns.svc.cluster.local"].service
    assert svc.waypoint.hostname.hostname == "waypoint.app-ns.svc.cluster.local"
    assert svc.waypoint.hbone_mtls_port == 15008
    assert not t.addresses["app-ns/svc-opt-out.app-ns.svc.cluster.local"].service.HasField("waypoint")
    assert not t.addresses["app-ns/waypoint.app-ns.svc.cluster.local"].service.HasField("waypoint")
    own = t.addresses["app-ns/svc-own.app-ns.svc.cluster.local"].service
    assert (
        own.waypoint.address.address == ipaddress.ip_address("10.96.1.2").packed and own.ingress_use_waypoint
    )
    assert not t.addresses["Kubernetes//Pod/app-ns/a-1"].workload.HasField("waypoint")
    assert t.addresses["Kubernetes//Pod/app-ns/b-1"].workload.HasField("waypoint")
    assert t.addresses["Kubernetes//Pod/other-ns/c-1"].workload.HasField("waypoint")
    assert not t.addresses["other-ns/svc-cross.other-ns.svc.cluster.local"].service.HasField("waypoint")
    tunnel = t.addresses["Kubernetes//Pod/app-ns/wl-waypoint-0"].workload.application_tunnel
    assert (tunnel.protocol, tunnel.port) == (wl.ApplicationTunnel.PROXY, 15088)


def test_authorization_rules() -> None:
    t = _case("authorization")
    auth = t.authorizations
    assert auth["istio-system/mesh-deny-legacy"].scope == sec.GLOBAL
    assert auth["bank/ns-allow"].scope == sec.NAMESPACE
    assert auth["bank/ledger-allow"].scope == sec.WORKLOAD_SELECTOR
    # Two of five rules use HTTP attributes and are dropped; the empty rule has no clauses.
    rules = auth["bank/ledger-allow"].rules
    assert len(rules) == 2 and len(rules[1].clauses) == 0
    deny = auth["bank/ledger-deny"].rules[0]
    assert [m.ByteSize() for m in deny.clauses[0].matches] == [0]  # `to` paths removed
    assert len(auth["bank/front-allow-nothing"].rules) == 0
    for absent in ("audit", "custom", "for-waypoint", "trial"):
        assert f"bank/{absent}" not in auth
    ledger = t.addresses["Kubernetes//Pod/bank/ledger-0"].workload
    assert list(ledger.authorization_policies) == [
        "bank/ledger-allow",
        "bank/ledger-deny",
        "istio-system/core-ports",
    ]
    sa = auth["bank/ns-allow"].rules[0].clauses[1].matches[1].service_accounts
    assert [(m.namespace, m.serviceAccount) for m in sa] == [("ops", "deployer"), ("bank", "auditor")]
    assert any("AUDIT" in n for n in t.notes) and any("dry-run" in n for n in t.notes)


def test_peer_authentication() -> None:
    t = _case("peerauthentication")
    strict = t.authorizations["istio-system/istio_converted_static_strict"]
    assert strict.action == sec.DENY and strict.scope == sec.WORKLOAD_SELECTOR
    assert strict.rules[0].clauses[0].matches[0].not_principals[0].HasField("presence")

    def policies(pod: str) -> list[str]:
        return list(t.addresses[f"Kubernetes//Pod/{pod}"].workload.authorization_policies)

    assert policies("strict-ns/other-0") == ["istio-system/istio_converted_static_strict"]
    assert policies("strict-ns/api-0") == ["strict-ns/converted_peer_authentication_metrics-open"]
    assert policies("loose-ns/plain-0") == []
    assert policies("loose-ns/pay-0") == ["loose-ns/converted_peer_authentication_pay-strict-port"]
    assert policies("loose-ns/probe-0") == ["loose-ns/converted_peer_authentication_probe-hole"]
    assert policies("loose-ns/secure-0") == ["istio-system/istio_converted_static_strict"]
    assert "loose-ns/converted_peer_authentication_secure" not in t.authorizations


def test_no_peer_authentication_means_no_static_policy() -> None:
    t = translate(KubeStore())
    assert t.authorizations == {} and t.addresses == {}


def test_settings_change_names_and_trust_domain() -> None:
    store = load_directory(GOLDEN / "peerauthentication" / "input").store
    t = translate(store, MeshSettings(trust_domain="example.org", cluster_id="east", root_namespace="mesh"))
    w = t.addresses["east//Pod/loose-ns/plain-0"].workload
    assert w.trust_domain == "example.org" and w.cluster_id == "east"
    assert "mesh/istio_converted_static_strict" in t.authorizations


def test_translation_is_deterministic() -> None:
    """Translating the same objects twice gives byte-identical resources, so the ADS server's
    content hashes (ads_state) only change when the content does."""

    def wire(addresses):
        return {name: pb.SerializeToString(deterministic=True) for name, pb in addresses.items()}

    old = translate(load_directory(GOLDEN / "workloads" / "input").store).addresses
    again = translate(load_directory(GOLDEN / "workloads" / "input").store).addresses
    assert wire(old) == wire(again)


def test_repr_says_what_it_holds() -> None:
    t = _case("services")
    assert repr(t).startswith("Translation(2 workloads, 4 services")
