"""HBONE's mutual TLS over real loopback sockets: what is accepted and what is refused."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from OpenSSL import SSL

from ambient_mesh.errors import CertificateError, ProtocolError
from ambient_mesh.identity import (
    CertificateAuthority,
    EmbeddedCaClient,
    Identity,
    SecretManager,
    WorkloadCertificate,
)
from ambient_mesh.identity.certificate import load_pem_certificates
from ambient_mesh.tls.context import (
    TlsContextCache,
    client_context,
    server_context,
    verify_client_identity,
    verify_server_identity,
)
from ambient_mesh.tls.transport import start_tls

NOW = datetime.now(UTC)
SERVER = Identity("cluster.local", "ns1", "server")
CLIENT = Identity("cluster.local", "ns2", "client")
OUTSIDER = Identity("other.domain", "ns2", "client")
STEP_TIMEOUT_S = 10.0


@dataclass
class Listener:
    port: int
    sni: list[str | None] = field(default_factory=list)
    accepted: list[Identity] = field(default_factory=list)
    rejected: list[Exception] = field(default_factory=list)
    tls: list[tuple[str | None, str | None, str | None]] = field(default_factory=list)


class Reader(asyncio.BufferedProtocol):
    """What one side of a tls/transport.py connection receives, until EOF or the end."""

    def __init__(self) -> None:
        self.buf = bytearray(64 * 1024)
        self.data = bytearray()
        self.transport: Any = None
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self.buf)

    def buffer_updated(self, nbytes: int) -> None:
        self.data += self.buf[:nbytes]

    def eof_received(self) -> bool:
        if not self.done.done():
            self.done.set_result(None)
        return False

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self.done.done():
            self.done.set_result(None)

    async def read(self) -> bytes:
        async with asyncio.timeout(STEP_TIMEOUT_S):
            await self.done
        return bytes(self.data)


@asynccontextmanager
async def hbone_listener(
    cert: WorkloadCertificate, ctx: SSL.Context | None = None
) -> AsyncIterator[Listener]:
    """A stand-in for the 15008 listener on tls/transport.py: handshake, check the client,
    greet or hang up."""
    ctx = ctx or server_context(cert)
    listener = Listener(port=0)
    ctx.set_tlsext_servername_callback(lambda conn: listener.sni.append(conn.get_servername()))
    loop = asyncio.get_running_loop()

    async def handle(sock: socket.socket) -> None:
        proto = Reader()
        try:
            transport = await start_tls(
                sock, ctx, proto, server_side=True, handshake_timeout_s=STEP_TIMEOUT_S
            )
        except (OSError, TimeoutError):
            return
        tls = transport.get_extra_info("ssl_object")
        try:
            peer = verify_client_identity(tls, cert.identity.trust_domain)
        except (CertificateError, ProtocolError) as e:
            listener.rejected.append(e)
        else:
            listener.accepted.append(peer)
            listener.tls.append((tls.version(), tls.selected_alpn_protocol(), tls.cipher()[0]))
            transport.write(f"hello {peer}".encode())
        transport.close()

    server_sock = socket.socket()
    server_sock.bind(("127.0.0.1", 0))
    server_sock.listen()
    server_sock.setblocking(False)
    listener.port = server_sock.getsockname()[1]
    tasks: set[asyncio.Task[None]] = set()

    async def accept() -> None:
        while True:
            sock, _ = await loop.sock_accept(server_sock)
            task = asyncio.create_task(handle(sock))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    acceptor = asyncio.create_task(accept())
    try:
        yield listener
    finally:
        acceptor.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await acceptor
        await asyncio.gather(*tasks, return_exceptions=True)
        server_sock.close()


async def open_hbone(port: int, ctx: SSL.Context | ssl.SSLContext) -> tuple[Any, Any]:
    """(something to `read()` from, the transport): HBONE's own client stack (tls/transport.py)
    for an HBONE context, Python's `ssl` for the bare stdlib clients below."""
    if isinstance(ctx, ssl.SSLContext):
        # server_hostname="" is how Python's asyncio suppresses SNI.
        return await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname="")
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    proto = Reader()
    transport = await start_tls(sock, ctx, proto, server_side=False, handshake_timeout_s=STEP_TIMEOUT_S)
    return proto, transport


async def exchange(port: int, ctx: SSL.Context | ssl.SSLContext) -> bytes | BaseException:
    """Connect and read what the listener says: its greeting, b"" or the error that ended it."""
    writer = None
    try:
        reader, writer = await open_hbone(port, ctx)
        return await reader.read()
    except (ssl.SSLError, ConnectionError) as e:
        return e
    finally:
        if writer is not None:
            writer.close()


def bare_client_context(*, maximum: ssl.TLSVersion = ssl.TLSVersion.TLSv1_3) -> ssl.SSLContext:
    """A client that presents no certificate (or caps the version), trusting nothing."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.maximum_version = maximum
    ctx.set_alpn_protocols(["h2"])
    return ctx


@pytest.fixture(scope="module")
def ca() -> CertificateAuthority:
    return CertificateAuthority.insecure_test_ca()


@pytest.fixture(scope="module")
def server_cert(ca: CertificateAuthority) -> WorkloadCertificate:
    return ca.issue(SERVER, 3600, now=NOW)


@pytest.fixture(scope="module")
def client_cert(ca: CertificateAuthority) -> WorkloadCertificate:
    return ca.issue(CLIENT, 3600, now=NOW)


async def test_mutual_handshake_tls13_h2_without_sni(
    server_cert: WorkloadCertificate, client_cert: WorkloadCertificate
) -> None:
    async with hbone_listener(server_cert) as listener:
        reader, writer = await open_hbone(listener.port, client_context(client_cert))
        tls = writer.get_extra_info("ssl_object")
        try:
            assert verify_server_identity(tls, [SERVER]) == SERVER
            assert tls.version() == "TLSv1.3"
            assert tls.selected_alpn_protocol() == "h2"
            assert await reader.read() == f"hello {CLIENT}".encode()
        finally:
            writer.close()

    assert listener.accepted == [CLIENT]
    assert listener.sni == [None]  # no server name was sent
    # ztunnel's two suites only, AES-128-GCM first (tls/context.py).
    assert listener.tls == [("TLSv1.3", "h2", "TLS_AES_128_GCM_SHA256")]


def only_suites(ctx: SSL.Context, *suites: str) -> SSL.Context:
    ctx.set_tls13_ciphersuites(":".join(suites).encode("ascii"))
    return ctx


async def test_client_offering_ztunnels_order_gets_a_suite_ztunnel_allows(
    server_cert: WorkloadCertificate, client_cert: WorkloadCertificate
) -> None:
    # ztunnel's client offers AES-256-GCM first; our server keeps its own preference.
    ctx = only_suites(client_context(client_cert), "TLS_AES_256_GCM_SHA384", "TLS_AES_128_GCM_SHA256")
    async with hbone_listener(server_cert) as listener:
        assert await exchange(listener.port, ctx) == f"hello {CLIENT}".encode()
    assert listener.tls == [("TLSv1.3", "h2", "TLS_AES_128_GCM_SHA256")]
    # A client that offers only AES-256-GCM gets it.
    ctx = only_suites(client_context(client_cert), "TLS_AES_256_GCM_SHA384")
    async with hbone_listener(server_cert) as listener:
        assert await exchange(listener.port, ctx) == f"hello {CLIENT}".encode()
    assert listener.tls == [("TLSv1.3", "h2", "TLS_AES_256_GCM_SHA384")]


async def test_chacha20_is_refused_both_ways(
    server_cert: WorkloadCertificate, client_cert: WorkloadCertificate
) -> None:
    # OpenSSL's default TLS 1.3 list has ChaCha20-Poly1305; ztunnel's has not, nor have we.
    chacha = only_suites(client_context(client_cert), "TLS_CHACHA20_POLY1305_SHA256")
    async with hbone_listener(server_cert) as listener:
        outcome = await exchange(listener.port, chacha)
    assert isinstance(outcome, (ssl.SSLError, ConnectionError)) or outcome == b""
    assert listener.accepted == listener.rejected == []  # no handshake completed

    chacha_server = only_suites(server_context(server_cert), "TLS_CHACHA20_POLY1305_SHA256")
    async with hbone_listener(server_cert, chacha_server) as listener:
        with pytest.raises((ssl.SSLError, ConnectionError)):
            await open_hbone(listener.port, client_context(client_cert))


async def test_fake_ca_proxies_in_different_processes_trust_each_other() -> None:
    # Each process loads the shipped test root on its own; two loads stand for two processes.
    server = CertificateAuthority.insecure_test_ca().issue(SERVER, 600, now=NOW)
    client = CertificateAuthority.insecure_test_ca().issue(CLIENT, 600, now=NOW)

    async with hbone_listener(server) as listener:
        assert await exchange(listener.port, client_context(client)) == f"hello {CLIENT}".encode()


async def test_client_from_another_trust_domain_is_refused(
    ca: CertificateAuthority, server_cert: WorkloadCertificate
) -> None:
    outsider = ca.issue(OUTSIDER, 3600, now=NOW)  # same root, foreign trust domain

    async with hbone_listener(server_cert) as listener:
        outcome = await exchange(listener.port, client_context(outsider))

    assert outcome == b""
    assert listener.accepted == []
    assert [type(e) for e in listener.rejected] == [CertificateError]
    assert "not in trust domain 'cluster.local'" in str(listener.rejected[0])


async def test_server_with_an_unexpected_identity_is_refused_by_the_client(
    server_cert: WorkloadCertificate, client_cert: WorkloadCertificate
) -> None:
    expected = Identity("cluster.local", "ns1", "someone-else")
    async with hbone_listener(server_cert) as listener:
        _, writer = await open_hbone(listener.port, client_context(client_cert))
        try:
            with pytest.raises(
                CertificateError, match=r"expected \[.*someone-else\], presented \[.*ns1/sa/server\]"
            ):
                verify_server_identity(writer.get_extra_info("ssl_object"), [expected])
        finally:
            writer.close()


async def test_client_without_a_certificate_is_refused(server_cert: WorkloadCertificate) -> None:
    async with hbone_listener(server_cert) as listener:
        outcome = await exchange(listener.port, bare_client_context())

    assert not isinstance(outcome, bytes) or outcome == b""
    assert listener.accepted == listener.rejected == []  # the handshake itself failed


async def test_client_certificate_from_another_root_is_refused(server_cert: WorkloadCertificate) -> None:
    stranger = CertificateAuthority.self_signed("cluster.local", now=NOW - timedelta(days=1))
    async with hbone_listener(server_cert) as listener:
        outcome = await exchange(listener.port, client_context(stranger.issue(CLIENT, 3600, now=NOW)))

    assert not isinstance(outcome, bytes) or outcome == b""
    assert listener.accepted == listener.rejected == []


async def test_server_certificate_from_another_root_is_refused_by_the_client(
    client_cert: WorkloadCertificate,
) -> None:
    stranger = CertificateAuthority.self_signed("cluster.local", now=NOW - timedelta(days=1))
    async with hbone_listener(stranger.issue(SERVER, 3600, now=NOW)) as listener:
        with pytest.raises(ssl.SSLError, match="certificate verify failed"):
            await open_hbone(listener.port, client_context(client_cert))

    assert listener.accepted == listener.rejected == []


async def test_tls12_only_client_is_refused(server_cert: WorkloadCertificate) -> None:
    async with hbone_listener(server_cert) as listener:
        # The server's protocol_version alert arrives as an SSLError, or as a reset when the
        # server has already closed the socket.
        with pytest.raises((ssl.SSLError, ConnectionError)):
            await open_hbone(listener.port, bare_client_context(maximum=ssl.TLSVersion.TLSv1_2))

    assert listener.accepted == listener.rejected == []


async def test_client_without_alpn_h2_is_refused(
    server_cert: WorkloadCertificate, client_cert: WorkloadCertificate
) -> None:
    ctx = client_context(client_cert)
    ctx.set_alpn_protos([b"http/1.1"])
    async with hbone_listener(server_cert) as listener:
        outcome = await exchange(listener.port, ctx)

    assert outcome == b""
    assert [type(e) for e in listener.rejected] == [ProtocolError]


def _ca_cert(
    name: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Certificate | None,
    issuer_key: ec.EllipticCurvePrivateKey,
) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, name)])
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer.subject if issuer else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW - timedelta(days=1))
        .not_valid_after(NOW + timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(issuer_key, hashes.SHA256())
    )


async def test_plugged_in_ca_with_an_intermediate_issues_working_certificates(tmp_path: Path) -> None:
    root_key, int_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    root = _ca_cert("Example Root", root_key, None, root_key)
    intermediate = _ca_cert("Example Intermediate", int_key, root, root_key)
    pem = serialization.Encoding.PEM
    (tmp_path / "root-cert.pem").write_bytes(root.public_bytes(pem))
    (tmp_path / "ca-cert.pem").write_bytes(intermediate.public_bytes(pem))
    (tmp_path / "cert-chain.pem").write_bytes(intermediate.public_bytes(pem) + root.public_bytes(pem))
    (tmp_path / "ca-key.pem").write_bytes(
        int_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )

    ca = CertificateAuthority.from_plugged_in_dir(tmp_path)
    server, client = ca.issue(SERVER, 3600, now=NOW), ca.issue(CLIENT, 3600, now=NOW)

    assert len(server.chain_pem) == 2  # leaf + intermediate; the root travels separately
    assert load_pem_certificates(server.roots_pem) == [root]
    leaf = x509.load_pem_x509_certificate(server.leaf_pem)
    leaf.verify_directly_issued_by(intermediate)
    intermediate.verify_directly_issued_by(root)
    # OpenSSL on both sides builds leaf -> intermediate -> root from what each side sent.
    async with hbone_listener(server) as listener:
        assert await exchange(listener.port, client_context(client)) == f"hello {CLIENT}".encode()


async def test_secret_manager_certificates_through_the_context_cache() -> None:
    manager = SecretManager(EmbeddedCaClient(CertificateAuthority.insecure_test_ca(), ttl_s=600))
    cache = TlsContextCache()
    try:
        server = await manager.fetch_certificate(SERVER)
        client = await manager.fetch_certificate(CLIENT)
        async with hbone_listener(server) as listener:
            reader, writer = await open_hbone(listener.port, cache.client(client))
            try:
                assert verify_server_identity(writer.get_extra_info("ssl_object"), [SERVER]) == SERVER
                assert await reader.read() == f"hello {CLIENT}".encode()
            finally:
                writer.close()
        assert repr(manager) == "SecretManager(2 certificates: 2 available, 0 pending)"
    finally:
        await manager.close()
