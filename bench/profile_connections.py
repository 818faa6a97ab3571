"""The per-connection path of an in-process mesh under cProfile with a CPU-time clock.

Both node proxies (dedicated mode, on 127.0.0.2 and 127.0.0.3 as tests/integration/mesh.py has
them), the echo app and the client run in one uvloop process, so nothing of ours is preempted
by a peer while inside a call (bench/README.md, issue 11: on one core a wall-clock profile puts
the woken peer's run time on the waking `write` or `connect`). The client opens --connections
tunnels one after another through the client proxy's SOCKS5 listener (connect, 1-byte round
trip, close); cProfile, timed by `time.thread_time`, is switched on after --warmup of them, so
the counts are calls per connection of the warm path. Prints the top functions by own CPU and
by cumulative CPU, per connection; `--out` keeps the pstats file.

    unshare --net bash -c 'ip link set lo up; .venv/bin/python bench/profile_connections.py \\
        [--connections 2000] [--warmup 300] [--top 40] [--no-profile] [--tree <other worktree>]'

(in a private network namespace: the proxies listen on fixed loopback ports, 15008).

Not a throughput figure (one process, cProfile's per-call cost): use connection_ab_bench.py or
hbone_bench.py for those. Writes results/profile_connections.json (the top rows).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import json
import os
import platform
import pstats
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CLIENT_IP = "127.0.0.2"
SERVER_IP = "127.0.0.3"
ECHO_PORT = 18080
MAX_CONNECTIONS = 100_000
ROUND_TRIP_TIMEOUT_S = 10.0

CONFIG = f"""
workloads:
- uid: cluster1//v1/Pod/default/client
  name: client
  namespace: default
  serviceAccount: client
  trustDomain: cluster.local
  workloadIps: ["{CLIENT_IP}"]
  protocol: HBONE
  node: node-a
  canonicalName: client
  canonicalRevision: v1
  workloadName: client
- uid: cluster1//v1/Pod/default/server
  name: server
  namespace: default
  serviceAccount: server
  trustDomain: cluster.local
  workloadIps: ["{SERVER_IP}"]
  protocol: HBONE
  node: node-b
  canonicalName: server
  canonicalRevision: v1
  workloadName: server
  services:
    "default/echo.default.svc.cluster.local":
      80: {ECHO_PORT}
services:
- name: echo
  namespace: default
  hostname: echo.default.svc.cluster.local
  vips: ["/127.10.0.1"]
  ports: {{80: {ECHO_PORT}}}
"""


def proxy_env(name: str, ip: str) -> dict[str, str]:
    from ambient_mesh.ports import HBONE_PORT

    return {
        "PROXY_MODE": "dedicated",
        "PROXY_WORKLOAD_INFO": f"default/{name}/{name}",
        "FAKE_CA": "true",
        "XDS_ADDRESS": "",
        "LOCAL_XDS": CONFIG,
        "UNSTABLE_ENABLE_SOCKS5": "true",
        "OUTBOUND_ADDR": f"{ip}:0",
        "INBOUND_ADDR": f"{ip}:{HBONE_PORT}",
        "INBOUND_PLAINTEXT_ADDR": f"{ip}:0",
        "SOCKS5_ADDR": f"{ip}:0",
        "ADMIN_ADDR": f"{ip}:0",
        "STATS_ADDR": f"{ip}:0",
        "READINESS_ADDR": f"{ip}:0",
        "ISTIO_META_DNS_PROXY_ADDR": f"{ip}:0",
        "TERMINATION_GRACE_PERIOD_SECONDS": "1",
    }


class Echo(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)  # type: ignore[attr-defined]

    def eof_received(self) -> bool:
        return False  # close


async def one_connection(socks: tuple[str, int]) -> None:
    reader, writer = await asyncio.open_connection(*socks)
    writer.write(b"\x05\x01\x00\x05\x01\x00\x01" + socket.inet_aton(SERVER_IP) + ECHO_PORT.to_bytes(2, "big"))
    if await reader.readexactly(2) != b"\x05\x00" or (await reader.readexactly(10))[1] != 0:
        raise SystemExit("SOCKS5 refused the connection: is the mesh up?")
    writer.write(b"x")
    if await reader.readexactly(1) != b"x":
        raise SystemExit("echo returned the wrong byte")
    writer.write_eof()
    await reader.read()  # the server side closes after EOF
    writer.close()
    await writer.wait_closed()


@contextlib.asynccontextmanager
async def in_process_mesh() -> AsyncIterator[tuple[str, int]]:
    """The echo app and both node proxies (`proxy_env`) in this process and event loop; yields
    the client proxy's SOCKS5 address (pingpong_ab_bench.py runs its trials in it too)."""
    from ambient_mesh.ztunnel import build

    loop = asyncio.get_running_loop()
    echo = await loop.create_server(Echo, SERVER_IP, ECHO_PORT)
    proxies = []
    try:
        for name, ip in (("client", CLIENT_IP), ("server", SERVER_IP)):
            proxy = await build(proxy_env(name, ip))
            await proxy.start()
            proxies.append(proxy)
        bound = proxies[0].listeners["socks5"].bound_address
        yield (str(bound.ip), bound.port)
    finally:
        for proxy in proxies:
            await proxy.drain(0.5)
        echo.close()


async def run(args: argparse.Namespace) -> tuple[cProfile.Profile, float, float]:
    async with in_process_mesh() as socks:
        for _ in range(args.warmup):
            await asyncio.wait_for(one_connection(socks), ROUND_TRIP_TIMEOUT_S)
        profile = cProfile.Profile(time.thread_time)
        wall0, cpu0 = time.monotonic(), time.thread_time()
        if not args.no_profile:
            profile.enable()
        for _ in range(args.connections):
            await asyncio.wait_for(one_connection(socks), ROUND_TRIP_TIMEOUT_S)
        profile.disable()
        return profile, time.monotonic() - wall0, time.thread_time() - cpu0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--connections", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--out", help="keep the pstats file here")
    p.add_argument(
        "--no-profile",
        action="store_true",
        help="run the connections without cProfile: the CPU per connection of the unprofiled process "
        "(and a target for py-spy or perf)",
    )
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "profile_connections.json"))
    p.add_argument("--tree", default=str(ROOT), help="the source tree whose ambient_mesh runs (A/B)")
    args = p.parse_args()
    sys.path.insert(0, args.tree)
    from ambient_mesh.logs import configure_logging

    if not 1 <= args.connections <= MAX_CONNECTIONS or not 0 <= args.warmup <= MAX_CONNECTIONS:
        raise SystemExit(f"--connections 1-{MAX_CONNECTIONS}, --warmup 0-{MAX_CONNECTIONS}")
    import uvloop

    # Access lines go where a proxy writes them (the handler configure_logging installs), to a
    # file rather than the terminal.
    fd, log_path = tempfile.mkstemp(prefix="profile-connections-", suffix=".log")
    log_file = os.fdopen(fd, "w")  # a plain file object: NamedTemporaryFile wraps every write
    configure_logging("plain", "info", stream=log_file)
    profile, wall_s, cpu_s = uvloop.run(run(args))
    log_file.close()
    os.unlink(log_path)
    n = args.connections
    if args.no_profile:
        print(
            f"{n} connections in {wall_s:.2f} s ({n / wall_s:.0f}/s), CPU {cpu_s * 1e6 / n:.0f} µs per connection"
        )
        return 0
    stats = pstats.Stats(profile, stream=io.StringIO())
    if args.out:
        stats.dump_stats(args.out)
    rows = [
        {
            "function": f"{fn} ({file.replace(f'{ROOT}/', '').split('site-packages/')[-1]}:{line})",
            "calls_per_conn": ncalls / n,
            "own_us_per_conn": tt * 1e6 / n,
            "cum_us_per_conn": ct * 1e6 / n,
        }
        for (file, line, fn), (_cc, ncalls, tt, ct, _callers) in stats.stats.items()  # type: ignore[attr-defined]
    ]
    total_us = sum(r["own_us_per_conn"] for r in rows)
    print(
        f"{n} connections in {wall_s:.2f} s ({n / wall_s:.0f}/s), CPU {cpu_s * 1e6 / n:.0f} µs per "
        f"connection under cProfile; profiled own time {total_us:.0f} µs per connection"
    )
    for key, title in (("own_us_per_conn", "own"), ("cum_us_per_conn", "cumulative")):
        print(f"\ntop {args.top} by {title} CPU, per connection (client, both proxies and echo)")
        print(f"{'own µs':>8} {'cum µs':>8} {'calls':>7}  function")
        for r in sorted(rows, key=lambda r: -r[key])[: args.top]:
            print(
                f"{r['own_us_per_conn']:8.1f} {r['cum_us_per_conn']:8.1f} {r['calls_per_conn']:7.2f}  {r['function']}"
            )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    top = sorted(rows, key=lambda r: -r["own_us_per_conn"])[: args.top]
    out.write_text(
        json.dumps(
            {
                "connections": n,
                "warmup": args.warmup,
                "conn_s": n / wall_s,
                "profiled_us_per_conn": total_us,
                "top_own": top,
                "python": platform.python_version(),
                "load_average": os.getloadavg(),
            },
            indent=2,
        )
    )
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
