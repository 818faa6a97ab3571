"""HTTP/2 frame codec (RFC 9113 section 4 and 6): constants, the 9-byte frame header, and the
frames this engine sends, serialized straight to bytes.

Counterparts: hyperframe (python-hyper) and the framing layer of ztunnel's `h2` crate. Parsing
lives in `connection.py`, which reads frame headers out of the receive buffer in place; this
module only knows how frames look on the wire.
"""

from __future__ import annotations

import enum
import struct

# RFC 9113 3.4: the client connection preface.
CLIENT_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

FRAME_HEADER_BYTES = 9
# RFC 9113 4.2: SETTINGS_MAX_FRAME_SIZE bounds, and the default every peer starts with.
DEFAULT_MAX_FRAME_BYTES = 16_384
MAX_ALLOWED_FRAME_BYTES = 16_777_215
# RFC 9113 6.9.1: windows start at 65,535 and never exceed 2^31-1.
DEFAULT_WINDOW_BYTES = 65_535
MAX_WINDOW_BYTES = 2**31 - 1
MAX_STREAM_ID = 2**31 - 1

# Frame types (RFC 9113 6).
DATA = 0x0
HEADERS = 0x1
PRIORITY = 0x2
RST_STREAM = 0x3
SETTINGS = 0x4
PUSH_PROMISE = 0x5
PING = 0x6
GOAWAY = 0x7
WINDOW_UPDATE = 0x8
CONTINUATION = 0x9

FRAME_NAMES = {
    DATA: "DATA",
    HEADERS: "HEADERS",
    PRIORITY: "PRIORITY",
    RST_STREAM: "RST_STREAM",
    SETTINGS: "SETTINGS",
    PUSH_PROMISE: "PUSH_PROMISE",
    PING: "PING",
    GOAWAY: "GOAWAY",
    WINDOW_UPDATE: "WINDOW_UPDATE",
    CONTINUATION: "CONTINUATION",
}

# Flags.
FLAG_END_STREAM = 0x1
FLAG_ACK = 0x1
FLAG_END_HEADERS = 0x4
FLAG_PADDED = 0x8
FLAG_PRIORITY = 0x20


class ErrorCode(enum.IntEnum):
    """RFC 9113 7."""

    NO_ERROR = 0x0
    PROTOCOL_ERROR = 0x1
    INTERNAL_ERROR = 0x2
    FLOW_CONTROL_ERROR = 0x3
    SETTINGS_TIMEOUT = 0x4
    STREAM_CLOSED = 0x5
    FRAME_SIZE_ERROR = 0x6
    REFUSED_STREAM = 0x7
    CANCEL = 0x8
    COMPRESSION_ERROR = 0x9
    CONNECT_ERROR = 0xA
    ENHANCE_YOUR_CALM = 0xB
    INADEQUATE_SECURITY = 0xC
    HTTP_1_1_REQUIRED = 0xD


def error_name(code: int) -> str:
    try:
        return ErrorCode(code).name
    except ValueError:
        return f"0x{code:x}"


class Setting(enum.IntEnum):
    """RFC 9113 6.5.2, plus RFC 8441's extended CONNECT (which we never advertise)."""

    HEADER_TABLE_SIZE = 0x1
    ENABLE_PUSH = 0x2
    MAX_CONCURRENT_STREAMS = 0x3
    INITIAL_WINDOW_SIZE = 0x4
    MAX_FRAME_SIZE = 0x5
    MAX_HEADER_LIST_SIZE = 0x6
    ENABLE_CONNECT_PROTOCOL = 0x8


HEADER = struct.Struct(">BHBBI")  # length (24 bits as 8 + 16), type, flags, stream id
_U32 = struct.Struct(">I")
_SETTING = struct.Struct(">HI")
_GOAWAY = struct.Struct(">II")


def frame_header(length: int, frame_type: int, flags: int, stream_id: int) -> bytes:
    return HEADER.pack(length >> 16, length & 0xFFFF, frame_type, flags, stream_id)


def parse_frame_header(buf: bytes | bytearray, offset: int = 0) -> tuple[int, int, int, int]:
    """(length, type, flags, stream id); the reserved bit of the stream id is ignored (4.1)."""
    hi, lo, frame_type, flags, sid = HEADER.unpack_from(buf, offset)
    return (hi << 16) | lo, frame_type, flags, sid & 0x7FFFFFFF


def settings_frame(values: dict[int, int]) -> bytes:
    body = b"".join(_SETTING.pack(k, v) for k, v in values.items())
    return frame_header(len(body), SETTINGS, 0, 0) + body


SETTINGS_ACK = frame_header(0, SETTINGS, FLAG_ACK, 0)


def parse_settings(payload: bytes) -> list[tuple[int, int]]:
    return [_SETTING.unpack_from(payload, i) for i in range(0, len(payload), 6)]


def window_update_frame(stream_id: int, increment: int) -> bytes:
    return frame_header(4, WINDOW_UPDATE, 0, stream_id) + _U32.pack(increment)


def rst_stream_frame(stream_id: int, code: int) -> bytes:
    return frame_header(4, RST_STREAM, 0, stream_id) + _U32.pack(code)


def ping_frame(payload: bytes, ack: bool = False) -> bytes:
    return frame_header(8, PING, FLAG_ACK if ack else 0, 0) + payload


def goaway_frame(last_stream_id: int, code: int, debug: bytes = b"") -> bytes:
    return frame_header(8 + len(debug), GOAWAY, 0, 0) + _GOAWAY.pack(last_stream_id, code) + debug


def parse_u32(payload: bytes, offset: int = 0) -> int:
    value: int = _U32.unpack_from(payload, offset)[0]
    return value


def parse_goaway(payload: bytes) -> tuple[int, int, bytes]:
    last, code = _GOAWAY.unpack_from(payload, 0)
    return last & 0x7FFFFFFF, code, bytes(payload[8:])


def header_block_frames(stream_id: int, block: bytes, end_stream: bool, max_frame_bytes: int) -> list[bytes]:
    """HEADERS (+ CONTINUATION) carrying one encoded header block (RFC 9113 6.2, 6.10)."""
    flags = FLAG_END_STREAM if end_stream else 0
    if len(block) <= max_frame_bytes:
        return [frame_header(len(block), HEADERS, flags | FLAG_END_HEADERS, stream_id) + block]
    out = []
    first = True
    for offset in range(0, len(block), max_frame_bytes):
        piece = block[offset : offset + max_frame_bytes]
        last = offset + max_frame_bytes >= len(block)
        frame_type = HEADERS if first else CONTINUATION
        f = (flags if first else 0) | (FLAG_END_HEADERS if last else 0)
        out.append(frame_header(len(piece), frame_type, f, stream_id) + piece)
        first = False
    return out
