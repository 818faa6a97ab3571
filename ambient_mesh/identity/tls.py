"""HBONE's mutual TLS: contexts for both sides and the SPIFFE checks after the handshake.

Counterparts: ztunnel src/tls/workload.rs (client and server configs, identity verifiers) and
src/tls/lib.rs. Facts carried over (wire-protocols.md section 7): TLS 1.3 only, ALPN `h2` on
both sides, mutual certificates verified against the roots of our own CA response, no
hostname check, no SNI, no session resumption; the server accepts only clients with a SPIFFE
id in its own trust domain, and the client accepts only a server naming an expected identity.

TLS12_ENABLED=true also allows TLS 1.2, with only the ECDHE-ECDSA/ECDHE-RSA AES-GCM suites
ztunnel adds (reference 6.5); otherwise 1.2 and older are refused on both sides.

CRL_PATH: `TlsContextCache.verify_server` / `verify_client` also check the peer's verified chain
against the CRLs (identity/tls_crl.py), so both sides of every handshake refuse revoked peers.

Cipher suites: ztunnel allows only TLS13_AES_256_GCM_SHA384 and TLS13_AES_128_GCM_SHA256, and so
do both our contexts (identity/tls_suites.py sets them, AES-128-GCM first, since Python's `ssl`
cannot), so OpenSSL's default ChaCha20-Poly1305 is neither offered nor accepted.
"""

from __future__ import annotations

import contextlib
import os
import ssl
import tempfile
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Protocol

from ..errors import CertificateError, ProtocolError
from ..metrics import REPORTER_DESTINATION, REPORTER_SOURCE
from .certificate import WorkloadCertificate, spiffe_ids
from .spiffe import Identity
from .tls_crl import CrlChecker
from .tls_suites import capture_traffic_secrets, set_tls13_suites

ALPN_H2 = "h2"
# TLS12_ENABLED's suites (OpenSSL names): ECDHE with ECDSA or RSA, AES-GCM only, as ztunnel.
TLS12_CIPHERS = (
    "ECDHE-ECDSA-AES256-GCM-SHA384:ECDHE-ECDSA-AES128-GCM-SHA256:"
    "ECDHE-RSA-AES256-GCM-SHA384:ECDHE-RSA-AES128-GCM-SHA256"
)

# Key material goes through a file only because `ssl` loads keys from paths; RAM-backed
# /dev/shm keeps it off disk for the microseconds it exists.
_KEY_DIR = "/dev/shm"


class PeerCertificateSource(Protocol):
    """The part of `ssl.SSLObject` / `ssl.SSLSocket` the identity checks read."""

    def getpeercert(self, binary_form: bool = ...) -> object: ...

    def selected_alpn_protocol(self) -> str | None: ...


def server_context(cert: WorkloadCertificate, *, tls12: bool = False) -> ssl.SSLContext:
    """The HBONE listener's context: presents `cert`, requires a client cert under its roots."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _configure(ctx, cert, tls12)
    # No resumption (wire-protocols.md 7): with OP_NO_TICKET alone OpenSSL still sends stateful
    # TLS 1.3 tickets, and each would be an application-key record written by OpenSSL after the
    # handshake, which HBONE's record layer (proxy/tls_records.py) would have to count.
    ctx.num_tickets = 0
    return ctx


def client_context(cert: WorkloadCertificate, *, tls12: bool = False) -> ssl.SSLContext:
    """An HBONE client's context: presents the source workload's chain.

    Connect with `server_hostname=""` so that no SNI is sent, as ztunnel does.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    # The server is identified by its SPIFFE id afterwards (verify_server_identity), never by
    # a DNS name; check_hostname must go off before verify_mode can be set.
    ctx.check_hostname = False
    _configure(ctx, cert, tls12)
    return ctx


def _configure(ctx: ssl.SSLContext, cert: WorkloadCertificate, tls12: bool = False) -> None:
    if tls12:
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_ciphers(TLS12_CIPHERS)  # governs 1.2 only; 1.3 keeps its suites
    else:
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.maximum_version = ssl.TLSVersion.TLSv1_3
    set_tls13_suites(ctx)
    ctx.set_alpn_protocols([ALPN_H2])
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.options |= ssl.OP_NO_TICKET  # ztunnel disables session resumption
    # RFC 8446 6.1: a FIN without close_notify is a truncation, an error. Under this option
    # OpenSSL reports it as a clean EOF, and some CPython builds set it by default (Debian's
    # 3.11.2 does, 3.11.7 does not), so it is cleared here rather than left to the interpreter.
    ctx.options &= ~ssl.OP_IGNORE_UNEXPECTED_EOF
    try:
        ctx.load_verify_locations(cadata=cert.roots_pem.decode("ascii"))
    except (ssl.SSLError, ValueError) as e:
        raise CertificateError(f"trust roots for {cert.identity} cannot be loaded: {e}") from e
    _load_key_and_chain(ctx, cert)
    # HBONE's own TLS 1.3 record layer after the handshake takes the traffic secrets from here
    # (identity/tls_suites.py, proxy/tls_transport.py).
    capture_traffic_secrets(ctx)


def _load_key_and_chain(ctx: ssl.SSLContext, cert: WorkloadCertificate) -> None:
    directory = _KEY_DIR if os.path.isdir(_KEY_DIR) and os.access(_KEY_DIR, os.W_OK) else None
    fd, name = tempfile.mkstemp(prefix="ambient-key-", suffix=".pem", dir=directory)  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cert.private_key_pem)
            for pem in cert.chain_pem:
                f.write(pem)
        ctx.load_cert_chain(name)
    except ssl.SSLError as e:
        raise CertificateError(f"certificate or key for {cert.identity} cannot be loaded: {e}") from e
    finally:
        with contextlib.suppress(FileNotFoundError):
            Path(name).unlink()


def require_h2(ssl_object: PeerCertificateSource) -> None:
    """HBONE is HTTP/2 only: a peer that did not agree to ALPN `h2` is not speaking HBONE."""
    selected = ssl_object.selected_alpn_protocol()
    if selected != ALPN_H2:
        raise ProtocolError(
            f"peer negotiated ALPN {selected!r}, HBONE needs {ALPN_H2!r}",
            hint="is the peer an HBONE endpoint (port 15008)?",
        )


def verify_server_identity(ssl_object: PeerCertificateSource, expected: Collection[Identity]) -> Identity:
    """Client side, after the handshake: the server must name one of `expected`.

    Returns the matching identity. ztunnel's rule: some SPIFFE URI SAN of the server leaf
    equals one expected identity (destination workload plus service subjectAltNames).
    """
    require_h2(ssl_object)
    presented = _peer_ids(ssl_object, "server")
    for identity in presented:
        if identity in expected:
            return identity
    raise CertificateError(
        f"server identity mismatch: expected {_names(expected)}, presented {_names(presented)}"
    )


def verify_client_identity(ssl_object: PeerCertificateSource, trust_domain: str) -> Identity:
    """Server side, after the handshake: the client's source identity for authorization.

    The client must carry a SPIFFE id in our trust domain; the first SPIFFE id is the source
    identity (ztunnel src/tls/workload.rs, TrustDomainVerifier).
    """
    require_h2(ssl_object)
    presented = _peer_ids(ssl_object, "client")
    if not any(i.trust_domain == trust_domain for i in presented):
        raise CertificateError(f"client identity {_names(presented)} is not in trust domain {trust_domain!r}")
    return presented[0]


def _peer_ids(ssl_object: PeerCertificateSource, side: str) -> list[Identity]:
    der = ssl_object.getpeercert(binary_form=True)
    if not der:
        raise CertificateError(f"{side} presented no certificate")
    assert isinstance(der, bytes)
    ids = spiffe_ids(der)
    if not ids:
        raise CertificateError(f"{side} certificate carries no SPIFFE id")
    return ids


def _names(ids: Collection[Identity]) -> str:
    return "[" + ", ".join(str(i) for i in ids) + "]"


class TlsContextCache:
    """One server and one client context per identity, rebuilt when the certificate renews,
    and the post-handshake checks with the settings that go with them (TLS12_ENABLED, CRL_PATH).

    Building a context parses keys and roots, so connections reuse it; keying on the serial
    means a refreshed certificate gets a fresh context and the old one is dropped with it.
    """

    def __init__(self, *, tls12: bool = False, crl: CrlChecker | None = None) -> None:
        self.tls12 = tls12
        self.crl = crl
        self._server: dict[Identity, tuple[str, ssl.SSLContext]] = {}
        self._client: dict[Identity, tuple[str, ssl.SSLContext]] = {}

    def __repr__(self) -> str:
        return f"TlsContextCache({len(self._server)} server, {len(self._client)} client)"

    def __len__(self) -> int:
        return len(self._server) + len(self._client)

    def server(self, cert: WorkloadCertificate) -> ssl.SSLContext:
        return self._get(self._server, cert, lambda c: server_context(c, tls12=self.tls12))

    def client(self, cert: WorkloadCertificate) -> ssl.SSLContext:
        return self._get(self._client, cert, lambda c: client_context(c, tls12=self.tls12))

    def verify_server(self, ssl_object: PeerCertificateSource, expected: Collection[Identity]) -> Identity:
        """Client side: CRL_PATH (if set), then the server's SPIFFE identity."""
        if self.crl is not None:
            self.crl.check(ssl_object, REPORTER_SOURCE)
        return verify_server_identity(ssl_object, expected)

    def verify_client(self, ssl_object: PeerCertificateSource, trust_domain: str) -> Identity:
        """Server side: CRL_PATH (if set), then the client's SPIFFE identity and trust domain."""
        if self.crl is not None:
            self.crl.check(ssl_object, REPORTER_DESTINATION)
        return verify_client_identity(ssl_object, trust_domain)

    def forget(self, identity: Identity) -> None:
        self._server.pop(identity, None)
        self._client.pop(identity, None)

    @staticmethod
    def _get(
        table: dict[Identity, tuple[str, ssl.SSLContext]],
        cert: WorkloadCertificate,
        build: Callable[[WorkloadCertificate], ssl.SSLContext],
    ) -> ssl.SSLContext:
        serial = cert.serial_number
        entry = table.get(cert.identity)
        if entry is not None and entry[0] == serial:
            return entry[1]
        ctx = build(cert)
        table[cert.identity] = (serial, ctx)
        return ctx
