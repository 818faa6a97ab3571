"""Attack benchmark: an honest client's latency on its own tunnel while each HBONE attack runs.

Counterpart: issue 8's attacks (tests/interop/h2attack.py, the same code the netns attack tests
use), measured as docs/performance.md, "Under attack", reports it: an honest client in the
client pod does 64-byte round trips to the server pod's app through both node proxies (its own
HBONE connection), first alone (the baseline), then while an attacker in another namespace,
holding a valid mesh certificate, repeats one attack against the server proxy's 15008 for
--seconds (reconnecting after each GOAWAY or close, at most --max-connections times).

Topology: hbone_bench.py's netns topology (root): nodes client and server with dedicated-mode
proxies and iptables capture, the bench server (echo) in server; the attacker dials from the
`plain` node (no proxy, no capture); a never-reading app in server for the aborted-uploads case.

The attacker runs in its own process (this script's `--worker attack`, inside the attacker's
namespace), so the honest client's timings do not include the attacker's share of our GIL.

Per attack the table gives: attacker connections and frames, how they ended (GOAWAY code or
close), the honest p50 / p99 / max and its round-trip count during the attack next to the
baseline, errors, and the server proxy's peak RSS and CPU. JSON goes to results/attack.json.

    sudo .venv/bin/python bench/attack_bench.py [--seconds 3] [--attacks rapid_reset,...]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from hbone_bench import BENCH_PORT, CMD_ECHO, NetnsTopology, proc_cpu_s, workdir  # noqa: E402

from tests.interop import h2attack  # noqa: E402
from tests.interop.h2attack import (  # noqa: E402
    FLOODS,
    HonestClient,
    RssWatch,
    Target,
    run_aborted_uploads,
    run_flood,
)

RESULTS = HERE / "results" / "attack.json"
SLOW_APP_PORT = 5202
HONEST_PAUSE_S = 0.001
HONEST_PAYLOAD = b"h" * 64
FLOOD_MAX_SECONDS = 10.0  # one attack connection, if the proxy never ends it
ATTACKS = (*FLOODS, "aborted_uploads")


def honest_window(topo: NetnsTopology, seconds: float) -> dict:
    with HonestClient(
        str(topo.server.ipv4),
        BENCH_PORT,
        netns=topo.client.netns,
        preamble=CMD_ECHO,
        payload=HONEST_PAYLOAD,
        pause_s=HONEST_PAUSE_S,
    ) as honest:
        time.sleep(seconds)
    return {**honest.percentiles_us(), "error": honest.error}


def run_attack_worker(args: argparse.Namespace) -> int:
    """Inside the attacker's namespace: repeat one attack for --seconds; print one JSON line."""
    from datetime import UTC

    from ambient_mesh.identity.ca import CertificateAuthority
    from ambient_mesh.identity.spiffe import Identity

    cert = CertificateAuthority.insecure_test_ca().issue(
        Identity("cluster.local", "bench", "attacker"), 3600, now=datetime.datetime.now(UTC)
    )
    target = Target(
        host=args.host,
        port=15008,
        echo_authority=f"{args.host}:{BENCH_PORT}",
        slow_authority=f"{args.host}:{SLOW_APP_PORT}",
        echo_preamble=CMD_ECHO,
    )
    ends: collections.Counter[str] = collections.Counter()
    frames = connections = 0
    goaway_after: list[int] = []
    reasons: set[str] = set()
    start = time.monotonic()
    while time.monotonic() - start < args.seconds and connections < args.max_connections:
        connections += 1
        try:
            if args.attack == "aborted_uploads":
                out = run_aborted_uploads(cert, target, uploads=12, upload_bytes=3 * 1024 * 1024)
                ends["echo ok" if out.echo_bytes_back == out.echo_bytes_sent > 0 else "echo lost"] += 1
                continue
            flood = run_flood(FLOODS[args.attack], cert, target, max_seconds=FLOOD_MAX_SECONDS, settle_s=0.5)
        except OSError as e:  # the proxy refused or timed out the attacker's connection itself
            ends[f"connect failed: {type(e).__name__}"] += 1
            continue
        frames += flood.frames_sent
        ends[flood.goaway_code or flood.ended_by] += 1
        if flood.goaway_after_frames is not None:
            goaway_after.append(flood.goaway_after_frames)
        if flood.goaway_reason:
            reasons.add(flood.goaway_reason)
    row = {
        "attack": args.attack,
        "seconds": time.monotonic() - start,
        "attacker_connections": connections,
        "frames_sent": frames,
        "ended": dict(ends),
        "goaway_after_frames_max": max(goaway_after) if goaway_after else None,
        "goaway_reasons": sorted(reasons),
    }
    print(json.dumps(row), flush=True)
    return 0


def attack_window(topo: NetnsTopology, name: str, args: argparse.Namespace) -> dict:
    pid = topo.proxies["server"].pid
    cpu_before = proc_cpu_s(pid)
    argv = [
        "ip",
        "netns",
        "exec",
        topo.plain.netns,
        sys.executable,
        __file__,
        "--worker",
        "attack",
        "--attack",
        name,
        "--host",
        str(topo.server.ipv4),
        "--seconds",
        str(args.seconds),
        "--max-connections",
        str(args.max_connections),
    ]
    with (
        HonestClient(
            str(topo.server.ipv4),
            BENCH_PORT,
            netns=topo.client.netns,
            preamble=CMD_ECHO,
            payload=HONEST_PAYLOAD,
            pause_s=HONEST_PAUSE_S,
        ) as honest,
        RssWatch(pid) as rss,
    ):
        before = honest.count()
        out = subprocess.run(
            argv, capture_output=True, timeout=args.seconds + FLOOD_MAX_SECONDS + 60, stdin=subprocess.DEVNULL
        )
        latency = honest.percentiles_us(before)
    if out.returncode != 0:
        raise RuntimeError(f"attacker ({name}) failed:\n{out.stderr.decode()[-3000:]}")
    row = json.loads(out.stdout.decode().strip().splitlines()[-1])
    row["honest"] = {**latency, "error": honest.error}
    row["proxy_rss_mib"] = {"before": rss.baseline / 2**20, "peak": rss.peak / 2**20}
    row["proxy_cpu_s"] = proc_cpu_s(pid) - cpu_before
    return row


def print_table(console, baseline: dict, rows: list[dict]) -> None:
    from rich.table import Table

    t = Table(title="honest client (64-byte round trips, own tunnel) while each attack runs")
    for col in (
        "attack",
        "attacker conns / frames",
        "ended (count)",
        "GOAWAY after ≤ frames",
        "honest p50 / p99 / max µs",
        "honest round trips",
        "honest error",
        "proxy RSS peak MiB",
        "proxy CPU s",
    ):
        t.add_column(col)
    t.add_row(
        "(none: baseline)",
        "–",
        "–",
        "–",
        f"{baseline['p50_us']:.0f} / {baseline['p99_us']:.0f} / {baseline['max_us']:.0f}",
        str(baseline["count"]),
        baseline["error"] or "–",
        "–",
        "–",
    )
    for r in rows:
        h = r["honest"]
        t.add_row(
            r["attack"],
            f"{r['attacker_connections']} / {r['frames_sent']}",
            ", ".join(f"{k} {v}" for k, v in r["ended"].items()),
            str(r["goaway_after_frames_max"] or "–"),
            f"{h['p50_us']:.0f} / {h['p99_us']:.0f} / {h['max_us']:.0f}",
            str(h["count"]),
            h["error"] or "–",
            f"{r['proxy_rss_mib']['before']:.0f} -> {r['proxy_rss_mib']['peak']:.0f}",
            f"{r['proxy_cpu_s']:.2f}",
        )
    console.print(t)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=3.0, help="per attack (and for the baseline)")
    p.add_argument("--max-connections", type=int, default=2000, help="attacker connections per attack")
    p.add_argument("--attacks", default=",".join(ATTACKS))
    p.add_argument("--keep", action="store_true", help="keep the work directory (proxy logs)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--worker", choices=("attack",), help=argparse.SUPPRESS)
    p.add_argument("--attack", help=argparse.SUPPRESS)
    p.add_argument("--host", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker == "attack":
        return run_attack_worker(args)
    attacks = [a for a in args.attacks.split(",") if a]
    for a in attacks:
        if a not in ATTACKS:
            p.error(f"unknown attack {a!r}; known: {', '.join(ATTACKS)}")
    if os.geteuid() != 0:
        p.error("needs root: the topology is network namespaces (hbone_bench.py's netns topology)")

    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 160)
    rows = []
    with workdir(args.keep) as wd:
        topo = NetnsTopology(wd)
        try:
            slow = topo.fabric.spawn(
                topo.server,
                [sys.executable, h2attack.__file__, "--slow-app", str(SLOW_APP_PORT)],
                stdout=subprocess.PIPE,
            )
            if not slow.stdout.readline().startswith(b"listening"):
                raise RuntimeError("the never-reading app did not start")
            honest_window(topo, 0.5)  # warm: certificates, the pooled HBONE connection
            baseline = honest_window(topo, args.seconds)
            console.print(
                f"topology: {topo.label}; attacker in {topo.plain.name}; server proxy pid {topo.pids()['server']}"
            )
            for name in attacks:
                row = attack_window(topo, name, args)
                rows.append(row)
                console.print(
                    f"{name}: done in {row['seconds']:.1f}s, {row['attacker_connections']} connections"
                )
        finally:
            topo.close()
    print_table(console, baseline, rows)
    doc = {
        "benchmark": "attack",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "topology": topo.label,
        "parameters": {"seconds": args.seconds, "max_connections": args.max_connections, "attacks": attacks},
        "baseline": baseline,
        "attacks": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
