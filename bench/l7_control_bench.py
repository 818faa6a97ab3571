"""Control-plane cost of waypoint routes: with 1,000 HTTPRoutes, what one changed route costs.

    .venv/bin/python bench/l7_control_bench.py [--routes 1000] [--services 100|1000] [--repeats 20]

The mesh: one waypoint Gateway serving `--services` HTTP Services (one pod each), `--routes`
HTTPRoutes spread over them (each with a path match, a header match and two weighted backends),
and 10 L7 AuthorizationPolicies bound to the waypoint. It is parsed as `ambient control` reads its
directory, translated (AmbientIndex), and the waypoint's Envoy snapshot built (WaypointIndex with
its routes and policies) as ControlPlane.apply does. Then one route changes (its path), `--repeats`
times: the new KubeStore is handed over with the changed key, and the CPU time (this process's)
of the index update, the L7 update and the waypoint rebuild is measured, with how many Envoy
resources the rebuilt snapshot changed.

Prints a table and writes JSON (default bench/results/l7_control.json). Never a timed assertion.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ambient_mesh.control.plane import freeze_loaded_state  # noqa: E402
from ambient_mesh.control.translate import AmbientIndex, MeshSettings  # noqa: E402
from ambient_mesh.control.waypoint_index import WaypointIndex  # noqa: E402
from ambient_mesh.kube.load import parse_documents  # noqa: E402
from ambient_mesh.kube.model import object_key  # noqa: E402
from ambient_mesh.kube.store import KubeStore  # noqa: E402
from tests.helpers.waypoint_manifests import WAYPOINT_BASE as WAYPOINT_MESH  # noqa: E402

WAYPOINT = "default/waypoint.default.svc.cluster.local"


def mesh(services: int) -> str:
    docs = [WAYPOINT_MESH]
    for i in range(services):
        ip = f"10.97.{i // 250}.{i % 250 + 1}"
        pod_ip = f"10.1.{i // 250}.{i % 250 + 1}"
        docs.append(f"""apiVersion: v1
kind: Service
metadata: {{name: svc-{i}, namespace: default, labels: {{istio.io/use-waypoint: waypoint}}}}
spec: {{selector: {{app: app-{i}}}, clusterIP: {ip}, ports: [{{name: http, port: 80, targetPort: 8080}}]}}
---
apiVersion: v1
kind: Pod
metadata: {{name: app-{i}, namespace: default, labels: {{app: app-{i}}}}}
spec: {{nodeName: node-a, serviceAccountName: app-{i}}}
status: {{phase: Running, podIP: {pod_ip}, conditions: [{{type: Ready, status: "True"}}]}}""")
    for i in range(10):
        docs.append(f"""apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: policy-{i}, namespace: default}}
spec:
  targetRefs: [{{group: gateway.networking.k8s.io, kind: Gateway, name: waypoint}}]
  action: DENY
  rules: [{{to: [{{operation: {{paths: ["/blocked-{i}/*"], methods: [DELETE]}}}}], from: [{{source: {{namespaces: [evil-{i}]}}}}]}}]""")
    return "\n---\n".join(docs)


def route(i: int, services: int, version: int = 0) -> str:
    svc = i % services
    return f"""apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {{name: route-{i}, namespace: default}}
spec:
  parentRefs: [{{group: "", kind: Service, name: svc-{svc}, port: 80}}]
  rules:
  - matches: [{{path: {{type: PathPrefix, value: /r{i}/v{version}}}, headers: [{{name: x-r, value: "{i}"}}]}}]
    backendRefs: [{{name: svc-{svc}, port: 80, weight: 90}}, {{name: svc-{(svc + 1) % services}, port: 80, weight: 10}}]"""


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--routes", type=int, default=1000)
    parser.add_argument("--services", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--gc",
        nargs="+",
        choices=("freeze", "plain"),
        default=["freeze", "plain"],
        help="freeze: the heap frozen after the first load, as `ambient control` does; plain: not",
    )
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "l7_control.json")
    args = parser.parse_args()
    rows = []
    for gc_mode, services in [(g, s) for s in args.services for g in args.gc]:
        gc.unfreeze()
        gc.collect()
        text = mesh(services) + "\n---\n" + "\n---\n".join(route(i, services) for i in range(args.routes))
        t0 = time.process_time()
        loaded = parse_documents(text, "mesh.yaml")
        assert not loaded.errors, loaded.errors[:3]
        store = KubeStore(loaded.objects)
        settings = MeshSettings()
        index = AmbientIndex(settings)
        waypoints = WaypointIndex(settings)
        delta = index.update(store, None)
        waypoints.update_l7(store, None)
        waypoints.apply(delta.addresses, delta.removed_addresses)
        snapshot = waypoints.snapshot(WAYPOINT)
        start_cpu = time.process_time() - t0
        if gc_mode == "freeze":
            freeze_loaded_state()
        cpu_ms = []
        changed_resources = []
        objects = {object_key(o): o for o in loaded.objects}
        for n in range(args.repeats):
            i = (n * 37) % args.routes
            (changed,) = parse_documents(route(i, services, version=n + 1), "route.yaml").objects
            key = object_key(changed)
            objects[key] = changed
            new_store = KubeStore(objects.values())
            t0 = time.process_time()
            delta = index.update(new_store, [key])
            waypoints.update_l7(new_store, [key])
            pushed = waypoints.apply(delta.addresses, delta.removed_addresses)
            after = waypoints.snapshot(WAYPOINT)
            cpu_ms.append((time.process_time() - t0) * 1000)
            assert pushed == {WAYPOINT}, pushed
            changed_resources.append(sum(len(v) for v in (after.changed or {}).values()))
            snapshot = after
        chains = len(snapshot.of("type.googleapis.com/envoy.config.listener.v3.Listener"))
        rows.append(
            {
                "gc": gc_mode,
                "routes": args.routes,
                "services": services,
                "policies": 10,
                "initial_build_cpu_s": round(start_cpu, 3),
                "change_cpu_ms_median": round(statistics.median(cpu_ms), 2),
                "change_cpu_ms_max": round(max(cpu_ms), 2),
                "changed_resources_per_push": statistics.median(changed_resources),
                "listeners": chains,
            }
        )
    print(
        f"{'gc':>7} {'routes':>7} {'services':>9} {'initial build CPU s':>20} {'1 change CPU ms p50':>20} {'max':>8} {'resources pushed':>17}"
    )
    for r in rows:
        print(
            f"{r['gc']:>7} {r['routes']:>7} {r['services']:>9} {r['initial_build_cpu_s']:>20} {r['change_cpu_ms_median']:>20} "
            f"{r['change_cpu_ms_max']:>8} {r['changed_resources_per_push']:>17}"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"goal_change_cpu_ms": 100, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
