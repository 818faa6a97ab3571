"""TLS12_ENABLED and CRL_PATH over real TLS handshakes on loopback, both as client and as server,
and through two running node proxies (HBONE), with the CRL file changed while they run."""

from __future__ import annotations

import asyncio
import logging
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from OpenSSL import SSL

from ambient_mesh.identity import CertificateAuthority, Identity
from ambient_mesh.tls.context import TlsContextCache
from ambient_mesh.tls.crl import CRL_RECHECK_INTERVAL_S, CertificateRevoked, CrlChecker
from ambient_mesh.tls.transport import start_tls
from tests.helpers.tls_pairs import Collector, tcp_pair

from .mesh import ECHO_PORT, SERVER_IP, running_mesh

NOW = datetime.now(UTC)
SERVER = Identity("cluster.local", "ns1", "server")
CLIENT = Identity("cluster.local", "ns2", "client")


@pytest.fixture(scope="module")
def ca() -> CertificateAuthority:
    return CertificateAuthority.insecure_test_ca()


def crl_pem(ca: CertificateAuthority, *serials: int) -> bytes:
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca.signing_cert.subject)
        .last_update(NOW - timedelta(minutes=1))
        .next_update(NOW + timedelta(days=1))
    )
    for serial in serials:
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(NOW).build()
        )
    return builder.sign(ca.signing_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def write(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def serial_of(cert) -> int:
    return x509.load_pem_x509_certificate(cert.leaf_pem).serial_number


async def handshake(server_cache: TlsContextCache, client_cache: TlsContextCache, server_cert, client_cert):
    """One mutual-TLS handshake on loopback (tls/transport.py both ends); what each side's
    post-handshake check returned."""
    outcome: dict[str, object] = {}
    s, c = tcp_pair()
    transports = await asyncio.gather(
        start_tls(s, server_cache.server(server_cert), Collector(), server_side=True, handshake_timeout_s=5),
        start_tls(c, client_cache.client(client_cert), Collector(), server_side=False, handshake_timeout_s=5),
    )
    try:
        for side, check in (
            (
                "server",
                lambda: server_cache.verify_client(
                    transports[0].get_extra_info("ssl_object"), "cluster.local"
                ),
            ),
            (
                "client",
                lambda: client_cache.verify_server(transports[1].get_extra_info("ssl_object"), [SERVER]),
            ),
        ):
            try:
                outcome[side] = check()
            except CertificateRevoked as e:
                outcome[side] = e
    finally:
        for t in transports:
            t.abort()
    return outcome


async def test_revoked_peers_are_refused_as_server_and_as_client(ca, tmp_path, caplog):
    server_cert = ca.issue(SERVER, 3600, now=NOW)
    client_cert = ca.issue(CLIENT, 3600, now=NOW)
    path = tmp_path / "crl.pem"
    write(path, crl_pem(ca))
    clock = [0.0]
    checker = CrlChecker(str(path), clock=lambda: clock[0])
    with_crl, plain = TlsContextCache(crl=checker), TlsContextCache()
    assert await handshake(with_crl, with_crl, server_cert, client_cert) == {
        "server": CLIENT,
        "client": SERVER,
    }
    # The CA revokes both certificates; the file changes under the running checker.
    write(path, crl_pem(ca, serial_of(server_cert), serial_of(client_cert)))
    clock[0] += CRL_RECHECK_INTERVAL_S
    caplog.set_level(logging.WARNING, logger="ambient_mesh.tls.crl")
    # As server: our CRL revokes the client's certificate.
    as_server = await handshake(with_crl, plain, server_cert, client_cert)
    assert isinstance(as_server["server"], CertificateRevoked) and as_server["client"] == SERVER
    assert "client certificate" in str(as_server["server"])
    # As client: our CRL revokes the server's certificate.
    as_client = await handshake(plain, with_crl, server_cert, client_cert)
    assert as_client["server"] == CLIENT and isinstance(as_client["client"], CertificateRevoked)
    assert "server certificate" in str(as_client["client"])
    assert checker.rejected == {"source": 1, "destination": 1}
    assert len([r for r in caplog.records if "refusing the connection" in r.getMessage()]) == 2


async def test_tls12_only_with_tls12_enabled(ca):
    cert = ca.issue(SERVER, 3600, now=NOW)
    client_cert = ca.issue(CLIENT, 3600, now=NOW)
    results: dict[bool, object] = {}
    for enabled in (False, True):
        server_ctx = TlsContextCache(tls12=enabled).server(cert)
        client_ctx = TlsContextCache(tls12=True).client(client_cert)
        client_ctx.set_max_proto_version(SSL.TLS1_2_VERSION)  # a TLS 1.2-only peer
        s, c = tcp_pair()
        outcome = await asyncio.gather(
            start_tls(s, server_ctx, Collector(), server_side=True, handshake_timeout_s=5),
            start_tls(c, client_ctx, Collector(), server_side=False, handshake_timeout_s=5),
            return_exceptions=True,
        )
        client = outcome[1]
        if isinstance(client, BaseException):
            results[enabled] = type(client).__name__
        else:
            tls = client.get_extra_info("ssl_object")
            results[enabled] = (tls.version(), tls.cipher()[0])
        for t in outcome:
            if not isinstance(t, BaseException):
                t.abort()
    # TLS 1.3 only by default, as ztunnel: the handshake fails.
    assert results[False] in ("HandshakeError", "ConnectionResetError")
    version, cipher = results[True]  # type: ignore[misc]
    assert version == "TLSv1.2" and cipher.startswith("ECDHE-") and "GCM" in cipher


def metric(proxy, name: str) -> dict[str, float]:
    text = proxy.metrics.render()[0].decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            out[labels[len(name) :]] = float(value)
    return out


async def test_crl_path_in_running_proxies_refuses_revoked_peers_after_a_reload(ca, tmp_path):
    client_crl, server_crl = tmp_path / "client-crl.pem", tmp_path / "server-crl.pem"
    write(client_crl, crl_pem(ca))
    write(server_crl, crl_pem(ca))
    async with running_mesh(
        client_env={"CRL_PATH": str(client_crl)},
        server_env={"CRL_PATH": str(server_crl)},
    ) as mesh:
        reader, writer = await mesh.socks_connect(SERVER_IP, ECHO_PORT)  # nothing revoked yet
        writer.write(b"a")
        assert await asyncio.wait_for(reader.readexactly(1), 10) == b"a"
        writer.close()
        client_cert = await mesh.client.cert_manager.fetch_certificate(
            Identity("cluster.local", "default", "client")
        )
        # The server proxy's CRL now revokes the client's certificate.
        write(server_crl, crl_pem(ca, serial_of(client_cert)))
        await asyncio.sleep(CRL_RECHECK_INTERVAL_S + 0.2)
        mesh.client.pi.pool.close()  # the next connection makes a new handshake
        with pytest.raises((ConnectionRefusedError, asyncio.IncompleteReadError)):
            r2, w2 = await mesh.socks_connect(SERVER_IP, ECHO_PORT)
            w2.write(b"b")
            await asyncio.wait_for(r2.readexactly(1), 10)
        assert metric(mesh.server, "istio_crl_policy_rejections_total") == {'{reporter="destination"}': 1.0}
        assert mesh.server.tls.crl.rejected["destination"] == 1
        # The other way round: the client proxy's CRL revokes the server's certificate.
        write(server_crl, crl_pem(ca))
        server_cert = await mesh.server.cert_manager.fetch_certificate(
            Identity("cluster.local", "default", "server")
        )
        write(client_crl, crl_pem(ca, serial_of(server_cert)))
        await asyncio.sleep(CRL_RECHECK_INTERVAL_S + 0.2)
        mesh.client.pi.pool.close()
        with pytest.raises((ConnectionRefusedError, asyncio.IncompleteReadError)):
            r3, w3 = await mesh.socks_connect(SERVER_IP, ECHO_PORT)
            w3.write(b"c")
            await asyncio.wait_for(r3.readexactly(1), 10)
        assert metric(mesh.client, "istio_crl_policy_rejections_total") == {'{reporter="source"}': 1.0}
