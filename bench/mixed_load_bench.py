"""Small messages beside a bulk transfer on one pooled connection: 1-byte round trips through the
pair while a transfer runs through it, their p50 / p99, and the transfer's Gbit/s.

Counterpart: none of issue 11's targets; it measures head-of-line blocking between streams that
share one HBONE connection (proxy/hbone/connection.py, "Streams sharing a connection"). Both clients go from
the same client workload to the same server workload, so our client proxy pools them onto one
HBONE connection; the Envoy pair carries them on its one upstream HTTP/2 connection as well.

Each pair starts the transfer (`--bulk-mib` through one connection), waits `--lead-s` for it to
fill the queues, runs `--round-trips` 1-byte ping-pongs to the end, then waits for the transfer.
Two ways to compare, in hbone_bench's netns topology pinned to one core:

    .venv/bin/python bench/mixed_load_bench.py [--pairs 4]            # ours against the Envoy pair
    .venv/bin/python bench/mixed_load_bench.py a=<tree> b=<tree>      # two source trees, A/B

(root). Each pair runs both sides, alternating which goes first; prints a table and writes
results/mixed_load.json (`--out`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hbone_bench import Bench, choose_topology, tree_benches  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "mixed_load.json"
BULK_TIMEOUT_S = 300.0
KEYS = ("p50_us", "p99_us", "gbit_s")


def one(bench: Bench, mode: str, args: argparse.Namespace) -> dict[str, float]:
    """The transfer in the background, the round trips beside it: p50, p99 and Gbit/s."""
    bulk_argv = ["--test", "throughput", "--size", str(args.bulk_mib * 2**20), "--parallel", "1"]
    bulk = subprocess.Popen(
        bench.client_argv(mode, *bulk_argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        time.sleep(args.lead_s)
        latency = bench.run_client(
            mode, "--test", "latency", "--latency-bytes", "1", "--warmup", "50",
            "--round-trips", str(args.round_trips),
        )  # fmt: skip
        out, err = bulk.communicate(timeout=BULK_TIMEOUT_S)
    finally:
        if bulk.poll() is None:
            bulk.kill()
            bulk.wait()
    if bulk.returncode != 0:
        raise RuntimeError(f"bulk client ({mode}) failed: {err.decode()[-2000:]}")
    transfer = json.loads(out.decode().strip().splitlines()[-1])
    return {"p50_us": latency["p50_us"], "p99_us": latency["p99_us"], "gbit_s": transfer["gbit_s"]}


def run_pairs(sides: list[tuple[str, Bench, str]], args: argparse.Namespace) -> list[dict]:
    rows = []
    for i in range(args.pairs):
        row = {}
        for name, bench, mode in sides if i % 2 == 0 else sides[::-1]:
            row[name] = one(bench, mode, args)
        rows.append(row)
        print(
            f"pair {i + 1}/{args.pairs}: "
            + "; ".join(
                f"{n} p50 {r['p50_us']:.0f} µs, p99 {r['p99_us']:.0f} µs, {r['gbit_s']:.2f} Gbit/s"
                for n, r in row.items()
            ),
            flush=True,
        )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "trees", nargs="*", help="name=PATH[@PYTHON] of two source trees (default: ours against Envoy)"
    )
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--bulk-mib", type=int, default=2048)
    p.add_argument("--round-trips", type=int, default=1000)
    p.add_argument("--lead-s", type=float, default=0.5, help="the transfer's head start")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    if args.trees and len(args.trees) != 2:
        p.error("give two trees, or none to compare ours with the Envoy pair")
    if args.trees:
        names = [spec.split("=", 1)[0] for spec in args.trees]
        with tree_benches([spec.split("=", 1)[1] for spec in args.trees], "mixed-") as benches:
            rows = run_pairs([(names[0], benches[0], "hbone"), (names[1], benches[1], "hbone")], args)
    else:
        names = ["hbone", "envoy"]
        workdir = Path(tempfile.mkdtemp(prefix="mixed-load-"))
        bench_args = argparse.Namespace(
            modes=names, size_mib=64, parallel=1, latency_bytes=1, round_trips=0, warmup=0,
            connections=0, idle_connections=0,
        )  # fmt: skip
        topo = choose_topology("netns", workdir, envoy=True)
        try:
            bench = Bench(topo=topo, args=bench_args, pin=True)
            bench.apply_layout("one-core")
            bench.warm_up()
            rows = run_pairs([("hbone", bench, "hbone"), ("envoy", bench, "envoy")], args)
        finally:
            topo.close()
            shutil.rmtree(workdir, ignore_errors=True)
    medians = {n: {k: statistics.median(r[n][k] for r in rows) for k in KEYS} for n in names}
    print(f"{'':8} {'p50 µs':>10} {'p99 µs':>10} {'Gbit/s':>8}   (medians of {args.pairs} pairs)")
    for n in names:
        m = medians[n]
        print(f"{n:8} {m['p50_us']:10.0f} {m['p99_us']:10.0f} {m['gbit_s']:8.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"args": {**vars(args), "out": str(args.out)}, "pairs": rows, "medians": medians}, indent=1
        )
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
