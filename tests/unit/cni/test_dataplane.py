"""The node agent's pure decisions and its data plane against recording fakes (no root, no kernel).

Covers istio-cni's node-agent scenarios (docs/istio-behaviour.md, "Node agent pod lifecycle"): add ordering
and its failure modes, removal, the start-up rebuild, the pod cache, the informer's per-pod decision, the
/proc scan, and the command runner's netns-path form.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ambient_mesh.capture.apply import Backend
from ambient_mesh.cni.dataplane import (
    DataplaneError,
    DataplaneSettings,
    MeshDataplane,
    OpenNetns,
    PodNetnsCache,
    workload_info,
)
from ambient_mesh.cni.enablement import DEFAULT_ENABLEMENT_SELECTORS
from ambient_mesh.cni.informer import Enablement, PodAction, decide_delete, decide_update, enrolled_snapshot
from ambient_mesh.cni.netns_discovery import (
    NetnsCandidate,
    NetnsFinder,
    match_pods,
    parse_ip_addr_json,
    parse_starttime,
    pod_uid_from_cgroup,
    scan_candidates,
)
from ambient_mesh.cni.pods import WatchedPod
from ambient_mesh.errors import ProtocolError
from ambient_mesh.host.commands import netns_argv
from tests.helpers.cni_fakes import FakeLocator, FakeMarker, FakeProbeSet, FakeZtunnel, OrderedRunner, pod

AMBIENT_NS = {"istio.io/dataplane-mode": "ambient"}
ENABLEMENT = Enablement(selectors=DEFAULT_ENABLEMENT_SELECTORS, exclude_namespaces=("kube-system",))


def enrolled(p: WatchedPod, value="enabled") -> WatchedPod:
    return p.with_redirection(value)


# -- host/commands: netns given as a path ------------------------------------------------------------


def test_netns_path_runs_through_nsenter_and_name_through_ip_netns():
    assert netns_argv(["iptables-save"], "/proc/42/ns/net") == [
        "nsenter",
        "--net=/proc/42/ns/net",
        "--",
        "iptables-save",
    ]
    assert netns_argv(["iptables-save"], "pod-a") == ["ip", "netns", "exec", "pod-a", "iptables-save"]
    assert netns_argv(["ip", "-j", "addr"], None) == ["ip", "-j", "addr"]


# -- the informer's decision ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("old", "new", "ns_labels", "known", "action"),
    [
        (None, pod(), AMBIENT_NS, False, PodAction.ADD),
        (None, pod(ips=()), AMBIENT_NS, False, PodAction.WAIT_FOR_IP),
        (None, pod(), {}, False, PodAction.NONE),
        (None, enrolled(pod()), {}, False, PodAction.REMOVE),  # namespace unlabeled
        (None, pod(), {}, True, PodAction.REMOVE),  # known to us without a mark
        (
            None,
            enrolled(pod(labels={"istio.io/dataplane-mode": "none"})),
            AMBIENT_NS,
            False,
            PodAction.REMOVE,
        ),
        (None, enrolled(pod()), AMBIENT_NS, False, PodAction.NONE),
        (pod(ips=("10.0.0.5",)), enrolled(pod(ips=("10.0.0.6",))), AMBIENT_NS, False, PodAction.UPDATE_IPS),
        (pod(), enrolled(pod(phase="Succeeded", ips=())), AMBIENT_NS, False, PodAction.DELETE),
        (pod(), enrolled(pod(phase="Failed"), "pending"), AMBIENT_NS, False, PodAction.DELETE),
        (pod(), pod(phase="Succeeded"), AMBIENT_NS, False, PodAction.NONE),
        (None, enrolled(pod(), "pending"), AMBIENT_NS, False, PodAction.ADD),  # retry the half-done add
        (None, pod(host_network=True), AMBIENT_NS, False, PodAction.NONE),
        (None, pod(annotations={"sidecar.istio.io/status": "{}"}), AMBIENT_NS, False, PodAction.NONE),
        (None, pod(ns="kube-system"), AMBIENT_NS, False, PodAction.NONE),
        (None, enrolled(pod(ns="kube-system")), AMBIENT_NS, False, PodAction.REMOVE),  # newly excluded
        (
            None,
            pod(ns="istio-system", labels={"app": "ztunnel", "istio.io/dataplane-mode": "ambient"}),
            {},
            False,
            PodAction.NONE,
        ),
    ],
)
def test_decide_update(old, new, ns_labels, known, action):
    assert decide_update(old, new, ns_labels, ENABLEMENT, known=known) is action


def test_decide_delete_removes_whatever_may_be_in_the_mesh():
    assert decide_delete(enrolled(pod()), {}, ENABLEMENT) is PodAction.DELETE
    assert decide_delete(pod(), AMBIENT_NS, ENABLEMENT) is PodAction.DELETE
    assert decide_delete(pod(), {}, ENABLEMENT, known=True) is PodAction.DELETE
    assert decide_delete(pod(), {}, ENABLEMENT) is PodAction.NONE


def test_enrolled_snapshot_only_enabled_running_non_ztunnel_pods():
    ztunnel = enrolled(pod(name="zt", uid="z", ns="istio-system", labels={"app": "ztunnel"}))
    pods = [
        enrolled(pod(uid="a")),
        enrolled(pod(uid="b"), "pending"),
        enrolled(pod(uid="c", phase="Failed")),
        pod(uid="d"),
        ztunnel,
    ]
    assert [
        p.uid for p in enrolled_snapshot(pods, Enablement(selectors=(), system_namespace="istio-system"))
    ] == ["a"]


# -- fakes ---------------------------------------------------------------------------------------------


class Harness:
    def __init__(self, tmp_path: Path, *, reconcile=True):
        self.log: list[tuple] = []
        self.runner = OrderedRunner(self.log)
        self.probe = FakeProbeSet(self.log)
        self.zt = FakeZtunnel(self.log)
        self.marker = FakeMarker(self.log)
        # Ordinary files stand in for namespaces: an fd and an inode are all the agent needs.
        self.netns = {name: tmp_path / f"netns-{name}" for name in ("a", "b")}
        for path in self.netns.values():
            path.write_text("")
        self.locator = FakeLocator({"uid-1": str(self.netns["a"])})
        self.dp = MeshDataplane(
            DataplaneSettings(reconcile_on_start=reconcile),
            runner=self.runner,
            probe_set=self.probe,
            ztunnel=self.zt,
            marker=self.marker,
            locator=self.locator,
            netns_guard=FilesStandInForNetns(),
        )

    def steps(self) -> list[str]:
        return [entry[0] + ":" + entry[1] for entry in self.log]

    def rule_calls(self) -> list[tuple]:
        return [
            (c.argv[0], c.netns)
            for c in self.runner.calls
            if c.argv[0].startswith(("iptables-restore", "ip"))
        ]


class FilesStandInForNetns:
    """The harness's netns are ordinary files: every named one is accepted (sandbox.NetnsGuard's
    own checks are tested on real namespaces in tests/netns/test_local_surfaces.py)."""

    def refusal(self, path, *, peer_pid=None):
        return None

    def move_refusal(self, enrolled, named, pod):
        return None


@pytest.fixture
def h(tmp_path):
    harness = Harness(tmp_path)
    yield harness
    harness.dp.close()


async def test_add_applies_rules_then_ztunnel_then_probe_set_then_mark(h):
    await h.dp.add_pod_to_mesh(pod(), ["10.0.0.5"], str(h.netns["a"]))
    assert h.steps() == ["rules:iptables-restore", "ztunnel:add", "probe:upsert", "mark:enabled"]
    restore = [c for c in h.runner.calls if c.argv[0] == "iptables-restore"]
    assert restore and all(c.netns == str(h.netns["a"]) for c in restore)
    assert b"ISTIO_OUTPUT" in restore[0].input
    assert h.log[1] == ("ztunnel", "add", "uid-1", "demo/web/sa-web")
    assert h.probe.members == {ipaddress.ip_address("10.0.0.5"): "uid-1"}
    assert h.dp.cache.get("uid-1").netns.path == str(h.netns["a"])
    assert h.dp.snapshot()[0][0] == "uid-1" and h.dp.snapshot()[0][2] is not None
    assert "1 added" in repr(h.dp)


async def test_add_prefers_cni_ips_over_pod_status(h):
    await h.dp.add_pod_to_mesh(pod(ips=()), ["10.9.9.9"], str(h.netns["a"]))
    assert ("probe", "upsert", "10.9.9.9", "uid-1") in h.log


async def test_add_twice_keeps_one_handle(h):
    await h.dp.add_pod_to_mesh(pod(), ["10.0.0.5"], str(h.netns["a"]))
    fd = h.dp.cache.get("uid-1").netns.fd
    await h.dp.add_pod_to_mesh(pod(), ["10.0.0.5"], str(h.netns["a"]))
    assert h.dp.cache.get("uid-1").netns.fd == fd
    assert len(h.dp.cache) == 1


async def test_ztunnel_failure_is_retryable_and_marks_pending(h):
    h.zt.error = "no ztunnel connection"
    with pytest.raises(DataplaneError) as info:
        await h.dp.add_pod_to_mesh(pod(), ["10.0.0.5"], str(h.netns["a"]))
    assert info.value.retryable and "no ztunnel connection" in str(info.value)
    assert h.marker.marks == {"uid-1": "pending"}
    assert h.probe.members == {}  # not added: the pod is not proxied yet
    assert "uid-1" in h.dp.cache  # rules stay, netns stays known for the retry


async def test_rule_failure_is_not_retryable_and_forgets_the_pod(h):
    h.runner.respond(["iptables-restore"], returncode=1, stderr="iptables-restore: line 3 failed")
    with pytest.raises(DataplaneError) as info:
        await h.dp.add_pod_to_mesh(pod(), ["10.0.0.5"], str(h.netns["a"]))
    assert not info.value.retryable
    assert "uid-1" not in h.dp.cache
    assert [step for step in h.steps() if not step.startswith("rules:")] == []  # no proxy, probe set, mark


async def test_unopenable_netns_is_not_retryable(h, tmp_path):
    with pytest.raises(DataplaneError) as info:
        await h.dp.add_pod_to_mesh(pod(), ["10.0.0.5"], str(tmp_path / "missing"))
    assert not info.value.retryable and "uid-1" not in h.dp.cache


async def test_add_without_cni_event_finds_netns_under_proc(h):
    await h.dp.add_pod_to_mesh(pod(), ["10.0.0.5"])
    assert h.locator.asked == [{"uid-1": ["10.0.0.5"]}]
    assert h.dp.cache.get("uid-1").netns.path == str(h.netns["a"])


async def test_add_without_netns_anywhere_fails_for_good(h):
    with pytest.raises(DataplaneError) as info:
        await h.dp.add_pod_to_mesh(pod(uid="uid-x"), ["10.0.0.7"])
    assert not info.value.retryable and "can't find netns" in str(info.value)


async def test_probe_set_failure_is_retryable(h):
    h.probe.fail = True
    with pytest.raises(DataplaneError) as info:
        await h.dp.add_pod_to_mesh(pod(), ["10.0.0.5"], str(h.netns["a"]))
    assert info.value.retryable and h.marker.marks == {}


async def test_remove_undoes_in_order(h):
    await h.dp.add_pod_to_mesh(pod(), ["10.0.0.5"], str(h.netns["a"]))
    h.log.clear()
    calls_before = len(h.runner.calls)
    await h.dp.remove_pod_from_mesh(enrolled(pod()), is_delete=False)
    assert h.steps() == ["probe:delete", "ztunnel:del", "unmark:uid-1"]
    removal = [c for c in h.runner.calls[calls_before:] if c.netns == str(h.netns["a"])]
    assert removal, "rules removed inside the pod's netns"
    assert "uid-1" not in h.dp.cache and h.marker.marks == {}


async def test_remove_keeps_probe_entry_of_a_newer_pod(h):
    h.probe.members[ipaddress.ip_address("10.0.0.5")] = "uid-new"
    await h.dp.remove_pod_from_mesh(enrolled(pod()), is_delete=True)
    assert h.probe.members == {ipaddress.ip_address("10.0.0.5"): "uid-new"}


async def test_remove_with_ztunnel_failure_is_retryable_and_keeps_the_mark(h):
    await h.dp.add_pod_to_mesh(pod(), ["10.0.0.5"], str(h.netns["a"]))
    h.zt.del_error = "#1: connection closed"
    with pytest.raises(DataplaneError) as info:
        await h.dp.remove_pod_from_mesh(enrolled(pod()), is_delete=False)
    assert info.value.retryable
    assert h.marker.marks == {"uid-1": "enabled"}
    assert h.probe.members == {}  # the probe entry went first, unconditionally


async def test_delete_tolerates_rule_removal_failure(h):
    await h.dp.add_pod_to_mesh(pod(), ["10.0.0.5"], str(h.netns["a"]))
    h.runner.respond(["iptables-save"], returncode=1, stderr="netns gone")
    await h.dp.remove_pod_from_mesh(enrolled(pod()), is_delete=True)
    assert "uid-1" not in h.dp.cache and ("ztunnel", "del", "uid-1") in h.log


async def test_rebuild_finds_netns_reconciles_and_syncs_probe_set(h):
    h.probe.members[ipaddress.ip_address("10.0.0.99")] = "uid-stale"
    problems = await h.dp.rebuild([enrolled(pod()), enrolled(pod(name="db", uid="uid-2", ips=("10.0.0.6",)))])
    assert problems == {"uid-2": "netns not found under /proc"}
    snapshot = {uid: fd for uid, _, fd in h.dp.snapshot()}
    assert snapshot["uid-1"] is not None and snapshot["uid-2"] is None  # add vs keep
    assert any(c.argv[0] == "iptables-restore" and c.netns == str(h.netns["a"]) for c in h.runner.calls)
    assert h.probe.members == {
        ipaddress.ip_address("10.0.0.5"): "uid-1",
        ipaddress.ip_address("10.0.0.6"): "uid-2",
    }


async def test_rebuild_without_reconcile_runs_no_rule_commands(tmp_path):
    harness = Harness(tmp_path, reconcile=False)
    try:
        await harness.dp.rebuild([enrolled(pod())])
        assert harness.runner.calls == []
    finally:
        harness.dp.close()


async def test_rebuild_with_a_pod_without_ip_does_not_prune(h):
    h.probe.members[ipaddress.ip_address("10.0.0.99")] = "uid-other"
    await h.dp.rebuild([enrolled(pod(ips=()))])
    assert ipaddress.ip_address("10.0.0.99") in h.probe.members


def test_inpod_config_reads_pod_overrides():
    settings = DataplaneSettings(dns_capture=True, ipv6=False, backend=Backend.NFTABLES)
    cfg = settings.inpod_config(
        pod(
            annotations={
                "ambient.istio.io/dns-capture": "false",
                "ambient.istio.io/bypass-inbound-capture": "true",
            }
        )
    )
    assert cfg.redirect_dns is False and cfg.ingress_mode is True
    assert workload_info(pod()).service_account == "sa-web"


# -- the pod cache -------------------------------------------------------------------------------------


def test_pod_cache_same_inode_keeps_old_handle_new_inode_replaces(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("")
    b.write_text("")
    cache = PodNetnsCache()
    info = workload_info(pod())
    first = cache.upsert("u", info, OpenNetns.open(str(a)))
    again = OpenNetns.open(str(a))
    assert cache.upsert("u", info, again) is first and again.fd == -1
    other = cache.upsert("u", info, OpenNetns.open(str(b)))
    assert other is not first and first.fd == -1
    cache.ensure("v", info)
    assert [(uid, fd is None) for uid, _, fd in cache.snapshot()] == [("u", False), ("v", True)]
    assert cache.take("u").netns is other and cache.take("u") is None
    assert repr(cache) == "PodNetnsCache(1 pods, 0 with netns)"
    other.close()
    cache.close()


def test_open_netns_command_path_falls_back_to_our_fd(tmp_path):
    path = tmp_path / "ns"
    path.write_text("")
    handle = OpenNetns.open(str(path))
    try:
        assert handle.command_path() == str(path)
        path.unlink()
        assert handle.command_path() == f"/proc/{os.getpid()}/fd/{handle.fd}"
    finally:
        handle.close()


# -- /proc scan ----------------------------------------------------------------------------------------


def stat_line(pid: int, starttime: int, comm: str = "sleep") -> str:
    rest = ["S"] + ["0"] * 18 + [str(starttime)] + ["0"] * 10
    return f"{pid} ({comm}) " + " ".join(rest)


def make_proc(root: Path, pid: int, netns_file: Path, starttime: int, cgroup: str = "0::/") -> None:
    d = root / str(pid)
    (d / "ns").mkdir(parents=True)
    (d / "ns" / "net").symlink_to(netns_file)
    (d / "stat").write_text(stat_line(pid, starttime))
    (d / "cgroup").write_text(cgroup)


def test_parse_starttime_counts_after_the_command():
    assert parse_starttime(stat_line(7, 12345, comm="a) b (c")) == 12345
    with pytest.raises(ProtocolError):
        parse_starttime("7 (x) S 1 2")


@given(st.text(max_size=200))
def test_parse_starttime_returns_int_or_protocol_error(text):
    try:
        assert parse_starttime(text) >= 0
    except ProtocolError:
        pass


def test_pod_uid_from_cgroup_layouts():
    uid = "0d9b9f3e-7c3a-4a8e-9a55-3c1f6a3b2c10"
    cgroupfs = f"0::/kubepods/besteffort/pod{uid}/0123abcd\n"
    systemd = f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid.replace('-', '_')}.slice/cri-containerd-01.scope\n"
    assert pod_uid_from_cgroup(cgroupfs) == uid
    assert pod_uid_from_cgroup(systemd) == uid
    assert pod_uid_from_cgroup("0::/user.slice\n") == ""
    other = "0d9b9f3e-7c3a-4a8e-9a55-3c1f6a3b2c11"
    assert pod_uid_from_cgroup(cgroupfs + f"1:cpu:/kubepods/pod{other}/x\n") == ""


def test_parse_ip_addr_json():
    text = '[{"ifname":"lo","addr_info":[{"local":"127.0.0.1"}]},{"ifname":"eth0","addr_info":[{"local":"10.1.0.4"},{"local":"fe80::1%eth0"}]}]'
    assert parse_ip_addr_json(text) == {"127.0.0.1", "10.1.0.4", "fe80::1"}
    with pytest.raises(ProtocolError):
        parse_ip_addr_json("{")


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=10),
        lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3),
        max_leaves=10,
    )
)
def test_parse_ip_addr_json_returns_set_or_protocol_error(doc):
    import json

    try:
        assert isinstance(parse_ip_addr_json(json.dumps(doc)), set)
    except ProtocolError:
        pass


def test_scan_dedupes_by_inode_keeps_oldest_and_skips_excluded(tmp_path):
    ns_pod, ns_host = tmp_path / "ns-pod", tmp_path / "ns-host"
    ns_pod.write_text("")
    ns_host.write_text("")
    proc = tmp_path / "proc"
    make_proc(proc, 100, ns_pod, starttime=500)
    make_proc(proc, 101, ns_pod, starttime=400)  # the pod's oldest process
    make_proc(proc, 1, ns_host, starttime=1)
    (proc / "self").mkdir()
    host_key = (os.stat(ns_host).st_dev, os.stat(ns_host).st_ino)
    found = scan_candidates(proc, exclude={host_key})
    assert [(c.pid, c.starttime) for c in found] == [(101, 400)]


def test_match_pods_requires_the_ip_and_agreeing_cgroup():
    cands = [
        NetnsCandidate(pid=1, path="/p/1", dev=1, inode=10, starttime=1, pod_uid="other"),
        NetnsCandidate(pid=2, path="/p/2", dev=1, inode=11, starttime=2),
        NetnsCandidate(pid=3, path="/p/3", dev=1, inode=12, starttime=3),
    ]
    addrs = {10: {"10.0.0.5"}, 11: {"10.0.0.9"}, 12: {"10.0.0.5"}}
    found = match_pods(cands, {"u": ["10.0.0.5"], "noip": []}, lambda c: addrs[c.inode])
    assert {uid: c.pid for uid, c in found.items()} == {"u": 3}


def test_match_pods_takes_no_namespace_when_the_ip_is_held_twice():
    # Another lab (or a nested cluster, or a stale sandbox) on the same host with the same pod
    # address: the older namespace is not the pod's just because it is older.
    other = NetnsCandidate(pid=1, path="/p/1", dev=1, inode=10, starttime=1)
    own = NetnsCandidate(pid=2, path="/p/2", dev=1, inode=11, starttime=2)
    addrs = {10: {"10.244.1.10"}, 11: {"10.244.1.10"}}
    assert match_pods([other, own], {"u": ["10.244.1.10"]}, lambda c: addrs[c.inode]) == {}


def test_match_pods_prefers_the_namespace_whose_cgroup_names_the_pod():
    bare = NetnsCandidate(pid=1, path="/p/1", dev=1, inode=10, starttime=1)
    named = NetnsCandidate(pid=2, path="/p/2", dev=1, inode=11, starttime=2, pod_uid="u")
    addrs = {10: {"10.0.0.5"}, 11: {"10.0.0.5"}}
    found = match_pods([bare, named], {"u": ["10.0.0.5"]}, lambda c: addrs[c.inode])
    assert {uid: c.pid for uid, c in found.items()} == {"u": 2}


def test_match_pods_a_namespace_holding_two_pods_ips_is_neithers():
    both = NetnsCandidate(pid=1, path="/p/1", dev=1, inode=10, starttime=1)
    own_v = NetnsCandidate(pid=2, path="/p/2", dev=1, inode=11, starttime=2)
    addrs = {10: {"10.0.0.5", "10.0.0.6"}, 11: {"10.0.0.6"}}
    found = match_pods([both, own_v], {"u": ["10.0.0.5"], "v": ["10.0.0.6"]}, lambda c: addrs[c.inode])
    assert found == {}


def test_finder_asks_each_namespace_once(tmp_path):
    ns_a = tmp_path / "ns-a"
    ns_a.write_text("")
    proc = tmp_path / "proc"
    make_proc(proc, 10, ns_a, starttime=5)
    make_proc(proc, 11, ns_a, starttime=6)

    class Probe:
        def __init__(self):
            self.asked = []

        def addresses(self, path):
            self.asked.append(path)
            return {"10.0.0.5"}

    probe = Probe()
    finder = NetnsFinder(
        probe, proc_root=proc, host_netns_path=str(tmp_path / "none"), own_netns_path=str(tmp_path / "none")
    )
    found = finder.find({"u": ["10.0.0.5"], "v": ["10.0.0.6"]})
    assert found["u"].pid == 10 and "v" not in found
    assert probe.asked == [f"{proc}/10/ns/net"]
