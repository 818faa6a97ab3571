"""Workload certificates: the key, chain and trust roots one SPIFFE identity presents.

Counterparts: ztunnel src/tls/certificate.rs (`WorkloadCertificate`) and the CSR half of
src/identity/caclient.rs. Pure: nothing here reads the clock or touches the network.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from ..errors import CertificateError, IdentityError
from .spiffe import Identity

# What cryptography raises for DER it cannot read: Rust parse errors are ValueError, the rest
# have their own classes outside the ValueError tree.
_PARSE_ERRORS = (
    ValueError,
    TypeError,
    x509.InvalidVersion,
    x509.DuplicateExtension,
    x509.UnsupportedGeneralNameType,
)

_PEM_CERT_RE = re.compile(rb"-----BEGIN CERTIFICATE-----\r?\n.+?\r?\n-----END CERTIFICATE-----", re.DOTALL)


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkloadCertificate:
    """What a workload presents in HBONE's mutual TLS, and the roots it verifies peers with."""

    identity: Identity
    # repr=False: a certificate ends up in logs and /config_dump; its private key must not.
    private_key_pem: bytes = field(repr=False)
    chain_pem: tuple[bytes, ...] = field(repr=False)
    roots_pem: bytes = field(repr=False)
    not_before: datetime
    not_after: datetime

    @property
    def leaf_pem(self) -> bytes:
        return self.chain_pem[0]

    @property
    def refresh_at(self) -> datetime:
        """Half the lifetime: ztunnel and istio-agent both rotate at 50%."""
        return self.not_before + (self.not_after - self.not_before) / 2

    def is_expired(self, now: datetime) -> bool:
        return now >= self.not_after

    @property
    def serial_number(self) -> str:
        return format(x509.load_pem_x509_certificate(self.leaf_pem).serial_number, "x")

    @classmethod
    def from_ca_response(
        cls, identity: Identity, private_key_pem: bytes, cert_chain: Sequence[str]
    ) -> WorkloadCertificate:
        """Build from `IstioCertificateResponse.cert_chain`: [leaf, intermediates..., root bundle].

        Checks what ztunnel checks in shared mode (the leaf names the identity we asked for),
        plus that the key matches the leaf and the chain reaches one of the roots, so a bad
        response fails here with a clear message instead of later as an opaque TLS alert.
        """
        if len(cert_chain) < 2:
            raise CertificateError(
                f"CA response for {identity} has {len(cert_chain)} certificate(s); "
                "expected the leaf and at least a root bundle"
            )
        try:
            leaf = x509.load_pem_x509_certificate(cert_chain[0].encode())
            intermediates = [x509.load_pem_x509_certificate(pem.encode()) for pem in cert_chain[1:-1]]
            roots = load_pem_certificates(cert_chain[-1].encode())
        except (*_PARSE_ERRORS, UnicodeError) as e:
            raise CertificateError(f"CA response for {identity} holds an unparseable certificate: {e}") from e
        if not roots:
            raise CertificateError(f"CA response for {identity} has no root certificate in its last element")
        presented = spiffe_ids(leaf.public_bytes(serialization.Encoding.DER))
        if not presented or presented[0] != identity:
            raise CertificateError(
                f"CA issued a certificate for {_names(presented)}, but {identity} was requested"
            )
        try:
            key = serialization.load_pem_private_key(private_key_pem, password=None)
        except (ValueError, TypeError) as e:
            raise CertificateError(f"private key for {identity} cannot be loaded: {e}") from e
        if key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        ) != leaf.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        ):
            raise CertificateError(f"CA issued a certificate for {identity} that does not match our key")
        verify_chain(leaf, intermediates, roots, what=f"certificate for {identity}")
        return cls(
            identity=identity,
            private_key_pem=private_key_pem,
            chain_pem=tuple(c.public_bytes(serialization.Encoding.PEM) for c in [leaf, *intermediates]),
            roots_pem=b"".join(r.public_bytes(serialization.Encoding.PEM) for r in roots),
            not_before=leaf.not_valid_before_utc,
            not_after=leaf.not_valid_after_utc,
        )


def generate_csr(identity: Identity) -> tuple[bytes, bytes]:
    """A fresh key and CSR as ztunnel sends them: (PKCS#8 key PEM, CSR PEM).

    ECDSA P-256 with SHA-256, empty subject, one URI SAN. The SAN is critical because the
    subject is empty (RFC 5280 section 4.2.1.6).
    """
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(str(identity))]), critical=True
        )
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return key_pem, csr.public_bytes(serialization.Encoding.PEM)


def spiffe_ids(cert_der: bytes) -> list[Identity]:
    """The parseable SPIFFE URI SANs of a DER certificate, in order.

    Raises CertificateError when the bytes are not a certificate or its SAN extension is
    malformed; URIs that are not Istio SPIFFE ids are skipped (ztunnel takes the first
    parseable one as the peer identity).
    """
    try:
        cert = x509.load_der_x509_certificate(cert_der)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        return []
    except _PARSE_ERRORS as e:
        raise CertificateError(f"peer certificate cannot be parsed: {e}") from e
    ids = []
    for uri in uris:
        try:
            ids.append(Identity.parse(uri))
        except IdentityError:
            continue
    return ids


def load_pem_certificates(data: bytes) -> list[x509.Certificate]:
    """Every certificate in a PEM bundle (ValueError if a block does not parse)."""
    try:
        return [x509.load_pem_x509_certificate(m.group(0)) for m in _PEM_CERT_RE.finditer(data)]
    except _PARSE_ERRORS as e:
        raise ValueError(str(e)) from e


def verify_chain(
    leaf: x509.Certificate,
    intermediates: Sequence[x509.Certificate],
    roots: Sequence[x509.Certificate],
    *,
    what: str,
) -> None:
    """Check that issuer names and signatures link `leaf` through `intermediates` to a root.

    Only the links: validity periods and usages are left to the TLS stack at handshake time.
    """
    current = leaf
    pool = list(intermediates)
    for _ in range(len(intermediates) + 1):
        for root in roots:
            if _issued_by(current, root):
                return
        issuer = next((c for c in pool if _issued_by(current, c)), None)
        if issuer is None:
            break
        pool.remove(issuer)
        current = issuer
    raise CertificateError(
        f"{what} does not chain to the trusted root(s): no issuer found for {current.subject.rfc4514_string() or '<empty subject>'}"
        f" (issuer {current.issuer.rfc4514_string()})"
    )


def _issued_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _names(ids: Sequence[Identity]) -> str:
    return ", ".join(str(i) for i in ids) if ids else "no SPIFFE id"


def to_utc(ts: float) -> datetime:
    """A Unix timestamp (what an injected clock returns) as an aware UTC datetime."""
    return datetime.fromtimestamp(ts, UTC)
