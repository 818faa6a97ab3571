"""A plain TCP transport of our own for the relay's TCP endpoints: the event loop's readiness
callbacks on a connected non-blocking socket, the socket's own recv and send.

Counterpart: uvloop's TCPTransport, which `loop.create_connection(sock=)` made for every plain
socket before (the accepted client on 15001, the app socket of every inbound stream, plain TCP
upstreams). That call cannot finish synchronously: the caller awaits a waiter that uvloop
resolves a turn of the loop later, so every connection needed a task to drive it, and each
socket cost two FIONBIO ioctls, a TCP_NODELAY, a getsockname and a getpeername (read up front
for `get_extra_info`), libuv's handle set-up and an entry in a WeakValueDictionary
(docs/performance.md, "The per-connection path"). Here the transport exists as soon as it
is made: the socket is already non-blocking and configured by whoever made it (the listener's
options are inherited by accepted sockets, `ProxyInputs.connect` sets the rest), and the peer's
address is read only when asked for.

Behaviour is asyncio's transport contract as uvloop implements it: reading starts at once;
`eof_received` returning true keeps the write side open (half-close); writes go to the socket at
once and only what it does not take waits (a bounded `WriteBacklog`), with `pause_writing` past
WRITE_HIGH_WATER_BYTES and `resume_writing` at WRITE_LOW_WATER_BYTES; `write_eof` shuts the write side down once what waits
is sent; `close` does the same and then closes, `abort` closes at once and drops what waits;
`connection_lost` is called once, from the loop, after the socket is closed. A protocol may be
swapped for a BufferedProtocol and back (`set_protocol`: relay.py's bulk reader).
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import socket
from typing import Any

from .write_backlog import BacklogOverflow, WriteBacklog

log = logging.getLogger("ambient_mesh.transport.tcp")

# One read takes at most this much, as uvloop's did (its UV_STREAM_RECV_BUF_SIZE): relay.py's
# TcpEndpoint moves to its bulk reader after a read this long.
READ_BYTES = 256_000
# What waits beyond the socket's own buffer before the protocol is told to stop writing, and
# below which it may start again (asyncio's and uvloop's defaults).
WRITE_HIGH_WATER_BYTES = 64 * 1024
WRITE_LOW_WATER_BYTES = 16 * 1024
# Buffers handed to one sendmsg when several wait (well under any IOV_MAX).
MAX_BUFFERS_PER_SEND = 64

# The process's one buffer for `data_received` reads (the event loop runs one callback at a
# time); each read's bytes are copied out of it into their own object before the protocol gets
# them, as uvloop copied out of its buffer.
_READ_BUFFER = bytearray(READ_BYTES)
_READ_VIEW = memoryview(_READ_BUFFER)

# A peer that went away while we wrote or shut down: an error for the connection, not a bug.
_PEER_GONE = frozenset({errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.ECONNABORTED, errno.ETIMEDOUT})


_LOST = asyncio.BaseProtocol()  # the protocol of a transport whose connection_lost has run


class TcpTransport(asyncio.Transport):
    """An asyncio transport over a connected non-blocking TCP socket (module docstring)."""

    __slots__ = (
        "_loop",
        "_sock",
        "_fd",
        "_protocol",
        "_buffered",
        "_backlog",
        "_reading",
        "_at_eof",
        "_closing",
        "_eof_wanted",
        "_eof_sent",
        "_writer",
        "_peername",
        "_lost",
    )

    def __init__(
        self, loop: asyncio.AbstractEventLoop, sock: socket.socket, protocol: asyncio.BaseProtocol
    ) -> None:
        super().__init__()
        if sock.gettimeout() != 0.0:  # CPython's own record: no syscall when it is non-blocking
            sock.setblocking(False)
        self._loop = loop
        self._sock = sock
        self._fd = sock.fileno()
        self._protocol = protocol
        self._buffered = isinstance(protocol, asyncio.BufferedProtocol)
        self._backlog = WriteBacklog(
            high_water_bytes=WRITE_HIGH_WATER_BYTES, low_water_bytes=WRITE_LOW_WATER_BYTES
        )
        self._reading = False
        self._at_eof = False
        self._closing = False
        self._eof_wanted = False
        self._eof_sent = False
        self._writer = False
        self._peername: Any = None
        self._lost = False
        protocol.connection_made(self)
        if not self._closing:
            self._reading = True
            loop.add_reader(self._fd, self._on_readable)

    def __repr__(self) -> str:
        state = "closing" if self._closing else "reading" if self._reading else "paused"
        return f"TcpTransport(fd={self._fd}, {state}, backlog={self._backlog.bytes}B)"

    # Reading ----------------------------------------------------------------------------
    def _on_readable(self) -> None:
        try:
            if self._buffered:
                protocol: Any = self._protocol
                buf = protocol.get_buffer(-1)
                n = self._sock.recv_into(buf)
                if n:
                    protocol.buffer_updated(n)
                    return
            else:
                n = self._sock.recv_into(_READ_BUFFER)
                if n:
                    self._protocol.data_received(_READ_VIEW[:n].tobytes())  # type: ignore[attr-defined]
                    return
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._fail(e)
            return
        except Exception as e:
            self._crash(e, "reading")
            return
        self._on_eof()

    def _on_eof(self) -> None:
        self._at_eof = True
        self._stop_reading()
        try:
            keep_open = self._protocol.eof_received()  # type: ignore[attr-defined]
        except Exception as e:
            self._crash(e, "at EOF")
            return
        if not keep_open:
            self.close()

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._fd)

    def is_reading(self) -> bool:
        return self._reading

    def pause_reading(self) -> None:
        self._stop_reading()

    def resume_reading(self) -> None:
        if self._reading or self._closing or self._at_eof:
            return
        self._reading = True
        self._loop.add_reader(self._fd, self._on_readable)

    # Writing ----------------------------------------------------------------------------
    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing or self._eof_wanted:
            return  # closed, or shut down for writing: nothing more can go out
        size = len(data)
        if not size:
            return
        backlog = self._backlog
        if not backlog.bytes:
            try:
                n = self._sock.send(data)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as e:
                self._fail(e)
                return
            if n == size:
                return
            if n:
                data = memoryview(data)[n:]
            self._writer = True
            self._loop.add_writer(self._fd, self._on_writable)
        # What waits is the caller's object itself, as uvloop kept it (bytes, or a view of a
        # buffer reused only once no view of it is alive), unless the backlog copies it
        # (WriteBacklog.push: a bytearray, a view that is a small share of its buffer).
        try:
            pause = backlog.push(data)
        except BacklogOverflow as e:
            self._fail(e)
            return
        if pause:
            self._protocol.pause_writing()

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def _on_writable(self) -> None:
        backlog = self._backlog
        pieces = backlog.pieces
        try:
            if len(pieces) == 1:
                n = self._sock.send(pieces[0])
            else:
                n = self._sock.sendmsg(list(itertools.islice(pieces, MAX_BUFFERS_PER_SEND)))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._fail(e)
            return
        if backlog.consume(n):
            self._protocol.resume_writing()
        if backlog.bytes:
            return
        self._writer = False
        self._loop.remove_writer(self._fd)
        if self._closing:
            self._finish(None)
        elif self._eof_wanted:
            self._shutdown_write()

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        if self._closing or self._eof_wanted:
            return
        self._eof_wanted = True
        if not self._backlog.bytes:
            self._shutdown_write()

    def _shutdown_write(self) -> None:
        self._eof_sent = True
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError as e:
            if e.errno not in _PEER_GONE:
                raise

    def get_write_buffer_size(self) -> int:
        return self._backlog.bytes

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._backlog.low_water_bytes, self._backlog.high_water_bytes

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._backlog.set_limits(high, low)

    # Closing ----------------------------------------------------------------------------
    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        """Stop reading; close once what waits to be written is sent."""
        if self._closing:
            return
        self._closing = True
        self._stop_reading()
        if not self._backlog.bytes:
            self._finish(None)

    def abort(self) -> None:
        """Close at once, dropping what waits to be written."""
        self._fail(None)

    def _fail(self, exc: OSError | None) -> None:
        """Closed at once, what waits dropped: the socket failed (reset, unreachable; the error
        goes to the protocol), or `abort` (None)."""
        if self._lost:
            return
        self._closing = True
        self._stop_reading()
        self._backlog.clear()
        self._finish(exc)

    def _crash(self, exc: Exception, doing: str) -> None:
        log.error("TCP transport %r: protocol failed %s", self, doing, exc_info=exc)
        self._fail(OSError(errno.ECONNABORTED, f"protocol failed {doing}: {exc}"))

    def _finish(self, exc: BaseException | None) -> None:
        if self._lost:
            return
        self._lost = True
        if self._writer:
            self._writer = False
            self._loop.remove_writer(self._fd)
        self._sock.close()
        self._loop.call_soon(self._connection_lost, exc)

    def _connection_lost(self, exc: BaseException | None) -> None:
        # The protocol is let go once told (as uvloop does): the endpoint refers to its
        # transport, so a transport that kept it would make a cycle for the collector.
        protocol, self._protocol = self._protocol, _LOST
        protocol.connection_lost(exc)  # type: ignore[arg-type]

    # Introspection ----------------------------------------------------------------------
    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "peername":
            if self._peername is None and not self._lost:
                try:
                    self._peername = self._sock.getpeername()
                except OSError:
                    return default
            return self._peername if self._peername is not None else default
        if name == "sockname":
            try:
                return self._sock.getsockname()
            except OSError:
                return default
        if name == "socket":
            return self._sock
        return default

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol
        self._buffered = isinstance(protocol, asyncio.BufferedProtocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol
