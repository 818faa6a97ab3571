"""What a transport's socket has not taken yet, with asyncio's flow-control marks and a bound (sans-IO).

Counterpart: the write buffer of an asyncio transport (uvloop's, CPython's selector transports):
the protocol is told to `pause_writing` once more than the high-water mark waits and to
`resume_writing` once no more than the low-water mark does. Here a protocol that keeps writing
after `pause_writing` is also cut off at `max_bytes`, so a peer that stops reading cannot make
us hold more than that. Both of our transports keep one: HBONE's TLS (tls/transport.py) and the
plain TCP endpoints (transport/tcp.py).
"""

from __future__ import annotations

import collections

# A protocol that keeps writing after pause_writing is cut off here (our protocols stop: the
# HBONE connection's core holds and bounds what waits, up to its 16 MiB connection window,
# hbone/; a relay's endpoint pauses the other side's reading, relay.py).
MAX_WRITE_BACKLOG_BYTES = 64 * 1024 * 1024
# A view that waits holds its whole buffer alive (a 1 MiB receive buffer of relay.py or hbone/connection.py,
# reused only once no view of it is alive): one shorter than this share of its buffer is copied
# instead, so what waits pins at most this many times its size (a slow app's socket,
# tests/netns/test_attack_hbone.py).
HELD_VIEW_MIN_SHARE = 4


class BacklogOverflow(ConnectionError):
    """The protocol wrote past the backlog's bound while the peer was not reading."""


class WriteBacklog:
    """The pieces waiting to be sent, oldest first, with the flow-control marks.

    The head goes out again as it is after a short or refused send (`head`, `pop`), or the sent
    part of it is dropped (`consume`)."""

    __slots__ = (
        "pieces",
        "bytes",
        "high_water_bytes",
        "low_water_bytes",
        "max_bytes",
        "paused",
        "_default_high_water_bytes",
    )

    def __init__(
        self,
        *,
        high_water_bytes: int,
        low_water_bytes: int,
        max_bytes: int = MAX_WRITE_BACKLOG_BYTES,
    ) -> None:
        self.pieces: collections.deque[bytes | memoryview] = collections.deque()
        self.bytes = 0
        self.high_water_bytes = high_water_bytes
        self.low_water_bytes = low_water_bytes
        self.max_bytes = max_bytes
        self.paused = False  # the protocol was told to pause_writing and not yet to resume
        self._default_high_water_bytes = high_water_bytes

    def __repr__(self) -> str:
        return f"WriteBacklog({self.bytes}B in {len(self.pieces)}, {'paused' if self.paused else 'open'})"

    def set_limits(self, high: int | None = None, low: int | None = None) -> None:
        """asyncio's `set_write_buffer_limits` rule: low defaults to high / 4, high to 4 x low
        (to this backlog's own high-water mark when neither is given)."""
        if high is None:
            high = self._default_high_water_bytes if low is None else 4 * low
        if low is None:
            low = high // 4
        if not high >= low >= 0:
            raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
        self.high_water_bytes = high
        self.low_water_bytes = low

    def push(self, data: bytes | bytearray | memoryview) -> bool:
        """Queue `data`; True when the protocol must now be told to pause writing. Kept as it is
        when it is bytes or a view of at least 1 / HELD_VIEW_MIN_SHARE of its buffer; a shorter
        view, and a bytearray (its owner may change it), are copied.

        Raises BacklogOverflow past `max_bytes`, before anything is queued."""
        if self.bytes + len(data) > self.max_bytes:
            raise BacklogOverflow(
                f"write backlog would exceed {self.max_bytes} bytes: the peer is not reading "
                "and the protocol kept writing after pause_writing"
            )
        if type(data) is memoryview:
            if len(data) * HELD_VIEW_MIN_SHARE < len(data.obj):  # type: ignore[arg-type]  # bytes or bytearray
                data = bytes(data)
        elif type(data) is not bytes:
            data = bytes(data)
        self.pieces.append(data)
        self.bytes += len(data)
        if not self.paused and self.bytes > self.high_water_bytes:
            self.paused = True
            return True
        return False

    def head(self) -> bytes | memoryview:
        return self.pieces[0]

    def pop(self) -> bool:
        """The head was written; True when the protocol must now be told to resume writing."""
        self.bytes -= len(self.pieces.popleft())
        return self._drained()

    def consume(self, n: int) -> bool:
        """`n` bytes from the front were written (whole pieces, then part of one); True when the
        protocol must now be told to resume writing."""
        pieces = self.pieces
        self.bytes -= n
        while n:
            first = pieces[0]
            if len(first) <= n:
                n -= len(first)
                pieces.popleft()
            else:
                pieces[0] = memoryview(first)[n:]
                n = 0
        return self._drained()

    def _drained(self) -> bool:
        if self.paused and self.bytes <= self.low_water_bytes:
            self.paused = False
            return True
        return False

    def clear(self) -> None:
        self.pieces.clear()
        self.bytes = 0
