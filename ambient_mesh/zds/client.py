"""The node proxy's side of ZDS: which pods to proxy, as told by the node agent.

Counterparts: ztunnel src/inpod/statemanager.rs (`WorkloadProxyManagerState`: snapshot
bookkeeping, idempotent adds, pending retries, readiness) and src/inpod/workloadmanager.rs
(`WorkloadProxyManager`: connect with backoff, hello, one ack per request, retry timer).
Facts: docs/istio-behaviour.md, "ZDS".

`ZdsClientState` is the sans-IO core: decoded requests and proxy start results in, commands out
(start/stop a pod's proxy, send an ack, close an fd, drop the connection). `ZdsClient` is the
asyncio shell: one AF_UNIX SOCK_SEQPACKET connection at a time, reconnecting forever, with the
per-pod proxies behind the `WorkloadProxyManager` protocol.

Ownership of netns fds: the fd of an Add belongs to the state machine until a `CloseFd` command
releases it. `start_proxy` borrows it for the duration of the call (a manager that keeps the
namespace must `os.dup` it); a pod whose start failed keeps its fd while it waits to be retried.

Deliberate difference from ztunnel: a protocol error (Keep after the snapshot, a second
snapshot) NACKs and reconnects, as the spec's error rule says, instead of stopping the manager;
a connection that ended before its snapshot completed backs off before the next attempt so a
node agent that keeps refusing us is not hammered.

Given the node proxy's `Metrics`, the shell keeps `workload_manager_pending_proxy_count` equal to
the pods waiting for a start retry after every batch of commands (ztunnel updates it wherever its
pending set changes); the manager counts active, started and stopped proxies itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ..config import ProxyWorkloadInfo
from ..host.netns import netns_problem
from ..metrics import Metrics, WorkloadManagerMetrics
from .codec import (
    AckMsg,
    Add,
    Del,
    Hello,
    Keep,
    Request,
    SnapshotSent,
    ZdsProtocolError,
    decode_request,
    encode,
    fds_to_send,
    nack_text,
)
from .transport import Datagram, SeqpacketChannel, close_fds

log = logging.getLogger("ambient_mesh.zds.client")

PENDING_RETRY_INTERVAL_S = 5.0
INITIAL_BACKOFF_S = 0.010
MAX_BACKOFF_S = 15.0
ACK_SEND_TIMEOUT_S = 5.0

NetnsId = tuple[int, int]  # (st_dev, st_ino) of the namespace file: equal ids = same namespace


# --- commands --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class SendHello:
    """Announce ourselves: the first datagram on a connection."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SendAck:
    """Answer the request just processed; a non-empty `error` is a NACK."""

    error: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class StartProxy:
    """Start the pod's proxy inside the namespace `netns_fd` refers to, then report with
    `ZdsClientState.start_finished`. `retry` starts answer no request, so they send no ack."""

    uid: str
    info: ProxyWorkloadInfo
    netns_fd: int
    retry: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class StopProxy:
    """Stop the pod's proxy: at once (`graceful=False`, the pod is gone) or after a drain."""

    uid: str
    graceful: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Reconcile:
    """The snapshot is complete: `keep` were mentioned in it, `stop` are stopped (StopProxy follows)."""

    keep: frozenset[str]
    stop: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class CloseFd:
    """A netns fd nobody needs any more."""

    fd: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Disconnect:
    """Drop this connection (after the NACK before it) and reconnect."""

    reason: str


Command = SendHello | SendAck | StartProxy | StopProxy | Reconcile | CloseFd | Disconnect


class ClientPhase(enum.Enum):
    CONNECTING = "connecting"  # no connection to the node agent
    HELLO_SENT = "hello sent"  # connected, hello sent, nothing received yet
    SNAPSHOT = "snapshot"  # receiving the snapshot: add, keep, del
    STEADY = "steady"  # snapshot received: add and del only
    CLOSED = "closed"  # connection dropped after a protocol error, or every proxy drained


@dataclass(slots=True, kw_only=True)
class _Pending:
    info: ProxyWorkloadInfo
    netns_fd: int
    netns_id: NetnsId | None


@dataclass(frozen=True, slots=True, kw_only=True)
class _Running:
    info: ProxyWorkloadInfo
    netns_id: NetnsId | None


# --- the state machine -----------------------------------------------------------------------------


class ZdsClientState:
    """What the node proxy runs, and what it answers, as ZDS requests arrive.

    Running proxies outlive connections: a disconnect changes nothing but readiness, and the next
    snapshot decides which of them stay.
    """

    def __init__(self, *, retry_interval_s: float = PENDING_RETRY_INTERVAL_S) -> None:
        self.retry_interval_s = retry_interval_s
        self.phase = ClientPhase.CONNECTING
        self.connections = 0
        self.last_error: str | None = None
        self.next_retry_at: float | None = None
        self._running: dict[str, _Running] = {}
        self._pending: dict[str, _Pending] = {}
        self._starting: dict[str, tuple[StartProxy, NetnsId | None]] = {}
        self._mentioned: set[str] = set()
        self._drained = False

    # -- views -------------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """ztunnel's rule: the first snapshot of this connection arrived and no pod waits for a retry."""
        return self.phase is ClientPhase.STEADY and not self._pending and not self._starting

    @property
    def running(self) -> dict[str, ProxyWorkloadInfo]:
        return {uid: r.info for uid, r in self._running.items()}

    @property
    def pending(self) -> tuple[str, ...]:
        return tuple(sorted(self._pending))

    def __repr__(self) -> str:
        return (
            f"<ZdsClientState {self.phase.value}: {len(self._running)} running, {len(self._pending)} pending"
            f"{', ready' if self.ready else ''}>"
        )

    # -- connection lifecycle ----------------------------------------------------------------------

    def connected(self) -> list[Command]:
        """A new connection: forget the previous connection's snapshot bookkeeping and pending pods
        (the new snapshot re-sends them), keep every running proxy, say hello."""
        if self._drained or self.phase not in (ClientPhase.CONNECTING, ClientPhase.CLOSED):
            raise ZdsProtocolError(f"connected while {self.phase.value}")
        self.connections += 1
        commands: list[Command] = [CloseFd(fd=p.netns_fd) for p in self._pending.values()]
        self._pending.clear()
        self._mentioned.clear()
        self.next_retry_at = None
        self.phase = ClientPhase.HELLO_SENT
        commands.append(SendHello())
        return commands

    def disconnected(self) -> list[Command]:
        """The connection is gone: not ready; proxies keep running until a new snapshot says otherwise."""
        commands: list[Command] = [CloseFd(fd=start.netns_fd) for start, _ in self._starting.values()]
        self._starting.clear()
        if not self._drained:
            self.phase = ClientPhase.CONNECTING
        return commands

    def drain(self) -> list[Command]:
        """Shutdown: drain every proxy gracefully and release every fd."""
        commands: list[Command] = [StopProxy(uid=uid, graceful=True) for uid in sorted(self._running)]
        commands += [CloseFd(fd=p.netns_fd) for p in self._pending.values()]
        commands += [CloseFd(fd=start.netns_fd) for start, _ in self._starting.values()]
        self._running.clear()
        self._pending.clear()
        self._starting.clear()
        self.next_retry_at = None
        self.phase = ClientPhase.CLOSED
        self._drained = True
        return commands

    # -- requests ----------------------------------------------------------------------------------

    def receive(self, msg: Request, *, netns_id: NetnsId | None = None, now: float = 0.0) -> list[Command]:
        """One decoded request. For an Add, `netns_id` identifies its namespace (the shell fstat()s
        the fd); None means unknown and never matches a running proxy."""
        if self.phase not in (ClientPhase.HELLO_SENT, ClientPhase.SNAPSHOT, ClientPhase.STEADY):
            raise ZdsProtocolError(
                f"request {type(msg).__name__} while {self.phase.value}", fds=fds_to_send(msg)
            )
        if self._starting:
            raise ZdsProtocolError(
                "request while a proxy start is still being reported", fds=fds_to_send(msg)
            )
        if self.phase is ClientPhase.HELLO_SENT:
            self.phase = ClientPhase.SNAPSHOT
        match msg:
            case Add():
                return self._add(msg, netns_id)
            case Keep():
                if self.phase is ClientPhase.STEADY:
                    return self._violation("pod keep received after snapshot")
                self._mentioned.add(msg.uid)
                return [SendAck()]
            case Del():
                return self._del(msg.uid)
            case SnapshotSent():
                if self.phase is ClientPhase.STEADY:
                    return self._violation("pod snapshot received already")
                return self._reconcile()
        raise TypeError(f"not a ZDS request: {msg!r}")

    def receive_invalid(self, error: ZdsProtocolError) -> list[Command]:
        """A datagram that could not be decoded: NACK it and reconnect (its fds are the shell's to close)."""
        return self._violation(f"failure to read message: {error.message}")

    def start_finished(self, uid: str, *, error: str | None, now: float) -> list[Command]:
        """The outcome of a StartProxy. A failure keeps the pod (and its fd) pending for a retry."""
        entry = self._starting.pop(uid, None)
        if entry is None:
            raise ZdsProtocolError(f"start of {uid!r} reported but none was requested")
        start, netns_id = entry
        if error is None:
            self._running[uid] = _Running(info=start.info, netns_id=netns_id)
            commands: list[Command] = [CloseFd(fd=start.netns_fd)]
            if not start.retry:
                commands.append(SendAck())
        else:
            log.warning("failed to start proxy for pod %s (%s): %s", uid, start.info, error)
            self._pending[uid] = _Pending(info=start.info, netns_fd=start.netns_fd, netns_id=netns_id)
            if self.next_retry_at is None:
                self.next_retry_at = now + self.retry_interval_s
            commands = (
                []
                if start.retry
                else [SendAck(error=nack_text(f"failure to start proxy for {uid}: {error}"))]
            )
        if not self._pending:
            self.next_retry_at = None
        return commands

    def retry_due(self, now: float) -> list[Command]:
        """Every pending pod gets another start if the retry time has come."""
        if self.next_retry_at is None or now < self.next_retry_at or self._starting:
            return []
        self.next_retry_at = None
        commands: list[Command] = []
        for uid, pending in sorted(self._pending.items()):
            start = StartProxy(uid=uid, info=pending.info, netns_fd=pending.netns_fd, retry=True)
            self._starting[uid] = (start, pending.netns_id)
            commands.append(start)
        self._pending.clear()
        return commands

    # -- rules -------------------------------------------------------------------------------------

    def _violation(self, reason: str) -> list[Command]:
        self.last_error = reason
        self.phase = ClientPhase.CLOSED
        return [SendAck(error=nack_text(reason)), Disconnect(reason=reason)]

    def _add(self, msg: Add, netns_id: NetnsId | None) -> list[Command]:
        if self.phase is not ClientPhase.STEADY:
            self._mentioned.add(msg.uid)
        commands: list[Command] = []
        running = self._running.get(msg.uid)
        if running is not None:
            if netns_id is not None and running.netns_id == netns_id:
                return [CloseFd(fd=msg.netns_fd), SendAck()]  # idempotent: same pod, same namespace
            # The sandbox was recreated (new namespace): the old proxy serves nothing any more.
            del self._running[msg.uid]
            commands.append(StopProxy(uid=msg.uid, graceful=False))
        stale = self._pending.pop(msg.uid, None)
        if stale is not None:
            commands.append(CloseFd(fd=stale.netns_fd))
        if not self._pending:
            self.next_retry_at = None
        start = StartProxy(uid=msg.uid, info=msg.info, netns_fd=msg.netns_fd)
        self._starting[msg.uid] = (start, netns_id)
        commands.append(start)
        return commands

    def _del(self, uid: str) -> list[Command]:
        self._mentioned.discard(uid)
        commands: list[Command] = []
        if self._running.pop(uid, None) is not None:
            commands.append(StopProxy(uid=uid, graceful=False))
        pending = self._pending.pop(uid, None)
        if pending is not None:
            commands.append(CloseFd(fd=pending.netns_fd))
        if not self._pending:
            self.next_retry_at = None
        commands.append(SendAck())
        return commands

    def _reconcile(self) -> list[Command]:
        keep = frozenset(self._mentioned)
        stop = tuple(sorted(uid for uid in self._running if uid not in keep))
        commands: list[Command] = [Reconcile(keep=keep, stop=stop)]
        for uid in stop:
            del self._running[uid]
            commands.append(StopProxy(uid=uid, graceful=False))
        self._mentioned.clear()
        self.phase = ClientPhase.STEADY
        commands.append(SendAck())
        return commands


# --- netns sanity check ----------------------------------------------------------------------------


def netns_id_of(fd: int) -> NetnsId:
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino)


# --- the asyncio shell -----------------------------------------------------------------------------


class WorkloadProxyManager(Protocol):
    """Starts and stops the per-pod proxies (ztunnel's ProxyFactory behind the inpod state manager)."""

    async def start_proxy(self, uid: str, info: ProxyWorkloadInfo, netns_fd: int) -> None:
        """Open the pod's listeners inside the namespace; raise to report a failure (it is retried).
        `netns_fd` is borrowed for the call: dup it to keep it."""

    async def stop_proxy(self, uid: str, graceful: bool) -> None:
        """Stop the pod's proxy. Called between requests: start the drain and return promptly."""


Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


@dataclass(slots=True)
class _ConnectionOutcome:
    reached_steady: bool = False
    reason: str = field(default="")


class ZdsClient:
    """Keeps one connection to the node agent at `path` and applies what it says to `manager`."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        manager: WorkloadProxyManager,
        *,
        initial_backoff_s: float = INITIAL_BACKOFF_S,
        max_backoff_s: float = MAX_BACKOFF_S,
        retry_interval_s: float = PENDING_RETRY_INTERVAL_S,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
        on_ready_change: Callable[[bool], None] | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.path = Path(path)
        self.manager = manager
        self.state = ZdsClientState(retry_interval_s=retry_interval_s)
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self._sleep = sleep
        self._on_ready_change = on_ready_change
        self._metrics: WorkloadManagerMetrics | None = (
            metrics.workload_manager if metrics is not None else None
        )
        self._ready_event = asyncio.Event()
        self._was_ready = False
        self._channel: SeqpacketChannel | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.connect_failures = 0
        self.last_disconnect: str | None = None

    # -- views -------------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.state.ready

    @property
    def connected(self) -> bool:
        return self._channel is not None

    async def wait_ready(self) -> None:
        await self._ready_event.wait()

    def dump(self) -> dict[str, object]:
        """The inpod section of /config_dump: connection phase and each pod's proxy state."""
        pods: dict[str, dict[str, str]] = {}
        for uid, info in self.state.running.items():
            pods[uid] = {"state": "Up", "info": str(info)}
        for uid in self.state.pending:
            pods[uid] = {"state": "Pending"}
        return {"path": str(self.path), "phase": self.state.phase.value, "ready": self.ready, "pods": pods}

    def __repr__(self) -> str:
        link = "connected" if self.connected else "disconnected"
        return (
            f"<ZdsClient {self.path} {link}, {self.state.phase.value}: {len(self.state.running)} running, "
            f"{len(self.state.pending)} pending, {'ready' if self.ready else 'not ready'}>"
        )

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> asyncio.Task[None]:
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name=f"zds client {self.path}")
        return self._task

    async def close(self, *, drain: bool = True) -> None:
        """Stop talking to the node agent; with `drain`, stop every proxy gracefully (shutdown)."""
        self._closing = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        commands = self.state.drain() if drain else self.state.disconnected()
        stops = [c for c in commands if isinstance(c, StopProxy)]
        close_fds([c.fd for c in commands if isinstance(c, CloseFd)])
        await asyncio.gather(*(self._stop(c) for c in stops))
        self._notify_ready()

    async def run(self) -> None:
        """Connect, serve, reconnect: until closed."""
        backoff = self.initial_backoff_s
        while not self._closing:
            try:
                sock = self._connect()
            except OSError as e:
                self.connect_failures += 1
                log.warning(
                    "failed to connect to the node agent over %s, is the node agent healthy? (%s); "
                    "retrying in %.3fs",
                    self.path,
                    e.strerror or e,
                    backoff,
                )
                await self._sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)
                continue
            outcome = await self._serve(sock)
            if self._closing:
                return
            self.last_disconnect = outcome.reason
            if outcome.reached_steady:
                backoff = self.initial_backoff_s
            log.warning(
                "connection to the node agent over %s ended (%s); reconnecting in %.3fs, "
                "is the node agent healthy?",
                self.path,
                outcome.reason,
                backoff,
            )
            await self._sleep(backoff)
            if not outcome.reached_steady:
                backoff = min(backoff * 2, self.max_backoff_s)

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.setblocking(False)
            # A Unix-domain connect completes at once or fails (EAGAIN: the backlog is full).
            sock.connect(str(self.path))
        except OSError:
            sock.close()
            raise
        return sock

    # -- one connection ----------------------------------------------------------------------------

    async def _serve(self, sock: socket.socket) -> _ConnectionOutcome:
        channel = SeqpacketChannel(sock)
        self._channel = channel
        outcome = _ConnectionOutcome()
        try:
            log.info("connected to the node agent over %s", self.path)
            if await self._execute(channel, self.state.connected()):
                outcome.reason = "could not send the hello"
                return outcome
            while True:
                timeout = None
                if self.state.next_retry_at is not None:
                    timeout = max(0.0, self.state.next_retry_at - self._clock())
                if not await channel.wait_readable(timeout):
                    if await self._execute(channel, self.state.retry_due(self._clock())):
                        outcome.reason = "connection failed during a retry"
                        return outcome
                    continue
                try:
                    datagram = channel.try_recv()
                except BlockingIOError:
                    continue
                if datagram is None:
                    outcome.reason = "node agent closed the connection"
                    return outcome
                stop = await self._execute(channel, self._receive(datagram))
                if self.state.phase is ClientPhase.STEADY:
                    outcome.reached_steady = True
                if stop:
                    outcome.reason = self.state.last_error or "connection failed"
                    return outcome
        except OSError as e:
            outcome.reason = f"socket error: {e.strerror or e}"
            return outcome
        finally:
            self._channel = None
            channel.close()
            close_fds([c.fd for c in self.state.disconnected() if isinstance(c, CloseFd)])
            self._notify_ready()

    def _receive(self, datagram: Datagram) -> list[Command]:
        try:
            msg = decode_request(datagram.data, datagram.fds, datagram.flags)
        except ZdsProtocolError as e:
            close_fds(e.fds)
            log.error("invalid request from the node agent: %s", e.message)
            return self.state.receive_invalid(e)
        log.info("received %s", msg)
        netns_id = None
        if isinstance(msg, Add):
            problem = netns_problem(msg.netns_fd)
            if problem is not None:
                # ztunnel only logs this: it catches node agent bugs during development.
                log.warning("netns fd for pod %s is %s", msg.uid, problem)
            with contextlib.suppress(OSError):
                netns_id = netns_id_of(msg.netns_fd)
        return self.state.receive(msg, netns_id=netns_id, now=self._clock())

    async def _execute(self, channel: SeqpacketChannel, commands: list[Command]) -> bool:
        """Carry out commands in order; True when the connection must be dropped."""
        queue = list(commands)
        drop = False
        while queue:
            command = queue.pop(0)
            match command:
                case SendHello():
                    await channel.send(encode(Hello()), timeout_s=ACK_SEND_TIMEOUT_S)
                case SendAck():
                    await channel.send(encode(AckMsg(error=command.error)), timeout_s=ACK_SEND_TIMEOUT_S)
                case StartProxy():
                    error = await self._start(command)
                    queue[:0] = self.state.start_finished(command.uid, error=error, now=self._clock())
                case StopProxy():
                    await self._stop(command)
                case Reconcile():
                    log.info(
                        "snapshot complete: keeping %d pods, stopping %d (%s)",
                        len(command.keep),
                        len(command.stop),
                        ", ".join(command.stop) or "none",
                    )
                case CloseFd():
                    close_fds([command.fd])
                case Disconnect():
                    drop = True
        self._notify_ready()
        return drop

    async def _start(self, command: StartProxy) -> str | None:
        try:
            await self.manager.start_proxy(command.uid, command.info, command.netns_fd)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure to start is a NACK and a retry, never a crash
            return str(e) or type(e).__name__
        log.info("proxy for pod %s (%s) started", command.uid, command.info)
        return None

    async def _stop(self, command: StopProxy) -> None:
        try:
            await self.manager.stop_proxy(command.uid, command.graceful)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a failed stop must not take the connection down
            log.exception("stopping the proxy for pod %s failed", command.uid)

    def _notify_ready(self) -> None:
        # Called after every change to the state machine, so the pending gauge follows it here too.
        if self._metrics is not None:
            self._metrics.set_pending(len(self.state.pending))
        ready = self.state.ready
        if ready == self._was_ready:
            return
        self._was_ready = ready
        if ready:
            self._ready_event.set()
        else:
            self._ready_event.clear()
        log.info("workload proxy manager is %s", "ready" if ready else "NOT ready")
        if self._on_ready_change is not None:
            self._on_ready_change(ready)


__all__ = [
    "PENDING_RETRY_INTERVAL_S",
    "ClientPhase",
    "CloseFd",
    "Command",
    "Datagram",
    "Disconnect",
    "NetnsId",
    "Reconcile",
    "SendAck",
    "SendHello",
    "SeqpacketChannel",
    "StartProxy",
    "StopProxy",
    "WorkloadProxyManager",
    "ZdsClient",
    "ZdsClientState",
    "close_fds",
    "netns_id_of",
]
