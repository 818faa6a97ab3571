"""The node proxy in shared (in-pod) mode: pods handed over ZDS, listeners inside each pod netns.

Tier 3 (root). One node, two enrolled pods and one plain pod, each a network namespace on the
fabric. The in-pod redirection rules are installed in the enrolled pods; a ZDS server (the node
agent's side, ambient_mesh.zds.server) hands their namespaces to a shared-mode node proxy
running in this process. Traffic between the enrolled pods must be captured inside the pods and
carried over HBONE (the server pod's proxy sees the client's SPIFFE id); the plain pod is
reached with plain TCP; deleting a pod over ZDS closes its listeners.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pytest
import yaml

from ambient_mesh.capture.apply import Backend, apply_inpod_rules
from ambient_mesh.capture.inpod import InpodConfig
from ambient_mesh.config import ProxyWorkloadInfo
from ambient_mesh.host.netns import NETNS_RUN_DIR, Fabric
from ambient_mesh.zds.server import ZdsServer
from ambient_mesh.ztunnel import build
from tests.helpers.shared_mode import APP_PORT, CLIENT_ID, NODE, PodTable, dns_query, local_config, wait_for

pytestmark = pytest.mark.timeout(120)


def access(caplog, direction: str) -> list[dict]:
    return [
        getattr(r, "fields", {})
        for r in caplog.records
        if r.getMessage() == "connection complete" and getattr(r, "fields", {}).get("direction") == direction
    ]


async def test_shared_mode_captures_inside_pods_and_carries_hbone(
    runner, start_echo, roundtrip, tmp_path: Path, caplog
):
    caplog.set_level(logging.INFO, logger="ambient_mesh")
    with Fabric(runner=runner) as fabric:
        client = fabric.add_node("client")
        server = fabric.add_node("server")
        plain = fabric.add_node("plain")
        start_echo(fabric, server, APP_PORT, tmp_path)
        plain_echo = start_echo(fabric, plain, APP_PORT, tmp_path)
        rules = InpodConfig(redirect_dns=False)
        for pod in (client, server):
            apply_inpod_rules(runner, pod.netns, rules, Backend.IPTABLES)

        table = PodTable()
        fds = []
        for uid, pod, sa in (("uid-client", client, "frontend"), ("uid-server", server, "echo")):
            fd = os.open(NETNS_RUN_DIR / pod.netns, os.O_RDONLY | os.O_CLOEXEC)
            fds.append(fd)
            name = "client" if pod is client else "server"
            table.pods[uid] = (ProxyWorkloadInfo(namespace="shop", name=name, service_account=sa), fd)
        zds = ZdsServer(str(tmp_path / "ztunnel.sock"), table)
        await zds.start()
        proxy = await build(
            {
                "PROXY_MODE": "shared",
                "INPOD_UDS": str(tmp_path / "ztunnel.sock"),
                "FAKE_CA": "true",
                "XDS_ADDRESS": "",
                "LOCAL_XDS": local_config(client, server, plain),
                "NODE_NAME": NODE,
                "ADMIN_ADDR": "127.0.0.1:0",
                "STATS_ADDR": "127.0.0.1:0",
                "READINESS_ADDR": "127.0.0.1:0",
                "ISTIO_META_DNS_CAPTURE": "false",
                "TERMINATION_GRACE_PERIOD_SECONDS": "2",
            }
        )
        try:
            await proxy.start()
            await wait_for(lambda: proxy.readiness.ready, what="the pods' proxies (ZDS snapshot)")
            assert set(proxy.inpod.pods) == {"uid-client", "uid-server"}

            # enrolled -> enrolled on the same node: captured in the client pod, and since this
            # node proxy serves both pods, carried by the same-node fast path (no TLS to itself)
            payload = b"through the mesh" * 1000
            got = await asyncio.to_thread(roundtrip, client.netns, str(server.ipv4), APP_PORT, payload)
            assert got == payload
            inbound = await wait_for(lambda: access(caplog, "inbound"), what="the server pod's access log")
            assert inbound[0]["src.identity"] == CLIENT_ID
            assert inbound[0]["src.addr"].startswith(f"{client.ipv4}:")
            outbound = access(caplog, "outbound")[0]
            assert outbound["dst.addr"] == f"{server.ipv4}:15008"
            assert outbound["src.identity"] == CLIENT_ID
            client_proxy = next(p.proxy for p in proxy.inpod.pods.values() if p.info.name == "client")
            assert client_proxy.outbound.fast_path_connections == 1
            assert client_proxy.pi.pool.connections_opened == 0

            # enrolled -> plain pod: plain TCP from the client pod's own address
            got = await asyncio.to_thread(roundtrip, client.netns, str(plain.ipv4), APP_PORT, b"plain")
            assert got == b"plain"
            assert str(client.ipv4) in plain_echo.peers()

            # a pod deleted over ZDS: its listeners close, new connections are no longer proxied
            assert await zds.del_workload("uid-server") is None
            await wait_for(lambda: "uid-server" not in proxy.inpod.pods, what="server pod proxy stopped")
        finally:
            await proxy.drain(0.5)
            await zds.stop()
            for fd in fds:
                os.close(fd)


async def test_shared_mode_pods_on_two_nodes_talk_hbone(
    runner, start_echo, roundtrip, tmp_path: Path, caplog
):
    """Two node proxies (one per node), each given its own pod over ZDS: real HBONE between them."""
    caplog.set_level(logging.INFO, logger="ambient_mesh")
    with Fabric(runner=runner) as fabric:
        client = fabric.add_node("client")
        server = fabric.add_node("server")
        plain = fabric.add_node("plain")
        start_echo(fabric, server, APP_PORT, tmp_path)
        for pod in (client, server):
            apply_inpod_rules(runner, pod.netns, InpodConfig(redirect_dns=False), Backend.IPTABLES)
        config = local_config(client, server, plain, server_node="node-2")
        proxies, servers, fds = [], [], []
        try:
            for node, pod, uid, name, sa in (
                (NODE, client, "uid-client", "client", "frontend"),
                ("node-2", server, "uid-server", "server", "echo"),
            ):
                fd = os.open(NETNS_RUN_DIR / pod.netns, os.O_RDONLY | os.O_CLOEXEC)
                fds.append(fd)
                table = PodTable()
                table.pods[uid] = (ProxyWorkloadInfo(namespace="shop", name=name, service_account=sa), fd)
                sock = str(tmp_path / f"{node}.sock")
                zds = ZdsServer(sock, table)
                await zds.start()
                servers.append(zds)
                proxy = await build(
                    {
                        "PROXY_MODE": "shared",
                        "INPOD_UDS": sock,
                        "FAKE_CA": "true",
                        "XDS_ADDRESS": "",
                        "LOCAL_XDS": config,
                        "NODE_NAME": node,
                        "ADMIN_ADDR": "127.0.0.1:0",
                        "STATS_ADDR": "127.0.0.1:0",
                        "READINESS_ADDR": "127.0.0.1:0",
                        "ISTIO_META_DNS_CAPTURE": "false",
                        "TERMINATION_GRACE_PERIOD_SECONDS": "2",
                    }
                )
                proxies.append(proxy)
                await proxy.start()
            for proxy in proxies:
                await wait_for(lambda proxy=proxy: proxy.readiness.ready, what="pod proxies ready")
            payload = b"across nodes" * 5000
            got = await asyncio.to_thread(roundtrip, client.netns, str(server.ipv4), APP_PORT, payload)
            assert got == payload
            inbound = await wait_for(lambda: access(caplog, "inbound"), what="the server pod's access log")
            assert inbound[0]["src.identity"] == CLIENT_ID
            client_pod = next(iter(proxies[0].inpod.pods.values())).proxy
            assert client_pod.outbound.fast_path_connections == 0
            assert client_pod.pi.pool.connections_opened == 1  # a real HBONE connection to node-2's pod
        finally:
            for proxy in proxies:
                await proxy.drain(0.5)
            for zds in servers:
                await zds.stop()
            for fd in fds:
                os.close(fd)


async def test_shared_mode_answers_dns_captured_inside_the_pod(runner, tmp_path: Path):
    """With DNS capture, a pod's query to any resolver on port 53 reaches the node proxy's DNS
    proxy inside that pod (15053) and service names resolve to their VIP."""
    with Fabric(runner=runner) as fabric:
        client = fabric.add_node("client")
        server = fabric.add_node("server")
        plain = fabric.add_node("plain")
        apply_inpod_rules(runner, client.netns, InpodConfig(redirect_dns=True), Backend.IPTABLES)
        config = yaml.safe_load(local_config(client, server, plain))
        config["workloads"][1]["services"] = {"shop/echo.shop.svc.cluster.local": {80: APP_PORT}}
        config["services"] = [
            {
                "name": "echo",
                "namespace": "shop",
                "hostname": "echo.shop.svc.cluster.local",
                "vips": ["/10.96.0.50"],
                "ports": {80: APP_PORT},
            }
        ]
        table = PodTable()
        fd = os.open(NETNS_RUN_DIR / client.netns, os.O_RDONLY | os.O_CLOEXEC)
        table.pods["uid-client"] = (
            ProxyWorkloadInfo(namespace="shop", name="client", service_account="frontend"),
            fd,
        )
        zds = ZdsServer(str(tmp_path / "ztunnel.sock"), table)
        await zds.start()
        proxy = await build(
            {
                "PROXY_MODE": "shared",
                "INPOD_UDS": str(tmp_path / "ztunnel.sock"),
                "FAKE_CA": "true",
                "XDS_ADDRESS": "",
                "LOCAL_XDS": yaml.safe_dump(config),
                "NODE_NAME": NODE,
                "ADMIN_ADDR": "127.0.0.1:0",
                "STATS_ADDR": "127.0.0.1:0",
                "READINESS_ADDR": "127.0.0.1:0",
                "TERMINATION_GRACE_PERIOD_SECONDS": "2",
            }
        )
        try:
            await proxy.start()
            await wait_for(lambda: proxy.readiness.ready, what="the pod's proxy")
            for name in ("echo.shop.svc.cluster.local.", "echo.shop.", "echo."):
                got = await asyncio.to_thread(dns_query, client.netns, "10.96.0.10", name)
                assert got == ["10.96.0.50"], name
        finally:
            await proxy.drain(0.5)
            await zds.stop()
            os.close(fd)
