"""Tier 2: traffic to a service (or workload) with a waypoint goes to the waypoint over HBONE.

A stand-in waypoint (an HBONE server presenting the waypoint's identity, answering with a
marker) listens on the waypoint workload's 15008, as ztunnel's tests do with their HBONE test
server; the client's proxy must dial it with the ORIGINAL VIP:port as the CONNECT authority
(docs/istio-behaviour.md, "Outbound (15001)") and verify the waypoint's identity.
"""

from __future__ import annotations

import asyncio
import ssl
from datetime import UTC, datetime

from ambient_mesh.identity.ca import CertificateAuthority
from ambient_mesh.identity.spiffe import Identity
from ambient_mesh.proxy.hbone import HboneConnection
from ambient_mesh.tls.context import verify_client_identity
from tests.helpers.tls_stdlib import stdlib_server_context as server_context

from .mesh import CLIENT_IP, SERVER_IP, VIP, WAYPOINT_IP, local_config, start_proxy

WAYPOINT = f"""
- uid: cluster1//v1/Pod/default/waypoint
  name: waypoint
  namespace: default
  serviceAccount: waypoint
  trustDomain: cluster.local
  workloadIps: ["{WAYPOINT_IP}"]
  protocol: HBONE
  node: node-w
"""

SERVICE_WITH_WAYPOINT = f"""
- name: reviews
  namespace: default
  hostname: reviews.default.svc.cluster.local
  vips: ["/127.10.0.9"]
  ports: {{9080: 8080}}
  waypoint: {{destination: "/{WAYPOINT_IP}", hboneMtlsPort: 15008}}
"""

MARKER = b"via-waypoint "


class StandInWaypoint:
    """Accepts HBONE as the waypoint identity, records each CONNECT, answers with a marker."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, Identity | None, str | None]] = []
        self.server = None

    async def start(self) -> None:
        cert = CertificateAuthority.insecure_test_ca().issue(
            Identity("cluster.local", "default", "waypoint"), 3600, now=datetime.now(UTC)
        )
        ctx = server_context(cert)

        def factory():
            def check(conn: HboneConnection) -> None:
                conn.peer_identity = verify_client_identity(
                    conn.transport.get_extra_info("ssl_object"), "cluster.local"
                )

            def on_request(stream) -> None:
                self.requests.append(
                    (stream.request.authority, stream.conn.peer_identity, stream.request.header("forwarded"))
                )
                stream.conn.respond(stream, 200)
                stream.write(MARKER)
                stream.write_eof()

            return HboneConnection(client_side=False, on_request=on_request, on_connected=check)

        self.server = await asyncio.get_running_loop().create_server(factory, WAYPOINT_IP, 15008, ssl=ctx)

    async def close(self) -> None:
        self.server.close()


async def socks_read(proxy, ip: str, port: int) -> bytes:
    addr = proxy.listeners["socks5"].bound_address
    reader, writer = await asyncio.open_connection(str(addr.ip), addr.port)
    writer.write(b"\x05\x01\x00\x05\x01\x00\x01" + bytes(map(int, ip.split("."))) + port.to_bytes(2, "big"))
    await reader.readexactly(12)
    try:
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


async def test_service_with_waypoint_goes_to_the_waypoint_with_the_vip_as_authority():
    waypoint = StandInWaypoint()
    await waypoint.start()
    client = await start_proxy(
        "client", CLIENT_IP, local_config(extra_workloads=WAYPOINT, extra_services=SERVICE_WITH_WAYPOINT)
    )
    try:
        assert await socks_read(client, "127.10.0.9", 9080) == MARKER
        assert len(waypoint.requests) == 1
        authority, caller, forwarded = waypoint.requests[0]
        assert authority == "127.10.0.9:9080"  # the original VIP:port, not an endpoint
        assert caller == Identity("cluster.local", "default", "client")
        assert forwarded is not None and "host=reviews.default.svc.cluster.local" in forwarded
        # a service without a waypoint is still routed directly (no second waypoint request)
        text = client.metrics.render()[0].decode()
        assert 'destination_principal="spiffe://cluster.local/ns/default/sa/waypoint"' in text
    finally:
        await client.drain(0.5)
        await waypoint.close()
    assert VIP != "127.10.0.9" and SERVER_IP  # the echo service of the mesh config is untouched


async def test_workload_with_waypoint_goes_to_the_waypoint_with_the_original_target():
    server_with_waypoint = local_config(extra_workloads=WAYPOINT).replace(
        f'workloadIps: ["{SERVER_IP}"]',
        f'workloadIps: ["{SERVER_IP}"]\n  waypoint: {{destination: "/{WAYPOINT_IP}", hboneMtlsPort: 15008}}',
    )
    waypoint = StandInWaypoint()
    await waypoint.start()
    client = await start_proxy("client", CLIENT_IP, server_with_waypoint)
    try:
        assert await socks_read(client, SERVER_IP, 8080) == MARKER
        assert [r[0] for r in waypoint.requests] == [f"{SERVER_IP}:8080"]
    finally:
        await client.drain(0.5)
        await waypoint.close()


async def test_waypoint_presenting_another_identity_is_refused():
    waypoint = StandInWaypoint()
    # the config says the waypoint runs as sa "waypoint"; claim it is "other" so the presented
    # certificate does not match what the client expects
    config = local_config(
        extra_workloads=WAYPOINT.replace("serviceAccount: waypoint", "serviceAccount: other"),
        extra_services=SERVICE_WITH_WAYPOINT,
    )
    await waypoint.start()
    client = await start_proxy("client", CLIENT_IP, config)
    try:
        try:
            got = await socks_read(client, "127.10.0.9", 9080)
        except (ConnectionResetError, ssl.SSLError):
            got = b""
        assert got == b""
        assert waypoint.requests == []
    finally:
        await client.drain(0.5)
        await waypoint.close()
