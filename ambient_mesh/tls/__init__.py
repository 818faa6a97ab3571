"""HBONE's TLS: contexts and handshakes (OpenSSL through pyOpenSSL), the SPIFFE and CRL checks
after them, HBONE's TLS 1.3 record layer and the transports that run it over a socket.

Counterpart: ztunnel src/tls/. Modules: `context` (contexts, the identity checks, the context
cache), `crl` (CRL_PATH), `handshake` (one handshake over memory BIOs, sans-IO; the peer's facts),
`records` (the TLS 1.3 record layer, sans-IO), `transport` (the asyncio shells). It imports the
identity domain and the foundation only (pyproject.toml's import contracts).
"""

from .context import (
    TlsContext,
    TlsContextCache,
    client_context,
    remove_stale_key_files,
    require_h2,
    server_context,
    verify_client_identity,
    verify_server_identity,
)
from .crl import CrlChecker

__all__ = [
    "CrlChecker",
    "TlsContext",
    "TlsContextCache",
    "client_context",
    "remove_stale_key_files",
    "require_h2",
    "server_context",
    "verify_client_identity",
    "verify_server_identity",
]
