"""The TokenReview decision (control/tokenreview.caller_from_review): who a review's status names,
and every way it can fail to name a service account we should trust."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ambient_mesh.control.tokenreview import caller_from_review
from ambient_mesh.control.tokens import AuthenticationError, Caller

AUD = ("istio-ca",)
GOOD = {
    "authenticated": True,
    "audiences": ["istio-ca"],
    "user": {
        "username": "system:serviceaccount:istio-system:ztunnel",
        "uid": "u",
        "groups": ["system:serviceaccounts", "system:serviceaccounts:istio-system", "system:authenticated"],
        "extra": {
            "authentication.kubernetes.io/pod-name": ["ztunnel-abc"],
            "authentication.kubernetes.io/pod-uid": ["1f2e"],
            "authentication.kubernetes.io/credential-id": ["JTI=x"],
        },
    },
}


def changed(path: str, value: object) -> dict:
    doc = copy.deepcopy(GOOD)
    *parents, last = path.split(".")
    target = doc
    for key in parents:
        target = target[key]
    if value is None:
        del target[last]
    else:
        target[last] = value
    return doc


def test_a_pod_bound_service_account_token():
    assert caller_from_review(GOOD, AUD) == Caller(
        namespace="istio-system", service_account="ztunnel", pod_name="ztunnel-abc", pod_uid="1f2e"
    )
    unbound = changed("user.extra", None)
    assert caller_from_review(unbound, AUD) == Caller(namespace="istio-system", service_account="ztunnel")


@pytest.mark.parametrize(
    ("status", "message"),
    [
        (None, "no status"),
        ({"authenticated": False, "error": "token expired"}, "refused the token: token expired"),
        (changed("authenticated", False), "did not authenticate"),
        (changed("audiences", ["https://kubernetes.default.svc"]), "not valid for audience istio-ca"),
        (changed("audiences", None), "not valid for audience istio-ca"),
        (changed("user.groups", ["system:authenticated"]), "not a service account's"),
        (changed("user.username", "system:node:node-1"), "is not a service account"),
        (changed("user.username", "system:serviceaccount:ns:sa:extra"), "is not a service account"),
        (changed("user.username", "system:serviceaccount:NS:sa"), "does not name a service account"),
    ],
)
def test_refusals(status, message):
    with pytest.raises(AuthenticationError, match=message):
        caller_from_review(status, AUD)


def test_a_pod_name_without_its_uid_is_refused():
    doc = copy.deepcopy(GOOD)
    del doc["user"]["extra"]["authentication.kubernetes.io/pod-uid"]
    with pytest.raises(AuthenticationError, match="without its UID"):
        caller_from_review(doc, AUD)


def test_extra_values_must_be_one_string():
    doc = copy.deepcopy(GOOD)
    doc["user"]["extra"]["authentication.kubernetes.io/pod-name"] = ["a", "b"]
    with pytest.raises(AuthenticationError, match="is not one string"):
        caller_from_review(doc, AUD)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(
    json_values
    | st.fixed_dictionaries(
        {"authenticated": st.booleans(), "audiences": json_values, "user": json_values, "error": json_values}
    )
)
def test_any_status_gives_a_caller_or_our_error(status):
    try:
        caller = caller_from_review(status, AUD)
    except AuthenticationError:
        return
    assert caller.namespace and caller.service_account
