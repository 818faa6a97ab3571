"""A faster libyaml loader for Kubernetes YAML that returns exactly what PyYAML's SafeLoader does.

Used by `objects.decode_yaml`. PyYAML's C loader scans, parses and composes in C, but resolves every
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

`plain_documents` goes further for the block YAML that `kubectl get -o yaml` and `yaml.safe_dump`
write: at 10,000 pods even the C loader spends most of its time making a Python node and two marks
per scalar for the constructor to walk. For a strict subset of YAML, read line by line (block
mappings and sequences; keys and values on one line, plain or quoted without escapes; `{}` and
`[]`; full-line comments; `---` between documents) it builds the documents directly, resolving
plain scalars with the same implicit resolvers and constructing them with SafeConstructor's own
functions. Any line outside the subset, anything it cannot tell apart from a longer construct
(a scalar continued on the next line, a comment after a value, a tag, an anchor, a block scalar, a
flow collection with content, tabs, CR, a byte order mark, non-printable text), a resolved tag
other than str and the plain scalar tags, or a constructor error raises `NotPlainYaml` and the
caller decodes the whole text again the general way, so every error and every result outside the
subset stays PyYAML's.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, ScalarNode, SequenceNode
from yaml.reader import Reader

# Bounds on the per-stream memos: hostile input with endless distinct scalars only stops hitting
# them, it cannot grow them.
MAX_RESOLVED_SCALARS = 4096
MAX_SHARED_STRINGS = 65536
MAX_SHARED_STRING_CHARS = 256
# Nesting `plain_documents` builds itself; deeper documents go the general way (which has its own
# limits and errors), so the subset never has to match PyYAML's behaviour at its recursion limit.
MAX_PLAIN_NESTING = 64
# Distinct lines and scalar texts (keys and values) `plain_documents` remembers what they say, per
# stream, each at most MAX_SHARED_STRING_CHARS long.
MAX_PLAIN_SCALARS = 16384
# Lines are split this many characters at a time: a 10,000-pod file's lines, all held at once,
# would be tens of MiB of small strings.
PLAIN_CHUNK_CHARS = 1 << 16


class SharedStrings(dict[str, str]):
    """`strings[value]` is the one object kept for text equal to `value` (a 10,000-pod directory
    repeats most keys and values); a hit is a plain dict lookup. At most MAX_SHARED_STRINGS are
    kept, each at most MAX_SHARED_STRING_CHARS long; other text is returned as it is."""

    __slots__ = ()

    def __missing__(self, value: str) -> str:
        if len(value) <= MAX_SHARED_STRING_CHARS and len(self) < MAX_SHARED_STRINGS:
            self[value] = value
        return value


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
            self._strings = SharedStrings()
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
                    return self._strings[node.value]
                if tag in _SCALAR_TAGS:
                    return self.yaml_constructors[tag](self, node)
                raise _Slow
            if cls is MappingNode and tag == _MAP:
                out = {}
                strings = self._strings
                build = self._build
                for key_node, value_node in node.value:
                    if type(key_node) is not ScalarNode or key_node.tag != _STR or self._track_aliases:
                        # `_build` refuses merge (`<<`) and value (`=`) keys (their tags are not
                        # scalar tags) and collection keys (unhashable to SafeConstructor too).
                        key = build(key_node)
                    else:
                        key = strings[key_node.value]
                    if type(value_node) is ScalarNode and value_node.tag == _STR and not self._track_aliases:
                        out[key] = strings[value_node.value]
                    else:
                        out[key] = build(value_node)
                return out
            if cls is SequenceNode and tag == _SEQ:
                return [self._build(item) for item in node.value]
            raise _Slow

else:  # PyYAML without libyaml: kube.decode_yaml uses the pure-Python loader only
    FastCSafeLoader = None  # type: ignore[assignment, misc]


# -- the plain block subset (module docstring) ---------------------------------------------------------


class NotPlainYaml(Exception):
    """The text is not (only) the plain block subset: decode it the general way."""


# Characters PyYAML reads differently from what a line-by-line reading would assume (tab, CR and
# the Unicode line breaks end or indent lines for it; a BOM is dropped), and what its Reader refuses.
_NOT_PLAIN_CHARS = ("\t", "\r", "\ufeff", "\x85", "\u2028", "\u2029")
_NON_PRINTABLE = Reader.NON_PRINTABLE
# A plain scalar of the subset: it starts with none of YAML's indicators (`-` only before a digit
# or `.`, as in -1 or -.5), holds no `#` (a comment after ` `), no quote and no flow indicator,
# and has `:` only before a character that is not a space (`: ` would be a mapping value).
_PLAIN_FIRST = r"[A-Za-z0-9_./~^$+=()<;]|-(?=[0-9.])"
_PLAIN_REST = r"[A-Za-z0-9_./~^$+=()<>;@%, -]"
_PLAIN = rf"(?:{_PLAIN_FIRST}){_PLAIN_REST}*(?::[A-Za-z0-9_./~^$+=()<>;@%,-]{_PLAIN_REST}*)*"
# Quoted scalars on one line and without escapes are their text ('' and backslashes are refused).
_VALUE = re.compile(rf"'(?P<sq>[^']*)'|\"(?P<dq>[^\"\\]*)\"|(?P<plain>{_PLAIN})|(?P<flow>\{{\}}|\[\])")
_KEY_LINE = re.compile(r"""(?P<key>[A-Za-z0-9_][A-Za-z0-9_./-]*|'[^']*'|"[^"\\]*"):(?: +(?P<value>.+))?""")
_NO_KEY = object()
_SKIP = object()
_NO_VALUE = object()
_EMPTY_MAP = object()
_EMPTY_SEQ = object()


def plain_documents(text: str) -> Iterator[Any]:
    """The documents of `text`, one at a time, as `yaml.safe_load_all` returns them, if `text` is
    in the plain block subset (module docstring); raises NotPlainYaml, possibly after yielding
    some documents, when it is not."""
    if any(c in text for c in _NOT_PLAIN_CHARS) or _NON_PRINTABLE.search(text):
        raise NotPlainYaml("characters outside the subset")
    if yaml.SafeLoader.yaml_path_resolvers:
        raise NotPlainYaml("path resolvers registered")
    return _guarded(PlainReader().documents(text))


def _guarded(documents: Iterator[Any]) -> Iterator[Any]:
    # Any surprise inside the subset reader sends the text the general way too, as
    # FastCSafeLoader does: the result must be PyYAML's, never a different error.
    try:
        yield from documents
    except NotPlainYaml:
        raise
    except Exception as exc:  # noqa: BLE001
        raise NotPlainYaml(f"{type(exc).__name__}: {exc}") from exc


class PlainReader:
    """One stream's reader of the plain block subset, with its bounded memos."""

    __slots__ = ("_lines", "_scalars", "_strings", "_by_first", "_wildcard", "_constructor")

    def __init__(self) -> None:
        self._lines: dict[str, tuple[int, int, Any, Any]] = {}  # a line -> what it says (most repeat)
        self._scalars: dict[str, Any] = {}  # a key or value as written -> its (immutable) value
        self._strings = SharedStrings()
        resolvers = yaml.SafeLoader.yaml_implicit_resolvers
        self._wildcard = tuple(resolvers.get(None, []))
        self._by_first = {first: tuple(entries) + self._wildcard for first, entries in resolvers.items()}
        self._constructor = SafeConstructor()

    def _plain(self, value: str) -> Any:
        """A plain scalar as BaseResolver.resolve and SafeConstructor make it."""
        tag = _STR
        for candidate, regexp in self._by_first.get(value[:1], self._wildcard):
            if regexp.match(value):
                tag = candidate
                break
        if tag == _STR:
            return self._strings[value]
        if tag not in _SCALAR_TAGS:
            raise NotPlainYaml(f"plain scalar {value!r} resolves to {tag}")
        try:
            made = SafeConstructor.yaml_constructors[tag](self._constructor, ScalarNode(tag, value))
        except Exception as exc:  # noqa: BLE001 - the general way reports it, as PyYAML does
            raise NotPlainYaml(f"{value!r}: {exc}") from None
        if made != made:
            # NaN: remembered, every `.nan` would be one object, and two NaN objects are not the
            # same dict key or list member; PyYAML makes a new one each time.
            raise NotPlainYaml("NaN")
        return made

    def _scalar(self, text: str) -> Any:
        """A key or value as written on its line: plain, quoted, `{}` or `[]` (as _EMPTY_MAP or
        _EMPTY_SEQ: those are mutable, so every occurrence gets a new one)."""
        value = self._scalars.get(text, _NO_VALUE)
        if value is not _NO_VALUE:
            return value
        match = _VALUE.fullmatch(text)
        if match is None:
            raise NotPlainYaml(f"{text!r} is not a one-line scalar of the subset")
        group = match.lastgroup
        if group == "plain":
            value = self._plain(text)
        elif group == "flow":
            value = _EMPTY_MAP if text == "{}" else _EMPTY_SEQ
        else:
            value = self._strings[match.group("sq") if group == "sq" else match.group("dq")]
        if len(self._scalars) < MAX_PLAIN_SCALARS and len(text) <= MAX_SHARED_STRING_CHARS:
            self._scalars[text] = value
        return value

    def _line(self, line: str) -> tuple[int, int, Any, Any]:
        """What a line says: (its indentation; the column of its content after a `- `, or -1
        without one; its key, or _NO_KEY; its value, or _NO_VALUE when nothing follows). A blank
        or comment line is (-1, -1, _SKIP, _SKIP), a `---` line (-1, -1, _NO_KEY, _NO_VALUE)."""
        s = line.lstrip(" ")
        if not s or s[0] == "#":
            return -1, -1, _SKIP, _SKIP
        indent = len(line) - len(s)
        s = s.rstrip(" ")
        if indent == 0 and s.startswith("---"):
            if s != "---":
                raise NotPlainYaml("content after ---")
            return -1, -1, _NO_KEY, _NO_VALUE
        return (indent, *self._content(s))

    def _content(self, s: str) -> tuple[int, Any, Any]:
        offset = -1
        if s[0] == "-" and (len(s) == 1 or s[1] == " "):
            rest = s[1:].lstrip(" ")
            if not rest:
                return 0, _NO_KEY, _NO_VALUE
            if rest[0] == "-" and (len(rest) == 1 or rest[1] == " "):
                raise NotPlainYaml("a sequence on a sequence entry's line")
            offset = len(s) - len(rest)
            match = _KEY_LINE.fullmatch(rest)
            if match is None:
                return offset, _NO_KEY, self._scalar(rest)
        else:
            match = _KEY_LINE.fullmatch(s)
            if match is None:
                raise NotPlainYaml(f"{s!r} is not a key line of the subset")
        key = self._scalar(match.group("key"))
        value = match.group("value")
        return offset, key, _NO_VALUE if value is None else self._scalar(value)

    def documents(self, text: str) -> Iterator[Any]:
        # Open blocks, innermost last: (column, container, is a mapping, indentless sequence).
        # An indentless sequence is a mapping value written at its key's column (`ports:\n- ...`).
        stack: list[tuple[int, Any, bool, bool]] = []
        # A key or sequence entry with nothing after it on its line: (container, key or index,
        # column, in a mapping). The next line decides whether a block starts there or it is null.
        pending: tuple[Any, Any, int, bool] | None = None
        started = False  # a document is open: an explicit `---`, or content before the first one
        null = self._plain("")
        lines = self._lines
        start, end_of_text = 0, len(text)
        while start < end_of_text:
            end = text.find("\n", start + PLAIN_CHUNK_CHARS)
            if end < 0:
                end = end_of_text
            chunk = text[start:end]
            start = end + 1
            for line in chunk.split("\n"):
                said = lines.get(line)
                if said is None:
                    said = self._line(line)
                    if len(lines) < MAX_PLAIN_SCALARS and len(line) <= MAX_SHARED_STRING_CHARS:
                        lines[line] = said
                indent, offset, key, value = said
                if indent < 0:
                    if key is _SKIP:
                        continue  # blank, or a comment on its own line
                    if started:  # `---`
                        if pending is not None:
                            pending[0][pending[1]] = null
                            pending = None
                        yield stack[0][1] if stack else None
                        stack = []
                    started = True
                    continue
                dash = offset >= 0
                if pending is not None:
                    container, slot, column, in_mapping = pending
                    pending = None
                    if indent > column or (in_mapping and dash and indent == column):
                        block: Any = [] if dash else {}
                        container[slot] = block
                        stack.append((indent, block, not dash, indent == column))
                        if len(stack) > MAX_PLAIN_NESTING:
                            raise NotPlainYaml("nested too deep")
                    else:
                        container[slot] = null
                elif not stack:
                    started = True
                    stack.append((indent, [] if dash else {}, not dash, False))
                column, container, in_mapping, indentless = stack[-1]
                while column > indent or (indentless and column == indent and not dash):
                    stack.pop()
                    if not stack:
                        raise NotPlainYaml("a line left of the document's first block")
                    column, container, in_mapping, indentless = stack[-1]
                if column != indent:
                    raise NotPlainYaml("indentation of no open block")
                if value is _EMPTY_MAP:
                    value = {}
                elif value is _EMPTY_SEQ:
                    value = []
                if dash:
                    if in_mapping:
                        raise NotPlainYaml("a sequence entry where a mapping key belongs")
                    if key is _NO_KEY:
                        if value is _NO_VALUE:
                            container.append(None)
                            pending = (container, len(container) - 1, indent, False)
                        else:
                            container.append(value)
                        continue
                    indent += offset
                    item: dict[Any, Any] = {}
                    container.append(item)
                    stack.append((indent, item, True, False))
                    if len(stack) > MAX_PLAIN_NESTING:
                        raise NotPlainYaml("nested too deep")
                    container = item
                elif not in_mapping:
                    raise NotPlainYaml("a mapping key where a sequence entry belongs")
                if value is _NO_VALUE:
                    container[key] = None
                    pending = (container, key, indent, True)
                else:
                    container[key] = value
        if started:
            if pending is not None:
                pending[0][pending[1]] = null
            yield stack[0][1] if stack else None
