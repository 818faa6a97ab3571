"""The fast path of L4 authorization: each policy compiled once into one Python function.

Counterpart: ztunnel src/rbac.rs `Authorization::matches` and the deny-before-allow order of
`assert_rbac` in src/state.rs. The semantics are `reference`'s (tests/unit/rbac/test_reference_properties.py
checks that the two always agree); this module only makes a decision cheap: one generated function
per policy over sets, tuples for `str.startswith` and masked integers, so a decision costs no
parsing and no `ipaddress` arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from types import CodeType, FunctionType
from typing import Any

from ..net import IPAddress
from .model import (
    REASON_ALLOWED,
    REASON_DENIED,
    REASON_NO_ALLOW_POLICIES,
    REASON_NOT_ALLOWED,
    Action,
    Authorization,
    Decision,
    IPNetwork,
    Match,
    RbacConnection,
    Rule,
    StringMatch,
    StringMatchKind,
)

#
# A connection becomes a flat tuple of values: the principal (None without identity), the peer
# namespace ("" without identity), the peer (namespace, service account) (None without identity),
# source and destination IP as keyed integers, and the destination port. A policy becomes one
# Python function over that tuple, so a decision costs one call per policy and no interpretation
# of the rule tree.
#
# The function's source is generated from the policy's *shape* only: variable names, operators
# and placeholders `k0, k1, ...`. Every value from the policy (strings, sets, masks, ports) is a
# default argument bound to a placeholder, so no policy text is ever compiled, and policies of the
# same shape share one code object (compiled once, cached). Per policy that leaves one function
# object and its defaults tuple, which keeps index builds cheap in time and in GC work.

# IP keys: the address as an integer with bit 128 set for IPv6, so one mask test can never match
# an address of the other family (an IPv4 mask keeps bit 128, which an IPv4 key never has).
_V6_BIT = 1 << 128
_FULL_V4, _FULL_V6 = (1 << 32) - 1 | _V6_BIT, (1 << 129) - 1

# The generated function's parameter names for the connection values, in `_peer_values` order.
_PRINCIPAL, _NAMESPACE, _ACCOUNT, _SRC_IP, _DST_IP, _PORT = "P", "N", "A", "S", "D", "T"
_CODE_CACHE_SIZE = 1024
_code_cache: dict[str, CodeType] = {}
_NO_BUILTINS: dict[str, object] = {"__builtins__": {}}


def _ip_key(ip: IPAddress) -> int:
    return int(ip) | _V6_BIT if ip.version == 6 else int(ip)


# principal, namespace, (namespace, service account), source key, destination key, port
PeerValues = tuple[str | None, str, tuple[str, str] | None, int, int, int]


def _peer_values(conn: RbacConnection) -> PeerValues:
    identity = conn.src_identity
    if identity is None:
        principal, namespace, account = None, "", None
    else:
        principal = identity.principal
        namespace = identity.namespace
        account = (identity.namespace, identity.service_account)
    return (principal, namespace, account, _ip_key(conn.src_ip), _ip_key(conn.dst_ip), conn.dst_port)


class _Source:
    """Collects one policy's generated expression text and the constants it refers to."""

    __slots__ = ("constants",)

    def __init__(self) -> None:
        self.constants: list[object] = []

    def const(self, value: object) -> str:
        self.constants.append(value)
        return f"k{len(self.constants) - 1}"

    def members(self, var: str, values: Iterable[object]) -> str:
        unique = frozenset(values)
        if len(unique) == 1:
            # `==` on one value is cheaper than a set probe; None == "x" is False as required.
            return f"{var} == {self.const(next(iter(unique)))}"
        return f"{var} in {self.const(unique)}"

    def strings(self, var: str, matches: Sequence[StringMatch], *, principal: bool) -> str:
        """`any(m.matches(value) for m in matches)`. For principals the value is None when the
        peer has no identity: ztunnel strips `spiffe://` from an empty id, fails, and so no
        principal match of any kind holds (not even exact "")."""
        exact = [m.value for m in matches if m.kind is StringMatchKind.EXACT]
        prefixes = tuple(m.value for m in matches if m.kind is StringMatchKind.PREFIX)
        suffixes = tuple(m.value for m in matches if m.kind is StringMatchKind.SUFFIX)
        presence = any(m.kind is StringMatchKind.PRESENCE for m in matches)
        if "" in prefixes or "" in suffixes:
            return f"{var} is not None" if principal else "True"
        if not (prefixes or suffixes or presence):
            return self.members(var, exact)
        parts = [self.members(var, exact)] if exact else []
        if presence:
            parts.append(f'{var} != ""')
        if prefixes:
            parts.append(f"{var}.startswith({self.const(prefixes)})")
        if suffixes:
            parts.append(f"{var}.endswith({self.const(suffixes)})")
        inner = " or ".join(parts)
        return f"({var} is not None and ({inner}))" if principal else f"({inner})"

    def networks(self, var: str, networks: Sequence[IPNetwork]) -> str:
        """CIDR containment as masked integer compares, one per distinct mask."""
        by_mask: dict[int, set[int]] = {}
        for net in networks:
            base = int(net.network_address) | (_V6_BIT if net.version == 6 else 0)
            by_mask.setdefault(int(net.netmask) | _V6_BIT, set()).add(base)
        if all(mask in (_FULL_V4, _FULL_V6) for mask in by_mask):
            return self.members(var, (base for bases in by_mask.values() for base in bases))
        tests = [
            f"{var} & {self.const(mask)} in {self.const(frozenset(bases))}" for mask, bases in by_mask.items()
        ]
        return tests[0] if len(tests) == 1 else f"({' or '.join(tests)})"

    def match(self, m: Match) -> str | None:
        """All of one Match's checks, AND-ed; None for an empty Match."""
        checks: list[str] = []

        def add(
            positive: Sequence[Any], negative: Sequence[Any], test: Callable[[Sequence[Any]], str]
        ) -> None:
            if positive:
                checks.append(test(positive))
            if negative:
                checks.append(f"not ({test(negative)})")

        # Ports first: the cheapest test and, in practice, the most selective.
        add(m.destination_ports, m.not_destination_ports, lambda v: self.members(_PORT, v))
        add(m.destination_ips, m.not_destination_ips, lambda v: self.networks(_DST_IP, v))
        add(m.source_ips, m.not_source_ips, lambda v: self.networks(_SRC_IP, v))
        add(
            m.service_accounts,
            m.not_service_accounts,
            lambda v: self.members(_ACCOUNT, ((a.namespace, a.service_account) for a in v)),
        )
        add(m.principals, m.not_principals, lambda v: self.strings(_PRINCIPAL, v, principal=True))
        add(m.namespaces, m.not_namespaces, lambda v: self.strings(_NAMESPACE, v, principal=False))
        return " and ".join(checks) if checks else None

    def rule(self, rule: Rule) -> str:
        """Every clause must hold; a clause holds if any of its non-empty Matches does."""
        clauses: list[str] = []
        for clause in rule.clauses:
            if not clause.matches:
                continue  # a clause with no matches holds for every connection
            # An empty Match (no field set) is skipped, never "matches everything"
            # (ztunnel `RbacMatch::is_empty`; istio/istio#61126).
            matches = [text for text in map(self.match, clause.matches) if text is not None]
            if not matches:
                return "False"
            clauses.append(matches[0] if len(matches) == 1 else " or ".join(f"({t})" for t in matches))
        if not clauses:
            return "True"
        return clauses[0] if len(clauses) == 1 else " and ".join(f"({t})" for t in clauses)


def _generate(policy: Authorization) -> Callable[[PeerValues], bool]:
    """The policy as one function of the connection values; zero rules match nothing."""
    source = _Source()
    body = [f"    {_PRINCIPAL}, {_NAMESPACE}, {_ACCOUNT}, {_SRC_IP}, {_DST_IP}, {_PORT} = v"]
    for rule in policy.rules:
        test = source.rule(rule)
        if test == "True":
            body.append("    return True")
            break
        if test != "False":
            body.append(f"    if {test}:\n        return True")
    else:
        body.append("    return False")
    params = "".join(f", k{i}" for i in range(len(source.constants)))
    text = f"def matches(v{params}):\n" + "\n".join(body) + "\n"
    code = _code_cache.get(text)
    if code is None:
        if len(_code_cache) >= _CODE_CACHE_SIZE:
            del _code_cache[next(iter(_code_cache))]  # the oldest shape
        namespace: dict[str, object] = {}
        exec(compile(text, "<rbac policy>", "exec"), _NO_BUILTINS, namespace)
        code = _code_cache[text] = namespace["matches"].__code__  # type: ignore[attr-defined]
    return FunctionType(code, _NO_BUILTINS, "matches", tuple(source.constants))


class CompiledPolicy:
    """An Authorization prepared for fast matching; built once per policy version."""

    __slots__ = ("policy", "key", "deny", "dry_run", "_matches")

    def __init__(self, policy: Authorization) -> None:
        self.policy = policy
        self.key = policy.key
        self.deny = policy.action is Action.DENY
        self.dry_run = policy.dry_run
        # `_matches(values)` with values from `_peer_values`: one call per policy and decision.
        self._matches = _generate(policy)

    def matches(self, conn: RbacConnection) -> bool:
        return self._matches(_peer_values(conn))

    def __repr__(self) -> str:
        action = "DENY" if self.deny else "ALLOW"
        dry = " dry-run" if self.dry_run else ""
        return (
            f"<CompiledPolicy {self.key} {self.policy.scope.name}{dry} {action}: "
            f"{len(self.policy.rules)} rules>"
        )


def compile_policy(policy: Authorization | CompiledPolicy) -> CompiledPolicy:
    return policy if isinstance(policy, CompiledPolicy) else CompiledPolicy(policy)


# -- evaluation (docs/istio-behaviour.md, "Authorization") -----------------------------------------


def _decide(
    deny: Sequence[CompiledPolicy],
    allow: Sequence[CompiledPolicy],
    dry_deny: Sequence[CompiledPolicy],
    dry_allow: Sequence[CompiledPolicy],
    conn: RbacConnection,
    *,
    any_allow: bool = False,
) -> Decision:
    """`any_allow` says an enforced ALLOW applies even though pruning left it out of `allow`."""
    if not (deny or allow or dry_deny or dry_allow):
        # Nothing to match: the connection's values are not needed.
        return Decision(
            allowed=not any_allow,
            policy=None,
            reason=REASON_NOT_ALLOWED if any_allow else REASON_NO_ALLOW_POLICIES,
        )
    values = _peer_values(conn)
    dry: list[str] = [p.key for p in dry_deny if p._matches(values)]
    for policy in deny:
        if policy._matches(values):
            return Decision(
                allowed=False,
                policy=policy.key,
                reason=REASON_DENIED.format(key=policy.key),
                dry_run_matches=tuple(dry),
            )
    dry.extend(p.key for p in dry_allow if p._matches(values))
    if not (allow or any_allow):
        # Istio's default: with no ALLOW policy for the workload, everything not denied passes.
        return Decision(
            allowed=True, policy=None, reason=REASON_NO_ALLOW_POLICIES, dry_run_matches=tuple(dry)
        )
    for policy in allow:
        if policy._matches(values):
            return Decision(
                allowed=True,
                policy=policy.key,
                reason=REASON_ALLOWED.format(key=policy.key),
                dry_run_matches=tuple(dry),
            )
    return Decision(allowed=False, policy=None, reason=REASON_NOT_ALLOWED, dry_run_matches=tuple(dry))


def evaluate(policies: Iterable[Authorization | CompiledPolicy], conn: RbacConnection) -> Decision:
    """Authorize `conn` against the policies that apply to its destination workload.

    Order (ztunnel `assert_rbac`, plus dry run): dry-run DENY matches are only recorded; any
    enforced DENY match rejects; dry-run ALLOW matches are recorded; no enforced ALLOW allows;
    any enforced ALLOW match allows; otherwise reject. Among several matches the first policy
    in `policies` names the decision. Plain Authorizations are compiled on the fly; pass
    CompiledPolicy objects (from a PolicyIndex) on the hot path.
    """
    deny: list[CompiledPolicy] = []
    allow: list[CompiledPolicy] = []
    dry_deny: list[CompiledPolicy] = []
    dry_allow: list[CompiledPolicy] = []
    for policy in policies:
        compiled = compile_policy(policy)
        if compiled.dry_run:
            (dry_deny if compiled.deny else dry_allow).append(compiled)
        else:
            (deny if compiled.deny else allow).append(compiled)
    return _decide(deny, allow, dry_deny, dry_allow, conn)
