"""HBONE: HTTP/2 CONNECT streams over a mutual-TLS connection (port 15008), the asyncio shell.

Counterparts: ztunnel src/proxy/h2.rs, h2/client.rs, h2/server.rs. The HTTP/2 protocol is the
sans-IO core in http2/ (frames, flow control, per-stream send queues, GOAWAY, flood
budgets); this module only moves bytes and time in and events out: one `HboneConnection` (an
asyncio Protocol) per TLS connection, client or server side, that reads, feeds the core,
dispatches its events to the streams (stream.py) and flushes what the core queued:

- read: `buffer_updated` / `data_received` -> `core.receive` -> `_dispatch`;
- write: a stream's bytes go through `send` (the core's `data_header` when a chunk goes out
  whole at once, the one fast path of this direction, else `core.send`, which queues what the
  windows do not take) and `flush` (`core.data_to_send` -> transport, not while the transport
  is paused: `pause_output`, the backpressure);
- one timer at `core.next_deadline()`.

Received bytes are acknowledged (window credit returned to the sender) only while the socket we
forward them to can take more (the core holds the credit): a slow reader closes the window
instead of growing our buffers. A stream the peer resets before we answered it cancels what
`on_request` started for it (the app connect).

Streams sharing a connection: while more than one stream is open, the socket holds at most
SHARED_NOTSENT_LOWAT_BYTES not yet sent (TCP_NOTSENT_LOWAT), so a bulk stream's bytes wait in
our transport's backlog, which pauses the connection, rather than megabytes deep in the kernel's
send queue, where every other stream's frames would queue behind them. One stream alone keeps
the kernel's default (no bound): nothing waits behind its bytes there, and the bound would only
add partial sends and wake-ups to a transfer.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from ... import http2
from ...errors import ResponseFlag
from ...host.cpython import ReusableBuffer
from ...http2 import events as ev
from ...http2.connection import Http2Error, SendQueueFull, StreamClosedError
from ...http2.frames import FRAME_HEADER_BYTES, ErrorCode, error_name
from ...tls.transport import MAX_RECORD_PLAINTEXT_BYTES, TlsTransport
from . import settings as hs
from .settings import DEFAULT_SETTINGS, SERVER_MAX_CONCURRENT_STREAMS, HboneSettings
from .stream import ConnectRequest, ConnectResponse, HboneError, HboneStream

if TYPE_CHECKING:
    from ...identity.spiffe import Identity


log = logging.getLogger("ambient_mesh.hbone")

# A DATA payload this long or shorter fits one TLS record with its frame header: written as one
# piece (header + payload), longer ones as two (TlsTransport.writelines puts the header inside
# the payload's first record).
_ONE_RECORD_PAYLOAD_BYTES = MAX_RECORD_PLAINTEXT_BYTES - FRAME_HEADER_BYTES
_DataReceived = ev.DataReceived  # the one event per message: a global, not an attribute lookup


# The process's one receive buffer: TLS connections (HboneConnection) decrypt into it one at a
# time, so it is reused while nothing refers to its bytes. What a read hands on is a read-only
# view of it; whoever keeps bytes past the call either copies them (the HTTP/2 core, below its
# zero-copy size; pending bytes of a closed window) or holds the view (a socket that could not
# send it yet, bytes held before a relay is attached), and then the next read gets a new buffer.
# Made on the first read: a process that never reads HBONE (the workers' owner) does not hold it.
_RECEIVE = ReusableBuffer(hs.RECEIVE_BUFFER_BYTES)


def _receive_into(_protocol: object, sizehint: int) -> memoryview:
    """`HboneConnection.get_buffer`: the shared receive buffer, or a new one while a view of the
    current one is alive. A view, not the bytearray: the TLS transport slices what it gets to
    fill it in parts. Plain sockets (relay.TcpEndpoint) stay on `data_received`: for them the
    two callbacks cost more per small message than the copy saves."""
    return memoryview(_RECEIVE.take())


class HboneConnection(asyncio.BufferedProtocol):
    """One HTTP/2 connection over TLS carrying CONNECT streams; client or server side.

    The server side calls `on_request(stream)` for each new CONNECT stream; the handler must
    answer with `respond(stream, status, headers)`. If it returns something with `cancel()` (the
    task serving the stream), that is cancelled when the peer resets the stream unanswered.
    """

    def __init__(
        self,
        *,
        client_side: bool,
        settings: HboneSettings = DEFAULT_SETTINGS,
        on_request: Callable[[HboneStream], object] | None = None,
        on_closed: Callable[[HboneConnection], None] | None = None,
        on_connected: Callable[[HboneConnection], None] | None = None,
        max_concurrent_streams: int = SERVER_MAX_CONCURRENT_STREAMS,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.client_side = client_side
        self.settings = settings
        self.on_request = on_request
        self.on_closed = on_closed
        self.on_connected = on_connected
        self.peer_identity: Identity | None = None  # set by on_connected from the peer's certificate
        self.core = http2.Connection(
            http2.CoreSettings(
                client_side=client_side,
                stream_window_bytes=settings.stream_window_bytes,
                connection_window_bytes=settings.connection_window_bytes,
                max_frame_bytes=settings.max_frame_bytes,
                max_header_list_bytes=hs.CLIENT_MAX_HEADER_LIST_BYTES
                if client_side
                else hs.SERVER_MAX_HEADER_LIST_BYTES,
                max_concurrent_streams=None if client_side else max_concurrent_streams,
                ping_interval_s=settings.ping_interval_s,
                ping_timeout_s=settings.ping_timeout_s,
                max_stream_queued_bytes=hs.MAX_STREAM_PENDING_BYTES,
            ),
            now=self.loop.time(),
        )
        self.transport: asyncio.Transport | None = None
        # TlsTransport.write drops what comes once the transport is closing, so a frame goes to
        # it without asking is_closing first (a Python call per message); other transports are
        # asked (docs/performance.md, "HTTP/2: a purpose-built sans-IO core").
        self._tls: TlsTransport | None = None
        self.streams: dict[int, HboneStream] = {}
        self._unsent_bounded = False  # SHARED_NOTSENT_LOWAT_BYTES set on the socket
        self.closed: asyncio.Future[None] = self.loop.create_future()
        self.goaway_received = False  # a GOAWAY went either way: no new streams
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._error: BaseException | None = None
        self._linger: asyncio.TimerHandle | None = None  # aborts an error close that lingers
        self.last_used = self.loop.time()
        self.total_streams = 0

    def __repr__(self) -> str:
        side = "client" if self.client_side else "server"
        state = "closed" if self.closed.done() else ("draining" if self.goaway_received else "open")
        return f"HboneConnection({side}, {state}, {len(self.streams)} streams, {self.total_streams} total)"

    # asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream transport (TCP + TLS)
        if type(transport) is TlsTransport:
            self._tls = transport
        if self.on_connected is not None:
            # TLS is complete here: check the peer before a single HTTP/2 byte is exchanged.
            try:
                self.on_connected(self)
            except Exception as e:
                self._error = e
                self.transport.abort()
                return
        self.core.initiate(self.loop.time())
        self.flush()
        self._arm_timer()

    # BufferedProtocol: TLS decrypts straight into the shared receive buffer (no bytes object
    # allocated per TLS read and no join of several reads; docs/performance.md, "Buffers and copies").
    get_buffer = _receive_into

    def buffer_updated(self, nbytes: int) -> None:
        """The one way in: `nbytes` read into the shared receive buffer are fed to the core, its
        events dispatched, what it queued flushed."""
        if self._error is not None:
            return
        core = self.core
        events = core.receive(memoryview(_RECEIVE.buf)[:nbytes].toreadonly(), self.loop.time())
        if events:
            self._dispatch(events)
        if core.events or core.outbox_bytes:
            self.flush()
        if core.deadline != self._timer_at:
            self._arm_timer()

    def data_received(self, data: bytes | memoryview) -> None:
        """A transport that does not fill buffers (a test's memory transport): its bytes go in
        through the receive buffer, a buffer's worth at a time, as a buffered transport's do."""
        view = memoryview(data)
        step = hs.RECEIVE_BUFFER_BYTES
        for start in range(0, max(len(view), 1), step):
            piece = view[start : start + step]
            _RECEIVE.take()[: len(piece)] = piece  # not kept: a reference would look like a view
            self.buffer_updated(len(piece))

    def _dispatch(self, events: list[Any]) -> None:
        # ev.Event items; dispatched on `type(event) is` (cheaper per frame than isinstance or
        # match), which mypy does not narrow, hence Any.
        streams = self.streams
        for event in events:
            t = type(event)
            if t is _DataReceived:
                stream = streams.get(event.stream_id)
                if stream is None:
                    self.core.acknowledge(event.stream_id, len(event.data))
                else:
                    stream.on_data(event.data)
            elif t is ev.StreamWritable:
                stream = streams.get(event.stream_id)
                if stream is not None:
                    if event.ended:
                        stream.on_end_sent()
                        if stream.finished:
                            self.forget(stream)
                    if not self.core.output_paused:
                        stream.set_blocked(False)
            elif t is ev.StreamEnded:
                stream = streams.get(event.stream_id)
                if stream is not None:
                    stream.on_end()
                    if stream.finished:
                        self.forget(stream)
            elif t is ev.RequestReceived:
                self._on_request(event)
            elif t is ev.ResponseReceived:
                stream = streams.get(event.stream_id)
                if stream is not None:
                    stream.on_response(ConnectResponse(event.status, event.headers))
                    if event.end_stream:
                        stream.on_end()
            elif t is ev.StreamReset:
                stream = streams.pop(event.stream_id, None)
                if stream is not None:
                    stream.on_reset(event.error_code, event.answered, event.refused)
            elif t is ev.RequestRefused:
                log.info("HBONE request on stream %d refused: %s", event.stream_id, event.reason)
            elif t is ev.GoawayReceived:
                self.goaway_received = True
                log.debug(
                    "GOAWAY from peer: last stream %d, %s",
                    event.last_stream_id,
                    error_name(event.error_code),
                )
            elif t is ev.ConnectionTerminated:
                self._terminated(event)

    def _terminated(self, event: ev.ConnectionTerminated) -> None:
        transport = self.transport
        if transport is None:
            return
        if event.clean:
            # Everything queued goes before close_notify, even while writing is paused: close()
            # writes the transport's backlog out first, and nothing would resume us afterwards.
            if self.core.events:
                self._dispatch(self.core.take_events())
            out = self.core.data_to_send()
            if out and not transport.is_closing():
                transport.writelines(out)
            if event.by_peer:
                transport.close()
            elif self._linger is None:
                # Our drain ended: the peer closes first, or we do after the bound (its bytes
                # read meanwhile go to the terminated core, which drops them).
                self._linger = self.loop.call_later(hs.DRAIN_CLOSE_LINGER_S, transport.close)
            return
        if self._error is None:
            flag = (
                ResponseFlag.CONNECT
                if event.error_code == ErrorCode.NO_ERROR
                else ResponseFlag.H2_HANDSHAKE_FAILURE
            )
            self._error = HboneError(f"HTTP/2 connection ended: {event.reason}", response_flag=flag)
        log.debug("HBONE connection terminated: %s", event.reason)
        out = self.core.data_to_send()  # the GOAWAY, written even while paused
        if out and not transport.is_closing():
            transport.writelines(out)
        # Not abort(): an abort with the attacker's bytes still unread resets the connection and
        # the GOAWAY can be lost (a rapid-reset attacker saw only the reset). A bounded close.
        transport.close()
        if self._linger is None:
            self._linger = self.loop.call_later(hs.ERROR_CLOSE_LINGER_S, transport.abort)

    def pause_writing(self) -> None:
        self.core.pause_output()
        for stream in list(self.streams.values()):
            stream.set_blocked(True)

    def resume_writing(self) -> None:
        core = self.core
        core.resume_output()  # every queue drains as far as the windows allow
        self.flush()
        if core.output_paused:
            # The flush filled the transport again: every stream stays blocked until the next
            # resume_writing (unblocked now, a stream's relay would read its app socket into the
            # core's queue while nothing drains it). What the flush took is on its way.
            return
        for stream in list(self.streams.values()):
            if not core.waiting(stream.stream_id):
                stream.set_blocked(False)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        self.core.close()
        err = self._error or exc or HboneError("HBONE connection closed")
        for stream in list(self.streams.values()):
            stream.on_connection_lost(err)
        self.streams.clear()
        if not self.closed.done():
            self.closed.set_result(None)
        if self.on_closed is not None:
            self.on_closed(self)

    # Sending ---------------------------------------------------------------------------
    def flush(self) -> None:
        """Dispatch events that API calls caused, then write what the core has queued."""
        core = self.core
        if core.events:
            self._dispatch(core.take_events())
        if core.output_paused:
            return  # backpressure: the core holds (and bounds) what waits
        out = core.data_to_send()
        if out:
            transport = self.transport
            if transport is not None and not transport.is_closing():
                if len(out) == 1:
                    transport.write(out[0])
                else:
                    transport.writelines(out)

    def send(self, stream: HboneStream, data: bytes | memoryview) -> None:
        """A stream's bytes (`HboneStream.write`): a chunk the windows take whole in one frame,
        with nothing queued and the transport not paused, is written at once (one piece when it
        fits one TLS record, else with its header inside the first record: the fast path, held
        to `core.send` by tests/unit/http2/test_connection_properties.py); otherwise the core frames what
        the windows take and queues the rest, and the stream's relay stops until it drained.
        Copies were most of the outbound proxy's CPU (docs/performance.md, "Buffers and copies")."""
        if (len(self.streams) > 1) is not self._unsent_bounded:
            self._bound_unsent(not self._unsent_bounded)
        core = self.core
        sid = stream.stream_id
        n = len(data)
        header = core.data_header(sid, n)
        if header is not None:
            tls = self._tls
            if tls is not None:
                if n <= _ONE_RECORD_PAYLOAD_BYTES:
                    tls.write(header + data)
                else:
                    tls.writelines((header, data))
                return
            transport = self.transport
            if transport is not None and not transport.is_closing():
                transport.writelines((header, data))
            return
        try:
            writable = core.send(sid, data)
        except SendQueueFull as e:
            log.error("%s", e)
            stream.on_send_failed(HboneError(str(e)), reset=True)  # the stream is reset (CANCEL)
            return
        except StreamClosedError as e:
            if self.streams.get(sid) is stream:  # else gone already: none of it can be sent
                stream.on_send_failed(HboneError(f"HBONE stream {sid} closed: {e}"), reset=False)
            return
        if not writable:
            stream.set_blocked(True)
        self.flush()

    def end(self, stream: HboneStream) -> None:
        """A stream's END_STREAM (`HboneStream.write_eof`), behind whatever of it waits."""
        sid = stream.stream_id
        try:
            sent = self.core.end(sid)
        except StreamClosedError as e:
            if self.streams.get(sid) is stream:
                stream.on_send_failed(HboneError(f"HBONE stream {sid} closed: {e}"), reset=False)
            return
        if sent:
            stream.on_end_sent()
            self.flush()
            if stream.finished:
                self.forget(stream)
        else:
            stream.set_blocked(True)  # the END_STREAM waits: StreamWritable reports it

    def reset_stream(self, stream_id: int, code: int) -> None:
        self.streams.pop(stream_id, None)
        self.core.reset_stream(stream_id, code)
        self.flush()

    def _bound_unsent(self, bounded: bool) -> None:
        """Bound what the socket holds unsent while streams share it, or give the kernel's
        default back (0: net.ipv4.tcp_notsent_lowat); module docstring. Asked before each write
        of a stream, so it follows the number of open streams with no bookkeeping where streams
        come and go."""
        self._unsent_bounded = bounded
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        if sock is None:
            return
        try:
            sock.setsockopt(
                socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, hs.SHARED_NOTSENT_LOWAT_BYTES if bounded else 0
            )
        except OSError as e:  # not a TCP socket (a test's socketpair), or one already closed
            log.debug("HBONE: TCP_NOTSENT_LOWAT not set: %s", e)

    def forget(self, stream: HboneStream) -> None:
        """Both sides of the stream ended: the connection no longer carries it."""
        if self.streams.pop(stream.stream_id, None) is not None:
            self.last_used = self.loop.time()

    @property
    def error(self) -> BaseException | None:
        """Why the connection failed, if it did (peer identity refused, protocol error, ...)."""
        return self._error

    # Client side -----------------------------------------------------------------------
    @property
    def open_streams(self) -> int:
        return len(self.streams)

    @property
    def max_streams(self) -> int:
        return self.core.peer_max_concurrent_streams

    @property
    def usable(self) -> bool:
        """Can carry a new stream: not closing, no GOAWAY either way."""
        return (
            not self.closed.done()
            and not self.goaway_received
            and not self.core.draining
            and self.core.terminated is None
            and self.transport is not None
            and not self.transport.is_closing()
        )

    async def open_stream(
        self, authority: str, headers: list[tuple[str, str]], early: bytes = b""
    ) -> tuple[HboneStream, ConnectResponse]:
        """Send a CONNECT and wait for the response headers. Non-200 is returned, not raised.

        `early` is the stream's first DATA, written with the HEADERS in one TLS write, before
        the answer: after its own HEADERS a client's DATA frames are the tunnel's bytes (RFC
        9113 8.5), and the server holds them until its app connection is up (a refused
        CONNECT discards them with the stream). It saves a TLS record each way and a wakeup
        of both proxies per connection whose client speaks first (docs/performance.md,
        "Buffers and copies"). What the stream window does not take waits in the stream, as a relay's bytes do."""
        if not self.usable:
            raise HboneError("HBONE connection is closing", response_flag=ResponseFlag.CONNECT)
        request = [(b":method", b"CONNECT"), (b":authority", authority.encode())]
        for k, v in headers:  # a loop, not a comprehension: no function call (Python 3.11)
            request.append((k.encode(), v.encode()))
        try:
            sid = self.core.send_request(request)
        except Http2Error as e:
            raise HboneError(f"cannot open HBONE stream: {e}") from None
        stream = HboneStream(self, sid)
        self.streams[sid] = stream
        self.total_streams += 1
        if early:
            # As a relay's bytes go: what the windows do not take waits in the core, and the
            # HEADERS and DATA leave in one flush.
            self.send(stream, early)
        else:
            self.flush()
        response = await cast("asyncio.Future[ConnectResponse]", stream.response)  # a client's stream
        if response.status != 200:
            # Nothing will be carried: release the stream on both sides.
            self.reset_stream(sid, ErrorCode.CANCEL)
        return stream, response

    # Server side -----------------------------------------------------------------------
    def _on_request(self, event: ev.RequestReceived) -> None:
        stream = HboneStream(self, event.stream_id)
        stream.request = ConnectRequest("CONNECT", event.authority, event.headers)
        self.streams[event.stream_id] = stream
        self.total_streams += 1
        if event.end_stream:
            stream.on_end()
        if self.on_request is None:
            self.respond(stream, 503)
            return
        stream.on_started(self.on_request(stream))

    def respond(self, stream: HboneStream, status: int, headers: Sequence[tuple[str, str]] = ()) -> None:
        """Answer a CONNECT. Non-200 answers end the stream."""
        if stream.stream_id not in self.streams:
            return
        fields = []
        for k, v in headers:  # a loop, not a comprehension: no function call (Python 3.11)
            fields.append((k.encode(), v.encode()))
        try:
            self.core.send_response(stream.stream_id, status, fields)
        except StreamClosedError:
            stream.on_answered(status)
            self.streams.pop(stream.stream_id, None)
            return
        stream.on_answered(status)
        if status != 200:
            # The core ended the stream (and reset what we will not read): nothing more here.
            self.forget(stream)
        self.flush()

    def drain(self) -> None:
        """Graceful shutdown: GOAWAY now; open streams carry on both ways until they end (RFC 9113
        6.8); the connection closes once none is left (or the caller's deadline aborts it)."""
        if self.closed.done():
            return
        self.goaway_received = True  # no new streams on our side either
        self.core.start_drain(self.loop.time())
        self.flush()
        self._arm_timer()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # Timers (keepalive PING, drain) -----------------------------------------------------
    def _arm_timer(self) -> None:
        deadline = self.core.deadline
        if deadline == self._timer_at and self._timer is not None:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = deadline
        if deadline is not None:
            self._timer = self.loop.call_at(deadline, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        if self.closed.done():
            return
        events = self.core.handle_timeout(self.loop.time())
        if events:
            self._dispatch(events)
        self.flush()
        self._arm_timer()

    def _cancel_timers(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._timer_at = None
