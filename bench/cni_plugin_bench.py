"""Wall time of one CNI ADD through the installed launcher, as a container runtime sees it.

Cases: a pod that is not ambient (pod lookup, no agent call) and an ambient pod (lookup plus
POST /cmdadd to a local fake agent socket answering 200), each through the two launchers
install.py can write (`python -I -m ...` and `python -I -S -c ...` with explicit sys.path),
plus the bare interpreter start as a floor. Prints p50/p90/max in ms, writes
bench/results/cni_plugin.json.

    .venv/bin/python bench/cni_plugin_bench.py [--runs 40]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socketserver
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ambient_mesh.cni.enablement import DEFAULT_ENABLEMENT_SELECTORS
from ambient_mesh.cni.install import fast_sys_path, launcher_script

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


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=40)
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
        for name, path in paths.items():
            cases.append((f"non-ambient ADD, {name}", [str(path)], env("db-0", "plain")))
            cases.append((f"ambient ADD, {name}", [str(path)], env("web-0", "apps")))

        results = []
        for label, argv, environ in cases:
            times: list[float] = []
            for _ in range(args.runs):
                start = time.perf_counter()
                proc = subprocess.run(argv, input=stdin, capture_output=True, env=environ, check=False)
                times.append((time.perf_counter() - start) * 1000)
                if proc.returncode != 0:
                    raise SystemExit(f"{label}: exit {proc.returncode}: {proc.stdout!r} {proc.stderr!r}")
            results.append(
                {
                    "case": label,
                    "runs": args.runs,
                    "p50_ms": round(statistics.median(times), 2),
                    "p90_ms": round(percentile(times, 0.9), 2),
                    "max_ms": round(max(times), 2),
                }
            )
        posts = server.posts  # type: ignore[attr-defined]
        server.shutdown()
        server.server_close()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    width = max(len(r["case"]) for r in results)
    print(f"{'case':<{width}}  {'p50 ms':>8}  {'p90 ms':>8}  {'max ms':>8}")
    for r in results:
        print(f"{r['case']:<{width}}  {r['p50_ms']:>8.1f}  {r['p90_ms']:>8.1f}  {r['max_ms']:>8.1f}")
    print(f"(fake agent received {posts} POSTs)")

    out = Path(__file__).parent / "results" / "cni_plugin.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "python": sys.version.split()[0],
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
