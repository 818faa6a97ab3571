"""StateMemo: the one way the data path keeps a decision instead of making it again.

A decision on the data path (a route, an outbound plan, an inbound CONNECT's checks, the workload
a listener serves) is a pure function of the proxy's state and of the request. The state changes
only through the one updater, which bumps `ProxyState.version` after every batch, so the state at
one version is fixed and a decision made at that version holds for as long as the version does.

The rule (docs/architecture.md, "Decisions and caches"): a memo is keyed on the state version and
on every other input of the decision, by value; an entry made at an older version never answers
(the whole memo is dropped when the version moves); entries are bounded. Authorization itself is
never memoized: the policy index answers every stream. A decision that does not read the state at
all (parsing text) passes version 0.

The property tests hold every user of this type to its uncached function
(tests/unit/state/test_memo.py, tests/integration/test_authz_live.py).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class StateMemo(Generic[K, V]):
    """Values of one decision by (state version, key); at most `max_entries`, the oldest
    dropped first. None is never kept (a miss reads as None)."""

    __slots__ = ("name", "max_entries", "_version", "_entries", "hits", "misses")

    def __init__(self, name: str, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"{name}: max_entries must be at least 1, not {max_entries}")
        self.name = name
        self.max_entries = max_entries
        self._version = -1
        self._entries: dict[K, V] = {}
        self.hits = 0
        self.misses = 0

    def __repr__(self) -> str:
        return (
            f"StateMemo({self.name}: {len(self._entries)}/{self.max_entries} at v{self._version}, "
            f"{self.hits} hits, {self.misses} misses)"
        )

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, version: int, key: K) -> V | None:
        """The value kept for `key` at `version`, or None."""
        if version != self._version:
            self._entries.clear()
            self._version = version
            self.misses += 1
            return None
        value = self._entries.get(key)
        if value is None:
            self.misses += 1
        else:
            self.hits += 1
        return value

    def put(self, version: int, key: K, value: V) -> V:
        """Keep `value` for `key` at `version` (a later version drops everything kept); returns it."""
        if value is None:
            return value
        entries = self._entries
        if version != self._version:
            entries.clear()
            self._version = version
        elif len(entries) >= self.max_entries and key not in entries:
            del entries[next(iter(entries))]  # the oldest: insertion order
        entries[key] = value
        return value

    def clear(self) -> None:
        self._entries.clear()


__all__ = ["StateMemo"]
