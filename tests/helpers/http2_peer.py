"""A scripted HTTP/2 peer for playbook tests of the sans-IO core: raw frames in, parsed frames out.

It writes frames by hand (with hpack's encoder for header blocks), so tests can send what an
attacker would: floods, endless CONTINUATION, resets in the same packet as the HEADERS.
"""

from __future__ import annotations

from dataclasses import dataclass

import hpack

from ambient_mesh.http2 import Connection, CoreSettings
from ambient_mesh.http2 import events as ev
from ambient_mesh.http2 import frames as f


@dataclass(frozen=True, slots=True)
class Frame:
    type: int
    flags: int
    sid: int
    payload: bytes

    @property
    def name(self) -> str:
        return f.FRAME_NAMES.get(self.type, hex(self.type))

    def u32(self, offset: int = 0) -> int:
        return f.parse_u32(self.payload, offset) & 0x7FFFFFFF


def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return f.frame_header(len(payload), ftype, flags, sid) + payload


def parse_frames(data: bytes) -> list[Frame]:
    out, pos = [], 0
    while pos < len(data):
        length, ftype, flags, sid = f.parse_frame_header(data, pos)
        out.append(Frame(ftype, flags, sid, data[pos + 9 : pos + 9 + length]))
        pos += 9 + length
    assert pos == len(data), "partial frame in the core's output"
    return out


CONNECT = [(b":method", b"CONNECT"), (b":authority", b"10.0.0.3:8080")]


class Peer:
    """The other end of one core. `now` is ours to move."""

    def __init__(self, core: Connection, *, client: bool) -> None:
        self.core = core
        self.client = client
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.decoder.max_header_list_size = 1 << 20
        self.now = 0.0
        self.events: list = []
        self.received: list[Frame] = []

    @classmethod
    def server_core(cls, **settings) -> Peer:
        """A server core, with this peer as its client, past the preface."""
        core = Connection(CoreSettings(client_side=False, **settings), now=0.0)
        core.initiate(0.0)
        peer = cls(core, client=True)
        peer.send(f.CLIENT_PREFACE + f.settings_frame({}))
        peer.read()
        return peer

    @classmethod
    def client_core(cls, **settings) -> Peer:
        core = Connection(
            CoreSettings(
                client_side=True, max_header_list_bytes=16 * 1024, max_concurrent_streams=None, **settings
            ),
            now=0.0,
        )
        core.initiate(0.0)
        peer = cls(core, client=False)
        preface = b"".join(bytes(p) for p in core.data_to_send())
        assert preface.startswith(f.CLIENT_PREFACE)
        peer.received += parse_frames(preface[len(f.CLIENT_PREFACE) :])
        peer.send(f.settings_frame({f.Setting.MAX_CONCURRENT_STREAMS: 200}))
        peer.read()
        return peer

    def send(self, data: bytes) -> list:
        events = self.core.receive(data, self.now)
        self.events += events
        return events

    def read(self) -> list[Frame]:
        """Frames the core queued since the last read."""
        frames = parse_frames(b"".join(bytes(p) for p in self.core.data_to_send()))
        self.received += frames
        return frames

    # Frame builders -----------------------------------------------------------------------
    def headers(self, sid: int, headers=CONNECT, *, end_stream: bool = False) -> bytes:
        block = self.encoder.encode(headers)
        flags = f.FLAG_END_HEADERS | (f.FLAG_END_STREAM if end_stream else 0)
        return frame(f.HEADERS, flags, sid, block)

    def response(self, sid: int, status: int = 200, *, end_stream: bool = False) -> bytes:
        return self.headers(sid, [(b":status", str(status).encode())], end_stream=end_stream)

    @staticmethod
    def data(sid: int, payload: bytes, *, end_stream: bool = False) -> bytes:
        return frame(f.DATA, f.FLAG_END_STREAM if end_stream else 0, sid, payload)

    @staticmethod
    def rst(sid: int, code: int = f.ErrorCode.CANCEL) -> bytes:
        return f.rst_stream_frame(sid, code)

    @staticmethod
    def window_update(sid: int, n: int) -> bytes:
        return f.window_update_frame(sid, n)

    @staticmethod
    def ping(payload: bytes = b"12345678", ack: bool = False) -> bytes:
        return f.ping_frame(payload, ack)

    # Reading what came back ---------------------------------------------------------------
    def goaway(self) -> Frame | None:
        return next((fr for fr in reversed(self.received) if fr.type == f.GOAWAY), None)

    def goaway_code(self) -> int | None:
        g = self.goaway()
        return None if g is None else f.parse_u32(g.payload, 4)

    def resets(self) -> dict[int, int]:
        return {fr.sid: f.parse_u32(fr.payload) for fr in self.received if fr.type == f.RST_STREAM}

    def connection_credit(self) -> int:
        """Connection WINDOW_UPDATE increments received so far."""
        return sum(fr.u32() for fr in self.received if fr.type == f.WINDOW_UPDATE and fr.sid == 0)

    def of(self, kind) -> list:
        return [e for e in self.events if isinstance(e, kind)]

    def terminated(self) -> ev.ConnectionTerminated | None:
        return self.core.terminated
