"""HBONE: HTTP/2 CONNECT streams over a mutual-TLS connection (port 15008), the asyncio shell.

Counterparts: ztunnel src/proxy/h2.rs, h2/client.rs, h2/server.rs. The HTTP/2 protocol is the
sans-IO core in proxy/http2/ (frames, flow control, GOAWAY, flood budgets); this module only
moves bytes and time in and events out: one `HboneConnection` (an asyncio Protocol) per TLS
connection, client or server side, with one read path (`data_received` -> `core.receive` ->
dispatch), one write path (`flush`: `core.data_to_send` -> transport, not while the transport
is paused, which is the backpressure), and one timer at `core.next_deadline()`. One
`HboneStream` per proxied TCP connection; streams are relay endpoints (relay.py), so bytes go
from a socket callback straight into `core.send_data` and out of DATA events straight into the
peer socket.

Settings follow ztunnel (docs/istio-behaviour.md, "HBONE"): stream window 4 MiB, connection
window 16 MiB, max frame 1 MiB, push disabled, header lists 16 KiB (client) and 64 KiB
(server), 200 concurrent streams on the server side, PING every 10 s and the connection
dropped after 20 s without an answer. Received bytes are acknowledged (window credit returned
to the sender) only while the socket we forward them to can take more: a slow reader closes
the window instead of growing our buffers. A stream the peer resets before we answered it
cancels what `on_request` started for it (the app connect).

Streams sharing a connection: while more than one stream is open, the socket holds at most
SHARED_NOTSENT_LOWAT_BYTES not yet sent (TCP_NOTSENT_LOWAT), so a bulk stream's bytes wait in
our transport's backlog, which pauses the connection, rather than megabytes deep in the kernel's
send queue, where every other stream's frames would queue behind them. One stream alone keeps
the kernel's default (no bound): nothing waits behind its bytes there, and the bound would only
add partial sends and wake-ups to a transfer.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

from ..errors import ProxyError, ResponseFlag
from ..host.cpython import ReusableBuffer
from ..tls.transport import MAX_RECORD_PLAINTEXT_BYTES, TlsTransport
from . import http2
from .http2 import events as ev
from .http2.connection import Http2Error, StreamClosedError
from .http2.frames import ErrorCode
from .relay import Endpoint

if TYPE_CHECKING:
    from ..identity.spiffe import Identity
    from .relay import Relay


class Cancellable(Protocol):
    """What `on_request` may hand back (the task serving a stream): cancelled on an early reset."""

    def cancel(self) -> object: ...


log = logging.getLogger("ambient_mesh.hbone")

STREAM_WINDOW_BYTES = 4 * 1024 * 1024
CONNECTION_WINDOW_BYTES = 16 * 1024 * 1024
MAX_FRAME_BYTES = 1024 * 1024
CLIENT_MAX_HEADER_LIST_BYTES = 16 * 1024
SERVER_MAX_HEADER_LIST_BYTES = 64 * 1024
SERVER_MAX_CONCURRENT_STREAMS = 200
PING_INTERVAL_S = 10.0
PING_TIMEOUT_S = 20.0
# TLS decrypts into one buffer per process (HboneConnection.get_buffer): what one read hands
# over at most (tls/transport.py fills it with the records that wait, uvloop's TLS reads this
# much). More than this is read in the next round. As large as the TLS transport's receive
# (tls/transport.py RECV_BYTES): one pass of HTTP/2 and relay per read.
RECEIVE_BUFFER_BYTES = 1024 * 1024
# What a socket carrying more than one stream holds unsent (module docstring). A 1-byte round
# trip beside a 2 GiB transfer on one pooled connection, one core: p99 23.1 ms -> 0.33 ms, p50
# 0.23 -> 0.21 ms, the transfer 1.05x as fast; 1 MiB (a bulk write's size) bounds nothing of it,
# p99 26.6 ms (bench/mixed_load_bench.py; docs/performance.md, "Streams sharing a connection").
SHARED_NOTSENT_LOWAT_BYTES = 256 * 1024
# What one stream may hold waiting for window or for the transport (`HboneStream._pending`). A
# blocked stream's relay stops reading, so it holds at most what was on its way: one bulk read
# (relay.APP_RECEIVE_BUFFER_BYTES, 1 MiB) and the part of one write past the window. Past this
# bound the relay did not stop, which must not become memory: the stream's relay fails with an
# error that names the bound, and the stream is reset (`_hold_overflow`).
MAX_STREAM_PENDING_BYTES = 8 * 1024 * 1024
# After a connection error (a flood, a protocol error) our GOAWAY goes out and the transport
# closes gracefully (TLS: close_notify, then reading and dropping until the peer's EOF), so
# that the peer's unread bytes do not make our close a TCP reset that can destroy the GOAWAY
# in flight (RFC 9113 5.4.1 and 6.8: the GOAWAY is sent before closing the connection). A
# peer that neither ends nor reads is cut off (abort) after this long: the connection was
# hostile or broken, so it gets less than the transport's own close bound.
ERROR_CLOSE_LINGER_S = 2.0


class HboneError(ProxyError):
    """An HBONE connection or stream failed; `response_flag` (a ResponseFlag) is what the metrics
    and the access log record for it, CONNECT unless the failure says otherwise."""


class HboneStreamRefused(HboneError):
    """The peer never processed the stream (GOAWAY below its id, REFUSED_STREAM): safe to retry."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HboneSettings:
    stream_window_bytes: int = STREAM_WINDOW_BYTES
    connection_window_bytes: int = CONNECTION_WINDOW_BYTES
    max_frame_bytes: int = MAX_FRAME_BYTES
    ping_interval_s: float = PING_INTERVAL_S
    ping_timeout_s: float = PING_TIMEOUT_S


DEFAULT_SETTINGS = HboneSettings()


@dataclass(frozen=True, slots=True)
class ConnectRequest:
    """What the server saw in a CONNECT stream's request headers."""

    method: str
    authority: str
    headers: tuple[tuple[str, str], ...]

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None


@dataclass(frozen=True, slots=True)
class ConnectResponse:
    status: int
    headers: tuple[tuple[str, str], ...]

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None


class StreamState(enum.Enum):
    OPEN = "open"
    HALF_CLOSED_LOCAL = "half-closed (local)"
    HALF_CLOSED_REMOTE = "half-closed (remote)"
    CLOSED = "closed"


_ORDERLY_RESETS = (ErrorCode.NO_ERROR, ErrorCode.CANCEL)
_Held = list[tuple[bytes | memoryview, int]]  # DATA payloads with the credit they carry
_NOTHING_HELD: _Held = []  # shared, always empty: nothing is held once attached
_DataReceived = ev.DataReceived
# A DATA payload this long or shorter fits one TLS record with its frame header: written as one
# piece (header + payload), longer ones as two (TlsTransport.writelines puts the header inside
# the payload's first record).
_ONE_RECORD_PAYLOAD_BYTES = MAX_RECORD_PLAINTEXT_BYTES - http2.frames.FRAME_HEADER_BYTES


class HboneStream(Endpoint):
    """One CONNECT stream: the HTTP/2 side of a relay."""

    __slots__ = (
        "conn",
        "stream_id",
        "request",
        "response",
        "_pending",
        "_eof_pending",
        "_end_sent",
        "_remote_ended",
        "_unacked",
        "_ack_paused",
        "_blocked",
        "_held",
        "_held_end",
        "_reset",
        "_cancel",
        "relay",
        "peer",
        "bytes_read",
    )

    def __init__(self, conn: HboneConnection, stream_id: int) -> None:
        self.conn = conn
        self.stream_id = stream_id
        self.relay = None
        self.peer: Endpoint | None = None  # the relay's other side (relay.Endpoint)
        self.bytes_read = 0
        self.request: ConnectRequest | None = None
        # The CONNECT's answer, for the client side's opener; the server side has nobody to wake,
        # and a future is 152 bytes of every idle tunnel there.
        self.response: asyncio.Future[ConnectResponse] | None = (
            conn.loop.create_future() if conn.client_side else None
        )
        self._pending = bytearray()  # bytes waiting for flow-control window
        self._eof_pending = False
        self._end_sent = False
        self._remote_ended = False
        self._unacked = 0  # received bytes whose window credit is held back
        self._ack_paused = False
        self._blocked = False  # we told the relay to stop feeding us
        self._held: _Held = []  # DATA received before a relay is attached
        self._held_end = False
        self._reset: int | None = None
        # What on_request started (the app connect): cancelled on an early reset.
        self._cancel: Cancellable | None = None

    def __repr__(self) -> str:
        return f"HboneStream(id={self.stream_id}, {self.state.value}, pending={len(self._pending)}B)"

    @property
    def state(self) -> StreamState:
        if self._reset is not None or (self._end_sent and self._remote_ended):
            return StreamState.CLOSED
        if self._end_sent:
            return StreamState.HALF_CLOSED_LOCAL
        if self._remote_ended:
            return StreamState.HALF_CLOSED_REMOTE
        return StreamState.OPEN

    # Relay-facing verbs ----------------------------------------------------------------
    def attach(self, relay: Relay) -> None:
        self.relay = relay
        self._cancel = None
        held, self._held = self._held, _NOTHING_HELD  # no new list per idle tunnel
        for chunk, flow in held:
            relay.data_from(self, chunk)
            self._credit(flow)
        if self._reset is not None:
            relay.failed(self, HboneError(f"stream reset by peer (code {self._reset})"))
        elif self._held_end:
            relay.eof_from(self)
        self.conn.flush()

    def write(self, data: bytes | memoryview) -> None:
        if self._reset is not None or self._end_sent:
            return
        conn = self.conn
        if (len(conn.streams) > 1) is not conn._unsent_bounded:
            conn._bound_unsent(not conn._unsent_bounded)
        if not self._pending and not self._blocked and not conn._write_paused:
            # The common cases without `pump`'s bookkeeping: a chunk the windows take whole in one
            # frame, with nothing queued, is written at once (one piece when it fits one TLS
            # record, else with its header inside the first record); otherwise the window takes
            # what it can.
            n = len(data)
            header = conn.core.data_header(self.stream_id, n)
            if header is not None:
                tls = conn._tls
                if tls is not None:
                    if n <= _ONE_RECORD_PAYLOAD_BYTES:
                        tls.write(header + data)
                    else:
                        tls.writelines((header, data))
                    return
                transport = conn.transport
                if transport is not None and not transport.is_closing():
                    transport.writelines((header, data))
                return
            try:
                taken = conn.core.send_data(self.stream_id, data)
            except StreamClosedError:
                taken = 0  # `pump` reports it
            if taken == len(data):
                conn.flush()
                return
            conn.pump(self, memoryview(data)[taken:] if taken else data)
            return
        conn.pump(self, data)

    def write_eof(self) -> None:
        if self._reset is not None or self._end_sent:
            return
        conn = self.conn
        if not self._pending and not self._blocked and not conn._write_paused:
            # Nothing waits for window: END_STREAM goes now, without `pump`'s bookkeeping (issue
            # 11, per connection: every stream ends so, once each way). `pump` reports a stream
            # the core no longer has.
            try:
                conn.core.end_stream(self.stream_id)
            except StreamClosedError:
                pass
            else:
                self._end_sent = True
                conn.flush()
                if self._remote_ended:
                    conn._forget(self)
                return
        self._eof_pending = True
        conn.pump(self)

    def abort(self) -> None:
        if self._reset is None and not (self._end_sent and self._remote_ended):
            self._reset = ErrorCode.CANCEL
            self.conn.reset_stream(self.stream_id, ErrorCode.CANCEL)

    def pause_reading(self) -> None:
        self._ack_paused = True

    def resume_reading(self) -> None:
        if self._ack_paused:
            self._ack_paused = False
            if self._unacked:
                n, self._unacked = self._unacked, 0
                self.conn.core.acknowledge(self.stream_id, n)
                self.conn.flush()

    def close(self) -> None:
        # Forgotten once both sides ended; a stream its END_STREAM or the peer's already forgot
        # (the usual case) costs no call.
        if self._end_sent and self._remote_ended and self.conn.streams.get(self.stream_id) is self:
            self.conn._forget(self)

    # Connection-facing -----------------------------------------------------------------
    def _credit(self, flow: int) -> None:
        if flow <= 0:
            return
        if self._ack_paused:
            self._unacked += flow
        else:
            self.conn.core.acknowledge(self.stream_id, flow)

    def on_data(self, data: bytes | memoryview) -> None:
        peer = self.peer
        if peer is None:
            self._held.append((data, len(data)))  # credit is returned when a relay takes them
            return
        if self._ack_paused and type(data) is memoryview:
            # The peer socket is not taking more: what it is handed now waits in its buffer, and
            # a view would pin a whole receive buffer (RECEIVE_BUFFER_BYTES) for it, so a slow
            # app would hold several times the stream window (tests/netns/test_attack_hbone.py).
            data = bytes(data)
        self.bytes_read += len(data)
        peer.write(data)
        if self._ack_paused:  # `_credit`, inlined: this runs once per DATA frame
            self._unacked += len(data)
        else:
            self.conn.core.acknowledge(self.stream_id, len(data))

    def on_end(self) -> None:
        self._remote_ended = True
        if self.relay is None:
            self._held_end = True
        else:
            self.relay.eof_from(self)

    def on_reset(self, code: int, answered: bool, refused: bool = False) -> None:
        self._reset = code
        if refused:
            self.fail_response(
                HboneStreamRefused("stream refused by the peer's GOAWAY before it was processed")
            )
        else:
            self.fail_response(HboneError(f"stream reset by peer ({http2.frames.error_name(code)})"))
        if not answered and self._cancel is not None:
            # Reset before we answered (rapid reset, or an impatient client): stop the app connect.
            cancel, self._cancel = self._cancel, None
            cancel.cancel()
        relay = self.relay
        if relay is None:
            return
        # RST_STREAM NO_ERROR / CANCEL is an orderly end (docs/istio-behaviour.md, "Stream ends and byte copying"): EOF to the socket,
        # and since a reset stream carries nothing more either way, the relay is finished.
        if code in _ORDERLY_RESETS:
            if not self._remote_ended:
                self._remote_ended = True
                relay.eof_from(self)
            if not relay.done.done():
                relay.finish()
        elif not relay.done.done():
            relay.failed(self, HboneError(f"stream reset by peer ({http2.frames.error_name(code)})"))

    def fail_response(self, exc: BaseException) -> None:
        """Wake a client waiting for the CONNECT answer; silent when nobody waits (server side)."""
        response = self.response
        if response is not None and not response.done():
            response.set_exception(exc)
            response.exception()  # mark retrieved: an awaiting opener still gets it

    def set_blocked(self, blocked: bool) -> None:
        if blocked == self._blocked or self.relay is None:
            return
        self._blocked = blocked
        if blocked:
            self.relay.blocked(self)
        else:
            self.relay.unblocked(self)


# The process's one receive buffer: TLS connections (HboneConnection) decrypt into it one at a
# time, so it is reused while nothing refers to its bytes. What a read hands on is a read-only
# view of it; whoever keeps bytes past the call either copies them (the HTTP/2 core, below its
# zero-copy size; pending bytes of a closed window) or holds the view (a socket that could not
# send it yet, bytes held before a relay is attached), and then the next read gets a new buffer.
# Made on the first read: a process that never reads HBONE (the workers' owner) does not hold it.
_RECEIVE = ReusableBuffer(RECEIVE_BUFFER_BYTES)


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
                max_header_list_bytes=CLIENT_MAX_HEADER_LIST_BYTES
                if client_side
                else SERVER_MAX_HEADER_LIST_BYTES,
                max_concurrent_streams=None if client_side else max_concurrent_streams,
                ping_interval_s=settings.ping_interval_s,
                ping_timeout_s=settings.ping_timeout_s,
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
        self._write_paused = False
        self._blocked_streams: set[HboneStream] = set()  # streams holding bytes or an END_STREAM (pump)
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
        # `data_received` of a view of the buffer, with that call inlined: this runs once per TLS
        # read (docs/performance.md, "Buffers and copies").
        if self._error is not None:
            return
        core = self.core
        events = core.receive(memoryview(_RECEIVE.buf)[:nbytes].toreadonly(), self.loop.time())
        if events:
            event = events[0]
            # One DATA frame per read is the small-message case: delivered without `_dispatch`,
            # and while the stream's relay takes it, with `on_data` inlined.
            if (
                len(events) == 1
                and type(event) is _DataReceived
                and (stream := self.streams.get(event.stream_id)) is not None
            ):
                peer = stream.peer
                if peer is None or stream._ack_paused:
                    stream.on_data(event.data)
                else:
                    data = event.data
                    stream.bytes_read += len(data)
                    peer.write(data)
                    if stream._ack_paused:  # the write paused the peer socket: credit held
                        stream._unacked += len(data)
                    else:
                        core.acknowledge(event.stream_id, len(data))
            else:
                self._dispatch(events)
        if core.events or core.outbox_bytes:
            self.flush()
        if core.deadline != self._timer_at:
            self._arm_timer()

    def data_received(self, data: bytes | memoryview) -> None:
        if self._error is not None:
            return
        core = self.core
        events = core.receive(data, self.loop.time())
        if events:
            self._dispatch(events)
        if core.events or core.outbox_bytes:
            self.flush()
        if core.deadline != self._timer_at:
            self._arm_timer()

    def _dispatch(self, events: list[Any]) -> None:
        # ev.Event items; dispatched on `type(event) is` (cheaper per frame than isinstance or
        # match), which mypy does not narrow, hence Any.
        streams = self.streams
        for event in events:
            t = type(event)
            if t is ev.DataReceived:
                stream = streams.get(event.stream_id)
                if stream is None:
                    self.core.acknowledge(event.stream_id, len(event.data))
                else:
                    stream.on_data(event.data)
            elif t is ev.WindowUpdated:
                if event.stream_id == 0:
                    self._pump_all()
                else:
                    stream = streams.get(event.stream_id)
                    if stream is not None:
                        self.pump(stream)
            elif t is ev.StreamEnded:
                stream = streams.get(event.stream_id)
                if stream is not None:
                    stream.on_end()
                    if stream._end_sent:
                        self._forget(stream)
            elif t is ev.RequestReceived:
                self._on_request(event)
            elif t is ev.ResponseReceived:
                stream = streams.get(event.stream_id)
                if stream is not None:
                    response = stream.response
                    if response is not None and not response.done():
                        response.set_result(ConnectResponse(event.status, event.headers))
                    if event.end_stream:
                        stream.on_end()
            elif t is ev.StreamReset:
                stream = streams.pop(event.stream_id, None)
                if stream is not None:
                    self._blocked_streams.discard(stream)
                    stream.on_reset(event.error_code, event.answered, event.refused)
            elif t is ev.RequestRefused:
                log.info("HBONE request on stream %d refused: %s", event.stream_id, event.reason)
            elif t is ev.GoawayReceived:
                self.goaway_received = True
                log.debug(
                    "GOAWAY from peer: last stream %d, %s",
                    event.last_stream_id,
                    http2.frames.error_name(event.error_code),
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
            transport.close()
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
            self._linger = self.loop.call_later(ERROR_CLOSE_LINGER_S, transport.abort)

    def pause_writing(self) -> None:
        self._write_paused = True
        for stream in list(self.streams.values()):
            stream.set_blocked(True)

    def resume_writing(self) -> None:
        self._write_paused = False
        self.flush()
        self._pump_all()
        if self._write_paused:
            # The flush or a pump filled the transport again: every stream stays blocked until
            # the next resume_writing (unblocked now, a stream's relay would read its app
            # socket into `_pending` without bound, with nothing left to pump it afterwards).
            return
        for stream in list(self.streams.values()):
            if stream not in self._blocked_streams:
                stream.set_blocked(False)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        self.core.close()
        err = self._error or exc or HboneError("HBONE connection closed")
        for stream in list(self.streams.values()):
            stream.fail_response(HboneError(f"HBONE connection lost: {err}"))
            if stream._cancel is not None and stream.relay is None:
                stream._cancel.cancel()  # nobody will read an answer
            if stream.relay is not None and not stream.relay.done.done():
                stream.relay.failed(stream, err if isinstance(err, BaseException) else HboneError(str(err)))
        self.streams.clear()
        self._blocked_streams.clear()
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
        if self._write_paused:
            return  # backpressure: the core holds (and bounds) what waits
        out = core.data_to_send()
        if out:
            transport = self.transport
            if transport is not None and not transport.is_closing():
                if len(out) == 1:
                    transport.write(out[0])
                else:
                    transport.writelines(out)

    def pump(self, stream: HboneStream, data: bytes | memoryview = b"") -> None:
        """Move bytes into DATA frames as far as the windows allow; the rest waits in `_pending`.

        `data` is a fresh chunk from the socket when nothing is pending: in the common case
        (window open) it becomes a frame without being copied. Copies were most of the
        outbound proxy's CPU (docs/performance.md, "Buffers and copies").
        """
        pending = stream._pending
        if data and (pending or self._write_paused):
            pending += data  # behind what already waits
            data = b""
            if len(pending) > MAX_STREAM_PENDING_BYTES:
                self._hold_overflow(stream)
                return
        if self._write_paused:
            # The transport's backpressure: what waits is pumped by resume_writing, which pumps
            # the streams in `_blocked_streams`, and the stream reads nothing more until then.
            if pending or stream._eof_pending:
                self._blocked_streams.add(stream)
                stream.set_blocked(True)
            return
        if stream._reset is not None or stream.stream_id not in self.streams:
            pending.clear()  # a stream the connection no longer has: none of it can be sent
            return
        core = self.core
        sid = stream.stream_id
        try:
            if data:
                n = core.send_data(sid, data)
                if n < len(data):
                    pending += memoryview(data)[n:]  # the rest of one write: nothing waited before it
            while pending:
                n = min(core.send_window(sid), len(pending))
                if n <= 0:
                    break
                with memoryview(pending) as view:
                    chunk = view[:n].tobytes()
                core.send_data(sid, chunk)
                del pending[:n]
            if not pending and stream._eof_pending and not stream._end_sent:
                core.end_stream(sid)
                stream._end_sent = True
        except StreamClosedError as e:
            pending.clear()
            if stream.relay is not None and not stream.relay.done.done():
                stream.relay.failed(stream, HboneError(f"HBONE stream {sid} closed: {e}"))
            return
        if pending:
            self._blocked_streams.add(stream)
            stream.set_blocked(True)
        else:
            self._blocked_streams.discard(stream)
            stream.set_blocked(False)
        self.flush()
        if stream._end_sent and stream._remote_ended:
            self._forget(stream)

    def _hold_overflow(self, stream: HboneStream) -> None:
        """A stream past MAX_STREAM_PENDING_BYTES: its bytes are dropped and it fails."""
        held = len(stream._pending)
        stream._pending.clear()
        self._blocked_streams.discard(stream)
        error = HboneError(
            f"HBONE stream {stream.stream_id} held {held} bytes waiting to be sent, past its bound of "
            f"{MAX_STREAM_PENDING_BYTES}: its relay kept reading while the stream was blocked "
            "(a bug in the proxy: report it with this log line)"
        )
        log.error("%s", error)
        relay = stream.relay
        if relay is not None and not relay.done.done():
            relay.failed(stream, error)  # aborts both sides: the stream is reset (CANCEL)
        else:
            stream.abort()

    def _pump_all(self) -> None:
        """Pump every stream that holds bytes or an END_STREAM: those are in `_blocked_streams`
        (`pump` puts them there, whether the window or the transport held them back)."""
        for stream in list(self._blocked_streams):
            self.pump(stream)

    def reset_stream(self, stream_id: int, code: int) -> None:
        stream = self.streams.pop(stream_id, None)
        if stream is not None:
            self._blocked_streams.discard(stream)
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
                socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, SHARED_NOTSENT_LOWAT_BYTES if bounded else 0
            )
        except OSError as e:  # not a TCP socket (a test's socketpair), or one already closed
            log.debug("HBONE: TCP_NOTSENT_LOWAT not set: %s", e)

    def _forget(self, stream: HboneStream) -> None:
        if self.streams.pop(stream.stream_id, None) is not None:
            self._blocked_streams.discard(stream)
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
            # As a relay's bytes go: what the windows do not take waits in the stream, and the
            # HEADERS and DATA leave in one flush.
            self.pump(stream, early)
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
        started = self.on_request(stream)
        if started is not None and hasattr(started, "cancel") and stream.relay is None:
            stream._cancel = cast(Cancellable, started)

    def respond(self, stream: HboneStream, status: int, headers: Sequence[tuple[str, str]] = ()) -> None:
        """Answer a CONNECT. Non-200 answers end the stream."""
        if stream.stream_id not in self.streams:
            return
        stream._cancel = None
        fields = []
        for k, v in headers:  # a loop, not a comprehension: no function call (Python 3.11)
            fields.append((k.encode(), v.encode()))
        try:
            self.core.send_response(stream.stream_id, status, fields)
        except StreamClosedError:
            self.streams.pop(stream.stream_id, None)
            return
        if status != 200:
            # The core ended the stream (and reset what we will not read): nothing more here.
            stream._end_sent = True
            self._forget(stream)
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
