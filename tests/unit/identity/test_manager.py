"""SecretManager: caching, shared fetches, the in-flight limit, priorities, refresh and backoff.

The CA client, clock and sleep are fakes: each CA call waits until the test answers it, and
each sleep waits until the test ends it, so nothing here waits real time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ambient_mesh.errors import IdentityError
from ambient_mesh.identity import (
    CertificateAuthority,
    Identity,
    Priority,
    SecretManager,
    WorkloadCertificate,
)
from ambient_mesh.identity.manager import backoff_delay_s, refresh_delay_s

T0 = datetime(2030, 6, 1, 12, 0, 0, tzinfo=UTC)
TTL_S = 100
ALICE = Identity("cluster.local", "ns1", "alice")
BOB = Identity("cluster.local", "ns1", "bob")


def ident(n: int) -> Identity:
    return Identity("cluster.local", "ns1", f"sa{n}")


class FakeClock:
    def __init__(self) -> None:
        self.now = T0.timestamp()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeSleep:
    """Records each requested delay; the sleep ends when the test calls `finish`."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, asyncio.Future[None]]] = []

    async def __call__(self, delay_s: float) -> None:
        future = asyncio.get_running_loop().create_future()
        self.calls.append((delay_s, future))
        await future

    @property
    def delays(self) -> list[float]:
        return [d for d, _ in self.calls]

    def finish(self, index: int = -1) -> None:
        self.calls[index][1].set_result(None)


class ScriptedCa:
    """A CA client whose calls wait until the test answers them with a cert or an error."""

    def __init__(self, ca: CertificateAuthority, clock: FakeClock) -> None:
        self.ca = ca
        self.clock = clock
        self.pending: list[tuple[Identity, asyncio.Future[WorkloadCertificate]]] = []
        self.calls: list[Identity] = []
        self.cancelled = 0

    async def fetch_certificate(self, identity: Identity) -> WorkloadCertificate:
        future: asyncio.Future[WorkloadCertificate] = asyncio.get_running_loop().create_future()
        self.calls.append(identity)
        self.pending.append((identity, future))
        try:
            return await future
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.pending = [(i, f) for i, f in self.pending if f is not future]

    def issue(self, identity: Identity) -> WorkloadCertificate:
        return self.ca.issue(identity, TTL_S, now=datetime.fromtimestamp(self.clock(), UTC))

    def answer(self, identity: Identity | None = None, *, error: Exception | None = None) -> None:
        """Complete the oldest pending call (for `identity`, if given)."""
        for who, future in self.pending:
            if not future.done() and (identity is None or who == identity):
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(self.issue(who))
                return
        raise AssertionError(f"no pending CA call for {identity}")

    @property
    def pending_ids(self) -> list[Identity]:
        return [i for i, f in self.pending if not f.done()]


async def until(condition: Callable[[], bool]) -> None:
    """Let the event loop run until `condition` holds (a bounded number of turns, no clock)."""
    for _ in range(200):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never became true")


@pytest.fixture(scope="module")
def test_ca() -> CertificateAuthority:
    return CertificateAuthority.self_signed("cluster.local", now=T0 - timedelta(days=1))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def sleep() -> FakeSleep:
    return FakeSleep()


@pytest.fixture
def ca(test_ca: CertificateAuthority, clock: FakeClock) -> ScriptedCa:
    return ScriptedCa(test_ca, clock)


@pytest.fixture
async def manager(ca: ScriptedCa, clock: FakeClock, sleep: FakeSleep):  # type: ignore[no-untyped-def]
    mgr = SecretManager(ca, clock=clock, sleep=sleep, jitter=lambda: 0.5)
    yield mgr
    await mgr.close()


# Pure timing decisions


def test_backoff_doubles_from_half_a_second_up_to_150_s() -> None:
    delays = [backoff_delay_s(n, 0.5) for n in range(1, 12)]

    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 150.0, 150.0]
    assert backoff_delay_s(10_000, 0.5) == 150.0


def test_backoff_jitter_is_plus_minus_20_percent() -> None:
    assert backoff_delay_s(3, 0.0) == pytest.approx(1.6)
    assert backoff_delay_s(3, 0.999999) == pytest.approx(2.4, rel=1e-5)


@given(st.integers(min_value=1, max_value=10_000), st.floats(min_value=0.0, max_value=1.0, exclude_max=True))
def test_backoff_stays_within_bounds(failures: int, jitter: float) -> None:
    delay = backoff_delay_s(failures, jitter)

    assert 0.4 <= delay <= 150.0


def test_refresh_delay_is_time_to_half_life(test_ca: CertificateAuthority) -> None:
    cert = test_ca.issue(ALICE, TTL_S, now=T0)

    assert refresh_delay_s(cert, T0) == 50.0
    assert refresh_delay_s(cert, T0 + timedelta(seconds=20)) == 30.0
    assert refresh_delay_s(cert, T0 + timedelta(seconds=70)) == 0.0


# Fetching and caching


async def test_fetch_is_cached(manager: SecretManager, ca: ScriptedCa) -> None:
    task = asyncio.create_task(manager.fetch_certificate(ALICE))
    await until(lambda: ca.pending_ids == [ALICE])
    assert repr(manager) == "SecretManager(1 certificates: 0 available, 1 pending)"

    ca.answer(ALICE)
    first = await task
    second = await manager.fetch_certificate(ALICE)

    assert second is first
    assert ca.calls == [ALICE]
    assert repr(manager) == "SecretManager(1 certificates: 1 available, 0 pending)"
    assert [(s.identity, s.state, s.cert) for s in manager.certificates()] == [(ALICE, "Available", first)]


async def test_concurrent_fetches_share_one_ca_call(manager: SecretManager, ca: ScriptedCa) -> None:
    tasks = [asyncio.create_task(manager.fetch_certificate(ALICE)) for _ in range(5)]
    await until(lambda: len(ca.pending_ids) == 1)

    ca.answer(ALICE)
    results = await asyncio.gather(*tasks)

    assert ca.calls == [ALICE]
    assert all(r is results[0] for r in results)


async def test_at_most_eight_ca_calls_in_flight(manager: SecretManager, ca: ScriptedCa) -> None:
    tasks = [asyncio.create_task(manager.fetch_certificate(ident(n))) for n in range(20)]
    await until(lambda: len(ca.pending_ids) == 8)
    for _ in range(5):
        await asyncio.sleep(0)

    assert len(ca.pending) == 8
    assert (manager.in_flight, manager.queued) == (8, 12)
    assert repr(manager) == "SecretManager(20 certificates: 0 available, 20 pending)"

    ca.answer(ident(0))
    await until(lambda: len(ca.calls) == 9)
    assert len(ca.pending) == 8
    assert (manager.in_flight, manager.queued) == (8, 11)

    while ca.pending:
        ca.answer()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    certs = await asyncio.gather(*tasks)
    assert [c.identity for c in certs] == [ident(n) for n in range(20)]
    assert len(ca.calls) == 20
    assert (manager.in_flight, manager.queued) == (0, 0)


async def test_queued_fetches_are_served_by_priority(
    ca: ScriptedCa, clock: FakeClock, sleep: FakeSleep
) -> None:
    mgr = SecretManager(ca, clock=clock, sleep=sleep, jitter=lambda: 0.5, max_in_flight=1)
    try:
        # ALICE holds a certificate whose refresh is due: that refresh is BACKGROUND work.
        first = asyncio.create_task(mgr.fetch_certificate(ALICE))
        await until(lambda: ca.pending_ids == [ALICE])
        ca.answer(ALICE)
        await first
        await until(lambda: len(sleep.calls) == 1)

        blocker = asyncio.create_task(mgr.fetch_certificate(BOB))
        await until(lambda: ca.pending_ids == [BOB])
        clock.advance(50)
        sleep.finish(0)  # ALICE's refresh now queues behind BOB
        mgr.prefetch(ident(1))  # WARMUP
        waiting = [asyncio.create_task(mgr.fetch_certificate(ident(n))) for n in (2, 3)]  # REAL_TIME
        warm = asyncio.create_task(mgr.fetch_certificate(ident(4), Priority.WARMUP))
        await until(lambda: mgr.queued == 5)

        order = []
        ca.answer(BOB)
        for _ in range(5):
            await until(lambda: len(ca.pending_ids) == 1)
            order.append(ca.pending_ids[0])
            ca.answer()
        await asyncio.gather(blocker, warm, *waiting)

        assert order == [ident(2), ident(3), ident(1), ident(4), ALICE]
    finally:
        await mgr.close()


async def test_a_waiting_connection_raises_a_queued_prefetch_to_real_time(
    ca: ScriptedCa, clock: FakeClock, sleep: FakeSleep
) -> None:
    mgr = SecretManager(ca, clock=clock, sleep=sleep, max_in_flight=1)
    try:
        mgr.prefetch(ALICE)
        await until(lambda: ca.pending_ids == [ALICE])
        mgr.prefetch(ident(1))
        mgr.prefetch(ident(2))
        await until(lambda: mgr.queued == 2)
        waiter = asyncio.create_task(mgr.fetch_certificate(ident(2)))
        await asyncio.sleep(0)

        ca.answer(ALICE)
        await until(lambda: ca.pending_ids != [] and ca.pending_ids != [ALICE])

        assert ca.pending_ids == [ident(2)]
        ca.answer()
        assert (await waiter).identity == ident(2)
    finally:
        await mgr.close()


async def test_prefetch_fetches_in_the_background(manager: SecretManager, ca: ScriptedCa) -> None:
    manager.prefetch(ALICE)
    await until(lambda: ca.pending_ids == [ALICE])
    ca.answer(ALICE)
    await until(lambda: manager.certificates()[0].state == "Available")

    cert = await manager.fetch_certificate(ALICE)

    assert cert.identity == ALICE
    assert ca.calls == [ALICE]


# Refresh and backoff


async def test_refresh_at_half_life(
    manager: SecretManager, ca: ScriptedCa, clock: FakeClock, sleep: FakeSleep
) -> None:
    task = asyncio.create_task(manager.fetch_certificate(ALICE))
    await until(lambda: len(ca.pending_ids) == 1)
    ca.answer(ALICE)
    old = await task
    await until(lambda: len(sleep.calls) == 1)
    assert sleep.delays == [50.0]

    clock.advance(50)
    sleep.finish()
    await until(lambda: len(ca.pending_ids) == 1)
    assert await manager.fetch_certificate(ALICE) is old  # still served while the refresh runs
    ca.answer(ALICE)
    await until(lambda: len(sleep.calls) == 2)

    new = await manager.fetch_certificate(ALICE)
    assert new.serial_number != old.serial_number
    assert new.not_before == old.not_before + timedelta(seconds=50)
    assert sleep.delays == [50.0, 50.0]
    assert ca.calls == [ALICE, ALICE]


async def test_failed_refresh_backs_off_and_keeps_serving_the_old_cert(
    manager: SecretManager, ca: ScriptedCa, clock: FakeClock, sleep: FakeSleep
) -> None:
    task = asyncio.create_task(manager.fetch_certificate(ALICE))
    await until(lambda: len(ca.pending_ids) == 1)
    ca.answer(ALICE)
    old = await task
    await until(lambda: len(sleep.calls) == 1)

    clock.advance(50)
    for attempt in range(3):
        sleep.finish()
        await until(lambda: len(ca.pending_ids) == 1)
        ca.answer(error=ConnectionError("istiod:15012 unreachable"))
        await until(lambda n=attempt: len(sleep.calls) == n + 2)
        clock.advance(sleep.delays[-1])
        assert await manager.fetch_certificate(ALICE) is old

    assert sleep.delays == [50.0, 0.5, 1.0, 2.0]
    assert manager.certificates()[0].state == "Available"

    # Once the old certificate expires, callers get the failure.
    clock.now = old.not_after.timestamp()
    with pytest.raises(
        IdentityError, match=r"could not fetch a certificate for .*alice: istiod:15012 unreachable"
    ) as info:
        await manager.fetch_certificate(ALICE)
    assert "is the CA reachable?" in str(info.value)
    assert isinstance(info.value.__cause__, ConnectionError)
    assert manager.certificates()[0].state == "Unavailable: istiod:15012 unreachable"
    assert repr(manager) == "SecretManager(1 certificates: 0 available, 0 pending, 1 unavailable)"

    # A success resets the backoff and schedules the next refresh at half life again.
    sleep.finish()
    await until(lambda: len(ca.pending_ids) == 1)
    ca.answer(ALICE)
    await until(lambda: len(sleep.calls) == 5)
    assert sleep.delays[-1] == 50.0
    assert (await manager.fetch_certificate(ALICE)).serial_number != old.serial_number


async def test_first_fetch_failure_raises_with_a_hint(
    manager: SecretManager, ca: ScriptedCa, sleep: FakeSleep
) -> None:
    task = asyncio.create_task(manager.fetch_certificate(ALICE))
    await until(lambda: len(ca.pending_ids) == 1)
    ca.answer(error=ConnectionRefusedError("connect refused"))

    with pytest.raises(IdentityError, match="connect refused") as info:
        await task
    assert info.value.hint is not None and "CA reachable" in info.value.hint
    await until(lambda: len(sleep.calls) == 1)
    assert sleep.delays == [0.5]
    assert ca.calls == [ALICE]  # the retry waits for the backoff, not for the next caller

    sleep.finish()
    await until(lambda: len(ca.pending_ids) == 1)
    ca.answer(ALICE)
    await until(lambda: manager.certificates()[0].state == "Available")
    assert (await manager.fetch_certificate(ALICE)).identity == ALICE


async def test_a_cert_for_the_wrong_identity_is_a_failure(clock: FakeClock, sleep: FakeSleep) -> None:
    test_ca = CertificateAuthority.self_signed("cluster.local", now=T0 - timedelta(days=1))

    class WrongCa:
        async def fetch_certificate(self, identity: Identity) -> WorkloadCertificate:
            return test_ca.issue(BOB, TTL_S, now=T0)

    mgr = SecretManager(WrongCa(), clock=clock, sleep=sleep)
    try:
        with pytest.raises(IdentityError, match="returned a certificate for .*bob, not .*alice"):
            await mgr.fetch_certificate(ALICE)
    finally:
        await mgr.close()


async def test_expired_cert_without_failure_triggers_an_immediate_refresh(
    manager: SecretManager, ca: ScriptedCa, clock: FakeClock, sleep: FakeSleep
) -> None:
    task = asyncio.create_task(manager.fetch_certificate(ALICE))
    await until(lambda: len(ca.pending_ids) == 1)
    ca.answer(ALICE)
    old = await task
    await until(lambda: len(sleep.calls) == 1)

    clock.advance(500)  # the host was suspended past the whole lifetime
    waiter = asyncio.create_task(manager.fetch_certificate(ALICE))
    await until(lambda: len(ca.pending_ids) == 1)
    assert sleep.calls[0][1].cancelled()
    ca.answer(ALICE)

    new = await waiter
    assert new.serial_number != old.serial_number
    assert not new.is_expired(datetime.fromtimestamp(clock(), UTC))


# Forget and close


async def test_forget_drops_the_cert_and_stops_refreshing(
    manager: SecretManager, ca: ScriptedCa, sleep: FakeSleep
) -> None:
    task = asyncio.create_task(manager.fetch_certificate(ALICE))
    await until(lambda: len(ca.pending_ids) == 1)
    ca.answer(ALICE)
    old = await task
    await until(lambda: len(sleep.calls) == 1)

    manager.forget(ALICE)
    await until(lambda: sleep.calls[0][1].cancelled())

    assert manager.certificates() == []
    assert repr(manager) == "SecretManager(0 certificates: 0 available, 0 pending)"
    again = asyncio.create_task(manager.fetch_certificate(ALICE))
    await until(lambda: len(ca.pending_ids) == 1)
    ca.answer(ALICE)
    assert (await again).serial_number != old.serial_number
    assert ca.calls == [ALICE, ALICE]


async def test_forget_while_fetching_fails_the_waiters_and_frees_the_slot(
    ca: ScriptedCa, clock: FakeClock, sleep: FakeSleep
) -> None:
    mgr = SecretManager(ca, clock=clock, sleep=sleep, max_in_flight=1)
    try:
        waiter = asyncio.create_task(mgr.fetch_certificate(ALICE))
        queued = asyncio.create_task(mgr.fetch_certificate(BOB))
        await until(lambda: ca.pending_ids == [ALICE] and mgr.queued == 1)

        mgr.forget(BOB)  # queued: leaves the queue
        mgr.forget(ALICE)  # in flight: the CA call is cancelled and its slot freed

        with pytest.raises(IdentityError, match="forgotten"):
            await waiter
        with pytest.raises(IdentityError, match="forgotten"):
            await queued
        await until(lambda: ca.cancelled == 1)
        assert (mgr.in_flight, mgr.queued) == (0, 0)
        third = asyncio.create_task(mgr.fetch_certificate(ident(3)))
        await until(lambda: ca.pending_ids == [ident(3)])
        ca.answer()
        assert (await third).identity == ident(3)
    finally:
        await mgr.close()


async def test_close_cancels_refresh_and_fetch_tasks(
    ca: ScriptedCa, clock: FakeClock, sleep: FakeSleep
) -> None:
    mgr = SecretManager(ca, clock=clock, sleep=sleep)
    task = asyncio.create_task(mgr.fetch_certificate(ALICE))
    await until(lambda: len(ca.pending_ids) == 1)
    ca.answer(ALICE)
    await task
    await until(lambda: len(sleep.calls) == 1)
    mgr.prefetch(BOB)
    await until(lambda: ca.pending_ids == [BOB])

    await mgr.close()

    assert sleep.calls[0][1].cancelled()
    assert ca.cancelled == 1
    assert ca.pending == []
    assert mgr.certificates() == []
    with pytest.raises(IdentityError, match="SecretManager is closed"):
        await mgr.fetch_certificate(ALICE)
    with pytest.raises(IdentityError, match="SecretManager is closed"):
        mgr.prefetch(BOB)


async def test_close_with_fetches_queued_behind_a_running_one(
    ca: ScriptedCa, clock: FakeClock, sleep: FakeSleep
) -> None:
    # Cancelling a running fetch frees its slot while the queued ones are being cancelled
    # too: none of them may be admitted, and every task must end.
    mgr = SecretManager(ca, clock=clock, sleep=sleep, max_in_flight=1)
    waiters = [asyncio.create_task(mgr.fetch_certificate(ident(n))) for n in range(4)]
    await until(lambda: len(ca.pending_ids) == 1 and mgr.queued == 3)

    await mgr.close()

    results = await asyncio.gather(*waiters, return_exceptions=True)
    assert all(isinstance(r, IdentityError) for r in results)
    assert ca.calls == [ident(0)]
    assert (mgr.in_flight, mgr.queued) == (0, 0)
