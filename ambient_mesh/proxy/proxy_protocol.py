"""HAProxy PROXY protocol version 2, as the node proxy writes it to application tunnels.

Counterpart: ztunnel src/proxy/inbound.rs (PROXY header for `applicationTunnel.protocol = PROXY`),
docs/istio-behaviour.md, "PROXY protocol and application tunnels": command PROXY, transport STREAM, the
original client as source, the tunnel target as destination, and TLV 0xD0 carrying the client's SPIFFE
identity. Layout per the HAProxy specification section 2.2: 12-byte signature, version/command byte,
family/transport byte, 16-bit length of what follows, addresses, then TLVs.
"""

from __future__ import annotations

import ipaddress
import struct
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import ProtocolError
from ..net import SocketAddr, ip_address

SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
VERSION_2_PROXY = 0x21  # version 2 (high nibble), command PROXY (low nibble)
VERSION_2_LOCAL = 0x20
FAMILY_TCP4 = 0x11  # AF_INET, STREAM
FAMILY_TCP6 = 0x21  # AF_INET6, STREAM
TLV_PEER_IDENTITY = 0xD0  # Istio: the client's SPIFFE id, UTF-8
TLV_SERVICE_HOSTNAME = 0xD1  # Istio: defined, not written by ztunnel
HEADER_FIXED_BYTES = 16
MAX_HEADER_BYTES = HEADER_FIXED_BYTES + 0xFFFF


class ProxyProtocolError(ProtocolError):
    """Bytes that are not a PROXY v2 header we can read."""


@dataclass(frozen=True, slots=True)
class ProxyHeader:
    source: SocketAddr
    destination: SocketAddr
    tlvs: tuple[tuple[int, bytes], ...] = ()

    def tlv(self, kind: int) -> bytes | None:
        return next((value for k, value in self.tlvs if k == kind), None)


def _as_v6(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> ipaddress.IPv6Address:
    return ip if ip.version == 6 else ipaddress.IPv6Address(f"::ffff:{ip}")


def encode_v2(source: SocketAddr, destination: SocketAddr, tlvs: Iterable[tuple[int, bytes]] = ()) -> bytes:
    """A PROXY v2 header. Mixed families are sent as IPv6 with the IPv4 side mapped."""
    if source.ip.version == 4 and destination.ip.version == 4:
        family = FAMILY_TCP4
        addresses = (
            source.ip.packed + destination.ip.packed + struct.pack("!HH", source.port, destination.port)
        )
    else:
        family = FAMILY_TCP6
        addresses = (
            _as_v6(source.ip).packed
            + _as_v6(destination.ip).packed
            + struct.pack("!HH", source.port, destination.port)
        )
    body = bytearray(addresses)
    for kind, value in tlvs:
        if not 0 <= kind <= 0xFF or len(value) > 0xFFFF:
            raise ProxyProtocolError(f"TLV {kind:#x} of {len(value)} bytes cannot be encoded")
        body += struct.pack("!BH", kind, len(value)) + value
    if len(body) > 0xFFFF:
        raise ProxyProtocolError("PROXY header longer than 65535 bytes")
    return SIGNATURE + bytes((VERSION_2_PROXY, family)) + struct.pack("!H", len(body)) + bytes(body)


def decode_v2(data: bytes) -> tuple[ProxyHeader, int] | None:
    """Parse a header at the start of `data`: (header, bytes consumed), or None if incomplete.

    Raises ProxyProtocolError for anything that is not a PROXY-command STREAM header over IPv4
    or IPv6 (the only kind we write).
    """
    if len(data) < HEADER_FIXED_BYTES:
        if not SIGNATURE.startswith(bytes(data[:12])):
            raise ProxyProtocolError("not a PROXY protocol v2 signature")
        return None
    if data[:12] != SIGNATURE:
        raise ProxyProtocolError("not a PROXY protocol v2 signature")
    if data[12] != VERSION_2_PROXY:
        raise ProxyProtocolError(f"unsupported version/command byte {data[12]:#x}")
    family = data[13]
    (length,) = struct.unpack_from("!H", data, 14)
    if len(data) < HEADER_FIXED_BYTES + length:
        return None
    body = bytes(data[HEADER_FIXED_BYTES : HEADER_FIXED_BYTES + length])
    if family == FAMILY_TCP4:
        if length < 12:
            raise ProxyProtocolError("IPv4 address block too short")
        src, dst = ip_address(body[0:4]), ip_address(body[4:8])
        sport, dport = struct.unpack_from("!HH", body, 8)
        offset = 12
    elif family == FAMILY_TCP6:
        if length < 36:
            raise ProxyProtocolError("IPv6 address block too short")
        src, dst = ip_address(body[0:16]), ip_address(body[16:32])
        sport, dport = struct.unpack_from("!HH", body, 32)
        offset = 36
    else:
        raise ProxyProtocolError(f"unsupported family/transport byte {family:#x}")
    tlvs = []
    while offset < length:
        if length - offset < 3:
            raise ProxyProtocolError("truncated TLV header")
        kind, size = struct.unpack_from("!BH", body, offset)
        offset += 3
        if length - offset < size:
            raise ProxyProtocolError(f"TLV {kind:#x} claims {size} bytes, {length - offset} left")
        tlvs.append((kind, body[offset : offset + size]))
        offset += size
    return ProxyHeader(
        SocketAddr(src, sport), SocketAddr(dst, dport), tuple(tlvs)
    ), HEADER_FIXED_BYTES + length
