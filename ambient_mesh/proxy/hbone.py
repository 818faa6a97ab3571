"""HBONE: HTTP/2 CONNECT streams over a mutual-TLS connection (port 15008).

Counterparts: ztunnel src/proxy/h2.rs, h2/client.rs, h2/server.rs. The HTTP/2 state machine is
python-hyper `h2` (sans-IO); this module is the thin asyncio shell around it: one
`HboneConnection` per TLS connection (client or server side), one `HboneStream` per proxied TCP
connection. Streams are relay endpoints (see relay.py), so bytes flow from a socket callback
straight into `h2.send_data` and out of `DATA` events straight into the peer socket.

Settings and flow control follow ztunnel (reference/ztunnel.md section 11): stream window
4 MiB, connection window 16 MiB, max frame 1 MiB, push disabled, header lists 16 KiB (client)
and 64 KiB (server), 200 concurrent streams on the server side, PING every 10 s and the
connection dropped after 20 s without an answer. Received bytes are acknowledged (window
credit returned to the sender) only while the socket we forward them to can take more: a slow
reader closes the window instead of growing our buffers.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import hyperframe.frame

from ..errors import AmbientError
from .relay import Endpoint

log = logging.getLogger("ambient_mesh.hbone")

STREAM_WINDOW_BYTES = 4 * 1024 * 1024
CONNECTION_WINDOW_BYTES = 16 * 1024 * 1024
MAX_FRAME_BYTES = 1024 * 1024
CLIENT_MAX_HEADER_LIST_BYTES = 16 * 1024
SERVER_MAX_HEADER_LIST_BYTES = 64 * 1024
SERVER_MAX_CONCURRENT_STREAMS = 200
PING_INTERVAL_S = 10.0
PING_TIMEOUT_S = 20.0
DEFAULT_WINDOW_BYTES = 65535


def _data_frame_body_repr(self: hyperframe.frame.DataFrame) -> str:
    # h2 4.4.1 formats repr(frame) for its trace log on every received frame, and hyperframe
    # hex-encodes the whole DATA payload to print only its first 10 bytes
    # (reference/performance.md B4.2: 2.4x-45x slower receive). Same text, first bytes only.
    data = bytes(self.data[:11])
    if self.flags and "PADDED" in self.flags:
        return hyperframe.frame._raw_data_repr(self.serialize_body()[:11])
    return hyperframe.frame._raw_data_repr(data)


hyperframe.frame.DataFrame._body_repr = _data_frame_body_repr


class HboneError(AmbientError):
    """An HBONE connection or stream failed. `response_flag` is Istio's flag for metrics."""

    def __init__(
        self,
        message: str,
        *,
        response_flag: str = "CONNECT",
        status: int | None = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(message, hint=hint)
        self.response_flag = response_flag
        self.status = status


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

    def header_values(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k == name]


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


def _decode_headers(raw) -> tuple[tuple[str, str], ...]:
    return tuple(
        (
            k.decode("latin-1") if isinstance(k, bytes) else k,
            v.decode("latin-1") if isinstance(v, bytes) else v,
        )
        for k, v in raw
    )


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
        "relay",
    )

    def __init__(self, conn: HboneConnection, stream_id: int) -> None:
        self.conn = conn
        self.stream_id = stream_id
        self.relay = None
        self.request: ConnectRequest | None = None
        self.response: asyncio.Future[ConnectResponse] = conn.loop.create_future()
        self._pending = bytearray()  # bytes waiting for flow-control window
        self._eof_pending = False
        self._end_sent = False
        self._remote_ended = False
        self._unacked = 0  # received bytes whose window credit is held back
        self._ack_paused = False
        self._blocked = False  # we told the relay to stop feeding us
        self._held: list[bytes] = []  # DATA received before a relay is attached
        self._held_end = False
        self._reset: int | None = None

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
    def attach(self, relay) -> None:
        self.relay = relay
        held, self._held = self._held, []
        for chunk, flow in held:
            relay.data_from(self, chunk)
            self._credit(flow)
        if self._reset is not None:
            relay.failed(self, HboneError(f"stream reset by peer (code {self._reset})"))
        elif self._held_end:
            relay.eof_from(self)
        self.conn.flush()

    def write(self, data: bytes) -> None:
        if self._reset is not None or self._end_sent:
            return
        if self._pending:
            self._pending += data
            data = b""
        self.conn.pump(self, data)

    def write_eof(self) -> None:
        if self._reset is not None or self._end_sent:
            return
        self._eof_pending = True
        self.conn.pump(self)

    def abort(self) -> None:
        if self._reset is None and not (self._end_sent and self._remote_ended):
            self._reset = h2.errors.ErrorCodes.CANCEL
            self.conn.reset_stream(self.stream_id, h2.errors.ErrorCodes.CANCEL)

    def pause_reading(self) -> None:
        self._ack_paused = True

    def resume_reading(self) -> None:
        if self._ack_paused:
            self._ack_paused = False
            if self._unacked:
                n, self._unacked = self._unacked, 0
                self.conn.acknowledge(self.stream_id, n)
                self.conn.flush()

    def close(self) -> None:
        self.conn.stream_closed(self)

    # Connection-facing -----------------------------------------------------------------
    def _credit(self, flow: int) -> None:
        if flow <= 0:
            return
        if self._ack_paused:
            self._unacked += flow
        else:
            self.conn.acknowledge(self.stream_id, flow)

    def on_data(self, data: bytes, flow: int) -> None:
        relay = self.relay
        if relay is None:
            self._held.append((data, flow))  # credit is returned when a relay takes them
            return
        relay.data_from(self, data)
        self._credit(flow)

    def on_end(self) -> None:
        self._remote_ended = True
        if self.relay is None:
            self._held_end = True
        else:
            self.relay.eof_from(self)

    def on_reset(self, code: int) -> None:
        self._reset = code
        self.fail_response(HboneError(f"stream reset by peer (code {code})"))
        relay = self.relay
        if relay is None:
            return
        # RST_STREAM NO_ERROR / CANCEL is an orderly end (reference 3.6): EOF to the socket,
        # and since a reset stream carries nothing more either way, the relay is finished.
        if code in (h2.errors.ErrorCodes.NO_ERROR, h2.errors.ErrorCodes.CANCEL):
            if not self._remote_ended:
                self._remote_ended = True
                relay.eof_from(self)
            if not relay.done.done():
                relay.finish()
        elif not relay.done.done():
            relay.failed(self, HboneError(f"stream reset by peer (code {code})"))

    def fail_response(self, exc: BaseException) -> None:
        """Wake a client waiting for the CONNECT answer; silent when nobody waits (server side)."""
        if not self.response.done():
            self.response.set_exception(exc)
            self.response.exception()  # mark retrieved: an awaiting opener still gets it

    def set_blocked(self, blocked: bool) -> None:
        if blocked == self._blocked or self.relay is None:
            return
        self._blocked = blocked
        if blocked:
            self.relay.blocked(self)
        else:
            self.relay.unblocked(self)


class HboneConnection(asyncio.Protocol):
    """One HTTP/2 connection over TLS carrying CONNECT streams; client or server side.

    The server side calls `on_request(stream)` for each new CONNECT stream; the handler must
    answer with `respond(stream, status, headers)`.
    """

    def __init__(
        self,
        *,
        client_side: bool,
        settings: HboneSettings = DEFAULT_SETTINGS,
        on_request: Callable[[HboneStream], None] | None = None,
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
        self.peer_identity = None  # set by on_connected from the peer's certificate
        config = h2.config.H2Configuration(
            client_side=client_side, header_encoding=None, validate_inbound_headers=True
        )
        self.h2 = h2.connection.H2Connection(config=config)
        local = {
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: settings.stream_window_bytes,
            h2.settings.SettingCodes.MAX_FRAME_SIZE: settings.max_frame_bytes,
            h2.settings.SettingCodes.ENABLE_PUSH: 0,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: CLIENT_MAX_HEADER_LIST_BYTES
            if client_side
            else SERVER_MAX_HEADER_LIST_BYTES,
        }
        if not client_side:
            local[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] = max_concurrent_streams
        # Set before initiate_connection() so the first SETTINGS frame carries them; h2 reads
        # the inbound frame limit once at construction, so it is updated alongside.
        self.h2.local_settings = h2.settings.Settings(client=client_side, initial_values=local)
        self.h2.max_inbound_frame_size = settings.max_frame_bytes
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, HboneStream] = {}
        self.closed: asyncio.Future[None] = self.loop.create_future()
        self.goaway_received = False
        self._write_paused = False
        self._blocked_streams: set[HboneStream] = set()
        self._ping_timer: asyncio.TimerHandle | None = None
        self._ping_deadline: asyncio.TimerHandle | None = None
        self._error: BaseException | None = None
        self.last_used = self.loop.time()
        self.total_streams = 0

    def __repr__(self) -> str:
        side = "client" if self.client_side else "server"
        state = "closed" if self.closed.done() else ("draining" if self.goaway_received else "open")
        return f"HboneConnection({side}, {state}, {len(self.streams)} streams, {self.total_streams} total)"

    # asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self.on_connected is not None:
            # TLS is complete here: check the peer before a single HTTP/2 byte is exchanged.
            try:
                self.on_connected(self)
            except Exception as e:
                self._error = e
                transport.abort()
                return
        self.h2.initiate_connection()
        extra = self.settings.connection_window_bytes - DEFAULT_WINDOW_BYTES
        if extra > 0:
            self.h2.increment_flow_control_window(extra)
        self.flush()
        self._schedule_ping()

    def data_received(self, data: bytes) -> None:
        if self._error is not None:
            return
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as e:
            log.debug("HTTP/2 protocol error from peer: %s", e)
            self.flush()
            self._fail(HboneError(f"HTTP/2 protocol error: {e}", response_flag="H2_HANDSHAKE_FAILURE"))
            return
        for event in events:
            self._dispatch(event)
        self.flush()

    def _dispatch(self, event) -> None:
        t = type(event)
        if t is h2.events.DataReceived:
            stream = self.streams.get(event.stream_id)
            if stream is None:
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                return
            stream.on_data(event.data, event.flow_controlled_length)
            if event.stream_ended is not None:
                stream.on_end()
        elif t is h2.events.WindowUpdated:
            if event.stream_id == 0:
                self._pump_all()
            else:
                stream = self.streams.get(event.stream_id)
                if stream is not None:
                    self.pump(stream)
        elif t is h2.events.RequestReceived:
            self._on_request(event)
        elif t is h2.events.ResponseReceived:
            stream = self.streams.get(event.stream_id)
            if stream is not None and not stream.response.done():
                headers = _decode_headers(event.headers)
                status = next((int(v) for k, v in headers if k == ":status"), 0)
                stream.response.set_result(ConnectResponse(status, headers))
            if event.stream_ended is not None and stream is not None:
                stream.on_end()
        elif t is h2.events.StreamEnded:
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                stream.on_end()
        elif t is h2.events.StreamReset:
            stream = self.streams.pop(event.stream_id, None)
            if stream is not None:
                self._blocked_streams.discard(stream)
                stream.on_reset(event.error_code)
        elif t is h2.events.RemoteSettingsChanged:
            if h2.settings.SettingCodes.INITIAL_WINDOW_SIZE in event.changed_settings:
                self._pump_all()
        elif t is h2.events.PingAckReceived:
            if self._ping_deadline is not None:
                self._ping_deadline.cancel()
                self._ping_deadline = None
        elif t is h2.events.ConnectionTerminated:
            self.goaway_received = True
            last = event.last_stream_id if event.last_stream_id is not None else 0
            for sid, stream in list(self.streams.items()):
                # Streams the peer never processed will not be answered (RFC 9113 6.8).
                if self.client_side and sid > last:
                    stream.fail_response(
                        HboneError("connection closed by GOAWAY before the stream was accepted")
                    )
            if not self.streams:
                self._close_transport()

    def pause_writing(self) -> None:
        self._write_paused = True
        for stream in list(self.streams.values()):
            stream.set_blocked(True)

    def resume_writing(self) -> None:
        self._write_paused = False
        self._pump_all()
        for stream in list(self.streams.values()):
            if stream not in self._blocked_streams:
                stream.set_blocked(False)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        err = self._error or exc or HboneError("HBONE connection closed")
        for stream in list(self.streams.values()):
            stream.fail_response(HboneError(f"HBONE connection lost: {err}"))
            if stream.relay is not None and not stream.relay.done.done():
                stream.relay.failed(stream, err if isinstance(err, BaseException) else HboneError(str(err)))
        self.streams.clear()
        if not self.closed.done():
            self.closed.set_result(None)
        if self.on_closed is not None:
            self.on_closed(self)

    # Sending ---------------------------------------------------------------------------
    def flush(self) -> None:
        data = self.h2.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def pump(self, stream: HboneStream, data: bytes = b"") -> None:
        """Move bytes into DATA frames as far as the windows allow; the rest waits in `_pending`.

        `data` is a fresh chunk from the socket when nothing is pending: in the common case
        (window open, chunk below the frame size) it becomes a frame without being copied.
        Copies were most of the outbound proxy's CPU (bench/README.md, HBONE profile).
        """
        pending = stream._pending
        if self._write_paused or stream._reset is not None or stream.stream_id not in self.streams:
            if data:
                pending += data
            return
        h2c = self.h2
        sid = stream.stream_id
        try:
            if data:
                view = memoryview(data)
                offset, size = 0, len(data)
                while offset < size:
                    n = min(h2c.local_flow_control_window(sid), h2c.max_outbound_frame_size, size - offset)
                    if n <= 0:
                        break
                    h2c.send_data(sid, data if n == size else view[offset : offset + n])
                    offset += n
                if offset < size:
                    pending += view[offset:]
                view.release()
            while pending:
                window = h2c.local_flow_control_window(sid)
                if window <= 0:
                    break
                n = min(window, h2c.max_outbound_frame_size, len(pending))
                h2c.send_data(sid, bytes(pending[:n]))
                del pending[:n]
            if not pending and stream._eof_pending and not stream._end_sent:
                h2c.end_stream(sid)
                stream._end_sent = True
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError) as e:
            stream._pending.clear()
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

    def _pump_all(self) -> None:
        for stream in list(self._blocked_streams) or list(self.streams.values()):
            self.pump(stream)

    def acknowledge(self, stream_id: int, n: int) -> None:
        try:
            self.h2.acknowledge_received_data(n, stream_id)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            pass  # stream already gone: its window no longer matters

    def reset_stream(self, stream_id: int, code: int) -> None:
        stream = self.streams.pop(stream_id, None)
        if stream is not None:
            self._blocked_streams.discard(stream)
        try:
            self.h2.reset_stream(stream_id, code)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            pass
        self.flush()
        self._maybe_close_idle()

    def stream_closed(self, stream: HboneStream) -> None:
        if stream._end_sent and stream._remote_ended:
            self._forget(stream)

    def _forget(self, stream: HboneStream) -> None:
        if self.streams.pop(stream.stream_id, None) is not None:
            self._blocked_streams.discard(stream)
            self.last_used = self.loop.time()
            self._maybe_close_idle()

    def _maybe_close_idle(self) -> None:
        if not self.streams and self.goaway_received:
            self._close_transport()

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
        return self.h2.remote_settings.max_concurrent_streams

    @property
    def usable(self) -> bool:
        """Can carry a new stream: not closing, no GOAWAY."""
        return (
            not self.closed.done()
            and not self.goaway_received
            and self.transport is not None
            and not self.transport.is_closing()
        )

    async def open_stream(
        self, authority: str, headers: list[tuple[str, str]]
    ) -> tuple[HboneStream, ConnectResponse]:
        """Send a CONNECT and wait for the response headers. Non-200 is returned, not raised."""
        if not self.usable:
            raise HboneError("HBONE connection is closing", response_flag="CONNECT")
        sid = self.h2.get_next_available_stream_id()
        stream = HboneStream(self, sid)
        self.streams[sid] = stream
        self.total_streams += 1
        request = [(b":method", b"CONNECT"), (b":authority", authority.encode())]
        request += [(k.encode(), v.encode()) for k, v in headers]
        try:
            self.h2.send_headers(sid, request, end_stream=False)
        except h2.exceptions.ProtocolError as e:
            self.streams.pop(sid, None)
            raise HboneError(f"cannot open HBONE stream: {e}") from None
        self.flush()
        response = await stream.response
        if response.status != 200:
            self.streams.pop(sid, None)
            self._maybe_close_idle()
        return stream, response

    # Server side -----------------------------------------------------------------------
    def _on_request(self, event: h2.events.RequestReceived) -> None:
        stream = HboneStream(self, event.stream_id)
        headers = _decode_headers(event.headers)
        method = next((v for k, v in headers if k == ":method"), "")
        authority = next((v for k, v in headers if k == ":authority"), "")
        stream.request = ConnectRequest(
            method, authority, tuple((k, v) for k, v in headers if not k.startswith(":"))
        )
        self.streams[event.stream_id] = stream
        self.total_streams += 1
        if event.stream_ended is not None:
            stream.on_end()
        if self.on_request is None:
            self.respond(stream, 503)
            return
        self.on_request(stream)

    def respond(self, stream: HboneStream, status: int, headers: list[tuple[str, str]] = ()) -> None:
        """Answer a CONNECT. Non-200 answers end the stream."""
        if stream.stream_id not in self.streams:
            return
        end = status != 200
        try:
            self.h2.send_headers(
                stream.stream_id,
                [(b":status", str(status).encode())] + [(k.encode(), v.encode()) for k, v in headers],
                end_stream=end,
            )
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            self.streams.pop(stream.stream_id, None)
            return
        if end:
            stream._end_sent = True
            if stream._remote_ended:
                self._forget(stream)
            else:
                # Nothing more will be read from this stream: reset it so its window frees up.
                self.reset_stream(stream.stream_id, h2.errors.ErrorCodes.NO_ERROR)
        self.flush()

    def drain(self) -> None:
        """Graceful shutdown: GOAWAY now, close once the open streams finish."""
        if self.closed.done():
            return
        self.goaway_received = True  # no new streams on our side either
        try:
            self.h2.close_connection()
        except h2.exceptions.ProtocolError:
            pass
        self.flush()
        self._maybe_close_idle()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # Keepalive -------------------------------------------------------------------------
    def _schedule_ping(self) -> None:
        if self.settings.ping_interval_s > 0:
            self._ping_timer = self.loop.call_later(self.settings.ping_interval_s, self._send_ping)

    def _send_ping(self) -> None:
        if self.closed.done() or self.transport is None or self.transport.is_closing():
            return
        try:
            self.h2.ping(os.urandom(8))
        except h2.exceptions.ProtocolError:
            return
        self.flush()
        if self._ping_deadline is None:
            self._ping_deadline = self.loop.call_later(self.settings.ping_timeout_s, self._ping_timed_out)
        self._schedule_ping()

    def _ping_timed_out(self) -> None:
        self._fail(HboneError(f"no PING answer within {self.settings.ping_timeout_s:g}s"))

    def _cancel_timers(self) -> None:
        for timer in (self._ping_timer, self._ping_deadline):
            if timer is not None:
                timer.cancel()
        self._ping_timer = self._ping_deadline = None

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        if self.transport is not None:
            self.transport.abort()

    def _close_transport(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
