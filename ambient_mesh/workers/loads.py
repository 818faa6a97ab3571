"""Each worker's open connections, in memory that the owner and every worker map: what lets a
worker's shared listeners leave a new connection to a worker that carries fewer.

Counterpart: tokio's work stealing, which gives ztunnel's idle worker threads the connection
tasks of busy ones at any time. A process cannot hand over a connection it accepted, and a
bulk connection stays where it landed: of a burst of 8 (workers_bench.py's throughput test) one
worker often took 6 or 7, whichever was awake first (bench/README.md, workers_bench.py, session
21). So a worker that carries many more connections than another (BUSIER_FACTOR) defers its accept
(proxy/listener.py `Listener.adopt`), and the other, woken by the same readiness, takes the
connection. The deferral is bounded (listener.MAX_ACCEPT_DEFERRALS times ACCEPT_DEFER_S in a row),
so a worker that is stalled, or whose count is a moment old, delays a connection by at most that.

Layout: one signed 64-bit count per worker, in a memfd the owner makes (`WorkerLoads.create`) and
hands to each worker at spawn (`WorkerLoads(fd, index)` there). A worker writes only its own slot (its ConnectionTrackers
count into it: proxy/inputs.py `count_connections_in`) and reads the others; an aligned 8-byte store
is one store on the platforms CPython runs the proxy on, and a count read a moment late only makes
one deferral wrong. A dead worker's slot is set to DEAD, so that nobody defers to it, and back to 0
when it is started again.
"""

from __future__ import annotations

import mmap
import os
from typing import Final

SLOT_BYTES: Final = 8
DEAD: Final = 2**62  # the count of a worker that is not running: never the less loaded one
MAX_WORKERS: Final = 1024
# How much busier than another a worker must be before it leaves new connections to it. Any
# difference at all was tried: with connections coming and going, counts differ by one or two
# all the time, and the workers deferred to each other in turn while clients waited (0.25x the
# connection rate of one worker); at twice plus one, two workers cannot both defer on the same
# counts, and a burst of 8 bulk connections splits 5:3 at worst (bench/README.md,
# workers_bench.py, session 21).
BUSIER_FACTOR: Final = 2


class WorkerLoads:
    """The counts table; `index` is this process's slot (None in the owner, which writes only to
    mark workers dead or restarted)."""

    __slots__ = ("fd", "index", "workers", "_map", "_counts")

    def __init__(self, fd: int, index: int | None) -> None:
        size = os.fstat(fd).st_size
        workers = size // SLOT_BYTES
        if size % SLOT_BYTES or not 1 <= workers <= MAX_WORKERS:
            raise ValueError(f"worker loads: a table of {size} bytes is not 1-{MAX_WORKERS} slots of 8")
        if index is not None and not 0 <= index < workers:
            raise ValueError(f"worker loads: slot {index} of {workers}")
        self.fd = fd
        self.index = index
        self.workers = workers
        self._map = mmap.mmap(fd, size)
        self._counts = memoryview(self._map).cast("q")

    def __repr__(self) -> str:
        return f"WorkerLoads(slot {self.index}, counts {list(self._counts)})"

    @classmethod
    def create(cls, workers: int) -> WorkerLoads:
        """The owner's table for `workers` workers, every count 0 (the fd is the owner's to pass)."""
        if not 1 <= workers <= MAX_WORKERS:
            raise ValueError(f"worker loads: {workers} workers (1-{MAX_WORKERS})")
        fd = os.memfd_create("ambient-mesh-worker-loads", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, workers * SLOT_BYTES)
            return cls(fd, None)
        except BaseException:
            os.close(fd)
            raise

    def add(self, delta: int) -> None:
        """This worker's count moves by `delta` (a connection opened: 1, ended: -1)."""
        assert self.index is not None, "the owner has no slot"
        self._counts[self.index] += delta

    def busier_than_another(self) -> bool:
        """This worker carries at least BUSIER_FACTOR times as many connections as another
        running worker, plus one (n >= 2 (m + 1): 2 against 0, 4 against 1, 20 against 9)."""
        assert self.index is not None, "the owner has no slot"
        counts = self._counts
        mine = counts[self.index]
        return any(mine >= BUSIER_FACTOR * (counts[i] + 1) for i in range(self.workers) if i != self.index)

    def set(self, index: int, count: int) -> None:
        """The owner: a worker restarted (0) or gone (DEAD)."""
        self._counts[index] = count

    def count(self, index: int) -> int:
        return int(self._counts[index])

    def close(self) -> None:
        self._counts.release()
        self._map.close()
        if self.index is None:
            os.close(self.fd)
