"""Two ends of a TLS connection over a loopback TCP pair, for the transport tests: the test CA's
certificates, a collecting protocol, and the record layer under test (`LAYER`, set per test)."""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime

from OpenSSL import SSL

from ambient_mesh.identity import CertificateAuthority, Identity
from ambient_mesh.tls.context import (
    client_context,
    server_context,
)
from ambient_mesh.tls.transport import OpenSslTransport, TlsTransport, start_tls

SERVER = Identity("cluster.local", "ns1", "server")

CLIENT = Identity("cluster.local", "ns2", "client")

CA = CertificateAuthority.insecure_test_ca()

STEP_TIMEOUT_S = 10.0


def _cert(identity: Identity):
    return CA.issue(identity, 3600, now=datetime.now(UTC))


SERVER_CERT = _cert(SERVER)

CLIENT_CERT = _cert(CLIENT)

OWN, OPENSSL = "own records", "OpenSSL records"

LAYER = [OWN]  # set per test by the `layer` fixture


def contexts() -> tuple[SSL.Context, SSL.Context]:
    """(server, client) contexts for the layer under test: TLS 1.2 keeps OpenSSL's records."""
    if LAYER[0] == OWN:
        return server_context(SERVER_CERT), client_context(CLIENT_CERT)
    server_ctx = server_context(SERVER_CERT, tls12=True)
    server_ctx.set_max_proto_version(SSL.TLS1_2_VERSION)
    return server_ctx, client_context(CLIENT_CERT, tls12=True)


class Collector(asyncio.BufferedProtocol):
    """Keeps what arrives, records the flow-control calls and the end."""

    def __init__(self, buffer_bytes: int = 64 * 1024) -> None:
        loop = asyncio.get_running_loop()
        self.buf = bytearray(buffer_bytes)
        self.data = bytearray()
        self.transport: TlsTransport | None = None
        self.eof = loop.create_future()
        self.lost: asyncio.Future[BaseException | None] = loop.create_future()
        self.paused = 0
        self.resumed = 0
        self.refcounts: list[int] = []
        self.grew = asyncio.Event()

    def connection_made(self, transport):
        self.transport = transport

    def get_buffer(self, sizehint):
        self.refcounts.append(sys.getrefcount(self.buf))
        return memoryview(self.buf)

    def buffer_updated(self, nbytes):
        self.data += self.buf[:nbytes]
        self.grew.set()

    def eof_received(self):
        if not self.eof.done():
            self.eof.set_result(None)
        return False

    def pause_writing(self):
        self.paused += 1

    def resume_writing(self):
        self.resumed += 1

    def connection_lost(self, exc):
        if not self.lost.done():
            self.lost.set_result(exc)

    async def wait_for_bytes(self, n: int) -> None:
        async with asyncio.timeout(STEP_TIMEOUT_S):
            while len(self.data) < n:
                self.grew.clear()
                await self.grew.wait()


def tcp_pair(buffer_bytes: int | None = None) -> tuple[socket.socket, socket.socket]:
    """(server side, client side) of one loopback TCP connection; `buffer_bytes` fixes both
    sockets' SO_SNDBUF and SO_RCVBUF (so that a peer that stops reading fills them soon)."""
    with socket.socket() as listener:
        client = socket.socket()
        if buffer_bytes is not None:
            for s in (listener, client):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        client.connect(listener.getsockname())
        server, _ = listener.accept()
    return server, client


@asynccontextmanager
async def tls_pair(
    server_proto: asyncio.BufferedProtocol | None = None,
    client_proto: asyncio.BufferedProtocol | None = None,
    buffer_bytes: int | None = None,
) -> AsyncIterator[tuple[Collector, Collector]]:
    s, c = tcp_pair(buffer_bytes)
    sp = server_proto or Collector()
    cp = client_proto or Collector()
    server_ctx, client_ctx = contexts()
    sni: list[str | None] = []
    server_ctx.set_tlsext_servername_callback(lambda conn: sni.append(conn.get_servername()))
    st, ct = await asyncio.gather(
        start_tls(s, server_ctx, sp, server_side=True, handshake_timeout_s=STEP_TIMEOUT_S),
        start_tls(c, client_ctx, cp, server_side=False, handshake_timeout_s=STEP_TIMEOUT_S),
    )
    assert sni == [None]  # no SNI, as ztunnel
    expected = TlsTransport if LAYER[0] == OWN else OpenSslTransport
    assert type(st) is expected and type(ct) is expected
    try:
        yield sp, cp  # type: ignore[misc]
    finally:
        st.abort()
        ct.abort()
