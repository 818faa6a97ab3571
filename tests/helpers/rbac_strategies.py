"""Hypothesis strategies for L4 authorization: connections, matches, rules and policy sets drawn
from small pools, so that random matches often hold (some policies match, some do not)."""

from __future__ import annotations

import ipaddress

from hypothesis import strategies as st

from ambient_mesh.identity.spiffe import Identity
from ambient_mesh.rbac import (
    Action,
    Authorization,
    Clause,
    Match,
    RbacConnection,
    Rule,
    Scope,
    ServiceAccountMatch,
    StringMatch,
    StringMatchKind,
)

NAMESPACES = ["a", "b", "c"]
ACCOUNTS = ["x", "y"]
V4 = [ipaddress.IPv4Address(f"10.0.0.{i}") for i in range(4)]
V6 = [ipaddress.IPv6Address(f"fd00::{i}") for i in range(4)]
PORTS = [80, 8080, 9090]
STRINGS = ["", "a", "b", "cluster.local/", "cluster.local/ns/a/sa/x", "/sa/x", "x", "other.domain/"]

identities = st.none() | st.builds(
    Identity,
    st.sampled_from(["cluster.local", "other.domain"]),
    st.sampled_from(NAMESPACES),
    st.sampled_from(ACCOUNTS),
)
ips = st.sampled_from(V4 + V6)
connections = st.builds(
    RbacConnection,
    src_identity=identities,
    src_ip=ips,
    dst_ip=ips,
    dst_port=st.sampled_from(PORTS),
    dst_network=st.sampled_from(["", "net1"]),
)
string_matches = st.builds(
    StringMatch, kind=st.sampled_from(list(StringMatchKind)), value=st.sampled_from(STRINGS)
)
account_matches = st.builds(
    ServiceAccountMatch, namespace=st.sampled_from(NAMESPACES), service_account=st.sampled_from(ACCOUNTS)
)


@st.composite
def networks(draw: st.DrawFn) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    ip = draw(ips)
    length = draw(st.sampled_from([0, 30, 31, 32] if ip.version == 4 else [0, 126, 127, 128]))
    return ipaddress.ip_network(f"{ip}/{length}", strict=False)


FIELD_VALUES: dict[str, st.SearchStrategy] = {
    "namespaces": string_matches,
    "not_namespaces": string_matches,
    "service_accounts": account_matches,
    "not_service_accounts": account_matches,
    "principals": string_matches,
    "not_principals": string_matches,
    "source_ips": networks(),
    "not_source_ips": networks(),
    "destination_ips": networks(),
    "not_destination_ips": networks(),
    "destination_ports": st.sampled_from(PORTS),
    "not_destination_ports": st.sampled_from(PORTS),
}


@st.composite
def match_objects(draw: st.DrawFn) -> Match:
    # A few fields per Match (none = the empty Match): with every list filled it would almost never hold.
    names = draw(st.lists(st.sampled_from(sorted(FIELD_VALUES)), max_size=3, unique=True))
    return Match(**{n: tuple(draw(st.lists(FIELD_VALUES[n], min_size=1, max_size=2))) for n in names})


clauses = st.builds(Clause, matches=st.lists(match_objects(), max_size=2).map(tuple))
rules = st.builds(Rule, clauses=st.lists(clauses, max_size=2).map(tuple))


@st.composite
def policy_sets(draw: st.DrawFn, max_size: int = 6) -> list[Authorization]:
    count = draw(st.integers(0, max_size))
    return [
        Authorization(
            name=f"p{i}",
            namespace=draw(st.sampled_from(NAMESPACES)),
            scope=draw(st.sampled_from(list(Scope))),
            action=draw(st.sampled_from(list(Action))),
            rules=tuple(draw(st.lists(rules, max_size=2))),
            dry_run=draw(st.booleans()),
        )
        for i in range(count)
    ]


def matching_rule(conn: RbacConnection) -> Rule:
    """A rule written for exactly this connection: it holds for it by construction."""
    host = ipaddress.ip_network(conn.src_ip)
    fields: dict = {"destination_ports": (conn.dst_port,), "source_ips": (host,)}
    if conn.src_identity is not None:
        fields["principals"] = (StringMatch.exact(conn.src_identity.principal),)
    return Rule(clauses=(Clause(matches=(Match(**fields),)),))
