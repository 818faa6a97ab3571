"""The lab's pure parts: the Kubernetes objects it writes, its address plan, its CNI invocations."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from ambient_mesh.errors import ConfigError
from ambient_mesh.kube.load import load_directory
from ambient_mesh.kube.model import Namespace, Pod, Service
from ambient_mesh.lab.cluster import (
    PodSpec,
    ServiceSpec,
    agent_daemonset_object,
    namespace_object,
    object_file_name,
    parse_pod_spec,
    pod_object,
    pod_uid,
    remove_object,
    service_object,
    write_objects,
    ztunnel_pod_spec,
)
from ambient_mesh.lab.runtime import chained_entries, find_conflist, plan_cni_call, prev_result
from ambient_mesh.lab.topology import host_veth_name, plan_node, plan_pod
from ambient_mesh.logs import access_events, parse_plain_fields

# --- cluster objects -------------------------------------------------------------------------------


def test_parse_pod_spec_full_form():
    spec = parse_pod_spec("node-2:shop/web@frontend,app=web,version=v1")
    assert spec == PodSpec(
        namespace="shop",
        name="web",
        node="node-2",
        service_account="frontend",
        labels={"app": "web", "version": "v1"},
    )
    assert spec.key == "shop/web" and spec.sa == "frontend"
    assert parse_pod_spec("node-1:demo/client").sa == "client"  # default: an SA named like the pod


@pytest.mark.parametrize(
    "text",
    [
        "demo/client",
        "node-1:client",
        "node-1:Demo/client",
        "node-1:demo/c,app",
        "node_1:demo/client",
        ":demo/client",
        "node-1:demo/",
    ],
)
def test_parse_pod_spec_rejects(text):
    with pytest.raises(ConfigError):
        parse_pod_spec(text)


@given(st.text(max_size=60))
def test_parse_pod_spec_returns_a_spec_or_raises_config_error(text):
    try:
        spec = parse_pod_spec(text)
    except ConfigError:
        return
    assert isinstance(spec, PodSpec) and spec.namespace and spec.name and spec.node


def test_pod_uid_is_a_stable_uuid_per_lab():
    a = pod_uid("am-1-1-", "demo", "client")
    assert a == pod_uid("am-1-1-", "demo", "client") != pod_uid("am-2-1-", "demo", "client")
    assert len(a) == 36 and a.count("-") == 4


def test_objects_are_what_the_control_plane_and_the_agent_read(tmp_path: Path):
    spec = parse_pod_spec("node-1:demo/client")
    objects = [
        namespace_object("demo", ambient=True),
        namespace_object("legacy", ambient=False),
        pod_object(spec, uid="u-1", ip=ipaddress.IPv4Address("10.244.1.10"), ports=(8080,)),
        pod_object(ztunnel_pod_spec("node-1"), uid="u-zt", ip="10.250.0.10"),
        service_object(
            ServiceSpec(
                namespace="demo",
                name="echo",
                cluster_ip=ipaddress.IPv4Address("10.96.0.10"),
                selector={"app": "echo"},
                ports={80: 8080},
            )
        ),
        agent_daemonset_object(),
    ]
    write_objects(tmp_path, objects)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(object_file_name(o) for o in objects)
    loaded = load_directory(tmp_path)
    assert not loaded.errors
    pods = {o.metadata.name: o for o in loaded.objects if isinstance(o, Pod)}
    assert pods["client"].node_name == "node-1" and pods["client"].service_account_name == "client"
    assert pods["client"].metadata.uid == "u-1"
    assert pods["ztunnel-node-1"].metadata.namespace == "istio-system"
    assert pods["ztunnel-node-1"].service_account_name == "ztunnel"
    namespaces = {
        o.metadata.name: dict(o.metadata.labels) for o in loaded.objects if isinstance(o, Namespace)
    }
    assert namespaces == {"demo": {"istio.io/dataplane-mode": "ambient"}, "legacy": {}}
    assert [o.metadata.name for o in loaded.objects if isinstance(o, Service)] == ["echo"]
    doc = yaml.safe_load((tmp_path / "pod-demo-client.yaml").read_text())
    assert doc["status"]["podIP"] == "10.244.1.10"
    assert doc["status"]["conditions"] == [{"type": "Ready", "status": "True"}]
    assert remove_object(tmp_path, "Pod", "demo", "client") is True
    assert remove_object(tmp_path, "Pod", "demo", "client") is False
    assert not list(tmp_path.glob(".*.tmp"))


def test_pending_pod_has_no_ip():
    doc = pod_object(parse_pod_spec("node-1:demo/client"), uid="u", ip=None)
    assert doc["status"] == {"phase": "Pending"}


# --- topology plan ---------------------------------------------------------------------------------


def test_node_and_pod_addresses():
    n1, n2 = plan_node("am-1-1-", "node-1", 0), plan_node("am-1-1-", "node-2", 1)
    assert (str(n1.uplink_ip), str(n1.pod_cidr), str(n1.pod_gateway)) == (
        "10.250.0.10",
        "10.244.1.0/24",
        "10.244.1.1",
    )
    assert (str(n2.uplink_ip), str(n2.pod_cidr)) == ("10.250.0.11", "10.244.2.0/24")
    pod = plan_pod("am-1-1-", n2, "demo/server", 0)
    assert (
        pod.netns == "am-1-1-p-demo-server"
        and str(pod.ip) == "10.244.2.10"
        and str(pod.gateway) == "10.244.2.1"
    )
    assert pod.netns_path == "/run/netns/am-1-1-p-demo-server"
    assert len(pod.host_ifname) <= 15 and pod.host_ifname == host_veth_name("demo/server") != host_veth_name(
        "demo/x"
    )


# --- CNI invocation --------------------------------------------------------------------------------


def test_plan_cni_add_is_what_a_runtime_sends():
    node = plan_node("am-1-1-", "node-1", 0)
    pod = plan_pod("am-1-1-", node, "demo/client", 0)
    conflist = {
        "cniVersion": "1.0.0",
        "name": "ambient-lab",
        "plugins": [{"type": "ambient-lab-bridge"}, {"type": "istio-cni", "ambient_enabled": True}],
    }
    (entry,) = chained_entries(conflist)
    call = plan_cni_call(
        "ADD",
        conflist=conflist,
        entry=entry,
        pod=pod,
        namespace="demo",
        name="client",
        uid="u-1",
        bin_dir=Path("/opt/cni/bin"),
        previous=prev_result(pod, "1.0.0"),
    )
    assert call.plugin == Path("/opt/cni/bin/istio-cni")
    stdin = json.loads(call.stdin)
    assert stdin["type"] == "istio-cni" and stdin["name"] == "ambient-lab" and stdin["cniVersion"] == "1.0.0"
    assert stdin["prevResult"]["ips"] == [
        {"address": "10.244.1.10/24", "gateway": "10.244.1.1", "interface": 0}
    ]
    assert call.env["CNI_NETNS"] == "/run/netns/am-1-1-p-demo-client" and call.env["CNI_IFNAME"] == "eth0"
    assert "K8S_POD_NAMESPACE=demo;K8S_POD_NAME=client;" in call.env["CNI_ARGS"]
    assert call.env["CNI_ARGS"].startswith("IgnoreUnknown=1;")
    argv = call.argv()
    assert argv[0] == "env" and argv[-1] == "/opt/cni/bin/istio-cni" and "CNI_COMMAND=ADD" in argv
    delete = plan_cni_call(
        "DEL",
        conflist=conflist,
        entry=entry,
        pod=pod,
        namespace="demo",
        name="client",
        uid="u-1",
        bin_dir=Path("/opt/cni/bin"),
        previous=None,
    )
    assert "prevResult" not in json.loads(delete.stdin)


def test_plan_cni_call_refuses_a_path_as_plugin_type():
    node = plan_node("p-", "n", 0)
    with pytest.raises(ConfigError):
        plan_cni_call(
            "ADD",
            conflist={},
            entry={"type": "../sh"},
            pod=plan_pod("p-", node, "a/b", 0),
            namespace="a",
            name="b",
            uid="u",
            bin_dir=Path("/bin"),
            previous=None,
        )


def test_find_conflist_takes_the_first_in_lexical_order(tmp_path: Path):
    with pytest.raises(ConfigError):
        find_conflist(tmp_path)
    (tmp_path / "20-b.conflist").write_text("{}")
    (tmp_path / "10-a.conflist").write_text("{}")
    (tmp_path / "05-c.conf").write_text("{}")
    assert find_conflist(tmp_path).name == "10-a.conflist"


# --- logs and status -------------------------------------------------------------------------------


def test_access_events_from_plain_log_lines():
    text = (
        "2026-01-01T00:00:00Z\tinfo\taccess\tconnection complete\tsrc.addr=10.0.0.1:5 "
        'src.identity=spiffe://cluster.local/ns/a/sa/b direction=inbound error="a \\"quoted\\" reason"\n'
        "2026-01-01T00:00:00Z\tinfo\txds\tpush applied\n"
    )
    (event,) = access_events(text)
    assert event["src.identity"] == "spiffe://cluster.local/ns/a/sa/b" and event["direction"] == "inbound"
    assert event["error"] == 'a "quoted" reason'


@given(st.text(max_size=200))
def test_parse_plain_fields_never_raises(line):
    fields = parse_plain_fields(line)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in fields.items())
