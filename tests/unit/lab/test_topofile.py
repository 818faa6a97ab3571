"""The lab's topology file (lab/topofile.py), its kube-proxy rules and its DNS answers
(lab/services.py): the pure parts."""

from __future__ import annotations

import dns.flags
import dns.message
import dns.rcode
import pytest

from ambient_mesh.errors import ConfigError
from ambient_mesh.kube.load import parse_documents
from ambient_mesh.lab.services import (
    allocate_cluster_ip,
    answer,
    render_kube_proxy_rules,
    resolv_conf,
    service_addresses,
    service_ports,
)
from ambient_mesh.lab.topofile import DEFAULT_TOPOLOGY, parse_topology


def test_default_topology():
    topo = parse_topology(DEFAULT_TOPOLOGY, "default.yaml")
    assert topo.nodes == ("node-1", "node-2")
    assert {(p.key, p.node, p.app, p.sa) for p in topo.pods} == {
        ("shop/client", "node-1", "sleep", "client"),
        ("shop/echo-1", "node-1", "echo", "echo"),
        ("shop/echo-2", "node-2", "echo", "echo"),
        ("legacy/client", "node-2", "sleep", "client"),
    }
    assert topo.ambient_namespaces == {"shop"}
    assert {(o["kind"], o["metadata"]["name"]) for o in topo.objects} == {
        ("Namespace", "shop"),
        ("Namespace", "legacy"),
        ("Service", "echo"),
    }


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("nodes: [node-1, node-2]", "nodes: [node-1, node-2]\nnodez: 3", "Lab: unknown field 'nodez'"),
        ("nodes: [node-1, node-2]", "nodes: 300", "nodes: 300: the lab runs 1 to"),
        (
            "  nodeName: node-2\n  serviceAccountName: echo",
            "  serviceAccountName: echo",
            "spec.nodeName is required",
        ),
        ("image: ambient-lab/sleep", "image: curlimages/curl", "image 'curlimages/curl'"),
        ("  selector: {app: echo}", "  selector: {app: echo}\n  selektor: {}", None),
    ],
)
def test_topology_errors_name_the_place(old, new, message):
    text = DEFAULT_TOPOLOGY.replace(old, new, 1)
    if message is None:  # Services are Kubernetes' kind: unknown fields there are not checked
        parse_topology(text, "t.yaml")
        return
    with pytest.raises(ConfigError, match=message) as exc:
        parse_topology(text, "t.yaml")
    assert "t.yaml:" in str(exc.value)


def test_policy_typo_in_a_topology_is_refused_with_its_line():
    policy = (
        "---\napiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {name: p, namespace: shop}\n"
        "spec:\n  rules:\n  - from:\n    - source: {principal: [x]}\n"
    )
    text = DEFAULT_TOPOLOGY + policy
    line = text.splitlines().index("    - source: {principal: [x]}") + 1
    with pytest.raises(
        ConfigError, match=rf"t.yaml:{line}:\d+: AuthorizationPolicy shop/p: .*source.principal"
    ):
        parse_topology(text, "t.yaml")


OBJECTS = """\
apiVersion: v1
kind: Service
metadata: {name: echo, namespace: shop}
spec:
  clusterIP: 10.96.0.10
  selector: {app: echo}
  ports: [{port: 80, targetPort: 8080}, {port: 81, targetPort: http}]
---
apiVersion: v1
kind: Pod
metadata: {name: a, namespace: shop, labels: {app: echo}}
spec: {nodeName: n1, containers: [{name: c, ports: [{name: http, containerPort: 9090}]}]}
status: {podIP: 10.244.1.10, conditions: [{type: Ready, status: "True"}]}
---
apiVersion: v1
kind: Pod
metadata: {name: b, namespace: shop, labels: {app: echo}}
spec: {nodeName: n2}
status: {podIP: 10.244.2.10, conditions: [{type: Ready, status: "True"}]}
---
apiVersion: v1
kind: Pod
metadata: {name: c, namespace: shop, labels: {app: echo}}
spec: {nodeName: n2}
status: {podIP: 10.244.2.11, conditions: [{type: Ready, status: "False"}]}
---
apiVersion: v1
kind: Pod
metadata: {name: d, namespace: other, labels: {app: echo}}
spec: {nodeName: n2}
status: {podIP: 10.244.2.12, conditions: [{type: Ready, status: "True"}]}
"""


def test_service_ports_pick_ready_pods_of_the_namespace_and_resolve_named_ports():
    ports = service_ports(parse_documents(OBJECTS, "o.yaml").objects)
    assert [(p.port, p.endpoints) for p in ports] == [
        (80, (("10.244.1.10", 8080), ("10.244.2.10", 8080))),
        (81, (("10.244.1.10", 9090),)),  # b has no port named http
    ]


def test_kube_proxy_rules_spread_evenly_and_masquerade_hairpin():
    ports = service_ports(parse_documents(OBJECTS, "o.yaml").objects)
    rules = render_kube_proxy_rules(ports, "10.244.1.0/24")
    chain = ports[0].chain
    assert len(chain) <= 28
    assert "-A LAB-SERVICES -d 10.96.0.10/32 -p tcp -m tcp --dport 80 " in rules
    assert (
        f"-A {chain} -p tcp -m statistic --mode random --probability 0.5000000000 -j DNAT --to-destination 10.244.1.10:8080"
        in rules
    )
    assert f"-A {chain} -p tcp -j DNAT --to-destination 10.244.2.10:8080" in rules
    assert (
        "-A LAB-POSTROUTING -s 10.244.1.0/24 -d 10.244.1.0/24 -m conntrack --ctstate DNAT -j MASQUERADE"
        in rules
    )
    assert rules.startswith("*nat\n") and rules.endswith("COMMIT\n")


def test_cluster_ip_allocation_and_resolv_conf():
    assert allocate_cluster_ip([]) == "10.96.0.10"
    assert allocate_cluster_ip(["10.96.0.10", "10.96.0.12"]) == "10.96.0.11"
    assert resolv_conf("10.250.0.1", "shop").splitlines() == [
        "nameserver 10.250.0.1",
        "search shop.svc.cluster.local svc.cluster.local cluster.local",
        "options ndots:5",
    ]


def _ask(name: str, rdtype: str = "A") -> dns.message.Message:
    names = service_addresses(parse_documents(OBJECTS, "o.yaml").objects)
    wire = answer(dns.message.make_query(name, rdtype).to_wire(), names)
    return dns.message.from_wire(wire)


def test_dns_answers_service_names_only():
    reply = _ask("echo.shop.svc.cluster.local.")
    assert reply.rcode() == dns.rcode.NOERROR and reply.flags & dns.flags.AA
    assert [r.to_text() for r in reply.answer[0]] == ["10.96.0.10"]
    assert _ask("nope.shop.svc.cluster.local.").rcode() == dns.rcode.NXDOMAIN
    assert _ask("echo.shop.svc.cluster.local.", "AAAA").answer == []
    assert _ask("example.com.").rcode() == dns.rcode.REFUSED  # the lab never asks the outside
    assert answer(b"\x00", {}) is None
    garbage = answer(b"\x12\x34" + b"\x00" * 10 + b"\xff", {})
    assert dns.message.from_wire(garbage).rcode() == dns.rcode.FORMERR
