"""Files replaced whole or not at all.

Counterpart: istio-cni's `file.AtomicWrite` (pkg/file): a temporary file in the same directory,
fsync, then rename over the target, so a reader (the container runtime reading the CNI config, a
restarted agent reading its state) never sees half a file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def atomic_write(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write `data` to `path` atomically; `mode` sets the permission bits (else the umask's)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{path.name}.tmp.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            if mode is not None:
                os.fchmod(f.fileno(), mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
