"""Waypoints on the cluster: `ambient waypoint apply --kube --enroll-namespace` writes the
Gateway, the control plane deploys it as istiod does (ServiceAccount, Deployment, Service owned by
the Gateway) and writes its `status.addresses`; a request to a Service of the enrolled namespace
goes client -> node proxy -> waypoint (the image's Envoy) -> node proxy -> server; at L7 the
waypoint routes by a header (an HTTPRoute to a canary), answers a DENY of a path with its own 403
(a `targetRefs` AuthorizationPolicy), and its pod counts the requests as Istio's
`istio_requests_total` on 15020; deleting the waypoint pod interrupts traffic only until the
Deployment's new pod is ready (the gap is measured and printed); deleting the Gateway deletes
its objects.

The server's Service port has no name (its protocol sniffed by the waypoint's HTTP inspector in
main_internal_sniffed), the canary's is named `http` (known, main_internal): both paths carry the
L7 checks, and the sniffed one the pod restart. (A sniffing listener reached through a second
internal hop, since removed, once lost responses there and made a waypoint pod reset every
stream after a restart.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .kube import KUBECONFIG, ROOT, wait_for

GATEWAY_NAME_LABEL = "gateway.networking.k8s.io/gateway-name"
GAP_BOUND_S = 60.0  # "briefly": a new pod's start, readiness and the node proxy's update
PROBE_DURATION_S = 90  # how long the in-pod probe loop runs at most
PROBE_INTERVAL_S = 0.1


def ambient(*argv: str, timeout: float = 240) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "ambient_mesh.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "KUBECONFIG": str(KUBECONFIG)},
    )
    assert proc.returncode == 0, f"ambient {' '.join(argv)}: {proc.stdout}{proc.stderr}"
    return proc.stdout


# GET once from inside a pod: the status and the Server header (Envoy's `istio-envoy` when the
# waypoint answered).
GET_CODE = """
import sys, urllib.request
try:
    r = urllib.request.urlopen(sys.argv[1], timeout=5)
    print(r.status, r.headers.get("server"))
except Exception as e:
    print(type(e).__name__, e)
"""

# Bounded probe loop inside the client pod: one GET every PROBE_INTERVAL_S for at most
# PROBE_DURATION_S, one line per request (`<monotonic> ok|fail`); stops after 5 s of successes
# that follow a failure.
PROBE_CODE = f"""
import sys, time, urllib.request
url, start = sys.argv[1], time.monotonic()
failed_once, ok_since = False, None
while time.monotonic() - start < {PROBE_DURATION_S}:
    t = time.monotonic()
    try:
        ok = urllib.request.urlopen(url, timeout=1).status == 200
    except Exception:
        ok = False
    print(f"{{t - start:.3f}} {{'ok' if ok else 'fail'}}", flush=True)
    if not ok:
        failed_once, ok_since = True, None
    elif failed_once:
        ok_since = ok_since or t
        if t - ok_since > 5:
            break
    time.sleep({PROBE_INTERVAL_S})
"""


def longest_gap(lines: list[str]) -> tuple[float, int]:
    """(seconds from the first failure of the longest failing run to the success after it,
    number of failed requests in all)."""
    samples = [(float(t), s == "ok") for t, s in (line.split() for line in lines if line.strip())]
    gap, failed, start = 0.0, 0, None
    for t, ok in samples:
        if not ok:
            failed += 1
            start = t if start is None else start
        elif start is not None:
            gap, start = max(gap, t - start), None
    assert start is None, "the probe ended while requests were still failing"
    return gap, failed


@pytest.fixture(scope="module")
def waypointed(cluster):
    ns = cluster.namespace(ambient=True)
    cluster.pod(ns, "server", sa="server", serve=True)
    cluster.pod(ns, "client", sa="client", serve=False)
    cluster.apply(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": "server", "namespace": ns},
                "spec": {
                    "selector": {"app": "server"},
                    "ports": [{"port": 80, "targetPort": 8080}],  # no name: sniffed by the waypoint
                },
            }
        )
    )
    cluster.running(ns, "server")
    wait_for(
        lambda: cluster.get("pod", "-n", ns, "client")["status"].get("phase") == "Running", "client running"
    )
    out = ambient("waypoint", "apply", "--kube", "-n", ns, "--enroll-namespace", "--wait", "--timeout", "120")
    print(f"\n{out}")
    vip = cluster.get("service", "-n", ns, "server")["spec"]["clusterIP"]
    return ns, f"http://{vip}/"


def waypoint_pods(cluster, ns: str) -> list[dict]:
    pods = cluster.get("pods", "-n", ns, "-l", f"{GATEWAY_NAME_LABEL}=waypoint")["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def test_the_control_plane_deploys_the_waypoint_as_istiod_does(cluster, waypointed):
    ns, _ = waypointed
    gw = cluster.get("gateway.gateway.networking.k8s.io", "-n", ns, "waypoint")
    assert gw["status"]["addresses"] == [{"type": "Hostname", "value": f"waypoint.{ns}.svc.cluster.local"}]
    for kind in ("serviceaccount", "deployment", "service"):
        obj = cluster.get(kind, "-n", ns, "waypoint")
        (owner,) = obj["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("Gateway", "waypoint", gw["metadata"]["uid"])
    ports = {p["name"]: p["port"] for p in cluster.get("service", "-n", ns, "waypoint")["spec"]["ports"]}
    assert ports == {"status-port": 15021, "mesh": 15008}
    wait_for(
        lambda: any(
            c.get("ready")
            for p in waypoint_pods(cluster, ns)
            for c in p["status"].get("containerStatuses", [])
        ),
        "the waypoint pod ready",
        180,
    )
    print(
        "\n"
        + ambient("waypoint", "list", "--kube", "-n", ns)
        + ambient("waypoint", "status", "--kube", "-n", ns)
    )


def test_a_service_request_goes_through_the_waypoint(cluster, waypointed):
    ns, url = waypointed

    def through_envoy():
        out = cluster.exec(ns, "client", "python3", "-c", GET_CODE, url, timeout=30).strip()
        return out if out == "200 istio-envoy" else None

    answer = wait_for(through_envoy, f"GET {url} answered through the waypoint's Envoy", 120)
    # the server's node proxy saw the waypoint's identity, not the client's (as in Istio)
    text = cluster.metrics(cluster.ztunnel_pod()["status"]["podIP"])
    principal = f'source_principal="spiffe://cluster.local/ns/{ns}/sa/waypoint"'
    assert any(
        line.startswith("istio_tcp_connections_opened_total{")
        and 'reporter="destination"' in line
        and principal in line
        for line in text.splitlines()
    ), "the destination node proxy counted no connection from the waypoint"
    print(f"\nGET {url} from {ns}/client: {answer} (Server header set by the waypoint's Envoy)")


# One request from inside a pod, with headers (`name:value` arguments): "<status> <Server
# header> <first line of the body>", HTTP errors included (a 403 is an answer, not a failure).
REQUEST_CODE = """
import sys, urllib.error, urllib.request
headers = dict(h.split(":", 1) for h in sys.argv[2:])
try:
    r = urllib.request.urlopen(urllib.request.Request(sys.argv[1], headers=headers), timeout=5)
    code, server, body = r.status, r.headers.get("server"), r.read(512)
except urllib.error.HTTPError as e:
    code, server, body = e.code, e.headers.get("server"), e.read(512)
except Exception as e:
    print("error", type(e).__name__, e)
    raise SystemExit(0)
lines = body.decode(errors="replace").strip().splitlines()
print(code, server, lines[0] if lines else "")
"""

# The canary: a server of its own that answers every GET with its name.
CANARY_CODE = """
import http.server, socket
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = f"canary {socket.gethostname()}\\n".encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("", 8080), H).serve_forever()
"""
CANARY_CALLS = 6  # each way, after the route is served: every one must go where the route says
DENIED_BODY = "RBAC: access denied"  # Envoy's own 403 body


def request(cluster, ns: str, url: str, *headers: str) -> str:
    return cluster.exec(ns, "client", "python3", "-c", REQUEST_CODE, url, *headers, timeout=30).strip()


def canary(cluster, ns: str) -> None:
    """Pod `server-canary` (the canary server) behind Service `server-canary`."""
    cluster.apply(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "List",
                "items": [
                    {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "metadata": {
                            "name": "server-canary",
                            "namespace": ns,
                            "labels": {"app": "server-canary"},
                        },
                        "spec": {
                            "serviceAccountName": "server",
                            "terminationGracePeriodSeconds": 1,
                            "containers": [
                                {
                                    "name": "main",
                                    "image": cluster.image,
                                    "imagePullPolicy": "IfNotPresent",
                                    "command": ["python3", "-c", CANARY_CODE],
                                    "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1},
                                }
                            ],
                        },
                    },
                    {
                        "apiVersion": "v1",
                        "kind": "Service",
                        "metadata": {"name": "server-canary", "namespace": ns},
                        "spec": {
                            "selector": {"app": "server-canary"},
                            "ports": [{"name": "http", "port": 80, "targetPort": 8080}],
                        },
                    },
                ],
            }
        )
    )
    cluster.running(ns, "server-canary")


def test_a_header_routes_to_the_canary_through_the_waypoint(cluster, waypointed):
    """An HTTPRoute on Service `server`: `x-canary: true` goes to `server-canary`, the rest to
    `server`; the waypoint's Envoy routes each request by its header."""
    ns, url = waypointed
    canary(cluster, ns)
    route = {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": "canary", "namespace": ns},
        "spec": {
            "parentRefs": [{"group": "", "kind": "Service", "name": "server", "port": 80}],
            "rules": [
                {
                    "matches": [{"headers": [{"name": "x-canary", "value": "true"}]}],
                    "backendRefs": [{"name": "server-canary", "port": 80}],
                },
                {"backendRefs": [{"name": "server", "port": 80}]},
            ],
        },
    }
    cluster.apply(json.dumps(route))
    try:
        wait_for(
            lambda: (
                (out := request(cluster, ns, url, "x-canary:true")).startswith("200 istio-envoy canary")
                and out
            ),
            "the canary route served by the waypoint",
            120,
        )
        with_header = [request(cluster, ns, url, "x-canary:true") for _ in range(CANARY_CALLS)]
        without = [request(cluster, ns, url, "x-canary:false") for _ in range(CANARY_CALLS)]
    finally:
        cluster.kubectl("delete", "httproute", "-n", ns, "canary", "--ignore-not-found")
    assert all(out == "200 istio-envoy canary server-canary" for out in with_header), with_header
    assert all(out.startswith("200 istio-envoy") and "canary" not in out for out in without), without
    print(
        f"\nHTTPRoute canary: {CANARY_CALLS}/{CANARY_CALLS} with x-canary: true answered by "
        f"server-canary, {CANARY_CALLS}/{CANARY_CALLS} without by server ({without[0]!r})"
    )
    wait_for(
        lambda: (
            "canary" not in (out := request(cluster, ns, url, "x-canary:true"))
            and out.startswith("200")
            and out
        ),
        "the route removed: the header no longer routes",
        120,
    )


def test_an_l7_deny_is_answered_403_by_the_waypoint(cluster, waypointed):
    """An AuthorizationPolicy bound to the waypoint (targetRefs) denies a path: the waypoint's
    Envoy answers 403 itself; other paths are served."""
    ns, url = waypointed
    policy = {
        "apiVersion": "security.istio.io/v1",
        "kind": "AuthorizationPolicy",
        "metadata": {"name": "deny-admin", "namespace": ns},
        "spec": {
            "targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "waypoint"}],
            "action": "DENY",
            "rules": [{"to": [{"operation": {"paths": ["/admin", "/admin/*"]}}]}],
        },
    }
    admin = url + "admin/users"
    cluster.apply(json.dumps(policy))
    try:
        answer = wait_for(
            lambda: (out := request(cluster, ns, admin)).startswith("403") and out,
            "the DENY served by the waypoint",
            120,
        )
        others = [request(cluster, ns, url) for _ in range(3)]
        again = request(cluster, ns, url + "admin")
    finally:
        cluster.kubectl("delete", "authorizationpolicy", "-n", ns, "deny-admin", "--ignore-not-found")
    assert answer == f"403 istio-envoy {DENIED_BODY}", answer
    assert again == f"403 istio-envoy {DENIED_BODY}", again
    assert all(out.startswith("200 istio-envoy") for out in others), others
    print(f"\nDENY /admin, /admin/*: GET {admin}: {answer!r}; GET {url}: {others[0]!r}")
    # removed: the path reaches the server (http.server's own 404 for a file it lacks)
    wait_for(
        lambda: (out := request(cluster, ns, admin)).startswith("404") and out,
        "the DENY removed: the server answers /admin/users",
        120,
    )


def waypoint_requests(cluster, ns: str) -> dict[tuple[str, str, str], float]:
    """istio_requests_total from the waypoint pod's 15020, by (source workload, destination
    service name, response code), reporter waypoint only."""
    import re
    import urllib.request

    (pod,) = waypoint_pods(cluster, ns)
    with urllib.request.urlopen(f"http://{pod['status']['podIP']}:15020/stats/prometheus", timeout=5) as r:
        text = r.read().decode()
    series = re.compile(r"^istio_requests_total\{(.*)\} (\S+)$")
    label = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
    out: dict[tuple[str, str, str], float] = {}
    for line in text.splitlines():
        m = series.match(line)
        if not m:
            continue
        labels = dict(label.findall(m.group(1)))
        if labels.get("reporter") != "waypoint":
            continue
        key = (
            f"{labels.get('source_workload_namespace')}/{labels.get('source_workload')}",
            labels.get("destination_service_name", ""),
            labels.get("response_code", ""),
        )
        out[key] = out.get(key, 0) + float(m.group(2))
    return out


def test_the_waypoint_pod_serves_istios_http_metrics(cluster, waypointed):
    """The requests of the tests above, counted by the waypoint pod on 15020 as Istio's
    `istio_requests_total` (reporter waypoint): the client's 200s to server and server-canary,
    and its 403s."""
    ns, _ = waypointed
    client = f"{ns}/client"
    wanted = [(client, "server", "200"), (client, "server-canary", "200")]

    def counted():
        table = waypoint_requests(cluster, ns)
        denied = sum(n for (src, _, code), n in table.items() if src == client and code == "403")
        # a 403 counted under whatever destination service the waypoint names for a denied request
        return table if denied > 0 and all(table.get(k, 0) > 0 for k in wanted) else None

    try:
        table = wait_for(counted, "the waypoint's istio_requests_total for 200, canary 200 and 403", 30)
    except AssertionError:
        raise AssertionError(
            f"waypoint metrics lack {wanted} or a 403: {waypoint_requests(cluster, ns)}"
        ) from None
    print("\nistio_requests_total (reporter waypoint):")
    for (src, dst, code), n in sorted(table.items()):
        print(f"  {src:30} -> {dst:15} {code}: {int(n)}")


def test_deleting_the_waypoint_pod_interrupts_traffic_briefly(cluster, waypointed):
    ns, url = waypointed
    (old,) = waypoint_pods(cluster, ns)
    probe = subprocess.Popen(
        ["kubectl", "exec", "-n", ns, "client", "--", "python3", "-c", PROBE_CODE, url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "KUBECONFIG": str(KUBECONFIG)},
    )
    try:
        wait_for(lambda: probe.poll() is None, "the probe running", 10)
        import time

        time.sleep(2)  # some successes first
        cluster.kubectl("delete", "pod", "-n", ns, old["metadata"]["name"], "--wait=false")
        stdout, stderr = probe.communicate(timeout=PROBE_DURATION_S + 30)
    finally:
        if probe.poll() is None:
            probe.kill()
            probe.communicate()
    lines = stdout.splitlines()
    assert lines, stderr
    (new,) = waypoint_pods(cluster, ns)
    if lines[-1].endswith("fail"):
        logs = cluster.kubectl("logs", "-n", ns, new["metadata"]["name"], "--tail=40", check=False)
        raise AssertionError(f"traffic did not come back through {new['metadata']['name']}:\n{logs}")
    gap, failed = longest_gap(lines)
    assert new["metadata"]["name"] != old["metadata"]["name"]
    print(
        f"\nwaypoint pod {old['metadata']['name']} deleted, {new['metadata']['name']} took over: "
        f"{len(lines)} requests, {failed} failed, longest gap {gap:.1f}s"
    )
    assert gap < GAP_BOUND_S


def test_deleting_the_gateway_deletes_what_was_deployed(cluster, waypointed):
    ns, url = waypointed
    ambient("waypoint", "delete", "--kube", "-n", ns)

    def gone():
        out = cluster.kubectl("get", "deployment,service,serviceaccount", "-n", ns, "-o", "name", check=False)
        return not any(line.endswith("/waypoint") for line in out.splitlines())

    wait_for(gone, "the waypoint's Deployment, Service and ServiceAccount garbage-collected", 120)
    # with no waypoint, the namespace label names nothing: traffic goes straight to the server
    answer = wait_for(
        lambda: (
            (out := cluster.exec(ns, "client", "python3", "-c", GET_CODE, url).strip()).startswith("200")
            and out
        ),
        "traffic direct again",
        60,
    )
    print(f"\nGateway deleted: its objects gone; GET {url}: {answer}")
