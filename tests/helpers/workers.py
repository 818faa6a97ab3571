"""The owner's worker processes in tests: letting one worker alone accept."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

from ambient_mesh.workers.owner import WorkerPool


@contextlib.contextmanager
def only_worker(pool: WorkerPool, index: int) -> Iterator[None]:
    """Every worker but `index` stopped (SIGSTOP): only it can accept new connections."""
    others = [w.pid for w in pool.workers if w.index != index and w.pid is not None]
    for pid in others:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in others:
            os.kill(pid, signal.SIGCONT)
