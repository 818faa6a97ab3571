"""identity/spiffe.py: SPIFFE ids parse any text safely, round-trip, and refuse malformed ids."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from ambient_mesh.errors import IdentityError
from ambient_mesh.identity.spiffe import Identity

segment = st.text(min_size=1, max_size=20).filter(lambda s: "/" not in s)
spiffe_text = st.one_of(
    st.text(max_size=60),
    st.builds(
        lambda rest: "spiffe://" + rest, st.text(alphabet=st.sampled_from(list("ab/nsa.-%")), max_size=40)
    ),
    st.builds(
        lambda td, ns, sa, a, b: f"spiffe://{td}/{a}/{ns}/{b}/{sa}",
        st.text(max_size=10),
        st.text(max_size=10),
        st.text(max_size=10),
        st.sampled_from(["ns", "sa", "NS", ""]),
        st.sampled_from(["sa", "ns", "SA", ""]),
    ),
)


@given(spiffe_text)
@example("spiffe://cluster.local/ns/default/sa/default")
@example("spiffe:///ns/a/sa/b")
@example("spiffe://td/ns//sa/b")
@example("spiffe://td/ns/a/sa/")
@example("spiffe://td/ns/a/sa/b/")
@example("SPIFFE://td/ns/a/sa/b")
def test_identity_parse_any_text(text: str) -> None:
    try:
        identity = Identity.parse(text)
    except IdentityError:
        return
    assert str(identity) == text
    assert identity.principal == text.removeprefix("spiffe://")
    assert Identity.parse(str(identity)) == identity


@given(segment, segment, segment)
def test_identity_round_trip(trust_domain: str, namespace: str, service_account: str) -> None:
    identity = Identity(trust_domain, namespace, service_account)
    assert Identity.parse(str(identity)) == identity
    assert str(identity) == f"spiffe://{trust_domain}/ns/{namespace}/sa/{service_account}"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "spiffe://",
        "spiffe://td",
        "spiffe://td/ns/a",
        "spiffe://td/ns/a/sa",
        "spiffe://td/ns/a/sa/",
        "spiffe://td/sa/a/ns/b",
        "spiffe://td/ns/a/sa/b/c",
        "spiffe:///ns/a/sa/b",
        "http://td/ns/a/sa/b",
        "td/ns/a/sa/b",
    ],
)
def test_identity_parse_rejects(text: str) -> None:
    with pytest.raises(IdentityError):
        Identity.parse(text)


def test_identity_defaults_for_workload() -> None:
    identity = Identity.for_workload(trust_domain="", namespace="ns1", service_account="")
    assert str(identity) == "spiffe://cluster.local/ns/ns1/sa/default"
    with pytest.raises(IdentityError):
        Identity.for_workload(trust_domain="", namespace="", service_account="")
