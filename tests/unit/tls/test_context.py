"""HBONE TLS without sockets (tls/context.py): context settings, keys from memory, the SPIFFE
checks, the context cache."""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from OpenSSL import SSL

import ambient_mesh
from ambient_mesh.errors import CertificateError, ProtocolError
from ambient_mesh.identity import CertificateAuthority, Identity, WorkloadCertificate
from ambient_mesh.tls.context import (
    TlsContextCache,
    client_context,
    remove_stale_key_files,
    server_context,
    verify_client_identity,
    verify_server_identity,
)

NOW = datetime.now(UTC)
ALICE = Identity("cluster.local", "ns1", "alice")
BOB = Identity("cluster.local", "ns1", "bob")
EVE = Identity("other.domain", "ns1", "eve")


@dataclass
class FakeSslObject:
    """What the checks read from an SSLObject after a handshake."""

    der: bytes | None
    alpn: str | None = "h2"

    def getpeercert(self, binary_form: bool = False) -> object:
        assert binary_form
        return self.der

    def selected_alpn_protocol(self) -> str | None:
        return self.alpn


@pytest.fixture(scope="module")
def ca() -> CertificateAuthority:
    return CertificateAuthority.insecure_test_ca()


def _der(cert: WorkloadCertificate) -> bytes:
    return x509.load_pem_x509_certificate(cert.leaf_pem).public_bytes(serialization.Encoding.DER)


def _der_with_uris(*uris: str) -> bytes:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([]))
        .issuer_name(x509.Name([]))
        .public_key(key.public_key())
        .serial_number(7)
        .not_valid_before(NOW)
        .not_valid_after(NOW + timedelta(hours=1))
    )
    if uris:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(u) for u in uris]), critical=True
        )
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.DER)


def _options(ctx: SSL.Context) -> int:
    return ctx.set_options(0)  # SSL_CTX_set_options returns the options now set


def _tls13_suites(ctx: SSL.Context) -> list[str]:
    return [name for name in SSL.Connection(ctx, None).get_cipher_list() if name.startswith("TLS_")]


@pytest.mark.parametrize("make", [server_context, client_context])
def test_context_settings(ca: CertificateAuthority, make: Any) -> None:
    ctx = make(ca.issue(ALICE, 3600, now=NOW))

    assert ctx.get_verify_mode() == SSL.VERIFY_PEER | SSL.VERIFY_FAIL_IF_NO_PEER_CERT
    options = _options(ctx)
    assert options & SSL.OP_NO_TICKET and options & SSL.OP_NO_RENEGOTIATION
    assert bool(options & SSL.OP_CIPHER_SERVER_PREFERENCE) == (make is server_context)
    assert ctx.get_session_cache_mode() == SSL.SESS_CACHE_OFF  # no resumption


def test_both_contexts_offer_exactly_ztunnels_tls13_suites(ca: CertificateAuthority) -> None:
    cert = ca.issue(ALICE, 3600, now=NOW)
    for ctx in (server_context(cert), client_context(cert)):
        assert _tls13_suites(ctx) == ["TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384"]
    assert "TLS_CHACHA20_POLY1305_SHA256" in _tls13_suites(SSL.Context(SSL.TLS_METHOD))


def test_no_module_reads_interpreter_memory_or_calls_libssl_through_ctypes() -> None:
    """Issue 24: OpenSSL is reached through pyOpenSSL's public API only: no `ctypes` in the TLS,
    identity or proxy packages (host/ keeps libc's, for mallopt and setns), nothing anywhere that
    opens libssl or reads object addresses (`id()` + `__basicsize__`), no C module of our own."""
    root = Path(ambient_mesh.__file__).parent
    offenders = []
    for path in root.rglob("*"):
        name = path.relative_to(root).as_posix()
        if path.suffix in (".so", ".c", ".pyd"):
            offenders.append(f"{name}: a compiled or C module")
        elif path.suffix == ".py" and not name.startswith("wire/istio"):
            text = path.read_text()
            needles = ["_ssl.__file__", "libssl", "__basicsize__", "from_address", "_sslobj"]
            if name.split("/")[0] in ("tls", "identity", "proxy"):
                needles += ["import ctypes", "from ctypes"]
            offenders += [f"{name}: {needle}" for needle in needles if needle in text]
    assert offenders == []


def test_building_contexts_opens_no_file(ca: CertificateAuthority) -> None:
    """Keys and certificates reach OpenSSL from memory: not one file is opened while the
    contexts are built, so a kill -9 at any moment leaves nothing of a key behind."""
    cert = ca.issue(ALICE, 3600, now=NOW)
    opened: list[object] = []
    watching = [True]

    def hook(event: str, args: tuple[object, ...]) -> None:
        if watching[0] and event in ("open", "os.open", "tempfile.mkstemp", "tempfile.mkdtemp"):
            opened.append((event, args[0] if args else None))

    sys.addaudithook(hook)  # cannot be removed: it stops recording below
    try:
        server_context(cert)
        client_context(cert)
        server_context(cert, tls12=True)
    finally:
        watching[0] = False
    assert opened == []


def test_stale_key_files_of_the_older_version_are_removed_at_start(tmp_path: Path) -> None:
    (tmp_path / "ambient-key-abc123.pem").write_bytes(b"-----BEGIN PRIVATE KEY-----")
    (tmp_path / "ambient-key-link.pem").symlink_to(tmp_path / "keep-me.pem")
    (tmp_path / "keep-me.pem").write_bytes(b"not ours")
    (tmp_path / "ambient-key-dir.pem").mkdir()
    (tmp_path / "other.pem").write_bytes(b"not ours either")

    # Younger than a minute: perhaps an older proxy beside us loading its key right now.
    assert remove_stale_key_files(str(tmp_path)) == 0
    assert remove_stale_key_files(str(tmp_path), now=time.time() + 61) == 2

    assert sorted(p.name for p in tmp_path.iterdir()) == ["ambient-key-dir.pem", "keep-me.pem", "other.pem"]
    assert (tmp_path / "keep-me.pem").read_bytes() == b"not ours"  # a link is removed, not followed
    assert remove_stale_key_files(str(tmp_path / "missing"), now=time.time() + 61) == 0


def test_a_key_that_does_not_match_the_chain_is_refused(ca: CertificateAuthority) -> None:
    cert = ca.issue(ALICE, 3600, now=NOW)
    other = ca.issue(ALICE, 3600, now=NOW)
    mixed = dataclasses.replace(cert, private_key_pem=other.private_key_pem)

    with pytest.raises(CertificateError, match="cannot be loaded"):
        server_context(mixed)


def test_bad_roots_are_refused(ca: CertificateAuthority) -> None:
    cert = dataclasses.replace(ca.issue(ALICE, 3600, now=NOW), roots_pem=b"not a certificate")

    with pytest.raises(CertificateError, match="trust roots .* cannot be loaded"):
        client_context(cert)


def test_verify_server_identity_accepts_any_expected_identity(ca: CertificateAuthority) -> None:
    peer = FakeSslObject(_der(ca.issue(BOB, 3600, now=NOW)))

    assert verify_server_identity(peer, [ALICE, BOB]) == BOB
    assert verify_server_identity(peer, {BOB}) == BOB


def test_verify_server_identity_matches_any_san_of_the_leaf() -> None:
    peer = FakeSslObject(_der_with_uris(str(ALICE), "https://example.com", str(BOB)))

    assert verify_server_identity(peer, [BOB]) == BOB


def test_verify_server_identity_names_expected_and_presented(ca: CertificateAuthority) -> None:
    peer = FakeSslObject(_der(ca.issue(EVE, 3600, now=NOW)))

    with pytest.raises(
        CertificateError,
        match=r"expected \[spiffe://cluster.local/ns/ns1/sa/alice\], presented \[spiffe://other.domain/ns/ns1/sa/eve\]",
    ):
        verify_server_identity(peer, [ALICE])


def test_verify_server_identity_needs_a_certificate_with_a_spiffe_id() -> None:
    with pytest.raises(CertificateError, match="server presented no certificate"):
        verify_server_identity(FakeSslObject(None), [ALICE])
    with pytest.raises(CertificateError, match="server certificate carries no SPIFFE id"):
        verify_server_identity(FakeSslObject(_der_with_uris("https://example.com")), [ALICE])


def test_verify_client_identity_returns_the_first_spiffe_id() -> None:
    # The source identity is the first SPIFFE SAN even when a later one is the in-domain id.
    peer = FakeSslObject(_der_with_uris("urn:x", str(EVE), str(ALICE)))

    assert verify_client_identity(peer, "cluster.local") == EVE


def test_verify_client_identity_refuses_another_trust_domain(ca: CertificateAuthority) -> None:
    peer = FakeSslObject(_der(ca.issue(EVE, 3600, now=NOW)))

    with pytest.raises(
        CertificateError,
        match=r"client identity \[spiffe://other.domain/.*\] is not in trust domain 'cluster.local'",
    ):
        verify_client_identity(peer, "cluster.local")


def test_verify_client_identity_needs_a_certificate_with_a_spiffe_id() -> None:
    with pytest.raises(CertificateError, match="client presented no certificate"):
        verify_client_identity(FakeSslObject(None), "cluster.local")
    with pytest.raises(CertificateError, match="client certificate carries no SPIFFE id"):
        verify_client_identity(FakeSslObject(_der_with_uris()), "cluster.local")


@pytest.mark.parametrize("alpn", [None, "http/1.1"])
def test_both_checks_require_alpn_h2(ca: CertificateAuthority, alpn: str | None) -> None:
    peer = FakeSslObject(_der(ca.issue(ALICE, 3600, now=NOW)), alpn=alpn)

    with pytest.raises(ProtocolError, match="HBONE needs 'h2'"):
        verify_server_identity(peer, [ALICE])
    with pytest.raises(ProtocolError, match="HBONE needs 'h2'"):
        verify_client_identity(peer, "cluster.local")


def test_context_cache_reuses_until_the_certificate_renews(ca: CertificateAuthority) -> None:
    cache = TlsContextCache()
    cert = ca.issue(ALICE, 3600, now=NOW)

    server, client = cache.server(cert), cache.client(cert)

    assert cache.server(cert) is server
    assert cache.client(cert) is client
    assert repr(cache) == "TlsContextCache(1 server, 1 client)"

    renewed = ca.issue(ALICE, 3600, now=NOW)
    assert cache.server(renewed) is not server
    assert cache.client(renewed) is not client
    assert len(cache) == 2  # the old contexts were replaced, not kept

    cache.server(ca.issue(BOB, 3600, now=NOW))
    assert repr(cache) == "TlsContextCache(2 server, 1 client)"
    cache.forget(ALICE)
    assert repr(cache) == "TlsContextCache(1 server, 0 client)"
