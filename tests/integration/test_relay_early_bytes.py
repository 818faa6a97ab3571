"""Bytes a plain socket's peer sends before the relay is attached (proxy/relay.py `wrap_socket`,
`TcpEndpoint`): the endpoint reads while it waits (it is not paused up front), pauses at the
first bytes, holds them (at most one read) and an EOF, and `attach` replays both in order."""

from __future__ import annotations

import asyncio
import socket

from ambient_mesh.proxy.relay import Relay, wrap_socket

STEP_TIMEOUT_S = 10.0


def _pair() -> tuple[socket.socket, socket.socket]:
    """(the proxy's side, the peer's side) of one loopback TCP connection."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        peer = socket.create_connection(listener.getsockname())
        proxy, _ = listener.accept()
    peer.setblocking(False)
    return proxy, peer


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
    down_sock, client = _pair()
    down = await wrap_socket(down_sock)
    try:
        await asyncio.sleep(0.01)
        assert down.transport is not None and down.transport.is_reading()
    finally:
        down.abort()
        client.close()


async def test_bytes_and_eof_before_attach_are_held_paused_and_replayed_in_order():
    loop = asyncio.get_running_loop()
    down_sock, client = _pair()
    up_sock, server = _pair()
    down, up = await wrap_socket(down_sock), await wrap_socket(up_sock)
    try:
        client.send(b"first ")
        assert down.transport is not None
        # The first read pauses the endpoint: what the client sends next stays in the kernel.
        await _until(lambda: not down.transport.is_reading(), "the endpoint to pause")
        client.send(b"second")
        client.shutdown(socket.SHUT_WR)
        await asyncio.sleep(0.01)
        assert not down.transport.is_reading()
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


async def test_an_eof_alone_before_attach_is_replayed():
    loop = asyncio.get_running_loop()
    down_sock, client = _pair()
    up_sock, server = _pair()
    down, up = await wrap_socket(down_sock), await wrap_socket(up_sock)
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
