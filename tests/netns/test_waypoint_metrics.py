"""Tier 3: Istio's HTTP metrics of a real waypoint, compared label for label with the traffic.

The mesh and apps are the route tests' (conftest's `rmesh`, tests/helpers/waypoint_routes.py).
Envoy sends each request's access log entry to
`ambient waypoint` (gRPC, unix socket); the agent labels it from the workloads it keeps and
serves `istio_requests_total` and the three histograms on the waypoint pod's 15020, followed by
Envoy's own statistics. Requests Envoy answers itself (a 403 by policy, a direct response, a
fault abort) are counted with the labels Istio's waypoint gives them.
"""

from __future__ import annotations

import re
import time

from tests.helpers.waypoint_routes import request, served, virtual_service

_SERIES = re.compile(r"^(\w+)\{(.*)\} (\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape(mesh, get) -> str:  # type: ignore[no-untyped-def]
    status, body = get(mesh.waypoint.netns, "127.0.0.1", 15020, "/stats/prometheus")
    assert status == 200
    return body.decode()


def series(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for line in text.splitlines():
        m = _SERIES.match(line)
        if m and m.group(1) == name:
            out[tuple(_LABEL.findall(m.group(2)))] = float(m.group(3))
    return out


def expected(code: int, flags: str = "-") -> dict[str, str]:
    return {
        "reporter": "waypoint",
        "source_workload": "client",
        "source_workload_namespace": "default",
        "source_principal": "spiffe://cluster.local/ns/default/sa/client",
        "source_app": "client",
        "source_version": "latest",
        "source_canonical_service": "client",
        "source_canonical_revision": "latest",
        "source_cluster": "Kubernetes",
        "destination_workload": "server",
        "destination_workload_namespace": "default",
        "destination_principal": "spiffe://cluster.local/ns/default/sa/server",
        "destination_app": "server",
        "destination_version": "latest",
        "destination_service": "routed.default.svc.cluster.local",
        "destination_service_name": "routed",
        "destination_service_namespace": "default",
        "destination_canonical_service": "server",
        "destination_canonical_revision": "latest",
        "destination_cluster": "Kubernetes",
        "request_protocol": "http",
        "response_flags": flags,
        "connection_security_policy": "mutual_tls",
        "response_code": str(code),
        "grpc_response_status": "",
    }


# The labels Istio's waypoint gives a request it answers itself (no upstream host was picked, so
# no endpoint's workload): every destination workload label `unknown`; the destination service
# is the route's cluster's when the route has one, `unknown` when it has none (a direct
# response: the host header fallback is off for waypoints).
NO_ENDPOINT = {
    "destination_workload": "unknown",
    "destination_workload_namespace": "unknown",
    "destination_principal": "unknown",
    "destination_app": "unknown",
    "destination_version": "unknown",
    "destination_canonical_service": "unknown",
    "destination_canonical_revision": "unknown",
    "destination_cluster": "unknown",
}
NO_SERVICE = {
    "destination_service": "unknown",
    "destination_service_name": "unknown",
    "destination_service_namespace": "unknown",
}


def settled(mesh, get) -> str:  # type: ignore[no-untyped-def]
    """A scrape after Envoy flushed what earlier requests logged (its buffer flushes every
    0.25 s): two scrapes a second apart that agree."""
    previous = scrape(mesh, get)
    for _ in range(10):
        time.sleep(1.0)
        now = scrape(mesh, get)
        if series(now, "istio_requests_total") == series(previous, "istio_requests_total"):
            return now
        previous = now
    return previous


def test_requests_are_counted_with_istios_labels(rmesh, get):
    before = series(settled(rmesh, get), "istio_requests_total")
    sent = {200: 7, 503: 3, 404: 2}
    for code, n in sent.items():
        for _ in range(n):
            path = "/ok" if code == 200 else f"/status/{code}"
            assert request(rmesh, path).status == code

    def counted():  # type: ignore[no-untyped-def]
        now = series(scrape(rmesh, get), "istio_requests_total")
        got = {}
        for key, value in now.items():
            labels = dict(key)
            if labels.get("destination_service_name") != "routed":
                continue
            delta = value - before.get(key, 0)
            if delta:
                got[key] = delta
        want = {tuple(expected(code).items()): float(n) for code, n in sent.items()}
        # A 503 from the app is retried by istiod's default policy only on connect failures,
        # so each request is one entry.
        assert got == want, f"got {got}"
        return now

    served(rmesh, counted, "the metrics of the requests sent", timeout_s=15)


def test_durations_and_bytes_are_histograms_of_the_traffic(rmesh, get):
    key = tuple(expected(200).items())
    text = settled(rmesh, get)
    count0 = series(text, "istio_request_duration_milliseconds_count").get(key, 0)
    sum0 = series(text, "istio_request_duration_milliseconds_sum").get(key, 0)
    resp0 = series(text, "istio_response_bytes_sum").get(key, 0)
    req0 = series(text, "istio_request_bytes_sum").get(key, 0)
    start = time.monotonic()
    r = request(rmesh, "/delay/300")
    took_ms = (time.monotonic() - start) * 1000
    assert r.status == 200

    def observed():  # type: ignore[no-untyped-def]
        now = scrape(rmesh, get)
        count = series(now, "istio_request_duration_milliseconds_count").get(key, 0)
        assert count == count0 + 1
        return now

    now = served(rmesh, observed, "the delayed request's duration", timeout_s=15)
    duration = series(now, "istio_request_duration_milliseconds_sum")[key] - sum0
    assert 300 <= duration <= took_ms + 5, (duration, took_ms)
    # Bytes on the wire, as Istio counts them: the request the client wrote and the response it
    # read, exactly (the tunnel carries them unchanged).
    response_bytes = series(now, "istio_response_bytes_sum")[key] - resp0
    request_bytes = series(now, "istio_request_bytes_sum")[key] - req0
    assert (request_bytes, response_bytes) == (r.sent, r.received), (len(r.body), r.headers)
    # Envoy's own statistics follow on the same page.
    assert "envoy_cluster_upstream_rq" in now


def counted_as(mesh, get, send, want: dict[str, str], n: int) -> None:  # type: ignore[no-untyped-def]
    """`send()` n times; the client's series with `want`'s response code grew by n, and
    that series has exactly `want`'s labels (label for label; no other series of the code grew)."""
    before = series(settled(mesh, get), "istio_requests_total")
    for _ in range(n):
        send()

    wanted = {tuple(want.items()): float(n)}
    got: dict[tuple[tuple[str, str], ...], float] = {}
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        got = {}
        for key, value in series(scrape(mesh, get), "istio_requests_total").items():
            labels = dict(key)
            if labels["source_workload"] != "client" or labels["response_code"] != want["response_code"]:
                continue
            if value - before.get(key, 0):
                got[key] = value - before.get(key, 0)
        if got == wanted:
            return
        time.sleep(0.3)
    assert [dict(k) for k in got] == [want], f"counts {list(got.values())}, want {n}"
    assert got == wanted


def test_a_policy_denial_is_counted_with_its_service_and_no_workload(rmesh, get, routes):
    routes(
        """
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: deny-admin, namespace: default}
spec:
  targetRefs: [{group: gateway.networking.k8s.io, kind: Gateway, name: waypoint}]
  action: DENY
  rules: [{to: [{operation: {paths: [/admin]}}]}]
"""
    )
    served(rmesh, lambda: request(rmesh, "/admin").status == 403, "the DENY policy")

    def send() -> None:
        r = request(rmesh, "/admin")
        assert r.status == 403 and r.body == b"RBAC: access denied", r

    # Envoy's RBAC filter answers without a response flag (UAEX is ext_authz's).
    counted_as(rmesh, get, send, {**expected(403), **NO_ENDPOINT}, 3)


def test_a_direct_response_is_counted_with_no_service(rmesh, get, routes):
    routes(
        virtual_service(
            """
  - match: [{uri: {exact: /tea}}]
    directResponse: {status: 418, body: {string: "short and stout"}}
  - route: [{destination: {host: routed}}]
"""
        )
    )
    served(rmesh, lambda: request(rmesh, "/tea").status == 418, "the direct response")

    def send() -> None:
        assert request(rmesh, "/tea").status == 418

    counted_as(rmesh, get, send, {**expected(418), **NO_ENDPOINT, **NO_SERVICE}, 2)


def test_fault_abort_and_delay_carry_envoys_flags(rmesh, get, routes):
    routes(
        virtual_service(
            """
  - match: [{uri: {prefix: /abort}}]
    fault: {abort: {httpStatus: 429, percentage: {value: 100}}}
    route: [{destination: {host: routed}}]
  - match: [{uri: {prefix: /slow}}]
    fault: {delay: {fixedDelay: 50ms, percentage: {value: 100}}}
    route: [{destination: {host: routed}}]
  - route: [{destination: {host: routed}}]
"""
        )
    )
    served(rmesh, lambda: request(rmesh, "/abort").status == 429, "the fault abort")

    def abort() -> None:
        r = request(rmesh, "/abort")
        assert r.status == 429 and b"fault filter abort" in r.body, r

    counted_as(rmesh, get, abort, {**expected(429, "FI"), **NO_ENDPOINT}, 2)
    # A delayed request still reaches the app: its endpoint's workload, and `DI`.
    counted_as(rmesh, get, lambda: request(rmesh, "/slow/x"), expected(200, "DI"), 2)


def test_grpc_requests_carry_their_grpc_status(rmesh, get, routes):
    # Requests with gRPC's content type are `request_protocol="grpc"` with a
    # `grpc_response_status`: the one Envoy's own reply to a gRPC request carries in its headers
    # (a fault abort of 503 is UNAVAILABLE, 14, in a 200), and for an app that gives none, the
    # one its HTTP status stands for (200: UNKNOWN, 2), as Istio's stats filter reads them.
    routes(
        virtual_service(
            """
  - match: [{uri: {prefix: /grpc-abort}}]
    fault: {abort: {httpStatus: 503, percentage: {value: 100}}}
    route: [{destination: {host: routed}}]
  - route: [{destination: {host: routed}}]
"""
        )
    )
    grpc = {"content-type": "application/grpc"}

    def aborted() -> bool:
        r = request(rmesh, "/grpc-abort", headers=grpc)
        assert r.status == 200 and r.headers.get("grpc-status") == "14", r
        return True

    served(rmesh, aborted, "the fault abort of a gRPC request")
    as_grpc = {"request_protocol": "grpc"}
    counted_as(
        rmesh,
        get,
        aborted,
        {**expected(200, "FI"), **NO_ENDPOINT, **as_grpc, "grpc_response_status": "14"},
        2,
    )
    counted_as(
        rmesh,
        get,
        lambda: request(rmesh, "/plain", headers=grpc),
        {**expected(200), **as_grpc, "grpc_response_status": "2"},
        2,
    )
