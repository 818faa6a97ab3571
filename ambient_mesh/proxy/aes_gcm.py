"""The AES-GCM that HBONE's record layer (proxy/tls_records.py) seals and opens with.

On x86-64 CPUs with AVX2, VAES and VPCLMULQDQ it is our own (proxy/_aes_gcm_vaes.c, built by
setup.py), two blocks per AES and carry-less multiply instruction; elsewhere it is
`cryptography`'s AESGCM, whose OpenSSL uses VAES on AVX-512 CPUs only. Both have the same
methods (encrypt, decrypt, encrypt_into, decrypt_into) and raise cryptography's InvalidTag.

`IMPLEMENTATION` names the one in use ("vaes" or "openssl") and `FALLBACK_REASON` says why it is
not ours when it is not: the node proxy logs both at start ("node proxy ready"), and
bench/hbone_bench.py prints them with its results.
"""

from __future__ import annotations

from typing import Protocol

from cryptography.hazmat.primitives.ciphers.aead import AESGCM as _OpenSslAesGcm


class Aead(Protocol):
    def encrypt(self, nonce: bytes, data: bytes | bytearray, associated_data: bytes | None) -> bytes: ...

    def decrypt(self, nonce: bytes, data: bytes | bytearray, associated_data: bytes | None) -> bytes: ...

    def encrypt_into(self, nonce: bytes, data: object, associated_data: object, buf: object) -> int: ...

    def decrypt_into(self, nonce: bytes, data: object, associated_data: object, buf: object) -> int: ...


def _pick() -> tuple[type, str, str]:
    try:
        from . import _aes_gcm_vaes  # type: ignore[attr-defined]
    except ImportError as error:
        return _OpenSslAesGcm, "openssl", f"the VAES extension is not built ({error}): run scripts/setup.sh"
    if not _aes_gcm_vaes.cpu_supported():
        return _OpenSslAesGcm, "openssl", "this CPU lacks AVX2, VAES or VPCLMULQDQ"
    return _aes_gcm_vaes.AesGcm, "vaes", ""


_IMPLEMENTATION_TYPE, IMPLEMENTATION, FALLBACK_REASON = _pick()


def aes_gcm(key: bytes | bytearray) -> Aead:
    """An AES-128-GCM or AES-256-GCM context for `key` (16 or 32 bytes)."""
    aead: Aead = _IMPLEMENTATION_TYPE(key)
    return aead
