"""state/memo.py `StateMemo`: a memoized decision answers exactly what the decision itself would
at the state version it is asked at, and never holds more than its bound."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ambient_mesh.state.memo import StateMemo

# A "state" is a dict the test changes between versions; the decision reads it and the key.
_steps = st.lists(
    st.one_of(
        st.tuples(st.just("change"), st.integers(0, 5), st.integers(0, 3)),
        st.tuples(st.just("ask"), st.integers(0, 7), st.just(0)),
    ),
    max_size=60,
)


@given(_steps, st.integers(1, 4))
def test_a_memoized_decision_is_the_decision_at_every_version(steps, bound) -> None:
    state: dict[int, int] = {}
    version = 0
    memo: StateMemo[int, tuple[int, int]] = StateMemo("test", bound)

    def decide(key: int) -> tuple[int, int]:
        return key, state.get(key % 6, -1)

    def memoized(key: int) -> tuple[int, int]:
        kept = memo.get(version, key)
        return kept if kept is not None else memo.put(version, key, decide(key))

    for op, a, b in steps:
        if op == "change":
            state[a] = b
            version += 1  # the one writer bumps the version after every batch
        else:
            assert memoized(a) == decide(a)
        assert len(memo) <= bound


def test_a_full_memo_drops_its_oldest_entry_and_a_new_version_drops_all() -> None:
    memo: StateMemo[str, int] = StateMemo("test", 2)
    memo.put(1, "a", 1)
    memo.put(1, "b", 2)
    memo.put(1, "c", 3)
    assert memo.get(1, "a") is None and memo.get(1, "b") == 2 and memo.get(1, "c") == 3
    assert memo.get(2, "c") is None and len(memo) == 0
    assert repr(memo).startswith("StateMemo(test: 0/2 at v2")


def test_none_is_never_kept_and_the_bound_must_be_positive() -> None:
    memo: StateMemo[str, int | None] = StateMemo("test", 1)
    memo.put(0, "a", None)
    assert "a" not in memo
    with pytest.raises(ValueError, match="at least 1"):
        StateMemo("test", 0)
