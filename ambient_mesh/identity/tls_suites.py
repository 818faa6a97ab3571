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

The `SSL_CTX` pointer is the first field after the object header in CPython's `PySSLContext`
(Modules/_ssl.c, unchanged from 3.7 to 3.13). Before writing anything through it, the pointer is
checked: `SSL_CTX_get_options` and `SSL_CTX_get_verify_mode` on it must return what the Python
object reports. When the interpreter is not CPython or the check fails, `set_tls13_suites`
raises: a context whose suites we could not narrow is not one we hand to HBONE silently.
"""

from __future__ import annotations

import ctypes
import functools
import ssl
import sys

from ..errors import CertificateError

# ztunnel's two suites, in the order we prefer them (see the module docstring).
HBONE_TLS13_SUITES = ("TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384")

# How Modules/_ssl.c maps `verify_mode` onto OpenSSL's flags (SSL_VERIFY_PEER = 1,
# SSL_VERIFY_FAIL_IF_NO_PEER_CERT = 2).
_OPENSSL_VERIFY_FLAGS = {ssl.CERT_NONE: 0, ssl.CERT_OPTIONAL: 1, ssl.CERT_REQUIRED: 3}

# CPython releases whose PySSLContext starts with `SSL_CTX *ctx` right after PyObject_HEAD.
_CHECKED_VERSIONS = ((3, 7), (3, 13))


class _OpenSsl:
    """The three libssl entry points used here, resolved through the `_ssl` extension module."""

    def __init__(self) -> None:
        import _ssl  # the extension module: its handle reaches the libssl it was linked with

        lib = ctypes.CDLL(_ssl.__file__)
        self.set_ciphersuites = lib.SSL_CTX_set_ciphersuites
        self.set_ciphersuites.argtypes = (ctypes.c_void_p, ctypes.c_char_p)
        self.set_ciphersuites.restype = ctypes.c_int
        self.get_options = lib.SSL_CTX_get_options  # uint64_t since OpenSSL 3.0
        self.get_options.argtypes = (ctypes.c_void_p,)
        self.get_options.restype = ctypes.c_uint64 if ssl.OPENSSL_VERSION_INFO[0] >= 3 else ctypes.c_ulong
        self.get_verify_mode = lib.SSL_CTX_get_verify_mode
        self.get_verify_mode.argtypes = (ctypes.c_void_p,)
        self.get_verify_mode.restype = ctypes.c_int


@functools.cache
def _openssl() -> _OpenSsl:
    return _OpenSsl()


def _ssl_ctx_pointer(ctx: ssl.SSLContext) -> int:
    if sys.implementation.name != "cpython" or not (
        _CHECKED_VERSIONS[0] <= sys.version_info[:2] <= _CHECKED_VERSIONS[1]
    ):
        raise CertificateError(
            f"cannot set TLS 1.3 cipher suites on {sys.implementation.name} "
            f"{sys.version_info[0]}.{sys.version_info[1]}",
            hint=f"run the node proxy on CPython {_CHECKED_VERSIONS[0][0]}.{_CHECKED_VERSIONS[0][1]}"
            f" to {_CHECKED_VERSIONS[1][0]}.{_CHECKED_VERSIONS[1][1]}",
        )
    header_bytes = object.__basicsize__  # PyObject_HEAD: reference count and type
    pointer = ctypes.c_void_p.from_address(id(ctx) + header_bytes).value
    lib = _openssl()
    if (
        not pointer
        or lib.get_options(pointer) != int(ctx.options)
        or lib.get_verify_mode(pointer) != _OPENSSL_VERIFY_FLAGS[ctx.verify_mode]
    ):
        raise CertificateError(
            "cannot find the OpenSSL context inside ssl.SSLContext to set TLS 1.3 cipher suites",
            hint="this CPython build lays out ssl.SSLContext differently; report its version",
        )
    return pointer


def set_tls13_suites(ctx: ssl.SSLContext, suites: tuple[str, ...] = HBONE_TLS13_SUITES) -> None:
    """Offer and accept exactly `suites` (OpenSSL names) in TLS 1.3 handshakes of `ctx`."""
    pointer = _ssl_ctx_pointer(ctx)
    if _openssl().set_ciphersuites(pointer, ":".join(suites).encode("ascii")) != 1:
        raise CertificateError(
            f"OpenSSL refused the TLS 1.3 cipher suites {':'.join(suites)}",
            hint="check the names against `openssl ciphers -s -tls1_3`",
        )
