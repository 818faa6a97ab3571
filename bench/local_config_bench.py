"""Local-config benchmark: how long a node proxy takes to read a large LOCAL_XDS file.

Counterpart: ztunnel's local config (serde_yaml). The file has --workloads workloads, each with
the fields of tests/unit/state/test_localconfig.py's full example, plus one service per 10 workloads.
The table gives the time to compose the YAML (yamlload, aliases bounded) with the pure-Python
loader and with the default one (libyaml), and to parse it whole (state.localconfig, default
loader), best of --repeat runs, side by side so both see the same host load. JSON goes to results/local_config.json.

    .venv/bin/python bench/local_config_bench.py [--workloads 20000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from labelled_json import write_run  # noqa: E402

from ambient_mesh import yamlload  # noqa: E402
from ambient_mesh.state.localconfig import parse_local_config  # noqa: E402


def local_config(workloads: int) -> str:
    lines = ["workloads:"]
    for i in range(workloads):
        app = f"app-{i // 10}"
        lines += [
            f"- uid: k1//v1/Pod/ns{i % 50}/{app}-{i}",
            f"  name: {app}-{i}",
            f"  namespace: ns{i % 50}",
            f"  serviceAccount: {app}",
            "  trustDomain: cluster.local",
            f'  workloadIps: ["10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}"]',
            "  protocol: HBONE",
            f"  node: node-{i % 100}",
            "  canonicalName: " + app,
            "  canonicalRevision: v1",
            "  workloadName: " + app,
            "  workloadType: deployment",
            '  locality: {region: eu-west, zone: eu-west-1a, subzone: ""}',
        ]
    lines.append("services:")
    for s in range(workloads // 10):
        lines += [
            f"- name: app-{s}",
            f"  namespace: ns{s * 10 % 50}",
            f"  hostname: app-{s}.ns{s * 10 % 50}.svc.cluster.local",
            f'  vips: ["/10.96.{s // 256 % 256}.{s % 256}"]',
            "  ports: {80: 8080}",
        ]
    return "\n".join(lines) + "\n"


def best_of(repeat: int, fn) -> float:  # noqa: ANN001
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default=str(HERE / "results" / "local_config.json"))
    args = parser.parse_args()
    text = local_config(args.workloads)
    python_s = best_of(args.repeat, lambda: yamlload.compose(text, fast=False))
    compose_s = best_of(args.repeat, lambda: yamlload.compose(text))
    parse_s = best_of(args.repeat, lambda: parse_local_config(text))
    loader = yamlload.compose_loader_name()
    print(
        f"{'workloads':>10} {'bytes':>10} {'pure-Python compose s':>22} {loader + ' compose s':>29} {'parse s':>8}"
    )
    print(f"{args.workloads:>10} {len(text):>10} {python_s:>22.2f} {compose_s:>29.2f} {parse_s:>8.2f}")
    write_run(
        args.out,
        args.label,
        workloads=args.workloads,
        bytes=len(text),
        loader=loader,
        compose_python_s=round(python_s, 3),
        compose_s=round(compose_s, 3),
        parse_s=round(parse_s, 3),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
