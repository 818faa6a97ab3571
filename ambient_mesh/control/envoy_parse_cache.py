"""Envoy resources parsed once: the JSON form of a resource to its protobuf message, kept from
one build of a waypoint to the next.

A waypoint is built again as a whole when anything it serves changes, and parsing the JSON form
(`json_format.ParseDict`, pure Python) was most of a rebuild: with 1,000 services, one changed
HTTPRoute re-parsed 1,000 filter chains, clusters and load assignments to change one chain. The
JSON text (C-encoded; the builders write keys in a fixed order, and another order only misses)
names a resource; a build reuses the messages of
the previous build whose text did not change, and keeps only those it used, so the cache holds
at most two builds' resources. A listener is parsed without its filter chains, which are
looked up one by one and copied in. Messages handed out are shared: callers must not modify them.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from google.protobuf import json_format
from google.protobuf.message import Message

M = TypeVar("M", bound=Message)


class ParseCache:
    """Parsed messages by (type, JSON text), from this build and the previous one."""

    __slots__ = ("_previous", "_current", "hits", "misses")

    def __init__(self) -> None:
        self._previous: dict[tuple[str, str], Message] = {}
        self._current: dict[tuple[str, str], Message] = {}
        self.hits = 0
        self.misses = 0

    def __repr__(self) -> str:
        return f"ParseCache({len(self._current)} kept, {self.hits} hits, {self.misses} misses)"

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

    def parse_listener(self, doc: dict[str, Any], listener_type: type[M], chain_type: type[Message]) -> M:
        """A listener, its filter chains parsed (and cached) one by one."""
        chains = doc.get("filter_chains", [])
        head = {k: v for k, v in doc.items() if k != "filter_chains"}
        message = listener_type()
        message.CopyFrom(self.parse(head, listener_type))
        for chain in chains:
            message.filter_chains.add().CopyFrom(self.parse(chain, chain_type))  # type: ignore[attr-defined]
        return message

    def end_build(self) -> None:
        """Forget what the finished build did not use."""
        self._previous, self._current = self._current, {}
