"""YAML with aliases bounded: the one YAML reader for files from outside.

Counterparts: ztunnel reads its local config with serde_yaml, and istiod reads Kubernetes YAML
with sigs.k8s.io/yaml (go-yaml), which refuses documents whose aliases expand too far. PyYAML
has no such limit: an alias is a pointer to an earlier node, so `&a [x, x]`, `&b [*a, *a]`, ...
doubles at every line and a 1.9 KB local config expanded to 943 MiB (a 7 KB AuthorizationPolicy
in `ambient control --dir` to 500 MiB) once something walked it.

The composer here counts, while composing, how many nodes every alias stands for (its anchored
node's size with all aliases inside it expanded, counted once per node) and refuses a stream
whose aliases add more than MAX_YAML_ALIAS_NODES nodes in all, or an alias inside the node it
names (a cycle). Refusals are `AliasLimitError`, a PyYAML ComposerError whose mark names the
alias's line and column, so every reader that reports YAML errors with a position reports these
too. Anchors used the ordinary way (shared labels, `<<: *defaults`) stay far below the bound.

Text without a possible alias can still go to libyaml (`may_have_aliases` says when not).
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from yaml.composer import ComposerError
from yaml.events import AliasEvent
from yaml.nodes import Node

# Nodes the aliases of one file (all its documents) may add to it. Ordinary anchors add tens or
# hundreds; the bombs above add billions. A limit on what aliases add, not on the file, so large
# honest files (tens of thousands of pods) are never refused for their size.
MAX_YAML_ALIAS_NODES = 100_000

_HOW_TO_FIX = "write the repeated part out in full, or use fewer and smaller aliases"

# `*` starts an alias only where a node can start: at the start of a line or after white space,
# a flow indicator or `:`. Anywhere else (inside a quoted or plain scalar) it is text.
_POSSIBLE_ALIAS = re.compile(r"(?<![^\s\[\]{},:])\*")


class AliasLimitError(ComposerError):
    """A YAML alias that expands past MAX_YAML_ALIAS_NODES, or refers to a node it is inside."""


class BoundedSafeLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader whose composer bounds what aliases expand to."""

    max_alias_nodes = MAX_YAML_ALIAS_NODES

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._expanded = 0  # nodes composed so far, with every alias counted as what it names
        self._alias_nodes = 0  # of those, the ones aliases added (for the whole stream)
        self._anchor_sizes: dict[str, int] = {}
        self._open_anchors: set[str] = set()

    def compose_document(self) -> Node | None:
        self._anchor_sizes = {}  # anchors are per document (YAML 1.1 section 3.2.2.2)
        return super().compose_document()

    def _next_event(self) -> Any:
        # PyYAML's stubs leave Parser.peek_event untyped; it returns the next event, not consumed.
        return self.peek_event()  # type: ignore[no-untyped-call]

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        if self.check_event(AliasEvent):
            event = self._next_event()
            anchor = event.anchor
            if anchor in self._open_anchors:
                raise AliasLimitError(
                    None,
                    None,
                    f"alias *{anchor} is inside the node &{anchor} it refers to (a recursive alias); "
                    "remove it: recursive structures cannot be configuration",
                    event.start_mark,
                )
            size = self._anchor_sizes.get(anchor)
            if size is not None:
                self._expanded += size
                self._alias_nodes += size
                if self._alias_nodes > self.max_alias_nodes:
                    raise AliasLimitError(
                        None,
                        None,
                        f"alias *{anchor} stands for {size} nodes, which takes what aliases add to "
                        f"this file past the limit of {self.max_alias_nodes} nodes (an alias bomb?); "
                        + _HOW_TO_FIX,
                        event.start_mark,
                    )
            return super().compose_node(parent, index)  # undefined aliases: PyYAML's own error
        anchor = self._next_event().anchor
        before = self._expanded
        if anchor is not None:
            self._open_anchors.add(anchor)
        try:
            node = super().compose_node(parent, index)
        finally:
            if anchor is not None:
                self._open_anchors.discard(anchor)
        self._expanded += 1
        if anchor is not None:
            self._anchor_sizes[anchor] = self._expanded - before
        return node


def compose(text: str) -> Node | None:
    """The node tree of a single-document stream (`yaml.compose`), aliases bounded."""
    loader = BoundedSafeLoader(text)
    try:
        return loader.get_single_node()
    finally:
        loader.dispose()


def load_all(text: str) -> list[Any]:
    """Every document of a stream as Python objects (`yaml.safe_load_all`), aliases bounded."""
    loader = BoundedSafeLoader(text)
    try:
        docs = []
        while loader.check_data():  # type: ignore[no-untyped-call]  # untyped in PyYAML's stubs
            docs.append(loader.get_data())
        return docs
    finally:
        loader.dispose()


def may_have_aliases(text: str) -> bool:
    """False when `text` certainly has no alias, so an unbounded loader (libyaml) is safe on it."""
    return "*" in text and _POSSIBLE_ALIAS.search(text) is not None
