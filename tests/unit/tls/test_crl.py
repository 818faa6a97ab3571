"""CRL_PATH without sockets: parsing, lookup by issuer and serial, signature trust, reload."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from ambient_mesh.errors import ConfigError
from ambient_mesh.identity import CertificateAuthority, Identity
from ambient_mesh.identity.certificate import load_pem_certificates
from ambient_mesh.tls.crl import (
    CRL_RECHECK_INTERVAL_S,
    REPORTER_DESTINATION,
    REPORTER_SOURCE,
    CertificateRevoked,
    CrlChecker,
    RevocationList,
)

NOW = datetime.now(UTC)
ALICE = Identity("cluster.local", "ns1", "alice")
BOB = Identity("cluster.local", "ns1", "bob")


@pytest.fixture(scope="module")
def ca() -> CertificateAuthority:
    return CertificateAuthority.insecure_test_ca()


def _cert(pem: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem)


def crl_pem(ca: CertificateAuthority, *serials: int, key=None, issuer=None) -> bytes:
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(issuer or ca.signing_cert.subject)
        .last_update(NOW - timedelta(minutes=1))
        .next_update(NOW + timedelta(days=1))
    )
    for serial in serials:
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(NOW).build()
        )
    crl = builder.sign(key or ca.signing_key, hashes.SHA256())
    return crl.public_bytes(serialization.Encoding.PEM)


@dataclass
class ChainSslObject:
    """An SSLObject after a handshake, as far as the CRL check reads it."""

    chain: list[bytes]

    def get_verified_chain(self) -> list[bytes]:  # Python 3.13's public form: DER bytes
        return self.chain


def chain_of(ca: CertificateAuthority, identity: Identity) -> tuple[ChainSslObject, int]:
    cert = ca.issue(identity, 3600, now=NOW)
    # What OpenSSL reports as verified: the presented chain up to the trust anchor.
    certs = [_cert(p) for p in cert.chain_pem]
    certs += [root for root in load_pem_certificates(cert.roots_pem) if root not in certs]
    der = [c.public_bytes(serialization.Encoding.DER) for c in certs]
    return ChainSslObject(der), certs[0].serial_number


@dataclass
class Clock:
    now: float = 1000.0
    calls: list[float] = field(default_factory=list)

    def __call__(self) -> float:
        return self.now


def write(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # a new inode, as a ConfigMap update or `mv` gives


def test_revoked_client_and_server_are_refused_others_pass(ca, tmp_path, caplog):
    alice, alice_serial = chain_of(ca, ALICE)
    bob, _ = chain_of(ca, BOB)
    path = tmp_path / "crl.pem"
    write(path, crl_pem(ca, alice_serial))
    checker = CrlChecker(str(path))
    caplog.set_level(logging.WARNING, logger="ambient_mesh.tls.crl")
    with pytest.raises(CertificateRevoked) as err:
        checker.check(alice, REPORTER_DESTINATION)
    assert err.value.response_flag == "CERT_REVOKED"
    assert f"serial {alice_serial:x}" in err.value.message and str(path) in err.value.message
    assert str(ALICE) in err.value.message and "client certificate" in err.value.message
    with pytest.raises(CertificateRevoked, match="server certificate"):
        checker.check(alice, REPORTER_SOURCE)
    checker.check(bob, REPORTER_DESTINATION)  # not revoked: no error
    checker.check(bob, REPORTER_SOURCE)
    assert checker.rejected == {REPORTER_SOURCE: 1, REPORTER_DESTINATION: 1}
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["refusing the connection"] * 2
    samples = {
        s.labels["reporter"]: s.value
        for m in checker.metrics.rejections.collect()
        for s in m.samples
        if s.name.endswith("_total")
    }
    assert samples == {"source": 1.0, "destination": 1.0}
    assert repr(checker).endswith("rejected 1 servers and 1 clients)")


def test_a_crl_signed_by_another_key_is_not_trusted(ca, tmp_path):
    alice, serial = chain_of(ca, ALICE)
    forged = crl_pem(ca, serial, key=ec.generate_private_key(ec.SECP256R1()))
    write(tmp_path / "crl.pem", forged)
    CrlChecker(str(tmp_path / "crl.pem")).check(alice, REPORTER_DESTINATION)  # allowed


def test_a_certificate_whose_issuer_has_no_crl_is_allowed(ca, tmp_path):
    alice, serial = chain_of(ca, ALICE)
    other = x509.Name([x509.NameAttribute(x509.NameOID.ORGANIZATION_NAME, "someone else")])
    write(tmp_path / "crl.pem", crl_pem(ca, serial, issuer=other))
    CrlChecker(str(tmp_path / "crl.pem")).check(alice, REPORTER_DESTINATION)


def test_der_and_several_pem_crls(ca, tmp_path):
    alice, a = chain_of(ca, ALICE)
    bob, b = chain_of(ca, BOB)
    der = x509.load_pem_x509_crl(crl_pem(ca, a)).public_bytes(serialization.Encoding.DER)
    write(tmp_path / "crl.der", der)
    with pytest.raises(CertificateRevoked):
        CrlChecker(str(tmp_path / "crl.der")).check(alice, REPORTER_SOURCE)
    write(tmp_path / "two.pem", crl_pem(ca, a) + crl_pem(ca, b))
    both = CrlChecker(str(tmp_path / "two.pem"))
    for peer in (alice, bob):
        with pytest.raises(CertificateRevoked):
            both.check(peer, REPORTER_SOURCE)


def test_reload_when_the_file_changes_at_most_once_per_interval(ca, tmp_path, caplog):
    alice, serial = chain_of(ca, ALICE)
    path = tmp_path / "crl.pem"
    write(path, crl_pem(ca))  # nothing revoked yet
    clock = Clock()
    checker = CrlChecker(str(path), clock=clock)
    checker.check(alice, REPORTER_DESTINATION)
    write(path, crl_pem(ca, serial))
    checker.check(alice, REPORTER_DESTINATION)  # within the interval: not looked at yet
    clock.now += CRL_RECHECK_INTERVAL_S
    with pytest.raises(CertificateRevoked):
        checker.check(alice, REPORTER_DESTINATION)
    assert checker.reloads == 1
    # A bad write keeps the last good CRLs (revocation never silently turns off).
    caplog.set_level(logging.WARNING, logger="ambient_mesh.tls.crl")
    write(path, b"garbage")
    clock.now += CRL_RECHECK_INTERVAL_S
    with pytest.raises(CertificateRevoked):
        checker.check(alice, REPORTER_DESTINATION)
    assert "keeping the previous CRLs" in caplog.text
    # Unrevoked again.
    write(path, crl_pem(ca))
    clock.now += CRL_RECHECK_INTERVAL_S
    checker.check(alice, REPORTER_DESTINATION)
    assert checker.reloads == 2


def test_reload_through_a_symlink_swap(ca, tmp_path):
    alice, serial = chain_of(ca, ALICE)
    (tmp_path / "v1").mkdir()
    (tmp_path / "v2").mkdir()
    (tmp_path / "v1" / "crl.pem").write_bytes(crl_pem(ca))
    (tmp_path / "v2" / "crl.pem").write_bytes(crl_pem(ca, serial))
    (tmp_path / "..data").symlink_to("v1")
    link = tmp_path / "crl.pem"
    link.symlink_to("..data/crl.pem")
    clock = Clock()
    checker = CrlChecker(str(link), clock=clock)
    checker.check(alice, REPORTER_SOURCE)
    (tmp_path / "..data.new").symlink_to("v2")
    os.replace(tmp_path / "..data.new", tmp_path / "..data")  # how kubelet updates a ConfigMap
    clock.now += CRL_RECHECK_INTERVAL_S
    with pytest.raises(CertificateRevoked):
        checker.check(alice, REPORTER_SOURCE)


@pytest.mark.parametrize(
    "content", [None, b"", b"-----BEGIN X509 CRL-----\nAAAA\n-----END X509 CRL-----\n", b"xx"]
)
def test_a_bad_file_at_start_is_a_config_error(tmp_path, content):
    path = tmp_path / "crl.pem"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        CrlChecker(str(path))
    assert err.value.source == f"CRL_PATH={path}"


def test_revocation_list_checks_intermediates_too(ca, tmp_path):
    # A chain leaf -> intermediate -> root where the root's CRL revokes the intermediate.
    root_key = ec.generate_private_key(ec.SECP256R1())
    root_name = x509.Name([x509.NameAttribute(x509.NameOID.ORGANIZATION_NAME, "root")])
    mid_key = ec.generate_private_key(ec.SECP256R1())
    mid_name = x509.Name([x509.NameAttribute(x509.NameOID.ORGANIZATION_NAME, "intermediate")])

    def cert(subject, issuer, key, signer, serial, ca_flag):
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(serial)
            .not_valid_before(NOW)
            .not_valid_after(NOW + timedelta(hours=1))
            .add_extension(x509.BasicConstraints(ca=ca_flag, path_length=None), critical=True)
            .sign(signer, hashes.SHA256())
        )

    leaf_key = ec.generate_private_key(ec.SECP256R1())
    root = cert(root_name, root_name, root_key, root_key, 1, True)
    mid = cert(mid_name, root_name, mid_key, root_key, 2, True)
    leaf = cert(x509.Name([]), mid_name, leaf_key, mid_key, 3, False)
    crl = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(root_name)
        .last_update(NOW)
        .next_update(NOW + timedelta(days=1))
        .add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(2).revocation_date(NOW).build()
        )
        .sign(root_key, hashes.SHA256())
    )
    revoked = RevocationList([crl]).revoked([leaf, mid, root])
    assert revoked is not None and revoked.serial == 2 and revoked.issuer == "O=root"
    assert RevocationList([crl]).revoked([leaf]) is None  # the chain is needed to know the issuer
