"""`ambient demo`: a guided tour of the lab, checking every step it shows.

Counterpart: Istio's ambient "getting started" (deploy sample apps, add them to the mesh, look at
the telemetry, apply an AuthorizationPolicy, enforce mTLS), on the lab (lab/): two nodes, each
with its node agent and node proxy as their own processes, the default topology (lab/topofile.py:
`shop` in the mesh with a sleep-style client and an HTTP echo service with two replicas on
different nodes; `legacy` outside the mesh with a client of its own).

The tour: start the lab; call an echo replica on the client's node and one on the other node
(curl, inside the client pod; the destination node proxy's access log names the client's SPIFFE
identity); call the Service by name (DNS answered by the node proxy's DNS proxy, the ClusterIP
balanced by the node proxy); print who talked to whom from the node proxies' metrics, with both
identities; apply a DENY policy and see the call refused, delete it and see it pass; show the
`legacy` client reaching the Service in plaintext (the lab's DNS and kube-proxy DNAT), apply
STRICT mTLS and see it refused while the mesh client still passes, delete it and see the legacy
client pass again; then the L7 layer: create a waypoint for `shop`'s Services (the Gateway
`ambient waypoint apply -n shop --enroll-namespace` writes, and the namespace label) with its pod
and Service (what `ambient control` deploys for it, as istiod does), call the Service and see the waypoint's Envoy
answer and the destination proxy see the waypoint's identity; at L7, a Service for a canary and an
HTTPRoute that sends `x-canary: true` to it, a DENY of /admin bound to the waypoint (its Envoy
answers 403), a VirtualService whose /maintenance route is a directResponse, each removed again,
and the table of Istio's HTTP metrics read from the waypoint pod (who called whom through it, by
response code); remove the waypoint and see the call go straight to the replica again; stop the
lab. Each step is checked; the exit status is non-zero when any
step did not behave as shown. Manifests go through the same path as `ambient lab apply`.
"""

from __future__ import annotations

import functools
import http.client
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import yaml
from prometheus_client.parser import text_string_to_metric_families

from .errors import AmbientError
from .lab import apply as manifests
from .lab.journal import leftover_namespaces
from .lab.lab import APP_PORT, Lab, LabConfig, http_get
from .lab.topofile import DEFAULT_TOPOLOGY, parse_topology
from .ports import STATS_PORT
from .waypointctl import waypoint_gateway
from .ztunnel_config import Table, render_tables

CLIENT = "shop/client"
LEGACY = "legacy/client"
ECHO_PORT = APP_PORT  # the lab's echo app
SERVICE_URL = "http://echo/"  # short name: the pod's search path makes it echo.shop.svc.cluster.local
LEGACY_SERVICE_URL = "http://echo.shop/"
CURL_TIMEOUT_S = 3
POLICY_TIMEOUT_S = 15.0  # the control plane reads the change and pushes it; the proxies apply it
ACCESS_LOG_TIMEOUT_S = 5.0
POLL_S = 0.2
REPLICAS = ("shop/echo-1", "shop/echo-2")  # echo-1 on the client's node, echo-2 on the other
REPLICA_CHECKS = 3  # calls after the first with the wanted outcome, each of which must agree
MAX_SERVICE_CALLS = 20  # until both replicas answered: with random picks, 20 miss one at 2^-19
TRUST_DOMAIN = "cluster.local"

DENY_POLICY = """\
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata:
  name: deny-client
  namespace: shop
spec:
  selector:
    matchLabels: {app: echo}
  action: DENY
  rules:
  - from:
    - source:
        principals: ["cluster.local/ns/shop/sa/client"]
"""

WAYPOINT = "waypoint"
WAYPOINT_POD = "shop/waypoint-0"
WAYPOINT_READY_TIMEOUT_S = 30.0
ENVOY_SERVER = "istio-envoy"  # the Server header the waypoint's HTTP connection manager sets
CANARY_POD = "shop/echo-canary"
L7_CALLS = 6  # calls each way once a route or policy is served: every one must agree
METRICS_TIMEOUT_S = 5.0  # Envoy hands its access log entries to the agent every 0.25 s
DENIED_BODY = "RBAC: access denied"  # Envoy's own body for an RBAC 403
MAINTENANCE_BODY = "shop closed for maintenance"

# The canary runs from the start (the lab's pods are its topology's), in no Service until the
# canary step applies its own.
CANARY_POD_OBJECT = """\
apiVersion: v1
kind: Pod
metadata: {name: echo-canary, namespace: shop, labels: {app: echo-canary, version: v2}}
spec:
  nodeName: node-2
  serviceAccountName: echo
  containers: [{name: app, image: ambient-lab/echo, ports: [{containerPort: 8080}]}]
"""

CANARY = """\
apiVersion: v1
kind: Service
metadata: {name: echo-canary, namespace: shop}
spec:
  selector: {app: echo-canary}
  ports: [{name: http, port: 80, targetPort: 8080}]
"""

CANARY_ROUTE = """\
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: echo-canary, namespace: shop}
spec:
  parentRefs: [{group: "", kind: Service, name: echo, port: 80}]
  rules:
  - matches: [{headers: [{name: x-canary, value: "true"}]}]
    backendRefs: [{name: echo-canary, port: 80}]
  - backendRefs: [{name: echo, port: 80}]
"""

DENY_ADMIN = f"""\
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: deny-admin, namespace: shop}}
spec:
  targetRefs: [{{group: gateway.networking.k8s.io, kind: Gateway, name: {WAYPOINT}}}]
  action: DENY
  rules: [{{to: [{{operation: {{paths: [/admin, /admin/*]}}}}]}}]
"""

MAINTENANCE = f"""\
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {{name: echo-maintenance, namespace: shop}}
spec:
  hosts: [echo]
  http:
  - match: [{{uri: {{prefix: /maintenance}}}}]
    directResponse: {{status: 503, body: {{string: {MAINTENANCE_BODY}}}}}
  - route: [{{destination: {{host: echo}}}}]
"""


def shop_namespace(waypoint: str | None) -> str:
    labels = (
        "{istio.io/dataplane-mode: ambient"
        + (f", istio.io/use-waypoint: {waypoint}" if waypoint else "")
        + "}"
    )
    return f"apiVersion: v1\nkind: Namespace\nmetadata: {{name: shop, labels: {labels}}}\n"


STRICT_MTLS = """\
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata:
  name: strict
  namespace: shop
spec:
  mtls:
    mode: STRICT
"""


def spiffe(namespace: str, sa: str) -> str:
    return f"spiffe://{TRUST_DOMAIN}/ns/{namespace}/sa/{sa}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Call:
    """One curl from a pod: the HTTP status (0: no response) and which replica answered."""

    status: int
    answered_by: str
    detail: str

    @property
    def ok(self) -> bool:
        return self.status == 200


def parse_curl(stdout: str, returncode: int) -> Call:
    """curl's output with `-w '\\n%{http_code}'` appended: the echo body, then the status."""
    body, _, code = stdout.rpartition("\n")
    status = int(code) if code.isdigit() else 0
    answered = next((line.split("=", 1)[1] for line in body.splitlines() if line.startswith("Hostname=")), "")
    detail = f"HTTP {status}" if status else f"no response (curl exit {returncode})"
    return Call(status=status, answered_by=answered, detail=detail)


def curl_server(lab: Lab, pod: str, url: str) -> tuple[Call, str]:
    """A call and the response's Server header ("" when none)."""
    result = lab.exec(
        pod,
        [
            "curl",
            "-s",
            "-m",
            str(CURL_TIMEOUT_S),
            "-D",
            "/dev/stderr",
            "-o",
            "-",
            "-w",
            "\n%{http_code}",
            url,
        ],
        check=False,
    )
    server = next(
        (
            line.split(":", 1)[1].strip()
            for line in result.stderr.decode(errors="replace").splitlines()
            if line.lower().startswith("server:")
        ),
        "",
    )
    return parse_curl(result.text, result.returncode), server


@dataclass(frozen=True, slots=True, kw_only=True)
class Reply:
    """One HTTP exchange as the caller saw it: the status (0: none), the Server header, the body,
    and the replica that answered (the echo app's `Hostname=` line; "" when none did)."""

    status: int
    server: str
    body: str
    answered_by: str

    @property
    def by_waypoint(self) -> bool:
        return self.server == ENVOY_SERVER

    def __str__(self) -> str:
        who = self.answered_by or repr(self.body.strip()[:40])
        return f"{self.status or 'no response'} from {who}, Server: {self.server or '-'}"


def curl_reply(lab: Lab, pod: str, url: str, headers: tuple[str, ...] = ()) -> Reply:
    """A call with request headers (`name: value`), and everything the demo checks of its reply."""
    argv = ["curl", "-s", "-m", str(CURL_TIMEOUT_S), "-D", "/dev/stderr", "-o", "-", "-w", "\n%{http_code}"]
    for header in headers:
        argv += ["-H", header]
    result = lab.exec(pod, [*argv, url], check=False)
    server = next(
        (
            line.split(":", 1)[1].strip()
            for line in result.stderr.decode(errors="replace").splitlines()
            if line.lower().startswith("server:")
        ),
        "",
    )
    call = parse_curl(result.text, result.returncode)
    body = result.text.rpartition("\n")[0]
    return Reply(status=call.status, server=server, body=body, answered_by=call.answered_by)


def waypoint_requests(text: str) -> Table:
    """Who called whom through the waypoint, with response codes: the waypoint pod's
    `istio_requests_total` (reporter `waypoint`, Istio's labels)."""
    rows: dict[tuple[str, ...], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name != "istio_requests_total" or sample.labels.get("reporter") != "waypoint":
                continue
            labels = sample.labels
            key = (
                f"{labels.get('source_workload_namespace')}/{labels.get('source_workload')}",
                labels.get("source_principal", "unknown"),
                labels.get("destination_service_name", "unknown"),
                # A reply the waypoint made itself (a DENY, a direct response) has no endpoint.
                "unknown"
                if labels.get("destination_workload", "unknown") == "unknown"
                else f"{labels.get('destination_workload_namespace')}/{labels.get('destination_workload')}",
                labels.get("response_code", "0"),
                labels.get("response_flags", "-"),
            )
            rows[key] = rows.get(key, 0) + sample.value
    return Table(
        title="HTTP requests through the waypoint (istio_requests_total, reporter waypoint)",
        headers=("SOURCE", "SOURCE IDENTITY", "SERVICE", "DESTINATION", "CODE", "FLAGS", "REQUESTS"),
        rows=tuple((*k, str(int(v))) for k, v in sorted(rows.items())),
    )


def canary_requests(table: Table, source: str) -> int:
    """The 200s `source` got from the canary, as the waypoint counted them."""
    return sum(
        int(r[6]) for r in table.rows if r[0] == source and r[2:5] == ("echo-canary", CANARY_POD, "200")
    )


def requests_by_code(table: Table, source: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for row in table.rows:
        if row[0] == source:
            out[row[4]] = out.get(row[4], 0) + int(row[6])
    return out


def curl(lab: Lab, pod: str, url: str) -> Call:
    result = lab.exec(
        pod, ["curl", "-s", "-m", str(CURL_TIMEOUT_S), "-o", "-", "-w", "\n%{http_code}", url], check=False
    )
    return parse_curl(result.text, result.returncode)


def talked(metrics_by_node: dict[str, str]) -> Table:
    """Who talked to whom, from each node proxy's `istio_tcp_connections_opened_total` as the
    destination reported it (the side that verified the client's certificate)."""
    rows: dict[tuple[str, ...], float] = {}
    for node, text in metrics_by_node.items():
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name != "istio_tcp_connections_opened_total":
                    continue
                labels = sample.labels
                if labels.get("reporter") != "destination":
                    continue
                key = (
                    f"{labels.get('source_workload_namespace')}/{labels.get('source_workload')}",
                    labels.get("source_principal", "unknown"),
                    f"{labels.get('destination_workload_namespace')}/{labels.get('destination_workload')}",
                    labels.get("destination_principal", "unknown"),
                    node,
                    labels.get("connection_security_policy", "unknown"),
                )
                rows[key] = rows.get(key, 0) + sample.value
    return Table(
        title="who talked to whom",
        headers=(
            "SOURCE",
            "SOURCE IDENTITY",
            "DESTINATION",
            "DESTINATION IDENTITY",
            "REPORTED BY",
            "MTLS",
            "CONNS",
        ),
        rows=tuple((*k, str(int(v))) for k, v in sorted(rows.items())),
    )


def served_by_replica(reply: Reply) -> bool:
    """Routed by the waypoint to one of Service echo's replicas, which answered."""
    return reply.status == 200 and reply.by_waypoint and reply.answered_by in REPLICAS


def made_by_waypoint(status: int, body: str) -> Callable[[Reply], bool]:
    """The waypoint's Envoy answered itself: `status` with `body`, and no replica's echo."""

    def made(reply: Reply) -> bool:
        return (
            reply.status == status
            and reply.by_waypoint
            and reply.body.strip() == body
            and not reply.answered_by
        )

    return made


class Tour:
    """Runs the steps against a started lab; each step prints one PASS/FAIL line."""

    def __init__(self, lab: Lab, out: IO[str], *, verbose: bool) -> None:
        self.lab = lab
        self.out = out
        self.verbose = verbose
        self.failures: list[str] = []
        self.started = time.monotonic()
        # Replies the client got from the waypoint's Envoy, by status; and from the canary.
        self.through_envoy: Counter[str] = Counter()
        self.canary_served = 0

    def say(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def check(self, title: str, ok: bool, detail: str) -> bool:
        elapsed = time.monotonic() - self.started
        self.say(f"{'PASS' if ok else 'FAIL'}  {elapsed:5.1f}s  {title}: {detail}")
        if not ok:
            self.failures.append(title)
        return ok

    def until(
        self, predicate: Callable[[], Call], want_ok: bool, timeout_s: float = POLICY_TIMEOUT_S
    ) -> Call:
        """Call until the outcome is the wanted one (a policy takes a moment to reach the proxies)."""
        deadline = time.monotonic() + timeout_s
        while True:
            call = predicate()
            if call.ok == want_ok or time.monotonic() >= deadline:
                return call
            time.sleep(POLL_S)

    def inbound_identity(self, node: str, since: int, dst: str) -> str:
        deadline = time.monotonic() + ACCESS_LOG_TIMEOUT_S
        while time.monotonic() < deadline:
            for event in self.lab.access_log(node, since):
                if event.get("direction") == "inbound" and event.get("dst.addr") == dst:
                    return event.get("src.identity", "")
            time.sleep(POLL_S)
        return ""

    def pod_call(self, title: str, target: str) -> None:
        pod = self.lab.pods[target]
        node = pod.spec.node
        since = self.lab.proxy_log_offset(node)
        call = curl(self.lab, CLIENT, f"http://{pod.ip}:{ECHO_PORT}/")
        identity = self.inbound_identity(node, since, f"{pod.ip}:{ECHO_PORT}") if call.ok else ""
        want = spiffe("shop", "client")
        self.check(
            title,
            call.ok and call.answered_by == target and identity == want,
            f"{CLIENT} -> {target} ({pod.ip}:{ECHO_PORT}, {node}): {call.detail} from {call.answered_by or '-'}; "
            f"{node}'s proxy saw {identity or 'no inbound HBONE connection'}",
        )

    def apply(self, text: str, name: str) -> None:
        checked = manifests.check(text, name)
        for line in manifests.apply(self.lab.objects_dir, checked):
            self.say(f"      ambient lab apply -f {name}: {line}")

    def delete(self, text: str, name: str) -> None:
        lines, _ = manifests.delete(self.lab.objects_dir, manifests.check(text, name))
        for line in lines:
            self.say(f"      ambient lab delete -f {name}: {line}")

    def run(self) -> None:
        lab = self.lab
        self.pod_call("same-node call over HBONE", "shop/echo-1")
        self.pod_call("cross-node call over HBONE", "shop/echo-2")
        answered: set[str] = set()
        calls = 0
        while calls < MAX_SERVICE_CALLS and answered != {"shop/echo-1", "shop/echo-2"}:
            call = curl(lab, CLIENT, SERVICE_URL)
            calls += 1
            if call.ok:
                answered.add(call.answered_by)
        self.check(
            "call through the Service by name",
            answered == {"shop/echo-1", "shop/echo-2"},
            f"{CLIENT} -> {SERVICE_URL} (echo.shop.svc.cluster.local, DNS and VIP by the node proxy): "
            f"{calls} calls answered by {', '.join(sorted(answered)) or 'nobody'}",
        )
        metrics = {}
        for node in lab.nodes:
            try:
                status, body = lab.proxy_get(node, STATS_PORT, "/metrics")
            except (OSError, http.client.HTTPException, AmbientError):
                status, body = 0, ""
            metrics[node] = body if status == 200 else ""
        table = talked(metrics)
        self.say()
        render_tables([table], self.out)
        self.say()
        client_id = spiffe("shop", "client")
        self.check(
            "both identities in the proxies' metrics",
            any(
                r[1] == client_id and r[3] == spiffe("shop", "echo") and r[5] == "mutual_tls"
                for r in table.rows
            ),
            f"{client_id} -> {spiffe('shop', 'echo')} counted with mutual_tls",
        )

        self.apply(DENY_POLICY, "deny-client.yaml")
        refused, detail = self.every_replica(CLIENT, want_ok=False)
        self.check("DENY refuses the client at every replica", refused, detail)
        self.delete(DENY_POLICY, "deny-client.yaml")
        served, detail = self.every_replica(CLIENT, want_ok=True)
        self.check("removing it lets the client in again", served, detail)

        call = self.until(lambda: curl(lab, LEGACY, LEGACY_SERVICE_URL), want_ok=True, timeout_s=5.0)
        self.check(
            "a pod outside the mesh reaches the Service in plaintext",
            call.ok,
            f"{LEGACY} -> {LEGACY_SERVICE_URL} (lab DNS, kube-proxy DNAT): {call.detail} from {call.answered_by or '-'}",
        )
        self.apply(STRICT_MTLS, "strict.yaml")
        refused, detail = self.every_replica(LEGACY, want_ok=False)
        served, mesh_detail = self.every_replica(CLIENT, want_ok=True)
        self.check(
            "STRICT mTLS refuses the non-mesh caller at every replica, not the mesh's",
            refused and served,
            f"{detail}; {mesh_detail} (mTLS)",
        )
        self.delete(STRICT_MTLS, "strict.yaml")
        served, detail = self.every_replica(LEGACY, want_ok=True)
        self.check("removing STRICT restores plaintext at every replica", served, detail)
        self.waypoint_steps()

    def waypoint_steps(self) -> None:
        """The L7 layer: a waypoint for shop's Services, a call through it, and its removal. The
        lab's control plane deploys what istiod would for the Gateway (ServiceAccount,
        Deployment, Service); the lab's Deployment controller and kubelet run its pod."""
        gateway = yaml.safe_dump(waypoint_gateway(WAYPOINT, "shop", "service"), sort_keys=False)
        self.say("      ambient waypoint apply -n shop --enroll-namespace:")
        started = time.monotonic()
        self.apply(gateway, "waypoint.yaml")
        self.apply(shop_namespace(WAYPOINT), "namespace.yaml")
        running = self.until_waypoint_pod(present=True)
        ready_s = time.monotonic() - started
        programmed = running and self.until_programmed()
        node = self.lab.pods[WAYPOINT_POD].spec.node if running else "-"
        self.check(
            "a waypoint for shop's Services",
            programmed,
            f"Gateway shop/{WAYPOINT} (istio-waypoint) Programmed={programmed}, its pod {WAYPOINT_POD} "
            f"(Envoy) deployed by the control plane and running on {node} {ready_s:.1f}s after the "
            f"apply, namespace shop labelled istio.io/use-waypoint={WAYPOINT}",
        )
        self.through_waypoint("a call to the Service goes through the waypoint", want=True)
        self.canary_steps()
        self.deny_path_steps()
        self.direct_response_steps()
        self.waypoint_metrics_step()
        self.delete(gateway, "waypoint.yaml")
        self.apply(shop_namespace(None), "namespace.yaml")
        self.until_waypoint_pod(present=False)
        self.through_waypoint("removing the waypoint sends the call straight to a replica", want=False)

    def until_waypoint_pod(self, *, present: bool) -> bool:
        """The lab's supervisor passes (its Deployment controller, then its kubelet) until the
        waypoint's pod runs (or is gone)."""
        deadline = time.monotonic() + WAYPOINT_READY_TIMEOUT_S
        while time.monotonic() < deadline:
            self.lab.supervise()
            if (WAYPOINT_POD in self.lab.pods) == present:
                return True
            time.sleep(POLL_S)
        return False

    # -- L7: what the waypoint does with HTTP ----------------------------------------------------

    def call(self, url: str, headers: tuple[str, ...] = ()) -> Reply:
        """One call from the client; a reply the waypoint's Envoy sent is counted by status, for
        the metrics step to compare with what the waypoint counted."""
        reply = curl_reply(self.lab, CLIENT, url, headers)
        if reply.by_waypoint:
            self.through_envoy[str(reply.status)] += 1
            if reply.status == 200 and reply.answered_by == CANARY_POD:
                self.canary_served += 1
        return reply

    def replies(
        self, url: str, want: Callable[[Reply], bool], headers: tuple[str, ...] = ()
    ) -> tuple[bool, str]:
        """Call until `want` holds (a route or policy takes a moment to reach the waypoint), then
        L7_CALLS more: every one must hold too. The verdict and a line of detail."""
        deadline = time.monotonic() + POLICY_TIMEOUT_S
        while not want(first := self.call(url, headers)) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        calls = [first] + [self.call(url, headers) for _ in range(L7_CALLS)]
        good = sum(want(c) for c in calls)
        shown = " ".join(f"-H '{h}'" for h in headers)
        return good == len(calls), (
            f"{CLIENT} -> {url}{' ' + shown if shown else ''}: {good}/{len(calls)} as expected (last {calls[-1]})"
        )

    def canary_steps(self) -> None:
        """A second version, pod `echo-canary` behind its own Service, and an HTTPRoute on
        Service echo that sends `x-canary: true` to it: the waypoint picks the backend by the
        header."""
        self.apply(CANARY, "echo-canary.yaml")
        running = CANARY_POD in self.lab.pods
        self.apply(CANARY_ROUTE, "canary-route.yaml")

        def to_canary(r: Reply) -> bool:
            return r.status == 200 and r.by_waypoint and r.answered_by == CANARY_POD

        tagged, tagged_detail = self.replies(SERVICE_URL, to_canary, ("x-canary: true",))
        plain, plain_detail = self.replies(SERVICE_URL, served_by_replica, ("x-canary: false",))
        self.check(
            "a header-matched canary route (HTTPRoute)",
            running and tagged and plain,
            f"{tagged_detail}; {plain_detail}",
        )
        self.delete(CANARY_ROUTE, "canary-route.yaml")
        back, detail = self.replies(SERVICE_URL, served_by_replica, ("x-canary: true",))
        self.check("removing the route: the header picks no canary", back, detail)

    def deny_path_steps(self) -> None:
        """A DENY of /admin bound to the waypoint (targetRefs): the waypoint's Envoy answers 403
        itself; other paths reach a replica."""
        self.answered_by_waypoint(
            "a path DENY answered 403 by the waypoint (L7 AuthorizationPolicy)",
            (DENY_ADMIN, "deny-admin.yaml"),
            SERVICE_URL + "admin/users",
            made_by_waypoint(403, DENIED_BODY),
            other_url=SERVICE_URL + "cart",
            removed="removing it lets /admin through again",
        )

    def direct_response_steps(self) -> None:
        """A VirtualService whose /maintenance route is a directResponse: the waypoint answers
        it without calling any replica; the rest is routed as before."""
        self.answered_by_waypoint(
            "a directResponse from the waypoint (VirtualService)",
            (MAINTENANCE, "maintenance.yaml"),
            SERVICE_URL + "maintenance",
            made_by_waypoint(503, MAINTENANCE_BODY),
            other_url=SERVICE_URL,
            removed="removing it routes /maintenance to a replica again",
        )

    def answered_by_waypoint(
        self,
        title: str,
        manifest: tuple[str, str],
        url: str,
        answer: Callable[[Reply], bool],
        *,
        other_url: str,
        removed: str,
    ) -> None:
        """Apply `manifest` (text, file name): `url` gets the waypoint's own `answer` and
        `other_url` a replica's; delete it: `url` reaches a replica again. Two checked steps."""
        self.apply(*manifest)
        answered, detail = self.replies(url, answer)
        others, others_detail = self.replies(other_url, served_by_replica)
        self.check(title, answered and others, f"{detail}; {others_detail}")
        self.delete(*manifest)
        again, detail = self.replies(url, served_by_replica)
        self.check(removed, again, detail)

    def waypoint_metrics_step(self) -> None:
        """Istio's HTTP metrics as the waypoint pod serves them on 15020: every reply the client
        got from the waypoint in the L7 steps is counted, by response code, with the client's
        identity (the waypoint's count also holds the earlier step's calls through it)."""
        pod = self.lab.pods.get(WAYPOINT_POD)
        deadline = time.monotonic() + METRICS_TIMEOUT_S
        table = waypoint_requests("")

        def complete(table: Table) -> bool:
            counted = requests_by_code(table, CLIENT)
            return canary_requests(table, CLIENT) >= self.canary_served and all(
                counted.get(c, 0) >= n for c, n in self.through_envoy.items()
            )

        while pod is not None:
            try:
                status, body = http_get(pod.netns, "127.0.0.1", STATS_PORT, "/stats/prometheus")
            except (OSError, AmbientError):
                status, body = 0, ""
            table = waypoint_requests(body if status == 200 else "")
            if complete(table) or time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        self.say()
        render_tables([table], self.out)
        self.say()
        counted = requests_by_code(table, CLIENT)
        client_id = spiffe("shop", "client")
        seen = ", ".join(f"{c} x{n}" for c, n in sorted(self.through_envoy.items()))
        got = ", ".join(f"{c} x{n}" for c, n in sorted(counted.items()))
        self.check(
            "the waypoint's HTTP metrics count what the client got from it",
            complete(table)
            and self.canary_served > 0
            and {"200", "403", "503"} <= set(self.through_envoy)
            and all(r[1] == client_id for r in table.rows if r[0] == CLIENT),
            f"{CLIENT} ({client_id}) got {seen} from the waypoint in the L7 steps; "
            f"{WAYPOINT_POD}:{STATS_PORT} counted {got or 'nothing'}, "
            f"{canary_requests(table, CLIENT)} of them answered by {CANARY_POD} ({self.canary_served} seen)",
        )

    def until_programmed(self) -> bool:
        from .control.status import read_status_dir
        from .lab.cli import control_status_dir

        record = {"state_dir": str(self.lab.state_dir)}
        deadline = time.monotonic() + POLICY_TIMEOUT_S
        while time.monotonic() < deadline:
            found = read_status_dir(control_status_dir(record), ("Gateway", "shop", WAYPOINT))
            if any(c.type == "Programmed" and c.status for c in found):
                return True
            time.sleep(POLL_S)
        return False

    def through_waypoint(self, title: str, *, want: bool) -> None:
        """Call the Service until the waypoint's Envoy answers (or, `want` False, no longer does),
        and check who the replica's node proxy saw calling: the waypoint's identity, or the
        client's."""
        lab = self.lab
        deadline = time.monotonic() + WAYPOINT_READY_TIMEOUT_S
        offsets = {node: lab.proxy_log_offset(node) for node in lab.nodes}
        while True:
            call, server = curl_server(lab, CLIENT, SERVICE_URL)
            if (call.ok and (server == ENVOY_SERVER) == want) or time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
            offsets = {node: lab.proxy_log_offset(node) for node in lab.nodes}
        seen = ""
        if call.ok and call.answered_by in lab.pods:
            replica = lab.pods[call.answered_by]
            seen = self.inbound_identity(
                replica.spec.node, offsets[replica.spec.node], f"{replica.ip}:{ECHO_PORT}"
            )
        want_id = spiffe("shop", WAYPOINT) if want else spiffe("shop", "client")
        self.check(
            title,
            call.ok and (server == ENVOY_SERVER) == want and seen == want_id,
            f"{CLIENT} -> {SERVICE_URL}: {call.detail} from {call.answered_by or '-'}, Server: {server or '-'}; "
            f"the replica's node proxy saw {seen or 'no inbound HBONE connection'}",
        )

    def every_replica(self, caller: str, *, want_ok: bool) -> tuple[bool, str]:
        """Call each echo replica by its own address (the Service would balance over them and
        could hide one that still answers) until the outcome is the wanted one, then
        REPLICA_CHECKS more times: every call must have that outcome. The verdict and a line of
        detail per replica."""
        ok, parts = True, []
        for target in REPLICAS:
            url = f"http://{self.lab.pods[target].ip}:{ECHO_PORT}/"
            first = self.until(functools.partial(curl, self.lab, caller, url), want_ok=want_ok)
            calls = [first] + [curl(self.lab, caller, url) for _ in range(REPLICA_CHECKS)]
            wanted = sum(c.ok == want_ok for c in calls)
            ok = ok and wanted == len(calls)
            parts.append(
                f"{caller} -> {target} ({url}): {wanted}/{len(calls)} {'served' if want_ok else 'refused'}"
                f" (last {calls[-1].detail})"
            )
        return ok, "; ".join(parts)


def netns_unavailable_reason() -> str | None:
    import os
    import shutil

    if os.geteuid() != 0:
        return "the demo runs the lab: network namespaces need root"
    for tool in ("ip", "iptables", "curl"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (scripts/setup.sh installs it)"
    return None


def run_demo(*, verbose: bool = False, out: IO[str] | None = None, state_dir: Path | None = None) -> int:
    """The tour; 0 when every step behaved as shown, 1 otherwise (2: it cannot run here)."""
    out = out or sys.stdout
    reason = netns_unavailable_reason()
    if reason:
        print(f"ambient demo: {reason}", file=sys.stderr)
        return 2
    topo = parse_topology(f"{DEFAULT_TOPOLOGY}---\n{CANARY_POD_OBJECT}", "<the demo's topology>")
    # Under /run, root's (the lab refuses a state directory others can write).
    with tempfile.TemporaryDirectory(prefix="ambient-demo-", dir="/run") as tmp:
        config = LabConfig(
            state_dir=state_dir or Path(tmp),
            nodes=topo.nodes,
            pods=topo.pods,
            objects=topo.objects,
            ambient_namespaces=topo.ambient_namespaces,
        )
        print(
            "ambient demo: a lab with 2 nodes (node agent + node proxy each), `shop` in the mesh "
            "(client, echo x2 behind Service echo, a canary echo-canary for the L7 steps), `legacy` "
            f"outside it; state in {config.state_dir}",
            file=out,
            flush=True,
        )
        started = time.monotonic()
        lab = Lab(config)
        tour = Tour(lab, out, verbose=verbose)
        try:
            lab.start()
            tour.check(
                "lab up",
                all(lab.proxy_ready(n) for n in lab.nodes),
                f"{len(lab.nodes)} nodes, {len(lab.pods)} pods, ready in {time.monotonic() - started:.1f}s",
            )
            tour.run()
        except AmbientError as e:
            tour.check("the tour", False, str(e))
        finally:
            if verbose:
                for node in lab.nodes:
                    print(f"--- ztunnel on {node} ---\n{lab.proxy_log(node)[-4000:]}", file=out)
            stop_started = time.monotonic()
            programs = list(lab.programs)
            lab.stop()
            left = leftover_namespaces(lab.runner, lab.lab_id)
            alive = [p.name for p in programs if p.running]
            tour.check(
                "lab down",
                not left and not alive,
                f"{len(programs)} processes stopped, every namespace deleted ({time.monotonic() - stop_started:.1f}s)"
                if not left and not alive
                else f"left behind: namespaces {left}, processes {alive}",
            )
    total = time.monotonic() - started
    if tour.failures:
        print(f"FAILED after {total:.1f}s: {', '.join(tour.failures)}", file=out)
        return 1
    print(f"all steps behaved as shown, in {total:.1f}s", file=out)
    return 0
