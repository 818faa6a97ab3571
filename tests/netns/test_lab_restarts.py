"""Restarts in a whole lab: the node agent and the node proxy come and go while pods run.

Counterpart: istio-cni's "traffic with established pods if CNI missing" and restart/reconcile
scenarios (reference/istio-cni.md 5.5, 5.7, 8.2) and ztunnel's restart behaviour in shared mode
(the node agent's ZDS snapshot hands every enrolled pod back to a new node proxy, 4.3 and 5.1).

One lab (2 nodes). The steps depend on each other, so each test is one step, in file order:

    node-1   demo/client, demo/local      node-2   demo/server, demo/gone
"""

from __future__ import annotations

import re

import pytest

from ambient_mesh.lab.cluster import parse_pod_spec
from ambient_mesh.lab.lab import APP_PORT, Lab, LabConfig, tcp_roundtrip, wait_until

pytestmark = pytest.mark.timeout(120)

PODS = ("node-1:demo/client", "node-1:demo/local", "node-2:demo/server", "node-2:demo/gone")
CLIENT_ID = "spiffe://cluster.local/ns/demo/sa/client"
WAIT_S = 20.0


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    config = LabConfig(
        state_dir=tmp_path_factory.mktemp("lab-restarts"),
        pods=tuple(parse_pod_spec(p) for p in PODS),
        ambient_namespaces=frozenset({"demo"}),
    )
    with Lab(config) as running:
        yield running


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
    assert tcp_roundtrip(lab.pods[src].netns, target.ip, APP_PORT, payload) == payload
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
    assert lab.stop_agent("node-1") == 0, first.tail()
    # With the agent gone, the pods keep their rules and their proxies: traffic still flows.
    hbone_roundtrip(lab, "demo/client", "demo/server", b"agent down")
    lab.start_agent("node-1")
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
