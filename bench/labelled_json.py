"""One benchmark run as JSON: its label, when it ran, how loaded the host was, and its numbers."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any


def write_run(out: str | Path, label: str, **numbers: Any) -> Path:
    """Write `numbers` with the run's label, time and load average to `out`; print where."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "label": label,
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpus": len(os.sched_getaffinity(0)),
        "load_average_1m": round(os.getloadavg()[0], 2),
        **numbers,
    }
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")
    return path
