"""Properties of HBONE's HTTP/2 core over arbitrary frame sequences (hypothesis).

Valid and invalid frames, any interleaving, split at any byte, mixed with what the shell does
(acknowledge, reset, send, end, drain, time passing): nothing but the core's own error type
escapes, the bytes it holds stay bounded, and the connection's receive credit is conserved.
Also: the linear HPACK decoder agrees with the `hpack` library's decoder.
"""

from __future__ import annotations

import hpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ambient_mesh.http2 import Connection, CoreSettings, Http2Error
from ambient_mesh.http2 import connection as c
from ambient_mesh.http2 import events as ev
from ambient_mesh.http2 import frames as f
from ambient_mesh.http2.hpack_block import BlockDecoder, HpackError
from tests.helpers.http2_peer import CONNECT

SIDS = st.sampled_from([0, 1, 2, 3, 5, 7, 9, 11, 2**31 - 1])
HEADER_LISTS = st.sampled_from(
    [
        CONNECT,
        CONNECT + [(b"baggage", b"k=v")],
        CONNECT + [(b":protocol", b"websocket")],
        [(b":method", b"GET"), (b":scheme", b"https"), (b":path", b"/"), (b":authority", b"a:1")],
        [(b":status", b"200")],
        [(b":method", b"CONNECT")],
        CONNECT + [(b"x-big", b"v" * 3000)],
    ]
)


def _payload(draw, ftype: int, encoder: hpack.Encoder) -> bytes:
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(st.binary(max_size=64))
    if ftype in (f.HEADERS, f.CONTINUATION):
        return encoder.encode(draw(HEADER_LISTS))
    if ftype == f.SETTINGS:
        entries = draw(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 2**32 - 1)), max_size=4))
        return b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in entries)
    if ftype in (f.WINDOW_UPDATE, f.RST_STREAM):
        return draw(st.integers(0, 2**32 - 1)).to_bytes(4, "big")
    if ftype == f.PING:
        return draw(st.binary(min_size=8, max_size=8))
    if ftype == f.GOAWAY:
        return draw(st.integers(0, 2**31 - 1)).to_bytes(4, "big") + draw(st.integers(0, 13)).to_bytes(
            4, "big"
        )
    if ftype == f.DATA:
        return b"x" * draw(st.sampled_from([0, 1, 100, 16384, 40000]))
    return draw(st.binary(max_size=8))


@st.composite
def frames(draw, encoder: hpack.Encoder) -> bytes:
    ftype = draw(st.sampled_from([0, 0, 0, 1, 1, 2, 3, 3, 4, 5, 6, 7, 8, 8, 9, 0x42]))
    flags = draw(st.sampled_from([0, 1, 4, 5, 8, 0x20, 0x25, 0xFF]))
    payload = _payload(draw, ftype, encoder)
    return f.frame_header(len(payload), ftype, flags, draw(SIDS)) + payload


ACTIONS = st.sampled_from(
    ["frame", "frame", "frame", "ack", "reset", "send", "end", "drain", "tick", "respond"]
)


def _check(core: Connection, window: int) -> None:
    s = core.settings
    assert core.buffered_bytes <= s.max_frame_bytes + f.FRAME_HEADER_BYTES + s.max_header_block_bytes
    assert core.credit_balance() == window
    assert core._control_queued <= c.MAX_OUTBOUND_CONTROL_FRAMES + 1
    assert len(core.streams) <= (s.max_concurrent_streams or 10_000)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.booleans())
def test_any_frame_sequence_keeps_the_core_bounded_and_credit_conserved(data, client_side):
    settings_ = CoreSettings(
        client_side=client_side,
        max_header_list_bytes=16 * 1024 if client_side else 64 * 1024,
        max_concurrent_streams=None if client_side else 5,
    )
    core = Connection(settings_, now=0.0)
    core.initiate(0.0)
    encoder = hpack.Encoder()
    now = 0.0
    wire = bytearray() if client_side else bytearray(f.CLIENT_PREFACE)
    if data.draw(st.booleans()):
        wire += f.settings_frame({f.Setting.INITIAL_WINDOW_SIZE: 1 << 20})
    delivered: dict[int, int] = {}
    for _ in range(data.draw(st.integers(1, 40))):
        action = data.draw(ACTIONS)
        try:
            if action == "frame":
                wire += data.draw(frames(encoder))
                cut = data.draw(st.integers(0, len(wire)))
                chunk, wire[:] = bytes(wire[:cut]), wire[cut:]
                for event in core.receive(chunk, now):
                    if isinstance(event, ev.DataReceived):
                        delivered[event.stream_id] = delivered.get(event.stream_id, 0) + len(event.data)
            elif action == "ack" and delivered:
                sid = data.draw(st.sampled_from(sorted(delivered)))
                n = data.draw(st.integers(0, delivered[sid]))
                delivered[sid] -= n
                core.acknowledge(sid, n)
            elif action == "reset":
                core.reset_stream(data.draw(SIDS))
            elif action == "send":
                core.send_data(data.draw(SIDS), b"s" * data.draw(st.sampled_from([1, 5000, 100_000])))
            elif action == "end":
                core.end_stream(data.draw(SIDS))
            elif action == "drain":
                core.start_drain(now)
            elif action == "respond":
                core.send_response(data.draw(SIDS), data.draw(st.sampled_from([200, 503])))
            elif action == "tick":
                now += data.draw(st.sampled_from([0.01, 1.0, 11.0]))
                core.handle_timeout(now)
        except Http2Error:
            pass  # the shell asked for something not allowed now: the one permitted exception
        _check(core, settings_.connection_window_bytes)
        if data.draw(st.booleans()):
            core.data_to_send()  # the peer reads (or not)
    core.close()
    assert core.buffered_bytes == 0


class _GeneralPathOnly(Connection):
    """Every DATA and HEADERS frame through _frame_start/_data_target/_on_headers (Connection has
    slots: a subclass, not an instance attribute)."""

    __slots__ = ()
    _DATA_FAST_PATH = False

    def _stream_frame_fast(self, *_args: object) -> bool:
        return False


def _general_path_only(core: Connection) -> Connection:
    core.__class__ = _GeneralPathOnly
    return core


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.booleans())
def test_whole_data_frame_fast_path_matches_the_general_path(data, client_side):
    """The same wire, cut the same way, into a core with its one-read DATA, HEADERS and
    END_STREAM fast paths and one without: the same events, bytes out, credit, windows and
    termination."""
    settings_ = CoreSettings(client_side=client_side, stream_window_bytes=60_000, max_concurrent_streams=None)
    fast, slow = Connection(settings_, now=0.0), _general_path_only(Connection(settings_, now=0.0))
    encoder = hpack.Encoder()
    wire = bytearray() if client_side else bytearray(f.CLIENT_PREFACE)
    wire += f.settings_frame({})
    if not client_side:
        wire += f.header_block_frames(1, encoder.encode(CONNECT), False, f.DEFAULT_MAX_FRAME_BYTES)[0]
    for core in (fast, slow):
        core.initiate(0.0)
        if client_side:
            core.send_request(CONNECT)
    for _ in range(data.draw(st.integers(1, 30))):
        kind = data.draw(st.integers(0, 5))
        if kind == 5:  # the peer's END_STREAM alone (how HBONE's half-close arrives)
            wire += f.frame_header(0, f.DATA, f.FLAG_END_STREAM, data.draw(st.sampled_from([1, 3, 5, 0])))
        elif kind == 4:  # a whole header block: a new request, a response, trailers or an error
            sid = data.draw(st.sampled_from([1, 1, 3, 5, 0, 2]))
            flags = data.draw(st.sampled_from([4, 4, 5, 0x0C, 0x24, 0]))
            wellformed = st.just([(b":status", b"200")] if client_side else CONNECT)
            block = encoder.encode(data.draw(st.one_of(wellformed, HEADER_LISTS)))
            pad = b"\x00" if flags & f.FLAG_PADDED else b""
            prio = b"\x00" * 5 if flags & f.FLAG_PRIORITY else b""
            wire += f.frame_header(len(pad + prio + block), f.HEADERS, flags, sid) + pad + prio + block
        elif kind:
            sid = data.draw(st.sampled_from([1, 1, 1, 3, 0]))
            flags = data.draw(st.sampled_from([0, 0, 0, 1, 8, 0x20]))
            payload = b"d" * data.draw(st.sampled_from([0, 1, 1, 9, 700, 16384, 20_000, 70_000]))
            wire += f.frame_header(len(payload), f.DATA, flags, sid) + payload
        else:
            wire += data.draw(frames(encoder))
        if data.draw(st.booleans()):
            # At the end of what is written as often as anywhere: whole frames within a read.
            cut = data.draw(st.one_of(st.just(len(wire)), st.integers(0, len(wire))))
            chunk, wire[:] = bytes(wire[:cut]), wire[cut:]
            got = [
                [
                    (ev.DataReceived, e.stream_id, bytes(e.data)) if type(e) is ev.DataReceived else e
                    for e in core.receive(chunk, 0.0)
                ]
                for core in (fast, slow)
            ]
            assert got[0] == got[1]  # every event's fields (DATA payloads as bytes)
            end_ours = data.draw(st.booleans())  # our side ends its streams: both halves close
            for core in (fast, slow):
                for sid, n in [(e[1], len(e[2])) for e in got[0] if type(e) is tuple]:
                    core.acknowledge(sid, n)
                for sid in [s.sid for s in core.streams.values() if end_ours and not s.local_closed]:
                    core.end_stream(sid)
        out = [b"".join(bytes(p) for p in core.data_to_send()) for core in (fast, slow)]
        assert out[0] == out[1]
        assert fast.credit_balance() == slow.credit_balance()
        assert [(s.sid, s.recv_window, s.unacked, s.remote_closed) for s in fast.streams.values()] == [
            (s.sid, s.recv_window, s.unacked, s.remote_closed) for s in slow.streams.values()
        ]
        assert fast.terminated == slow.terminated


def _open_pair() -> tuple[Connection, Connection, int]:
    client = Connection(CoreSettings(client_side=True, max_concurrent_streams=None), now=0.0)
    server = Connection(CoreSettings(client_side=False), now=0.0)
    for core in (client, server):
        core.initiate(0.0)
    sid = client.send_request(CONNECT)
    for _ in range(3):
        server.receive(b"".join(bytes(p) for p in client.data_to_send()), 0.0)
        client.receive(b"".join(bytes(p) for p in server.data_to_send()), 0.0)
    return client, server, sid


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["data", "control", "end", "drain"]), st.integers(0, 70_000)), max_size=12
    )
)
def test_data_header_is_send_data_when_it_applies(steps):
    """`data_header` (one frame, written at once by the shell: the header, then the payload)
    gives the bytes and windows `send_data` would have queued, and declines whenever anything is
    queued, the chunk is empty or longer than a frame, or the windows do not take it whole."""
    direct, _server_of_direct, sid = _open_pair()
    twin, _server, _sid = _open_pair()
    for action, n in steps:
        if action == "data":
            data = b"z" * n
            header = direct.data_header(sid, n)
            window = twin.send_window(sid)
            if header is None:
                assert direct.outbox_bytes or not 0 < n <= direct.peer_max_frame_bytes or n > window
                try:
                    direct.send_data(sid, data)
                    twin.send_data(sid, data)
                except Http2Error:
                    continue
            else:
                assert not twin.outbox_bytes and 0 < n <= window
                twin.send_data(sid, data)
                assert header + data == b"".join(bytes(p) for p in twin.data_to_send())
        elif action == "control":
            for core in (direct, twin):
                core.reset_stream(sid + 2)  # an idle stream: nothing happens; then a PING answer
                core.receive(f.ping_frame(b"12345678"), 0.0)
        elif action == "end":
            for core in (direct, twin):
                try:
                    core.end_stream(sid)
                except Http2Error:
                    pass
        else:
            for core in (direct, twin):
                core.start_drain(0.0)
        assert direct.send_window(sid) == twin.send_window(sid)
        if n % 3 == 0:
            assert b"".join(bytes(p) for p in direct.data_to_send()) == b"".join(
                bytes(p) for p in twin.data_to_send()
            )


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.binary(min_size=1, max_size=20).map(lambda b: b.lower()),
            st.binary(max_size=300),
            st.sampled_from([True, False]),
        ),
        max_size=30,
    ),
    st.booleans(),
)
def test_linear_decoder_matches_the_hpack_library(fields, huffman):
    encoder = hpack.Encoder()
    reference = hpack.Decoder()
    ours = BlockDecoder(max_list_bytes=1 << 20)
    headers = [
        hpack.NeverIndexedHeaderTuple(n, v) if sensitive else hpack.HeaderTuple(n, v)
        for n, v, sensitive in fields
    ]
    for _ in range(2):  # twice: the second block uses the dynamic table the first one filled
        block = encoder.encode(headers, huffman=huffman)
        expected = [(bytes(n), bytes(v)) for n, v in reference.decode(block, raw=True)]
        assert ours.decode(block) == expected


@given(st.binary(max_size=200))
def test_linear_decoder_only_raises_hpack_error(block):
    try:
        BlockDecoder(max_list_bytes=4096).decode(block)
    except HpackError:
        pass
