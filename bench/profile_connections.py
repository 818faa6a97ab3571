"""The per-connection path of an in-process mesh under cProfile with a CPU-time clock.

Both node proxies (dedicated mode, on 127.0.0.2 and 127.0.0.3 as tests/integration/mesh.py has
them), the echo app and the client run in one uvloop process, so nothing of ours is preempted
by a peer while inside a call (on one core a wall-clock profile puts
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

`--netns` profiles each node proxy of hbone_bench's netns topology instead (one-core layout,
the bench's client through the 15001 capture, as connection_ab_bench runs it): the proxies run
the tree with a `sitecustomize` that starts cProfile (thread CPU) on SIGUSR1 and writes its
stats on SIGUSR2, sent around --connections after --warmup; an unprofiled batch first gives each
proxy's user and system CPU per connection (/proc). Prints, per proxy, the Python calls per
connection (cProfile's total calls / connections: a count, not a time, so it compares across
runs on a loaded host), the profiled time, the calls by file and the top functions.

    .venv/bin/python bench/profile_connections.py --netns [--connections 2000] [--tree <worktree>]

`--roots` times each callback root of the per-connection path (ROOTS: the accept and TLS read
callbacks, the plain endpoints' callbacks, the handler coroutines' steps, the end of a
connection, and a few calls inside them) with `time.thread_time` inside each netns proxy, and
prints the thread CPU per connection of each: real CPU with syscalls, where cProfile's figures
are inflated by its cost per call and call-heavy code the most.

    .venv/bin/python bench/profile_connections.py --roots [--connections 2000] [--tree <worktree>]
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
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

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


# Loaded by each proxy (the tree's `ambient_mesh` beside it on PYTHONPATH): cProfile on thread
# CPU between SIGUSR1 and SIGUSR2, its stats written beside this file as <pid>.pstats.
PROFILER_SITECUSTOMIZE = """
import cProfile, os, signal, time
_here = os.path.dirname(os.path.abspath(__file__))
_profile = []
def _start(signum, frame):
    _profile[:] = [cProfile.Profile(time.thread_time)]
    _profile[0].enable()
def _stop(signum, frame):
    if _profile:
        _profile[0].disable()
        _profile.pop().dump_stats(os.path.join(_here, f"{os.getpid()}.pstats"))
signal.signal(signal.SIGUSR1, _start)
signal.signal(signal.SIGUSR2, _stop)
"""
# `--roots`: the callbacks and handler coroutines where a proxy's per-connection work starts (and
# a few calls inside them), each timed by time.thread_time inside the netns proxies: real CPU,
# syscalls included, without cProfile's cost per call (about 1 µs per wrapped call for the two
# clock reads). (module, attribute path, "call" or "coro": a coroutine function's every
# resumption is timed). Names a tree does not have are skipped.
ROOTS = (
    ("ambient_mesh.proxy.listener", "Listener._on_readable", "call"),
    ("ambient_mesh.tls.transport", "TlsTransport._on_readable", "call"),
    ("ambient_mesh.tls.transport", "TlsTransport.write", "call"),
    ("ambient_mesh.tls.transport", "TlsTransport.writelines", "call"),
    ("ambient_mesh.proxy.hbone", "HboneConnection.buffer_updated", "call"),
    ("ambient_mesh.proxy.hbone", "HboneConnection.flush", "call"),
    ("ambient_mesh.proxy.hbone", "HboneConnection.respond", "call"),
    ("ambient_mesh.proxy.hbone", "HboneConnection.open_stream", "coro"),
    ("ambient_mesh.transport.relay", "TcpEndpoint.data_received", "call"),
    ("ambient_mesh.transport.relay", "TcpEndpoint.eof_received", "call"),
    ("ambient_mesh.transport.relay", "TcpEndpoint.connection_lost", "call"),
    ("ambient_mesh.transport.relay", "Relay.eof_from", "call"),
    ("ambient_mesh.proxy.open_connections", "OpenConnections._ended", "call"),
    ("ambient_mesh.proxy.open_connections", "OpenConnections.spawn", "call"),
    ("ambient_mesh.proxy.inputs", "ProxyInputs.connect", "coro"),
    ("ambient_mesh.proxy.inputs", "ProxyInputs.start_connect", "call"),
    ("ambient_mesh.proxy.telemetry", "ConnectionResult.complete", "call"),
    ("ambient_mesh.proxy.telemetry", "ConnectionResult.__init__", "call"),
    ("ambient_mesh.proxy.telemetry", "record_ended_connections", "call"),
    ("ambient_mesh.logs", "log_access_complete", "call"),
    ("ambient_mesh.logs", "write_deferred_access_lines", "call"),
    ("ambient_mesh.proxy.outbound", "OutboundProxy.handle_captured", "coro"),
    ("ambient_mesh.proxy.outbound", "OutboundProxy.open", "coro"),
    ("ambient_mesh.proxy.outbound", "OutboundProxy._open_hbone", "coro"),
    ("ambient_mesh.proxy.outbound", "build_request", "call"),
    ("ambient_mesh.proxy.inbound", "InboundProxy.serve_stream", "coro"),
    ("ambient_mesh.proxy.inbound", "InboundProxy.admit", "coro"),
    ("ambient_mesh.proxy.inbound", "InboundProxy.decide", "call"),
    ("ambient_mesh.proxy.inbound", "InboundProxy.start_carry", "call"),
    ("ambient_mesh.proxy.listener", "Listener._guard", "coro"),
    ("ambient_mesh.proxy.outbound", "OutboundProxy.proxy_to", "coro"),
    ("ambient_mesh.proxy.outbound", "OutboundProxy.carry", "coro"),
    ("ambient_mesh.transport.relay", "wrap_socket", "coro"),
    ("ambient_mesh.transport.relay", "read_waiting", "call"),
    ("ambient_mesh.host.sockets", "original_destination", "call"),
    ("ambient_mesh.proxy.pool", "HbonePool.open_stream", "coro"),
    ("ambient_mesh.proxy.hbone", "HboneConnection._on_request", "call"),
    ("ambient_mesh.proxy.inbound", "InboundProxy._on_request", "call"),
    ("ambient_mesh.proxy.open_connections", "OpenConnections.track", "call"),
    ("ambient_mesh.transport.relay", "TcpEndpoint.attach", "call"),
    ("ambient_mesh.proxy.hbone", "HboneStream.attach", "call"),
)
ROOTS_SITECUSTOMIZE = """
import collections.abc, functools, importlib, inspect, json, os, signal, sys, time
_here = os.path.dirname(os.path.abspath(__file__))
_on = [False]
_acc = {}
_tt = time.thread_time
def _add(name, t):
    e = _acc.setdefault(name, [0, 0.0]); e[0] += 1; e[1] += _tt() - t
def _timed(name, fn):
    @functools.wraps(fn)
    def w(*a, **k):
        if not _on[0]:
            return fn(*a, **k)
        t = _tt()
        try:
            return fn(*a, **k)
        finally:
            _add(name, t)
    return w
class _TimedCoro(collections.abc.Coroutine):
    __slots__ = ("c", "name")
    def __init__(self, c, name): self.c = c; self.name = name
    def __await__(self): return self
    def __iter__(self): return self
    def __next__(self): return self.send(None)
    def _step(self, f, *a):
        if not _on[0]:
            return f(*a)
        t = _tt()
        try:
            return f(*a)
        finally:
            _add(self.name, t)
    def send(self, v): return self._step(self.c.send, v)
    def throw(self, *a): return self._step(self.c.throw, *a)
    def close(self): return self.c.close()
def _coro(name, fn):
    @functools.wraps(fn)
    def w(*a, **k): return _TimedCoro(fn(*a, **k), name)
    return w
def _install(roots):
    for module, path, kind in roots:
        try:
            owner = importlib.import_module(module)
            *outer, attr = path.split(".")
            for part in outer:
                owner = getattr(owner, part)
            fn = getattr(owner, attr)
        except (ImportError, AttributeError):
            continue
        # "coro" only where the tree's function is one (relay.wrap_socket was, before 19's tcp_transport)
        wrapped = (_coro if kind == "coro" and inspect.iscoroutinefunction(fn) else _timed)(path, fn)
        setattr(owner, attr, wrapped)
        if not outer:  # a module function: also where other modules imported it by name
            for other in list(sys.modules.values()):
                if getattr(other, "__name__", "").startswith("ambient_mesh") and getattr(other, attr, None) is fn:
                    setattr(other, attr, wrapped)
def _start(signum, frame):
    _acc.clear(); _acc["_start"] = [0, _tt()]; _on[0] = True
def _stop(signum, frame):
    _on[0] = False
    _acc["_thread"] = [0, _tt() - _acc.pop("_start")[1]]
    with open(os.path.join(_here, f"{os.getpid()}.roots.json"), "w") as out:
        json.dump(_acc, out)
if "ztunnel" in sys.argv:
    _install(json.load(open(os.path.join(_here, "roots.json"))))
signal.signal(signal.SIGUSR1, _start)
signal.signal(signal.SIGUSR2, _stop)
"""
PROFILE_STATS_WAIT_S = 10.0
NETNS_BATCH_MAX_SECONDS = 120


def per_file(stats: pstats.Stats, n: int) -> tuple[float, float, list[dict[str, float | str]]]:
    """Total calls and profiled µs per connection, and both by source file."""
    calls: dict[str, int] = {}
    own: dict[str, float] = {}
    for (file, _line, _fn), (_cc, ncalls, tt, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        key = file.split("ambient_mesh/")[-1] if "ambient_mesh/" in file else file.split("site-packages/")[-1]
        calls[key] = calls.get(key, 0) + ncalls
        own[key] = own.get(key, 0.0) + tt
    rows: list[dict[str, float | str]] = [
        {"file": key, "calls_per_conn": calls[key] / n, "own_us_per_conn": own[key] * 1e6 / n}
        for key in sorted(calls, key=lambda k: -calls[k])
    ]
    return sum(calls.values()) / n, sum(own.values()) * 1e6 / n, rows


@contextlib.contextmanager
def _netns_proxies_of(
    args: argparse.Namespace, sitecustomize: str, prefix: str, **files: str
) -> Iterator[tuple[Path, Path, Any]]:
    """hbone_bench's netns topology whose proxies run `--tree`'s ambient_mesh with
    `sitecustomize` (and `files`) on their path, warmed up by `--warmup` connections:
    (tree, the wrapper directory the proxies write into, the bench). Removed afterwards."""
    import shutil

    sys.path.insert(0, str(ROOT / "bench"))
    from hbone_bench import tree_benches

    tree = Path(args.tree).resolve()
    if not (tree / "ambient_mesh" / "proxy").is_dir():
        raise SystemExit(f"--tree {tree}: no ambient_mesh package there")
    wrapper = Path(tempfile.mkdtemp(prefix=f"{prefix}tree-"))
    try:
        (wrapper / "ambient_mesh").symlink_to(tree / "ambient_mesh")
        (wrapper / "sitecustomize.py").write_text(sitecustomize)
        for name, text in files.items():
            (wrapper / name).write_text(text)
        with tree_benches([str(wrapper)], prefix) as (bench,):
            if args.warmup:
                bench.run_client("hbone", "--test", "connections", "--connections", str(args.warmup))
            yield tree, wrapper, bench
    finally:
        shutil.rmtree(wrapper, ignore_errors=True)


def _signalled_batch(bench: Any, wrapper: Path, pids: dict[str, int], suffix: str, n: int) -> dict[str, Any]:
    """`n` connections between SIGUSR1 and SIGUSR2 to every proxy (its sitecustomize starts and
    stops measuring there), then a bounded wait for each proxy's `<pid><suffix>` in `wrapper`."""
    import signal

    for pid in pids.values():
        os.kill(pid, signal.SIGUSR1)
    result = bench.run_client(
        "hbone",
        "--test",
        "connections",
        "--connections",
        str(n),
        "--max-seconds",
        str(NETNS_BATCH_MAX_SECONDS),
    )
    for pid in pids.values():
        os.kill(pid, signal.SIGUSR2)
    deadline = time.monotonic() + PROFILE_STATS_WAIT_S
    while time.monotonic() < deadline and not all(
        (wrapper / f"{pid}{suffix}").exists() for pid in pids.values()
    ):
        time.sleep(0.1)
    time.sleep(0.2)  # written in place: let the last one finish
    return dict(result)


def _write_report(
    args: argparse.Namespace, mode: str, tree: Path, report: dict[str, Any], **extra: object
) -> None:
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "mode": mode,
                "tree": str(tree),
                "connections": args.connections,
                **extra,
                "proxies": report,
                "python": platform.python_version(),
                "load_average": os.getloadavg(),
            },
            indent=2,
        )
    )
    print(f"\nwrote {out}")


def netns_main(args: argparse.Namespace) -> int:
    import shutil

    sys.path.insert(0, str(ROOT / "bench"))
    from hbone_bench import proc_cpu_s, proc_user_cpu_s

    n = args.connections
    batch = ("--test", "connections", "--connections", str(n), "--max-seconds", str(NETNS_BATCH_MAX_SECONDS))
    report: dict[str, dict] = {}
    with _netns_proxies_of(args, PROFILER_SITECUSTOMIZE, "profile-conn-") as (tree, wrapper, bench):
        pids = bench.topo.pids()
        before = {role: (proc_user_cpu_s(pid), proc_cpu_s(pid)) for role, pid in pids.items()}
        plain = bench.run_client("hbone", *batch)
        after = {role: (proc_user_cpu_s(pid), proc_cpu_s(pid)) for role, pid in pids.items()}
        profiled = _signalled_batch(bench, wrapper, pids, ".pstats", n)
        for role, pid in pids.items():
            done = plain["connections"]
            user = (after[role][0] - before[role][0]) * 1e6 / done
            system = (after[role][1] - before[role][1]) * 1e6 / done - user
            m = profiled["connections"]
            stats = pstats.Stats(str(wrapper / f"{pid}.pstats"), stream=io.StringIO())
            if args.out:
                shutil.copyfile(wrapper / f"{pid}.pstats", f"{args.out}.{role}")
            calls, own_us, files = per_file(stats, m)
            top = sorted(
                (
                    {
                        "function": f"{fn} ({file.split('ambient_mesh/')[-1].split('site-packages/')[-1]}:{line})",
                        "calls_per_conn": ncalls / m,
                        "own_us_per_conn": tt * 1e6 / m,
                        "cum_us_per_conn": ct * 1e6 / m,
                    }
                    for (file, line, fn), (_cc, ncalls, tt, ct, _c) in stats.stats.items()  # type: ignore[attr-defined]
                ),
                key=lambda r: -r["calls_per_conn"],
            )[: args.top]
            report[role] = {
                "user_us_per_conn": user,
                "system_us_per_conn": system,
                "python_calls_per_conn": calls,
                "profiled_us_per_conn": own_us,
                "by_file": files,
                "top_by_calls": top,
            }
            print(
                f"{role} proxy: {calls:.0f} Python calls per connection (profiled {own_us:.0f} µs); "
                f"unprofiled CPU per connection: user {user:.0f} µs, system {system:.0f} µs"
            )
        for role in pids:
            print(f"\n{role} proxy, calls per connection by file")
            for row in report[role]["by_file"][:25]:
                print(f"{row['calls_per_conn']:8.1f} {row['own_us_per_conn']:8.1f} µs  {row['file']}")
            print(f"\n{role} proxy, top {args.top} functions by calls per connection")
            print(f"{'calls':>7} {'own µs':>8} {'cum µs':>8}  function")
            for r in report[role]["top_by_calls"]:
                print(
                    f"{r['calls_per_conn']:7.2f} {r['own_us_per_conn']:8.1f} {r['cum_us_per_conn']:8.1f}  {r['function']}"
                )
    _write_report(args, "netns", tree, report, warmup=args.warmup)
    return 0


def roots_main(args: argparse.Namespace) -> int:
    """`--roots`: thread CPU per connection of each callback root (ROOTS) in each netns proxy."""
    report: dict[str, dict] = {}
    with _netns_proxies_of(
        args, ROOTS_SITECUSTOMIZE, "profile-roots-", **{"roots.json": json.dumps(ROOTS)}
    ) as (tree, wrapper, bench):
        pids = bench.topo.pids()
        done = _signalled_batch(bench, wrapper, pids, ".roots.json", args.connections)["connections"]
        for role, pid in pids.items():
            got = json.loads((wrapper / f"{pid}.roots.json").read_text())
            thread = got.pop("_thread")[1]
            rows = sorted(
                (
                    {"root": name, "us_per_conn": cpu * 1e6 / done, "calls_per_conn": calls / done}
                    for name, (calls, cpu) in got.items()
                ),
                key=lambda r: -r["us_per_conn"],
            )
            report[role] = {"thread_us_per_conn": thread * 1e6 / done, "roots": rows}
            print(f"\n{role} proxy: thread CPU {thread * 1e6 / done:.0f} µs per connection")
            for r in rows:
                print(f"{r['us_per_conn']:8.1f} µs {r['calls_per_conn']:6.2f} calls  {r['root']}")
    _write_report(args, "roots", tree, report)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--connections", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--out", help="keep the pstats file here (with --netns: one per proxy, PATH.<role>)")
    p.add_argument(
        "--no-profile",
        action="store_true",
        help="run the connections without cProfile: the CPU per connection of the unprofiled process "
        "(and a target for py-spy or perf)",
    )
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "profile_connections.json"))
    p.add_argument("--tree", default=str(ROOT), help="the source tree whose ambient_mesh runs (A/B)")
    p.add_argument(
        "--netns",
        action="store_true",
        help="profile each node proxy of hbone_bench's netns topology (per-proxy calls per connection)",
    )
    p.add_argument(
        "--roots",
        action="store_true",
        help="thread CPU per connection of each callback root (ROOTS) in each node proxy of the "
        "netns topology, without cProfile",
    )
    args = p.parse_args()
    if args.roots:
        if not 1 <= args.connections <= MAX_CONNECTIONS or not 0 <= args.warmup <= MAX_CONNECTIONS:
            raise SystemExit(f"--connections 1-{MAX_CONNECTIONS}, --warmup 0-{MAX_CONNECTIONS}")
        return roots_main(args)
    if args.netns:
        if not 1 <= args.connections <= MAX_CONNECTIONS or not 0 <= args.warmup <= MAX_CONNECTIONS:
            raise SystemExit(f"--connections 1-{MAX_CONNECTIONS}, --warmup 0-{MAX_CONNECTIONS}")
        return netns_main(args)
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
