"""Bytes a plain socket's peer sends before the relay is attached (transport/relay.py `wrap_socket`,
`TcpEndpoint`): the endpoint reads while it waits (it is not paused up front), holds what it
reads and an EOF, pauses once MAX_HELD_BEFORE_RELAY_BYTES are held (one read more at most,
against a client that sends much before its upstream is reached), and `attach` replays
everything in order."""

from __future__ import annotations

import asyncio
import socket

from ambient_mesh.transport.relay import (
    MAX_EARLY_DATA_BYTES,
    MAX_HELD_BEFORE_RELAY_BYTES,
    UVLOOP_READ_BYTES,
    Relay,
    read_waiting,
    wrap_socket,
)

from .tcp_pair import tcp_pair

STEP_TIMEOUT_S = 10.0


async def _until(condition, what: str) -> None:
    try:
        async with asyncio.timeout(STEP_TIMEOUT_S):
            while not condition():
                await asyncio.sleep(0.001)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def _receive_until_eof(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytes:
    got = bytearray()
    async with asyncio.timeout(STEP_TIMEOUT_S):
        while chunk := await loop.sock_recv(sock, 65536):
            got += chunk
    return bytes(got)


async def test_a_silent_peer_leaves_the_endpoint_reading_until_attach():
    down_sock, client = tcp_pair()
    down = wrap_socket(down_sock)
    try:
        await asyncio.sleep(0.01)
        assert down.transport is not None and down.transport.is_reading()
    finally:
        down.abort()
        client.close()


async def test_a_short_first_message_and_eof_are_held_without_pausing_and_replayed_in_order():
    loop = asyncio.get_running_loop()
    down_sock, client = tcp_pair()
    up_sock, server = tcp_pair()
    down, up = wrap_socket(down_sock), wrap_socket(up_sock)
    try:
        client.send(b"first ")
        assert down.transport is not None
        await _until(lambda: down._held, "the first bytes to be held")
        assert down.transport.is_reading()  # far below MAX_HELD_BEFORE_RELAY_BYTES: not paused
        client.send(b"second")
        client.shutdown(socket.SHUT_WR)
        await _until(lambda: down._held_eof, "the EOF to be held")  # (reading ends at an EOF)
        relay = Relay(down, up)
        up.attach(relay)
        down.attach(relay)
        assert await _receive_until_eof(loop, server) == b"first second"
        server.send(b"reply")
        server.shutdown(socket.SHUT_WR)
        assert await _receive_until_eof(loop, client) == b"reply"
        async with asyncio.timeout(STEP_TIMEOUT_S):
            assert await relay.done is None
        assert (relay.bytes_up, relay.bytes_down) == (12, 5)
    finally:
        down.abort()
        up.abort()
        client.close()
        server.close()


async def test_a_client_sending_much_before_attach_is_paused_within_the_bound():
    loop = asyncio.get_running_loop()
    down_sock, client = tcp_pair()
    up_sock, server = tcp_pair()
    down, up = wrap_socket(down_sock), wrap_socket(up_sock)
    sent = bytes(range(256)) * (4 * 1024)  # 1 MiB, far more than the bound
    try:
        sender = asyncio.ensure_future(loop.sock_sendall(client, sent))
        assert down.transport is not None
        await _until(lambda: not down.transport.is_reading(), "the endpoint to pause")
        await asyncio.sleep(0.05)  # the client keeps sending; the kernel buffers fill, we hold no more
        held = sum(map(len, down._held))
        assert MAX_HELD_BEFORE_RELAY_BYTES <= held < MAX_HELD_BEFORE_RELAY_BYTES + UVLOOP_READ_BYTES
        relay = Relay(down, up)
        up.attach(relay)
        down.attach(relay)
        got = bytearray()
        async with asyncio.timeout(STEP_TIMEOUT_S):
            while len(got) < len(sent):
                chunk = await loop.sock_recv(server, 1 << 20)
                assert chunk
                got += chunk
            await sender
        assert bytes(got) == sent
    finally:
        down.abort()
        up.abort()
        client.close()
        server.close()


async def test_an_eof_alone_before_attach_is_replayed():
    loop = asyncio.get_running_loop()
    down_sock, client = tcp_pair()
    up_sock, server = tcp_pair()
    down, up = wrap_socket(down_sock), wrap_socket(up_sock)
    try:
        client.shutdown(socket.SHUT_WR)
        await asyncio.sleep(0.01)
        relay = Relay(down, up)
        up.attach(relay)
        down.attach(relay)
        assert await _receive_until_eof(loop, server) == b""
    finally:
        down.abort()
        up.abort()
        client.close()
        server.close()


async def test_bytes_read_before_the_socket_was_wrapped_are_bounded_and_replayed_first():
    """`read_waiting` (the captured path reads a client's first bytes before its upstream is
    reached): at most MAX_EARLY_DATA_BYTES, b"" from a silent peer; bytes it read and did not
    send ahead (`hold_first`) are relayed before anything the transport read later."""
    loop = asyncio.get_running_loop()
    down_sock, client = tcp_pair()
    up_sock, server = tcp_pair()
    down_sock.setblocking(False)  # as the listener hands accepted sockets on
    try:
        assert read_waiting(down_sock) == b""  # nothing sent yet: no wait, no error
        first = b"f" * (MAX_EARLY_DATA_BYTES + 100)
        client.sendall(first)
        await _until(lambda: _readable(down_sock), "the first bytes to arrive")
        await asyncio.sleep(0.01)
        early = read_waiting(down_sock)
        assert early == first[:MAX_EARLY_DATA_BYTES]
        down, up = wrap_socket(down_sock), wrap_socket(up_sock)
        client.send(b" later")
        client.shutdown(socket.SHUT_WR)
        await _until(lambda: down._held_eof, "the rest and the EOF to be held")
        down.hold_first(early)
        relay = Relay(down, up)
        up.attach(relay)
        down.attach(relay)
        assert await _receive_until_eof(loop, server) == first + b" later"
        down.abort()
        up.abort()
    finally:
        client.close()
        server.close()
        down_sock.close()
        up_sock.close()


def _readable(sock: socket.socket) -> bool:
    import select

    return bool(select.select([sock], [], [], 0)[0])
