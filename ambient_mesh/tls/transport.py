"""HBONE's TLS over the socket itself: OpenSSL's handshake (tls/handshake.py, through pyOpenSSL
over memory BIOs), then HBONE's own TLS 1.3 records (`TlsTransport` over the sans-IO
tls/records.py), or OpenSSL's records for TLS 1.2 (`OpenSslTransport`), each driven from the
event loop's readiness callbacks.

Own records (TLS 1.3, every HBONE context of tls/context.py): once the handshake is done the
record layer has the two application traffic secrets and OpenSSL's connection is released, so
nothing else can seal a record on those keys. From then on one `recv` per wake-up into a
per-thread buffer, records opened straight into the protocol's buffer; a write's records sealed
into one buffer and sent with one `send`. Why our own records and not OpenSSL's: docs/performance.md,
"TLS: our own TLS 1.3 records on `cryptography`'s AES-GCM"; the AEAD is `cryptography`'s AESGCM either way.

TLS 1.2 (TLS12_ENABLED=true, off by default) keeps OpenSSL's records: `OpenSslTransport` below,
OpenSSL over the same memory BIOs (each received chunk written into it, each write's records read
out of it and sent with one `send`); tests/integration/test_tls_transport.py runs every transport
test on both.

Counterparts: ztunnel's rustls over tokio's TcpStream (tokio-rustls), which also encrypts into and
decrypts out of the buffers it hands the socket; asyncio's sslproto and uvloop's SSLProtocol,
which this replaces for HBONE.

Facts this relies on (RFC 8446, OpenSSL's SSL_read(3) / SSL_write(3)):
- TLS 1.3 has no renegotiation; post-handshake messages (KeyUpdate, RFC 8446 4.6.3) are handled
  by whichever record layer reads them and answered before its next record.
- A TCP reset and a TCP FIN without close_notify end the connection with an error (RFC 8446 6.1:
  a truncation); only close_notify is an EOF.
- Closing sends close_notify (RFC 8446 6.1) and then waits, at most SHUTDOWN_TIMEOUT_S, for the
  peer's EOF so that unread bytes in our socket do not turn our last records into a TCP reset.
- Record-layer failures (a record that fails authentication, an oversized one, an unexpected
  message) are counted (`istio_tls_record_failures_total{reason}`, metrics.py) and logged as a
  warning with the peer's address, at most one line per LOG_FAILURES_EVERY_S per reason.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable
from typing import Any, Protocol

from OpenSSL import SSL

from ..errors import ProtocolError
from ..metrics import TLS_RECORD_FAILURES
from ..transport.write_backlog import BacklogOverflow, WriteBacklog
from . import records as tls_records
from .handshake import Handshake, HandshakeError, PeerTls, drain_output

log = logging.getLogger("ambient_mesh.tls")

# What waits in our backlog (beyond the socket's own buffer) before the protocol is told to stop
# writing, and below which it may start again; asyncio's flow-control contract.
WRITE_HIGH_WATER_BYTES = 256 * 1024
WRITE_LOW_WATER_BYTES = 64 * 1024
# Decrypted bytes handed to the protocol per readiness callback before other callbacks run (the
# socket is polled level-triggered: what is left is read on the next round).
READ_BYTES_PER_WAKE = 1024 * 1024
# RFC 8446 5.1: a record carries at most 2^14 bytes of plaintext.
MAX_RECORD_PLAINTEXT_BYTES = 16 * 1024
# How long close waits for the backlog to drain and for the peer's EOF after close_notify (uvloop's
# default ssl_shutdown_timeout).
SHUTDOWN_TIMEOUT_S = 30.0
# Read and thrown away while closing (after close_notify): one record, or raw bytes, per call.
_DISCARD = bytearray(64 * 1024)
# Dropping raw bytes while closing (see _drain_raw) ends after this long without any.
DRAIN_IDLE_S = 1.0
# What one handshake read takes from the socket at most.
HANDSHAKE_READ_BYTES = 64 * 1024
# The record layer of TLS 1.3 connections: HBONE's own (False), or OpenSSL's (True) only where a
# benchmark asks for it (docs/performance.md, "TLS: our own TLS 1.3 records on `cryptography`'s AES-GCM").
OPENSSL_RECORDS = False
# Record-layer failures: at most one warning per reason this often (the counter counts them all).
LOG_FAILURES_EVERY_S = 10.0
LAST_LOGGED: dict[str, float] = {}
_suppressed: dict[str, int] = {}


def record_failure(reason: str, peer: object, detail: str) -> None:
    """Count one record-layer failure (`reason`: the alert we sent, or the peer's) and warn about
    it, rate-limited per reason (module docstring)."""
    TLS_RECORD_FAILURES.labels(reason).inc()
    now = time.monotonic()
    last = LAST_LOGGED.get(reason)
    if last is not None and now - last < LOG_FAILURES_EVERY_S:
        _suppressed[reason] = _suppressed.get(reason, 0) + 1
        return
    LAST_LOGGED[reason] = now
    more = _suppressed.pop(reason, 0)
    log.warning(
        "TLS record layer failure (%s) with peer %s: %s%s",
        reason,
        peer,
        detail,
        f" ({more} more like it in the last {LOG_FAILURES_EVERY_S:.0f} s not logged)" if more else "",
    )


class RecordProtection(Protocol):
    """What a transport needs of a record layer: tls/records.py's `RecordLayer` (TLS 1.3) or
    OpenSSL's behind `_OpenSslRecords` (TLS 1.2)."""

    @property
    def output(self) -> bytes | bytearray: ...

    def open_into(self, src: memoryview, end: int, dst: memoryview, filled: int) -> tuple[int, int, int]: ...

    def seal_write(self, data: bytes | bytearray | memoryview) -> bytes | memoryview: ...

    def seal_pieces(self, pieces: Iterable[bytes | bytearray | memoryview]) -> bytes | memoryview: ...

    def take_output(self) -> bytes: ...

    def close_notify(self) -> bytes: ...

    def wipe(self) -> None: ...


def _ready(loop: asyncio.AbstractEventLoop, fd: int, writable: bool) -> asyncio.Future[None]:
    fut: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not fut.done():
            fut.set_result(None)

    if writable:
        loop.add_writer(fd, wake)
    else:
        loop.add_reader(fd, wake)
    return fut


async def _wait(loop: asyncio.AbstractEventLoop, fd: int, writable: bool) -> None:
    try:
        await _ready(loop, fd, writable)
    finally:
        if writable:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)


async def _send_all(loop: asyncio.AbstractEventLoop, sock: socket.socket, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = sock.send(view)
        except (BlockingIOError, InterruptedError):
            n = 0
        view = view[n:]
        if view:
            await _wait(loop, sock.fileno(), True)


async def _handshake(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, handshake: Handshake, timeout_s: float
) -> None:
    fd = sock.fileno()
    buf = bytearray(HANDSHAKE_READ_BYTES)
    try:
        async with asyncio.timeout(timeout_s):
            try:
                out = handshake.start() if not handshake.server_side else b""
                while True:
                    if out:
                        await _send_all(loop, sock, out)
                        out = b""
                    if handshake.done:
                        return
                    try:
                        n = sock.recv_into(buf)
                    except (BlockingIOError, InterruptedError):
                        await _wait(loop, fd, False)
                        continue
                    if not n:
                        raise HandshakeError("TLS handshake failed: the peer closed the connection")
                    out = handshake.receive(memoryview(buf)[:n])
            except HandshakeError:
                # Our alert (if OpenSSL sealed one) goes out first, best effort.
                alert = handshake.failure_output()
                if alert:
                    try:
                        sock.send(alert)
                    except OSError:
                        pass
                raise
    except TimeoutError:
        raise TimeoutError(f"TLS handshake did not complete within {timeout_s} s") from None


async def start_tls(
    sock: socket.socket,
    ctx: SSL.Context,
    protocol: asyncio.BufferedProtocol,
    *,
    server_side: bool,
    handshake_timeout_s: float,
    records_per_key: int | None = None,
    openssl_records: bool | None = None,
) -> TlsTransport | OpenSslTransport:
    """TLS on the connected `sock`, then `protocol.connection_made(transport)`; the transport.

    The socket becomes the transport's (closed on any failure). No SNI is sent, as ztunnel; the
    peer is identified by its certificate afterwards (`get_extra_info("ssl_object")`, a
    tls/handshake.py `PeerTls`). TLS 1.3 gets HBONE's own records (`TlsTransport`), TLS 1.2
    OpenSSL's (`OpenSslTransport`; for TLS 1.3 too with `openssl_records`, what
    bench/tls_transport_bench.py and hbone_bench measure ours against). `records_per_key` lowers RFC 8446 5.5's limit for tests (by default
    tls/records.py's `KeyUpdates`, which interop tests change). Raises HandshakeError (an
    ssl.SSLError, so an OSError) for a failed handshake, TimeoutError after
    `handshake_timeout_s`.
    """
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    handshake: Handshake | None = None
    transport: TlsTransport | OpenSslTransport
    try:
        handshake = Handshake(ctx, server_side=server_side)
        await _handshake(loop, sock, handshake, handshake_timeout_s)
        if openssl_records is None:
            openssl_records = OPENSSL_RECORDS
        peer, records = handshake.finish(
            records_per_key or tls_records.KeyUpdates.records_per_key,
            openssl_records=openssl_records,
            request_peer_update=tls_records.KeyUpdates.request_peer_update,
        )
        leftover = handshake.leftover()
        if records is None:
            transport = OpenSslTransport(loop, sock, protocol, peer, handshake.take_openssl())
        else:
            transport = TlsTransport(loop, sock, protocol, peer, records)
        if leftover:
            transport._held = leftover
    except BaseException:
        if handshake is not None:
            handshake.release()
        sock.close()
        raise
    handshake.release()
    protocol.connection_made(transport)
    transport._start()
    return transport


class _TlsTransportBase(asyncio.Transport):
    """What both TLS transports share: extra info, reader and writer registration, flow-control
    limits, the close timers and the end."""

    __slots__ = (
        "_loop",
        "_sock",
        "_peer",
        "_peername",
        "_fd",
        "_protocol",
        "_backlog",
        "_reading",
        "_read_paused",
        "_writer_on",
        "_closing",
        "_eof",
        "_closed",
        "_close_timer",
        "_idle_timer",
        "_held",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        protocol: asyncio.BufferedProtocol,
        peer: PeerTls,
    ) -> None:
        super().__init__()
        self._loop = loop
        self._sock = sock
        self._peer = peer
        try:
            self._peername: Any = sock.getpeername()
        except OSError:
            self._peername = None
        self._fd = sock.fileno()
        self._protocol = protocol
        self._backlog = WriteBacklog(
            high_water_bytes=WRITE_HIGH_WATER_BYTES, low_water_bytes=WRITE_LOW_WATER_BYTES
        )
        self._reading = False  # our reader is registered with the loop
        self._read_paused = False  # the protocol asked us to pause reading
        self._writer_on = False
        self._closing = False
        self._eof = False  # the peer's close_notify (or, OpenSSL's records, TCP EOF) was read
        self._closed = False  # the socket is closed and connection_lost is scheduled
        self._close_timer: asyncio.TimerHandle | None = None
        self._idle_timer: asyncio.TimerHandle | None = None  # see _drain_raw
        self._held: bytes | None = None  # received bytes not yet opened (see _on_readable)

    def _on_readable(self) -> None:
        raise NotImplementedError

    def _on_writable(self) -> None:
        raise NotImplementedError

    # Extra info: what the callers and the identity checks read ---------------------------------
    def get_extra_info(self, name: str, default: Any = None) -> Any:
        """ "ssl_object" is the peer's facts (tls/handshake.py `PeerTls`), not an OpenSSL object:
        nothing handed out here can read or write records (tests/integration/test_tls_one_writer.py).
        "sslcontext" is not offered."""
        if name == "ssl_object":
            return self._peer
        if name == "socket":
            return self._sock
        try:
            if name == "peername":
                return self._sock.getpeername()
            if name == "sockname":
                return self._sock.getsockname()
        except OSError:
            return default
        if name == "peercert":
            return self._peer.getpeercert()
        if name == "cipher":
            return self._peer.cipher()
        return default

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        raise NotImplementedError(f"{type(self).__name__} keeps the protocol it was started with")

    def _add_reader(self) -> None:
        if not self._reading:
            self._loop.add_reader(self._fd, self._on_readable)
            self._reading = True

    def _remove_reader(self) -> None:
        if self._reading:
            self._loop.remove_reader(self._fd)
            self._reading = False

    def is_reading(self) -> bool:
        return not self._read_paused and not self._closing and not self._eof

    def pause_reading(self) -> None:
        if self._closing or self._read_paused:
            return
        self._read_paused = True
        self._remove_reader()

    def _add_writer(self) -> None:
        if not self._writer_on:
            self._loop.add_writer(self._fd, self._on_writable)
            self._writer_on = True

    def _remove_writer(self) -> None:
        if self._writer_on:
            self._loop.remove_writer(self._fd)
            self._writer_on = False

    def can_write_eof(self) -> bool:
        return False

    def write_eof(self) -> None:
        raise NotImplementedError("TLS write EOF is not offered: close() sends close_notify")

    def get_write_buffer_size(self) -> int:
        return self._backlog.bytes

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return (self._backlog.low_water_bytes, self._backlog.high_water_bytes)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._backlog.set_limits(high, low)

    def is_closing(self) -> bool:
        return self._closing

    def _drain_raw(self) -> None:
        """Drop the socket's raw bytes until the peer's FIN, or DRAIN_IDLE_S without any (a peer
        that is itself waiting for our FIN): nothing after our close_notify needs decrypting."""
        if self._closed:
            return
        budget = READ_BYTES_PER_WAKE
        while budget > 0:
            try:
                n = os.readv(self._fd, (_DISCARD,))
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                n = 0
            if not n:
                self._finish(None)
                return
            budget -= n
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._idle_timer = self._loop.call_later(DRAIN_IDLE_S, self._finish, None)

    def _shutdown_timed_out(self) -> None:
        self._close_timer = None
        if not self._closed:
            log.debug("TLS close did not finish within %s s; aborting", SHUTDOWN_TIMEOUT_S)
            self._finish(None)

    def abort(self) -> None:
        self._finish(None)

    def _fatal(self, exc: Exception) -> None:
        log.debug("TLS connection with %s failed: %s", self._peername, exc)
        self._finish(exc)

    def _finish(self, exc: Exception | None) -> None:
        if self._closed:
            return
        self._closed = True
        self._closing = True
        self._remove_reader()
        self._remove_writer()
        if self._close_timer is not None:
            self._close_timer.cancel()
            self._close_timer = None
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        self._backlog.clear()
        try:
            self._sock.close()
        except OSError as e:
            if e.errno != errno.EBADF:
                raise
        self._loop.call_soon(self._protocol.connection_lost, exc)


# HBONE's own TLS 1.3 records (module docstring, "Own records") ---------------------------------
# One receive buffer per thread (per event loop): what a connection holds between wake-ups (the
# start of a record, or what a paused protocol left, at most the buffer) is copied to its front,
# one `recv` fills the rest. Sharing it relies on one `_on_readable` never running inside
# another: the loop runs readiness callbacks one at a time, and nothing a protocol's
# `buffer_updated` calls reads a TLS socket at once (`resume_reading` schedules the read; the
# close path reads into a buffer of its own, `DRAIN_READ_BYTES`).
RECV_BYTES = 1024 * 1024  # a bulk write's records (relay.APP_RECEIVE_BUFFER_BYTES) in one recv
RECV_BUFFER_BYTES = RECV_BYTES + 2 * tls_records.MAX_SEALED_RECORD_BYTES
_RECV_BUFFERS = threading.local()


def _recv_view() -> memoryview:
    view: memoryview | None = getattr(_RECV_BUFFERS, "view", None)
    if view is None:
        view = _RECV_BUFFERS.view = memoryview(bytearray(RECV_BUFFER_BYTES))
    return view


_NEED_MORE, _CLOSED = tls_records.NEED_MORE, tls_records.CLOSED
# What the close path (_drain_to_eof) reads per wake-up, into a buffer of its own: it may run from
# inside _on_readable (a close from buffer_updated), which is still reading the shared one.
DRAIN_READ_BYTES = 64 * 1024
# Held bytes longer than this may hold whole records (a pause left them): they are opened before
# the next `recv`.
_HELD_BEFORE_RECV_BYTES = tls_records.MAX_SEALED_RECORD_BYTES
_recv_into = socket.socket.recv_into  # the C methods, called unbound
_send = socket.socket.send


class TlsTransport(_TlsTransportBase):
    """A TLS 1.3 stream transport whose records are HBONE's own (tls/records.py) after
    OpenSSL's handshake (see `start_tls`).

    Reads: one `recv` per wake-up into a process-wide buffer, records opened straight into the
    BufferedProtocol's buffer. Writes: one write's records sealed into one buffer and sent with one
    `send`; what the socket does not take waits, sealed, in a bounded `WriteBacklog`. Write EOF is
    not offered (close sends close_notify): HBONE ends streams in HTTP/2, not with half-closes.
    """

    __slots__ = ("_records", "_shut", "_recv")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        protocol: asyncio.BufferedProtocol,
        peer: PeerTls,
        records: RecordProtection,
    ) -> None:
        super().__init__(loop, sock, protocol, peer)
        self._records = records
        self._shut = False  # our close_notify is sealed
        self._recv = _recv_view()  # this thread's receive buffer

    def __repr__(self) -> str:
        state = "closed" if self._closed else "closing" if self._closing else "open"
        return f"TlsTransport(fd={self._fd}, {state}, backlog={self._backlog.bytes}B, {self._records!r})"

    def _start(self) -> None:
        if not self._closing and not self._read_paused:
            self._add_reader()
            if self._held is not None:  # what came right behind the handshake's last record
                self._loop.call_soon(self._on_readable)

    def _more_inside(self) -> bool:
        """Whether the record layer may hold received bytes of its own (OpenSSL's does)."""
        return False

    # Reading ---------------------------------------------------------------------------
    def _on_readable(self) -> None:
        """One `recv` after what this connection held, then every whole record opened into the
        protocol's buffers, one `buffer_updated` per buffer. Runs once per received message, so
        it is all inline (docs/performance.md, "Buffers and copies")."""
        if self._closing or self._read_paused or self._eof:
            return
        view = self._recv
        held = self._held
        end = 0
        if held is not None:
            end = len(held)
            view[:end] = held
            self._held = None
        if end <= _HELD_BEFORE_RECV_BYTES:
            try:
                n = _recv_into(self._sock, view[end:] if end else view, RECV_BYTES)
            except (BlockingIOError, InterruptedError):
                n = -1
            except OSError as e:
                self._fatal(e)
                return
            if not n:
                # RFC 8446 6.1: a FIN without close_notify is a truncation, as OpenSSL (and
                # uvloop's SSL protocol) report it: an error, not an EOF.
                self._fatal(ConnectionResetError("TLS peer closed without close_notify (TCP reset or FIN)"))
                return
            if n > 0:
                end += n
        if not end and not self._more_inside():
            return
        protocol = self._protocol
        records = self._records
        pos = 0
        while True:
            buf = protocol.get_buffer(-1)
            if type(buf) is not memoryview:  # HboneConnection's already is one
                buf = memoryview(buf)
            if not buf.nbytes:
                del buf
                self._fatal(RuntimeError("get_buffer() returned an empty buffer"))
                return
            try:
                used, filled, status = records.open_into(view[pos:] if pos else view, end - pos, buf, 0)
            except ProtocolError as e:
                del buf
                self._fail(e)
                return
            # Our view must not outlive the open: the protocol reuses its buffer only while
            # nothing else refers to it (hbone._receive_into).
            del buf
            pos += used
            if filled:
                protocol.buffer_updated(filled)
                if self._closed:
                    return
                if self._closing or self._read_paused:
                    if pos < end:
                        self._held = bytes(view[pos:end])
                        if self._reading and self._closing:  # close() started the drain
                            self._loop.call_soon(self._drain_to_eof)
                    return
            if status == _NEED_MORE:
                break
            if status == _CLOSED:
                self._on_eof()
                return
        if records.output:  # a KeyUpdate answer (RFC 8446 4.6.3)
            self._send_sealed(records.take_output())
        if pos < end:
            self._held = bytes(view[pos:end])

    def _on_eof(self) -> None:
        self._eof = True
        self._held = None
        self._remove_reader()
        if not self._protocol.eof_received():
            self.close()

    def resume_reading(self) -> None:
        if self._closing or not self._read_paused:
            return
        self._read_paused = False
        if self._eof:
            return
        self._add_reader()
        if self._held is not None:
            self._loop.call_soon(self._on_readable)  # no readiness event announces these

    # Writing ---------------------------------------------------------------------------
    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing or not data:
            return
        records = self._records
        try:
            # One short message (the per-message path's common case): one record as bytes.
            sealed = records.seal_write(data)
        except ProtocolError as e:
            self._fatal(e)
            return
        self._send_sealed(sealed)

    def writelines(self, list_of_data: Any) -> None:
        """All pieces sealed as one stream into one buffer and sent with one `send`: a DATA
        frame's header shares the first record of its payload, and records are full 2^14 bytes
        up to the last, no header-only records (docs/performance.md, "Buffers and copies")."""
        if self._closing:
            return
        try:
            sealed = self._records.seal_pieces(list_of_data)
        except ProtocolError as e:
            self._fatal(e)
            return
        if sealed:
            self._send_sealed(sealed)

    def _send_sealed(self, sealed: bytes | memoryview) -> None:
        """Send records now if nothing waits, else queue them; the seal buffer is reused by the
        next seal, so what is queued is copied."""
        backlog = self._backlog
        if not backlog.bytes:
            try:
                n = _send(self._sock, sealed)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as e:
                self._fatal(e)
                return
            if n == len(sealed):
                return
            sealed = sealed[n:]
            self._add_writer()
        self._queue(sealed)

    def _queue(self, sealed: bytes | memoryview) -> None:
        """Records the socket did not take, behind what already waits (copied unless bytes: the
        seal buffer is reused by the next seal)."""
        try:
            pause = self._backlog.push(sealed if type(sealed) is bytes else bytes(sealed))
        except BacklogOverflow as e:
            self._fatal(e)
            return
        if pause:
            try:
                self._protocol.pause_writing()
            except Exception:
                log.exception("pause_writing failed")

    def _on_writable(self) -> None:
        backlog = self._backlog
        resume = False
        while backlog.bytes:
            head = backlog.head()
            try:
                n = _send(self._sock, head)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._fatal(e)
                return
            if n < len(head):
                backlog.pieces[0] = memoryview(head)[n:]
                backlog.bytes -= n
                return
            resume = backlog.pop() or resume
        self._remove_writer()
        if self._closing:
            self._shutdown()
            return
        if resume:
            try:
                self._protocol.resume_writing()
            except Exception:
                log.exception("resume_writing failed")

    # Closing ---------------------------------------------------------------------------
    def close(self) -> None:
        """Write what waits, send close_notify, wait (bounded) for the peer's, then close."""
        if self._closing:
            return
        self._closing = True
        self._remove_reader()
        self._close_timer = self._loop.call_later(SHUTDOWN_TIMEOUT_S, self._shutdown_timed_out)
        if not self._backlog.bytes:
            self._shutdown()
        # otherwise _on_writable calls _shutdown once the backlog is out

    def _shutdown(self) -> None:
        if not self._shut:
            self._shut = True
            self._send_sealed(self._records.close_notify())  # RFC 8446 6.1
            if self._closed:
                return
            if self._backlog.bytes:
                return  # _on_writable comes back here once close_notify is out
        self._remove_writer()
        if self._eof:
            self._finish(None)
            return
        # Read until the peer's close_notify (or FIN), so our unread bytes do not turn our last
        # records into a TCP reset; what it still sends is opened and dropped.
        self._loop.add_reader(self._fd, self._drain_to_eof)
        self._reading = True
        if self._held is not None:
            self._drain_to_eof()

    def _drain_to_eof(self) -> None:
        if self._closed:
            return
        records = self._records
        held = self._held
        end = 0 if held is None else len(held)
        view = memoryview(bytearray(end + DRAIN_READ_BYTES))
        if held is not None:
            view[:end] = held
            self._held = None
        try:
            n = _recv_into(self._sock, view[end:], DRAIN_READ_BYTES)
        except (BlockingIOError, InterruptedError):
            n = -1
        except OSError:
            n = 0
        if not n:
            self._finish(None)  # FIN (or a reset) after our close_notify: nothing more to wait for
            return
        end += max(n, 0)
        discard = memoryview(_DISCARD)
        pos = 0
        while True:
            try:
                used, _, status = records.open_into(view[pos:], end - pos, discard, 0)
            except ProtocolError:
                self._loop.add_reader(self._fd, self._drain_raw)
                self._drain_raw()
                return
            pos += used
            if status == _CLOSED:
                self._finish(None)
                return
            if status == _NEED_MORE:
                break
        if pos < end:
            self._held = bytes(view[pos:end])
        # The peer still sends after our close_notify: as in _drain_raw, DRAIN_IDLE_S without any
        # bytes ends the wait (a peer that waits for our FIN itself).
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._idle_timer = self._loop.call_later(DRAIN_IDLE_S, self._finish, None)

    def _fail(self, exc: ProtocolError) -> None:
        """The peer broke the record layer, or ended it with a fatal alert: counted and warned
        about (`record_failure`); our alert (if the core sealed one) goes out first."""
        if isinstance(exc, tls_records.TlsRecordError):
            record_failure(exc.alert, self._peername, str(exc))
        output = self._records.output
        if output and not self._backlog.bytes:
            try:
                _send(self._sock, output)
            except OSError:
                pass
        self._fatal(exc)

    def _finish(self, exc: Exception | None) -> None:
        if self._closed:
            return
        self._held = None
        self._records.wipe()
        super()._finish(exc)


class OpenSslTransport(TlsTransport):
    """A TLS 1.2 stream transport (TLS12_ENABLED): OpenSSL's records over the handshake's memory
    BIOs. What it shares with `TlsTransport` is everything around the records: the one `recv` per
    wake-up, the backlog of sealed bytes, the sends, close and its bounds. The pyOpenSSL
    connection is this transport's alone (`get_extra_info` hands out the peer's facts only)."""

    __slots__ = ("_ssl",)

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        protocol: asyncio.BufferedProtocol,
        peer: PeerTls,
        conn: SSL.Connection,
    ) -> None:
        super().__init__(loop, sock, protocol, peer, _OpenSslRecords(conn))
        self._ssl = conn

    def __repr__(self) -> str:
        state = "closed" if self._closed else "closing" if self._closing else "open"
        return f"OpenSslTransport(fd={self._fd}, {state}, backlog={self._backlog.bytes}B)"

    def _more_inside(self) -> bool:
        return True

    def resume_reading(self) -> None:
        was_paused = self._read_paused
        super().resume_reading()
        if was_paused and not self._read_paused and not self._eof and self._held is None:
            self._loop.call_soon(self._on_readable)  # OpenSSL may hold records a pause left


class _OpenSslRecords:
    """OpenSSL's record layer behind `TlsTransport`'s record-layer interface (`open_into`,
    `seal_write`, `seal_pieces`, `close_notify`, `output`), over memory BIOs."""

    __slots__ = ("_conn", "output", "_failed")

    def __init__(self, conn: SSL.Connection) -> None:
        self._conn = conn
        self.output = b""  # records OpenSSL wrote on its own while reading (alerts)
        self._failed = False

    def __repr__(self) -> str:
        return f"OpenSSL records ({self._conn.get_protocol_version_name()})"

    def _drain(self) -> bytes:
        return drain_output(self._conn)

    def open_into(self, src: memoryview, end: int, dst: memoryview, filled: int) -> tuple[int, int, int]:
        """Everything in `src[:end]` goes into OpenSSL; what it decrypts fills `dst`. OpenSSL
        keeps what does not fit (BUFFER_FULL), so all of `src` is always used."""
        conn = self._conn
        if self._failed:
            raise ProtocolError("TLS record layer already failed: no more records are opened")
        room = len(dst)
        status = tls_records.NEED_MORE
        try:
            if end:
                conn.bio_write(bytes(src[:end]))
            while filled < room:
                n = conn.recv_into(dst[filled:], room - filled)
                if not n:
                    break
                filled += n
            else:
                status = tls_records.BUFFER_FULL
        except SSL.WantReadError:
            pass
        except SSL.ZeroReturnError:
            status = tls_records.CLOSED
        except SSL.Error as e:
            self._failed = True
            self.output = self._drain()
            raise tls_records.TlsRecordError("openssl", f"OpenSSL refused a record: {e}") from None
        out = self._drain()
        if out:
            self.output += out
        return end, filled, status

    def take_output(self) -> bytes:
        out, self.output = self.output, b""
        return out

    def seal_write(self, data: bytes | bytearray | memoryview) -> bytes:
        try:
            self._conn.sendall(bytes(data))
        except SSL.Error as e:
            raise ProtocolError(f"OpenSSL refused to write: {e}") from None
        return self._drain()

    def seal_pieces(self, pieces: Iterable[bytes | bytearray | memoryview]) -> bytes:
        joined = b"".join(bytes(p) for p in pieces if p)
        return self.seal_write(joined) if joined else b""

    def close_notify(self) -> bytes:
        try:
            self._conn.shutdown()
        except SSL.Error:
            pass
        return self.take_output() + self._drain()

    def wipe(self) -> None:
        self._failed = True
