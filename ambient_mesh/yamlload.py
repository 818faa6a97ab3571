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

Large files are parsed by libyaml (docs/performance.md, "The control plane at scale"):
`BoundedCSafeLoader` takes libyaml's events and composes them with the same alias-counting Python
composer, and text without a possible alias (`may_have_aliases`) is composed by libyaml too, since there
is nothing to bound. A property test holds both to the pure-Python loader (`compose(text, fast=False)`).
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from yaml.composer import Composer, ComposerError
from yaml.constructor import SafeConstructor
from yaml.events import AliasEvent
from yaml.nodes import Node
from yaml.resolver import Resolver

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


class _AliasBound(Composer):
    """PyYAML's Composer, counting what aliases expand to. Mixed in before a parser (PyYAML's
    pure-Python one, or libyaml's CParser), so composition is always this Python code."""

    max_alias_nodes = MAX_YAML_ALIAS_NODES

    def _init_alias_bound(self) -> None:
        self._expanded = 0  # nodes composed so far, with every alias counted as what it names
        self._alias_nodes = 0  # of those, the ones aliases added (for the whole stream)
        self._anchor_sizes: dict[str, int] = {}
        self._open_anchors: set[str] = set()

    def compose_document(self) -> Node | None:
        self._anchor_sizes = {}  # anchors are per document (YAML 1.1 section 3.2.2.2)
        return super().compose_document()

    def _parser(self) -> Any:
        """Self as the parser mixed in beside this composer (PyYAML's Parser or libyaml's
        CParser), whose event methods the stubs do not give Composer."""
        return self

    def _next_event(self) -> Any:
        # The next event, not consumed.
        return self._parser().peek_event()

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        if self._parser().check_event(AliasEvent):
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


class BoundedSafeLoader(_AliasBound, yaml.SafeLoader):
    """PyYAML's SafeLoader whose composer bounds what aliases expand to."""

    def __init__(self, stream: Any) -> None:
        yaml.SafeLoader.__init__(self, stream)
        self._init_alias_bound()


# libyaml's parser and loader; None when PyYAML was built without it.
# yaml imports its cyaml module only when libyaml is there.
_CParser: Any = getattr(getattr(yaml, "cyaml", None), "CParser", None)
_CSafeLoader: Any = getattr(yaml, "CSafeLoader", None)
FastLoader: Any = BoundedSafeLoader

if _CParser is not None:

    class BoundedCSafeLoader(_AliasBound, _CParser, SafeConstructor, Resolver):  # type: ignore[misc]
        """libyaml scans and parses (in C, most of the time a large file takes); the composer
        is still _AliasBound's Python, so aliases are bounded exactly as in BoundedSafeLoader.
        Python's Composer methods come first in the MRO and override CParser's C composer."""

        def __init__(self, stream: Any) -> None:
            _CParser.__init__(self, stream)
            Composer.__init__(self)
            SafeConstructor.__init__(self)
            Resolver.__init__(self)
            self._init_alias_bound()

    FastLoader = BoundedCSafeLoader


def compose(text: str, *, fast: bool = True) -> Node | None:
    """The node tree of a single-document stream (`yaml.compose`), aliases bounded; libyaml
    parses it unless `fast` is False (held to the pure-Python loader by a property test)."""
    if fast and _CSafeLoader is not None and not may_have_aliases(text):
        # No alias, nothing to bound: libyaml composes too (most of what is left of the time).
        loader: Any = _CSafeLoader(text)
    else:
        loader = FastLoader(text) if fast else BoundedSafeLoader(text)
    try:
        node: Node | None = loader.get_single_node()
        return node
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


def compose_loader_name() -> str:
    """Which loader `compose` uses by default (for benchmarks)."""
    return str(FastLoader.__name__)
