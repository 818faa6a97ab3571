"""Tier 2: our node proxies fed by our control plane over real gRPC (delta ADS + CA) on loopback."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

import grpc
import pytest

from ambient_mesh.config import ZtunnelConfig
from ambient_mesh.control.plane import ControlPlane, ControlPlaneConfig, build, mint_token
from ambient_mesh.errors import IdentityError
from ambient_mesh.identity.caclient import GrpcCaClient
from ambient_mesh.identity.spiffe import Identity
from ambient_mesh.kube.store import KubeStore
from ambient_mesh.net import SocketAddr
from ambient_mesh.ztunnel import Ztunnel
from tests.helpers.control_plane import NAMESPACE, PODS, SERVICE, proxy_env, start_proxy, wait_for, write

from .mesh import CLIENT_IP, ECHO_PORT, SERVER_IP, echo_handler

DENY_CLIENT = """
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: deny-client, namespace: default}
spec:
  action: DENY
  rules: [{from: [{source: {principals: ["cluster.local/ns/default/sa/client"]}}]}]
"""


async def start_plane(tmp: Path, port: int = 0) -> ControlPlane:
    config = ControlPlaneConfig(
        directory=tmp / "objects",
        state_dir=tmp / "state",
        listen=SocketAddr.parse(f"127.0.0.1:{port}"),
        poll_interval_s=0.05,
    )
    plane = build(config)
    await plane.start()
    return plane


async def socks(proxy: Ztunnel, ip: str, port: int):
    addr = proxy.listeners["socks5"].bound_address
    reader, writer = await asyncio.open_connection(str(addr.ip), addr.port)
    writer.write(b"\x05\x01\x00\x05\x01\x00\x01" + bytes(map(int, ip.split("."))) + port.to_bytes(2, "big"))
    await writer.drain()
    await reader.readexactly(12)
    return reader, writer


async def echo_roundtrip(proxy: Ztunnel, ip: str, port: int, payload: bytes = b"hello") -> bytes:
    reader, writer = await socks(proxy, ip, port)
    writer.write(payload)
    writer.write_eof()
    try:
        return await asyncio.wait_for(reader.read(), 10)
    except ConnectionResetError:
        return b""
    finally:
        writer.close()


async def config_dump(proxy: Ztunnel) -> dict:
    """GET /config_dump from another thread: the admin server runs on this event loop."""
    admin = proxy.admin.bound_address

    def get() -> dict:
        with urllib.request.urlopen(f"http://{admin}/config_dump", timeout=5) as resp:
            return json.loads(resp.read())

    return await asyncio.to_thread(get)


async def _has(proxy: Ztunnel, key: str, present: bool = True) -> bool:
    return (key in (await config_dump(proxy))["policies"]) == present


@pytest.fixture
async def mesh(tmp_path):
    objects = tmp_path / "objects"
    objects.mkdir()
    write(objects, "namespace.yaml", NAMESPACE)
    write(objects, "pods.yaml", PODS)
    write(objects, "service.yaml", SERVICE)
    plane = await start_plane(tmp_path)
    port = plane.bound["tls"].port
    echo = await asyncio.start_server(echo_handler, SERVER_IP, ECHO_PORT)
    proxies = []
    try:
        proxies.append(await start_proxy(proxy_env(tmp_path, port, "client", CLIENT_IP)))
        proxies.append(await start_proxy(proxy_env(tmp_path, port, "server", SERVER_IP)))
        for p in proxies:
            await wait_for(lambda p=p: p.readiness.ready, what="proxy readiness after the first xDS push")
        yield plane, proxies[0], proxies[1], tmp_path
    finally:
        for p in proxies:
            await p.drain(0.5)
        await plane.stop(0)
        echo.close()
        await echo.wait_closed()


async def test_yaml_changes_reach_the_proxy_and_change_routing_and_authorization(mesh):
    plane, client, server, tmp = mesh
    dump = await config_dump(client)
    assert {w["name"] for w in dump["workloads"]} == {"client", "server"}
    assert [s["hostname"] for s in dump["services"]] == ["echo.default.svc.cluster.local"]
    # the VIP routes to the server over HBONE with certificates from the control plane's CA
    assert await echo_roundtrip(client, "127.10.0.1", 80) == b"hello"
    certs = (await config_dump(server))["certificates"]
    assert [c["identity"] for c in certs] == ["spiffe://cluster.local/ns/default/sa/server"]
    assert certs[0]["state"] == "Available"
    # a new policy file denies the client at the server's proxy
    write(tmp / "objects", "policy.yaml", DENY_CLIENT)
    await wait_for(lambda: _has(server, "default/deny-client"), what="policy at the proxy")
    assert await echo_roundtrip(client, "127.10.0.1", 80) == b""
    # removing it allows again
    (tmp / "objects" / "policy.yaml").unlink()
    await wait_for(lambda: _has(server, "default/deny-client", False), what="policy removal")
    assert await echo_roundtrip(client, "127.10.0.1", 80) == b"hello"
    # and the service's port change is routing the proxy follows
    write(tmp / "objects", "service.yaml", SERVICE.replace("port: 80,", "port: 81,"))
    await wait_for(
        lambda: client.state.services.find_vip("", SocketAddr.parse("127.10.0.1:0").ip).ports.get(81) == 8080,
        what="service port update",
    )
    assert await echo_roundtrip(client, "127.10.0.1", 81) == b"hello"


async def test_malformed_object_is_reported_and_the_rest_still_served(mesh, caplog):
    plane, client, _server, tmp = mesh
    write(
        tmp / "objects",
        "bad.yaml",
        PODS.replace("nodeName: node-a", "nodeName: [not, a, string]")
        .replace("name: client", "name: broken")
        .replace("name: server", "name: broken2"),
    )
    await wait_for(lambda: any("bad.yaml" in e for e in plane.load_errors), what="load error")
    error = next(e for e in plane.load_errors if "bad.yaml" in e)
    assert "spec.nodeName" in error
    assert await echo_roundtrip(client, "127.10.0.1", 80) == b"hello"
    assert {w["name"] for w in (await config_dump(client))["workloads"]} >= {"client", "server"}


async def test_control_plane_restart_is_survived_without_losing_state(mesh):
    plane, client, _server, tmp = mesh
    port = plane.bound["tls"].port
    before = {w["uid"] for w in (await config_dump(client))["workloads"]}
    assert await echo_roundtrip(client, "127.10.0.1", 80) == b"hello"
    await plane.stop(0)
    # serving goes on with the last state while the control plane is away
    assert await echo_roundtrip(client, "127.10.0.1", 80) == b"hello"
    assert {w["uid"] for w in (await config_dump(client))["workloads"]} == before
    restarted = await start_plane(tmp, port)
    try:
        await wait_for(
            lambda: restarted.ads.connections() and len(restarted.ads.connections()) == 2,
            what="both proxies reconnected",
        )
        write(tmp / "objects", "policy.yaml", DENY_CLIENT)
        await wait_for(lambda: _has(_server, "default/deny-client"), what="push after restart")
        assert {w["uid"] for w in (await config_dump(client))["workloads"]} == before
    finally:
        await restarted.stop(0)


async def test_node_proxy_cannot_get_an_identity_that_is_not_on_its_node(mesh):
    plane, _client, _server, tmp = mesh
    port = plane.bound["tls"].port
    token = tmp / "ztunnel-a.token"
    # a node proxy for node-a, bound to a ztunnel pod that exists in the control plane's view
    write(
        tmp / "objects",
        "ztunnel.yaml",
        """
apiVersion: v1
kind: Pod
metadata: {name: ztunnel-a, namespace: istio-system, uid: uid-zt-a}
spec: {nodeName: node-a, serviceAccountName: ztunnel, containers: [{name: z, image: z}]}
status: {phase: Running, podIP: 127.0.0.60}
""",
    )
    await wait_for(
        lambda: plane.node_index.bound_pod("istio-system", "ztunnel-a") is not None, what="ztunnel pod"
    )
    token.write_text(
        mint_token(
            tmp / "state", account=("istio-system", "ztunnel"), node="node-a", pod="ztunnel-a", uid="uid-zt-a"
        )
    )
    config = ZtunnelConfig.from_env(
        {
            "CA_ADDRESS": f"https://127.0.0.1:{port}",
            "CA_ROOT_CA": str(tmp / "state" / "root-cert.pem"),
            "AUTH_TOKEN": str(token),
            "XDS_ADDRESS": "",
            "ISTIO_META_DNS_CAPTURE": "false",
        }
    )
    ca = GrpcCaClient(config, shared_mode=True)
    try:
        cert = await ca.fetch_certificate(
            Identity("cluster.local", "default", "client")
        )  # client runs on node-a
        assert cert.identity == Identity("cluster.local", "default", "client")
        with pytest.raises(IdentityError, match="impersonation"):
            await ca.fetch_certificate(
                Identity("cluster.local", "default", "server")
            )  # server runs on node-b
    finally:
        await ca.close()
    assert isinstance(grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode)


async def test_certificate_rotation_keeps_long_and_new_connections_working(tmp_path):
    objects = tmp_path / "objects"
    objects.mkdir()
    write(objects, "namespace.yaml", NAMESPACE)
    write(objects, "pods.yaml", PODS)
    write(objects, "service.yaml", SERVICE)
    plane = await start_plane(tmp_path)
    port = plane.bound["tls"].port
    echo = await asyncio.start_server(echo_handler, SERVER_IP, ECHO_PORT)
    proxies = []
    try:
        for name, ip in (("client", CLIENT_IP), ("server", SERVER_IP)):
            proxies.append(await start_proxy(proxy_env(tmp_path, port, name, ip, SECRET_TTL="10s")))
        client, server = proxies
        for p in proxies:
            await wait_for(lambda p=p: p.readiness.ready, what="readiness")
        reader, writer = await socks(client, SERVER_IP, ECHO_PORT)
        writer.write(b"first")
        assert await reader.readexactly(5) == b"first"
        serial = (await config_dump(server))["certificates"][0]["certChain"][0]["serialNumber"]
        # the 10 s certificates are renewed at half life; keep the long connection busy meanwhile
        deadline = asyncio.get_running_loop().time() + 12
        while asyncio.get_running_loop().time() < deadline:
            writer.write(b"tick")
            assert await asyncio.wait_for(reader.readexactly(4), 5) == b"tick"
            await asyncio.sleep(0.5)
        renewed = (await config_dump(server))["certificates"][0]["certChain"][0]["serialNumber"]
        assert renewed != serial
        writer.close()
        # new connections after the rotation (the pool holds a connection made with the old cert)
        assert await echo_roundtrip(client, SERVER_IP, ECHO_PORT, b"after") == b"after"
        client.pi.pool.close()
        assert await echo_roundtrip(client, SERVER_IP, ECHO_PORT, b"fresh") == b"fresh"
    finally:
        for p in proxies:
            await p.drain(0.5)
        await plane.stop(0)
        echo.close()
        await echo.wait_closed()


def test_store_snapshot_view_has_no_objects_by_default():
    assert KubeStore(()).pods == () or list(KubeStore(()).pods) == []
