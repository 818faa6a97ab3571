"""The relay's own plain TCP transport (transport/tcp.py) on real loopback connections:
asyncio's transport contract as the relay uses it (reading at once, half-close, flow control,
close and abort, errors, a swapped BufferedProtocol), and that the protocol is let go once its
connection_lost has run."""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import struct
import weakref

import pytest

from ambient_mesh.transport.tcp import (
    WRITE_HIGH_WATER_BYTES,
    WRITE_LOW_WATER_BYTES,
    TcpTransport,
)
from ambient_mesh.transport.write_backlog import HELD_VIEW_MIN_SHARE, BacklogOverflow

from .tcp_pair import tcp_pair

STEP_TIMEOUT_S = 10.0


class Recorder(asyncio.Protocol):
    """Records every callback; `keep_open` is what eof_received answers."""

    def __init__(self, keep_open: bool = True) -> None:
        self.keep_open = keep_open
        self.transport: asyncio.Transport | None = None
        self.events: list[str] = []
        self.data = bytearray()
        self.types: set[type] = set()
        self.lost: list[BaseException | None] = []
        self.made_in_constructor = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.events.append("made")

    def data_received(self, data: bytes) -> None:
        self.types.add(type(data))
        self.data += data

    def eof_received(self) -> bool:
        self.events.append("eof")
        return self.keep_open

    def pause_writing(self) -> None:
        self.events.append("pause")

    def resume_writing(self) -> None:
        self.events.append("resume")

    def connection_lost(self, exc: Exception | None) -> None:
        self.events.append("lost")
        self.lost.append(exc)


async def until(predicate, what: str) -> None:
    try:
        async with asyncio.timeout(STEP_TIMEOUT_S):
            while not predicate():
                await asyncio.sleep(0.001)
    except TimeoutError:
        raise AssertionError(f"no {what} within {STEP_TIMEOUT_S} s") from None


async def receive_all(peer: socket.socket) -> bytes:
    """What the peer reads until EOF."""
    loop = asyncio.get_running_loop()
    got = bytearray()
    async with asyncio.timeout(STEP_TIMEOUT_S):
        while chunk := await loop.sock_recv(peer, 1 << 20):
            got += chunk
    return bytes(got)


def make(sock: socket.socket, protocol: asyncio.BaseProtocol) -> TcpTransport:
    return TcpTransport(asyncio.get_running_loop(), sock, protocol)


async def test_reads_at_once_and_half_closes_both_ways():
    sock, peer = tcp_pair()  # the proxy's side blocking, as accepted: the transport makes it not
    protocol = Recorder()
    transport = make(sock, protocol)
    assert protocol.events == ["made"] and protocol.transport is transport  # no turn of the loop
    assert sock.gettimeout() == 0.0
    peer.send(b"hello")
    await until(lambda: protocol.data == b"hello", "data")
    assert protocol.types == {bytes}
    peer.shutdown(socket.SHUT_WR)
    await until(lambda: "eof" in protocol.events, "eof")
    assert not transport.is_closing() and not transport.is_reading()
    transport.resume_reading()  # after EOF: nothing more to read, and no second eof_received
    transport.write(b"after their eof")
    transport.write_eof()
    assert await receive_all(peer) == b"after their eof"
    transport.close()
    await until(lambda: protocol.lost, "connection_lost")
    assert protocol.events == ["made", "eof", "lost"] and protocol.lost == [None]
    assert sock.fileno() == -1
    peer.close()


async def test_eof_received_false_closes():
    sock, peer = tcp_pair()
    protocol = Recorder(keep_open=False)
    transport = make(sock, protocol)
    peer.shutdown(socket.SHUT_WR)
    await until(lambda: protocol.lost, "connection_lost")
    assert transport.is_closing() and protocol.events == ["made", "eof", "lost"]
    assert await receive_all(peer) == b""
    peer.close()


async def test_flow_control_pauses_and_resumes_and_keeps_the_order():
    sock, peer = tcp_pair()
    protocol = Recorder()
    transport = make(sock, protocol)
    sent = bytearray()
    # Write until the socket's buffers are full and our backlog passes the high water mark:
    # bytes, and read-only views (the relay's bulk reads), each chunk its own pattern.
    async with asyncio.timeout(STEP_TIMEOUT_S):
        while "pause" not in protocol.events:
            chunk = bytes([len(sent) // 65536 % 251]) * 65536
            transport.write(memoryview(chunk).toreadonly() if len(sent) % 2 else chunk)
            sent += chunk
            await asyncio.sleep(0)
    assert transport.get_write_buffer_size() > WRITE_HIGH_WATER_BYTES
    transport.write(b"end")
    sent += b"end"
    transport.write_eof()  # after the backlog
    assert not transport.is_closing()
    assert await receive_all(peer) == bytes(sent)
    assert protocol.events.count("pause") == 1 and protocol.events.count("resume") == 1
    assert transport.get_write_buffer_size() == 0
    transport.close()
    await until(lambda: protocol.lost, "connection_lost")
    assert protocol.lost == [None]
    peer.close()


async def test_a_writer_that_ignores_pause_writing_is_cut_off_at_the_backlog_bound():
    sock, peer = tcp_pair()  # the peer never reads
    protocol = Recorder()
    transport = make(sock, protocol)
    transport._backlog.max_bytes = 1024 * 1024  # the bound under test, made small
    chunk = b"z" * (64 * 1024)
    for _ in range(10_000):
        transport.write(chunk)
        if transport.is_closing():
            break
    await until(lambda: protocol.lost, "connection_lost")
    assert isinstance(protocol.lost[0], BacklogOverflow)
    assert "1048576 bytes" in str(protocol.lost[0])
    assert protocol.events.count("pause") == 1 and transport.get_write_buffer_size() == 0
    peer.close()


async def test_bytes_and_copied_bytearrays_arrive_intact_behind_a_backlog():
    sock, peer = tcp_pair()
    protocol = Recorder()
    transport = make(sock, protocol)
    transport.set_write_buffer_limits(high=1 << 30)  # no pause: only the backlog's contents count
    expected = bytearray()
    scratch = bytearray(100_000)
    for i in range(60):
        if i % 2:
            part = bytes([i]) * 100_000
        else:
            scratch[:] = bytes([i]) * 100_000
            part = scratch  # changed again by the next round: the transport must have copied it
        transport.write(part)
        expected += bytes([i]) * 100_000
    assert transport.get_write_buffer_size() > 0
    transport.close()  # after the backlog
    assert transport.is_closing()
    transport.write(b"too late")  # closed: dropped
    assert await receive_all(peer) == bytes(expected)
    await until(lambda: protocol.lost, "connection_lost")
    assert protocol.lost == [None]
    peer.close()


async def test_a_waiting_view_is_kept_only_when_it_is_a_large_share_of_its_buffer():
    """A view of a 1 MiB receive buffer that must wait is held as it is when it is at least
    1 / HELD_VIEW_MIN_SHARE of the buffer; a shorter one is copied, so the buffer is not pinned
    for a few bytes (relay.py's and hbone/connection.py's buffers are reused once no view is alive)."""
    sock, peer = tcp_pair()  # the peer does not read until the end: everything waits
    protocol = Recorder()
    transport = make(sock, protocol)
    transport.set_write_buffer_limits(high=1 << 30)
    buffer = bytearray(b"b" * (1 << 20))
    filler = bytearray()
    for _ in range(256):  # until the socket's buffers are full, so the views below wait
        transport.write(b"f" * (1 << 20))
        filler += b"f" * (1 << 20)
        if transport.get_write_buffer_size():
            break
    assert transport.get_write_buffer_size(), "the socket took 256 MiB without the peer reading"
    share = len(buffer) // HELD_VIEW_MIN_SHARE
    small = memoryview(buffer)[: share - 1].toreadonly()
    large = memoryview(buffer)[:share].toreadonly()
    transport.write(small)
    transport.write(large)
    pieces = list(transport._backlog.pieces)
    assert type(pieces[-2]) is bytes and bytes(pieces[-2]) == bytes(small)  # copied
    assert pieces[-1] is large  # held as it is
    del small, large, pieces
    transport.close()
    assert await receive_all(peer) == filler + b"b" * (2 * share - 1)
    await until(lambda: protocol.lost, "connection_lost")
    assert protocol.lost == [None]
    peer.close()


async def test_abort_drops_the_backlog_and_closes_at_once():
    sock, peer = tcp_pair()
    protocol = Recorder()
    transport = make(sock, protocol)
    transport.set_write_buffer_limits(high=1 << 30)
    transport.write(b"x" * (16 << 20))
    assert transport.get_write_buffer_size() > 0
    transport.abort()
    assert transport.get_write_buffer_size() == 0 and sock.fileno() == -1
    transport.abort()  # once only
    await until(lambda: protocol.lost, "connection_lost")
    await asyncio.sleep(0.01)
    assert protocol.lost == [None] and protocol.events.count("lost") == 1
    peer.close()


async def test_a_reset_by_the_peer_is_the_error_of_connection_lost():
    sock, peer = tcp_pair()
    protocol = Recorder()
    transport = make(sock, protocol)
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    peer.close()  # RST
    await until(lambda: protocol.lost, "connection_lost")
    assert isinstance(protocol.lost[0], ConnectionResetError)
    assert transport.is_closing()
    assert transport.get_extra_info("peername") is None  # closed: nobody to name


async def test_the_peer_address_is_read_when_asked_and_none_after_a_reset():
    sock, peer = tcp_pair()
    transport = make(sock, Recorder())
    transport.pause_reading()  # so the reset below is not read before we ask
    assert transport.get_extra_info("peername") == peer.getsockname()
    assert transport.get_extra_info("sockname") == sock.getsockname()
    assert transport.get_extra_info("socket") is sock
    assert transport.get_extra_info("nothing", "default") == "default"
    transport.abort()
    peer.close()

    sock, peer = tcp_pair()
    transport = make(sock, Recorder())
    transport.pause_reading()
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    peer.close()  # reset before anyone asked who it was
    await asyncio.sleep(0.01)
    assert transport.get_extra_info("peername") is None
    transport.abort()


async def test_paused_reading_reads_nothing_until_resumed():
    sock, peer = tcp_pair()
    protocol = Recorder()
    transport = make(sock, protocol)
    transport.pause_reading()
    assert not transport.is_reading()
    peer.send(b"waiting")
    await asyncio.sleep(0.05)
    assert protocol.data == b""
    transport.resume_reading()
    await until(lambda: protocol.data == b"waiting", "data")
    transport.close()
    peer.close()


class Buffered(asyncio.BufferedProtocol):
    def __init__(self, back: asyncio.Protocol) -> None:
        self.buf = bytearray(7)
        self.got = bytearray()
        self.back = back

    def get_buffer(self, sizehint: int) -> bytearray:
        return self.buf

    def buffer_updated(self, nbytes: int) -> None:
        self.got += self.buf[:nbytes]

    def eof_received(self) -> bool:
        return self.back.eof_received()  # type: ignore[return-value]

    def connection_lost(self, exc: Exception | None) -> None:
        self.back.connection_lost(exc)


async def test_a_buffered_protocol_swapped_in_reads_into_its_buffer_and_back():
    sock, peer = tcp_pair()
    protocol = Recorder()
    transport = make(sock, protocol)
    buffered = Buffered(protocol)
    transport.set_protocol(buffered)
    assert transport.get_protocol() is buffered
    peer.send(b"into the given buffer")
    await until(lambda: buffered.got == b"into the given buffer", "buffered data")
    transport.set_protocol(protocol)
    peer.send(b"plain again")
    await until(lambda: protocol.data == b"plain again", "data")
    peer.shutdown(socket.SHUT_WR)
    await until(lambda: "eof" in protocol.events, "eof")
    transport.close()
    await until(lambda: protocol.lost, "connection_lost")
    peer.close()


class Failing(Recorder):
    def data_received(self, data: bytes) -> None:
        raise RuntimeError("broken protocol")


async def test_a_protocol_that_raises_is_logged_and_its_connection_closed(caplog):
    sock, peer = tcp_pair()
    protocol = Failing()
    transport = make(sock, protocol)
    with caplog.at_level(logging.ERROR, logger="ambient_mesh.transport.tcp"):
        peer.send(b"x")
        await until(lambda: protocol.lost, "connection_lost")
    assert transport.is_closing() and isinstance(protocol.lost[0], OSError)
    assert "broken protocol" in caplog.text
    peer.close()


async def test_the_protocol_is_let_go_after_connection_lost():
    gc.collect()
    gc.disable()
    try:
        sock, peer = tcp_pair()
        protocol = Recorder()
        transport = make(sock, protocol)
        protocol_ref, lost = weakref.ref(protocol), protocol.lost
        transport.close()
        await until(lambda: lost, "connection_lost")
        del protocol
        # The protocol refers to the transport; the transport no longer refers back.
        assert protocol_ref() is None
        assert transport.get_protocol() is not None
    finally:
        gc.enable()
    peer.close()


@pytest.mark.parametrize(("high", "low"), [(10, 20), (-1, None)])
def test_write_buffer_limits_are_checked(high, low):
    sock, peer = tcp_pair()
    loop = asyncio.new_event_loop()
    try:
        transport = TcpTransport(loop, sock, Recorder())
        assert transport.get_write_buffer_limits() == (WRITE_LOW_WATER_BYTES, WRITE_HIGH_WATER_BYTES)
        with pytest.raises(ValueError):
            transport.set_write_buffer_limits(high=high, low=low)
        transport.abort()
    finally:
        loop.close()
        peer.close()
