"""HBONE's TLS 1.3 record layer after the handshake (sans-IO): records in, plaintext out;
plaintext in, records out.

OpenSSL does the handshake (tls/handshake.py drives it through pyOpenSSL); once it is done, the
two application traffic secrets (from OpenSSL's keylog callback, tls/handshake.py
`TrafficSecrets`) are all this core needs. Counterparts: rustls' record layer under ztunnel,
BoringSSL's under Envoy, OpenSSL's `ssl/record/`; why HBONE keeps a record layer of its own rather
than OpenSSL's: docs/performance.md, "TLS: our own TLS 1.3 records on `cryptography`'s AES-GCM".

What it implements (RFC 8446), each rule with a test in tests/unit/tls/test_records.py:
- 5.1 / 5.2: every record after the handshake is a TLSCiphertext (outer type application_data,
  legacy_record_version 0x0303); any other outer type is an unprotected record and ends the
  connection (unexpected_message); a record longer than 2^14 + 256 bytes is record_overflow.
- 5.3: the per-record nonce is the iv XOR the 64-bit sequence number, one sequence per direction
  and key, starting at 0; the record header is the AEAD's associated data; a sequence number is
  never wrapped (5.3: rekey or terminate): we send a KeyUpdate of our own first.
- 5.4: the inner plaintext is content, then its content type, then zero padding (we send none,
  we strip what the peer sends); an inner plaintext over 2^14 + 1 bytes is record_overflow, one
  of zeros only is unexpected_message.
- 5.5: AES-GCM's limit: at most 2^24.5 full records per key; we send a KeyUpdate before
  RECORDS_PER_KEY of our records.
- 5.1: alerts are exactly one 2-byte message per record; handshake messages are not interleaved
  with other content types, and a KeyUpdate ends its record (4.6.3, 5.1: a key change is on a
  record boundary).
- 6: close_notify is the peer's end of data (data after it is ignored, 6.1); user_canceled, the
  other closure alert (6.1), is not an error: reading goes on to the close_notify that should
  follow it. Every other alert ends the connection with its name in the error (6.2: all others
  are fatal, unknown ones too).
  Our fatal alerts (bad_record_mac, record_overflow, unexpected_message, decode_error,
  illegal_parameter) are sealed for the shell to send before it closes.
- 4.6.1: a NewSessionTicket (server to client only) is checked for its structure and dropped: we
  do no resumption (tls/context.py). 4.6.3: a KeyUpdate rotates the read key; update_requested
  is answered by a KeyUpdate of ours (update_not_requested) before our next record, several
  requests in a row by one answer, and rotates our write key. 4.6.2 (post-handshake
  authentication) is never offered, so a CertificateRequest, like any other post-handshake
  message, is unexpected_message.
- 7.1 / 7.3: traffic keys and ivs by HKDF-Expand-Label from the traffic secret, next secrets by
  "traffic upd". Every output here is at most the hash length, so HKDF-Expand is one HMAC.

Suites: TLS_AES_128_GCM_SHA256 and TLS_AES_256_GCM_SHA384, ztunnel's two (tls/context.py
narrows the handshake to them); the AEAD is `cryptography`'s AESGCM (its OpenSSL's AES-GCM): no
cryptographic primitive here is our own, only the record framing, nonces and key schedule of
RFC 8446 around it.

Bounds on what a peer can make us hold or do: one record (MAX_CIPHERTEXT_BYTES), one
post-handshake message (MAX_POST_HANDSHAKE_MESSAGE_BYTES), post-handshake messages in a row without
application data, and empty application-data records, in a row (MAX_NO_DATA_IN_A_ROW).
"""

from __future__ import annotations

import hmac
import struct
import threading
from collections.abc import Iterable
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ..errors import ProtocolError

# RFC 8446 5.1: at most 2^14 bytes of content per record.
MAX_RECORD_PLAINTEXT_BYTES: Final = 2**14
# RFC 8446 5.4: content + content type + padding.
MAX_INNER_PLAINTEXT_BYTES: Final = 2**14 + 1
# RFC 8446 5.2: the longest encrypted_record any AEAD may produce.
MAX_CIPHERTEXT_BYTES: Final = 2**14 + 256
RECORD_HEADER_BYTES: Final = 5
AEAD_TAG_BYTES: Final = 16
# What one full record of ours takes on the wire: header, content, content type, tag.
RECORD_OVERHEAD_BYTES: Final = RECORD_HEADER_BYTES + 1 + AEAD_TAG_BYTES
MAX_SEALED_RECORD_BYTES: Final = MAX_RECORD_PLAINTEXT_BYTES + RECORD_OVERHEAD_BYTES
# RFC 8446 5.5: AES-GCM keys protect at most 2^24.5 full-size records; ours are rotated before
# 2^24 (about 256 GiB in full records).
RECORDS_PER_KEY: Final = 2**24
# RFC 8446 5.3: a sequence number never wraps.
MAX_SEQUENCE: Final = 2**64 - 1
# The largest post-handshake message we reassemble. A NewSessionTicket (the only big one) holds
# a ticket of up to 2^16 - 1 bytes plus extensions; real ones (BoringSSL's, OpenSSL's) are a few
# hundred bytes to a few KiB. We drop tickets, so this bounds only what a peer can make us hold.
MAX_POST_HANDSHAKE_MESSAGE_BYTES: Final = 64 * 1024
# Post-handshake messages (tickets, KeyUpdates) and empty application-data records accepted in
# a row with no application data between them: each costs us a record's work (a KeyUpdate a key
# schedule too) and gives the protocol nothing, so a peer sending only those is cut off. BoringSSL
# sends 2 tickets, OpenSSL 2 by default; OpenSSL's own record layer allows 32 empty records in a
# row (MAX_EMPTY_RECORDS).
MAX_NO_DATA_IN_A_ROW: Final = 32

# Content types (RFC 8446 5.1, B.1).
CHANGE_CIPHER_SPEC: Final = 20
ALERT: Final = 21
HANDSHAKE: Final = 22
APPLICATION_DATA: Final = 23
# Handshake message types (RFC 8446 4, B.3).
NEW_SESSION_TICKET: Final = 4
KEY_UPDATE: Final = 24
UPDATE_NOT_REQUESTED: Final = 0
UPDATE_REQUESTED: Final = 1
# Alert descriptions (RFC 8446 6). close_notify and user_canceled are the closure alerts (6.1).
CLOSE_NOTIFY: Final = 0
USER_CANCELED: Final = 90
ALERT_NAMES: Final = {
    0: "close_notify",
    10: "unexpected_message",
    20: "bad_record_mac",
    22: "record_overflow",
    40: "handshake_failure",
    42: "bad_certificate",
    43: "unsupported_certificate",
    44: "certificate_revoked",
    45: "certificate_expired",
    46: "certificate_unknown",
    47: "illegal_parameter",
    48: "unknown_ca",
    49: "access_denied",
    50: "decode_error",
    51: "decrypt_error",
    70: "protocol_version",
    71: "insufficient_security",
    80: "internal_error",
    86: "inappropriate_fallback",
    90: "user_canceled",
    109: "missing_extension",
    110: "unsupported_extension",
    112: "unrecognized_name",
    113: "bad_certificate_status_response",
    115: "unknown_psk_identity",
    116: "certificate_required",
    120: "no_application_protocol",
}
_ALERT_CODES: Final = {name: code for code, name in ALERT_NAMES.items()}
_WARNING, _FATAL = 1, 2

# TLS 1.3 suite name (OpenSSL's and IANA's) -> (AES key bytes, hash name, hash bytes).
SUITES: Final = {
    "TLS_AES_128_GCM_SHA256": (16, "sha256", 32),
    "TLS_AES_256_GCM_SHA384": (32, "sha384", 48),
}
IV_BYTES: Final = 12

# What `open_into` stopped at.
NEED_MORE: Final = 0  # the rest of `src` is not a whole record: read more
BUFFER_FULL: Final = 1  # the next record's plaintext does not fit: hand `dst` over, call again
CLOSED: Final = 2  # the peer's close_notify: its data ends here

_HEADER = struct.Struct(">BHH")  # content type, legacy_record_version, length
_MIN_CIPHERTEXT = 1 + AEAD_TAG_BYTES  # a content type and the tag
_MAX_OURS = MAX_INNER_PLAINTEXT_BYTES + AEAD_TAG_BYTES  # AES-GCM's longest valid record
_TLS12 = 0x0303


class TlsRecordError(ProtocolError):
    """The peer broke the record layer's rules: `alert` is what we sent it (RFC 8446 6.2)."""

    def __init__(self, alert: str, message: str) -> None:
        super().__init__(
            f"TLS {alert}: {message}",
            hint="the HBONE peer's TLS stack sent records RFC 8446 forbids; check its version",
        )
        self.alert = alert


class TlsPeerAlert(ProtocolError):
    """The peer ended the connection with a fatal alert (anything but close_notify)."""

    def __init__(self, alert: str, code: int) -> None:
        super().__init__(
            f"TLS peer sent alert {alert} ({code})",
            hint="the peer closed this HBONE connection with an error: see its log",
        )
        self.alert = alert


def hkdf_expand_label(
    secret: bytes | bytearray, label: bytes, context: bytes, length: int, hash_name: str
) -> bytes:
    """RFC 8446 7.1 HKDF-Expand-Label for outputs of at most the hash length (one HMAC block,
    RFC 5869 2.3: T(1) = HMAC(PRK, info | 0x01))."""
    full = b"tls13 " + label
    info = struct.pack(">HB", length, len(full)) + full + bytes((len(context),)) + context
    out = hmac.digest(secret, info + b"\x01", hash_name)
    if length > len(out):
        raise ValueError(f"HKDF-Expand-Label output of {length} bytes needs more than one {hash_name} block")
    return out[:length]


class _Keys:
    """One direction's traffic key state: the AEAD, its iv as an int, the next sequence number and
    the secret the next key comes from."""

    __slots__ = ("aead", "iv", "seq", "secret")

    def __init__(self, secret: bytearray, key_bytes: int, hash_name: str) -> None:
        key = bytearray(hkdf_expand_label(secret, b"key", b"", key_bytes, hash_name))
        self.aead = AESGCM(key)
        _wipe(key)
        self.iv = int.from_bytes(hkdf_expand_label(secret, b"iv", b"", IV_BYTES, hash_name), "big")
        self.seq = 0
        self.secret = secret


def _wipe(buffer: bytearray) -> None:
    buffer[:] = bytes(len(buffer))


# A 1 MiB write (relay.APP_RECEIVE_BUFFER_BYTES with its DATA frame header: 64 records), a
# KeyUpdate and a record waiting in `output`; a longer write gets a buffer of its own.
SEAL_BUFFER_BYTES: Final = 66 * MAX_SEALED_RECORD_BYTES


class _Scratch:
    """The buffers a record layer seals and opens through: a record's inner plaintext (content
    then type) before it is sealed, where a record is opened when the caller's buffer cannot take
    it, and the records of one write. One set per thread that makes record layers: the event
    loop seals and opens one record layer at a time, and the shell sends or copies a write's
    records before its next seal (`RecordLayer.seal`'s contract), so connections on one loop
    share them; a layer made on another thread (another loop) gets a set of its own, so no
    plaintext can cross between threads."""

    __slots__ = ("inner", "opened", "sealed")

    def __init__(self) -> None:
        self.inner = memoryview(bytearray(MAX_INNER_PLAINTEXT_BYTES))
        self.opened = memoryview(bytearray(MAX_INNER_PLAINTEXT_BYTES))
        self.sealed = memoryview(bytearray(SEAL_BUFFER_BYTES))


_SCRATCH = threading.local()


def _scratch() -> _Scratch:
    scratch: _Scratch | None = getattr(_SCRATCH, "buffers", None)
    if scratch is None:
        scratch = _SCRATCH.buffers = _Scratch()
    return scratch


# Writes up to this size are sealed by `seal_write` as one record in a new bytes object.
SMALL_SEAL_BYTES: Final = 2048
_APPLICATION_DATA_TYPE: Final = bytes((APPLICATION_DATA,))
_KEY_UPDATE_NOT_REQUESTED: Final = bytes((KEY_UPDATE, 0, 0, 1, UPDATE_NOT_REQUESTED))
_KEY_UPDATE_REQUESTED: Final = bytes((KEY_UPDATE, 0, 0, 1, UPDATE_REQUESTED))


class KeyUpdates:
    """How often new record layers change keys on their own, process-wide. The defaults are RFC
    8446 5.5's AES-GCM limit and a KeyUpdate that asks nothing of the peer. Interop tests lower
    the limit and ask for the peer's KeyUpdate too (update_requested, which every TLS 1.3 peer
    must answer, 4.6.3), so that real peers (Envoy's BoringSSL, Node's OpenSSL) change keys both
    ways inside one transfer; `start_tls` (tls/transport.py) reads both when it makes a layer."""

    records_per_key: int = RECORDS_PER_KEY
    request_peer_update: bool = False


KEY_UPDATE_RECORD_BYTES: Final = RECORD_HEADER_BYTES + len(_KEY_UPDATE_NOT_REQUESTED) + 1 + AEAD_TAG_BYTES


class RecordLayer:
    """The record protection of one TLS 1.3 connection after its handshake.

    `open_into` decrypts records from the peer into a caller's buffer and handles what is not
    application data; `seal` turns our application data into records. Records this core must
    send on its own (a KeyUpdate answer, a fatal alert) wait in `output`, and `seal` puts them in
    front of the next data, so records always leave in the order of their sequence numbers."""

    __slots__ = (
        "suite",
        "client_side",
        "_key_bytes",
        "_hash_name",
        "_hash_bytes",
        "_read",
        "_write",
        "records_per_key",
        "request_peer_update",
        "output",
        "_answer_due",
        "_handshake",
        "_in_a_row",
        "_rest",
        "read_closed",
        "write_closed",
        "failed",
        "_scratch",
    )

    def __init__(
        self,
        suite: str,
        *,
        client_side: bool,
        read_secret: bytes | bytearray,
        write_secret: bytes | bytearray,
        records_per_key: int = RECORDS_PER_KEY,
        write_sequence: int = 0,
        request_peer_update: bool = False,
    ) -> None:
        try:
            key_bytes, hash_name, hash_bytes = SUITES[suite]
        except KeyError:
            raise ProtocolError(
                f"TLS 1.3 suite {suite!r} is not one HBONE's record layer has",
                hint=f"the handshake must negotiate one of {', '.join(SUITES)} (tls/context.py)",
            ) from None
        if len(read_secret) != hash_bytes or len(write_secret) != hash_bytes:
            raise ValueError(f"{suite} traffic secrets are {hash_bytes} bytes")
        if not 1 < records_per_key <= RECORDS_PER_KEY:
            raise ValueError(f"records_per_key must be in 2..{RECORDS_PER_KEY}")
        self.suite = suite
        self.client_side = client_side
        self._key_bytes, self._hash_name, self._hash_bytes = key_bytes, hash_name, hash_bytes
        self._read = _Keys(bytearray(read_secret), key_bytes, hash_name)
        self._write = _Keys(bytearray(write_secret), key_bytes, hash_name)
        # Records OpenSSL sealed under our first write key before we took over (a server's
        # NewSessionTickets, tls/handshake.py): our sequence numbers continue after them.
        if not 0 <= write_sequence <= records_per_key - 2:
            raise ValueError(f"write_sequence {write_sequence} is out of range")
        self._write.seq = write_sequence
        self.records_per_key = records_per_key
        self.request_peer_update = request_peer_update  # our own KeyUpdates: update_requested
        self.output = bytearray()  # sealed records waiting to be sent (see the class docstring)
        self._answer_due = False  # a KeyUpdate(update_requested) waits for our KeyUpdate
        self._handshake = bytearray()  # a post-handshake message not yet whole
        self._in_a_row = 0  # post-handshake messages and empty records since the last data
        self._rest: memoryview | None = None  # plaintext a too-short buffer could not take
        self.read_closed = False  # the peer's close_notify was read
        self.write_closed = False  # our close_notify or fatal alert was sealed
        self.failed = False  # a fatal alert went either way: nothing more is opened or sealed
        self._scratch = _scratch()  # this thread's (use a layer on the thread that made it)

    def __repr__(self) -> str:
        side = "client" if self.client_side else "server"
        return (
            f"RecordLayer({side}, {self.suite}, read seq {self._read.seq}, write seq {self._write.seq}"
            f"{', read closed' if self.read_closed else ''}{', write closed' if self.write_closed else ''})"
        )

    # Receiving ---------------------------------------------------------------------------------
    def open_into(self, src: memoryview, end: int, dst: memoryview, filled: int) -> tuple[int, int, int]:
        """Open the whole records in `src[:end]` into `dst` from `filled` on, as long as each
        record's plaintext fits; returns (bytes of `src` used, `dst` filled up to, why it stopped:
        NEED_MORE, BUFFER_FULL or CLOSED). Raises TlsRecordError (its fatal alert then waits in
        `output`) or TlsPeerAlert; after either, nothing more is opened."""
        if self.failed:
            raise ProtocolError("TLS record layer already failed: no more records are opened")
        if self.read_closed:
            return end, filled, CLOSED  # RFC 8446 6.1: data after close_notify is ignored
        rest = self._rest
        if rest is not None:
            filled = self._give_rest(rest, dst, filled)
            if self._rest is not None:
                return 0, filled, BUFFER_FULL
        # The per-record path runs once per record received (about 65,000 per GiB): the read
        # key's state is kept in locals and written back at the end or before a control record.
        keys = self._read
        decrypt, iv, seq = keys.aead.decrypt_into, keys.iv, keys.seq
        handshake = self._handshake  # the same bytearray throughout: truthy while a message is partial
        unpack = _HEADER.unpack_from
        room = len(dst)
        pos = 0
        status = NEED_MORE
        while end - pos >= RECORD_HEADER_BYTES:
            outer, version, length = unpack(src, pos)
            if outer != APPLICATION_DATA or version != _TLS12 or not _MIN_CIPHERTEXT <= length <= _MAX_OURS:
                self._bad_header(outer, version, length)
            body = pos + RECORD_HEADER_BYTES
            stop = body + length
            if stop > end:
                break
            inner = length - AEAD_TAG_BYTES
            if inner > room - filled:
                if filled and inner - 1 > room - filled:
                    status = BUFFER_FULL
                    break
                # Room for the content but not its content type byte (a full record at the
                # end of a buffer of 2^14 multiples), or a buffer shorter than one record:
                # open into the scratch and hand out what fits.
                target = self._scratch.opened
                start = 0
            else:
                target = dst
                start = filled
            if seq == MAX_SEQUENCE:
                raise self._fail(
                    "unexpected_message", "the peer's record sequence number would wrap (RFC 8446 5.3)"
                )
            try:
                decrypt(
                    (iv ^ seq).to_bytes(IV_BYTES, "big"),
                    src[body:stop],
                    src[pos:body],
                    target[start : start + inner],
                )
            except InvalidTag:
                raise self._fail("bad_record_mac", "a record failed authentication") from None
            seq += 1
            pos = stop
            kind = target[start + inner - 1]
            if kind == APPLICATION_DATA and not handshake:
                n = inner - 1
            else:
                n, kind = self._unpad(target, start, inner)
                if kind != APPLICATION_DATA or handshake:
                    keys.seq = seq
                    closed = self._control(kind, target[start : start + n])
                    keys = self._read  # a KeyUpdate replaced it
                    decrypt, iv, seq = keys.aead.decrypt_into, keys.iv, keys.seq
                    if closed:
                        status = CLOSED
                        break
                    continue
            if n:
                if self._in_a_row:
                    self._in_a_row = 0
            else:  # an empty application-data record (RFC 8446 5.4 allows them): bounded
                self._in_a_row += 1
                if self._in_a_row > MAX_NO_DATA_IN_A_ROW:
                    keys.seq = seq
                    raise self._fail(
                        "unexpected_message",
                        f"more than {MAX_NO_DATA_IN_A_ROW} records in a row without application data",
                    )
            if target is dst:
                filled += n
            else:
                filled = self._give_rest(target[:n], dst, filled)
                if self._rest is not None:
                    status = BUFFER_FULL
                    break
        # Every exit but an exception comes here (after one, nothing more is opened or answered).
        keys.seq = seq
        if self._answer_due:
            self._answer_key_update()
        return pos, filled, status

    def _give_rest(self, rest: memoryview, dst: memoryview, filled: int) -> int:
        take = min(len(rest), len(dst) - filled)
        dst[filled : filled + take] = rest[:take]
        # What is left is copied out of the process-wide scratch, which the next open reuses.
        self._rest = memoryview(bytes(rest[take:])) if take < len(rest) else None
        return filled + take

    def _bad_header(self, outer: int, version: int, length: int) -> None:
        if outer != APPLICATION_DATA:
            # RFC 8446 5.1 / 5.2: after the handshake every record is protected; a plaintext
            # change_cipher_spec is allowed only before the peer's Finished (5, D.4).
            raise self._fail(
                "unexpected_message", f"an unprotected record (content type {outer}) after the handshake"
            )
        if version != _TLS12:
            raise self._fail("decode_error", f"record version {version:#06x}, not 0x0303 (RFC 8446 5.2)")
        if length > MAX_CIPHERTEXT_BYTES:
            raise self._fail(
                "record_overflow",
                f"a record of {length} bytes (at most {MAX_CIPHERTEXT_BYTES}, RFC 8446 5.2)",
            )
        if length > _MAX_OURS:
            raise self._fail(
                "record_overflow",
                f"a record of {length} bytes holds more than {MAX_INNER_PLAINTEXT_BYTES} bytes of plaintext (RFC 8446 5.4)",
            )
        raise self._fail("decode_error", f"a record of {length} bytes holds no content type")

    def _unpad(self, target: memoryview, start: int, inner: int) -> tuple[int, int]:
        """RFC 8446 5.4: the content type is the last non-zero byte; (content length, type). The
        zeros are stripped in C (one copy of the record): a loop over them in Python would let a
        peer make us spend about a millisecond per 16 KiB record of padding."""
        stripped = bytes(target[start : start + inner]).rstrip(b"\x00")
        if not stripped:
            raise self._fail("unexpected_message", "a record's plaintext is all padding (no content type)")
        return len(stripped) - 1, stripped[-1]

    def _control(self, kind: int, content: memoryview) -> bool:
        """A record that is not plain application data; True when it was the peer's close_notify."""
        if kind == HANDSHAKE:
            if not content:
                raise self._fail("unexpected_message", "a zero-length handshake fragment (RFC 8446 5.1)")
            self._on_handshake(content)
            return False
        if self._handshake:
            raise self._fail(
                "unexpected_message",
                "a handshake message interleaved with another content type (RFC 8446 5.1)",
            )
        if kind == ALERT:
            if len(content) != 2:
                raise self._fail(
                    "decode_error",
                    f"an alert record of {len(content)} bytes, not one 2-byte alert (RFC 8446 5.1)",
                )
            code = content[1]
            name = ALERT_NAMES.get(code, f"unknown alert {code}")
            if code == CLOSE_NOTIFY:
                self.read_closed = True
                return True
            if code == USER_CANCELED:
                # RFC 8446 6.1: a closure alert, not an error; its close_notify should follow.
                # It counts as a record without data, so a peer cannot send them forever.
                self._in_a_row += 1
                if self._in_a_row > MAX_NO_DATA_IN_A_ROW:
                    raise self._fail(
                        "unexpected_message", f"more than {MAX_NO_DATA_IN_A_ROW} user_canceled in a row"
                    )
                return False
            self.failed = True
            raise TlsPeerAlert(name, code)
        if kind == APPLICATION_DATA:  # only here with a message pending, refused above
            return False
        raise self._fail("unexpected_message", f"a protected record of content type {kind}")

    def _on_handshake(self, fragment: memoryview) -> None:
        pending = self._handshake
        if len(pending) + len(fragment) > 4 + MAX_POST_HANDSHAKE_MESSAGE_BYTES and len(pending) >= 4:
            raise self._fail("illegal_parameter", "a post-handshake message beyond its bound")
        pending += fragment
        while len(pending) >= 4:
            kind = pending[0]
            length = int.from_bytes(pending[1:4], "big")
            if length > MAX_POST_HANDSHAKE_MESSAGE_BYTES:
                raise self._fail(
                    "illegal_parameter",
                    f"a post-handshake message of {length} bytes (at most {MAX_POST_HANDSHAKE_MESSAGE_BYTES})",
                )
            if len(pending) < 4 + length:
                return
            body = bytes(pending[4 : 4 + length])
            del pending[: 4 + length]
            self._in_a_row += 1
            if self._in_a_row > MAX_NO_DATA_IN_A_ROW:
                raise self._fail(
                    "unexpected_message",
                    f"more than {MAX_NO_DATA_IN_A_ROW} records in a row without application data (post-handshake messages)",
                )
            if kind == KEY_UPDATE:
                self._on_key_update(body, more=bool(pending))
            elif kind == NEW_SESSION_TICKET and self.client_side:
                _check_ticket(self, body)
            else:
                raise self._fail("unexpected_message", f"post-handshake message type {kind} (RFC 8446 4.6)")

    def _on_key_update(self, body: bytes, *, more: bool) -> None:
        if len(body) != 1:
            raise self._fail("decode_error", f"a KeyUpdate of {len(body)} bytes (RFC 8446 4.6.3)")
        if body[0] not in (UPDATE_NOT_REQUESTED, UPDATE_REQUESTED):
            raise self._fail("illegal_parameter", f"KeyUpdate request_update {body[0]} (RFC 8446 4.6.3)")
        if more:
            raise self._fail("unexpected_message", "a KeyUpdate not at the end of its record (RFC 8446 5.1)")
        self._read = self._next_keys(self._read)
        if body[0] == UPDATE_REQUESTED:
            self._answer_due = True

    def _next_keys(self, keys: _Keys) -> _Keys:
        """RFC 8446 7.2: application_traffic_secret_N+1 = HKDF-Expand-Label(N, "traffic upd", "", Hash.length)."""
        secret = bytearray(
            hkdf_expand_label(keys.secret, b"traffic upd", b"", self._hash_bytes, self._hash_name)
        )
        _wipe(keys.secret)
        return _Keys(secret, self._key_bytes, self._hash_name)

    def _fail(self, alert: str, message: str) -> TlsRecordError:
        """Seal our fatal alert (RFC 8446 6.2) into `output`; the error to raise."""
        if not self.write_closed and not self.failed:
            self.output += self._seal_control(ALERT, bytes((_FATAL, _ALERT_CODES[alert])))
            self.write_closed = True
        self.failed = True
        return TlsRecordError(alert, message)

    # Sending -----------------------------------------------------------------------------------
    def seal_write(self, data: bytes | bytearray | memoryview) -> bytes | memoryview:
        """`seal` of one write; a short one (at most SMALL_SEAL_BYTES) as a new bytes object:
        one record, built with the AEAD's allocating `encrypt`, which for a few bytes costs less
        than filling the shared buffer (a 1-byte message: about 4 -> 2 µs). `seal` itself for
        longer writes, when a KeyUpdate is due or records wait in `output`."""
        keys = self._write
        seq = keys.seq
        if (
            seq >= self.records_per_key - 1
            or self.output
            or self.write_closed
            or len(data) > SMALL_SEAL_BYTES
        ):
            return self.seal(data)
        header = _HEADER.pack(APPLICATION_DATA, _TLS12, len(data) + 1 + AEAD_TAG_BYTES)
        keys.seq = seq + 1
        inner = (
            data + _APPLICATION_DATA_TYPE
            if type(data) is not memoryview
            else bytes(data) + _APPLICATION_DATA_TYPE
        )
        return header + keys.aead.encrypt((keys.iv ^ seq).to_bytes(IV_BYTES, "big"), inner, header)

    def _start_seal(self, n: int, records: int) -> tuple[memoryview, int, int]:
        """The buffer for `records` records of `n` bytes with `output` already in front: (buffer,
        where the records start, the last sequence number a data record may take)."""
        if self.write_closed:
            raise ProtocolError("TLS write side already closed (close_notify or alert sent)")
        last = self.records_per_key - 1  # the sequence number kept for a KeyUpdate or an alert
        output = self.output
        need = (
            len(output)
            + n
            + records * RECORD_OVERHEAD_BYTES
            + (records // last + 1) * KEY_UPDATE_RECORD_BYTES
        )
        out = self._scratch.sealed if need <= SEAL_BUFFER_BYTES else memoryview(bytearray(need))
        o = len(output)
        if o:
            out[:o] = output
            output.clear()
        return out, o, last

    def seal(self, data: bytes | bytearray | memoryview) -> memoryview:
        """Our application data as records (each at most MAX_RECORD_PLAINTEXT_BYTES of it), with
        `output` in front, and a KeyUpdate of ours wherever the write key reaches
        `records_per_key` (RFC 8446 5.5). The view is valid until the next `seal` in this
        process: send it or copy it first."""
        view = data if type(data) is memoryview else memoryview(data)
        return self._seal_chunks(
            [
                view[at : at + MAX_RECORD_PLAINTEXT_BYTES]
                for at in range(0, len(view), MAX_RECORD_PLAINTEXT_BYTES)
            ],
            len(view),
        )

    def seal_pieces(self, pieces: Iterable[bytes | bytearray | memoryview]) -> memoryview:
        """`seal` of the pieces joined, without joining them: a record's content is a slice of one
        piece where it can be, and only the records across a piece boundary (a DATA frame's
        header and the start of its payload) are joined, so only the last record is short."""
        chunks: list[bytes | bytearray | memoryview] = []
        carry: bytearray | None = None  # the start of a record across a piece boundary
        n = 0
        for piece in pieces:
            view = piece if type(piece) is memoryview else memoryview(piece)
            size = view.nbytes
            if not size:
                continue
            n += size
            at = 0
            if carry is not None:
                at = min(MAX_RECORD_PLAINTEXT_BYTES - len(carry), size)
                carry += view[:at]
                if len(carry) < MAX_RECORD_PLAINTEXT_BYTES:
                    continue
                chunks.append(carry)
                carry = None
            while size - at >= MAX_RECORD_PLAINTEXT_BYTES:
                chunks.append(view[at : at + MAX_RECORD_PLAINTEXT_BYTES])
                at += MAX_RECORD_PLAINTEXT_BYTES
            if at < size:
                carry = bytearray(view[at:])
        if carry is not None:
            chunks.append(carry)
        return self._seal_chunks(chunks, n)

    def _seal_chunks(self, chunks: list[bytes | bytearray | memoryview], n: int) -> memoryview:
        """Each chunk (at most MAX_RECORD_PLAINTEXT_BYTES, `n` bytes in all) as one record, into the
        shared buffer after `output`. This loop runs once per record sent (about 65,000 per GiB)."""
        out, o, last = self._start_seal(n, len(chunks))
        inner = self._scratch.inner
        pack = _HEADER.pack_into
        keys = self._write
        seal = keys.aead.encrypt_into
        iv, seq = keys.iv, keys.seq
        for chunk in chunks:
            if seq >= last:
                keys.seq = seq
                record = self._key_update(requested=self.request_peer_update)
                out[o : o + len(record)] = record
                o += len(record)
                keys = self._write
                seal = keys.aead.encrypt_into
                iv, seq = keys.iv, keys.seq
            k = len(chunk)
            inner[:k] = chunk
            inner[k] = APPLICATION_DATA
            length = k + 1 + AEAD_TAG_BYTES
            pack(out, o, APPLICATION_DATA, _TLS12, length)
            body = o + RECORD_HEADER_BYTES
            seal((iv ^ seq).to_bytes(IV_BYTES, "big"), inner[: k + 1], out[o:body], out[body : body + length])
            seq += 1
            o = body + length
        keys.seq = seq
        return out[:o]

    def _key_update(self, *, requested: bool = False) -> bytes:
        """Our KeyUpdate, sealed under the current write key, which it then replaces (RFC 8446
        4.6.3): update_not_requested, unless `requested` (only ever at our own limit, never in
        answer to the peer's, so two of us cannot make each other update forever)."""
        message = _KEY_UPDATE_REQUESTED if requested else _KEY_UPDATE_NOT_REQUESTED
        record = self._seal_control(HANDSHAKE, message)
        self._write = self._next_keys(self._write)
        return record

    def _answer_key_update(self) -> None:
        """RFC 8446 4.6.3: our KeyUpdate (update_not_requested) before our next record; several
        requests read together get one answer."""
        self._answer_due = False
        if not self.write_closed:
            self.output += self._key_update()

    def _seal_control(self, kind: int, content: bytes) -> bytes:
        keys = self._write
        if keys.seq >= self.records_per_key:  # seal keeps the last sequence number for this
            raise ValueError("TLS control record past records_per_key")
        length = len(content) + 1 + AEAD_TAG_BYTES
        header = _HEADER.pack(APPLICATION_DATA, _TLS12, length)
        sealed = keys.aead.encrypt(
            (keys.iv ^ keys.seq).to_bytes(IV_BYTES, "big"), content + bytes((kind,)), header
        )
        keys.seq += 1
        return header + sealed

    def take_output(self) -> bytes:
        """The records this core sealed on its own (KeyUpdate answers, alerts), to send now."""
        out = bytes(self.output)
        self.output.clear()
        return out

    def close_notify(self) -> bytes:
        """Our close_notify (RFC 8446 6.1) after whatever waits in `output`; nothing is sealed
        after it."""
        if self.write_closed:
            return self.take_output()
        self.output += self._seal_control(ALERT, bytes((_WARNING, 0)))
        self.write_closed = True
        return self.take_output()

    def wipe(self) -> None:
        """Zero the traffic secrets we hold (the AEAD contexts are freed with this object)."""
        _wipe(self._read.secret)
        _wipe(self._write.secret)
        self.failed = True
        self.write_closed = True


def _check_ticket(layer: RecordLayer, body: bytes) -> None:
    """RFC 8446 4.6.1 NewSessionTicket: lifetime, age_add, nonce<0..255>, ticket<1..2^16-1>,
    extensions<0..2^16-2>; checked for its structure and dropped (we do no resumption)."""
    try:
        at = 8
        nonce = body[at]
        at += 1 + nonce
        ticket = int.from_bytes(body[at : at + 2], "big")
        if ticket < 1 or len(body) < at + 2:
            raise IndexError
        at += 2 + ticket
        extensions = int.from_bytes(body[at : at + 2], "big")
        if len(body) < at + 2:
            raise IndexError
        at += 2 + extensions
        if at != len(body):
            raise IndexError
    except IndexError:
        raise layer._fail("decode_error", "a malformed NewSessionTicket (RFC 8446 4.6.1)") from None


def alert_name(code: int) -> str:
    return ALERT_NAMES.get(code, f"unknown alert {code}")
