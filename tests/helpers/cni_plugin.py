"""The CNI plugin against a fake API server: pods and namespaces as the API returns them, a fake
node agent, the plugin's environment and stdin, and one run of it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from ambient_mesh.cni.enablement import DEFAULT_ENABLEMENT_SELECTORS
from tests.integration.cni_plugin_run import run_plugin

AMBIENT = {"istio.io/dataplane-mode": "ambient"}

PREV = {
    "cniVersion": "1.0.0",
    "interfaces": [{"name": "eth0", "sandbox": "/var/run/netns/cni-1"}],
    "ips": [{"address": "10.244.1.5/24", "gateway": "10.244.1.1", "interface": 0}],
}


def pod(name: str, namespace: str, labels: dict | None = None) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", "labels": labels or {}},
        "spec": {"nodeName": "node-1", "containers": [{"name": "app"}]},
        "status": {"phase": "Pending"},
    }


def namespace(name: str, labels: dict | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}}


class FakeAgent:
    """The node agent's plugin-facing sockets: /cmdadd on pluginevent.sock, /log on log.sock."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, bytes]] = []
        self.servers: list[asyncio.AbstractServer] = []

    async def start(self, run_dir: Path) -> None:
        for name in ("pluginevent.sock", "log.sock"):
            self.servers.append(await asyncio.start_unix_server(self._serve, path=str(run_dir / name)))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:] if line)
        body = await reader.readexactly(int(headers["Content-Length"]))
        self.requests.append((lines[0].split(" ")[1], body))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    def close(self) -> None:
        for server in self.servers:
            server.close()

    def adds(self) -> list[dict]:
        return [json.loads(body) for path, body in self.requests if path == "/cmdadd"]


def cni_env(pod_name: str, pod_namespace: str) -> dict[str, str]:
    return {
        "CNI_COMMAND": "ADD",
        "CNI_CONTAINERID": "c0ffee",
        "CNI_NETNS": "/var/run/netns/cni-1",
        "CNI_IFNAME": "eth0",
        "CNI_PATH": "/opt/cni/bin",
        "CNI_ARGS": f"IgnoreUnknown=1;K8S_POD_NAMESPACE={pod_namespace};K8S_POD_NAME={pod_name}",
    }


def plugin_stdin(run_dir: Path) -> bytes:
    # istio-cni's chained entry as install.py writes it: no pod source key, so the plugin reads
    # <cni_agent_run_dir>/istio-cni-kubeconfig.
    return json.dumps(
        {
            "cniVersion": "1.0.0",
            "name": "k8s-pod-network",
            "type": "istio-cni",
            "cni_agent_run_dir": str(run_dir),
            "ambient_enabled": True,
            "enablement_selectors": [s.to_json() for s in DEFAULT_ENABLEMENT_SELECTORS],
            "exclude_namespaces": ["kube-system"],
            "pod_namespace": "istio-system",
            "prevResult": PREV,
        }
    ).encode()


async def run_plugin_json(environ: dict[str, str], data: bytes) -> tuple[int, dict, bytes]:
    code, out, err = await run_plugin(environ, data)
    return code, json.loads(out), err
