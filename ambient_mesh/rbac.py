"""L4 authorization: `istio.security.Authorization` as the node proxy holds and enforces it.

Counterparts: ztunnel src/rbac.rs (the model and `Authorization::matches`), src/state/policy.rs
(`PolicyStore`, the by-namespace index) and `assert_rbac` in src/state.rs (which policies apply,
deny before allow). Wire form: spec/wire-protocols.md section 3, where istiod's
`groups -> rules -> matches` is ztunnel's `rules -> clauses -> matches`; we use ztunnel's names.
Behaviour: reference/ztunnel.md 5.1-5.5.

Evaluation is pure: `evaluate` and `PolicyIndex.check` return a `Decision` value and never do I/O;
the caller closes the connection, records the DENY flag and logs (`log_dry_run`). Policies are
compiled once (`CompiledPolicy`: string matches become sets and tuples for `str.startswith`,
CIDRs become masked integers) so a decision costs no parsing and no `ipaddress` arithmetic.
"""

from __future__ import annotations

import enum
import ipaddress
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
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
# A connection becomes a flat tuple of values, a Match a tuple of (value index, test, expected)
# checks. Tests are mostly C-level bound methods (`frozenset.__contains__`), so a check costs one
# call. Values: the principal (None without identity), the peer namespace ("" without identity),
# the peer (namespace, service account) (None without identity), source and destination IP as
# keyed integers, and the destination port.

_PRINCIPAL, _NAMESPACE, _ACCOUNT, _SRC_IP, _DST_IP, _PORT = range(6)

# IP keys: the address as an integer with bit 128 set for IPv6, so one mask test can never match
# an address of the other family (an IPv4 mask keeps bit 128, which an IPv4 key never has).
_V6_BIT = 1 << 128

Test = Callable[[object], bool]
Check = tuple[int, Test, bool]


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


def _always(_value: object) -> bool:
    return True


def _string_test(matches: Sequence[StringMatch], *, principal: bool) -> Test:
    """One test equivalent to `any(m.matches(value) for m in matches)`.

    For principals the value is None when the peer has no identity: ztunnel strips `spiffe://`
    from an empty id, fails, and so no principal match of any kind holds (not even exact "").
    """
    exact = frozenset(m.value for m in matches if m.kind is StringMatchKind.EXACT)
    prefixes = tuple(m.value for m in matches if m.kind is StringMatchKind.PREFIX)
    suffixes = tuple(m.value for m in matches if m.kind is StringMatchKind.SUFFIX)
    presence = any(m.kind is StringMatchKind.PRESENCE for m in matches)
    if "" in prefixes or "" in suffixes:
        inner: Test = _always
    elif not (prefixes or suffixes or presence):
        # frozenset.__contains__ is also False for None, so no wrapper is needed.
        return exact.__contains__
    else:

        def inner(value: object) -> bool:
            return (
                value in exact
                or (presence and value != "")
                or value.startswith(prefixes)  # type: ignore[union-attr]
                or value.endswith(suffixes)  # type: ignore[union-attr]
            )

    if not principal:
        return inner

    def principal_test(value: object) -> bool:
        return value is not None and inner(value)

    return principal_test


def _ip_test(networks: Sequence[IPNetwork]) -> Test:
    """CIDR containment as masked integer compares, grouped by mask."""
    by_mask: dict[int, set[int]] = {}
    for net in networks:
        if net.version == 6:
            mask, base = int(net.netmask) | _V6_BIT, int(net.network_address) | _V6_BIT
        else:
            mask, base = int(net.netmask) | _V6_BIT, int(net.network_address)
        by_mask.setdefault(mask, set()).add(base)
    groups = tuple((mask, frozenset(bases)) for mask, bases in by_mask.items())
    full_v4, full_v6 = (1 << 32) - 1 | _V6_BIT, (1 << 129) - 1
    if all(mask in (full_v4, full_v6) for mask, _ in groups):
        # Only single addresses: the key itself is the base.
        return frozenset().union(*(bases for _, bases in groups)).__contains__

    def test(key: object) -> bool:
        for mask, bases in groups:
            if key & mask in bases:  # type: ignore[operator]
                return True
        return False

    return test


def _checks(m: Match) -> tuple[Check, ...]:
    checks: list[Check] = []

    def add(index: int, test: Test | None, values: Sequence, want: bool) -> None:
        if values and test is not None:
            checks.append((index, test, want))

    # Ports first: the cheapest test and, in practice, the most selective.
    add(_PORT, frozenset(m.destination_ports).__contains__, m.destination_ports, True)
    add(_PORT, frozenset(m.not_destination_ports).__contains__, m.not_destination_ports, False)
    for index, positive, negative in (
        (_DST_IP, m.destination_ips, m.not_destination_ips),
        (_SRC_IP, m.source_ips, m.not_source_ips),
    ):
        add(index, positive and _ip_test(positive), positive, True)
        add(index, negative and _ip_test(negative), negative, False)
    accounts = frozenset((a.namespace, a.service_account) for a in m.service_accounts)
    not_accounts = frozenset((a.namespace, a.service_account) for a in m.not_service_accounts)
    add(_ACCOUNT, accounts.__contains__, m.service_accounts, True)
    add(_ACCOUNT, not_accounts.__contains__, m.not_service_accounts, False)
    for index, positive, negative, principal in (
        (_PRINCIPAL, m.principals, m.not_principals, True),
        (_NAMESPACE, m.namespaces, m.not_namespaces, False),
    ):
        add(index, positive and _string_test(positive, principal=principal), positive, True)
        add(index, negative and _string_test(negative, principal=principal), negative, False)
    return tuple(checks)


# A clause compiled to None matches everything (it had no matches at all); otherwise it is the
# tuple of its non-empty matches, and an empty tuple (only empty Match objects) never matches.
_CompiledClause = tuple[tuple[Check, ...], ...] | None


class CompiledPolicy:
    """An Authorization prepared for fast matching; built once per policy version."""

    __slots__ = ("policy", "key", "deny", "dry_run", "_rules")

    def __init__(self, policy: Authorization) -> None:
        self.policy = policy
        self.key = policy.key
        self.deny = policy.action is Action.DENY
        self.dry_run = policy.dry_run
        rules: list[tuple[_CompiledClause, ...]] = []
        for rule in policy.rules:
            clauses: list[_CompiledClause] = []
            for clause in rule.clauses:
                if not clause.matches:
                    clauses.append(None)
                    continue
                # An empty Match (no field set) is skipped, never "matches everything"
                # (ztunnel `RbacMatch::is_empty`; istio/istio#61126).
                clauses.append(tuple(c for c in map(_checks, clause.matches) if c))
            # A clause with no matches holds for every connection, so it adds nothing to the AND.
            rules.append(tuple(c for c in clauses if c is not None))
        self._rules = tuple(rules)

    def matches(self, conn: RbacConnection) -> bool:
        return self._matches(_peer_values(conn))

    def _matches(self, values: tuple) -> bool:
        # Zero rules match nothing; a rule with zero clauses matches everything.
        for rule in self._rules:
            for clause in rule:
                for checks in clause:
                    for index, test, want in checks:
                        if test(values[index]) is not want:
                            break
                    else:
                        break  # this match holds, so the clause does
                else:
                    break  # no match held: the clause fails, and with it the rule
            else:
                return True
        return False

    def __repr__(self) -> str:
        action = "DENY" if self.deny else "ALLOW"
        dry = " dry-run" if self.dry_run else ""
        return f"<CompiledPolicy {self.key} {self.policy.scope.name}{dry} {action}: {len(self._rules)} rules>"


def compile_policy(policy: Authorization | CompiledPolicy) -> CompiledPolicy:
    return policy if isinstance(policy, CompiledPolicy) else CompiledPolicy(policy)


# -- evaluation (reference 5.3) ---------------------------------------------------------------------


def _decide(
    deny: Sequence[CompiledPolicy],
    allow: Sequence[CompiledPolicy],
    dry_deny: Sequence[CompiledPolicy],
    dry_allow: Sequence[CompiledPolicy],
    conn: RbacConnection,
) -> Decision:
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
    if not allow:
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


class PolicyIndex(MutableMapping[str, Authorization]):
    """All policies by key, compiled, plus ztunnel's by-namespace index ("" = GLOBAL).

    A drop-in for the `dict[str, Authorization]` that ProxyState keeps (`index[key] = policy`,
    `pop`, `clear`, `items` all work), so a per-connection lookup touches only the destination
    namespace's and the global policies, and each policy is compiled once, when it arrives.
    """

    def __init__(self, policies: Iterable[Authorization] = ()) -> None:
        self._by_key: dict[str, CompiledPolicy] = {}
        self._by_namespace: dict[str, dict[str, CompiledPolicy]] = {}
        for policy in policies:
            self.insert(policy)

    # -- writes -----------------------------------------------------------------------------------

    def insert(self, policy: Authorization) -> None:
        """Add or replace a policy; a replacement may change scope, so the old entry is unfiled."""
        self._unfile(policy.key)
        compiled = CompiledPolicy(policy)
        self._by_key[compiled.key] = compiled
        index = _index_namespace(policy)
        if index is not None:
            self._by_namespace.setdefault(index, {})[compiled.key] = compiled

    def remove(self, key: str) -> bool:
        return self._unfile(key) is not None

    def _unfile(self, key: str) -> CompiledPolicy | None:
        old = self._by_key.pop(key, None)
        if old is None:
            return None
        index = _index_namespace(old.policy)
        bucket = self._by_namespace.get(index) if index is not None else None
        if bucket is not None:
            del bucket[key]
            if not bucket:
                del self._by_namespace[index]  # type: ignore[arg-type]
        return old

    def clear(self) -> None:
        self._by_key.clear()
        self._by_namespace.clear()

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
        return tuple(c.policy for c in bucket.values()) if bucket else ()

    def global_(self) -> tuple[Authorization, ...]:
        return self.by_namespace(GLOBAL_INDEX)

    def _own(self, workload: PolicyTarget) -> list[CompiledPolicy]:
        by_key = self._by_key

        def lookup(key: str) -> Authorization | None:
            compiled = by_key.get(key)
            return compiled.policy if compiled else None

        return [by_key[key] for key, _policy in _selected(lookup, workload)]

    def applicable(self, workload: PolicyTarget) -> list[CompiledPolicy]:
        """What `policies_for` returns, compiled: namespace, then global, then the workload's list."""
        ns = workload.namespace
        result: list[CompiledPolicy] = []
        if ns != GLOBAL_INDEX and (bucket := self._by_namespace.get(ns)):
            result.extend(bucket.values())
        if bucket := self._by_namespace.get(GLOBAL_INDEX):
            result.extend(bucket.values())
        result.extend(self._own(workload))
        return result

    def check(self, workload: PolicyTarget, conn: RbacConnection) -> Decision:
        """`evaluate(policies_for(self, workload), conn)` on the compiled policies.

        bench/rbac_bench.py measured a cached per-namespace split by action: no gain, since
        matching dominates, so the policies are split per call.
        """
        return evaluate(self.applicable(workload), conn)

    def __repr__(self) -> str:
        glob = self._by_namespace.get(GLOBAL_INDEX)
        n_global = len(glob) if glob else 0
        namespaces = len(self._by_namespace) - (1 if glob else 0)
        indexed = sum(len(b) for b in self._by_namespace.values())
        return (
            f"<PolicyIndex: {len(self._by_key)} policies, {n_global} global, "
            f"{indexed - n_global} in {namespaces} namespaces, {len(self._by_key) - indexed} by selector>"
        )
