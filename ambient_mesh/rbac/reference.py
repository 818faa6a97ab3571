"""The reference evaluator: Istio's L4 authorization semantics, read top to bottom.

Counterparts: ztunnel src/rbac.rs `Authorization::matches` / `RbacMatch` and `assert_rbac` in
src/state.rs; behaviour in docs/istio-behaviour.md, "Authorization". Nothing here is fast: it walks the rule
tree with `StringMatch.matches` and `ip in network` for every connection. It exists to say what a
decision means; `compiled` (and `PolicyIndex.check` on top of it) is what the proxy runs, and the
property tests hold the two to the same answer for every policy set and connection.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from .model import (
    REASON_ALLOWED,
    REASON_DENIED,
    REASON_NO_ALLOW_POLICIES,
    REASON_NOT_ALLOWED,
    Action,
    Authorization,
    Decision,
    Match,
    RbacConnection,
)

_T = TypeVar("_T")


def _field_holds(positive: Sequence[_T], negative: Sequence[_T], holds: Callable[[_T], bool]) -> bool:
    """One field of a Match: some positive entry holds (or the list is empty) and no negated one does."""
    return (not positive or any(holds(v) for v in positive)) and not any(holds(v) for v in negative)


def match_holds(m: Match, conn: RbacConnection) -> bool:
    """Every non-empty field of the Match holds (fields AND-ed, entries of one field OR-ed)."""
    peer = conn.src_identity
    # Without an mTLS identity there is no principal at all: no principal entry of any kind holds,
    # not even exact "" (ztunnel strips `spiffe://` from an empty id and fails). The namespace is
    # "" instead, so exact "" and empty affixes on namespaces do hold.
    principal = peer.principal if peer is not None else None
    namespace = peer.namespace if peer is not None else ""
    return (
        _field_holds(m.destination_ips, m.not_destination_ips, lambda net: conn.dst_ip in net)
        and _field_holds(m.source_ips, m.not_source_ips, lambda net: conn.src_ip in net)
        and _field_holds(m.destination_ports, m.not_destination_ports, lambda port: port == conn.dst_port)
        and _field_holds(
            m.service_accounts,
            m.not_service_accounts,
            lambda sa: (
                peer is not None
                and (sa.namespace, sa.service_account) == (peer.namespace, peer.service_account)
            ),
        )
        and _field_holds(
            m.principals, m.not_principals, lambda s: principal is not None and s.matches(principal)
        )
        and _field_holds(m.namespaces, m.not_namespaces, lambda s: s.matches(namespace))
    )


def policy_matches(policy: Authorization, conn: RbacConnection) -> bool:
    """A policy matches when any of its rules holds; a policy with no rules matches nothing.

    A rule holds when every clause does. A clause with no matches holds for every connection; a
    clause holds when any of its non-empty Matches does. An empty Match (no field set) is skipped,
    never "matches everything" (ztunnel `RbacMatch::is_empty`; istio/istio#61126), so a clause of
    only empty Matches never holds.
    """
    for rule in policy.rules:
        if all(
            not clause.matches or any(match_holds(m, conn) for m in clause.matches if m != Match())
            for clause in rule.clauses
        ):
            return True
    return False


def evaluate(policies: Iterable[Authorization], conn: RbacConnection) -> Decision:
    """Authorize `conn` against the policies that apply to its destination (docs/istio-behaviour.md,
    "Authorization").

    1. Dry-run DENY policies that match are recorded, never enforced.
    2. The first enforced DENY that matches rejects.
    3. Dry-run ALLOW policies that match are recorded.
    4. With no enforced ALLOW policy at all, the connection is allowed (Istio's default).
    5. The first enforced ALLOW that matches allows; otherwise the connection is rejected.
    """
    policies = list(policies)
    dry = [p.key for p in policies if p.dry_run and p.action is Action.DENY and policy_matches(p, conn)]
    for p in policies:
        if not p.dry_run and p.action is Action.DENY and policy_matches(p, conn):
            return Decision(
                allowed=False,
                policy=p.key,
                reason=REASON_DENIED.format(key=p.key),
                dry_run_matches=tuple(dry),
            )
    dry += [p.key for p in policies if p.dry_run and p.action is Action.ALLOW and policy_matches(p, conn)]
    allows = [p for p in policies if not p.dry_run and p.action is Action.ALLOW]
    if not allows:
        return Decision(
            allowed=True, policy=None, reason=REASON_NO_ALLOW_POLICIES, dry_run_matches=tuple(dry)
        )
    for p in allows:
        if policy_matches(p, conn):
            return Decision(
                allowed=True,
                policy=p.key,
                reason=REASON_ALLOWED.format(key=p.key),
                dry_run_matches=tuple(dry),
            )
    return Decision(allowed=False, policy=None, reason=REASON_NOT_ALLOWED, dry_run_matches=tuple(dry))
