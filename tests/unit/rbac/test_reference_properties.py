"""Properties of L4 authorization over random policy sets (docs/istio-behaviour.md, "Authorization").

Values come from small pools so that random matches often hold: the interesting cases are the ones where some
policies match and some do not. `ambient_mesh.rbac.reference` is the plain reading of docs/istio-behaviour.md,
"Authorization" (StringMatch.matches, `ip in network`, no compilation); the compiled fast path and the pruning
index must agree with it on every input.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from ambient_mesh.rbac import (
    Action,
    Authorization,
    Clause,
    CompiledPolicy,
    Match,
    PolicyIndex,
    RbacConnection,
    Rule,
    Scope,
    evaluate,
    policies_for,
)
from ambient_mesh.rbac.reference import evaluate as reference_evaluate
from ambient_mesh.rbac.reference import policy_matches as reference_matches
from tests.helpers.rbac_strategies import (
    NAMESPACES,
    connections,
    match_objects,
    matching_rule,
    policy_sets,
)

# -- properties ---------------------------------------------------------------------------------------


@settings(max_examples=500)
@given(st.lists(match_objects(), max_size=1), connections)
def test_single_match_agrees_with_reference(ms: list[Match], conn: RbacConnection) -> None:
    p = Authorization(name="p", namespace="a", rules=(Rule(clauses=(Clause(matches=tuple(ms)),)),))
    assert CompiledPolicy(p).matches(conn) is reference_matches(p, conn)


@settings(max_examples=150)
@given(policy_sets(), connections)
def test_evaluate_agrees_with_reference(policies: list[Authorization], conn: RbacConnection) -> None:
    assert evaluate(policies, conn) == reference_evaluate(policies, conn)


@given(policy_sets(), connections, st.integers(0, 6), st.sampled_from(list(Scope)))
def test_matching_enforced_deny_always_denies(
    policies: list[Authorization], conn: RbacConnection, at: int, scope: Scope
) -> None:
    explicit = Authorization(
        name="explicit-deny", namespace="a", scope=scope, action=Action.DENY, rules=(matching_rule(conn),)
    )
    policies.insert(min(at, len(policies)), explicit)
    d = evaluate(policies, conn)
    assert not d.allowed
    assert d.policy is not None and d.reason == f"explicitly denied by: {d.policy}"
    # Whichever DENY decided really matches the connection.
    decider = next(p for p in policies if p.key == d.policy)
    assert decider.action is Action.DENY and not decider.dry_run and reference_matches(decider, conn)


@given(policy_sets(), connections, st.integers(0, 6))
def test_matching_allow_only_loses_to_a_deny(
    policies: list[Authorization], conn: RbacConnection, at: int
) -> None:
    explicit = Authorization(
        name="explicit-allow", namespace="a", action=Action.ALLOW, rules=(matching_rule(conn),)
    )
    policies.insert(min(at, len(policies)), explicit)
    d = evaluate(policies, conn)
    matching_denies = {
        p.key for p in policies if p.action is Action.DENY and not p.dry_run and reference_matches(p, conn)
    }
    if matching_denies:
        assert not d.allowed and d.policy in matching_denies
    else:
        assert d.allowed and d.policy is not None


@given(
    policy_sets(max_size=10),
    connections,
    st.sampled_from(NAMESPACES),
    st.lists(st.sampled_from([f"{ns}/p{i}" for ns in NAMESPACES for i in range(12)]), max_size=4),
)
def test_never_raises_and_index_agrees(
    policies: list[Authorization], conn: RbacConnection, namespace: str, listed: list[str]
) -> None:
    @dataclass(frozen=True)
    class Target:
        namespace: str
        authorization_policies: tuple[str, ...]

    wl = Target(namespace=namespace, authorization_policies=tuple(listed))
    by_key = {p.key: p for p in policies}
    index = PolicyIndex(by_key.values())
    applicable = policies_for(by_key, wl)
    # Same set from the scan and the index, each policy at most once.
    assert sorted(p.key for p in policies_for(index, wl)) == sorted(p.key for p in applicable)
    assert len({p.key for p in applicable}) == len(applicable)
    # Both orders put namespace before global before the workload's list, so the decision is identical.
    expected = evaluate(applicable, conn)
    assert expected == reference_evaluate(applicable, conn)
    assert index.check(wl, conn) == expected
    assert evaluate(policies_for(index, wl), conn) == expected


@given(st.lists(st.tuples(st.booleans(), policy_sets(max_size=1)), max_size=12))
def test_index_tracks_a_dict_through_inserts_and_removes(ops: list[tuple[bool, list[Authorization]]]) -> None:
    index = PolicyIndex()
    mirror: dict[str, Authorization] = {}
    for remove, batch in ops:
        for p in batch:
            if remove:
                assert index.remove(p.key) is (mirror.pop(p.key, None) is not None)
            else:
                index.insert(p)
                mirror[p.key] = p
    assert dict(index) == mirror
    for ns in [*NAMESPACES, ""]:
        expected = {
            k
            for k, p in mirror.items()
            if (p.scope is Scope.NAMESPACE and p.namespace == ns) or (p.scope is Scope.GLOBAL and ns == "")
        }
        assert {p.key for p in index.by_namespace(ns)} == expected
