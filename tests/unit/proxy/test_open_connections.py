"""proxy/open_connections.py: what one proxy has open, what a drain waits for, what it dumps."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from ambient_mesh.proxy import open_connections
from ambient_mesh.proxy.open_connections import OpenConnections, count_connections_in
from ambient_mesh.transport.relay import Endpoint, Relay


class About:
    """A relay's description as telemetry.ConnectionResult gives it."""

    def __init__(self, direction: str, name: str) -> None:
        self.direction = direction
        self.name = name

    def dump_info(self) -> dict[str, Any]:
        return {"direction": self.direction, "name": self.name}


class Counter:
    def __init__(self) -> None:
        self.value = 0
        self.calls: list[int] = []

    def add(self, delta: int) -> None:
        self.value += delta
        self.calls.append(delta)


class Quiet(Endpoint):
    """An endpoint with nothing underneath: closing or aborting it only records that it was."""

    def __init__(self) -> None:
        self.ended = ""

    def close(self) -> None:
        self.ended = "closed"

    def abort(self) -> None:
        self.ended = "aborted"


def new_relay() -> Relay:
    return Relay(Quiet(), Quiet())


def released(relay: Relay) -> bool:
    return relay.downstream.relay is None and relay.upstream.relay is None


async def test_a_tracked_relay_is_listed_by_direction_until_it_ends():
    open_ = OpenConnections()
    inbound, outbound = new_relay(), new_relay()
    open_.track(inbound, About("inbound", "a"))
    open_.track(outbound, About("outbound", "b"))
    assert open_.dump("inbound") == [{"direction": "inbound", "name": "a"}]
    assert open_.dump("outbound") == [{"direction": "outbound", "name": "b"}]
    assert open_.pending() == {inbound.done, outbound.done}
    assert "2 relays, 0 tasks" in repr(open_)

    inbound.finish()
    await asyncio.sleep(0)
    assert open_.dump("inbound") == []
    assert released(inbound) and not released(outbound)
    assert open_.pending() == {outbound.done}


async def test_the_end_callback_gets_the_relay_and_its_error_then_the_relay_is_released():
    open_ = OpenConnections()
    relay = new_relay()
    seen: list[tuple[Relay, BaseException | None, bool]] = []
    open_.track(relay, About("inbound", "a"), on_end=lambda r, e: seen.append((r, e, released(r))))
    error = ConnectionResetError("peer reset")
    relay.abort(error)
    await asyncio.sleep(0)
    # on_end ran while the endpoints were still linked; release unlinked them afterwards.
    assert seen == [(relay, error, False)]
    assert released(relay)
    assert open_.relays == {}


async def test_a_failing_end_callback_still_releases_and_forgets_the_relay():
    open_ = OpenConnections()
    relay = new_relay()

    def boom(_relay: Relay, _error: BaseException | None) -> None:
        raise RuntimeError("recording failed")

    open_.track(relay, About("outbound", "x"), on_end=boom)
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    relay.finish()
    await asyncio.sleep(0)
    loop.set_exception_handler(None)
    assert open_.relays == {}
    assert released(relay)
    assert [type(c.get("exception")) for c in errors] == [RuntimeError]


async def test_spawned_set_up_tasks_are_waited_for_by_a_drain_and_forgotten_when_done():
    open_ = OpenConnections()
    gate = asyncio.Event()

    async def setting_up() -> None:
        await gate.wait()

    task = open_.spawn(setting_up())
    relay = new_relay()
    open_.track(relay, About("inbound", "a"))
    assert open_.pending() == {task, relay.done}

    drained = asyncio.ensure_future(asyncio.wait(open_.pending()))
    await asyncio.sleep(0)
    assert not drained.done()
    gate.set()
    relay.finish()
    await asyncio.wait_for(drained, 5)
    await asyncio.sleep(0)
    assert open_.tasks == set() and open_.relays == {}
    assert open_.pending() == set()


async def test_without_a_load_counter_nothing_else_is_counted():
    assert open_connections._load is None
    open_ = OpenConnections()
    relay = new_relay()
    open_.track(relay, About("inbound", "a"))
    relay.finish()
    await asyncio.sleep(0)
    assert open_.relays == {}


async def test_a_load_counter_sees_every_task_and_relay_come_and_go():
    counter = Counter()
    count_connections_in(counter)
    try:
        open_ = OpenConnections()
        task = open_.spawn(asyncio.sleep(0))
        relay = new_relay()
        open_.track(relay, About("outbound", "b"))
        assert counter.value == 2
        await task
        await asyncio.sleep(0)
        assert counter.value == 1
        relay.finish()
        await asyncio.sleep(0)
        assert counter.value == 0
        assert counter.calls == [1, 1, -1, -1]
    finally:
        count_connections_in(None)


async def test_a_relay_tracked_before_the_counter_was_set_is_not_uncounted_after():
    # The counter in force when a connection opened is the one told when it ends, so a counter
    # set (or cleared) in between never goes negative.
    open_ = OpenConnections()
    relay = new_relay()
    open_.track(relay, About("inbound", "a"))
    counter = Counter()
    count_connections_in(counter)
    try:
        relay.finish()
        await asyncio.sleep(0)
        assert counter.calls == []
    finally:
        count_connections_in(None)


@pytest.mark.parametrize("direction", ["inbound", "outbound"])
async def test_dump_leaves_out_the_other_direction(direction):
    open_ = OpenConnections()
    open_.track(new_relay(), About("inbound", "i"))
    open_.track(new_relay(), About("outbound", "o"))
    assert [row["direction"] for row in open_.dump(direction)] == [direction]
