"""HBONE's mutual TLS: OpenSSL contexts for both sides (through pyOpenSSL) and the SPIFFE checks
after the handshake.

Counterparts: ztunnel src/tls/workload.rs (client and server configs, identity verifiers) and
src/tls/lib.rs. Facts carried over (docs/istio-behaviour.md, "Data-plane TLS"): TLS 1.3 only, ALPN `h2` on
both sides, mutual certificates verified against the roots of our own CA response, no
hostname check, no SNI, no session resumption; the server accepts only clients with a SPIFFE
id in its own trust domain, and the client accepts only a server naming an expected identity.

TLS12_ENABLED=true also allows TLS 1.2, with only the ECDHE-ECDSA/ECDHE-RSA AES-GCM suites
ztunnel adds (docs/istio-behaviour.md, "Data-plane TLS"); otherwise 1.2 and older are refused on both sides.

CRL_PATH: `TlsContextCache.verify_server` / `verify_client` also check the peer's verified chain
against the CRLs (tls/crl.py), so both sides of every handshake refuse revoked peers.

Cipher suites: ztunnel allows only TLS13_AES_256_GCM_SHA384 and TLS13_AES_128_GCM_SHA256, and so
do both our contexts (`Context.set_tls13_ciphersuites`), AES-128-GCM first, as BoringSSL (Envoy,
Istio's other HBONE speaker) orders them: the 128-bit key costs less per byte, and a proxy
encrypts or decrypts every byte it carries. Our server prefers its own order
(OP_CIPHER_SERVER_PREFERENCE); a ztunnel client offering AES-256-GCM first gets AES-128-GCM from
us, which it allows. OpenSSL's default ChaCha20-Poly1305 is neither offered nor accepted.

Everything goes through pyOpenSSL's public API: the key as a `cryptography` key object and the
certificates as `cryptography` certificates (`use_privatekey`, `use_certificate`,
`add_extra_chain_cert`, the store's `add_cert`), so no key or certificate ever touches a file;
the keylog callback that hands HBONE's record layer its traffic secrets (tls/handshake.py);
the TLS 1.3 suites. An older version of this module passed keys through files in /dev/shm for a
moment, and a `kill -9` in that moment left one behind: `remove_stale_key_files` deletes those at
the node proxy's start.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable, Collection
from typing import Any, Protocol

from cryptography import x509
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from OpenSSL import SSL, crypto

from ..errors import CertificateError, ProtocolError
from ..identity.certificate import WorkloadCertificate, spiffe_ids
from ..identity.spiffe import Identity
from ..metrics import REPORTER_DESTINATION, REPORTER_SOURCE
from .crl import CrlChecker
from .handshake import NO_VERIFIED_CHAIN, on_keylog

log = logging.getLogger("ambient_mesh.tls")

ALPN_H2 = "h2"
_ALPN_H2 = ALPN_H2.encode("ascii")
# ztunnel's two TLS 1.3 suites, in the order we prefer them (see the module docstring).
HBONE_TLS13_SUITES = ("TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384")
# TLS12_ENABLED's suites (OpenSSL names): ECDHE with ECDSA or RSA, AES-GCM only, as ztunnel.
TLS12_CIPHERS = (
    "ECDHE-ECDSA-AES256-GCM-SHA384:ECDHE-ECDSA-AES128-GCM-SHA256:"
    "ECDHE-RSA-AES256-GCM-SHA384:ECDHE-RSA-AES128-GCM-SHA256"
)
# The context type of HBONE's TLS.
TlsContext = SSL.Context

# Where the older version's key files were, and their names (see the module docstring).
STALE_KEY_DIR = "/dev/shm"
STALE_KEY_PREFIX = "ambient-key-"
STALE_KEY_SUFFIX = ".pem"
STALE_KEY_AGE_S = 60.0


class PeerCertificateSource(Protocol):
    """The part of tls/handshake.py's `PeerTls` the identity checks read."""

    def getpeercert(self, binary_form: bool = ...) -> object: ...

    def selected_alpn_protocol(self) -> str | None: ...


def server_context(cert: WorkloadCertificate, *, tls12: bool = False) -> SSL.Context:
    """The HBONE listener's context: presents `cert`, requires a client cert under its roots."""
    ctx = _context(cert, tls12)
    ctx.set_options(SSL.OP_CIPHER_SERVER_PREFERENCE)
    ctx.set_alpn_select_callback(_select_h2)
    return ctx


def client_context(cert: WorkloadCertificate, *, tls12: bool = False) -> SSL.Context:
    """An HBONE client's context: presents the source workload's chain. No SNI is sent and no
    hostname checked: the server is identified by its SPIFFE id afterwards
    (`verify_server_identity`), as ztunnel does."""
    ctx = _context(cert, tls12)
    ctx.set_alpn_protos([_ALPN_H2])
    return ctx


def _select_h2(conn: SSL.Connection, offered: list[bytes]) -> Any:
    # A client without h2 gets no ALPN (and is refused after the handshake, `require_h2`), as
    # Python's `ssl` and BoringSSL servers do without an overlap.
    return _ALPN_H2 if _ALPN_H2 in offered else SSL.NO_OVERLAPPING_PROTOCOLS


def _context(cert: WorkloadCertificate, tls12: bool) -> SSL.Context:
    ctx = SSL.Context(SSL.TLS_METHOD)
    try:
        ctx.set_min_proto_version(SSL.TLS1_2_VERSION if tls12 else SSL.TLS1_3_VERSION)
        ctx.set_max_proto_version(SSL.TLS1_3_VERSION)
        if tls12:
            ctx.set_cipher_list(TLS12_CIPHERS.encode("ascii"))  # governs 1.2 only
        ctx.set_tls13_ciphersuites(":".join(HBONE_TLS13_SUITES).encode("ascii"))
        # No resumption (ztunnel disables it); no TLS 1.2 renegotiation. A TLS 1.3 server still
        # sends stateful tickets under OP_NO_TICKET (tls/handshake.py counts them); with the
        # session cache off they resume nothing.
        ctx.set_options(SSL.OP_NO_TICKET | SSL.OP_NO_RENEGOTIATION | SSL.OP_NO_COMPRESSION)
        ctx.set_session_cache_mode(SSL.SESS_CACHE_OFF)
    except SSL.Error as e:
        raise CertificateError(
            f"OpenSSL refused HBONE's TLS settings: {e}",
            hint="check the suites against `openssl ciphers -s -tls1_3` for cryptography's OpenSSL",
        ) from e
    ctx.set_verify(SSL.VERIFY_PEER | SSL.VERIFY_FAIL_IF_NO_PEER_CERT)
    try:
        store = ctx.get_cert_store()
        assert store is not None
        for root in x509.load_pem_x509_certificates(cert.roots_pem):
            store.add_cert(crypto.X509.from_cryptography(root))
    except (ValueError, crypto.Error) as e:
        raise CertificateError(f"trust roots for {cert.identity} cannot be loaded: {e}") from e
    try:
        key = load_pem_private_key(cert.private_key_pem, password=None)
        chain = [x509.load_pem_x509_certificate(pem) for pem in cert.chain_pem]
        if not chain:
            raise ValueError("no certificate")
        ctx.use_certificate(chain[0])
        for intermediate in chain[1:]:
            ctx.add_extra_chain_cert(intermediate)
        ctx.use_privatekey(key)  # type: ignore[arg-type]
        ctx.check_privatekey()
    except (ValueError, TypeError, SSL.Error, crypto.Error) as e:
        raise CertificateError(f"certificate or key for {cert.identity} cannot be loaded: {e}") from e
    # HBONE's own TLS 1.3 record layer after the handshake takes the traffic secrets from here.
    ctx.set_keylog_callback(on_keylog)
    return ctx


def remove_stale_key_files(
    directory: str = STALE_KEY_DIR, *, older_than_s: float = STALE_KEY_AGE_S, now: float | None = None
) -> int:
    """Delete the key files an older version left in `directory` when it was killed while loading
    a key (module docstring); how many. Only regular files with that name pattern and older than
    `older_than_s` (an older proxy still running beside us holds its file for microseconds; a
    left-over one stays forever); a symlink is removed itself, never followed."""
    cutoff = (time.time() if now is None else now) - older_than_s
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if not (name.startswith(STALE_KEY_PREFIX) and name.endswith(STALE_KEY_SUFFIX)):
            continue
        path = os.path.join(directory, name)
        try:
            info = os.lstat(path)
            if not (stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode)) or info.st_mtime > cutoff:
                continue
            os.unlink(path)
        except OSError as e:
            log.warning("cannot remove the stale key file %s: %s", path, e)
            continue
        removed += 1
    if removed:
        log.warning(
            "removed %d private key file(s) an older ztunnel version left in %s (%s*%s)",
            removed,
            directory,
            STALE_KEY_PREFIX,
            STALE_KEY_SUFFIX,
        )
    return removed


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
        self._server: dict[Identity, tuple[str, SSL.Context]] = {}
        self._client: dict[Identity, tuple[str, SSL.Context]] = {}

    def __repr__(self) -> str:
        return f"TlsContextCache({len(self._server)} server, {len(self._client)} client)"

    def __len__(self) -> int:
        return len(self._server) + len(self._client)

    def server(self, cert: WorkloadCertificate) -> SSL.Context:
        return self._get(self._server, cert, lambda c: self._mark(server_context(c, tls12=self.tls12)))

    def client(self, cert: WorkloadCertificate) -> SSL.Context:
        return self._get(self._client, cert, lambda c: self._mark(client_context(c, tls12=self.tls12)))

    def _mark(self, ctx: SSL.Context) -> SSL.Context:
        """Without CRL_PATH nothing reads a peer's verified chain: its connections skip copying it
        (tls/handshake.py `PeerTls.of`)."""
        if self.crl is None:
            ctx.set_app_data(NO_VERIFIED_CHAIN)
        return ctx

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
        table: dict[Identity, tuple[str, SSL.Context]],
        cert: WorkloadCertificate,
        build: Callable[[WorkloadCertificate], SSL.Context],
    ) -> SSL.Context:
        serial = cert.serial_number
        entry = table.get(cert.identity)
        if entry is not None and entry[0] == serial:
            return entry[1]
        ctx = build(cert)
        table[cert.identity] = (serial, ctx)
        return ctx
