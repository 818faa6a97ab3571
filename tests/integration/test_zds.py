"""ZDS over a real Unix SOCK_SEQPACKET socket: node agent server and node proxy client in one process.

Netns fds are stood in for by files and pipes here (the namespace itself is tests/netns'
business); what matters is that the received fd is the same open file, which fstat shows.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from ambient_mesh.config import ProxyWorkloadInfo
from ambient_mesh.zds.client import SeqpacketChannel, ZdsClient, close_fds, netns_id_of
from ambient_mesh.zds.codec import (
    AckMsg,
    Add,
    Hello,
    Keep,
    SnapshotSent,
    decode_hello,
    decode_response,
    encode,
    fds_to_send,
)
from ambient_mesh.zds.server import NO_CONNECTION, ZdsServer

WAIT_S = 5.0
RETRY_S = 0.05


def info(name: str) -> ProxyWorkloadInfo:
    return ProxyWorkloadInfo(namespace="default", name=name, service_account=f"{name}-sa")


class RecordingManager:
    """A WorkloadProxyManager that remembers which file each start's fd referred to."""

    def __init__(self, *, failures: dict[str, int] | None = None) -> None:
        self.failures = dict(failures or {})
        self.running: dict[str, tuple[int, int]] = {}
        self.log: list[tuple[str, str]] = []

    async def start_proxy(self, uid: str, info: ProxyWorkloadInfo, netns_fd: int) -> None:
        self.log.append(("start", uid))
        if self.failures.get(uid, 0) > 0:
            self.failures[uid] -= 1
            raise OSError(98, f"address in use for {info.name}")
        self.running[uid] = netns_id_of(netns_fd)

    async def stop_proxy(self, uid: str, graceful: bool) -> None:
        self.log.append(("stop-graceful" if graceful else "stop", uid))
        self.running.pop(uid, None)


class PodStore:
    def __init__(self) -> None:
        self.pods: dict[str, tuple[ProxyWorkloadInfo, int | None]] = {}

    def snapshot(self):
        return [(uid, i, fd) for uid, (i, fd) in self.pods.items()]


async def until(predicate, what: str, timeout_s: float = WAIT_S):
    async with asyncio.timeout(timeout_s):
        while not (value := predicate()):
            await asyncio.sleep(0.005)
    assert value, what
    return value


@pytest.fixture
def sock_path():
    # Short, private directory: Unix socket paths are limited to 107 bytes.
    directory = tempfile.mkdtemp(prefix="zds-", dir="/tmp")
    yield Path(directory) / "run" / "ztunnel.sock"
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def files(tmp_path):
    """`files(name) -> fd` of a fresh file; all closed at teardown."""
    opened: list[int] = []

    def open_file(name: str) -> int:
        fd = os.open(tmp_path / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
        opened.append(fd)
        return fd

    yield open_file
    close_fds(opened)


@pytest.fixture
async def stack():
    """Start servers and clients; every one is stopped at teardown."""
    servers: list[ZdsServer] = []
    clients: list[ZdsClient] = []

    class Stack:
        async def server(self, path, store) -> ZdsServer:
            server = ZdsServer(path, store, accept_rate_per_s=0)
            await server.start()
            servers.append(server)
            return server

        def client(self, path, manager, **kw) -> ZdsClient:
            client = ZdsClient(path, manager, retry_interval_s=RETRY_S, max_backoff_s=0.05, **kw)
            client.start()
            clients.append(client)
            return client

    yield Stack()
    for client in clients:
        await client.close(drain=False)
    for server in servers:
        await server.stop()


async def test_snapshot_then_add_and_del(sock_path, files, stack):
    store = PodStore()
    fd_a = files("a")
    store.pods = {"a": (info("a"), fd_a), "b": (info("b"), None)}
    server = await stack.server(sock_path, store)
    assert sock_path.exists()
    manager = RecordingManager()
    readiness: list[bool] = []
    client = stack.client(sock_path, manager, on_ready_change=readiness.append)
    async with asyncio.timeout(WAIT_S):
        await client.wait_ready()
        await server.wait_connected(1)
    assert manager.running == {"a": netns_id_of(fd_a)}  # the same open file arrived
    assert readiness == [True]
    assert repr(server) == f"<ZdsServer {sock_path} listening: 1 node proxies [#1 steady]>"
    assert repr(client) == f"<ZdsClient {sock_path} connected, steady: 1 running, 0 pending, ready>"

    r, w = os.pipe()
    try:
        assert await server.add_workload("c", info("c"), r) is None
        assert manager.running["c"] == netns_id_of(r)
        # the add is idempotent for the same namespace
        assert await server.add_workload("c", info("c"), r) is None
        assert manager.log.count(("start", "c")) == 1
        assert await server.del_workload("c") is None
    finally:
        close_fds([r, w])
    assert manager.log[-1] == ("stop", "c")
    assert client.dump()["pods"] == {"a": {"state": "Up", "info": "default/a/a-sa"}}


async def test_no_connection_means_add_fails(sock_path, files, stack):
    server = await stack.server(sock_path, PodStore())
    assert await server.add_workload("a", info("a"), files("a")) == NO_CONNECTION
    assert await server.del_workload("a") is None


async def test_reconnect_after_server_restart_reconciles(sock_path, files, stack):
    store = PodStore()
    store.pods = {"a": (info("a"), files("a")), "b": (info("b"), files("b"))}
    server = await stack.server(sock_path, store)
    manager = RecordingManager()
    client = stack.client(sock_path, manager)
    async with asyncio.timeout(WAIT_S):
        await client.wait_ready()
    assert manager.running.keys() == {"a", "b"}

    await server.stop()
    await until(lambda: not client.connected, "client notices the node agent is gone")
    assert not client.ready
    assert manager.running.keys() == {"a", "b"}  # proxies keep running while disconnected

    store.pods = {"a": (info("a"), None)}  # the new agent lost a's netns, and b is gone
    server2 = await stack.server(sock_path, store)
    async with asyncio.timeout(WAIT_S):
        await server2.wait_connected(1)
        await client.wait_ready()
    assert manager.running.keys() == {"a"}
    assert ("stop", "b") in manager.log
    assert manager.log.count(("start", "a")) == 1
    assert client.state.connections == 2


async def test_start_failure_nacks_then_retries(sock_path, files, stack):
    server = await stack.server(sock_path, PodStore())
    manager = RecordingManager(failures={"a": 2})
    client = stack.client(sock_path, manager)
    async with asyncio.timeout(WAIT_S):
        await client.wait_ready()
    error = await server.add_workload("a", info("a"), files("a"))
    assert error is not None and "address in use for a" in error
    assert not client.ready and client.state.pending == ("a",)
    async with asyncio.timeout(WAIT_S):
        await client.wait_ready()  # two retries later
    assert manager.log.count(("start", "a")) == 3
    assert "a" in manager.running
    assert client.connected and client.state.connections == 1  # the NACK kept the connection


async def test_two_proxies_adds_go_to_the_newest_dels_to_all(sock_path, files, stack):
    store = PodStore()
    store.pods = {"a": (info("a"), files("a"))}  # in both snapshots
    server = await stack.server(sock_path, store)
    old, new = RecordingManager(), RecordingManager()
    stack.client(sock_path, old)
    async with asyncio.timeout(WAIT_S):
        await server.wait_connected(1)
    stack.client(sock_path, new)
    async with asyncio.timeout(WAIT_S):
        await server.wait_connected(2)
    assert server.connections == ("#1 steady", "#2 steady")
    assert old.running.keys() == new.running.keys() == {"a"}
    assert await server.add_workload("b", info("b"), files("b")) is None
    assert "b" in new.running and "b" not in old.running
    assert await server.del_workload("a") is None
    assert ("stop", "a") in new.log and ("stop", "a") in old.log
    assert old.running == {} and new.running.keys() == {"b"}


async def test_client_disconnect_is_seen_by_the_server(sock_path, stack):
    server = await stack.server(sock_path, PodStore())
    client = stack.client(sock_path, RecordingManager())
    async with asyncio.timeout(WAIT_S):
        await server.wait_connected(1)
    await client.close(drain=True)
    await until(lambda: server.connected == 0, "server drops the closed connection")


async def test_connect_failures_back_off_and_log(sock_path, stack, caplog):
    sleeps: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        sleeps.append(seconds)
        await asyncio.sleep(0)

    client = stack.client(sock_path, RecordingManager(), sleep=fake_sleep, initial_backoff_s=0.01)
    await until(lambda: len(sleeps) >= 5, "several connect attempts")
    assert sleeps[:4] == [0.01, 0.02, 0.04, 0.05]  # doubling, capped (at 0.05 in this test)
    assert "is the node agent healthy?" in caplog.text
    assert not client.ready and client.connect_failures >= 5


# --- a hand-driven node agent, to break the protocol on purpose -----------------------------------


class RawAgent:
    """A listening SEQPACKET socket driven step by step by the test."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(str(path))
        self.listener.listen()
        self.listener.setblocking(False)

    async def accept(self) -> SeqpacketChannel:
        async with asyncio.timeout(WAIT_S):
            while True:
                try:
                    conn, _ = self.listener.accept()
                    return SeqpacketChannel(conn)
                except BlockingIOError:
                    await asyncio.sleep(0.005)

    @staticmethod
    async def hello(channel: SeqpacketChannel) -> Hello:
        datagram = await channel.recv(WAIT_S)
        return decode_hello(datagram.data, datagram.fds, datagram.flags)

    @staticmethod
    async def request(channel: SeqpacketChannel, msg, fds=None) -> AckMsg:
        await channel.send(encode(msg), fds_to_send(msg) if fds is None else fds)
        datagram = await channel.recv(WAIT_S)
        return decode_response(datagram.data, datagram.fds, datagram.flags)

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def raw_agent(sock_path):
    agent = RawAgent(sock_path)
    yield agent
    agent.close()


async def test_keep_after_snapshot_nacks_and_reconnects(sock_path, raw_agent, stack):
    client = stack.client(sock_path, RecordingManager())
    channel = await raw_agent.accept()
    try:
        assert await raw_agent.hello(channel) == Hello(version=1)
        assert (await raw_agent.request(channel, SnapshotSent())).ok
        await until(lambda: client.ready, "ready after an empty snapshot")
        ack = await raw_agent.request(channel, Keep(uid="late"))
        assert ack.error == "pod keep received after snapshot"
        assert await channel.recv(WAIT_S) is None  # the client hung up
    finally:
        channel.close()
    again = await raw_agent.accept()  # and came back
    try:
        assert await raw_agent.hello(again) == Hello(version=1)
        assert not client.ready
    finally:
        again.close()


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


async def test_fd_rules_on_the_wire(sock_path, files, raw_agent, stack):
    x, y = files("x"), files("y")
    before = open_fds()
    manager = RecordingManager()
    client = stack.client(sock_path, manager)
    channel = await raw_agent.accept()
    try:
        await raw_agent.hello(channel)
        # An Add with two fds is refused; the client closes both copies it received.
        ack = await raw_agent.request(channel, Add.of("a", info("a"), 0), fds=[x, y])
        assert "expected at most 1 fd" in ack.error
        assert await channel.recv(WAIT_S) is None
    finally:
        channel.close()
    channel = await raw_agent.accept()
    try:
        await raw_agent.hello(channel)
        ack = await raw_agent.request(channel, Add.of("a", info("a"), 0), fds=[])
        assert "without a netns fd" in ack.error
    finally:
        channel.close()
    assert manager.log == []
    await client.close()
    assert open_fds() == before  # nothing leaked: received copies and sockets are all closed
