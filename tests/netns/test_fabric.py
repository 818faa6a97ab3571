"""The namespace fabric itself: nodes reach each other over TCP, and teardown leaves nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ambient_mesh.host.netns import Fabric, cleanup_stale_namespaces, create_netns, list_netns


def test_nodes_reach_each_other_over_tcp_v4_and_v6(fabric, start_echo, roundtrip, tmp_path):
    a = fabric.add_node("a")
    b = fabric.add_node("b")
    server = start_echo(fabric, b, 8080, tmp_path)
    assert roundtrip(a.netns, str(b.ipv4), 8080, b"hello over v4") == b"hello over v4"
    assert roundtrip(a.netns, str(b.ipv6), 8080, b"hello over v6") == b"hello over v6"
    assert server.peers() == [str(a.ipv4), str(a.ipv6)]


def test_three_nodes_share_one_subnet(fabric, start_echo, roundtrip, tmp_path):
    nodes = [fabric.add_node(name) for name in ("a", "b", "c")]
    assert [str(n.ipv4) for n in nodes] == ["10.240.0.11", "10.240.0.12", "10.240.0.13"]
    server = start_echo(fabric, nodes[2], 9000, tmp_path)
    for client in nodes[:2]:
        assert roundtrip(client.netns, str(nodes[2].ipv4), 9000, b"x" * 100_000) == b"x" * 100_000
    assert server.peers() == [str(nodes[0].ipv4), str(nodes[1].ipv4)]


def test_sysctls_apply_inside_the_fabric_namespace_only(fabric, runner):
    node = fabric.add_node("a")
    forward = ["sysctl", "-n", "net.ipv4.ip_forward"]
    assert runner.run(forward, netns=fabric.network_netns).text.strip() == "1"
    assert runner.run(forward, netns=node.netns).text.strip() == "0"


def test_teardown_removes_namespaces_and_stops_processes(runner):
    with Fabric(runner=runner) as fab:
        node = fab.add_node("a")
        sleeper = fab.spawn(node, ["sleep", "300"])
        created = fab.namespaces
        assert set(created) <= set(list_netns(runner))
        assert len(created) == 2
    assert sleeper.poll() is not None
    assert not set(created) & set(list_netns(runner))
    assert "down" in repr(fab)


def test_teardown_runs_when_the_body_raises(runner):
    with pytest.raises(RuntimeError, match="boom"), Fabric(runner=runner) as fab:
        fab.add_node("a")
        created = fab.namespaces
        raise RuntimeError("boom")
    assert not set(created) & set(list_netns(runner))


def test_stale_namespaces_of_dead_runs_are_removed(runner):
    finished = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    dead_pid = int(finished.stdout)
    stale = f"am-{dead_pid}-1-leftover"
    create_netns(runner, stale)
    try:
        with Fabric(runner=runner) as live:  # a live run's namespaces must survive the cleanup
            removed = cleanup_stale_namespaces(runner)
            assert stale in removed
            assert set(live.namespaces) <= set(list_netns(runner))
        assert stale not in list_netns(runner)
    finally:
        if stale in list_netns(runner):
            runner.run(["ip", "netns", "delete", stale], check=False)
