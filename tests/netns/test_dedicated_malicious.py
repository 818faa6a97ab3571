"""Calls aimed at the node proxy's own ports, in dedicated mode: none may loop or leak the admin API.

Counterpart: ztunnel's `malicious_calls_inpod` namespaced test, adapted
to dedicated mode, where the proxy shares its pod's network namespace. Facts honoured: the port
table and `illegal_ports` = {15001, 15006, 15008} (docs/istio-behaviour.md, "Ports"), the
inbound checks ("Inbound HBONE (15008)", "Inbound passthrough (15006)").

Topology (one Fabric):

    node-a   client pod: captured (dedicated-mode rules) + its own `ambient ztunnel`
    node-b   server pod: captured + `ambient ztunnel`, echo app on 8080
    outside  a namespace with no proxy and no capture rules (an "uncaptured" caller)

Callers dial 15001, 15006, 15008 (plain TCP, no TLS), 15000, 15020 and 15021 of:
the server pod's IP from outside and from the client pod; 127.0.0.1 and the pod's own IP from
inside each pod. What must hold:

- 15001/15006: the connection is closed without a byte (the proxy refuses it as a loop or as an
  illegal target port), and the refusal is logged once; nothing is forwarded back into the proxy.
- 15008 without TLS: no HTTP/2 (nor any HTTP) response; the connection closes.
- 15000 (admin, bound to 127.0.0.1): answers inside the pod on 127.0.0.1 only.
- 15020 (metrics) and 15021 (readiness): answer, from anywhere (meant to be reachable).
- The proxies stay healthy: still running and /healthz/ready is 200 afterwards.

Every case prints what happened (connect result, how the connection ended, the first bytes
back, the proxies' new log lines) in its failure message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import yaml

from ambient_mesh.capture.dedicated import apply_dedicated_rules, render_dedicated_rules
from ambient_mesh.host.netns import Fabric, Node
from ambient_mesh.ports import (
    ADMIN_PORT,
    HBONE_PORT,
    INBOUND_PLAINTEXT_PORT,
    OUTBOUND_PORT,
    READINESS_PORT,
    STATS_PORT,
)
from tests.helpers.dedicated_mesh import (
    APP_PORT,
    PACKET_MARK,
    NodeProxy,
    node_proxy_missing,
    start_proxy,
    wait_ready,
)
from tests.helpers.malicious_probes import Expect, Outcome, check, payload_for, probe

pytestmark = pytest.mark.timeout(240)

LOG_WAIT_TIMEOUT_S = 10.0


REFUSED_OWN_PORT = "is one of the proxy's own ports"
REFUSED_NOT_REDIRECTED = "(not redirected) refused"


# --- probing -------------------------------------------------------------------------------------


# --- expectations ----------------------------------------------------------------------------------


# --- topology --------------------------------------------------------------------------------------


@dataclass(slots=True)
class Topology:
    fabric: Fabric
    client: Node
    server: Node
    outside: Node
    proxies: dict[str, NodeProxy]  # by node name
    server_app: object


def workload(name: str, namespace: str, sa: str, node: Node) -> dict:
    return {
        "uid": f"Kubernetes//Pod/{namespace}/{name}",
        "name": name,
        "namespace": namespace,
        "serviceAccount": sa,
        "trustDomain": "cluster.local",
        "workloadIps": [str(node.ipv4)],
        "protocol": "HBONE",
        "node": node.name,
    }


@pytest.fixture(scope="module")
def topo(runner, start_echo, get, poll, tmp_path_factory):
    missing = node_proxy_missing()
    if missing:
        pytest.skip(missing)
    tmp = tmp_path_factory.mktemp("dedicated-malicious")
    with Fabric(runner=runner) as fabric:
        client = fabric.add_node("node-a")
        server = fabric.add_node("node-b")
        outside = fabric.add_node("outside")
        config = tmp / "local-xds.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "workloads": [
                        workload("client", "shop", "frontend", client),
                        workload("server", "shop", "echo", server),
                    ]
                },
                sort_keys=False,
            )
        )
        server_app = start_echo(fabric, server, APP_PORT, tmp)
        for pod in (client, server):
            apply_dedicated_rules(runner, pod.netns, render_dedicated_rules(mark=PACKET_MARK))
            apply_dedicated_rules(
                runner, pod.netns, render_dedicated_rules(mark=PACKET_MARK, ipv6=True), ipv6=True
            )
        proxies = {
            client.name: start_proxy(fabric, client, "shop/client/frontend", config, tmp / "proxy-a"),
            server.name: start_proxy(fabric, server, "shop/server/echo", config, tmp / "proxy-b"),
        }
        for proxy in proxies.values():
            wait_ready(proxy, get, poll)
        yield Topology(
            fabric=fabric,
            client=client,
            server=server,
            outside=outside,
            proxies=proxies,
            server_app=server_app,
        )


def new_events(proxy: NodeProxy, since: int) -> list[str]:
    """Access-log events (`connection complete` / `connection failed`) written after `since`."""
    with open(proxy.log, "rb") as f:
        f.seek(since)
        text = f.read().decode(errors="replace")
    return [
        line for line in text.splitlines() if "connection complete" in line or "connection failed" in line
    ]


def report(what: str, expect: Expect, outcome: Outcome, topo: Topology, offsets: dict[str, int]) -> str:
    lines = [f"{what}: expected {expect.value}; got {outcome}"]
    for name, proxy in topo.proxies.items():
        events = new_events(proxy, offsets[name])
        lines.append(f"  {name} proxy access events since the call ({len(events)}):")
        lines += [f"    {event}" for event in events] or ["    (none)"]
    return "\n".join(lines)


def events_about(proxy: NodeProxy, since: int, port: int) -> list[str]:
    """New access events that name `port` as a destination (`dst.addr=ip:port`, `hbone_addr=ip:port`)
    or in a refusal (`port N is ...`). The previous case's completion line may land after this
    case's offset was taken; it names another port, so it is not counted here."""
    about = re.compile(rf"(?::|port ){port}\b")
    return [event for event in new_events(proxy, since) if about.search(event)]


def wait_for_event(proxy: NodeProxy, since: int, port: int, needles: tuple[str, ...], poll) -> str | None:
    """The first new access event about `port` containing any of `needles`, or None after the wait."""

    def find():
        return next((e for e in events_about(proxy, since, port) if any(n in e for n in needles)), None)

    try:
        return poll(find, timeout_s=LOG_WAIT_TIMEOUT_S, what=f"{needles} in {proxy.node.name}'s log")
    except pytest.fail.Exception:
        return None


def run_case(
    topo: Topology, source: Node, host: str, port: int, expect: Expect
) -> tuple[Outcome, dict[str, int], str]:
    offsets = {name: proxy.offset() for name, proxy in topo.proxies.items()}
    outcome = probe(source.netns, host, port, payload_for(port))
    what = f"{source.name} -> {host}:{port}"
    message = report(what, expect, outcome, topo, offsets)
    assert check(expect, outcome), message
    return outcome, offsets, what


def assert_refusal_logged_once(
    topo: Topology,
    node: Node,
    port: int,
    offsets: dict[str, int],
    needles: tuple[str, ...],
    what: str,
    expect: Expect,
    outcome: Outcome,
    poll,
) -> None:
    """The refusing proxy logged the reason, and one event only: a loop would log one per hop."""
    proxy = topo.proxies[node.name]
    found = wait_for_event(proxy, offsets[node.name], port, needles, poll)
    message = report(what, expect, outcome, topo, offsets)
    assert found is not None, f"{node.name}'s proxy logged no refusal containing {needles}\n{message}"
    events = events_about(proxy, offsets[node.name], port)
    assert len(events) == 1, f"{len(events)} events about port {port} for one call\n{message}"


# --- the cases -------------------------------------------------------------------------------------

# Callers reaching the server pod's IP from elsewhere. From outside nothing is captured on the
# way out, and the server pod's PREROUTING rule redirects every port but 15008 to 15006; from the
# client pod every port is captured by its proxy and carried over HBONE.
REMOTE_CASES = [
    (OUTBOUND_PORT, Expect.CLOSED),
    (INBOUND_PLAINTEXT_PORT, Expect.CLOSED),
    (HBONE_PORT, Expect.NO_H2),
    # Reached through the plaintext passthrough, which finds nothing listening on podIP:15000.
    (ADMIN_PORT, Expect.CLOSED),
    (STATS_PORT, Expect.HTTP_OK),
    (READINESS_PORT, Expect.HTTP_OK),
]


@pytest.mark.parametrize(("port", "expect"), REMOTE_CASES, ids=[str(p) for p, _ in REMOTE_CASES])
def test_uncaptured_caller_to_server_pod_ip(topo, poll, port, expect):
    outcome, offsets, what = run_case(topo, topo.outside, str(topo.server.ipv4), port, expect)
    if port in (OUTBOUND_PORT, INBOUND_PLAINTEXT_PORT):
        # 15001 arrives at 15006 with an illegal original port; 15006 arrives at 15006 itself.
        assert_refusal_logged_once(
            topo,
            topo.server,
            port,
            offsets,
            (REFUSED_OWN_PORT, REFUSED_NOT_REDIRECTED),
            what,
            expect,
            outcome,
            poll,
        )
    if port == ADMIN_PORT:
        assert_refusal_logged_once(
            topo,
            topo.server,
            port,
            offsets,
            (f"{topo.server.ipv4}:{ADMIN_PORT} failed",),
            what,
            expect,
            outcome,
            poll,
        )


@pytest.mark.parametrize(("port", "expect"), REMOTE_CASES, ids=[str(p) for p, _ in REMOTE_CASES])
def test_captured_caller_to_server_pod_ip(topo, poll, port, expect):
    outcome, offsets, what = run_case(topo, topo.client, str(topo.server.ipv4), port, expect)
    if port in (OUTBOUND_PORT, INBOUND_PLAINTEXT_PORT, HBONE_PORT):
        # Carried over HBONE with authority podIP:<port>; the server's inbound refuses the
        # illegal target port (400) before any connect.
        assert_refusal_logged_once(
            topo, topo.server, port, offsets, (REFUSED_OWN_PORT,), what, expect, outcome, poll
        )
    if port == ADMIN_PORT:
        assert_refusal_logged_once(
            topo,
            topo.server,
            port,
            offsets,
            (f"{topo.server.ipv4}:{ADMIN_PORT} failed",),
            what,
            expect,
            outcome,
            poll,
        )


# Calls from inside a pod to its own proxy, as the app would make them (unmarked sockets).
# Traffic to 127.0.0.1 and to the pod's own IP leaves through lo and is never captured.
LOCAL_CASES = [
    ("loopback", OUTBOUND_PORT, Expect.CLOSED),
    ("loopback", INBOUND_PLAINTEXT_PORT, Expect.CLOSED),
    ("loopback", HBONE_PORT, Expect.NO_H2),
    ("loopback", ADMIN_PORT, Expect.HTTP_OK),
    ("loopback", STATS_PORT, Expect.HTTP_OK),
    ("loopback", READINESS_PORT, Expect.HTTP_OK),
    ("pod-ip", OUTBOUND_PORT, Expect.CLOSED),
    ("pod-ip", INBOUND_PLAINTEXT_PORT, Expect.CLOSED),
    ("pod-ip", HBONE_PORT, Expect.NO_H2),
    ("pod-ip", ADMIN_PORT, Expect.NOT_LISTENING),
    ("pod-ip", STATS_PORT, Expect.HTTP_OK),
    ("pod-ip", READINESS_PORT, Expect.HTTP_OK),
]


@pytest.mark.parametrize("pod", ["client", "server"])
@pytest.mark.parametrize(
    ("target", "port", "expect"), LOCAL_CASES, ids=[f"{t}-{p}" for t, p, _ in LOCAL_CASES]
)
def test_pod_calls_its_own_proxy(topo, poll, pod, target, port, expect):
    node = topo.client if pod == "client" else topo.server
    host = "127.0.0.1" if target == "loopback" else str(node.ipv4)
    outcome, offsets, what = run_case(topo, node, host, port, expect)
    if port in (OUTBOUND_PORT, INBOUND_PLAINTEXT_PORT):
        assert_refusal_logged_once(
            topo, node, port, offsets, (REFUSED_NOT_REDIRECTED,), what, expect, outcome, poll
        )


def test_no_call_reached_the_app_and_the_proxies_stay_healthy(topo, get):
    # Runs last in this module (pytest keeps file order): after every malicious call above.
    assert topo.server_app.peers() == [], f"calls to proxy ports reached the app: {topo.server_app.peers()}"
    for proxy in topo.proxies.values():
        assert proxy.process.poll() is None, f"{proxy.node.name}'s proxy exited:\n{proxy.tail()}"
        status, body = get(proxy.node.netns, "127.0.0.1", READINESS_PORT, "/healthz/ready")
        assert status == 200, f"{proxy.node.name}'s proxy not ready after the calls: {status} {body!r}"
    # The mesh still carries traffic: the client reaches the server's app over HBONE.
    outcome = probe(topo.client.netns, str(topo.server.ipv4), APP_PORT, b"still alive", half_close=True)
    assert outcome.data == b"still alive", f"client -> server app after the calls: {outcome}"
