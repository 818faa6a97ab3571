"""Two node proxies in dedicated mode on a network-namespace fabric: the proxies' command line and
readiness, the workloads they capture, and their access log lines."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import pytest

from ambient_mesh.capture.dedicated import apply_dedicated_rules, render_dedicated_rules
from ambient_mesh.host.netns import Fabric, Node
from ambient_mesh.logs import access_events
from ambient_mesh.ports import ADMIN_PORT, READINESS_PORT

PACKET_MARK = 1337

APP_PORT = 8080

CLIENT_ID = "spiffe://cluster.local/ns/shop/sa/frontend"

PROXY_READY_TIMEOUT_S = 30.0

ACCESS_LOG_TIMEOUT_S = 10.0

PAYLOAD = bytes(range(256)) * 256  # 64 KiB, every byte value


def node_proxy_missing() -> str | None:
    for module in ("ambient_mesh.cli", "ambient_mesh.ztunnel"):
        if importlib.util.find_spec(module) is None:
            return f"node proxy not built yet: module {module} does not exist"
    return None


def proxy_argv() -> list[str]:
    script = Path(sys.executable).with_name("ambient")
    if script.exists():
        return [str(script), "ztunnel"]
    return [sys.executable, "-m", "ambient_mesh.cli", "ztunnel"]


@dataclass(slots=True)
class NodeProxy:
    node: Node
    process: object
    log: Path

    def offset(self) -> int:
        return self.log.stat().st_size

    def access_lines(self, since: int = 0) -> list[dict[str, str]]:
        with open(self.log, "rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
        return access_events(text)

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def workload(name: str, namespace: str, sa: str, node: Node, protocol: str) -> dict:
    """One pod of ztunnel's local xDS YAML (docs/istio-behaviour.md, "Local config file"), at the node's IPv4
    address."""
    return {
        "uid": f"Kubernetes//Pod/{namespace}/{name}",
        "name": name,
        "namespace": namespace,
        "serviceAccount": sa,
        "trustDomain": "cluster.local",
        "workloadIps": [str(node.ipv4)],
        "protocol": protocol,
        "node": node.name,
    }


def capture(runner, node: Node, *, transparent: bool = False) -> None:
    """Install the dedicated-mode capture rules (IPv4 and IPv6) in a pod; `transparent` adds the
    original-source return path (a mangle table, so its policy routes come with it)."""
    apply_dedicated_rules(
        runner, node.netns, render_dedicated_rules(mark=PACKET_MARK, transparent=transparent)
    )
    apply_dedicated_rules(
        runner,
        node.netns,
        render_dedicated_rules(mark=PACKET_MARK, transparent=transparent, ipv6=True),
        ipv6=True,
    )


def start_proxy(
    fabric: Fabric,
    node: Node,
    workload_info: str,
    config: Path,
    workdir: Path,
    extra_env: Mapping[str, str] = MappingProxyType({}),
) -> NodeProxy:
    """Start `ambient ztunnel` in dedicated mode inside `node`, configured only through its
    environment; `extra_env` adds to (or overrides) that environment."""
    workdir.mkdir()
    log = workdir / "ztunnel.log"
    env = dict(os.environ)
    env.update(
        {
            "PROXY_MODE": "dedicated",
            "PROXY_WORKLOAD_INFO": workload_info,
            "FAKE_CA": "true",
            "XDS_ADDRESS": "",
            "LOCAL_XDS_PATH": str(config),
            "PACKET_MARK": str(PACKET_MARK),
            "NODE_NAME": node.name,
            "ADMIN_ADDR": f"127.0.0.1:{ADMIN_PORT}",
        }
    )
    env.update(extra_env)
    with open(log, "wb") as out:
        process = fabric.spawn(node, proxy_argv(), env=env, cwd=workdir, stdout=out, stderr=out)
    return NodeProxy(node=node, process=process, log=log)


def wait_ready(proxy: NodeProxy, get, poll) -> None:
    def ready():
        if proxy.process.poll() is not None:
            pytest.fail(
                f"node proxy in {proxy.node.name} exited with code {proxy.process.returncode}:\n"
                f"{proxy.tail()}"
            )
        try:
            status, _ = get(proxy.node.netns, "127.0.0.1", READINESS_PORT, "/healthz/ready")
        except OSError:
            return False
        return status == 200

    poll(ready, timeout_s=PROXY_READY_TIMEOUT_S, what=f"node proxy in {proxy.node.name} to be ready")


def wait_access_line(proxy: NodeProxy, since: int, poll, **expected: str) -> dict[str, str]:
    """The first `connection complete` line after `since` whose fields include `expected`."""

    def find():
        for fields in proxy.access_lines(since):
            if all(fields.get(key.replace("_", ".")) == value for key, value in expected.items()):
                return fields
        return None

    try:
        return poll(
            find, timeout_s=ACCESS_LOG_TIMEOUT_S, what=f"access log line {expected} in {proxy.node.name}"
        )
    except pytest.fail.Exception:
        pytest.fail(
            f"no access log line with {expected} in {proxy.node.name}'s proxy; log tail:\n{proxy.tail()}"
        )
