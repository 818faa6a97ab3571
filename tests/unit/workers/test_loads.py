"""workers/loads.py: the connection counts the owner and its workers share."""

from __future__ import annotations

import os

import pytest

from ambient_mesh.proxy import open_connections
from ambient_mesh.proxy.open_connections import OpenConnections, count_connections_in
from ambient_mesh.workers.loads import DEAD, WorkerLoads


def test_each_worker_writes_its_slot_and_compares_with_the_others():
    owner = WorkerLoads.create(3)
    workers = [WorkerLoads(owner.fd, i) for i in range(3)]
    try:
        assert not any(w.busier_than_another() for w in workers)  # all at 0
        workers[0].add(1)
        assert workers[0].busier_than_another()  # 1 against 0
        assert not workers[1].busier_than_another()
        workers[1].add(1)
        workers[2].add(1)
        assert not workers[0].busier_than_another()  # 1, 1, 1
        for w in workers:
            w.add(7)  # 8, 8, 8
        workers[0].add(2)
        assert not workers[0].busier_than_another()  # 10 against 8: within a quarter of 8
        workers[0].add(1)
        assert workers[0].busier_than_another()  # 11 against 8
        owner.set(2, DEAD)  # a dead worker is never the less loaded one
        workers[1].add(2)
        assert not workers[0].busier_than_another()  # 11, 10 and a dead one
        workers[1].deferring(1)  # worker 1 is not listening: not one to defer to either
        workers[1].add(-5)
        assert not workers[0].busier_than_another()  # 11 against a deferring 5
        workers[1].deferring(-1)
        assert workers[0].busier_than_another()
        assert [owner.count(i) for i in range(3)] == [11, 5, DEAD]
        owner.set(2, 0)  # restarted
        assert workers[1].busier_than_another()  # 5 against the restarted worker's 0
    finally:
        for w in workers:
            w.close()
        owner.close()


def test_a_table_of_the_wrong_size_or_slot_is_refused():
    owner = WorkerLoads.create(2)
    try:
        with pytest.raises(ValueError, match="slot 2 of 2"):
            WorkerLoads(owner.fd, 2)
        os.ftruncate(owner.fd, 24)
        with pytest.raises(ValueError, match="24 bytes"):
            WorkerLoads(owner.fd, 0)
    finally:
        owner.close()
    with pytest.raises(ValueError, match="0 workers"):
        WorkerLoads.create(0)


async def test_trackers_count_tasks_and_relays_into_the_worker_slot():
    import asyncio

    from ambient_mesh.transport.relay import Endpoint, Relay

    owner = WorkerLoads.create(2)
    mine = WorkerLoads(owner.fd, 0)
    count_connections_in(mine)
    try:
        tracker = OpenConnections()
        gate = asyncio.Event()

        async def setting_up() -> None:
            await gate.wait()

        task = tracker.spawn(setting_up())
        assert owner.count(0) == 1
        relay = Relay(Endpoint(), Endpoint())
        tracker.track(relay, about=None)  # type: ignore[arg-type]
        assert owner.count(0) == 2
        gate.set()
        await task
        await asyncio.sleep(0)
        assert owner.count(0) == 1
        relay.done.set_result(None)
        await asyncio.sleep(0)
        assert owner.count(0) == 0
    finally:
        count_connections_in(None)
        mine.close()
        owner.close()
    assert open_connections._load is None
