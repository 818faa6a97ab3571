"""A relay's end (proxy/open_connections.py `OpenConnections`, transport/relay.py `Relay.release`): once a
relay has ended and been recorded, it lets go of its endpoints, so the connection's objects are
freed by reference counting, without the garbage collector; the released relay keeps its byte
counts, and late events on its endpoints do nothing."""

from __future__ import annotations

import asyncio
import gc
import socket
import weakref

from ambient_mesh.proxy.open_connections import OpenConnections
from ambient_mesh.transport.relay import Relay, wrap_socket

from .tcp_pair import tcp_pair

STEP_TIMEOUT_S = 10.0


class _About:
    direction = "outbound"

    def dump_info(self) -> dict:
        return {}


async def _ended_relay() -> tuple[weakref.ref, weakref.ref, weakref.ref, list]:
    """A relay between two loopback connections, carried to its end through a tracker."""
    loop = asyncio.get_running_loop()
    down_sock, client = tcp_pair()
    up_sock, server = tcp_pair()
    down, up = wrap_socket(down_sock), wrap_socket(up_sock)
    relay = Relay(down, up)
    ended: list = []
    OpenConnections().track(relay, _About(), on_end=lambda r, err: ended.append(err))
    up.attach(relay)
    down.attach(relay)
    client.send(b"x")
    async with asyncio.timeout(STEP_TIMEOUT_S):
        assert await loop.sock_recv(server, 1) == b"x"
    client.shutdown(socket.SHUT_WR)
    server.shutdown(socket.SHUT_WR)
    async with asyncio.timeout(STEP_TIMEOUT_S):
        while not ended:
            await asyncio.sleep(0.001)
    # Relay has no __weakref__ slot: its `done` future stands for it (the relay holds it).
    refs = (weakref.ref(relay.done), weakref.ref(down), weakref.ref(up))
    client.close()
    server.close()
    return (*refs, ended)


async def test_an_ended_relay_and_its_endpoints_are_freed_without_the_collector():
    gc.collect()
    gc.disable()
    try:
        done_ref, down_ref, up_ref, ended = await _ended_relay()
        assert ended == [None]
        # The transports let go of their protocols when their connection_lost has run.
        async with asyncio.timeout(STEP_TIMEOUT_S):
            while done_ref() is not None or down_ref() is not None or up_ref() is not None:
                await asyncio.sleep(0.001)
    finally:
        gc.enable()


async def test_a_released_relay_keeps_its_counts_and_late_events_do_nothing():
    loop = asyncio.get_running_loop()
    down_sock, client = tcp_pair()
    up_sock, server = tcp_pair()
    down, up = wrap_socket(down_sock), wrap_socket(up_sock)
    try:
        relay = Relay(down, up)
        up.attach(relay)
        down.attach(relay)
        client.send(b"abc")
        async with asyncio.timeout(STEP_TIMEOUT_S):
            assert await loop.sock_recv(server, 3) == b"abc"
        relay.finish()
        relay.release()
        assert (relay.bytes_up, relay.bytes_down) == (3, 0)
        assert down.relay is None and up.relay is None
        assert down.peer is not up and up.peer is not down
        # Late events on the endpoints reach neither the relay nor the other side.
        down.data_received(b"late")
        down.eof_received()
        up.pause_writing()
        up.resume_writing()
        down.connection_lost(ConnectionResetError())
        assert relay.done.result() is None
        assert (relay.bytes_up, relay.bytes_down) == (7, 0)  # counted, then dropped
    finally:
        down.abort()
        up.abort()
        client.close()
        server.close()


async def test_a_relay_still_running_is_not_released():
    down_sock, client = tcp_pair()
    up_sock, server = tcp_pair()
    down, up = wrap_socket(down_sock), wrap_socket(up_sock)
    try:
        relay = Relay(down, up)
        up.attach(relay)
        down.attach(relay)
        relay.release()
        assert down.relay is relay and up.relay is relay
        assert down.peer is up and up.peer is down
    finally:
        down.abort()
        up.abort()
        client.close()
        server.close()
