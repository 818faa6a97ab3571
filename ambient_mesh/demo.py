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
client pass again; stop the lab. Each step is checked; the exit status is non-zero when any
step did not behave as shown. Manifests go through the same path as `ambient lab apply`.
"""

from __future__ import annotations

import functools
import http.client
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from prometheus_client.parser import text_string_to_metric_families

from .errors import AmbientError
from .lab import apply as manifests
from .lab.journal import leftover_namespaces
from .lab.lab import APP_PORT, Lab, LabConfig
from .lab.topofile import load_topology
from .ports import STATS_PORT
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


class Tour:
    """Runs the steps against a started lab; each step prints one PASS/FAIL line."""

    def __init__(self, lab: Lab, out: IO[str], *, verbose: bool) -> None:
        self.lab = lab
        self.out = out
        self.verbose = verbose
        self.failures: list[str] = []
        self.started = time.monotonic()

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
    topo = load_topology(None)
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
            f"(client, echo x2 behind Service echo), `legacy` outside it; state in {config.state_dir}",
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
