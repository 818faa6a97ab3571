"""Certificate revocation for HBONE's mutual TLS (`CRL_PATH`), checked on both sides of every
handshake.

Counterpart: ztunnel src/tls/crl.rs (the CRL manager behind `CRL_PATH`), docs/istio-behaviour.md,
"Data-plane TLS": PEM or DER CRLs, reloaded when the file changes (a symlink swap too), revoked chains
refused in both directions, a certificate whose issuer has no CRL allowed (unknown status).

Where: after the handshake, beside the SPIFFE checks (tls/context.py), on the chain OpenSSL
verified (leaf, intermediates, root). Python's `ssl` cannot give OpenSSL a CRL with "unknown
status allowed": X509_V_FLAG_CRL_CHECK fails every chain whose issuer has no CRL, and a reload
would mean rebuilding every context. So each certificate of the verified chain is looked up by
(issuer, serial) in CRLs whose signature its issuer (the next certificate of the chain) verifies.
A CRL no certificate of ours can verify is never trusted.

A refusal is one warning naming the peer, the serial, the issuer and the file, and is counted
(`istio_crl_policy_rejections_total{reporter}`: source when we were the client, destination
when we were the server). Reload failures keep the last good CRLs, so a bad write to the file
never turns revocation checking off. Open connections are not re-checked when the file changes
(ztunnel closes them; not done here).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cryptography import x509
from prometheus_client import Counter

from ..errors import CertificateError, ConfigError, ResponseFlag
from ..metrics import REPORTER_DESTINATION, REPORTER_SOURCE

log = logging.getLogger("ambient_mesh.tls.crl")

# The CRL file comes from the operator, but it is still read into memory whole: bound it.
MAX_CRL_FILE_BYTES = 32 * 1024 * 1024
# How often a handshake may stat the file to notice a change (a stat is microseconds; this keeps
# a handshake burst from doing thousands).
CRL_RECHECK_INTERVAL_S = 1.0


_PEM_CRL = re.compile(rb"-----BEGIN X509 CRL-----\r?\n.+?\r?\n-----END X509 CRL-----", re.DOTALL)


class CertificateRevoked(CertificateError):
    """The peer's chain holds a certificate its issuer's CRL revokes."""

    response_flag = ResponseFlag.CERT_REVOKED


@dataclass(frozen=True, slots=True, kw_only=True)
class Revocation:
    serial: int
    subject: str
    issuer: str
    revoked_at: str


class RevocationList:
    """The CRLs of one file, indexed by issuer name."""

    __slots__ = ("_by_issuer", "count")

    def __init__(self, crls: Sequence[x509.CertificateRevocationList]) -> None:
        self._by_issuer: dict[bytes, list[x509.CertificateRevocationList]] = {}
        for crl in crls:
            self._by_issuer.setdefault(crl.issuer.public_bytes(), []).append(crl)
        self.count = len(crls)

    @classmethod
    def parse(cls, data: bytes, source: str) -> RevocationList:
        """PEM (one or more CRLs) or DER (one CRL); ConfigError naming `source` otherwise."""
        try:
            if b"-----BEGIN" in data:
                blocks = _PEM_CRL.findall(data)
                if not blocks:
                    raise ValueError("no '-----BEGIN X509 CRL-----' block")
                crls = [x509.load_pem_x509_crl(block) for block in blocks]
            else:
                crls = [x509.load_der_x509_crl(data)]
        except ValueError as e:
            raise ConfigError(source, f"not a CRL in PEM or DER: {e}") from None
        return cls(crls)

    def revoked(self, chain: Sequence[x509.Certificate]) -> Revocation | None:
        """The first certificate of `chain` (leaf first) that its issuer's CRL revokes."""
        for cert, issuer in zip(chain, chain[1:], strict=False):
            for crl in self._by_issuer.get(cert.issuer.public_bytes(), ()):
                entry = crl.get_revoked_certificate_by_serial_number(cert.serial_number)
                if entry is None or not _signed_by(crl, issuer):
                    continue
                return Revocation(
                    serial=cert.serial_number,
                    subject=_describe(cert),
                    issuer=cert.issuer.rfc4514_string() or "<empty issuer>",
                    revoked_at=entry.revocation_date_utc.isoformat(),
                )
        return None


def _signed_by(crl: x509.CertificateRevocationList, issuer: x509.Certificate) -> bool:
    try:
        return crl.is_signature_valid(issuer.public_key())  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


def _describe(cert: x509.Certificate) -> str:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    return ", ".join(uris) or cert.subject.rfc4514_string() or "<no subject>"


def verified_chain(ssl_object: object) -> list[x509.Certificate]:
    """The chain OpenSSL verified for the peer, leaf first: tls/handshake.py's `PeerTls` copies it
    out of OpenSSL (`cryptography` certificates). Without it the issuers are unknown, so no CRL
    could be checked: that fails closed."""
    getter = getattr(ssl_object, "get_verified_chain", None)
    if getter is None:
        raise CertificateError(
            "cannot read the peer's verified chain to check CRL_PATH",
            hint="the TLS connection must come from tls/transport.py, whose peer object has it",
        )
    out = []
    for item in getter():
        if isinstance(item, x509.Certificate):
            out.append(item)
        elif isinstance(item, bytes):
            out.append(x509.load_der_x509_certificate(item))
        else:
            raise CertificateError(
                f"the peer's verified chain holds a {type(item).__name__}, not a certificate"
            )
    return out


class CrlMetrics:
    __slots__ = ("rejections",)

    def __init__(self) -> None:
        self.rejections = Counter(
            "istio_crl_policy_rejections",
            "Connections refused because a certificate in the peer's chain is revoked by CRL_PATH",
            ("reporter",),
            registry=None,
        )


class CrlChecker:
    """`CRL_PATH`: loaded at start (a bad file is a start-up error), reloaded when it changes."""

    def __init__(
        self,
        path: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        metrics: CrlMetrics | None = None,
    ) -> None:
        self.path = path
        self._clock = clock
        self.metrics = metrics or CrlMetrics()
        self.rejected = {REPORTER_SOURCE: 0, REPORTER_DESTINATION: 0}
        self.reloads = 0
        self._next_stat = 0.0
        stamp, data = self._read()
        self._crls = RevocationList.parse(data, f"CRL_PATH={path}")
        self._stamp = stamp
        log.info("CRL_PATH=%s: %d CRL(s) loaded; revoked peers are refused", path, self._crls.count)

    def __repr__(self) -> str:
        return (
            f"CrlChecker({self.path}: {self._crls.count} CRLs, {self.reloads} reloads, "
            f"rejected {self.rejected[REPORTER_SOURCE]} servers and {self.rejected[REPORTER_DESTINATION]} clients)"
        )

    def _read(self) -> tuple[tuple[int, int, int, int], bytes]:
        try:
            st = os.stat(self.path)  # follows symlinks: a swapped ..data link is a new inode
            if st.st_size > MAX_CRL_FILE_BYTES:
                raise ConfigError(
                    f"CRL_PATH={self.path}",
                    f"{st.st_size} bytes, more than the {MAX_CRL_FILE_BYTES} a CRL file may have",
                )
            with open(self.path, "rb") as f:
                data = f.read(MAX_CRL_FILE_BYTES + 1)
        except OSError as e:
            raise ConfigError(
                f"CRL_PATH={self.path}", f"cannot read the CRL file: {e.strerror or e}"
            ) from None
        return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size), data

    def maybe_reload(self) -> None:
        now = self._clock()
        if now < self._next_stat:
            return
        self._next_stat = now + CRL_RECHECK_INTERVAL_S
        try:
            st = os.stat(self.path)
            stamp = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
            if stamp == self._stamp:
                return
            stamp, data = self._read()
            crls = RevocationList.parse(data, f"CRL_PATH={self.path}")
        except (OSError, ConfigError) as e:
            log.warning(
                "CRL_PATH=%s changed but cannot be used (%s); keeping the previous CRLs", self.path, e
            )
            return
        self._crls, self._stamp = crls, stamp
        self.reloads += 1
        log.info("CRL_PATH=%s reloaded: %d CRL(s)", self.path, crls.count)

    def check(self, ssl_object: object, reporter: str) -> None:
        """Raise CertificateRevoked when the peer's verified chain holds a revoked certificate."""
        self.maybe_reload()
        revocation = self._crls.revoked(verified_chain(ssl_object))
        if revocation is None:
            return
        peer = "server" if reporter == REPORTER_SOURCE else "client"
        self.rejected[reporter] += 1
        self.metrics.rejections.labels(reporter).inc()
        message = (
            f"{peer} certificate {revocation.subject} (serial {revocation.serial:x}, issuer "
            f"{revocation.issuer}) was revoked at {revocation.revoked_at} by the CRL in {self.path}"
        )
        log.warning("refusing the connection: %s", message)
        raise CertificateRevoked(message, hint="the peer needs a new certificate from its CA")
