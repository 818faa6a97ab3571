"""Drain and GOAWAY through the asyncio shell: two HboneConnections over loopback TCP.

A tunnel that keeps sending after the server's GOAWAY carries on until it ends; then both
connections close by themselves. The pool never opens a stream on a connection that got
GOAWAY, and retries a stream the peer refused before processing it.
"""

from __future__ import annotations

import asyncio

import pytest

from ambient_mesh.identity.spiffe import Identity
from ambient_mesh.net import SocketAddr
from ambient_mesh.proxy.hbone import HboneError, HboneStreamRefused
from ambient_mesh.proxy.pool import HbonePool, WorkloadKey
from ambient_mesh.transport.relay import Relay
from tests.helpers.hbone_echo import Recorder, connect, wait_until


async def test_drain_lets_a_live_tunnel_keep_sending_after_goaway(echo_server):
    port, server_conns = echo_server
    client = await connect(port)
    stream, response = await asyncio.wait_for(client.open_stream("10.0.0.3:80", []), 5)
    assert response.status == 200
    app = Recorder()
    relay = Relay(app, stream)
    stream.attach(relay)
    relay.data_from(app, b"before;")
    await wait_until(lambda: app.received == b"before;")

    [server] = server_conns
    server.drain()  # GOAWAY(2^31-1), PING, then GOAWAY(1)
    await wait_until(lambda: client.goaway_received)
    assert not client.usable
    with pytest.raises(HboneError):
        await client.open_stream("10.0.0.3:80", [])
    expected = b"before;"
    for i in range(20):  # the tunnel keeps sending after the GOAWAY, and is answered
        chunk = f"after-goaway-{i};".encode()
        expected += chunk
        relay.data_from(app, chunk)
        await asyncio.sleep(0.01)
    await wait_until(lambda: bytes(app.received) == expected)
    assert not server.closed.done() and not client.closed.done()

    relay.eof_from(app)  # the client half-closes; the echo half-closes back: the stream ends
    await asyncio.wait_for(app.eof.wait(), 5)
    await asyncio.wait_for(relay.done, 5)
    await asyncio.wait_for(asyncio.gather(server.closed, client.closed), 5)
    assert server.error is None and client.error is None


async def test_pool_replaces_a_connection_that_received_goaway(echo_server):
    port, server_conns = echo_server
    pool = HbonePool(lambda key: connect(port))
    key = WorkloadKey.of(Identity("td", "ns", "src"), [], SocketAddr.parse("127.0.0.1:1"), None)
    first, _ = await pool.open_stream(key, "10.0.0.3:80", [])
    assert pool.connections_opened == 1
    server_conns[0].drain()
    await wait_until(lambda: first.conn.goaway_received)
    second, _ = await pool.open_stream(key, "10.0.0.3:80", [])
    assert second.conn is not first.conn and pool.connections_opened == 2
    assert pool.connections(key) == [second.conn]
    pool.close()


class RefusingConnection:
    """Stands in for a connection whose GOAWAY raced our new stream (RFC 9113 8.7)."""

    def __init__(self) -> None:
        self.usable = True
        self.open_streams = 0
        self.max_streams = 100

    async def open_stream(self, authority, headers, early=b""):
        self.usable = False
        raise HboneStreamRefused("stream refused by the peer's GOAWAY before it was processed")

    def drain(self) -> None:
        pass


async def test_pool_retries_a_stream_refused_by_goaway_on_a_new_connection(echo_server):
    port, _ = echo_server
    made = []

    async def connector(key):
        conn = RefusingConnection() if not made else await connect(port)
        made.append(conn)
        return conn

    pool = HbonePool(connector)
    key = WorkloadKey.of(Identity("td", "ns", "src"), [], SocketAddr.parse("127.0.0.1:1"), None)
    stream, response = await pool.open_stream(key, "10.0.0.3:80", [])
    assert response.status == 200 and len(made) == 2 and stream.conn is made[1]
    pool.close()
