"""L4 authorization: `istio.security.Authorization` as the node proxy holds and enforces it.

Counterparts: ztunnel src/rbac.rs (the model and `Authorization::matches`), src/state/policy.rs
(`PolicyStore`, the by-namespace index) and `assert_rbac` in src/state.rs (which policies apply,
deny before allow). Wire form: spec/wire-protocols.md section 3, where istiod's
`groups -> rules -> matches` is ztunnel's `rules -> clauses -> matches`; we use ztunnel's names.
Behaviour: reference/ztunnel.md 5.1-5.5.

Evaluation is pure: `evaluate` and `PolicyIndex.check` return a `Decision` value and never do I/O;
the caller closes the connection, records the DENY flag and logs (`log_dry_run`). Policies are
compiled once (`CompiledPolicy`: one generated function per policy over sets, tuples for
`str.startswith` and masked integers) so a decision costs no parsing and no `ipaddress`
arithmetic. A PolicyIndex also files each policy by necessary conditions (`rule_filters`) so a
check matches only the policies that could match the connection: with thousands of GLOBAL
policies a decision touches a handful (bench/rbac_bench.py).
"""

from __future__ import annotations

import enum
import ipaddress
import itertools
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence, Set
from dataclasses import dataclass
from types import CodeType, FunctionType
from typing import Protocol

from .identity.spiffe import Identity
from .net import IPAddress, SocketAddr

log = logging.getLogger(__name__)

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class Scope(enum.Enum):
    GLOBAL = "Global"  # wire 0
    NAMESPACE = "Namespace"  # wire 1
    WORKLOAD_SELECTOR = "WorkloadSelector"  # wire 2


class Action(enum.Enum):
    ALLOW = "Allow"  # wire 0
    DENY = "Deny"  # wire 1


class StringMatchKind(enum.Enum):
    EXACT = "Exact"
    PREFIX = "Prefix"
    SUFFIX = "Suffix"
    PRESENCE = "Presence"


@dataclass(frozen=True, slots=True, kw_only=True)
class StringMatch:
    kind: StringMatchKind
    value: str = ""

    def matches(self, candidate: str) -> bool:
        match self.kind:
            case StringMatchKind.EXACT:
                return candidate == self.value
            case StringMatchKind.PREFIX:
                return candidate.startswith(self.value)
            case StringMatchKind.SUFFIX:
                return candidate.endswith(self.value)
            case StringMatchKind.PRESENCE:
                # Istio's `*`: any non-empty value (a peer without identity has none).
                return candidate != ""
        raise AssertionError(self.kind)

    @classmethod
    def exact(cls, value: str) -> StringMatch:
        return cls(kind=StringMatchKind.EXACT, value=value)

    @classmethod
    def prefix(cls, value: str) -> StringMatch:
        return cls(kind=StringMatchKind.PREFIX, value=value)

    @classmethod
    def suffix(cls, value: str) -> StringMatch:
        return cls(kind=StringMatchKind.SUFFIX, value=value)

    @classmethod
    def presence(cls) -> StringMatch:
        return cls(kind=StringMatchKind.PRESENCE)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceAccountMatch:
    namespace: str
    service_account: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Match:
    """One match entry: non-empty lists are AND-ed, values within a list OR-ed."""

    namespaces: tuple[StringMatch, ...] = ()
    not_namespaces: tuple[StringMatch, ...] = ()
    service_accounts: tuple[ServiceAccountMatch, ...] = ()
    not_service_accounts: tuple[ServiceAccountMatch, ...] = ()
    principals: tuple[StringMatch, ...] = ()
    not_principals: tuple[StringMatch, ...] = ()
    source_ips: tuple[IPNetwork, ...] = ()
    not_source_ips: tuple[IPNetwork, ...] = ()
    destination_ips: tuple[IPNetwork, ...] = ()
    not_destination_ips: tuple[IPNetwork, ...] = ()
    destination_ports: tuple[int, ...] = ()
    not_destination_ports: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Clause:
    """Istio's `Rules`: any one of `matches` satisfies the clause."""

    matches: tuple[Match, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Rule:
    """Istio's `Group`: every clause must be satisfied."""

    clauses: tuple[Clause, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Authorization:
    name: str
    namespace: str
    scope: Scope = Scope.GLOBAL  # the proto3 zero value, as on the wire
    action: Action = Action.ALLOW
    rules: tuple[Rule, ...] = ()
    dry_run: bool = False

    @property
    def key(self) -> str:
        """xDS resource name and `Workload.authorization_policies` entry: `namespace/name`."""
        return f"{self.namespace}/{self.name}"


# -- STRICT mTLS as istiod expresses it (reference 5.4) --------------------------------------------

STRICT_MTLS_POLICY_NAME = "istio_converted_static_strict"
DEFAULT_ROOT_NAMESPACE = "istio-system"


def strict_mtls_policy(root_namespace: str = DEFAULT_ROOT_NAMESPACE) -> Authorization:
    """The static policy istiod sends once any PeerAuthentication exists.

    Workloads whose effective mode is STRICT list its key in `authorization_policies`; it denies
    every peer that has no mTLS identity (no principal at all fails `presence`, so the negated
    list holds and the DENY matches).
    """
    return Authorization(
        name=STRICT_MTLS_POLICY_NAME,
        namespace=root_namespace,
        scope=Scope.WORKLOAD_SELECTOR,
        action=Action.DENY,
        rules=(Rule(clauses=(Clause(matches=(Match(not_principals=(StringMatch.presence(),)),)),)),),
    )


# -- what authorization sees of a connection --------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RbacConnection:
    """ztunnel's `rbac::Connection`: the inbound connection as policies see it.

    `dst_ip` is the local pod IP and `dst_port` the resolved target port (the port inside the
    HBONE CONNECT authority, never 15008). `src_identity` is the mTLS-proven peer identity; None
    for plaintext. `dst_network` does not take part in matching; it keys the connection for the
    policy watcher (reference 5.5).
    """

    src_identity: Identity | None
    src_ip: IPAddress
    dst_ip: IPAddress
    dst_port: int
    dst_network: str = ""

    def __str__(self) -> str:
        return f"{self.src_ip}({self.src_identity or 'None'})->{SocketAddr(self.dst_ip, self.dst_port)}"


REASON_DENIED = "explicitly denied by: {key}"
REASON_NOT_ALLOWED = "allow policies exist, but none allowed"
REASON_NO_ALLOW_POLICIES = "no allow policies"
REASON_ALLOWED = "allowed by: {key}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """The outcome of authorizing one connection; a denial is a value, not an exception."""

    allowed: bool
    policy: str | None
    reason: str
    dry_run_matches: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{'allow' if self.allowed else 'deny'}: {self.reason}"


def log_dry_run(decision: Decision, conn: RbacConnection) -> None:
    """Log what dry-run policies would have done (reference 5.1: evaluated, logged, never enforced)."""
    for key in decision.dry_run_matches:
        log.info("dry-run policy %s matches connection %s", key, conn)


# -- compiled policies ------------------------------------------------------------------------------
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


def _peer_values(conn: RbacConnection) -> tuple:
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

        def add(positive: Sequence, negative: Sequence, test: Callable[[Sequence], str]) -> None:
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


def _generate(policy: Authorization) -> Callable[[tuple], bool]:
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


# -- necessary conditions: which policies can possibly match (the pruning index) --------------------
#
# Every entry of a Match list (one StringMatch, CIDR, port or service account) holds for a
# connection exactly when its *key* is in the connection's key set (`conn_keys`): a prefix "abc"
# holds when the value cut to 3 characters is "abc", a /24 when the address shifted right by 8
# bits equals the network's, and so on. Keys are tuples tagged by field, so fields never collide.
# The connection's set has one key per field, plus one per prefix, suffix and CIDR length that
# some indexed policy uses (`KeyLength`).
#
# From entry keys each rule gets a filter: a guard (the rule can only hold if the connection has
# one of its keys; ALWAYS_KEY when nothing is required) and an exclusion (the rule cannot hold if
# the connection has any of its keys). A bucket files a policy under its rules' guard keys, grouped
# by exclusion, so a check looks up the connection's few keys and never touches a policy that
# provably cannot match. Pruning only filters: the survivors are matched as before.

(
    _K_PRINCIPAL,
    _K_PRINCIPAL_PREFIX,
    _K_PRINCIPAL_SUFFIX,
    _K_PRINCIPAL_PRESENT,
    _K_NAMESPACE,
    _K_NAMESPACE_PREFIX,
    _K_NAMESPACE_SUFFIX,
    _K_NAMESPACE_PRESENT,
    _K_ACCOUNT,
    _K_SRC_IP,
    _K_DST_IP,
    _K_PORT,
    _K_ALWAYS,
) = range(13)

Key = tuple
ALWAYS_KEY: Key = (_K_ALWAYS,)
# A length the connection's key set must cover: (tag, IP version or 0, length).
KeyLength = tuple[int, int, int]
_NO_KEYS: frozenset[Key] = frozenset()
_ALWAYS: frozenset[Key] = frozenset((ALWAYS_KEY,))

# Tags for EXACT, PREFIX, SUFFIX, PRESENCE, by field (True: principals, False: namespaces).
_STRING_TAGS = {
    True: (_K_PRINCIPAL, _K_PRINCIPAL_PREFIX, _K_PRINCIPAL_SUFFIX, _K_PRINCIPAL_PRESENT),
    False: (_K_NAMESPACE, _K_NAMESPACE_PREFIX, _K_NAMESPACE_SUFFIX, _K_NAMESPACE_PRESENT),
}

# Which positive list guards a rule: the rank of a list is its worst entry's, and lower ranks are
# rarer among connections. Identities are the most selective; ports (a mesh has few) and entries
# that hold for nearly everyone (presence, "" affixes, /0) the least. Any choice is correct.
_RANK_IDENTITY, _RANK_SRC_IP, _RANK_NAMESPACE, _RANK_DST_IP, _RANK_AFFIX, _RANK_PORT, _RANK_ANY = range(7)


def _string_keys(
    matches: Sequence[StringMatch], principal: bool, lengths: set[KeyLength]
) -> tuple[int, list[Key]]:
    exact_tag, prefix_tag, suffix_tag, present_tag = _STRING_TAGS[principal]
    rank = 0
    keys: list[Key] = []
    for m in matches:
        kind = m.kind
        if kind is StringMatchKind.EXACT:
            keys.append((exact_tag, m.value))
            rank = max(rank, _RANK_IDENTITY if principal else _RANK_NAMESPACE)
        elif kind is StringMatchKind.PRESENCE:
            keys.append((present_tag,))
            rank = _RANK_ANY
        else:
            tag = prefix_tag if kind is StringMatchKind.PREFIX else suffix_tag
            keys.append((tag, m.value))
            lengths.add((tag, 0, len(m.value)))
            rank = max(rank, _RANK_AFFIX if m.value else _RANK_ANY)
    return rank, keys


def _ip_keys(tag: int, networks: Sequence[IPNetwork], lengths: set[KeyLength]) -> tuple[int, list[Key]]:
    rank = _RANK_SRC_IP if tag == _K_SRC_IP else _RANK_DST_IP
    keys: list[Key] = []
    for net in networks:
        length = net.prefixlen
        keys.append((tag, net.version, length, int(net.network_address) >> (net.max_prefixlen - length)))
        lengths.add((tag, net.version, length))
        if length == 0:
            rank = _RANK_ANY
    return rank, keys


def _better(best: tuple[int, list[Key]] | None, candidate: tuple[int, list[Key]]) -> tuple[int, list[Key]]:
    return candidate if best is None or candidate[0] < best[0] else best


def _match_keys(m: Match, lengths: set[KeyLength]) -> tuple[tuple[int, list[Key]] | None, set[Key]]:
    """One Match in keys: its best-ranked positive list (None when it has none) and the union of
    its negative lists (any one of those keys in the connection's set makes the Match fail).
    Positive lists are looked at from the best possible rank down, skipping those that cannot
    rank better; a list never looked at adds no key lengths (none of its keys are filed)."""
    best: tuple[int, list[Key]] | None = None
    if m.service_accounts:
        best = (_RANK_IDENTITY, [(_K_ACCOUNT, a.namespace, a.service_account) for a in m.service_accounts])
    if m.principals and best is None:
        best = _string_keys(m.principals, True, lengths)
    # Unrolled on purpose: per-call closures would cost more in GC work than the lookups save.
    if m.source_ips and (best is None or best[0] > _RANK_SRC_IP):
        best = _better(best, _ip_keys(_K_SRC_IP, m.source_ips, lengths))
    if m.namespaces and (best is None or best[0] > _RANK_NAMESPACE):
        best = _better(best, _string_keys(m.namespaces, False, lengths))
    if m.destination_ips and (best is None or best[0] > _RANK_DST_IP):
        best = _better(best, _ip_keys(_K_DST_IP, m.destination_ips, lengths))
    if m.destination_ports and (best is None or best[0] > _RANK_PORT):
        best = (_RANK_PORT, [(_K_PORT, p) for p in m.destination_ports])
    negative: set[Key] = set()
    if m.not_service_accounts:
        negative.update((_K_ACCOUNT, a.namespace, a.service_account) for a in m.not_service_accounts)
    if m.not_principals:
        negative.update(_string_keys(m.not_principals, True, lengths)[1])
    if m.not_namespaces:
        negative.update(_string_keys(m.not_namespaces, False, lengths)[1])
    if m.not_source_ips:
        negative.update(_ip_keys(_K_SRC_IP, m.not_source_ips, lengths)[1])
    if m.not_destination_ips:
        negative.update(_ip_keys(_K_DST_IP, m.not_destination_ips, lengths)[1])
    if m.not_destination_ports:
        negative.update((_K_PORT, p) for p in m.not_destination_ports)
    return best, negative


@dataclass(frozen=True, slots=True, kw_only=True)
class RuleFilter:
    """A necessary condition for one rule: it can hold only if the connection's key set meets
    `guard` and misses `exclusion` (ALWAYS_KEY is in every connection's set)."""

    guard: frozenset[Key]
    exclusion: frozenset[Key] = _NO_KEYS

    def admits(self, keys: Set[Key]) -> bool:
        return not self.guard.isdisjoint(keys) and self.exclusion.isdisjoint(keys)


def rule_filters(policy: Authorization) -> tuple[tuple[RuleFilter, ...], frozenset[KeyLength]]:
    """The filter of every rule that can hold at all (a rule with a clause made only of empty
    Matches never does), and the key lengths the filters rely on."""
    lengths: set[KeyLength] = set()
    filters: list[RuleFilter] = []
    for rule in policy.rules:
        best: tuple[int, set[Key]] | None = None
        exclusion: set[Key] = set()
        possible = True
        for clause in rule.clauses:
            if not clause.matches:
                continue  # holds for everyone: neither guards nor excludes
            clause_rank = 0
            clause_guard: set[Key] | None = set()
            clause_exclusion: set[Key] | None = None
            for m in clause.matches:
                guard, negative = _match_keys(m, lengths)
                if guard is None and not negative:
                    continue  # an empty Match: skipped, never "matches everything"
                if guard is None:
                    clause_guard = None
                elif clause_guard is not None:
                    clause_rank = max(clause_rank, guard[0])
                    clause_guard.update(guard[1])
                # The clause fails only if every Match fails: keys that exclude all of them.
                clause_exclusion = negative if clause_exclusion is None else clause_exclusion & negative
            if clause_exclusion is None:
                possible = False  # only empty Matches: the clause, and so the rule, never holds
                break
            exclusion |= clause_exclusion
            if clause_guard is not None and (best is None or clause_rank < best[0]):
                best = (clause_rank, clause_guard)
        if possible:
            guard = frozenset(best[1]) if best is not None else _ALWAYS
            filters.append(RuleFilter(guard=guard, exclusion=frozenset(exclusion)))
    return tuple(filters), frozenset(lengths)


def conn_keys(conn: RbacConnection, lengths: Mapping[tuple[int, int], Sequence[int]]) -> frozenset[Key]:
    """The connection's key set; `lengths` maps (tag, IP version or 0) to the lengths in use."""
    keys: list[Key] = [ALWAYS_KEY, (_K_PORT, conn.dst_port)]
    identity = conn.src_identity
    # Without identity the namespace is "" (so exact "" and empty affixes hold) and no principal
    # or service account key exists: no principal entry of any kind holds (see `_string_test`).
    namespace = identity.namespace if identity is not None else ""
    strings: list[tuple[str, tuple[int, int, int, int]]] = [(namespace, _STRING_TAGS[False])]
    if identity is not None:
        keys.append((_K_ACCOUNT, identity.namespace, identity.service_account))
        strings.append((identity.principal, _STRING_TAGS[True]))
    for value, (exact_tag, prefix_tag, suffix_tag, present_tag) in strings:
        keys.append((exact_tag, value))
        if value:
            keys.append((present_tag,))
        size = len(value)
        keys.extend((prefix_tag, value[:n]) for n in lengths.get((prefix_tag, 0), ()) if n <= size)
        keys.extend((suffix_tag, value[size - n :]) for n in lengths.get((suffix_tag, 0), ()) if n <= size)
    for tag, ip in ((_K_SRC_IP, conn.src_ip), (_K_DST_IP, conn.dst_ip)):
        version, bits, value = ip.version, ip.max_prefixlen, int(ip)
        keys.extend((tag, version, n, value >> (bits - n)) for n in lengths.get((tag, version), ()))
    return frozenset(keys)


# -- evaluation (reference 5.3) ---------------------------------------------------------------------


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


# -- which policies apply (reference 5.2) -----------------------------------------------------------


class PolicyTarget(Protocol):
    """What policy selection reads of a destination workload (`state.model.Workload` fits)."""

    @property
    def namespace(self) -> str: ...

    @property
    def authorization_policies(self) -> Sequence[str]: ...


GLOBAL_INDEX = ""


def _index_namespace(policy: Authorization) -> str | None:
    """Where ztunnel's PolicyStore files a policy: GLOBAL under "" whatever its own namespace
    (istiod gives root-namespace policies without selector GLOBAL scope, and they must reach
    every namespace), NAMESPACE under its namespace, WORKLOAD_SELECTOR nowhere."""
    match policy.scope:
        case Scope.GLOBAL:
            return GLOBAL_INDEX
        case Scope.NAMESPACE:
            return policy.namespace
        case Scope.WORKLOAD_SELECTOR:
            return None
    raise AssertionError(policy.scope)


def _selected(
    lookup: Callable[[str], Authorization | None], workload: PolicyTarget
) -> Iterator[tuple[str, Authorization]]:
    """The workload's own policy list, minus unknown keys (warned) and keys the namespace and
    global indexes already contributed (ztunnel would evaluate those twice; the result is the
    same, the dry-run log would not be)."""
    seen: set[str] = set()
    for key in workload.authorization_policies:
        policy = lookup(key)
        if policy is None:
            # Usually a transition: the workload arrived before its policy, or the policy was removed.
            log.warning("skipping unknown policy %s", key)
            continue
        if key in seen or _index_namespace(policy) in (workload.namespace, GLOBAL_INDEX):
            continue
        seen.add(key)
        yield key, policy


def policies_for(state_policies: Mapping[str, Authorization], workload: PolicyTarget) -> list[Authorization]:
    """The policies that apply to `workload`: its namespace's, the global ones, its own list.

    With a PolicyIndex this uses the index; with a plain mapping it scans every policy (fine for
    tests and small local configs, not for the per-connection path of a large mesh).
    """
    if isinstance(state_policies, PolicyIndex):
        return [c.policy for c in state_policies.applicable(workload)]
    ns = workload.namespace
    values = state_policies.values()
    result = [p for p in values if _index_namespace(p) == ns] if ns != GLOBAL_INDEX else []
    result.extend(p for p in values if _index_namespace(p) == GLOBAL_INDEX)
    result.extend(p for _key, p in _selected(state_policies.get, workload))
    return result


# Below this many policies a bucket is matched in full: computing the connection's keys and
# looking them up costs about as much as matching a few policies (bench/rbac_bench.py).
MIN_INDEXED_POLICIES = 16


class PolicyBucket:
    """The policies filed under one namespace ("" = GLOBAL) in arrival order, with the postings
    that prune them: guard key -> exclusion -> sequence numbers of the policies filed there."""

    __slots__ = ("policies", "postings", "filed", "enforced_allow")

    def __init__(self) -> None:
        self.policies: dict[int, CompiledPolicy] = {}
        self.postings: dict[Key, dict[frozenset[Key], set[int]]] = {}
        self.filed: dict[int, tuple[tuple[Key, frozenset[Key]], ...]] = {}
        # Pruning may drop every ALLOW, but "no allow policies" is about existence, not matching.
        self.enforced_allow = 0

    def add(self, seq: int, compiled: CompiledPolicy, filters: Sequence[RuleFilter]) -> None:
        self.policies[seq] = compiled
        entries = {(key, f.exclusion) for f in filters for key in f.guard}
        for key, exclusion in entries:
            self.postings.setdefault(key, {}).setdefault(exclusion, set()).add(seq)
        self.filed[seq] = tuple(entries)
        if not compiled.deny and not compiled.dry_run:
            self.enforced_allow += 1

    def discard(self, seq: int) -> None:
        compiled = self.policies.pop(seq)
        for key, exclusion in self.filed.pop(seq):
            groups = self.postings[key]
            seqs = groups[exclusion]
            seqs.discard(seq)
            if not seqs:
                del groups[exclusion]
                if not groups:
                    del self.postings[key]
        if not compiled.deny and not compiled.dry_run:
            self.enforced_allow -= 1

    def candidates(self, keys: frozenset[Key]) -> list[CompiledPolicy]:
        """The policies, in order, that are not provably unable to match a connection with `keys`."""
        found: set[int] = set()
        postings = self.postings
        for key in keys:
            groups = postings.get(key)
            if groups:
                for exclusion, seqs in groups.items():
                    if exclusion.isdisjoint(keys):
                        found.update(seqs)
        policies = self.policies
        return [policies[seq] for seq in sorted(found)]

    def __len__(self) -> int:
        return len(self.policies)

    def __repr__(self) -> str:
        return (
            f"<PolicyBucket: {len(self.policies)} policies, {self.enforced_allow} enforced ALLOW, "
            f"{len(self.postings)} guard keys>"
        )


class PolicyIndex(MutableMapping[str, Authorization]):
    """All policies by key, compiled, plus ztunnel's by-namespace index ("" = GLOBAL).

    A drop-in for the `dict[str, Authorization]` that ProxyState keeps (`index[key] = policy`,
    `pop`, `clear`, `items` all work), so a per-connection lookup touches only the destination
    namespace's and the global policies, and each policy is compiled once, when it arrives.
    Buckets of at least `min_indexed` policies are pruned by key (PolicyBucket) before matching.
    """

    def __init__(
        self, policies: Iterable[Authorization] = (), *, min_indexed: int = MIN_INDEXED_POLICIES
    ) -> None:
        self.min_indexed = min_indexed
        self._by_key: dict[str, CompiledPolicy] = {}
        self._seq: dict[str, int] = {}
        self._next_seq = itertools.count()
        self._by_namespace: dict[str, PolicyBucket] = {}
        # Key lengths in use by filed policies, counted so that removals can retire them.
        self._lengths: Counter[KeyLength] = Counter()
        self._filed_lengths: dict[str, frozenset[KeyLength]] = {}
        self._grouped: dict[tuple[int, int], tuple[int, ...]] | None = None
        for policy in policies:
            self.insert(policy)

    # -- writes -----------------------------------------------------------------------------------

    def insert(self, policy: Authorization) -> None:
        """Add or replace a policy; a replacement may change scope, so the old entry is unfiled."""
        self._unfile(policy.key)
        compiled = CompiledPolicy(policy)
        key = compiled.key
        self._by_key[key] = compiled
        index = _index_namespace(policy)
        if index is None:
            return
        seq = next(self._next_seq)
        self._seq[key] = seq
        filters, lengths = rule_filters(policy)
        bucket = self._by_namespace.get(index)
        if bucket is None:
            bucket = self._by_namespace[index] = PolicyBucket()
        bucket.add(seq, compiled, filters)
        if lengths:
            self._filed_lengths[key] = lengths
            if any(length not in self._lengths for length in lengths):
                self._grouped = None
            self._lengths.update(lengths)

    def remove(self, key: str) -> bool:
        return self._unfile(key) is not None

    def _unfile(self, key: str) -> CompiledPolicy | None:
        old = self._by_key.pop(key, None)
        if old is None:
            return None
        index = _index_namespace(old.policy)
        if index is None:
            return old
        bucket = self._by_namespace[index]
        bucket.discard(self._seq.pop(key))
        if not bucket:
            del self._by_namespace[index]
        lengths = self._filed_lengths.pop(key, ())
        if lengths:
            self._lengths.subtract(lengths)
            for length in lengths:
                if self._lengths[length] <= 0:
                    del self._lengths[length]
                    self._grouped = None
        return old

    def clear(self) -> None:
        self._by_key.clear()
        self._seq.clear()
        self._by_namespace.clear()
        self._lengths.clear()
        self._filed_lengths.clear()
        self._grouped = None

    def __setitem__(self, key: str, policy: Authorization) -> None:
        if key != policy.key:
            raise KeyError(f"policy {policy.key} filed under {key!r}: the key must be namespace/name")
        self.insert(policy)

    def __delitem__(self, key: str) -> None:
        if not self.remove(key):
            raise KeyError(key)

    # -- reads ------------------------------------------------------------------------------------

    def __getitem__(self, key: str) -> Authorization:
        return self._by_key[key].policy

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_key)

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def compiled(self, key: str) -> CompiledPolicy | None:
        return self._by_key.get(key)

    def by_namespace(self, namespace: str) -> tuple[Authorization, ...]:
        """The policies filed under `namespace` (NAMESPACE scope; "" gives the GLOBAL ones)."""
        bucket = self._by_namespace.get(namespace)
        return tuple(c.policy for c in bucket.policies.values()) if bucket else ()

    def global_(self) -> tuple[Authorization, ...]:
        return self.by_namespace(GLOBAL_INDEX)

    def bucket(self, namespace: str) -> PolicyBucket | None:
        return self._by_namespace.get(namespace)

    def _own(self, workload: PolicyTarget) -> list[CompiledPolicy]:
        by_key = self._by_key

        def lookup(key: str) -> Authorization | None:
            compiled = by_key.get(key)
            return compiled.policy if compiled else None

        return [by_key[key] for key, _policy in _selected(lookup, workload)]

    def _buckets(self, workload: PolicyTarget) -> list[PolicyBucket]:
        ns = workload.namespace
        buckets = []
        if ns != GLOBAL_INDEX and (bucket := self._by_namespace.get(ns)):
            buckets.append(bucket)
        if bucket := self._by_namespace.get(GLOBAL_INDEX):
            buckets.append(bucket)
        return buckets

    def applicable(self, workload: PolicyTarget) -> list[CompiledPolicy]:
        """What `policies_for` returns, compiled: namespace, then global, then the workload's list."""
        result: list[CompiledPolicy] = []
        for bucket in self._buckets(workload):
            result.extend(bucket.policies.values())
        result.extend(self._own(workload))
        return result

    def conn_keys(self, conn: RbacConnection) -> frozenset[Key]:
        """The connection's key set, covering every key length a filed policy uses."""
        grouped = self._grouped
        if grouped is None:
            by_field: dict[tuple[int, int], list[int]] = {}
            for tag, version, length in sorted(self._lengths):
                by_field.setdefault((tag, version), []).append(length)
            grouped = self._grouped = {field: tuple(lengths) for field, lengths in by_field.items()}
        return conn_keys(conn, grouped)

    def candidates(self, workload: PolicyTarget, conn: RbacConnection) -> tuple[list[CompiledPolicy], bool]:
        """The applicable policies that may match `conn`, in `applicable` order, and whether any
        enforced ALLOW applies at all (pruned or not)."""
        result: list[CompiledPolicy] = []
        any_allow = False
        keys: frozenset[Key] | None = None
        for bucket in self._buckets(workload):
            any_allow = any_allow or bucket.enforced_allow > 0
            if len(bucket) < self.min_indexed:
                result.extend(bucket.policies.values())
                continue
            if keys is None:
                keys = self.conn_keys(conn)
            result.extend(bucket.candidates(keys))
        result.extend(self._own(workload))
        return result, any_allow

    def check(self, workload: PolicyTarget, conn: RbacConnection) -> Decision:
        """`evaluate(policies_for(self, workload), conn)`, matching only the candidates.

        Dropping a policy that cannot match changes no decision: the first matching DENY or
        ALLOW, and the dry-run matches, are the same in the full list and in the candidates;
        only "are there any enforced ALLOWs" needs the full set, and the buckets count those.
        """
        policies, any_allow = self.candidates(workload, conn)
        deny: list[CompiledPolicy] = []
        allow: list[CompiledPolicy] = []
        dry_deny: list[CompiledPolicy] = []
        dry_allow: list[CompiledPolicy] = []
        for compiled in policies:
            if compiled.dry_run:
                (dry_deny if compiled.deny else dry_allow).append(compiled)
            else:
                (deny if compiled.deny else allow).append(compiled)
        return _decide(deny, allow, dry_deny, dry_allow, conn, any_allow=any_allow)

    def __repr__(self) -> str:
        glob = self._by_namespace.get(GLOBAL_INDEX)
        n_global = len(glob) if glob else 0
        namespaces = len(self._by_namespace) - (1 if glob else 0)
        indexed = sum(len(b) for b in self._by_namespace.values())
        return (
            f"<PolicyIndex: {len(self._by_key)} policies, {n_global} global, "
            f"{indexed - n_global} in {namespaces} namespaces, {len(self._by_key) - indexed} by selector>"
        )
