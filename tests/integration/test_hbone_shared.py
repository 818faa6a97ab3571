"""Streams sharing one HBONE connection (proxy/hbone/connection.py, module docstring): while more than one
stream is open the socket holds at most SHARED_NOTSENT_LOWAT_BYTES unsent (TCP_NOTSENT_LOWAT),
and a stream alone gives the kernel's default back. Two HboneConnections over loopback TCP, the
server's streams echoing."""

from __future__ import annotations

import asyncio
import socket

from ambient_mesh.proxy.hbone import SHARED_NOTSENT_LOWAT_BYTES, HboneConnection
from ambient_mesh.transport.relay import Relay
from tests.helpers.hbone_echo import Recorder, connect, wait_until


async def _tunnel(client: HboneConnection) -> tuple[Recorder, Relay]:
    stream, response = await asyncio.wait_for(client.open_stream("10.0.0.3:80", []), 5)
    assert response.status == 200
    app = Recorder()
    relay = Relay(app, stream)
    stream.attach(relay)
    return app, relay


def _unsent_bound(conn: HboneConnection) -> int:
    assert conn.transport is not None
    return conn.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT)


async def test_the_unsent_bound_follows_the_number_of_open_streams(echo_server):
    port, _server_conns = echo_server
    client = await connect(port)
    try:
        bulk, bulk_relay = await _tunnel(client)
        bulk_relay.data_from(bulk, b"alone;")
        await wait_until(lambda: bulk.received == b"alone;")
        assert _unsent_bound(client) == 0  # one stream: the kernel's default

        ping, ping_relay = await _tunnel(client)
        ping_relay.data_from(ping, b"ping")
        await wait_until(lambda: ping.received == b"ping")
        assert _unsent_bound(client) == SHARED_NOTSENT_LOWAT_BYTES
        bulk_relay.data_from(bulk, b"shared;")
        await wait_until(lambda: bulk.received == b"alone;shared;")
        assert _unsent_bound(client) == SHARED_NOTSENT_LOWAT_BYTES

        ping_relay.eof_from(ping)  # the ping stream ends both ways
        await asyncio.wait_for(ping_relay.done, 5)
        await wait_until(lambda: client.open_streams == 1)
        bulk_relay.data_from(bulk, b"alone again;")
        await wait_until(lambda: bulk.received == b"alone;shared;alone again;")
        assert _unsent_bound(client) == 0
    finally:
        client.abort()
