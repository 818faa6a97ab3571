"""What the HTTP/2 core tells its shell (the counterpart of h2's events, for CONNECT tunnels).

Every event is a frozen slotted dataclass. Stream ids are the peer's and ours as on the wire.
Header names and values are decoded as Latin-1 (RFC 9110 5.5: field values are octets; the
shell compares them as text).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestReceived:
    """Server side: a well-formed plain CONNECT (RFC 9113 8.5) with an authority."""

    stream_id: int
    authority: str
    headers: tuple[tuple[str, str], ...]  # regular fields only, in order
    end_stream: bool


@dataclass(frozen=True, slots=True)
class RequestRefused:
    """Server side: a request the core answered itself (400) or reset (malformed), never the app's."""

    stream_id: int
    reason: str


@dataclass(frozen=True, slots=True)
class ResponseReceived:
    """Client side: the final response to our CONNECT (1xx responses are skipped)."""

    stream_id: int
    status: int
    headers: tuple[tuple[str, str], ...]
    end_stream: bool


@dataclass(frozen=True, slots=True)
class DataReceived:
    """Stream bytes, in order. Acknowledge them (Connection.acknowledge) to return window credit."""

    stream_id: int
    data: bytes | memoryview  # a read-only view of the received bytes for long payloads


@dataclass(frozen=True, slots=True)
class StreamEnded:
    """The peer half-closed the stream (END_STREAM)."""

    stream_id: int


@dataclass(frozen=True, slots=True)
class StreamReset:
    """The stream is gone: RST_STREAM from the peer, or (`refused`) not processed by a peer's GOAWAY.

    `answered` is False when the request never got its response: on the server side the shell
    cancels whatever it started for the stream (the app connect); on the client side a refused
    stream may be retried on another connection (RFC 9113 8.7).
    """

    stream_id: int
    error_code: int
    answered: bool
    refused: bool = False


@dataclass(frozen=True, slots=True)
class WindowUpdated:
    """Send window grew: 0 for the connection (every stream may send), else that stream."""

    stream_id: int


@dataclass(frozen=True, slots=True)
class StreamWritable:
    """The stream's send queue drained (`Connection.send`/`end` had held bytes or the END_STREAM
    back behind a closed window or paused output): its producer may write again. `ended`: the
    END_STREAM that waited went out with it."""

    stream_id: int
    ended: bool


@dataclass(frozen=True, slots=True)
class GoawayReceived:
    """No new streams on this connection; streams up to `last_stream_id` carry on (RFC 9113 6.8)."""

    last_stream_id: int
    error_code: int
    debug: bytes


@dataclass(frozen=True, slots=True)
class ConnectionTerminated:
    """The core is finished: write what `data_to_send` still holds, then close the transport.

    `error_code` is what our GOAWAY said; `reason` says why, for logs. `clean` is True when the
    connection simply ran out of streams after a GOAWAY (a drain): close gracefully. Otherwise it
    failed (protocol error, flood, PING timeout): write the GOAWAY and abort.
    """

    error_code: int
    reason: str
    by_peer: bool = False
    clean: bool = False


Event = (
    RequestReceived
    | RequestRefused
    | ResponseReceived
    | DataReceived
    | StreamEnded
    | StreamReset
    | WindowUpdated
    | StreamWritable
    | GoawayReceived
    | ConnectionTerminated
)
