"""Upgrades of the data plane on the cluster, with bound service-account tokens (issue 31).

- The cluster runs with bound tokens (scripts/cluster/up.sh: BoundServiceAccountTokenVolume on
  1.20-1.21, always from 1.22): a pod's token names its pod and is refused once the pod is gone.
- The CNI plugin's kubeconfig carries a token of its own narrow account (`istio-cni-plugin`),
  requested by the node agent with a TokenRequest and not bound to the agent's pod.
- While the node agent is being replaced (its new pod held back by an init container), a pod
  outside the mesh starts; an ambient pod waits (fail closed) and is captured once the agent is
  back. Before, the plugin carried the agent's pod-bound token, and no pod could start.
- With DaemonSet maxSurge (Kubernetes 1.22+), a rollout of the node proxy keeps a long-lived
  stream and a request loop working (errors and duration printed).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time

import pytest

from .kube import DAEMONSET_SURGE_MINOR, KUBECONFIG, kubernetes_minor, wait_for

REDIRECTION = "ambient.istio.io/redirection"
AGENT_LABEL = "k8s-app=istio-cni-node"
PLUGIN_KUBECONFIG = "/var/run/istio-cni/istio-cni-kubeconfig"
AGENT_HELD_S = 60  # how long the replacement agent's init container holds it back
STREAM_S = 20


def jwt_claims(token: str) -> dict:
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


def test_pods_get_tokens_bound_to_them(cluster):
    ns = cluster.namespace(ambient=False)
    cluster.pod(ns, "client", sa="client", serve=False)
    cluster.running(ns, "client")
    token = cluster.exec(ns, "client", "cat", "/var/run/secrets/kubernetes.io/serviceaccount/token")
    claims = jwt_claims(token.strip())
    assert claims["kubernetes.io"]["pod"]["name"] == "client", claims
    print(f"\na pod's token is bound to it: {claims['kubernetes.io']}")


def test_the_plugins_kubeconfig_carries_its_own_narrow_token(cluster):
    doc = json.loads(open(PLUGIN_KUBECONFIG).read())
    claims = jwt_claims(doc["users"][0]["user"]["token"])
    assert claims["sub"] == "system:serviceaccount:istio-system:istio-cni-plugin", claims
    assert "pod" not in claims.get("kubernetes.io", {}), claims  # not bound to the agent's pod
    assert claims["exp"] - claims["iat"] <= 3600 + 60, claims  # short-lived
    print(f"\nthe plugin's token: {claims['sub']}, valid {claims['exp'] - claims['iat']} s, unbound")


def agent_pods(cluster) -> list[dict]:
    return [p for p in cluster.system_pods(AGENT_LABEL) if not p["metadata"].get("deletionTimestamp")]


def agent_ready(cluster) -> bool:
    pods = agent_pods(cluster)
    return bool(pods) and all(c.get("ready") for p in pods for c in p["status"].get("containerStatuses", []))


def sandbox_refusals(cluster, ns: str) -> list[str]:
    events = cluster.get("events", "-n", ns)["items"]
    return [e["message"] for e in events if e.get("reason") == "FailedCreatePodSandBox"]


def patch_agent(cluster, kind: str, body: object, *, check: bool = True) -> None:
    cluster.kubectl(
        "patch",
        "daemonset",
        "-n",
        "istio-system",
        "istio-cni-node",
        "--type",
        kind,
        "-p",
        json.dumps(body),
        check=check,
    )


def test_agent_restart_lets_pods_outside_the_mesh_start_and_holds_ambient_ones(cluster):
    plain = cluster.namespace(ambient=False)
    mesh = cluster.namespace(ambient=True)
    hold = {
        "spec": {
            "template": {
                "spec": {
                    "initContainers": [
                        {
                            "name": "held-back",
                            "image": cluster.image,
                            "imagePullPolicy": "IfNotPresent",
                            "command": ["sleep", str(AGENT_HELD_S)],
                        }
                    ]
                }
            }
        }
    }
    (old,) = [p["metadata"]["name"] for p in agent_pods(cluster)]
    patch_agent(cluster, "merge", hold)
    try:
        wait_for(
            lambda: old not in [p["metadata"]["name"] for p in cluster.system_pods(AGENT_LABEL)],
            "the old node agent pod gone",
            120,
        )
        gone_at = time.monotonic()
        # The agent's pod-bound token is refused from here on (after the API server notices);
        # the plugin's own token is not bound to it.
        cluster.pod(plain, "outside", sa="outside", serve=True)
        cluster.pod(mesh, "inside", sa="inside", serve=True)
        cluster.running(plain, "outside", timeout_s=AGENT_HELD_S - 15)
        started_s = time.monotonic() - gone_at
        assert not agent_ready(cluster), "the agent came back before the check: hold it longer"
        inside = cluster.get("pod", "-n", mesh, "inside")
        assert not inside["status"].get("podIP"), inside["status"]  # waits: fail closed
        refusals = wait_for(
            lambda: sandbox_refusals(cluster, mesh), f"{mesh}/inside refused by istio-cni", 60
        )
        assert not sandbox_refusals(cluster, plain)
        wait_for(lambda: agent_ready(cluster), "the replacement node agent ready", AGENT_HELD_S + 120)
        cluster.running(mesh, "inside", timeout_s=180)
        assert cluster.annotations(mesh, "inside").get(REDIRECTION) == "enabled"
        print(
            f"\nagent replaced: {plain}/outside started {started_s:.1f}s after the old agent pod went, "
            f"before the new one was ready; {mesh}/inside waited ({refusals[-1][:200]}) and was "
            "captured once the agent was back"
        )
    finally:
        patch_agent(
            cluster, "json", [{"op": "remove", "path": "/spec/template/spec/initContainers"}], check=False
        )
        wait_for(lambda: agent_ready(cluster), "the node agent back without the hold", AGENT_HELD_S + 180)


ECHO_SERVER = (
    "import socket, threading\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('', 8080)); s.listen(64)\n"
    "def serve(c):\n"
    "    with c:\n"
    "        while (d := c.recv(65536)):\n"
    "            c.sendall(d)\n"
    "while True:\n"
    "    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()\n"
)

# In the client pod: a stream (one connection, an echo every 50 ms) and a request loop (a new
# connection each time), both bounded, printing one JSON line of counts at the end.
CLIENT = """
import json, socket, sys, threading, time
host, seconds = sys.argv[1], float(sys.argv[2])
end = time.monotonic() + seconds
out = {"stream_ok": 0, "stream_errors": [], "requests_ok": 0, "request_errors": 0}
def stream():
    try:
        with socket.create_connection((host, 8080), timeout=5) as s:
            n = 0
            while time.monotonic() < end:
                line = b"stream %06d\\n" % n
                s.sendall(line)
                got = b""
                while len(got) < len(line):
                    chunk = s.recv(len(line) - len(got))
                    if not chunk:
                        raise ConnectionError("closed after %d" % n)
                    got += chunk
                assert got == line
                out["stream_ok"] += 1; n += 1
                time.sleep(0.05)
    except Exception as e:
        out["stream_errors"].append(repr(e))
t = threading.Thread(target=stream); t.start()
for i in range(100000):
    if time.monotonic() >= end:
        break
    try:
        with socket.create_connection((host, 8080), timeout=3) as s:
            s.sendall(b"r\\n"); s.shutdown(socket.SHUT_WR)
            assert s.recv(16) == b"r\\n"
        out["requests_ok"] += 1
    except Exception:
        out["request_errors"] += 1
    time.sleep(0.02)
t.join()
print(json.dumps(out))
"""


def _echo_and_client(cluster) -> tuple[str, str]:
    """A namespace in the mesh with a raw echo pod and a client pod: (namespace, echo's IP)."""
    ns = cluster.namespace(ambient=True)
    cluster.pod(ns, "client", sa="client", serve=False)
    cluster.apply(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "echo", "namespace": ns},
                "spec": {
                    "terminationGracePeriodSeconds": 1,
                    "containers": [
                        {
                            "name": "main",
                            "image": cluster.image,
                            "imagePullPolicy": "IfNotPresent",
                            "command": ["python3", "-c", ECHO_SERVER],
                            "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1},
                        }
                    ],
                },
            }
        )
    )
    cluster.running(ns, "client")
    cluster.running(ns, "echo")
    return ns, cluster.pod_ip(ns, "echo")


def _while_the_loop_runs(cluster, ns: str, ip: str, replace) -> tuple[float, dict]:
    """Run the client's stream and request loop for STREAM_S seconds, and `replace()` (the node
    proxy's replacement) 3 s into it; (how long `replace` took, the client's counts)."""
    loop = subprocess.Popen(
        ["kubectl", "exec", "-n", ns, "client", "--", "python3", "-c", CLIENT, ip, str(STREAM_S)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "KUBECONFIG": str(KUBECONFIG)},
    )
    try:
        time.sleep(3)
        t0 = time.monotonic()
        replace()
        took = time.monotonic() - t0
        out, _ = loop.communicate(timeout=STREAM_S + 60)
    finally:
        if loop.poll() is None:
            loop.kill()
    return took, json.loads(out.strip().splitlines()[-1])


def test_node_proxy_rollout_keeps_a_long_lived_stream(cluster):
    """The stream lasts STREAM_S, less than the old node proxy's drain deadline (25 s after its
    SIGTERM), so it ends on its own while the old proxy still carries it."""
    if kubernetes_minor() < DAEMONSET_SURGE_MINOR:
        pytest.skip(
            f"DaemonSet maxSurge needs Kubernetes 1.{DAEMONSET_SURGE_MINOR}+; "
            f"this cluster is 1.{kubernetes_minor()} (its ztunnel rolls one pod at a time; "
            "test_node_proxy_surge_by_a_second_daemonset covers the same hand-over there)"
        )
    ns, ip = _echo_and_client(cluster)
    old = cluster.ztunnel_pod()["metadata"]["name"]

    def rollout() -> None:
        cluster.kubectl("rollout", "restart", "daemonset", "-n", "istio-system", "ztunnel")
        cluster.kubectl(
            "rollout", "status", "daemonset", "-n", "istio-system", "ztunnel", "--timeout=120s", timeout=150
        )

    rolled_s, counts = _while_the_loop_runs(cluster, ns, ip, rollout)
    assert cluster.ztunnel_pod()["metadata"]["name"] != old
    print(f"\nztunnel rollout {rolled_s:.1f}s: {counts}")
    assert counts["request_errors"] == 0 and counts["requests_ok"] > 0, counts
    assert counts["stream_errors"] == [] and counts["stream_ok"] > 0, counts


def _surge_copy(ds: dict, name: str) -> dict:
    """The ztunnel DaemonSet as another DaemonSet `name` (its own pod label), same pods otherwise."""
    copy = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": name, "namespace": ds["metadata"]["namespace"]},
        "spec": json.loads(json.dumps(ds["spec"])),
    }
    copy["spec"]["selector"] = {"matchLabels": {"app": name}}
    copy["spec"]["template"]["metadata"].setdefault("labels", {})["app"] = name
    return copy


def test_node_proxy_surge_by_a_second_daemonset_keeps_a_long_lived_stream(cluster):
    """What maxSurge does, by hand, on a Kubernetes without it (1.20): a second node proxy starts
    on the node, the node agent hands it every pod over ZDS, then the first one's DaemonSet is
    deleted and that proxy drains. No request of the loop fails and the open stream, carried by the
    old proxy to its end, is never cut. The original DaemonSet is put back the same way."""
    ns, ip = _echo_and_client(cluster)
    original = cluster.get("daemonset", "-n", "istio-system", "ztunnel")
    surge = _surge_copy(original, "ztunnel-surge")
    restore = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "ztunnel", "namespace": "istio-system"},
        "spec": original["spec"],
    }

    def ready(label: str) -> bool:
        pods = [p for p in cluster.system_pods(f"app={label}") if not p["metadata"].get("deletionTimestamp")]
        return len(pods) == 1 and all(
            c.get("ready") for c in pods[0]["status"].get("containerStatuses", [{}])
        )

    def hand_over(to: dict, away: str) -> None:
        cluster.apply(json.dumps(to))
        wait_for(lambda: ready(to["metadata"]["name"]), "the new node proxy ready", 120)
        time.sleep(1)  # the node agent hands the pods to the newest ZDS connection as it connects
        cluster.kubectl("delete", "daemonset", "-n", "istio-system", away, "--wait=false")

    try:
        took, counts = _while_the_loop_runs(cluster, ns, ip, lambda: hand_over(surge, "ztunnel"))
        print(f"\nsurge to ztunnel-surge ({took:.1f}s to ready and hand over): {counts}")
        assert counts["request_errors"] == 0 and counts["requests_ok"] > 0, counts
        assert counts["stream_errors"] == [] and counts["stream_ok"] > 0, counts
        back, counts = _while_the_loop_runs(cluster, ns, ip, lambda: hand_over(restore, "ztunnel-surge"))
        print(f"and back to ztunnel ({back:.1f}s): {counts}")
        assert counts["request_errors"] == 0 and counts["stream_errors"] == [], counts
    finally:
        if not cluster.kubectl("get", "daemonset", "-n", "istio-system", "ztunnel", check=False).strip():
            cluster.apply(json.dumps(restore))
        cluster.kubectl("delete", "daemonset", "-n", "istio-system", "ztunnel-surge", "--ignore-not-found")
        wait_for(
            lambda: ready("ztunnel") and not cluster.system_pods("app=ztunnel-surge"), "ztunnel alone", 180
        )
