"""ZTUNNEL_WORKER_THREADS: one node proxy's many-connection throughput with 1 and with 2 workers.

Counterpart: ztunnel's scaling figures with worker threads (e.g.
istio/ztunnel#1174). One proxy only, in the `tcp` mode of bench/hbone_bench.py: the bench
client enters the proxy through SOCKS5 and the destination is a TCP workload, so the proxy
under test does the whole outbound path (SOCKS5, routing, authorization, upstream connect,
relay, access log, metrics) and no second proxy competes for the cores. For the connection
test the load generator and the bench server are the C ones of bench/loadgen.c (built with gcc
at start; --python-generator, or no gcc, takes the uvloop ones, which cost more CPU per
connection than the proxy).

  connections  --concurrency clients, each looping connect + SOCKS5 + 1-byte round trip +
               close for --seconds: conn/s, and proxy CPU-ms per connection
  throughput   --parallel connections at once, --size-mib each, client -> server: Gbit/s (the
               Python generator and sink cost about as much CPU per byte as the proxy: on 2
               vCPUs they take the second core's share, so this says little about workers)

Both proxies (1 and 2 workers) are up at once and their runs alternate, in both orders, one
pair per round, layout and test, so the host's other work falls on both alike; the ratio is
taken within each pair. Layouts (--layouts):

  budget   each serving process (the workers; the 1-worker proxy's one process) pinned to a
           CPU of its own and held to --budget of it by a CFS quota (cgroup cpu controller,
           10 ms period); the generator and the bench server float over every CPU. The issue
           asks for the gain where the load's other end is not on the proxy's cores; a 2-vCPU
           host has no third core, so each worker gets the slice of a core the 1-worker proxy
           gets, and the rest of every core is left to the generator and the host. A quota
           is not a core: the process runs in bursts within each period, and on this host the
           1-worker proxy's CPU per connection moved with the budget (0.23 ms at 0.35, 0.14-0.18
           at 0.6, 0.20 unlimited, a loaded host), so compare ratios at one budget only.
  machine  1 worker on CPU1 with CPU0 left to the generator and the bench server; 2 workers
           free over every CPU, sharing CPU0 with them. This charges the generator's CPU to the
           2-worker figure only: with c1, c2 the proxy's CPU per connection with 1 and 2
           workers and g the generator's and bench server's, 2 workers reach at most
           2 c1 / (c2 + g) times 1 worker however well they scale (1.4-1.55 here: c 0.17-0.20
           ms, g 0.085 ms), so it cannot show the 1.6x target; it stays as the figure for the
           whole 2-vCPU machine.
  free     (not by default) nothing pinned and no quota, as on a node: the scheduler places
           the proxy's processes, the generator and the bench server. The same ceiling as
           `machine`, with the generator's CPU spread over both cores.

The machine is shared with other sessions. The bench's processes (this one and all it starts)
run in cgroups with a CFS weight of --weight nice-0 tasks (default 100, the most it sets), so
the host's other work takes little from them; it still took 0.15-0.5 cores in runs at load 7
(sleepers that wake often win a CPU back). Each run records the load average before and after,
CPU busy per core, and `other_cpu_s`, the CPU time the host spent on anything but the proxy,
the generator and the bench server. Pairs where that stays under QUIET_OTHER_CORES of a core in
both runs are summarized apart as `quiet`. In `budget`, `throttled_periods` counts the CFS
periods in which the quota held the proxy back: a run near zero was not limited by its budget.

    .venv/bin/python bench/workers_bench.py [--rounds 6] [--seconds 3] [--budget 0.5]
        [--layouts budget,machine] [--tests connections,throughput]

The budget layout and --weight need root and the cgroup cpu controller (v1, or v2 with it
enabled); without them the layout is skipped and the weight not applied, each with a note.
Prints a table and writes bench/results/workers.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hbone_bench as hb  # noqa: E402 - the sibling bench's process helpers (one of each thing)

RESULTS = Path(__file__).resolve().parent / "results" / "workers.json"
PROXY_IP = "127.0.77.2"
SERVER_IP = "127.0.77.3"
IO_TIMEOUT_S = 10.0
MAX_SECONDS = 30.0  # bound on any one measurement
MAX_ROUNDS = 20
CHUNK_BYTES = 256 * 1024
LOADGEN_SOURCE = Path(__file__).resolve().parent / "loadgen.c"
CPU_PERIOD_US = 10_000  # the budget layout's CFS period: short, so a throttled worker waits little
QUIET_OTHER_CORES = 0.15  # a run is quiet when the host's other work took less than this many cores
CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")
CGROUP_V2 = Path("/sys/fs/cgroup")


# ================================================================================================
# Workers: the bench server and the load generator (separate processes, uvloop)
# ================================================================================================


class EchoOne(asyncio.Protocol):
    """Connection test: echo what arrives."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)  # type: ignore[attr-defined]


class Sink(asyncio.Protocol):
    """Throughput test: count bytes until the client half-closes, answer the count, close."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.got = 0

    def data_received(self, data: bytes) -> None:
        self.got += len(data)

    def eof_received(self) -> bool:
        self.transport.write(self.got.to_bytes(8, "big"))  # type: ignore[attr-defined]
        self.transport.close()
        return False


async def serve(bind: str) -> None:
    loop = asyncio.get_running_loop()
    echo = await loop.create_server(EchoOne, bind, 0, backlog=4096)
    sink = await loop.create_server(Sink, bind, 0, backlog=4096)
    ports = (echo.sockets[0].getsockname()[1], sink.sockets[0].getsockname()[1])
    print(f"listening {ports[0]} {ports[1]}", flush=True)
    await asyncio.Event().wait()


async def socks_dial(
    loop: asyncio.AbstractEventLoop, socks: tuple[str, int], host: str, port: int
) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((PROXY_IP, 0))  # the proxy tells its workload's connections by source address
        await loop.sock_connect(sock, socks)
        await loop.sock_sendall(
            sock, b"\x05\x01\x00\x05\x01\x00\x01" + socket.inet_aton(host) + port.to_bytes(2, "big")
        )
        reply = b""
        while len(reply) < 12:
            chunk = await loop.sock_recv(sock, 12 - len(reply))
            if not chunk:
                raise ConnectionError("proxy closed during the SOCKS5 handshake")
            reply += chunk
        if reply[1] != 0 or reply[3] != 0:
            raise ConnectionRefusedError(f"SOCKS5 refused: {reply.hex()}")
        return sock
    except BaseException:
        sock.close()
        raise


async def generate_connections(socks: tuple[str, int], port: int, concurrency: int, seconds: float) -> dict:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + min(seconds, MAX_SECONDS)
    done = [0]
    failed = [0]

    async def client() -> None:
        while loop.time() < deadline:
            try:
                async with asyncio.timeout(IO_TIMEOUT_S):
                    sock = await socks_dial(loop, socks, SERVER_IP, port)
                    try:
                        await loop.sock_sendall(sock, b"x")
                        if await loop.sock_recv(sock, 1) != b"x":
                            raise ConnectionError("no echo")
                    finally:
                        sock.close()
                done[0] += 1
            except (OSError, TimeoutError):
                failed[0] += 1

    begin = loop.time()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = loop.time() - begin
    return {"connections": done[0], "failed": failed[0], "seconds": elapsed, "conn_s": done[0] / elapsed}


async def generate_throughput(socks: tuple[str, int], port: int, parallel: int, size: int) -> dict:
    loop = asyncio.get_running_loop()
    socks_list = [await socks_dial(loop, socks, SERVER_IP, port) for _ in range(parallel)]
    chunk = bytes(CHUNK_BYTES)

    async def send(sock: socket.socket) -> int:
        remaining = size
        while remaining:
            n = min(CHUNK_BYTES, remaining)
            await loop.sock_sendall(sock, chunk[:n] if n < CHUNK_BYTES else chunk)
            remaining -= n
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while len(answer) < 8:
            piece = await loop.sock_recv(sock, 8 - len(answer))
            if not piece:
                break
            answer += piece
        sock.close()
        return int.from_bytes(answer, "big") if len(answer) == 8 else -1

    begin = loop.time()
    async with asyncio.timeout(MAX_SECONDS * 2):
        got = await asyncio.gather(*(send(s) for s in socks_list))
    elapsed = loop.time() - begin
    if any(g != size for g in got):
        raise ConnectionError(f"server received {got}, expected {size} each")
    total = size * parallel
    return {"bytes": total, "seconds": elapsed, "gbit_s": total * 8 / elapsed / 1e9}


def run_worker(args: argparse.Namespace) -> int:
    import uvloop

    if args.worker == "server":
        uvloop.run(serve(args.bind))
        return 0
    host, _, port = args.socks.rpartition(":")
    socks = (host, int(port))
    if args.test == "connections":
        result = uvloop.run(generate_connections(socks, args.port, args.concurrency, args.seconds))
    else:
        result = uvloop.run(generate_throughput(socks, args.port, args.parallel, args.size_mib * 1024 * 1024))
    print(json.dumps(result), flush=True)
    return 0


# ================================================================================================
# Orchestrator
# ================================================================================================


def local_config() -> str:
    return json.dumps(
        {
            "workloads": [
                hb.workload("client", "client", PROXY_IP, "HBONE", "node-a"),
                hb.workload("plain", "plain", SERVER_IP, "TCP", "node-b"),
            ]
        }
    )


def proxy_env(workers: int) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ZTUNNEL_", "PROXY_", "XDS_", "CA_", "LOCAL_XDS"))
    }
    env.update(
        {
            "PROXY_MODE": "dedicated",
            "PROXY_WORKLOAD_INFO": "bench/client/client",
            "FAKE_CA": "true",
            "XDS_ADDRESS": "",
            "LOCAL_XDS": local_config(),
            "UNSTABLE_ENABLE_SOCKS5": "true",
            "ISTIO_META_DNS_CAPTURE": "false",
            "OUTBOUND_ADDR": f"{PROXY_IP}:0",
            "INBOUND_ADDR": f"{PROXY_IP}:0",
            "INBOUND_PLAINTEXT_ADDR": f"{PROXY_IP}:0",
            "SOCKS5_ADDR": f"{PROXY_IP}:0",
            "ADMIN_ADDR": f"{PROXY_IP}:0",
            "STATS_ADDR": f"{PROXY_IP}:0",
            "READINESS_ADDR": f"{PROXY_IP}:0",
            "ZTUNNEL_WORKER_THREADS": str(workers),
            "TERMINATION_GRACE_PERIOD_SECONDS": "1",
        }
    )
    return env


class CpuGroup:
    """One process (and the children it starts later) in a cgroup of its own (v1 `cpu`
    hierarchy, or v2 with the cpu controller): a CFS weight of `weight` nice-0 tasks against
    the host's other work, and a quota when `set` gives one. Removed again by `close`."""

    def __init__(self, pid: int, weight: int) -> None:
        self.pid = pid
        self.v1 = (CGROUP_V1_CPU / "cpu.cfs_quota_us").exists()
        root = CGROUP_V1_CPU if self.v1 else CGROUP_V2
        self.root = root
        self.path = root / f"workers-bench-{os.getpid()}-{pid}"
        self.path.mkdir()
        try:
            if self.v1:
                (self.path / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
                (self.path / "cpu.shares").write_text(str(1024 * weight))
            else:
                (self.path / "cpu.weight").write_text(str(min(10_000, 100 * weight)))
            (self.path / "cgroup.procs").write_text(str(pid))
        except OSError:
            self.path.rmdir()
            raise

    @staticmethod
    def available() -> str:
        """'' when a quota can be set here, else why not."""
        if os.geteuid() != 0:
            return "not root"
        if (CGROUP_V1_CPU / "cpu.cfs_quota_us").exists():
            return ""
        controllers = CGROUP_V2 / "cgroup.subtree_control"
        if controllers.exists() and "cpu" in controllers.read_text().split():
            return ""
        return "no cgroup cpu controller (v1 /sys/fs/cgroup/cpu or v2 with cpu enabled)"

    def set(self, cores: float | None) -> None:
        """Hold the process to `cores` of a CPU, or lift the limit (None)."""
        if self.v1:
            quota = -1 if cores is None else int(cores * CPU_PERIOD_US)
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            quota_text = "max" if cores is None else str(int(cores * CPU_PERIOD_US))
            (self.path / "cpu.max").write_text(f"{quota_text} {CPU_PERIOD_US}")

    def throttled(self) -> int:
        """Periods in which the quota ran out (the process was held back) so far."""
        for line in (self.path / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "nr_throttled":
                return int(value)
        return 0

    def close(self) -> None:
        with contextlib.suppress(OSError):
            (self.root / "cgroup.procs").write_text(str(self.pid))
        for _ in range(50):  # the kernel empties the group at once; a dying process may lag
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02)


class Proxy:
    def __init__(self, workers: int, workdir: Path, quota: bool, weight: int) -> None:
        self.workers = workers
        self.log = workdir / f"proxy-{workers}w-{time.monotonic_ns()}.log"
        self.quotas: list[CpuGroup] = []
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                hb.proxy_argv(),
                env=proxy_env(workers),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            fields = hb.wait_proxy_ready(self.process, self.log)
            host, _, port = fields["socks5"].rpartition(":")
            self.socks = (host, int(port))
            self.admin = fields["admin"]
            self.pids = [self.process.pid]
            if workers > 1:
                with urllib.request.urlopen(f"http://{self.admin}/config_dump", timeout=10) as reply:
                    dump = json.loads(reply.read())
                self.pids += [w["pid"] for w in dump["workers"]]
            if quota:
                self.quotas = [CpuGroup(pid, weight) for pid in self.serving]
        except BaseException:
            self.close()
            raise

    @property
    def serving(self) -> list[int]:
        """The processes that serve connections: the workers, or the one process."""
        return self.pids[1:] if self.workers > 1 else self.pids

    def place(self, layout: str, budget: float) -> None:
        cpus = sorted(os.sched_getaffinity(0))
        if layout == "budget":
            for i, pid in enumerate(self.serving):
                # 1 worker on the second CPU, as in `machine`; worker i on CPU i.
                hb.set_affinity(pid, {cpus[(i + (self.workers == 1)) % len(cpus)]})
            if self.workers > 1:
                hb.set_affinity(self.pids[0], set(cpus))
            for q in self.quotas:
                q.set(budget)
        else:
            pinned = layout == "machine" and self.workers == 1
            for pid in self.pids:
                hb.set_affinity(pid, {cpus[1]} if pinned else set(cpus))
            for q in self.quotas:
                q.set(None)

    def cpu_s(self) -> float:
        return sum(hb.proc_cpu_s(pid) for pid in self.pids)

    def throttled(self) -> int:
        return sum(q.throttled() for q in self.quotas)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, 15)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, 9)
            self.process.wait(timeout=10)
        for q in self.quotas:
            q.close()


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cpu_ticks() -> dict[str, tuple[int, int]]:
    """Per CPU from /proc/stat: (busy, idle) clock ticks so far."""
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu") and line[3].isdigit():
                name, *fields = line.split()
                ticks = [int(v) for v in fields[:8]]
                idle = ticks[3] + ticks[4]
                out[name] = (sum(ticks) - idle, idle)
    return out


@dataclass(eq=False)
class Target:
    """One proxy under test with its own bench servers (own ports: no run connects into a
    4-tuple space that the other proxy's runs filled with TIME_WAIT sockets)."""

    proxy: Proxy
    server_pids: list[int]
    echo_port: int
    sink_port: int


def run_generator(
    args: argparse.Namespace, target: Target, layout: str, test: str, loadgen: Path | None
) -> dict:
    proxy = target.proxy
    port = target.echo_port if test == "connections" else target.sink_port
    if test == "connections" and loadgen is not None:
        argv = [str(loadgen), "client", proxy.socks[0], str(proxy.socks[1]), PROXY_IP, SERVER_IP, str(port)]
        argv += [str(args.concurrency), str(args.seconds)]
    else:
        argv = [
            sys.executable,
            __file__,
            "--worker",
            "client",
            "--socks",
            f"{proxy.socks[0]}:{proxy.socks[1]}",
        ]
        argv += ["--test", test, "--port", str(port), "--concurrency", str(args.concurrency)]
        argv += [
            "--seconds",
            str(args.seconds),
            "--parallel",
            str(args.parallel),
            "--size-mib",
            str(args.size_mib),
        ]
    all_cpus = sorted(os.sched_getaffinity(0))
    generator_cpus = {all_cpus[0]} if layout == "machine" else set(all_cpus)
    for pid in target.server_pids:
        hb.set_affinity(pid, generator_cpus)
    proxy.place(layout, args.budget)
    prefix = ["taskset", "-c", ",".join(map(str, sorted(generator_cpus)))]
    load_before = os.getloadavg()[0]
    ticks_before = cpu_ticks()
    throttled_before = proxy.throttled()
    cpu_before = proxy.cpu_s()
    by_process_before = [hb.proc_cpu_s(pid) for pid in proxy.pids]
    generator_before, server_before = children_cpu_s(), sum(hb.proc_cpu_s(p) for p in target.server_pids)
    out = subprocess.run(prefix + argv, capture_output=True, timeout=MAX_SECONDS * 3, check=False)
    cpu = proxy.cpu_s() - cpu_before
    # Owner first, then each worker: how evenly the workers shared the connections' work.
    by_process = [
        hb.proc_cpu_s(pid) - before for pid, before in zip(proxy.pids, by_process_before, strict=True)
    ]
    generator_cpu = children_cpu_s() - generator_before
    server_cpu = sum(hb.proc_cpu_s(p) for p in target.server_pids) - server_before
    ticks_after = cpu_ticks()
    if out.returncode != 0:
        raise RuntimeError(f"generator failed:\n{out.stderr.decode()[-3000:]}")
    result = json.loads(out.stdout.decode().strip().splitlines()[-1])
    tick_s = 1 / os.sysconf("SC_CLK_TCK")
    busy = {}
    host_busy_s = 0.0
    for name, (b1, i1) in ticks_after.items():
        b0, i0 = ticks_before[name]
        busy[name] = (b1 - b0) / max(1, (b1 - b0) + (i1 - i0))
        host_busy_s += (b1 - b0) * tick_s
    result["proxy_cpu_s"] = cpu
    result["proxy_cpu_s_by_process"] = by_process
    result["generator_cpu_s"] = generator_cpu
    result["server_cpu_s"] = server_cpu
    result["cpu_busy"] = busy
    # What the host spent on anything else in the meantime: other sessions' work.
    result["other_cpu_s"] = max(0.0, host_busy_s - cpu - generator_cpu - server_cpu)
    result["throttled_periods"] = proxy.throttled() - throttled_before
    result["load_before"] = load_before
    result["load_after"] = os.getloadavg()[0]
    if test == "connections" and result["connections"]:
        result["proxy_cpu_ms_per_conn"] = cpu * 1000 / result["connections"]
    return result


@contextlib.contextmanager
def bench_server(loadgen: Path | None) -> Iterator[tuple[list[int], int, int]]:
    """The bench servers: ([pids], echo port, sink port). The echo is the C one when `loadgen`
    is built, and the Python process serves the sink (throughput)."""
    started: list[subprocess.Popen[bytes]] = []
    try:
        server = subprocess.Popen(
            [sys.executable, __file__, "--worker", "server"],
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        started.append(server)
        assert server.stdout is not None
        line = server.stdout.readline().decode().split()
        echo_port, sink_port = int(line[1]), int(line[2])
        if loadgen is not None:
            echo = subprocess.Popen(
                [str(loadgen), "server", SERVER_IP], stdout=subprocess.PIPE, start_new_session=True
            )
            started.append(echo)
            assert echo.stdout is not None
            echo_port = int(echo.stdout.readline().decode().split()[1])
        yield [p.pid for p in started], echo_port, sink_port
    finally:
        for p in started:
            p.kill()
            p.wait()


def build_loadgen(workdir: Path) -> Path | None:
    """bench/loadgen.c built with gcc, or None (the Python generator, with a note) without it."""
    gcc = shutil.which("gcc")
    if gcc is None:
        print("generator: Python (gcc not found); it costs more CPU per connection than the proxy")
        return None
    out = workdir / "loadgen"
    subprocess.run([gcc, "-O2", "-o", str(out), str(LOADGEN_SOURCE)], check=True, timeout=120)
    print(f"generator: C ({LOADGEN_SOURCE.name}, gcc -O2) for the connection test; Python for throughput")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=("server", "client"), help=argparse.SUPPRESS)
    p.add_argument("--bind", default=SERVER_IP, help=argparse.SUPPRESS)
    p.add_argument("--socks", help=argparse.SUPPRESS)
    p.add_argument("--test", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=6, help="pairs of runs per layout and test")
    p.add_argument("--seconds", type=float, default=3.0, help="length of one connection-rate run")
    p.add_argument("--concurrency", type=int, default=32, help="connections in flight in the rate test")
    # 32, not 8: a worker keeps the connections it accepted, and with 8 long transfers one
    # worker did under 30% of the work in 23 of 48 runs (11 of 24 with one accept queue, 12 of
    # 24 with an SO_REUSEPORT member each).
    p.add_argument("--parallel", type=int, default=32, help="connections in the throughput test")
    p.add_argument("--size-mib", type=int, default=64, help="bytes per throughput connection")
    p.add_argument("--tests", default="connections,throughput")
    p.add_argument("--layouts", default="budget,machine")
    p.add_argument("--budget", type=float, default=0.5, help="share of a CPU per worker in `budget`")
    p.add_argument(
        "--weight",
        type=int,
        default=100,
        help="CFS weight of the bench's processes, in nice-0 tasks (1: none; needs a cgroup cpu controller)",
    )
    p.add_argument(
        "--python-generator", action="store_true", help="the Python connection generator, not loadgen.c"
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if args.worker:
        return run_worker(args)
    args.rounds = max(1, min(args.rounds, MAX_ROUNDS))
    args.seconds = min(args.seconds, MAX_SECONDS)
    args.budget = min(max(args.budget, 0.05), 1.0)
    tests = [t for t in args.tests.split(",") if t]
    layouts = [layout for layout in args.layouts.split(",") if layout]
    if unknown := set(layouts) - {"budget", "machine", "free"}:
        p.error(f"unknown layouts {sorted(unknown)}")
    if len(os.sched_getaffinity(0)) < 2:
        p.error("needs at least 2 CPUs")
    if "budget" in layouts and (why := CpuGroup.available()):
        print(f"budget layout skipped: {why}")
        layouts.remove("budget")
    results: dict[str, dict[str, dict[str, list[dict]]]] = {
        layout: {t: {"1": [], "2": []} for t in tests} for layout in layouts
    }
    with tempfile.TemporaryDirectory(prefix="workers-bench-") as tmp, contextlib.ExitStack() as stack:
        workdir = Path(tmp)
        args.weight = max(1, min(args.weight, 100))
        if args.weight > 1 and (why := CpuGroup.available()):
            print(f"--weight {args.weight} not applied: {why}")
            args.weight = 1
        if args.weight > 1:
            # This process first: the proxies, generators and bench servers it starts inherit it.
            stack.callback(CpuGroup(os.getpid(), args.weight).close)
        loadgen = None if args.python_generator else build_loadgen(workdir)
        targets = {}
        for workers in (1, 2):
            server_pids, echo_port, sink_port = stack.enter_context(bench_server(loadgen))
            proxy = Proxy(workers, workdir, quota="budget" in layouts, weight=args.weight)
            stack.callback(proxy.close)
            targets[workers] = Target(proxy, server_pids, echo_port, sink_port)
        time.sleep(0.5)  # let start-up (certificates, imports) settle
        for round_no in range(args.rounds):
            order = (1, 2) if round_no % 2 == 0 else (2, 1)
            for layout in layouts:
                for test in tests:
                    for workers in order:
                        result = run_generator(args, targets[workers], layout, test, loadgen)
                        results[layout][test][str(workers)].append(result)
                        print(
                            f"round {round_no + 1} {layout} {workers} worker(s) {test}: {json.dumps(result)}",
                            flush=True,
                        )
    print_and_save(args, results)
    return 0


def paired(by: dict[str, list[dict]], key: str, quiet_only: bool, seconds: float) -> list[float]:
    """Ratios 2 workers / 1 worker within each round's pair (optionally the quiet pairs only)."""
    out = []
    for one, two in zip(by["1"], by["2"], strict=True):
        quiet = all(
            r["other_cpu_s"] / max(r.get("seconds", seconds), 1e-9) < QUIET_OTHER_CORES for r in (one, two)
        )
        if one[key] and (quiet or not quiet_only):
            out.append(two[key] / one[key])
    return out


def print_and_save(args: argparse.Namespace, results: dict) -> None:
    key = {"connections": "conn_s", "throughput": "gbit_s"}
    unit = {"connections": "conn/s", "throughput": "Gbit/s"}
    summary: dict[str, dict] = {}
    print()
    print(
        f"{'layout':<8} {'test':<12} {'1 worker':>12} {'2 workers':>12} {'paired ratio (range)':>22} "
        f"{'quiet pairs':>16}  load avg (min-max)"
    )
    for layout, by_test in results.items():
        summary[layout] = {}
        for test, by in by_test.items():
            one = statistics.median(r[key[test]] for r in by["1"])
            two = statistics.median(r[key[test]] for r in by["2"])
            ratios = paired(by, key[test], False, args.seconds)
            quiet = paired(by, key[test], True, args.seconds)
            loads = [r[k] for w in ("1", "2") for r in by[w] for k in ("load_before", "load_after")]
            entry: dict[str, object] = {
                "1": one,
                "2": two,
                "unit": unit[test],
                "paired_ratio_median": statistics.median(ratios),
                "paired_ratio_range": [min(ratios), max(ratios)],
                "quiet_pairs": len(quiet),
                "quiet_paired_ratio_median": statistics.median(quiet) if quiet else None,
                "load_range": [min(loads), max(loads)],
            }
            quiet_text = f"{len(quiet)}: {statistics.median(quiet):.2f}x" if quiet else "0"
            print(
                f"{layout:<8} {test:<12} {one:>9.2f} {unit[test]:<3}{two:>9.2f}    "
                f"{entry['paired_ratio_median']:>5.2f}x ({min(ratios):.2f}-{max(ratios):.2f})  "
                f"{quiet_text:>16}  {min(loads):.1f}-{max(loads):.1f}"
            )
            if test == "connections":
                cpu = {
                    w: statistics.median(r.get("proxy_cpu_ms_per_conn", 0) for r in by[w]) for w in ("1", "2")
                }
                print(
                    f"{'':<8} {'  cpu/conn':<12} {cpu['1']:>9.3f} ms {cpu['2']:>9.3f} ms   (proxy: owner and workers)"
                )
                entry["proxy_cpu_ms_per_conn"] = cpu
                # loadgen.c's `slow`: connections over 0.5 s, a dropped SYN's 1 s retransmission
                # (seen between back-to-back bench invocations), not the proxy's work.
                stalled = [r for w in ("1", "2") for r in by[w] if r.get("slow")]
                if stalled:
                    print(
                        f"{'':<8} {'  stalled':<12} {len(stalled)} runs with connections over 0.5 s (see `slow`)"
                    )
                entry["runs_with_slow_connections"] = len(stalled)
                if layout == "budget":
                    # Of the CFS periods each serving process ran through, the share where its
                    # quota held it back: near 1, the budget set the rate; well under, something
                    # else did (the host's other work, the generator).
                    periods_per_s = 1e6 / CPU_PERIOD_US
                    held = {
                        w: statistics.median(
                            r["throttled_periods"] / (r["seconds"] * periods_per_s * int(w)) for r in by[w]
                        )
                        for w in ("1", "2")
                    }
                    print(
                        f"{'':<8} {'  throttled':<12} {held['1']:>12.2f} {held['2']:>12.2f}   (share of CFS periods)"
                    )
                    entry["throttled_share"] = held
                entry["generator_and_server_cpu_ms_per_conn"] = statistics.median(
                    (r["generator_cpu_s"] + r["server_cpu_s"]) * 1000 / r["connections"]
                    for w in ("1", "2")
                    for r in by[w]
                    if r["connections"]
                )
            summary[layout][test] = entry
    print(
        f"target: 2 workers >= 1.6x 1 worker (issue 11); quiet: the host's other work under {QUIET_OTHER_CORES} cores"
    )
    out = {
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "args": {
            k: v
            for k, v in vars(args).items()
            if k
            in ("rounds", "seconds", "concurrency", "parallel", "size_mib", "budget", "layouts", "weight")
        },
        "layouts": {
            "budget": f"each serving process on its own CPU, held to {args.budget} of it (CFS quota); "
            "generator and bench server on every CPU",
            "machine": "1 worker on CPU1, 2 workers over every CPU, generator and bench server on CPU0",
            "free": "nothing pinned, no quota",
        },
        "summary": summary,
        "runs": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
