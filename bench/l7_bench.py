"""Waypoint L7 cost: requests per second and added latency with 10 routes and 10 L7 policies,
generated configuration against a static one extended by hand, and the time from `lab apply` of
an HTTPRoute to the first request it routes.

    sudo flock /tmp/ambient-netns.lock .venv/bin/python bench/l7_bench.py [--requests 300] [--rounds 3]

Topology: bench/waypoint_bench.py's (tests/netns/test_waypoint_envoy.py's mesh plus a fifth
namespace running the same Envoy with the hand-written static configuration). Both waypoints
carry the same L7 work for their service:

  generated  `ambient control`'s configuration, from one HTTPRoute of 10 rules (9 with a path
             and a header match that these requests miss, then the catch-all to the service)
             and 10 DENY AuthorizationPolicies bound to the waypoint (a path and a header each,
             none matching), plus the gRPC access log behind Istio's HTTP metrics
  static     the static example's chain extended by hand with the same 10 routes (Envoy JSON),
             one RBAC DENY filter of the same 10 policies, and the same gRPC access log (to a
             sink in this process)
  direct     the service without a waypoint (the L4 path alone), the baseline for "added"

Each mode is a sequence of HTTP GETs, one new connection per request (client pod -> SOCKS5 ->
client node proxy -> waypoint -> server node proxy -> app); requests per second are 1 / mean
latency of that sequential client. Rounds interleave the modes.

Then the lab (`ambient lab`, its own namespaces): with a waypoint running and a Service using
it, `lab apply` of an HTTPRoute whose rule redirects `/moved`, timed until the client's first
request gets that redirect.

Prints a table and writes JSON (default bench/results/l7.json). Never a timed assertion.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import datetime
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import grpc  # noqa: E402
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc  # noqa: E402
from waypoint_bench import (  # noqa: E402
    DIRECT_VIP,
    STATIC_VIP,
    start_static_waypoint,
    summary,
    timed_requests,
    wait,
)

from ambient_mesh.control import waypoint_l7  # noqa: E402
from ambient_mesh.host.commands import SubprocessRunner  # noqa: E402
from ambient_mesh.host.netns import http_get  # noqa: E402
from tests.helpers.waypoint_mesh import ALLOW_CLIENT_AND_WAYPOINT, running_waypoint_mesh  # noqa: E402
from tests.netns.conftest import start_echo_server  # noqa: E402

GENERATED_VIP = "10.96.0.10"
T = "type.googleapis.com/"

# -- the generated side: what a user applies ----------------------------------------------------

ROUTE = "\n".join(
    [
        "apiVersion: gateway.networking.k8s.io/v1",
        "kind: HTTPRoute",
        "metadata: {name: bench, namespace: default}",
        "spec:",
        '  parentRefs: [{group: "", kind: Service, name: web, port: 80}]',
        "  rules:",
        *[
            f"  - matches: [{{path: {{type: PathPrefix, value: /api-{i}}}, headers: [{{name: x-route, value: '{i}'}}]}}]\n"
            "    backendRefs: [{name: web, port: 80}]"
            for i in range(9)
        ],
        "  - backendRefs: [{name: web, port: 80}]",
    ]
)
POLICIES = "\n---\n".join(
    f"""apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: deny-{i}, namespace: default}}
spec:
  targetRefs: [{{group: gateway.networking.k8s.io, kind: Gateway, name: waypoint}}]
  action: DENY
  rules: [{{to: [{{operation: {{paths: ["/deny-{i}/*"]}}}}], when: [{{key: "request.headers[x-deny-{i}]", values: ["*"]}}]}}]"""
    for i in range(10)
)

# -- the static side: the same, written by hand in Envoy's terms -----------------------------------


def static_routes(cluster: str) -> list[dict[str, Any]]:
    retry = {
        "retry_on": "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes",
        "num_retries": 2,
    }
    routes: list[dict[str, Any]] = [
        {
            "match": {
                "path_separated_prefix": f"/api-{i}",
                "headers": [{"name": "x-route", "string_match": {"exact": str(i)}}],
            },
            "route": {"cluster": cluster, "timeout": "0s", "retry_policy": retry},
        }
        for i in range(9)
    ]
    routes.append(
        {"match": {"prefix": "/"}, "route": {"cluster": cluster, "timeout": "0s", "retry_policy": retry}}
    )
    return routes


def static_rbac() -> dict[str, Any]:
    policies = {
        f"ns[default]-policy[deny-{i}]-rule[0]": {
            "permissions": [
                {
                    "and_rules": {
                        "rules": [
                            {"url_path": {"path": {"prefix": f"/deny-{i}/"}}},
                            {"header": {"name": f"x-deny-{i}", "present_match": True}},
                        ]
                    }
                }
            ],
            "principals": [{"any": True}],
        }
        for i in range(10)
    }
    return {
        "name": "envoy.filters.http.rbac",
        "typed_config": {
            "@type": T + "envoy.extensions.filters.http.rbac.v3.RBAC",
            "rules": {"action": "DENY", "policies": policies},
        },
    }


def static_access_log(cluster: str) -> dict[str, Any]:
    """The generated access log (waypoint_l7.ACCESS_LOG, the same fields, so both sides pay
    alike), sent to the bench's own sink."""
    log = copy.deepcopy(waypoint_l7.ACCESS_LOG[0])
    common = log["typed_config"]["common_config"]
    common["log_name"] = "bench"
    common["grpc_service"] = {"envoy_grpc": {"cluster_name": cluster}}
    return log


def extend_static(boot: dict[str, Any], als_socket: Path) -> dict[str, Any]:
    """The static waypoint's service chain with the routes, the RBAC filter and the access log."""
    main = next(li for li in boot["static_resources"]["listeners"] if li["name"] == "main_internal")
    hcm = main["filter_chains"][0]["filters"][0]["typed_config"]
    vhost = hcm["route_config"]["virtual_hosts"][0]
    cluster = vhost["routes"][0]["route"]["cluster"]
    vhost["routes"] = static_routes(cluster)
    hcm["http_filters"] = [static_rbac(), *hcm["http_filters"]]
    hcm["access_log"] = [static_access_log("als-sink")]
    boot["static_resources"]["clusters"].append(
        {
            "name": "als-sink",
            "type": "STATIC",
            "connect_timeout": "1s",
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": T + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {}},
                }
            },
            "load_assignment": {
                "cluster_name": "als-sink",
                "endpoints": [
                    {"lb_endpoints": [{"endpoint": {"address": {"pipe": {"path": str(als_socket)}}}}]}
                ],
            },
        }
    )
    return boot


class _Sink(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    entries = 0

    def StreamAccessLogs(self, request_iterator, context):  # noqa: N802
        for message in request_iterator:
            _Sink.entries += len(message.http_logs.log_entry)
        return als_pb2.StreamAccessLogsResponse()


# -- lab apply of an HTTPRoute -> first routed request --------------------------------------------

LAB_VIP = "10.96.50.12"
LAB_ROUTE = """
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: moved, namespace: demo}
spec:
  parentRefs: [{group: "", kind: Service, name: web}]
  rules:
  - matches: [{path: {type: PathPrefix, value: /moved}}]
    filters: [{type: RequestRedirect, requestRedirect: {hostname: moved.example, statusCode: 301}}]
  - backendRefs: [{name: web, port: 80}]
"""


def _redirected(netns: str) -> bool:
    from ambient_mesh.host.netns import netns_socket

    sock = netns_socket(netns)
    sock.settimeout(2.0)
    try:
        sock.connect((LAB_VIP, 80))
        sock.sendall(b"GET /moved HTTP/1.1\r\nHost: web\r\nConnection: close\r\n\r\n")
        data = sock.recv(4096)
    except OSError:
        return False
    finally:
        sock.close()
    return data.startswith(b"HTTP/1.1 301") and b"moved.example" in data


def lab_apply_route_to_first_request(runs: int) -> list[float]:
    from ambient_mesh.lab.lab import APP_PORT, Lab, LabConfig
    from tests.helpers.lab_waypoint import WAYPOINT, WAYPOINT_POD, apply_text, delete_text, demo_pods

    service = f"""
apiVersion: v1
kind: Service
metadata: {{name: web, namespace: demo, labels: {{istio.io/use-waypoint: waypoint}}}}
spec: {{selector: {{app: server}}, clusterIP: {LAB_VIP}, ports: [{{name: http, port: 80, targetPort: {APP_PORT}}}]}}
"""
    out: list[float] = []
    with tempfile.TemporaryDirectory(prefix="l7lab-") as state:
        config = LabConfig(
            state_dir=Path(state), pods=demo_pods(), ambient_namespaces=frozenset({"demo"}), cluster_dns=False
        )
        with Lab(config) as lab:
            apply_text(lab, service + "---" + WAYPOINT)
            client = lab.pods["demo/client"]

            def waypoint_up() -> bool:
                lab.supervise()
                return WAYPOINT_POD in lab.pods

            if not wait(waypoint_up, 90):
                print("the lab's waypoint pod did not start", file=sys.stderr)
                return out
            time.sleep(3.0)  # its Envoy programmed
            for _ in range(runs):
                # The control plane polls its directory once a second; a random start keeps the
                # runs from locking onto that phase (each run starts right after a push).
                time.sleep(random.uniform(0.0, 1.0))
                t0 = time.perf_counter()
                apply_text(lab, LAB_ROUTE, "route.yaml")

                def routed() -> bool:
                    lab.supervise()
                    return _redirected(client.netns)

                if wait(routed, 30):
                    out.append((time.perf_counter() - t0) * 1000)
                delete_text(lab, LAB_ROUTE, "route.yaml")
                wait(lambda: not _redirected(client.netns), 30)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="requests per mode per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lab-runs", type=int, default=5, help="0 skips the lab measurement")
    parser.add_argument("--lab-only", action="store_true", help="only the lab measurement")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "l7.json"))
    args = parser.parse_args(argv)
    if args.lab_only:
        lab_ms = lab_apply_route_to_first_request(max(1, min(args.lab_runs, 20)))
        s = summary(lab_ms) | {"runs": lab_ms}
        if lab_ms:
            print(
                f"lab apply of an HTTPRoute -> first routed request: p50 {s['p50_ms']:.0f} ms, p90 {s['p90_ms']:.0f} ms, max {max(lab_ms):.0f} ms over {len(lab_ms)} runs (goal < 1000 ms)"
            )
        Path(args.out).write_text(json.dumps({"lab_apply_route_to_first_request_ms": s}, indent=2) + "\n")
        return 0
    if os.geteuid() != 0:
        print("l7_bench needs root (network namespaces)", file=sys.stderr)
        return 2
    requests = max(1, min(args.requests, 5000))
    samples: dict[str, list[float]] = {"direct": [], "generated": [], "static": []}
    failures = dict.fromkeys(samples, 0)
    with tempfile.TemporaryDirectory(prefix="l7-bench-") as tmpname:
        tmp = Path(tmpname)
        als_socket = tmp / "als.sock"
        sink = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4))
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(_Sink(), sink)
        sink.add_insecure_port(f"unix:{als_socket}")
        sink.start()
        try:
            with running_waypoint_mesh(
                SubprocessRunner(), http_get, start_echo_server, tmp, ALLOW_CLIENT_AND_WAYPOINT
            ) as mesh:
                start_static_waypoint(mesh, tmp, lambda c: extend_static(c, als_socket))
                mesh.write("l7.yaml", ROUTE + "\n---\n" + POLICIES)

                def l7_programmed() -> bool:
                    # The policies are in the chain's filters, the routes in its RDS resource.
                    listeners = mesh.envoy_admin("/config_dump?resource=dynamic_listeners").decode()
                    routes = mesh.envoy_admin("/config_dump?resource=dynamic_route_configs").decode()
                    return "deny-9" in listeners and "/api-8" in routes

                for what, ok in (
                    ("the generated L7 configuration", lambda: l7_programmed()),
                    ("the direct service", lambda: mesh.http_get(DIRECT_VIP, 80)[0] == 200),
                    ("the static waypoint", lambda: mesh.http_get(STATIC_VIP, 80)[0] == 200),
                ):
                    if not wait(ok, 30):
                        print(
                            f"not ready: {what}; static Envoy log:\n{(tmp / 'static-envoy.log').read_text()[-2000:]}",
                            file=sys.stderr,
                        )
                        return 1
                vips = {"direct": DIRECT_VIP, "generated": GENERATED_VIP, "static": STATIC_VIP}
                for _ in range(args.rounds):
                    for mode, vip in vips.items():
                        timed_requests(mesh, vip, 20)
                        got, failed = timed_requests(mesh, vip, requests)
                        samples[mode].extend(got)
                        failures[mode] += failed
        finally:
            sink.stop(grace=1.0)
    lab_ms = lab_apply_route_to_first_request(max(0, min(args.lab_runs, 10))) if args.lab_runs else []
    lat = {mode: summary(s) for mode, s in samples.items()}
    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "cpus": os.cpu_count(),
        "requests_per_mode": requests * args.rounds,
        "latency": lat,
        "failures": failures,
        "static_access_log_entries": _Sink.entries,
        "lab_apply_route_to_first_request_ms": summary(lab_ms) | {"runs": lab_ms},
    }
    print(
        f"{'mode':<10} {'n':>6} {'req/s':>7} {'p50 ms':>8} {'p99 ms':>8} {'added p50':>10} {'added p99':>10} {'failed':>7}"
    )
    for mode in samples:
        row = lat[mode]
        if not row.get("n"):
            continue
        row["rps"] = 1000.0 / row["mean_ms"]
        added50 = row["p50_ms"] - lat["direct"]["p50_ms"] if lat["direct"].get("n") else 0.0
        added99 = row["p99_ms"] - lat["direct"]["p99_ms"] if lat["direct"].get("n") else 0.0
        row["added_p50_ms"], row["added_p99_ms"] = added50, added99
        print(
            f"{mode:<10} {row['n']:>6} {row['rps']:>7.1f} {row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f} "
            f"{added50:>10.2f} {added99:>10.2f} {failures[mode]:>7}"
        )
    if lat["generated"].get("n") and lat["static"].get("n"):
        result["generated_over_static_rps"] = lat["generated"]["rps"] / lat["static"]["rps"]
        print(
            f"generated / static requests per second: {result['generated_over_static_rps']:.3f} (goal >= 0.95)"
        )
    if lab_ms:
        s = result["lab_apply_route_to_first_request_ms"]
        print(
            f"lab apply of an HTTPRoute -> first routed request: p50 {s['p50_ms']:.0f} ms, max {max(lab_ms):.0f} ms over {len(lab_ms)} runs (goal < 1000 ms)"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
