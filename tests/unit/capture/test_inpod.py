"""In-pod redirection rules: rendering (golden files), pod overrides, and apply/remove plans.

Golden files live in tests/unit/golden/inpod/; `UPDATE_GOLDEN=1` rewrites them. Plans are
checked without running anything: observations are built by hand or from iptables-save text,
and execution goes through RecordingRunner.
"""

from __future__ import annotations

import ipaddress
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ambient_mesh.capture.apply import (
    Backend,
    InpodObservation,
    IptablesState,
    PlanAction,
    RulePlan,
    RuleStateError,
    Step,
    apply_inpod_rules,
    execute_plan,
    parse_iptables_save,
    parse_nft_tables,
    plan_inpod_apply,
    plan_inpod_remove,
    remove_inpod_rules,
)
from ambient_mesh.capture.inpod import (
    InpodConfig,
    IpFamily,
    PodDns,
    PodLevelOverrides,
    iptables_rule_set,
    parse_go_bool,
    render_iptables,
    render_nftables,
    routing_commands,
    routing_removal_commands,
)
from ambient_mesh.errors import AmbientError, ConfigError
from ambient_mesh.host.commands import CommandError, RecordingRunner
from ambient_mesh.metadata import (
    ANNOTATION_BYPASS_INBOUND,
    ANNOTATION_DNS_CAPTURE,
    ANNOTATION_VIRTUAL_INTERFACES,
)
from tests.helpers.paths import UNIT_GOLDEN

GOLDEN_DIR = UNIT_GOLDEN / "inpod"
UPDATE_GOLDEN = os.environ.get("UPDATE_GOLDEN") == "1"

VIRTUAL = ("fake1s0f0", "fake1s0f1")
# name -> (InpodConfig kwargs); every case is rendered for iptables v4 (+ v6 when ipv6) and nftables.
CASES = {
    "default": {},
    "default_ipv6": {"ipv6": True},
    "dns_off": {"redirect_dns": False},
    "dns_off_ipv6": {"redirect_dns": False, "ipv6": True},
    "ingress": {"ingress_mode": True},
    "ingress_ipv6": {"ingress_mode": True, "ipv6": True},
    "virtual_interfaces": {"virtual_interfaces": VIRTUAL},
    "virtual_interfaces_ipv6": {"virtual_interfaces": VIRTUAL, "ipv6": True},
    "ingress_and_virtual_interfaces": {"ingress_mode": True, "virtual_interfaces": VIRTUAL},
    "ingress_and_virtual_interfaces_ipv6": {
        "ingress_mode": True,
        "virtual_interfaces": VIRTUAL,
        "ipv6": True,
    },
}


def assert_golden(name: str, text: str) -> None:
    path = GOLDEN_DIR / name
    if UPDATE_GOLDEN:
        GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"golden file {path} missing: run with UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(), f"rendered rules differ from {path} (UPDATE_GOLDEN=1 regenerates)"


def golden_params():
    for case, kwargs in sorted(CASES.items()):
        cfg = InpodConfig(**kwargs)
        for family in cfg.families:
            yield pytest.param(
                f"{case}.iptables_v{family.value}.rules", cfg, family, id=f"{case}-ipt-v{family.value}"
            )
        yield pytest.param(f"{case}.nftables.rules", cfg, None, id=f"{case}-nft")


@pytest.mark.parametrize(("name", "cfg", "family"), list(golden_params()))
def test_rendered_rules_match_golden(name, cfg, family):
    text = render_nftables(cfg) if family is None else render_iptables(cfg, family)
    assert_golden(name, text)


def test_every_golden_file_has_a_case():
    expected = {p.values[0] for p in golden_params()}
    on_disk = {p.name for p in GOLDEN_DIR.glob("*.rules")} if GOLDEN_DIR.exists() else set()
    assert on_disk == expected


# --- the facts of docs/istio-behaviour.md, "In-pod redirection rules", line by line ---------------


def lines_of(cfg: InpodConfig, family: IpFamily = IpFamily.V4) -> list[str]:
    return render_iptables(cfg, family).splitlines()


def section(lines: list[str], table: str) -> list[str]:
    start = lines.index(f"*{table}")
    return lines[start + 1 : lines.index("COMMIT", start)]


def test_default_v4_rules_are_istio_cnis_in_order():
    lines = lines_of(InpodConfig())
    assert section(lines, "mangle") == [
        "-N ISTIO_PRERT",
        "-N ISTIO_OUTPUT",
        "-A PREROUTING -j ISTIO_PRERT",
        "-A OUTPUT -j ISTIO_OUTPUT",
        "-A ISTIO_PRERT -m mark --mark 0x539/0xfff -j CONNMARK --set-xmark 0x111/0xfff",
        "-A ISTIO_OUTPUT -m connmark --mark 0x111/0xfff -j CONNMARK --restore-mark --nfmask 0xffffffff "
        "--ctmask 0xffffffff",
    ]
    nat = section(lines, "nat")
    assert [line for line in nat if line.startswith("-A ISTIO_PRERT")] == [
        "-A ISTIO_PRERT -s 169.254.7.127 -p tcp -m tcp -j ACCEPT",
        "-A ISTIO_PRERT ! -d 127.0.0.1/32 -p tcp ! --dport 15008 -m mark ! --mark 0x539/0xfff "
        "-j REDIRECT --to-ports 15006",
    ]
    assert [line for line in nat if line.startswith("-A ISTIO_OUTPUT")] == [
        "-A ISTIO_OUTPUT -d 169.254.7.127 -p tcp -m tcp -j ACCEPT",
        "-A ISTIO_OUTPUT ! -o lo -p udp -m mark ! --mark 0x539/0xfff -m udp --dport 53 -j REDIRECT --to-port 15053",
        "-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -p tcp --dport 53 -m mark ! --mark 0x539/0xfff "
        "-j REDIRECT --to-ports 15053",
        "-A ISTIO_OUTPUT -p tcp -m mark --mark 0x111/0xfff -j ACCEPT",
        "-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -o lo -j ACCEPT",
        "-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -p tcp -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15001",
    ]
    assert nat.index("-A OUTPUT -j ISTIO_OUTPUT") < nat.index("-A PREROUTING -j ISTIO_PRERT")
    assert section(lines, "raw")[-2:] == [
        "-A ISTIO_OUTPUT -p udp -m mark --mark 0x539/0xfff -m udp --dport 53 -j CT --zone 1",
        "-A ISTIO_PRERT -p udp -m mark ! --mark 0x539/0xfff -m udp --sport 53 -j CT --zone 1",
    ]


def test_tables_come_in_alphabetical_order():
    tables = [line for line in lines_of(InpodConfig()) if line.startswith("*")]
    assert tables == ["*mangle", "*nat", "*raw"]


def test_ipv6_rules_substitute_loopback_and_probe_address():
    text = render_iptables(InpodConfig(ipv6=True), IpFamily.V6)
    assert "127.0.0.1" not in text and "169.254.7.127" not in text
    assert "-A ISTIO_PRERT -s fd16:9254:7127:1337:ffff:ffff:ffff:ffff -p tcp -m tcp -j ACCEPT" in text
    assert "-A ISTIO_OUTPUT ! -d ::1/128 -o lo -j ACCEPT" in text


def test_ipv6_rules_are_refused_when_ipv6_is_off():
    with pytest.raises(ConfigError):
        render_iptables(InpodConfig(), IpFamily.V6)


def test_dns_off_drops_the_dns_rules_and_the_raw_table():
    text = render_iptables(InpodConfig(redirect_dns=False))
    assert "*raw" not in text and "15053" not in text and "CT --zone" not in text
    nft = render_nftables(InpodConfig(redirect_dns=False))
    assert "istio-ambient-raw" not in nft and "15053" not in nft


def test_ingress_mode_keeps_connmark_but_drops_inbound_capture():
    lines = lines_of(InpodConfig(ingress_mode=True))
    assert "-A ISTIO_PRERT -m mark --mark 0x539/0xfff -j CONNMARK --set-xmark 0x111/0xfff" in lines
    assert not any("15006" in line for line in lines)
    assert not any(line.startswith("-A ISTIO_PRERT -s ") for line in lines)
    assert "-A ISTIO_OUTPUT -d 169.254.7.127 -p tcp -m tcp -j ACCEPT" in lines
    nft = render_nftables(InpodConfig(ingress_mode=True))
    assert "redirect to :15006" not in nft and "ct mark set" in nft and "saddr 169.254.7.127" not in nft


def test_virtual_interfaces_come_first_in_nat_prerouting():
    nat = section(lines_of(InpodConfig(virtual_interfaces=("veth7", "tap0"))), "nat")
    prert = [line for line in nat if line.startswith("-A ISTIO_PRERT")]
    assert prert[:4] == [
        "-A ISTIO_PRERT -i veth7 -p tcp -j REDIRECT --to-ports 15001",
        "-A ISTIO_PRERT -i veth7 -p tcp -j RETURN",
        "-A ISTIO_PRERT -i tap0 -p tcp -j REDIRECT --to-ports 15001",
        "-A ISTIO_PRERT -i tap0 -p tcp -j RETURN",
    ]


def test_nftables_default_has_three_inet_tables_with_istio_chains():
    text = render_nftables(InpodConfig())
    for table in ("istio-ambient-nat", "istio-ambient-mangle", "istio-ambient-raw"):
        assert f"add table inet {table}\nflush table inet {table}\n" in text
    assert "add chain inet istio-ambient-nat prerouting { type nat hook prerouting priority -100 ; }" in text
    assert "add chain inet istio-ambient-mangle output { type route hook output priority -150 ; }" in text
    assert (
        "add chain inet istio-ambient-raw prerouting { type filter hook prerouting priority -300 ; }" in text
    )
    assert (
        "add rule inet istio-ambient-nat istio-prerouting meta l4proto tcp ip saddr 169.254.7.127 "
        "counter accept"
    ) in text
    assert " ip6 " not in text  # IPv6 off: no v6 address rules


def test_nftables_ipv6_adds_v6_variants():
    text = render_nftables(InpodConfig(ipv6=True))
    assert "ip6 daddr != ::1/128 tcp dport != 15008" in text
    assert "ip6 saddr fd16:9254:7127:1337:ffff:ffff:ffff:ffff counter accept" in text


def test_custom_ports_and_marks_flow_into_every_backend():
    cfg = InpodConfig(
        outbound_port=25001, inbound_plaintext_port=25006, hbone_port=25008, dns_port=25053, mark=0x1234
    )
    for text in (render_iptables(cfg), render_nftables(cfg)):
        assert "15001" not in text and "15006" not in text and "15008" not in text and "15053" not in text
        assert "0x1234" in text and "0x539" not in text


@pytest.mark.parametrize(
    "kwargs",
    [
        {"outbound_port": 0},
        {"hbone_port": 70000},
        {"mark": 0},
        {"connmark": 1 << 33},
        {"probe_ipv4": ipaddress.IPv4Address("10.0.0.1")},
        {"virtual_interfaces": ("eth0 -j ACCEPT",)},
        {"virtual_interfaces": ("a" * 16,)},
    ],
)
def test_bad_config_is_refused(kwargs):
    with pytest.raises(ConfigError):
        InpodConfig(**kwargs)


def test_routing_commands_follow_reference_3_4():
    assert routing_commands(InpodConfig()) == (
        ("ip", "-4", "rule", "add", "fwmark", "0x111/0xfff", "pref", "32764", "lookup", "100"),
        ("ip", "-4", "route", "replace", "local", "0.0.0.0/0", "dev", "lo", "table", "100"),
    )
    v6 = routing_commands(InpodConfig(ipv6=True))
    assert ("ip", "-6", "route", "replace", "local", "::/0", "dev", "lo", "table", "100") in v6
    assert not any("::/0" in argv for argv in routing_commands(InpodConfig(ipv6=True), ipv6_loopback=False))
    removal = routing_removal_commands(InpodConfig(ipv6=True))
    assert ("ip", "-6", "rule", "del", "fwmark", "0x111/0xfff", "pref", "32764", "lookup", "100") in removal


# --- pod-level overrides ---------------------------------------------------------------------------


def test_overrides_from_annotations():
    overrides = PodLevelOverrides.from_annotations(
        {
            ANNOTATION_BYPASS_INBOUND: "true",
            ANNOTATION_DNS_CAPTURE: "F",
            ANNOTATION_VIRTUAL_INTERFACES: "virt0, virt1,,",
        }
    )
    assert overrides == PodLevelOverrides(
        virtual_interfaces=("virt0", "virt1"), ingress_mode=True, dns=PodDns.DISABLED
    )
    assert PodLevelOverrides.from_annotations({ANNOTATION_DNS_CAPTURE: "yes"}).dns is PodDns.UNSET


@pytest.mark.parametrize(
    ("global_dns", "pod_dns", "expected"),
    [
        (True, PodDns.UNSET, True),
        (False, PodDns.UNSET, False),
        (False, PodDns.ENABLED, True),
        (True, PodDns.DISABLED, False),
    ],
)
def test_pod_dns_override_beats_the_global_setting(global_dns, pod_dns, expected):
    cfg = InpodConfig.for_pod(dns_capture=global_dns, ipv6=False, overrides=PodLevelOverrides(dns=pod_dns))
    assert cfg.redirect_dns is expected


@given(st.text(max_size=8))
def test_parse_go_bool_matches_go(text):
    value = parse_go_bool(text)
    assert value is (
        True
        if text in {"1", "t", "T", "TRUE", "true", "True"}
        else False
        if text in {"0", "f", "F", "FALSE", "false", "False"}
        else None
    )


@given(
    st.dictionaries(
        st.sampled_from(
            [ANNOTATION_BYPASS_INBOUND, ANNOTATION_DNS_CAPTURE, ANNOTATION_VIRTUAL_INTERFACES, "other"]
        ),
        st.text(max_size=40),
    )
)
def test_annotation_parsing_returns_overrides_or_config_error(annotations):
    try:
        overrides = PodLevelOverrides.from_annotations(annotations)
    except ConfigError:
        return
    # whatever was accepted renders into valid-looking rules, one token per interface name
    text = render_iptables(InpodConfig.for_pod(dns_capture=True, ipv6=False, overrides=overrides))
    for name in overrides.virtual_interfaces:
        assert f"-A ISTIO_PRERT -i {name} -p tcp -j RETURN" in text.splitlines()


# --- reading state -------------------------------------------------------------------------------


def saved_text(cfg: InpodConfig, family: IpFamily = IpFamily.V4, *, extra: tuple[str, ...] = ()) -> str:
    """iptables-save-shaped text holding exactly `cfg`'s rules (plus `extra` lines for nat)."""
    rule_set = iptables_rule_set(cfg, family)
    out = ["# Generated by test"]
    for table in ("mangle", "nat", "raw", "filter"):
        out.append(f"*{table}")
        out += [":PREROUTING ACCEPT [0:0]", ":OUTPUT ACCEPT [0:0]"]
        out += [f":{chain} - [0:0]" for chain in rule_set.chains.get(table, ())]
        out += [rule.line for rule in rule_set.rules_in(table)]
        if table == "nat":
            out += list(extra)
        out.append("COMMIT")
    return "\n".join(out) + "\n"


def test_parse_iptables_save_finds_our_chains_and_jumps():
    state = parse_iptables_save(saved_text(InpodConfig()))
    assert ("nat", "ISTIO_OUTPUT") in state.istio_chains()
    assert ("mangle", "PREROUTING", ("-j", "ISTIO_PRERT")) in state.istio_jumps()
    assert len(state.istio_jumps()) == 6
    assert not state.empty
    assert parse_iptables_save("*nat\n:PREROUTING ACCEPT [0:0]\nCOMMIT\n").empty


@pytest.mark.parametrize("text", ["-A FOO -j BAR\n", "*nat\n-Z\n", "*nat\n-A X 'unbalanced\n", "*\n"])
def test_parse_iptables_save_rejects_garbage(text):
    with pytest.raises(RuleStateError):
        parse_iptables_save(text)


@given(st.text(max_size=300))
def test_parse_iptables_save_returns_state_or_rule_state_error(text):
    try:
        state = parse_iptables_save(text)
    except RuleStateError:
        return
    assert isinstance(state, IptablesState)


@given(st.text(max_size=200))
def test_parse_nft_tables_returns_pairs_or_rule_state_error(text):
    try:
        tables = parse_nft_tables(text)
    except RuleStateError:
        return
    assert all(len(pair) == 2 for pair in tables)


# --- plans ---------------------------------------------------------------------------------------


def observed(cfg: InpodConfig, texts: dict[IpFamily, str], *, all_present: bool = True) -> InpodObservation:
    states = {family: parse_iptables_save(text, family) for family, text in texts.items()}
    present = {
        family: frozenset(iptables_rule_set(cfg, family).rules) if all_present else frozenset()
        for family in cfg.families
    }
    return InpodObservation(iptables=states, present=present)


def test_clean_pod_gets_a_create_plan():
    cfg = InpodConfig(ipv6=True)
    plan = plan_inpod_apply(cfg, Backend.IPTABLES, InpodObservation())
    assert plan.action is PlanAction.CREATE
    assert [s.argv for s in plan.steps[:2]] == [
        ("iptables-restore", "-w", "--noflush"),
        ("ip6tables-restore", "-w", "--noflush"),
    ]
    assert plan.steps[0].input == render_iptables(cfg, IpFamily.V4)
    assert [s.argv for s in plan.steps[2:]] == list(routing_commands(cfg))
    assert repr(plan).startswith("RulePlan(iptables create: 6 steps;")


def test_in_sync_pod_needs_nothing_but_the_idempotent_routes():
    cfg = InpodConfig()
    plan = plan_inpod_apply(cfg, Backend.IPTABLES, observed(cfg, {IpFamily.V4: saved_text(cfg)}))
    assert plan.action is PlanAction.NONE, plan.reason
    assert all(step.argv[0] == "ip" for step in plan.steps)


def test_duplicate_jump_triggers_a_guarded_reconcile():
    cfg = InpodConfig()
    plan = plan_inpod_apply(
        cfg,
        Backend.IPTABLES,
        observed(cfg, {IpFamily.V4: saved_text(cfg, extra=("-A OUTPUT -j ISTIO_OUTPUT",))}),
    )
    assert plan.action is PlanAction.RECONCILE
    assert "present 2 times" in plan.reason
    argvs = [s.argv for s in plan.steps]
    install = ("iptables", "-w", "-t", "filter", "-I", "INPUT", "1", "-p", "tcp", "-j", "DROP")
    delete_jump = ("iptables", "-w", "-t", "nat", "-D", "OUTPUT", "-j", "ISTIO_OUTPUT")
    restore = ("iptables-restore", "-w", "--noflush")
    assert argvs.index(install) < argvs.index(delete_jump) < argvs.index(restore)
    assert argvs.count(delete_jump) == 2  # both copies go
    assert ("iptables", "-w", "-t", "filter", "-D", "INPUT", "-p", "tcp", "-j", "DROP") in [
        s.argv for s in plan.finally_steps
    ]


def test_rule_that_fails_the_check_triggers_reconcile():
    cfg = InpodConfig()
    plan = plan_inpod_apply(
        cfg, Backend.IPTABLES, observed(cfg, {IpFamily.V4: saved_text(cfg)}, all_present=False)
    )
    assert plan.action is PlanAction.RECONCILE and "rule differs" in plan.reason


def test_leftover_chains_of_another_config_are_removed():
    old = InpodConfig(redirect_dns=True)
    new = InpodConfig(redirect_dns=False)
    plan = plan_inpod_apply(new, Backend.IPTABLES, observed(new, {IpFamily.V4: saved_text(old)}))
    assert plan.action is PlanAction.RECONCILE
    argvs = [s.argv for s in plan.steps]
    assert ("iptables", "-w", "-t", "raw", "-X", "ISTIO_PRERT") in argvs
    assert ("iptables", "-w", "-t", "raw", "-D", "PREROUTING", "-j", "ISTIO_PRERT") in argvs


def test_ipv6_leftovers_are_cleaned_even_with_ipv6_off():
    cfg = InpodConfig()
    v6 = saved_text(InpodConfig(ipv6=True), IpFamily.V6)
    plan = plan_inpod_apply(
        cfg, Backend.IPTABLES, observed(cfg, {IpFamily.V4: saved_text(cfg), IpFamily.V6: v6})
    )
    assert plan.action is PlanAction.RECONCILE
    assert ("ip6tables", "-w", "-t", "nat", "-X", "ISTIO_OUTPUT") in [s.argv for s in plan.steps]
    assert not any(s.argv[0] == "ip6tables-restore" for s in plan.steps)


def test_remove_plan_deletes_jumps_then_flushes_then_deletes_chains():
    cfg = InpodConfig()
    plan = plan_inpod_remove(cfg, Backend.IPTABLES, observed(cfg, {IpFamily.V4: saved_text(cfg)}))
    kinds = [s.argv[4] for s in plan.steps if s.argv[0] == "iptables"]
    assert kinds == sorted(kinds, key=["-D", "-F", "-X"].index)
    assert kinds.count("-X") == 6
    assert all(not s.check for s in plan.steps)


def test_nft_plan_replaces_existing_tables_atomically():
    cfg = InpodConfig(redirect_dns=False)
    obs = InpodObservation(
        nft_tables=frozenset({("inet", "istio-ambient-raw"), ("inet", "istio-ambient-nat"), ("ip", "nat")})
    )
    plan = plan_inpod_apply(cfg, Backend.NFTABLES, obs)
    assert plan.action is PlanAction.RECONCILE
    script = plan.steps[0].input
    assert script.startswith("delete table inet istio-ambient-nat\ndelete table inet istio-ambient-raw\n")
    assert script.endswith(render_nftables(cfg))
    assert "delete table ip nat" not in script
    assert plan_inpod_apply(cfg, Backend.NFTABLES, InpodObservation()).action is PlanAction.CREATE
    removal = plan_inpod_remove(cfg, Backend.NFTABLES, obs)
    assert (
        removal.steps[0].input == "delete table inet istio-ambient-nat\ndelete table inet istio-ambient-raw\n"
    )


# --- doing ---------------------------------------------------------------------------------------


def test_execute_tolerates_eexist_and_ignores_unchecked_failures():
    runner = RecordingRunner()
    runner.respond(["ip", "-4", "rule", "add"], returncode=2, stderr="RTNETLINK answers: File exists")
    runner.respond(["iptables"], returncode=1, stderr="No chain/target/match by that name.")
    plan = RulePlan(
        backend=Backend.IPTABLES,
        action=PlanAction.CREATE,
        reason="test",
        steps=(
            Step(argv=("iptables", "-D", "X"), why="x", check=False),
            Step(argv=tuple(routing_commands(InpodConfig())[0]), why="rule", ok_stderr="File exists"),
        ),
    )
    execute_plan(runner, "pod", plan)
    assert len(runner.calls) == 2 and all(call.netns == "pod" for call in runner.calls)


def test_execute_raises_on_required_failure_but_still_runs_cleanup():
    runner = RecordingRunner()
    runner.respond(["iptables-restore"], returncode=1, stderr="line 3 failed")
    plan = RulePlan(
        backend=Backend.IPTABLES,
        action=PlanAction.RECONCILE,
        reason="test",
        steps=(
            Step(argv=("iptables-restore", "--noflush"), input="x", why="apply"),
            Step(argv=("ip", "route"), why="never reached"),
        ),
        finally_steps=(Step(argv=("iptables", "-D", "INPUT"), why="guardrail", check=False),),
    )
    with pytest.raises(CommandError) as info:
        execute_plan(runner, None, plan)
    assert "line 3 failed" in str(info.value)
    assert isinstance(info.value, AmbientError)
    assert runner.argvs == [("iptables-restore", "--noflush"), ("iptables", "-D", "INPUT")]


def test_apply_on_a_clean_pod_runs_restore_with_the_rendered_input():
    runner = RecordingRunner()
    runner.respond(["iptables-save"], stdout="*nat\n:PREROUTING ACCEPT [0:0]\nCOMMIT\n")
    runner.respond(["ip6tables-save"], returncode=127, stderr="not found")
    plan = apply_inpod_rules(runner, "pod-ns", InpodConfig())
    assert plan.action is PlanAction.CREATE
    restore = next(call for call in runner.calls if call.argv[0] == "iptables-restore")
    assert restore.input == render_iptables(InpodConfig()).encode()
    assert not any(call.argv[0] == "ip6tables-restore" for call in runner.calls)


def test_apply_fails_when_ip6tables_is_missing_but_ipv6_is_on():
    runner = RecordingRunner()
    runner.respond(["ip6tables-save"], returncode=127, stderr="ip6tables-save: not found")
    with pytest.raises(CommandError):
        apply_inpod_rules(runner, "pod-ns", InpodConfig(ipv6=True))


def test_reapply_in_sync_state_runs_checks_and_no_restore():
    cfg = InpodConfig()
    runner = RecordingRunner()
    runner.respond(["iptables-save"], stdout=saved_text(cfg))
    plan = apply_inpod_rules(runner, "pod-ns", cfg)
    assert plan.action is PlanAction.NONE
    checks = [call.argv for call in runner.calls if call.argv[:2] == ("iptables", "-w") and "-C" in call.argv]
    assert len(checks) == len(iptables_rule_set(cfg, IpFamily.V4).rules)
    assert not any(call.argv[0].endswith("-restore") for call in runner.calls)


def test_remove_with_nftables_lists_then_deletes():
    runner = RecordingRunner()
    runner.respond(["nft", "list", "tables"], stdout="table ip filter\ntable inet istio-ambient-mangle\n")
    plan = remove_inpod_rules(runner, "pod-ns", InpodConfig(), Backend.NFTABLES)
    nft_call = next(call for call in runner.calls if call.argv == ("nft", "-f", "-"))
    assert nft_call.input == b"delete table inet istio-ambient-mangle\n"
    assert plan.action is PlanAction.REMOVE
