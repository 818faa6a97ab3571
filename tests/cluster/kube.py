"""The cluster tier's session: bring the one-node cluster up with the project's scripts, apply
Istio's CRDs, the CA and the whole-mesh overlay (plus the test cluster's own settings), and tear
it all down afterwards. `Cluster` wraps kubectl and the few host-side looks the checks need
(a pod's network namespace through containerd, the node's CNI directories)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import secrets
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts" / "cluster"
CACHE = Path(os.environ.get("AMBIENT_CACHE", "/var/cache/ambient-mesh"))
K8S_BIN = CACHE / "k8s" / "bin"
CL = CACHE / "cluster"
KUBECONFIG = CL / "kubeconfig"
MAX_OUTPUT_CHARS = 4000  # of a failing command's output, quoted in the error
T = TypeVar("T")


def cluster_env() -> dict[str, str]:
    """The plain NAME=value constants of scripts/cluster/env.sh (addresses, dirs)."""
    out = {}
    for line in (SCRIPTS / "env.sh").read_text().splitlines():
        m = re.fullmatch(r"([A-Z_]+)=([^$\s]+)", line.strip())
        if m:
            out[m.group(1)] = m.group(2)
    return out


ENV = cluster_env()
CONTAINERD_SOCK = Path(ENV["RUN"]) / "containerd" / "containerd.sock"
CNI_BIN = CL / "cni" / "bin"
CNI_NET = CL / "cni" / "net.d"


def run(argv: list[str], *, input: str | None = None, timeout: float = 120, check: bool = True) -> str:
    env = {**os.environ, "KUBECONFIG": str(KUBECONFIG), "AMBIENT_CACHE": str(CACHE)}
    proc = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(argv)} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-MAX_OUTPUT_CHARS:]}"
        )
    return proc.stdout


def wait_for(check: Callable[[], T | None], what: str, timeout_s: float = 60, interval_s: float = 0.5) -> T:
    """Poll `check` until it returns something truthy; AssertionError naming `what` on timeout."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while True:
        try:
            last = check()
        except (AssertionError, subprocess.TimeoutExpired, OSError) as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what} (last: {last!r})")
        time.sleep(interval_s)


@dataclass
class Cluster:
    image: str
    timings: dict[str, float]

    def kubectl(self, *args: str, input: str | None = None, timeout: float = 60, check: bool = True) -> str:
        return run(["kubectl", *args], input=input, timeout=timeout, check=check)

    def get(self, *args: str) -> dict[str, Any]:
        return json.loads(self.kubectl("get", "-o", "json", *args))

    def apply(self, manifest: str) -> None:
        self.kubectl("apply", "-f", "-", input=manifest)

    def namespace(self, *, ambient: bool) -> str:
        name = f"amt-{secrets.token_hex(3)}"
        labels = {"ambient-mesh-test": "true"}
        if ambient:
            labels["istio.io/dataplane-mode"] = "ambient"
        self.apply(
            json.dumps(
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}
            )
        )
        return name

    def pod(self, ns: str, name: str, *, sa: str, serve: bool) -> None:
        """A pod of our image (python3 is in it): an HTTP server on 8080, or an idle client."""
        command = ["python3", "-m", "http.server", "8080"] if serve else ["sleep", "3600"]
        objs = [
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa, "namespace": ns}},
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "namespace": ns, "labels": {"app": name}},
                "spec": {
                    "serviceAccountName": sa,
                    "terminationGracePeriodSeconds": 1,
                    "containers": [
                        {
                            "name": "main",
                            "image": self.image,
                            "imagePullPolicy": "IfNotPresent",
                            "command": command,
                            **(
                                {"readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1}}
                                if serve
                                else {}
                            ),
                        }
                    ],
                },
            },
        ]
        self.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}))

    def running(self, ns: str, name: str, timeout_s: float = 120) -> dict[str, Any]:
        def ready():
            pod = self.get("pod", "-n", ns, name)
            conditions = {c["type"]: c["status"] for c in pod["status"].get("conditions", [])}
            return pod if conditions.get("Ready") == "True" else None

        return wait_for(ready, f"pod {ns}/{name} ready", timeout_s)

    def pod_ip(self, ns: str, name: str) -> str:
        return self.get("pod", "-n", ns, name)["status"]["podIP"]

    def annotations(self, ns: str, name: str) -> dict[str, str]:
        return self.get("pod", "-n", ns, name)["metadata"].get("annotations", {})

    def exec(self, ns: str, name: str, *cmd: str, timeout: float = 30, check: bool = True) -> str:
        return self.kubectl("exec", "-n", ns, name, "--", *cmd, timeout=timeout, check=check)

    def http_get(self, ns: str, client: str, url: str, timeout_s: float = 5) -> str:
        """GET `url` from inside pod `client`: "200" or the error's name and text."""
        code = (
            "import sys, urllib.request\n"
            "try:\n"
            f"    print(urllib.request.urlopen({url!r}, timeout={timeout_s}).status)\n"
            "except Exception as e:\n"
            "    print(type(e).__name__, e)\n"
        )
        return self.exec(ns, client, "python3", "-c", code, timeout=timeout_s + 20).strip()

    @contextlib.contextmanager
    def node_proxy_off_the_node(self) -> Iterator[None]:
        """Take the node proxy DaemonSet's pod off the node (a node selector no node matches),
        and put it back afterwards, also when the block fails: the node agent then has no ZDS
        connection, as on a node whose ztunnel has not started yet."""
        key = "ambient-mesh.test/no-node"

        def patch(kind: str, body: object) -> None:
            self.kubectl(
                "patch", "daemonset", "-n", "istio-system", "ztunnel", "--type", kind, "-p", json.dumps(body)
            )

        patch("merge", {"spec": {"template": {"spec": {"nodeSelector": {key: "true"}}}}})
        try:
            wait_for(lambda: not self.system_pods("app=ztunnel"), "the node proxy pod gone", 120)
            yield
        finally:
            path = "/spec/template/spec/nodeSelector/" + key.replace("/", "~1")
            patch("json", [{"op": "remove", "path": path}])
            wait_for(self.node_proxy_running, "the node proxy DaemonSet pod running again", 180)

    def node_proxy_running(self) -> bool:
        pods = self.system_pods("app=ztunnel")
        return bool(pods) and all(
            "running" in c.get("state", {}) for p in pods for c in p["status"].get("containerStatuses", [])
        )

    def system_pods(self, label: str) -> list[dict[str, Any]]:
        return self.get("pods", "-n", "istio-system", "-l", label)["items"]

    def ztunnel_pod(self) -> dict[str, Any]:
        pods = [p for p in self.system_pods("app=ztunnel") if not p["metadata"].get("deletionTimestamp")]
        assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
        return pods[0]

    def container_pid(self, ns: str, name: str) -> int:
        """The PID (host's view) of the pod's first container, from containerd."""
        status = self.get("pod", "-n", ns, name)["status"]["containerStatuses"][0]
        cid = status["containerID"].removeprefix("containerd://")
        out = run(["ctr", "--address", str(CONTAINERD_SOCK), "-n", "k8s.io", "tasks", "ls"])
        for line in out.splitlines():
            fields = line.split()
            if fields and fields[0] == cid:
                return int(fields[1])
        raise AssertionError(f"no containerd task {cid} for pod {ns}/{name}")

    def netns_rules(self, ns: str, name: str) -> str:
        """The pod's netfilter rules (iptables nat/mangle and nftables), read from the host."""
        pid = str(self.container_pid(ns, name))
        out = run(["nsenter", "-t", pid, "-n", "iptables-save"], check=False)
        out += run(["nsenter", "-t", pid, "-n", "nft", "list", "ruleset"], check=False)
        return out

    def metrics(self, pod_ip: str, port: int = 15020) -> str:
        with urllib.request.urlopen(f"http://{pod_ip}:{port}/metrics", timeout=5) as r:
            return r.read().decode()


DAEMONSET_SURGE_MINOR = 22  # DaemonSet rollingUpdate.maxSurge, on by default from 1.22


@functools.cache
def kubernetes_minor() -> int:
    """The minor version of the cluster's Kubernetes (its apiserver binary)."""
    out = run([str(K8S_BIN / "kube-apiserver"), "--version"])
    match = re.search(r"v1\.(\d+)\.", out)
    assert match, out
    return int(match.group(1))


def overlay(image: str) -> Path:
    """The test cluster's overlay over deploy/overlays/mesh: this build's image, the cluster's
    own CNI directories (the charts' cniBinDir/cniConfDir), since this cluster has no DNS a
    fixed ClusterIP for istiod that the node proxy's /etc/hosts names, and no DaemonSet maxSurge
    before Kubernetes 1.22."""
    d = CL / "overlay"
    d.mkdir(parents=True, exist_ok=True)
    name, tag = image.rsplit(":", 1)
    base = os.path.relpath(ROOT / "deploy" / "overlays" / "mesh", d)
    (d / "kustomization.yaml").write_text(
        json.dumps(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [base],
                "images": [{"name": "localhost/ambient-mesh", "newName": name, "newTag": tag}],
                "patches": [
                    {"path": "cluster.yaml"},
                    {"path": "cni.yaml"},
                    {"path": "istiod.yaml"},
                    # Kubernetes before 1.22 has no DaemonSet maxSurge: replace ztunnel's
                    # surge-first update with the default one-at-a-time there
                    *(
                        [
                            {
                                "target": {"kind": "DaemonSet", "name": "ztunnel"},
                                "patch": json.dumps(
                                    [
                                        {
                                            "op": "replace",
                                            "path": "/spec/updateStrategy",
                                            "value": {"type": "RollingUpdate"},
                                        }
                                    ]
                                ),
                            }
                        ]
                        if kubernetes_minor() < DAEMONSET_SURGE_MINOR
                        else []
                    ),
                ],
            },
            indent=1,
        )
    )
    (d / "cni.yaml").write_text(
        json.dumps(
            {
                "apiVersion": "apps/v1",
                "kind": "DaemonSet",
                "metadata": {"name": "istio-cni-node", "namespace": "istio-system"},
                "spec": {
                    "template": {
                        "spec": {
                            "volumes": [
                                {"name": "cni-bin-dir", "hostPath": {"path": str(CNI_BIN)}},
                                {"name": "cni-net-dir", "hostPath": {"path": str(CNI_NET)}},
                                # the chart's cniNetnsDir: /var/run is a symlink on this host, and
                                # containerd wants the HostToContainer source on a shared mount
                                # as written, which /run/netns is (ip netns) and / is not
                                {"name": "cni-netns-dir", "hostPath": {"path": "/run/netns"}},
                            ]
                        }
                    }
                },
            }
        )
    )
    (d / "cluster.yaml").write_text(
        json.dumps(
            {
                "apiVersion": "apps/v1",
                "kind": "DaemonSet",
                "metadata": {"name": "ztunnel", "namespace": "istio-system"},
                "spec": {
                    "template": {
                        "spec": {
                            "hostAliases": [
                                {"ip": ENV["ISTIOD_IP"], "hostnames": ["istiod.istio-system.svc"]}
                            ]
                        }
                    }
                },
            }
        )
    )
    (d / "istiod.yaml").write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": "istiod", "namespace": "istio-system"},
                "spec": {"clusterIP": ENV["ISTIOD_IP"]},
            }
        )
    )
    return d


# The Istio kinds the mesh reads, as the project's own minimal CRDs (Istio's install brings its own).
ISTIO_KINDS_CRDS = ROOT / "deploy" / "crds" / "istio-kinds.yaml"


@contextlib.contextmanager
def cluster_session() -> Iterator[Cluster]:
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    run(["bash", str(SCRIPTS / "build.sh")], timeout=3600)
    timings["build"] = time.monotonic() - t0
    t = time.monotonic()
    image = run(["bash", str(SCRIPTS / "image.sh")], timeout=1800).strip().splitlines()[-1]
    timings["image"] = time.monotonic() - t
    run(["bash", str(SCRIPTS / "down.sh")], timeout=180, check=False)
    try:
        t = time.monotonic()
        run(["bash", str(SCRIPTS / "up.sh"), image], timeout=600)
        timings["up"] = time.monotonic() - t
        t = time.monotonic()
        run(["kubectl", "apply", "-f", str(ISTIO_KINDS_CRDS)], timeout=300)
        run(["kubectl", "wait", "--for=condition=Established", "crd/authorizationpolicies.security.istio.io"])
        run(["bash", str(SCRIPTS / "mesh-ca.sh"), str(CL / "mesh-ca")])
        run(["kubectl", "apply", "-k", str(overlay(image))])
        cluster = Cluster(image=image, timings=timings)

        def agent_ready():
            pods = cluster.system_pods("k8s-app=istio-cni-node")
            return pods and all(
                c.get("ready") for p in pods for c in p["status"].get("containerStatuses", [])
            )

        wait_for(agent_ready, "the node agent DaemonSet pod ready", 180)

        wait_for(cluster.node_proxy_running, "the node proxy DaemonSet pod running", 180)
        timings["mesh"] = time.monotonic() - t
        yield cluster
    finally:
        with contextlib.suppress(Exception):
            logs = CL / "log"
            for label, file in (("k8s-app=istio-cni-node", "istio-cni.log"), ("app=ztunnel", "ztunnel.log")):
                out = run(
                    ["kubectl", "logs", "-n", "istio-system", "-l", label, "--tail=-1", "--prefix"],
                    check=False,
                    timeout=30,
                )
                (logs / file).write_text(out)
            (logs / "istiod.log").write_text(
                run(
                    ["kubectl", "logs", "-n", "istio-system", "deploy/istiod", "--tail=-1"],
                    check=False,
                    timeout=30,
                )
            )
        t = time.monotonic()
        run(["bash", str(SCRIPTS / "down.sh")], timeout=180, check=False)
        timings["down"] = time.monotonic() - t
        print("\ncluster tier timings (s): " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()))
