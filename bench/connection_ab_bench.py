"""Before/after of the per-connection path: two source trees' node proxy pairs at once, batches alternated.

On this shared 2-vCPU host the speed of a core drifts by tens of percent within a minute, so two
hbone_bench runs one after the other (or even the hbone and envoy modes of one round) can differ
more than a change does. Here both trees run at the same time: one netns topology per tree
(hbone_bench's, pinned one-core), each tree's proxies started with `PYTHONPATH=<tree>`, and
batches of connections (connect, 1-byte round trip, close) alternate between them, in ABBA
order. A batch pair shares the host's state, so the ratio of their proxy CPU per connection
(both proxies, from /proc) is the figure; its median over the pairs is printed with conn/s, and
each proxy's user and system CPU per connection (utime and stime apart: which half a change cuts).

    git -C /work/main worktree add --detach /tmp/main-tree main     # the "before" tree
    sudo .venv/bin/python bench/connection_ab_bench.py before=/tmp/main-tree after=$PWD \\
        [--batches 10] [--connections 200]

Run it from the repository root (the bench script and its topology come from here; only the
proxies' code comes from each tree). A tree given as `PATH@PYTHON` runs its proxies on that
interpreter (a virtualenv's `bin/python` with the project's dependencies), so one source can be
measured on two interpreters. Writes results/connection_ab.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hbone_bench import Bench, proc_cpu_s, proc_user_cpu_s, split_tree, tree_benches  # noqa: E402

WARMUP_CONNECTIONS = 300
BATCH_MAX_SECONDS = 60.0
MAX_BATCHES = 100
MAX_CONNECTIONS_PER_BATCH = 5000


def proc_user_system_s(pid: int) -> tuple[float, float]:
    """utime and stime of a process (all its threads), in seconds."""
    user = proc_user_cpu_s(pid)
    return user, proc_cpu_s(pid) - user


def run_split(bench: Bench, *argv: str) -> tuple[dict, dict[str, tuple[float, float]]]:
    """One `hbone` client run of `bench`, and each proxy's (user, system) CPU seconds meanwhile."""
    pids = bench.topo.pids()
    before = {role: proc_user_system_s(pid) for role, pid in pids.items()}
    result = bench.run_client("hbone", *argv)
    after = {role: proc_user_system_s(pid) for role, pid in pids.items()}
    return result, {
        role: (after[role][0] - before[role][0], after[role][1] - before[role][1]) for role in pids
    }


SPLIT_KEYS = tuple(
    f"{role}_{half}_ms_per_conn" for role in ("client", "server") for half in ("user", "system")
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "trees",
        nargs=2,
        metavar="NAME=PATH[@PYTHON]",
        help="two source trees, first the baseline; @PYTHON runs one on another interpreter",
    )
    p.add_argument("--batches", type=int, default=10)
    p.add_argument("--connections", type=int, default=200, help="connections per batch")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "connection_ab.json"))
    args = p.parse_args()
    if not 2 <= args.batches <= MAX_BATCHES or not 10 <= args.connections <= MAX_CONNECTIONS_PER_BATCH:
        raise SystemExit(f"--batches 2-{MAX_BATCHES} and --connections 10-{MAX_CONNECTIONS_PER_BATCH}")
    trees = [tuple(t.split("=", 1)) for t in args.trees]
    for _name, spec in trees:
        split_tree(spec)  # says what is wrong with it before anything starts
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)
    per_batch: list[dict[str, dict[str, float]]] = []
    with tree_benches([path for _name, path in trees], "conn-ab-") as benches:
        for bench in benches:
            bench.run_client(
                "hbone",
                "--test",
                "connections",
                "--connections",
                str(WARMUP_CONNECTIONS),
                "--max-seconds",
                "30",
            )
        for i in range(args.batches):
            row: dict[str, dict[str, float]] = {}
            for k in (0, 1) if i % 2 == 0 else (1, 0):
                result, split = run_split(
                    benches[k],
                    "--test",
                    "connections",
                    "--connections",
                    str(args.connections),
                    "--max-seconds",
                    str(BATCH_MAX_SECONDS),
                )
                n = result["connections"]
                row[trees[k][0]] = {
                    "connections": n,
                    "conn_s": result["conn_s"],
                    "proxy_cpu_ms_per_conn": sum(u + s for u, s in split.values()) * 1000 / n,
                    **{
                        f"{role}_{half}_ms_per_conn": value * 1000 / n
                        for role, (user, system) in split.items()
                        for half, value in (("user", user), ("system", system))
                    },
                }
            per_batch.append(row)
            console.print(
                f"batch {i + 1}/{args.batches}: "
                + ", ".join(
                    f"{n} {v['proxy_cpu_ms_per_conn']:.2f} ms, {v['conn_s']:.0f}/s" for n, v in row.items()
                )
            )

    (base, _), (other, _) = trees
    cpu_ratio = [b[other]["proxy_cpu_ms_per_conn"] / b[base]["proxy_cpu_ms_per_conn"] for b in per_batch]
    rate_ratio = [b[other]["conn_s"] / b[base]["conn_s"] for b in per_batch]
    summary = {
        name: {
            "proxy_cpu_ms_per_conn_median": statistics.median(
                b[name]["proxy_cpu_ms_per_conn"] for b in per_batch
            ),
            "conn_s_median": statistics.median(b[name]["conn_s"] for b in per_batch),
            **{f"{key}_median": statistics.median(b[name][key] for b in per_batch) for key in SPLIT_KEYS},
        }
        for name, _ in trees
    }
    summary["ratio"] = {
        "proxy_cpu_per_conn_median": statistics.median(cpu_ratio),
        "proxy_cpu_per_conn_range": [min(cpu_ratio), max(cpu_ratio)],
        "conn_s_median": statistics.median(rate_ratio),
        "conn_s_range": [min(rate_ratio), max(rate_ratio)],
    }
    table = Table(
        title=f"per-connection path, {args.batches} x {args.connections} connections per tree, one-core"
    )
    for column in (
        "tree",
        "proxy CPU ms per conn (both), median",
        "client user / system ms",
        "server user / system ms",
        "conn/s, median",
    ):
        table.add_column(column)
    for name, path in trees:
        s = summary[name]
        table.add_row(
            f"{name} ({path})",
            f"{s['proxy_cpu_ms_per_conn_median']:.3f}",
            *(
                f"{s[f'{role}_user_ms_per_conn_median']:.3f} / {s[f'{role}_system_ms_per_conn_median']:.3f}"
                for role in ("client", "server")
            ),
            f"{s['conn_s_median']:.0f}",
        )
    r = summary["ratio"]
    table.add_row(
        f"{other} / {base}, same batch pair",
        f"{r['proxy_cpu_per_conn_median']:.3f} ({r['proxy_cpu_per_conn_range'][0]:.2f}-"
        f"{r['proxy_cpu_per_conn_range'][1]:.2f})",
        "",
        "",
        f"{r['conn_s_median']:.3f} ({r['conn_s_range'][0]:.2f}-{r['conn_s_range'][1]:.2f})",
    )
    console.print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "trees": dict(trees),
                "batches": per_batch,
                "summary": summary,
                "python": platform.python_version(),
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "load_average": os.getloadavg(),
            },
            indent=2,
        )
    )
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
