"""A sans-IO HTTP/2 connection for CONNECT tunnels (HBONE): bytes and `now` in, events and bytes out.

Counterparts: the `h2` crate under ztunnel (src/proxy/h2.rs) and python-hyper's `h2`, which this
replaces. No sockets, no awaits, no clock: the shell (proxy/hbone/connection.py) passes `now` to
`receive`, `handle_timeout` and `start_drain`, writes what `data_to_send` returns, and arms one
timer at `next_deadline()`.

Why a purpose-built engine rather than `h2` 4.4.1 with limits in front of it (issue 8):

- h2 moves the whole connection to CLOSED once a GOAWAY is sent or received, so the next DATA on
  a stream that RFC 9113 6.8 lets finish kills it: drains cut live tunnels. Correcting that means
  patching its state machine from outside.
- h2 hands complete header blocks to `hpack`, whose decoder is quadratic in the block size, and it
  only counts CONTINUATION frames (64), not bytes: 64 x 1 MiB frames froze the loop for 21 s.
  Bounding the block in front of h2 would mean parsing every frame twice.
- Flood limits, early-reset accounting and connection-credit conservation all need per-frame
  decisions that h2 makes internally; and h2 builds a frame object, an event object and a
  `repr` per frame, the per-frame cost issue 11 wants gone.
- HBONE needs a small subset: CONNECT only, no push, no priorities, no trailers of interest.
  About 1,000 lines with HPACK from the `hpack` library (hpack_block.py) cover it, and every
  limit below is enforced at the frame header, before the payload is buffered.

What the core enforces (budgets are per connection; the names are the constants below):

- Frames longer than the SETTINGS_MAX_FRAME_SIZE we advertised: FRAME_SIZE_ERROR.
- Header blocks: HEADERS + CONTINUATION payload bytes are counted at each frame header and
  refused above `max_header_list_bytes + HPACK_SLACK_BYTES` before the bytes are buffered
  (GOAWAY ENHANCE_YOUR_CALM); decoding is linear; the decoded list is bounded again by the
  advertised SETTINGS_MAX_HEADER_LIST_SIZE. An unfinished block is dropped on close.
- Rapid reset (CVE-2023-44487): a stream reset by the peer before we answered it is never
  announced when HEADERS and RST_STREAM arrive together, and otherwise reported with
  `answered=False` so the shell cancels the app connect. More than EARLY_RESET_BURST (20, hyper's
  h2 limit) such resets, refilled at EARLY_RESET_PER_S, -> GOAWAY ENHANCE_YOUR_CALM.
- Control-frame floods, as token buckets (burst, refill per second): SETTINGS (32, 1/s), PING
  (64, 5/s), RST_STREAM of a closed stream or an unanswered request (1000, 33/s: nghttp2's
  stream-reset rate limit; ending a live stream is no flood), stream errors we send
  (100, 10/s), PRIORITY and unknown frame types (1000, 100/s). WINDOW_UPDATE is earned the way
  Envoy earns it: 100 + 10 per DATA frame we sent + 2 per stream. Empty DATA/HEADERS/CONTINUATION
  frames without END_STREAM: at most 10 in a row (Envoy allows 1). Any of these exceeded ->
  GOAWAY ENHANCE_YOUR_CALM.
- A peer that does not read: when more than MAX_OUTBOUND_CONTROL_FRAMES (1000, Envoy's
  max_outbound_control_frames and nghttp2's max_outbound_ack) control frames wait in our outbox
  (the shell stops taking bytes while the transport is paused), GOAWAY and close.
- Flow control: every byte counted against our connection window comes back to it however its
  stream ends (acknowledged, reset either way, refused, unknown stream, padding): for every state
  `credit_balance() == connection_window_bytes`. Credit is returned in WINDOW_UPDATEs once 1/8 of
  a window is owed or less than half of it is left (fewer frames than one per DATA frame).
- GOAWAY (RFC 9113 6.8): after sending or receiving it, streams at or below the last stream id
  carry on both ways until they end; new streams are refused (REFUSED_STREAM); our own streams
  above a received last id are reported `refused` (safe to retry). `start_drain` on the server
  sends GOAWAY(2^31-1), then a PING, then GOAWAY(last processed id) once the PING is answered.
  The connection terminates when a final GOAWAY went either way and no stream is left.
- Requests: only plain CONNECT with an :authority and without :scheme/:path reaches the shell
  (RFC 9113 8.5). `:protocol` (RFC 8441 extended CONNECT, never enabled by us) and any other
  malformed request -> RST_STREAM PROTOCOL_ERROR; a well-formed non-CONNECT request -> 400.
- Keepalive: a PING every `ping_interval_s`; no answer within `ping_timeout_s` -> terminated.

Send state per stream (`send`, `end`, `pause_output`, `resume_output`): what the windows do not
take, or what comes while the shell's transport is paused, waits in the stream's send queue,
bounded by `max_stream_queued_bytes` (past it `send` raises SendQueueFull and drops the queue);
an END_STREAM asked for behind queued bytes waits behind them. Queues drain, in the order the
streams started waiting, as WINDOW_UPDATEs and SETTINGS open windows and when output resumes;
a stream whose queue emptied is reported with a `StreamWritable` event, and `send` returns False
when the caller must stop producing until then. Receive credit the shell consumed while its own
consumer is paused is held (`hold_credit`) and returned at `release_credit`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ProtocolError
from ..host.cpython import new_frozen, slot_setter
from . import frames as f
from .events import (
    ConnectionTerminated,
    DataReceived,
    Event,
    GoawayReceived,
    RequestReceived,
    RequestRefused,
    ResponseReceived,
    StreamEnded,
    StreamReset,
    StreamWritable,
    WindowUpdated,
)
from .hpack_block import BlockDecoder, BlockEncoder, HeaderListTooLarge, HpackError

E = f.ErrorCode
_unpack_header = f.HEADER.unpack_from
_pack_header = f.HEADER.pack
_DATA = f.DATA
_HEADERS = f.HEADERS
_END_STREAM = f.FLAG_END_STREAM
_END_HEADERS = f.FLAG_END_HEADERS
_PADDED_OR_PRIORITY = f.FLAG_PADDED | f.FLAG_PRIORITY
_NOT_END_STREAM = 0xFF & ~f.FLAG_END_STREAM
# A DataReceived per DATA frame made without the frozen dataclass's generated __init__
# (host/cpython.py): the same frozen object for about half the cost.
_new_object = new_frozen
_set_event_sid = slot_setter(DataReceived, "stream_id")
_set_event_data = slot_setter(DataReceived, "data")

# Header blocks: encoded bytes may exceed the decoded list only by padding (<= 256 per HEADERS
# frame), priority fields and table size updates; Huffman is only used when it is shorter.
HPACK_SLACK_BYTES = 1024
# Budgets (see the module docstring for where the numbers come from).
EARLY_RESET_BURST = 20
EARLY_RESET_PER_S = 1.0
SETTINGS_BURST, SETTINGS_PER_S = 32, 1.0
PING_BURST, PING_PER_S = 64, 5.0
RST_STREAM_BURST, RST_STREAM_PER_S = 1000, 33.0
STREAM_ERROR_BURST, STREAM_ERROR_PER_S = 100, 10.0
IGNORED_FRAME_BURST, IGNORED_FRAME_PER_S = 1000, 100.0
WINDOW_UPDATE_BASE_FRAMES = 100
WINDOW_UPDATES_PER_DATA_FRAME_SENT = 10
WINDOW_UPDATES_PER_STREAM = 2
MAX_CONSECUTIVE_EMPTY_FRAMES = 10
MAX_OUTBOUND_CONTROL_FRAMES = 1000
# Node's default (CVE-2020-11080): a SETTINGS frame with more entries is a flood by itself.
MAX_SETTINGS_ENTRIES = 32
MAX_GOAWAY_FRAME_BYTES = 16 * 1024
# Streams we reset whose in-flight DATA we still accept (and credit back), oldest forgotten first.
MAX_RESET_STREAMS_REMEMBERED = 1000
# Before the peer's SETTINGS arrive we open at most this many streams (nghttp2 does the same).
INITIAL_PEER_MAX_CONCURRENT_STREAMS = 100
# A drain's PING that is not answered in this time is treated as answered.
DRAIN_PING_TIMEOUT_S = 1.0
# DATA payloads at least this long are handed out as views of the received bytes, not copies
# (a TLS read holds a frame header and up to 1 MiB of payload; the slice was a full copy).
ZERO_COPY_SLICE_BYTES = 16 * 1024
# Writes smaller than this are joined into one buffer (one TLS record instead of several).
COALESCE_BELOW_BYTES = 16 * 1024
GOAWAY_DEBUG_BYTES = 128

_REQUEST_PSEUDO = frozenset((b":method", b":scheme", b":authority", b":path", b":protocol"))
# RFC 9113 8.2.2: connection-specific fields are malformed in HTTP/2.
_CONNECTION_SPECIFIC = frozenset(
    (b"connection", b"proxy-connection", b"keep-alive", b"transfer-encoding", b"upgrade")
)
# RFC 9113 8.2.1 / RFC 9110 5.1: lowercase tchar names; values without NUL, CR, LF.
_BAD_NAME = re.compile(rb"[^!#$%&'*+\-.^_`|~0-9a-z]")
# Values are checked for NUL, CR and LF with three `in` tests (memchr), not a regex search: on a
# 116-byte `baggage` value 0.27 against 2.2 µs (issue 11, per connection: every field of every
# CONNECT and response is checked).
_NUL, _LF, _CR = 0, 10, 13
# Field names that passed the token check, so that the next request's same names are a set
# lookup, not a regex search each. Names come from peers: the set is bounded in entries and in
# name length, and once full, other names are searched every time.
MAX_CHECKED_NAMES = 256
MAX_CHECKED_NAME_BYTES = 64
_CHECKED_NAMES: set[bytes] = set()
_STATUS = re.compile(rb"[1-5][0-9][0-9]")
_STATUS_200 = (b":status", b"200")


class Http2Error(ProtocolError):
    """The one error type the core raises: the shell asked for something the protocol forbids."""


class StreamClosedError(Http2Error):
    """The stream is not open for sending (reset, ended or unknown)."""


class SendQueueFull(Http2Error):
    """A stream's send queue went past `CoreSettings.max_stream_queued_bytes`: its producer kept
    writing after `send` returned False. The queue was dropped; the caller resets the stream."""


class _ConnectionError(Http2Error):
    """Internal: a connection error (RFC 9113 5.4.1); caught inside the core, never escapes."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


@dataclass(frozen=True, slots=True, kw_only=True)
class CoreSettings:
    """What we advertise and how we keep the connection alive (defaults: ztunnel's, docs/istio-behaviour.md,
    "HBONE")."""

    client_side: bool
    stream_window_bytes: int = 4 * 1024 * 1024
    connection_window_bytes: int = 16 * 1024 * 1024
    max_frame_bytes: int = 1024 * 1024
    max_header_list_bytes: int = 64 * 1024
    max_concurrent_streams: int | None = 200  # advertised by servers; None: not advertised
    ping_interval_s: float = 10.0
    ping_timeout_s: float = 20.0
    # What one stream may hold in its send queue (module docstring): a producer that stops when
    # `send` returns False holds at most one read and the part of one write past the window.
    max_stream_queued_bytes: int = 8 * 1024 * 1024

    @property
    def max_header_block_bytes(self) -> int:
        return self.max_header_list_bytes + HPACK_SLACK_BYTES


class TokenBucket:
    """`burst` tokens, refilled at `per_s` per second of the `now` the caller passes."""

    __slots__ = ("burst", "per_s", "tokens", "at")

    def __init__(self, burst: float, per_s: float, now: float) -> None:
        self.burst = burst
        self.per_s = per_s
        self.tokens = float(burst)
        self.at = now

    def take(self, now: float) -> bool:
        tokens = self.tokens
        if now > self.at:
            tokens = min(self.burst, tokens + (now - self.at) * self.per_s)
            self.at = now
        if tokens < 1.0:
            self.tokens = tokens
            return False
        self.tokens = tokens - 1.0
        return True


class _Stream:
    __slots__ = (
        "sid",
        "local",
        "send_window",
        "recv_window",
        "recv_credit",
        "unacked",
        "local_closed",
        "remote_closed",
        "answered",
        "queued",
        "end_queued",
        "credit_held",
        "held_credit",
    )

    def __init__(self, sid: int, local: bool, send_window: int, recv_window: int) -> None:
        self.sid = sid
        self.local = local  # opened by us
        self.send_window = send_window
        self.recv_window = recv_window
        self.recv_credit = 0  # acknowledged bytes not yet returned in a stream WINDOW_UPDATE
        self.unacked = 0  # delivered bytes the shell has not acknowledged yet
        self.local_closed = False
        self.remote_closed = False
        self.answered = False  # server: response sent; client: final response received
        self.queued: bytearray | None = None  # bytes waiting for window or for output to resume
        self.end_queued = False  # END_STREAM asked for, waiting behind `queued`
        self.credit_held = False  # hold_credit: acknowledged bytes keep their credit
        self.held_credit = 0  # acknowledged while held: returned by release_credit


def _text(value: bytes) -> str:
    return value.decode("latin-1")


class Connection:
    """One HTTP/2 connection, client or server side, carrying CONNECT streams."""

    # Slots, not an instance dict: with more than 30 attributes CPython 3.11 cannot share the
    # instance dict's keys, so every attribute read and write on the per-message path became a
    # dict lookup instead of a fixed offset (docs/performance.md, "HTTP/2: a purpose-built sans-IO core").
    __slots__ = (
        "settings",
        "client_side",
        "streams",
        "terminated",
        "events",
        "_fresh",
        "_nulled",
        "_outbox",
        "outbox_bytes",
        "_control_queued",
        "_decoder",
        "_encoder",
        "_preface_left",
        "_got_settings",
        "_buf",
        "_max_frame_in",
        "_max_block_in",
        "_stream_credit_step",
        "_stream_credit_floor",
        "_connection_credit_step",
        "_connection_credit_floor",
        "_hdr",
        "_data_left",
        "_data_stream",
        "_data_sid",
        "_data_end",
        "_skip_left",
        "_block",
        "_block_sid",
        "_block_end_stream",
        "_empty_run",
        "_next_local_sid",
        "_highest_peer_sid",
        "_reset_allowance",
        "_streams_total",
        "_send_window",
        "_recv_window",
        "_recv_credit",
        "_peer_initial_window",
        "_peer_max_frame",
        "peer_max_concurrent_streams",
        "_goaway_last",
        "_goaway_first_sent",
        "goaway_received",
        "_drain_ping",
        "_drain_deadline",
        "_ping_counter",
        "_keepalive_ping",
        "_next_ping_at",
        "_ping_deadline",
        "deadline",
        "_early_resets",
        "_settings_budget",
        "_ping_budget",
        "_rst_budget",
        "_stream_error_budget",
        "_ignored_budget",
        "_window_updates_received",
        "_data_frames_sent",
        "_now",
        "_output_paused",
        "_waiting",
    )
    # The one-read DATA fast path in `receive` (tests/unit/http2/test_connection_properties.py turns it off
    # in a subclass to hold it to the general path's results).
    _DATA_FAST_PATH = True

    def __init__(self, settings: CoreSettings, now: float = 0.0) -> None:
        self.settings = settings
        self.client_side = settings.client_side
        self.streams: dict[int, _Stream] = {}
        self.terminated: ConnectionTerminated | None = None
        # Events not taken yet (None: one withdrawn, rapid reset) and the bytes queued to send:
        # plain attributes the shell tests once per message (read-only there; a property call
        # per message cost more), taken with take_events / data_to_send.
        self.events: list[Event | None] = []
        self._fresh: dict[int, list[int]] = {}  # streams announced in this batch -> event indexes
        self._nulled = False
        self._outbox: list[bytes | memoryview] = []
        self.outbox_bytes = 0
        self._control_queued = 0
        self._decoder = BlockDecoder(max_list_bytes=settings.max_header_list_bytes)
        self._encoder = BlockEncoder()
        # Receive state.
        self._preface_left = b"" if settings.client_side else f.CLIENT_PREFACE
        self._got_settings = False
        self._buf = bytearray()
        self._max_frame_in = settings.max_frame_bytes
        self._max_block_in = min(settings.max_frame_bytes, settings.max_header_block_bytes)
        # Credit is returned once 1/8 of a window is owed or less than half of it is left.
        self._stream_credit_step = settings.stream_window_bytes >> 3
        self._stream_credit_floor = settings.stream_window_bytes >> 1
        self._connection_credit_step = settings.connection_window_bytes >> 3
        self._connection_credit_floor = settings.connection_window_bytes >> 1
        self._hdr: tuple[int, int, int, int] | None = None  # frame whose payload is being buffered
        self._data_left = 0
        self._data_stream: _Stream | None = None
        self._data_sid = 0
        self._data_end = False
        self._skip_left = 0
        self._block: bytearray | None = None
        self._block_sid = 0
        self._block_end_stream = False
        self._empty_run = 0
        # Stream ids.
        self._next_local_sid = 1 if settings.client_side else 2
        self._highest_peer_sid = 0
        self._reset_allowance: dict[int, int] = {}
        self._streams_total = 0
        # Windows.
        self._send_window = f.DEFAULT_WINDOW_BYTES
        self._recv_window = settings.connection_window_bytes
        self._recv_credit = 0
        self._peer_initial_window = f.DEFAULT_WINDOW_BYTES
        self._peer_max_frame = f.DEFAULT_MAX_FRAME_BYTES
        self.peer_max_concurrent_streams = INITIAL_PEER_MAX_CONCURRENT_STREAMS
        # GOAWAY and drain.
        self._goaway_last: int | None = None  # last stream id of the final GOAWAY we sent
        self._goaway_first_sent = False
        self.goaway_received: tuple[int, int] | None = None  # (last stream id, error code)
        self._drain_ping: bytes | None = None
        self._drain_deadline: float | None = None
        # Keepalive.
        self._ping_counter = 0
        self._keepalive_ping: bytes | None = None
        self._next_ping_at: float | None = None
        self._ping_deadline: float | None = None
        self.deadline: float | None = None  # the earliest of the three: when to call handle_timeout
        # Budgets.
        self._early_resets = TokenBucket(EARLY_RESET_BURST, EARLY_RESET_PER_S, now)
        self._settings_budget = TokenBucket(SETTINGS_BURST, SETTINGS_PER_S, now)
        self._ping_budget = TokenBucket(PING_BURST, PING_PER_S, now)
        self._rst_budget = TokenBucket(RST_STREAM_BURST, RST_STREAM_PER_S, now)
        self._stream_error_budget = TokenBucket(STREAM_ERROR_BURST, STREAM_ERROR_PER_S, now)
        self._ignored_budget = TokenBucket(IGNORED_FRAME_BURST, IGNORED_FRAME_PER_S, now)
        self._window_updates_received = 0
        self._data_frames_sent = 0
        self._now = now
        # Send queues: output paused by the shell (its transport's backpressure), and the streams
        # whose queue holds bytes or an END_STREAM, in the order they started waiting.
        self._output_paused = False
        self._waiting: dict[int, _Stream] = {}

    def __repr__(self) -> str:
        side = "client" if self.client_side else "server"
        state = "terminated" if self.terminated else ("draining" if self.draining else "open")
        return f"http2.Connection({side}, {state}, {len(self.streams)} streams)"

    # State the shell reads ------------------------------------------------------------
    @property
    def draining(self) -> bool:
        """A GOAWAY went either way: no new streams."""
        return self._goaway_first_sent or self.goaway_received is not None

    @property
    def can_open_stream(self) -> bool:
        return (
            self.client_side
            and self.terminated is None
            and not self.draining
            and len(self.streams) < self.peer_max_concurrent_streams
            and self._next_local_sid <= f.MAX_STREAM_ID
        )

    def send_window(self, sid: int) -> int:
        s = self.streams.get(sid)
        if s is None or s.local_closed or self.terminated is not None:
            return 0
        return min(self._send_window, s.send_window)

    @property
    def peer_max_frame_bytes(self) -> int:
        return self._peer_max_frame

    def credit_balance(self) -> int:
        """Receive credit accounted for; equals `connection_window_bytes` in every state."""
        inflight = self._data_left if self._data_stream is not None else 0
        return (
            self._recv_window + self._recv_credit + inflight + sum(s.unacked for s in self.streams.values())
        )

    @property
    def unannounced_credit(self) -> int:
        """Connection credit returned to us but not yet sent in a WINDOW_UPDATE (batched)."""
        return self._recv_credit

    @property
    def buffered_bytes(self) -> int:
        """Peer bytes held by the core: a partial frame and an unfinished header block."""
        return len(self._buf) + (len(self._block) if self._block is not None else 0)

    # Input ------------------------------------------------------------------------------
    def initiate(self, now: float) -> None:
        """Queue the connection preface: (client preface), SETTINGS, the connection window."""
        s = self.settings
        values: dict[int, int] = {
            f.Setting.ENABLE_PUSH: 0,
            f.Setting.INITIAL_WINDOW_SIZE: s.stream_window_bytes,
            f.Setting.MAX_FRAME_SIZE: s.max_frame_bytes,
            f.Setting.MAX_HEADER_LIST_SIZE: s.max_header_list_bytes,
        }
        if s.max_concurrent_streams is not None and not s.client_side:
            values[f.Setting.MAX_CONCURRENT_STREAMS] = s.max_concurrent_streams
        out = [f.CLIENT_PREFACE] if s.client_side else []
        out.append(f.settings_frame(values))
        extra = s.connection_window_bytes - f.DEFAULT_WINDOW_BYTES
        if extra > 0:
            out.append(f.window_update_frame(0, extra))
        self._queue(b"".join(out))
        self._now = now
        if s.ping_interval_s > 0:
            self._next_ping_at = now + s.ping_interval_s
        self._update_deadline()

    def receive(self, data: bytes | memoryview, now: float) -> list[Event]:
        """Feed bytes from the peer; returns the events they caused (and any still pending).

        `data` may be a read-only memoryview of a buffer the shell reuses: what the core keeps or
        hands out from it below ZERO_COPY_SLICE_BYTES is copied; longer DATA payloads are views
        of it, so the shell reuses the buffer only once no view is left."""
        if self.terminated is None:
            self._now = now
            if type(data) is not bytes and not (isinstance(data, memoryview) and data.readonly):
                data = bytes(data)
            # The frame parser, inlined here (it was `_feed`): one Python call per read fewer on
            # the per-message path (docs/performance.md, "HTTP/2: a purpose-built sans-IO core").
            try:
                n = len(data)
                pos = 0
                if self._preface_left:
                    want = self._preface_left
                    k = min(len(want), n)
                    if data[:k] != want[:k]:
                        raise _ConnectionError(
                            E.PROTOCOL_ERROR, "the client did not send the HTTP/2 connection preface"
                        )
                    self._preface_left = want[k:]
                    pos = k
                buf = self._buf
                while pos < n:
                    if self.terminated is not None:
                        break
                    left = self._data_left
                    if left:
                        k = min(left, n - pos)
                        chunk: bytes | memoryview
                        if k < ZERO_COPY_SLICE_BYTES:
                            chunk = bytes(data[pos : pos + k])  # a copy (of bytes: the slice already is)
                        elif pos == 0 and k == n:
                            chunk = data
                        else:
                            chunk = memoryview(data)[pos : pos + k]  # read-only, as `data` is
                        pos += k
                        self._data_left = left - k
                        self._data_chunk(chunk)
                        if not self._data_left:
                            self._data_finish()
                        continue
                    if self._skip_left:
                        k = min(self._skip_left, n - pos)
                        pos += k
                        self._skip_left -= k
                        continue
                    hdr = self._hdr
                    if hdr is None:
                        if buf:
                            take = data[pos : pos + f.FRAME_HEADER_BYTES - len(buf)]
                            buf += take
                            pos += len(take)
                            if len(buf) < f.FRAME_HEADER_BYTES:
                                break
                            header = f.parse_frame_header(buf)
                            buf.clear()
                        elif n - pos < f.FRAME_HEADER_BYTES:
                            buf += data[pos:]
                            break
                        else:
                            hi, lo, ftype, flags, sid = _unpack_header(data, pos)
                            length = (hi << 16) | lo
                            sid &= 0x7FFFFFFF  # the reserved bit is ignored (RFC 9113 4.1)
                            end = pos + f.FRAME_HEADER_BYTES + length
                            # One whole unpadded DATA frame within this read, for an open stream
                            # with window for it: the checks of `_frame_start` and `_data_target`
                            # for that case, inlined (small messages arrive so, one frame per TLS
                            # record; the general path costs six calls per frame, a method of its
                            # own one). Anything else goes the general path, which raises whatever
                            # error it is.
                            if (
                                ftype == _DATA
                                and end <= n
                                and 0 < length <= self._max_frame_in
                                and not flags & _NOT_END_STREAM
                                and self._block is None
                                and self._got_settings
                                and self._DATA_FAST_PATH
                                and (s := self.streams.get(sid)) is not None
                                and not s.remote_closed
                                and length <= self._recv_window
                                and length <= s.recv_window
                            ):
                                self._empty_run = 0
                                self._recv_window -= length
                                s.recv_window -= length
                                s.unacked += length
                                start = pos + f.FRAME_HEADER_BYTES
                                event = _new_object(DataReceived)
                                _set_event_sid(event, sid)
                                _set_event_data(
                                    event,
                                    bytes(data[start:end])
                                    if length < ZERO_COPY_SLICE_BYTES
                                    else memoryview(data)[start:end],
                                )
                                if self._fresh:
                                    self._emit(event)
                                else:
                                    self.events.append(event)
                                if flags:  # END_STREAM, the only flag let through
                                    s.remote_closed = True
                                    self._emit(StreamEnded(sid))
                                    self._maybe_close(s)
                                pos = end
                                continue
                            if (
                                (
                                    ftype == _HEADERS
                                    or (ftype == _DATA and flags == _END_STREAM and not length)
                                )
                                and end <= n
                                and sid
                                and self._block is None
                                and self._got_settings
                                and self._stream_frame_fast(
                                    data, pos + f.FRAME_HEADER_BYTES, end, ftype, flags, sid
                                )
                            ):
                                pos = end
                                continue
                            header = (length, ftype, flags, sid)
                            pos += f.FRAME_HEADER_BYTES
                        self._frame_start(*header)
                        continue
                    length = hdr[0]
                    if not buf and n - pos >= length:
                        payload = bytes(data[pos : pos + length])
                        pos += length
                    else:
                        take = data[pos : pos + length - len(buf)]
                        buf += take
                        pos += len(take)
                        if len(buf) < length:
                            break
                        payload = bytes(buf)
                        buf.clear()
                    self._hdr = None
                    self._frame(hdr, payload)
            except _ConnectionError as e:
                self._terminate(e.code, str(e))
            credit = self._recv_credit
            if credit and (
                credit >= self._connection_credit_step or self._recv_window < self._connection_credit_floor
            ):
                self._flush_credit()
        events = self.events
        if not events:
            return []
        if self._fresh or self._nulled:
            return self.take_events()
        self.events = []
        return events  # type: ignore[return-value]  # None only ever appears with _nulled set

    def handle_timeout(self, now: float) -> list[Event]:
        """Run the keepalive and drain timers that are due at `now`."""
        if self.terminated is None:
            self._now = now
            try:
                self._timers(now)
            except _ConnectionError:
                pass  # the outbox overflowed: the connection is terminated
            self._update_deadline()
        return self.take_events()

    def _timers(self, now: float) -> None:
        if self._drain_deadline is not None and now >= self._drain_deadline:
            self._final_goaway()
        if self.terminated is None:
            if self._ping_deadline is not None and now >= self._ping_deadline:
                self._terminate(
                    E.NO_ERROR, f"no PING answer within {self.settings.ping_timeout_s:g}s", send_goaway=False
                )
            elif self._next_ping_at is not None and now >= self._next_ping_at:
                self._ping_counter += 1
                self._keepalive_ping = b"ka" + self._ping_counter.to_bytes(6, "big")
                self._queue_control(f.ping_frame(self._keepalive_ping))
                if self._ping_deadline is None:
                    self._ping_deadline = now + self.settings.ping_timeout_s
                self._next_ping_at = now + self.settings.ping_interval_s

    def next_deadline(self) -> float | None:
        """When `handle_timeout` is next due (None: no timer). Also the `deadline` attribute."""
        return self.deadline

    def _update_deadline(self) -> None:
        if self.terminated is not None:
            self.deadline = None
            return
        times = [t for t in (self._next_ping_at, self._ping_deadline, self._drain_deadline) if t is not None]
        self.deadline = min(times) if times else None

    def take_events(self) -> list[Event]:
        events = self.events
        if not events:
            return []
        self.events = []
        self._fresh.clear()
        if self._nulled:
            self._nulled = False
            return [e for e in events if e is not None]
        return events  # type: ignore[return-value]  # None only ever appears with _nulled set

    # Output -----------------------------------------------------------------------------
    def data_to_send(self) -> list[bytes | memoryview]:
        """Everything queued, small pieces joined; the caller writes it in order."""
        out = self._outbox
        if not out:
            return out
        self._outbox = []
        self.outbox_bytes = 0
        self._control_queued = 0
        if len(out) == 1:
            return out
        if len(out) == 2 and len(out[1]) < COALESCE_BELOW_BYTES:
            return [b"".join(out)]  # one small DATA frame: its header and its payload
        joined: list[bytes | memoryview] = []
        small: list[bytes | memoryview] = []
        for piece in out:
            if len(piece) >= COALESCE_BELOW_BYTES:
                if small:
                    joined.append(b"".join(small) if len(small) > 1 else small[0])
                    small = []
                joined.append(piece)
            else:
                small.append(piece)
        if small:
            joined.append(b"".join(small) if len(small) > 1 else small[0])
        return joined

    def _queue(self, data: bytes) -> None:
        self._outbox.append(data)
        self.outbox_bytes += len(data)

    def _queue_control(self, frame: bytes) -> None:
        self._outbox.append(frame)
        self.outbox_bytes += len(frame)
        self._control_queued += 1
        if self._control_queued > MAX_OUTBOUND_CONTROL_FRAMES and self.terminated is None:
            self._terminate(
                E.ENHANCE_YOUR_CALM,
                f"peer does not read: more than {MAX_OUTBOUND_CONTROL_FRAMES} control frames queued",
            )
            raise _ConnectionError(E.ENHANCE_YOUR_CALM, "outbound control frames")

    def _emit(self, event: Event) -> None:
        sid = getattr(event, "stream_id", None)
        if sid is not None and sid in self._fresh:
            self._fresh[sid].append(len(self.events))
        self.events.append(event)

    # Stream operations (the shell) --------------------------------------------------------
    def send_request(self, headers: list[tuple[bytes, bytes]], end_stream: bool = False) -> int:
        """Client: open a stream with `headers` (pseudo-headers first); returns its id."""
        if not self.can_open_stream:
            raise Http2Error(self._why_not_open())
        sid = self._next_local_sid
        self._next_local_sid += 2
        s = _Stream(sid, True, self._peer_initial_window, self.settings.stream_window_bytes)
        self.streams[sid] = s
        self._streams_total += 1
        self._queue_header_block(sid, self._encoder.encode(headers), end_stream)
        if end_stream:
            s.local_closed = True
        return sid

    def _queue_header_block(self, sid: int, block: bytes, end_stream: bool) -> None:
        n = len(block)
        if n <= self._peer_max_frame:  # one HEADERS frame: `header_block_frames` without its list
            flags = _END_HEADERS | _END_STREAM if end_stream else _END_HEADERS
            self._outbox.append(_pack_header(n >> 16, n & 0xFFFF, _HEADERS, flags, sid) + block)
            self.outbox_bytes += f.FRAME_HEADER_BYTES + n
            return
        for frame in f.header_block_frames(sid, block, end_stream, self._peer_max_frame):
            self._queue(frame)

    def _why_not_open(self) -> str:
        if self.terminated is not None:
            return f"HTTP/2 connection terminated: {self.terminated.reason}"
        if self.draining:
            return "HTTP/2 connection is draining (GOAWAY): no new streams"
        if not self.client_side:
            return "only the client side opens streams"
        return f"peer allows {self.peer_max_concurrent_streams} concurrent streams"

    def send_response(self, sid: int, status: int, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
        """Server: answer a CONNECT. Anything but 200 ends the stream (and resets what we will not read)."""
        s = self.streams.get(sid)
        if s is None or s.local or s.answered or self.terminated is not None:
            raise StreamClosedError(f"stream {sid} cannot be answered (reset, answered or unknown)")
        s.answered = True
        end = status != 200
        status_field = _STATUS_200 if not end else (b":status", str(status).encode())
        self._queue_header_block(sid, self._encoder.encode([status_field, *headers]), end)
        if end:
            s.local_closed = True
            if not s.remote_closed:
                # RFC 9113 8.1: a complete response before the request ended; NO_ERROR asks the
                # client to stop sending, and frees the stream's share of the window now.
                try:
                    self._send_reset(s, E.NO_ERROR)
                except _ConnectionError:
                    return  # the outbox overflowed: the connection is terminated
            else:
                self._maybe_close(s)
            self._flush_credit()  # the credit of a stream reset or closed here

    def send_data(self, sid: int, data: bytes | bytearray | memoryview) -> int:
        """Queue DATA frames for as much of `data` as the windows allow; returns the bytes taken.

        `bytes` and read-only memoryviews are framed without a copy; anything else is copied.
        """
        s = self.streams.get(sid)
        if s is None or s.local_closed or self.terminated is not None:
            raise StreamClosedError(f"stream {sid} is not open for sending")
        size = len(data)
        n = min(size, self._send_window, s.send_window)
        if n <= 0:
            return 0
        frozen: bytes | memoryview | None = (
            data if type(data) is bytes or (isinstance(data, memoryview) and data.readonly) else None
        )
        max_frame = self._peer_max_frame
        outbox = self._outbox
        if n == size and n <= max_frame:
            header = _pack_header(n >> 16, n & 0xFFFF, _DATA, 0, sid)
            if n < COALESCE_BELOW_BYTES:
                outbox.append(header + data)  # one piece: data_to_send need not join it
            else:
                outbox.append(header)
                outbox.append(frozen if frozen is not None else bytes(data))
            self._data_frames_sent += 1
        else:
            view = memoryview(data)
            off = 0
            while off < n:
                k = min(max_frame, n - off)
                outbox.append(f.frame_header(k, f.DATA, 0, sid))
                outbox.append(view[off : off + k] if frozen is not None else bytes(view[off : off + k]))
                self._data_frames_sent += 1
                off += k
        self.outbox_bytes += n
        self._send_window -= n
        s.send_window -= n
        return n

    def data_header(self, sid: int, n: int) -> bytes | None:
        """`send_data` for the common cases, without the outbox: when nothing is queued and the
        windows take all `n` bytes in one frame, the header of that DATA frame (counted as sent,
        the windows taken) for the shell to write at once with the payload behind it; otherwise
        None, and `send` applies (it also raises for a stream not open for sending). Declines
        while output is paused or the stream has bytes queued: those go first."""
        if self._outbox or self._output_paused or not 0 < n <= self._peer_max_frame:
            return None
        s = self.streams.get(sid)
        if (
            s is None
            or s.queued is not None
            or s.local_closed
            or self.terminated is not None
            or n > self._send_window
            or n > s.send_window
        ):
            return None
        self._send_window -= n
        s.send_window -= n
        self._data_frames_sent += 1
        return _pack_header(n >> 16, n & 0xFFFF, _DATA, 0, sid)

    def end_stream(self, sid: int) -> None:
        """Half-close our side (an empty DATA frame with END_STREAM)."""
        s = self.streams.get(sid)
        if s is None or s.local_closed or self.terminated is not None:
            raise StreamClosedError(f"stream {sid} is not open for sending")
        self._outbox.append(_pack_header(0, 0, _DATA, _END_STREAM, sid))
        self.outbox_bytes += f.FRAME_HEADER_BYTES
        s.local_closed = True
        if s.remote_closed:
            self._remove(s)  # its unacknowledged credit goes back to the connection
            if self._recv_credit:
                self._flush_credit()

    def reset_stream(self, sid: int, code: int = E.CANCEL) -> None:
        """Abort a stream (RST_STREAM); a no-op for streams that are already gone."""
        s = self.streams.get(sid)
        if s is None or self.terminated is not None:
            return
        try:
            self._send_reset(s, code)
        except _ConnectionError:
            pass  # the outbox overflowed: the connection is terminated
        self._flush_credit()

    def acknowledge(self, sid: int, n: int) -> None:
        """The shell consumed `n` delivered bytes of `sid`: return their window credit."""
        s = self.streams.get(sid)
        if s is None or n <= 0 or self.terminated is not None:
            return  # gone streams already gave their credit back
        if n > s.unacked:
            n = s.unacked
            if not n:
                return
        if s.credit_held:
            s.held_credit = min(s.held_credit + n, s.unacked)
            return
        s.unacked -= n
        credit = self._recv_credit + n
        self._recv_credit = credit
        if not s.remote_closed:
            # `_stream_credit`'s rule inlined for the common case that owes no frame yet.
            stream_credit = s.recv_credit + n
            if stream_credit < self._stream_credit_step and s.recv_window >= self._stream_credit_floor:
                s.recv_credit = stream_credit
            else:
                try:
                    self._stream_credit(s, n)
                except _ConnectionError:
                    return  # outbox overflow: the connection is terminated
        if credit >= self._connection_credit_step or self._recv_window < self._connection_credit_floor:
            self._flush_credit()

    # Send queues (module docstring) -------------------------------------------------------
    def send(self, sid: int, data: bytes | bytearray | memoryview) -> bool:
        """Send `data` on `sid` behind whatever of the stream waits: DATA frames for what the
        windows take now (none while output is paused), the rest into the stream's send queue.

        Returns True when nothing of the stream waits, False when its producer must stop until a
        `StreamWritable` event. Raises StreamClosedError for a stream not open for sending (or
        ended), SendQueueFull past `max_stream_queued_bytes` (the queue is dropped)."""
        s = self.streams.get(sid)
        if s is None or s.local_closed or s.end_queued or self.terminated is not None:
            raise StreamClosedError(f"stream {sid} is not open for sending")
        queue = s.queued
        if not data:
            return queue is None  # nothing to frame or queue
        if queue is None:
            if not self._output_paused:
                n = self.send_data(sid, data)
                if n == len(data):
                    return True
                if n:
                    data = memoryview(data)[n:]
            queue = s.queued = bytearray()
            self._waiting[sid] = s
        queue += data
        if len(queue) > self.settings.max_stream_queued_bytes:
            held = len(queue)
            s.queued = None
            del self._waiting[sid]
            raise SendQueueFull(
                f"HBONE stream {sid} held {held} bytes waiting to be sent, past its bound of "
                f"{self.settings.max_stream_queued_bytes}: its producer kept writing while the "
                "stream was blocked (a bug in the proxy: report it with this log line)"
            )
        return False

    def end(self, sid: int) -> bool:
        """Half-close our side behind whatever of the stream waits. True: the END_STREAM is
        queued to send now; False: it waits behind queued bytes or paused output, and a
        `StreamWritable(ended=True)` reports when it went. Raises StreamClosedError as `send`."""
        s = self.streams.get(sid)
        if s is None or s.local_closed or s.end_queued or self.terminated is not None:
            raise StreamClosedError(f"stream {sid} is not open for sending")
        if s.queued is None and not self._output_paused:
            self.end_stream(sid)
            return True
        s.end_queued = True
        self._waiting[sid] = s
        return False

    def waiting(self, sid: int) -> bool:
        """The stream holds queued bytes or an END_STREAM (its producer should be stopped)."""
        return sid in self._waiting

    def queued_bytes(self, sid: int) -> int:
        s = self._waiting.get(sid)
        return len(s.queued) if s is not None and s.queued is not None else 0

    @property
    def output_paused(self) -> bool:
        return self._output_paused

    def pause_output(self) -> None:
        """The shell's transport is full: every `send` queues until `resume_output`."""
        self._output_paused = True

    def resume_output(self) -> None:
        """The transport takes bytes again: every queue drains as far as the windows allow, at
        once (so a pause that comes while the shell writes the result leaves no stream behind:
        what is left waits for a window and drains when it opens)."""
        self._output_paused = False
        if self._waiting:
            self._drain(None)

    def _drain(self, only: _Stream | None) -> None:
        """Move queued bytes into DATA frames as the windows allow; report emptied queues."""
        if self._output_paused or self.terminated is not None:
            return
        waiting = self._waiting
        for s in list(waiting.values()) if only is None else (only,):
            if s.local_closed:  # ended or answered past the queue (`end_stream`, a non-200)
                s.queued = None
                s.end_queued = False
                waiting.pop(s.sid, None)
                continue
            queue = s.queued
            if queue is not None:
                n = min(self._send_window, s.send_window, len(queue))
                if n <= 0:
                    continue
                if n == len(queue):
                    self.send_data(s.sid, bytes(queue))
                    s.queued = None
                else:
                    with memoryview(queue) as view:
                        chunk = view[:n].tobytes()
                    self.send_data(s.sid, chunk)
                    del queue[:n]
                    continue
            ended = s.end_queued
            if ended:
                s.end_queued = False
                self.end_stream(s.sid)  # may remove the stream (both sides ended)
            waiting.pop(s.sid, None)
            self._emit(StreamWritable(s.sid, ended))
            if self.terminated is not None:
                return  # the last stream after a GOAWAY: nothing more goes out

    def hold_credit(self, sid: int) -> None:
        """The shell's consumer of `sid` is paused: bytes acknowledged from now on keep their
        window credit (a slow reader closes the window instead of growing buffers)."""
        s = self.streams.get(sid)
        if s is not None:
            s.credit_held = True

    def release_credit(self, sid: int) -> None:
        """The consumer takes bytes again: return the credit held since `hold_credit`."""
        s = self.streams.get(sid)
        if s is None or not s.credit_held:
            return
        s.credit_held = False
        n, s.held_credit = s.held_credit, 0
        if n:
            self.acknowledge(sid, n)

    def start_drain(self, now: float) -> None:
        """Graceful shutdown: no new streams; open ones finish; terminated when none is left."""
        if self.terminated is not None or self._goaway_first_sent:
            return
        self._now = now
        self._goaway_first_sent = True
        try:
            if self.client_side:
                # The server never opens streams, so there is no race to close: one GOAWAY.
                self._final_goaway()
            else:
                self._queue_control(f.goaway_frame(f.MAX_STREAM_ID, E.NO_ERROR))
                self._ping_counter += 1
                self._drain_ping = b"dr" + self._ping_counter.to_bytes(6, "big")
                self._queue_control(f.ping_frame(self._drain_ping))
                self._drain_deadline = now + DRAIN_PING_TIMEOUT_S
                self._update_deadline()
        except _ConnectionError:
            pass

    def close(self) -> None:
        """The transport is gone: release every buffer (an unfinished header block included)."""
        if self.terminated is None:
            self.terminated = ConnectionTerminated(E.NO_ERROR, "transport closed", by_peer=True)
        self._release()

    def _release(self) -> None:
        self._buf = bytearray()
        self._block = None
        self._hdr = None
        self._data_left = self._skip_left = 0
        self._data_stream = None
        self.streams.clear()
        self._reset_allowance.clear()
        self._waiting.clear()

    # Internals: stream lifecycle -----------------------------------------------------------
    def _send_reset(self, s: _Stream, code: int) -> None:
        self._remove(s)
        allowance = self._reset_allowance
        allowance[s.sid] = max(s.recv_window, 0)  # what the peer may still have in flight
        if len(allowance) > MAX_RESET_STREAMS_REMEMBERED:
            del allowance[next(iter(allowance))]
        self._queue_control(f.rst_stream_frame(s.sid, code))

    def _remove(self, s: _Stream) -> None:
        if self.streams.pop(s.sid, None) is None:
            return
        if s.queued is not None or s.end_queued:
            # Reset either way: nothing more of it can be sent.
            s.queued = None
            s.end_queued = False
            self._waiting.pop(s.sid, None)
        # Conservation: whatever the shell never acknowledged goes back to the connection.
        self._recv_credit += s.unacked
        s.unacked = 0
        if not self.streams and (self._goaway_last is not None or self.goaway_received is not None):
            self._maybe_finish()  # the last stream after a GOAWAY either way

    def _maybe_close(self, s: _Stream) -> None:
        if s.local_closed and s.remote_closed:
            self._remove(s)

    def _maybe_finish(self) -> None:
        if self.streams or self.terminated is not None:
            return
        if self._goaway_last is not None:
            self._terminate(
                E.NO_ERROR, "drained: GOAWAY sent and no stream left", send_goaway=False, clean=True
            )
        elif self.goaway_received is not None:
            self._terminate(
                E.NO_ERROR,
                "peer sent GOAWAY and no stream is left",
                send_goaway=False,
                by_peer=True,
                clean=True,
            )

    def _final_goaway(self) -> None:
        self._drain_deadline = None
        self._drain_ping = None
        self._update_deadline()
        if self._goaway_last is None:
            self._goaway_last = self._highest_peer_sid
            self._queue_control(f.goaway_frame(self._goaway_last, E.NO_ERROR))
            self._maybe_finish()

    def _terminate(
        self, code: int, reason: str, *, send_goaway: bool = True, by_peer: bool = False, clean: bool = False
    ) -> None:
        if self.terminated is not None:
            return
        if send_goaway:
            last = self._highest_peer_sid if self._goaway_last is None else self._goaway_last
            frame = f.goaway_frame(last, code, reason.encode("ascii", "replace")[:GOAWAY_DEBUG_BYTES])
            self._outbox.append(frame)
            self.outbox_bytes += len(frame)
        self.terminated = ConnectionTerminated(code, reason, by_peer, clean)
        self._release()
        self._next_ping_at = self._ping_deadline = self._drain_deadline = None
        self.deadline = None
        self._emit(self.terminated)

    def _stream_error(self, s: _Stream | None, sid: int, code: int, reason: str) -> None:
        """RFC 9113 5.4.2: RST_STREAM; budgeted, since a peer can provoke them at will."""
        if not self._stream_error_budget.take(self._now):
            raise _ConnectionError(
                E.ENHANCE_YOUR_CALM,
                f"more than {STREAM_ERROR_BURST} stream errors in a burst (last: {reason})",
            )
        if s is not None and s.sid in self.streams:
            self._emit(StreamReset(sid, code, s.answered))
            self._send_reset(s, code)
        else:
            allowance = self._reset_allowance
            allowance[sid] = self.settings.stream_window_bytes
            if len(allowance) > MAX_RESET_STREAMS_REMEMBERED:
                del allowance[next(iter(allowance))]
            self._queue_control(f.rst_stream_frame(sid, code))

    def _is_idle(self, sid: int) -> bool:
        """Never opened (RFC 9113 5.1): frames other than HEADERS/PRIORITY on it are errors."""
        if (sid & 1) == (1 if self.client_side else 0):  # our parity
            return sid >= self._next_local_sid
        return sid > self._highest_peer_sid

    # Internals: credit ----------------------------------------------------------------------
    def _flush_credit(self) -> None:
        """Return owed connection credit once it is worth a frame (module docstring)."""
        credit = self._recv_credit
        if not credit or self.terminated is not None:
            return
        if credit >= self._connection_credit_step or self._recv_window < self._connection_credit_floor:
            self._recv_credit = 0
            self._recv_window += credit
            try:
                self._queue_control(f.window_update_frame(0, credit))
            except _ConnectionError:
                pass  # outbox overflow: already terminated

    def _stream_credit(self, s: _Stream, n: int) -> None:
        """The same rule for one stream's window (raises on outbox overflow)."""
        credit = s.recv_credit + n
        if credit >= self._stream_credit_step or s.recv_window < self._stream_credit_floor:
            s.recv_credit = 0
            s.recv_window += credit
            self._queue_control(f.window_update_frame(s.sid, credit))
        else:
            s.recv_credit = credit

    # Internals: frame parsing -------------------------------------------------------------
    # Internals: frame parsing (the loop itself is in `receive`) ---------------------------
    def _frame_start(self, length: int, ftype: int, flags: int, sid: int) -> None:
        """Checks that need only the frame header, before a payload byte is buffered."""
        if length > self.settings.max_frame_bytes:
            raise _ConnectionError(
                E.FRAME_SIZE_ERROR,
                f"{f.FRAME_NAMES.get(ftype, 'frame')} of {length} bytes above the "
                f"{self.settings.max_frame_bytes} we advertised (SETTINGS_MAX_FRAME_SIZE)",
            )
        if not self._got_settings:
            if ftype != f.SETTINGS or flags & f.FLAG_ACK:
                raise _ConnectionError(E.PROTOCOL_ERROR, "the first frame from the peer must be SETTINGS")
            self._got_settings = True
        if self._block is not None and (ftype != f.CONTINUATION or sid != self._block_sid):
            raise _ConnectionError(
                E.PROTOCOL_ERROR, "header block interrupted by another frame (RFC 9113 6.10)"
            )
        if flags & f.FLAG_PADDED and ftype in (f.DATA, f.HEADERS):
            need = 1 + (5 if ftype == f.HEADERS and flags & f.FLAG_PRIORITY else 0)
            if length < need:
                raise _ConnectionError(
                    E.FRAME_SIZE_ERROR, f"padded {f.FRAME_NAMES[ftype]} too short for its padding"
                )
        if ftype == f.DATA:
            if length == 0 and not flags & f.FLAG_END_STREAM:
                self._empty_frame()
            elif length:
                self._empty_run = 0
            if not flags & f.FLAG_PADDED:
                self._data_begin(length, flags, sid)
                if not length:
                    self._data_finish()
                return
        elif ftype == f.HEADERS or ftype == f.CONTINUATION:
            if length == 0 and not flags & (f.FLAG_END_HEADERS | f.FLAG_END_STREAM):
                self._empty_frame()
            elif length:
                self._empty_run = 0
            so_far = len(self._block) if self._block is not None else 0
            limit = self.settings.max_header_block_bytes
            if so_far + length > limit:
                raise _ConnectionError(
                    E.ENHANCE_YOUR_CALM,
                    f"header block of more than {limit} bytes (SETTINGS_MAX_HEADER_LIST_SIZE "
                    f"{self.settings.max_header_list_bytes} + {HPACK_SLACK_BYTES}), refused before decoding",
                )
        elif ftype == f.SETTINGS:
            if sid:
                raise _ConnectionError(E.PROTOCOL_ERROR, "SETTINGS on a stream")
            if flags & f.FLAG_ACK and length:
                raise _ConnectionError(E.FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            if length % 6:
                raise _ConnectionError(E.FRAME_SIZE_ERROR, "SETTINGS length not a multiple of 6")
            if length // 6 > MAX_SETTINGS_ENTRIES:
                raise _ConnectionError(
                    E.ENHANCE_YOUR_CALM, f"SETTINGS frame with more than {MAX_SETTINGS_ENTRIES} entries"
                )
        elif ftype == f.PING:
            if length != 8:
                raise _ConnectionError(E.FRAME_SIZE_ERROR, "PING payload is not 8 bytes")
        elif ftype == f.WINDOW_UPDATE or ftype == f.RST_STREAM:
            if length != 4:
                raise _ConnectionError(E.FRAME_SIZE_ERROR, f"{f.FRAME_NAMES[ftype]} payload is not 4 bytes")
        elif ftype == f.GOAWAY:
            if length < 8 or length > MAX_GOAWAY_FRAME_BYTES:
                raise _ConnectionError(E.FRAME_SIZE_ERROR, f"GOAWAY of {length} bytes")
        elif ftype == f.PRIORITY:
            if length != 5:
                raise _ConnectionError(E.FRAME_SIZE_ERROR, "PRIORITY payload is not 5 bytes")
        elif ftype == f.PUSH_PROMISE:
            raise _ConnectionError(E.PROTOCOL_ERROR, "PUSH_PROMISE although we disabled push (RFC 9113 8.4)")
        else:
            # RFC 9113 5.5: unknown frame types are ignored, without buffering their payload.
            self._ignored_frame(f"frame type 0x{ftype:x}")
            self._skip_left = length
            return
        if length == 0:
            self._frame((length, ftype, flags, sid), b"")
        else:
            self._hdr = (length, ftype, flags, sid)

    def _empty_frame(self) -> None:
        self._empty_run += 1
        if self._empty_run > MAX_CONSECUTIVE_EMPTY_FRAMES:
            raise _ConnectionError(
                E.ENHANCE_YOUR_CALM,
                f"more than {MAX_CONSECUTIVE_EMPTY_FRAMES} empty DATA/HEADERS frames in a row",
            )

    def _ignored_frame(self, what: str) -> None:
        if not self._ignored_budget.take(self._now):
            raise _ConnectionError(
                E.ENHANCE_YOUR_CALM, f"{what} flood: more than {IGNORED_FRAME_BURST} in a burst"
            )

    def _frame(self, hdr: tuple[int, int, int, int], payload: bytes) -> None:
        length, ftype, flags, sid = hdr
        if ftype == f.HEADERS:
            self._on_headers(flags, sid, payload)
        elif ftype == f.CONTINUATION:
            self._on_continuation(flags, sid, payload)
        elif ftype == f.DATA:
            self._on_padded_data(length, flags, sid, payload)
        elif ftype == f.WINDOW_UPDATE:
            self._on_window_update(sid, payload)
        elif ftype == f.RST_STREAM:
            self._on_rst_stream(sid, payload)
        elif ftype == f.SETTINGS:
            self._on_settings(flags, payload)
        elif ftype == f.PING:
            self._on_ping(flags, sid, payload)
        elif ftype == f.GOAWAY:
            self._on_goaway(sid, payload)
        elif ftype == f.PRIORITY:
            if sid == 0:
                raise _ConnectionError(E.PROTOCOL_ERROR, "PRIORITY on stream 0")
            self._ignored_frame("PRIORITY")  # RFC 9113 5.3.2: priority signals are ignored

    # DATA -------------------------------------------------------------------------------------
    def _data_target(self, length: int, flags: int, sid: int) -> _Stream | None:
        """Flow control for one DATA frame of `length` bytes; the stream to deliver to, if any."""
        if sid == 0:
            raise _ConnectionError(E.PROTOCOL_ERROR, "DATA on stream 0")
        if length > self._recv_window:
            raise _ConnectionError(
                E.FLOW_CONTROL_ERROR,
                f"DATA of {length} bytes beyond the connection window ({self._recv_window})",
            )
        s = self.streams.get(sid)
        if s is None:
            if self._is_idle(sid):
                raise _ConnectionError(E.PROTOCOL_ERROR, f"DATA on idle stream {sid}")
            allowance = self._reset_allowance.get(sid)
            if allowance is None or length > allowance:
                raise _ConnectionError(E.STREAM_CLOSED, f"DATA on closed stream {sid}")
            self._reset_allowance[sid] = allowance - length
            self._recv_window -= length
            self._recv_credit += length  # never delivered: straight back to the connection
            return None
        self._recv_window -= length
        if s.remote_closed:
            self._recv_credit += length
            self._stream_error(s, sid, E.STREAM_CLOSED, f"DATA after END_STREAM on stream {sid}")
            return None
        if length > s.recv_window:
            self._recv_credit += length
            self._stream_error(s, sid, E.FLOW_CONTROL_ERROR, f"DATA beyond stream {sid}'s window")
            return None
        s.recv_window -= length
        return s

    def _stream_frame_fast(
        self, data: bytes | memoryview, start: int, end: int, ftype: int, flags: int, sid: int
    ) -> bool:
        """A stream's HEADERS and its END_STREAM, whole within one read: a HEADERS frame that is
        a complete block (END_HEADERS, unpadded, no priority, within our frame and block limits)
        or an empty DATA frame with END_STREAM on a stream still open from the peer. The checks
        of `_frame_start` and `_on_headers` / `_data_target` for those cases without the five
        calls of the general path per frame (issue 11, per connection: each stream has two of
        each). False leaves the frame to the general path, which raises whatever error it is."""
        if ftype == _HEADERS:
            if (
                not flags & _END_HEADERS
                or flags & _PADDED_OR_PRIORITY
                or not 0 < end - start <= self._max_block_in
            ):
                return False
            self._empty_run = 0
            self._header_block(sid, bytes(data[start:end]), bool(flags & _END_STREAM))
            return True
        s = self.streams.get(sid)
        if s is None or s.remote_closed:
            return False
        s.remote_closed = True
        if self._fresh:
            self._emit(StreamEnded(sid))
        else:
            self.events.append(StreamEnded(sid))
        if s.local_closed:
            self._remove(s)
        return True

    def _data_begin(self, length: int, flags: int, sid: int) -> None:
        s = self._data_target(length, flags, sid)
        self._data_end = bool(flags & f.FLAG_END_STREAM)
        self._data_sid = sid
        if s is None:
            self._data_stream = None
            self._skip_left = length
        else:
            self._data_stream = s
            self._data_left = length

    def _data_chunk(self, chunk: bytes | memoryview) -> None:
        s = self._data_stream
        if s is not None and self.streams.get(self._data_sid) is s:
            s.unacked += len(chunk)
            if self._fresh:
                self._emit(DataReceived(self._data_sid, chunk))
            else:
                self.events.append(DataReceived(self._data_sid, chunk))
        else:
            self._recv_credit += len(chunk)  # the stream went away mid-frame

    def _data_finish(self) -> None:
        s = self._data_stream
        self._data_stream = None
        if s is not None and self._data_end and self.streams.get(self._data_sid) is s:
            s.remote_closed = True
            self._emit(StreamEnded(s.sid))
            self._maybe_close(s)

    def _on_padded_data(self, length: int, flags: int, sid: int, payload: bytes) -> None:
        pad = payload[0]
        if pad >= length:
            raise _ConnectionError(E.PROTOCOL_ERROR, "DATA padding longer than the frame")
        data = payload[1 : length - pad]
        if not data and not flags & f.FLAG_END_STREAM:
            self._empty_frame()
        s = self._data_target(length, flags, sid)
        if s is None:
            return
        padding = length - len(data)  # never delivered: its credit goes straight back
        self._recv_credit += padding
        if padding and not flags & f.FLAG_END_STREAM:
            self._stream_credit(s, padding)
        self._data_sid = sid
        self._data_end = bool(flags & f.FLAG_END_STREAM)
        self._data_stream = s
        if data:
            self._data_chunk(data)
        self._data_finish()

    # HEADERS ------------------------------------------------------------------------------------
    def _on_headers(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0:
            raise _ConnectionError(E.PROTOCOL_ERROR, "HEADERS on stream 0")
        start, end = 0, len(payload)
        if flags & f.FLAG_PADDED:
            pad = payload[0]
            start = 1
            end -= pad
        if flags & f.FLAG_PRIORITY:
            start += 5
        if start > end:
            raise _ConnectionError(E.PROTOCOL_ERROR, "HEADERS padding or priority longer than the frame")
        fragment = payload[start:end] if (start or end != len(payload)) else payload
        end_stream = bool(flags & f.FLAG_END_STREAM)
        if flags & f.FLAG_END_HEADERS:
            self._header_block(sid, fragment, end_stream)
        else:
            self._block = bytearray(fragment)
            self._block_sid = sid
            self._block_end_stream = end_stream

    def _on_continuation(self, flags: int, sid: int, payload: bytes) -> None:
        block = self._block
        if block is None:
            raise _ConnectionError(E.PROTOCOL_ERROR, "CONTINUATION without HEADERS")
        block += payload
        if flags & f.FLAG_END_HEADERS:
            self._block = None
            self._header_block(sid, bytes(block), self._block_end_stream)

    def _header_block(self, sid: int, block: bytes, end_stream: bool) -> None:
        # Decode first, whatever happens to the stream: the HPACK table is connection state.
        try:
            headers = self._decoder.decode(block)
        except HeaderListTooLarge as e:
            raise _ConnectionError(E.ENHANCE_YOUR_CALM, str(e)) from None
        except HpackError as e:
            raise _ConnectionError(E.COMPRESSION_ERROR, str(e)) from None
        s = self.streams.get(sid)
        if s is None:
            if self.client_side:
                self._headers_unknown_stream_client(sid)
            else:
                self._new_request(sid, headers, end_stream)
            return
        if s.remote_closed:
            self._stream_error(s, sid, E.STREAM_CLOSED, f"HEADERS after END_STREAM on stream {sid}")
            return
        if self.client_side and not s.answered:
            self._response(s, headers, end_stream)
            return
        # Trailers (RFC 9113 8.1): they must end the stream; their fields mean nothing to a tunnel.
        if not end_stream:
            self._stream_error(s, sid, E.PROTOCOL_ERROR, f"second HEADERS without END_STREAM on stream {sid}")
            return
        s.remote_closed = True
        self._emit(StreamEnded(sid))
        self._maybe_close(s)

    def _headers_unknown_stream_client(self, sid: int) -> None:
        if sid % 2 == 0:
            raise _ConnectionError(E.PROTOCOL_ERROR, f"server opened stream {sid} (push is disabled)")
        if self._is_idle(sid):
            raise _ConnectionError(E.PROTOCOL_ERROR, f"HEADERS on idle stream {sid}")
        if sid not in self._reset_allowance:
            raise _ConnectionError(E.STREAM_CLOSED, f"HEADERS on closed stream {sid}")

    def _new_request(self, sid: int, headers: list[tuple[bytes, bytes]], end_stream: bool) -> None:
        if sid % 2 == 0:
            raise _ConnectionError(E.PROTOCOL_ERROR, f"client opened even stream {sid}")
        if sid <= self._highest_peer_sid:
            if sid in self._reset_allowance:
                return  # trailers of a stream we reset
            raise _ConnectionError(E.STREAM_CLOSED, f"HEADERS on closed stream {sid}")
        self._highest_peer_sid = sid
        if self._goaway_last is not None:
            # RFC 9113 6.8: after our final GOAWAY, new streams are not processed.
            self._stream_error(None, sid, E.REFUSED_STREAM, "stream opened after GOAWAY")
            return
        limit = self.settings.max_concurrent_streams
        if limit is not None and len(self.streams) >= limit:
            self._stream_error(None, sid, E.REFUSED_STREAM, f"more than {limit} concurrent streams")
            return
        verdict = _check_request(headers)
        if isinstance(verdict, _Malformed):
            self._stream_error(None, sid, E.PROTOCOL_ERROR, verdict.reason)
            self._emit(RequestRefused(sid, f"malformed request, stream reset: {verdict.reason}"))
            return
        s = _Stream(sid, False, self._peer_initial_window, self.settings.stream_window_bytes)
        s.remote_closed = end_stream
        self.streams[sid] = s
        self._streams_total += 1
        if isinstance(verdict, str):
            self._emit(RequestRefused(sid, f"answered 400: {verdict}"))
            self.send_response(sid, 400)
            return
        authority, regular = verdict
        self._fresh[sid] = [len(self.events)]
        self.events.append(RequestReceived(sid, authority, regular, end_stream))

    def _response(self, s: _Stream, headers: list[tuple[bytes, bytes]], end_stream: bool) -> None:
        status = None
        regular = []
        for name, value in headers:
            if name == b":status" and status is None and (value == b"200" or _STATUS.fullmatch(value)):
                status = int(value)
            elif (
                name[:1] == b":"
                or (name not in _CHECKED_NAMES and not _token_name(name))
                or _NUL in value
                or _LF in value
                or _CR in value
            ):
                status = -1
                break
            else:
                regular.append((name.decode("latin-1"), value.decode("latin-1")))  # `_text`, inlined
        if status is None or status < 0:
            self._stream_error(s, s.sid, E.PROTOCOL_ERROR, f"malformed response on stream {s.sid}")
            return
        if status < 200:
            if end_stream:
                self._stream_error(s, s.sid, E.PROTOCOL_ERROR, "informational response with END_STREAM")
            return  # 1xx: the final response follows (RFC 9113 8.1)
        s.answered = True
        self._emit(ResponseReceived(s.sid, status, tuple(regular), end_stream))
        if end_stream:
            s.remote_closed = True
            self._maybe_close(s)

    # Control frames ---------------------------------------------------------------------------
    def _on_window_update(self, sid: int, payload: bytes) -> None:
        self._window_updates_received += 1
        allowed = (
            WINDOW_UPDATE_BASE_FRAMES
            + WINDOW_UPDATES_PER_DATA_FRAME_SENT * self._data_frames_sent
            + WINDOW_UPDATES_PER_STREAM * self._streams_total
        )
        if self._window_updates_received > allowed:
            raise _ConnectionError(
                E.ENHANCE_YOUR_CALM,
                f"WINDOW_UPDATE flood: {self._window_updates_received} received for "
                f"{self._data_frames_sent} DATA frames sent",
            )
        increment = f.parse_u32(payload) & 0x7FFFFFFF
        if sid == 0:
            if increment == 0:
                raise _ConnectionError(E.PROTOCOL_ERROR, "WINDOW_UPDATE of 0 on the connection")
            self._send_window += increment
            if self._send_window > f.MAX_WINDOW_BYTES:
                raise _ConnectionError(E.FLOW_CONTROL_ERROR, "connection window above 2^31-1")
            self._emit(WindowUpdated(0))
            if self._waiting:
                self._drain(None)
            return
        s = self.streams.get(sid)
        if s is None:
            if self._is_idle(sid):
                raise _ConnectionError(E.PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {sid}")
            return  # closed: allowed to arrive late
        if increment == 0:
            self._stream_error(s, sid, E.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            return
        s.send_window += increment
        if s.send_window > f.MAX_WINDOW_BYTES:
            self._stream_error(s, sid, E.FLOW_CONTROL_ERROR, f"stream {sid} window above 2^31-1")
            return
        if not s.local_closed:
            self._emit(WindowUpdated(sid))
            if s.sid in self._waiting:
                self._drain(s)

    def _on_rst_stream(self, sid: int, payload: bytes) -> None:
        if sid == 0:
            raise _ConnectionError(E.PROTOCOL_ERROR, "RST_STREAM on stream 0")
        if self._is_idle(sid):
            raise _ConnectionError(E.PROTOCOL_ERROR, f"RST_STREAM on idle stream {sid}")
        code = f.parse_u32(payload)
        s = self.streams.get(sid)
        early = s is not None and not self.client_side and not s.answered
        # The flood budget is for resets that cost the peer nothing: of streams already gone, or
        # of requests we have not answered. Ending a live stream that was set up (ours, or one we
        # answered) is a stream's normal end: a proxy in the path (Envoy) resets every tunnel
        # whose far side it closed, so on a busy connection these come at the request rate.
        if (s is None or early) and not self._rst_budget.take(self._now):
            raise _ConnectionError(
                E.ENHANCE_YOUR_CALM, f"RST_STREAM flood: more than {RST_STREAM_BURST} in a burst"
            )
        if s is None:
            return
        if early and not self._early_resets.take(self._now):
            raise _ConnectionError(
                E.ENHANCE_YOUR_CALM,
                f"rapid reset: more than {EARLY_RESET_BURST} streams reset before they were answered",
            )
        self._remove(s)
        fresh = self._fresh.pop(sid, None)
        if fresh is not None:
            # Announced in this very batch: the shell never sees the request (nor its data).
            for i in fresh:
                self.events[i] = None
            self._nulled = True
            return
        self._emit(StreamReset(sid, code, s.answered))

    def _on_settings(self, flags: int, payload: bytes) -> None:
        if not self._settings_budget.take(self._now):
            raise _ConnectionError(
                E.ENHANCE_YOUR_CALM, f"SETTINGS flood: more than {SETTINGS_BURST} in a burst"
            )
        if flags & f.FLAG_ACK:
            return
        opened = False
        for key, value in f.parse_settings(payload):
            if key == f.Setting.INITIAL_WINDOW_SIZE:
                if value > f.MAX_WINDOW_BYTES:
                    raise _ConnectionError(E.FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE above 2^31-1")
                delta = value - self._peer_initial_window
                self._peer_initial_window = value
                for s in self.streams.values():
                    s.send_window += delta
                    if s.send_window > f.MAX_WINDOW_BYTES:
                        raise _ConnectionError(E.FLOW_CONTROL_ERROR, "stream window above 2^31-1")
                opened = opened or delta > 0
            elif key == f.Setting.MAX_FRAME_SIZE:
                if not f.DEFAULT_MAX_FRAME_BYTES <= value <= f.MAX_ALLOWED_FRAME_BYTES:
                    raise _ConnectionError(E.PROTOCOL_ERROR, f"SETTINGS_MAX_FRAME_SIZE {value} out of range")
                self._peer_max_frame = value
            elif key == f.Setting.MAX_CONCURRENT_STREAMS:
                self.peer_max_concurrent_streams = value
            elif key == f.Setting.HEADER_TABLE_SIZE:
                self._encoder.set_table_size(value)
            elif key == f.Setting.ENABLE_PUSH or key == f.Setting.ENABLE_CONNECT_PROTOCOL:
                if value > 1:
                    raise _ConnectionError(E.PROTOCOL_ERROR, f"SETTINGS 0x{key:x} must be 0 or 1")
            # MAX_HEADER_LIST_SIZE: ours are far below any limit; unknown settings are ignored (6.5.2).
        self._queue_control(f.SETTINGS_ACK)
        if opened:
            self._emit(WindowUpdated(0))
            if self._waiting:
                self._drain(None)

    def _on_ping(self, flags: int, sid: int, payload: bytes) -> None:
        if sid:
            raise _ConnectionError(E.PROTOCOL_ERROR, "PING on a stream")
        if not self._ping_budget.take(self._now):
            raise _ConnectionError(E.ENHANCE_YOUR_CALM, f"PING flood: more than {PING_BURST} in a burst")
        if not flags & f.FLAG_ACK:
            self._queue_control(f.ping_frame(payload, ack=True))
            return
        if payload == self._keepalive_ping:
            self._ping_deadline = None
            self._update_deadline()
        elif self._drain_ping is not None and payload == self._drain_ping:
            self._final_goaway()

    def _on_goaway(self, sid: int, payload: bytes) -> None:
        if sid:
            raise _ConnectionError(E.PROTOCOL_ERROR, "GOAWAY on a stream")
        last, code, debug = f.parse_goaway(payload)
        previous = self.goaway_received
        if previous is not None:
            self._ignored_frame("repeated GOAWAY")
            last = min(last, previous[0])  # RFC 9113 6.8: the last stream id must not increase
        self.goaway_received = (last, code)
        self._emit(GoawayReceived(last, code, debug))
        for s in [s for s in self.streams.values() if s.local and s.sid > last]:
            # Never processed by the peer: safe to retry elsewhere (RFC 9113 8.7).
            self._remove(s)
            self._emit(StreamReset(s.sid, E.REFUSED_STREAM, False, refused=True))
        self._maybe_finish()


class _Malformed:
    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _token_name(name: bytes) -> bool:
    """One or more octets, none outside lowercase tchar (RFC 9113 8.2.1, RFC 9110 5.6.2: a token
    is 1*tchar); remembered if short."""
    if not name or _BAD_NAME.search(name):
        return False
    if len(_CHECKED_NAMES) < MAX_CHECKED_NAMES and len(name) <= MAX_CHECKED_NAME_BYTES:
        _CHECKED_NAMES.add(name)
    return True


def _check_request(
    headers: list[tuple[bytes, bytes]],
) -> tuple[str, tuple[tuple[str, str], ...]] | str | _Malformed:
    """(authority, regular fields) for a plain CONNECT; a reason (str) for a 400; or _Malformed."""
    pseudo: dict[bytes, bytes] = {}
    regular: list[tuple[str, str]] = []
    for name, value in headers:
        if _NUL in value or _LF in value or _CR in value:
            return _Malformed(f"field {name[:40]!r} has NUL, CR or LF in its value")
        if name[:1] == b":":
            if regular:
                return _Malformed("pseudo-header after a regular field (RFC 9113 8.3)")
            if name not in _REQUEST_PSEUDO:
                return _Malformed(f"unknown pseudo-header {name[:40]!r}")
            if name in pseudo:
                return _Malformed(f"repeated {name.decode()}")
            pseudo[name] = value
            continue
        if name not in _CHECKED_NAMES and not _token_name(name):
            return _Malformed(f"field name {name[:40]!r} is not a lowercase token (RFC 9113 8.2.1)")
        if name in _CONNECTION_SPECIFIC or (name == b"te" and value != b"trailers"):
            return _Malformed(f"connection-specific field {name.decode()} (RFC 9113 8.2.2)")
        regular.append((name.decode("latin-1"), value.decode("latin-1")))  # `_text`, inlined
    method = pseudo.get(b":method")
    if not method:
        return _Malformed("no :method")
    if b":protocol" in pseudo:
        return _Malformed(
            "extended CONNECT (:protocol) although SETTINGS_ENABLE_CONNECT_PROTOCOL was never sent (RFC 8441 3)"
        )
    if method == b"CONNECT":
        if b":scheme" in pseudo or b":path" in pseudo:
            return _Malformed("CONNECT with :scheme or :path (RFC 9113 8.5)")
        authority = pseudo.get(b":authority")
        if not authority:
            return _Malformed("CONNECT without :authority (RFC 9113 8.5)")
        return _text(authority), tuple(regular)
    if b":scheme" not in pseudo or b":path" not in pseudo:
        return _Malformed("request without :scheme or :path (RFC 9113 8.3.1)")
    return f"method {_text(method)[:40]} is not CONNECT"
