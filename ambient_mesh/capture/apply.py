"""Applying, removing and reconciling the in-pod rule set inside a pod's network namespace.

Counterparts: istio-cni's IptablesConfigurator / NftablesConfigurator (CreateInpodRules,
DeleteInpodRules) and the reconcile helper of tools/istio-iptables/pkg/capture/helper.go
(docs/istio-behaviour.md, "In-pod redirection rules").

Decide, then do: `observe_inpod` runs only read-only commands (`iptables-save`, `iptables -C`,
`nft list tables`, a sysctl read) and returns what it saw; `plan_inpod_apply` /
`plan_inpod_remove` are pure and return a `RulePlan` (every command, in order, with why);
`execute_plan` carries a plan out through a CommandRunner. `apply_inpod_rules` and
`remove_inpod_rules` chain the three and return the plan they executed.

Reconcile (docs/istio-behaviour.md, "In-pod redirection rules", idempotency): the current state is
"in sync" when every expected ISTIO_* chain exists with the same number of rules, every expected rule
passes `iptables -C`, every jump from a built-in chain exists exactly once and no other ISTIO_* chain is
left over. In sync: nothing to do. Clean: apply. Anything else: guardrails (drop all TCP/UDP in filter
INPUT/FORWARD/OUTPUT for the few milliseconds it takes), remove everything ISTIO_* that is there, apply,
drop the guardrails (always, even when the apply failed). nftables needs no guardrails: one `nft -f`
transaction deletes our tables and recreates them atomically.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

from ..errors import AmbientError
from ..host.commands import CommandError, CommandRunner
from .inpod import (
    ISTIO_CHAIN_PREFIX,
    NFT_TABLES,
    InpodConfig,
    IpFamily,
    IptablesRule,
    iptables_rule_set,
    nft_rule_set,
    routing_commands,
    routing_removal_commands,
)

BUILTIN_CHAINS = frozenset({"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"})
GUARDRAIL_CHAINS = ("INPUT", "FORWARD", "OUTPUT")
GUARDRAIL_PROTOCOLS = ("tcp", "udp")
# `ip rule add` of an existing rule is refused with EEXIST: the rule is there, which is the goal.
EEXIST_TEXT = "File exists"
IPV6_LO_SYSCTL = "net.ipv6.conf.lo.disable_ipv6"


class RuleStateError(AmbientError):
    """The rule state read back from the kernel (iptables-save, nft) could not be understood."""


class Backend(Enum):
    IPTABLES = "iptables"
    NFTABLES = "nftables"


class PlanAction(Enum):
    NONE = "none"  # already in sync
    CREATE = "create"  # nothing of ours there
    RECONCILE = "reconcile"  # leftovers or a different rule set: replace cleanly
    REMOVE = "remove"


# --- reading state -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class IptablesState:
    """One family's `iptables-save` output: table -> chain -> rule argument lists, in order."""

    family: IpFamily
    tables: Mapping[str, Mapping[str, tuple[tuple[str, ...], ...]]]

    def istio_chains(self) -> list[tuple[str, str]]:
        return [
            (table, chain)
            for table, chains in sorted(self.tables.items())
            for chain in chains
            if chain.startswith(ISTIO_CHAIN_PREFIX)
        ]

    def istio_jumps(self) -> list[tuple[str, str, tuple[str, ...]]]:
        """(table, built-in chain, rule args) of every rule that jumps into an ISTIO_* chain."""
        jumps = []
        for table, chains in sorted(self.tables.items()):
            for chain, rules in chains.items():
                if chain.startswith(ISTIO_CHAIN_PREFIX):
                    continue
                for args in rules:
                    if _jump_target(args).startswith(ISTIO_CHAIN_PREFIX):
                        jumps.append((table, chain, args))
        return jumps

    @property
    def empty(self) -> bool:
        return not self.istio_chains() and not self.istio_jumps()


def _jump_target(args: Sequence[str]) -> str:
    for i, arg in enumerate(args[:-1]):
        if arg in ("-j", "--jump", "-g", "--goto"):
            return args[i + 1]
    return ""


def parse_iptables_save(text: str, family: IpFamily = IpFamily.V4) -> IptablesState:
    """Parse `iptables-save` output. Raises RuleStateError on lines it cannot place."""
    tables: dict[str, dict[str, list[tuple[str, ...]]]] = {}
    current: dict[str, list[tuple[str, ...]]] | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("*"):
            name = line[1:].strip()
            if not name or any(c.isspace() for c in name):
                raise RuleStateError(f"iptables-save line {number}: bad table header {raw!r}")
            current = tables.setdefault(name, {})
            continue
        if current is None:
            raise RuleStateError(f"iptables-save line {number}: {raw!r} outside a table")
        if line == "COMMIT":
            current = None
            continue
        if line.startswith(":"):
            parts = line[1:].split()
            if not parts:
                raise RuleStateError(f"iptables-save line {number}: bad chain declaration {raw!r}")
            current.setdefault(parts[0], [])
            continue
        try:
            words = shlex.split(line)
        except ValueError as e:
            raise RuleStateError(f"iptables-save line {number}: {e}: {raw!r}") from None
        if len(words) < 2 or words[0] not in ("-A", "--append"):
            raise RuleStateError(f"iptables-save line {number}: not a rule: {raw!r}")
        current.setdefault(words[1], []).append(tuple(words[2:]))
    return IptablesState(
        family=family, tables={t: {c: tuple(r) for c, r in chains.items()} for t, chains in tables.items()}
    )


def parse_nft_tables(text: str) -> frozenset[tuple[str, str]]:
    """(family, name) pairs from `nft list tables` output (`table inet istio-ambient-nat`)."""
    found = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        words = raw.split()
        if not words:
            continue
        if len(words) != 3 or words[0] != "table":
            raise RuleStateError(f"nft list tables line {number}: unexpected {raw!r}")
        found.add((words[1], words[2]))
    return frozenset(found)


@dataclass(frozen=True, slots=True, kw_only=True)
class InpodObservation:
    """What was read from the pod's netns before deciding anything."""

    iptables: Mapping[IpFamily, IptablesState] = field(default_factory=dict)
    # expected rules that `iptables -C` found present, per family
    present: Mapping[IpFamily, frozenset[IptablesRule]] = field(default_factory=dict)
    nft_tables: frozenset[tuple[str, str]] = frozenset()
    ipv6_loopback: bool = True  # False when lo has disable_ipv6=1 (no v6 local route possible)


def check_argv(family: IpFamily, rule: IptablesRule) -> tuple[str, ...]:
    return (family.iptables, "-w", "-t", rule.table, "-C", rule.chain, *rule.args)


def observe_inpod(
    runner: CommandRunner, netns: str | None, cfg: InpodConfig, backend: Backend = Backend.IPTABLES
) -> InpodObservation:
    """Read-only look at the pod netns: our rules/tables as they stand, and lo's IPv6 switch."""
    states: dict[IpFamily, IptablesState] = {}
    present: dict[IpFamily, frozenset[IptablesRule]] = {}
    nft_tables: frozenset[tuple[str, str]] = frozenset()
    if backend is Backend.IPTABLES:
        for family in (IpFamily.V4, IpFamily.V6):
            try:
                saved = runner.run([family.save], netns=netns, check=family in cfg.families)
            except CommandError:
                # ip6tables may be missing entirely: fine while IPv6 is off for this pod
                if family in cfg.families:
                    raise
                continue
            if not saved.ok:
                continue
            state = parse_iptables_save(saved.text, family)
            states[family] = state
            if family in cfg.families and not state.empty:
                expected = iptables_rule_set(cfg, family).rules
                present[family] = frozenset(
                    rule
                    for rule in expected
                    if runner.run(check_argv(family, rule), netns=netns, check=False).ok
                )
    else:
        listed = runner.run(["nft", "list", "tables"], netns=netns)
        nft_tables = parse_nft_tables(listed.text)
    ipv6_loopback = True
    if cfg.ipv6:
        result = runner.run(["sysctl", "-n", IPV6_LO_SYSCTL], netns=netns, check=False)
        ipv6_loopback = result.ok and result.text.strip() != "1"
    return InpodObservation(
        iptables=states, present=present, nft_tables=nft_tables, ipv6_loopback=ipv6_loopback
    )


# --- plans ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Step:
    """One command of a plan. `check=False`: failure is expected and ignored (nothing to delete)."""

    argv: tuple[str, ...]
    why: str
    input: str | None = None
    check: bool = True
    ok_stderr: str | None = None  # a failure whose stderr contains this counts as success

    def __str__(self) -> str:
        return shlex.join(self.argv) + (" <<input" if self.input is not None else "")


@dataclass(frozen=True, slots=True, kw_only=True)
class RulePlan:
    """What applying or removing will do; `finally_steps` run even when a step fails."""

    backend: Backend
    action: PlanAction
    reason: str
    steps: tuple[Step, ...] = ()
    finally_steps: tuple[Step, ...] = ()

    def __repr__(self) -> str:
        extra = f" + {len(self.finally_steps)} cleanup" if self.finally_steps else ""
        return (
            f"RulePlan({self.backend.value} {self.action.value}: {len(self.steps)} steps{extra}; "
            f"{self.reason})"
        )

    @property
    def argvs(self) -> list[tuple[str, ...]]:
        return [step.argv for step in (*self.steps, *self.finally_steps)]


def _in_sync(
    cfg: InpodConfig, family: IpFamily, state: IptablesState, present: frozenset[IptablesRule]
) -> str:
    """'' when `state` holds exactly the expected set for `family`, else why not."""
    expected = iptables_rule_set(cfg, family)
    for table, chains in expected.chains.items():
        for chain in chains:
            want = [r for r in expected.rules if r.table == table and r.chain == chain]
            have = state.tables.get(table, {}).get(chain)
            if have is None:
                return f"{family.iptables} chain {table}/{chain} missing"
            if len(have) != len(want):
                return f"{family.iptables} chain {table}/{chain} has {len(have)} rules, expected {len(want)}"
    for table, chain in state.istio_chains():
        if chain not in expected.chains.get(table, ()):
            return f"{family.iptables} leftover chain {table}/{chain}"
    jumps = [r for r in expected.rules if not r.chain.startswith(ISTIO_CHAIN_PREFIX)]
    for rule in jumps:
        count = sum(1 for args in state.tables.get(rule.table, {}).get(rule.chain, ()) if args == rule.args)
        if count != 1:
            return (
                f"{family.iptables} jump {rule.table}/{rule.chain} -> {rule.args[-1]} present {count} times"
            )
    if len(state.istio_jumps()) != len(jumps):
        return f"{family.iptables} unexpected jumps into ISTIO_* chains"
    missing = [r for r in expected.rules if r not in present]
    if missing:
        return f"{family.iptables} rule differs: {missing[0].table} {missing[0].line}"
    return ""


def _iptables_cleanup_steps(state: IptablesState) -> list[Step]:
    """Remove every ISTIO_* jump and chain found in `state` (ours or a leftover of anyone's)."""
    ipt = state.family.iptables
    steps = [
        Step(argv=(ipt, "-w", "-t", table, "-D", chain, *args), why="remove jump into our chain", check=False)
        for table, chain, args in state.istio_jumps()
    ]
    chains = state.istio_chains()
    # flush all before deleting any: our chains may reference each other
    steps += [
        Step(argv=(ipt, "-w", "-t", table, "-F", chain), why="flush our chain", check=False)
        for table, chain in chains
    ]
    steps += [
        Step(argv=(ipt, "-w", "-t", table, "-X", chain), why="delete our chain", check=False)
        for table, chain in chains
    ]
    return steps


def guardrail_steps(family: IpFamily) -> tuple[list[Step], list[Step]]:
    """(install, remove): drop all TCP/UDP in the filter table while the rules are swapped."""
    ipt = family.iptables
    install = [
        Step(
            argv=(ipt, "-w", "-t", "filter", "-I", chain, "1", "-p", proto, "-j", "DROP"),
            why="guardrail during reconcile",
        )
        for chain in GUARDRAIL_CHAINS
        for proto in GUARDRAIL_PROTOCOLS
    ]
    remove = [
        Step(
            argv=(ipt, "-w", "-t", "filter", "-D", chain, "-p", proto, "-j", "DROP"),
            why="remove guardrail",
            check=False,
        )
        for chain in GUARDRAIL_CHAINS
        for proto in GUARDRAIL_PROTOCOLS
    ]
    return install, remove


def _routing_steps(cfg: InpodConfig, observation: InpodObservation) -> list[Step]:
    return [
        Step(argv=argv, why="policy route for connmark-tagged replies (3.4)", ok_stderr=EEXIST_TEXT)
        for argv in routing_commands(cfg, ipv6_loopback=observation.ipv6_loopback)
    ]


def plan_inpod_apply(cfg: InpodConfig, backend: Backend, observation: InpodObservation) -> RulePlan:
    """Pure: the steps that bring the pod netns to exactly `cfg`'s rule set."""
    routing = _routing_steps(cfg, observation)
    if backend is Backend.NFTABLES:
        ours = [
            name for family, name in sorted(observation.nft_tables) if family == "inet" and name in NFT_TABLES
        ]
        # Delete-then-recreate in one transaction: atomic, so no packet ever sees a half set,
        # and a table the new set does not use (raw, when DNS capture was turned off) is gone.
        script = "".join(f"delete table inet {name}\n" for name in ours) + nft_rule_set(cfg).render()
        action = PlanAction.RECONCILE if ours else PlanAction.CREATE
        reason = f"replace tables {', '.join(ours)}" if ours else "no in-pod tables yet"
        steps = [Step(argv=("nft", "-f", "-"), input=script, why="in-pod nftables rules"), *routing]
        return RulePlan(
            backend=backend, action=action, reason=f"{reason} ({cfg.describe()})", steps=tuple(steps)
        )

    states = {
        family: observation.iptables.get(family, IptablesState(family=family, tables={}))
        for family in (IpFamily.V4, IpFamily.V6)
    }
    if all(state.empty for state in states.values()):
        steps = [
            Step(
                argv=(family.restore, "-w", "--noflush"),
                input=iptables_rule_set(cfg, family).render(),
                why=f"in-pod rules, IPv{family.value}",
            )
            for family in cfg.families
        ]
        return RulePlan(
            backend=backend,
            action=PlanAction.CREATE,
            reason=f"no ISTIO_* chains yet ({cfg.describe()})",
            steps=tuple([*steps, *routing]),
        )

    reasons = []
    for family in (IpFamily.V4, IpFamily.V6):
        state = states[family]
        if family in cfg.families:
            why = _in_sync(cfg, family, state, observation.present.get(family, frozenset()))
        else:
            why = "" if state.empty else f"{family.iptables} leftovers while IPv6 is off"
        if why:
            reasons.append(why)
    if not reasons:
        return RulePlan(
            backend=backend,
            action=PlanAction.NONE,
            reason=f"in sync ({cfg.describe()})",
            steps=tuple(routing),
        )

    steps = []
    finally_steps: list[Step] = []
    for family in cfg.families:
        install, remove = guardrail_steps(family)
        steps += remove  # a crashed earlier reconcile may have left some behind
        steps += install
        finally_steps += remove
    for family in (IpFamily.V4, IpFamily.V6):
        steps += _iptables_cleanup_steps(states[family])
    steps += [
        Step(
            argv=(family.restore, "-w", "--noflush"),
            input=iptables_rule_set(cfg, family).render(),
            why=f"in-pod rules, IPv{family.value}",
        )
        for family in cfg.families
    ]
    steps += routing
    return RulePlan(
        backend=backend,
        action=PlanAction.RECONCILE,
        reason="; ".join(reasons),
        steps=tuple(steps),
        finally_steps=tuple(finally_steps),
    )


def plan_inpod_remove(cfg: InpodConfig, backend: Backend, observation: InpodObservation) -> RulePlan:
    """Pure: the steps that remove our rules and policy route, whatever is left of them."""
    routing = [
        Step(argv=argv, why="remove policy route", check=False) for argv in routing_removal_commands(cfg)
    ]
    if backend is Backend.NFTABLES:
        ours = [
            name for family, name in sorted(observation.nft_tables) if family == "inet" and name in NFT_TABLES
        ]
        steps = (
            [
                Step(
                    argv=("nft", "-f", "-"),
                    input="".join(f"delete table inet {name}\n" for name in ours),
                    why="delete in-pod tables",
                )
            ]
            if ours
            else []
        )
        return RulePlan(
            backend=backend,
            action=PlanAction.REMOVE,
            reason=f"tables present: {', '.join(ours) or 'none'}",
            steps=tuple([*steps, *routing]),
        )
    steps = []
    for family in (IpFamily.V4, IpFamily.V6):
        state = observation.iptables.get(family)
        if state is not None:
            steps += _iptables_cleanup_steps(state)
    found = sum(len(s.istio_chains()) for s in observation.iptables.values())
    return RulePlan(
        backend=backend,
        action=PlanAction.REMOVE,
        reason=f"{found} ISTIO_* chains present",
        steps=tuple([*steps, *routing]),
    )


# --- doing ---------------------------------------------------------------------------------------


def _run_step(runner: CommandRunner, netns: str | None, step: Step) -> None:
    data = step.input.encode() if step.input is not None else None
    result = runner.run(step.argv, input=data, netns=netns, check=False)
    if result.ok or not step.check:
        return
    if step.ok_stderr is not None and step.ok_stderr.encode() in result.stderr:
        return
    raise CommandError(
        step.argv, result.returncode, result.stderr, netns=netns, hint=f"while trying to {step.why}"
    )


def execute_plan(runner: CommandRunner, netns: str | None, plan: RulePlan) -> None:
    """Run a plan's steps in order; the first required step that fails raises CommandError."""
    try:
        for step in plan.steps:
            _run_step(runner, netns, step)
    finally:
        for step in plan.finally_steps:
            _run_step(runner, netns, step)


def apply_inpod_rules(
    runner: CommandRunner, netns: str | None, cfg: InpodConfig, backend: Backend = Backend.IPTABLES
) -> RulePlan:
    """Observe, plan and carry out: the pod netns ends with exactly `cfg`'s rules. Idempotent."""
    plan = plan_inpod_apply(cfg, backend, observe_inpod(runner, netns, cfg, backend))
    execute_plan(runner, netns, plan)
    return plan


def remove_inpod_rules(
    runner: CommandRunner, netns: str | None, cfg: InpodConfig, backend: Backend = Backend.IPTABLES
) -> RulePlan:
    """Remove our rules, chains/tables and policy route from the pod netns. Idempotent."""
    plan = plan_inpod_remove(cfg, backend, observe_inpod(runner, netns, cfg, backend))
    execute_plan(runner, netns, plan)
    return plan
