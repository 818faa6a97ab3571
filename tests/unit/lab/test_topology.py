"""lab/topology.py's command plan on the shared fabric (host/netns.py `Fabric`), with a recording
runner: what each node and pod gets, inside the lab's own namespaces only, and what teardown
deletes."""

from __future__ import annotations

import pytest

from ambient_mesh.errors import AmbientError
from ambient_mesh.host.commands import CommandError, RecordingRunner
from ambient_mesh.lab.topology import Topology

PREFIX = "am-7-1-"


def ip_changes(runner: RecordingRunner) -> list[tuple[str, ...]]:
    return [c.argv for c in runner.calls if c.argv[0] == "ip" and c.argv[1] != "netns"]


def test_a_node_is_a_fabric_node_plus_its_pod_bridge_and_route():
    runner = RecordingRunner()
    with Topology(runner=runner, prefix=PREFIX) as topo:
        node = topo.add_node("node-1")
        assert (node.netns, str(node.uplink_ip), str(node.pod_cidr)) == (
            "am-7-1-node-1",
            "10.250.0.10",
            "10.244.1.0/24",
        )
        assert topo.fabric.nodes["node-1"].ipv4 == node.uplink_ip  # one fabric, one address plan
        assert str(topo.gateway) == "10.250.0.1"
        assert "up, 1 nodes, 0 pods" in repr(topo)
    argvs = ip_changes(runner)
    assert ("ip", "-n", "am-7-1-node-1", "addr", "add", "10.250.0.10/24", "dev", "eth0") in argvs
    assert ("ip", "-n", "am-7-1-node-1", "route", "replace", "default", "via", "10.250.0.1") in argvs
    assert ("ip", "-n", "am-7-1-node-1", "addr", "add", "10.244.1.1/24", "dev", "cni0") in argvs
    assert ("ip", "-n", "am-7-1-net", "route", "replace", "10.244.1.0/24", "via", "10.250.0.10") in argvs
    # IPv4 only: the lab's fabric has no IPv6 subnet.
    assert not [a for a in argvs if "-6" in a]
    for argv in argvs:  # the root namespace is never touched
        assert argv[1] == "-n" and argv[2].startswith(PREFIX), argv


def test_pods_get_sandboxes_on_their_node_and_teardown_deletes_pods_first():
    runner = RecordingRunner()
    created: list[str] = []
    with Topology(runner=runner, prefix=PREFIX, on_create=created.append) as topo:
        topo.add_node("node-1")
        topo.add_node("node-2")
        pod = topo.add_pod("node-2", "demo/server")
        assert (pod.netns, str(pod.ip), str(pod.gateway)) == (
            "am-7-1-p-demo-server",
            "10.244.2.10",
            "10.244.2.1",
        )
        assert topo.namespaces == created
    assert created == ["am-7-1-net", "am-7-1-node-1", "am-7-1-node-2", "am-7-1-p-demo-server"]
    deletes = [c.argv[3] for c in runner.calls if c.argv[:3] == ("ip", "netns", "delete")]
    assert deletes == list(reversed(created))
    assert topo.namespaces == [] and topo.pods == {} and "down" in repr(topo)
    argvs = ip_changes(runner)
    assert ("ip", "-n", "am-7-1-p-demo-server", "route", "replace", "default", "via", "10.244.2.1") in argvs
    assert ("ip", "-n", "am-7-1-node-2", "link", "set", pod.host_ifname, "master", "cni0") in argvs


def test_a_removed_pod_frees_its_namespace_and_its_address():
    runner = RecordingRunner()
    with Topology(runner=runner, prefix=PREFIX) as topo:
        topo.add_node("node-1")
        first = topo.add_pod("node-1", "demo/a")
        topo.add_pod("node-1", "demo/b")
        topo.remove_pod("demo/a")
        assert first.netns not in topo.namespaces
        again = topo.add_pod("node-1", "demo/c")
        assert again.ip == first.ip  # the freed slot is the first one handed out again
        deletes = [c.argv[3] for c in runner.calls if c.argv[:3] == ("ip", "netns", "delete")]
        assert deletes == [first.netns]


def test_a_pod_whose_wiring_fails_leaves_no_namespace_and_the_lab_goes_on():
    runner = RecordingRunner()
    runner.respond(
        ["ip", "-n", "am-7-1-p-demo-x", "addr", "add"], returncode=2, stderr="RTNETLINK answers: no"
    )
    with Topology(runner=runner, prefix=PREFIX) as topo:
        topo.add_node("node-1")
        with pytest.raises(CommandError):
            topo.add_pod("node-1", "demo/x")
        assert "am-7-1-p-demo-x" not in topo.namespaces and "demo/x" not in topo.pods
        assert topo.add_pod("node-1", "demo/y").ip.packed[-1] == 10  # slot 0 still free


def test_duplicates_and_nodes_before_open_are_refused():
    topo = Topology(runner=RecordingRunner(), prefix=PREFIX)
    with pytest.raises(AmbientError, match="before the fabric was opened"):
        topo.add_node("node-1")
    with topo:
        topo.add_node("node-1")
        with pytest.raises(AmbientError, match="already has a node"):
            topo.add_node("node-1")
        topo.add_pod("node-1", "demo/a")
        with pytest.raises(AmbientError, match="already has a pod"):
            topo.add_pod("node-1", "demo/a")
