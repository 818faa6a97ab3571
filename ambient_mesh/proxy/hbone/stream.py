"""One HBONE CONNECT stream: the HTTP/2 side of a relay (transport/relay.py's `Endpoint`).

Counterpart: ztunnel src/proxy/h2.rs (`H2Stream`). A stream keeps only what its relay needs:
whether either side ended, whether its relay is told to stop feeding it, the peer's bytes that
came before a relay was attached, and what to cancel when the peer resets it unanswered. Send
state (queued bytes, a waiting END_STREAM) and held receive credit live in the HTTP/2 core;
the stream reaches it through its connection's public verbs (`send`, `end`, `reset_stream`,
`forget`, `flush`) and the core's own (`acknowledge`, `hold_credit`, `release_credit`), and the
connection reaches the stream through the `on_*` verbs below.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ...errors import ProxyError
from ...http2.frames import ErrorCode, error_name
from ...transport.relay import Endpoint

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ...http2 import Connection
    from ...identity.spiffe import Identity
    from ...transport.relay import Relay


class Cancellable(Protocol):
    """What `on_request` may hand back (the task serving a stream): cancelled on an early reset."""

    def cancel(self) -> object: ...


class StreamOwner(Protocol):
    """A stream's connection (connection.HboneConnection) as the stream and its users see it:
    public verbs only."""

    loop: asyncio.AbstractEventLoop
    client_side: bool
    core: Connection
    streams: dict[int, HboneStream]
    peer_identity: Identity | None

    def respond(self, stream: HboneStream, status: int, headers: Sequence[tuple[str, str]] = ()) -> None: ...

    def send(self, stream: HboneStream, data: bytes | memoryview) -> None: ...
    def end(self, stream: HboneStream) -> None: ...
    def reset_stream(self, stream_id: int, code: int) -> None: ...
    def forget(self, stream: HboneStream) -> None: ...
    def flush(self) -> None: ...


class HboneError(ProxyError):
    """An HBONE connection or stream failed; `response_flag` (a ResponseFlag) is what the metrics
    and the access log record for it, CONNECT unless the failure says otherwise."""


class HboneStreamRefused(HboneError):
    """The peer never processed the stream (GOAWAY below its id, REFUSED_STREAM): safe to retry."""


def _header(headers: tuple[tuple[str, str], ...], name: str) -> str | None:
    for k, v in headers:
        if k == name:
            return v
    return None


@dataclass(frozen=True, slots=True)
class ConnectRequest:
    """What the server saw in a CONNECT stream's request headers."""

    method: str
    authority: str
    headers: tuple[tuple[str, str], ...]

    def header(self, name: str) -> str | None:
        return _header(self.headers, name)


@dataclass(frozen=True, slots=True)
class ConnectResponse:
    status: int
    headers: tuple[tuple[str, str], ...]

    def header(self, name: str) -> str | None:
        return _header(self.headers, name)


class StreamState(enum.Enum):
    OPEN = "open"
    HALF_CLOSED_LOCAL = "half-closed (local)"
    HALF_CLOSED_REMOTE = "half-closed (remote)"
    CLOSED = "closed"


_ORDERLY_RESETS = (ErrorCode.NO_ERROR, ErrorCode.CANCEL)
_NOTHING_HELD: list[bytes | memoryview] = []  # shared, always empty: nothing is held once attached


class HboneStream(Endpoint):
    """One CONNECT stream: the HTTP/2 side of a relay."""

    __slots__ = (
        "conn",
        "stream_id",
        "request",
        "response",
        "_end_asked",
        "_end_sent",
        "_remote_ended",
        "_reading_paused",
        "_blocked",
        "_held",
        "_held_end",
        "_reset",
        "_cancel",
        "relay",
        "peer",
        "bytes_read",
    )

    def __init__(self, conn: StreamOwner, stream_id: int) -> None:
        self.conn = conn
        self.stream_id = stream_id
        self.relay: Relay | None = None
        self.peer: Endpoint | None = None  # the relay's other side (relay.Endpoint)
        self.bytes_read = 0
        self.request: ConnectRequest | None = None
        # The CONNECT's answer, for the client side's opener; the server side has nobody to wake,
        # and a future is 152 bytes of every idle tunnel there.
        self.response: asyncio.Future[ConnectResponse] | None = (
            conn.loop.create_future() if conn.client_side else None
        )
        self._end_asked = False  # write_eof was called (the END_STREAM may wait in the core)
        self._end_sent = False  # the END_STREAM is queued to go out
        self._remote_ended = False
        self._reading_paused = False  # the relay's other side takes no more: credit held
        self._blocked = False  # we told the relay to stop feeding us
        self._held: list[bytes | memoryview] = []  # DATA received before a relay is attached
        self._held_end = False
        self._reset: int | None = None
        # What on_request started (the app connect): cancelled on an early reset.
        self._cancel: Cancellable | None = None

    def __repr__(self) -> str:
        queued = self.conn.core.queued_bytes(self.stream_id)
        return f"HboneStream(id={self.stream_id}, {self.state.value}, queued={queued}B)"

    @property
    def state(self) -> StreamState:
        if self._reset is not None or (self._end_sent and self._remote_ended):
            return StreamState.CLOSED
        if self._end_sent:
            return StreamState.HALF_CLOSED_LOCAL
        if self._remote_ended:
            return StreamState.HALF_CLOSED_REMOTE
        return StreamState.OPEN

    @property
    def finished(self) -> bool:
        """Both sides ended: the connection forgets the stream."""
        return self._end_sent and self._remote_ended

    # Relay-facing verbs ----------------------------------------------------------------
    def attach(self, relay: Relay) -> None:
        self.relay = relay
        self._cancel = None
        held, self._held = self._held, _NOTHING_HELD  # no new list per idle tunnel
        core = self.conn.core
        for chunk in held:
            relay.data_from(self, chunk)
            core.acknowledge(self.stream_id, len(chunk))  # held while the relay pauses us
        if self._reset is not None:
            relay.failed(self, HboneError(f"stream reset by peer (code {self._reset})"))
        elif self._held_end:
            relay.eof_from(self)
        self.conn.flush()

    def write(self, data: bytes | memoryview) -> None:
        if self._reset is None and not self._end_asked:
            self.conn.send(self, data)

    def write_eof(self) -> None:
        if self._reset is None and not self._end_asked:
            self._end_asked = True
            self.conn.end(self)

    def abort(self) -> None:
        if self._reset is None and not (self._end_sent and self._remote_ended):
            self._reset = ErrorCode.CANCEL
            self.conn.reset_stream(self.stream_id, ErrorCode.CANCEL)

    def pause_reading(self) -> None:
        if not self._reading_paused:
            self._reading_paused = True
            self.conn.core.hold_credit(self.stream_id)

    def resume_reading(self) -> None:
        if self._reading_paused:
            self._reading_paused = False
            self.conn.core.release_credit(self.stream_id)
            self.conn.flush()

    def close(self) -> None:
        # Forgotten once both sides ended; a stream its END_STREAM or the peer's already forgot
        # (the usual case) costs no call.
        if self._end_sent and self._remote_ended and self.conn.streams.get(self.stream_id) is self:
            self.conn.forget(self)

    # Connection-facing verbs -------------------------------------------------------------
    def on_data(self, data: bytes | memoryview) -> None:
        """A DATA payload from the peer: to the relay's other side, its credit to the core (which
        holds it while that side is paused)."""
        peer = self.peer
        if peer is None:
            self._held.append(data)  # credit is returned when a relay takes them
            return
        if self._reading_paused and type(data) is memoryview:
            # The peer socket is not taking more: what it is handed now waits in its buffer, and
            # a view would pin a whole receive buffer (RECEIVE_BUFFER_BYTES) for it, so a slow
            # app would hold several times the stream window (tests/netns/test_attack_hbone.py).
            data = bytes(data)
        self.bytes_read += len(data)
        peer.write(data)
        self.conn.core.acknowledge(self.stream_id, len(data))

    def on_end(self) -> None:
        self._remote_ended = True
        if self.relay is None:
            self._held_end = True
        else:
            self.relay.eof_from(self)

    def on_end_sent(self) -> None:
        """The connection queued our END_STREAM to go out (at once, or once the queue drained)."""
        self._end_asked = True
        self._end_sent = True

    def on_response(self, response: ConnectResponse) -> None:
        """Client side: the CONNECT's answer."""
        future = self.response
        if future is not None and not future.done():
            future.set_result(response)

    def on_started(self, started: object) -> None:
        """Server side: what `on_request` started for the stream (the app connect), cancelled
        if the peer resets the stream before it is answered."""
        if started is not None and hasattr(started, "cancel") and self.relay is None:
            self._cancel = started

    def on_answered(self, status: int) -> None:
        """Server side: the CONNECT was answered; anything but 200 ended our side."""
        self._cancel = None
        if status != 200:
            self.on_end_sent()

    def on_reset(self, code: int, answered: bool, refused: bool = False) -> None:
        self._reset = code
        if refused:
            self.fail_response(
                HboneStreamRefused("stream refused by the peer's GOAWAY before it was processed")
            )
        else:
            self.fail_response(HboneError(f"stream reset by peer ({error_name(code)})"))
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
            relay.failed(self, HboneError(f"stream reset by peer ({error_name(code)})"))

    def on_send_failed(self, error: HboneError, *, reset: bool) -> None:
        """What the stream sent could not be: its relay fails (which aborts both sides); with no
        relay, `reset` resets the stream here."""
        relay = self.relay
        if relay is not None and not relay.done.done():
            relay.failed(self, error)
        elif reset:
            self.abort()

    def on_connection_lost(self, error: BaseException) -> None:
        self.fail_response(HboneError(f"HBONE connection lost: {error}"))
        relay = self.relay
        if relay is None:
            if self._cancel is not None:
                self._cancel.cancel()  # nobody will read an answer
        elif not relay.done.done():
            relay.failed(self, error)

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
