"""TLS 1.3 cipher suites on a Python `ssl.SSLContext`, which Python 3.11's `ssl` cannot set.

`SSLContext.set_ciphers` governs TLS 1.2 and older only, so without this a context offers
OpenSSL's default TLS 1.3 list (AES-256-GCM, ChaCha20-Poly1305, AES-128-GCM). ztunnel allows
exactly TLS13_AES_256_GCM_SHA384 and TLS13_AES_128_GCM_SHA256 (reference/ztunnel.md, TLS), so
HBONE contexts are narrowed to those two with OpenSSL's own `SSL_CTX_set_ciphersuites`, called
through ctypes on the `SSL_CTX` the context object holds.

Order: AES-128-GCM first, as BoringSSL (Envoy, Istio's other HBONE speaker) orders them. Both
suites are ztunnel's; the 128-bit key costs less per byte (`openssl speed -evp` on the 2-vCPU
bench host, 16 KiB blocks: AES-128-GCM 2.6 GB/s, AES-256-GCM 1.8 GB/s), and a proxy encrypts or
decrypts every byte it carries. Our server context prefers its own order (Python sets
OP_CIPHER_SERVER_PREFERENCE), our client offers it first; a ztunnel server honours the client's
order and a ztunnel client offering AES-256-GCM first gets AES-128-GCM from us, which it allows.

The `SSL_CTX` pointer is the first field of CPython's `PySSLContext` (identity/openssl_native.py).
Before writing anything through it, the pointer is checked: `SSL_CTX_get_options` and
`SSL_CTX_get_verify_mode` on it must return what the Python object reports. When the interpreter
is not one whose layout was checked or the check fails, `set_tls13_suites` raises: a context whose suites we could not narrow is not one we hand to HBONE silently.
"""

from __future__ import annotations

import ssl
import sys

from ..errors import CertificateError
from . import openssl_native

# ztunnel's two suites, in the order we prefer them (see the module docstring).
HBONE_TLS13_SUITES = ("TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384")

# How Modules/_ssl.c maps `verify_mode` onto OpenSSL's flags (SSL_VERIFY_PEER = 1,
# SSL_VERIFY_FAIL_IF_NO_PEER_CERT = 2).
_OPENSSL_VERIFY_FLAGS = {ssl.CERT_NONE: 0, ssl.CERT_OPTIONAL: 1, ssl.CERT_REQUIRED: 3}


def _ssl_ctx_pointer(ctx: ssl.SSLContext) -> tuple[openssl_native.LibSsl, int]:
    lib = openssl_native.libssl()
    if lib is None:
        (low, high) = openssl_native.CHECKED_CPYTHON
        raise CertificateError(
            f"cannot set TLS 1.3 cipher suites on {sys.implementation.name} "
            f"{sys.version_info[0]}.{sys.version_info[1]}",
            hint=f"run the node proxy on CPython {low[0]}.{low[1]} to {high[0]}.{high[1]}",
        )
    pointer = openssl_native.field_pointer(ctx, 0)  # PySSLContext: `SSL_CTX *ctx` first
    if (
        not pointer
        or lib.ctx_get_options(pointer) != int(ctx.options)
        or lib.ctx_get_verify_mode(pointer) != _OPENSSL_VERIFY_FLAGS[ctx.verify_mode]
    ):
        raise CertificateError(
            "cannot find the OpenSSL context inside ssl.SSLContext to set TLS 1.3 cipher suites",
            hint="this CPython build lays out ssl.SSLContext differently; report its version",
        )
    return lib, pointer


def set_tls13_suites(ctx: ssl.SSLContext, suites: tuple[str, ...] = HBONE_TLS13_SUITES) -> None:
    """Offer and accept exactly `suites` (OpenSSL names) in TLS 1.3 handshakes of `ctx`."""
    lib, pointer = _ssl_ctx_pointer(ctx)
    if lib.set_ciphersuites(pointer, ":".join(suites).encode("ascii")) != 1:
        raise CertificateError(
            f"OpenSSL refused the TLS 1.3 cipher suites {':'.join(suites)}",
            hint="check the names against `openssl ciphers -s -tls1_3`",
        )
