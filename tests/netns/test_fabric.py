"""The namespace fabric itself: nodes reach each other over TCP, and teardown leaves nothing."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from ambient_mesh.host.netns import (
    Fabric,
    cleanup_stale_namespaces,
    create_netns,
    list_netns,
    set_sysctl,
)


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
    # A new namespace's ip_forward is not a fixed 0: with net.core.devconf_inherit_init_net at
    # its default (0), the kernel copies the host's (init_net's) devconf into it, not the
    # creator's (Documentation/networking/ip-sysctl.rst). So a node reads whatever the host had
    # when the node was made: 1 on a router host, or while a cluster-tier run (scripts/cluster/
    # up.sh turns the host's on) shares the machine. What the fabric owns is checked instead:
    # the network namespace forwards, and a sysctl set in one namespace changes no other.
    forward = "net.ipv4.ip_forward"

    def read(netns: str | None) -> str:
        return runner.run(["sysctl", "-n", forward], netns=netns).text.strip()

    own = read(None)  # the test's namespace: the host's in CI, a private one under `unshare --net`
    a = fabric.add_node("a")
    b = fabric.add_node("b")
    assert read(fabric.network_netns) == "1"  # Fabric.open sets it: the bridge routes between nodes
    before_b = read(b.netns)
    flipped = "0" if read(a.netns) == "1" else "1"
    set_sysctl(runner, netns=a.netns, key=forward, value=flipped)
    assert read(a.netns) == flipped
    assert read(b.netns) == before_b
    assert read(fabric.network_netns) == "1"
    assert read(None) == own


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


# The pid-reuse case of stop_process, run in a private pid namespace (unshare --pid --fork
# --mount-proc) so that the recycled pid is forced (ns_last_pid) and no other process on the
# host is involved. Before the fix, stop_process SIGKILLed the stranger: bench servers of one
# run died while other runs' suites stopped their own, already reaped, processes.
_PID_REUSE_SCRIPT = r"""
import os, subprocess, sys, time
from ambient_mesh.host.netns import stop_process
first = subprocess.Popen(["true"], start_new_session=True)
first.wait()
with open("/proc/sys/kernel/ns_last_pid", "w") as f:
    f.write(str(first.pid - 1))
stranger = subprocess.Popen(["sleep", "30"], start_new_session=True)
assert stranger.pid == first.pid, (stranger.pid, first.pid)
stop_process(first)
time.sleep(0.2)
alive = stranger.poll() is None
stranger.kill()
stranger.wait()
print("stranger alive" if alive else f"stranger killed ({stranger.returncode})")
"""


def test_stop_process_of_a_reaped_leader_spares_the_process_that_reused_its_pid():
    out = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", _PID_REUSE_SCRIPT],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "stranger alive"


def test_stop_process_of_a_reaped_leader_still_kills_its_leftover_children():
    # The leader starts a child in its group and exits; the child (pid != pgid) must die.
    leader = subprocess.Popen(
        [sys.executable, "-c", "import subprocess; print(subprocess.Popen(['sleep', '30']).pid)"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    child = int(leader.stdout.readline())
    leader.wait()
    from ambient_mesh.host.netns import pid_alive, stop_process

    assert pid_alive(child)
    stop_process(leader)
    for _ in range(100):
        try:
            with open(f"/proc/{child}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] == "Z":
                    break  # killed; a zombie until init reaps it
        except FileNotFoundError:
            break
        time.sleep(0.02)
    else:
        pytest.fail(f"leftover child {child} still running")
