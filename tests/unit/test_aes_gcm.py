"""proxy/_aes_gcm_vaes.c, our AES-GCM, against `cryptography`'s AESGCM (OpenSSL) and the GCM
specification's own test cases; and proxy/aes_gcm.py's choice between them."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ambient_mesh.proxy import aes_gcm


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


CPU_HAS_VAES = {"avx2", "aes", "pclmulqdq", "vaes", "vpclmulqdq"} <= _cpu_flags()

try:
    from ambient_mesh.proxy._aes_gcm_vaes import AesGcm  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - the extension did not build
    AesGcm = None

needs_vaes = pytest.mark.skipif(
    not CPU_HAS_VAES or AesGcm is None,
    reason="this CPU has no VAES/VPCLMULQDQ (or the extension is not built)",
)


def test_the_record_layer_uses_ours_where_the_cpu_has_vaes() -> None:
    # A build that failed silently (setup.py's extension is optional) would show here.
    if CPU_HAS_VAES:
        assert aes_gcm.IMPLEMENTATION == "vaes", aes_gcm.FALLBACK_REASON
        assert aes_gcm.FALLBACK_REASON == ""
    else:
        assert aes_gcm.IMPLEMENTATION == "openssl"
        assert aes_gcm.FALLBACK_REASON


# NIST GCM specification (McGrew and Viega), test cases 1-4: AES-128, 96-bit IV.
_K3 = "feffe9928665731c6d6a8f9467308308"
_IV3 = "cafebabefacedbaddecaf888"
_P3 = (
    "d9313225f88406e5a55909c5aff5269a86a7a9531534f7da2e4c303d8a318a72"
    "1c3c0c95956809532fcf0e2449a6b525b16aedf5aa0de657ba637b391aafd255"
)
_C3 = (
    "42831ec2217774244b7221b784d0d49ce3aa212f2c02a4e035c17e2329aca12e"
    "21d514b25466931c7d8f6a5aac84aa051ba30b396a0aac973d58e091473f5985"
)
SPEC_CASES = [
    ("00" * 16, "00" * 12, "", "", "", "58e2fccefa7e3061367f1d57a4e7455a"),
    (
        "00" * 16,
        "00" * 12,
        "00" * 16,
        "",
        "0388dace60b6a392f328c2b971b2fe78",
        "ab6e47d42cec13bdf53a67b21257bddf",
    ),
    (_K3, _IV3, _P3, "", _C3, "4d5c2af327cd64a62cf35abd2ba6fab4"),
    (
        _K3,
        _IV3,
        _P3[:120],
        "feedfacedeadbeeffeedfacedeadbeefabaddad2",
        _C3[:120],
        "5bc94fbc3221a5db94fae95ae7121a47",
    ),
]


@needs_vaes
@pytest.mark.parametrize(("key", "iv", "plain", "ad", "cipher", "tag"), SPEC_CASES)
def test_specification_cases(key: str, iv: str, plain: str, ad: str, cipher: str, tag: str) -> None:
    aead = AesGcm(bytes.fromhex(key))
    sealed = aead.encrypt(bytes.fromhex(iv), bytes.fromhex(plain), bytes.fromhex(ad))
    assert sealed.hex() == cipher + tag
    assert aead.decrypt(bytes.fromhex(iv), sealed, bytes.fromhex(ad)).hex() == plain


# Lengths around every boundary the code has: a block, the two-block registers, the 16 blocks of
# one GHASH step and counter-mode round, a TLS record (16 KiB + content type) and several steps.
EDGE_LENGTHS = [0, 1, 15, 16, 17, 31, 32, 33, 47, 240, 255, 256, 257, 271, 272, 511, 512, 513, 16385, 16401]


@needs_vaes
@pytest.mark.parametrize("key_bytes", [16, 32])
def test_same_bytes_as_openssl_at_every_edge(key_bytes: int) -> None:
    rng = random.Random(key_bytes)
    for n in EDGE_LENGTHS:
        for ad_n in (0, 5, 13, 16, 17, 255, 256, 257):
            key, nonce = rng.randbytes(key_bytes), rng.randbytes(12)
            data, ad = rng.randbytes(n), rng.randbytes(ad_n)
            expected = AESGCM(key).encrypt(nonce, data, ad)
            ours = AesGcm(key)
            assert ours.encrypt(nonce, data, ad) == expected, (n, ad_n)
            assert ours.decrypt(nonce, expected, ad) == data


@needs_vaes
def test_same_bytes_as_openssl_at_random() -> None:
    rng = random.Random(21)
    for _ in range(300):
        key, nonce = rng.randbytes(rng.choice((16, 32))), rng.randbytes(12)
        data, ad = rng.randbytes(rng.randrange(70_000)), rng.randbytes(rng.randrange(600))
        ours, theirs = AesGcm(key), AESGCM(key)
        assert ours.encrypt(nonce, data, ad) == theirs.encrypt(nonce, data, ad)
        sealed = theirs.encrypt(nonce, data, None)
        assert ours.decrypt(nonce, sealed, None) == data


@needs_vaes
def test_into_forms_fill_the_caller_buffer_and_work_in_place() -> None:
    key, nonce, ad = os.urandom(16), os.urandom(12), b"\x17\x03\x03\x40\x11"
    data = os.urandom(16385)
    ours = AesGcm(key)
    out = bytearray(len(data) + 16)
    assert ours.encrypt_into(nonce, data, ad, out) == len(out)
    assert bytes(out) == AESGCM(key).encrypt(nonce, data, ad)
    plain = bytearray(len(data))
    assert ours.decrypt_into(nonce, memoryview(out), ad, memoryview(plain)) == len(data)
    assert plain == data
    # In place: the record layer never does this, but equal buffers must not break it.
    buf = bytearray(data) + bytearray(16)
    view = memoryview(buf)
    ours.encrypt_into(nonce, view[: len(data)], ad, view)
    assert bytes(buf) == bytes(out)
    ours.decrypt_into(nonce, view, ad, view[: len(data)])
    assert bytes(buf[: len(data)]) == data


@needs_vaes
@pytest.mark.parametrize("where", ["tag", "first byte", "last block", "associated data", "nonce"])
def test_any_change_is_invalid_tag_and_nothing_is_written(where: str) -> None:
    key, nonce, ad = os.urandom(32), bytearray(os.urandom(12)), bytearray(b"\x17\x03\x03\x40\x11")
    data = os.urandom(1000)
    ours = AesGcm(key)
    sealed = bytearray(ours.encrypt(bytes(nonce), data, bytes(ad)))
    target = {"tag": (sealed, -1), "first byte": (sealed, 0), "last block": (sealed, -20)}.get(where)
    if target is not None:
        target[0][target[1]] ^= 0x01
    elif where == "associated data":
        ad[0] ^= 0x80
    else:
        nonce[11] ^= 0x01
    plain = bytearray(b"\xaa" * len(data))
    with pytest.raises(InvalidTag):
        ours.decrypt_into(bytes(nonce), sealed, bytes(ad), plain)
    assert plain == b"\xaa" * len(data)  # the tag is checked before anything is decrypted
    with pytest.raises(InvalidTag):
        ours.decrypt(bytes(nonce), bytes(sealed), bytes(ad))


@needs_vaes
def test_bad_arguments_are_refused_as_cryptography_refuses_them() -> None:
    ours = AesGcm(os.urandom(16))
    with pytest.raises(ValueError, match="128 or 256 bits"):
        AesGcm(os.urandom(24))  # AES-192: not a TLS 1.3 suite
    with pytest.raises(ValueError, match="Nonce must be 12 bytes"):
        ours.encrypt(os.urandom(16), b"x", None)
    with pytest.raises(ValueError, match="buffer must be 17 bytes"):
        ours.encrypt_into(os.urandom(12), b"x", None, bytearray(16))
    with pytest.raises(ValueError, match="buffer must be 1 bytes"):
        ours.decrypt_into(os.urandom(12), os.urandom(17), None, bytearray(2))
    with pytest.raises(InvalidTag):  # shorter than a tag
        ours.decrypt(os.urandom(12), os.urandom(15), None)
    with pytest.raises(BufferError):
        ours.encrypt_into(os.urandom(12), b"x", None, bytes(17))  # not writable
    with pytest.raises(TypeError, match="takes 3 arguments"):
        ours.encrypt(os.urandom(12), b"x")
