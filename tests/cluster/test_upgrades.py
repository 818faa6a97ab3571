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
import subprocess
import time

import pytest

from .kube import DAEMONSET_SURGE_MINOR, kubernetes_minor, wait_for

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


def test_node_proxy_rollout_keeps_a_long_lived_stream(cluster):
    """The stream lasts STREAM_S, less than the old node proxy's drain deadline (25 s after its
    SIGTERM), so it ends on its own while the old proxy still carries it."""
    if kubernetes_minor() < DAEMONSET_SURGE_MINOR:
        pytest.skip(
            f"DaemonSet maxSurge needs Kubernetes 1.{DAEMONSET_SURGE_MINOR}+; "
            f"this cluster is 1.{kubernetes_minor()} (its ztunnel rolls one pod at a time)"
        )
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
    ip = cluster.pod_ip(ns, "echo")
    old = cluster.ztunnel_pod()["metadata"]["name"]
    seconds = STREAM_S
    loop = subprocess.Popen(
        ["kubectl", "exec", "-n", ns, "client", "--", "python3", "-c", CLIENT, ip, str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(3)
        t0 = time.monotonic()
        cluster.kubectl("rollout", "restart", "daemonset", "-n", "istio-system", "ztunnel")
        cluster.kubectl(
            "rollout", "status", "daemonset", "-n", "istio-system", "ztunnel", "--timeout=120s", timeout=150
        )
        rolled_s = time.monotonic() - t0
        out, _ = loop.communicate(timeout=seconds + 60)
    finally:
        if loop.poll() is None:
            loop.kill()
    counts = json.loads(out.strip().splitlines()[-1])
    assert cluster.ztunnel_pod()["metadata"]["name"] != old
    print(f"\nztunnel rollout {rolled_s:.1f}s: {counts}")
    assert counts["request_errors"] == 0 and counts["requests_ok"] > 0, counts
    assert counts["stream_errors"] == [] and counts["stream_ok"] > 0, counts
