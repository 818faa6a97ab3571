"""Two meshed pods, each with its own dedicated-mode node proxy, talking HBONE across nodes.

Counterpart: the `*_dedicated` rows of ztunnel's namespaced test matrix.
Topology (one Fabric, subnet 10.240.0.0/24):

    node-a  client pod: the app (this test process, via in-namespace sockets) + `ambient ztunnel`
    node-b  server pod: echo app on 8080 + `ambient ztunnel`
    node-c  plain-TCP workload: echo on 8080, no proxy (protocol TCP in the config)
    outside an address the config does not know: echo on 8080, reached by passthrough

Each proxy runs as its own process inside its pod's namespace, configured only through the
environment (PROXY_MODE=dedicated, FAKE_CA, LOCAL_XDS_PATH, ...) as Istio's ztunnel is, with the
dedicated-mode capture rules installed in the pod first.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import pytest
import yaml

from ambient_mesh.capture.dedicated import apply_dedicated_rules, render_dedicated_rules
from ambient_mesh.host.netns import Fabric, Node
from ambient_mesh.logs import access_events
from ambient_mesh.ports import ADMIN_PORT, READINESS_PORT

pytestmark = pytest.mark.timeout(240)

PACKET_MARK = 1337
APP_PORT = 8080
SERVICE_VIP = "10.96.0.50"
SERVICE_PORT = 80
SERVICE_HOST = "echo.shop.svc.cluster.local"
CLIENT_ID = "spiffe://cluster.local/ns/shop/sa/frontend"
SERVER_ID = "spiffe://cluster.local/ns/shop/sa/echo"
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


@dataclass(slots=True)
class Mesh:
    fabric: Fabric
    client: Node
    server: Node
    plain: Node
    outside: Node
    client_proxy: NodeProxy
    server_proxy: NodeProxy
    server_app: object
    plain_app: object
    outside_app: object


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


def local_config(client: Node, server: Node, plain: Node) -> dict:
    """ztunnel's local xDS YAML (docs/istio-behaviour.md, "Local config file"): two HBONE pods, one TCP
    workload, a service."""
    server_workload = workload("server", "shop", "echo", server, "HBONE")
    server_workload["services"] = {f"shop/{SERVICE_HOST}": {SERVICE_PORT: APP_PORT}}
    return {
        "workloads": [
            workload("client", "shop", "frontend", client, "HBONE"),
            server_workload,
            workload("plain", "legacy", "plain", plain, "TCP"),
        ],
        "services": [
            {
                "name": "echo",
                "namespace": "shop",
                "hostname": SERVICE_HOST,
                "vips": [f"/{SERVICE_VIP}"],
                "ports": {SERVICE_PORT: APP_PORT},
            }
        ],
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


@pytest.fixture(scope="module")
def mesh(runner, start_echo, get, poll, tmp_path_factory):
    missing = node_proxy_missing()
    if missing:
        pytest.skip(missing)
    tmp = tmp_path_factory.mktemp("dedicated-mesh")
    with Fabric(runner=runner) as fabric:
        client = fabric.add_node("node-a")
        server = fabric.add_node("node-b")
        plain = fabric.add_node("node-c")
        outside = fabric.add_node("outside")
        config = tmp / "local-xds.yaml"
        config.write_text(yaml.safe_dump(local_config(client, server, plain), sort_keys=False))
        server_app = start_echo(fabric, server, APP_PORT, tmp)
        plain_app = start_echo(fabric, plain, APP_PORT, tmp)
        outside_app = start_echo(fabric, outside, APP_PORT, tmp)
        for pod in (client, server):
            capture(runner, pod)
        client_proxy = start_proxy(fabric, client, "shop/client/frontend", config, tmp / "proxy-a")
        server_proxy = start_proxy(fabric, server, "shop/server/echo", config, tmp / "proxy-b")
        for proxy in (client_proxy, server_proxy):
            wait_ready(proxy, get, poll)
        yield Mesh(
            fabric=fabric,
            client=client,
            server=server,
            plain=plain,
            outside=outside,
            client_proxy=client_proxy,
            server_proxy=server_proxy,
            server_app=server_app,
            plain_app=plain_app,
            outside_app=outside_app,
        )
    # Fabric teardown has stopped both proxies and the echo servers and deleted every namespace.


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


def test_proxies_are_up_and_serve_config_dump(mesh, get):
    for proxy in (mesh.client_proxy, mesh.server_proxy):
        status, body = get(proxy.node.netns, "127.0.0.1", ADMIN_PORT, "/config_dump")
        assert status == 200, proxy.tail()
        dump = json.loads(body)
        assert dump, "empty config_dump"
        text = body.decode()
        for node in (mesh.client, mesh.server, mesh.plain):
            assert str(node.ipv4) in text, (
                f"{node.name}'s workload missing from {proxy.node.name}'s config_dump"
            )


def test_pod_ip_traffic_crosses_hbone_with_the_client_identity(mesh, roundtrip, poll):
    server_since, client_since = mesh.server_proxy.offset(), mesh.client_proxy.offset()
    assert roundtrip(mesh.client.netns, str(mesh.server.ipv4), APP_PORT, PAYLOAD) == PAYLOAD
    inbound = wait_access_line(
        mesh.server_proxy, server_since, poll, direction="inbound", src_identity=CLIENT_ID
    )
    assert inbound["src.addr"].startswith(f"{mesh.client.ipv4}:")
    outbound = wait_access_line(
        mesh.client_proxy, client_since, poll, direction="outbound", dst_identity=SERVER_ID
    )
    assert outbound["src.addr"].startswith(f"{mesh.client.ipv4}:")


def test_service_vip_traffic_reaches_the_endpoint_over_hbone(mesh, roundtrip, poll):
    server_since = mesh.server_proxy.offset()
    accepted_before = len(mesh.server_app.peers())
    assert roundtrip(mesh.client.netns, SERVICE_VIP, SERVICE_PORT, PAYLOAD) == PAYLOAD
    wait_access_line(mesh.server_proxy, server_since, poll, direction="inbound", src_identity=CLIENT_ID)
    assert len(mesh.server_app.peers()) == accepted_before + 1


def test_plain_tcp_workload_is_reached_directly_and_sees_the_client_ip(mesh, roundtrip):
    before = len(mesh.plain_app.peers())
    server_since = mesh.server_proxy.offset()
    assert roundtrip(mesh.client.netns, str(mesh.plain.ipv4), APP_PORT, PAYLOAD) == PAYLOAD
    peers = mesh.plain_app.peers()
    assert peers[before:] == [str(mesh.client.ipv4)]
    assert not mesh.server_proxy.access_lines(server_since)


def test_unknown_destination_passes_through_unchanged(mesh, roundtrip):
    before = len(mesh.outside_app.peers())
    assert roundtrip(mesh.client.netns, str(mesh.outside.ipv4), APP_PORT, PAYLOAD) == PAYLOAD
    assert mesh.outside_app.peers()[before:] == [str(mesh.client.ipv4)]
