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

import json
from dataclasses import dataclass

import pytest
import yaml

from ambient_mesh.host.netns import Fabric, Node
from ambient_mesh.ports import ADMIN_PORT
from tests.helpers.dedicated_mesh import (
    APP_PORT,
    CLIENT_ID,
    PAYLOAD,
    NodeProxy,
    capture,
    node_proxy_missing,
    start_proxy,
    wait_access_line,
    wait_ready,
    workload,
)

pytestmark = pytest.mark.timeout(240)

SERVICE_VIP = "10.96.0.50"
SERVICE_PORT = 80
SERVICE_HOST = "echo.shop.svc.cluster.local"
SERVER_ID = "spiffe://cluster.local/ns/shop/sa/echo"


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
