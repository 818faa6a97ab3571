"""targetRef AuthorizationPolicies on a waypoint's TCP chains (translate/tcp_authz.py): istiod's
TCP semantics (an ALLOW rule needing HTTP is left out, a DENY rule loses its HTTP fields), and
the bindings the HTTP chains use."""

from __future__ import annotations

from typing import Any

from envoy.extensions.filters.network.rbac.v3 import rbac_pb2
from google.protobuf import json_format

from ambient_mesh.control.translate.common import MeshSettings
from ambient_mesh.control.translate.tcp_authz import (
    NETWORK_RBAC_FILTER,
    TCP_STAT_PREFIX,
    network_rbac_filters,
)
from ambient_mesh.control.waypoint_envoy import DIRECT_TCP, ServicePort
from ambient_mesh.control.waypoint_l7 import WaypointL7
from ambient_mesh.kube.load import parse_documents
from ambient_mesh.kube.model import AuthorizationPolicy, object_key
from ambient_mesh.kube.store import KubeStore

GATEWAY = "[{group: gateway.networking.k8s.io, kind: Gateway, name: waypoint}]"


def policy(spec: str, *, name: str = "p", refs: str = GATEWAY, annotations: str = "") -> AuthorizationPolicy:
    meta = (
        f"{{name: {name}, namespace: default{', annotations: {' + annotations + '}' if annotations else ''}}}"
    )
    text = f"""apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {meta}
spec:
  targetRefs: {refs}
{spec}"""
    loaded = parse_documents(text, "p.yaml")
    assert not loaded.errors, loaded.errors
    (obj,) = loaded.objects
    assert isinstance(obj, AuthorizationPolicy)
    return obj


def configs(*policies: AuthorizationPolicy) -> list[dict[str, Any]]:
    filters = network_rbac_filters(policies)
    for f in filters:
        assert f["name"] == NETWORK_RBAC_FILTER
        # Envoy's own message takes it (what the listener parse does with the whole chain).
        json_format.ParseDict({k: v for k, v in f["typed_config"].items() if k != "@type"}, rbac_pb2.RBAC())
        assert f["typed_config"]["stat_prefix"] == TCP_STAT_PREFIX
    return [f["typed_config"] for f in filters]


def peer(match: dict[str, Any]) -> dict[str, Any]:
    return {"filter_state": {"key": "io.istio.peer_principal", "string_match": match}}


ANY = {"any": True}


def test_allow_by_principal_matches_the_hbone_peer() -> None:
    (config,) = configs(
        policy(
            "  action: ALLOW\n  rules: [{from: [{source: {principals: [cluster.local/ns/default/sa/client]}}]}]"
        )
    )
    assert config["rules"] == {
        "action": "ALLOW",
        "policies": {
            "ns[default]-policy[p]-rule[0]": {
                "permissions": [ANY],
                "principals": [peer({"exact": "spiffe://cluster.local/ns/default/sa/client"})],
            }
        },
    }


def test_allow_with_only_http_fields_allows_nothing() -> None:
    (config,) = configs(
        policy(
            "  action: ALLOW\n  rules:\n"
            "  - to: [{operation: {methods: [GET]}}]\n"
            "  - from: [{source: {principals: [cluster.local/ns/default/sa/client]}}]\n"
            "    to: [{operation: {paths: [/a]}}]\n"
            "  - when: [{key: 'request.headers[x-a]', values: [b]}]\n"
            "  - from: [{source: {requestPrincipals: ['*']}}]\n"
        )
    )
    # Every rule needs HTTP: none can match a connection, and an ALLOW with no policy denies.
    assert config["rules"] == {"action": "ALLOW", "policies": {}}


def test_allow_keeps_only_the_rules_a_connection_can_match() -> None:
    (config,) = configs(
        policy(
            "  action: ALLOW\n  rules:\n"
            "  - to: [{operation: {hosts: [web]}}, {operation: {ports: ['80']}}]\n"
            "  - to: [{operation: {ports: ['9000'], notPorts: ['9001']}}]\n"
        )
    )
    # One HTTP-only field in any operation drops the whole rule (istiod), the other stays.
    assert config["rules"]["policies"] == {
        "ns[default]-policy[p]-rule[1]": {
            "permissions": [
                {
                    "and_rules": {
                        "rules": [{"destination_port": 9000}, {"not_rule": {"destination_port": 9001}}]
                    }
                }
            ],
            "principals": [ANY],
        }
    }


def test_deny_with_http_fields_still_denies_on_the_rest() -> None:
    (config,) = configs(
        policy(
            "  action: DENY\n  rules:\n"
            "  - from: [{source: {namespaces: [evil], requestPrincipals: ['*']}}]\n"
            "    to: [{operation: {paths: [/admin], methods: [POST]}}]\n"
            "    when: [{key: 'request.headers[x-a]', values: [b]}]\n"
            "  - to: [{operation: {methods: [DELETE]}}]\n"
        )
    )
    assert config["rules"] == {
        "action": "DENY",
        "policies": {
            # The HTTP fields dropped: the namespace alone decides (it denies more).
            "ns[default]-policy[p]-rule[0]": {
                "permissions": [ANY],
                "principals": [peer({"safe_regex": {"regex": ".*/ns/evil/.*"}})],
            },
            # Nothing left: every connection.
            "ns[default]-policy[p]-rule[1]": {"permissions": [ANY], "principals": [ANY]},
        },
    }


def test_ports_namespaces_and_ip_blocks() -> None:
    (config,) = configs(
        policy(
            "  action: ALLOW\n  rules:\n"
            "  - from: [{source: {namespaces: [default], notNamespaces: [kube-system], ipBlocks: [10.0.0.0/8]}}]\n"
            "    to: [{operation: {ports: ['9000', '9001']}}]\n"
            "    when: [{key: destination.port, values: ['9000']}]\n"
        )
    )
    (rule,) = config["rules"]["policies"].values()
    assert rule["permissions"] == [
        {
            "and_rules": {
                "rules": [
                    {"or_rules": {"rules": [{"destination_port": 9000}, {"destination_port": 9001}]}},
                    {"destination_port": 9000},
                ]
            }
        }
    ]
    assert rule["principals"] == [
        {
            "and_ids": {
                "ids": [
                    peer({"safe_regex": {"regex": ".*/ns/default/.*"}}),
                    {"not_id": peer({"safe_regex": {"regex": ".*/ns/kube\\-system/.*"}})},
                    {"source_ip": {"address_prefix": "10.0.0.0", "prefix_len": 8}},
                ]
            }
        }
    ]


def test_order_audit_dry_run_and_custom() -> None:
    found = configs(
        policy("  action: ALLOW\n  rules: [{}]", name="a"),
        policy("  action: DENY\n  rules: [{to: [{operation: {paths: [/x]}}]}]", name="b"),
        policy("  action: AUDIT\n  rules: [{}]", name="c"),
        policy(
            "  action: ALLOW\n  rules: [{to: [{operation: {paths: [/x]}}]}]",
            name="d",
            annotations='istio.io/dry-run: "true"',
        ),
        policy("  action: CUSTOM\n  provider: {name: ext}\n  rules: [{}]", name="e"),
    )
    assert [(c.get("rules", {}).get("action"), "shadow_rules" in c) for c in found] == [
        ("DENY", False),  # CUSTOM without a provider denies what it matches
        ("LOG", False),  # AUDIT only marks
        ("DENY", False),
        ("ALLOW", True),
    ]
    assert list(found[0]["rules"]["policies"]) == [
        "istio-ext-authz-ns[default]-policy[e]-rule[0]-deny-due-to-bad-CUSTOM-action"
    ]
    # The dry-run ALLOW's only rule needs HTTP: in the shadow, it would deny every connection.
    assert found[3]["shadow_rules"] == {"action": "ALLOW", "policies": {}}
    assert found[3]["shadow_rules_stat_prefix"] == "istio_dry_run_allow_"


def test_no_rules_and_no_policies() -> None:
    assert configs() == []
    (config,) = configs(policy("  action: ALLOW"))
    assert config["rules"] == {"action": "ALLOW", "policies": {}}


def sp(host: str, port: int, protocol: str) -> ServicePort:
    return ServicePort(hostname=host, vips=("10.96.0.1",), port=port, protocol=protocol, endpoints=())


def test_bindings_follow_the_http_chains() -> None:
    service_ref = '[{group: "", kind: Service, name: db}]'
    objects = [
        policy("  action: DENY\n  rules: [{}]", name="whole"),
        policy("  action: ALLOW\n  rules: [{}]", name="db-only", refs=service_ref),
    ]
    store = KubeStore(objects)
    l7 = WaypointL7(MeshSettings())
    assert l7.update_policies(store)
    db, other, web = (
        sp("db.default.svc.cluster.local", 5432, "tcp"),
        sp("other.default.svc.cluster.local", 9000, "auto"),
        sp("web.default.svc.cluster.local", 80, "http"),
    )
    out = l7.tcp_filters(("default", "waypoint"), [db, other, web])
    assert set(out) == {db.cluster("tcp"), other.cluster("tcp"), DIRECT_TCP}

    def names(chain: str) -> set[str]:
        return {k for f in out[chain] for k in f["typed_config"]["rules"]["policies"]}

    assert names(db.cluster("tcp")) == {
        "ns[default]-policy[whole]-rule[0]",
        "ns[default]-policy[db-only]-rule[0]",
    }
    assert names(other.cluster("tcp")) == {"ns[default]-policy[whole]-rule[0]"}
    assert names(DIRECT_TCP) == {"ns[default]-policy[whole]-rule[0]"}
    # Another waypoint serving db: the Service's policy only.
    elsewhere = l7.tcp_filters(("default", "elsewhere"), [db, other])
    assert {k for f in elsewhere[db.cluster("tcp")] for k in f["typed_config"]["rules"]["policies"]} == {
        "ns[default]-policy[db-only]-rule[0]"
    }
    assert set(elsewhere) == {db.cluster("tcp")}
    # Unchanged policies: the very same filter lists (the build memo compares by identity).
    again = l7.tcp_filters(("default", "waypoint"), [db, other, web])
    assert all(again[k] is out[k] for k in out)
    assert object_key(objects[0]) in l7.policies
