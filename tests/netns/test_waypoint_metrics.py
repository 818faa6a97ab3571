"""Tier 3: Istio's HTTP metrics of a real waypoint, compared label for label with the traffic.

The mesh and apps are the route tests' (conftest's `rmesh`, tests/helpers/waypoint_routes.py).
Envoy sends each request's access log entry to
`ambient waypoint` (gRPC, unix socket); the agent labels it from the workloads it keeps and
serves `istio_requests_total` and the three histograms on the waypoint pod's 15020, followed by
Envoy's own statistics.
"""

from __future__ import annotations

import re
import time

from tests.helpers.waypoint_routes import request, served

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
    # The app's JSON body plus its headers (as Envoy wrote them), at least the body.
    response_bytes = series(now, "istio_response_bytes_sum")[key] - resp0
    assert len(r.body) < response_bytes < len(r.body) + 1024, (response_bytes, len(r.body))
    # Envoy's own statistics follow on the same page.
    assert "envoy_cluster_upstream_rq" in now
