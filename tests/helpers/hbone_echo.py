"""HBONE endpoints for shell tests over loopback TCP: an echoing and a recording endpoint, a client
connection, and waiting on a condition."""

from __future__ import annotations

import asyncio

from ambient_mesh.proxy.hbone import HboneConnection
from ambient_mesh.transport.relay import Endpoint


class QuietEndpoint(Endpoint):
    """An app side that ignores flow control and close (the test ends it); subclasses say what
    happens to the bytes."""

    def abort(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass


class Echo(QuietEndpoint):
    """The app side of a server stream: sends every byte back, half-closes when the client does."""

    def __init__(self) -> None:
        self.relay = None
        self.seen = bytearray()

    def write(self, data: bytes) -> None:
        self.seen += data
        self.relay.data_from(self, bytes(data))

    def write_eof(self) -> None:
        self.relay.eof_from(self)


class Recorder(QuietEndpoint):
    def __init__(self) -> None:
        self.relay = None
        self.received = bytearray()
        self.eof = asyncio.Event()

    def write(self, data: bytes) -> None:
        self.received += data

    def write_eof(self) -> None:
        self.eof.set()

    def abort(self) -> None:
        self.eof.set()


async def wait_until(predicate, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


async def connect(port: int) -> HboneConnection:
    _t, conn = await asyncio.get_running_loop().create_connection(
        lambda: HboneConnection(client_side=True), "127.0.0.1", port
    )
    return conn
