"""Bulk reads of plain sockets (transport/relay.py `_BulkReader`): a relay between two real loopback
TCP connections switches an endpoint to the reused receive buffer once a read fills uvloop's,
carries every byte in order while views of that buffer wait in a slow peer's write buffer, and
goes back to `data_received` for small messages."""

from __future__ import annotations

import asyncio
import hashlib
import socket

from ambient_mesh.host.cpython import ReusableBuffer
from ambient_mesh.transport import relay as relay_module
from ambient_mesh.transport.relay import Relay, TcpEndpoint, wrap_socket

from .tcp_pair import tcp_pair

STEP_TIMEOUT_S = 20.0


async def _relay() -> tuple[Relay, TcpEndpoint, TcpEndpoint, socket.socket, socket.socket]:
    down_sock, client = tcp_pair()
    up_sock, server = tcp_pair()
    down, up = wrap_socket(down_sock), wrap_socket(up_sock)
    relay = Relay(down, up)
    up.attach(relay)
    down.attach(relay)
    return relay, down, up, client, server


def _pattern(n: int) -> bytes:
    return (hashlib.sha256(b"bulk").digest() * (n // 32 + 1))[:n]


async def _receive(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int, slow: bool = False) -> bytes:
    got = bytearray()
    async with asyncio.timeout(STEP_TIMEOUT_S):
        while len(got) < n:
            chunk = await loop.sock_recv(sock, min(64 * 1024 if slow else 1 << 20, n - len(got)))
            assert chunk, "EOF before every byte arrived"
            got += chunk
            if slow:
                await asyncio.sleep(0.001)  # the proxy's writes to us back up meanwhile
    return bytes(got)


async def test_bulk_reads_switch_to_the_reused_buffer_and_carry_every_byte_in_order(monkeypatch):
    buffers: set[int] = set()
    take = ReusableBuffer.take

    def recording(self):
        buf = take(self)
        if self is relay_module._APP_RECEIVE:
            buffers.add(id(buf))
        return buf

    monkeypatch.setattr(ReusableBuffer, "take", recording)
    loop = asyncio.get_running_loop()
    relay, down, up, client, server = await _relay()
    # The upstream's writes are not paused, so the relay keeps reading while whole reads (views
    # of the buffer) wait behind the slow reader: the buffer's reuse rule is what keeps the
    # bytes right.
    assert up.transport is not None
    up.transport.set_write_buffer_limits(high=48 * 1024 * 1024)
    try:
        data = _pattern(32 * 1024 * 1024 + 12345)
        sender = loop.create_task(loop.sock_sendall(client, data))
        got = await _receive(loop, server, len(data), slow=True)
        await sender
        assert got == data
        assert down.transport is not None
        assert isinstance(down.transport.get_protocol(), relay_module._BulkReader)
        # The slow reader's socket backed up: views of the buffer waited in the event loop's
        # write buffer, so later reads went to new buffers, and the bytes still came out right.
        assert len(buffers) > 1, buffers
        # Small messages afterwards: every byte still arrives, and the endpoint goes back to
        # data_received after SMALL_READS_TO_LEAVE_BULK of them.
        for i in range(relay_module.SMALL_READS_TO_LEAVE_BULK + 4):
            message = b"ping %03d" % i
            await loop.sock_sendall(client, message)
            assert await _receive(loop, server, len(message)) == message
        assert down.transport.get_protocol() is down
        # And the other direction, which never read in bulk, never switched.
        assert up.transport is not None and up.transport.get_protocol() is up
        await loop.sock_sendall(server, b"pong")
        assert await _receive(loop, client, 4) == b"pong"
        assert relay.bytes_up == len(data) + 8 * (relay_module.SMALL_READS_TO_LEAVE_BULK + 4)
    finally:
        relay.abort(ConnectionResetError("test over"))
        client.close()
        server.close()


async def test_a_bulk_reader_passes_eof_and_half_close_on():
    loop = asyncio.get_running_loop()
    relay, down, up, client, server = await _relay()
    try:
        data = _pattern(4 * 1024 * 1024)
        await loop.sock_sendall(client, data)
        got = await _receive(loop, server, len(data))
        assert got == data
        assert down.transport is not None
        assert isinstance(down.transport.get_protocol(), relay_module._BulkReader)
        client.shutdown(socket.SHUT_WR)
        async with asyncio.timeout(STEP_TIMEOUT_S):
            assert await loop.sock_recv(server, 10) == b""  # the EOF came through
        await loop.sock_sendall(server, b"still open the other way")
        assert await _receive(loop, client, 24) == b"still open the other way"
        server.shutdown(socket.SHUT_WR)
        async with asyncio.timeout(STEP_TIMEOUT_S):
            assert await relay.done is None
    finally:
        relay.abort(ConnectionResetError("test over"))
        client.close()
        server.close()
