"""TLS 1.3 cipher suites and traffic-secret capture on a Python `ssl.SSLContext`, neither of
which Python 3.11's `ssl` offers.

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

Traffic secrets (`capture_traffic_secrets`): HBONE's own TLS 1.3 record layer
(proxy/tls_records.py) takes over from OpenSSL after the handshake and needs the two application
traffic secrets, which OpenSSL reports only to a keylog callback (SSL_CTX_set_keylog_callback,
the interface SSLKEYLOGFILE uses). One callback serves every context: it runs inside
`do_handshake` on the calling thread (ctypes takes the GIL for it), so the handshake in progress
is the thread's `KEYLOG.current` (a `TrafficSecrets` the shell sets around each `do_handshake`
call), and a line is kept only when its `SSL *` is that handshake's. Only
CLIENT_TRAFFIC_SECRET_0 and SERVER_TRAFFIC_SECRET_0 are kept (in bytearrays the record layer
wipes at the end); the handshake and exporter secrets are never read past their label, and
nothing is logged or written anywhere. The line and its hex are immutable Python bytes for the
moment they are parsed: freed at once, not wiped (OpenSSL holds the same secrets for the
connection's life in any case).
"""

from __future__ import annotations

import binascii
import ctypes
import ssl
import sys
import threading

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


# Keylog labels kept (NSS key log format, which OpenSSL's keylog callback writes).
_CLIENT_LABEL = b"CLIENT_TRAFFIC_SECRET_0 "
_SERVER_LABEL = b"SERVER_TRAFFIC_SECRET_0 "
# Longest secret we take: SHA-384's 48 bytes (TLS_AES_256_GCM_SHA384), as hex.
_MAX_SECRET_HEX = 96


class TrafficSecrets:
    """The application traffic secrets of one handshake, as its keylog lines report them."""

    __slots__ = ("ssl_pointer", "client", "server")

    def __init__(self, ssl_pointer: int) -> None:
        self.ssl_pointer = ssl_pointer
        self.client: bytearray | None = None
        self.server: bytearray | None = None

    def __repr__(self) -> str:  # never the secrets themselves
        return f"TrafficSecrets(client={self.client is not None}, server={self.server is not None})"

    def wipe(self) -> None:
        for secret in (self.client, self.server):
            if secret is not None:
                secret[:] = bytes(len(secret))
        self.client = self.server = None


class _Keylog(threading.local):
    current: TrafficSecrets | None = None


# The handshake in progress on this thread (see the module docstring).
KEYLOG = _Keylog()


def _on_keylog(ssl_pointer: int | None, line: int | None) -> None:
    # Runs inside OpenSSL: it must never raise (ctypes would only print the error).
    try:
        secrets = KEYLOG.current
        if secrets is None or not line or ssl_pointer != secrets.ssl_pointer:
            return
        label = ctypes.string_at(line, len(_CLIENT_LABEL))
        if label != _CLIENT_LABEL and label != _SERVER_LABEL:
            return
        hex_secret = ctypes.string_at(line).rpartition(b" ")[2]
        if not hex_secret or len(hex_secret) > _MAX_SECRET_HEX:
            return
        value = bytearray(binascii.a2b_hex(hex_secret))
        if label == _CLIENT_LABEL:
            secrets.client = value
        else:
            secrets.server = value
    except Exception:  # noqa: BLE001 - nothing may escape into OpenSSL; the secret stays missing
        return


_KEYLOG_CALLBACK = openssl_native.KEYLOG_CALLBACK(_on_keylog)


def capture_traffic_secrets(ctx: ssl.SSLContext) -> None:
    """Report `ctx`'s TLS 1.3 application traffic secrets to the thread's `KEYLOG.current`."""
    lib, pointer = _ssl_ctx_pointer(ctx)
    lib.ctx_set_keylog_callback(pointer, _KEYLOG_CALLBACK)


def captures_traffic_secrets(ctx: ssl.SSLContext) -> bool:
    """Whether `ctx` has our keylog callback (Python's `keylog_filename` would replace it)."""
    lib, pointer = _ssl_ctx_pointer(ctx)
    return bool(lib.ctx_get_keylog_callback(pointer) == ctypes.cast(_KEYLOG_CALLBACK, ctypes.c_void_p).value)
