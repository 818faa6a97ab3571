"""HBONE's TLS 1.3 record layer core (tls/records.py) without sockets: two cores talking,
and a peer that breaks each rule of RFC 8446 the core implements (one test per rule)."""

from __future__ import annotations

import os
import struct

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import given, settings
from hypothesis import strategies as st

from ambient_mesh.errors import ProtocolError
from ambient_mesh.tls import records as tr
from ambient_mesh.tls.records import (
    BUFFER_FULL,
    CLOSED,
    NEED_MORE,
    RecordLayer,
    TlsPeerAlert,
    TlsRecordError,
    hkdf_expand_label,
)

SUITES = list(tr.SUITES)


def pair(suite: str = "TLS_AES_128_GCM_SHA256", **kwargs) -> tuple[RecordLayer, RecordLayer]:
    """(client, server) cores sharing fresh traffic secrets."""
    size = tr.SUITES[suite][2]
    c_secret, s_secret = os.urandom(size), os.urandom(size)
    client = RecordLayer(suite, client_side=True, read_secret=s_secret, write_secret=c_secret, **kwargs)
    server = RecordLayer(suite, client_side=False, read_secret=c_secret, write_secret=s_secret, **kwargs)
    return client, server


def open_all(layer: RecordLayer, wire: bytes, buffer_bytes: int = 64 * 1024) -> tuple[bytes, int, int]:
    """Everything `wire` opens to, through buffers of `buffer_bytes`; (plaintext, bytes of wire
    used, last status)."""
    out = bytearray()
    src = memoryview(bytearray(wire))
    used = 0
    while True:
        dst = memoryview(bytearray(buffer_bytes))
        pos, filled, status = layer.open_into(src[used:], len(wire) - used, dst, 0)
        used += pos
        out += dst[:filled]
        if status != BUFFER_FULL:
            return bytes(out), used, status


class Peer:
    """A hand-rolled TLS 1.3 sender with the core's secrets, for records the core never makes."""

    def __init__(self, suite: str, secret: bytes) -> None:
        key_bytes, hash_name, _ = tr.SUITES[suite]
        self.suite, self.secret, self.hash_name, self.key_bytes = suite, secret, hash_name, key_bytes
        self._keys()

    def _keys(self) -> None:
        self.aead = AESGCM(hkdf_expand_label(self.secret, b"key", b"", self.key_bytes, self.hash_name))
        self.iv = int.from_bytes(hkdf_expand_label(self.secret, b"iv", b"", 12, self.hash_name), "big")
        self.seq = 0

    def rotate(self) -> None:
        self.secret = hkdf_expand_label(self.secret, b"traffic upd", b"", len(self.secret), self.hash_name)
        self._keys()

    def record(
        self,
        content: bytes,
        kind: int = tr.APPLICATION_DATA,
        padding: int = 0,
        *,
        outer: int = 23,
        version: int = 0x0303,
    ) -> bytes:
        inner = content + bytes((kind,)) + bytes(padding)
        header = struct.pack(">BHH", outer, version, len(inner) + 16)
        nonce = (self.iv ^ self.seq).to_bytes(12, "big")
        self.seq += 1
        return header + self.aead.encrypt(nonce, inner, header)

    def key_update(self, requested: bool) -> bytes:
        record = self.record(bytes((24, 0, 0, 1, int(requested))), tr.HANDSHAKE)
        self.rotate()
        return record


def peer_of(layer_secret_side: str, suite: str = "TLS_AES_128_GCM_SHA256") -> tuple[RecordLayer, Peer, bytes]:
    """A client core and a Peer sending as its server; (core, peer, the core's write secret)."""
    size = tr.SUITES[suite][2]
    c_secret, s_secret = os.urandom(size), os.urandom(size)
    client = RecordLayer(
        suite, client_side=layer_secret_side == "client", read_secret=s_secret, write_secret=c_secret
    )
    return client, Peer(suite, s_secret), c_secret


def alert_sent(layer: RecordLayer, read_secret: bytes, suite: str = "TLS_AES_128_GCM_SHA256") -> str:
    """The alert the core sealed into its output, opened with its write secret."""
    other = RecordLayer(
        suite,
        client_side=not layer.client_side,
        read_secret=read_secret,
        write_secret=os.urandom(tr.SUITES[suite][2]),
    )
    with pytest.raises(TlsPeerAlert) as err:
        open_all(other, layer.take_output())
    return err.value.alert


# Key schedule ------------------------------------------------------------------------------------
# RFC 8448 section 3 (the simple 1-RTT handshake, TLS_AES_128_GCM_SHA256): the two application
# traffic secrets, the keys and ivs derived from them, and the first application-data record
# each side sends (50 bytes 00..31; the client's at sequence 0, the server's at 1, after its
# NewSessionTicket). Values from the RFC, which independent implementations test against too.
RFC8448_C_AP = bytes.fromhex("9e40646ce79a7f9dc05af8889bce6552875afa0b06df0087f792ebb7c17504a5")
RFC8448_S_AP = bytes.fromhex("a11af9f05531f856ad47116b45a950328204b4f44bfb6b3a4b4f1f3fcb631643")
RFC8448_APP_DATA = bytes(range(0x32))
RFC8448_CLIENT_RECORD = bytes.fromhex(
    "1703030043a23f7054b62c94d0affafe8228ba55cbefacea42f914aa66bcab3f2b9819a8a5b46b395bd54a9a"
    "20441e2b62974e1f5a6292a2977014bd1e3deae63aeebb21694915e4"
)
RFC8448_SERVER_RECORD = bytes.fromhex(
    "17030300432e937e11ef4ac740e538ad36005fc4a46932fc3225d05f82aa1b36e30efaf97d90e6dffc602dcb"
    "501a59a8fcc49c4bf2e5f0a21c0047c2abf332540dd032e167c2955d"
)


def test_rfc8448_application_keys_and_ivs():
    for secret, key, iv in (
        (RFC8448_C_AP, "17422dda596ed5d9acd890e3c63f5051", "5b78923dee08579033e523d9"),
        (RFC8448_S_AP, "9f02283b6c9c07efc26bb9f2ac92e356", "cf782b88dd83549aadf1e984"),
    ):
        assert hkdf_expand_label(secret, b"key", b"", 16, "sha256") == bytes.fromhex(key)
        assert hkdf_expand_label(secret, b"iv", b"", 12, "sha256") == bytes.fromhex(iv)


def test_rfc8448_records_are_sealed_and_opened_byte_for_byte():
    suite = "TLS_AES_128_GCM_SHA256"
    client = RecordLayer(suite, client_side=True, read_secret=RFC8448_S_AP, write_secret=RFC8448_C_AP)
    server = RecordLayer(suite, client_side=False, read_secret=RFC8448_C_AP, write_secret=RFC8448_S_AP)
    # The client's first record, both seal paths (the short write's and the general one).
    assert bytes(client.seal_write(RFC8448_APP_DATA)) == RFC8448_CLIENT_RECORD
    assert open_all(server, RFC8448_CLIENT_RECORD)[0] == RFC8448_APP_DATA
    again = RecordLayer(suite, client_side=True, read_secret=RFC8448_S_AP, write_secret=RFC8448_C_AP)
    assert bytes(again.seal(RFC8448_APP_DATA)) == RFC8448_CLIENT_RECORD
    # The server's, at sequence 1: its sequence 0 went to a record of ours first.
    open_all(client, server.seal_write(b"ticket's place"))
    assert bytes(server.seal_write(RFC8448_APP_DATA)) == RFC8448_SERVER_RECORD
    assert open_all(client, RFC8448_SERVER_RECORD)[0] == RFC8448_APP_DATA


def test_hkdf_expand_label_is_one_hmac_over_the_hkdf_label():
    # RFC 8446 7.1: HkdfLabel = uint16 length, opaque label<7..255> ("tls13 " + label), opaque
    # context<0..255>; RFC 5869: T(1) = HMAC(PRK, info | 0x01).
    import hmac

    secret = bytes(range(32))
    info = b"\x00\x10" + b"\x09tls13 key" + b"\x00"
    assert (
        hkdf_expand_label(secret, b"key", b"", 16, "sha256")
        == hmac.digest(secret, info + b"\x01", "sha256")[:16]
    )
    with pytest.raises(ValueError):
        hkdf_expand_label(secret, b"key", b"", 33, "sha256")


def test_an_unknown_suite_and_wrong_secret_sizes_are_refused():
    with pytest.raises(ProtocolError, match="CHACHA20"):
        RecordLayer(
            "TLS_CHACHA20_POLY1305_SHA256", client_side=True, read_secret=bytes(32), write_secret=bytes(32)
        )
    with pytest.raises(ValueError):
        RecordLayer("TLS_AES_256_GCM_SHA384", client_side=True, read_secret=bytes(32), write_secret=bytes(32))


# Two cores -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("size", [0, 1, 100, 2**14 - 1, 2**14, 2**14 + 1, 256 * 1024 - 9, 300_000, 1_000_000])
def test_records_carry_every_size_both_ways(suite, size):
    client, server = pair(suite)
    data = os.urandom(size)
    wire = bytes(client.seal(data))
    assert len(wire) == size + -(-size // 2**14) * tr.RECORD_OVERHEAD_BYTES
    got, used, status = open_all(server, wire)
    assert (got, used, status) == (data, len(wire), NEED_MORE)
    back = bytes(server.seal(data[::-1]))
    assert open_all(client, back)[0] == data[::-1]


def test_each_record_holds_at_most_2_14_bytes_and_its_nonce_is_iv_xor_sequence():
    # RFC 8446 5.1 (2^14 per record) and 5.3 (nonce = iv XOR the padded sequence number).
    client, server = pair()
    secret = client._write.secret
    key = hkdf_expand_label(secret, b"key", b"", 16, "sha256")
    iv = int.from_bytes(hkdf_expand_label(secret, b"iv", b"", 12, "sha256"), "big")
    wire = bytes(client.seal(bytes(2**14 * 2 + 5)))
    at, seq = 0, 0
    while at < len(wire):
        kind, version, length = struct.unpack_from(">BHH", wire, at)
        assert (kind, version) == (23, 0x0303) and length <= 2**14 + 17
        plain = AESGCM(key).decrypt(
            (iv ^ seq).to_bytes(12, "big"), wire[at + 5 : at + 5 + length], wire[at : at + 5]
        )
        assert plain[-1] == 23
        at += 5 + length
        seq += 1
    assert seq == 3


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40_000), min_size=1, max_size=6),
    cuts=st.lists(st.integers(1, 50_000), min_size=1, max_size=20),
    buffer_bytes=st.sampled_from([1, 7, 2**14, 2**14 + 1, 64 * 1024]),
)
def test_any_split_of_the_stream_and_any_buffer_size_give_the_same_bytes(sizes, cuts, buffer_bytes):
    client, server = pair()
    data = [os.urandom(n) for n in sizes]
    wire = b"".join(bytes(client.seal(d)) for d in data)
    held = bytearray()
    out = bytearray()
    at = 0
    for cut in [*cuts, len(wire)]:
        held += wire[at : at + cut]
        at += cut
        while True:
            src = memoryview(bytes(held))
            dst = memoryview(bytearray(buffer_bytes))
            pos, filled, status = server.open_into(src, len(src), dst, 0)
            out += dst[:filled]
            del held[:pos]
            assert status in (NEED_MORE, BUFFER_FULL)
            if status == NEED_MORE:
                break
        if at >= len(wire):
            break
    assert bytes(out) == b"".join(data) and not held


def test_a_buffer_with_room_left_is_handed_over_before_a_record_that_does_not_fit():
    client, server = pair()
    wire = bytes(client.seal(b"a" * 10)) + bytes(client.seal(b"b" * 2**14))
    src = memoryview(wire)
    dst = memoryview(bytearray(2**14))
    pos, filled, status = server.open_into(src, len(wire), dst, 0)
    assert (filled, status) == (10, BUFFER_FULL) and pos == 10 + 22
    pos2, filled2, status2 = server.open_into(src[pos:], len(wire) - pos, memoryview(bytearray(2**14 + 1)), 0)
    assert (filled2, status2, pos + pos2) == (2**14, NEED_MORE, len(wire))


# Receiving: the rules ----------------------------------------------------------------------------
def test_a_tampered_record_is_bad_record_mac_and_the_alert_is_sealed():
    # RFC 8446 5.2: a record that fails deprotection ends the connection with bad_record_mac.
    client, server = pair()
    wire = bytearray(client.seal(b"hello"))
    wire[8] ^= 1
    with pytest.raises(TlsRecordError) as err:
        open_all(server, bytes(wire))
    assert err.value.alert == "bad_record_mac" and "bad_record_mac" in str(err.value)
    assert alert_sent(server, server_write_secret(server)) == "bad_record_mac"
    with pytest.raises(ProtocolError):
        open_all(server, bytes(client.seal(b"more")))  # nothing is opened after a failure


def server_write_secret(layer: RecordLayer) -> bytes:
    return bytes(layer._write.secret)


def test_a_tampered_header_fails_authentication_too():
    # The record header is the AEAD's associated data (RFC 8446 5.2).
    client, server = pair()
    wire = bytearray(client.seal(b"x" * 100))
    struct.pack_into(">H", wire, 3, 100 + 17 - 1)  # claim one byte less
    with pytest.raises(TlsRecordError, match="bad_record_mac"):
        open_all(server, bytes(wire))


def test_replayed_or_reordered_records_fail():
    # RFC 8446 5.3: each record's nonce has its own sequence number.
    client, server = pair()
    first, second = bytes(client.seal(b"1")), bytes(client.seal(b"2"))
    with pytest.raises(TlsRecordError, match="bad_record_mac"):
        open_all(server, second + first)
    client, server = pair()
    first = bytes(client.seal(b"1"))
    with pytest.raises(TlsRecordError, match="bad_record_mac"):
        open_all(server, first + first)


@pytest.mark.parametrize("length", [2**14 + 256 + 1, 2**16 - 1])
def test_a_record_over_2_14_plus_256_is_record_overflow_before_it_is_read(length):
    # RFC 8446 5.2; the header alone decides, so no such record is ever buffered.
    _, server = pair()
    with pytest.raises(TlsRecordError, match="record_overflow"):
        open_all(server, struct.pack(">BHH", 23, 0x0303, length))


def test_an_inner_plaintext_over_2_14_plus_1_is_record_overflow():
    # RFC 8446 5.4: content + type + padding at most 2^14 + 1 bytes.
    core, peer, _ = peer_of("client")
    with pytest.raises(TlsRecordError, match="record_overflow"):
        open_all(core, peer.record(bytes(2**14), padding=1))
    core, peer, _ = peer_of("client")
    got, _, _ = open_all(core, peer.record(bytes(2**14 - 10), padding=10))
    assert len(got) == 2**14 - 10


@pytest.mark.parametrize("outer", [20, 21, 22, 24, 0, 255])
def test_an_unprotected_record_after_the_handshake_is_unexpected_message(outer):
    # RFC 8446 5 / D.4: change_cipher_spec only before the peer's Finished; every record after
    # the handshake is application_data on the outside.
    _, server = pair()
    with pytest.raises(TlsRecordError, match="unexpected_message"):
        open_all(server, struct.pack(">BHH", outer, 0x0303, 1) + b"\x01")


def test_a_record_version_other_than_0x0303_is_decode_error():
    core, peer, _ = peer_of("client")
    with pytest.raises(TlsRecordError, match="decode_error"):
        open_all(core, peer.record(b"x", version=0x0301))


def test_a_record_too_short_for_a_content_type_is_decode_error():
    _, server = pair()
    with pytest.raises(TlsRecordError, match="decode_error"):
        open_all(server, struct.pack(">BHH", 23, 0x0303, 16) + bytes(16))


def test_padding_is_stripped_and_all_padding_is_unexpected_message():
    # RFC 8446 5.4: the type is the last non-zero byte; none at all is unexpected_message.
    core, peer, _ = peer_of("client")
    assert open_all(core, peer.record(b"padded", padding=300))[0] == b"padded"
    core, peer, _ = peer_of("client")
    header = struct.pack(">BHH", 23, 0x0303, 10 + 16)
    record = header + peer.aead.encrypt((peer.iv ^ 0).to_bytes(12, "big"), bytes(10), header)
    with pytest.raises(TlsRecordError, match="unexpected_message"):
        open_all(core, record)


def test_zero_length_application_data_is_allowed():
    core, peer, _ = peer_of("client")
    assert open_all(core, peer.record(b"") + peer.record(b"x"))[0] == b"x"


def test_an_unknown_inner_content_type_is_unexpected_message():
    for kind in (20, 24, 99):
        core, peer, _ = peer_of("client")
        with pytest.raises(TlsRecordError, match="unexpected_message"):
            open_all(core, peer.record(b"\x01", kind))


# Alerts ------------------------------------------------------------------------------------------
def test_close_notify_is_the_end_of_data_and_what_follows_is_ignored():
    # RFC 8446 6.1.
    client, server = pair()
    wire = bytes(client.seal(b"last")) + client.close_notify()
    got, used, status = open_all(server, wire + b"garbage after the close")
    assert (got, status) == (b"last", CLOSED) and server.read_closed
    assert server.open_into(memoryview(b"more"), 4, memoryview(bytearray(10)), 0)[2] == CLOSED
    with pytest.raises(ProtocolError, match="closed"):
        client.seal(b"after close_notify")


@pytest.mark.parametrize(
    "code,name",
    [(40, "handshake_failure"), (80, "internal_error"), (200, "unknown alert 200")],
)
@pytest.mark.parametrize("level", [1, 2])
def test_every_other_alert_ends_the_connection_with_its_name(code, name, level):
    # RFC 8446 6.2: all other alerts are errors whatever their level, unknown ones too.
    core, peer, _ = peer_of("client")
    with pytest.raises(TlsPeerAlert) as err:
        open_all(core, peer.record(b"ok") + peer.record(bytes((level, code)), tr.ALERT))
    assert err.value.alert == name and name in str(err.value)
    assert not core.output  # no alert is answered with one


@pytest.mark.parametrize("level", [1, 2])
def test_user_canceled_is_a_closure_alert_not_an_error(level):
    # RFC 8446 6.1: user_canceled is a closure alert; the close_notify that follows ends the data.
    core, peer, _ = peer_of("client")
    wire = peer.record(b"before") + peer.record(bytes((level, 90)), tr.ALERT) + peer.record(b"after")
    got, _used, status = open_all(core, wire + peer.record(bytes((1, 0)), tr.ALERT))
    assert (got, status) == (b"beforeafter", CLOSED) and core.read_closed and not core.failed
    assert not core.output  # no alert is answered with one


def test_user_canceled_without_end_is_cut_off():
    # Like empty records, closure alerts without data in between are bounded.
    core, peer, _ = peer_of("client")
    wire = b"".join(peer.record(bytes((1, 90)), tr.ALERT) for _ in range(tr.MAX_NO_DATA_IN_A_ROW + 1))
    with pytest.raises(TlsRecordError, match="unexpected_message"):
        open_all(core, wire)


def test_the_write_sequence_continues_after_records_openssl_sealed():
    # A TLS 1.3 server's NewSessionTickets are sealed by OpenSSL under the first write key
    # (tls/handshake.py); our records continue with the next sequence numbers.
    client, server = pair()
    secrets = {"read_secret": bytes(server._read.secret), "write_secret": bytes(server._write.secret)}
    openssl = RecordLayer(server.suite, client_side=False, **secrets)
    tickets = openssl._seal_control(tr.HANDSHAKE, ticket()) + openssl._seal_control(tr.HANDSHAKE, ticket())
    ours = RecordLayer(server.suite, client_side=False, write_sequence=2, **secrets)
    assert open_all(client, tickets + bytes(ours.seal(b"data")))[0] == b"data"
    # Without the count, our first record reuses the tickets' nonce and fails as a forgery would.
    fresh = RecordLayer(
        server.suite,
        client_side=True,
        read_secret=secrets["write_secret"],
        write_secret=secrets["read_secret"],
    )
    with pytest.raises(TlsRecordError, match="bad_record_mac"):
        open_all(fresh, bytes(ours.seal(b"x")))
    with pytest.raises(ValueError, match="write_sequence"):
        RecordLayer(server.suite, client_side=False, write_sequence=-1, **secrets)


@pytest.mark.parametrize("content", [b"", b"\x01", b"\x01\x00\x00"])
def test_an_alert_record_that_is_not_one_2_byte_alert_is_decode_error(content):
    # RFC 8446 5.1: one alert per record, never fragmented or coalesced.
    core, peer, _ = peer_of("client")
    with pytest.raises(TlsRecordError, match="decode_error"):
        open_all(core, peer.record(content, tr.ALERT))


# Post-handshake messages ------------------------------------------------------------------------
def ticket(nonce: bytes = b"\x00" * 8, body: bytes = b"t" * 200, extensions: bytes = b"") -> bytes:
    message = struct.pack(">II", 7200, 12345) + bytes((len(nonce),)) + nonce
    message += struct.pack(">H", len(body)) + body + struct.pack(">H", len(extensions)) + extensions
    return bytes((4,)) + len(message).to_bytes(3, "big") + message


def test_a_client_drops_new_session_tickets_even_fragmented_and_coalesced():
    # RFC 8446 4.6.1; 5.1: handshake messages may be split across records and share one.
    core, peer, _ = peer_of("client")
    two = ticket() + ticket(extensions=b"\x00\x2a\x00\x04\x00\x00\x40\x00")
    wire = (
        peer.record(two[:3], tr.HANDSHAKE)
        + peer.record(two[3:150], tr.HANDSHAKE)
        + peer.record(two[150:], tr.HANDSHAKE)
    )
    wire += peer.record(b"data")
    assert open_all(core, wire)[0] == b"data" and not core.output


def test_a_server_receiving_a_ticket_is_unexpected_message():
    core, peer, _ = peer_of("server")
    with pytest.raises(TlsRecordError, match="unexpected_message"):
        open_all(core, peer.record(ticket(), tr.HANDSHAKE))


@pytest.mark.parametrize("bad", [ticket()[:-1] + b"", ticket() + b"x", ticket(body=b"")])
def test_a_malformed_ticket_is_decode_error(bad):
    fixed = bad[:1] + (len(bad) - 4).to_bytes(3, "big") + bad[4:]
    core, peer, _ = peer_of("client")
    with pytest.raises(TlsRecordError, match="decode_error"):
        open_all(core, peer.record(fixed, tr.HANDSHAKE))


@pytest.mark.parametrize("kind", [13, 11, 20, 1, 2, 8, 99])
def test_other_post_handshake_messages_are_unexpected_message(kind):
    # RFC 8446 4.6.2: we never offer post-handshake authentication; the rest has no place here.
    core, peer, _ = peer_of("client")
    with pytest.raises(TlsRecordError, match="unexpected_message"):
        open_all(core, peer.record(bytes((kind, 0, 0, 2, 0, 0)), tr.HANDSHAKE))


def test_a_zero_length_handshake_fragment_is_unexpected_message():
    core, peer, _ = peer_of("client")
    with pytest.raises(TlsRecordError, match="unexpected_message"):
        open_all(core, peer.record(b"", tr.HANDSHAKE))


def test_application_data_inside_a_handshake_message_is_unexpected_message():
    # RFC 8446 5.1: handshake messages are not interleaved with other record types.
    core, peer, _ = peer_of("client")
    message = ticket()
    with pytest.raises(TlsRecordError, match="unexpected_message"):
        open_all(core, peer.record(message[:10], tr.HANDSHAKE) + peer.record(b"data"))
    core, peer, _ = peer_of("client")
    with pytest.raises(TlsRecordError, match="unexpected_message"):
        open_all(core, peer.record(message[:10], tr.HANDSHAKE) + peer.record(b"\x01\x00", tr.ALERT))


def test_a_post_handshake_message_beyond_its_bound_is_refused_from_its_header():
    # MAX_POST_HANDSHAKE_MESSAGE_BYTES: the claimed length alone is refused, nothing is held.
    core, peer, _ = peer_of("client")
    too_long = tr.MAX_POST_HANDSHAKE_MESSAGE_BYTES + 1
    with pytest.raises(TlsRecordError, match="illegal_parameter"):
        open_all(core, peer.record(bytes((4,)) + too_long.to_bytes(3, "big"), tr.HANDSHAKE))
    # A message at the bound is reassembled (and then found malformed, which is decode_error).
    core, peer, _ = peer_of("client")
    at_bound = tr.MAX_POST_HANDSHAKE_MESSAGE_BYTES
    message = bytes((4,)) + at_bound.to_bytes(3, "big") + bytes(at_bound)
    wire = b"".join(peer.record(message[i : i + 2**14], tr.HANDSHAKE) for i in range(0, len(message), 2**14))
    with pytest.raises(TlsRecordError, match="decode_error"):
        open_all(core, wire)
    assert len(core._handshake) <= 4 + at_bound


def test_post_handshake_messages_in_a_row_without_data_are_bounded():
    core, peer, _ = peer_of("client")
    wire = b"".join(peer.record(ticket(), tr.HANDSHAKE) for _ in range(tr.MAX_NO_DATA_IN_A_ROW))
    wire += peer.record(b"d")  # application data resets the run
    wire += b"".join(peer.record(ticket(), tr.HANDSHAKE) for _ in range(tr.MAX_NO_DATA_IN_A_ROW))
    assert open_all(core, wire)[0] == b"d"
    with pytest.raises(TlsRecordError, match="unexpected_message"):
        open_all(core, peer.record(ticket(), tr.HANDSHAKE))
    core, peer, _ = peer_of("client")
    wire = b"".join(peer.key_update(False) for _ in range(tr.MAX_NO_DATA_IN_A_ROW + 1))
    with pytest.raises(TlsRecordError, match="without application data"):
        open_all(core, wire)


def test_empty_application_data_records_in_a_row_are_bounded():
    # RFC 8446 5.4 allows zero-length application data; a run of them (with padding, or as
    # bare content types) gives the protocol nothing and is cut off as OpenSSL cuts it off.
    core, peer, secret = peer_of("client")
    wire = b"".join(peer.record(b"", padding=i % 3 * 100) for i in range(tr.MAX_NO_DATA_IN_A_ROW))
    wire += peer.record(b"d")  # application data resets the run
    wire += b"".join(peer.record(b"") for _ in range(tr.MAX_NO_DATA_IN_A_ROW))
    assert open_all(core, wire)[0] == b"d"
    with pytest.raises(TlsRecordError, match="without application data"):
        open_all(core, peer.record(b"", padding=10))
    assert alert_sent(core, secret) == "unexpected_message"


def test_a_record_of_maximal_padding_opens_to_its_content():
    # The content type is the last non-zero byte however much padding follows (RFC 8446 5.4).
    core, peer, _ = peer_of("client")
    wire = peer.record(b"x", padding=2**14 - 1) + peer.record(b"\x00\x00y\x00", padding=2**13)
    assert open_all(core, wire)[0] == b"x\x00\x00y\x00"


# KeyUpdate -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("suite", SUITES)
def test_a_key_update_rotates_the_read_key(suite):
    # RFC 8446 4.6.3 / 7.2: the next read key comes from "traffic upd"; no answer is due.
    core, peer, _ = peer_of("client", suite)
    wire = peer.record(b"before") + peer.key_update(False) + peer.record(b"after")
    assert open_all(core, wire)[0] == b"beforeafter"
    assert not core.output
    assert core._read.seq == 1


def test_update_requested_is_answered_once_and_rotates_our_write_key():
    size = 32
    c_secret, s_secret = os.urandom(size), os.urandom(size)
    core = RecordLayer(
        "TLS_AES_128_GCM_SHA256", client_side=True, read_secret=s_secret, write_secret=c_secret
    )
    peer = Peer("TLS_AES_128_GCM_SHA256", s_secret)
    # Two requests read together are answered by one KeyUpdate (RFC 8446 4.6.3).
    assert open_all(core, peer.key_update(True) + peer.key_update(True))[0] == b""
    assert core.output
    # What the core sends next: its KeyUpdate (under the old key), then data under the new one.
    ours = RecordLayer(
        "TLS_AES_128_GCM_SHA256", client_side=False, read_secret=c_secret, write_secret=os.urandom(size)
    )
    wire = bytes(core.seal(b"data"))
    assert not core.output
    got, _, _ = open_all(ours, wire)
    assert got == b"data" and ours._read.seq == 1  # one KeyUpdate, then one record of the new key
    assert hkdf_expand_label(c_secret, b"traffic upd", b"", 32, "sha256") == bytes(ours._read.secret)


def test_an_answer_waits_in_output_when_nothing_is_written():
    core, peer, _ = peer_of("client")
    open_all(core, peer.key_update(True))
    answer = core.take_output()
    assert len(answer) == tr.KEY_UPDATE_RECORD_BYTES and not core.output


@pytest.mark.parametrize(
    "body,alert", [(b"", "decode_error"), (b"\x00\x00", "decode_error"), (b"\x02", "illegal_parameter")]
)
def test_a_malformed_key_update_is_refused(body, alert):
    core, peer, _ = peer_of("client")
    with pytest.raises(TlsRecordError, match=alert):
        open_all(core, peer.record(bytes((24,)) + len(body).to_bytes(3, "big") + body, tr.HANDSHAKE))


def test_a_key_update_must_end_its_record():
    # RFC 8446 5.1: a message before a key change ends on a record boundary.
    core, peer, _ = peer_of("client")
    with pytest.raises(TlsRecordError, match="unexpected_message"):
        open_all(core, peer.record(bytes((24, 0, 0, 1, 0)) + ticket(), tr.HANDSHAKE))


def test_data_under_the_old_key_after_a_key_update_fails():
    core, peer, _ = peer_of("client")
    update = peer.record(bytes((24, 0, 0, 1, 0)), tr.HANDSHAKE)  # peer keeps its old key
    with pytest.raises(TlsRecordError, match="bad_record_mac"):
        open_all(core, update + peer.record(b"old key"))


def test_our_own_key_update_comes_before_the_records_per_key_limit():
    # RFC 8446 5.5 (AES-GCM: 2^24.5 records per key); here with a limit of 4 records per key.
    client, server = pair(records_per_key=4)
    data = os.urandom(2**14 * 10 + 3)
    wire = bytes(client.seal(data)) + bytes(client.seal(b"tail"))
    got, used, _ = open_all(server, wire)
    assert got == data + b"tail" and used == len(wire)
    kinds = []
    at = 0
    while at < len(wire):
        at += 5 + struct.unpack_from(">H", wire, at + 3)[0]
        kinds.append(at)
    # 12 data records, each key protecting 3 of them and a KeyUpdate: 4 KeyUpdates in all.
    assert len(kinds) == 12 + 3
    assert server._read.seq <= 3 and client._write.seq <= 3
    assert tr.RECORDS_PER_KEY <= 2**24.5


def test_the_read_sequence_number_never_wraps():
    # RFC 8446 5.3: a sequence number would wrap: terminate.
    core, peer, _ = peer_of("client")
    core._read.seq = tr.MAX_SEQUENCE
    peer.seq = tr.MAX_SEQUENCE
    with pytest.raises(TlsRecordError, match="wrap"):
        open_all(core, peer.record(b"x"))


def test_wipe_zeroes_the_secrets_we_hold():
    client, _ = pair()
    read, write = client._read.secret, client._write.secret
    client.wipe()
    assert read == bytes(len(read)) and write == bytes(len(write))
    with pytest.raises(ProtocolError):
        client.seal(b"x")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_from_a_peer_open_or_raise_our_protocol_error(junk):
    _, server = pair()
    try:
        open_all(server, junk, buffer_bytes=100)
    except ProtocolError:
        pass


@pytest.mark.parametrize("size", [1, 100, tr.SMALL_SEAL_BYTES, tr.SMALL_SEAL_BYTES + 1])
@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_seal_write_is_one_record_like_seal_and_falls_back_when_it_must(size, kind):
    client, server = pair(records_per_key=3)
    data = os.urandom(size)
    wire = b"".join(bytes(client.seal_write(kind(data))) for _ in range(5))  # KeyUpdates fall due
    got, used, _ = open_all(server, wire)
    assert got == data * 5 and used == len(wire)
    # An answer waiting in output goes first.
    core, peer, _ = peer_of("client")
    open_all(core, peer.key_update(True))
    assert core.output
    sealed = core.seal_write(kind(data))
    assert not core.output and len(sealed) == tr.KEY_UPDATE_RECORD_BYTES + size + tr.RECORD_OVERHEAD_BYTES


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 40_000), max_size=8), st.sampled_from([bytes, bytearray, memoryview]))
def test_seal_pieces_is_seal_of_the_pieces_joined_with_only_the_last_record_short(sizes, kind):
    client, server = pair()
    pieces = [os.urandom(n) for n in sizes]
    wire = bytes(client.seal_pieces([kind(p) for p in pieces]))
    joined = b"".join(pieces)
    assert open_all(server, wire)[0] == joined
    lengths = []
    at = 0
    while at < len(wire):
        length = struct.unpack_from(">H", wire, at + 3)[0]
        lengths.append(length - 17)
        at += 5 + length
    assert sum(lengths) == len(joined)
    assert all(n == 2**14 for n in lengths[:-1])


def test_a_layer_made_on_another_thread_seals_through_buffers_of_its_own():
    # The shared scratch buffers are per thread: two event loops in one process never share one.
    import threading

    here, _ = pair()
    there: list[RecordLayer] = []
    thread = threading.Thread(target=lambda: there.append(pair()[0]))
    thread.start()
    thread.join()
    assert here._scratch is not there[0]._scratch
    assert here._scratch is pair()[0]._scratch


def test_our_key_update_may_ask_for_the_peers_and_the_answer_asks_nothing():
    """`request_peer_update` (what interop tests switch on through `KeyUpdates`): our KeyUpdate at
    the limit carries update_requested; the peer answers with update_not_requested, so two of
    ours rotate both ways once per limit and never answer each other in a loop."""
    client, server = pair(records_per_key=4, request_peer_update=True)
    first_client_write, first_server_write, first_server_read = client._write, server._write, server._read
    wire = b"".join(bytes(client.seal(b"c%d" % i)) for i in range(5))  # past the limit
    got, _, _ = open_all(server, wire)
    assert got == b"".join(b"c%d" % i for i in range(5))
    assert client._write is not first_client_write and server._read is not first_server_read
    assert server.output  # its answer waits, sealed under its old key, before its next record
    answer = bytes(server.seal(b"s"))
    assert server._write is not first_server_write
    got, _, _ = open_all(client, answer)
    assert got == b"s" and not client.output  # no answer to an answer
