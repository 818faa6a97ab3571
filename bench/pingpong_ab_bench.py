"""The per-message path for small messages: 1-byte round trips through an in-process mesh, A/B.

Counterpart: none (hbone_bench.py's latency test measures the same path across processes and
namespaces against the Envoy pair; this one isolates our Python). Both node proxies (dedicated
mode, as bench/profile_connections.py builds them: SOCKS5 in, HBONE over TLS between them), the
echo app and the client run in one uvloop process, so the process's CPU time per round trip is
the whole path of both proxies (TLS, HTTP/2 shell and core, relay, uvloop, syscalls) plus a
client and an echo that cost the same in every tree. Nothing of ours is preempted by a peer,
which is what makes small changes visible on a shared host (docs/performance.md, "How we measure").

Each trial is a fresh process in a private network namespace (the proxies listen on fixed
loopback ports), the trees alternated trial by trial (ABAB...), and the ratio taken within each
pair; each trial keeps the least CPU of its SLICES_PER_TRIAL slices. `--profile` runs one trial per tree under cProfile (timer `time.thread_time`, switched on
after the warm-up) and prints the Python calls per round trip of the whole process.

    .venv/bin/python bench/pingpong_ab_bench.py [name=tree ...] [--trials 8] [--round-trips 5000]
        [--profile] [--top 40]

(root: each trial runs under `unshare --net`.) `--netns` instead runs both trees' proxies across
processes, in hbone_bench's topology pinned to one core, latency batches alternated ABBA with
the ratio of proxy CPU per round trip and of p50 taken within each batch pair:

    .venv/bin/python bench/pingpong_ab_bench.py --netns main=<tree> this=$PWD [--trials 12]
        [--round-trips 5000] [--bulk-mib 256]

(`--bulk-mib`: each batch one transfer through one connection instead, with proxy CPU per GiB.)
A tree given as `name=PATH@PYTHON` runs on that interpreter (a virtualenv's `bin/python` with the
project's dependencies): one source measured on two interpreters.

Writes results/pingpong_ab.json.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import platform
import pstats
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_ROUND_TRIPS = 1_000_000
MAX_BULK_KIB = 64 * 1024
MAX_BULK_MIB = 4096
WARMUP_ROUND_TRIPS = 2000
TRIAL_TIMEOUT_S = 300.0
ROUND_TRIP_TIMEOUT_S = 10.0
SLICES_PER_TRIAL = 5


class PingClient(asyncio.Protocol):
    """Writes one byte each time one comes back, `remaining` times; `done` at the end."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.remaining = 0
        self.done: asyncio.Future[None] = loop.create_future()
        self.loop = loop

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def start(self, count: int) -> asyncio.Future[None]:
        self.remaining = count
        self.done = self.loop.create_future()
        self.transport.write(b"x")  # type: ignore[attr-defined]
        return self.done

    def bulk(self, size: int) -> asyncio.Future[None]:
        """`size` bytes in one write, echoed back: the tunnel has carried a bulk write before the
        ping-pong, as in hbone_bench (its warm-up transfer) and on a long-lived pooled connection."""
        self.remaining = -size
        self.done = self.loop.create_future()
        self.transport.write(b"b" * size)  # type: ignore[attr-defined]
        return self.done

    def data_received(self, data: bytes) -> None:
        if self.remaining < 0:  # a bulk echo
            self.remaining += len(data)
            if not self.remaining and not self.done.done():
                self.done.set_result(None)
            return
        self.remaining -= len(data)
        if self.remaining > 0:
            self.transport.write(b"x")  # type: ignore[attr-defined]
        elif not self.done.done():
            self.done.set_result(None)


async def _tunnel(loop: asyncio.AbstractEventLoop, socks: tuple[str, int]) -> PingClient:
    from profile_connections import ECHO_PORT, SERVER_IP

    sock = socket.create_connection(socks, timeout=ROUND_TRIP_TIMEOUT_S)
    sock.setblocking(False)
    await loop.sock_sendall(
        sock, b"\x05\x01\x00\x05\x01\x00\x01" + socket.inet_aton(SERVER_IP) + ECHO_PORT.to_bytes(2, "big")
    )
    reply = b""
    while len(reply) < 12:
        got = await asyncio.wait_for(loop.sock_recv(sock, 12 - len(reply)), ROUND_TRIP_TIMEOUT_S)
        if not got:
            raise SystemExit("SOCKS5 closed the connection")
        reply += got
    if reply[:2] != b"\x05\x00" or reply[3] != 0:
        raise SystemExit(f"SOCKS5 refused the connection: {reply!r}")
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    _t, client = await loop.create_connection(lambda: PingClient(loop), sock=sock)
    return client


async def child_run(round_trips: int, profile: bool, bulk_kib: int) -> dict:
    from profile_connections import in_process_mesh

    loop = asyncio.get_running_loop()
    async with in_process_mesh() as socks:
        client = await _tunnel(loop, socks)
        if bulk_kib:
            await asyncio.wait_for(client.bulk(bulk_kib * 1024), TRIAL_TIMEOUT_S)
        await asyncio.wait_for(client.start(WARMUP_ROUND_TRIPS), TRIAL_TIMEOUT_S)
        prof = cProfile.Profile(time.thread_time) if profile else None
        # Several slices per trial, the least CPU per round trip kept: a slice that another
        # process's burst on this shared host disturbed costs more, never less.
        slices = []
        for _ in range(1 if profile else SLICES_PER_TRIAL):
            wall0, cpu0 = time.monotonic(), time.process_time()
            if prof is not None:
                prof.enable()
            await asyncio.wait_for(client.start(round_trips), TRIAL_TIMEOUT_S)
            if prof is not None:
                prof.disable()
            slices.append((time.process_time() - cpu0, time.monotonic() - wall0))
        cpu, wall = min(slices)
        client.transport.close()
    out: dict = {"cpu_us_per_rt": cpu * 1e6 / round_trips, "wall_us_per_rt": wall * 1e6 / round_trips}
    if prof is not None:
        stats = pstats.Stats(prof, stream=io.StringIO())
        rows = []
        for (file, line, fn), (_cc, ncalls, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
            where = file.split("site-packages/")[-1].split("/ambient_mesh/")[-1]
            rows.append(
                {
                    "function": f"{fn} ({where}:{line})",
                    "calls_per_rt": ncalls / round_trips,
                    "own_us_per_rt": tt * 1e6 / round_trips,
                    "cum_us_per_rt": ct * 1e6 / round_trips,
                }
            )
        out["profile"] = sorted(rows, key=lambda r: -r["own_us_per_rt"])
    return out


def child_main(args: argparse.Namespace) -> int:
    sys.path.insert(0, args.tree)
    sys.path.insert(1, str(ROOT / "bench"))
    import uvloop

    from ambient_mesh.logs import configure_logging

    fd, log_path = tempfile.mkstemp(prefix="pingpong-ab-", suffix=".log")
    log_file = os.fdopen(fd, "w")
    configure_logging("plain", "info", stream=log_file)
    try:
        result = uvloop.run(child_run(args.round_trips, args.profile, args.bulk_kib))
    finally:
        log_file.close()
        os.unlink(log_path)
    print(json.dumps(result))
    return 0


def trial(spec: str, round_trips: int, profile: bool, bulk_kib: int = 0) -> dict:
    """One trial of a tree (`PATH[@PYTHON]`) in a fresh process of its interpreter."""
    sys.path.insert(0, str(ROOT / "bench"))
    from hbone_bench import split_tree

    tree, python = split_tree(spec)
    inner = [python, __file__, "--child", "--tree", tree, "--round-trips", str(round_trips)]
    inner += ["--bulk-kib", str(bulk_kib)]
    if profile:
        inner.append("--profile")
    script = "ip link set lo up && exec " + " ".join(f"'{a}'" for a in inner)
    done = subprocess.run(
        ["unshare", "--net", "bash", "-c", script],
        capture_output=True,
        text=True,
        timeout=TRIAL_TIMEOUT_S,
        env={**os.environ, "PYTHONPATH": tree},
    )
    if done.returncode != 0:
        raise SystemExit(f"trial of {tree} failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def netns_ab(trees: dict[str, str], batches: int, round_trips: int, bulk_mib: int = 0) -> dict:
    """Both trees' proxy pairs up at once in hbone_bench's netns topology (pinned one-core, as
    connection_ab_bench.py does for connections), latency batches alternated ABBA; per batch each
    pair's proxy CPU per round trip (both proxies, /proc) and p50. The ratio within a batch
    pair is the figure: on this host the speed of a core drifts more between runs than a small
    change moves it. With `bulk_mib`, each batch is one transfer of that many MiB through one
    connection instead (the per-message path for large messages): proxy CPU per GiB (both
    proxies together) and Gbit/s."""
    sys.path.insert(0, str(ROOT / "bench"))
    from hbone_bench import run_measured, tree_benches

    names = list(trees)
    rows: list[dict[str, dict[str, float]]] = []
    latency = ["--test", "latency", "--latency-bytes", "1", "--warmup", "200"]
    latency += ["--round-trips", str(round_trips)]
    bulk = ["--test", "throughput", "--size", str(bulk_mib * 1024 * 1024), "--parallel", "1"]
    keys = ("proxy_cpu_s_per_gib", "gbit_s") if bulk_mib else ("proxy_cpu_us_per_rt", "p50_us")
    with tree_benches([trees[name] for name in names], "pingpong-ab-") as benches:
        for i in range(batches):
            row: dict[str, dict[str, float]] = {}
            for k in (0, 1) if i % 2 == 0 else (1, 0):
                result, cpu = run_measured(benches[k], *(bulk if bulk_mib else latency))
                if bulk_mib:
                    row[names[k]] = {keys[0]: cpu / (result["bytes"] / 2**30), keys[1]: result["gbit_s"]}
                    continue
                n = result["count"] + 200  # the warm-up's round trips ran through the proxies too
                row[names[k]] = {keys[0]: cpu * 1e6 / n / 2, keys[1]: result["p50_us"]}
            rows.append(row)
            print(
                f"batch {i + 1}/{batches}: "
                + ", ".join(
                    f"{n} {keys[0]} {v[keys[0]]:.2f}, {keys[1]} {v[keys[1]]:.2f}" for n, v in row.items()
                ),
                flush=True,
            )
    base, other = names
    out: dict = {"batches": rows}
    for key in keys:
        ratios = [r[other][key] / r[base][key] for r in rows]
        out[f"{key}_median"] = {n: statistics.median(r[n][key] for r in rows) for n in names}
        out[f"paired_ratio_{key}"] = statistics.median(ratios)
        out[f"paired_ratio_{key}_range"] = [min(ratios), max(ratios)]
        print(
            f"{key}: medians "
            + ", ".join(f"{n} {v:.1f}" for n, v in out[f"{key}_median"].items())
            + f"; {other}/{base} median paired ratio {statistics.median(ratios):.3f} "
            f"({min(ratios):.3f}-{max(ratios):.3f})"
        )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "trees",
        nargs="*",
        help="name=PATH[@PYTHON] of a source tree (default: this one); @PYTHON runs it on another interpreter",
    )
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--round-trips", type=int, default=5000, help="per slice (5 slices per trial)")
    p.add_argument("--profile", action="store_true")
    p.add_argument(
        "--bulk-kib",
        type=int,
        default=0,
        help="in-process: first send this much through the tunnel in one write (echoed back)",
    )
    p.add_argument(
        "--netns",
        action="store_true",
        help="two trees' proxies in hbone_bench's netns topology instead, latency batches alternated "
        "(--trials batches of --round-trips)",
    )
    p.add_argument(
        "--bulk-mib",
        type=int,
        default=0,
        help="--netns: batches of one transfer of this many MiB (proxy CPU per GiB) instead of round trips",
    )
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "pingpong_ab.json"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tree", default=str(ROOT), help=argparse.SUPPRESS)
    args = p.parse_args()
    if not 1 <= args.round_trips <= MAX_ROUND_TRIPS or not 1 <= args.trials <= 100:
        raise SystemExit(f"--round-trips 1-{MAX_ROUND_TRIPS}, --trials 1-100")
    if not 0 <= args.bulk_kib <= MAX_BULK_KIB:
        raise SystemExit(f"--bulk-kib 0-{MAX_BULK_KIB}")
    if not 0 <= args.bulk_mib <= MAX_BULK_MIB:
        raise SystemExit(f"--bulk-mib 0-{MAX_BULK_MIB}")
    if args.child:
        return child_main(args)
    trees = dict(t.split("=", 1) for t in args.trees) if args.trees else {"this": str(ROOT)}
    if args.netns:
        if len(trees) != 2:
            raise SystemExit("--netns compares two trees: base=PATH other=PATH")
        result = netns_ab(trees, args.trials, args.round_trips, args.bulk_mib)
        result.update(
            trees=trees, round_trips=args.round_trips, bulk_mib=args.bulk_mib, load_average=os.getloadavg()
        )
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"wrote {out}")
        return 0
    if args.profile:
        for name, tree in trees.items():
            result = trial(tree, args.round_trips, profile=True, bulk_kib=args.bulk_kib)
            rows = result["profile"]
            calls = sum(r["calls_per_rt"] for r in rows)
            print(
                f"\n{name} ({tree}): {result['cpu_us_per_rt']:.1f} µs CPU per round trip under cProfile, "
                f"{calls:.1f} Python-visible calls per round trip (both proxies, client, echo)"
            )
            print(f"{'own µs':>8} {'cum µs':>8} {'calls':>7}  function")
            for r in rows[: args.top]:
                print(
                    f"{r['own_us_per_rt']:8.2f} {r['cum_us_per_rt']:8.2f} {r['calls_per_rt']:7.2f}  {r['function']}"
                )
        return 0
    cpu: dict[str, list[float]] = {k: [] for k in trees}
    for i in range(args.trials):
        order = list(trees) if i % 2 == 0 else list(reversed(trees))
        for name in order:
            cpu[name].append(trial(trees[name], args.round_trips, False, args.bulk_kib)["cpu_us_per_rt"])
        print(
            f"trial {i + 1}/{args.trials}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in cpu.items()),
            flush=True,
        )
    names = list(trees)
    print(f"\nCPU µs per round trip (whole process: both proxies, client, echo), {args.trials} trials")
    for name in names:
        print(f"  {name:<12} median {statistics.median(cpu[name]):7.1f}  min {min(cpu[name]):7.1f}")
    result: dict = {
        "trees": trees,
        "round_trips": args.round_trips,
        "cpu_us_per_rt": cpu,
        "python": platform.python_version(),
        "load_average": os.getloadavg(),
    }
    if len(names) >= 2:
        base = names[0]
        for name in names[1:]:
            ratios = [a / b for a, b in zip(cpu[name], cpu[base], strict=True)]
            result[f"paired_ratio_{name}_over_{base}"] = statistics.median(ratios)
            print(
                f"  {name}/{base}: median paired ratio {statistics.median(ratios):.3f} "
                f"({min(ratios):.3f}-{max(ratios):.3f})"
            )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
