"""Bidirectional byte copy between two endpoints, with backpressure and half-close.

Counterpart: ztunnel src/copy.rs. An endpoint is either a plain TCP connection
(`TcpEndpoint`, an asyncio Protocol) or an HBONE stream (`proxy.hbone.HboneStream`). The
relay joins two of them: bytes read on one side are written to the other; when a side cannot
take more (its socket buffer is full, or its HTTP/2 window is closed) the relay pauses reading
on the other side; EOF on one side becomes a write-shutdown (or END_STREAM) on the other, so
half-closed connections keep working; an error on either side aborts both.

Protocol callbacks keep the hot path free of awaits: a chunk goes from `data_received` to the
peer's `write` in one call (docs/performance.md,
"The per-connection path").

Bulk reads: uvloop reads a plain socket into its own 256,000-byte buffer and copies every read
into a new bytes object for `data_received`. A read that fills that buffer means more was
waiting (a bulk transfer), and from then on the endpoint reads through `_BulkReader`, a
BufferedProtocol, straight into a reused buffer (`_APP_RECEIVE`): no copy, no allocation per
read. Small messages stay on `data_received`, which costs one Python callback per read where a
BufferedProtocol costs two (docs/performance.md, "Tried and not kept"); an endpoint that goes back to small reads goes back to it.
"""

from __future__ import annotations

import asyncio
import socket

from ..host.cpython import ReusableBuffer
from .tcp import READ_BYTES, TcpTransport

# The TCP transport's read size (tcp.py, as uvloop's UV_STREAM_RECV_BUF_SIZE was): a
# `data_received` this long filled it.
UVLOOP_READ_BYTES = READ_BYTES
# What one bulk read takes at most: one DATA frame (hbone.MAX_FRAME_BYTES is 1 MiB) or one TLS
# write of this many bytes per read. 9 bytes short of 1 MiB: such a read goes out as one
# HTTP/2 DATA frame whose 9-byte header (RFC 9113 4.1) shares the first TLS record
# (tls/transport.py TlsTransport.writelines), so header and payload fill 64 records of 2^14 bytes
# exactly (RFC 8446 5.1); a full 1 MiB would leave a 9-byte last record per frame to seal, send,
# open and hand over (docs/performance.md, "Buffers and copies"). 1 MiB rather than 256 KiB: a
# quarter of the reads, seals, sends and wake-ups per GiB on both proxies.
APP_RECEIVE_BUFFER_BYTES = 1024 * 1024 - 9
# Back to `data_received` after this many reads in a row shorter than a quarter of the buffer.
SMALL_READS_TO_LEAVE_BULK = 16
# What a plain endpoint reads and holds before its relay starts, at most: past it, reading pauses
# until `attach` (one read more can be held: uvloop reads up to UVLOOP_READ_BYTES at a time). A
# client's first message (sent while the upstream is being reached) is usually far shorter,
# and pausing and resuming a socket is a uv_read_stop, a uv_read_start and their epoll changes
# (docs/performance.md, "The per-connection path").
MAX_HELD_BEFORE_RELAY_BYTES = 16 * 1024


# What a captured client's socket is read for before its upstream is reached (`read_waiting`):
# the bytes it sent already go out with the HBONE CONNECT (outbound.py).
MAX_EARLY_DATA_BYTES = MAX_HELD_BEFORE_RELAY_BYTES


class Endpoint:
    """One side of a relay. Subclasses implement the five verbs the relay uses.

    An endpoint hands what it reads to `peer.write` itself and counts it in `bytes_read`, with no
    call through the relay per chunk (docs/performance.md, "The per-connection path"); `Relay.data_from`
    does the same for the paths that are not per chunk (bytes held before the relay started)."""

    relay: Relay | None = None
    peer: Endpoint | None = None  # the other side of the relay, set when it starts
    bytes_read = 0

    def write(self, data: bytes | memoryview) -> None:
        raise NotImplementedError

    def write_eof(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    def pause_reading(self) -> None:
        raise NotImplementedError

    def resume_reading(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Both directions are finished: release the endpoint cleanly."""
        raise NotImplementedError


class Relay:
    """Joins `downstream` (the side that opened the connection) and `upstream`.

    `bytes_up` counts downstream -> upstream (what the client sent), `bytes_down` the reverse
    (what each side read: `Endpoint.bytes_read`); the connection's metrics read them
    (metrics.ConnectionRecorder.follow), no call per chunk.
    `done` resolves with None on a clean finish or the error that ended the relay.
    """

    __slots__ = (
        "downstream",
        "upstream",
        "done",
        "_eof_from",
        "_closed",
    )

    def __init__(self, downstream: Endpoint, upstream: Endpoint) -> None:
        self.downstream = downstream
        self.upstream = upstream
        self.done: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
        self._eof_from = 0  # bit 1: downstream sent EOF, bit 2: upstream (a set was 216 B per relay)
        self._closed = False
        downstream.relay = self
        upstream.relay = self
        downstream.peer = upstream
        upstream.peer = downstream

    def __repr__(self) -> str:
        state = (
            "done"
            if self.done.done()
            else f"half-closed from {bin(self._eof_from).count('1')} side(s)"
            if self._eof_from
            else "open"
        )
        return f"Relay({state}, up={self.bytes_up}B, down={self.bytes_down}B)"

    def _other(self, side: Endpoint) -> Endpoint:
        return self.upstream if side is self.downstream else self.downstream

    # What metrics.ByteTotals reads: what each side read.
    @property
    def bytes_up(self) -> int:
        return self.downstream.bytes_read

    @property
    def bytes_down(self) -> int:
        return self.upstream.bytes_read

    def data_from(self, side: Endpoint, data: bytes | memoryview) -> None:
        """What the endpoints do per chunk themselves (see Endpoint)."""
        side.bytes_read += len(data)
        self._other(side).write(data)

    def eof_from(self, side: Endpoint) -> None:
        bit = 1 if side is self.downstream else 2
        if self._eof_from & bit or self._closed:
            return
        self._eof_from |= bit
        self._other(side).write_eof()
        if self._eof_from == 3:
            self._finish(None)

    def blocked(self, side: Endpoint) -> None:
        """`side` cannot take more bytes: stop reading from the other side."""
        if not self._closed:
            self._other(side).pause_reading()

    def unblocked(self, side: Endpoint) -> None:
        if not self._closed:
            self._other(side).resume_reading()

    def failed(self, side: Endpoint, exc: BaseException) -> None:
        if self._closed:
            return
        self._closed = True
        self._other(side).abort()
        side.abort()
        if not self.done.done():
            self.done.set_result(exc)

    def abort(self, exc: BaseException) -> None:
        """Tear both sides down from outside (drain deadline, policy change)."""
        if self._closed:
            return
        self._closed = True
        self.downstream.abort()
        self.upstream.abort()
        if not self.done.done():
            self.done.set_result(exc)

    def finish(self) -> None:
        """End cleanly now: both sides are closed after their buffered bytes are written."""
        if not self._closed:
            self._finish(None)

    def _finish(self, exc: BaseException | None) -> None:
        self._closed = True
        self.downstream.close()
        self.upstream.close()
        if not self.done.done():
            self.done.set_result(exc)

    def release(self) -> None:
        """Unlink the endpoints from the relay and from each other once it has ended and been
        recorded.

        Each endpoint's `relay` becomes None (what a late callback then does is what it does
        before a relay starts: nothing, as the sockets are closed) and its `peer` an endpoint
        that drops what it is handed; the relay keeps the endpoints, so its byte counts stay
        readable. Without those references back, the connection's objects (relay, endpoints,
        transports, futures) are freed by reference counting when the last callback is done
        with them, instead of as a cycle by the garbage collector: about 10 objects per
        connection and proxy, and a collection every ~100 connections (docs/performance.md,
        "The per-connection path").
        """
        if not self._closed:
            return
        for side in (self.downstream, self.upstream):
            side.relay = None
            side.peer = _RELEASED


class _ReleasedEndpoint(Endpoint):
    """The `peer` of both sides of a released relay (`Relay.release`): it drops what it is
    handed (the relay has ended: both sockets are closed or closing)."""

    __slots__ = ()

    def write(self, data: bytes | memoryview) -> None:
        pass

    def write_eof(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass


_RELEASED = _ReleasedEndpoint()


_NOTHING_HELD: list[
    bytes | memoryview
] = []  # shared and always empty: nothing is held once a relay is attached


# The process's one buffer for bulk reads of plain sockets (the event loop runs one read callback
# at a time). What a read hands on is a read-only view of it; whoever keeps the bytes past the
# call copies them or holds the view (the TLS write backlog does, the HTTP/2 core's outbox while
# writing is paused), and then the next read gets a new buffer (hbone/connection.py's TLS receive buffer
# works the same way). Made on the first bulk read: the workers' owner never relays.
_APP_RECEIVE = ReusableBuffer(APP_RECEIVE_BUFFER_BYTES)
_QUARTER_BUFFER = APP_RECEIVE_BUFFER_BYTES // 4


class _BulkReader(asyncio.BufferedProtocol):
    """A TcpEndpoint's protocol while it reads in bulk (module docstring)."""

    __slots__ = ("endpoint", "_small_reads")

    def __init__(self, endpoint: TcpEndpoint) -> None:
        self.endpoint = endpoint
        self._small_reads = 0

    def get_buffer(self, sizehint: int) -> bytearray:
        return _APP_RECEIVE.take()

    def buffer_updated(self, nbytes: int) -> None:
        endpoint = self.endpoint
        peer = endpoint.peer
        if peer is None:  # not reached: an endpoint reads in bulk only once it is relaying
            endpoint.data_received(bytes(_APP_RECEIVE.buf[:nbytes]))
        else:
            endpoint.bytes_read += nbytes
            peer.write(memoryview(_APP_RECEIVE.buf)[:nbytes].toreadonly())
        if nbytes >= _QUARTER_BUFFER:
            self._small_reads = 0
            return
        self._small_reads += 1
        if self._small_reads >= SMALL_READS_TO_LEAVE_BULK:
            transport = endpoint.transport
            if transport is not None and not transport.is_closing():
                transport.set_protocol(endpoint)

    def eof_received(self) -> bool:
        return self.endpoint.eof_received()

    def pause_writing(self) -> None:
        self.endpoint.pause_writing()

    def resume_writing(self) -> None:
        self.endpoint.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.endpoint.connection_lost(exc)


class TcpEndpoint(asyncio.Protocol, Endpoint):
    """A plain TCP connection as a relay endpoint.

    Bytes that arrive before the relay is attached are held (reading pauses past
    MAX_HELD_BEFORE_RELAY_BYTES) so nothing is lost while the proxy is still deciding where
    the connection goes.
    """

    __slots__ = ("transport", "peer", "bytes_read", "_held", "_held_eof", "_lost", "_eof_sent")

    def __init__(self) -> None:
        self.transport: TcpTransport | None = None  # wrap_socket makes it
        self.relay = None
        self.peer = None
        self.bytes_read = 0
        self._held: list[bytes | memoryview] = []
        self._held_eof = False
        self._lost: BaseException | None | bool = False
        self._eof_sent = False

    def __repr__(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport else None
        return f"TcpEndpoint(peer={peer})"

    # asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes | memoryview) -> None:
        peer = self.peer
        if peer is None:  # no relay yet (Relay sets `relay` and `peer` together)
            held = self._held
            held.append(data)
            if self.transport is not None and sum(map(len, held)) >= MAX_HELD_BEFORE_RELAY_BYTES:
                self.transport.pause_reading()
            return
        self.bytes_read += len(data)
        peer.write(data)
        if len(data) >= UVLOOP_READ_BYTES:
            transport = self.transport
            if transport is not None and not transport.is_closing():
                transport.set_protocol(_BulkReader(self))

    def eof_received(self) -> bool:
        if self.relay is None:
            self._held_eof = True
        else:
            self.relay.eof_from(self)
        return True  # keep the write side open: half-close

    def pause_writing(self) -> None:
        if self.relay is not None:
            self.relay.blocked(self)

    def resume_writing(self) -> None:
        if self.relay is not None:
            self.relay.unblocked(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = exc
        relay = self.relay
        if relay is not None and not relay.done.done():
            relay.failed(self, exc or ConnectionResetError("connection closed before the relay finished"))

    # Endpoint --------------------------------------------------------------------------
    def attach(self, relay: Relay) -> None:
        """Start relaying: replay anything held while the route was decided."""
        self.relay = relay
        held, self._held = self._held, _NOTHING_HELD  # no new list per idle connection
        for chunk in held:
            relay.data_from(self, chunk)
        if self._held_eof:
            relay.eof_from(self)
        elif self._lost is not False and not relay.done.done():
            lost = self._lost if isinstance(self._lost, BaseException) else None
            relay.failed(self, lost or ConnectionResetError("connection closed early"))
        elif self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def hold_first(self, data: bytes) -> None:
        """Bytes read from the socket before it was wrapped (`read_waiting`) and not sent ahead:
        they are relayed first, before anything the transport read (not once attached)."""
        self._held.insert(0, data)

    def write(self, data: bytes | memoryview) -> None:
        # No is_closing() call first: our transport drops writes once it is closing itself, and
        # this runs once per message (docs/performance.md, "Buffers and copies").
        transport = self.transport
        if transport is not None:
            transport.write(data)

    def write_eof(self) -> None:
        if self._eof_sent or self.transport is None or self.transport.is_closing():
            return
        self._eof_sent = True
        if self.transport.can_write_eof():
            self.transport.write_eof()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def pause_reading(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def read_waiting(sock: socket.socket) -> bytes:
    """What the peer of a connected non-blocking socket has sent already, up to
    MAX_EARLY_DATA_BYTES, read before the event loop's transport takes the socket; b"" when
    nothing waits (or the peer has ended or failed: the transport reads and reports that).

    A client that speaks first (HTTP, TLS) has usually sent its first message by the time its
    connection is accepted: read here, it can go out with the CONNECT (outbound.py)."""
    try:
        return sock.recv(MAX_EARLY_DATA_BYTES)
    except OSError:  # BlockingIOError: nothing yet; anything else the transport sees again
        return b""


def wrap_socket(sock: socket.socket) -> TcpEndpoint:
    """A connected non-blocking plain socket (accepted or dialled) as a TcpEndpoint, reading at
    once and holding what it reads until `attach`; on our own transport
    (transport/tcp.py), made here and now: no await, no turn of the event loop. HBONE's TLS
    has its own transport (tls/transport.py).

    Reading is not paused up front: what arrives before `attach` is held, and reading pauses
    once MAX_HELD_BEFORE_RELAY_BYTES are (`data_received`), so a socket whose peer sends nothing
    or a short first message (an inbound app socket, a client waiting for its upstream) is
    never paused and resumed (docs/performance.md, "The per-connection path")."""
    endpoint = TcpEndpoint()
    TcpTransport(asyncio.get_running_loop(), sock, endpoint)
    return endpoint
