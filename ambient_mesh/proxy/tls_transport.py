"""HBONE's TLS over the socket itself: OpenSSL's handshake on the non-blocking socket, then HBONE's
own TLS 1.3 records (`TlsTransport` over the sans-IO proxy/tls_records.py), or OpenSSL's records
for TLS 1.2 (`OpenSslTransport`), each driven from the event loop's readiness callbacks.

Own records (TLS 1.3, every HBONE context of identity/tls.py): the system OpenSSL 3.0 that `_ssl`
links does AES-GCM without VAES; `cryptography`'s AESGCM (its own OpenSSL) is about twice as fast
per record where the CPU has AVX-512 (bench/README.md, issue 11, "Per message, session 17"); on
one without it both run the same AES-NI code and the two record layers cost the same per GiB
("Issue 11, session 20"). OpenSSL does the handshake with
read-ahead off, so every byte after the peer's last handshake record is still in the socket;
its keylog callback hands over the application traffic secrets (identity/tls_suites.py), and
`take_over` refuses the connection if OpenSSL holds any received byte (SSL_has_pending). Server
contexts send no tickets (num_tickets = 0), so both sequence numbers start at 0. From then on
OpenSSL never reads or writes this socket: one `recv` per wake-up into a process-wide buffer,
records opened straight into the protocol's buffer; a write's records sealed into one buffer and
sent with one `send` (this replaces OpenSSL's write coalescing and read-ahead for TLS 1.3). A
TLS 1.3 context without our keylog callback (none of HBONE's) keeps OpenSSL's records.

TLS 1.2 (TLS12_ENABLED=true, off by default) keeps OpenSSL's records: `OpenSslTransport` below,
with read-ahead and the write coalescer; tests/integration/test_tls_transport.py runs every
transport test on both.

OpenSSL's records (`OpenSslTransport`): OpenSSL reads and writes the non-blocking socket (a socket
BIO), and a thin asyncio transport drives it.

Counterparts: ztunnel's rustls over tokio's TcpStream (tokio-rustls), which also encrypts into and
decrypts out of the buffers it hands the socket; asyncio's sslproto and uvloop's SSLProtocol,
which this replaces for HBONE. Those run OpenSSL over a memory BIO: every received record is
copied into the BIO and out of it again, every sent record into the BIO and out into a new bytes
object before the socket write (OpenSSL zeroes the BIO's buffer as it grows), and each message goes
through the Python-level `ssl.SSLObject.read` / `write` plus a raised SSLWantReadError
(bench/README.md, issue 11: 9-10% of each proxy's CPU in memmove, 2-3% in memset).

Facts this relies on (OpenSSL's SSL_read(3) / SSL_write(3), RFC 8446):
- Without SSL_MODE_ENABLE_PARTIAL_WRITE (CPython never sets it) SSL_write sends the whole buffer
  or reports WANT_WRITE after some of its records; the call must then be repeated with the same
  bytes, and only then is the next buffer written. CPython sets SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER,
  so the repeat may pass another object with the same bytes (`WriteBacklog` keeps the same one).
- SSL_read returns at most one record's plaintext (2^14 bytes, RFC 8446 5.1). With read-ahead
  off (CPython's default) it reads nothing beyond that record from the socket, and what a short
  buffer could not take is counted by SSL_pending; with it on (below) OpenSSL may hold further
  records, counted by SSL_has_pending only. No readiness event announces either.
- TLS 1.3 has no renegotiation, but post-handshake messages (KeyUpdate, RFC 8446 4.6.3) let a read
  want to write and a write want to read: both are waited for, never spun on.
- OpenSSL reports a TCP reset and a TCP FIN without close_notify alike (SSL_ERROR_SSL, unexpected
  EOF): both end the connection with an error; only close_notify is an EOF.
- Closing sends close_notify (RFC 8446 6.1) and then waits, at most SHUTDOWN_TIMEOUT_S, for the
  peer's EOF so that unread bytes in our socket do not turn our last records into a TCP reset.

Read-ahead: with it off, OpenSSL reads each record from the socket in two `recv` calls (its
5-byte header, then the rest), a syscall per message more than uvloop's one read per wake-up
(strace of bench/tls_transport_bench.py's ping-pong: 2.06 reads per message against 1.06).
Python's `ssl` offers neither SSL_set_read_ahead nor SSL_has_pending (which, unlike SSL_pending,
also counts read-ahead bytes not yet decrypted: they would otherwise sit there with no readiness
event to announce them), so both are called through ctypes on the `SSL *` inside the C object,
as identity/tls_suites.py does for the `SSL_CTX *` (both through identity/openssl_native.py). The
pointer is the second field of CPython's PySSLSocket and is used only once `SSL_get_fd` on it returns the socket's descriptor; otherwise
read-ahead stays off and SSL_pending does.

Write coalescing: with the socket BIO, one SSL_write of a 256 KiB chunk is sixteen records and
sixteen `send` calls of 16 KiB each, plus one for the DATA frame's header record (strace of
hbone_bench's client proxy: 72,832 writes per GiB, every one a trip through TCP, netfilter and the
bridge with its own segment). A connection's first write of more than one record puts a
buffering BIO (BIO_f_buffer, WRITE_COALESCE_BYTES) in front of the socket BIO for writes only, the
way OpenSSL buffers its own handshake flights; the records of a write then go out together and
the buffer is flushed after each write. Its bytes are copied once more (into the buffer), which
costs less than the sends it saves (bench/README.md, issue 11, the per-message path for large
messages). Connections that only ever carry small messages never get it (no memory, no flush
call), and one that goes back to small messages gives it back after
SMALL_WRITES_BEFORE_UNCOALESCING of them in a row (the next bulk write puts it back). What the buffer holds is part of what close waits for; a flush the socket refuses is
retried when it is writable, and while it waits new writes join the backlog.

`ctx.wrap_socket` is the public way in; the hot path then calls the SSLSocket's C object
(`_sslobj`) directly: `SSLSocket.recv_into` / `send` are three Python frames per record in front
of the same C calls (CPython's ssl.py), which is the per-message cost this module exists to cut.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import functools
import logging
import os
import socket
import ssl
import threading
from collections.abc import Callable
from typing import Any

from ..errors import ProtocolError
from ..identity import openssl_native
from ..identity.tls_suites import KEYLOG, TrafficSecrets
from . import tls_records
from .write_backlog import BacklogOverflow, WriteBacklog

log = logging.getLogger("ambient_mesh.tls")

# What waits in our backlog (beyond the socket's own buffer) before the protocol is told to stop
# writing, and below which it may start again; asyncio's flow-control contract.
WRITE_HIGH_WATER_BYTES = 256 * 1024
WRITE_LOW_WATER_BYTES = 64 * 1024
# The write-side buffering BIO (module docstring): one 256 KiB chunk's 17 records (16 KiB of
# plaintext each plus TLS 1.3's 22 bytes: header, content type, AES-GCM tag) and its DATA frame
# header's record fit, so a chunk leaves in one send. Allocated per connection, and only on the
# first write of at least COALESCE_FROM_BYTES.
WRITE_COALESCE_BYTES = 288 * 1024
COALESCE_FROM_BYTES = 32 * 1024
# After this many small writes in a row (each under COALESCE_FROM_BYTES) the buffering BIO is
# taken out again: a pooled connection that carried one bulk transfer would otherwise keep its
# WRITE_COALESCE_BYTES for life, and copy every small message through it. The next bulk write
# puts it back.
SMALL_WRITES_BEFORE_UNCOALESCING = 16
# Decrypted bytes handed to the protocol per readiness callback before other callbacks run (the
# socket is polled level-triggered: what is left is read on the next round).
READ_BYTES_PER_WAKE = 1024 * 1024
# RFC 8446 5.1: a record carries at most 2^14 bytes of plaintext. A shorter read means the peer's
# message ended there (as far as it wrote it), so the read loop stops without another read that
# would only fail with WANT_READ.
MAX_RECORD_PLAINTEXT_BYTES = 16 * 1024
# How long close waits for the backlog to drain and for the peer's EOF after close_notify (uvloop's
# default ssl_shutdown_timeout).
SHUTDOWN_TIMEOUT_S = 30.0
# Read and thrown away while closing (after close_notify): one record, or raw bytes, per call.
_DISCARD = bytearray(64 * 1024)
# Dropping raw bytes while closing (see _drain_raw) ends after this long without any.
DRAIN_IDLE_S = 1.0

_WANT_IO = (ssl.SSLWantReadError, ssl.SSLWantWriteError)
# Why a buffer's fill stopped in `_on_readable` (besides an exception object).
_FULL = "full"
_DRAINED = "drained"
_EOF = "eof"
_WANTS_WRITE = "wants-write"


# OpenSSL's SSL_CTRL_SET_READ_AHEAD (ssl.h); BIO_C_SET_BUFF_SIZE, BIO_CTRL_FLUSH and
# BIO_FLAGS_SHOULD_RETRY (bio.h).
_SSL_CTRL_SET_READ_AHEAD = 41
_BIO_C_SET_BUFF_SIZE = 117
_BIO_CTRL_FLUSH = 11
_BIO_FLAGS_SHOULD_RETRY = 8


def read_ahead(tls: ssl.SSLSocket) -> Callable[[], int] | None:
    """Switch read-ahead on for `tls`; what then tells whether OpenSSL holds received bytes
    (SSL_has_pending), or None when the `SSL *` cannot be found (read-ahead stays off)."""
    lib = openssl_native.libssl()
    pointer = openssl_native.ssl_pointer(lib, tls) if lib is not None else None
    if lib is None or pointer is None:
        return None
    lib.ctrl(pointer, _SSL_CTRL_SET_READ_AHEAD, 1, None)
    return functools.partial(lib.has_pending, pointer)


class _Coalescer:
    """The buffering BIO in front of one connection's socket BIO (module docstring)."""

    __slots__ = ("flush", "should_retry", "_lib", "_ssl", "_bio")

    def __init__(self, lib: openssl_native.LibSsl, ssl_pointer: int, bio: int) -> None:
        self._lib, self._ssl, self._bio = lib, ssl_pointer, bio
        self.flush: Callable[[], int] = functools.partial(lib.bio_ctrl, bio, _BIO_CTRL_FLUSH, 0, None)
        self.should_retry: Callable[[], int] = functools.partial(
            lib.bio_test_flags, bio, _BIO_FLAGS_SHOULD_RETRY
        )

    def remove(self) -> None:
        """Put the socket BIO back as the write BIO and free the buffer. Only once a flush sent
        everything and no write is pending in OpenSSL (between writes, as for installing).

        BIO_pop first: it detaches the socket BIO, whose reference the buffer held, and that
        reference becomes the write BIO's; SSL_set0_wbio then frees the old write BIO with
        BIO_free_all, which is the buffer alone. The socket BIO's references are as they were
        before `coalesce_writes`: the read BIO's and the write BIO's."""
        lib, bio = self._lib, self._bio
        lib.set0_wbio(self._ssl, lib.bio_pop(bio))


def coalesce_writes(tls: ssl.SSLSocket, size: int = WRITE_COALESCE_BYTES) -> _Coalescer | None:
    """Put a `size`-byte buffering BIO in front of `tls`'s socket BIO for writes; None (writes
    stay as they are) when the `SSL *` cannot be found or its BIOs are not the one socket BIO
    CPython set up. Only between writes: nothing may be pending in OpenSSL's write path."""
    lib = openssl_native.libssl()
    pointer = openssl_native.ssl_pointer(lib, tls) if lib is not None else None
    if lib is None or pointer is None:
        return None
    sock_bio = lib.get_rbio(pointer)
    if not sock_bio or lib.get_wbio(pointer) != sock_bio:
        return None  # not SSL_set_fd's single BIO (or OpenSSL's handshake buffer is still on)
    bio = lib.bio_new(lib.bio_f_buffer())
    if not bio:
        return None
    output = ctypes.c_int(1)  # BIO_set_write_buffer_size: the output side only
    if lib.bio_ctrl(bio, _BIO_C_SET_BUFF_SIZE, size, ctypes.byref(output)) != 1:
        lib.bio_free(bio)
        return None
    # SSL_set0_wbio drops one reference to the old write BIO (the socket BIO, which stays the read
    # BIO too); the buffer holds it as its next BIO, so it needs a reference of its own.
    lib.bio_up_ref(sock_bio)
    lib.bio_push(bio, sock_bio)
    lib.set0_wbio(pointer, bio)
    return _Coalescer(lib, pointer, bio)


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


async def _handshake(
    loop: asyncio.AbstractEventLoop, tls: ssl.SSLSocket, timeout_s: float, secrets: TrafficSecrets | None
) -> None:
    fd = tls.fileno()
    sslobj = tls._sslobj  # type: ignore[attr-defined]
    keylog = KEYLOG
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                # OpenSSL's keylog callback reports this handshake's secrets to `secrets` while
                # do_handshake runs on this thread (identity/tls_suites.py).
                keylog.current = secrets
                try:
                    sslobj.do_handshake()
                    return
                except ssl.SSLWantReadError:
                    writable = False
                except ssl.SSLWantWriteError:
                    writable = True
                finally:
                    keylog.current = None
                try:
                    await _ready(loop, fd, writable)
                finally:
                    if writable:
                        loop.remove_writer(fd)
                    else:
                        loop.remove_reader(fd)
    except TimeoutError:
        raise TimeoutError(f"TLS handshake did not complete within {timeout_s} s") from None


async def start_tls(
    sock: socket.socket,
    ctx: ssl.SSLContext,
    protocol: asyncio.BufferedProtocol,
    *,
    server_side: bool,
    handshake_timeout_s: float,
) -> TlsTransport | OpenSslTransport:
    """TLS on the connected `sock`, then `protocol.connection_made(transport)`; the transport.

    The socket becomes the transport's (detached from `sock` by `wrap_socket`, closed on any
    failure). No SNI is sent (server_hostname None, as ztunnel); the peer is identified by its
    certificate afterwards (`get_extra_info("ssl_object")`). A TLS 1.3 connection whose traffic
    secrets the context reported (identity/tls.py contexts do) gets HBONE's own records
    (`TlsTransport`); TLS 1.2, or a context without the keylog callback, keeps OpenSSL's
    (`OpenSslTransport`). Raises ssl.SSLError / OSError for a failed handshake, ProtocolError when
    the record layer cannot take over, TimeoutError after `handshake_timeout_s`.
    """
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    try:
        tls = ctx.wrap_socket(sock, server_side=server_side, do_handshake_on_connect=False)
    except BaseException:
        sock.close()
        raise
    lib = openssl_native.libssl()
    pointer = openssl_native.ssl_pointer(lib, tls) if lib is not None else None
    secrets = TrafficSecrets(pointer) if pointer else None
    transport: TlsTransport | OpenSslTransport
    try:
        await _handshake(loop, tls, handshake_timeout_s, secrets)
        records = take_over(tls, secrets, server_side=server_side)
        if records is None:
            transport = OpenSslTransport(loop, tls, protocol)
        else:
            transport = TlsTransport(loop, tls, protocol, records)
    except BaseException:
        tls.close()
        raise
    finally:
        if secrets is not None:
            secrets.wipe()
    protocol.connection_made(transport)
    transport._start()
    return transport


def take_over(
    tls: ssl.SSLSocket | ssl.SSLObject, secrets: TrafficSecrets | None, *, server_side: bool
) -> tls_records.RecordLayer | None:
    """HBONE's record layer for `tls` after its handshake, or None when OpenSSL keeps the records
    (TLS 1.2, or no secrets were reported). Refused (ProtocolError) when OpenSSL holds received
    bytes (SSL_has_pending: they would be lost to us) or the suite is not one we have."""
    if secrets is None or tls.version() != "TLSv1.3" or secrets.client is None or secrets.server is None:
        return None
    lib = openssl_native.libssl()
    if lib is None or lib.has_pending(secrets.ssl_pointer):
        raise ProtocolError(
            "OpenSSL holds received TLS bytes at the end of the handshake; refusing the connection",
            hint="read-ahead must be off until HBONE's record layer takes over (proxy/tls_transport.py)",
        )
    cipher = tls.cipher()
    read, write = (secrets.client, secrets.server) if server_side else (secrets.server, secrets.client)
    return tls_records.RecordLayer(
        cipher[0] if cipher else "", client_side=not server_side, read_secret=read, write_secret=write
    )


class _TlsTransportBase(asyncio.Transport):
    """What both TLS transports share: extra info, reader and writer registration, flow-control
    limits, the close timers and the end."""

    __slots__ = (
        "_loop",
        "_tls",
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
    )

    def __init__(
        self, loop: asyncio.AbstractEventLoop, tls: ssl.SSLSocket, protocol: asyncio.BufferedProtocol
    ) -> None:
        super().__init__()
        self._loop = loop
        self._tls = tls
        self._fd = tls.fileno()
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

    def _on_readable(self) -> None:
        raise NotImplementedError

    def _on_writable(self) -> None:
        raise NotImplementedError

    # Extra info: what the callers and the identity checks read ---------------------------------
    def get_extra_info(self, name: str, default: Any = None) -> Any:
        tls = self._tls
        if name in ("ssl_object", "socket"):
            return tls
        try:
            if name == "peername":
                return tls.getpeername()
            if name == "sockname":
                return tls.getsockname()
        except OSError:
            return default
        if name == "peercert":
            return tls.getpeercert()
        if name == "cipher":
            return tls.cipher()
        if name == "sslcontext":
            return tls.context
        if name == "compression":
            return tls.compression()
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
        log.debug("TLS connection failed: %s", exc)
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
            self._tls.close()
        except OSError as e:
            if e.errno != errno.EBADF:
                raise
        self._loop.call_soon(self._protocol.connection_lost, exc)


class OpenSslTransport(_TlsTransportBase):
    """A TLS stream transport over an SSLSocket whose handshake is done, OpenSSL's records (TLS
    1.2, and TLS 1.3 when the traffic secrets could not be had: see `start_tls`).

    Reads decrypt straight into the BufferedProtocol's buffer; writes encrypt straight into the
    socket; what the socket does not take waits in a bounded `WriteBacklog`. Write EOF is not
    offered (close sends close_notify): HBONE ends streams in HTTP/2, not with half-closes.
    """

    __slots__ = (
        "_ssl",
        "_read_wants_write",
        "_write_wants_read",
        "_has_pending",
        "_coalescer",
        "_coalesce",
        "_small_writes",
        "_unflushed",
        "_batching",
    )

    def __init__(
        self, loop: asyncio.AbstractEventLoop, tls: ssl.SSLSocket, protocol: asyncio.BufferedProtocol
    ):
        super().__init__(loop, tls, protocol)
        self._ssl = tls._sslobj  # type: ignore[attr-defined]
        self._read_wants_write = False  # OpenSSL's read needs the socket writable first
        self._write_wants_read = False  # OpenSSL's write needs a read first
        # Whether OpenSSL holds received bytes no readiness event will announce: SSL_has_pending
        # with read-ahead on, SSL_pending (the rest of a record a short buffer did not take)
        # without it.
        self._has_pending: Callable[[], int] = read_ahead(tls) or self._ssl.pending
        self._coalescer: _Coalescer | None = None  # installed on the first bulk write
        self._coalesce = True  # whether to try (False when coalesce_writes found no way in)
        self._small_writes = 0  # small writes in a row while the coalescer is in
        self._unflushed = False  # the coalescing buffer holds bytes the socket refused
        self._batching = False  # in writelines: one flush after all its pieces

    def __repr__(self) -> str:
        state = "closed" if self._closed else "closing" if self._closing else "open"
        return f"OpenSslTransport(fd={self._fd}, {state}, backlog={self._backlog.bytes}B)"

    def _start(self) -> None:
        if not self._closing and not self._read_paused:
            self._add_reader()
            if self._has_pending():  # bytes that came with the handshake's last flight
                self._loop.call_soon(self._on_readable)

    # Reading ---------------------------------------------------------------------------

    def _on_readable(self) -> None:
        """Decrypt the records that wait into the protocol's buffers, one `buffer_updated` per
        buffer (several records each: the protocol above runs once per buffer, not per record).
        A buffer is filled until it has no room for another whole record (_FULL), the socket has
        no more (WANT_READ) or a short record ended a message (_DRAINED), the peer's close_notify
        (_EOF), _WANTS_WRITE, or an error. The fill loop is inlined here, not a method of its
        own: this runs once per received message (bench/README.md, issue 11, per message)."""
        if self._closing or self._read_paused or self._eof:
            return
        protocol = self._protocol
        read = self._ssl.read
        has_pending = self._has_pending
        budget = READ_BYTES_PER_WAKE
        while True:
            buf = protocol.get_buffer(-1)
            if type(buf) is not memoryview:  # HboneConnection's already is one
                buf = memoryview(buf)
            size = buf.nbytes
            filled = 0
            end: object
            if not size:
                end = RuntimeError("get_buffer() returned an empty buffer")
            else:
                try:
                    while True:
                        n = read(size - filled, buf[filled:] if filled else buf)
                        if not n:
                            end = _EOF
                            break
                        filled += n
                        if size - filled < MAX_RECORD_PLAINTEXT_BYTES:
                            end = _FULL
                            break
                        if n < MAX_RECORD_PLAINTEXT_BYTES and not has_pending():
                            # A short record that fit whole (there was room for the longest one),
                            # and nothing read ahead: the message ended here; polling brings more.
                            end = _DRAINED
                            break
                except ssl.SSLWantReadError:
                    end = _DRAINED
                except ssl.SSLWantWriteError:
                    end = _WANTS_WRITE
                except ssl.SSLError as e:
                    # OpenSSL reports a TCP reset and a FIN without close_notify alike (RFC 8446
                    # 6.1: a truncation): an error, as uvloop's SSL protocol never called it an EOF.
                    # CPython 3.11.7 raises SSLEOFError for it, 3.11.2 an SSLError of that reason.
                    end = (
                        ConnectionResetError("TLS peer closed without close_notify (TCP reset or FIN)")
                        if isinstance(e, ssl.SSLEOFError) or e.reason == "UNEXPECTED_EOF_WHILE_READING"
                        else e
                    )
                except OSError as e:
                    end = e
            # Our view must not outlive the reads: the protocol reuses its buffer only while
            # nothing else refers to it (hbone._receive_into).
            del buf
            if filled:
                protocol.buffer_updated(filled)
                if self._closing or self._read_paused:
                    return
            if end is not _FULL:
                break
            budget -= filled
            if budget <= 0:
                if has_pending():
                    self._loop.call_soon(self._on_readable)  # no readiness event announces these
                return  # what waits in the socket: level-triggered polling calls us again
        if end is _EOF:
            self._on_eof()
            return
        if end is _WANTS_WRITE:
            # A post-handshake message needs an answer the socket cannot take yet: stop reading
            # (readable would spin) until it is writable.
            self._read_wants_write = True
            self._remove_reader()
            self._add_writer()
            return
        if isinstance(end, Exception):
            self._fatal(end)
            return
        if self._write_wants_read:
            self._write_wants_read = False
            self._flush()

    def _on_eof(self) -> None:
        self._eof = True
        self._remove_reader()
        if not self._protocol.eof_received():
            self.close()

    def resume_reading(self) -> None:
        if self._closing or not self._read_paused:
            return
        self._read_paused = False
        if self._eof:
            return
        if not self._read_wants_write:
            self._add_reader()
        if self._has_pending():
            self._loop.call_soon(self._on_readable)

    # Writing ---------------------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing or not data:
            return
        backlog = self._backlog
        if not backlog.bytes and not self._unflushed:
            coalescer = self._coalescer
            if coalescer is None and self._coalesce and len(data) >= COALESCE_FROM_BYTES:
                coalescer = self._start_coalescing()
            try:
                self._ssl.write(data)
            except ssl.SSLWantWriteError:
                self._add_writer()
            except ssl.SSLWantReadError:
                self._write_wants_read = True
            except OSError as e:
                self._fatal(e)
                return
            else:
                if coalescer is not None:
                    if len(data) >= COALESCE_FROM_BYTES:
                        self._small_writes = 0
                    else:
                        self._small_writes += 1
                    if not self._batching:
                        if coalescer.flush() <= 0:
                            self._flush_refused(coalescer)
                        elif self._small_writes >= SMALL_WRITES_BEFORE_UNCOALESCING:
                            self._stop_coalescing(coalescer)
                return
        if not isinstance(data, bytes) and not (isinstance(data, memoryview) and data.readonly):
            data = bytes(data)  # the caller may change it before it goes out
        try:
            pause = backlog.push(data)
        except BacklogOverflow as e:
            self._fatal(e)
            return
        if pause:
            try:
                self._protocol.pause_writing()
            except Exception:
                log.exception("pause_writing failed")

    def writelines(self, list_of_data: Any) -> None:
        """Each piece as `write` does it, with one flush of the coalescing buffer at the end: a
        DATA frame's header and its payload (hbone.py writes them as two pieces) in one send.

        A piece shorter than a record is joined with the start of the next piece, up to a
        record's worth (MAX_RECORD_PLAINTEXT_BYTES), and the rest of that piece is written as it
        is: a frame header is not a TLS record of its own. Before, every DATA frame's 9-byte
        header was one: a record more per frame to encrypt here and to decrypt and hand over at
        the peer (bench/README.md, issue 11, the per-message path)."""
        self._batching = True
        try:
            short: bytes | None = None
            for data in list_of_data:
                if not data:
                    continue
                if short is not None:
                    room = MAX_RECORD_PLAINTEXT_BYTES - len(short)
                    if len(data) > room:
                        view = data if type(data) is memoryview else memoryview(data)
                        self.write(b"".join((short, view[:room])))
                        data = view[room:]
                    else:
                        data = b"".join((short, data))
                    short = None
                if len(data) < MAX_RECORD_PLAINTEXT_BYTES:
                    short = bytes(data) if type(data) is not bytes else data
                    continue
                self.write(data)
            if short is not None:
                self.write(short)
        finally:
            self._batching = False
        coalescer = self._coalescer
        if coalescer is not None and not self._closed and not self._backlog.bytes and not self._unflushed:
            if coalescer.flush() <= 0:
                self._flush_refused(coalescer)

    def _on_writable(self) -> None:
        if self._read_wants_write:
            self._read_wants_write = False
            if not self._backlog.bytes:
                self._remove_writer()
            if not self._read_paused and not self._closing:
                self._add_reader()
                self._on_readable()
            if self._closed:
                return
        self._flush()

    def _flush(self) -> None:
        """Write the backlog, oldest first, the head as it was; then the coalescing buffer."""
        backlog = self._backlog
        coalescer = self._coalescer
        if self._unflushed and coalescer is not None and not self._flush_coalescer(coalescer):
            return  # the socket is still full (or failed): nothing after those bytes may go
        write = self._ssl.write
        resume = False
        while backlog.bytes:
            try:
                write(backlog.head())
            except ssl.SSLWantWriteError:
                self._add_writer()
                break
            except ssl.SSLWantReadError:
                self._write_wants_read = True
                self._remove_writer()
                break
            except OSError as e:
                self._fatal(e)
                return
            resume = backlog.pop() or resume
        else:
            if coalescer is None or self._flush_coalescer(coalescer):
                if not self._read_wants_write:
                    self._remove_writer()
                if self._closing:
                    self._shutdown()
                    return
            elif self._closed:
                return
        if resume and not self._closing:
            try:
                self._protocol.resume_writing()
            except Exception:
                log.exception("resume_writing failed")

    # Write coalescing (module docstring) -------------------------------------------------
    def _start_coalescing(self) -> _Coalescer | None:
        self._coalescer = coalesce_writes(self._tls)
        self._coalesce = self._coalescer is not None  # no way in: not tried again
        self._small_writes = 0
        return self._coalescer

    def _stop_coalescing(self, coalescer: _Coalescer) -> None:
        """The buffer was just flushed whole: take it out (SMALL_WRITES_BEFORE_UNCOALESCING)."""
        coalescer.remove()
        self._coalescer = None

    def _flush_coalescer(self, coalescer: _Coalescer) -> bool:
        """Send what the buffer holds; False when the socket refused it (see _flush_refused)."""
        if coalescer.flush() > 0:
            self._unflushed = False
            return True
        self._flush_refused(coalescer)
        return False

    def _flush_refused(self, coalescer: _Coalescer) -> None:
        if coalescer.should_retry():
            # The socket is full: what the buffer holds goes first once it is writable, and
            # writes meanwhile join the backlog (their order is the stream's).
            self._unflushed = True
            self._add_writer()
            return
        code = self._tls.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) or errno.EPIPE
        self._fatal(OSError(code, f"TLS socket write failed: {os.strerror(code)}"))

    def _flush_close(self) -> None:
        """close_notify waited in the coalescing buffer for a writable socket (see _shutdown)."""
        coalescer = self._coalescer
        if coalescer is not None and coalescer.flush() <= 0 and coalescer.should_retry():
            return  # still full; SHUTDOWN_TIMEOUT_S bounds the wait
        self._remove_writer()
        if self._eof:
            self._finish(None)

    # Closing ---------------------------------------------------------------------------

    def close(self) -> None:
        """Write what waits, send close_notify, wait (bounded) for the peer's EOF, then close."""
        if self._closing:
            return
        self._closing = True
        self._remove_reader()
        self._close_timer = self._loop.call_later(SHUTDOWN_TIMEOUT_S, self._shutdown_timed_out)
        if not self._backlog.bytes and not self._unflushed:
            self._shutdown()
        # otherwise _flush calls _shutdown once the backlog and the coalescing buffer are out

    def _shutdown(self) -> None:
        dead = False
        try:
            self._ssl.shutdown()  # close_notify; raises WANT_READ while the peer's is still due
        except _WANT_IO:
            pass
        except (OSError, ValueError):
            # CPython's shutdown() calls SSL_shutdown a second time, and that one reads: the
            # peer's application data still arriving fails it (APPLICATION_DATA_AFTER_CLOSE_NOTIFY)
            # and every later SSL_read with it (SSLEOFError); the peer gone fails it too.
            dead = True
        self._remove_writer()
        coalescer = self._coalescer
        if coalescer is not None and coalescer.flush() <= 0 and coalescer.should_retry():
            # OpenSSL flushes after its alert, but the socket was full: close_notify waits in
            # the coalescing buffer until it is writable.
            self._loop.add_writer(self._fd, self._flush_close)
            self._writer_on = True
        if self._eof:
            if not self._writer_on:
                self._finish(None)
            return
        # Read (and drop) until the peer's EOF, so our unread bytes do not reset the connection.
        self._loop.add_reader(self._fd, self._drain_raw if dead else self._drain_to_eof)
        self._reading = True
        if dead:
            self._drain_raw()

    def _drain_to_eof(self) -> None:
        budget = READ_BYTES_PER_WAKE  # a peer that keeps sending cannot hold the loop here
        while budget > 0:
            try:
                n = self._ssl.read(len(_DISCARD), _DISCARD)
            except _WANT_IO:
                return
            except (OSError, ValueError):
                # A real truncation, or OpenSSL failed on data after our close_notify (above):
                # the socket's raw bytes from here on; its FIN (or silence) ends the wait.
                self._loop.add_reader(self._fd, self._drain_raw)
                self._drain_raw()
                return
            if not n:
                break  # the peer's close_notify
            budget -= n
        else:
            if self._has_pending():
                self._loop.call_soon(self._drain_to_eof)  # no readiness event announces these
            return
        self._finish(None)


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
_recv_into = socket.socket.recv_into  # the C methods: an SSLSocket's own would go through OpenSSL
_send = socket.socket.send


class TlsTransport(_TlsTransportBase):
    """A TLS 1.3 stream transport whose records are HBONE's own (proxy/tls_records.py) after
    OpenSSL's handshake (see `start_tls`).

    Reads: one `recv` per wake-up into a process-wide buffer, records opened straight into the
    BufferedProtocol's buffer. Writes: one write's records sealed into one buffer and sent with one
    `send`; what the socket does not take waits, sealed, in a bounded `WriteBacklog`. Write EOF is
    not offered (close sends close_notify): HBONE ends streams in HTTP/2, not with half-closes.
    """

    __slots__ = ("_records", "_held", "_shut", "_recv")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        tls: ssl.SSLSocket,
        protocol: asyncio.BufferedProtocol,
        records: tls_records.RecordLayer,
    ) -> None:
        super().__init__(loop, tls, protocol)
        self._records = records
        self._held: bytes | None = None  # received bytes not yet opened (see _on_readable)
        self._shut = False  # our close_notify is sealed
        self._recv = _recv_view()  # this thread's receive buffer

    def __repr__(self) -> str:
        state = "closed" if self._closed else "closing" if self._closing else "open"
        return f"TlsTransport(fd={self._fd}, {state}, backlog={self._backlog.bytes}B, {self._records!r})"

    def _start(self) -> None:
        if not self._closing and not self._read_paused:
            self._add_reader()

    # Reading ---------------------------------------------------------------------------
    def _on_readable(self) -> None:
        """One `recv` after what this connection held, then every whole record opened into the
        protocol's buffers, one `buffer_updated` per buffer. Runs once per received message, so
        it is all inline (bench/README.md, issue 11, per message)."""
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
                n = _recv_into(self._tls, view[end:] if end else view, RECV_BYTES)
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
        if not end:
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
        # _send_sealed, inlined: this runs once per message sent.
        if not self._backlog.bytes:
            try:
                n = _send(self._tls, sealed)
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

    def writelines(self, list_of_data: Any) -> None:
        """All pieces sealed as one stream into one buffer and sent with one `send`: a DATA
        frame's header shares the first record of its payload, and records are full 2^14 bytes
        up to the last (bench/README.md, issue 11: no header-only records)."""
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
                n = _send(self._tls, sealed)
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
                n = _send(self._tls, head)
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
            n = _recv_into(self._tls, view[end:], DRAIN_READ_BYTES)
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
        """The peer broke the record layer: our alert (if the core sealed one) goes out first."""
        output = self._records.output
        if output and not self._backlog.bytes:
            try:
                _send(self._tls, output)
            except OSError:
                pass
        self._fatal(exc)

    def _finish(self, exc: Exception | None) -> None:
        if self._closed:
            return
        self._held = None
        self._records.wipe()
        super()._finish(exc)
