"""glibc allocator settings for the proxies' bulk data path.

Relaying allocates and frees a buffer of up to 1 MiB per read; above glibc's default mmap
threshold (128 KiB) every such buffer is an mmap/munmap pair and fresh pages to fault in.
Raising the thresholds keeps those buffers on the heap (docs/performance.md, "Buffers and copies").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger("ambient_mesh.host")

# mallopt(3) parameter numbers (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 4 * 1024 * 1024
TRIM_THRESHOLD_BYTES = 64 * 1024 * 1024
TOP_PAD_BYTES = 16 * 1024 * 1024

_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def tune_allocator() -> bool:
    """Apply the settings through mallopt unless the operator set glibc's MALLOC_* variables.

    Returns whether they were applied; a non-glibc libc (musl) simply keeps its defaults.
    """
    if any(name in os.environ for name in _ENV):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = all(
        mallopt(param, value) == 1
        for param, value in (
            (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
            (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
            (M_TOP_PAD, TOP_PAD_BYTES),
        )
    )
    if not ok:
        log.debug("mallopt refused the allocator settings; keeping the defaults")
    return ok
