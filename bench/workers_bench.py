"""ZTUNNEL_WORKER_THREADS: one node proxy's many-connection throughput with 1 and with 2 workers.

Counterpart: ztunnel's scaling figures with worker threads (reference/ztunnel.md 14, e.g.
istio/ztunnel#1174). One proxy only, in the `tcp` mode of bench/hbone_bench.py: the bench
client enters the proxy through SOCKS5 and the destination is a TCP workload, so the proxy
under test does the whole outbound path (SOCKS5, routing, authorization, upstream connect,
relay, access log, metrics) and no second proxy competes for the cores. The load generator
and the bench server are pinned to CPU0. For the connection test they are the C ones of
bench/loadgen.c (built with gcc at start; --python-generator, or no gcc, takes the uvloop ones):
on 2 cores they share a core with a worker, and in Python they cost more CPU per connection
than the proxy (0.6 ms against 0.5), which hid any gain from a second worker; in C, 0.08 ms.

  connections  --concurrency clients, each looping connect + SOCKS5 + 1-byte round trip +
               close for --seconds: conn/s, and proxy CPU-ms per connection
  throughput   --parallel connections at once, --size-mib each, client -> server: Gbit/s

Layouts: 1 worker: the proxy pinned to CPU1 (the generator has CPU0 to itself); 2 workers: the
owner and its workers float over CPU0-1 (the second core is shared with the generator: a
2-core machine has no third). Rounds alternate the order. The machine is shared with other
sessions: the load average before and after each measurement is printed and recorded.

    .venv/bin/python bench/workers_bench.py [--rounds 2] [--seconds 5] [--size-mib 64]

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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hbone_bench as hb  # noqa: E402 - the sibling bench's process helpers (one of each thing)

RESULTS = Path(__file__).resolve().parent / "results" / "workers.json"
PROXY_IP = "127.0.77.2"
SERVER_IP = "127.0.77.3"
IO_TIMEOUT_S = 10.0
MAX_SECONDS = 30.0  # bound on any one measurement
MAX_ROUNDS = 5
CHUNK_BYTES = 256 * 1024
LOADGEN_SOURCE = Path(__file__).resolve().parent / "loadgen.c"


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


class Proxy:
    def __init__(self, workers: int, workdir: Path) -> None:
        self.workers = workers
        self.log = workdir / f"proxy-{workers}w-{time.monotonic_ns()}.log"
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                hb.proxy_argv(),
                env=proxy_env(workers),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        fields = hb.wait_proxy_ready(self.process, self.log)
        host, _, port = fields["socks5"].rpartition(":")
        self.socks = (host, int(port))
        self.admin = fields["admin"]
        self.pids = [self.process.pid]
        if workers > 1:
            with urllib.request.urlopen(f"http://{self.admin}/config_dump", timeout=10) as reply:
                dump = json.loads(reply.read())
            self.pids += [w["pid"] for w in dump["workers"]]

    def pin(self, cpus: set[int]) -> None:
        for pid in self.pids:
            hb.set_affinity(pid, cpus)

    def cpu_s(self) -> float:
        return sum(hb.proc_cpu_s(pid) for pid in self.pids)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, 15)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, 9)
            self.process.wait(timeout=10)


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_generator(
    args: argparse.Namespace, proxy: Proxy, server_pids: list[int], test: str, port: int, loadgen: Path | None
) -> dict:
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
    prefix = [] if args.no_pin else ["taskset", "-c", "0"]
    load_before = os.getloadavg()[0]
    cpu_before = proxy.cpu_s()
    generator_before, server_before = children_cpu_s(), sum(hb.proc_cpu_s(pid) for pid in server_pids)
    out = subprocess.run(prefix + argv, capture_output=True, timeout=MAX_SECONDS * 3, check=False)
    cpu = proxy.cpu_s() - cpu_before
    # What the load generator and the bench server cost: they share CPU0 with worker 0.
    generator_cpu = children_cpu_s() - generator_before
    server_cpu = sum(hb.proc_cpu_s(pid) for pid in server_pids) - server_before
    if out.returncode != 0:
        raise RuntimeError(f"generator failed:\n{out.stderr.decode()[-3000:]}")
    result = json.loads(out.stdout.decode().strip().splitlines()[-1])
    result["proxy_cpu_s"] = cpu
    result["generator_cpu_s"] = generator_cpu
    result["server_cpu_s"] = server_cpu
    result["load_before"] = load_before
    result["load_after"] = os.getloadavg()[0]
    if test == "connections" and result["connections"]:
        result["proxy_cpu_ms_per_conn"] = cpu * 1000 / result["connections"]
    return result


@contextlib.contextmanager
def bench_server(pin: bool, loadgen: Path | None) -> Iterator[tuple[list[int], int, int]]:
    """The bench servers: ([pids], echo port, sink port). The echo is the C one when `loadgen`
    is built, and the Python process serves the sink (throughput)."""
    taskset = [] if not pin else ["taskset", "-c", "0"]
    started: list[subprocess.Popen[bytes]] = []
    try:
        server = subprocess.Popen(
            taskset + [sys.executable, __file__, "--worker", "server"],
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        started.append(server)
        assert server.stdout is not None
        line = server.stdout.readline().decode().split()
        echo_port, sink_port = int(line[1]), int(line[2])
        if loadgen is not None:
            echo = subprocess.Popen(
                taskset + [str(loadgen), "server", SERVER_IP], stdout=subprocess.PIPE, start_new_session=True
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
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=5.0, help="length of one connection-rate run")
    p.add_argument("--concurrency", type=int, default=32, help="connections in flight in the rate test")
    p.add_argument("--parallel", type=int, default=8, help="connections in the throughput test")
    p.add_argument("--size-mib", type=int, default=64, help="bytes per throughput connection")
    p.add_argument("--tests", default="connections,throughput")
    p.add_argument("--no-pin", action="store_true")
    p.add_argument(
        "--python-generator", action="store_true", help="the Python connection generator, not loadgen.c"
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if args.worker:
        return run_worker(args)
    args.rounds = max(1, min(args.rounds, MAX_ROUNDS))
    args.seconds = min(args.seconds, MAX_SECONDS)
    tests = [t for t in args.tests.split(",") if t]
    pin = not args.no_pin and len(os.sched_getaffinity(0)) >= 2
    results: dict[str, dict[str, list[dict]]] = {t: {"1": [], "2": []} for t in tests}
    with tempfile.TemporaryDirectory(prefix="workers-bench-") as tmp:
        workdir = Path(tmp)
        loadgen = None if args.python_generator else build_loadgen(workdir)
        for round_no in range(args.rounds):
            order = (1, 2) if round_no % 2 == 0 else (2, 1)
            for workers in order:
                # A new bench server (new ports) and a new proxy (new SOCKS5 port) per
                # configuration, so no run connects into a 4-tuple space that an earlier
                # run's TIME_WAIT sockets (thousands per 5 s run) fill.
                with bench_server(pin, loadgen) as (server_pids, echo_port, sink_port):
                    proxy = Proxy(workers, workdir)
                    try:
                        if pin:
                            proxy.pin({1} if workers == 1 else {0, 1})
                        time.sleep(0.5)  # let start-up (certificates, imports) settle
                        for test in tests:
                            port = echo_port if test == "connections" else sink_port
                            result = run_generator(args, proxy, server_pids, test, port, loadgen)
                            results[test][str(workers)].append(result)
                            print(
                                f"round {round_no + 1} {workers} worker(s) {test}: {json.dumps(result)}",
                                flush=True,
                            )
                    finally:
                        proxy.close()
    print_and_save(args, results, pin)
    return 0


def print_and_save(args: argparse.Namespace, results: dict, pin: bool) -> None:
    key = {"connections": "conn_s", "throughput": "gbit_s"}
    unit = {"connections": "conn/s", "throughput": "Gbit/s"}
    summary = {}
    print()
    print(
        f"{'test':<12} {'1 worker':>12} {'2 workers':>12} {'ratio':>7}  {'load avg (before/after, each run)'}"
    )
    for test, by in results.items():
        one = statistics.median(r[key[test]] for r in by["1"])
        two = statistics.median(r[key[test]] for r in by["2"])
        loads = " ".join(f"{r['load_before']:.1f}/{r['load_after']:.1f}" for w in ("1", "2") for r in by[w])
        print(f"{test:<12} {one:>9.2f} {unit[test]:<3}{two:>9.2f}    {two / one:>6.2f}x  {loads}")
        summary[test] = {"1": one, "2": two, "ratio": two / one, "unit": unit[test]}
        if test == "connections":
            cpu1 = statistics.median(r.get("proxy_cpu_ms_per_conn", 0) for r in by["1"])
            cpu2 = statistics.median(r.get("proxy_cpu_ms_per_conn", 0) for r in by["2"])
            print(f"{'  cpu/conn':<12} {cpu1:>9.2f} ms {cpu2:>9.2f} ms   (proxy: owner and workers)")
            summary["proxy_cpu_ms_per_conn"] = {"1": cpu1, "2": cpu2}
            gen = statistics.median(
                (r["generator_cpu_s"] + r["server_cpu_s"]) * 1000 / r["connections"]
                for w in ("1", "2")
                for r in by[w]
                if r["connections"]
            )
            print(f"{'  load gen':<12} {gen:>9.2f} ms per connection (generator + bench server, CPU0)")
            summary["generator_and_server_cpu_ms_per_conn"] = gen
    print("target: 2 workers >= 1.6x 1 worker (issue 11)")
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
            if k in ("rounds", "seconds", "concurrency", "parallel", "size_mib")
        },
        "layout": "1 worker on CPU1, 2 workers over CPU0-1, generator and server on CPU0"
        if pin
        else "unpinned",
        "summary": summary,
        "runs": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
