"""HBONE TLS without sockets: context settings, the SPIFFE checks, the context cache."""

from __future__ import annotations

import dataclasses
import ssl
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from ambient_mesh.errors import CertificateError, ProtocolError
from ambient_mesh.identity import (
    CertificateAuthority,
    Identity,
    TlsContextCache,
    WorkloadCertificate,
    client_context,
    openssl_native,
    server_context,
    tls_suites,
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


def test_server_context_settings(ca: CertificateAuthority) -> None:
    ctx = server_context(ca.issue(ALICE, 3600, now=NOW))

    assert ctx.minimum_version == ctx.maximum_version == ssl.TLSVersion.TLSv1_3
    assert ctx.verify_mode == ssl.CERT_REQUIRED
    assert ctx.check_hostname is False
    assert ctx.options & ssl.OP_NO_TICKET
    assert not ctx.options & ssl.OP_IGNORE_UNEXPECTED_EOF  # a truncation stays an error (RFC 8446 6.1)
    assert len(ctx.get_ca_certs()) == 1


def test_client_context_settings(ca: CertificateAuthority) -> None:
    ctx = client_context(ca.issue(ALICE, 3600, now=NOW))

    assert ctx.minimum_version == ctx.maximum_version == ssl.TLSVersion.TLSv1_3
    assert ctx.verify_mode == ssl.CERT_REQUIRED
    assert ctx.check_hostname is False
    assert ctx.options & ssl.OP_NO_TICKET
    assert not ctx.options & ssl.OP_IGNORE_UNEXPECTED_EOF


def tls13_suites(ctx: ssl.SSLContext) -> list[str]:
    return [c["name"] for c in ctx.get_ciphers() if c["protocol"] == "TLSv1.3"]


def test_both_contexts_offer_exactly_ztunnels_tls13_suites(ca: CertificateAuthority) -> None:
    cert = ca.issue(ALICE, 3600, now=NOW)
    for ctx in (server_context(cert), client_context(cert)):
        assert tls13_suites(ctx) == ["TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384"]
    assert "TLS_CHACHA20_POLY1305_SHA256" in tls13_suites(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))


def test_suites_are_not_written_through_a_pointer_that_fails_the_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = openssl_native.libssl()
    assert real is not None
    writes: list[object] = []

    class Skewed:
        ctx_get_verify_mode = real.ctx_get_verify_mode

        @staticmethod
        def ctx_get_options(pointer: int) -> int:
            return int(real.ctx_get_options(pointer)) ^ 1  # what another layout would read

        @staticmethod
        def set_ciphersuites(pointer: int, names: bytes) -> int:
            writes.append(names)
            return 1

    monkeypatch.setattr(openssl_native, "libssl", lambda: Skewed)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    with pytest.raises(CertificateError, match="cannot find the OpenSSL context"):
        tls_suites.set_tls13_suites(ctx)
    assert writes == []
    assert "TLS_CHACHA20_POLY1305_SHA256" in tls13_suites(ctx)


def test_suites_are_refused_on_an_unchecked_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(openssl_native, "CHECKED_CPYTHON", ((3, 0), (3, 1)))
    openssl_native.libssl.cache_clear()
    try:
        assert not openssl_native.interpreter_checked() and openssl_native.libssl() is None
        with pytest.raises(CertificateError, match="cannot set TLS 1.3 cipher suites on cpython"):
            tls_suites.set_tls13_suites(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT))
    finally:
        monkeypatch.undo()
        openssl_native.libssl.cache_clear()
    assert openssl_native.libssl() is not None


def test_an_unknown_suite_name_is_an_error() -> None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    with pytest.raises(CertificateError, match="OpenSSL refused the TLS 1.3 cipher suites TLS_NO_SUCH"):
        tls_suites.set_tls13_suites(ctx, ("TLS_NO_SUCH",))


def test_building_contexts_leaves_no_key_file_behind(
    ca: CertificateAuthority, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The key files this process makes (the directory is shared with every other process on the
    # host, so it is not compared as a whole).
    made: list[str] = []
    real_mkstemp = tempfile.mkstemp

    def recording_mkstemp(*args: Any, **kwargs: Any) -> tuple[int, str]:
        fd, name = real_mkstemp(*args, **kwargs)
        made.append(name)
        return fd, name

    monkeypatch.setattr(tempfile, "mkstemp", recording_mkstemp)
    cert = ca.issue(ALICE, 3600, now=NOW)

    server_context(cert)
    client_context(cert)

    assert len(made) == 2 and all(Path(n).name.startswith("ambient-key-") for n in made), made
    assert [n for n in made if Path(n).exists()] == []


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
