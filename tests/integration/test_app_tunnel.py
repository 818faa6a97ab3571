"""Tier 2: a destination workload with an application tunnel gets a PROXY v2 header first
(docs/istio-behaviour.md, "PROXY protocol and application tunnels"): the real client, the requested target,
and the client's SPIFFE identity in TLV 0xD0, delivered over loopback to the tunnel port."""

from __future__ import annotations

import asyncio

from ambient_mesh.proxy.proxy_protocol import TLV_PEER_IDENTITY, decode_v2

from .mesh import CLIENT_IP, SERVER_IP, local_config, running_mesh

TUNNEL_PORT = 15088


async def test_proxy_header_names_client_target_and_identity():
    received: list[bytes] = []
    done = asyncio.Event()

    async def app(reader, writer):
        data = b""
        while b"hello" not in data:
            chunk = await reader.read(4096)
            if not chunk:
                break
            data += chunk
        received.append(data)
        writer.write(b"ok")
        await writer.drain()
        writer.close()
        done.set()

    tunnel_app = await asyncio.start_server(app, "127.0.0.1", TUNNEL_PORT)
    config = local_config().replace(
        f'workloadIps: ["{SERVER_IP}"]',
        f'workloadIps: ["{SERVER_IP}"]\n  applicationTunnel: {{protocol: PROXY, port: {TUNNEL_PORT}}}',
    )
    try:
        async with running_mesh(config, echo=False) as mesh:
            reader, writer = await mesh.socks_connect(SERVER_IP, 8080)
            writer.write(b"hello")
            assert await asyncio.wait_for(reader.read(), 10) == b"ok"
            writer.close()
            await asyncio.wait_for(done.wait(), 5)
    finally:
        tunnel_app.close()
        await tunnel_app.wait_closed()
    header, used = decode_v2(received[0])
    assert str(header.source.ip) == CLIENT_IP
    assert str(header.destination) == f"{SERVER_IP}:8080"
    assert header.tlv(TLV_PEER_IDENTITY) == b"spiffe://cluster.local/ns/default/sa/client"
    assert received[0][used:] == b"hello"
