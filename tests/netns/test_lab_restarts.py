"""Restarts in a whole lab: the node agent and the node proxy come and go while pods run.

Counterpart: istio-cni's "traffic with established pods if CNI missing" and restart/reconcile
scenarios (docs/istio-behaviour.md, "Node agent start and shutdown") and ztunnel's restart
behaviour in shared mode (the node agent's ZDS snapshot hands every enrolled pod back to a new
node proxy: "ZDS").

One lab (2 nodes). The steps depend on each other, so each test is one step, in file order:

    node-1   demo/client, demo/local      node-2   demo/server, demo/gone

Beside it, a namespace that is not the lab's, older than its pods, holds node-1's pod addresses:
what another lab (or a nested cluster, or a stale sandbox) on the same host looks like to the node
agent's /proc scan when it restarts. The agent used to take the oldest namespace holding a pod's IP
for the pod's own; the snapshot then told the node proxy the pods had a new sandbox, and it
stopped their proxies and failed to start them in that foreign namespace (test 2 then found
demo/client unproxied: "connection refused"). It happened whenever another lab shared the host.
"""

from __future__ import annotations

import os
import re
import secrets

import pytest

from ambient_mesh.host.netns import create_netns, delete_netns, listening_ports, spawn_in_netns, stop_process
from ambient_mesh.lab.cluster import parse_pod_spec
from ambient_mesh.lab.lab import APP_PORT, Lab, LabConfig, tcp_roundtrip, wait_until

pytestmark = pytest.mark.timeout(120)

PODS = ("node-1:demo/client", "node-1:demo/local", "node-2:demo/server", "node-2:demo/gone")
CLIENT_ID = "spiffe://cluster.local/ns/demo/sa/client"
WAIT_S = 20.0
# The addresses the lab gives demo/client and demo/local (topology.py: node-1's pod CIDR is
# 10.244.1.0/24, pods from .10 in order); the fixture checks that they still are.
NODE_1_POD_IPS = ("10.244.1.10", "10.244.1.11")


@pytest.fixture(scope="module")
def decoy(runner):
    """A namespace outside the lab holding NODE_1_POD_IPS, with a process in it (the /proc scan
    finds namespaces through processes), made before the lab so that it is the older one."""
    name = f"am-{os.getpid()}-0-decoy{secrets.token_hex(3)}"
    create_netns(runner, name)
    holder = None
    try:
        runner.run(["ip", "-n", name, "link", "add", "decoy0", "type", "veth", "peer", "name", "decoy1"])
        for ip in NODE_1_POD_IPS:
            runner.run(["ip", "-n", name, "addr", "add", f"{ip}/24", "dev", "decoy0"])
        runner.run(["ip", "-n", name, "link", "set", "decoy0", "up"])
        holder = spawn_in_netns(name, ["sleep", "600"])
        yield name
    finally:
        if holder is not None:
            stop_process(holder)
        delete_netns(runner, name)


@pytest.fixture(scope="module")
def lab(tmp_path_factory, decoy):
    config = LabConfig(
        state_dir=tmp_path_factory.mktemp("lab-restarts"),
        pods=tuple(parse_pod_spec(p) for p in PODS),
        ambient_namespaces=frozenset({"demo"}),
    )
    with Lab(config) as running:
        assert (running.pods["demo/client"].ip, running.pods["demo/local"].ip) == NODE_1_POD_IPS
        yield running


def roundtrip_failure(lab: Lab, src: str, dst: str, error: OSError) -> str:
    """What the next failure needs to explain itself: who proxies the two pods, what listens in
    them, and the end of both node proxies' logs."""
    lines = [f"{src} -> {dst}: {error!r}"]
    for key in (src, dst):
        node = lab.pods[key].spec.node
        lines.append(
            f"{key} on {node}: listening {sorted(listening_ports(lab.runner, lab.pods[key].netns))}, "
            f"{node}'s proxy ready={lab.proxy_ready(node)} serves {sorted(lab.served_pods(node))}"
        )
    for node in sorted({lab.pods[src].spec.node, lab.pods[dst].spec.node}):
        proxy = lab.nodes[node].proxy
        lines.append(f"--- {node} node proxy log (end) ---\n{proxy.tail() if proxy else '(not running)'}")
    return "\n".join(lines)


def istio_rules(lab: Lab, key: str) -> list[str]:
    return [
        line
        for line in lab.exec(key, ["iptables-save"]).text.splitlines()
        if re.match(r"(:ISTIO_|-A ISTIO_|-A \w+ -j ISTIO_)", line)
    ]


def hbone_roundtrip(lab: Lab, src: str, dst: str, payload: bytes) -> dict[str, str]:
    """Send from `src` to `dst`'s app; return the destination node proxy's inbound access event,
    which must name the source's SPIFFE id (the connection was captured and carried over HBONE)."""
    target = lab.pods[dst]
    node = target.spec.node
    since = lab.proxy_log_offset(node)
    try:
        echoed = tcp_roundtrip(lab.pods[src].netns, target.ip, APP_PORT, payload)
    except OSError as e:
        pytest.fail(roundtrip_failure(lab, src, dst, e))
    assert echoed == payload
    event = wait_until(
        lambda: next(
            (
                e
                for e in lab.access_log(node, since)
                if e.get("direction") == "inbound" and e.get("dst.addr") == f"{target.ip}:{APP_PORT}"
            ),
            None,
        ),
        timeout_s=WAIT_S,
        what=f"{node}'s inbound access event for {src} -> {dst}",
    )
    assert (
        event["src.identity"]
        == f"spiffe://cluster.local/ns/{lab.pods[src].spec.namespace}/sa/{lab.pods[src].spec.sa}"
    )
    return event


def test_1_agent_restart_keeps_rules_enrollment_and_traffic(lab):
    before = {key: istio_rules(lab, key) for key in lab.pods}
    marks = {node: lab.enrollment(node) for node in lab.nodes}
    assert all(before[key] for key in lab.pods) and all(len(m) == 2 for m in marks.values())
    first = lab.nodes["node-1"].agent
    since = lab.proxy_log_offset("node-1")
    assert lab.stop_agent("node-1") == 0, first.tail()
    # With the agent gone, the pods keep their rules and their proxies: traffic still flows.
    hbone_roundtrip(lab, "demo/client", "demo/server", b"agent down")
    lab.start_agent("node-1")  # returns once node-1's proxy has taken the new agent's snapshot
    # The snapshot kept the pods' running proxies (ztunnel's idempotent add): none was stopped
    # or restarted, though the decoy holds their addresses.
    assert lab.served_pods("node-1") == {"demo/client", "demo/local"}
    assert "pod proxy stopped" not in lab.proxy_log("node-1", since)
    # Reconciled in place: same rules (nothing duplicated), same enrollment, plugin back.
    assert {key: istio_rules(lab, key) for key in lab.pods} == before
    assert lab.enrollment("node-1") == marks["node-1"]
    assert lab.plugin_installed("node-1")
    hbone_roundtrip(lab, "demo/client", "demo/server", b"agent back")
    hbone_roundtrip(lab, "demo/server", "demo/local", b"to node-1")
    # The new agent handles CNI ADD: a pod started now is enrolled and proxied.
    lab.add_pod(parse_pod_spec("node-1:demo/late"))
    assert lab.enrolled("demo/late") and lab.proxied("demo/late")
    hbone_roundtrip(lab, "demo/late", "demo/server", b"late pod")


def test_2_node_proxy_restart_recovers_pods_from_the_zds_snapshot(lab):
    assert lab.stop_proxy("node-2") == 0
    assert not lab.proxied("demo/server")  # its listeners went with the process
    lab.start_proxy("node-2")
    lab.wait_proxy_ready("node-2")
    assert lab.served_pods("node-2") == {"demo/server", "demo/gone"}
    assert lab.proxied("demo/server") and lab.proxied("demo/gone")
    hbone_roundtrip(lab, "demo/client", "demo/server", b"new proxy")
    hbone_roundtrip(lab, "demo/gone", "demo/local", b"outbound from a recovered pod")


def test_3_pod_deleted_while_the_node_proxy_is_down_is_not_proxied_after(lab):
    gone_uid = lab.pods["demo/gone"].uid
    assert lab.stop_proxy("node-2") == 0
    lab.delete_pod("demo/gone")
    # The agent sees the delete (pod watch) and forgets the pod; no proxy is there to tell.
    wait_until(
        lambda: gone_uid not in lab.enrollment("node-2"), timeout_s=WAIT_S, what="demo/gone unenrolled"
    )
    lab.start_proxy("node-2")
    lab.wait_proxy_ready("node-2")
    assert lab.served_pods("node-2") == {"demo/server"}
    assert gone_uid not in lab.proxy_log("node-2")  # never handed to the new proxy at all
    hbone_roundtrip(lab, "demo/client", "demo/server", b"still meshed")
    hbone_roundtrip(lab, "demo/server", "demo/client", b"and back")
