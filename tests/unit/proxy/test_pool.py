"""proxy/pool.py `HbonePool` with a fake connector: what it holds after each step (`repr`), how
many connections it opens and when, and what it does with connections that can no longer carry a
stream. The connections are fakes with the four things the pool reads (open streams, the peer's
stream limit, usable, last use) and the two it calls (open_stream, drain)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from ambient_mesh.identity.spiffe import Identity
from ambient_mesh.net import SocketAddr
from ambient_mesh.proxy.hbone import ConnectResponse, HboneConnection, HboneStreamRefused
from ambient_mesh.proxy.pool import HbonePool, WorkloadKey

SRC = Identity("cluster.local", "default", "client")
DST = Identity("cluster.local", "default", "server")
KEY = WorkloadKey.of(SRC, (DST,), SocketAddr.parse("10.0.0.2:15008"), None)
OTHER_KEY = WorkloadKey.of(SRC, (DST,), SocketAddr.parse("10.0.0.3:15008"), None)
OK = ConnectResponse(status=200, headers=())


class FakeConnection:
    """What HbonePool reads and calls of an HboneConnection."""

    def __init__(self, name: str, max_streams: int = 1000) -> None:
        self.name = name
        self.streams: list[str] = []
        self.max_streams = max_streams
        self.usable = True
        self.drained = False
        self.last_used = asyncio.get_running_loop().time()
        self.refuse_next = False

    @property
    def open_streams(self) -> int:
        return len(self.streams)

    async def open_stream(self, authority: str, headers: list[tuple[str, str]], early: bytes = b"") -> Any:
        if self.refuse_next:  # the peer's GOAWAY came before it saw our stream
            self.refuse_next = False
            self.usable = False
            raise HboneStreamRefused("refused by GOAWAY")
        stream = f"{self.name}/{len(self.streams)}"
        self.streams.append(stream)
        self.last_used = asyncio.get_running_loop().time()
        return stream, OK

    def end_stream(self) -> None:
        self.streams.pop()
        self.last_used = asyncio.get_running_loop().time()

    def drain(self) -> None:
        self.drained = True
        self.usable = False


class FakeConnector:
    """Makes FakeConnections; `gate` holds every connect until it is set; `fail` makes the next
    connect raise it."""

    def __init__(self, max_streams: int = 1000) -> None:
        self.made: list[FakeConnection] = []
        self.keys: list[WorkloadKey] = []
        self.max_streams = max_streams
        self.gate: asyncio.Event | None = None
        self.fail: BaseException | None = None

    async def __call__(self, key: WorkloadKey) -> HboneConnection:
        self.keys.append(key)
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            error, self.fail = self.fail, None
            raise error
        conn = FakeConnection(f"c{len(self.made)}", self.max_streams)
        self.made.append(conn)
        return cast(HboneConnection, conn)


def pool_of(connector: FakeConnector, **kwargs: Any) -> HbonePool:
    return HbonePool(connector, **kwargs)


async def open_one(pool: HbonePool, key: WorkloadKey = KEY) -> str:
    stream, response = await pool.open_stream(key, "10.0.0.2:8080", [])
    assert response.status == 200
    return cast(str, stream)


async def test_streams_share_one_connection_until_it_is_full() -> None:
    connector = FakeConnector()
    pool = pool_of(connector, max_streams_per_connection=2)
    assert repr(pool) == "HbonePool(0 keys, 0 active, 0 idle, 0 streams, 0 connecting)"
    assert await open_one(pool) == "c0/0"
    assert await open_one(pool) == "c0/1"
    assert repr(pool) == "HbonePool(1 keys, 1 active, 0 idle, 2 streams, 0 connecting)"
    assert await open_one(pool) == "c1/0"  # both slots of c0 taken: a second connection
    assert pool.connections_opened == 2 and connector.keys == [KEY, KEY]
    assert repr(pool) == "HbonePool(1 keys, 2 active, 0 idle, 3 streams, 0 connecting)"
    pool.close()


async def test_the_peers_stream_limit_counts_when_it_is_lower() -> None:
    connector = FakeConnector(max_streams=1)
    pool = pool_of(connector, max_streams_per_connection=100)
    assert [await open_one(pool) for _ in range(3)] == ["c0/0", "c1/0", "c2/0"]
    pool.close()


async def test_keys_do_not_share_connections() -> None:
    connector = FakeConnector()
    pool = pool_of(connector)
    assert await open_one(pool, KEY) == "c0/0"
    assert await open_one(pool, OTHER_KEY) == "c1/0"
    assert await open_one(pool, KEY) == "c0/1"
    assert repr(pool) == "HbonePool(2 keys, 2 active, 0 idle, 3 streams, 0 connecting)"
    pool.close()


async def test_one_connect_per_key_at_a_time_and_waiters_use_it() -> None:
    connector = FakeConnector()
    connector.gate = asyncio.Event()
    pool = pool_of(connector)
    opening = [asyncio.ensure_future(open_one(pool)) for _ in range(5)]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert len(connector.keys) == 1
    assert repr(pool) == "HbonePool(0 keys, 0 active, 0 idle, 0 streams, 1 connecting)"
    connector.gate.set()
    streams = await asyncio.gather(*opening)
    assert sorted(streams) == [f"c0/{i}" for i in range(5)] and len(connector.made) == 1
    pool.close()


async def test_a_failed_connect_fails_its_caller_and_the_waiters_try_again() -> None:
    connector = FakeConnector()
    connector.gate = asyncio.Event()
    connector.fail = ConnectionRefusedError("no one listens")
    pool = pool_of(connector)
    first = asyncio.ensure_future(open_one(pool))
    await asyncio.sleep(0)
    second = asyncio.ensure_future(open_one(pool))
    await asyncio.sleep(0)
    connector.gate.set()
    with pytest.raises(ConnectionRefusedError):
        await first
    assert await second == "c0/0"  # it connected again rather than sharing the failure
    assert connector.keys == [KEY, KEY] and pool.connections_opened == 1
    pool.close()


async def test_a_connection_that_got_goaway_carries_no_new_stream() -> None:
    connector = FakeConnector()
    pool = pool_of(connector)
    await open_one(pool)
    connector.made[0].usable = False  # GOAWAY received
    assert await open_one(pool) == "c1/0"
    assert pool.connections(KEY) == [connector.made[1]]  # the unusable one was dropped
    pool.close()


async def test_a_stream_refused_by_goaway_is_retried_once_on_another_connection() -> None:
    connector = FakeConnector()
    pool = pool_of(connector)
    await open_one(pool)
    connector.made[0].refuse_next = True
    assert await open_one(pool) == "c1/0"
    assert len(connector.made) == 2
    pool.close()


async def test_idle_connections_are_released_after_the_timeout_active_ones_are_kept() -> None:
    connector = FakeConnector()
    pool = pool_of(connector, max_streams_per_connection=1, unused_release_timeout_s=0.05)
    await open_one(pool)
    await open_one(pool)
    idle, active = connector.made
    idle.end_stream()
    assert repr(pool) == "HbonePool(1 keys, 1 active, 1 idle, 1 streams, 0 connecting)"
    pool.expire_idle()
    assert not idle.drained  # unused for less than the timeout
    await asyncio.sleep(0.06)
    pool.expire_idle()
    assert idle.drained and not active.drained
    assert repr(pool) == "HbonePool(1 keys, 1 active, 0 idle, 1 streams, 0 connecting)"
    active.end_stream()
    await asyncio.sleep(0.06)
    pool.expire_idle()
    assert active.drained
    assert repr(pool) == "HbonePool(0 keys, 0 active, 0 idle, 0 streams, 0 connecting)"


async def test_close_drains_every_connection_and_forgets_them() -> None:
    connector = FakeConnector()
    pool = pool_of(connector)
    await open_one(pool, KEY)
    await open_one(pool, OTHER_KEY)
    pool.close()
    assert all(c.drained for c in connector.made)
    assert repr(pool) == "HbonePool(0 keys, 0 active, 0 idle, 0 streams, 0 connecting)"
    assert await open_one(pool) == "c2/0"  # a closed pool opens afresh
    pool.close()
