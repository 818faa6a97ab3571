"""Tier 3: HTTPRoute and VirtualService through a real waypoint (Envoy 1.40, configured by
`ambient control`), one test per row of the routing fact sheet at least.

The mesh is test_waypoint_envoy's (control, client and server node proxies, the waypoint);
two more HTTP apps on the server pod (tests/netns/http_echo.py: `v1` on 8081, `v2` on 8082)
answer with what they received, behind the Services `routed` and `routed-v2`, both served by
the waypoint. Each test writes its route objects into the control plane's directory and
waits until Envoy serves them; every request goes client pod -> client node proxy -> waypoint
-> server node proxy -> app.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ambient_mesh.waypoint.envoy import DRAIN_TIME_S
from tests.helpers.waypoint_mesh import (
    WaypointMesh,
)
from tests.helpers.waypoint_routes import request, served, virtual_service

HOST = "routed.default.svc.cluster.local"


def http_route(rules: str, name: str = "r") -> str:
    return f"""
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {{name: {name}, namespace: default}}
spec:
  parentRefs: [{{group: "", kind: Service, name: routed, port: 80}}]
  rules:
{rules}
"""


def app_log(mesh: WaypointMesh, name: str) -> list[dict[str, Any]]:
    path = mesh.tmp / f"app-{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- matches -----------------------------------------------------------------------------------


def test_path_exact_prefix_and_regex(rmesh, routes):
    routes(
        http_route(
            """
  - matches: [{path: {type: Exact, value: /exact}}]
    backendRefs: [{name: routed-v2, port: 80}]
  - matches: [{path: {type: PathPrefix, value: /pre/}}]
    backendRefs: [{name: routed-v2, port: 80}]
  - matches: [{path: {type: RegularExpression, value: "/re/[0-9]+"}}]
    backendRefs: [{name: routed-v2, port: 80}]
  - backendRefs: [{name: routed, port: 80}]
"""
        )
    )
    served(rmesh, lambda: request(rmesh, "/exact").echo["name"] == "v2", "Exact path")
    assert request(rmesh, "/exact/more").echo["name"] == "v1"
    assert request(rmesh, "/pre").echo["name"] == "v2"
    assert request(rmesh, "/pre/a/b").echo["name"] == "v2"
    # Gateway API prefixes match whole path segments.
    assert request(rmesh, "/prefix").echo["name"] == "v1"
    assert request(rmesh, "/re/123").echo["name"] == "v2"
    assert request(rmesh, "/re/abc").echo["name"] == "v1"


def test_header_query_and_method_matches(rmesh, routes):
    routes(
        http_route(
            """
  - matches: [{headers: [{name: x-env, value: canary}]}]
    backendRefs: [{name: routed-v2, port: 80}]
  - matches: [{queryParams: [{name: v, value: "2"}]}]
    backendRefs: [{name: routed-v2, port: 80}]
  - matches: [{method: DELETE}]
    backendRefs: [{name: routed-v2, port: 80}]
  - backendRefs: [{name: routed, port: 80}]
"""
        )
    )
    served(rmesh, lambda: request(rmesh, headers={"X-Env": "canary"}).echo["name"] == "v2", "header match")
    assert request(rmesh, headers={"X-Env": "prod"}).echo["name"] == "v1"
    assert request(rmesh, "/q?v=2").echo["name"] == "v2"
    assert request(rmesh, "/q?v=3").echo["name"] == "v1"
    assert request(rmesh, "/m", method="DELETE").echo["name"] == "v2"
    assert request(rmesh, "/m", method="PUT").echo["name"] == "v1"


def test_weighted_backends(rmesh, routes):
    routes(
        http_route(
            "  - backendRefs: [{name: routed, port: 80, weight: 0}, {name: routed-v2, port: 80, weight: 1}]"
        )
    )
    served(rmesh, lambda: request(rmesh).echo["name"] == "v2", "all weight on v2")
    assert {request(rmesh).echo["name"] for _ in range(10)} == {"v2"}
    routes(
        http_route(
            "  - backendRefs: [{name: routed, port: 80, weight: 50}, {name: routed-v2, port: 80, weight: 50}]"
        )
    )
    seen: set[str] = set()

    def both() -> bool:
        seen.add(request(rmesh).echo.get("name", ""))
        return {"v1", "v2"} <= seen

    served(rmesh, both, "both backends at 50/50")


# -- actions -----------------------------------------------------------------------------------


def test_request_and_response_header_modifiers(rmesh, routes):
    routes(
        http_route(
            """
  - backendRefs: [{name: routed, port: 80}]
    filters:
    - type: RequestHeaderModifier
      requestHeaderModifier: {set: [{name: x-set, value: one}], add: [{name: x-add, value: two}], remove: [x-drop]}
    - type: ResponseHeaderModifier
      responseHeaderModifier: {set: [{name: x-resp, value: three}], remove: [content-type]}
"""
        )
    )
    r = served(
        rmesh,
        lambda: (lambda r: r if r.headers.get("x-resp") == "three" else None)(
            request(rmesh, headers={"x-set": "old", "x-add": "first", "x-drop": "gone"})
        ),
        "header modifiers",
    )
    sent = r.echo["headers"]
    assert sent["x-set"] == "one"
    assert sent["x-add"] == "first,two"
    assert "x-drop" not in sent
    assert "content-type" not in r.headers


def test_request_redirect(rmesh, routes):
    routes(
        http_route(
            """
  - matches: [{path: {type: PathPrefix, value: /old}}]
    filters: [{type: RequestRedirect, requestRedirect: {scheme: https, hostname: new.example, statusCode: 301, path: {type: ReplacePrefixMatch, replacePrefixMatch: /new}}}]
  - backendRefs: [{name: routed, port: 80}]
"""
        )
    )
    r = served(
        rmesh, lambda: (lambda r: r if r.status == 301 else None)(request(rmesh, "/old/page")), "redirect"
    )
    assert r.headers["location"] == "https://new.example/new/page"


def test_url_rewrite_prefix_full_path_and_hostname(rmesh, routes):
    routes(
        http_route(
            """
  - matches: [{path: {type: PathPrefix, value: /v1}}]
    backendRefs: [{name: routed, port: 80}]
    filters: [{type: URLRewrite, urlRewrite: {hostname: rewritten.example, path: {type: ReplacePrefixMatch, replacePrefixMatch: /}}}]
  - matches: [{path: {type: PathPrefix, value: /api}}]
    backendRefs: [{name: routed, port: 80}]
    filters: [{type: URLRewrite, urlRewrite: {path: {type: ReplacePrefixMatch, replacePrefixMatch: /backend}}}]
  - matches: [{path: {type: PathPrefix, value: /full}}]
    backendRefs: [{name: routed, port: 80}]
    filters: [{type: URLRewrite, urlRewrite: {path: {type: ReplaceFullPath, replaceFullPath: /replaced}}}]
  - backendRefs: [{name: routed, port: 80}]
"""
        )
    )
    r = served(
        rmesh,
        lambda: (lambda r: r if r.echo["path"] == "/items/7" else None)(request(rmesh, "/v1/items/7")),
        "prefix rewrite to /",
    )
    assert r.echo["headers"]["host"] == "rewritten.example"
    assert r.echo["headers"]["x-envoy-original-path"] == "/v1/items/7"
    assert request(rmesh, "/api/x").echo["path"] == "/backend/x"
    assert request(rmesh, "/full/a/b").echo["path"] == "/replaced"


def test_request_mirror(rmesh, routes):
    routes(
        http_route(
            """
  - backendRefs: [{name: routed, port: 80}]
    filters: [{type: RequestMirror, requestMirror: {backendRef: {name: routed-v2, port: 80}}}]
"""
        )
    )
    marker = f"/mirrored/{time.monotonic_ns()}"

    def mirrored() -> bool:
        assert request(rmesh, marker).echo["name"] == "v1"
        return any(e["path"] == marker for e in app_log(rmesh, "v2"))

    served(rmesh, mirrored, "the mirrored copy at v2")
    copy = next(e for e in app_log(rmesh, "v2") if e["path"] == marker)
    assert copy["headers"]["host"].endswith("-shadow")


def test_request_timeout_and_retries(rmesh, routes):
    routes(
        http_route(
            """
  - matches: [{path: {type: PathPrefix, value: /delay}}]
    backendRefs: [{name: routed, port: 80}]
    timeouts: {request: 300ms}
  - matches: [{path: {type: PathPrefix, value: /flaky}}]
    backendRefs: [{name: routed, port: 80}]
    retry: {attempts: 3, codes: [503]}
  - backendRefs: [{name: routed, port: 80}]
"""
        )
    )
    served(rmesh, lambda: request(rmesh, "/delay/2000").status == 504, "the request timeout")
    key = f"k{time.monotonic_ns()}"
    r = request(rmesh, f"/flaky/{key}/2")
    assert r.status == 200, r
    assert sum(e["path"] == f"/flaky/{key}/2" for e in app_log(rmesh, "v1")) == 3


def test_no_backend_answers_500(rmesh, routes):
    routes(
        http_route(
            "  - matches: [{path: {type: PathPrefix, value: /none}}]\n  - backendRefs: [{name: routed, port: 80}]"
        )
    )
    served(rmesh, lambda: request(rmesh, "/none").status == 500, "500 without a backend")


# -- VirtualService ----------------------------------------------------------------------------


def test_virtual_service_direct_response_and_fault(rmesh, routes):
    routes(
        virtual_service(
            """
  - match: [{uri: {exact: /tea}}]
    directResponse: {status: 418, body: {string: "short and stout"}}
  - match: [{uri: {prefix: /abort}}]
    fault: {abort: {httpStatus: 503, percentage: {value: 100}}}
    route: [{destination: {host: routed}}]
  - match: [{uri: {prefix: /slow}}]
    fault: {delay: {fixedDelay: 400ms, percentage: {value: 100}}}
    route: [{destination: {host: routed}}]
  - route: [{destination: {host: routed}}]
"""
        )
    )
    r = served(
        rmesh, lambda: (lambda r: r if r.status == 418 else None)(request(rmesh, "/tea")), "direct response"
    )
    assert r.body == b"short and stout"
    r = request(rmesh, "/abort")
    assert r.status == 503 and b"fault filter abort" in r.body, r
    start = time.monotonic()
    assert request(rmesh, "/slow").echo["path"] == "/slow"
    # Envoy's 400 ms timer against our clock: a few ms early is still the delay (an undelayed
    # request here takes a few ms).
    assert time.monotonic() - start >= 0.35


def test_virtual_service_cors_headers_retries_and_timeout(rmesh, routes):
    routes(
        virtual_service(
            """
  - match: [{uri: {prefix: /delay}}]
    timeout: 300ms
    route: [{destination: {host: routed}}]
  - match: [{uri: {prefix: /flaky}}]
    retries: {attempts: 2, retryOn: "503"}
    route: [{destination: {host: routed}}]
  - corsPolicy: {allowOrigins: [{exact: "https://a.example"}], allowMethods: [GET, POST], maxAge: 1h}
    headers: {request: {set: {x-vs: "1"}}, response: {add: {x-vs-resp: "2"}}}
    route: [{destination: {host: routed}, weight: 100, headers: {request: {set: {x-dest: v1}}}}]
"""
        )
    )
    preflight = {"Origin": "https://a.example", "Access-Control-Request-Method": "POST"}
    r = served(
        rmesh,
        lambda: (lambda r: r if "access-control-allow-origin" in r.headers else None)(
            request(rmesh, "/c", method="OPTIONS", headers=preflight)
        ),
        "CORS preflight",
    )
    assert r.headers["access-control-allow-origin"] == "https://a.example"
    assert r.headers["access-control-allow-methods"] == "GET,POST"
    assert r.headers["access-control-max-age"] == "3600"
    other = request(rmesh, "/c", method="OPTIONS", headers={**preflight, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers
    r = request(rmesh, "/h")
    assert r.echo["headers"]["x-vs"] == "1" and r.echo["headers"]["x-dest"] == "v1"
    assert r.headers["x-vs-resp"] == "2"
    assert request(rmesh, "/delay/2000").status == 504
    key = f"k{time.monotonic_ns()}"
    assert request(rmesh, f"/flaky/{key}/2").status == 200
    assert sum(e["path"] == f"/flaky/{key}/2" for e in app_log(rmesh, "v1")) == 3


def test_virtual_service_uri_rewrite_redirect_and_source_labels(rmesh, routes):
    routes(
        virtual_service(
            """
  - match: [{sourceLabels: {app: client}}]
    route: [{destination: {host: routed-v2}}]
  - match: [{uri: {prefix: /go}}]
    redirect: {uri: /gone, authority: other.example}
  - match: [{uri: {prefix: /old/}}]
    rewrite: {uri: /new/, authority: rewritten.example}
    route: [{destination: {host: routed}}]
  - route: [{destination: {host: routed}}]
"""
        )
    )
    r = served(rmesh, lambda: (lambda r: r if r.status == 301 else None)(request(rmesh, "/go")), "redirect")
    assert r.headers["location"] == "http://other.example/gone"
    r = request(rmesh, "/old/x")
    assert r.echo["path"] == "/new/x" and r.echo["headers"]["host"] == "rewritten.example"
    # The sourceLabels match is dropped (a waypoint cannot honour it): nothing goes to v2.
    assert request(rmesh, "/any").echo["name"] == "v1"


# -- changes under load ------------------------------------------------------------------------

CHANGE_ROUNDS = 6
CHANGE_DEADLINE_S = 60.0
REQUESTS_PER_ROUND = 4  # the load's requests each configuration sees at least


def test_a_request_in_flight_outlives_a_change_of_its_services_routes(rmesh, routes):
    """A request still running when its service's routes change is answered: the routes come
    over RDS, so the change leaves the service's filter chain, and the connections on it, as
    they are. (Inline routes made it a new chain, and Envoy closed the old chain's connections
    when its drain ended: this request was cut after about 6 s.)"""
    import threading

    delay_ms = (DRAIN_TIME_S + 3) * 1000
    answered: dict[str, Any] = {}

    def long_request() -> None:
        try:
            r = request(rmesh, f"/delay/{delay_ms}")
            answered["status"] = r.status
        except OSError as e:
            answered["status"] = repr(e)

    thread = threading.Thread(target=long_request, daemon=True)
    thread.start()
    time.sleep(1.0)  # the request is with the app
    routes(
        http_route(
            "  - matches: [{headers: [{name: x-version, value: v2}]}]\n"
            "    backendRefs: [{name: routed-v2, port: 80}]\n"
            "  - backendRefs: [{name: routed, port: 80}]"
        )
    )
    served(
        rmesh,
        lambda: request(rmesh, "/probe", headers={"x-version": "v2"}).echo["name"] == "v2",
        "the changed route",
    )
    thread.join(delay_ms / 1000 + 10)
    assert answered.get("status") == 200, answered


def test_route_and_policy_changes_while_requests_flow(rmesh, routes):
    """Requests flow while the routes and an L7 policy change back and forth; each request is
    one that both the old and the new configuration serve (200), so none may fail."""
    import threading

    to_v2 = http_route("  - backendRefs: [{name: routed-v2, port: 80}]")
    to_v1 = http_route(
        "  - backendRefs: [{name: routed, port: 80, weight: 1}, {name: routed-v2, port: 80, weight: 0}]"
    )
    deny_other = """
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: deny-other, namespace: default}
spec:
  targetRefs: [{group: gateway.networking.k8s.io, kind: Gateway, name: waypoint}]
  action: DENY
  rules: [{to: [{operation: {paths: [/other]}}]}]
"""
    stop = threading.Event()
    results: list[tuple[int, str]] = []

    def load() -> None:
        deadline = time.monotonic() + CHANGE_DEADLINE_S
        while not stop.is_set() and time.monotonic() < deadline and len(results) < 5000:
            try:
                r = request(rmesh, "/flow")
                results.append((r.status, r.echo.get("name", "")))
            except OSError as e:
                results.append((0, repr(e)))

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    try:
        for i in range(CHANGE_ROUNDS):
            routes(to_v2 if i % 2 == 0 else to_v1)
            routes(deny_other if i % 2 == 0 else "", "policy.yaml")
            want = "v2" if i % 2 == 0 else "v1"
            served(rmesh, lambda want=want: request(rmesh, "/probe").echo["name"] == want, f"round {i}")
            # Some of the load in every configuration, however fast the change was served.
            before = len(results)
            served(rmesh, lambda before=before: len(results) >= before + REQUESTS_PER_ROUND, f"load {i}")
    finally:
        stop.set()
        thread.join(timeout=CHANGE_DEADLINE_S)
    failures = [r for r in results if r[0] != 200]
    names = {name for _, name in results}
    assert len(results) >= CHANGE_ROUNDS * REQUESTS_PER_ROUND, f"only {len(results)} requests ran"
    assert not failures, f"{len(failures)} of {len(results)} failed: {failures[:5]}"
    assert {"v1", "v2"} <= names, names
    print(f"{len(results)} requests across {CHANGE_ROUNDS} route and policy changes, none failed")
