"""Transparent capture in a whole lab: CNI plugin -> node agent -> in-pod rules -> node proxy over ZDS.

Counterpart: ztunnel's namespaced shared-mode scenarios local_captured_inpod,
server_uncaptured_inpod / client_uncaptured_inpod and cross_node_captured_inpod
and istio-cni's host probe handling (docs/istio-behaviour.md, "Host probe rules").
Every program is its own process, started by `ambient lab` (ambient_mesh/lab): the control plane,
per node the node agent and the shared-mode node proxy; each pod is created by the lab's kubelet
and added through the real CNI plugin.

Topology (one lab per backend, iptables and NATIVE_NFTABLES=true):

    node-1   demo/client, demo/local        (namespace demo is ambient)
    node-2   demo/server, legacy/plain      (namespace legacy is not)
"""

from __future__ import annotations

import re
from collections import Counter

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
from ambient_mesh.logs import access_events
from ambient_mesh.ports import STATS_PORT

pytestmark = pytest.mark.timeout(120)

PODS = ("node-1:demo/client", "node-1:demo/local", "node-2:demo/server", "node-2:legacy/plain")
CLIENT_ID = "spiffe://cluster.local/ns/demo/sa/client"
PROBE_SNAT_IP = "169.254.7.127"  # HOST_PROBE_SNAT_IP's default (docs/istio-behaviour.md, "Host probe rules")
LOG_WAIT_S = 10.0
PAYLOAD = bytes(range(256)) * 64


@pytest.fixture(scope="module", params=["iptables", "nftables"])
def lab(request, tmp_path_factory):
    config = LabConfig(
        state_dir=tmp_path_factory.mktemp(f"lab-{request.param}"),
        pods=tuple(parse_pod_spec(p) for p in PODS),
        ambient_namespaces=frozenset({"demo"}),
        native_nftables=request.param == "nftables",
        # The rule sets checked here are the TCP capture's; DNS capture (on by default) adds a raw
        # table and port-53 rules, which the demo's test exercises.
        cluster_dns=False,
    )
    with Lab(config) as running:
        yield running


def find_access(lab: Lab, node: str, since: int, match, what: str) -> dict[str, str]:
    """The first access-log event on `node` after `since` that `match` accepts."""
    try:
        return wait_until(
            lambda: next((e for e in lab.access_log(node, since) if match(e)), None),
            timeout_s=LOG_WAIT_S,
            what=what,
        )
    except AmbientError:
        pytest.fail(
            f"no access event on {node}: {what}; its new events:\n"
            + "\n".join(map(str, lab.access_log(node, since)))
        )


def new_access(lab: Lab, node: str, since: int, **expected: str) -> dict[str, str]:
    """The first access-log event on `node` after `since` whose fields include `expected`."""
    return find_access(
        lab, node, since, lambda e: all(e.get(k) == v for k, v in expected.items()), str(expected)
    )


def test_every_pod_is_where_the_lab_put_it(lab):
    assert repr(lab).endswith("processes running)") and ": 2 nodes, 4 pods," in repr(lab)
    for key in ("demo/client", "demo/local", "demo/server"):
        assert lab.enrolled(key), lab.status()["pods"][key]
        assert lab.proxied(key)
    assert not lab.enrolled("legacy/plain") and not lab.proxied("legacy/plain")


def test_cross_node_enrolled_pods_talk_hbone(lab):
    client, server = lab.pods["demo/client"], lab.pods["demo/server"]
    since = {n: lab.proxy_log_offset(n) for n in lab.nodes}
    assert tcp_roundtrip(client.netns, server.ip, APP_PORT, PAYLOAD) == PAYLOAD
    inbound = new_access(
        lab, "node-2", since["node-2"], direction="inbound", **{"dst.addr": f"{server.ip}:{APP_PORT}"}
    )
    assert inbound["src.identity"] == CLIENT_ID
    assert inbound["src.addr"].startswith(f"{client.ip}:")
    outbound = new_access(
        lab, "node-1", since["node-1"], direction="outbound", **{"dst.hbone_addr": f"{server.ip}:{APP_PORT}"}
    )
    assert outbound["dst.addr"] == f"{server.ip}:15008"
    assert outbound["dst.identity"] == "spiffe://cluster.local/ns/demo/sa/server"
    status, metrics = lab.proxy_get("node-2", STATS_PORT, "/metrics")
    assert status == 200
    opened = [
        line
        for line in metrics.splitlines()
        if line.startswith("istio_tcp_connections_opened_total{")
        and 'reporter="destination"' in line
        and f'source_principal="{CLIENT_ID}"' in line
    ]
    assert opened and all('connection_security_policy="mutual_tls"' in line for line in opened), opened
    # The app saw the client pod's own address: the node proxies are transparent.
    assert client.ip in lab.app_peers("demo/server")


def test_same_node_enrolled_pods(lab):
    client, local = lab.pods["demo/client"], lab.pods["demo/local"]
    since = lab.proxy_log_offset("node-1")
    assert tcp_roundtrip(client.netns, local.ip, APP_PORT, b"same node") == b"same node"
    inbound = new_access(lab, "node-1", since, direction="inbound", **{"dst.addr": f"{local.ip}:{APP_PORT}"})
    assert inbound["src.identity"] == CLIENT_ID
    assert client.ip in lab.app_peers("demo/local")


def test_enrolled_pod_to_pod_outside_the_mesh_is_plain_tcp(lab):
    client, plain = lab.pods["demo/client"], lab.pods["legacy/plain"]
    since = {n: lab.proxy_log_offset(n) for n in lab.nodes}
    assert tcp_roundtrip(client.netns, plain.ip, APP_PORT, b"plain") == b"plain"
    outbound = new_access(
        lab, "node-1", since["node-1"], direction="outbound", **{"dst.addr": f"{plain.ip}:{APP_PORT}"}
    )
    assert "dst.hbone_addr" not in outbound and "dst.identity" not in outbound
    assert client.ip in lab.app_peers("legacy/plain")
    # Nothing on node-2 proxied it: plain has no proxy.
    assert not [
        e for e in lab.access_log("node-2", since["node-2"]) if e.get("dst.addr", "").startswith(plain.ip)
    ]


def test_pod_outside_the_mesh_to_enrolled_pod(lab):
    plain, server = lab.pods["legacy/plain"], lab.pods["demo/server"]
    since = lab.proxy_log_offset("node-2")
    assert tcp_roundtrip(plain.netns, server.ip, APP_PORT, b"from outside") == b"from outside"
    inbound = find_access(
        lab,
        "node-2",
        since,
        lambda e: e.get("src.addr", "").startswith(f"{plain.ip}:"),
        f"inbound from {plain.ip}",
    )
    assert inbound["direction"] == "inbound"
    assert "src.identity" not in inbound  # plaintext, captured on 15006: no peer identity
    assert inbound["dst.addr"] == f"{server.ip}:{APP_PORT}"
    assert plain.ip in lab.app_peers("demo/server")


@pytest.mark.parametrize("key", ["demo/server", "demo/client"])
def test_kubelet_probe_from_the_node_bypasses_capture(lab, key):
    pod = lab.pods[key]
    node = lab.nodes[pod.spec.node]
    since = lab.proxy_log_offset(pod.spec.node)
    before = len(lab.app_peers(key))
    # A tcpSocket probe: opened by a process on the node, from the node's own namespace.
    assert tcp_roundtrip(node.net.netns, pod.ip, APP_PORT, b"probe") == b"probe"
    peers = wait_until(lambda: lab.app_peers(key)[before:], timeout_s=LOG_WAIT_S, what="the probe at the app")
    # SNATed by the node agent's host rule, then let through by the in-pod rules, uncaptured.
    assert peers == [PROBE_SNAT_IP]
    assert [
        e
        for e in access_events(lab.proxy_log(pod.spec.node, since))
        if e.get("dst.addr") == f"{pod.ip}:{APP_PORT}"
    ] == []


def istio_lines(text: str) -> list[str]:
    return [
        line
        for line in text.splitlines()
        if re.match(r"(:ISTIO_\w+|-A ISTIO_\w+|-A \w+ .*-j ISTIO_|-I \w+ .*-j ISTIO_)", line)
    ]


def istio_lines_by_table(saved: str) -> dict[str, list[str]]:
    """`iptables-save` output split per table (`*nat` ... COMMIT), ISTIO lines only."""
    tables: dict[str, list[str]] = {}
    current = ""
    for line in saved.splitlines():
        if line.startswith("*"):
            current = line[1:]
        elif istio_lines(line):
            tables.setdefault(current, []).append(line)
    return tables


def test_inpod_rules_present_exactly_once(lab):
    for key in ("demo/client", "demo/server"):
        saved = lab.exec(key, ["iptables-save"]).text
        if lab.config.native_nftables:
            ruleset = lab.exec(key, ["nft", "list", "ruleset"]).text
            tables = re.findall(r"^table (\w+) (\S+)", ruleset, flags=re.M)
            assert Counter(tables)[("inet", "istio-ambient-nat")] == 1, ruleset
            assert Counter(tables)[("inet", "istio-ambient-mangle")] == 1, ruleset
            assert "redirect to :15001" in ruleset and "redirect to :15006" in ruleset, ruleset
            assert PROBE_SNAT_IP in ruleset
            assert istio_lines(saved) == []  # no iptables rules alongside
        else:
            tables = istio_lines_by_table(saved)
            assert set(tables) == {"nat", "mangle"}, saved
            for table, lines in tables.items():
                duplicates = [line for line, n in Counter(lines).items() if n > 1]
                assert duplicates == [], f"{key}: duplicated in {table}: {duplicates}\n{saved}"
                assert sorted(line.split()[0] for line in lines if line.startswith(":")) == [
                    ":ISTIO_OUTPUT",
                    ":ISTIO_PRERT",
                ], saved
                assert "-A OUTPUT -j ISTIO_OUTPUT" in lines and "-A PREROUTING -j ISTIO_PRERT" in lines
            nat = tables["nat"]
            assert any("--to-ports 15001" in line for line in nat) and any(
                "--to-ports 15006" in line for line in nat
            )
    plain = lab.exec("legacy/plain", ["iptables-save"]).text
    assert istio_lines(plain) == []
    if lab.config.native_nftables:
        assert "istio" not in lab.exec("legacy/plain", ["nft", "list", "ruleset"]).text


def test_host_probe_rule_on_each_node(lab):
    for name in lab.nodes:
        if lab.config.native_nftables:
            ruleset = lab.node_exec(name, ["nft", "list", "ruleset"]).text
            assert f"snat ip to {PROBE_SNAT_IP}" in ruleset, ruleset
        else:
            nat = lab.node_exec(name, ["iptables-save", "-t", "nat"]).text
            assert nat.count("-A POSTROUTING -j ISTIO_POSTRT") == 1, nat
            assert f"--to-source {PROBE_SNAT_IP}" in nat
