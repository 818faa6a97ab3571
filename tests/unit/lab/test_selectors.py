"""`ambient lab get -l`: kubectl's label selector syntax, parsed once and matched."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ambient_mesh.errors import ConfigError
from ambient_mesh.lab.selectors import Operator, parse_selector

LABELS = {"app": "echo", "version": "v1", "istio.io/dataplane-mode": "ambient"}


@pytest.mark.parametrize(
    ("text", "matches"),
    [
        ("app=echo", True),
        ("app==echo", True),
        ("app=client", False),
        ("app!=client", True),
        ("app!=echo", False),
        ("missing!=x", True),  # kubectl: a missing label satisfies !=
        ("app in (client, echo)", True),
        ("app notin (client,echo)", False),
        ("missing notin (a)", True),
        ("version", True),
        ("!version", False),
        ("!missing", True),
        ("istio.io/dataplane-mode=ambient,app=echo", True),
        ("istio.io/dataplane-mode=ambient,app=client", False),
        ("app in (echo),version=v1", True),
    ],
)
def test_selector_matches_as_kubectl(text, matches):
    assert parse_selector(text).matches(LABELS) is matches


def test_selector_parts():
    s = parse_selector("a=1,b!=2,c in (x,y),!d,e")
    assert [r.operator for r in s.requirements] == [
        Operator.EQUALS,
        Operator.NOT_EQUALS,
        Operator.IN,
        Operator.DOES_NOT_EXIST,
        Operator.EXISTS,
    ]
    assert s.requirements[2].values == frozenset({"x", "y"})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty requirement"),
        ("a=1,,b=2", "empty requirement"),
        ("a in (x", "without its ')'"),
        ("a)", "without its '('"),
        ("bad key=1", "not a label key"),
        ("a=b c", "not a label value"),
        ("a=" + "x" * 64, "not a label value"),
        ("a," * 100 + "a", "requirements; at most"),
    ],
)
def test_selector_refuses_what_it_cannot_read(text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_selector(text)


@given(st.text(max_size=200))
def test_selector_parser_returns_a_selector_or_our_error(text):
    try:
        selector = parse_selector(text)
    except ConfigError:
        return
    selector.matches(LABELS)
