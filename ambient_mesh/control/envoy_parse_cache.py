"""Envoy resources parsed once: the JSON form of a resource to its protobuf message, kept from
one build of a waypoint to the next.

A waypoint is built again as a whole when anything it serves changes, and parsing the JSON form
(`json_format.ParseDict`, pure Python) was most of a rebuild: with 1,000 services, one changed
HTTPRoute re-parsed 1,000 filter chains, clusters and load assignments to change one chain.

Two ways in. `parse` names a resource by its JSON text (C-encoded; the builders write keys in a
fixed order, and another order only misses). `memo` names it by what it is made of: a hashable
key the caller derives from every input of the builder, and the objects it holds by identity
(an unchanged route object keeps its rule objects); the builder runs, and the JSON is written
and parsed, only on a miss, so an unchanged service costs one dictionary look-up rather than
building and encoding its JSON. A build reuses the messages of the previous build and keeps only
those it used, so the cache holds at most two builds' resources. A listener is parsed without
its filter chains, which are looked up one by one and copied in. Messages handed out are shared:
callers must not modify them. Measured reason: docs/performance.md, "Waypoint rebuilds".
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

from google.protobuf import json_format
from google.protobuf.message import Message

M = TypeVar("M", bound=Message)


class ParseCache:
    """Parsed messages by (type, JSON text) or by (type, key, held objects), from this build and
    the previous one."""

    __slots__ = ("_previous", "_current", "_memo_previous", "_memo_current", "hits", "misses")

    def __init__(self) -> None:
        self._previous: dict[tuple[str, str], Message] = {}
        self._current: dict[tuple[str, str], Message] = {}
        self._memo_previous: dict[tuple[str, Hashable], tuple[tuple[object, ...], Message]] = {}
        self._memo_current: dict[tuple[str, Hashable], tuple[tuple[object, ...], Message]] = {}
        self.hits = 0
        self.misses = 0

    def __repr__(self) -> str:
        kept = len(self._current) + len(self._memo_current)
        return f"ParseCache({kept} kept, {self.hits} hits, {self.misses} misses)"

    def parse(self, doc: dict[str, Any], message_type: type[M]) -> M:
        key = (message_type.DESCRIPTOR.full_name, json.dumps(doc, separators=(",", ":")))
        found = self._current.get(key) or self._previous.get(key)
        if found is None:
            found = message_type()
            json_format.ParseDict(doc, found)
            self.misses += 1
        else:
            self.hits += 1
        self._current[key] = found
        return found  # type: ignore[return-value]

    def memo(
        self,
        key: Hashable,
        held: Sequence[object],
        make: Callable[[], dict[str, Any]],
        message_type: type[M],
    ) -> M:
        """The message `make()` parses to, built only when no kept message has the same `key`
        and the very same `held` objects. `key` and `held` together must determine `make()`'s
        result: that is the caller's promise, and the property test's subject."""
        full = (message_type.DESCRIPTOR.full_name, key)
        held = tuple(held)
        entry = self._memo_current.get(full) or self._memo_previous.get(full)
        if (
            entry is not None
            and len(entry[0]) == len(held)
            and all(a is b for a, b in zip(entry[0], held, strict=True))
        ):
            self.hits += 1
        else:
            message = message_type()
            json_format.ParseDict(make(), message)
            entry = (held, message)
            self.misses += 1
        self._memo_current[full] = entry
        return entry[1]  # type: ignore[return-value]

    def parse_listener(self, doc: dict[str, Any], listener_type: type[M], chain_type: type[Message]) -> M:
        """A listener, its filter chains parsed (and cached) one by one; a chain already given as
        a message (from `memo`) is copied in as it is."""
        chains = doc.get("filter_chains", [])
        head = {k: v for k, v in doc.items() if k != "filter_chains"}
        message = listener_type()
        message.CopyFrom(self.parse(head, listener_type))
        for chain in chains:
            parsed = chain if isinstance(chain, Message) else self.parse(chain, chain_type)
            message.filter_chains.add().CopyFrom(parsed)  # type: ignore[attr-defined]
        return message

    def end_build(self) -> None:
        """Forget what the finished build did not use."""
        self._previous, self._current = self._current, {}
        self._memo_previous, self._memo_current = self._memo_current, {}
