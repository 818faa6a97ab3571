"""Dedicated-mode capture rules (golden files) and the host plumbing they are applied through.

Rendered rules are compared with tests/unit/golden/*.rules; `UPDATE_GOLDEN=1` rewrites them.
The host-plumbing tests here (runner, namespace naming, Fabric command plans) need no root: they
drive the code through RecordingRunner, or run harmless commands (`true`, `cat`, `sh`).
"""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ambient_mesh.capture.dedicated import (
    apply_dedicated_rules,
    policy_route_commands,
    remove_dedicated_rules,
    render_dedicated_rules,
)
from ambient_mesh.errors import AmbientError, ConfigError
from ambient_mesh.host.commands import (
    MISSING_BINARY_HINT,
    CommandError,
    RecordingRunner,
    SubprocessRunner,
    netns_argv,
)
from ambient_mesh.host.netns import (
    Fabric,
    cleanup_stale_namespaces,
    creator_pid,
    parse_netns_list,
    run_prefix,
    stale_namespaces,
)
from tests.helpers.paths import UNIT_GOLDEN

GOLDEN_DIR = UNIT_GOLDEN
UPDATE_GOLDEN = os.environ.get("UPDATE_GOLDEN") == "1"

GOLDEN_CASES = {
    "dedicated_v4": {},
    "dedicated_v6": {"ipv6": True},
    "dedicated_transparent_v4": {"transparent": True},
    "dedicated_transparent_v6": {"transparent": True, "ipv6": True},
    "dedicated_custom_v4": {
        "mark": 0x1234,
        "outbound_port": 25001,
        "inbound_plaintext_port": 25006,
        "hbone_port": 25008,
        "exclude_uids": (0, 1337),
    },
}


def assert_golden(name: str, text: str) -> None:
    path = GOLDEN_DIR / f"{name}.rules"
    if UPDATE_GOLDEN:
        GOLDEN_DIR.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"golden file {path} missing: run with UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(), f"rendered rules differ from {path} (UPDATE_GOLDEN=1 regenerates)"


# --- rendering -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_rendered_rules_match_golden(name):
    assert_golden(name, render_dedicated_rules(**GOLDEN_CASES[name]))


def test_default_rules_redirect_outbound_and_inbound_but_skip_mark_loopback_and_hbone():
    lines = render_dedicated_rules().splitlines()
    assert "-A AMBIENT_OUTPUT -m mark --mark 0x539 -j RETURN" in lines
    assert "-A AMBIENT_OUTPUT -o lo -j RETURN" in lines
    assert "-A AMBIENT_PRERT -p tcp --dport 15008 -j RETURN" in lines
    assert "-A AMBIENT_PRERT -i lo -j RETURN" in lines
    # every exemption comes before the REDIRECT it protects against
    assert lines.index("-A AMBIENT_OUTPUT -m mark --mark 0x539 -j RETURN") < lines.index(
        "-A AMBIENT_OUTPUT -p tcp -j REDIRECT --to-ports 15001"
    )
    assert lines.index("-A AMBIENT_PRERT -p tcp --dport 15008 -j RETURN") < lines.index(
        "-A AMBIENT_PRERT -p tcp -j REDIRECT --to-ports 15006"
    )
    assert "*mangle" not in lines


def test_transparent_rules_tag_marked_connections_and_note_policy_routes():
    text = render_dedicated_rules(transparent=True)
    assert "-A AMBIENT_PRERT -m mark --mark 0x539 -j CONNMARK --set-xmark 0x111/0xfff" in text
    assert "--restore-mark" in text
    for argv in policy_route_commands():
        assert f"#   {' '.join(argv)}" in text


def test_ipv6_rules_use_ipv6_loopback():
    text = render_dedicated_rules(ipv6=True)
    assert "-d ::1/128" in text
    assert "127.0.0.0/8" not in text


@pytest.mark.parametrize(
    "kwargs, source",
    [
        ({"mark": 0}, "PACKET_MARK"),
        ({"mark": 1 << 32}, "PACKET_MARK"),
        ({"outbound_port": 0}, "outbound_port"),
        ({"inbound_plaintext_port": 70000}, "inbound_plaintext_port"),
        ({"hbone_port": -1}, "hbone_port"),
        ({"exclude_uids": (-5,)}, "exclude_uids"),
    ],
)
def test_bad_parameters_are_config_errors(kwargs, source):
    with pytest.raises(ConfigError) as info:
        render_dedicated_rules(**kwargs)
    assert info.value.source == source


@given(
    mark=st.integers(1, 0xFFFFFFFF),
    port=st.integers(1, 65535),
    uids=st.lists(st.integers(0, 0xFFFFFFFF), max_size=3),
    transparent=st.booleans(),
    ipv6=st.booleans(),
)
def test_any_valid_parameters_render_one_restore_table_per_commit(mark, port, uids, transparent, ipv6):
    text = render_dedicated_rules(
        mark=mark, outbound_port=port, exclude_uids=uids, transparent=transparent, ipv6=ipv6
    )
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    tables = [line for line in lines if line.startswith("*")]
    assert tables == (["*mangle", "*nat"] if transparent else ["*nat"])
    assert lines.count("COMMIT") == len(tables)
    assert f"-A AMBIENT_OUTPUT -m mark --mark {mark:#x} -j RETURN" in lines
    assert lines[-2] == f"-A AMBIENT_OUTPUT -p tcp -j REDIRECT --to-ports {port}"


# --- applying and removing -----------------------------------------------------------------------


def test_apply_removes_old_rules_then_restores_inside_the_namespace():
    runner = RecordingRunner()
    rules = render_dedicated_rules()
    apply_dedicated_rules(runner, "am-1-1-pod", rules)
    assert all(call.netns == "am-1-1-pod" for call in runner.calls)
    restore = [c for c in runner.calls if c.argv[0] == "iptables-restore"]
    assert len(restore) == 1
    assert restore[0].argv == ("iptables-restore", "--noflush")
    assert restore[0].input == rules.encode()
    assert restore[0].check
    index = runner.calls.index(restore[0])
    assert ("iptables", "-t", "nat", "-D", "OUTPUT", "-j", "AMBIENT_OUTPUT") in runner.argvs[:index]
    assert ("iptables", "-t", "nat", "-X", "AMBIENT_PRERT") in runner.argvs[:index]
    # no policy routes for the plain REDIRECT set
    assert not [argv for argv in runner.argvs[index:] if argv[:4] == ("ip", "-4", "rule", "add")]


def test_apply_transparent_v6_installs_policy_routes_after_the_rules():
    runner = RecordingRunner()
    apply_dedicated_rules(runner, "pod", render_dedicated_rules(transparent=True, ipv6=True), ipv6=True)
    argvs = runner.argvs
    index = argvs.index(("ip6tables-restore", "--noflush"))
    assert argvs[index + 1 :] == list(policy_route_commands(ipv6=True))
    assert all(c.check for c in runner.calls[index:])


def test_apply_failure_is_a_command_error_naming_the_command():
    runner = RecordingRunner()
    runner.respond(["iptables-restore"], returncode=2, stderr="iptables-restore: line 3 failed")
    with pytest.raises(CommandError) as info:
        apply_dedicated_rules(runner, "pod", render_dedicated_rules())
    assert info.value.returncode == 2
    assert "line 3 failed" in str(info.value)
    assert "iptables-restore --noflush" in str(info.value)
    assert "pod" in str(info.value)


def test_remove_deletes_repeated_jumps_until_none_is_left_and_ignores_failures():
    runner = RecordingRunner()
    nat_output_jump = ["iptables", "-t", "nat", "-D", "OUTPUT", "-j", "AMBIENT_OUTPUT"]
    runner.respond(["iptables", "-t"], returncode=1, stderr="No chain/target/match by that name.")
    runner.respond(["ip", "-4", "rule", "del"], returncode=2)
    runner.respond(nat_output_jump, returncode=0, times=2)  # the jump was installed twice
    remove_dedicated_rules(runner, "pod")
    assert runner.argvs.count(tuple(nat_output_jump)) == 3
    assert runner.argvs.count(("iptables", "-t", "nat", "-D", "PREROUTING", "-j", "AMBIENT_PRERT")) == 1
    assert ("iptables", "-t", "mangle", "-X", "AMBIENT_OUTPUT") in runner.argvs
    assert ("ip", "-4", "route", "flush", "table", "100") in runner.argvs
    assert not any(c.check for c in runner.calls)


# --- command runners -----------------------------------------------------------------------------


def test_subprocess_runner_returns_output_and_passes_input():
    result = SubprocessRunner().run(["cat"], input=b"rules\n")
    assert result.ok and result.stdout == b"rules\n"


def test_subprocess_runner_raises_with_exit_code_and_stderr():
    with pytest.raises(CommandError) as info:
        SubprocessRunner().run([sys.executable, "-c", "import sys; sys.stderr.write('nope'); sys.exit(3)"])
    assert info.value.returncode == 3
    assert info.value.stderr == "nope"
    assert "exited with code 3: nope" in str(info.value)
    assert isinstance(info.value, AmbientError)


def test_subprocess_runner_without_check_returns_the_failure():
    result = SubprocessRunner().run(["false"], check=False)
    assert not result.ok and result.returncode == 1


def test_missing_binary_raises_with_install_hint_even_without_check():
    with pytest.raises(CommandError) as info:
        SubprocessRunner().run(["am-no-such-binary-xyz"], check=False)
    assert info.value.hint == MISSING_BINARY_HINT
    assert info.value.returncode is None


def test_netns_argv_wraps_in_ip_netns_exec():
    assert netns_argv(["iptables-save"], None) == ["iptables-save"]
    assert netns_argv(["iptables-save"], "am-1-1-a") == ["ip", "netns", "exec", "am-1-1-a", "iptables-save"]


def test_recording_runner_matches_prefix_and_netns_and_counts_down():
    runner = RecordingRunner()
    runner.respond(["ip", "netns", "list"], stdout="x (id: 0)\n", netns="inner", times=1)
    assert runner.run(["ip", "netns", "list"]).stdout == b""
    assert runner.run(["ip", "netns", "list"], netns="inner").stdout == b"x (id: 0)\n"
    assert runner.run(["ip", "netns", "list"], netns="inner").stdout == b""
    assert repr(runner) == "RecordingRunner(3 calls, 1 canned results)"


# --- namespace names -----------------------------------------------------------------------------


def test_run_prefixes_are_unique_and_carry_the_pid():
    first, second = run_prefix(pid=42), run_prefix(pid=42)
    assert first != second
    assert creator_pid(first + "node-a") == 42
    assert creator_pid("cni-1234") is None
    assert creator_pid("am-x-1-a") is None


def test_parse_netns_list_handles_ids_and_blank_lines():
    text = "am-7-1-net (id: 2)\n\nam-7-1-a (id: 1)\nplain\n"
    assert parse_netns_list(text) == ["am-7-1-net", "am-7-1-a", "plain"]


@given(st.text())
def test_parse_netns_list_never_fails_and_yields_single_tokens(text):
    for name in parse_netns_list(text):
        assert name and not any(ch.isspace() for ch in name)


def test_stale_namespaces_are_ours_with_a_dead_creator():
    names = ["am-10-1-a", "am-20-1-a", "other-30-1", "am-10-2-net"]
    assert stale_namespaces(names, alive=lambda pid: pid == 20) == ["am-10-1-a", "am-10-2-net"]


def test_cleanup_stale_namespaces_deletes_only_stale_ones():
    runner = RecordingRunner()
    runner.respond(["ip", "netns", "list"], stdout="am-10-1-a (id: 0)\nam-20-1-b\nmine\n")
    removed = cleanup_stale_namespaces(runner, alive=lambda pid: pid == 20)
    assert removed == ["am-10-1-a"]
    assert ("ip", "netns", "delete", "am-10-1-a") in runner.argvs
    assert not [a for a in runner.argvs if a[:3] == ("ip", "netns", "delete") and a[3] != "am-10-1-a"]


# --- the fabric's command plan --------------------------------------------------------------------


def test_fabric_wires_nodes_only_inside_its_own_namespaces_and_tears_down():
    runner = RecordingRunner()
    with Fabric(runner=runner, prefix="am-9-1-") as fabric:
        node = fabric.add_node("a")
        assert str(node.ipv4) == "10.240.0.11" and node.netns == "am-9-1-a"
        assert repr(fabric) == "Fabric('am-9-1-', up, 1 nodes, 0 processes running, subnet 10.240.0.0/24)"
    argvs = runner.argvs
    # every `ip` change names a namespace: the root namespace is never touched
    for argv in argvs:
        if argv[0] == "ip" and argv[1] != "netns":
            assert argv[1] == "-n" and argv[2].startswith("am-9-1-"), argv
    assert (
        "ip",
        "-n",
        "am-9-1-a",
        "link",
        "add",
        "eth0",
        "type",
        "veth",
        "peer",
        "name",
        "vp0",
        "netns",
        "am-9-1-net",
    ) in argvs
    assert ("ip", "-n", "am-9-1-a", "route", "replace", "default", "via", "10.240.0.1") in argvs
    deletes = [a[3] for a in argvs if a[:3] == ("ip", "netns", "delete")]
    assert deletes == ["am-9-1-a", "am-9-1-net"]
    assert fabric.namespaces == []


def test_fabric_tears_down_what_it_built_when_wiring_fails():
    runner = RecordingRunner()
    runner.respond(["ip", "-n", "am-9-2-b", "addr", "add"], returncode=2, stderr="RTNETLINK answers: no")
    with pytest.raises(CommandError), Fabric(runner=runner, prefix="am-9-2-") as fabric:
        fabric.add_node("a")
        fabric.add_node("b")
    deletes = [a[3] for a in runner.argvs if a[:3] == ("ip", "netns", "delete")]
    assert deletes == ["am-9-2-b", "am-9-2-a", "am-9-2-net"]


def test_fabric_refuses_duplicate_nodes_and_foreign_namespaces():
    with Fabric(runner=RecordingRunner(), prefix="am-9-3-", subnet6=None) as fabric:
        fabric.add_node("a")
        with pytest.raises(AmbientError):
            fabric.add_node("a")
        with pytest.raises(AmbientError):
            fabric.spawn("somebody-else", ["true"])
