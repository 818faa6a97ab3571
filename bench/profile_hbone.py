"""Profile both node proxies under one HBONE bench test with py-spy (sampling, no code changes).

Builds the same topology as hbone_bench.py (netns when root, else loopback), warms the HBONE
path up, attaches `py-spy record --format raw` to the client (outbound) and server (inbound)
proxy processes, runs one test through them, stops the samplers and prints, per proxy, the
functions with the most self samples and the most inclusive samples. `--test throughput`
(default) pushes --size-mib through one HBONE connection (or --parallel of them): the
per-message path; `--test connections` opens --connections tunnels one after another
(connect, 1-byte round trip, close): the per-connection path; `--test latency` does
--round-trips 1-byte ping-pongs on one tunnel: the per-message path for small messages. Samples are of active CPU only: py-spy leaves out threads that are idle in
epoll. Raw folded stacks are kept in a directory printed at the end (flamegraph-ready).

`--perf` samples with `perf record` instead (shares by shared object and C symbol) and adds, per
proxy, the share of samples in AES-GCM code (`perf_aead.py`), as CPU s per GiB in a throughput
test. `--mode envoy --perf` profiles the Envoy pair of hbone_bench's envoy mode the same way, so
both pairs' AES-GCM cost can be set side by side.

    .venv/bin/pip install py-spy        # once
    sudo .venv/bin/python bench/profile_hbone.py [--test throughput|connections|latency]
        [--size-mib 2048] [--connections 3000] [--round-trips 20000] [--native] [--top 25]
        [--perf [--mode hbone|envoy]]
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hbone_bench  # noqa: E402
import perf_aead  # noqa: E402
from hbone_bench import ROOT, Bench, choose_topology, proc_cpu_s  # noqa: E402

PYSPY_START_S = 1.0  # py-spy needs a moment to attach before the traffic starts
PYSPY_STOP_TIMEOUT_S = 30.0
_LINE = re.compile(r":\d+\)$")


def pyspy_binary() -> str:
    local = Path(sys.executable).with_name("py-spy")
    found = str(local) if local.exists() else shutil.which("py-spy")
    if not found:
        raise SystemExit("py-spy is not installed: .venv/bin/pip install py-spy")
    return found


def frame_name(frame: str) -> str:
    """`send_data (h2/connection.py:880)` -> `send_data (h2/connection.py)`: one row per function."""
    frame = _LINE.sub(")", frame.strip())
    return re.sub(r"\(.*?site-packages/", "(", frame.replace(f"({ROOT}/", "("))


def fold(path: Path) -> tuple[collections.Counter, collections.Counter, int]:
    """Self and inclusive sample counts per function from py-spy's raw (folded) output."""
    own: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [frame_name(f) for f in stack.split(";") if f.strip()]
        if not frames:
            continue
        total += n
        own[frames[-1]] += n
        for name in set(frames):
            inclusive[name] += n
    return own, inclusive, total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--topology", choices=("auto", "netns", "loopback"), default="auto")
    p.add_argument("--size-mib", type=int, default=2048)
    p.add_argument("--parallel", type=int, default=1)
    p.add_argument("--test", choices=("throughput", "connections", "latency"), default="throughput")
    p.add_argument("--connections", type=int, default=3000, help="tunnels for --test connections")
    p.add_argument("--round-trips", type=int, default=20000, help="ping-pongs for --test latency")
    p.add_argument("--max-seconds", type=float, default=60.0, help="bound of --test connections")
    p.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    p.add_argument("--native", action="store_true", help="include C frames (OpenSSL, CPython)")
    p.add_argument(
        "--perf",
        action="store_true",
        help="sample with `perf record` (cpu-clock, user and kernel) instead of py-spy: shares by "
        "shared object and by C symbol, which py-spy's Python view hides (the interpreter, uvloop, "
        "OpenSSL, the kernel)",
    )
    p.add_argument("--top", type=int, default=25)
    p.add_argument(
        "--mode",
        choices=("hbone", "envoy"),
        default="hbone",
        help="the pair to profile: our proxies, or the Envoy pair of hbone_bench's envoy mode "
        "(--perf only: Envoy is not Python)",
    )
    p.add_argument("--no-pin", action="store_true")
    p.add_argument(
        "--cprofile",
        action="store_true",
        help="run the proxies under cProfile (timer: time.thread_time) instead of py-spy (exact call "
        "counts per connection or round trip, deterministic overhead on every Python call)",
    )
    args = p.parse_args()
    if args.mode == "envoy" and not args.perf:
        p.error("--mode envoy needs --perf (py-spy and cProfile see only Python)")
    if args.cprofile:
        return cprofile_main(args)

    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)
    spy = shutil.which("perf") if args.perf else pyspy_binary()
    if spy is None:
        raise SystemExit("perf is not installed (apt-get install linux-perf)")
    out_dir = Path(tempfile.mkdtemp(prefix="hbone-profile-"))
    bench_args = argparse.Namespace(
        modes=[args.mode],
        size_mib=args.size_mib if args.test == "throughput" else 64,  # warm-up transfer
        parallel=args.parallel,
        latency_bytes=1,
        round_trips=0,
        warmup=0,
        connections=0,
        idle_connections=0,
    )
    workdir = Path(tempfile.mkdtemp(prefix="hbone-bench-"))
    topo = choose_topology(args.topology, workdir, envoy=args.mode == "envoy")
    try:
        bench = Bench(topo=topo, args=bench_args, pin=not args.no_pin)
        bench.apply_layout("spread")
        bench.warm_up()
        samplers = {}
        pids = topo.pids(args.mode)
        for name, pid in pids.items():
            if args.perf:
                argv = [spy, "record", "-e", "cpu-clock", "-F", str(args.rate), "-p", str(pid)]
                argv += ["-o", str(out_dir / f"{name}.perf")]
                samplers[name] = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                continue
            argv = [
                spy,
                "record",
                "--pid",
                str(pid),
                "--rate",
                str(args.rate),
                "--format",
                "raw",
                "--output",
                str(out_dir / f"{name}.folded"),
            ]
            # Native unwinding has to stop the process for each sample; Python-only need not.
            argv.append("--native" if args.native else "--nonblocking")
            samplers[name] = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(PYSPY_START_S)
        size = args.size_mib * 1024 * 1024
        cpu0 = {n: proc_cpu_s(pid) for n, pid in pids.items()}
        if args.test == "throughput":
            test_argv = ["--test", "throughput", "--size", str(size), "--parallel", str(args.parallel)]
        elif args.test == "connections":
            test_argv = ["--test", "connections", "--connections", str(args.connections)]
            test_argv += ["--max-seconds", str(args.max_seconds)]
        else:
            test_argv = ["--test", "latency", "--latency-bytes", "1", "--warmup", "0"]
            test_argv += ["--round-trips", str(args.round_trips)]
        result = bench.run_client(args.mode, *test_argv)
        cpu = {n: proc_cpu_s(pid) - cpu0[n] for n, pid in pids.items()}
        for name, sampler in samplers.items():
            sampler.send_signal(signal.SIGINT)
            try:
                sampler.wait(timeout=PYSPY_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                sampler.kill()
                sampler.wait()
            if sampler.returncode not in (0, -signal.SIGINT):
                console.print(
                    f"py-spy for {name} exited with {sampler.returncode}: "
                    f"{sampler.stderr.read().decode()[-500:]}"
                )
    finally:
        topo.close()
        shutil.rmtree(workdir, ignore_errors=True)

    console.print(f"topology: {topo.label}")
    if args.test == "throughput":
        what = f"{result['gbit_s']:.2f} Gbit/s, {args.parallel} x {args.size_mib} MiB"
    elif args.test == "connections":
        n = result["connections"]
        what = f"{result['conn_s']:.0f} conn/s, {n} connections; proxy CPU ms per connection: " + ", ".join(
            f"{k} {v * 1000 / n:.3f}" for k, v in cpu.items()
        )
    else:
        what = f"p50 {result['p50_us']:.1f} µs, p99 {result['p99_us']:.1f} µs, {result['count']} round trips"
    console.print(
        f"{args.mode} {args.test} under {'perf' if args.perf else 'py-spy'} ({args.rate} Hz, {'native' if args.native or args.perf else 'python'} "
        f"frames): {what}; proxy CPU s: " + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items())
    )
    for name, role in (("client", "outbound (TCP -> HBONE)"), ("server", "inbound (HBONE -> TCP)")):
        if args.perf:
            print_perf(console, out_dir / f"{name}.perf", f"{name} proxy, {role}", args.top)
            print_aead(console, out_dir / f"{name}.perf", name, args.mode, cpu[name], result, args.test)
            continue
        path = out_dir / f"{name}.folded"
        if not path.exists():
            console.print(f"no samples for {name}")
            continue
        own, inclusive, total = fold(path)
        if not total:
            continue
        for title, counter in (("self", own), ("inclusive", inclusive)):
            t = Table(title=f"{name} proxy, {role}: top {args.top} by {title} samples ({total} samples)")
            t.add_column("%", justify="right")
            t.add_column("samples", justify="right")
            t.add_column("function (file)")
            for fn, n in counter.most_common(args.top):
                t.add_row(f"{100 * n / total:.1f}", str(n), fn)
            console.print(t)
    console.print(f"folded stacks kept in {out_dir}")
    return 0


def print_perf(console, path: Path, title: str, top: int) -> None:
    """`perf report` of one proxy: the share of each shared object, then of each symbol."""
    if not path.exists():
        console.print(f"no perf samples for {title}")
        return
    for sort in ("dso", "dso,sym"):
        report = subprocess.run(
            ["perf", "report", "-i", str(path), "--stdio", "--sort", sort, "--percent-limit", "0.5"],
            capture_output=True,
            text=True,
            timeout=300,
        ).stdout
        rows = [line for line in report.splitlines() if line.strip() and not line.startswith("#")]
        console.print(f"[bold]{title}[/bold]: perf samples by {sort}")
        for line in rows[:top]:
            console.print("  " + line.strip())


def aead_objects(mode: str) -> dict[str, str]:
    """The shared objects whose AES-GCM `perf_aead` looks for: Envoy's binary (BoringSSL is in it),
    or ours: `cryptography`'s Rust extension (its own OpenSSL: the record layer's AEAD and, through
    pyOpenSSL, the handshake) and the system OpenSSL (whatever else links it)."""
    if mode == "envoy":
        from tests.interop.envoy import envoy_binary

        binary = envoy_binary()
        return {"envoy": binary} if binary else {}
    import cryptography.hazmat.bindings._rust as rust

    objects = {Path(rust.__file__).name: rust.__file__}
    libcrypto = Path("/usr/lib/x86_64-linux-gnu/libcrypto.so.3")
    if libcrypto.exists():
        objects[libcrypto.name] = str(libcrypto)
    return objects


def print_aead(console, path: Path, name: str, mode: str, cpu_s: float, result: dict, test: str) -> None:
    """The share of one proxy's samples in AES-GCM code (perf_aead), and that share of its CPU per
    GiB in a throughput test."""
    if not path.exists():
        return
    share = perf_aead.aead_share(path, aead_objects(mode))
    line = f"{name} proxy: AES-GCM code {share.total_pct:.1f}% of samples"
    if test == "throughput" and result.get("bytes"):
        gib = result["bytes"] / 2**30
        line += f" = {cpu_s * share.total_pct / 100 / gib:.3f} of {cpu_s / gib:.3f} CPU s per GiB"
    console.print(line + " (" + ", ".join(f"{k} {v:.1f}%" for k, v in share.by_object.items()) + ")")


# The proxy under cProfile timed by `time.thread_time`: the process's own CPU, not wall time (on one core
# a wall-clock profile puts the woken peer's run time on the waking write). Written when the proxy exits
# (stop_member's SIGTERM drains it).
_CPROFILE_THREAD_TIME = """
import cProfile, runpy, sys, time
out = sys.argv[1]
sys.argv = ["ambient_mesh.cli", "ztunnel"]
profile = cProfile.Profile(time.thread_time)
profile.enable()
try:
    runpy.run_module("ambient_mesh.cli", run_name="__main__", alter_sys=True)
finally:
    profile.disable()
    profile.dump_stats(out)
"""


def cprofile_main(args: argparse.Namespace) -> int:
    """The proxies under `python -m cProfile`: top functions by own time, with calls per unit."""
    import pstats

    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 160)
    workdir = Path(tempfile.mkdtemp(prefix="hbone-bench-"))
    outputs = [workdir / "cprofile-client.out", workdir / "cprofile-server.out"]
    spawned = iter(outputs * 2)
    hbone_bench.proxy_argv = lambda: [  # _start_proxies spawns the client, then the server
        sys.executable,
        "-c",
        _CPROFILE_THREAD_TIME,
        str(next(spawned)),
    ]
    bench_args = argparse.Namespace(
        modes=["hbone"],
        size_mib=args.size_mib if args.test == "throughput" else 64,
        parallel=args.parallel,
        latency_bytes=1,
        round_trips=0,
        warmup=0,
        connections=0,
        idle_connections=0,
    )
    topo = choose_topology(args.topology, workdir)
    try:
        bench = Bench(topo=topo, args=bench_args, pin=not args.no_pin)
        bench.apply_layout("spread")
        bench.warm_up()
        if args.test == "connections":
            test_argv = ["--test", "connections", "--connections", str(args.connections)]
            test_argv += ["--max-seconds", str(args.max_seconds)]
            units, unit = args.connections, "connection"
        elif args.test == "latency":
            test_argv = ["--test", "latency", "--latency-bytes", "1", "--warmup", "0"]
            test_argv += ["--round-trips", str(args.round_trips)]
            units, unit = args.round_trips, "round trip"
        else:
            size = args.size_mib * 1024 * 1024
            test_argv = ["--test", "throughput", "--size", str(size), "--parallel", str(args.parallel)]
            units, unit = args.size_mib, "MiB"
        result = bench.run_client("hbone", *test_argv)
        for process in topo.proxies.values():
            hbone_bench.stop_member(process, grace_s=20.0)  # cProfile writes its file at exit
    finally:
        topo.close()
    console.print(f"topology: {topo.label}; {args.test}: {result}")
    for name, path in zip(("client", "server"), outputs, strict=True):
        if not path.exists():
            console.print(f"no cProfile output for {name}")
            continue
        stats = pstats.Stats(str(path))
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])  # own time
        total = sum(v[2] for _k, v in rows)
        console.print(f"[bold]{name} proxy[/bold]: {total:.2f} s own time in Python-visible calls")
        for (file, line, fn), (_cc, ncalls, tt, ct, _callers) in rows[: args.top]:
            where = file.replace(f"{ROOT}/", "").split("site-packages/")[-1]
            console.print(
                f"  {100 * tt / total:5.1f}%  {tt * 1e6 / units:8.1f} µs/{unit}  "
                f"{ncalls / units:7.2f} calls/{unit}  cum {ct * 1e6 / units:8.1f}  {fn} ({where}:{line})"
            )
    console.print(f"cProfile files kept in {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
