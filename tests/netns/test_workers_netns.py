"""Shared (in-pod) mode with ZTUNNEL_WORKER_THREADS=2, across two nodes.

Tier 3 (root). Each node proxy is an owner with two worker processes. The node agent's side
(ZdsServer) hands each proxy its pod's network namespace; the owner opens the pod's listeners
inside it, one socket each, and hands them and the namespace to every worker (one accept queue).
Connections captured in the client pod are served by the client node's two workers (half of
them while worker 1 is stopped, half while worker 0 is, so each serves a known share) and
reach the server pod over real HBONE through the server node's workers; the one view (/stats,
/config_dump) counts them all.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.request
from pathlib import Path

import pytest
import yaml

from ambient_mesh.capture.apply import Backend, apply_inpod_rules
from ambient_mesh.capture.inpod import InpodConfig
from ambient_mesh.config import ProxyWorkloadInfo
from ambient_mesh.host.netns import NETNS_RUN_DIR, Fabric
from ambient_mesh.zds.server import ZdsServer
from ambient_mesh.ztunnel import Ztunnel, build
from tests.helpers.shared_mode import APP_PORT, CLIENT_ID, NODE, PodTable, local_config, wait_for
from tests.helpers.workers import only_worker

pytestmark = pytest.mark.timeout(180)

CONNECTIONS = 16


def fetch(proxy: Ztunnel, which: str, path: str) -> bytes:
    bound = (proxy.admin if which == "admin" else proxy.stats).bound_address
    with urllib.request.urlopen(f"http://{bound.ip}:{bound.port}{path}", timeout=10) as reply:
        return reply.read()


def sample(text: str, name: str, **labels: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items())
    )


async def test_two_workers_per_node_proxy_serve_pods_over_hbone(
    runner, start_echo, roundtrip, tmp_path: Path
):
    with Fabric(runner=runner) as fabric:
        client = fabric.add_node("client")
        server = fabric.add_node("server")
        plain = fabric.add_node("plain")
        start_echo(fabric, server, APP_PORT, tmp_path)
        for pod in (client, server):
            apply_inpod_rules(runner, pod.netns, InpodConfig(redirect_dns=False), Backend.IPTABLES)
        config = local_config(client, server, plain, server_node="node-2")
        proxies: list[Ztunnel] = []
        servers, fds = [], []
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
                        "ZTUNNEL_WORKER_THREADS": "2",
                        # one stream per HBONE connection: concurrent connections spread on node-2 too
                        "POOL_MAX_STREAMS_PER_CONNECTION": "1",
                    }
                )
                proxies.append(proxy)
                await proxy.start()
            for proxy in proxies:
                await wait_for(lambda proxy=proxy: proxy.readiness.ready, what="pod proxies ready")
            client_proxy, server_proxy = proxies
            assert client_proxy.pool is not None and server_proxy.pool is not None
            assert set(client_proxy.inpod.pods) == {"uid-client"}
            # The owner opened the pod's listeners in the pod's namespace, one socket each.
            handed = client_proxy.pool.proxies["uid-client"]
            assert handed.netns is not None and "outbound" in handed.sockets

            payload = b"across nodes, two workers" * 4000

            async def on_each_worker() -> None:
                for index in (0, 1):
                    with only_worker(client_proxy.pool, index):
                        results = await asyncio.gather(
                            *(
                                asyncio.to_thread(
                                    roundtrip, client.netns, str(server.ipv4), APP_PORT, payload
                                )
                                for _ in range(CONNECTIONS // 2)
                            )
                        )
                    assert all(got == payload for got in results)

            await on_each_worker()
            client_dump = json.loads(await asyncio.to_thread(fetch, client_proxy, "admin", "/config_dump"))
            outbound = [w["accepted"]["uid-client"]["outbound"] for w in client_dump["workers"]]
            assert outbound == [CONNECTIONS // 2] * 2, outbound
            server_dump = json.loads(await asyncio.to_thread(fetch, server_proxy, "admin", "/config_dump"))
            inbound = [w["accepted"]["uid-server"]["inbound"] for w in server_dump["workers"]]
            assert sum(inbound) >= 1, inbound  # HBONE connections; pooled, so up to 16
            metrics = (await asyncio.to_thread(fetch, server_proxy, "stats", "/metrics")).decode()
            opened = sample(
                metrics,
                "istio_tcp_connections_opened_total",
                reporter="destination",
                source_principal=CLIENT_ID,
            )
            assert opened == CONNECTIONS  # every stream, from whichever worker, with the client's identity
            metrics = (await asyncio.to_thread(fetch, client_proxy, "stats", "/metrics")).decode()
            assert sample(metrics, "workload_manager_active_proxy_count") == 1  # the owner's, not per worker

            # A client worker dies: it is restarted, given the pod's sockets and namespace again,
            # and the pod's traffic flows through both workers once more.
            victim = client_proxy.pool.workers[0]
            old_pid = victim.pid
            assert old_pid is not None
            os.kill(old_pid, signal.SIGKILL)
            await wait_for(lambda: victim.state == "up" and victim.pid != old_pid, what="worker 0 restarted")
            await on_each_worker()
            await client_proxy.pool.refresh_stats()
            assert all(w["accepted"]["uid-client"]["outbound"] > 0 for w in client_proxy.pool.dump())

            # The pod leaves: the owner closes its copies and every worker stops the pod's proxy.
            assert await servers[1].del_workload("uid-server") is None
            await wait_for(
                lambda: "uid-server" not in server_proxy.inpod.pods, what="server pod proxy stopped"
            )
            assert "uid-server" not in server_proxy.pool.proxies
            await server_proxy.pool.refresh_stats()
            assert all("uid-server" not in w["accepted"] for w in server_proxy.pool.dump())
        finally:
            for proxy in proxies:
                await proxy.drain(0.5)
            for zds in servers:
                await zds.stop()
            for fd in fds:
                os.close(fd)


async def test_dns_captured_in_the_pod_is_answered_by_the_owner_with_two_workers(runner, tmp_path: Path):
    """The DNS proxy stays in the owner: with two workers, a pod's captured query is answered
    from the pod's 15053, which the owner opened in the pod's namespace."""
    from tests.helpers.shared_mode import dns_query

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
                "ZTUNNEL_WORKER_THREADS": "2",
            }
        )
        try:
            await proxy.start()
            await wait_for(lambda: proxy.readiness.ready, what="the pod's proxy")
            got = await asyncio.to_thread(
                dns_query, client.netns, "10.96.0.10", "echo.shop.svc.cluster.local."
            )
            assert got == ["10.96.0.50"]
        finally:
            await proxy.drain(0.5)
            await zds.stop()
            os.close(fd)
