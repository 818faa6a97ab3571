"""HBONE's HTTP/2 layer driven without sockets: our HboneConnection against a plain h2 peer.

Each test wires one HboneConnection to an `h2` connection through in-memory transports and
checks what goes over the wire: settings, windows, the CONNECT request's exact pseudo-headers,
half-close, and that received bytes are acknowledged only while the reader keeps up.
"""

from __future__ import annotations

import asyncio

import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest

from ambient_mesh.proxy.hbone import (
    CONNECTION_WINDOW_BYTES,
    MAX_FRAME_BYTES,
    SERVER_MAX_CONCURRENT_STREAMS,
    STREAM_WINDOW_BYTES,
    HboneConnection,
)
from ambient_mesh.proxy.hbone import settings as hs
from ambient_mesh.transport.relay import Endpoint, Relay


class MemoryTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False

    def write(self, data) -> None:
        self.out += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def get_extra_info(self, name, default=None):
        return default

    def take(self) -> bytes:
        data = bytes(self.out)
        self.out.clear()
        return data


class RecordingEndpoint(Endpoint):
    """The TCP side of a relay, recording what reaches it."""

    def __init__(self) -> None:
        self.relay = None
        self.received = bytearray()
        self.eof = False
        self.aborted = False
        self.paused = False

    def write(self, data: bytes) -> None:
        self.received += data

    def write_eof(self) -> None:
        self.eof = True

    def abort(self) -> None:
        self.aborted = True

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def close(self) -> None:
        pass


def peer(client_side: bool) -> h2.connection.H2Connection:
    conn = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=client_side, header_encoding="utf-8")
    )
    conn.initiate_connection()
    return conn


def exchange(ours: HboneConnection, transport: MemoryTransport, theirs: h2.connection.H2Connection) -> list:
    """Move bytes both ways until both sides are quiet; return the peer's events."""
    events = []
    for _ in range(20):
        moved = False
        data = transport.take()
        if data:
            events += theirs.receive_data(data)
            moved = True
        back = theirs.data_to_send()
        if back:
            ours.data_received(back)
            moved = True
        if not moved:
            break
    return events


async def test_client_settings_and_connection_window_match_ztunnel():
    ours = HboneConnection(client_side=True)
    transport = MemoryTransport()
    ours.connection_made(transport)
    server = peer(client_side=False)
    events = exchange(ours, transport, server)
    settings = next(e for e in events if isinstance(e, h2.events.RemoteSettingsChanged)).changed_settings
    assert (
        settings[h2.settings.SettingCodes.INITIAL_WINDOW_SIZE].new_value
        == STREAM_WINDOW_BYTES
        == 4 * 1024 * 1024
    )
    assert settings[h2.settings.SettingCodes.MAX_FRAME_SIZE].new_value == MAX_FRAME_BYTES == 1024 * 1024
    assert settings[h2.settings.SettingCodes.ENABLE_PUSH].new_value == 0
    assert settings[h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE].new_value == 16 * 1024
    update = next(e for e in events if isinstance(e, h2.events.WindowUpdated) and e.stream_id == 0)
    assert update.delta + 65535 == CONNECTION_WINDOW_BYTES == 16 * 1024 * 1024
    ours._cancel_timers()


async def test_server_advertises_200_streams_and_64k_header_list():
    ours = HboneConnection(client_side=False)
    transport = MemoryTransport()
    client = peer(client_side=True)
    ours.connection_made(transport)
    ours.data_received(client.data_to_send())
    events = client.receive_data(transport.take())
    settings = next(e for e in events if isinstance(e, h2.events.RemoteSettingsChanged)).changed_settings
    assert (
        settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS].new_value == SERVER_MAX_CONCURRENT_STREAMS
    )
    assert settings[h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE].new_value == 64 * 1024
    ours._cancel_timers()


async def test_server_streams_hold_no_response_future_and_survive_an_early_reset():
    """Nobody awaits a CONNECT's answer on the server side, so its streams carry no future (152
    bytes of every idle tunnel); a reset before the answer still cancels what on_request started."""
    started = []

    class Started:
        cancelled = False

        def cancel(self) -> None:
            self.cancelled = True

    def on_request(stream):
        started.append((stream, Started()))
        return started[-1][1]

    ours = HboneConnection(client_side=False, on_request=on_request)
    transport = MemoryTransport()
    client = peer(client_side=True)
    ours.connection_made(transport)
    exchange(ours, transport, client)
    client.send_headers(1, [(":method", "CONNECT"), (":authority", "10.0.0.3:8080")])
    exchange(ours, transport, client)
    [(stream, task)] = started
    assert stream.response is None and stream.request.authority == "10.0.0.3:8080"
    client.reset_stream(1)
    exchange(ours, transport, client)
    assert task.cancelled and ours.open_streams == 0
    ours._cancel_timers()


async def test_connect_request_carries_only_method_and_authority_pseudo_headers():
    ours = HboneConnection(client_side=True)
    transport = MemoryTransport()
    ours.connection_made(transport)
    server = peer(client_side=False)
    exchange(ours, transport, server)
    opening = asyncio.ensure_future(
        ours.open_stream("[fd00::3]:8080", [("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-00")])
    )
    await asyncio.sleep(0)
    events = exchange(ours, transport, server)
    request = next(e for e in events if isinstance(e, h2.events.RequestReceived))
    pseudo = [(k, v) for k, v in request.headers if k.startswith(":")]
    assert pseudo == [(":method", "CONNECT"), (":authority", "[fd00::3]:8080")]
    server.send_headers(request.stream_id, [(":status", "200")])
    exchange(ours, transport, server)
    stream, response = await opening
    assert response.status == 200
    ours._cancel_timers()


async def _open(ours, transport, server):
    exchange(ours, transport, server)
    opening = asyncio.ensure_future(ours.open_stream("10.0.0.3:8080", []))
    await asyncio.sleep(0)
    events = exchange(ours, transport, server)
    sid = next(e for e in events if isinstance(e, h2.events.RequestReceived)).stream_id
    server.send_headers(sid, [(":status", "200")])
    exchange(ours, transport, server)
    stream, _ = await opening
    tcp = RecordingEndpoint()
    relay = Relay(tcp, stream)
    stream.attach(relay)
    return stream, tcp, relay, sid


async def test_half_close_each_way_and_relay_finishes():
    ours = HboneConnection(client_side=True)
    transport = MemoryTransport()
    ours.connection_made(transport)
    server = peer(client_side=False)
    stream, tcp, relay, sid = await _open(ours, transport, server)
    relay.data_from(tcp, b"request")
    relay.eof_from(tcp)  # client half-closes: END_STREAM must go out
    events = exchange(ours, transport, server)
    data = b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived))
    assert data == b"request"
    assert any(isinstance(e, h2.events.StreamEnded) for e in events)
    assert not relay.done.done()  # the other direction is still open
    server.send_data(sid, b"response", end_stream=True)
    exchange(ours, transport, server)
    assert bytes(tcp.received) == b"response" and tcp.eof
    assert relay.done.done() and relay.done.result() is None
    assert ours.open_streams == 0
    ours._cancel_timers()


async def test_received_bytes_are_acknowledged_only_while_the_reader_keeps_up():
    ours = HboneConnection(client_side=True)
    transport = MemoryTransport()
    ours.connection_made(transport)
    server = peer(client_side=False)
    stream, tcp, relay, sid = await _open(ours, transport, server)
    stream.pause_reading()  # the TCP reader is slow: hold the window credit
    for _ in range(3):
        server.send_data(sid, b"x" * 1_000_000)  # 1 MiB frames are allowed: we advertised MAX_FRAME_SIZE
    events = exchange(ours, transport, server)
    assert not any(isinstance(e, h2.events.WindowUpdated) and e.stream_id == sid for e in events)
    assert len(tcp.received) == 3_000_000
    stream.resume_reading()  # the reader caught up: the credit goes back in one WINDOW_UPDATE
    events = exchange(ours, transport, server)
    updates = [e for e in events if isinstance(e, h2.events.WindowUpdated) and e.stream_id == sid]
    assert sum(e.delta for e in updates) == 3_000_000
    ours._cancel_timers()


async def test_sender_stops_reading_when_the_peer_window_is_exhausted():
    ours = HboneConnection(client_side=True)
    transport = MemoryTransport()
    ours.connection_made(transport)
    server = peer(client_side=False)  # h2 default: 65535-byte windows, never acknowledged here
    stream, tcp, relay, sid = await _open(ours, transport, server)
    relay.data_from(tcp, b"y" * 100_000)
    assert tcp.paused  # our window at the peer is 65535: the rest waits and the TCP side pauses
    events = exchange(ours, transport, server)
    got = sum(len(e.data) for e in events if isinstance(e, h2.events.DataReceived))
    assert got == 65535
    server.acknowledge_received_data(got, sid)
    server.increment_flow_control_window(100_000)
    exchange(ours, transport, server)
    assert not tcp.paused
    ours._cancel_timers()


async def test_half_close_waits_behind_bytes_the_window_holds_back():
    """END_STREAM goes at once when nothing waits for window, and after the bytes that do."""
    ours = HboneConnection(client_side=True)
    transport = MemoryTransport()
    ours.connection_made(transport)
    server = peer(client_side=False)  # h2 default: 65535-byte windows
    stream, tcp, relay, sid = await _open(ours, transport, server)
    relay.data_from(tcp, b"y" * 100_000)
    relay.eof_from(tcp)
    events = exchange(ours, transport, server)
    assert sum(len(e.data) for e in events if isinstance(e, h2.events.DataReceived)) == 65535
    assert not any(isinstance(e, h2.events.StreamEnded) for e in events)
    server.acknowledge_received_data(65535, sid)
    server.increment_flow_control_window(100_000)
    server.increment_flow_control_window(100_000, stream_id=sid)
    events = exchange(ours, transport, server)
    kinds = [type(e) for e in events if isinstance(e, (h2.events.DataReceived, h2.events.StreamEnded))]
    assert kinds[-1] is h2.events.StreamEnded and h2.events.DataReceived in kinds
    assert sum(len(e.data) for e in events if isinstance(e, h2.events.DataReceived)) == 100_000 - 65535
    server.send_data(sid, b"", end_stream=True)
    exchange(ours, transport, server)
    assert relay.done.done() and ours.open_streams == 0
    ours._cancel_timers()


async def test_ping_every_interval_and_drop_without_answer():
    from ambient_mesh.proxy.hbone import HboneSettings

    settings = HboneSettings(ping_interval_s=0.05, ping_timeout_s=0.12)
    answered = HboneConnection(client_side=True, settings=settings)
    silent = HboneConnection(client_side=True, settings=settings)
    t_answered, t_silent = MemoryTransport(), MemoryTransport()
    answered.connection_made(t_answered)
    silent.connection_made(t_silent)
    peer_answering = peer(client_side=False)
    exchange(answered, t_answered, peer_answering)
    t_silent.take()
    pings = 0
    for _ in range(6):  # 0.3 s: several intervals, longer than the timeout
        await asyncio.sleep(0.05)
        events = exchange(answered, t_answered, peer_answering)  # the peer acks every PING
        pings += sum(isinstance(e, h2.events.PingReceived) for e in events)
    assert pings >= 2
    assert not t_answered.closed  # answered PINGs keep the connection
    assert t_silent.closed  # no PONG within the timeout: dropped
    assert "no PING answer" in str(silent.error)
    answered._cancel_timers()
    silent._cancel_timers()


class KeepingEndpoint(RecordingEndpoint):
    """Keeps every chunk object as written (a socket that could not send them yet holds them so)."""

    def __init__(self) -> None:
        super().__init__()
        self.chunks: list = []

    def write(self, data) -> None:
        self.chunks.append(data)


def _read_into_buffer(ours: asyncio.BufferedProtocol, data: bytes) -> int:
    """What uvloop does for a BufferedProtocol: read (or decrypt) into get_buffer's buffer and
    let go of it. Returns the buffer's id."""
    buf = ours.get_buffer(len(data))
    buf[: len(data)] = data
    which = id(buf.obj)
    buf.release()
    ours.buffer_updated(len(data))
    return which


async def test_receive_buffer_is_reused_only_once_no_view_of_it_is_left():
    """TLS decrypts into one shared buffer. Small DATA payloads are copied out of it, so the next
    read reuses it; a long payload still held (here: an endpoint that keeps what it is written)
    is a view of it, so the next read gets a new buffer and the held bytes stay intact."""
    ours = HboneConnection(client_side=True)
    transport = MemoryTransport()
    ours.connection_made(transport)
    server = peer(client_side=False)
    stream, _tcp, _relay, sid = await _open(ours, transport, server)
    keeper = KeepingEndpoint()
    stream.relay = Relay(keeper, stream)

    server.send_data(sid, b"small")
    first = _read_into_buffer(ours, server.data_to_send())
    assert [bytes(c) for c in keeper.chunks] == [b"small"] and type(keeper.chunks[0]) is bytes
    assert _read_into_buffer(ours, b"") == first  # nothing refers to it: reused

    big = bytes(range(256)) * 128  # 32 KiB, above the core's zero-copy size
    server.send_data(sid, big)
    held = _read_into_buffer(ours, server.data_to_send())
    assert held == first
    assert isinstance(keeper.chunks[1], memoryview) and keeper.chunks[1].readonly
    server.send_data(sid, b"x" * 40_000)
    again = _read_into_buffer(ours, server.data_to_send())
    assert again != held  # the held view pins the old buffer: the read went to a new one
    assert bytes(keeper.chunks[1]) == big and bytes(keeper.chunks[2]) == b"x" * 40_000
    keeper.chunks.clear()
    assert _read_into_buffer(ours, b"") == _read_into_buffer(ours, b"") == again
    ours._cancel_timers()


async def test_a_clean_end_while_writing_is_paused_still_writes_what_the_core_holds(monkeypatch):
    # Draining, writing paused by the transport, the last stream reset: the connection ends
    # cleanly at once, and its RST_STREAM must reach the wire before the close (nothing resumes a
    # closing transport). The close itself waits for the peer to close first, at most
    # DRAIN_CLOSE_LINGER_S (a peer may still be delivering the end of a finished stream).
    monkeypatch.setattr(hs, "DRAIN_CLOSE_LINGER_S", 0.05)
    ours = HboneConnection(client_side=True)
    transport = MemoryTransport()
    ours.connection_made(transport)
    server = peer(client_side=False)
    stream, _tcp, _relay, sid = await _open(ours, transport, server)
    ours.drain()
    exchange(ours, transport, server)
    ours.pause_writing()
    stream.abort()
    # (h2 has closed its side on our GOAWAY, so the frame is looked for in the bytes: RFC 9113
    # 6.4, length 4, type RST_STREAM, no flags, the stream id, CANCEL.)
    rst = bytes([0, 0, 4, 3, 0]) + sid.to_bytes(4, "big") + (8).to_bytes(4, "big")
    assert rst in transport.take()
    assert not transport.closed  # the peer may close first
    await asyncio.sleep(0.2)
    assert transport.closed  # it did not: closed after the bound
    ours._cancel_timers()


class PausingEndpoint(RecordingEndpoint):
    """A socket whose buffer fills with what it is written: each write makes the relay pause the
    other side, as TcpEndpoint's pause_writing does."""

    def write(self, data) -> None:
        super().write(data)
        assert self.relay is not None
        self.relay.blocked(self)


def _stream_credit(events: list, sid: int) -> int:
    return sum(e.delta for e in events if isinstance(e, h2.events.WindowUpdated) and e.stream_id == sid)


@pytest.mark.parametrize("pausing", [False, True])
async def test_one_data_frame_per_read_credits_only_while_the_reader_keeps_up(pausing):
    """`buffer_updated` hands a read that is one DATA frame to the relay itself (on_data inlined):
    its credit goes back when the socket took it, and is held when that very write paused the
    socket (returned on resume), as on_data does."""
    from ambient_mesh.proxy.hbone import HboneSettings

    # A 1 MiB stream window: credit goes back in a WINDOW_UPDATE once 1/8 of it (128 KiB) is owed,
    # so each chunk's credit shows on the wire by itself.
    ours = HboneConnection(client_side=True, settings=HboneSettings(stream_window_bytes=1024 * 1024))
    transport = MemoryTransport()
    ours.connection_made(transport)
    server = peer(client_side=False)
    stream, _tcp, _relay, sid = await _open(ours, transport, server)
    tcp = PausingEndpoint() if pausing else RecordingEndpoint()
    Relay(tcp, stream)
    chunk = 200 * 1024  # one DATA frame, one read of the 256 KiB receive buffer
    for _ in range(3):
        server.send_data(sid, b"z" * chunk)
        _read_into_buffer(ours, server.data_to_send())
    assert bytes(tcp.received) == b"z" * (3 * chunk)
    credit = _stream_credit(server.receive_data(transport.take()), sid)
    assert credit == (0 if pausing else 3 * chunk)
    if pausing:
        stream.resume_reading()
        assert _stream_credit(server.receive_data(transport.take()), sid) == 3 * chunk
    ours._cancel_timers()


# A client's first bytes sent with its CONNECT (`open_stream`'s `early`): DATA right behind the
# HEADERS in one transport write, before the answer (RFC 9113 8.5); what the stream window does
# not take waits for window; the server holds such DATA until its relay is attached.
class CountingTransport(MemoryTransport):
    """Counts the transport writes (a TLS transport makes each one its own records)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, data) -> None:
        self.writes += 1
        super().write(data)

    def writelines(self, pieces) -> None:
        self.writes += 1
        for piece in pieces:
            super().write(piece)


async def test_early_bytes_go_out_with_the_connect_in_one_write_before_the_answer():
    ours = HboneConnection(client_side=True)
    transport = CountingTransport()
    ours.connection_made(transport)
    server = peer(client_side=False)
    exchange(ours, transport, server)
    transport.writes = 0
    opening = asyncio.ensure_future(ours.open_stream("10.0.0.3:8080", [], b"hello"))
    await asyncio.sleep(0)
    assert transport.writes == 1  # HEADERS and DATA together
    events = server.receive_data(transport.take())
    request = next(e for e in events if isinstance(e, h2.events.RequestReceived))
    data = [e.data for e in events if isinstance(e, h2.events.DataReceived)]
    assert data == [b"hello"]
    assert not opening.done()  # sent before any answer
    server.send_headers(request.stream_id, [(":status", "200")])
    ours.data_received(server.data_to_send())
    stream, response = await opening
    assert response.status == 200 and stream.stream_id == request.stream_id
    ours._cancel_timers()


async def test_early_bytes_beyond_the_stream_window_wait_for_window():
    ours = HboneConnection(client_side=True)
    transport = MemoryTransport()
    ours.connection_made(transport)
    server = peer(client_side=False)
    server.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 3})
    exchange(ours, transport, server)
    opening = asyncio.ensure_future(ours.open_stream("10.0.0.3:8080", [], b"hello"))
    await asyncio.sleep(0)
    events = server.receive_data(transport.take())
    request = next(e for e in events if isinstance(e, h2.events.RequestReceived))
    assert [e.data for e in events if isinstance(e, h2.events.DataReceived)] == [b"hel"]
    server.send_headers(request.stream_id, [(":status", "200")])
    server.increment_flow_control_window(3, stream_id=request.stream_id)
    events = exchange(ours, transport, server)
    assert [e.data for e in events if isinstance(e, h2.events.DataReceived)] == [b"lo"]
    stream, response = await opening
    assert response.status == 200 and not ours.core.queued_bytes(stream.stream_id)
    ours._cancel_timers()


async def test_the_server_holds_early_data_until_the_relay_is_attached_then_delivers_it_first():
    streams = []
    ours = HboneConnection(client_side=False, on_request=streams.append)
    transport = MemoryTransport()
    client = peer(client_side=True)
    ours.connection_made(transport)
    exchange(ours, transport, client)
    client.send_headers(1, [(":method", "CONNECT"), (":authority", "10.0.0.3:8080")])
    client.send_data(1, b"early ")
    ours.data_received(client.data_to_send())  # HEADERS and DATA in one read
    [stream] = streams
    app = RecordingEndpoint()
    assert app.received == b""  # no relay yet: held
    ours.respond(stream, 200)
    relay = Relay(stream, app)
    app.attach = lambda relay: None  # a recording endpoint has nothing to replay
    stream.attach(relay)
    assert app.received == b"early "
    client.send_data(1, b"later", end_stream=True)
    exchange(ours, transport, client)
    assert app.received == b"early later" and app.eof
    ours._cancel_timers()


class RepausingTransport(MemoryTransport):
    """A transport whose buffer fills again at the first write after `repause` is armed: it
    calls the protocol's pause_writing from inside that write, as TlsTransport does past its high
    water mark."""

    def __init__(self) -> None:
        super().__init__()
        self.protocol: HboneConnection | None = None
        self.repause = False

    def write(self, data) -> None:
        super().write(data)
        if self.repause and self.protocol is not None:
            self.repause = False
            self.protocol.pause_writing()


async def test_writing_paused_again_while_resuming_keeps_every_stream_blocked_and_loses_nothing():
    # Seen under load (4 streams sharing a connection): resume_writing's own flush filled the
    # transport again, then resume_writing unblocked every stream anyway; their relays read the
    # app sockets into the stream's queue while writing stayed paused, and the next resume drained
    # only the streams it knew were blocked, so one stream's 250 MiB sat pending for good.
    ours = HboneConnection(client_side=True)
    transport = RepausingTransport()
    ours.connection_made(transport)
    server = peer(client_side=False)
    _first, tcp1, relay1, sid1 = await _open(ours, transport, server)
    _second, tcp2, relay2, sid2 = await _open(ours, transport, server)
    transport.protocol = ours

    ours.pause_writing()
    assert tcp1.paused and tcp2.paused
    relay1.data_from(tcp1, b"a" * 1000)  # one read already on its way when the pause came
    transport.repause = True
    ours.resume_writing()  # its flush writes the first stream's bytes, and pauses again
    assert ours.core.output_paused
    assert tcp1.paused and tcp2.paused  # nobody reads while the transport is full
    relay2.data_from(tcp2, b"b" * 2000)  # the second stream's read in flight: held, not lost
    relay2.eof_from(tcp2)
    assert tcp2.paused

    ours.resume_writing()
    assert not tcp1.paused and not tcp2.paused
    events = exchange(ours, transport, server)
    got = {sid1: b"", sid2: b""}
    for e in events:
        if isinstance(e, h2.events.DataReceived):
            got[e.stream_id] += e.data
    assert got == {sid1: b"a" * 1000, sid2: b"b" * 2000}
    assert any(isinstance(e, h2.events.StreamEnded) and e.stream_id == sid2 for e in events)
    assert not ours.core.waiting(sid1) and not ours.core.waiting(sid2)
    ours._cancel_timers()


async def test_a_stream_that_is_fed_while_blocked_fails_at_its_bound_instead_of_growing(monkeypatch):
    # The bound behind the fix above: a relay that kept writing into a blocked stream (the bug
    # it fixed, or any like it) ends the stream with an error that names the bound.
    from ambient_mesh.proxy import hbone

    monkeypatch.setattr(hbone.settings, "MAX_STREAM_PENDING_BYTES", 64 * 1024)
    ours = HboneConnection(client_side=True)
    transport = MemoryTransport()
    ours.connection_made(transport)
    server = peer(client_side=False)
    stream, tcp, relay, sid = await _open(ours, transport, server)
    ours.pause_writing()
    for _ in range(4):
        stream.write(b"x" * 16 * 1024)  # up to the bound: held
    assert not relay.done.done() and ours.core.queued_bytes(sid) == 64 * 1024
    stream.write(b"x")  # one byte past it
    assert relay.done.done()
    error = relay.done.result()
    assert isinstance(error, hbone.HboneError) and "past its bound of 65536" in str(error)
    assert not ours.core.queued_bytes(sid) and tcp.aborted
    ours.resume_writing()
    events = exchange(ours, transport, server)
    assert any(isinstance(e, h2.events.StreamReset) and e.stream_id == sid for e in events)
    ours._cancel_timers()
