"""How the server proxy serves a CONNECT stream (proxy/inbound.py `serve_stream`): without a
task when its app connection is made at once, by a task that waits for it when it is not, and
a failure while serving one stream resets that stream only, not its HBONE connection."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
from dataclasses import dataclass, field
from typing import Any

import pytest

from ambient_mesh.net import ip_address
from ambient_mesh.proxy.connection_manager import ConnectionManager
from ambient_mesh.proxy.open_connections import OpenConnections
from tests.helpers.proxy_metrics import samples
from tests.helpers.state_writes import upsert

from .mesh import CLIENT_IP, ECHO_PORT, SERVER_IP, running_mesh

STEP_TIMEOUT_S = 15.0


@dataclass(eq=False)
class RecordingTracker(OpenConnections):
    """The server proxy's connection tracker, recording the tasks it is asked to start."""

    spawned: list[asyncio.Task[None]] = field(default_factory=list)

    def spawn(self, coro: Any) -> asyncio.Task[None]:
        task = super().spawn(coro)
        self.spawned.append(task)
        return task


class FailingOnce(ConnectionManager):
    """Authorization that raises once, as a bug in serving a stream would."""

    failed = False

    def authorize(self, conn, workload):  # type: ignore[no-untyped-def]
        if not self.failed:
            self.failed = True
            raise RuntimeError("a bug while serving the stream")
        return super().authorize(conn, workload)


async def test_streams_whose_app_accepts_at_once_are_served_without_a_task():
    async with running_mesh() as mesh:
        tracker = RecordingTracker()
        mesh.server.pi.connections = tracker
        for _ in range(10):
            await mesh.echo_once()
        # Over loopback the kernel has nearly always finished the handshake inside connect();
        # at least one of ten (on a loaded host) was served with no task at all.
        assert len(tracker.spawned) < 10


async def test_a_stream_whose_app_connect_waits_is_served_by_a_task():
    """A listener with a full accept queue drops SYNs: the app connect waits (the SYN is sent
    again after about a second), and the stream is answered once it is made."""
    loop = asyncio.get_running_loop()
    with socket.create_server((SERVER_IP, 0), backlog=0) as app:
        app.setblocking(False)
        port = app.getsockname()[1]
        filler = socket.create_connection((SERVER_IP, port))  # the one queue slot (backlog 0)
        async with running_mesh() as mesh:
            tracker = RecordingTracker()
            mesh.server.pi.connections = tracker
            opening = asyncio.ensure_future(mesh.socks_connect(SERVER_IP, port))
            try:
                async with asyncio.timeout(STEP_TIMEOUT_S):
                    while not tracker.spawned:
                        await asyncio.sleep(0.005)
                assert not opening.done()  # not answered while the app connect waits
                app.accept()[0].close()  # the filler's slot is free: the next SYN gets in
                filler.close()
                async with asyncio.timeout(STEP_TIMEOUT_S):
                    reader, writer = await opening
                    accepted, _ = await loop.sock_accept(app)
                with accepted:
                    writer.write(b"through")
                    async with asyncio.timeout(STEP_TIMEOUT_S):
                        assert await loop.sock_recv(accepted, 7) == b"through"
                    await loop.sock_sendall(accepted, b"back")
                    async with asyncio.timeout(STEP_TIMEOUT_S):
                        assert await reader.readexactly(4) == b"back"
                    writer.close()
                (task,) = tracker.spawned
                assert task.done() and task.exception() is None
            finally:
                opening.cancel()


async def test_a_failure_while_serving_a_stream_resets_only_that_stream(caplog):
    async with running_mesh() as mesh:
        await mesh.echo_once()  # the HBONE connection is up and pooled
        server = mesh.server.pi
        server.connection_manager = FailingOnce(server.state)
        with caplog.at_level(logging.ERROR, logger="ambient_mesh.proxy.inbound"):
            with pytest.raises(ConnectionRefusedError):
                async with asyncio.timeout(STEP_TIMEOUT_S):
                    await mesh.socks_connect(SERVER_IP, ECHO_PORT)
        assert "serving it failed" in caplog.text and "a bug while serving the stream" in caplog.text
        # The next stream goes over the same HBONE connection, served as usual.
        await mesh.echo_once()
        assert mesh.client.pi.pool is not None and mesh.client.pi.pool.connections_opened == 1


async def test_a_state_change_reaches_the_next_streams_decision():
    """The server keeps a CONNECT's decision and its caller's workload per state version
    (`InboundProxy._decided`): a change to the caller's workload shows in the next stream's
    metrics, not the kept one's."""
    async with running_mesh() as mesh:
        state = mesh.server.state
        client = state.workloads.find_address("", ip_address(CLIENT_IP))
        assert client is not None
        await mesh.echo_once()
        await mesh.echo_once()
        upsert(state, dataclasses.replace(client, workload_name="renamed"))
        await mesh.echo_once()
        opened = {
            labels["source_workload"]: value
            for labels, value in samples(mesh.server, "istio_tcp_connections_opened_total")
            if labels["reporter"] == "destination"
        }
        assert opened == {"client": 2, "renamed": 1}
