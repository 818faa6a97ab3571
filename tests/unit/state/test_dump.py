"""/config_dump shapes (state/dump.py) against a golden file, plus the rules behind them.

The golden file holds every section a fixed local config produces, in ztunnel's JSON shape.
Regenerate it after an intended change with `UPDATE_GOLDEN=1 pytest tests/unit/state/test_dump.py`
and review the diff like code.
"""

from __future__ import annotations

import base64
import json
import os
from datetime import UTC, datetime
from pathlib import Path

from cryptography import x509

from ambient_mesh.config import ProxyWorkloadInfo, ZtunnelConfig
from ambient_mesh.identity.ca import CertificateAuthority
from ambient_mesh.identity.manager import CertificateState
from ambient_mesh.identity.spiffe import Identity
from ambient_mesh.state.dump import (
    build_info,
    dump_cert,
    dump_certificates,
    dump_local_config,
    dump_policies,
    dump_services,
    dump_staged_services,
    dump_static_config,
    dump_workload,
    dump_workload_state,
    dump_workloads,
    split_pems,
)
from ambient_mesh.state.localconfig import parse_local_config
from ambient_mesh.state.model import Workload
from ambient_mesh.state.store import ProxyState
from tests.helpers.paths import UNIT_GOLDEN
from tests.helpers.state_writes import load

GOLDEN = UNIT_GOLDEN / "config_dump.json"
NOW = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)

# Names and addresses invented for this test; every field the dump prints is set somewhere.
LOCAL_CONFIG = """
workloads:
- uid: cluster1//v1/Pod/shop/cart-7f9c
  name: cart-7f9c
  namespace: shop
  serviceAccount: cart
  trustDomain: cluster.local
  workloadIps: ["10.0.1.10", "fd00::10"]
  protocol: HBONE
  node: node-a
  network: net-a
  canonicalName: cart
  canonicalRevision: v2
  workloadName: cart
  workloadType: deployment
  clusterId: cluster1
  capacity: 3
  locality: {region: eu-west, zone: eu-west-1a, subzone: rack-1}
  waypoint: {destination: "shop/waypoint.shop.svc.cluster.local", hboneMtlsPort: 15008}
  authorizationPolicies: ["shop/only-frontend"]
  services:
    "shop/cart.shop.svc.cluster.local": {80: 8080, 443: 8443}
    "shop/not-yet.shop.svc.cluster.local": {9000: 9001}
- uid: cluster1//v1/Pod/shop/web-1a2b
  name: web-1a2b
  namespace: shop
  serviceAccount: frontend
  trustDomain: cluster.local
  workloadIps: ["10.0.1.11"]
  protocol: TCP
  node: node-b
  status: Unhealthy
  waypoint: {destination: "/10.96.0.9"}
  services:
    "shop/cart.shop.svc.cluster.local": {80: 8081}
- uid: cluster1//v1/Pod/shop/waypoint-0
  name: waypoint-0
  namespace: shop
  serviceAccount: waypoint
  trustDomain: cluster.local
  workloadIps: ["10.0.1.9"]
  protocol: HBONE
  node: node-a
  workloadType: pod
  applicationTunnel: {protocol: PROXY, port: 15088}
  services:
    "shop/waypoint.shop.svc.cluster.local": {15008: 15008}
- uid: cluster2//v1/WorkloadEntry/shop/remote
  name: remote
  namespace: shop
  serviceAccount: cart
  trustDomain: cluster.local
  workloadIps: []
  hostname: remote.example.com
  network: net-b
  networkMode: HostNetwork
  nativeTunnel: true
  networkGateway: {destination: "net-b/192.0.2.1", hboneMtlsPort: 15009}
  applicationTunnel: {protocol: NONE}
  workloadType: job
services:
- name: cart
  namespace: shop
  hostname: cart.shop.svc.cluster.local
  vips: ["/10.96.7.7", "net-a/10.96.7.8"]
  ports: {80: 8080, 443: 0}
  subjectAltNames: ["spiffe://cluster.local/ns/shop/sa/cart"]
  canonical: true
  waypoint: {destination: "/10.96.0.9", hboneMtlsPort: 15008}
  ipFamilies: Dual
  loadBalancer:
    routingPreferences: [Network, Region, Zone]
    mode: Failover
    healthPolicy: AllowAll
  endpoints:
    cluster2//v1/WorkloadEntry/shop/remote: {workloadUid: cluster2//v1/WorkloadEntry/shop/remote, port: {80: 18080}, status: Healthy}
- name: waypoint
  namespace: shop
  hostname: waypoint.shop.svc.cluster.local
  vips: ["/10.96.0.9"]
  ports: {15008: 15008}
  visibility: Namespace
  cidrVips: [{network: "", cidr: "10.97.0.0/16"}]
  weightedWaypoints: [{destination: "shop/waypoint.shop.svc.cluster.local", weight: 100}]
policies:
- name: allow-all-from-mesh
  namespace: ""
  scope: Global
  action: Allow
  dryRun: false
  rules:
  - - - principals: [{Presence: []}]
- name: only-frontend
  namespace: shop
  scope: WorkloadSelector
  action: Allow
  dryRun: false
  rules:
  - - - principals: [{Exact: "cluster.local/ns/shop/sa/frontend"}, {Suffix: "/sa/admin"}]
        notPrincipals: [{Prefix: "other.domain/"}]
        destinationPorts: [8080]
        notDestinationPorts: [8443]
      - serviceAccounts: [{namespace: shop, serviceAccount: frontend}]
        notServiceAccounts: [{namespace: shop, serviceAccount: intruder}]
    - - sourceIps: ["10.0.0.0/8", "fd00::1"]
        notSourceIps: ["10.0.9.0/24"]
  - - - destinationIps: ["10.0.1.10/32"]
        notDestinationIps: ["10.0.1.0/30"]
- name: no-debug-port
  namespace: shop
  scope: Namespace
  action: Deny
  dryRun: true
  rules:
  - - - namespaces: [{Exact: shop}, {Prefix: "team-"}, {Suffix: "-dev"}, {Presence: []}]
        notNamespaces: [{Exact: kube-system}]
        destinationPorts: [9999]
  - []
"""

SERVED = ProxyWorkloadInfo(namespace="shop", name="cart-7f9c", service_account="cart")


def state_from(text: str) -> ProxyState:
    local = parse_local_config(text, "test")
    state = ProxyState()
    load(state, local.workloads, local.services, local.policies)
    return state


def certificate_states() -> list[CertificateState]:
    ca = CertificateAuthority.insecure_test_ca()
    ready = Identity("cluster.local", "shop", "cart")
    return [
        CertificateState(identity=Identity("cluster.local", "shop", "web"), state="Initializing", cert=None),
        CertificateState(identity=ready, state="Available", cert=ca.issue(ready, 3600, now=NOW)),
        CertificateState(
            identity=Identity("cluster.local", "shop", "gone"),
            state="Unavailable: the identity is no longer needed",
            cert=None,
        ),
    ]


def stable_certificates(entries: list[dict]) -> list[dict]:
    """The leaf's key and serial are random; everything else is fixed by NOW and the test root."""
    for entry in entries:
        for cert in entry["certChain"]:
            x509.load_pem_x509_certificate(base64.b64decode(cert["pem"]))  # still a real PEM
            assert cert["serialNumber"].isdigit()
            cert["pem"] = cert["serialNumber"] = "<random>"
    return entries


def full_dump() -> dict:
    state = state_from(LOCAL_CONFIG)
    served = next(w for w in state.workloads if w.name == "cart-7f9c")
    connection = {
        "direction": "inbound",
        "src": "10.0.1.11:40000",
        "originalDst": "10.0.1.10:15008",
        "actualDst": "10.0.1.10:8080",
        "protocol": "HBONE",
    }
    return {
        "workloads": dump_workloads(state),
        "services": dump_services(state),
        "policies": dump_policies(state),
        "stagedServices": dump_staged_services(state),
        "staticConfig": dump_local_config(parse_local_config(LOCAL_CONFIG, "test")),
        "certificates": stable_certificates(dump_certificates(certificate_states())),
        "workloadState": dump_workload_state(served=served, info=SERVED, inbound=[connection], outbound=[]),
    }


def test_config_dump_matches_golden() -> None:
    got = json.dumps(full_dump(), indent=2, sort_keys=False) + "\n"
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(got)
    want = GOLDEN.read_text()
    assert got == want, (
        "config_dump changed; if intended, regenerate with UPDATE_GOLDEN=1 and review the diff"
    )


def test_dump_is_plain_json() -> None:
    dump = full_dump()
    assert json.loads(json.dumps(dump)) == dump


# --- rules the golden file relies on, each stated on its own ---------------------------------


def test_workload_omits_empty_fields_as_serde_does() -> None:
    out = dump_workload(Workload(uid="", namespace="ns"))
    # Always printed: workloadIps, protocol, networkMode, name, namespace, status, clusterId, capacity.
    assert out == {
        "workloadIps": [],
        "protocol": "TCP",
        "networkMode": "Standard",
        "name": "",
        "namespace": "ns",
        "workloadType": "deployment",
        "status": "Healthy",
        "clusterId": "",
        "capacity": 1,
    }
    assert list(out)[:3] == ["workloadIps", "protocol", "networkMode"]


def test_workloads_sorted_by_uid_and_services_are_names() -> None:
    state = state_from(LOCAL_CONFIG)
    uids = [w["uid"] for w in dump_workloads(state)]
    assert uids == sorted(uids)
    cart = next(w for w in dump_workloads(state) if w["name"] == "cart-7f9c")
    assert cart["services"] == ["shop/cart.shop.svc.cluster.local", "shop/not-yet.shop.svc.cluster.local"]
    assert cart["waypoint"] == {"destination": "shop/waypoint.shop.svc.cluster.local", "hboneMtlsPort": 15008}


def test_service_endpoints_and_ports_are_string_keyed_and_sorted() -> None:
    cart = next(s for s in dump_services(state_from(LOCAL_CONFIG)) if s["name"] == "cart")
    assert cart["ports"] == {"80": 8080, "443": 0}
    # AllowAll keeps the unhealthy web endpoint; the explicit endpoint from the YAML is kept too.
    assert list(cart["endpoints"]) == sorted(cart["endpoints"])
    assert cart["endpoints"]["cluster1//v1/Pod/shop/web-1a2b"] == {
        "workloadUid": "cluster1//v1/Pod/shop/web-1a2b",
        "port": {"80": 8081},
        "status": "Unhealthy",
    }
    assert cart["ipFamilies"] == "Dual"


def test_unhealthy_endpoint_dropped_without_allow_all() -> None:
    text = LOCAL_CONFIG.replace("healthPolicy: AllowAll", "healthPolicy: OnlyHealthy")
    cart = next(s for s in dump_services(state_from(text)) if s["name"] == "cart")
    assert "cluster1//v1/Pod/shop/web-1a2b" not in cart["endpoints"]


def test_staged_services_hold_endpoints_of_unknown_services() -> None:
    staged = dump_staged_services(state_from(LOCAL_CONFIG))
    assert staged == {
        "shop/not-yet.shop.svc.cluster.local": {
            "cluster1//v1/Pod/shop/cart-7f9c": {
                "workloadUid": "cluster1//v1/Pod/shop/cart-7f9c",
                "port": {"9000": 9001},
                "status": "Healthy",
            }
        }
    }


def test_policies_keyed_and_matches_skip_empty_lists() -> None:
    policies = dump_policies(state_from(LOCAL_CONFIG))
    assert list(policies) == ["/allow-all-from-mesh", "shop/no-debug-port", "shop/only-frontend"]
    deny = policies["shop/no-debug-port"]
    assert deny["rules"][0][0][0]["namespaces"] == [
        {"Exact": "shop"},
        {"Prefix": "team-"},
        {"Suffix": "-dev"},
        {"Presence": []},
    ]
    assert deny["rules"][1] == []
    assert set(deny["rules"][0][0][0]) == {"namespaces", "notNamespaces", "destinationPorts"}
    assert policies["shop/only-frontend"]["rules"][0][1][0]["sourceIps"] == ["10.0.0.0/8", "fd00::1/128"]


def test_static_config_keeps_the_port_maps() -> None:
    static = dump_local_config(parse_local_config(LOCAL_CONFIG, "test"))
    assert static["workloads"][0]["services"] == {
        "shop/cart.shop.svc.cluster.local": {"80": 8080, "443": 8443},
        "shop/not-yet.shop.svc.cluster.local": {"9000": 9001},
    }
    assert [p["name"] for p in static["policies"]] == [
        "allow-all-from-mesh",
        "only-frontend",
        "no-debug-port",
    ]


def test_static_config_reread_from_file_or_null(tmp_path: Path) -> None:
    path = tmp_path / "local.yaml"
    path.write_text(LOCAL_CONFIG)
    config = ZtunnelConfig(local_xds_path=str(path))
    assert dump_static_config(config.local_config_source)["services"][0]["name"] == "cart"
    inline = ZtunnelConfig(local_xds=LOCAL_CONFIG)
    assert dump_static_config(inline.local_config_source) == dump_static_config(config.local_config_source)
    path.write_text("workloads: [")  # broken after start: the dump still answers
    assert dump_static_config(config.local_config_source) is None
    path.unlink()  # gone after start: the same
    assert dump_static_config(config.local_config_source) is None
    assert dump_static_config(ZtunnelConfig().local_config_source) is None


def test_certificate_dump_decimal_serial_and_rfc3339() -> None:
    ca = CertificateAuthority.insecure_test_ca()
    cert = dump_cert(ca.root_pem)
    root = ca.roots[0]
    assert cert["serialNumber"] == str(root.serial_number)
    assert base64.b64decode(cert["pem"]) == ca.root_pem
    assert cert["validFrom"].endswith("Z") and "." not in cert["validFrom"]
    assert datetime.strptime(cert["expirationTime"], "%Y-%m-%dT%H:%M:%SZ").replace(
        tzinfo=UTC
    ) == root.not_valid_after_utc.replace(microsecond=0)


def test_certificates_only_show_chains_when_available() -> None:
    entries = dump_certificates(certificate_states())
    assert [e["identity"] for e in entries] == sorted(e["identity"] for e in entries)
    by_state = {e["state"].split(":")[0]: e for e in entries}
    assert by_state["Initializing"]["certChain"] == [] and by_state["Unavailable"]["rootCerts"] == []
    available = by_state["Available"]
    assert len(available["certChain"]) == 1 and len(available["rootCerts"]) == 1
    assert available["certChain"][0]["validFrom"] == "2025-01-02T03:04:05Z"


def test_split_pems() -> None:
    root = CertificateAuthority.insecure_test_ca().root_pem
    assert split_pems(b"junk\n" + root + root) == [root, root]
    assert split_pems(b"") == []


def test_workload_state_up_pending_and_absent() -> None:
    served = Workload(uid="u1", name="cart", namespace="shop", service_account="cart")
    conn = {"direction": "outbound", "src": "a", "originalDst": "b", "actualDst": "c", "protocol": "TCP"}
    up = dump_workload_state(served=served, info=SERVED, inbound=[], outbound=[conn])
    assert up == {
        "u1": {
            "state": "Up",
            "info": {"name": "cart", "namespace": "shop", "serviceAccount": "cart"},
            "connections": {
                "inbound": [],
                "outbound": [{"src": "a", "originalDst": "b", "actualDst": "c", "protocol": "TCP"}],
            },
        }
    }
    pending = dump_workload_state(served=None, info=SERVED, inbound=[], outbound=[])
    assert pending["shop/cart-7f9c/cart"]["state"] == "Pending"
    assert dump_workload_state(served=None, info=None, inbound=[], outbound=[]) == {}


def test_build_info() -> None:
    info = build_info("1.2.3")
    assert info["version"] == "1.2.3" and info["pythonVersion"]
