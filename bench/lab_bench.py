"""How long the lab takes to come up and go down with the default topology, and the demo's tour.

`ambient lab up` with the default topology (lab/topofile.py: 2 nodes, 4 pods, a Service) is
started and stopped `--runs` times in a fresh state directory; each run records the time from
`Lab.start()` to ready (every node proxy ready, every pod Running and known to every proxy) and
the time `Lab.stop()` takes. With `--demo`, `ambient demo` is run as a process as often and
timed end to end (its promise: under 30 s). The machine's load average is printed with each run:
on a shared machine it explains most of the spread.

    sudo .venv/bin/python bench/lab_bench.py [--runs 3] [--demo] [--out bench/results/lab.json]

Needs root (network namespaces). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ambient_mesh.lab.lab import Lab, LabConfig
from ambient_mesh.lab.topofile import load_topology

MAX_RUNS = 20
DEMO_TIMEOUT_S = 300.0


def one_lab_run() -> dict:
    topo = load_topology(None)
    with tempfile.TemporaryDirectory(prefix="ambient-lab-bench-", dir="/tmp") as tmp:
        config = LabConfig(
            state_dir=Path(tmp),
            nodes=topo.nodes,
            pods=topo.pods,
            objects=topo.objects,
            ambient_namespaces=topo.ambient_namespaces,
        )
        lab = Lab(config)
        load = os.getloadavg()[0]
        started = time.monotonic()
        try:
            lab.start()
            up_s = time.monotonic() - started
        finally:
            stopping = time.monotonic()
            lab.stop()
            down_s = time.monotonic() - stopping
    return {"up_s": round(up_s, 2), "down_s": round(down_s, 2), "load1": round(load, 1)}


def one_demo_run() -> dict:
    load = os.getloadavg()[0]
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "ambient_mesh", "demo"], capture_output=True, text=True, timeout=DEMO_TIMEOUT_S
    )
    return {
        "demo_s": round(time.monotonic() - started, 2),
        "demo_rc": done.returncode,
        "load1": round(load, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--demo", action="store_true", help="also time `ambient demo` end to end")
    parser.add_argument("--out", default="bench/results/lab.json")
    args = parser.parse_args(argv)
    if not 1 <= args.runs <= MAX_RUNS:
        parser.error(f"--runs must be 1-{MAX_RUNS}")
    if os.geteuid() != 0:
        print("lab_bench: needs root (network namespaces)", file=sys.stderr)
        return 2
    labs = [one_lab_run() for _ in range(args.runs)]
    demos = [one_demo_run() for _ in range(args.runs)] if args.demo else []
    print(
        f"{'run':>3}  {'lab up s':>8}  {'lab down s':>10}  {'load1':>5}" + ("  demo s  rc" if demos else "")
    )
    for i, run in enumerate(labs):
        line = f"{i + 1:>3}  {run['up_s']:>8.2f}  {run['down_s']:>10.2f}  {run['load1']:>5.1f}"
        if demos:
            line += f"  {demos[i]['demo_s']:>6.2f}  {demos[i]['demo_rc']:>2}"
        print(line)
    summary = {
        "lab_up_median_s": statistics.median(r["up_s"] for r in labs),
        "lab_down_median_s": statistics.median(r["down_s"] for r in labs),
    }
    if demos:
        summary["demo_median_s"] = statistics.median(r["demo_s"] for r in demos)
    print("median: " + ", ".join(f"{k} {v:.2f}" for k, v in summary.items()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"labs": labs, "demos": demos, "summary": summary, "cpus": os.cpu_count()}, indent=2)
    )
    print(f"wrote {out}")
    return 0 if all(d["demo_rc"] == 0 for d in demos) else 1


if __name__ == "__main__":
    sys.exit(main())
