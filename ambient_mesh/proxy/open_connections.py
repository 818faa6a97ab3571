"""The connections one proxy has open: what a drain waits for and what /config_dump lists.

Its one job is bookkeeping of what is open, in both directions: a connection is a task while it
is being set up (accept, route, connect) and a relay once its bytes flow. Authorization of open
connections is not here: that is ztunnel's ConnectionManager, `connection_manager.py`, which
tracks inbound connections for their policy and closes those a new state refuses.

The task ends when the relay starts, so an idle tunnel holds no task or coroutine frames
(docs/performance.md, "Where we stand (one-core, ours / Envoy, same runs)"), and the relay's end
is handled by one callback on `relay.done`. In a worker process (`ZTUNNEL_WORKER_THREADS` > 1)
every `OpenConnections` also counts into the worker's load slot (`count_connections_in`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..transport.relay import Relay


class Dumpable(Protocol):
    """What a tracked relay is described by (telemetry.ConnectionResult): its /config_dump row."""

    direction: str

    def dump_info(self) -> dict[str, Any]: ...


class LoadCounter(Protocol):
    """A count of the connections this process carries (a worker's slot, workers/loads.py)."""

    def add(self, delta: int) -> None: ...


# Where every OpenConnections of this process also counts its connections (set by a worker at
# start, `count_connections_in`); None in a proxy without workers, which counts nothing more.
_load: LoadCounter | None = None


def count_connections_in(counter: LoadCounter | None) -> None:
    """From now on, every OpenConnections of this process counts its open connections (tasks
    being set up and relays carrying bytes) into `counter` as well."""
    global _load
    _load = counter


@dataclass(eq=False)
class OpenConnections:
    """The open connections of one proxy: tasks being set up and relays carrying bytes."""

    relays: dict[Relay, Dumpable] = field(default_factory=dict)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def __repr__(self) -> str:
        return f"OpenConnections({len(self.relays)} relays, {len(self.tasks)} tasks)"

    def track(
        self,
        relay: Relay,
        about: Dumpable,
        on_end: Callable[[Relay, BaseException | None], None] | None = None,
    ) -> None:
        """Track `relay` until it ends, then call `on_end(relay, error)`: one callback per relay
        (each closure on `relay.done` is about 200 B an idle tunnel keeps)."""
        self.relays[relay] = about
        load = _load
        if load is not None:
            load.add(1)
        relay.done.add_done_callback(functools.partial(self._ended, relay, on_end, load))

    def _ended(
        self,
        relay: Relay,
        on_end: Callable[[Relay, BaseException | None], None] | None,
        load: LoadCounter | None,
        done: asyncio.Future[BaseException | None],
    ) -> None:
        self.relays.pop(relay, None)
        if load is not None:
            load.add(-1)
        try:
            if on_end is not None:
                on_end(relay, done.result())
        finally:
            relay.release()  # recorded: its endpoints are no longer needed (Relay.release)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run `coro` (one connection's set-up) as a task a drain waits for."""
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        load = _load
        if load is None:
            task.add_done_callback(self.tasks.discard)
        else:
            load.add(1)
            task.add_done_callback(functools.partial(self._task_done, load))
        return task

    def _task_done(self, load: LoadCounter, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        load.add(-1)

    def dump(self, direction: str) -> list[dict[str, Any]]:
        """The /config_dump rows of the relays going `direction` ("inbound" or "outbound")."""
        return [about.dump_info() for about in self.relays.values() if about.direction == direction]

    def pending(self) -> set[asyncio.Future[Any]]:
        """What a drain waits for: connections being set up, and relays still carrying bytes."""
        return {*self.tasks, *(relay.done for relay in self.relays)}
