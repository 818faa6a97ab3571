"""The node agent's side of ZDS: hand pods (and their network namespaces) to the node proxies.

Counterpart: istio-cni cni/pkg/nodeagent/ztunnelserver.go (`ztunnelServer`: listen, accept,
`handleConn`, `sendSnapshot`, `PodAdded`, `PodDeleted`, `connMgr`). Facts: docs/istio-behaviour.md,
"ZDS". Only root may connect (SO_PEERCRED, checked at accept),
through a 0600 socket in a directory only root can write: a connection receives network
namespaces.

`ZdsConnectionState` is the sans-IO core of one connection: hello, then the snapshot one request
at a time (each waiting for its ack), then steady-state requests in lockstep. `ZdsServer` is the
asyncio shell: it listens on a Unix SOCK_SEQPACKET path, serves every node proxy that connects
(during a node proxy upgrade there are two), sends adds to the newest connection and deletes to
all of them.

fds: the server never closes a caller's fd. Snapshot fds are dup()ed the moment the snapshot is
read, so the pod store may close its own handles at any time; the dups are closed once sent.

Deliberate difference from istio-cni: when an ack does not come within the deadline the
connection is closed, because acks are correlated only by order and a late one would be taken
for the answer to the next request.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..config import ProxyWorkloadInfo
from ..host.private import SOCKET_FILE_MODE, peer_refusal, private_dir
from .codec import (
    VERSION_V1,
    AckMsg,
    Add,
    Del,
    Hello,
    Keep,
    Request,
    SnapshotSent,
    ZdsProtocolError,
    decode_hello,
    decode_response,
    encode,
    fds_to_send,
)
from .transport import SeqpacketChannel, close_fds

log = logging.getLogger("ambient_mesh.zds.server")

READ_WRITE_DEADLINE_S = 5.0
ACCEPT_RATE_PER_S = 5.0  # at most two node proxies per node; a reconnect loop must not exhaust us
UPDATE_QUEUE_SIZE = 100
NO_CONNECTION = "no ztunnel connection"

SnapshotEntry = tuple[str, ProxyWorkloadInfo, int | None]


class PodSnapshotSource(Protocol):
    """The node agent's pod cache (istio-cni `PodNetnsCache.ReadCurrentPodSnapshot`)."""

    def snapshot(self) -> Sequence[SnapshotEntry]:
        """Every pod this node proxies: (pod uid, info, open netns fd or None when unknown)."""


def plan_snapshot(entries: Sequence[SnapshotEntry]) -> list[Add | Keep]:
    """Add (with the netns fd) for each pod whose namespace is known, Keep for the others."""
    plan: list[Add | Keep] = []
    for uid, info, fd in entries:
        plan.append(Keep(uid=uid) if fd is None else Add.of(uid, info, fd))
    return plan


# --- commands ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class SendRequest:
    """Send `request` (with its fd for an Add) and wait for the ack."""

    request: Request


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotComplete:
    """The node proxy acknowledged SnapshotSent; `nacks` are (uid, error) of snapshot pods it refused."""

    sent: int
    nacks: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Acked:
    """The answer to a steady-state request."""

    request: Request
    error: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CloseConnection:
    reason: str


ServerCommand = SendRequest | SnapshotComplete | Acked | CloseConnection


class ServerPhase(enum.Enum):
    AWAIT_HELLO = "await hello"
    SNAPSHOT = "snapshot"
    STEADY = "steady"
    CLOSED = "closed"


def _uid(request: Request) -> str:
    return "" if isinstance(request, SnapshotSent) else request.uid


class ZdsConnectionState:
    """One node proxy connection: what to send next and what each ack answers."""

    def __init__(self) -> None:
        self.phase = ServerPhase.AWAIT_HELLO
        self.version: int | None = None
        self.outstanding: Request | None = None
        self.close_reason: str | None = None
        self._plan: list[Request] = []
        self._sent = 0
        self._nacks: list[tuple[str, str]] = []

    @property
    def busy(self) -> bool:
        return self.outstanding is not None

    def __repr__(self) -> str:
        detail = f", waiting for the ack of {type(self.outstanding).__name__}" if self.outstanding else ""
        return f"<ZdsConnectionState {self.phase.value}{detail}>"

    def receive_hello(self, hello: Hello, snapshot: Sequence[Add | Keep]) -> list[ServerCommand]:
        if self.phase is not ServerPhase.AWAIT_HELLO:
            return self.fail(f"hello while {self.phase.value}")
        if hello.version != VERSION_V1:
            log.warning("node proxy speaks ZDS version %d; talking V1 to it", hello.version)
        self.version = hello.version
        self.phase = ServerPhase.SNAPSHOT
        self._plan = [*snapshot, SnapshotSent()]
        return self._next_snapshot_request()

    def receive_ack(self, ack: AckMsg) -> list[ServerCommand]:
        request = self.outstanding
        if request is None or self.phase not in (ServerPhase.SNAPSHOT, ServerPhase.STEADY):
            # The node proxy must never speak unasked (istio-cni's keepalive read treats it so).
            return self.fail("ztunnel protocol error, unexpected message")
        self.outstanding = None
        if self.phase is ServerPhase.STEADY:
            return [Acked(request=request, error=ack.error)]
        if ack.error:
            # istio-cni logs snapshot NACKs and goes on: the node proxy retries that pod itself.
            self._nacks.append((_uid(request), ack.error))
        if isinstance(request, SnapshotSent):
            self.phase = ServerPhase.STEADY
            return [SnapshotComplete(sent=self._sent - 1, nacks=tuple(self._nacks))]
        return self._next_snapshot_request()

    def send(self, request: Add | Del) -> list[ServerCommand]:
        """A steady-state update; the shell sends one at a time."""
        if self.phase is not ServerPhase.STEADY or self.busy:
            raise ZdsProtocolError(
                f"cannot send {type(request).__name__} while {self.phase.value}"
                f"{' and busy' if self.busy else ''}"
            )
        self.outstanding = request
        return [SendRequest(request=request)]

    def fail(self, reason: str) -> list[ServerCommand]:
        """Bad input, a deadline, or EOF: this connection is over."""
        self.phase = ServerPhase.CLOSED
        self.close_reason = reason
        return [CloseConnection(reason=reason)]

    def _next_snapshot_request(self) -> list[ServerCommand]:
        request = self._plan.pop(0)
        self._sent += 1
        self.outstanding = request
        return [SendRequest(request=request)]


# --- the asyncio shell -------------------------------------------------------------------------


@dataclass(slots=True)
class _Update:
    request: Add | Del
    done: asyncio.Future[str | None]


class _Connection:
    """One accepted node proxy connection."""

    def __init__(self, number: int, channel: SeqpacketChannel, deadline_s: float) -> None:
        self.number = number
        self.channel = channel
        self.deadline_s = deadline_s
        self.state = ZdsConnectionState()
        self.updates: asyncio.Queue[_Update] = asyncio.Queue(UPDATE_QUEUE_SIZE)
        self.snapshot_done = asyncio.Event()

    def __repr__(self) -> str:
        return f"#{self.number} {self.state.phase.value}"

    async def request(self, request: Request) -> AckMsg:
        """Send one request and read its ack, both within the deadline."""
        await self.channel.send(encode(request), fds_to_send(request), timeout_s=self.deadline_s)
        datagram = await self.channel.recv(self.deadline_s)
        if datagram is None:
            raise EOFError("node proxy closed the connection")
        try:
            return decode_response(datagram.data, datagram.fds, datagram.flags)
        except ZdsProtocolError as e:
            close_fds(e.fds)
            raise

    def fail_queued(self, reason: str) -> None:
        while not self.updates.empty():
            update = self.updates.get_nowait()
            if not update.done.done():
                update.done.set_result(reason)


def _failed(state: ZdsConnectionState, reason: str) -> str:
    """Close the conversation for `reason` and return it (the CloseConnection command's reason)."""
    state.fail(reason)
    return reason


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class ZdsServer:
    """Listens for node proxies on `path` and keeps each one in step with the pod store."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        pods: PodSnapshotSource,
        *,
        deadline_s: float = READ_WRITE_DEADLINE_S,
        accept_rate_per_s: float = ACCEPT_RATE_PER_S,
    ) -> None:
        self.path = Path(path)
        self.pods = pods
        self.deadline_s = deadline_s
        self.accept_interval_s = 1.0 / accept_rate_per_s if accept_rate_per_s > 0 else 0.0
        self._connections: list[_Connection] = []
        self._numbers = itertools.count(1)
        self._listener: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Condition()
        self.accepted = 0
        self.refused = 0  # connections from peers other than root (peer_refusal)

    # -- views -------------------------------------------------------------------------------------

    @property
    def connections(self) -> tuple[str, ...]:
        """`#n phase` of each connected node proxy, oldest first."""
        return tuple(repr(c) for c in self._connections)

    @property
    def connected(self) -> int:
        """istio-cni's `ztunnel_connected` gauge."""
        return len(self._connections)

    def __repr__(self) -> str:
        state = "listening" if self._listener is not None else "stopped"
        proxies = ", ".join(self.connections) or "none"
        return f"<ZdsServer {self.path} {state}: {self.connected} node proxies [{proxies}]>"

    async def wait_connected(self, count: int = 1) -> None:
        """Until at least `count` node proxies have taken their snapshot."""
        async with self._changed:
            await self._changed.wait_for(
                lambda: sum(c.state.phase is ServerPhase.STEADY for c in self._connections) >= count
            )

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Create the socket directory, remove a stale socket file, listen, and accept."""
        if self._listener is not None:
            return
        # The socket hands out pods' network namespaces: its directory is root's alone, checked
        # at every start, and the socket itself 0600 (the peer is checked again at accept).
        private_dir(self.path.parent)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # left over from a previous node agent
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.bind(str(self.path))
            os.chmod(self.path, SOCKET_FILE_MODE)
            sock.listen()
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._listener = sock
        self._task = asyncio.create_task(self._serve(sock), name=f"zds server {self.path}")
        log.info("listening for node proxies on %s", self.path)

    async def stop(self) -> None:
        """Stop accepting, close every connection, remove the socket file."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    async def _serve(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        async with asyncio.TaskGroup() as group:
            while True:
                readable: asyncio.Future[None] = loop.create_future()
                loop.add_reader(listener.fileno(), _resolve, readable)
                try:
                    await readable
                finally:
                    loop.remove_reader(listener.fileno())
                try:
                    conn_sock, _ = listener.accept()
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as e:
                    log.error("failed to accept a node proxy connection: %s", e)
                    continue
                refusal = peer_refusal(conn_sock)
                if refusal is not None:
                    # Before a byte is exchanged: a snapshot carries every pod's netns fd.
                    conn_sock.close()
                    self.refused += 1
                    log.warning("refused a node proxy connection: %s", refusal)
                    continue
                conn_sock.setblocking(False)
                self.accepted += 1
                connection = _Connection(next(self._numbers), SeqpacketChannel(conn_sock), self.deadline_s)
                group.create_task(self._handle(connection), name=f"zds connection {connection!r}")
                if self.accept_interval_s:
                    await asyncio.sleep(self.accept_interval_s)

    async def _changed_notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # -- one connection ----------------------------------------------------------------------------

    async def _handle(self, connection: _Connection) -> None:
        # The connection counts from accept on (as istio-cni's), so adds queue behind its snapshot.
        self._connections.append(connection)
        log.info("node proxy %r connected, total connected %d", connection, len(self._connections))
        reason = "closed"
        try:
            reason = await self._converse(connection)
        except asyncio.CancelledError:
            reason = "server stopped"
            raise
        except Exception as e:  # noqa: BLE001 - the crash barrier of one connection
            log.exception("node proxy connection %r failed", connection)
            reason = f"internal error: {e!r}"
        finally:
            if connection.state.phase is not ServerPhase.CLOSED:
                connection.state.fail(reason)
            self._connections.remove(connection)
            connection.fail_queued(f"ztunnel connection closed: {reason}")
            connection.channel.close()
            log.info(
                "node proxy #%d disconnected (%s), total connected %d",
                connection.number,
                reason,
                len(self._connections),
            )
            await self._changed_notify()

    async def _converse(self, connection: _Connection) -> str:
        state = connection.state
        try:
            datagram = await connection.channel.recv(self.deadline_s)
        except TimeoutError:
            return _failed(state, f"no hello within {self.deadline_s}s")
        if datagram is None:
            return _failed(state, "node proxy closed the connection before its hello")
        try:
            hello = decode_hello(datagram.data, datagram.fds, datagram.flags)
        except ZdsProtocolError as e:
            close_fds(e.fds)
            return _failed(state, f"bad hello: {e.message}")
        log.info("received hello from node proxy #%d (version %d)", connection.number, hello.version)

        # dup() now, in the same step as reading the snapshot: the store may close its handles later.
        plan = plan_snapshot(
            [(uid, info, None if fd is None else os.dup(fd)) for uid, info, fd in self.pods.snapshot()]
        )
        dups = [fd for request in plan for fd in fds_to_send(request)]
        try:
            commands = state.receive_hello(hello, plan)
            while state.phase is ServerPhase.SNAPSHOT:
                (command,) = commands
                assert isinstance(command, SendRequest)
                ack = await self._roundtrip(connection, command.request)
                if ack is None:
                    return state.close_reason or "closed"
                commands = state.receive_ack(ack)
        finally:
            close_fds(dups)
        (done,) = commands
        if isinstance(done, CloseConnection):
            return done.reason
        assert isinstance(done, SnapshotComplete)
        for uid, error in done.nacks:
            log.error("node proxy #%d refused snapshot pod %s: %s", connection.number, uid, error)
        log.info("snapshot of %d pods sent to node proxy #%d", done.sent, connection.number)
        connection.snapshot_done.set()
        await self._changed_notify()
        return await self._steady(connection)

    async def _roundtrip(self, connection: _Connection, request: Request) -> AckMsg | None:
        """Send and read the ack; None (with the state CLOSED) when the connection is unusable."""
        try:
            return await connection.request(request)
        except TimeoutError:
            connection.state.fail(f"no ack for {type(request).__name__} within {self.deadline_s}s")
        except EOFError as e:
            connection.state.fail(str(e))
        except ZdsProtocolError as e:
            connection.state.fail(e.message)
        except OSError as e:
            connection.state.fail(f"socket error: {e.strerror or e}")
        return None

    async def _steady(self, connection: _Connection) -> str:
        state = connection.state
        while True:
            get = asyncio.ensure_future(connection.updates.get())
            readable = asyncio.ensure_future(connection.channel.wait_readable())
            try:
                await asyncio.wait({get, readable}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                # Wait for the cancellations to land: a watcher still unwinding would remove the
                # reader that the next ack read installs on the same fd.
                pending = {f for f in (get, readable) if not f.done()}
                for f in pending:
                    f.cancel()
                if pending:
                    await asyncio.wait(pending)
            if get.done() and not get.cancelled():
                update = get.result()
                reason = await self._send_update(connection, update)
                if reason is not None:
                    return reason
                continue
            # Readable while idle: the node proxy never speaks unasked, so this is EOF or an error.
            try:
                datagram = connection.channel.try_recv()
            except BlockingIOError:
                continue
            except OSError as e:
                return _failed(state, f"socket error: {e.strerror or e}")
            if datagram is None:
                return _failed(state, "node proxy closed the connection")
            close_fds(datagram.fds)
            return _failed(state, "ztunnel protocol error, unexpected message")

    async def _send_update(self, connection: _Connection, update: _Update) -> str | None:
        """Send one update and resolve its future; a reason when the connection is over."""
        state = connection.state
        (command,) = state.send(update.request)
        assert isinstance(command, SendRequest)
        ack = await self._roundtrip(connection, command.request)
        if ack is None:
            reason = state.close_reason or "closed"
            if not update.done.done():
                update.done.set_result(f"ztunnel connection failed: {reason}")
            return reason
        (acked,) = state.receive_ack(ack)
        if isinstance(acked, CloseConnection):  # pragma: no cover - send() made the ack expected
            update.done.set_result(acked.reason)
            return acked.reason
        assert isinstance(acked, Acked)
        if not update.done.done():
            update.done.set_result(acked.error or None)
        return None

    # -- the node agent's API ----------------------------------------------------------------------

    async def _submit(self, connection: _Connection, request: Add | Del) -> str | None:
        try:
            encode(request)
        except ZdsProtocolError as e:
            return e.message
        done: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        try:
            connection.updates.put_nowait(_Update(request=request, done=done))
        except asyncio.QueueFull:
            return f"ztunnel connection #{connection.number} has {UPDATE_QUEUE_SIZE} updates queued"
        if connection not in self._connections:  # closed while we queued
            return f"ztunnel connection closed: {connection.state.close_reason}"
        return await done

    async def add_workload(self, uid: str, info: ProxyWorkloadInfo, netns_fd: int) -> str | None:
        """Hand a pod to the newest node proxy; None once it acked, else why not (retryable).

        `netns_fd` stays the caller's; it must stay open until this returns.
        """
        if not self._connections:
            return NO_CONNECTION
        connection = self._connections[-1]
        log.info("sending pod add %s (%s) to node proxy %r", uid, info, connection)
        error = await self._submit(connection, Add.of(uid, info, netns_fd))
        if error:
            log.error("failed to add workload %s: %s", uid, error)
        return error

    async def del_workload(self, uid: str) -> str | None:
        """Tell every connected node proxy to stop proxying the pod; None when all acked."""
        connections = list(self._connections)
        results = await asyncio.gather(*(self._submit(c, Del(uid=uid)) for c in connections))
        errors = [f"#{c.number}: {e}" for c, e in zip(connections, results, strict=True) if e]
        return "; ".join(errors) or None


__all__ = [
    "ACCEPT_RATE_PER_S",
    "NO_CONNECTION",
    "READ_WRITE_DEADLINE_S",
    "Acked",
    "CloseConnection",
    "PodSnapshotSource",
    "SendRequest",
    "ServerCommand",
    "ServerPhase",
    "SnapshotComplete",
    "SnapshotEntry",
    "ZdsConnectionState",
    "ZdsServer",
    "plan_snapshot",
]
