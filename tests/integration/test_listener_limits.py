"""The accept loop at the edges: out of file descriptors, and clients gone before their handler.

The descriptor test runs the listener in a subprocess with a low RLIMIT_NOFILE, so the limit
is real and the test process keeps its own descriptors.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import subprocess
import sys
import textwrap
import time

from ambient_mesh.net import SocketAddr
from ambient_mesh.proxy.listener import AcceptErrorLog, Listener
from ambient_mesh.proxy.open_connections import OpenConnections

NOFILE_LIMIT = 64
CLIENTS = 150  # well past the limit, bounded
CLIENT_TIMEOUT_S = 8.0

_CHILD = textwrap.dedent(
    """
    import asyncio, logging, resource, socket, sys
    import uvloop
    from ambient_mesh.net import SocketAddr
    from ambient_mesh.proxy.open_connections import OpenConnections
    from ambient_mesh.proxy.listener import Listener

    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE_MAX, NOFILE_MAX))
    logging.basicConfig(stream=sys.stderr, level=logging.DEBUG, format="%(levelname)s %(message)s")

    async def handler(conn):
        # What the proxy's handlers do first: ask who the client is, then hold the connection.
        conn.getpeername()
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(conn, b"hi")
        while await loop.sock_recv(conn, 100):
            pass
        conn.close()

    async def main():
        listener = Listener("limits", SocketAddr.parse("127.0.0.1:0"), handler, OpenConnections())
        listener.start()
        print(listener.bound_address.port, flush=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.readline)
        print(repr(listener), file=sys.stderr, flush=True)

    uvloop.run(main())
    """
).replace("NOFILE_MAX", str(NOFILE_LIMIT))


def _outcome(sock: socket.socket, deadline: float) -> str:
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    try:
        data = sock.recv(10)
    except ConnectionResetError:
        return "closed"
    except TimeoutError:
        return "hung"
    return "served" if data == b"hi" else "closed"


def _connect(port: int) -> socket.socket | None:
    """A client, or None when the listener shed it before connect() returned: on a loaded host
    the server's accept-and-close can reset the connection before the client's poll wakes."""
    try:
        return socket.create_connection(("127.0.0.1", port), timeout=5)
    except ConnectionResetError:
        return None


def test_out_of_descriptors_sheds_clients_with_one_log_line_and_recovers():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    clients: list[socket.socket | None] = []
    try:
        port = int(child.stdout.readline())
        for _ in range(CLIENTS):
            clients.append(_connect(port))
        deadline = time.monotonic() + CLIENT_TIMEOUT_S  # one bound for all clients together
        outcomes = ["closed" if c is None else _outcome(c, deadline) for c in clients]
        assert outcomes.count("hung") == 0, outcomes
        served = outcomes.count("served")
        assert 0 < served < NOFILE_LIMIT
        assert outcomes.count("closed") == CLIENTS - served
        # Free the descriptors: the listener serves again.
        for c in clients:
            if c is not None:
                c.close()
        clients.clear()
        deadline = time.monotonic() + CLIENT_TIMEOUT_S
        late = "none"
        while late != "served" and time.monotonic() < deadline:
            clients.append(c := _connect(port))
            late = "closed" if c is None else _outcome(c, deadline)
        assert late == "served"
        child.stdin.write("\n")
        child.stdin.flush()
        _out, err = child.communicate(timeout=20)
    finally:
        for c in clients:
            if c is not None:
                c.close()
        if child.poll() is None:
            child.kill()
            child.communicate()
    warnings = [line for line in err.splitlines() if "accept failed" in line]
    assert 1 <= len(warnings) <= 2, err
    assert "EMFILE" in warnings[0] and "closed" in warnings[0] and "ulimit" in warnings[0]
    assert "Traceback" not in err, err
    assert "shed" in err.splitlines()[-1]  # the listener's repr counts shed clients


async def test_client_reset_before_its_handler_runs_is_one_debug_line(caplog):
    seen: list[str] = []

    async def handler(conn: socket.socket) -> None:
        conn.getpeername()  # ENOTCONN for a client that already reset
        seen.append("served")

    listener = Listener("reset", SocketAddr.parse("127.0.0.1:0"), handler, OpenConnections())
    listener.bind()  # bound and listening, but not accepting yet
    port = listener.bound_address.port
    for _ in range(3):
        c = socket.create_connection(("127.0.0.1", port))
        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        c.close()  # RST while the connection waits in the backlog
    caplog.set_level(logging.DEBUG, logger="ambient_mesh.proxy.listener")
    listener.start()
    try:
        for _ in range(100):
            if listener.accepted >= 3 and not listener._tracker.tasks:
                break
            await asyncio.sleep(0.01)
        good = socket.create_connection(("127.0.0.1", port))
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.01)
        good.close()
    finally:
        listener.close()
    assert seen == ["served"]  # the listener still serves after the resets
    records = [r for r in caplog.records if r.name == "ambient_mesh.proxy.listener"]
    assert not [r for r in records if r.exc_info or r.levelno >= logging.WARNING], records
    assert [r for r in records if "client gone" in r.getMessage()]


def test_accept_error_log_says_one_line_per_interval_with_counts(caplog):
    caplog.set_level(logging.WARNING, logger="ambient_mesh.proxy.listener")
    errors = AcceptErrorLog("x", interval_s=10.0)
    emfile = OSError(24, "Too many open files")
    for i in range(1000):
        errors.note(emfile, 2, now=i * 0.005)  # 1000 failures in 5 s
    errors.note(emfile, 1, now=11.0)
    assert errors.lines == 2
    lines = [r.getMessage() for r in caplog.records]
    assert "accept failed 1 times" in lines[0]
    assert "accept failed 1000 times" in lines[1] and "closed 1999 waiting clients" in lines[1]


class _CountingListenSocket(socket.socket):
    """A listening socket that counts its accept calls, and those that found nothing (EAGAIN)."""

    accepts = 0
    empty = 0

    def _accept(self):  # type: ignore[override]
        type(self).accepts += 1
        try:
            return super()._accept()  # type: ignore[misc]
        except BlockingIOError:
            type(self).empty += 1
            raise


async def test_a_wakeup_accepts_what_waits_without_an_accept_that_finds_nothing():
    # One client per wakeup (the usual case) and a burst that waited before the listener
    # started: every client is accepted, and no accept() call came back empty (EAGAIN), since
    # the listener asks poll() whether another client waits.
    class Counting(_CountingListenSocket):
        accepts = 0
        empty = 0

    served: list[int] = []
    got = asyncio.Event()

    async def handler(conn: socket.socket) -> None:
        served.append(conn.getpeername()[1])
        conn.close()
        got.set()

    listener = Listener(
        "count",
        SocketAddr.parse("127.0.0.1:0"),
        handler,
        OpenConnections(),
        socket_factory=lambda family, type: Counting(family, type),
    )
    listener.bind()
    port = listener.bound_address.port
    burst = [socket.create_connection(("127.0.0.1", port)) for _ in range(5)]  # waiting in the backlog
    listener.start()
    try:
        deadline = time.monotonic() + 5
        while len(served) < 5 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert sorted(served) == sorted(c.getsockname()[1] for c in burst)
        for _ in range(3):  # one at a time
            got.clear()
            with socket.create_connection(("127.0.0.1", port)):
                await asyncio.wait_for(got.wait(), 5)
        assert len(served) == 8
        assert Counting.accepts == 8
        assert Counting.empty == 0
    finally:
        listener.close()
        for c in burst:
            c.close()


async def _closing_handler(conn: socket.socket) -> None:
    conn.close()


def _owner_socket() -> tuple[socket.socket, int]:
    """A listening socket as a worker pool's owner makes one for its workers; and its port."""
    owner = socket.socket()
    owner.bind(("127.0.0.1", 0))
    owner.listen(16)
    return owner, owner.getsockname()[1]


async def test_a_socket_shared_with_other_workers_is_accepted_from_one_client_per_wakeup():
    # Workers adopt the owner's listening socket; each readiness callback takes one client, so a
    # burst is left for the other workers, which the same readiness woke. A listener that bound
    # its own socket takes the whole burst in one callback.
    owner, port = _owner_socket()
    shared = Listener("shared", SocketAddr.parse("127.0.0.1:0"), _closing_handler, OpenConnections())
    shared.adopt(owner)
    own = Listener("own", SocketAddr.parse("127.0.0.1:0"), _closing_handler, OpenConnections())
    own.bind()
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
    clients += [socket.create_connection(("127.0.0.1", own.bound_address.port)) for _ in range(4)]
    try:
        for listener in (shared, own):
            listener.start()
            listener._loop.remove_reader(listener._sock)  # type: ignore[union-attr]  # the test wakes it
        shared._on_readable()
        own._on_readable()
        assert (shared.accepted, own.accepted) == (1, 4)
        for _ in range(3):
            shared._on_readable()
        assert shared.accepted == 4
    finally:
        shared.close()
        own.close()
        for c in clients:
            c.close()


class FixedShare:
    """An AcceptShare whose answer the test sets."""

    def __init__(self, busier: bool) -> None:
        self.busier = busier
        self.asked = 0
        self.deferring_listeners = 0
        self.deferrals_started = 0

    def busier_than_another(self) -> bool:
        self.asked += 1
        return self.busier

    def deferring(self, delta: int) -> None:
        self.deferring_listeners += delta
        self.deferrals_started += delta > 0


async def test_a_busier_worker_leaves_a_waiting_client_to_the_others_for_a_bounded_time():
    # Two workers' listeners on one socket (the owner's), in one process for the test: the one
    # that carries more connections defers; the other, woken by the same readiness, takes the
    # client. A busier worker alone still takes it, after MAX_ACCEPT_DEFERRALS deferrals.
    from ambient_mesh.proxy import listener as listener_module

    owner, port = _owner_socket()
    busy_share, idle_share = FixedShare(True), FixedShare(False)
    busy = Listener("busy", SocketAddr.parse("127.0.0.1:0"), _closing_handler, OpenConnections())
    busy.adopt(socket.socket(fileno=os.dup(owner.fileno())), busy_share)
    idle = Listener("idle", SocketAddr.parse("127.0.0.1:0"), _closing_handler, OpenConnections())
    idle.adopt(socket.socket(fileno=os.dup(owner.fileno())), idle_share)
    clients = []
    try:
        busy.start()
        idle.start()
        for listener in (busy, idle):  # the test wakes them, busy first
            listener._loop.remove_reader(listener._sock)  # type: ignore[union-attr]
        clients.append(socket.create_connection(("127.0.0.1", port)))
        await asyncio.sleep(0.01)  # the client is in the backlog
        busy._on_readable()
        assert busy.accepted == 0 and busy_share.asked == 1  # it asked and stood back
        assert busy_share.deferring_listeners == 1  # and said so, for the others
        idle._on_readable()
        assert (busy.accepted, idle.accepted) == (0, 1)
        idle._loop.add_reader(idle._sock, idle._on_readable)  # type: ignore[union-attr]
        await asyncio.sleep(0.01)  # busy's deferral ends: it finds nothing waiting
        assert busy.accepted == 0 and busy_share.deferring_listeners == 0

        idle.close()  # now the busier one is alone: it takes the next client, a bounded while later
        loop = asyncio.get_running_loop()
        started = loop.time()
        clients.append(socket.create_connection(("127.0.0.1", port)))
        while not busy.accepted and loop.time() - started < 1.0:
            await asyncio.sleep(0.001)
        waited = loop.time() - started
        assert busy.accepted == 1
        assert busy_share.deferring_listeners == 0  # listening again
        bound = listener_module.MAX_ACCEPT_DEFERRALS * listener_module.ACCEPT_DEFER_S
        assert waited >= bound * 0.9 and waited < bound + 0.5
    finally:
        busy.close()
        idle.close()
        owner.close()
        for c in clients:
            c.close()
