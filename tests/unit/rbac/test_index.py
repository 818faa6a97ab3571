"""The pruning structures of L4 authorization: entry keys, rule filters, policy buckets.

`PolicyIndex.check` matches only the policies its buckets cannot rule out. These tests pin the
three facts that make that safe: one entry's key is in a connection's key set exactly when the
entry holds (so filters are exact for single entries), a rule that holds always passes its filter
(a filter is a necessary condition), and the index decides exactly as the plain reference does
however many policies it prunes (min_indexed=0 prunes every bucket).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ambient_mesh.identity.spiffe import Identity
from ambient_mesh.net import ip_address
from ambient_mesh.rbac import (
    ALWAYS_KEY,
    REASON_NO_ALLOW_POLICIES,
    REASON_NOT_ALLOWED,
    Action,
    Authorization,
    Clause,
    CompiledPolicy,
    Match,
    PolicyIndex,
    RbacConnection,
    Rule,
    RuleFilter,
    Scope,
    ServiceAccountMatch,
    StringMatch,
    conn_keys,
    evaluate,
    policies_for,
    rule_filters,
    strict_mtls_policy,
)
from ambient_mesh.rbac import compiled as rbac_compiled
from ambient_mesh.rbac.reference import evaluate as reference_evaluate
from ambient_mesh.rbac.reference import policy_matches as reference_matches
from tests.helpers.rbac_strategies import (
    account_matches,
    connections,
    networks,
    policy_sets,
    rules,
    string_matches,
)


@dataclass(frozen=True)
class Target:
    namespace: str
    authorization_policies: tuple[str, ...] = ()


PEER = Identity("cluster.local", "a", "x")


def conn(
    identity: Identity | None = PEER, src: str = "10.0.0.1", dst: str = "10.0.0.2", port: int = 80
) -> RbacConnection:
    return RbacConnection(
        src_identity=identity, src_ip=ip_address(src), dst_ip=ip_address(dst), dst_port=port
    )


def policy(
    *rs: Rule, name: str = "p", scope: Scope = Scope.GLOBAL, action: Action = Action.ALLOW
) -> Authorization:
    return Authorization(name=name, namespace="a", scope=scope, action=action, rules=rs)


def one(m: Match) -> Rule:
    return Rule(clauses=(Clause(matches=(m,)),))


def keys_for(p: Authorization, c: RbacConnection) -> tuple[tuple[RuleFilter, ...], frozenset]:
    """The policy's filters and the connection's keys over exactly the lengths the policy uses."""
    filters, lengths = rule_filters(p)
    grouped: dict[tuple[int, int], list[int]] = {}
    for tag, version, length in lengths:
        grouped.setdefault((tag, version), []).append(length)
    return filters, conn_keys(c, grouped)


# -- keys are exact for single entries ---------------------------------------------------------------

single_entries = st.one_of(
    st.tuples(
        st.sampled_from(["principals", "not_principals", "namespaces", "not_namespaces"]), string_matches
    ),
    st.tuples(st.sampled_from(["service_accounts", "not_service_accounts"]), account_matches),
    st.tuples(
        st.sampled_from(["source_ips", "not_source_ips", "destination_ips", "not_destination_ips"]),
        networks(),
    ),
    st.tuples(
        st.sampled_from(["destination_ports", "not_destination_ports"]), st.sampled_from([80, 8080, 9090])
    ),
)


@settings(max_examples=400)
@given(single_entries, connections)
def test_a_single_entry_filter_is_exact(entry: tuple[str, object], c: RbacConnection) -> None:
    field, value = entry
    p = policy(one(Match(**{field: (value,)})))
    (only,), keys = keys_for(p, c)
    assert only.admits(keys) is reference_matches(p, c)


@settings(max_examples=300)
@given(st.lists(rules, max_size=3), connections)
def test_a_matching_rule_always_passes_its_filter(rs: list[Rule], c: RbacConnection) -> None:
    for rule in rs:
        p = policy(rule)
        filters, keys = keys_for(p, c)
        if reference_matches(p, c):
            assert len(filters) == 1 and filters[0].admits(keys)
        # A rule with no filter can never hold (a clause of only empty Matches).
        if not filters:
            assert not reference_matches(p, c)


def test_string_keys_cover_affixes_presence_and_no_identity() -> None:
    prefix = policy(one(Match(principals=(StringMatch.prefix("cluster.local/ns/a/"),))))
    suffix = policy(one(Match(namespaces=(StringMatch.suffix(""),))))
    present = policy(one(Match(principals=(StringMatch.presence(),))))
    for p, with_identity, without in ((prefix, True, False), (suffix, True, True), (present, True, False)):
        (f,), keys = keys_for(p, conn())
        assert f.admits(keys) is with_identity
        (f,), keys = keys_for(p, conn(identity=None))
        assert f.admits(keys) is without


def test_cidr_keys_never_cross_families() -> None:
    everything_v4 = policy(one(Match(source_ips=(ipaddress.ip_network("0.0.0.0/0"),))))
    (f,), keys = keys_for(everything_v4, conn(src="fd00::1"))
    assert not f.admits(keys)
    (f,), keys = keys_for(everything_v4, conn(src="192.0.2.1"))
    assert f.admits(keys)


def test_filter_shapes() -> None:
    account = Match(principals=(StringMatch.exact("cluster.local/ns/a/sa/x"),), destination_ports=(80,))
    (f,), _ = rule_filters(policy(one(account)))
    # The principal guards (rank above the port); nothing excludes.
    assert f == RuleFilter(guard=frozenset({(0, "cluster.local/ns/a/sa/x")}))
    (f,), _ = rule_filters(strict_mtls_policy())
    assert f.guard == frozenset({ALWAYS_KEY}) and len(f.exclusion) == 1
    # Exclusion of a clause is what excludes every one of its Matches.
    two = Rule(
        clauses=(Clause(matches=(Match(not_destination_ports=(80, 81)), Match(not_destination_ports=(80,)))),)
    )
    (f,), _ = rule_filters(policy(two))
    assert f.exclusion == frozenset({(11, 80)})
    # Zero rules, and a rule whose clause has only empty Matches: nothing to file.
    assert rule_filters(policy()) == ((), frozenset())
    assert rule_filters(policy(Rule(clauses=(Clause(matches=(Match(),)),))))[0] == ()
    # A rule without clauses holds for everyone.
    assert rule_filters(policy(Rule()))[0] == (RuleFilter(guard=frozenset({ALWAYS_KEY})),)


# -- the pruned index decides like the reference -------------------------------------------------------


@settings(max_examples=300)
@given(
    policy_sets(max_size=10),
    connections,
    st.sampled_from(["a", "b", "c"]),
    st.lists(st.sampled_from([f"{ns}/p{i}" for ns in "abc" for i in range(12)]), max_size=4),
)
def test_pruned_check_agrees_with_reference(
    policies: list[Authorization], c: RbacConnection, namespace: str, listed: list[str]
) -> None:
    wl = Target(namespace=namespace, authorization_policies=tuple(listed))
    by_key = {p.key: p for p in policies}
    index = PolicyIndex(by_key.values(), min_indexed=0)
    expected = reference_evaluate(policies_for(by_key, wl), c)
    assert index.check(wl, c) == expected
    candidates, _ = index.candidates(wl, c)
    # Pruning only drops policies that do not match.
    kept = {p.key for p in candidates}
    assert all(not reference_matches(p, c) for p in policies_for(by_key, wl) if p.key not in kept)


@settings(max_examples=100)
@given(st.lists(st.tuples(st.booleans(), policy_sets(max_size=2)), max_size=12), connections)
def test_buckets_follow_inserts_and_removes(
    ops: list[tuple[bool, list[Authorization]]], c: RbacConnection
) -> None:
    index = PolicyIndex(min_indexed=0)
    mirror: dict[str, Authorization] = {}
    for remove, batch in ops:
        for p in batch:
            if remove:
                index.remove(p.key)
                mirror.pop(p.key, None)
            else:
                index.insert(p)
                mirror[p.key] = p
            wl = Target(namespace="a")
            got, want = index.check(wl, c), evaluate(policies_for(mirror, wl), c)
            # After removals and re-inserts the index may list equal policies in another order,
            # so when several could decide, a different one may be named; the verdict is the same.
            assert (got.allowed, sorted(got.dry_run_matches), got.policy is None) == (
                want.allowed,
                sorted(want.dry_run_matches),
                want.policy is None,
            )
            if got.policy is not None:
                assert got.policy in mirror and mirror[got.policy].action == mirror[want.policy].action
    for key in list(mirror):
        index.remove(key)
    assert index._by_namespace == {} and not index._lengths


def test_a_pruned_allow_still_counts_as_an_allow_policy() -> None:
    only_b = policy(one(Match(namespaces=(StringMatch.exact("b"),))), name="allow-b")
    index = PolicyIndex([only_b], min_indexed=0)
    assert index.candidates(Target(namespace="a"), conn()) == ([], True)
    assert index.check(Target(namespace="a"), conn()).reason == REASON_NOT_ALLOWED
    index.remove(only_b.key)
    assert index.check(Target(namespace="a"), conn()).reason == REASON_NO_ALLOW_POLICIES


@pytest.mark.parametrize("min_indexed", [0, 16, 100])
def test_many_global_policies_prune_to_the_ones_that_can_match(min_indexed: int) -> None:
    misses = [
        policy(
            one(Match(principals=(StringMatch.exact(f"cluster.local/ns/a/sa/other-{i}"),))),
            # Holds on the destination IP but is excluded by the port.
            one(Match(destination_ips=(ipaddress.ip_network("10.0.0.0/8"),), not_destination_ports=(80,))),
            name=f"miss-{i}",
            action=Action.DENY if i % 2 else Action.ALLOW,
        )
        for i in range(40)
    ]
    hit = policy(one(Match(namespaces=(StringMatch.prefix("a"),), destination_ports=(80,))), name="hit")
    index = PolicyIndex([*misses, hit], min_indexed=min_indexed)
    wl = Target(namespace="a")
    candidates, any_allow = index.candidates(wl, conn())
    assert [p.key for p in candidates] == (
        ["a/hit"] if min_indexed <= 41 else [p.key for p in [*misses, hit]]
    )
    assert any_allow
    assert index.check(wl, conn()).reason == "allowed by: a/hit"
    # On another port the IP rule is no longer excluded: every policy is a candidate again.
    candidates, _ = index.candidates(wl, conn(port=81))
    assert len(candidates) == 41
    assert index.check(wl, conn(port=81)) == reference_evaluate([*misses, hit], conn(port=81))
    bucket = index.bucket("")
    assert repr(bucket) == "<PolicyBucket: 41 policies, 21 enforced ALLOW, 42 guard keys>"


def test_rule_filter_admits() -> None:
    f = RuleFilter(guard=frozenset({ALWAYS_KEY}), exclusion=frozenset({(11, 80)}))
    assert f.admits({ALWAYS_KEY}) and not f.admits({ALWAYS_KEY, (11, 80)})
    assert not RuleFilter(guard=frozenset({(11, 81)})).admits({ALWAYS_KEY, (11, 80)})


# -- generated matchers ----------------------------------------------------------------------------------


def test_policies_of_one_shape_share_their_code_and_differ_in_constants() -> None:
    a = CompiledPolicy(
        policy(one(Match(principals=(StringMatch.exact("cluster.local/ns/a/sa/x"),))), name="a")
    )
    b = CompiledPolicy(
        policy(one(Match(principals=(StringMatch.exact("cluster.local/ns/b/sa/y"),))), name="b")
    )
    assert a._matches.__code__ is b._matches.__code__
    assert a._matches.__defaults__ == ("cluster.local/ns/a/sa/x",)
    assert a.matches(conn()) and not b.matches(conn())


def test_policy_text_is_never_compiled() -> None:
    hostile = '"); raise SystemExit("x'
    p = policy(
        one(Match(principals=(StringMatch.prefix(hostile),), namespaces=(StringMatch.suffix(hostile),))),
        one(Match(not_principals=(StringMatch.exact(hostile),))),
    )
    compiled = CompiledPolicy(p)
    assert hostile not in compiled._matches.__code__.co_consts
    assert hostile in compiled._matches.__defaults__[0]
    weird = Identity("cluster.local", "a", "x")
    assert compiled.matches(conn(identity=weird)) is reference_matches(p, conn(identity=weird))


def test_the_code_cache_is_bounded() -> None:
    host = (ipaddress.ip_network("10.0.0.1/32"),)
    fields = {
        "namespaces": (StringMatch.exact("a"),),
        "not_namespaces": (StringMatch.prefix("b"),),
        "principals": (StringMatch.suffix("/sa/x"),),
        "not_principals": (StringMatch.presence(),),
        "source_ips": host,
        "not_source_ips": (ipaddress.ip_network("10.0.0.0/8"),),
        "destination_ips": host,
        "not_destination_ips": host,
        "destination_ports": (80,),
        "not_destination_ports": (81, 82),
        "service_accounts": (ServiceAccountMatch(namespace="a", service_account="x"),),
        "not_service_accounts": (ServiceAccountMatch(namespace="a", service_account="y"),),
    }
    names = list(fields)
    shapes = rbac_compiled._CODE_CACHE_SIZE + 20
    assert 2 ** len(names) > shapes
    for bits in range(1, shapes + 1):
        # Every subset of fields is its own shape.
        m = Match(**{n: fields[n] for i, n in enumerate(names) if bits >> i & 1})
        compiled = CompiledPolicy(policy(one(m)))
        assert compiled.matches(conn()) is reference_matches(compiled.policy, conn())
        assert len(rbac_compiled._code_cache) <= rbac_compiled._CODE_CACHE_SIZE
