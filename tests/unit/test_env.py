"""The one env reader (env.py) both programs' configurations use."""

from __future__ import annotations

import pytest

from ambient_mesh.env import ISTIO_CNI_BOOLS, ZTUNNEL_BOOLS, EnvReader
from ambient_mesh.errors import ConfigError


def reader(bools=ZTUNNEL_BOOLS, strip=False, **env: str) -> EnvReader:
    return EnvReader(env, bools=bools, strip=strip)


@pytest.mark.parametrize(("value", "expected"), [("true", True), ("1", True), ("FALSE", False), ("0", False)])
def test_ztunnel_booleans(value, expected):
    assert reader(X=value).boolean("X", not expected) is expected


@pytest.mark.parametrize("value", ["yes", "on", "t", "y"])
def test_go_spellings_only_for_istio_cni(value):
    with pytest.raises(ConfigError, match="true, false, 1 or 0"):
        reader(X=value).boolean("X", False)
    assert reader(ISTIO_CNI_BOOLS, X=value).boolean("X", False) is True


def test_unset_and_empty_mean_default_and_strip_is_per_program():
    assert reader().string("X", "d") == "d"
    assert reader(X="").string("X", "d") == "d"
    assert reader(X=" v ").string("X") == " v "  # the node proxy passes values as given
    assert reader(strip=True, X=" v ").text("X") == "v"
    assert reader(strip=True, X="   ").text("X", "d") == "d"


@pytest.mark.parametrize(
    ("value", "base", "minimum", "expected"),
    [("42", 10, 0, 42), ("600", 8, 0, 0o600), ("0o640", 8, 0, 0o640), ("-1", 10, -1, -1), (" 7 ", 10, 0, 7)],
)
def test_integers(value, base, minimum, expected):
    assert reader(X=value).integer("X", 0, minimum=minimum, maximum=65535, base=base) == expected


@pytest.mark.parametrize(
    ("value", "minimum"), [("-1", 0), ("1_000", 0), ("+5", 0), ("9", 0), ("x", 0), ("1e3", 0)]
)
def test_integers_refused(value, minimum):
    base = 8 if value == "9" else 10
    with pytest.raises(ConfigError) as err:
        reader(X=value).integer("X", 0, minimum=minimum, maximum=65535, base=base)
    assert err.value.source == "X"


def test_one_duration_grammar_with_a_range():
    r = reader(A="250ms", B="1h30m", C="2", D="2h")
    assert r.duration("A", 1.0) == 0.25
    assert r.duration("B", 1.0) == 5400
    with pytest.raises(ConfigError, match="Go duration"):
        r.duration("C", 1.0)  # a bare number: its unit would be a guess
    with pytest.raises(ConfigError, match="at most 1h"):
        r.duration("D", 1.0, maximum_s=3600)
    assert r.optional_duration("UNSET") is None
