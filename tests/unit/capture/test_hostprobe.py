"""Host-side kubelet-probe SNAT: rendering (golden files), plans and probe-set membership.

Golden files: tests/unit/golden/inpod/host_*.rules (`UPDATE_GOLDEN=1` rewrites them). Set
membership logic runs against an in-memory ProbeSet; the nft set driver against RecordingRunner.
"""

from __future__ import annotations

import ipaddress
import json
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ambient_mesh.capture.apply import Backend, PlanAction, RuleStateError
from ambient_mesh.capture.hostprobe import (
    HostProbeConfig,
    IPAddress,
    NftProbeSet,
    add_pod_to_probe_set,
    apply_host_probe_rules,
    parse_nft_set_json,
    plan_host_rules,
    plan_prune,
    remove_pod_from_probe_set,
    render_host_iptables,
    render_host_nftables,
    sync_probe_set,
)
from ambient_mesh.capture.inpod import IpFamily
from ambient_mesh.errors import ConfigError
from ambient_mesh.host.commands import RecordingRunner
from tests.helpers.paths import UNIT_GOLDEN

GOLDEN_DIR = UNIT_GOLDEN / "inpod"
UPDATE_GOLDEN = os.environ.get("UPDATE_GOLDEN") == "1"
KUBELET_UID = 1000


def assert_golden(name: str, text: str) -> None:
    path = GOLDEN_DIR / name
    if UPDATE_GOLDEN:
        GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"golden file {path} missing: run with UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(), f"rendered rules differ from {path} (UPDATE_GOLDEN=1 regenerates)"


@pytest.mark.parametrize(
    ("name", "render"),
    [
        ("host.iptables_v4.hostrules", lambda: render_host_iptables(HostProbeConfig())),
        ("host_ipv6.iptables_v4.hostrules", lambda: render_host_iptables(HostProbeConfig(ipv6=True))),
        (
            "host_ipv6.iptables_v6.hostrules",
            lambda: render_host_iptables(HostProbeConfig(ipv6=True), IpFamily.V6),
        ),
        ("host.nftables.hostrules", lambda: render_host_nftables(HostProbeConfig(kubelet_uid=KUBELET_UID))),
        (
            "host_ipv6.nftables.hostrules",
            lambda: render_host_nftables(HostProbeConfig(ipv6=True, kubelet_uid=KUBELET_UID)),
        ),
    ],
)
def test_host_rules_match_golden(name, render):
    assert_golden(name, render())


def test_iptables_host_rule_is_reference_3_7():
    lines = render_host_iptables(HostProbeConfig()).splitlines()
    assert "-I POSTROUTING 1 -j ISTIO_POSTRT" in lines
    assert (
        "-A ISTIO_POSTRT -m owner --socket-exists -p tcp -m set --match-set istio-inpod-probes-v4 dst "
        "-j SNAT --to-source 169.254.7.127"
    ) in lines
    v6 = render_host_iptables(HostProbeConfig(ipv6=True), IpFamily.V6)
    assert "istio-inpod-probes-v6 dst -j SNAT --to-source fd16:9254:7127:1337:ffff:ffff:ffff:ffff" in v6


def test_nft_host_rule_matches_the_kubelet_uid_and_keeps_set_members():
    text = render_host_nftables(HostProbeConfig(kubelet_uid=KUBELET_UID))
    assert (
        "add rule inet istio-ambient-nat postrouting meta l4proto tcp skuid 1000 "
        "ip daddr @istio-inpod-probes-v4 counter snat ip to 169.254.7.127"
    ) in text
    assert "flush chain inet istio-ambient-nat postrouting" in text
    assert "flush table" not in text and "flush set" not in text


def test_nft_host_rule_needs_a_kubelet_uid():
    with pytest.raises(ConfigError):
        render_host_nftables(HostProbeConfig())


@pytest.mark.parametrize(
    "kwargs",
    [
        {"probe_ipv4": ipaddress.IPv4Address("10.1.1.1")},
        {"set_prefix": "x y"},
        {"set_prefix": "a" * 40},
        {"kubelet_uid": -1},
    ],
)
def test_bad_host_config_is_refused(kwargs):
    with pytest.raises(ConfigError):
        HostProbeConfig(**kwargs)


def test_host_plan_deletes_then_creates():
    saved = {
        IpFamily.V4: "*nat\n:POSTROUTING ACCEPT [0:0]\n:ISTIO_POSTRT - [0:0]\n"
        "-A POSTROUTING -j ISTIO_POSTRT\n-A POSTROUTING -j KUBE-POSTROUTING\nCOMMIT\n"
    }
    plan = plan_host_rules(HostProbeConfig(), Backend.IPTABLES, saved)
    assert plan.action is PlanAction.RECONCILE
    assert [s.argv for s in plan.steps] == [
        ("iptables", "-w", "-t", "nat", "-D", "POSTROUTING", "-j", "ISTIO_POSTRT"),
        ("iptables", "-w", "-t", "nat", "-F", "ISTIO_POSTRT"),
        ("iptables", "-w", "-t", "nat", "-X", "ISTIO_POSTRT"),
        ("iptables-restore", "-w", "--noflush"),
    ]
    clean = plan_host_rules(HostProbeConfig(), Backend.IPTABLES, {IpFamily.V4: "*nat\nCOMMIT\n"})
    assert clean.action is PlanAction.CREATE and len(clean.steps) == 1


# --- membership ----------------------------------------------------------------------------------


class MemorySet:
    """An in-memory ProbeSet."""

    def __init__(self) -> None:
        self.members: dict[IPAddress, str] = {}
        self.ensured = 0

    def ensure(self) -> None:
        self.ensured += 1

    def entries(self) -> dict[IPAddress, str]:
        return dict(self.members)

    def upsert(self, ip: IPAddress, uid: str) -> None:
        self.members[ip] = uid

    def delete(self, ip: IPAddress) -> None:
        del self.members[ip]

    def flush(self) -> None:
        self.members.clear()

    def destroy(self) -> None:
        self.members.clear()


def ip(text: str) -> IPAddress:
    return ipaddress.ip_address(text)


def test_add_unmaps_v4_and_skips_v6_when_ipv6_is_off():
    sets = MemorySet()
    add_pod_to_probe_set(sets, HostProbeConfig(), "uid-a", ["::ffff:10.0.0.5", "fd00::5"])
    assert sets.members == {ip("10.0.0.5"): "uid-a"}
    add_pod_to_probe_set(sets, HostProbeConfig(ipv6=True), "uid-a", ["fd00::5"])
    assert sets.members[ip("fd00::5")] == "uid-a"


def test_remove_only_takes_entries_that_carry_the_pods_uid():
    sets = MemorySet()
    cfg = HostProbeConfig()
    add_pod_to_probe_set(sets, cfg, "old-pod", ["10.0.0.5"])
    add_pod_to_probe_set(sets, cfg, "new-pod", ["10.0.0.5"])  # the IP was reused: upsert re-comments
    assert remove_pod_from_probe_set(sets, cfg, "old-pod", ["10.0.0.5"]) == [(ip("10.0.0.5"), "new-pod")]
    assert sets.members == {ip("10.0.0.5"): "new-pod"}
    assert remove_pod_from_probe_set(sets, cfg, "new-pod", ["10.0.0.5", "10.0.0.9"]) == []
    assert sets.members == {}


def test_prune_only_from_a_complete_snapshot():
    current = {ip("10.0.0.1"): "a", ip("10.0.0.2"): "b"}
    assert plan_prune(current, {ip("10.0.0.1"): "a"}, complete=True) == [ip("10.0.0.2")]
    assert plan_prune(current, {ip("10.0.0.1"): "a"}, complete=False) == []


def test_sync_upserts_and_prunes():
    sets = MemorySet()
    sets.members = {ip("10.0.0.1"): "stale", ip("10.0.0.2"): "b"}
    pruned = sync_probe_set(
        sets, HostProbeConfig(), {"a": ["10.0.0.1"], "b": ["10.0.0.2"], "c": ["10.0.0.3"]}
    )
    assert pruned == []
    assert sets.members == {ip("10.0.0.1"): "a", ip("10.0.0.2"): "b", ip("10.0.0.3"): "c"}
    assert sync_probe_set(sets, HostProbeConfig(), {"c": ["10.0.0.3"]}) == [ip("10.0.0.1"), ip("10.0.0.2")]


def test_apply_host_rules_creates_the_sets_first():
    sets = MemorySet()
    runner = RecordingRunner()
    runner.respond(["iptables-save"], stdout="*nat\nCOMMIT\n")
    plan = apply_host_probe_rules(runner, "node", HostProbeConfig(), Backend.IPTABLES, sets)
    assert sets.ensured == 1 and plan.action is PlanAction.CREATE
    assert runner.calls[-1].input == render_host_iptables(HostProbeConfig()).encode()


# --- nft sets ------------------------------------------------------------------------------------


def nft_json(*elems) -> str:
    return json.dumps(
        {
            "nftables": [
                {"metainfo": {"json_schema_version": 1}},
                {
                    "set": {
                        "family": "inet",
                        "name": "istio-inpod-probes-v4",
                        "table": "istio-ambient-nat",
                        "type": "ipv4_addr",
                        "elem": list(elems),
                    }
                },
            ]
        }
    )


def test_parse_nft_set_json_reads_members_and_comments():
    text = nft_json({"elem": {"val": "10.0.0.1", "comment": "uid-1"}}, "10.0.0.2")
    assert parse_nft_set_json(text) == {ip("10.0.0.1"): "uid-1", ip("10.0.0.2"): ""}
    assert parse_nft_set_json(json.dumps({"nftables": [{"set": {"name": "x"}}]})) == {}


@pytest.mark.parametrize(
    "text",
    [
        "",
        "[]",
        '{"nftables": 3}',
        nft_json({"elem": {"val": "nope"}}),
        nft_json(7),
        nft_json({"elem": {"val": "10.0.0.1", "comment": 5}}),
    ],
)
def test_parse_nft_set_json_rejects_garbage(text):
    with pytest.raises(RuleStateError):
        parse_nft_set_json(text)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(["nftables", "set", "elem", "val", "comment", "x"]), inner, max_size=4
        )
    ),
    max_leaves=20,
)


@given(json_values)
def test_parse_nft_set_json_returns_members_or_rule_state_error(value):
    try:
        members = parse_nft_set_json(json.dumps(value))
    except RuleStateError:
        return
    assert all(isinstance(k, ipaddress.IPv4Address | ipaddress.IPv6Address) for k in members)


def test_nft_upsert_recomments_an_existing_member_in_one_transaction():
    runner = RecordingRunner()
    runner.respond(
        ["nft", "-j", "list", "set"], stdout=nft_json({"elem": {"val": "10.0.0.1", "comment": "old"}})
    )
    sets = NftProbeSet(runner, "node", HostProbeConfig())
    sets.upsert(ip("10.0.0.1"), "new")
    script = runner.calls[-1].input.decode()
    assert script == (
        "delete element inet istio-ambient-nat istio-inpod-probes-v4 { 10.0.0.1 }\n"
        'add element inet istio-ambient-nat istio-inpod-probes-v4 { 10.0.0.1 comment "new" }\n'
    )
    calls = len(runner.calls)
    sets.upsert(ip("10.0.0.1"), "old")  # already so: no write
    assert len(runner.calls) == calls + 1
    assert repr(sets) == "NftProbeSet(istio-inpod-probes-v4 in node)"


def test_nft_comment_cannot_break_out_of_quotes():
    runner = RecordingRunner()
    runner.respond(["nft", "-j", "list", "set"], stdout=nft_json())
    with pytest.raises(ConfigError):
        NftProbeSet(runner, None, HostProbeConfig()).upsert(ip("10.0.0.1"), 'x" }; flush ruleset; {"')
