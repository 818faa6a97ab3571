"""Time of one CNI ADD through the installed executable, as a container runtime sees it.

Cases: a pod that is not ambient (pod lookup, no agent call) and an ambient pod (lookup plus
POST /cmdadd to a local fake agent socket answering 200), with the plugin deciding by itself (no
agent to hand the run to: plugin_handoff falls back to the whole plugin), and "handed to the
agent": the run goes to a real CniPluginServer (the agent's code, over the same YAML pods,
with an add handler that only counts) on `pluginrun.sock`. Each through the two launchers
install.py writes for a checkout (`python -I -m ...` and `python -I -S -c ...` with explicit
sys.path) and through the frozen bundle the image ships (scripts/cluster/plugin.sh, PyInstaller
onedir; `--bundle`, default the cached build), plus the bare interpreter start as a floor.
`--onefile FILE` adds a PyInstaller onefile build for comparison. Wall time depends on how busy
the machine is; the plugin's own time is its CPU time (user + system, from wait4), which is what
the 100 ms budget of an ADD is about. Prints p50/p90/max, writes bench/results/cni_plugin.json.

    .venv/bin/python bench/cni_plugin_bench.py [--runs 40] [--bundle DIR] [--onefile FILE] [--match TEXT]
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import ipaddress
import json
import os
import platform
import resource
import shutil
import socketserver
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ambient_mesh.cni.cni_server import CniPluginServer
from ambient_mesh.cni.cniconf import CniAddEvent
from ambient_mesh.cni.enablement import DEFAULT_ENABLEMENT_SELECTORS
from ambient_mesh.cni.install import fast_sys_path, launcher_script
from ambient_mesh.cni.plugin_basics import PLUGIN_RUN_SOCKET_NAME
from ambient_mesh.cni.pods import DirectoryPodSource

POD_YAML = """\
apiVersion: v1
kind: Namespace
metadata: {name: apps, labels: {istio.io/dataplane-mode: ambient}}
---
apiVersion: v1
kind: Namespace
metadata: {name: plain}
---
apiVersion: v1
kind: Pod
metadata: {name: web-0, namespace: apps}
spec: {containers: [{name: app}]}
---
apiVersion: v1
kind: Pod
metadata: {name: db-0, namespace: plain}
spec: {containers: [{name: app}]}
"""


class AgentHandler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        length = 0
        while (line := self.rfile.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        self.rfile.read(length)
        self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        self.server.posts += 1  # type: ignore[attr-defined]


DEFAULT_BUNDLE = Path(os.environ.get("AMBIENT_CACHE", "/var/cache/ambient-mesh")) / "plugin/dist/istio-cni"


def tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def run_once(argv: list[str], stdin: bytes, environ: dict[str, str]) -> tuple[float, int, bytes]:
    """Wall ms, exit code, stdout (the caller reads the child's CPU time from RUSAGE_CHILDREN)."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environ
    )
    out, _err = proc.communicate(stdin)
    wall = (time.perf_counter() - start) * 1000
    return wall, proc.returncode, out


API_OBJECTS = {
    "/api/v1/namespaces/apps": {
        "metadata": {"name": "apps", "labels": {"istio.io/dataplane-mode": "ambient"}}
    },
    "/api/v1/namespaces/plain": {"metadata": {"name": "plain"}},
    "/api/v1/namespaces/apps/pods/web-0": {"metadata": {"name": "web-0", "namespace": "apps"}, "spec": {}},
    "/api/v1/namespaces/plain/pods/db-0": {"metadata": {"name": "db-0", "namespace": "plain"}, "spec": {}},
}


class ApiHandler(http.server.BaseHTTPRequestHandler):
    """The two GETs the plugin makes of a real API server (namespace, pod), over TLS."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        obj = API_OBJECTS.get(self.path.split("?", 1)[0])
        body = json.dumps(obj if obj is not None else {"kind": "Status", "code": 404}).encode()
        self.send_response(200 if obj is not None else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args) -> None:
        pass


def start_api_server(work: Path) -> http.server.ThreadingHTTPServer:
    """A loopback HTTPS server with a throwaway certificate, and the kubeconfig the node agent
    would write for the plugin (`<run dir>/istio-cni-kubeconfig`) pointing at it."""
    from datetime import UTC, datetime, timedelta

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bench-apiserver")])
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=1))
        .not_valid_after(now + timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    (work / "api.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (work / "api.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(work / "api.crt", work / "api.key")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ApiHandler)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "local",
                "cluster": {
                    "server": f"https://127.0.0.1:{server.server_address[1]}",
                    "certificate-authority": str(work / "api.crt"),
                },
            }
        ],
        "users": [{"name": "istio-cni", "user": {"token": "bench-token"}}],
        "contexts": [{"name": "istio-cni", "context": {"cluster": "local", "user": "istio-cni"}}],
        "current-context": "istio-cni",
    }
    (work / "istio-cni-kubeconfig").write_text(json.dumps(kubeconfig))
    return server


class BenchAgent:
    """The node agent's plugin server (real code) on its own loop thread, over the YAML pods;
    its add handler counts the adds instead of changing a netns."""

    def __init__(self, run_dir: Path, pods_dir: Path) -> None:
        self.run_dir = run_dir
        self.pods_dir = pods_dir
        self.adds = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server: CniPluginServer | None = None

    async def _on_add(self, _event: CniAddEvent) -> str | None:
        self.adds += 1
        return None

    async def _start(self) -> None:
        source = DirectoryPodSource(self.pods_dir, node_name="", state_file=self.run_dir / "state.json")
        await source.start()
        self.server = CniPluginServer(
            self.run_dir / "pluginevent.sock",
            None,
            self._on_add,
            run_socket=self.run_dir / PLUGIN_RUN_SOCKET_NAME,
            pods=source,
        )
        await self.server.start()

    def start(self) -> None:
        self.run_dir.mkdir()
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)

    def stop(self) -> None:
        if self.server is not None:
            asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE, help="frozen plugin dir (plugin.sh)")
    parser.add_argument("--onefile", type=Path, default=None, help="a PyInstaller onefile build, to compare")
    parser.add_argument("--match", default="", help="run only the cases whose name contains this")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="cnib-", dir="/tmp"))
    try:
        (work / "pods").mkdir()
        (work / "pods" / "objects.yaml").write_text(POD_YAML)
        server = socketserver.ThreadingUnixStreamServer(str(work / "pluginevent.sock"), AgentHandler)
        server.posts = 0  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, daemon=True).start()

        launchers = {
            "-I -m": launcher_script(sys.executable),
            "-I -S (sys.path)": launcher_script(sys.executable, sys_path=fast_sys_path()),
        }
        paths = {}
        for i, (name, script) in enumerate(launchers.items()):
            path = work / f"istio-cni-{i}"
            path.write_text(script)
            path.chmod(0o755)
            paths[name] = path

        config = {
            "cniVersion": "1.0.0",
            "name": "k8s-pod-network",
            "type": "istio-cni",
            "cni_agent_run_dir": str(work),
            "ambient_enabled": True,
            "enablement_selectors": [s.to_json() for s in DEFAULT_ENABLEMENT_SELECTORS],
            "ambient_pod_source": {"directory": str(work / "pods")},
            "prevResult": {"cniVersion": "1.0.0", "ips": [{"address": "10.244.1.5/24", "interface": 0}]},
        }
        stdin = json.dumps(config).encode()
        agent = BenchAgent(work / "agent", work / "pods")
        agent.start()
        agent_stdin = json.dumps({**config, "cni_agent_run_dir": str(agent.run_dir)}).encode()
        # the cluster's case: pods from the API server (the kubeconfig the agent writes)
        api = start_api_server(work)
        api_stdin = json.dumps({k: v for k, v in config.items() if k != "ambient_pod_source"}).encode()

        def env(pod: str, ns: str) -> dict[str, str]:
            return {
                "CNI_COMMAND": "ADD",
                "CNI_CONTAINERID": "c0ffee",
                "CNI_NETNS": "/var/run/netns/bench",
                "CNI_IFNAME": "eth0",
                "CNI_PATH": "/opt/cni/bin",
                "CNI_ARGS": f"IgnoreUnknown=1;K8S_POD_NAMESPACE={ns};K8S_POD_NAME={pod}",
            }

        cases: list[tuple[str, list[str], dict[str, str]]] = [
            ("python -I -S -c pass (floor)", [sys.executable, "-I", "-S", "-c", "pass"], {}),
            ("python -I -c pass (floor)", [sys.executable, "-I", "-c", "pass"], {}),
        ]
        sizes: dict[str, int] = {}
        if args.bundle.is_dir():
            paths["bundle (onedir)"] = args.bundle / "istio-cni"
            sizes["bundle (onedir)"] = tree_bytes(args.bundle)
        else:
            print(f"no bundle at {args.bundle}: run scripts/cluster/plugin.sh (bundle cases skipped)")
        if args.onefile is not None:
            paths["onefile"] = args.onefile
            sizes["onefile"] = tree_bytes(args.onefile)
        api_cases: set[str] = set()
        agent_cases: set[str] = set()
        for name, path in paths.items():
            for pod, ns, what in (("db-0", "plain", "non-ambient"), ("web-0", "apps", "ambient")):
                label = f"{what} ADD handed to the agent, {name}"
                agent_cases.add(label)
                cases.append((label, [str(path)], env(pod, ns)))
            # start-up and imports only: what an ADD costs before it does anything
            cases.append((f"VERSION, {name}", [str(path)], {"CNI_COMMAND": "VERSION"}))
            cases.append((f"non-ambient ADD, {name}", [str(path)], env("db-0", "plain")))
            cases.append((f"ambient ADD, {name}", [str(path)], env("web-0", "apps")))
            for pod, ns, what in (("db-0", "plain", "non-ambient"), ("web-0", "apps", "ambient")):
                label = f"{what} ADD via API server, {name}"
                api_cases.add(label)
                cases.append((label, [str(path)], env(pod, ns)))

        cases = [case for case in cases if args.match in case[0]]
        results = []
        for label, argv, environ in cases:
            times: list[float] = []
            cpu: list[float] = []
            for _ in range(args.runs):
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                data = api_stdin if label in api_cases else agent_stdin if label in agent_cases else stdin
                wall, code, out = run_once(argv, data, environ)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                times.append(wall)
                cpu.append((after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) * 1000)
                if code != 0:
                    raise SystemExit(f"{label}: exit {code}: {out!r}")
            results.append(
                {
                    "case": label,
                    "runs": args.runs,
                    "p50_ms": round(statistics.median(times), 2),
                    "p90_ms": round(percentile(times, 0.9), 2),
                    "max_ms": round(max(times), 2),
                    "cpu_p50_ms": round(statistics.median(cpu), 2),
                    "cpu_p90_ms": round(percentile(cpu, 0.9), 2),
                }
            )
        posts = server.posts  # type: ignore[attr-defined]
        assert agent.server is not None
        handed = (agent.server.plugin_runs, agent.adds)
        agent.stop()
        server.shutdown()
        server.server_close()
        api.shutdown()
        api.server_close()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    width = max(len(r["case"]) for r in results)
    print(f"{'case':<{width}}  {'p50 ms':>8}  {'p90 ms':>8}  {'max ms':>8}  {'cpu p50':>8}  {'cpu p90':>8}")
    for r in results:
        print(
            f"{r['case']:<{width}}  {r['p50_ms']:>8.1f}  {r['p90_ms']:>8.1f}  {r['max_ms']:>8.1f}"
            f"  {r['cpu_p50_ms']:>8.1f}  {r['cpu_p90_ms']:>8.1f}"
        )
    print(
        f"(fake agent received {posts} POSTs; the agent ran {handed[0]} handed-over runs, {handed[1]} adds)"
    )
    for name, size in sizes.items():
        print(f"size of {name}: {size / 1e6:.1f} MB")

    out = Path(__file__).parent / "results" / "cni_plugin.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "python": sys.version.split()[0],
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "load_average": os.getloadavg(),
                "sizes_bytes": sizes,
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
