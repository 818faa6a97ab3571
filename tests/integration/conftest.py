"""In-process tests run on uvloop, the event loop the programs use (cli._run); fixtures shared by
several integration modules."""

import asyncio

import pytest
import uvloop

from ambient_mesh.proxy.hbone import HboneConnection
from ambient_mesh.transport.relay import Relay
from tests.helpers.hbone_echo import Echo


def pytest_asyncio_loop_factories(config, item):
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture
async def echo_server():
    """An HBONE server (plain TCP: the shell does not care) whose streams echo."""
    conns: list[HboneConnection] = []

    def on_request(stream) -> None:
        stream.conn.respond(stream, 200)
        echo = Echo()
        relay = Relay(stream, echo)
        echo.relay = relay
        stream.attach(relay)

    def factory() -> HboneConnection:
        conn = HboneConnection(client_side=False, on_request=on_request)
        conns.append(conn)
        return conn

    server = await asyncio.get_running_loop().create_server(factory, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield port, conns
    finally:
        server.close()
        for conn in conns:
            conn.abort()
