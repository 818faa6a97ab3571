"""The embedded CA: roots, signing, the plugged-in cacerts layout, the insecure test root."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, ExtensionOID, NameOID
from hypothesis import given
from hypothesis import strategies as st

from ambient_mesh.errors import CertificateError, ConfigError
from ambient_mesh.identity import CertificateAuthority, EmbeddedCaClient, Identity, generate_csr
from ambient_mesh.identity.certificate import load_pem_certificates
from tests.helpers.weak_keys import ACCEPTED_KEYS, REFUSED_KEYS, csr_pem

NOW = datetime(2030, 6, 1, 12, 0, 0, tzinfo=UTC)
ALICE = Identity("cluster.local", "ns1", "alice")


@pytest.fixture(scope="module")
def ca() -> CertificateAuthority:
    return CertificateAuthority.self_signed("cluster.local", now=NOW - timedelta(days=1))


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _make_ca_cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Certificate | None,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = True,
) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer.subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW - timedelta(days=30))
        .not_valid_after(NOW + timedelta(days=365))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .sign(issuer_key, hashes.SHA256())
    )


def _plugged_in_dir(
    tmp_path: Path, *, chain_with_root: bool = False
) -> tuple[Path, x509.Certificate, x509.Certificate]:
    """root -> intermediate, laid out as Istio's cacerts secret."""
    root_key, int_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    root = _make_ca_cert("Root CA", root_key, None, root_key)
    intermediate = _make_ca_cert("Intermediate CA", int_key, root, root_key)
    (tmp_path / "ca-cert.pem").write_bytes(_pem(intermediate))
    (tmp_path / "ca-key.pem").write_bytes(_key_pem(int_key))
    (tmp_path / "root-cert.pem").write_bytes(_pem(root))
    (tmp_path / "cert-chain.pem").write_bytes(_pem(intermediate) + (_pem(root) if chain_with_root else b""))
    return tmp_path, root, intermediate


def test_self_signed_root(ca: CertificateAuthority) -> None:
    (root,) = load_pem_certificates(ca.root_pem)

    assert root.subject == root.issuer
    assert root.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "cluster.local"
    assert isinstance(root.public_key(), ec.EllipticCurvePublicKey)
    assert root.public_key().curve.name == "secp256r1"
    assert root.not_valid_after_utc - root.not_valid_before_utc == timedelta(days=3650)
    assert root.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert root.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign
    root.verify_directly_issued_by(root)


def test_sign_csr_issues_an_istio_workload_leaf(ca: CertificateAuthority) -> None:
    _, csr_pem = generate_csr(ALICE)

    chain = ca.sign_csr(csr_pem, ALICE, 3600, now=NOW)

    assert len(chain) == 2
    assert chain[1].encode() == ca.root_pem
    leaf = x509.load_pem_x509_certificate(chain[0].encode())
    (root,) = load_pem_certificates(ca.root_pem)
    leaf.verify_directly_issued_by(root)
    assert leaf.subject == x509.Name([])
    san = leaf.extensions.get_extension_for_oid(ExtensionOID.SUBJECT_ALTERNATIVE_NAME)
    assert san.critical
    assert san.value.get_values_for_type(x509.UniformResourceIdentifier) == [str(ALICE)]
    usage = leaf.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.digital_signature and usage.key_encipherment and not usage.key_cert_sign
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    assert leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    aki = leaf.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    ski = root.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    assert aki.key_identifier == ski.digest
    assert leaf.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value == (
        x509.SubjectKeyIdentifier.from_public_key(leaf.public_key())
    )
    assert leaf.not_valid_before_utc == NOW
    assert leaf.not_valid_after_utc == NOW + timedelta(hours=1)


def test_sign_csr_takes_the_san_from_the_authenticated_identity_not_the_csr(ca: CertificateAuthority) -> None:
    _, csr_pem = generate_csr(Identity("cluster.local", "ns1", "mallory"))

    chain = ca.sign_csr(csr_pem, ALICE, 3600, now=NOW)

    leaf = x509.load_pem_x509_certificate(chain[0].encode())
    assert leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.UniformResourceIdentifier
    ) == [str(ALICE)]


def test_sign_csr_ttl_defaults_and_caps(ca: CertificateAuthority) -> None:
    _, csr_pem = generate_csr(ALICE)

    def lifetime(ttl_s: int, now: datetime = NOW) -> timedelta:
        leaf = x509.load_pem_x509_certificate(ca.sign_csr(csr_pem, ALICE, ttl_s, now=now)[0].encode())
        return leaf.not_valid_after_utc - leaf.not_valid_before_utc

    assert lifetime(0) == timedelta(hours=24)
    assert lifetime(-5) == timedelta(hours=24)
    assert lifetime(365 * 86400) == timedelta(days=90)
    (root,) = load_pem_certificates(ca.root_pem)
    near_end = root.not_valid_after_utc - timedelta(hours=1)
    assert lifetime(86400, near_end) == timedelta(hours=1)


def test_sign_csr_refuses_a_tampered_csr(ca: CertificateAuthority) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "aaaa")]))
        .sign(key, hashes.SHA256())
    )
    der = csr.public_bytes(serialization.Encoding.DER).replace(b"aaaa", b"bbbb")
    tampered = x509.load_der_x509_csr(der).public_bytes(serialization.Encoding.PEM)

    with pytest.raises(CertificateError, match="invalid signature"):
        ca.sign_csr(tampered, ALICE, 3600, now=NOW)


def test_sign_csr_refuses_when_the_signer_is_not_valid(ca: CertificateAuthority) -> None:
    _, csr_pem = generate_csr(ALICE)

    with pytest.raises(CertificateError, match="not valid at"):
        ca.sign_csr(csr_pem, ALICE, 3600, now=NOW + timedelta(days=3651))


@given(st.binary(max_size=300))
def test_sign_csr_on_arbitrary_bytes_raises_certificate_error(data: bytes) -> None:
    ca = _shared_ca()
    with pytest.raises(CertificateError):
        ca.sign_csr(
            b"-----BEGIN CERTIFICATE REQUEST-----\n" + data + b"\n-----END CERTIFICATE REQUEST-----\n",
            ALICE,
            60,
            now=NOW,
        )


_CA_CACHE: list[CertificateAuthority] = []


def _shared_ca() -> CertificateAuthority:
    if not _CA_CACHE:
        _CA_CACHE.append(CertificateAuthority.self_signed("cluster.local", now=NOW - timedelta(days=1)))
    return _CA_CACHE[0]


def test_issue_is_the_fake_ca_path(ca: CertificateAuthority) -> None:
    cert = ca.issue(ALICE, 600, now=NOW)

    assert cert.identity == ALICE
    assert cert.roots_pem == ca.root_pem
    assert cert.not_after - cert.not_before == timedelta(minutes=10)


def test_insecure_test_ca_is_the_shipped_fixed_root() -> None:
    first, second = CertificateAuthority.insecure_test_ca(), CertificateAuthority.insecure_test_ca()

    assert first.root_pem == second.root_pem  # the same root in every process
    (root,) = load_pem_certificates(first.root_pem)
    assert (
        root.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value
        == "ambient-mesh insecure test CA"
    )
    assert root.not_valid_before_utc == datetime(2025, 1, 1, tzinfo=UTC)
    assert root.not_valid_after_utc == datetime(2045, 1, 1, tzinfo=UTC)
    cert = first.issue(ALICE, 60, now=NOW)
    x509.load_pem_x509_certificate(cert.leaf_pem).verify_directly_issued_by(root)


async def test_embedded_ca_client_signs_with_its_clock_and_ttl(ca: CertificateAuthority) -> None:
    client = EmbeddedCaClient(ca, ttl_s=120, clock=lambda: NOW.timestamp())

    cert = await client.fetch_certificate(ALICE)

    assert cert.identity == ALICE
    assert cert.not_before == NOW
    assert cert.not_after == NOW + timedelta(seconds=120)
    assert client.issued == 1
    assert "issued=1" in repr(client)


def test_plugged_in_ca_with_intermediate(tmp_path: Path) -> None:
    path, root, intermediate = _plugged_in_dir(tmp_path)

    ca = CertificateAuthority.from_plugged_in_dir(path)
    _, csr_pem = generate_csr(ALICE)
    chain = ca.sign_csr(csr_pem, ALICE, 3600, now=NOW)

    assert ca.root_pem == _pem(root)
    assert [c.encode() for c in chain[1:]] == [_pem(intermediate), _pem(root)]
    x509.load_pem_x509_certificate(chain[0].encode()).verify_directly_issued_by(intermediate)


def test_plugged_in_cert_chain_may_end_with_the_root(tmp_path: Path) -> None:
    path, root, intermediate = _plugged_in_dir(tmp_path, chain_with_root=True)

    ca = CertificateAuthority.from_plugged_in_dir(path)

    assert ca.intermediates == (intermediate,)
    assert ca.roots == (root,)


def test_plugged_in_cert_chain_is_optional(tmp_path: Path) -> None:
    path, _, intermediate = _plugged_in_dir(tmp_path)
    (path / "cert-chain.pem").unlink()

    assert CertificateAuthority.from_plugged_in_dir(path).intermediates == (intermediate,)


def test_plugged_in_missing_key_names_the_file(tmp_path: Path) -> None:
    path, _, _ = _plugged_in_dir(tmp_path)
    (path / "ca-key.pem").unlink()

    with pytest.raises(ConfigError, match="ca-key.pem: cannot be read") as info:
        CertificateAuthority.from_plugged_in_dir(path)
    assert info.value.source == str(path / "ca-key.pem")


def test_plugged_in_key_of_another_cert_names_the_key_file(tmp_path: Path) -> None:
    path, _, _ = _plugged_in_dir(tmp_path)
    (path / "ca-key.pem").write_bytes(_key_pem(ec.generate_private_key(ec.SECP256R1())))

    with pytest.raises(
        ConfigError, match=r"ca-key.pem: the key does not belong to the certificate in ca-cert.pem"
    ):
        CertificateAuthority.from_plugged_in_dir(path)


def test_plugged_in_garbage_key_names_the_key_file(tmp_path: Path) -> None:
    path, _, _ = _plugged_in_dir(tmp_path)
    (path / "ca-key.pem").write_bytes(b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")

    with pytest.raises(ConfigError, match=r"ca-key.pem: not an unencrypted PEM private key"):
        CertificateAuthority.from_plugged_in_dir(path)


def test_plugged_in_signing_cert_from_another_root_names_ca_cert(tmp_path: Path) -> None:
    path, _, _ = _plugged_in_dir(tmp_path)
    other_key = ec.generate_private_key(ec.SECP256R1())
    (path / "root-cert.pem").write_bytes(_pem(_make_ca_cert("Other Root", other_key, None, other_key)))

    with pytest.raises(
        ConfigError, match=r"ca-cert.pem: .*does not chain to the trusted root.*root-cert.pem"
    ):
        CertificateAuthority.from_plugged_in_dir(path)


def test_plugged_in_garbage_root_names_the_root_file(tmp_path: Path) -> None:
    path, _, _ = _plugged_in_dir(tmp_path)
    (path / "root-cert.pem").write_bytes(b"hello\n")

    with pytest.raises(ConfigError, match=r"root-cert.pem: holds no PEM certificate"):
        CertificateAuthority.from_plugged_in_dir(path)


def test_plugged_in_corrupt_certificate_names_the_file(tmp_path: Path) -> None:
    path, _, _ = _plugged_in_dir(tmp_path)
    (path / "ca-cert.pem").write_bytes(b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")

    with pytest.raises(ConfigError, match=r"ca-cert.pem: holds a certificate that does not parse"):
        CertificateAuthority.from_plugged_in_dir(path)


def test_plugged_in_chain_must_start_with_the_signing_cert(tmp_path: Path) -> None:
    path, root, _ = _plugged_in_dir(tmp_path)
    (path / "cert-chain.pem").write_bytes(_pem(root))

    with pytest.raises(
        ConfigError, match=r"cert-chain.pem: the first certificate must be the one in ca-cert.pem"
    ):
        CertificateAuthority.from_plugged_in_dir(path)


def test_plugged_in_signing_cert_must_be_a_ca(tmp_path: Path) -> None:
    path, root, _ = _plugged_in_dir(tmp_path)
    key = ec.generate_private_key(ec.SECP256R1())
    root_key_missing = _make_ca_cert("Leaf", key, root, key, ca=False)  # not a CA (and badly signed)
    (path / "ca-cert.pem").write_bytes(_pem(root_key_missing))
    (path / "ca-key.pem").write_bytes(_key_pem(key))

    with pytest.raises(ConfigError, match=r"ca-cert.pem: the certificate is not a CA"):
        CertificateAuthority.from_plugged_in_dir(path)


# --- the CSR key allow-list (issue 25, S6) ----------------------------------------------------


@pytest.mark.parametrize("name", sorted(REFUSED_KEYS))
def test_csr_keys_off_the_allow_list_are_refused_with_a_reason(ca: CertificateAuthority, name: str) -> None:
    make, reason = REFUSED_KEYS[name]
    with pytest.raises(CertificateError) as info:
        ca.sign_csr(csr_pem(make()), ALICE, 3600, now=NOW)  # type: ignore[no-untyped-call]
    assert f"CSR for {ALICE} is refused" in str(info.value) and reason in str(info.value)


@pytest.mark.parametrize("name", sorted(ACCEPTED_KEYS))
def test_csr_keys_on_the_allow_list_are_signed(ca: CertificateAuthority, name: str) -> None:
    key = ACCEPTED_KEYS[name]()  # type: ignore[no-untyped-call]
    leaf = x509.load_pem_x509_certificate(ca.sign_csr(csr_pem(key), ALICE, 3600, now=NOW)[0].encode())
    assert leaf.public_key() == key.public_key()
