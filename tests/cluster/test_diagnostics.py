"""The operator's tools against the cluster: the control plane's conditions in a policy's status
(written through the API server's status subresource), `ambient explain --kube` agreeing with
what the traffic did, and `ambient analyze --kube` finding a seeded misconfiguration."""

from __future__ import annotations

import json
import sys

from .kube import KUBECONFIG, run, wait_for


def ambient(*args: str, check: bool = True) -> str:
    return run([sys.executable, "-m", "ambient_mesh", *args], timeout=120, check=check)


def condition(cluster, ns: str, name: str, type_: str) -> dict | None:
    status = cluster.get("authorizationpolicy", "-n", ns, name).get("status") or {}
    return next((c for c in status.get("conditions", []) if c.get("type") == type_), None)


def test_a_policy_ztunnel_cannot_fully_honour_says_so_in_its_status(cluster, mesh):
    ns, url = mesh
    cluster.apply(
        f"""
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: get-only, namespace: {ns}}}
spec:
  selector: {{matchLabels: {{app: server}}}}
  action: ALLOW
  rules: [{{to: [{{operation: {{methods: ["GET"]}}}}]}}]
"""
    )
    try:
        found = wait_for(lambda: condition(cluster, ns, "get-only", "ZtunnelAccepted"), "ZtunnelAccepted", 60)
        assert found["reason"] == "UnsupportedValue" and "HTTP attributes" in found["message"], found
        # What the condition says is what the node proxy does: no rule, so nothing is allowed.
        wait_for(lambda: cluster.http_get(ns, "client", url) != "200", "the L7-only ALLOW refusing", 30)
        print(
            f"\n{ns}/get-only status: {found['type']}={found['status']} ({found['reason']}): {found['message']}"
        )
    finally:
        cluster.kubectl("delete", "authorizationpolicy", "-n", ns, "get-only")
    wait_for(lambda: cluster.http_get(ns, "client", url) == "200", "traffic back after the removal", 30)


def test_explain_on_the_cluster_agrees_with_the_traffic(cluster, mesh):
    ns, url = mesh
    src, dst = f"{ns}/client", f"{ns}/server:8080"

    def explained() -> dict:
        return json.loads(ambient("explain", "--kubeconfig", str(KUBECONFIG), src, dst, "-o", "json"))

    allowed = explained()
    assert allowed["verdict"] == "ALLOWED" and cluster.http_get(ns, "client", url) == "200", allowed
    cluster.apply(
        f"""
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: deny-client, namespace: {ns}}}
spec:
  selector: {{matchLabels: {{app: server}}}}
  action: DENY
  rules: [{{from: [{{source: {{principals: ["cluster.local/ns/{ns}/sa/client"]}}}}]}}]
"""
    )
    try:
        wait_for(lambda: cluster.http_get(ns, "client", url) != "200", "DENY enforced", 30)
        denied = wait_for(lambda: (e := explained())["verdict"] == "DENIED" and e, "explain says DENIED", 30)
        assert denied["policy"] == f"{ns}/deny-client" and denied["rule"] == 0, denied
        print(f"\nexplain {src} -> {dst}: {allowed['verdict']}, then {denied['verdict']}: {denied['reason']}")
    finally:
        cluster.kubectl("delete", "authorizationpolicy", "-n", ns, "deny-client")
    wait_for(lambda: cluster.http_get(ns, "client", url) == "200", "traffic back after the removal", 30)


def test_analyze_on_the_cluster_finds_a_policy_that_selects_nothing(cluster, mesh):
    ns, _ = mesh
    cluster.apply(
        f"""
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: selects-nothing, namespace: {ns}}}
spec:
  selector: {{matchLabels: {{app: no-such-app}}}}
  action: DENY
  rules: [{{from: [{{source: {{namespaces: ["elsewhere"]}}}}]}}]
"""
    )
    try:
        out = ambient("analyze", "--kubeconfig", str(KUBECONFIG), "-n", ns, "-o", "json", check=False)
        mine = [f for f in json.loads(out) if "selects-nothing" in f["resource"]]
        assert [f["code"] for f in mine] == ["IST0127"], out
        print(f"\nanalyze -n {ns}: {mine[0]['code']} {mine[0]['resource']}: {mine[0]['message']}")
    finally:
        cluster.kubectl("delete", "authorizationpolicy", "-n", ns, "selects-nothing")
