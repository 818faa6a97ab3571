"""A faster libyaml loader for Kubernetes YAML that returns exactly what PyYAML's SafeLoader does.

Used by `kube.decode_yaml`. PyYAML's C loader scans, parses and composes in C, but resolves every
plain scalar's tag with Python regular expressions and constructs the documents through
SafeConstructor's generic, generator-based path, which is most of the decode time at 10,000 pods.
This loader keeps libyaml's composer and SafeConstructor's own per-tag scalar constructors, and
changes two things:

- plain scalars resolve through a bounded memo (Kubernetes YAML repeats the same keys and values
  thousands of times), with the same implicit resolvers in the same order;
- a document made only of mappings, sequences and scalars with a standard tag, no alias (no node
  reached twice) and no merge (`<<`) or value (`=`) key is built by one direct walk. Anything else
  (aliases, merges, `!!set`, `!!omap`, unknown tags, unhashable keys, a constructor error) is built
  again, from the same nodes, by SafeConstructor's own `construct_document`, so results and errors
  stay PyYAML's.

Strings are shared within one stream through a bounded memo as well, so 10,000 copies of `TCP` or
`app` are one object (the memo is dropped with the loader).
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.nodes import MappingNode, ScalarNode, SequenceNode

# Bounds on the per-stream memos: hostile input with endless distinct scalars only stops hitting
# them, it cannot grow them.
MAX_RESOLVED_SCALARS = 4096
MAX_SHARED_STRINGS = 65536
MAX_SHARED_STRING_CHARS = 256

_STR = "tag:yaml.org,2002:str"
_MAP = "tag:yaml.org,2002:map"
_SEQ = "tag:yaml.org,2002:seq"
# Scalar tags whose SafeConstructor constructor is a plain function of the node (no generator).
_SCALAR_TAGS = frozenset(
    {
        "tag:yaml.org,2002:null",
        "tag:yaml.org,2002:bool",
        "tag:yaml.org,2002:int",
        "tag:yaml.org,2002:float",
        "tag:yaml.org,2002:binary",
        "tag:yaml.org,2002:timestamp",
    }
)


class _Slow(Exception):
    """The document needs SafeConstructor's general path."""


CSafeLoader = getattr(yaml, "CSafeLoader", None) if getattr(yaml, "__with_libyaml__", False) else None


if CSafeLoader is not None:

    class FastCSafeLoader(CSafeLoader):  # type: ignore[misc, valid-type]
        """libyaml's SafeLoader with a memoised resolver and a direct constructor (module docstring)."""

        def __init__(self, stream: Any) -> None:
            super().__init__(stream)
            # Only valid while nobody registered path resolvers (PyYAML's add_path_resolver).
            self._fast = not self.yaml_path_resolvers
            self._resolved: dict[str, str] = {}
            self._strings: dict[str, str] = {}
            self._seen: set[int] = set()
            # Without an anchor (`&`) there can be no alias, so no node is reached twice.
            self._track_aliases = not isinstance(stream, str) or "&" in stream
            resolvers = self.yaml_implicit_resolvers
            wildcard = resolvers.get(None, [])
            self._by_first = {first: tuple(entries + wildcard) for first, entries in resolvers.items()}
            self._wildcard = tuple(wildcard)

        # -- resolving (BaseResolver.resolve, memoised for plain scalars) -------------------------

        def descend_resolver(self, current_node: Any, current_index: Any) -> None:
            if not self._fast:
                super().descend_resolver(current_node, current_index)

        def ascend_resolver(self) -> None:
            if not self._fast:
                super().ascend_resolver()

        def resolve(self, kind: Any, value: Any, implicit: Any) -> str:
            if not self._fast:
                return str(super().resolve(kind, value, implicit))
            if kind is ScalarNode:
                if not implicit[0]:
                    return str(self.DEFAULT_SCALAR_TAG)
                tag: str | None = self._resolved.get(value)
                if tag is None:
                    tag = str(self.DEFAULT_SCALAR_TAG)
                    for candidate, regexp in self._by_first.get(value[:1] if value else "", self._wildcard):
                        if regexp.match(value):
                            tag = candidate
                            break
                    if len(self._resolved) < MAX_RESOLVED_SCALARS:
                        self._resolved[value] = tag
                return tag
            if kind is SequenceNode:
                return str(self.DEFAULT_SEQUENCE_TAG)
            return str(self.DEFAULT_MAPPING_TAG)

        # -- constructing -------------------------------------------------------------------------

        def get_data(self) -> Any:
            if not self.check_node():
                return None
            node = self.get_node()
            if self._fast:
                self._seen.clear()
                try:
                    return self._build(node)
                except Exception:  # noqa: BLE001 - any surprise: SafeConstructor decides, as always
                    pass
            return self.construct_document(node)

        def _string(self, value: str) -> str:
            if len(value) > MAX_SHARED_STRING_CHARS:
                return value
            shared = self._strings.get(value)
            if shared is not None:
                return shared
            if len(self._strings) < MAX_SHARED_STRINGS:
                self._strings[value] = value
            return value

        def _build(self, node: Any) -> Any:
            if self._track_aliases:
                ident = id(node)
                if ident in self._seen:
                    raise _Slow  # an alias: SafeConstructor shares the object, and counts aliases
                self._seen.add(ident)
            tag = node.tag
            cls = type(node)
            if cls is ScalarNode:
                if tag == _STR:
                    return self._string(node.value)
                if tag in _SCALAR_TAGS:
                    return self.yaml_constructors[tag](self, node)
                raise _Slow
            if cls is MappingNode and tag == _MAP:
                out = {}
                string = self._string
                build = self._build
                for key_node, value_node in node.value:
                    if type(key_node) is not ScalarNode or key_node.tag != _STR or self._track_aliases:
                        # `_build` refuses merge (`<<`) and value (`=`) keys (their tags are not
                        # scalar tags) and collection keys (unhashable to SafeConstructor too).
                        key = build(key_node)
                    else:
                        key = string(key_node.value)
                    if type(value_node) is ScalarNode and value_node.tag == _STR and not self._track_aliases:
                        out[key] = string(value_node.value)
                    else:
                        out[key] = build(value_node)
                return out
            if cls is SequenceNode and tag == _SEQ:
                return [self._build(item) for item in node.value]
            raise _Slow

else:  # PyYAML without libyaml: kube.decode_yaml uses the pure-Python loader only
    FastCSafeLoader = None  # type: ignore[assignment, misc]
