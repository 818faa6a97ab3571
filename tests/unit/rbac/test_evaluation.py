"""L4 authorization evaluation (docs/istio-behaviour.md, "Authorization" and "STRICT mTLS").

Table-driven: every match field, positive and negated, with and without a peer identity; the
structural edge cases (empty rules, clauses, matches); evaluation order with dry run; which
policies apply to a workload; and STRICT mTLS as istiod expresses it.
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass, field

import pytest

from ambient_mesh.identity.spiffe import Identity
from ambient_mesh.net import ip_address
from ambient_mesh.rbac import (
    REASON_NO_ALLOW_POLICIES,
    REASON_NOT_ALLOWED,
    STRICT_MTLS_POLICY_NAME,
    Action,
    Authorization,
    Clause,
    CompiledPolicy,
    Decision,
    Match,
    PolicyIndex,
    RbacConnection,
    Rule,
    Scope,
    ServiceAccountMatch,
    StringMatch,
    evaluate,
    log_dry_run,
    policies_for,
    reference,
    strict_mtls_policy,
)
from ambient_mesh.rbac.index import unknown_policies

PEER = Identity("cluster.local", "ns1", "sa1")
PEER_PRINCIPAL = "cluster.local/ns/ns1/sa/sa1"


def conn(
    identity: Identity | None = PEER,
    *,
    src: str = "10.0.0.1",
    dst: str = "10.0.1.1",
    port: int = 8080,
) -> RbacConnection:
    return RbacConnection(
        src_identity=identity, src_ip=ip_address(src), dst_ip=ip_address(dst), dst_port=port
    )


def net(cidr: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    return ipaddress.ip_network(cidr)


def policy(
    *rules: Rule,
    name: str = "p",
    namespace: str = "ns1",
    action: Action = Action.ALLOW,
    scope: Scope = Scope.NAMESPACE,
    dry_run: bool = False,
) -> Authorization:
    return Authorization(
        name=name, namespace=namespace, scope=scope, action=action, rules=rules, dry_run=dry_run
    )


def one(*matches: Match) -> Rule:
    """A rule of one clause holding `matches`."""
    return Rule(clauses=(Clause(matches=matches),))


def matches(m: Match, c: RbacConnection) -> bool:
    return CompiledPolicy(policy(one(m))).matches(c)


# -- every match field --------------------------------------------------------------------------------

NO_ID = None
OTHER_SA = ServiceAccountMatch(namespace="ns1", service_account="other")

# (case id, match, peer identity, port, src, dst, expected)
FIELD_TABLE: list[tuple[str, Match, Identity | None, bool]] = [
    # principals: the SPIFFE id without `spiffe://`
    ("principal exact", Match(principals=(StringMatch.exact(PEER_PRINCIPAL),)), PEER, True),
    ("principal exact, no identity", Match(principals=(StringMatch.exact(PEER_PRINCIPAL),)), NO_ID, False),
    ("principal exact other", Match(principals=(StringMatch.exact("cluster.local/ns/x/sa/y"),)), PEER, False),
    (
        "principal with spiffe scheme",
        Match(principals=(StringMatch.exact(f"spiffe://{PEER_PRINCIPAL}"),)),
        PEER,
        False,
    ),
    ("principal prefix", Match(principals=(StringMatch.prefix("cluster.local/ns/ns1/"),)), PEER, True),
    ("principal prefix miss", Match(principals=(StringMatch.prefix("cluster.local/ns/ns2/"),)), PEER, False),
    ("principal suffix", Match(principals=(StringMatch.suffix("/sa/sa1"),)), PEER, True),
    ("principal suffix miss", Match(principals=(StringMatch.suffix("/sa/sa2"),)), PEER, False),
    ("principal presence", Match(principals=(StringMatch.presence(),)), PEER, True),
    ("principal presence, no identity", Match(principals=(StringMatch.presence(),)), NO_ID, False),
    # ztunnel strips `spiffe://` from the (empty) id of a plaintext peer, fails, and matches nothing.
    ('principal exact "", no identity', Match(principals=(StringMatch.exact(""),)), NO_ID, False),
    ('principal prefix "", no identity', Match(principals=(StringMatch.prefix(""),)), NO_ID, False),
    ('principal prefix "", identity', Match(principals=(StringMatch.prefix(""),)), PEER, True),
    (
        "principal any of two",
        Match(principals=(StringMatch.exact("cluster.local/ns/x/sa/y"), StringMatch.suffix("sa1"))),
        PEER,
        True,
    ),
    ("not principal presence", Match(not_principals=(StringMatch.presence(),)), PEER, False),
    ("not principal presence, no identity", Match(not_principals=(StringMatch.presence(),)), NO_ID, True),
    ("not principal own", Match(not_principals=(StringMatch.exact(PEER_PRINCIPAL),)), PEER, False),
    (
        "not principal other",
        Match(not_principals=(StringMatch.exact("cluster.local/ns/x/sa/y"),)),
        PEER,
        True,
    ),
    (
        "not principal own, no identity",
        Match(not_principals=(StringMatch.exact(PEER_PRINCIPAL),)),
        NO_ID,
        True,
    ),
    # namespaces: the peer identity's namespace, "" without identity
    ("namespace exact", Match(namespaces=(StringMatch.exact("ns1"),)), PEER, True),
    ("namespace exact, no identity", Match(namespaces=(StringMatch.exact("ns1"),)), NO_ID, False),
    ("namespace exact other", Match(namespaces=(StringMatch.exact("ns2"),)), PEER, False),
    ("namespace prefix", Match(namespaces=(StringMatch.prefix("ns"),)), PEER, True),
    ("namespace suffix", Match(namespaces=(StringMatch.suffix("1"),)), PEER, True),
    ("namespace presence", Match(namespaces=(StringMatch.presence(),)), PEER, True),
    ("namespace presence, no identity", Match(namespaces=(StringMatch.presence(),)), NO_ID, False),
    # Unlike principals, the namespace of a plaintext peer is the empty string, and "" equals "".
    ('namespace exact "", no identity', Match(namespaces=(StringMatch.exact(""),)), NO_ID, True),
    ("not namespace own", Match(not_namespaces=(StringMatch.exact("ns1"),)), PEER, False),
    ("not namespace own, no identity", Match(not_namespaces=(StringMatch.exact("ns1"),)), NO_ID, True),
    ("not namespace other", Match(not_namespaces=(StringMatch.exact("ns2"),)), PEER, True),
    ("not namespace presence, no identity", Match(not_namespaces=(StringMatch.presence(),)), NO_ID, True),
    # service accounts: namespace and name, exactly
    (
        "service account",
        Match(service_accounts=(ServiceAccountMatch(namespace="ns1", service_account="sa1"),)),
        PEER,
        True,
    ),
    (
        "service account, no identity",
        Match(service_accounts=(ServiceAccountMatch(namespace="ns1", service_account="sa1"),)),
        NO_ID,
        False,
    ),
    ("service account other name", Match(service_accounts=(OTHER_SA,)), PEER, False),
    (
        "service account other namespace",
        Match(service_accounts=(ServiceAccountMatch(namespace="ns2", service_account="sa1"),)),
        PEER,
        False,
    ),
    (
        "service account any of two",
        Match(service_accounts=(OTHER_SA, ServiceAccountMatch(namespace="ns1", service_account="sa1"))),
        PEER,
        True,
    ),
    (
        "not service account own",
        Match(not_service_accounts=(ServiceAccountMatch(namespace="ns1", service_account="sa1"),)),
        PEER,
        False,
    ),
    (
        "not service account own, no identity",
        Match(not_service_accounts=(ServiceAccountMatch(namespace="ns1", service_account="sa1"),)),
        NO_ID,
        True,
    ),
    ("not service account other", Match(not_service_accounts=(OTHER_SA,)), PEER, True),
]

# IP and port fields do not look at the identity: each row runs with and without one.
ADDRESS_TABLE: list[tuple[str, Match, bool]] = [
    ("source ip /24", Match(source_ips=(net("10.0.0.0/24"),)), True),
    ("source ip /32", Match(source_ips=(net("10.0.0.1/32"),)), True),
    ("source ip /32 other", Match(source_ips=(net("10.0.0.2/32"),)), False),
    ("source ip other /24", Match(source_ips=(net("10.0.1.0/24"),)), False),
    ("source ip /0", Match(source_ips=(net("0.0.0.0/0"),)), True),
    ("source ip IPv6 /0 for IPv4 peer", Match(source_ips=(net("::/0"),)), False),
    ("source ip any of two", Match(source_ips=(net("192.168.0.0/16"), net("10.0.0.0/8"))), True),
    ("not source ip /24", Match(not_source_ips=(net("10.0.0.0/24"),)), False),
    ("not source ip other", Match(not_source_ips=(net("10.0.1.0/24"),)), True),
    ("destination ip /32", Match(destination_ips=(net("10.0.1.1/32"),)), True),
    ("destination ip /16", Match(destination_ips=(net("10.0.0.0/16"),)), True),
    ("destination ip other", Match(destination_ips=(net("10.0.0.1/32"),)), False),
    ("destination ip IPv6", Match(destination_ips=(net("fd00::/8"),)), False),
    ("not destination ip own", Match(not_destination_ips=(net("10.0.1.1/32"),)), False),
    ("not destination ip other", Match(not_destination_ips=(net("10.0.0.1/32"),)), True),
    ("destination port", Match(destination_ports=(8080,)), True),
    ("destination port other", Match(destination_ports=(80,)), False),
    ("destination port any of two", Match(destination_ports=(80, 8080)), True),
    ("not destination port own", Match(not_destination_ports=(8080,)), False),
    ("not destination port other", Match(not_destination_ports=(80,)), True),
    ("port and source ip both hold", Match(destination_ports=(8080,), source_ips=(net("10.0.0.0/8"),)), True),
    (
        "port holds, source ip does not",
        Match(destination_ports=(8080,), source_ips=(net("11.0.0.0/8"),)),
        False,
    ),
    (
        "positive and negated on one field",
        Match(destination_ports=(8080,), not_destination_ports=(8080,)),
        False,
    ),
    (
        "source ip holds, negated source ip too",
        Match(source_ips=(net("10.0.0.0/8"),), not_source_ips=(net("10.0.0.0/24"),)),
        False,
    ),
]


@pytest.mark.parametrize(
    ("m", "identity", "expected"), [row[1:] for row in FIELD_TABLE], ids=[r[0] for r in FIELD_TABLE]
)
def test_identity_fields(m: Match, identity: Identity | None, expected: bool) -> None:
    assert matches(m, conn(identity)) is expected


@pytest.mark.parametrize("identity", [PEER, NO_ID], ids=["mtls", "plaintext"])
@pytest.mark.parametrize(
    ("m", "expected"), [row[1:] for row in ADDRESS_TABLE], ids=[r[0] for r in ADDRESS_TABLE]
)
def test_address_fields(m: Match, expected: bool, identity: Identity | None) -> None:
    assert matches(m, conn(identity)) is expected


IPV6_TABLE: list[tuple[str, Match, bool]] = [
    ("source /64", Match(source_ips=(net("fd00:1::/64"),)), True),
    ("source /128", Match(source_ips=(net("fd00:1::5/128"),)), True),
    ("source other /64", Match(source_ips=(net("fd00:2::/64"),)), False),
    ("source IPv4 /0 for IPv6 peer", Match(source_ips=(net("0.0.0.0/0"),)), False),
    ("destination ::/0", Match(destination_ips=(net("::/0"),)), True),
    ("not destination own /128", Match(not_destination_ips=(net("fd00:9::1/128"),)), False),
    # An IPv4 network whose integer equals the low bits of the IPv6 address must not match.
    ("destination IPv4 with same low bits", Match(destination_ips=(net("0.0.0.1/32"),)), False),
]


@pytest.mark.parametrize(("m", "expected"), [row[1:] for row in IPV6_TABLE], ids=[r[0] for r in IPV6_TABLE])
def test_ipv6_fields(m: Match, expected: bool) -> None:
    assert matches(m, conn(src="fd00:1::5", dst="fd00:9::1")) is expected


# -- structure: rules, clauses, empty matches -----------------------------------------------------------

HIT = Match(destination_ports=(8080,))
MISS = Match(destination_ports=(80,))
EMPTY = Match()

STRUCTURE_TABLE: list[tuple[str, tuple[Rule, ...], bool]] = [
    ("zero rules match nothing", (), False),
    ("rule without clauses matches everything", (Rule(),), True),
    ("clause without matches matches", (Rule(clauses=(Clause(),)),), True),
    ("clause of one empty match never matches", (one(EMPTY),), False),
    ("clause of only empty matches never matches", (one(EMPTY, EMPTY),), False),
    ("empty match is skipped, the next one decides", (one(EMPTY, HIT),), True),
    ("empty match beside a miss", (one(EMPTY, MISS),), False),
    ("clause: any match", (one(MISS, HIT),), True),
    ("clause: no match", (one(MISS, MISS),), False),
    ("rule: all clauses", (Rule(clauses=(Clause(matches=(HIT,)), Clause(matches=(HIT,)))),), True),
    ("rule: one clause fails", (Rule(clauses=(Clause(matches=(HIT,)), Clause(matches=(MISS,)))),), False),
    ("rule: empty clause beside a failing one", (Rule(clauses=(Clause(), Clause(matches=(MISS,)))),), False),
    ("rule: empty clause beside a holding one", (Rule(clauses=(Clause(), Clause(matches=(HIT,)))),), True),
    ("policy: any rule", (one(MISS), one(HIT)), True),
    ("policy: no rule", (one(MISS), one(MISS)), False),
    ("policy: empty-match rule then a hit", (one(EMPTY), one(HIT)), True),
]


@pytest.mark.parametrize(
    ("rules", "expected"), [r[1:] for r in STRUCTURE_TABLE], ids=[r[0] for r in STRUCTURE_TABLE]
)
def test_structure(rules: tuple[Rule, ...], expected: bool) -> None:
    assert CompiledPolicy(policy(*rules)).matches(conn()) is expected


def test_allow_policy_without_rules_allows_nothing() -> None:
    d = evaluate([policy()], conn())
    assert d == Decision(allowed=False, policy=None, reason=REASON_NOT_ALLOWED)


def test_deny_policy_without_rules_denies_nothing() -> None:
    d = evaluate([policy(action=Action.DENY)], conn())
    assert d == Decision(allowed=True, policy=None, reason=REASON_NO_ALLOW_POLICIES)


def test_deny_of_only_empty_matches_never_fires() -> None:
    # istiod's translation of an L7-only DENY rule (istio/istio#61126): it silently never fires.
    d = evaluate([policy(one(EMPTY), action=Action.DENY)], conn(NO_ID))
    assert d.allowed and d.reason == REASON_NO_ALLOW_POLICIES


# -- evaluation order and dry run -------------------------------------------------------------------------


def allow(name: str, *rules: Rule, dry_run: bool = False) -> Authorization:
    return policy(*rules, name=name, action=Action.ALLOW, dry_run=dry_run)


def deny(name: str, *rules: Rule, dry_run: bool = False) -> Authorization:
    return policy(*rules, name=name, action=Action.DENY, dry_run=dry_run)


@dataclass(frozen=True)
class Case:
    policies: tuple[Authorization, ...]
    allowed: bool
    reason: str
    policy: str | None = None
    dry: tuple[str, ...] = field(default=())


ORDER_TABLE: list[tuple[str, Case]] = [
    ("no policies", Case((), True, "no allow policies")),
    ("matching deny", Case((deny("d", one(HIT)),), False, "explicitly denied by: ns1/d", "ns1/d")),
    (
        "deny beats allow",
        Case((allow("a", one(HIT)), deny("d", one(HIT))), False, "explicitly denied by: ns1/d", "ns1/d"),
    ),
    ("matching allow", Case((allow("a", one(HIT)),), True, "allowed by: ns1/a", "ns1/a")),
    (
        "second allow matches",
        Case((allow("a", one(MISS)), allow("b", one(HIT))), True, "allowed by: ns1/b", "ns1/b"),
    ),
    (
        "allow exists, none matches",
        Case((allow("a", one(MISS)),), False, "allow policies exist, but none allowed"),
    ),
    ("only a non-matching deny", Case((deny("d", one(MISS)),), True, "no allow policies")),
    (
        "non-matching deny, matching allow",
        Case((deny("d", one(MISS)), allow("a", one(HIT))), True, "allowed by: ns1/a", "ns1/a"),
    ),
    (
        "first matching deny names the decision",
        Case(
            (deny("d1", one(MISS)), deny("d2", one(HIT)), deny("d3", one(HIT))),
            False,
            "explicitly denied by: ns1/d2",
            "ns1/d2",
        ),
    ),
    (
        "dry-run deny only logs",
        Case((deny("d", one(HIT), dry_run=True),), True, "no allow policies", None, ("ns1/d",)),
    ),
    (
        "dry-run deny beside an enforced deny",
        Case(
            (deny("dd", one(HIT), dry_run=True), deny("d", one(HIT))),
            False,
            "explicitly denied by: ns1/d",
            "ns1/d",
            ("ns1/dd",),
        ),
    ),
    # A dry-run ALLOW is not an ALLOW policy: the workload still has "no allow policies".
    ("dry-run allow that misses", Case((allow("da", one(MISS), dry_run=True),), True, "no allow policies")),
    (
        "dry-run allow that matches beside a missing allow",
        Case(
            (allow("da", one(HIT), dry_run=True), allow("a", one(MISS))),
            False,
            "allow policies exist, but none allowed",
            None,
            ("ns1/da",),
        ),
    ),
    # Step 2 rejects before step 3 looks at dry-run ALLOWs.
    (
        "enforced deny stops before dry-run allows",
        Case(
            (allow("da", one(HIT), dry_run=True), deny("d", one(HIT)), deny("dd", one(HIT), dry_run=True)),
            False,
            "explicitly denied by: ns1/d",
            "ns1/d",
            ("ns1/dd",),
        ),
    ),
    (
        "dry-run deny and allow both recorded, deny first",
        Case(
            (allow("da", one(HIT), dry_run=True), deny("dd", one(HIT), dry_run=True), allow("a", one(HIT))),
            True,
            "allowed by: ns1/a",
            "ns1/a",
            ("ns1/dd", "ns1/da"),
        ),
    ),
]


@pytest.mark.parametrize("case", [r[1] for r in ORDER_TABLE], ids=[r[0] for r in ORDER_TABLE])
def test_evaluation_order(case: Case) -> None:
    expected = Decision(
        allowed=case.allowed, policy=case.policy, reason=case.reason, dry_run_matches=case.dry
    )
    assert evaluate(case.policies, conn()) == expected
    # The reference evaluator states the same order.
    assert reference.evaluate(case.policies, conn()) == expected
    # Precompiled policies decide the same, and so does the index on the same set.
    assert evaluate([CompiledPolicy(p) for p in case.policies], conn()) == expected
    index = PolicyIndex(case.policies)
    assert index.check(target(), conn()) == expected


def test_decision_and_connection_read_as_ztunnel_logs_them() -> None:
    c = conn(port=9080)
    assert str(c) == "10.0.0.1(spiffe://cluster.local/ns/ns1/sa/sa1)->10.0.1.1:9080"
    assert str(conn(NO_ID, src="fd00::1", dst="fd00::2")) == "fd00::1(None)->[fd00::2]:8080"
    assert str(evaluate([deny("d", one(HIT))], conn())) == "deny: explicitly denied by: ns1/d"


def test_log_dry_run(caplog: pytest.LogCaptureFixture) -> None:
    d = evaluate([deny("dd", one(HIT), dry_run=True)], conn())
    with caplog.at_level(logging.INFO, logger="ambient_mesh.rbac"):
        log_dry_run(d, conn())
    assert [r.getMessage() for r in caplog.records] == [
        "dry-run policy ns1/dd matches connection 10.0.0.1(spiffe://cluster.local/ns/ns1/sa/sa1)->10.0.1.1:8080"
    ]


# -- which policies apply ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """Stands in for state.model.Workload: policy selection reads only these two fields."""

    namespace: str = "ns1"
    authorization_policies: tuple[str, ...] = ()


def target(namespace: str = "ns1", *keys: str) -> Target:
    return Target(namespace=namespace, authorization_policies=keys)


NS1 = policy(name="ns1-wide", namespace="ns1", scope=Scope.NAMESPACE)
NS2 = policy(name="ns2-wide", namespace="ns2", scope=Scope.NAMESPACE)
ROOT_GLOBAL = policy(name="mesh-wide", namespace="istio-system", scope=Scope.GLOBAL)
SELECTOR = policy(name="only-some", namespace="ns1", scope=Scope.WORKLOAD_SELECTOR)
OTHER_SELECTOR = policy(name="only-others", namespace="ns2", scope=Scope.WORKLOAD_SELECTOR)
ALL = (NS1, NS2, ROOT_GLOBAL, SELECTOR, OTHER_SELECTOR)

SCOPING_TABLE: list[tuple[str, Target, list[str]]] = [
    ("namespace and global", target("ns1"), ["ns1/ns1-wide", "istio-system/mesh-wide"]),
    ("other namespace", target("ns2"), ["ns2/ns2-wide", "istio-system/mesh-wide"]),
    # GLOBAL is filed under "", not under its own (root) namespace, so it reaches everyone...
    ("namespace without policies", target("ns3"), ["istio-system/mesh-wide"]),
    # ...and once only for a workload in the root namespace.
    ("root namespace", target("istio-system"), ["istio-system/mesh-wide"]),
    # ztunnel files GLOBAL under "": a workload without namespace must not get it twice.
    ("empty namespace", target(""), ["istio-system/mesh-wide"]),
    (
        "selector through the workload list",
        target("ns1", "ns1/only-some"),
        ["ns1/ns1-wide", "istio-system/mesh-wide", "ns1/only-some"],
    ),
    # The list is the only way a WORKLOAD_SELECTOR policy applies, whatever its namespace.
    (
        "selector of another namespace listed",
        target("ns1", "ns2/only-others"),
        ["ns1/ns1-wide", "istio-system/mesh-wide", "ns2/only-others"],
    ),
    (
        "unknown key skipped",
        target("ns1", "ns1/gone", "ns1/only-some"),
        ["ns1/ns1-wide", "istio-system/mesh-wide", "ns1/only-some"],
    ),
    (
        "listed keys already applied are not repeated",
        target("ns1", "ns1/ns1-wide", "istio-system/mesh-wide", "ns1/only-some", "ns1/only-some"),
        ["ns1/ns1-wide", "istio-system/mesh-wide", "ns1/only-some"],
    ),
    # A NAMESPACE policy of another namespace, listed by the workload, still applies (ztunnel chains the list).
    (
        "namespace policy of another namespace listed",
        target("ns1", "ns2/ns2-wide"),
        ["ns1/ns1-wide", "istio-system/mesh-wide", "ns2/ns2-wide"],
    ),
]


@pytest.mark.parametrize("indexed", [False, True], ids=["dict", "index"])
@pytest.mark.parametrize(
    ("wl", "expected"), [r[1:] for r in SCOPING_TABLE], ids=[r[0] for r in SCOPING_TABLE]
)
def test_policies_for(wl: Target, expected: list[str], indexed: bool) -> None:
    policies = PolicyIndex(ALL) if indexed else {p.key: p for p in ALL}
    assert [p.key for p in policies_for(policies, wl)] == expected


UNKNOWN_WARNING = "skipping unknown policy ns1/gone (a workload names it; logged once, counted after)"


@pytest.fixture(autouse=True)
def _unknown_policies_logged_afresh() -> None:
    unknown_policies.forget()


@pytest.mark.parametrize("indexed", [False, True], ids=["dict", "index"])
def test_unknown_policy_key_is_warned_once_and_counted(
    indexed: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Every check of a workload that names a missing policy meets it (until the next push):
    one warning per name, a count per check."""
    policies = PolicyIndex(ALL) if indexed else {p.key: p for p in ALL}
    before = unknown_policies.skipped
    with caplog.at_level(logging.WARNING, logger="ambient_mesh.rbac"):
        for _ in range(5):
            policies_for(policies, target("ns1", "ns1/gone"))
    assert [r.getMessage() for r in caplog.records] == [UNKNOWN_WARNING]
    assert unknown_policies.skipped == before + 5


def test_scoping_decides() -> None:
    """A DENY-all in ns2 leaves ns1 alone; a GLOBAL one reaches every namespace."""
    deny_all = Rule()
    index = PolicyIndex([policy(deny_all, name="deny-all", namespace="ns2", action=Action.DENY)])
    assert index.check(target("ns1"), conn()).allowed
    assert not index.check(target("ns2"), conn()).allowed
    index.insert(
        policy(deny_all, name="deny-all", namespace="istio-system", scope=Scope.GLOBAL, action=Action.DENY)
    )
    assert index.check(target("ns1"), conn()).reason == "explicitly denied by: istio-system/deny-all"
    selector = policy(
        deny_all, name="sel", namespace="ns3", scope=Scope.WORKLOAD_SELECTOR, action=Action.DENY
    )
    index = PolicyIndex([selector])
    assert index.check(target("ns3"), conn()).allowed
    assert index.check(target("ns1", "ns3/sel"), conn()).policy == "ns3/sel"


def test_check_without_applicable_policies_is_the_default_allow(caplog: pytest.LogCaptureFixture) -> None:
    """No policy for the namespace, none global, none listed: Istio's default, as evaluate([])
    gives it, also once the index held and lost a policy there; a listed key still goes the full
    way (its warning), and a policy arriving for the namespace is matched at once."""
    empty = Decision(allowed=True, policy=None, reason=REASON_NO_ALLOW_POLICIES)
    index = PolicyIndex([NS2, OTHER_SELECTOR])
    for c in (conn(), conn(None), conn(dst="fd00::1")):
        assert index.check(target("ns1"), c) == evaluate([], c) == reference.evaluate([], c) == empty
    assert PolicyIndex().check(target(""), conn()) == empty
    deny_ns1 = policy(Rule(), name="deny-all", namespace="ns1", scope=Scope.NAMESPACE, action=Action.DENY)
    index.insert(deny_ns1)
    assert not index.check(target("ns1"), conn()).allowed
    index.remove(deny_ns1.key)
    assert index.check(target("ns1"), conn()) == empty
    with caplog.at_level(logging.WARNING, logger="ambient_mesh.rbac"):
        assert index.check(target("ns1", "ns1/gone"), conn()) == empty
    assert [r.getMessage() for r in caplog.records] == [UNKNOWN_WARNING]
    # An enforced ALLOW pruned away by the index still makes "none allowed" (no values matched).
    ns1_allows = [policy(one(Match(destination_ports=(9,))), name=f"a{i}") for i in range(20)]
    pruned = PolicyIndex(ns1_allows, min_indexed=1)
    assert pruned.candidates(target("ns1"), conn()) == ([], True)
    assert (
        pruned.check(target("ns1"), conn())
        == evaluate(ns1_allows, conn())
        == reference.evaluate(ns1_allows, conn())
    )
    assert pruned.check(target("ns1"), conn()).reason == REASON_NOT_ALLOWED


# -- PolicyIndex ----------------------------------------------------------------------------------------------


def test_index_files_by_scope() -> None:
    index = PolicyIndex(ALL)
    assert index.by_namespace("ns1") == (NS1,)
    assert index.by_namespace("ns2") == (NS2,)
    assert index.by_namespace("istio-system") == ()
    assert index.global_() == (ROOT_GLOBAL,)
    assert index.by_namespace("") == (ROOT_GLOBAL,)
    assert repr(index) == "<PolicyIndex: 5 policies, 1 global, 2 in 2 namespaces, 2 by selector>"


def test_index_replacement_moves_between_buckets() -> None:
    index = PolicyIndex([NS1])
    widened = policy(name="ns1-wide", namespace="ns1", scope=Scope.GLOBAL)
    index.insert(widened)
    assert index.by_namespace("ns1") == ()
    assert index.global_() == (widened,)
    assert index["ns1/ns1-wide"] is widened
    assert len(index) == 1
    narrowed = policy(name="ns1-wide", namespace="ns1", scope=Scope.WORKLOAD_SELECTOR)
    index.insert(narrowed)
    assert index.global_() == ()
    assert policies_for(index, target("ns1")) == []
    assert repr(index) == "<PolicyIndex: 1 policies, 0 global, 0 in 0 namespaces, 1 by selector>"


def test_index_remove_and_mapping_protocol() -> None:
    index = PolicyIndex()
    index[NS1.key] = NS1
    index[ROOT_GLOBAL.key] = ROOT_GLOBAL
    assert dict(index.items()) == {NS1.key: NS1, ROOT_GLOBAL.key: ROOT_GLOBAL}
    assert NS1.key in index and "ns1/nope" not in index
    assert index.pop(NS1.key) is NS1
    assert index.pop(NS1.key, None) is None
    assert not index.remove(NS1.key)
    assert index.by_namespace("ns1") == ()
    with pytest.raises(KeyError):
        del index[NS1.key]
    with pytest.raises(KeyError):
        index["ns1/elsewhere"] = NS1
    assert (
        index.compiled(ROOT_GLOBAL.key) is not None and index.compiled(ROOT_GLOBAL.key).policy is ROOT_GLOBAL
    )
    index.clear()
    assert len(index) == 0 and index.global_() == ()


def test_index_check_follows_changes() -> None:
    """The cached per-namespace action split is rebuilt after every write."""
    index = PolicyIndex()
    wl = target("ns1")
    assert index.check(wl, conn()).reason == REASON_NO_ALLOW_POLICIES
    index.insert(allow("a", one(MISS)))
    assert index.check(wl, conn()).reason == REASON_NOT_ALLOWED
    index.insert(allow("a", one(HIT)))
    assert index.check(wl, conn()).reason == "allowed by: ns1/a"
    index.insert(deny("d", one(HIT)))
    assert index.check(wl, conn()).reason == "explicitly denied by: ns1/d"
    index.remove("ns1/d")
    index.remove("ns1/a")
    assert index.check(wl, conn()).reason == REASON_NO_ALLOW_POLICIES


def test_compiled_policy_repr() -> None:
    assert repr(CompiledPolicy(deny("d", one(HIT), one(MISS), dry_run=True))) == (
        "<CompiledPolicy ns1/d NAMESPACE dry-run DENY: 2 rules>"
    )


# -- STRICT mTLS (docs/istio-behaviour.md, "STRICT mTLS") ------------------------------------------


def test_strict_policy_shape() -> None:
    strict = strict_mtls_policy()
    assert (
        strict.key
        == f"istio-system/{STRICT_MTLS_POLICY_NAME}"
        == "istio-system/istio_converted_static_strict"
    )
    assert strict.scope is Scope.WORKLOAD_SELECTOR and strict.action is Action.DENY and not strict.dry_run
    assert strict.rules == (
        Rule(clauses=(Clause(matches=(Match(not_principals=(StringMatch.presence(),)),)),)),
    )
    assert strict_mtls_policy("mesh-root").key == "mesh-root/istio_converted_static_strict"


@pytest.mark.parametrize(
    ("identity", "listed", "allowed", "reason"),
    [
        (NO_ID, True, False, "explicitly denied by: istio-system/istio_converted_static_strict"),
        (PEER, True, True, "no allow policies"),
        (NO_ID, False, True, "no allow policies"),
        (PEER, False, True, "no allow policies"),
    ],
    ids=["plaintext strict", "mtls strict", "plaintext permissive", "mtls permissive"],
)
def test_strict_mtls(identity: Identity | None, listed: bool, allowed: bool, reason: str) -> None:
    strict = strict_mtls_policy()
    wl = target("ns1", strict.key) if listed else target("ns1")
    for policies in ({strict.key: strict}, PolicyIndex([strict])):
        d = evaluate(policies_for(policies, wl), conn(identity))
        assert (d.allowed, d.reason) == (allowed, reason)


def test_strict_with_allow_policy() -> None:
    """STRICT denies plaintext before any ALLOW is consulted; mTLS peers still need an ALLOW."""
    strict = strict_mtls_policy()
    index = PolicyIndex([strict, allow("ports", one(Match(destination_ports=(8080,))))])
    wl = target("ns1", strict.key)
    assert index.check(wl, conn(NO_ID)).policy == strict.key
    assert index.check(wl, conn(PEER)).reason == "allowed by: ns1/ports"
    assert index.check(wl, conn(PEER, port=9090)).reason == REASON_NOT_ALLOWED
