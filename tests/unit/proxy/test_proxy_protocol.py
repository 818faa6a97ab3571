"""PROXY protocol v2 headers, checked against bytes laid out by hand from the HAProxy spec."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ambient_mesh.net import SocketAddr
from ambient_mesh.proxy.proxy_protocol import (
    TLV_PEER_IDENTITY,
    ProxyProtocolError,
    decode_v2,
    encode_v2,
)

SIG = bytes([0x0D, 0x0A, 0x0D, 0x0A, 0x00, 0x0D, 0x0A, 0x51, 0x55, 0x49, 0x54, 0x0A])


def test_ipv4_with_identity_tlv_byte_for_byte():
    identity = b"spiffe://cluster.local/ns/a/sa/b"
    header = encode_v2(
        SocketAddr.parse("10.0.0.1:40000"), SocketAddr.parse("10.0.0.2:8080"), [(TLV_PEER_IDENTITY, identity)]
    )
    tlv = bytes([0xD0]) + len(identity).to_bytes(2, "big") + identity
    body = bytes([10, 0, 0, 1, 10, 0, 0, 2]) + (40000).to_bytes(2, "big") + (8080).to_bytes(2, "big") + tlv
    assert header == SIG + bytes([0x21, 0x11]) + len(body).to_bytes(2, "big") + body


def test_ipv6_and_mixed_families():
    header = encode_v2(SocketAddr.parse("[fd00::1]:1"), SocketAddr.parse("[fd00::2]:2"))
    assert header[12:14] == bytes([0x21, 0x21]) and struct.unpack("!H", header[14:16])[0] == 36
    mixed, _ = decode_v2(encode_v2(SocketAddr.parse("10.0.0.1:5"), SocketAddr.parse("[fd00::2]:6")))
    assert mixed.source == SocketAddr.parse("10.0.0.1:5")  # sent v4-mapped, read back as IPv4
    assert str(mixed.destination) == "[fd00::2]:6"


def test_round_trip_and_incomplete_input():
    header = encode_v2(
        SocketAddr.parse("1.2.3.4:5"), SocketAddr.parse("6.7.8.9:10"), [(0xD0, b"x"), (0xD1, b"")]
    )
    parsed, used = decode_v2(header + b"payload")
    assert used == len(header)
    assert parsed.tlv(0xD0) == b"x" and parsed.tlv(0xD1) == b"" and parsed.tlv(0xD2) is None
    for cut in range(len(header)):
        assert decode_v2(header[:cut]) is None


def test_garbage_is_refused():
    with pytest.raises(ProxyProtocolError):
        decode_v2(b"GET / HTTP/1.1\r\n\r\n")


@given(st.binary(max_size=200))
def test_decoder_returns_or_raises_protocol_error(data):
    try:
        decode_v2(data)
    except ProxyProtocolError:
        pass


@given(
    st.ip_addresses(),
    st.integers(0, 65535),
    st.ip_addresses(),
    st.integers(0, 65535),
    st.lists(st.tuples(st.integers(0, 255), st.binary(max_size=40)), max_size=4),
)
def test_any_header_round_trips(src, sport, dst, dport, tlvs):
    parsed, _ = decode_v2(encode_v2(SocketAddr(src, sport), SocketAddr(dst, dport), tlvs))
    assert parsed.tlvs == tuple(tlvs)
    assert (parsed.source.port, parsed.destination.port) == (sport, dport)
