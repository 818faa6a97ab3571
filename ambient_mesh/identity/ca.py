"""The embedded certificate authority and the CA client seam.

Counterparts: istiod's CA signing (security/pkg/pki/ca, its "plugged-in" cacerts layout), and
ztunnel's FAKE_CA (src/identity/manager.rs mock client signing with the test root shipped in
src/tls). Signing is pure: the caller passes `now`. `EmbeddedCaClient` is the only part that
reads a clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Protocol

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
from cryptography.hazmat.primitives.asymmetric.types import (
    CertificateIssuerPrivateKeyTypes,
    CertificatePublicKeyTypes,
)
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ..errors import CertificateError, ConfigError
from .certificate import (
    WorkloadCertificate,
    generate_csr,
    load_pem_certificates,
    to_utc,
    verify_chain,
)
from .spiffe import Identity

ROOT_LIFETIME = timedelta(days=3650)
# istiod: DEFAULT_WORKLOAD_CERT_TTL (24 h) when the request asks for <= 0, capped at
# MAX_WORKLOAD_CERT_TTL (90 days).
DEFAULT_WORKLOAD_CERT_TTL_S = 86400
MAX_WORKLOAD_CERT_TTL_S = 90 * 86400

# The CSR key allow-list (csr_key_refusal).
MIN_RSA_KEY_BITS = 2048
RSA_PUBLIC_EXPONENT = 65537
ALLOWED_CURVES = (ec.SECP256R1, ec.SECP384R1)

TESTDATA_DIR = Path(__file__).parent / "testdata"

# Istio's plugged-in CA layout (the `cacerts` secret mounted into istiod).
CA_CERT_FILE = "ca-cert.pem"
CA_KEY_FILE = "ca-key.pem"
ROOT_CERT_FILE = "root-cert.pem"
CERT_CHAIN_FILE = "cert-chain.pem"


def csr_key_refusal(public_key: CertificatePublicKeyTypes) -> str | None:
    """Why the CA will not certify this key, or None when it is on the allow-list.

    The allow-list is what a workload certificate may carry and every peer can verify: RSA of at
    least `MIN_RSA_KEY_BITS` with the exponent 65537, ECDSA on P-256 or P-384, and Ed25519 (the
    keys istiod's CSR checks and Go's TLS stack accept). Short RSA moduli can be factored, small
    exponents invite signature forgeries, and P-192 or secp256k1 are curves TLS 1.3 peers do not
    offer, so a certificate for them would only ever serve an attacker."""
    if isinstance(public_key, rsa.RSAPublicKey):
        numbers = public_key.public_numbers()
        if public_key.key_size < MIN_RSA_KEY_BITS:
            return f"an RSA key of {public_key.key_size} bits (at least {MIN_RSA_KEY_BITS} are needed)"
        if numbers.e != RSA_PUBLIC_EXPONENT:
            return f"an RSA key with public exponent {numbers.e} (only {RSA_PUBLIC_EXPONENT} is accepted)"
        return None
    if isinstance(public_key, ec.EllipticCurvePublicKey):
        if not isinstance(public_key.curve, ALLOWED_CURVES):
            allowed = ", ".join(c.name for c in (ec.SECP256R1, ec.SECP384R1))
            return f"an ECDSA key on curve {public_key.curve.name} (only {allowed} are accepted)"
        return None
    if isinstance(public_key, ed25519.Ed25519PublicKey):
        return None
    return (
        f"a {type(public_key).__name__} key (accepted: RSA >= {MIN_RSA_KEY_BITS} bits with "
        f"e={RSA_PUBLIC_EXPONENT}, ECDSA P-256 or P-384, Ed25519)"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class CertificateAuthority:
    """A signing certificate and key, the intermediates above it and the trusted root bundle."""

    signing_cert: x509.Certificate = field(repr=False)
    signing_key: CertificateIssuerPrivateKeyTypes = field(repr=False)
    # Between the signing cert and the root, excluding the root; includes the signing cert
    # itself unless it is a root.
    intermediates: tuple[x509.Certificate, ...] = field(repr=False)
    roots: tuple[x509.Certificate, ...] = field(repr=False)

    def __repr__(self) -> str:
        return (
            f"CertificateAuthority(signer={self.signing_cert.subject.rfc4514_string()!r}, "
            f"intermediates={len(self.intermediates)}, roots={len(self.roots)})"
        )

    @property
    def root_pem(self) -> bytes:
        return b"".join(r.public_bytes(serialization.Encoding.PEM) for r in self.roots)

    @classmethod
    def self_signed(cls, trust_domain: str, *, now: datetime | None = None) -> CertificateAuthority:
        """A fresh P-256 root valid for ten years, as istiod creates when no cacerts are plugged in."""
        now = now or datetime.now(UTC)
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, trust_domain)])
        ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
        root = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(now + ROOT_LIFETIME)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(_key_usage(key_cert_sign=True), critical=True)
            .add_extension(ski, critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(signing_cert=root, signing_key=key, intermediates=(), roots=(root,))

    @classmethod
    def insecure_test_ca(cls) -> CertificateAuthority:
        """FAKE_CA's signer: the published test root in testdata/ (see its README: insecure)."""
        root = x509.load_pem_x509_certificate((TESTDATA_DIR / ROOT_CERT_FILE).read_bytes())
        key = serialization.load_pem_private_key((TESTDATA_DIR / CA_KEY_FILE).read_bytes(), password=None)
        return cls(signing_cert=root, signing_key=key, intermediates=(), roots=(root,))  # type: ignore[arg-type]

    @classmethod
    def from_plugged_in_dir(cls, path: str | Path) -> CertificateAuthority:
        """Load Istio's plugged-in CA files and check they fit together.

        ca-cert.pem: the signing cert; ca-key.pem: its key; root-cert.pem: the root bundle;
        cert-chain.pem (optional): the signing cert followed by intermediates, possibly
        ending with the root.
        """
        path = Path(path)
        ca_cert_path, key_path = path / CA_CERT_FILE, path / CA_KEY_FILE
        root_path, chain_path = path / ROOT_CERT_FILE, path / CERT_CHAIN_FILE

        signing_cert = _read_certs(ca_cert_path)[0]
        roots = _read_certs(root_path)
        chain = _read_certs(chain_path) if chain_path.exists() else [signing_cert]
        try:
            key = serialization.load_pem_private_key(_read(key_path), password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm) as e:
            raise ConfigError(str(key_path), f"not an unencrypted PEM private key: {e}") from e
        if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey | ed25519.Ed25519PrivateKey):
            raise ConfigError(str(key_path), f"unsupported CA key type {type(key).__name__}")
        if _spki(key.public_key()) != _spki(signing_cert.public_key()):
            raise ConfigError(str(key_path), f"the key does not belong to the certificate in {CA_CERT_FILE}")
        constraints = _basic_constraints(signing_cert)
        if constraints is None or not constraints.ca:
            raise ConfigError(
                str(ca_cert_path), "the certificate is not a CA (basicConstraints CA:TRUE missing)"
            )
        if chain[0] != signing_cert:
            raise ConfigError(str(chain_path), f"the first certificate must be the one in {CA_CERT_FILE}")
        intermediates = tuple(c for c in chain if c not in roots)
        try:
            verify_chain(signing_cert, intermediates[1:], roots, what=CA_CERT_FILE)
        except CertificateError as e:
            raise ConfigError(
                str(ca_cert_path), f"{e.message}: check {CERT_CHAIN_FILE} and {ROOT_CERT_FILE}"
            ) from e
        return cls(
            signing_cert=signing_cert, signing_key=key, intermediates=intermediates, roots=tuple(roots)
        )

    def sign_csr(self, csr_pem: bytes, identity: Identity, ttl_s: int, *, now: datetime) -> list[str]:
        """Sign a workload CSR for `identity`; returns `IstioCertificateResponse.cert_chain`.

        Like istiod, the SAN comes from the authenticated `identity`, not from the CSR; the
        CSR only supplies the public key, whose possession its signature proves.
        """
        try:
            csr = x509.load_pem_x509_csr(csr_pem)
        except ValueError as e:
            raise CertificateError(f"CSR for {identity} cannot be parsed: {e}") from e
        try:
            valid = csr.is_signature_valid
        except UnsupportedAlgorithm as e:
            raise CertificateError(f"CSR for {identity} uses an unsupported algorithm: {e}") from e
        if not valid:
            raise CertificateError(f"CSR for {identity} has an invalid signature")
        public_key = csr.public_key()
        refused = csr_key_refusal(public_key)
        if refused is not None:
            raise CertificateError(f"CSR for {identity} is refused: {refused}")
        signer_not_after = self.signing_cert.not_valid_after_utc
        if not (self.signing_cert.not_valid_before_utc <= now < signer_not_after):
            raise CertificateError(
                f"the CA's signing certificate is not valid at {now.isoformat()} "
                f"(valid {self.signing_cert.not_valid_before_utc.isoformat()} to {signer_not_after.isoformat()})"
            )
        ttl_s = DEFAULT_WORKLOAD_CERT_TTL_S if ttl_s <= 0 else min(ttl_s, MAX_WORKLOAD_CERT_TTL_S)
        not_after = min(now + timedelta(seconds=ttl_s), signer_not_after)
        leaf = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([]))
            .issuer_name(self.signing_cert.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(not_after)
            # Critical because the subject is empty (RFC 5280 section 4.2.1.6).
            .add_extension(
                x509.SubjectAlternativeName([x509.UniformResourceIdentifier(str(identity))]), critical=True
            )
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(digital_signature=True, key_encipherment=True), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
            .add_extension(_authority_key_id(self.signing_cert), critical=False)
            .sign(self.signing_key, _signature_hash(self.signing_key))
        )
        pem = serialization.Encoding.PEM
        return [
            leaf.public_bytes(pem).decode(),
            *(c.public_bytes(pem).decode() for c in self.intermediates),
            self.root_pem.decode(),
        ]

    def issue(self, identity: Identity, ttl_s: int, *, now: datetime) -> WorkloadCertificate:
        """Key, CSR, signature and checks in one step: what FAKE_CA does for each identity."""
        key_pem, csr_pem = generate_csr(identity)
        return WorkloadCertificate.from_ca_response(
            identity, key_pem, self.sign_csr(csr_pem, identity, ttl_s, now=now)
        )


class CaClient(Protocol):
    """Where the SecretManager gets certificates: istiod over gRPC, or the embedded CA."""

    async def fetch_certificate(self, identity: Identity) -> WorkloadCertificate: ...


class EmbeddedCaClient:
    """ztunnel's FAKE_CA: sign locally instead of calling istiod."""

    def __init__(
        self,
        ca: CertificateAuthority,
        *,
        ttl_s: int = DEFAULT_WORKLOAD_CERT_TTL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._ca = ca
        self._ttl_s = ttl_s
        self._clock = clock
        self.issued = 0

    def __repr__(self) -> str:
        return f"EmbeddedCaClient({self._ca!r}, ttl_s={self._ttl_s}, issued={self.issued})"

    async def fetch_certificate(self, identity: Identity) -> WorkloadCertificate:
        cert = self._ca.issue(identity, self._ttl_s, now=to_utc(self._clock()))
        self.issued += 1
        return cert


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise ConfigError(str(path), f"cannot be read: {e.strerror or e}") from e


def _read_certs(path: Path) -> list[x509.Certificate]:
    try:
        certs = load_pem_certificates(_read(path))
    except ValueError as e:
        raise ConfigError(str(path), f"holds a certificate that does not parse: {e}") from e
    if not certs:
        raise ConfigError(str(path), "holds no PEM certificate")
    return certs


def _spki(key: CertificatePublicKeyTypes) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _basic_constraints(cert: x509.Certificate) -> x509.BasicConstraints | None:
    try:
        return cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        return None


def _authority_key_id(issuer: x509.Certificate) -> x509.AuthorityKeyIdentifier:
    try:
        ski = issuer.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    except x509.ExtensionNotFound:
        return x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer.public_key())  # type: ignore[arg-type]
    return x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski)


def _signature_hash(key: CertificateIssuerPrivateKeyTypes) -> hashes.SHA256 | None:
    # EdDSA signs without a separate digest; everything else uses SHA-256 as istiod does.
    if isinstance(key, ed25519.Ed25519PrivateKey | ed448.Ed448PrivateKey):
        return None
    return hashes.SHA256()


def _key_usage(
    *, digital_signature: bool = False, key_encipherment: bool = False, key_cert_sign: bool = False
) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=digital_signature,
        content_commitment=False,
        key_encipherment=key_encipherment,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=key_cert_sign,
        crl_sign=key_cert_sign,
        encipher_only=False,
        decipher_only=False,
    )
