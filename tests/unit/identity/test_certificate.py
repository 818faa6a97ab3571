"""WorkloadCertificate, CSR generation and SPIFFE SAN extraction."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtensionOID
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ambient_mesh.errors import CertificateError
from ambient_mesh.identity import (
    CertificateAuthority,
    Identity,
    WorkloadCertificate,
    generate_csr,
    spiffe_ids,
)

NOW = datetime(2030, 6, 1, 12, 0, 0, tzinfo=UTC)
ALICE = Identity("cluster.local", "default", "alice")
BOB = Identity("cluster.local", "default", "bob")


@pytest.fixture(scope="module")
def ca() -> CertificateAuthority:
    return CertificateAuthority.self_signed("cluster.local", now=NOW - timedelta(days=1))


def _cert_with_sans(sans: list[x509.GeneralName]) -> bytes:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([]))
        .issuer_name(x509.Name([]))
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(NOW)
        .not_valid_after(NOW + timedelta(days=1))
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=True)
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.DER)


def test_generate_csr_matches_what_ztunnel_sends() -> None:
    key_pem, csr_pem = generate_csr(ALICE)

    assert key_pem.startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS#8, not SEC1
    key = serialization.load_pem_private_key(key_pem, password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert key.curve.name == "secp256r1"
    csr = x509.load_pem_x509_csr(csr_pem)
    assert csr.is_signature_valid
    assert isinstance(csr.signature_hash_algorithm, hashes.SHA256)
    assert csr.subject == x509.Name([])
    san = csr.extensions.get_extension_for_oid(ExtensionOID.SUBJECT_ALTERNATIVE_NAME)
    assert san.critical
    assert list(san.value) == [x509.UniformResourceIdentifier(str(ALICE))]
    assert len(csr.extensions) == 1


def test_generate_csr_uses_a_fresh_key_each_time() -> None:
    assert generate_csr(ALICE)[0] != generate_csr(ALICE)[0]


def test_spiffe_ids_keeps_order_and_skips_unparseable_uris() -> None:
    der = _cert_with_sans(
        [
            x509.DNSName("alice.default.svc"),
            x509.UniformResourceIdentifier("https://example.com/"),
            x509.UniformResourceIdentifier(str(BOB)),
            x509.UniformResourceIdentifier("spiffe://cluster.local/ns/default"),
            x509.UniformResourceIdentifier(str(ALICE)),
        ]
    )
    assert spiffe_ids(der) == [BOB, ALICE]


def test_spiffe_ids_of_a_cert_without_san_is_empty() -> None:
    assert spiffe_ids(_cert_with_sans([])) == []


def test_spiffe_ids_rejects_bytes_that_are_not_a_certificate() -> None:
    with pytest.raises(CertificateError, match="cannot be parsed"):
        spiffe_ids(b"\x30\x03\x02\x01\x01")


@given(st.binary(max_size=600))
def test_spiffe_ids_on_arbitrary_bytes_returns_or_raises_certificate_error(data: bytes) -> None:
    try:
        result = spiffe_ids(data)
    except CertificateError:
        return
    assert all(isinstance(i, Identity) for i in result)


_SAMPLE_DER = _cert_with_sans([x509.UniformResourceIdentifier(str(ALICE)), x509.DNSName("a.b")])


@given(st.lists(st.tuples(st.integers(0, len(_SAMPLE_DER) - 1), st.integers(0, 255)), min_size=1, max_size=4))
def test_spiffe_ids_on_corrupted_certificates_returns_or_raises_certificate_error(
    edits: list[tuple[int, int]],
) -> None:
    data = bytearray(_SAMPLE_DER)
    for offset, value in edits:
        data[offset] = value
    try:
        result = spiffe_ids(bytes(data))
    except CertificateError:
        return
    assert all(isinstance(i, Identity) for i in result)


def test_from_ca_response_builds_the_certificate(ca: CertificateAuthority) -> None:
    key_pem, csr_pem = generate_csr(ALICE)
    chain = ca.sign_csr(csr_pem, ALICE, 3600, now=NOW)

    cert = WorkloadCertificate.from_ca_response(ALICE, key_pem, chain)

    assert cert.identity == ALICE
    assert cert.private_key_pem == key_pem
    assert cert.leaf_pem == cert.chain_pem[0] == chain[0].encode()
    assert cert.chain_pem == (chain[0].encode(),)
    assert cert.roots_pem == ca.root_pem
    assert cert.not_before == NOW
    assert cert.not_after == NOW + timedelta(hours=1)
    leaf = x509.load_pem_x509_certificate(cert.leaf_pem)
    assert cert.serial_number == format(leaf.serial_number, "x")
    assert int(cert.serial_number, 16) == leaf.serial_number


def test_refresh_at_is_half_the_lifetime_and_expiry_is_not_after(ca: CertificateAuthority) -> None:
    cert = ca.issue(ALICE, 100, now=NOW)

    assert cert.refresh_at == NOW + timedelta(seconds=50)
    assert not cert.is_expired(NOW + timedelta(seconds=99))
    assert cert.is_expired(NOW + timedelta(seconds=100))


def test_repr_never_shows_key_material(ca: CertificateAuthority) -> None:
    cert = ca.issue(ALICE, 100, now=NOW)

    text = repr(cert)

    assert "PRIVATE KEY" not in text
    assert "BEGIN" not in text
    assert "alice" in text


def test_from_ca_response_rejects_a_leaf_for_another_identity(ca: CertificateAuthority) -> None:
    key_pem, csr_pem = generate_csr(ALICE)
    chain = ca.sign_csr(csr_pem, BOB, 3600, now=NOW)

    with pytest.raises(
        CertificateError,
        match=r"issued a certificate for spiffe://cluster.local/ns/default/sa/bob, but .*alice was requested",
    ):
        WorkloadCertificate.from_ca_response(ALICE, key_pem, chain)


def test_from_ca_response_rejects_a_leaf_for_another_key(ca: CertificateAuthority) -> None:
    _, csr_pem = generate_csr(ALICE)
    other_key_pem, _ = generate_csr(ALICE)
    chain = ca.sign_csr(csr_pem, ALICE, 3600, now=NOW)

    with pytest.raises(CertificateError, match="does not match our key"):
        WorkloadCertificate.from_ca_response(ALICE, other_key_pem, chain)


def test_from_ca_response_needs_a_root(ca: CertificateAuthority) -> None:
    key_pem, csr_pem = generate_csr(ALICE)
    chain = ca.sign_csr(csr_pem, ALICE, 3600, now=NOW)

    with pytest.raises(CertificateError, match="1 certificate"):
        WorkloadCertificate.from_ca_response(ALICE, key_pem, chain[:1])
    with pytest.raises(CertificateError, match="no root"):
        WorkloadCertificate.from_ca_response(ALICE, key_pem, [chain[0], "not a pem"])


def test_from_ca_response_rejects_a_chain_that_does_not_reach_the_roots(ca: CertificateAuthority) -> None:
    other = CertificateAuthority.self_signed("cluster.local", now=NOW - timedelta(days=1))
    key_pem, csr_pem = generate_csr(ALICE)
    chain = ca.sign_csr(csr_pem, ALICE, 3600, now=NOW)

    with pytest.raises(CertificateError, match="does not chain to the trusted root"):
        WorkloadCertificate.from_ca_response(ALICE, key_pem, [chain[0], other.root_pem.decode()])


def test_from_ca_response_accepts_a_root_bundle_during_root_rotation(ca: CertificateAuthority) -> None:
    old = CertificateAuthority.self_signed("cluster.local", now=NOW - timedelta(days=1))
    key_pem, csr_pem = generate_csr(ALICE)
    leaf, root = ca.sign_csr(csr_pem, ALICE, 3600, now=NOW)

    cert = WorkloadCertificate.from_ca_response(ALICE, key_pem, [leaf, old.root_pem.decode() + root])

    assert cert.roots_pem == old.root_pem + ca.root_pem


@settings(max_examples=50, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.text(max_size=80), max_size=4))
def test_from_ca_response_on_arbitrary_text_raises_certificate_error(chain: list[str]) -> None:
    with pytest.raises(CertificateError):
        WorkloadCertificate.from_ca_response(ALICE, b"", chain)
