"""Calls aimed at the node proxy's own ports in shared mode: none may loop or reach the admin API.

Counterpart: ztunnel's `malicious_calls_inpod`, in a whole lab where
the node proxy runs in the node's namespace and opens 15001/15006/15008 inside each enrolled pod
(docs/istio-behaviour.md, "Ports": `illegal_ports` = {15001, 15006, 15008}). The raw-TCP probe
and the expectation checks are tests/netns/test_dedicated_malicious.py's.

    node-1   demo/client (captured), legacy/outside (not captured)
    node-2   demo/server (captured, echo app on 8080)

What must hold, per target:
- the server pod's IP, from the uncaptured pod: every port but 15008 is redirected to 15006 in
  the server pod; 15001/15006 are refused there (loops), 15000/15020/15021 find nothing inside the
  pod (the proxy's admin, stats and readiness live in the node's namespace); 15008 without TLS
  gets no HTTP/2 answer.
- the server pod's IP, from the captured pod: carried over HBONE; the server's proxy refuses the
  illegal target ports; the others find nothing in the pod.
- 127.0.0.1 and the pod's own IP, from inside each pod: never captured; 15001/15006 reach the
  pod proxy's listeners unredirected and are refused, 15008 wants TLS, nothing else listens.
- the node proxy's own address (its node's), from both pods: only 15020 (metrics) and 15021
  (readiness) answer; admin (127.0.0.1 only) and the pod-only ports are not there.
And afterwards the proxies are still running and ready, nothing reached the server's app, and
the mesh still carries traffic.
"""

from __future__ import annotations

import re

import pytest

from ambient_mesh.errors import AmbientError
from ambient_mesh.lab.cluster import parse_pod_spec
from ambient_mesh.lab.lab import (
    APP_PORT,
    Lab,
    LabConfig,
    tcp_roundtrip,
    wait_until,
)
from ambient_mesh.ports import ADMIN_PORT, READINESS_PORT, STATS_PORT
from tests.helpers.malicious_probes import Expect, Outcome, check, payload_for, probe

pytestmark = pytest.mark.timeout(180)

OUTBOUND, INBOUND_PLAIN, HBONE = 15001, 15006, 15008
ADMIN, STATS, READY = ADMIN_PORT, STATS_PORT, READINESS_PORT
PODS = ("node-1:demo/client", "node-1:legacy/outside", "node-2:demo/server")
LOG_WAIT_S = 10.0
LOOP_PORTS = (OUTBOUND, INBOUND_PLAIN)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    config = LabConfig(
        state_dir=tmp_path_factory.mktemp("lab-malicious"),
        pods=tuple(parse_pod_spec(p) for p in PODS),
        ambient_namespaces=frozenset({"demo"}),
    )
    with Lab(config) as running:
        yield running


def events_about(lab: Lab, node: str, since: int, port: int) -> list[str]:
    """New access events on `node` naming `port` as a destination or in a refusal."""
    about = re.compile(rf"(?::|port ){port}\b")
    return [
        line
        for line in lab.proxy_log(node, since).splitlines()
        if ("connection complete" in line or "connection failed" in line) and about.search(line)
    ]


def run_case(lab: Lab, source: str, host: str, port: int, expect: Expect) -> tuple[Outcome, dict[str, int]]:
    offsets = {n: lab.proxy_log_offset(n) for n in lab.nodes}
    outcome = probe(lab.pods[source].netns, host, port, payload_for(port))
    detail = "\n".join(f"  {n}: {line}" for n in lab.nodes for line in events_about(lab, n, offsets[n], port))
    assert check(expect, outcome), (
        f"{source} -> {host}:{port}: expected {expect.value}; got {outcome}\n{detail}"
    )
    return outcome, offsets


def assert_refused_once(lab: Lab, node: str, since: int, port: int) -> None:
    """One refusal event, not one per hop: a loop back into the proxy would log again and again."""
    try:
        wait_until(
            lambda: events_about(lab, node, since, port),
            timeout_s=LOG_WAIT_S,
            what=f"{node}'s proxy to log the refused call to port {port}",
        )
    except AmbientError as e:
        pytest.fail(str(e))
    events = events_about(lab, node, since, port)
    assert len(events) == 1, "\n".join(events)


SERVER_CASES = [
    (OUTBOUND, Expect.CLOSED),
    (INBOUND_PLAIN, Expect.CLOSED),
    (HBONE, Expect.NO_H2),
    (ADMIN, Expect.CLOSED),
    (STATS, Expect.CLOSED),
    (READY, Expect.CLOSED),
]


@pytest.mark.parametrize("source", ["legacy/outside", "demo/client"])
@pytest.mark.parametrize(("port", "expect"), SERVER_CASES, ids=[str(p) for p, _ in SERVER_CASES])
def test_call_to_the_server_pod_ip(lab, source, port, expect):
    server = lab.pods["demo/server"]
    _, offsets = run_case(lab, source, server.ip, port, expect)
    captured = source == "demo/client"
    if port in LOOP_PORTS or (captured and port == HBONE):
        assert_refused_once(lab, "node-2", offsets["node-2"], port)


LOCAL_CASES = [
    (OUTBOUND, Expect.CLOSED),
    (INBOUND_PLAIN, Expect.CLOSED),
    (HBONE, Expect.NO_H2),
    (ADMIN, Expect.NOT_LISTENING),
    (STATS, Expect.NOT_LISTENING),
    (READY, Expect.NOT_LISTENING),
]


@pytest.mark.parametrize("pod", ["demo/client", "demo/server"])
@pytest.mark.parametrize("target", ["loopback", "pod-ip"])
@pytest.mark.parametrize(("port", "expect"), LOCAL_CASES, ids=[str(p) for p, _ in LOCAL_CASES])
def test_pod_calls_its_own_proxy_ports(lab, pod, target, port, expect):
    host = "127.0.0.1" if target == "loopback" else lab.pods[pod].ip
    node = lab.pods[pod].spec.node
    _, offsets = run_case(lab, pod, host, port, expect)
    if port in LOOP_PORTS:
        assert_refused_once(lab, node, offsets[node], port)


NODE_CASES = {
    # uncaptured caller: straight to the node's namespace, where only stats and readiness listen
    "legacy/outside": [
        (OUTBOUND, Expect.NOT_LISTENING),
        (INBOUND_PLAIN, Expect.NOT_LISTENING),
        (HBONE, Expect.NOT_LISTENING),
        (ADMIN, Expect.NOT_LISTENING),
        (STATS, Expect.HTTP_OK),
        (READY, Expect.HTTP_OK),
    ],
    # captured caller: the node's address is the ztunnel pod's (a workload outside the mesh), so
    # its proxy passes the call through as plain TCP; a refused upstream closes the client
    "demo/client": [
        (OUTBOUND, Expect.CLOSED),
        (INBOUND_PLAIN, Expect.CLOSED),
        (HBONE, Expect.CLOSED),
        (ADMIN, Expect.CLOSED),
        (STATS, Expect.HTTP_OK),
        (READY, Expect.HTTP_OK),
    ],
}


@pytest.mark.parametrize(
    ("source", "port", "expect"),
    [(s, p, e) for s, cases in NODE_CASES.items() for p, e in cases],
    ids=[f"{s.split('/')[1]}-{p}" for s, cases in NODE_CASES.items() for p, _ in cases],
)
def test_call_to_the_node_proxy_address(lab, source, port, expect):
    for node in lab.nodes.values():
        run_case(lab, source, str(node.net.uplink_ip), port, expect)


def test_nothing_reached_the_app_and_the_proxies_stay_ready(lab):
    # Runs last in this module (pytest keeps file order): after every call above.
    assert lab.app_peers("demo/server") == []
    for name, node in lab.nodes.items():
        assert node.proxy is not None and node.proxy.running, node.proxy.tail() if node.proxy else name
        assert lab.proxy_ready(name), f"{name}'s node proxy is not ready after the calls"
    server = lab.pods["demo/server"]
    assert tcp_roundtrip(lab.pods["demo/client"].netns, server.ip, APP_PORT, b"still alive") == b"still alive"
