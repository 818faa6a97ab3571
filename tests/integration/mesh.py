"""An in-process mesh for tier-2 tests: node proxies in dedicated mode on loopback addresses.

Like ztunnel's tests/direct.rs: each proxy serves one workload at its own 127.0.0.x address,
with SOCKS5 on an ephemeral port as the client's way in (no iptables needed), and HBONE on
<workload ip>:15008 so proxies reach each other exactly as across nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
from dataclasses import dataclass, field

from ambient_mesh.ports import HBONE_PORT
from ambient_mesh.ztunnel import Ztunnel, build

CLIENT_IP = "127.0.0.2"
SERVER_IP = "127.0.0.3"
TCP_IP = "127.0.0.4"
WAYPOINT_IP = "127.0.0.5"
VIP = "127.10.0.1"
ECHO_PORT = 8080


def local_config(
    extra_workloads: str = "",
    extra_services: str = "",
    policies: str = "",
    server_sa: str = "server",
    server_td: str = "cluster.local",
) -> str:
    return f"""
workloads:
- uid: cluster1//v1/Pod/default/client
  name: client
  namespace: default
  serviceAccount: client
  trustDomain: cluster.local
  workloadIps: ["{CLIENT_IP}"]
  protocol: HBONE
  node: node-a
  canonicalName: client
  canonicalRevision: v1
  workloadName: client
- uid: cluster1//v1/Pod/default/server
  name: server
  namespace: default
  serviceAccount: {server_sa}
  trustDomain: {server_td}
  workloadIps: ["{SERVER_IP}"]
  protocol: HBONE
  node: node-b
  canonicalName: server
  canonicalRevision: v1
  workloadName: server
  services:
    "default/echo.default.svc.cluster.local":
      80: {ECHO_PORT}
- uid: cluster1//v1/Pod/default/plain
  name: plain
  namespace: default
  serviceAccount: plain
  trustDomain: cluster.local
  workloadIps: ["{TCP_IP}"]
  protocol: TCP
  node: node-c
{extra_workloads}
services:
- name: echo
  namespace: default
  hostname: echo.default.svc.cluster.local
  vips: ["/{VIP}"]
  ports: {{80: {ECHO_PORT}}}
{extra_services}
{"policies:" if policies else ""}
{policies}
"""


def listener_env(ip: str) -> dict[str, str]:
    """Every listener of an in-process proxy on `ip`: HBONE on its real port (peers dial it),
    the rest on kernel-chosen ports; SOCKS5 on, so tests can send through the outbound path."""
    return {
        "UNSTABLE_ENABLE_SOCKS5": "true",
        "OUTBOUND_ADDR": f"{ip}:0",
        "INBOUND_ADDR": f"{ip}:{HBONE_PORT}",
        "INBOUND_PLAINTEXT_ADDR": f"{ip}:0",
        "SOCKS5_ADDR": f"{ip}:0",
        "ADMIN_ADDR": f"{ip}:0",
        "STATS_ADDR": f"{ip}:0",
        "READINESS_ADDR": f"{ip}:0",
        "ISTIO_META_DNS_PROXY_ADDR": f"{ip}:0",
        "TERMINATION_GRACE_PERIOD_SECONDS": "2",
    }


def proxy_env(name: str, ip: str, config: str, **extra: str) -> dict[str, str]:
    env = {
        "PROXY_MODE": "dedicated",
        "PROXY_WORKLOAD_INFO": f"default/{name}/{name}",
        "FAKE_CA": "true",
        "XDS_ADDRESS": "",
        "LOCAL_XDS": config,
        **listener_env(ip),
    }
    env.update(extra)
    return env


async def start_proxy(name: str, ip: str, config: str, **extra: str) -> Ztunnel:
    proxy = await build(proxy_env(name, ip, config, **extra))
    await proxy.start()
    return proxy


async def echo_handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(256 * 1024):
            writer.write(data)
            await writer.drain()
        writer.write_eof()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


@dataclass
class Mesh:
    client: Ztunnel
    server: Ztunnel
    servers: list[asyncio.Server] = field(default_factory=list)

    async def socks_connect(self, ip: str, port: int, proxy: Ztunnel | None = None):
        """Open a connection through a proxy's SOCKS5 listener; returns (reader, writer)."""
        socks = (proxy or self.client).listeners["socks5"].bound_address
        reader, writer = await asyncio.open_connection(str(socks.ip), socks.port)
        writer.write(b"\x05\x01\x00\x05\x01\x00\x01" + socket.inet_aton(ip) + port.to_bytes(2, "big"))
        await writer.drain()
        greeting = await reader.readexactly(2)
        reply = await reader.readexactly(10)
        assert greeting == b"\x05\x00", greeting
        if reply[1] != 0:
            writer.close()
            raise ConnectionRefusedError(f"SOCKS5 reply {reply[1]}")
        return reader, writer

    async def echo_once(self, ip: str = SERVER_IP, port: int = ECHO_PORT, timeout_s: float = 15.0) -> None:
        """One connection through the client's SOCKS5 listener: a ping echoed, then closed."""
        async with asyncio.timeout(timeout_s):
            reader, writer = await self.socks_connect(ip, port)
            try:
                writer.write(b"ping")
                assert await reader.readexactly(4) == b"ping"
            finally:
                writer.close()

    async def close(self) -> None:
        for proxy in (self.client, self.server):
            await proxy.drain(0.5)
        for srv in self.servers:
            srv.close()
            await srv.wait_closed()


@contextlib.asynccontextmanager
async def running_mesh(
    config: str | None = None,
    *,
    client_env: dict | None = None,
    server_env: dict | None = None,
    echo: bool = True,
):
    config = config or local_config()
    servers = []
    if echo:
        servers.append(await asyncio.start_server(echo_handler, SERVER_IP, ECHO_PORT))
    client = server = None
    try:
        client = await start_proxy("client", CLIENT_IP, config, **(client_env or {}))
        server = await start_proxy("server", SERVER_IP, config, **(server_env or {}))
        mesh = Mesh(client, server, servers)
        yield mesh
    finally:
        for proxy in (client, server):
            if proxy is not None:
                await proxy.drain(0.5)
        for srv in servers:
            srv.close()
            await srv.wait_closed()


async def transfer(reader, writer, total: int, chunk: int = 1024 * 1024) -> tuple[str, str]:
    """Send `total` deterministic bytes, half-close, read the echo; return (sent, received) sha256."""
    sent_hash, recv_hash = hashlib.sha256(), hashlib.sha256()
    block = hashlib.sha256(b"seed").digest() * (chunk // 32)

    async def send() -> None:
        remaining = total
        while remaining > 0:
            piece = block[: min(chunk, remaining)]
            writer.write(piece)
            sent_hash.update(piece)
            remaining -= len(piece)
            await writer.drain()
        writer.write_eof()

    async def receive() -> int:
        got = 0
        while data := await reader.read(1024 * 1024):
            recv_hash.update(data)
            got += len(data)
        return got

    _, got = await asyncio.gather(send(), receive())
    writer.close()
    assert got == total, f"received {got} of {total} bytes"
    return sent_hash.hexdigest(), recv_hash.hexdigest()
