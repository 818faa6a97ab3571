"""SecretManager: one workload certificate per identity, fetched once, refreshed at half life.

Counterpart: ztunnel src/identity/manager.rs. Behaviour carried over:
- one cached certificate per identity; concurrent callers share a single CA call;
- at most 8 CA calls in flight, admitted by priority (a waiting connection before a warm-up
  prefetch before a background refresh);
- refresh at half the lifetime; on failure retry with exponential backoff (500 ms, x2, 20%
  jitter, capped at 150 s) and keep serving the old certificate until it expires.

The timing decisions are pure functions (`refresh_delay_s`, `backoff_delay_s`); the clock, the
sleep and the jitter source are injected so tests never wait real seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime

from ..errors import IdentityError
from .ca import CaClient
from .certificate import WorkloadCertificate, to_utc
from .spiffe import Identity

MAX_IN_FLIGHT = 8
BACKOFF_INITIAL_S = 0.5
BACKOFF_MULTIPLIER = 2.0
BACKOFF_JITTER = 0.2
BACKOFF_MAX_S = 150.0

CA_HINT = (
    "is the CA reachable? check CA_ADDRESS and the node's token, or set FAKE_CA=true for a local test CA"
)


class Priority(enum.IntEnum):
    """Higher is served first when more than MAX_IN_FLIGHT fetches wait."""

    BACKGROUND = 0  # refresh of a certificate we still hold
    WARMUP = 1  # prefetch for a workload that has no connection yet
    REAL_TIME = 2  # a connection is waiting for this certificate


@dataclass(frozen=True, slots=True, kw_only=True)
class CertificateState:
    """One line of /config_dump's certificate view."""

    identity: Identity
    state: str  # "Initializing", "Available" or "Unavailable: <reason>"
    cert: WorkloadCertificate | None


def refresh_delay_s(cert: WorkloadCertificate, now: datetime) -> float:
    """Seconds until `cert` should be renewed (zero when already due)."""
    return max(0.0, (cert.refresh_at - now).total_seconds())


def backoff_delay_s(failures: int, jitter: float) -> float:
    """Delay before retry number `failures` (1-based); `jitter` in [0, 1) spreads it +-20%."""
    exponent = min(max(failures - 1, 0), 32)  # 0.5 s * 2**9 already exceeds the cap
    base = min(BACKOFF_INITIAL_S * BACKOFF_MULTIPLIER**exponent, BACKOFF_MAX_S)
    return min(base * (1.0 + BACKOFF_JITTER * (2.0 * jitter - 1.0)), BACKOFF_MAX_S)


class _CertSlot:
    """Mutable per-identity bookkeeping, owned by the SecretManager and its worker task."""

    __slots__ = (
        "identity",
        "cert",
        "error",
        "priority",
        "seq",
        "future",
        "changed",
        "wake",
        "task",
        "closed",
    )

    def __init__(self, identity: Identity, priority: Priority) -> None:
        self.identity = identity
        self.cert: WorkloadCertificate | None = None
        self.error: Exception | None = None
        self.priority = priority
        # Gate bookkeeping while queued for a CA call slot.
        self.seq = 0
        self.future: asyncio.Future[None] | None = None
        # Set and cleared after every fetch attempt: wakes everyone waiting for an outcome.
        self.changed = asyncio.Event()
        # Cuts the worker's sleep short (a caller found the certificate expired early).
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.closed = False


class _FetchGate:
    """At most `limit` CA calls at once; queued fetches are admitted most urgent first, then FIFO."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        self._queue: list[_CertSlot] = []
        self._seq = itertools.count()

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def acquire(self, slot: _CertSlot) -> None:
        if self.in_flight < self.limit and not self._queue:
            self.in_flight += 1
            return
        slot.seq = next(self._seq)
        slot.future = asyncio.get_running_loop().create_future()
        self._queue.append(slot)
        try:
            await slot.future
        except asyncio.CancelledError:
            if slot.future.done() and not slot.future.cancelled():
                self.release()  # admitted just before being cancelled: pass the slot on
            else:
                self._queue.remove(slot)
            raise
        finally:
            slot.future = None

    def release(self) -> None:
        self.in_flight -= 1
        while self.in_flight < self.limit:
            # A queued fetch whose task was cancelled keeps its place until that task runs
            # its handler; it must not be admitted meanwhile.
            ready = [s for s in self._queue if s.future is not None and not s.future.done()]
            if not ready:
                return
            # Priority can rise while queued (a connection starts waiting on a prefetch), so
            # the choice is made at admission time rather than by a heap built at enqueue.
            best = max(ready, key=lambda s: (s.priority, -s.seq))
            self._queue.remove(best)
            self.in_flight += 1
            assert best.future is not None
            best.future.set_result(None)


class SecretManager:
    def __init__(
        self,
        ca_client: CaClient,
        *,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        jitter: Callable[[], float] = random.random,
        max_in_flight: int = MAX_IN_FLIGHT,
    ) -> None:
        self._ca = ca_client
        self._clock = clock
        self._sleep = sleep
        self._jitter = jitter
        self._gate = _FetchGate(max_in_flight)
        self._slots: dict[Identity, _CertSlot] = {}
        self._closed = False

    def __repr__(self) -> str:
        states = self.certificates()
        available = sum(s.state == "Available" for s in states)
        pending = sum(s.state == "Initializing" for s in states)
        unavailable = len(states) - available - pending
        text = f"SecretManager({len(states)} certificates: {available} available, {pending} pending"
        if unavailable:
            text += f", {unavailable} unavailable"
        return text + ")"

    @property
    def in_flight(self) -> int:
        """CA calls running now."""
        return self._gate.in_flight

    @property
    def queued(self) -> int:
        """Fetches waiting for one of the in-flight slots."""
        return self._gate.queued

    async def fetch_certificate(
        self, identity: Identity, priority: Priority = Priority.REAL_TIME
    ) -> WorkloadCertificate:
        """The current certificate for `identity`, fetching it first if need be.

        Raises IdentityError when no unexpired certificate exists and the last fetch failed.
        """
        slot = self._start(identity, priority)
        while True:
            now = to_utc(self._clock())
            if slot.cert is not None and not slot.cert.is_expired(now):
                return slot.cert
            if slot.closed:
                raise IdentityError(
                    f"certificate for {identity} was forgotten while a connection waited for it"
                )
            if slot.error is not None:
                raise IdentityError(
                    f"could not fetch a certificate for {identity}: {slot.error}", hint=CA_HINT
                ) from slot.error
            if slot.cert is not None:
                # Expired without a failed refresh: the process slept past the refresh time.
                slot.wake.set()
            slot.priority = max(slot.priority, priority)
            await slot.changed.wait()

    def prefetch(self, identity: Identity) -> None:
        """Start fetching in the background (ztunnel: Warmup for each local HBONE workload)."""
        self._start(identity, Priority.WARMUP)

    def forget(self, identity: Identity) -> None:
        """Drop the certificate and stop refreshing it (the last local workload left)."""
        slot = self._slots.pop(identity, None)
        if slot is not None:
            self._stop(slot)

    def certificates(self) -> list[CertificateState]:
        now = to_utc(self._clock())
        return [self._describe(slot, now) for _, slot in sorted(self._slots.items())]

    async def close(self) -> None:
        self._closed = True
        slots = list(self._slots.values())
        self._slots.clear()
        for slot in slots:
            self._stop(slot)
        tasks = [s.task for s in slots if s.task is not None]
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _start(self, identity: Identity, priority: Priority) -> _CertSlot:
        if self._closed:
            # A task started now would outlive the proxy that closed us.
            raise IdentityError(f"cannot fetch a certificate for {identity}: the SecretManager is closed")
        slot = self._slots.get(identity)
        if slot is None:
            slot = _CertSlot(identity, priority)
            self._slots[identity] = slot
            slot.task = asyncio.get_running_loop().create_task(
                self._run(slot), name=f"SecretManager refresh {identity}"
            )
        else:
            slot.priority = max(slot.priority, priority)
        return slot

    def _stop(self, slot: _CertSlot) -> None:
        slot.closed = True
        if slot.task is not None:
            slot.task.cancel()
        slot.changed.set()

    @staticmethod
    def _describe(slot: _CertSlot, now: datetime) -> CertificateState:
        if slot.cert is not None and not slot.cert.is_expired(now):
            state = "Available"
        elif slot.error is not None:
            state = f"Unavailable: {slot.error}"
        elif slot.cert is not None:
            state = "Unavailable: certificate expired, refresh pending"
        else:
            state = "Initializing"
        return CertificateState(identity=slot.identity, state=state, cert=slot.cert)

    async def _run(self, slot: _CertSlot) -> None:
        failures = 0
        while True:
            try:
                cert = await self._fetch_once(slot)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - any CA client failure is retried with backoff
                slot.error = e
                failures += 1
                delay = backoff_delay_s(failures, self._jitter())
            else:
                slot.cert, slot.error, failures = cert, None, 0
                delay = refresh_delay_s(cert, to_utc(self._clock()))
            slot.changed.set()
            slot.changed.clear()
            slot.priority = Priority.BACKGROUND
            await self._nap(slot, delay)

    async def _fetch_once(self, slot: _CertSlot) -> WorkloadCertificate:
        await self._gate.acquire(slot)
        try:
            cert = await self._ca.fetch_certificate(slot.identity)
        finally:
            self._gate.release()
        if cert.identity != slot.identity:
            raise IdentityError(f"CA client returned a certificate for {cert.identity}, not {slot.identity}")
        return cert

    async def _nap(self, slot: _CertSlot, delay_s: float) -> None:
        slot.wake.clear()
        sleeper = asyncio.ensure_future(self._sleep(delay_s))
        waker = asyncio.ensure_future(slot.wake.wait())
        try:
            await asyncio.wait({sleeper, waker}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeper.cancel()
            waker.cancel()
