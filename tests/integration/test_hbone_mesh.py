"""Tier 2: two node proxies in one process, talking HBONE over loopback."""

from __future__ import annotations

import asyncio
import logging
import ssl
from datetime import UTC, datetime

import pytest

from ambient_mesh.identity.ca import CertificateAuthority
from ambient_mesh.identity.spiffe import Identity
from ambient_mesh.proxy.hbone import HboneConnection
from ambient_mesh.transport.relay import Relay, TcpEndpoint
from tests.helpers.tls_stdlib import stdlib_client_context as client_context

from .mesh import (
    CLIENT_IP,
    ECHO_PORT,
    SERVER_IP,
    TCP_IP,
    VIP,
    echo_handler,
    local_config,
    running_mesh,
    start_proxy,
    transfer,
)

CLIENT_ID = Identity("cluster.local", "default", "client")
SERVER_ID = Identity("cluster.local", "default", "server")


def access_lines(caplog, direction: str) -> list[dict]:
    out = []
    for rec in caplog.records:
        if rec.getMessage() == "connection complete":
            fields = getattr(rec, "fields", {})
            if fields.get("direction") == direction:
                out.append(fields)
    return out


async def echo_once(mesh, ip: str, port: int, payload: bytes = b"hello mesh") -> bytes:
    reader, writer = await mesh.socks_connect(ip, port)
    writer.write(payload)
    writer.write_eof()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return data


async def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


async def test_pod_ip_crosses_hbone_with_client_identity(caplog):
    caplog.set_level(logging.INFO, logger="ambient_mesh")
    async with running_mesh() as mesh:
        assert await echo_once(mesh, SERVER_IP, ECHO_PORT) == b"hello mesh"
        await wait_for(lambda: access_lines(caplog, "inbound") and access_lines(caplog, "outbound"))
    inbound = access_lines(caplog, "inbound")[0]
    assert inbound["src.identity"] == str(CLIENT_ID)
    assert inbound["dst.identity"] == str(SERVER_ID)
    assert inbound["src.workload"] == "client"
    assert inbound["dst.hbone_addr"] == f"{SERVER_IP}:{ECHO_PORT}"
    assert inbound["bytes_recv"] == 10 and inbound["bytes_sent"] == 10
    outbound = access_lines(caplog, "outbound")[0]
    assert outbound["dst.addr"] == f"{SERVER_IP}:15008"
    assert outbound["dst.identity"] == str(SERVER_ID)


async def test_service_vip_is_load_balanced_to_the_endpoint(caplog):
    caplog.set_level(logging.INFO, logger="ambient_mesh")
    async with running_mesh() as mesh:
        assert await echo_once(mesh, VIP, 80, b"via vip") == b"via vip"
        await wait_for(lambda: access_lines(caplog, "inbound"))
    inbound = access_lines(caplog, "inbound")[0]
    # The VIP:80 became pod:8080 on the client side; the server saw the service in `forwarded`.
    assert inbound["dst.hbone_addr"] == f"{SERVER_IP}:{ECHO_PORT}"
    assert inbound["dst.service"] == "echo.default.svc.cluster.local"
    assert inbound["src.identity"] == str(CLIENT_ID)


async def test_plain_tcp_workload_gets_plain_tcp_from_the_client_address():
    peers = []

    async def remember_peer(reader, writer):
        peers.append(writer.get_extra_info("peername")[0])
        await echo_handler(reader, writer)

    plain = await asyncio.start_server(remember_peer, TCP_IP, 9090)
    try:
        async with running_mesh() as mesh:
            assert await echo_once(mesh, TCP_IP, 9090, b"plain") == b"plain"
            # The plain server got plain TCP (it echoed raw bytes) from the client workload's address.
            assert peers == [CLIENT_IP]
            assert mesh.client.pi.pool.connections_opened == 0
    finally:
        plain.close()
        await plain.wait_closed()


async def test_unknown_destination_passes_through_unchanged():
    unknown = await asyncio.start_server(echo_handler, "127.0.0.9", 9091)
    try:
        async with running_mesh() as mesh:
            assert await echo_once(mesh, "127.0.0.9", 9091, b"passthrough") == b"passthrough"
            assert mesh.client.pi.pool.connections_opened == 0
    finally:
        unknown.close()
        await unknown.wait_closed()


async def test_half_close_both_ways():
    """Client half-closes first; the server answers after seeing EOF, then half-closes too."""

    async def answer_after_eof(reader, writer):
        request = await reader.read()  # until the client's EOF arrives through the tunnel
        writer.write(b"got " + request)
        await writer.drain()
        writer.write_eof()
        await asyncio.sleep(0.2)
        writer.close()

    server = await asyncio.start_server(answer_after_eof, SERVER_IP, 7070)
    try:
        async with running_mesh() as mesh:
            reader, writer = await mesh.socks_connect(SERVER_IP, 7070)
            writer.write(b"question")
            writer.write_eof()
            reply = await asyncio.wait_for(reader.read(), 10)
            assert reply == b"got question"
            writer.close()
    finally:
        server.close()
        await server.wait_closed()


async def test_one_gib_through_the_tunnel_intact():
    async with running_mesh() as mesh:
        reader, writer = await mesh.socks_connect(SERVER_IP, ECHO_PORT)
        sent, received = await asyncio.wait_for(transfer(reader, writer, 1024**3), 300)
        assert sent == received


async def test_many_concurrent_streams_share_one_pooled_connection():
    async with running_mesh() as mesh:
        conns = [await mesh.socks_connect(SERVER_IP, ECHO_PORT) for _ in range(50)]
        for i, (_r, w) in enumerate(conns):
            w.write(f"stream {i}".encode())
        replies = await asyncio.gather(
            *(r.readexactly(len(f"stream {i}")) for i, (r, _w) in enumerate(conns))
        )
        assert replies == [f"stream {i}".encode() for i in range(50)]
        pool = mesh.client.pi.pool
        assert pool.connections_opened == 1
        assert repr(pool) == "HbonePool(1 keys, 1 active, 0 idle, 50 streams, 0 connecting)"
        for _r, w in conns:
            w.close()
        await wait_for(lambda: " 0 streams" in repr(pool))
        assert repr(pool) == "HbonePool(1 keys, 0 active, 1 idle, 0 streams, 0 connecting)"


async def test_stream_limit_opens_another_connection():
    async with running_mesh(client_env={"POOL_MAX_STREAMS_PER_CONNECTION": "10"}) as mesh:
        conns = [await mesh.socks_connect(SERVER_IP, ECHO_PORT) for _ in range(15)]
        for _r, w in conns:
            w.write(b"x")
        await asyncio.gather(*(r.readexactly(1) for r, _w in conns))
        pool = mesh.client.pi.pool
        assert pool.connections_opened == 2
        assert repr(pool) == "HbonePool(1 keys, 2 active, 0 idle, 15 streams, 0 connecting)"
        for _r, w in conns:
            w.close()


async def test_pool_reuses_connections_and_expires_idle_ones():
    async with running_mesh(client_env={"POOL_UNUSED_RELEASE_TIMEOUT": "1s"}) as mesh:
        pool = mesh.client.pi.pool
        for _i in range(3):
            assert await echo_once(mesh, SERVER_IP, ECHO_PORT, b"again") == b"again"
        assert pool.connections_opened == 1
        await asyncio.sleep(1.1)
        pool.expire_idle()
        assert repr(pool) == "HbonePool(0 keys, 0 active, 0 idle, 0 streams, 0 connecting)"
        assert await echo_once(mesh, SERVER_IP, ECHO_PORT, b"fresh") == b"fresh"
        assert pool.connections_opened == 2


async def test_server_with_unexpected_identity_is_refused():
    """The client expects the server workload's identity; a server presenting another one fails."""
    client_view = local_config()
    server_view = local_config(server_sa="impostor")
    echo = await asyncio.start_server(echo_handler, SERVER_IP, ECHO_PORT)
    client = await start_proxy("client", CLIENT_IP, client_view)
    server = await start_proxy(
        "server", SERVER_IP, server_view, PROXY_WORKLOAD_INFO="default/server/impostor"
    )
    try:
        socks = client.listeners["socks5"].bound_address
        reader, writer = await asyncio.open_connection(str(socks.ip), socks.port)
        writer.write(b"\x05\x01\x00\x05\x01\x00\x01" + bytes([127, 0, 0, 3]) + ECHO_PORT.to_bytes(2, "big"))
        await reader.readexactly(12)
        writer.write(b"secret")
        try:  # closed (FIN or reset), nothing delivered
            assert await asyncio.wait_for(reader.read(), 10) == b""
        except ConnectionResetError:
            pass
        writer.close()
        text = client.metrics.render()[0].decode()
        assert 'response_flags="TLS_FAILURE"' in text
    finally:
        await client.drain(0.5)
        await server.drain(0.5)
        echo.close()
        await echo.wait_closed()


# Raw HBONE clients against the server proxy's 15008 ----------------------------------------


def issue(identity: Identity, ca: CertificateAuthority | None = None):
    return (ca or CertificateAuthority.insecure_test_ca()).issue(identity, 3600, now=datetime.now(UTC))


async def raw_hbone(ctx: ssl.SSLContext, address: str = SERVER_IP, port: int = 15008) -> HboneConnection:
    loop = asyncio.get_running_loop()
    _t, conn = await loop.create_connection(
        lambda: HboneConnection(client_side=True), address, port, ssl=ctx, server_hostname=""
    )
    return conn


async def connect_status(conn: HboneConnection, authority: str) -> int:
    _stream, response = await asyncio.wait_for(conn.open_stream(authority, []), 10)
    return response.status


async def test_status_codes_of_the_hbone_server():
    async with running_mesh() as mesh:
        conn = await raw_hbone(client_context(issue(CLIENT_ID)))
        stream, response = await conn.open_stream(f"{SERVER_IP}:{ECHO_PORT}", [])
        assert response.status == 200
        assert (
            response.header("baggage") == "k8s.namespace.name=default,k8s.deployment.name=server,"
            "service.name=server,service.version=v1"
        )
        stream.abort()
        # authority IP is not the address the connection arrived on
        assert await connect_status(conn, f"127.0.0.9:{ECHO_PORT}") == 400
        # a proxy port as target (loop)
        assert await connect_status(conn, f"{SERVER_IP}:15008") == 400
        # not an address
        assert await connect_status(conn, "no-port") == 400
        # nothing listening on the target port
        assert await connect_status(conn, f"{SERVER_IP}:9") == 503
        # hostname authority for a service that does not exist
        assert await connect_status(conn, "nope.default.svc.cluster.local:80") == 503
        # hostname authority for the echo service maps service port 80 to 8080
        assert await connect_status(conn, "echo.default.svc.cluster.local:80") == 200
        assert "server" in repr(conn) or conn.usable
        text = mesh.server.metrics.render()[0].decode()
        assert "istio_tcp_connections_failed_total" in text


async def test_non_connect_method_gets_400():
    from ambient_mesh.proxy.hbone import HboneStream

    async with running_mesh():
        conn = await raw_hbone(client_context(issue(CLIENT_ID)))
        request = [
            (b":method", b"GET"),
            (b":scheme", b"https"),
            (b":path", b"/"),
            (b":authority", f"{SERVER_IP}:{ECHO_PORT}".encode()),
        ]
        sid = conn.core.send_request(request, end_stream=True)  # a legal HTTP/2 request, not CONNECT
        stream = HboneStream(conn, sid)
        conn.streams[sid] = stream
        conn.flush()
        response = await asyncio.wait_for(stream.response, 10)
        assert response.status == 400


@pytest.mark.parametrize("case", ["other-trust-domain", "no-client-cert", "other-root"])
async def test_hbone_server_refuses_bad_clients(case):
    if case == "other-trust-domain":
        ctx = client_context(issue(Identity("evil.local", "default", "client")))
    elif case == "other-root":
        ctx = client_context(issue(CLIENT_ID, CertificateAuthority.self_signed("cluster.local")))
    else:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.set_alpn_protocols(["h2"])
    async with running_mesh():
        try:
            conn = await raw_hbone(ctx)
        except (ssl.SSLError, ConnectionError, OSError):
            return  # refused during the handshake
        # TLS 1.3: the server rejects the client certificate after the client finished; the
        # connection must close without ever answering a CONNECT.
        with pytest.raises(Exception):  # noqa: B017 - closed connection, reset or HboneError
            await asyncio.wait_for(conn.open_stream(f"{SERVER_IP}:{ECHO_PORT}", []), 10)


async def test_drain_waits_for_open_connections_then_closes():
    async with running_mesh() as mesh:
        reader, writer = await mesh.socks_connect(SERVER_IP, ECHO_PORT)
        writer.write(b"before drain")
        assert await reader.readexactly(12) == b"before drain"
        drain = asyncio.create_task(mesh.client.drain(0.5))
        await asyncio.sleep(0.2)
        assert not drain.done()  # the open connection holds the drain until the deadline
        await asyncio.wait_for(drain, 5)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # forced closed at the deadline
        writer.close()


async def test_a_drain_past_its_deadline_closes_hbone_connections_through_their_transport():
    """The server proxy's drain ends while a tunnel is open: the task serving its HBONE connection
    is cancelled. The connection's TLS transport must close the socket itself, taking its
    descriptor off the event loop first. The listener once closed the socket under it, and the
    loop kept watching a descriptor number the next socket reused: in the lab, the next admin
    request took that number and timed out."""
    async with running_mesh() as mesh:
        reader, writer = await mesh.socks_connect(SERVER_IP, ECHO_PORT)
        writer.write(b"held")
        assert await reader.readexactly(4) == b"held"
        assert mesh.server.workload_proxy is not None
        [conn] = mesh.server.workload_proxy.inbound.connections
        transport = conn.transport
        assert transport is not None and not transport.is_closing()
        await asyncio.wait_for(mesh.server.drain(0.2), 5)
        assert transport.is_closing(), "the HBONE connection's socket was closed under its transport"
        await asyncio.wait_for(conn.closed, 5)
        writer.close()


async def test_server_proxy_drain_lets_a_live_tunnel_finish_after_goaway():
    """SIGTERM / quitquitquit on the server proxy: GOAWAY to the client proxy, but the open tunnel
    keeps carrying data both ways until it ends, and the drain ends with it, before the deadline."""
    async with running_mesh() as mesh:
        reader, writer = await mesh.socks_connect(SERVER_IP, ECHO_PORT)
        writer.write(b"before drain;")
        assert await reader.readexactly(13) == b"before drain;"
        [pooled] = [c for cs in mesh.client.pi.pool._connections.values() for c in cs]
        drain = asyncio.create_task(mesh.server.drain(10))
        await wait_for(lambda: pooled.goaway_received)
        for i in range(10):
            chunk = f"after goaway {i};".encode()
            writer.write(chunk)
            assert await asyncio.wait_for(reader.readexactly(len(chunk)), 5) == chunk
            await asyncio.sleep(0.02)
        assert not drain.done()
        writer.write_eof()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        await asyncio.wait_for(drain, 5)  # ended with the tunnel, well before the 10 s deadline
        await wait_for(lambda: pooled.closed.done())  # the client side closed it too, cleanly
        assert pooled.error is None


async def test_relay_repr_and_counts():
    """The relay reports what it carried (used by the pool and dumps)."""
    a, b = TcpEndpoint(), TcpEndpoint()
    relay = Relay(a, b)
    assert repr(relay) == "Relay(open, up=0B, down=0B)"
