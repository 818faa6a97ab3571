"""Traffic through the whole mesh on the cluster: pod to pod over HBONE with the caller's
identity checked by the destination's node proxy, an AuthorizationPolicy DENY applied and removed
with kubectl, traffic across restarts of the node agent and the node proxy, and
`ambient ztunnel-config` against the node proxy pod."""

from __future__ import annotations

import json
import re

from .kube import CL, wait_for

CA_ROOT_CERT = "istio-ca-root-cert"


def inbound_from(cluster, ns: str, client_sa: str) -> float:
    """Connections the (only) node proxy opened inbound for `client_sa`'s identity over mTLS."""
    text = cluster.metrics(cluster.ztunnel_pod()["status"]["podIP"])
    total = 0.0
    for line in text.splitlines():
        if not line.startswith("istio_tcp_connections_opened_total{"):
            continue
        if (
            'reporter="destination"' in line
            and f'source_principal="spiffe://cluster.local/ns/{ns}/sa/{client_sa}"' in line
            and 'connection_security_policy="mutual_tls"' in line
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_pod_to_pod_over_hbone_with_the_callers_identity(cluster, mesh):
    ns, url = mesh
    before = inbound_from(cluster, ns, "client")
    assert cluster.http_get(ns, "client", url) == "200"
    after = wait_for(
        lambda: inbound_from(cluster, ns, "client") > before and inbound_from(cluster, ns, "client"), "metric"
    )
    print(
        f"\nGET {url} from {ns}/client: 200; destination proxy counted {after:g} mTLS connections from "
        f"spiffe://cluster.local/ns/{ns}/sa/client"
    )


def test_authorization_policy_deny_applied_and_removed(cluster, mesh):
    ns, url = mesh
    policy = f"""
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: deny-client, namespace: {ns}}}
spec:
  selector: {{matchLabels: {{app: server}}}}
  action: DENY
  rules:
  - from: [{{source: {{principals: ["cluster.local/ns/{ns}/sa/client"]}}}}]
"""
    cluster.apply(policy)
    denied = wait_for(
        lambda: cluster.http_get(ns, "client", url) != "200" and cluster.http_get(ns, "client", url),
        "DENY enforced",
        30,
    )
    cluster.kubectl("delete", "authorizationpolicy", "-n", ns, "deny-client")
    wait_for(
        lambda: cluster.http_get(ns, "client", url) == "200", "traffic restored after the DENY's removal", 30
    )
    print(f"\nwith DENY: {denied}; after removal: 200")


def test_traffic_resumes_after_agent_and_proxy_restarts(cluster, mesh):
    ns, url = mesh
    for label in ("k8s-app=istio-cni-node", "app=ztunnel"):
        (old,) = [p["metadata"]["name"] for p in cluster.system_pods(label)]
        cluster.kubectl("delete", "pod", "-n", "istio-system", old, "--wait=true", timeout=120)
        wait_for(lambda: cluster.http_get(ns, "client", url) == "200", f"traffic after restarting {old}", 120)
    print(f"\nGET {url}: 200 after restarting the node agent and the node proxy")


def test_control_plane_writes_the_root_cert_configmap_in_every_namespace(cluster, mesh):
    ns, _ = mesh
    root = (CL / "mesh-ca" / "root-cert.pem").read_text()

    def configmap():
        out = cluster.kubectl("get", "configmap", "-n", ns, CA_ROOT_CERT, "-o", "json", check=False)
        return json.loads(out) if out.strip().startswith("{") else None

    cm = wait_for(configmap, f"{ns}/{CA_ROOT_CERT}", 60)
    assert cm["data"]["root-cert.pem"] == root and cm["metadata"]["labels"] == {"istio.io/config": "true"}
    # the node proxies' own (istio-system), written by the control plane too: mesh-ca.sh no longer does
    system = json.loads(cluster.kubectl("get", "configmap", "-n", "istio-system", CA_ROOT_CERT, "-o", "json"))
    assert system["data"]["root-cert.pem"] == root
    cluster.kubectl("delete", "configmap", "-n", ns, CA_ROOT_CERT)
    again = wait_for(configmap, f"{ns}/{CA_ROOT_CERT} made again after its deletion", 60)
    assert again["data"]["root-cert.pem"] == root
    print(f"\n{ns}/{CA_ROOT_CERT} and istio-system/{CA_ROOT_CERT} hold the mesh root; deleted, it came back")


def test_ztunnel_config_lists_the_pods(cluster, mesh):
    ns, _ = mesh
    zt = cluster.ztunnel_pod()["metadata"]["name"]
    out = cluster.exec("istio-system", zt, "ambient", "ztunnel-config", "workloads", "-n", ns)
    names = set(re.findall(r"\b(server|client)\b", out))
    assert names == {"server", "client"}, out
    print(f"\nambient ztunnel-config workloads -n {ns} (in {zt}):\n{out}")
