"""Playbook and property tests of the HTTP/2 core's per-stream send state: the bounded send queue
drained as windows open and as output resumes, the END_STREAM waiting behind it, `StreamWritable`
when a queue empties, and receive credit held while the shell's consumer is paused.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ambient_mesh.http2 import Connection, CoreSettings, SendQueueFull, StreamClosedError
from ambient_mesh.http2 import events as ev
from ambient_mesh.http2 import frames as f
from tests.helpers.http2_peer import CONNECT, Peer

MiB = 1024 * 1024


def served(**settings) -> Peer:
    """A server core with stream 1 open and answered (the peer is its client)."""
    peer = Peer.server_core(**settings)
    peer.send(peer.headers(1))
    peer.core.send_response(1, 200)
    peer.read()
    return peer


def data_of(frames, sid: int) -> bytes:
    return b"".join(fr.payload for fr in frames if fr.type == f.DATA and fr.sid == sid)


def ends_of(frames, sid: int) -> int:
    return sum(1 for fr in frames if fr.type == f.DATA and fr.sid == sid and fr.flags & f.FLAG_END_STREAM)


def writable(peer: Peer) -> list[ev.StreamWritable]:
    """StreamWritable events since the last call: from `receive` and from the shell's verbs."""
    events, peer.events = peer.events + peer.core.take_events(), []
    return [e for e in events if type(e) is ev.StreamWritable]


# The queue and the windows -----------------------------------------------------------------------


def test_send_frames_what_the_window_takes_and_queues_the_rest_until_window_update():
    peer = served()  # the client's initial stream window: 65,535
    payload = bytes(range(256)) * 400  # 102,400 bytes
    assert peer.core.send(1, payload) is False  # the producer must stop
    assert peer.core.waiting(1) and peer.core.queued_bytes(1) == len(payload) - 65_535
    assert data_of(peer.read(), 1) == payload[:65_535]
    assert peer.core.send(1, b"more") is False  # behind what waits, never around it
    peer.send(peer.window_update(0, MiB) + peer.window_update(1, 20_000))
    assert data_of(peer.read(), 1) == payload[65_535 : 65_535 + 20_000]
    assert not writable(peer)  # still holding bytes
    peer.send(peer.window_update(1, MiB))
    assert data_of(peer.read(), 1) == payload[65_535 + 20_000 :] + b"more"
    assert writable(peer) == [ev.StreamWritable(1, False)]
    assert not peer.core.waiting(1) and peer.core.queued_bytes(1) == 0
    assert peer.core.send(1, b"free") is True  # nothing waits: framed at once
    assert data_of(peer.read(), 1) == b"free"


def test_end_stream_waits_behind_queued_bytes_and_is_reported_with_them():
    peer = served()
    assert peer.core.send(1, b"x" * 70_000) is False
    assert peer.core.end(1) is False  # END_STREAM behind 4,465 queued bytes
    with pytest.raises(StreamClosedError):
        peer.core.send(1, b"after end")
    frames = peer.read()
    assert ends_of(frames, 1) == 0
    peer.send(peer.window_update(0, MiB) + peer.window_update(1, MiB))
    frames = peer.read()
    assert len(data_of(frames, 1)) == 70_000 - 65_535 and ends_of(frames, 1) == 1
    assert frames[-1].flags & f.FLAG_END_STREAM  # after the last byte
    assert writable(peer) == [ev.StreamWritable(1, True)]


def test_end_with_nothing_queued_goes_at_once():
    peer = served()
    assert peer.core.end(1) is True
    assert ends_of(peer.read(), 1) == 1
    with pytest.raises(StreamClosedError):
        peer.core.end(1)


def test_the_connection_window_drains_streams_in_the_order_they_started_waiting():
    peer = Peer.server_core()
    for sid in (1, 3):
        peer.send(peer.headers(sid))
        peer.core.send_response(sid, 200)
    peer.send(peer.window_update(1, MiB) + peer.window_update(3, MiB))
    peer.read()
    assert peer.core.send(3, b"3" * 65_535) is True  # takes the whole connection window
    assert peer.core.send(1, b"1" * 100) is False
    assert peer.core.send(3, b"3" * 100) is False
    peer.read()
    peer.send(peer.window_update(0, 150))
    frames = peer.read()
    assert [(fr.sid, len(fr.payload)) for fr in frames if fr.type == f.DATA] == [(1, 100), (3, 50)]
    assert writable(peer) == [ev.StreamWritable(1, False)]


def test_a_settings_window_increase_drains_queues():
    peer = served()
    assert peer.core.send(1, b"s" * 70_000) is False
    peer.read()
    peer.send(peer.window_update(0, MiB) + f.settings_frame({f.Setting.INITIAL_WINDOW_SIZE: 1 << 20}))
    assert len(data_of(peer.read(), 1)) == 70_000 - 65_535
    assert writable(peer) == [ev.StreamWritable(1, False)]


def test_the_queue_bound_drops_the_queue_and_names_the_bound():
    peer = served(max_stream_queued_bytes=64 * 1024)
    peer.core.pause_output()
    for _ in range(4):
        assert peer.core.send(1, b"q" * 16 * 1024) is False
    assert peer.core.queued_bytes(1) == 64 * 1024  # at the bound: held
    with pytest.raises(SendQueueFull, match="past its bound of 65536"):
        peer.core.send(1, b"!")
    assert peer.core.queued_bytes(1) == 0 and not peer.core.waiting(1)
    peer.core.reset_stream(1)  # what the shell does next
    peer.core.resume_output()
    frames = peer.read()
    assert data_of(frames, 1) == b"" and peer.resets() == {1: f.ErrorCode.CANCEL}


def test_a_peer_reset_drops_the_queue_and_reports_no_writable():
    peer = served()
    assert peer.core.send(1, b"r" * 70_000) is False
    assert peer.core.end(1) is False
    peer.read()
    peer.send(peer.rst(1))
    assert not peer.core.waiting(1) and peer.core.queued_bytes(1) == 0
    peer.send(peer.window_update(0, MiB))
    assert data_of(peer.read(), 1) == b"" and not writable(peer)


def test_our_reset_drops_what_the_stream_had_queued():
    peer = served()
    peer.core.pause_output()
    assert peer.core.send(1, b"held") is False
    assert peer.core.end(1) is False
    peer.core.reset_stream(1, f.ErrorCode.CANCEL)
    assert not peer.core.waiting(1)
    peer.core.resume_output()
    frames = peer.read()
    assert data_of(frames, 1) == b"" and ends_of(frames, 1) == 0 and peer.resets() == {1: f.ErrorCode.CANCEL}
    assert not writable(peer)


# Output paused (the shell's transport backpressure) -----------------------------------------------


def test_paused_output_queues_everything_and_resume_drains_every_stream():
    peer = Peer.server_core()
    for sid in (1, 3):
        peer.send(peer.headers(sid))
        peer.core.send_response(sid, 200)
    peer.read()
    peer.core.pause_output()
    assert peer.core.data_header(1, 1) is None  # no bytes around the pause
    assert peer.core.send(1, b"one") is False and peer.core.send(3, b"three") is False
    assert peer.core.end(3) is False
    assert data_of(peer.read(), 1) == b""
    peer.core.resume_output()
    frames = peer.read()
    assert data_of(frames, 1) == b"one" and data_of(frames, 3) == b"three" and ends_of(frames, 3) == 1
    assert writable(peer) == [ev.StreamWritable(1, False), ev.StreamWritable(3, True)]


def test_paused_again_while_resuming_leaves_no_stream_behind():
    # The stall the shell once had (4 streams sharing a connection under load): resuming wrote
    # the first stream's bytes, the transport filled and paused again at once, a second stream's
    # read in flight went into its queue, and only the streams known to be blocked were drained
    # at the next resume, so that stream's bytes and END_STREAM stayed behind for good.
    peer = Peer.server_core()
    for sid in (1, 3):
        peer.send(peer.headers(sid))
        peer.core.send_response(sid, 200)
    peer.read()
    core = peer.core
    core.pause_output()
    assert core.send(1, b"a" * 1000) is False
    core.resume_output()  # drains stream 1 into the outbox ...
    core.pause_output()  # ... and writing it fills the transport again, before anything else
    got = peer.read()  # what the shell wrote when it could
    assert core.send(3, b"b" * 2000) is False  # the second stream's read in flight
    assert core.end(3) is False
    assert core.waiting(3) and not core.waiting(1)
    core.resume_output()
    got += peer.read()
    assert data_of(got, 1) == b"a" * 1000 and data_of(got, 3) == b"b" * 2000 and ends_of(got, 3) == 1
    assert not core.waiting(1) and not core.waiting(3)
    assert writable(peer) == [
        ev.StreamWritable(1, False),
        ev.StreamWritable(3, True),
    ]


# Receive credit held while the consumer is paused ------------------------------------------------


def test_held_credit_is_returned_at_release_and_conserved_meanwhile():
    peer = served()
    core = peer.core
    peer.send(peer.data(1, b"d" * MiB))
    core.hold_credit(1)
    core.acknowledge(1, MiB)  # consumed, but the consumer's own socket is full
    assert core.credit_balance() == 16 * MiB
    assert not [fr for fr in peer.read() if fr.type == f.WINDOW_UPDATE]
    core.release_credit(1)
    updates = {fr.sid: fr.u32() for fr in peer.read() if fr.type == f.WINDOW_UPDATE}
    assert updates == {1: MiB}  # the stream's credit, owed at 1/8 of its window
    assert core.credit_balance() == 16 * MiB
    core.release_credit(1)  # twice: nothing more
    assert not peer.read()


def test_held_credit_never_exceeds_what_was_delivered():
    peer = served()
    peer.send(peer.data(1, b"d" * 100))
    peer.core.hold_credit(1)
    peer.core.acknowledge(1, 10_000)
    peer.core.release_credit(1)
    assert peer.core.credit_balance() == 16 * MiB
    assert peer.core.unannounced_credit == 100


# Properties -----------------------------------------------------------------------------------------

STEPS = st.lists(
    st.tuples(
        st.sampled_from(["send", "send", "send", "end", "window", "window0", "pause", "resume", "read"]),
        st.sampled_from([1, 3, 5]),
        st.sampled_from([0, 1, 100, 16_384, 40_000, 70_000, 200_000]),
    ),
    max_size=40,
)


def peer_step(peer: Peer, action: str, sid: int, n: int) -> None:
    """The steps that are not the stream's own: the peer's window updates, output paused and resumed."""
    if action == "window":
        peer.send(peer.window_update(sid, n + 1))
    elif action == "window0":
        peer.send(peer.window_update(0, n + 1))
    elif action == "pause":
        peer.core.pause_output()
    elif action == "resume":
        peer.core.resume_output()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(STEPS)
def test_random_writes_window_updates_and_pauses_lose_and_duplicate_nothing(steps):
    """Any interleaving of sends (each a distinct byte pattern), ends, window updates, output
    paused and resumed and the peer reading: once output resumes and the windows open, each
    stream's bytes arrive exactly once, in order, END_STREAM after the last of them; a stream
    is reported writable exactly when its queue emptied; nothing exceeds its bound."""
    peer = Peer.server_core()
    core = peer.core
    sent: dict[int, bytearray] = {}
    ended: set[int] = set()
    for sid in (1, 3, 5):
        peer.send(peer.headers(sid))
        core.send_response(sid, 200)
        sent[sid] = bytearray()
    got = peer.read()
    counter = 0
    for action, sid, n in steps:
        if action == "send" and sid not in ended:
            counter += 1
            chunk = bytes((counter + i) & 0xFF for i in range(n))
            was_waiting = core.waiting(sid) or (core.output_paused and n > 0)
            ok = core.send(sid, chunk)
            sent[sid] += chunk
            assert ok is not core.waiting(sid)
            if was_waiting:
                assert not ok
        elif action == "end" and sid not in ended:
            ended.add(sid)
            core.end(sid)
        elif action == "read" and not core.output_paused:  # the shell writes only while it may
            got += peer.read()
        else:
            peer_step(peer, action, sid, n)
        assert all(core.queued_bytes(s) <= core.settings.max_stream_queued_bytes for s in sent)
        assert core.credit_balance() == core.settings.connection_window_bytes
    core.resume_output()
    peer.send(peer.window_update(0, 1 << 30) + b"".join(peer.window_update(s, 1 << 30) for s in sent))
    got += peer.read()
    for sid, data in sent.items():
        assert data_of(got, sid) == bytes(data), sid
        assert ends_of(got, sid) == (1 if sid in ended else 0)
        if sid in ended:
            last = [fr for fr in got if fr.type == f.DATA and fr.sid == sid][-1]
            assert last.flags & f.FLAG_END_STREAM
        assert not core.waiting(sid)


class _SendOnly(Connection):
    """Never the fast path: every chunk through `send` (Connection has slots: a subclass)."""

    __slots__ = ()

    def data_header(self, sid: int, n: int) -> bytes | None:
        return None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(STEPS)
def test_the_shells_send_fast_path_writes_what_send_alone_would(steps):
    """The HBONE shell's one send fast path (`data_header`, then the header and payload written
    straight to the transport) against `send` alone, for the same steps: the same bytes on the
    wire in the same order at every step, the same windows and queues."""
    fast_core = Connection(CoreSettings(client_side=False), now=0.0)
    slow_core = Connection(CoreSettings(client_side=False), now=0.0)
    slow_core.__class__ = _SendOnly
    peers = [Peer(fast_core, client=True), Peer(slow_core, client=True)]
    wires = [bytearray(), bytearray()]
    for peer in peers:
        peer.core.initiate(0.0)
        peer.send(f.CLIENT_PREFACE + f.settings_frame({}))
        for sid in (1, 3, 5):
            peer.send(peer.headers(sid, CONNECT))
            peer.core.send_response(sid, 200)
    ended: set[int] = set()
    counter = 0
    for action, sid, n in steps:
        counter += 1
        for peer, wire in zip(peers, wires, strict=True):
            core = peer.core
            if action == "send" and sid not in ended:
                chunk = bytes((counter + i) & 0xFF for i in range(n))
                header = core.data_header(sid, n)
                if header is not None:
                    wire += b"".join(bytes(p) for p in core.data_to_send())  # empty: it declines otherwise
                    wire += header + chunk
                else:
                    core.send(sid, chunk)
            elif action == "end" and sid not in ended:
                core.end(sid)
            else:
                peer_step(peer, action, sid, n)
            if not core.output_paused:
                wire += b"".join(bytes(p) for p in core.data_to_send())
        if action == "end":
            ended.add(sid)
        assert wires[0] == wires[1]
        assert [fast_core.send_window(s) for s in (1, 3, 5)] == [slow_core.send_window(s) for s in (1, 3, 5)]
        assert [fast_core.queued_bytes(s) for s in (1, 3, 5)] == [
            slow_core.queued_bytes(s) for s in (1, 3, 5)
        ]
        reported = [writable(peer) for peer in peers]
        assert reported[0] == reported[1]
