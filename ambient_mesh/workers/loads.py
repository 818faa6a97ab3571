"""Each worker's open connections, in memory that the owner and every worker map: what lets a
worker's shared listeners leave a new connection to a worker that carries fewer.

Counterpart: tokio's work stealing, which gives ztunnel's idle worker threads the connection tasks of busy
ones at any time. A process cannot hand over a connection it accepted, and a bulk connection stays where
it landed: of a burst of 8 (workers_bench.py's throughput test) one worker often took 6 or 7, whichever
was awake first (docs/performance.md, "Workers"). So a worker that carries more connections than another
(BUSIER_SHARE_DIVISOR) defers its accept (proxy/listener.py `Listener.adopt`), and the other, woken by the
same readiness, takes the connection. The deferral is bounded (listener.MAX_ACCEPT_DEFERRALS times
ACCEPT_DEFER_S in a row), so a worker that is stalled, or whose count is a moment old, delays a connection
by at most that.

Layout: per worker a signed 64-bit count, then per worker how many of its listeners are deferring
right now, in a memfd the owner makes (`WorkerLoads.create`) and hands to each worker at spawn
(`WorkerLoads(fd, index)` there). A worker writes only its own slots (its OpenConnections count
into one: proxy/open_connections.py `count_connections_in`) and reads the others'; an aligned 8-byte store
is one store on the platforms CPython runs the proxy on, and a count read a moment late only
makes one deferral wrong. A dead worker's count is set to DEAD, so that nobody defers to it, and
back to 0 when it is started again.
"""

from __future__ import annotations

import mmap
import os
from typing import Final

SLOT_BYTES: Final = 8
SLOTS_PER_WORKER: Final = 2  # its count, and how many of its listeners are deferring
DEAD: Final = 2**62  # the count of a worker that is not running: never the less loaded one
MAX_WORKERS: Final = 1024
# How much busier than the least loaded other worker a worker must be before it leaves new
# connections to it: one connection more, and a quarter of that worker's count more (so that
# connections coming and going, which move the counts by one or two all the time, defer less
# when many are open; a burst of 8 still splits 4:4). A worker that is deferring right now is
# not the least loaded one: it is not listening. Without that, two workers deferred to each
# other in turn while clients waited (0.25x the connection rate of one worker).
BUSIER_SHARE_DIVISOR: Final = 4


class WorkerLoads:
    """The counts table; `index` is this process's slot (None in the owner, which writes only to
    mark workers dead or restarted)."""

    __slots__ = ("fd", "index", "workers", "_map", "_counts")

    def __init__(self, fd: int, index: int | None) -> None:
        size = os.fstat(fd).st_size
        row = SLOT_BYTES * SLOTS_PER_WORKER
        workers = size // row
        if size % row or not 1 <= workers <= MAX_WORKERS:
            raise ValueError(f"worker loads: a table of {size} bytes is not 1-{MAX_WORKERS} rows of {row}")
        if index is not None and not 0 <= index < workers:
            raise ValueError(f"worker loads: slot {index} of {workers}")
        self.fd = fd
        self.index = index
        self.workers = workers
        self._map = mmap.mmap(fd, size)
        self._counts = memoryview(self._map).cast("q")

    def __repr__(self) -> str:
        counts = list(self._counts)
        return f"WorkerLoads(slot {self.index}, counts {counts[: self.workers]}, deferring {counts[self.workers :]})"

    @classmethod
    def create(cls, workers: int) -> WorkerLoads:
        """The owner's table for `workers` workers, every count 0 (the fd is the owner's to pass)."""
        if not 1 <= workers <= MAX_WORKERS:
            raise ValueError(f"worker loads: {workers} workers (1-{MAX_WORKERS})")
        fd = os.memfd_create("ambient-mesh-worker-loads", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, workers * SLOT_BYTES * SLOTS_PER_WORKER)
            return cls(fd, None)
        except BaseException:
            os.close(fd)
            raise

    def add(self, delta: int) -> None:
        """This worker's count moves by `delta` (a connection opened: 1, ended: -1)."""
        assert self.index is not None, "the owner has no slot"
        self._counts[self.index] += delta

    def busier_than_another(self) -> bool:
        """Another running worker that is not deferring carries fewer connections than this one
        by at least 1 + its count / BUSIER_SHARE_DIVISOR (1 against 0, 4 against 3, 11 against 8,
        21 against 16)."""
        me = self.index
        assert me is not None, "the owner has no slot"
        counts, workers = self._counts, self.workers
        mine = counts[me]
        return any(
            mine >= counts[i] + 1 + counts[i] // BUSIER_SHARE_DIVISOR
            for i in range(workers)
            if i != me and not counts[workers + i]
        )

    def deferring(self, delta: int) -> None:
        """One of this worker's listeners stops (1) or starts again (-1) taking connections: while
        any of them is deferring, the others do not defer to this worker."""
        assert self.index is not None, "the owner has no slot"
        self._counts[self.workers + self.index] += delta

    def set(self, index: int, count: int) -> None:
        """The owner: a worker restarted (0) or gone (DEAD); either way not deferring."""
        self._counts[index] = count
        self._counts[self.workers + index] = 0

    def count(self, index: int) -> int:
        return int(self._counts[index])

    def close(self) -> None:
        self._counts.release()
        self._map.close()
        if self.index is None:
            os.close(self.fd)
