"""Waypoint cost: the latency a waypoint adds, generated configuration against a static one, and
how long a new waypoint attachment takes to carry its first request.

    sudo flock /tmp/ambient-netns.lock .venv/bin/python bench/waypoint_bench.py [--requests 300] [--rounds 3]

Topology (network namespaces on a fabric, as tests/netns/test_waypoint_envoy.py builds it):
`ambient control`, a client and a server pod each with its dedicated `ambient ztunnel`, the
waypoint pod `ambient waypoint` (Envoy 1.40 fed by the control plane), and a fifth namespace
running the same Envoy binary with a hand-written static configuration of the same path
(connect_terminate, main_internal with the service's VIP chain and istiod's default route,
connect_originate, static clusters, certificates from files; none of the static example's L7
extras such as RBAC, fault or access logs, which are part 2).

Modes, each a sequence of HTTP GETs, one new connection per request, client pod -> SOCKS5 ->
client node proxy -> ... -> server node proxy -> app:
  direct     a service without waypoint (the L4 path alone)
  generated  a service using the waypoint configured by `ambient control`
  static     a service using the static-configuration waypoint
Rounds interleave the modes. Then `attach`: a service's `istio.io/use-waypoint` label is
written at t0 (the waypoint already running), and the time until a request has gone through the
waypoint (Envoy's counter for that service's cluster) is measured.

`--lab-runs N` (default 3) then brings up an `ambient lab` (2 nodes, a client and a server pod)
and measures, N times, `lab apply` of a Gateway (the service already labelled) -> the control
plane deploys it -> the lab's Deployment controller and kubelet run the pod -> the first
request the client's node proxy sends through the waypoint; the Gateway is deleted (and its pod
gone) between runs.

Prints a table and writes JSON (default bench/results/waypoint.json). Never a timed assertion.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ambient_mesh.host.commands import SubprocessRunner  # noqa: E402
from ambient_mesh.host.netns import http_get  # noqa: E402
from ambient_mesh.identity.ca import CertificateAuthority  # noqa: E402
from ambient_mesh.identity.spiffe import Identity  # noqa: E402
from ambient_mesh.waypoint.envoy import find_envoy  # noqa: E402
from tests.helpers.waypoint_mesh import (  # noqa: E402
    ALLOW_CLIENT_AND_WAYPOINT,
    HTTP_PORT,
    running_waypoint_mesh,
)
from tests.netns.conftest import start_echo_server  # noqa: E402

DIRECT_VIP, STATIC_VIP, LATE_VIP = "10.96.0.20", "10.96.0.21", "10.96.0.22"
HOST = "cluster.local"


def _services(static_ip: str) -> str:
    return f"""
apiVersion: v1
kind: Service
metadata: {{name: web-direct, namespace: default}}
spec: {{selector: {{app: server}}, clusterIP: {DIRECT_VIP}, ports: [{{name: http, port: 80, targetPort: {HTTP_PORT}}}]}}
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {{name: static-wp, namespace: default}}
spec:
  gatewayClassName: istio-waypoint
  listeners: [{{name: mesh, port: 15008, protocol: HBONE}}]
status:
  addresses: [{{type: Hostname, value: static-wp.default.svc.cluster.local}}]
---
apiVersion: v1
kind: Service
metadata: {{name: static-wp, namespace: default, labels: {{gateway.istio.io/managed: istio.io-mesh-controller, gateway.networking.k8s.io/gateway-name: static-wp}}}}
spec:
  selector: {{gateway.networking.k8s.io/gateway-name: static-wp}}
  clusterIP: 10.96.0.3
  ports: [{{name: mesh, port: 15008}}]
---
apiVersion: v1
kind: Pod
metadata: {{name: static-wp-0, namespace: default, uid: uid-static-wp, labels: {{gateway.networking.k8s.io/gateway-name: static-wp, istio.io/dataplane-mode: none}}}}
spec: {{nodeName: static, serviceAccountName: static-wp, containers: [{{name: istio-proxy, image: x}}]}}
status: {{phase: Running, podIP: {static_ip}, conditions: [{{type: Ready, status: "True"}}]}}
---
apiVersion: v1
kind: Service
metadata: {{name: web-static, namespace: default, labels: {{istio.io/use-waypoint: static-wp}}}}
spec: {{selector: {{app: server}}, clusterIP: {STATIC_VIP}, ports: [{{name: http, port: 80, targetPort: {HTTP_PORT}}}]}}
"""


def _late_service(labelled: bool) -> str:
    labels = "{istio.io/use-waypoint: waypoint}" if labelled else "{}"
    return f"""
apiVersion: v1
kind: Service
metadata: {{name: web-late, namespace: default, labels: {labels}}}
spec: {{selector: {{app: server}}, clusterIP: {LATE_VIP}, ports: [{{name: http, port: 80, targetPort: {HTTP_PORT}}}]}}
"""


def _tls(cert_dir: Path, td: str) -> dict:
    san = [{"san_type": "URI", "matcher": {"prefix": f"spiffe://{td}/"}}]
    return {
        "alpn_protocols": ["h2"],
        "tls_params": {"tls_minimum_protocol_version": "TLSv1_3", "tls_maximum_protocol_version": "TLSv1_3"},
        "tls_certificates": [
            {
                "certificate_chain": {"filename": str(cert_dir / "chain.pem")},
                "private_key": {"filename": str(cert_dir / "key.pem")},
            }
        ],
        "validation_context": {
            "trusted_ca": {"filename": str(cert_dir / "root.pem")},
            "match_typed_subject_alt_names": san,
        },
    }


def static_bootstrap(cert_dir: Path, admin: Path, vip: str, endpoint: str) -> dict:
    """The hand-written waypoint: the reference example's shape, for one service."""
    t = "type.googleapis.com/"
    raw = {
        "name": "raw_buffer",
        "typed_config": {"@type": t + "envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer"},
    }
    internal = t + "envoy.extensions.transport_sockets.internal_upstream.v3.InternalUpstreamTransport"
    router = {
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": t + "envoy.extensions.filters.http.router.v3.Router"},
    }
    odst = {
        "name": "envoy.filters.listener.original_dst",
        "typed_config": {"@type": t + "envoy.extensions.filters.listener.original_dst.v3.OriginalDst"},
    }
    hcm = t + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
    cluster = f"inbound-vip|80|http|web-static.default.svc.{HOST}"
    state = [
        ("envoy.filters.listener.original_dst.local_ip", "%REQ(:AUTHORITY)%", None),
        ("io.istio.peer_principal", "%DOWNSTREAM_PEER_URI_SAN%", "envoy.string"),
    ]
    on_request = []
    for key, fmt, factory in state:
        entry = {
            "object_key": key,
            "format_string": {"text_format_source": {"inline_string": fmt}},
            "shared_with_upstream": "ONCE",
        }
        if factory:
            entry["factory_key"] = factory
        on_request.append(entry)
    return {
        "admin": {"address": {"pipe": {"path": str(admin)}}},
        "bootstrap_extensions": [
            {
                "name": "envoy.bootstrap.internal_listener",
                "typed_config": {
                    "@type": t + "envoy.extensions.bootstrap.internal_listener.v3.InternalListener"
                },
            }
        ],
        "static_resources": {
            "listeners": [
                {
                    "name": "connect_terminate",
                    "address": {"socket_address": {"address": "0.0.0.0", "port_value": 15008}},
                    "filter_chains": [
                        {
                            "transport_socket": {
                                "name": "tls",
                                "typed_config": {
                                    "@type": t
                                    + "envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
                                    "require_client_certificate": True,
                                    "common_tls_context": _tls(cert_dir, "cluster.local"),
                                },
                            },
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": {
                                        "@type": hcm,
                                        "stat_prefix": "connect_terminate",
                                        "upgrade_configs": [{"upgrade_type": "CONNECT"}],
                                        "http2_protocol_options": {"allow_connect": True},
                                        "route_config": {
                                            "virtual_hosts": [
                                                {
                                                    "name": "default",
                                                    "domains": ["*"],
                                                    "routes": [
                                                        {
                                                            "match": {"connect_matcher": {}},
                                                            "route": {
                                                                "cluster": "main_internal",
                                                                "upgrade_configs": [
                                                                    {
                                                                        "upgrade_type": "CONNECT",
                                                                        "connect_config": {},
                                                                    }
                                                                ],
                                                            },
                                                        }
                                                    ],
                                                }
                                            ]
                                        },
                                        "http_filters": [
                                            {
                                                "name": "connect_authority",
                                                "typed_config": {
                                                    "@type": t
                                                    + "envoy.extensions.filters.http.set_filter_state.v3.Config",
                                                    "on_request_headers": on_request,
                                                },
                                            },
                                            router,
                                        ],
                                    },
                                }
                            ],
                        }
                    ],
                },
                {
                    "name": "main_internal",
                    "internal_listener": {},
                    "listener_filters": [odst],
                    "filter_chains": [
                        {
                            "filter_chain_match": {
                                "prefix_ranges": [{"address_prefix": vip, "prefix_len": 32}],
                                "destination_port": 80,
                            },
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": {
                                        "@type": hcm,
                                        "stat_prefix": "inbound_vip",
                                        "route_config": {
                                            "virtual_hosts": [
                                                {
                                                    "name": "inbound|http|80",
                                                    "domains": ["*"],
                                                    "routes": [
                                                        {
                                                            "match": {"prefix": "/"},
                                                            "route": {"cluster": cluster, "timeout": "0s"},
                                                        }
                                                    ],
                                                }
                                            ]
                                        },
                                        "http_filters": [router],
                                    },
                                }
                            ],
                        }
                    ],
                },
                {
                    "name": "connect_originate",
                    "use_original_dst": False,
                    "internal_listener": {},
                    "listener_filters": [odst],
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.tcp_proxy",
                                    "typed_config": {
                                        "@type": t + "envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                                        "stat_prefix": "connect_originate",
                                        "cluster": "connect_originate",
                                        "tunneling_config": {"hostname": "%DOWNSTREAM_LOCAL_ADDRESS%"},
                                    },
                                }
                            ]
                        }
                    ],
                },
            ],
            "clusters": [
                {
                    "name": "main_internal",
                    "type": "STATIC",
                    "load_assignment": {
                        "cluster_name": "main_internal",
                        "endpoints": [
                            {
                                "lb_endpoints": [
                                    {
                                        "endpoint": {
                                            "address": {
                                                "envoy_internal_address": {
                                                    "server_listener_name": "main_internal"
                                                }
                                            }
                                        }
                                    }
                                ]
                            }
                        ],
                    },
                    "transport_socket": {
                        "name": "internal_upstream",
                        "typed_config": {"@type": internal, "transport_socket": raw},
                    },
                },
                {
                    "name": cluster,
                    "type": "STATIC",
                    "load_assignment": {
                        "cluster_name": cluster,
                        "endpoints": [
                            {
                                "lb_endpoints": [
                                    {
                                        "endpoint": {
                                            "address": {
                                                "envoy_internal_address": {
                                                    "server_listener_name": "connect_originate",
                                                    "endpoint_id": endpoint,
                                                }
                                            }
                                        },
                                        "metadata": {
                                            "filter_metadata": {
                                                "envoy.filters.listener.original_dst": {"local": endpoint}
                                            }
                                        },
                                    }
                                ]
                            }
                        ],
                    },
                    "transport_socket": {
                        "name": "internal_upstream",
                        "typed_config": {
                            "@type": internal,
                            "passthrough_metadata": [
                                {"kind": {"host": {}}, "name": "envoy.filters.listener.original_dst"}
                            ],
                            "transport_socket": raw,
                        },
                    },
                },
                {
                    "name": "connect_originate",
                    "type": "ORIGINAL_DST",
                    "lb_policy": "CLUSTER_PROVIDED",
                    "original_dst_lb_config": {"upstream_port_override": 15008},
                    "typed_extension_protocol_options": {
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                            "@type": t + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                            "explicit_http_config": {"http2_protocol_options": {"allow_connect": True}},
                        }
                    },
                    "transport_socket": {
                        "name": "tls",
                        "typed_config": {
                            "@type": t + "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                            "common_tls_context": _tls(cert_dir, "cluster.local"),
                        },
                    },
                },
            ],
        },
    }


def timed_requests(mesh, vip: str, n: int) -> tuple[list[float], int]:
    """`n` GETs through the client pod, each on a new connection; (latencies in ms, failures)."""
    out, failures = [], 0
    for _ in range(n):
        t0 = time.perf_counter()
        try:
            status, _ = mesh.http_get(vip, 80)
        except OSError:
            status = 0
        if status == 200:
            out.append((time.perf_counter() - t0) * 1000)
        else:
            failures += 1
    return out, failures


def summary(samples: list[float]) -> dict:
    if not samples:
        return {"n": 0}
    s = sorted(samples)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return {
        "n": len(s),
        "p50_ms": pick(0.5),
        "p90_ms": pick(0.9),
        "p99_ms": pick(0.99),
        "mean_ms": statistics.fmean(s),
    }


def wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return True
        except OSError:
            pass
        time.sleep(0.05)
    return False


def lab_apply_to_first_request(runs: int) -> list[float]:
    """`ambient lab apply` of a Gateway -> the first request through its waypoint, per run."""
    import tempfile

    from ambient_mesh.lab.lab import Lab, LabConfig, tcp_roundtrip
    from tests.helpers.lab_waypoint import (
        SERVER_VIP,
        WAYPOINT,
        WAYPOINT_POD,
        apply_text,
        delete_text,
        demo_pods,
        services,
    )

    out: list[float] = []
    with tempfile.TemporaryDirectory(prefix="wplab-") as state:
        config = LabConfig(
            state_dir=Path(state), pods=demo_pods(), ambient_namespaces=frozenset({"demo"}), cluster_dns=False
        )
        with Lab(config) as lab:
            apply_text(lab, services(True))
            client = lab.pods["demo/client"]
            for _ in range(runs):
                since = lab.proxy_log_offset("node-1")
                t0 = time.perf_counter()
                apply_text(lab, WAYPOINT)

                def through(since: int = since) -> bool:
                    lab.supervise()
                    try:
                        tcp_roundtrip(client.netns, SERVER_VIP, 80, b"x", timeout_s=2.0)
                    except OSError:
                        return False
                    return any(
                        e.get("direction") == "outbound"
                        and e.get("dst.workload") == WAYPOINT_POD.split("/")[1]
                        for e in lab.access_log("node-1", since)
                    )

                if wait(through, 60):
                    out.append((time.perf_counter() - t0) * 1000)
                delete_text(lab, WAYPOINT)

                def gone() -> bool:
                    lab.supervise()
                    return WAYPOINT_POD not in lab.pods

                wait(gone, 60)
    return out


def start_static_waypoint(mesh: Any, tmp: Path, extend: Callable[[dict], dict] = lambda c: c) -> None:
    """A second waypoint, Envoy on the hand-written static configuration (`extend`ed), on a node
    of its own with a certificate of the mesh CA for `static-wp`; the bench's services pointed at
    it and the destination's policy allowing it."""
    static = mesh.fabric.add_node("static")
    ca = CertificateAuthority.from_plugged_in_dir(mesh.state / "cacerts")
    cert = ca.issue(
        Identity("cluster.local", "default", "static-wp"), 24 * 3600, now=datetime.datetime.now(datetime.UTC)
    )
    cert_dir = tmp / "static-certs"
    cert_dir.mkdir()
    (cert_dir / "key.pem").write_bytes(cert.private_key_pem)
    (cert_dir / "chain.pem").write_bytes(b"".join(cert.chain_pem))
    (cert_dir / "root.pem").write_bytes(cert.roots_pem)
    boot = tmp / "static-envoy.yaml"
    config = static_bootstrap(
        cert_dir, tmp / "static-admin.sock", STATIC_VIP, f"{mesh.server.ipv4}:{HTTP_PORT}"
    )
    boot.write_text(yaml.safe_dump(extend(config)))
    argv = [
        str(find_envoy()),
        "-c",
        str(boot),
        "--disable-hot-restart",
        "--concurrency",
        "2",
        "-l",
        "warning",
    ]
    with open(tmp / "static-envoy.log", "wb") as out:
        mesh.fabric.spawn(static, argv, stdout=out, stderr=out)
    mesh.fabric.wait_for_listen(static, 15008)
    mesh.write("bench.yaml", _services(str(static.ipv4)))
    mesh.write(
        "policy.yaml",
        ALLOW_CLIENT_AND_WAYPOINT.replace(
            '"cluster.local/ns/default/sa/waypoint"]',
            '"cluster.local/ns/default/sa/waypoint", "cluster.local/ns/default/sa/static-wp"]',
        ),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="requests per mode per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--attach-runs", type=int, default=3)
    parser.add_argument("--lab-runs", type=int, default=3, help="0 skips the lab measurement")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "waypoint.json"))
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("waypoint_bench needs root (network namespaces)", file=sys.stderr)
        return 2
    requests = max(1, min(args.requests, 5000))
    import tempfile

    samples: dict[str, list[float]] = {"direct": [], "generated": [], "static": []}
    failures = dict.fromkeys(samples, 0)
    attach_ms: list[float] = []
    with tempfile.TemporaryDirectory(prefix="waypoint-bench-") as tmpname:
        tmp = Path(tmpname)
        with running_waypoint_mesh(
            SubprocessRunner(), http_get, start_echo_server, tmp, ALLOW_CLIENT_AND_WAYPOINT
        ) as mesh:
            start_static_waypoint(mesh, tmp)
            for vip in (DIRECT_VIP, STATIC_VIP):
                if not wait(lambda vip=vip: mesh.http_get(vip, 80)[0] == 200, 30):
                    print(
                        f"no 200 from {vip}; static Envoy log:\n{(tmp / 'static-envoy.log').read_text()[-2000:]}",
                        file=sys.stderr,
                    )
                    return 1
            vips = {"direct": DIRECT_VIP, "generated": "10.96.0.10", "static": STATIC_VIP}
            for _ in range(args.rounds):
                for mode, vip in vips.items():
                    timed_requests(mesh, vip, 20)  # warm the pools
                    got, failed = timed_requests(mesh, vip, requests)
                    samples[mode].extend(got)
                    failures[mode] += failed
            counter = f"cluster.inbound-vip|80|http|web-late.default.svc.{HOST}.upstream_rq_total"
            for _ in range(max(1, min(args.attach_runs, 10))):
                mesh.write("late.yaml", _late_service(False))
                wait(lambda: mesh.http_get(LATE_VIP, 80)[0] == 200, 30)
                t0 = time.perf_counter()
                mesh.write("late.yaml", _late_service(True))

                def through_waypoint() -> bool:
                    mesh.http_get(LATE_VIP, 80)
                    return any(
                        line.startswith(counter) and not line.endswith(": 0")
                        for line in mesh.envoy_admin("/stats?filter=web-late").decode().splitlines()
                    )

                if wait(through_waypoint, 30):
                    attach_ms.append((time.perf_counter() - t0) * 1000)
                mesh.remove("late.yaml")
                wait(lambda: "web-late" not in mesh.envoy_admin("/clusters").decode(), 30)
    lab_ms = lab_apply_to_first_request(max(0, min(args.lab_runs, 10))) if args.lab_runs else []
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "cpus": os.cpu_count(),
        "requests_per_mode": requests * args.rounds,
        "latency": {mode: summary(s) for mode, s in samples.items()},
        "failures": failures,
        "attach_ms": summary(attach_ms) | {"runs": attach_ms},
        "lab_apply_to_first_request_ms": summary(lab_ms) | {"runs": lab_ms},
    }
    lat = result["latency"]
    print(f"{'mode':<10} {'n':>6} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'mean ms':>8} {'failed':>7}")
    for mode in samples:
        row = lat[mode]
        if row["n"]:
            print(
                f"{mode:<10} {row['n']:>6} {row['p50_ms']:>8.2f} {row['p90_ms']:>8.2f} {row['p99_ms']:>8.2f} {row['mean_ms']:>8.2f} {failures[mode]:>7}"
            )
    if lat["generated"].get("n") and lat["static"].get("n") and lat["direct"].get("n"):
        added_gen = lat["generated"]["p50_ms"] - lat["direct"]["p50_ms"]
        added_static = lat["static"]["p50_ms"] - lat["direct"]["p50_ms"]
        result["added_p50_ms"] = {"generated": added_gen, "static": added_static}
        print(f"waypoint added p50: generated {added_gen:.2f} ms, static {added_static:.2f} ms")
    if attach_ms:
        print(
            f"label written -> first request through the waypoint: p50 {result['attach_ms']['p50_ms']:.0f} ms over {len(attach_ms)} runs {[round(x) for x in attach_ms]}"
        )
    if lab_ms:
        print(
            f"lab apply of the Gateway -> first request through its waypoint: p50 "
            f"{result['lab_apply_to_first_request_ms']['p50_ms']:.0f} ms over {len(lab_ms)} runs {[round(x) for x in lab_ms]}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
