"""Playbook tests of HBONE's sans-IO HTTP/2 core: frames in, frames and events out, no sockets.

One test per attack of issue 8 (rapid reset, oversized and endless header blocks, each control
frame flood, a peer that does not read), credit conservation on every way a stream can end,
GOAWAY both ways with streams still carrying data, and refused requests (extended CONNECT).
"""

from __future__ import annotations

import hpack
import pytest

from ambient_mesh.http2 import Connection, CoreSettings, Http2Error, StreamClosedError
from ambient_mesh.http2 import connection as c
from ambient_mesh.http2 import events as ev
from ambient_mesh.http2 import frames as f
from tests.helpers.http2_peer import CONNECT, Peer, frame

E = f.ErrorCode
MiB = 1024 * 1024
CONN_WINDOW = 16 * MiB


def open_stream(peer: Peer, sid: int, *, answer: bool = True) -> None:
    peer.send(peer.headers(sid))
    if answer:
        peer.core.send_response(sid, 200)
    peer.read()


def assert_terminated(peer: Peer, code: int, words: str) -> None:
    peer.read()
    term = peer.terminated()
    assert term is not None and term.error_code == code and not term.clean, term
    assert words in term.reason, term.reason
    assert peer.goaway_code() == code
    assert peer.of(ev.ConnectionTerminated) == [term]
    assert peer.core.buffered_bytes == 0 and not peer.core.streams


# Settings ------------------------------------------------------------------------------------


def test_server_preface_advertises_ztunnel_settings_and_window():
    core = Connection(CoreSettings(client_side=False), now=0.0)
    core.initiate(0.0)
    peer = Peer(core, client=True)
    frames = peer.read()
    settings = dict(f.parse_settings(frames[0].payload))
    assert settings == {
        f.Setting.ENABLE_PUSH: 0,
        f.Setting.INITIAL_WINDOW_SIZE: 4 * MiB,
        f.Setting.MAX_FRAME_SIZE: MiB,
        f.Setting.MAX_HEADER_LIST_SIZE: 64 * 1024,
        f.Setting.MAX_CONCURRENT_STREAMS: 200,
    }
    assert f.Setting.ENABLE_CONNECT_PROTOCOL not in settings  # RFC 8441 is never offered
    assert frames[1].type == f.WINDOW_UPDATE and frames[1].u32() + 65535 == CONN_WINDOW


def test_first_frame_must_be_settings_and_preface_must_match():
    core = Connection(CoreSettings(client_side=False), now=0.0)
    core.initiate(0.0)
    core.receive(b"GET / HTTP/1.1\r\n\r\n", 0.0)
    assert core.terminated.error_code == E.PROTOCOL_ERROR
    core = Connection(CoreSettings(client_side=False), now=0.0)
    core.receive(f.CLIENT_PREFACE + f.ping_frame(b"x" * 8), 0.0)
    assert "first frame" in core.terminated.reason


# Rapid reset ---------------------------------------------------------------------------------


def test_reset_in_the_same_batch_as_headers_never_reaches_the_app_and_21_resets_goaway():
    peer = Peer.server_core()
    for i in range(c.EARLY_RESET_BURST):
        sid = 1 + 2 * i
        events = peer.send(peer.headers(sid) + peer.rst(sid))
        assert events == []  # no RequestReceived, no StreamReset: nothing for the app to start
        assert peer.terminated() is None
    peer.send(peer.headers(41) + peer.rst(41))  # the 21st
    assert_terminated(peer, E.ENHANCE_YOUR_CALM, "rapid reset")
    assert peer.goaway().u32() == 41  # last stream id we processed


def test_reset_after_the_request_was_announced_is_reported_unanswered():
    peer = Peer.server_core()
    [request] = peer.send(peer.headers(1))
    assert isinstance(request, ev.RequestReceived) and request.authority == "10.0.0.3:8080"
    [reset] = peer.send(peer.rst(1))
    assert reset == ev.StreamReset(1, E.CANCEL, answered=False)  # the shell cancels the app connect
    assert not peer.core.streams


def test_resets_of_answered_streams_do_not_count_as_rapid_reset_and_refill_over_time():
    peer = Peer.server_core()
    for i in range(100):
        open_stream(peer, 1 + 2 * i)
        peer.send(peer.rst(1 + 2 * i))
    assert peer.terminated() is None
    for i in range(c.EARLY_RESET_BURST):
        peer.send(peer.headers(1001 + 2 * i) + peer.rst(1001 + 2 * i))
    peer.now += 5.0  # the budget refills: 5 more resets are allowed 5 s later
    for i in range(5):
        peer.send(peer.headers(2001 + 2 * i) + peer.rst(2001 + 2 * i))
    assert peer.terminated() is None
    peer.send(peer.headers(3001) + peer.rst(3001))
    assert peer.terminated().error_code == E.ENHANCE_YOUR_CALM


def test_streams_beyond_max_concurrent_are_refused():
    peer = Peer.server_core(max_concurrent_streams=3)
    for sid in (1, 3, 5):
        peer.send(peer.headers(sid))
    assert peer.send(peer.headers(7)) == []
    peer.read()
    assert peer.resets() == {7: E.REFUSED_STREAM}


# Header blocks -------------------------------------------------------------------------------


def test_header_block_bytes_are_bounded_before_decoding():
    peer = Peer.server_core()
    limit = 64 * 1024 + c.HPACK_SLACK_BYTES
    block = peer.encoder.encode(CONNECT)
    peer.send(frame(f.HEADERS, 0, 1, block))
    filler = b"\x00" * 16 * 1024
    sent = len(block)
    while sent + len(filler) <= limit:
        peer.send(frame(f.CONTINUATION, 0, 1, filler))
        sent += len(filler)
        assert peer.core.buffered_bytes == sent
    # Only the header of the frame that would pass the limit: refused before its payload arrives.
    peer.send(f.frame_header(len(filler), f.CONTINUATION, 0, 1))
    assert_terminated(peer, E.ENHANCE_YOUR_CALM, "refused before decoding")


def test_a_16_mib_header_block_is_refused_at_its_first_frame():
    peer = Peer.server_core()
    peer.send(f.frame_header(MiB, f.HEADERS, 0, 1))  # a 1 MiB HEADERS frame, first of 16
    assert_terminated(peer, E.ENHANCE_YOUR_CALM, "header block of more than")


def test_endless_empty_continuation_frames_goaway():
    peer = Peer.server_core()
    peer.send(frame(f.HEADERS, 0, 1, peer.encoder.encode(CONNECT)))
    for _ in range(c.MAX_CONSECUTIVE_EMPTY_FRAMES):
        peer.send(frame(f.CONTINUATION, 0, 1))
    assert peer.terminated() is None
    peer.send(frame(f.CONTINUATION, 0, 1))
    assert_terminated(peer, E.ENHANCE_YOUR_CALM, "empty")


def test_unfinished_header_block_is_released_on_close():
    peer = Peer.server_core()
    peer.send(frame(f.HEADERS, 0, 1, peer.encoder.encode(CONNECT) + b"\x00" * 30_000))
    assert peer.core.buffered_bytes > 30_000
    peer.core.close()
    assert peer.core.buffered_bytes == 0


def test_decoded_header_list_above_the_advertised_limit_goaway():
    peer = Peer.server_core()
    headers = CONNECT + [(b"x-big", b"v" * 60_000), (b"x-more", b"w" * 5_500)]
    block = hpack.Encoder().encode(headers, huffman=False)
    assert len(block) <= 64 * 1024 + c.HPACK_SLACK_BYTES  # passes the byte bound, not the list bound
    peer.send(frame(f.HEADERS, f.FLAG_END_HEADERS, 1, block))
    assert_terminated(peer, E.ENHANCE_YOUR_CALM, "header list larger")


def test_continuation_interrupted_by_another_frame_is_a_protocol_error():
    peer = Peer.server_core()
    peer.send(frame(f.HEADERS, 0, 1, peer.encoder.encode(CONNECT)) + peer.ping())
    assert_terminated(peer, E.PROTOCOL_ERROR, "interrupted")


def test_garbage_header_block_is_a_compression_error():
    peer = Peer.server_core()
    peer.send(frame(f.HEADERS, f.FLAG_END_HEADERS, 1, b"\xff\xff\xff\xff\xff\xff\xff\xff"))
    assert_terminated(peer, E.COMPRESSION_ERROR, "HPACK")


# Control-frame floods ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "burst", "make"),
    [
        ("SETTINGS", c.SETTINGS_BURST, lambda i: f.settings_frame({f.Setting.MAX_CONCURRENT_STREAMS: 100})),
        ("PING", c.PING_BURST, lambda i: f.ping_frame(i.to_bytes(8, "big"))),
        (
            "PRIORITY",
            c.IGNORED_FRAME_BURST,
            lambda i: frame(f.PRIORITY, 0, 1 + 2 * i, b"\x00\x00\x00\x00\x10"),
        ),
        ("frame type", c.IGNORED_FRAME_BURST, lambda i: frame(0x42, 0, 0, b"junk")),
        ("WINDOW_UPDATE", c.WINDOW_UPDATE_BASE_FRAMES, lambda i: f.window_update_frame(0, 1)),
        ("empty", c.MAX_CONSECUTIVE_EMPTY_FRAMES, lambda i: frame(f.DATA, 0, 1)),
    ],
)
def test_each_control_frame_flood_ends_in_goaway(name, burst, make):
    peer = Peer.server_core()
    open_stream(peer, 1)
    # The opening SETTINGS took one token; the open stream earned WINDOW_UPDATEs.
    extra = {"SETTINGS": 1, "WINDOW_UPDATE": -c.WINDOW_UPDATES_PER_STREAM}.get(name, 0)
    for i in range(burst - extra):
        peer.send(make(i))
        peer.read()  # the peer reads: this is the processing budget, not the outbox bound
    assert peer.terminated() is None
    peer.send(make(burst))
    assert_terminated(peer, E.ENHANCE_YOUR_CALM, name)


def test_rst_stream_flood_on_closed_streams_goaway():
    peer = Peer.server_core()
    open_stream(peer, 1)
    peer.send(peer.rst(1))  # ends the live stream: free
    batch = peer.rst(1) * c.RST_STREAM_BURST
    peer.send(batch)
    assert peer.terminated() is None
    peer.send(peer.rst(1))
    assert_terminated(peer, E.ENHANCE_YOUR_CALM, "RST_STREAM flood")


def test_resets_ending_live_answered_streams_are_no_rst_stream_flood():
    # Envoy in front of a node proxy resets each tunnel whose far side it closed (a waypoint's
    # HTTP/1 upstream closing after a `Connection: close` response): one RST_STREAM per request,
    # at the request rate. Twice the flood burst of them at once must not end the connection.
    peer = Peer.server_core()
    open_stream(peer, 1)  # a long-lived tunnel on the same connection
    for i in range(2 * c.RST_STREAM_BURST):
        sid = 3 + 2 * i
        open_stream(peer, sid)
        peer.send(peer.rst(sid, E.INTERNAL_ERROR))
    assert peer.terminated() is None and 1 in peer.core.streams
    # A reset of a stream already gone still draws from the budget.
    peer.send(peer.rst(3) * c.RST_STREAM_BURST)
    assert peer.terminated() is None
    peer.send(peer.rst(3))
    assert_terminated(peer, E.ENHANCE_YOUR_CALM, "RST_STREAM flood")


def test_a_client_whose_streams_the_server_resets_keeps_its_connection():
    # Our outbound side: Envoy answers each CONNECT, then resets it (CONNECT_ERROR) when its
    # upstream closes; a held stream on the same connection must outlive any number of those.
    peer = Peer.client_core()
    core = peer.core
    held = core.send_request(CONNECT)
    peer.read()
    peer.send(peer.response(held))
    for _ in range(2 * c.RST_STREAM_BURST):
        sid = core.send_request(CONNECT)
        peer.read()
        peer.send(peer.response(sid) + peer.rst(sid, E.CONNECT_ERROR))
    assert core.terminated is None and held in core.streams


def test_window_updates_are_earned_by_data_we_send():
    peer = Peer.server_core()
    open_stream(peer, 1)
    peer.send(peer.window_update(0, 1 << 20) + peer.window_update(1, 1 << 20))
    for _ in range(50):
        assert peer.core.send_data(1, b"x" * 100) == 100
        peer.read()
        peer.send(peer.window_update(0, 100) + peer.window_update(1, 100))  # an honest reader
    assert peer.terminated() is None


def test_ping_budget_refills_with_time():
    peer = Peer.server_core()
    for i in range(200):
        peer.now += 0.25  # 4 PINGs per second: under the 5/s refill
        peer.send(peer.ping(i.to_bytes(8, "big")))
        peer.read()
    assert peer.terminated() is None
    assert len([fr for fr in peer.received if fr.type == f.PING and fr.flags & f.FLAG_ACK]) == 200


def test_settings_with_too_many_entries_is_refused():
    peer = Peer.server_core()
    values = {0x100 + i: 1 for i in range(c.MAX_SETTINGS_ENTRIES + 1)}
    peer.send(f.settings_frame(values))
    assert_terminated(peer, E.ENHANCE_YOUR_CALM, "entries")


def test_peer_that_does_not_read_is_dropped_when_control_frames_pile_up():
    peer = Peer.server_core()
    peer.read()
    for i in range(c.MAX_OUTBOUND_CONTROL_FRAMES):
        peer.now += 0.25  # within the PING budget: only the unread outbox is the problem
        peer.send(peer.ping(i.to_bytes(8, "big")))
    assert peer.terminated() is None
    assert peer.core.outbox_bytes <= 17 * c.MAX_OUTBOUND_CONTROL_FRAMES
    peer.now += 0.25
    peer.send(peer.ping(b"one more"))
    assert peer.terminated().error_code == E.ENHANCE_YOUR_CALM
    assert "does not read" in peer.terminated().reason
    assert peer.core.outbox_bytes <= 17 * (c.MAX_OUTBOUND_CONTROL_FRAMES + 1) + 9 + 8 + c.GOAWAY_DEBUG_BYTES


def test_oversized_frame_is_refused_from_its_header():
    peer = Peer.server_core()
    peer.send(f.frame_header(MiB + 1, f.DATA, 0, 1))
    assert_terminated(peer, E.FRAME_SIZE_ERROR, "SETTINGS_MAX_FRAME_SIZE")


# Flow control: credit conserved however a stream ends ------------------------------------------


def _fill(peer: Peer, sid: int, n: int, *, end_stream: bool = False) -> None:
    chunk = b"d" * (256 * 1024)
    while n > 0:
        k = min(n, len(chunk))
        n -= k
        peer.send(peer.data(sid, chunk[:k], end_stream=end_stream and n == 0))


def _check_all_credit_back(peer: Peer, received: int) -> None:
    peer.read()
    assert peer.core.credit_balance() == CONN_WINDOW
    announced = peer.connection_credit() - (CONN_WINDOW - 65535)
    assert announced + peer.core.unannounced_credit == received


@pytest.mark.parametrize(
    "ending",
    [
        "peer-reset",
        "we-reset",
        "both-ended-unacked",
        "data-after-end",
        "stream-window-exceeded",
        "refused-400",
    ],
)
def test_connection_credit_returns_however_the_stream_ends(ending):
    peer = Peer.server_core()
    open_stream(peer, 1, answer=ending != "refused-400")
    in_flight = 64 * 1024 if ending == "we-reset" else 0
    received = 4 * MiB - in_flight
    _fill(peer, 1, received)  # the app reads nothing: no credit returned yet
    assert peer.core.credit_balance() == CONN_WINDOW
    if ending == "peer-reset":
        peer.send(peer.rst(1))
    elif ending == "we-reset":
        peer.core.reset_stream(1, E.CANCEL)
        _fill(peer, 1, in_flight)  # in flight when our RST left: accepted and credited back
        received += in_flight
        peer.send(peer.data(1, b"!"))  # beyond the stream's window: not in flight, an error
        assert peer.terminated().error_code == E.STREAM_CLOSED
        return
    elif ending == "both-ended-unacked":
        peer.send(peer.data(1, b"", end_stream=True))
        peer.core.end_stream(1)
    elif ending == "data-after-end":
        peer.send(peer.data(1, b"", end_stream=True))
        peer.send(peer.data(1, b"late"))
        received += 4
    elif ending == "stream-window-exceeded":
        peer.send(peer.data(1, b"over"))  # the stream window (4 MiB) is full
        received += 4
    elif ending == "refused-400":
        peer.core.send_response(1, 400)
    assert not peer.core.streams
    _check_all_credit_back(peer, received)


def test_four_aborted_uploads_to_a_slow_app_leave_the_connection_usable():
    """Issue 8, item 3: after a few aborted uploads every later stream delivered 0 bytes."""
    peer = Peer.server_core()
    window = CONN_WINDOW
    for i in range(4):
        sid = 1 + 2 * i
        open_stream(peer, sid)
        _fill(peer, sid, 4 * MiB)
        window -= 4 * MiB
        peer.send(peer.rst(sid))
        window += sum(fr.u32() for fr in peer.read() if fr.type == f.WINDOW_UPDATE and fr.sid == 0)
    assert window == CONN_WINDOW
    open_stream(peer, 9)
    events = []
    _fill(peer, 9, 4 * MiB)
    events = [e for e in peer.events if isinstance(e, ev.DataReceived) and e.stream_id == 9]
    assert sum(len(e.data) for e in events) == 4 * MiB


def test_acknowledged_credit_goes_back_in_few_window_updates():
    peer = Peer.server_core()
    open_stream(peer, 1)
    for _ in range(64):
        peer.send(peer.data(1, b"z" * 16384))
        peer.core.acknowledge(1, 16384)
    updates = [fr for fr in peer.read() if fr.type == f.WINDOW_UPDATE]
    assert sum(fr.u32() for fr in updates if fr.sid == 1) == MiB  # 1 MiB: two updates of 512 KiB
    assert len(updates) <= 2
    assert peer.core.credit_balance() == CONN_WINDOW


def test_padded_data_padding_is_credited_back():
    peer = Peer.server_core()
    open_stream(peer, 1)
    payload = bytes([200]) + b"p" * 100 + b"\x00" * 200
    peer.send(frame(f.DATA, f.FLAG_PADDED, 1, payload))
    data = [e for e in peer.events if isinstance(e, ev.DataReceived)]
    assert b"".join(e.data for e in data) == b"p" * 100
    assert peer.core.credit_balance() == CONN_WINDOW
    peer.core.reset_stream(1)
    _check_all_credit_back(peer, len(payload))


@pytest.mark.parametrize("ftype", [f.DATA, f.HEADERS])
def test_padded_frame_without_room_for_its_pad_length_is_an_error(ftype):
    peer = Peer.server_core()
    peer.send(frame(ftype, f.FLAG_PADDED, 1))
    assert_terminated(peer, E.FRAME_SIZE_ERROR, "padding")


def test_data_split_across_reads_is_delivered_as_it_arrives():
    peer = Peer.server_core()
    open_stream(peer, 1)
    wire = peer.data(1, b"a" * 100_000, end_stream=True)
    got = []
    for i in range(0, len(wire), 7_000):
        got += peer.send(wire[i : i + 7_000])
    data = [e for e in got if isinstance(e, ev.DataReceived)]
    assert len(data) > 10 and b"".join(e.data for e in data) == b"a" * 100_000
    assert isinstance(got[-1], ev.StreamEnded)


def test_data_beyond_the_connection_window_is_a_flow_control_error():
    peer = Peer.server_core()
    for i in range(5):
        open_stream(peer, 1 + 2 * i)
    for i in range(4):
        _fill(peer, 1 + 2 * i, 4 * MiB)
    peer.send(peer.data(9, b"!"))
    assert_terminated(peer, E.FLOW_CONTROL_ERROR, "connection window")


# Sending ------------------------------------------------------------------------------------


def test_send_data_respects_windows_and_frame_size():
    peer = Peer.server_core()
    open_stream(peer, 1)
    assert peer.core.send_window(1) == 65535
    assert peer.core.send_data(1, b"x" * 100_000) == 65535
    frames = [fr for fr in peer.read() if fr.type == f.DATA]
    assert [len(fr.payload) for fr in frames] == [16384, 16384, 16384, 16383]
    assert peer.core.send_data(1, b"y") == 0
    peer.send(f.settings_frame({f.Setting.MAX_FRAME_SIZE: MiB, f.Setting.INITIAL_WINDOW_SIZE: 8 * MiB}))
    peer.send(peer.window_update(0, 8 * MiB))
    assert peer.of(ev.WindowUpdated)
    assert peer.core.send_window(1) == 8 * MiB - 65535
    peer.core.end_stream(1)
    with pytest.raises(StreamClosedError):
        peer.core.send_data(1, b"after end")


def test_bytes_are_framed_without_a_copy():
    peer = Peer.server_core()
    open_stream(peer, 1)
    peer.send(f.settings_frame({f.Setting.MAX_FRAME_SIZE: MiB, f.Setting.INITIAL_WINDOW_SIZE: MiB}))
    peer.send(peer.window_update(0, MiB))
    payload = b"q" * 100_000
    assert peer.core.send_data(1, payload) == 100_000
    out = peer.core.data_to_send()
    assert any(piece is payload for piece in out)


# GOAWAY ------------------------------------------------------------------------------------


def test_server_drain_two_goaways_and_streams_carry_on_both_ways():
    peer = Peer.server_core()
    open_stream(peer, 1)
    peer.core.start_drain(peer.now)
    frames = peer.read()
    assert [fr.name for fr in frames] == ["GOAWAY", "PING"]
    assert frames[0].u32() == 2**31 - 1  # first GOAWAY: "stop soon", every stream still welcome
    peer.send(peer.headers(3))  # raced with the GOAWAY: still accepted
    assert peer.of(ev.RequestReceived)[-1].stream_id == 3
    peer.core.send_response(3, 200)
    peer.send(peer.ping(frames[1].payload, ack=True))
    final = peer.read()[-1]
    assert final.name == "GOAWAY" and final.u32() == 3
    # After the final GOAWAY: new streams refused, open ones carry data both ways.
    peer.send(peer.headers(5))
    peer.read()
    assert peer.resets() == {5: E.REFUSED_STREAM}
    for sid in (1, 3):
        peer.send(peer.data(sid, b"after goaway"))
        assert peer.core.send_data(sid, b"still answering") == 15
    got = [e for e in peer.events if isinstance(e, ev.DataReceived) and e.data == b"after goaway"]
    assert {e.stream_id for e in got} == {1, 3}
    assert peer.terminated() is None
    peer.send(peer.data(1, b"", end_stream=True) + peer.data(3, b"", end_stream=True))
    peer.core.end_stream(1)
    assert peer.terminated() is None  # stream 3 still open
    peer.core.end_stream(3)
    term = peer.terminated()
    assert term is not None and term.clean and term.error_code == E.NO_ERROR


def test_drain_without_a_ping_answer_sends_the_final_goaway_after_the_timeout():
    peer = Peer.server_core()
    peer.core.start_drain(0.0)
    peer.read()
    assert peer.core.next_deadline() == pytest.approx(c.DRAIN_PING_TIMEOUT_S)
    peer.core.handle_timeout(c.DRAIN_PING_TIMEOUT_S)
    assert peer.read()[-1].name == "GOAWAY"
    assert peer.terminated().clean  # no streams: done at once


def test_client_receiving_goaway_keeps_streams_up_to_last_id_and_refuses_the_rest():
    peer = Peer.client_core()
    core = peer.core
    s1 = core.send_request(CONNECT)
    s3 = core.send_request(CONNECT)
    peer.read()
    peer.send(peer.response(s1))
    peer.send(f.goaway_frame(s1, E.NO_ERROR))
    assert peer.of(ev.GoawayReceived) == [ev.GoawayReceived(s1, E.NO_ERROR, b"")]
    assert ev.StreamReset(s3, E.REFUSED_STREAM, answered=False, refused=True) in peer.events
    assert not core.can_open_stream
    with pytest.raises(Http2Error):
        core.send_request(CONNECT)
    # Stream 1 keeps carrying data both ways.
    peer.send(peer.window_update(0, 1000) + peer.data(s1, b"from server after GOAWAY"))
    assert core.send_data(s1, b"from client after GOAWAY") == 24
    assert any(isinstance(e, ev.DataReceived) and e.data == b"from server after GOAWAY" for e in peer.events)
    assert any(fr.payload == b"from client after GOAWAY" for fr in peer.read())
    assert core.terminated is None
    core.end_stream(s1)
    peer.send(peer.data(s1, b"", end_stream=True))
    assert core.terminated is not None and core.terminated.clean


def test_client_drain_is_one_goaway_and_waits_for_streams():
    peer = Peer.client_core()
    s1 = peer.core.send_request(CONNECT)
    peer.send(peer.response(s1))
    peer.core.start_drain(0.0)
    assert peer.read()[-1].name == "GOAWAY"
    assert peer.core.terminated is None
    peer.send(peer.data(s1, b"more", end_stream=True))
    peer.core.end_stream(s1)
    assert peer.core.terminated.clean


# Requests ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "why"),
    [
        (CONNECT + [(b":protocol", b"websocket")], "extended CONNECT"),
        ([(b":method", b"CONNECT"), (b":protocol", b"websocket"), (b":authority", b"a:1")], "extended"),
        ([(b":method", b"CONNECT"), (b":authority", b"a:1"), (b":path", b"/")], ":path"),
        ([(b":method", b"CONNECT")], ":authority"),
        ([(b":authority", b"a:1")], ":method"),
        (CONNECT + [(b"Upper", b"x")], "lowercase"),
        (CONNECT + [(b"", b"x")], "lowercase"),  # a token is 1*tchar (RFC 9110 5.6.2)
        (CONNECT + [(b"connection", b"close")], "connection-specific"),
        ([(b"x", b"1")] + CONNECT, "pseudo-header after"),
        (CONNECT + [(b"x", b"a\r\nb")], "CR or LF"),
        (CONNECT + [(b"x", b"a\x00b")], "NUL"),
        (CONNECT + [(b"x", b"a\nb")], "CR or LF"),
        (CONNECT + [(b"x", b"a\rb")], "CR or LF"),
        ([(b":method", b"CONNECT"), (b":authority", b"a:1\n")], "CR or LF"),
    ],
)
def test_malformed_and_extended_connect_are_reset_before_the_app(headers, why):
    peer = Peer.server_core()
    events = peer.send(peer.headers(1, headers))
    assert not any(isinstance(e, ev.RequestReceived) for e in events)
    [refused] = [e for e in events if isinstance(e, ev.RequestRefused)]
    assert why in refused.reason
    peer.read()
    assert peer.resets() == {1: E.PROTOCOL_ERROR}


def test_get_is_answered_400_by_the_core():
    peer = Peer.server_core()
    get = [(b":method", b"GET"), (b":scheme", b"https"), (b":path", b"/"), (b":authority", b"a:1")]
    events = peer.send(peer.headers(1, get, end_stream=True))
    assert [type(e) for e in events] == [ev.RequestRefused]
    [response] = [fr for fr in peer.read() if fr.type == f.HEADERS]
    assert peer.decoder.decode(response.payload) == [(":status", "400")]
    assert response.flags & f.FLAG_END_STREAM


def test_request_headers_reach_the_shell():
    peer = Peer.server_core()
    headers = CONNECT + [
        (b"forwarded", b"for=10.0.0.1"),
        (b"baggage", b"k=v"),
        (b"traceparent", b"00-1-2-00"),
    ]
    [request] = peer.send(peer.headers(1, headers))
    assert request.headers == (
        ("forwarded", "for=10.0.0.1"),
        ("baggage", "k=v"),
        ("traceparent", "00-1-2-00"),
    )


def test_non_200_response_ends_and_resets_an_open_request():
    peer = Peer.server_core()
    open_stream(peer, 1, answer=False)
    peer.core.send_response(1, 401)
    frames = peer.read()
    assert [fr.name for fr in frames] == ["HEADERS", "RST_STREAM"]
    assert frames[0].flags & f.FLAG_END_STREAM and peer.resets() == {1: E.NO_ERROR}


@pytest.mark.parametrize("name", [b"", b"X-Upper", b"a b"])
def test_response_with_a_field_name_that_is_no_lowercase_token_resets_the_stream(name):
    peer = Peer.client_core()
    sid = peer.core.send_request(CONNECT)
    events = peer.send(peer.headers(sid, [(b":status", b"200"), (name, b"v")]))
    assert not any(isinstance(e, ev.ResponseReceived) for e in events)
    peer.read()
    assert peer.resets() == {sid: E.PROTOCOL_ERROR}


def test_client_response_informational_then_final():
    peer = Peer.client_core()
    sid = peer.core.send_request(CONNECT)
    assert peer.send(peer.response(sid, 100)) == []
    [response] = peer.send(peer.response(sid, 200))
    assert response.status == 200 and not response.end_stream


# Keepalive ----------------------------------------------------------------------------------


def test_ping_every_interval_and_terminate_without_answer():
    peer = Peer.client_core()
    core = peer.core
    assert core.next_deadline() == 10.0
    core.handle_timeout(10.0)
    ping = peer.read()[-1]
    assert ping.name == "PING" and not ping.flags
    peer.now = 11.0
    peer.send(peer.ping(ping.payload, ack=True))
    core.handle_timeout(20.0)
    core.handle_timeout(30.0)  # this PING is never answered: 20 s after it was sent, dropped
    assert core.terminated is None
    core.handle_timeout(40.0)
    assert core.terminated is not None and "no PING answer" in core.terminated.reason
    assert not core.terminated.clean


# Two cores -----------------------------------------------------------------------------------


def _shuttle(a: Connection, b: Connection, now: float = 0.0) -> tuple[list, list]:
    """Move bytes both ways until quiet; the events each side saw."""
    ea, eb = [], []
    for _ in range(1000):
        out_a = b"".join(bytes(p) for p in a.data_to_send())
        out_b = b"".join(bytes(p) for p in b.data_to_send())
        if not out_a and not out_b:
            break
        new_a = a.receive(out_b, now) if out_b else []
        new_b = b.receive(out_a, now) if out_a else []
        ea += new_a
        eb += new_b
        for events, core in ((new_a, a), (new_b, b)):
            for e in events:
                if isinstance(e, ev.DataReceived):
                    core.acknowledge(e.stream_id, len(e.data))
    return ea, eb


def test_two_cores_carry_a_tunnel_with_half_close_and_drain():
    client = Connection(
        CoreSettings(client_side=True, max_header_list_bytes=16 * 1024, max_concurrent_streams=None)
    )
    server = Connection(CoreSettings(client_side=False))
    client.initiate(0.0)
    server.initiate(0.0)
    _shuttle(client, server)
    sid = client.send_request(CONNECT + [(b"baggage", b"k=v")])
    _, server_events = _shuttle(client, server)
    [request] = [e for e in server_events if isinstance(e, ev.RequestReceived)]
    server.send_response(sid, 200)
    client_events, _ = _shuttle(client, server)
    assert [e.status for e in client_events if isinstance(e, ev.ResponseReceived)] == [200]
    up, down = b"u" * (12 * MiB), b"d" * (9 * MiB)
    sent_up = sent_down = 0
    got_up = bytearray()
    got_down = bytearray()
    for _ in range(200):
        if sent_up < len(up):
            sent_up += client.send_data(sid, up[sent_up:])
        if sent_down < len(down):
            sent_down += server.send_data(sid, down[sent_down:])
        ce, se = _shuttle(client, server)
        got_down += b"".join(e.data for e in ce if isinstance(e, ev.DataReceived))
        got_up += b"".join(e.data for e in se if isinstance(e, ev.DataReceived))
        if sent_up == len(up) and sent_down == len(down):
            break
    assert bytes(got_up) == up and bytes(got_down) == down
    server.start_drain(0.0)  # GOAWAY while the tunnel is open: it keeps working
    _shuttle(client, server)
    assert client.goaway_received is not None and not client.can_open_stream
    assert client.send_data(sid, b"after drain") == 11
    client.end_stream(sid)
    _, se = _shuttle(client, server)
    assert b"".join(e.data for e in se if isinstance(e, ev.DataReceived)) == b"after drain"
    assert any(isinstance(e, ev.StreamEnded) for e in se)
    server.end_stream(sid)
    _shuttle(client, server)
    assert server.terminated is not None and server.terminated.clean
    assert client.terminated is not None and client.terminated.clean
    assert client.credit_balance() == server.credit_balance() == CONN_WINDOW  # all credit back


@pytest.mark.parametrize("split", [False, True])
def test_header_blocks_and_end_stream_carry_their_flags_whole_or_split(split):
    """A request and a response with END_STREAM, and a lone END_STREAM, give the same events and
    stream states read whole (one read per frame: the core's one-read path) or a byte at a time."""

    def send(peer: Peer, wire: bytes) -> list:
        if not split:
            return peer.send(wire)
        return [e for i in range(len(wire)) for e in peer.send(wire[i : i + 1])]

    server = Peer.server_core()
    [request] = send(server, server.headers(1, CONNECT, end_stream=True))
    assert type(request) is ev.RequestReceived and request.end_stream
    assert server.core.streams[1].remote_closed
    [request] = send(server, server.headers(3, CONNECT))
    assert not request.end_stream
    server.core.send_response(3, 200)
    server.core.end_stream(3)
    assert send(server, server.data(3, b"", end_stream=True)) == [ev.StreamEnded(3)]
    assert 3 not in server.core.streams  # both halves closed: gone

    client = Peer.client_core()
    sid = client.core.send_request(CONNECT)
    assert send(client, client.response(sid, end_stream=True)) == [ev.ResponseReceived(sid, 200, (), True)]
    assert client.core.streams[sid].remote_closed


def test_field_names_checked_once_are_remembered_within_bounds():
    """Names that passed the token check are a set lookup the next time; a peer's endless new
    names fill the set only to MAX_CHECKED_NAMES, long names are never kept, and a bad name is
    refused however many good ones came before."""
    c._CHECKED_NAMES.clear()
    peer = Peer.server_core(max_concurrent_streams=None)
    sid = 1
    for i in range(c.MAX_CHECKED_NAMES + 50):
        [request] = peer.send(peer.headers(sid, CONNECT + [(f"x-{i}".encode(), b"v")]))
        assert type(request) is ev.RequestReceived
        peer.core.reset_stream(sid)
        sid += 2
    long_name = b"x" * (c.MAX_CHECKED_NAME_BYTES + 1)
    [request] = peer.send(peer.headers(sid, CONNECT + [(long_name, b"v")]))
    assert type(request) is ev.RequestReceived
    assert len(c._CHECKED_NAMES) == c.MAX_CHECKED_NAMES and long_name not in c._CHECKED_NAMES
    events = peer.send(peer.headers(sid + 2, CONNECT + [(b"x-0", b"v"), (b"X-Upper", b"v")]))
    assert [type(e) for e in events] == [ev.RequestRefused]
