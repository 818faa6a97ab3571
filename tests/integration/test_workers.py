"""ZTUNNEL_WORKER_THREADS=2 on loopback: two worker processes share the server proxy's
listeners, get the owner's state and certificates, and report into one /stats and /config_dump.

The client proxy is single-process with POOL_MAX_STREAMS_PER_CONNECTION=1, so each concurrent
connection is its own HBONE connection to the server's 15008. The workers take connections from
one accept queue, whichever has time first; the tests stop (SIGSTOP) all workers but one while
they connect, so which worker serves which connection is known, and a stopped worker is also
shown not to hold any up (with one SO_REUSEPORT member per worker, its share would wait).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import urllib.request

import pytest

from ambient_mesh.workers.owner import WorkerPool
from ambient_mesh.ztunnel import Ztunnel
from tests.helpers.workers import only_worker

from .fake_ads import AUTHORIZATION, FakeAds, authorization
from .mesh import CLIENT_IP, ECHO_PORT, SERVER_IP, Mesh, echo_handler, local_config, start_proxy

CONNECTIONS = 16


@pytest.fixture
async def fake():
    server = FakeAds()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@contextlib.asynccontextmanager
async def worker_mesh(fake: FakeAds):
    config = local_config()
    echo = await asyncio.start_server(echo_handler, SERVER_IP, ECHO_PORT)
    client = server = None
    try:
        server = await start_proxy(
            "server", SERVER_IP, config, XDS_ADDRESS=fake.address, ZTUNNEL_WORKER_THREADS="2"
        )
        client = await start_proxy("client", CLIENT_IP, config, POOL_MAX_STREAMS_PER_CONNECTION="1")
        yield Mesh(client, server, [echo])
    finally:
        for proxy in (client, server):
            if proxy is not None:
                await proxy.drain(0.5)
        echo.close()
        await echo.wait_closed()


def get(proxy: Ztunnel, server: str, path: str) -> bytes:
    bound = (proxy.admin if server == "admin" else proxy.stats).bound_address
    with urllib.request.urlopen(f"http://{bound.ip}:{bound.port}{path}", timeout=10) as reply:
        return reply.read()


async def fetch(proxy: Ztunnel, server: str, path: str) -> bytes:
    return await asyncio.to_thread(get, proxy, server, path)


def sample(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def open_on_each_worker(mesh: Mesh, pool: WorkerPool, n: int):
    """`n` echoing connections, the first half accepted by worker 0 alone, the rest by worker 1."""
    conns = []
    for index, count in ((0, n // 2), (1, n - n // 2)):
        with only_worker(pool, index):
            conns += await open_echoing(mesh, count)
    return conns


async def open_echoing(mesh: Mesh, n: int):
    conns = []
    for i in range(n):
        reader, writer = await mesh.socks_connect(SERVER_IP, ECHO_PORT)
        writer.write(b"ping %d\n" % i)
        await writer.drain()
        assert await asyncio.wait_for(reader.readline(), 10) == b"ping %d\n" % i
        conns.append((reader, writer))
    return conns


async def closed_by_peer(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), 10) == b""
    except (ConnectionError, OSError):
        return True


async def test_two_workers_share_the_listeners_and_both_get_a_policy_from_xds(fake: FakeAds):
    async with worker_mesh(fake) as mesh:
        server = mesh.server
        assert server.pool is not None and server.pool.count == 2
        assert server.listeners == {}  # no listener in the owner: the workers accept
        conns = await open_on_each_worker(mesh, server.pool, CONNECTIONS)

        # Each worker accepted its half while the other was stopped (one accept queue: the
        # stopped one held none up), and /config_dump shows them all (one view).
        dump = json.loads(await fetch(server, "admin", "/config_dump"))
        accepted = [w["accepted"]["dedicated"]["inbound"] for w in dump["workers"]]
        assert accepted == [CONNECTIONS // 2, CONNECTIONS - CONNECTIONS // 2]
        assert {w["state"] for w in dump["workers"]} == {"up"}
        assert len({w["pid"] for w in dump["workers"]} | {os.getpid()}) == 3
        assert (
            len(dump["workloadState"]["cluster1//v1/Pod/default/server"]["connections"]["inbound"])
            == CONNECTIONS
        )
        # ... and in /stats/prometheus, summed over the workers.
        metrics = (await fetch(server, "stats", "/stats/prometheus")).decode()
        opened = sample(metrics, "istio_tcp_connections_opened_total", reporter="destination")
        assert opened == CONNECTIONS
        assert metrics.count("# TYPE istio_tcp_connections_opened_total counter") == 1
        assert sample(metrics, "istio_build") == 1.0  # the owner's, not one per worker

        # A policy pushed over xDS reaches the owner and both workers: every open connection,
        # whichever worker holds it, is closed, and new ones are refused.
        nonce = await fake.push(AUTHORIZATION, [authorization("allow-nothing", namespace="default", scope=1)])
        reply = await fake.wait_reply(nonce)
        assert not reply.HasField("error_detail")
        assert "default/allow-nothing" in server.state.policies
        results = await asyncio.gather(*(closed_by_peer(r) for r, _w in conns))
        assert all(results)
        for _r, w in conns:
            w.close()
        with pytest.raises(ConnectionRefusedError, match="SOCKS5 reply 2"):  # not allowed by ruleset
            await mesh.socks_connect(SERVER_IP, ECHO_PORT)
        metrics = (await fetch(server, "stats", "/stats/prometheus")).decode()
        assert (
            sample(
                metrics, "istio_tcp_connections_failed_total", reporter="destination", response_flags="DENY"
            )
            >= CONNECTIONS
        )


async def test_a_dead_worker_is_restarted_and_served_again_without_losing_counters(fake: FakeAds):
    async with worker_mesh(fake) as mesh:
        server = mesh.server
        pool = server.pool
        assert pool is not None
        # All on worker 0, the one to die: no HBONE connection the client pools afterwards
        # leads to worker 1, which open_on_each_worker stops below.
        with only_worker(pool, 0):
            conns = await open_echoing(mesh, CONNECTIONS)
        for _r, w in conns:
            w.close()
        await pool.refresh_stats()
        victim = pool.workers[0]
        old_pid = victim.pid
        assert old_pid is not None
        before = sample(
            (await fetch(server, "stats", "/metrics")).decode(), "istio_tcp_connections_opened_total"
        )
        assert before == CONNECTIONS
        os.kill(old_pid, signal.SIGKILL)
        for _ in range(300):
            if victim.state == "up" and victim.pid != old_pid:
                break
            await asyncio.sleep(0.05)
        assert victim.state == "up" and victim.pid != old_pid and victim.restarts == 1
        # The restarted worker has the state, a certificate and its sockets again: new
        # connections succeed on both workers.
        conns = await open_on_each_worker(mesh, pool, CONNECTIONS)
        dump = json.loads(await fetch(server, "admin", "/config_dump"))
        assert all(w["accepted"]["dedicated"]["inbound"] > 0 for w in dump["workers"])
        # The dead worker's counters were kept: the total still counts every connection.
        after = sample(
            (await fetch(server, "stats", "/metrics")).decode(), "istio_tcp_connections_opened_total"
        )
        assert after == 2 * CONNECTIONS
        for _r, w in conns:
            w.close()


async def test_sigterm_to_the_owner_drains_every_worker_and_exits_zero():
    from tests.helpers.ztunnel_process import AMBIENT, wait_ready_line

    from .mesh import proxy_env

    env = {**os.environ, **proxy_env("server", "127.0.0.33", local_config()), "ZTUNNEL_WORKER_THREADS": "2"}
    proc = await asyncio.create_subprocess_exec(
        *AMBIENT, env=env, stderr=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL
    )
    try:
        fields = await wait_ready_line(proc)
        assert fields["workers"] == "2"
        with urllib.request.urlopen(f"http://{fields['admin']}/config_dump", timeout=10) as reply:
            pids = [w["pid"] for w in json.loads(reply.read())["workers"]]
        assert len(pids) == 2 and all(pids)
        proc.send_signal(signal.SIGTERM)
        rest = (await asyncio.wait_for(proc.stderr.read(), 30)).decode()
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        assert "draining 2 worker processes" in rest
        for pid in pids:  # the workers are gone too (not left behind as orphans)
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_socks5_domain_names_resolve_in_every_worker():
    config = local_config()
    echo = await asyncio.start_server(echo_handler, SERVER_IP, ECHO_PORT)
    client = server = None
    try:
        server = await start_proxy("server", SERVER_IP, config)
        client = await start_proxy("client", CLIENT_IP, config, ZTUNNEL_WORKER_THREADS="2")
        assert client.remote is not None
        host, _, port = client.remote.bound_addresses()["socks5"].rpartition(":")
        name = b"echo.default.svc.cluster.local"
        assert client.pool is not None
        for i in range(CONNECTIONS):
            with only_worker(client.pool, i % 2):
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(
                    b"\x05\x01\x00\x05\x01\x00\x03" + bytes([len(name)]) + name + (80).to_bytes(2, "big")
                )
                await writer.drain()
                reply = await asyncio.wait_for(reader.readexactly(12), 10)
                # Resolved (the mesh service's VIP) and connected.
                assert reply[:4] == b"\x05\x00\x05\x00", reply
                writer.write(b"hello %d\n" % i)
                assert await asyncio.wait_for(reader.readline(), 10) == b"hello %d\n" % i
                writer.close()
        await client.pool.refresh_stats()
        assert [w["accepted"]["dedicated"]["socks5"] for w in client.pool.dump()] == [CONNECTIONS // 2] * 2
    finally:
        for proxy in (client, server):
            if proxy is not None:
                await proxy.drain(0.5)
        echo.close()
        await echo.wait_closed()


def test_workers_serve_pods_with_inpod_port_reuse_off():
    # The workers share one socket per pod listener, not an SO_REUSEPORT group: INPOD_PORT_REUSE
    # is the pod sockets' own option again, as with one process (it used to be refused here).
    from ambient_mesh.config import ProxyMode, ZtunnelConfig
    from ambient_mesh.ztunnel import check_supported

    check_supported(ZtunnelConfig(proxy_mode=ProxyMode.SHARED, worker_threads=2, inpod_port_reuse=False))
