"""The few OpenSSL calls Python 3.11's `ssl` does not offer, on the objects it made.

Two users: identity/tls_suites.py sets TLS 1.3 cipher suites and a keylog callback (which hands
HBONE's record layer its traffic secrets, proxy/tls_records.py) on the `SSL_CTX *` of an
`ssl.SSLContext`; proxy/tls_transport.py switches read-ahead on (and asks SSL_has_pending) on the
`SSL *` of a connection's `_ssl._SSLSocket`, and puts a buffering BIO in front of its socket BIO
for writes and takes it out again (BIO_f_buffer, the BIO OpenSSL buffers its own handshake
flights with). Both pointers are fields of CPython's own objects (Modules/_ssl.c, unchanged from 3.7 to 3.13): `PySSLContext` starts with `SSL_CTX *ctx`
right after the object header, `PySSLSocket` with `PyObject *Socket` and then `SSL *ssl`. A pointer
read that way is only a candidate: each user checks it with an OpenSSL getter whose answer it
knows (the context's options and verify mode, the socket's descriptor) before writing through it.

The functions are resolved through the `_ssl` extension module's handle, which reaches the libssl
it was linked with, whichever that is.
"""

from __future__ import annotations

import ctypes
import functools
import ssl
import sys
from typing import Any

# CPython releases whose _ssl object layouts are the ones described above.
CHECKED_CPYTHON = ((3, 7), (3, 13))


class LibSsl:
    """The libssl entry points used, with their C signatures."""

    def __init__(self) -> None:
        import _ssl  # the extension module: its handle reaches the libssl it was linked with

        lib = ctypes.CDLL(_ssl.__file__)
        ptr, c_int = ctypes.c_void_p, ctypes.c_int
        self.set_ciphersuites = _bind(lib.SSL_CTX_set_ciphersuites, (ptr, ctypes.c_char_p), c_int)
        # uint64_t since OpenSSL 3.0, unsigned long before.
        options_t = ctypes.c_uint64 if ssl.OPENSSL_VERSION_INFO[0] >= 3 else ctypes.c_ulong
        self.ctx_get_options = _bind(lib.SSL_CTX_get_options, (ptr,), options_t)
        self.ctx_get_verify_mode = _bind(lib.SSL_CTX_get_verify_mode, (ptr,), c_int)
        self.ctrl = _bind(lib.SSL_ctrl, (ptr, c_int, ctypes.c_long, ptr), ctypes.c_long)
        self.has_pending = _bind(lib.SSL_has_pending, (ptr,), c_int)
        self.get_fd = _bind(lib.SSL_get_fd, (ptr,), c_int)
        self.get_rbio = _bind(lib.SSL_get_rbio, (ptr,), ptr)
        self.get_wbio = _bind(lib.SSL_get_wbio, (ptr,), ptr)
        self.set0_wbio = _bind(lib.SSL_set0_wbio, (ptr, ptr), None)
        # libcrypto's, reached through the same handle (a dependency of _ssl).
        self.bio_f_buffer = _bind(lib.BIO_f_buffer, (), ptr)
        self.bio_new = _bind(lib.BIO_new, (ptr,), ptr)
        self.bio_push = _bind(lib.BIO_push, (ptr, ptr), ptr)
        self.bio_pop = _bind(lib.BIO_pop, (ptr,), ptr)
        self.bio_up_ref = _bind(lib.BIO_up_ref, (ptr,), c_int)
        self.bio_free = _bind(lib.BIO_free, (ptr,), c_int)
        self.bio_ctrl = _bind(lib.BIO_ctrl, (ptr, c_int, ctypes.c_long, ptr), ctypes.c_long)
        self.bio_test_flags = _bind(lib.BIO_test_flags, (ptr, c_int), c_int)
        self.ctx_set_keylog_callback = _bind(lib.SSL_CTX_set_keylog_callback, (ptr, KEYLOG_CALLBACK), None)
        self.ctx_get_keylog_callback = _bind(lib.SSL_CTX_get_keylog_callback, (ptr,), ptr)
        # Tests make a real OpenSSL peer send KeyUpdates with it (RFC 8446 4.6.3).
        self.key_update = _bind(lib.SSL_key_update, (ptr, c_int), c_int)


# void (*)(const SSL *ssl, const char *line): OpenSSL's keylog callback (SSL_CTX_set_keylog_callback(3)).
# The line is read with ctypes.string_at inside the callback, so it is passed as a plain pointer.
KEYLOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)


def _bind(function: Any, argtypes: tuple[type, ...], restype: type | None) -> Any:
    function.argtypes = argtypes
    function.restype = restype
    return function


def interpreter_checked() -> bool:
    """The running interpreter is a CPython whose _ssl layouts are the ones described above."""
    return sys.implementation.name == "cpython" and (
        CHECKED_CPYTHON[0] <= sys.version_info[:2] <= CHECKED_CPYTHON[1]
    )


@functools.cache
def libssl() -> LibSsl | None:
    """The entry points, or None on another interpreter or a libssl without them."""
    if not interpreter_checked():
        return None
    try:
        return LibSsl()
    except (OSError, AttributeError):  # no shared libssl, or one without these functions
        return None


def ssl_pointer(lib: LibSsl, tls: ssl.SSLSocket | ssl.SSLObject) -> int | None:
    """The `SSL *` inside `tls`'s `_ssl._SSLSocket`, checked: for an SSLSocket its SSL_get_fd
    must be the socket's descriptor, for an SSLObject (memory BIOs) -1; None otherwise."""
    sslobj = getattr(tls, "_sslobj", None)
    if type(sslobj).__name__ != "_SSLSocket":
        return None
    pointer = field_pointer(sslobj, 1)  # PySSLSocket: `Socket`, then `SSL *ssl`
    expected = tls.fileno() if isinstance(tls, ssl.SSLSocket) else -1
    if not pointer or lib.get_fd(pointer) != expected:
        return None
    return pointer


def field_pointer(obj: object, index: int) -> int | None:
    """The `index`-th pointer-sized field after `obj`'s object header: a candidate only (see the
    module docstring); None when it is NULL."""
    address = id(obj) + object.__basicsize__ + index * ctypes.sizeof(ctypes.c_void_p)
    return ctypes.c_void_p.from_address(address).value
