"""kube/decode.py and kube/yaml_loader.py: every text decodes exactly as PyYAML's pure-Python
loader decodes it, whichever reader (the plain block subset, libyaml, PyYAML) takes it."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from ambient_mesh.kube.decode import decode_yaml
from ambient_mesh.kube.load import parse_documents

HAS_LIBYAML = bool(getattr(yaml, "__with_libyaml__", False))


# -- YAML decoding --------------------------------------------------------------------------------


# Any exception, not only YAMLError: PyYAML's SafeConstructor raises ValueError or IndexError for
# some explicit tags (`!!int a`), and the fast path must not change that either.
def _reference(text: str) -> tuple[str, str]:
    """What the pure-Python loader makes of `text`, as comparable text."""
    try:
        return "ok", repr(list(yaml.load_all(text, Loader=yaml.SafeLoader)))
    except Exception as exc:
        return type(exc).__name__, str(exc)


def _decoded(text: str) -> tuple[str, str]:
    try:
        return "ok", repr(decode_yaml(text))
    except Exception as exc:
        return type(exc).__name__, str(exc)


# Pieces where libyaml and PyYAML's pure-Python loader are known to disagree (tabs, BOM, Unicode
# line breaks, bare `!` tags, `|#` headers), plus ordinary YAML and Kubernetes-shaped values.
_PIECES = [*"ab:- \n\t\r'\"[]{},#&*!|>?%@`\\.0123x<=~"] + [
    "\u00e9", "\ud800", "\x00", "\x01", "\x7f", "\x85", "\x9f", "\xa0", "\ufeff", "\u2028", "\u2029",
    "\ufffe", "\U0001f600", "\r\n", "!!str ", "!!int ", "!!binary ", "!foo ", "%YAML 1.1\n",
    "%YAML 2.0\n", "%TAG ! tag:x,2000:\n", "---\n", "...\n", "<<: ", "2024-05-01T10:00:00Z",
    "2001-12-14 21:59:43.10 -5", "2002-12-14", "0x1f", "0o17", "1_000", "1:20", ".inf", "~", "null",
    "yes", "On", "&a ", "*a", "? ", "\\x41", "  ", "\n  ", "key: ", "- ", "|-\n  ", ">+\n  ",
]  # fmt: skip


@settings(max_examples=400)
@given(st.lists(st.sampled_from(_PIECES), max_size=40).map("".join))
def test_decode_matches_the_pure_python_loader_exactly(text: str) -> None:
    decoded = _decoded(text)
    if decoded[0] == "AliasLimitError":
        # The one intended difference: a recursive alias (`&a [*a]`) is refused (yamlload).
        assert "recursive alias" in decoded[1]
        return
    assert decoded == _reference(text)


_SCALARS = st.one_of(
    st.text(max_size=12), st.integers(), st.booleans(), st.none(), st.datetimes(), st.dates()
)
_DOCS = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)


@settings(max_examples=200)
@given(_DOCS, st.booleans())
def test_decode_matches_for_dumped_documents(doc: object, flow: bool) -> None:
    text = yaml.safe_dump(doc, allow_unicode=True, default_flow_style=flow)
    assert _decoded(text) == _reference(text)


POD_WITH_TIMESTAMPS = """\
apiVersion: v1
kind: Pod
metadata:
  name: web
  namespace: default
  creationTimestamp: "2024-05-01T10:00:00Z"
  labels: {app: web}
spec: {nodeName: node-1}
status: {podIP: 10.0.0.1}
---
apiVersion: v1
kind: Pod
metadata:
  name: unquoted
  creationTimestamp: 2024-05-01T10:00:00Z
"""


def test_timestamps_decode_as_pyyaml_does() -> None:
    docs = decode_yaml(POD_WITH_TIMESTAMPS)
    assert repr(docs) == repr(list(yaml.safe_load_all(POD_WITH_TIMESTAMPS)))
    # An unquoted timestamp is a datetime to YAML 1.1; the object model keeps its RFC 3339 text.
    assert type(docs[1]["metadata"]["creationTimestamp"]).__name__ == "datetime"
    result = parse_documents(POD_WITH_TIMESTAMPS, "pods.yaml")
    assert result.errors == ()
    assert [(o.metadata.name, o.metadata.creation_timestamp) for o in result.objects] == [
        ("web", "2024-05-01T10:00:00Z"),
        ("unquoted", "2024-05-01T10:00:00Z"),
    ]


@pytest.mark.parametrize(
    "text",
    [
        "a: [1, 2\nb: 3\n",  # unclosed flow sequence
        "a: b: c\n",  # mapping values not allowed here
        "a:\n  - 1\n - 2\n",  # bad indentation
        "a: *missing\n",  # unknown alias
        "a: 1\n\tb: 2\n",  # tab indentation (libyaml is more lenient)
        "%YAML 2.0\n---\na: 1\n",
    ],
)
def test_errors_keep_pyyaml_positions(text: str) -> None:
    with pytest.raises(yaml.MarkedYAMLError) as expected:
        list(yaml.safe_load_all(text))
    mark = expected.value.problem_mark
    assert mark is not None
    result = parse_documents(text, "bad.yaml")
    assert result.objects == ()
    assert [str(e) for e in result.errors] == [
        f"bad.yaml: line {mark.line + 1} column {mark.column + 1}: {expected.value.problem}"
    ]


def test_reader_errors_keep_pyyaml_text() -> None:
    text = "a: \x07\n"  # a control character: refused before any parsing, so there is no mark
    with pytest.raises(yaml.reader.ReaderError) as expected:
        list(yaml.safe_load_all(text))
    assert [str(e) for e in parse_documents(text, "bad.yaml").errors] == [f"bad.yaml: {expected.value}"]


@pytest.mark.skipif(not HAS_LIBYAML, reason="PyYAML built without libyaml: only the pure-Python loader runs")
def test_plain_kubernetes_yaml_takes_the_libyaml_path() -> None:
    # Plain Kubernetes YAML takes the C loader; observable only through speed, so check that the
    # C loader is what decode_yaml would pick and that it agrees.
    from ambient_mesh.kube import decode

    assert decode._libyaml_agrees(POD_WITH_TIMESTAMPS)
    for risky in ("a:\tb\n", "a: !\n", "a: |#\n", "\ufeffa: 1\n", "a: b\u2028c\n", "a: b\x85c\n", "{a?}\n"):
        assert not decode._libyaml_agrees(risky), repr(risky)
    fast = list(yaml.load_all(POD_WITH_TIMESTAMPS, Loader=yaml.CSafeLoader))
    assert repr(fast) == repr(decode_yaml(POD_WITH_TIMESTAMPS))


@pytest.mark.skipif(not HAS_LIBYAML, reason="PyYAML built without libyaml: only the pure-Python loader runs")
def test_fast_loader_builds_plain_documents_and_leaves_the_rest_to_safeconstructor(monkeypatch) -> None:
    from ambient_mesh.kube.yaml_loader import FastCSafeLoader

    general: list[object] = []
    original = FastCSafeLoader.construct_document

    def counting(self, node):
        general.append(node)
        return original(self, node)

    monkeypatch.setattr(FastCSafeLoader, "construct_document", counting)

    def load(text: str, loader) -> tuple[str, str]:
        try:
            return "ok", repr(list(yaml.load_all(text, Loader=loader)))
        except Exception as exc:
            return type(exc).__name__, str(exc)

    def both(text: str) -> tuple[tuple[str, str], tuple[str, str]]:
        # Against libyaml's own SafeLoader: decode_yaml handles where libyaml and PyYAML differ.
        return load(text, FastCSafeLoader), load(text, yaml.CSafeLoader)

    plain = (
        POD_WITH_TIMESTAMPS + "---\na: [1, 0x1f, 1_000, 1:20, .inf, ~, yes, On, 2002-12-14, !!binary aGk=]\n"
    )
    fast, reference = both(plain)
    assert fast == reference and general == []
    for text in (
        "a: &x [1]\nb: *x\n",  # an alias: one shared object
        "base: &b {x: 1}\nc:\n  <<: *b\n  y: 2\n",  # a merge key
        "s: !!set {a, b}\no: !!omap [{a: 1}]\n",
        "? [a]\n: 1\n",  # an unhashable key
        "a: !!int x\n",  # a constructor error
        "a: !custom 1\n",
        "=: 1\n",  # a value key
    ):
        general.clear()
        fast, reference = both(text)
        assert fast == reference, text
        assert len(general) == 1, text


@pytest.mark.skipif(not HAS_LIBYAML, reason="PyYAML built without libyaml: only the pure-Python loader runs")
def test_fast_loader_memos_are_bounded_and_share_strings(monkeypatch) -> None:
    from ambient_mesh.kube import yaml_loader

    monkeypatch.setattr(yaml_loader, "MAX_RESOLVED_SCALARS", 8)
    monkeypatch.setattr(yaml_loader, "MAX_SHARED_STRINGS", 8)
    text = "".join(f"k{i}: [v{i}, TCP, '{i}', {i}]\n" for i in range(100))
    loader = yaml_loader.FastCSafeLoader(text)
    try:
        docs = []
        while loader.check_data():
            docs.append(loader.get_data())
        assert len(loader._resolved) <= 8 and len(loader._strings) <= 8
    finally:
        loader.dispose()
    assert repr(docs) == repr(list(yaml.safe_load_all(text)))
    assert docs[0]["k1"][1] is docs[0]["k99"][1]  # one "TCP" for the whole stream


# -- the plain block subset (yaml_loader.plain_documents) -------------------------------------------------

# Line pieces: the subset's own shapes and, next to each, what it must not mistake for them
# (continuations, comments after values, indicators, tags, anchors, block scalars, merge keys,
# constructor errors, odd indentation, document markers).
_INDENTS = ["", " ", "  ", "   ", "    ", "      "]
_KEYS = [
    "a", "b", "name", "app.kubernetes.io/name", "80", "0x1f", "yes", "null", "~", "2024-05-01",
    "'q'", '"d"', "'a: b'", "''", "<<", "=", "a b", "-x", "k:v", "? a", "&a a", "*a", "!!str a", "[a]",
]  # fmt: skip
_VALUES = [
    "", "1", "-1", "-.5", "+1", "0o17", "0x1f", "1_000", "1:20", ".inf", ".NaN", "~", "null", "yes",
    "On", "true", "x", "-x", "x y", "x  y", "x - y", "x:y", "x:", "x: y", "x #c", "x#c", "#c",
    "2024-05-01", "2024-05-01T10:00:00Z", "2001-12-14 21:59:43.10 -5", "2020-13-45", "'s'",
    "'it''s'", "'a: #b'", "'\u00e9'", '"d"', '"a\\"b"', '"a\\nb"', "''", '""', "{}", "[]",
    "{a: 1}", "[1]", "[", "=", "<<", "<x", "*a", "&a x", "!!str x", "!x y", "|", "|-", ">", "@x",
    "%x", "`x`", "---", "...", "- x", "-", "a,b", "(x)", "$x", "^x", ";x", "10.1.0.9",
    "spiffe://cluster.local/ns/a/sa/b", "\u00e9", "x ",
]  # fmt: skip
_SPECIAL_LINES = ["---", "--- ", "--- x", "...", "# c", "  # c", "", "   ", "%YAML 1.1", "-", "- ", "- - x"]


@st.composite
def _plain_like_line(draw) -> str:
    if draw(st.integers(0, 9)) == 0:
        return draw(st.sampled_from(_SPECIAL_LINES))
    line = draw(st.sampled_from(_INDENTS)) + draw(st.sampled_from(["", "", "- ", "-  ", "-"]))
    if draw(st.booleans()):
        line += draw(st.sampled_from(_KEYS)) + draw(st.sampled_from([":", ": ", ":  ", " :"]))
    return line + draw(st.sampled_from(_VALUES))


def _plain(text: str) -> tuple[str, str] | None:
    """What the subset reader makes of `text` as comparable text; None when it declines."""
    from ambient_mesh.kube.yaml_loader import NotPlainYaml, plain_documents

    try:
        return "ok", repr(list(plain_documents(text)))
    except NotPlainYaml:
        return None


@settings(max_examples=500)
@given(st.lists(_plain_like_line(), max_size=12).map("\n".join), st.booleans())
def test_plain_subset_is_exactly_pyyaml_or_declines(text: str, newline: bool) -> None:
    text += "\n" if newline else ""
    plain = _plain(text)
    if plain is not None:
        assert plain == _reference(text)


@settings(max_examples=300)
@given(_DOCS)
def test_plain_subset_reads_block_dumps(doc: object) -> None:
    text = yaml.safe_dump(doc, allow_unicode=True, default_flow_style=False)
    plain = _plain(text)
    if plain is not None:
        assert plain == _reference(text)


_SUBSET_KEYS = [
    "a",
    "b",
    "name",
    "app.kubernetes.io/name",
    "80",
    "yes",
    "null",
    "Off",
    "1.5",
    "'q'",
    '"d"',
    "''",
]
_SUBSET_SCALARS = [
    "1", "-1", "-.5", "+1", "0o17", "0x1f", "1_000", "1:20", ".inf", ".NaN", "~", "null", "Null", "yes",
    "On", "n", "true", "x", "-x1", "x y", "x  y", "x - y", "x:y", "a,b", "(x)", "10.1.0.9", "2024-05-01",
    "2024-05-01T10:00:00Z", "'s'", "' s '", "'a: #b'", '"d"', '"a\'b"', "''", '""', "{}", "[]", "<x",
    "=x", "~x", "spiffe://cluster.local/ns/a/sa/b", "$x", ";x",
]  # fmt: skip


@st.composite
def _subset_block(draw, indent: int, depth: int) -> list[str]:
    """Lines of one block node at `indent`, in the subset's styles (some lines left over for
    PyYAML to refuse: a sequence entry in a mapping written at the key's column is one)."""
    pad = " " * indent
    lines: list[str] = []
    as_sequence = draw(st.booleans())
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.integers(0, 6)) == 0:
            lines.append(draw(st.sampled_from(["", pad + "# c", "#", "   "])))
        lead = pad + ("-" + " " * draw(st.integers(1, 2)) if as_sequence else "")
        inner = len(lead)
        if as_sequence and draw(st.integers(0, 3)) == 0:
            lines.append(pad + "-")  # an entry whose node starts on the next line, or null
            if depth < 3 and draw(st.booleans()):
                lines += draw(_subset_block(indent + draw(st.integers(1, 3)), depth + 1))
            continue
        if as_sequence and draw(st.booleans()):
            lines.append(lead + draw(st.sampled_from(_SUBSET_SCALARS)))
            continue
        key = draw(st.sampled_from(_SUBSET_KEYS))
        if depth < 3 and draw(st.booleans()):
            lines.append(lead + key + ":")
            nested = inner + draw(st.sampled_from([0, 0, 1, 2, 4]))  # 0: at the key's column
            lines += draw(_subset_block(nested, depth + 1))
        else:
            spaces = " " * draw(st.integers(1, 2))
            lines.append(lead + key + ":" + spaces + draw(st.sampled_from(_SUBSET_SCALARS)))
        if as_sequence and draw(st.booleans()):
            # more keys of the entry's mapping, at its first key's column
            lines.append(" " * inner + draw(st.sampled_from(_SUBSET_KEYS)) + ": x")
    return lines


@st.composite
def _subset_text(draw) -> str:
    docs = [draw(_subset_block(draw(st.sampled_from([0, 0, 2])), 0)) for _ in range(draw(st.integers(1, 3)))]
    text = "\n---\n".join("\n".join(doc) for doc in docs)
    return draw(st.sampled_from(["", "---\n", "# c\n"])) + text + draw(st.sampled_from(["", "\n", "\n---\n"]))


@settings(max_examples=400)
@given(_subset_text())
def test_plain_subset_is_exactly_pyyaml_on_subset_shaped_text(text: str) -> None:
    plain = _plain(text)
    if plain is not None:
        assert plain == _reference(text)
    else:  # declined: the general way still gives PyYAML's result
        assert _decoded(text) == _reference(text)


KUBECTL_STYLE = """\
# a comment before the first document
apiVersion: v1
kind: Pod
metadata:
  name: web-1
  namespace: demo
  uid: 9d000000000000000000000000000001
  creationTimestamp: "2024-05-01T10:00:00Z"
  labels:
    app: web
    pod-template-hash: "5e000001"
  annotations: {}
  ownerReferences:
  - apiVersion: apps/v1
    kind: ReplicaSet
    name: web-5e000001
    controller: true
spec:
  nodeName: node-1
  containers:
  - name: app
    ports:
    - name: http
      containerPort: 8080
      protocol: TCP
    -
      name: grpc
      containerPort: 9090
  tolerations: []
status:
  phase: Running
  podIP: 10.1.0.9
  podIPs:
  - ip: 10.1.0.9
  conditions:
  - type: Ready
    status: "True"
    lastProbeTime:
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: flow-style, namespace: demo}
"""


def test_plain_subset_reads_kubectl_style_and_hands_on_at_the_first_line_outside(monkeypatch) -> None:
    from ambient_mesh.kube import yaml_loader

    first = KUBECTL_STYLE.split("---\n")[0]
    assert _plain(first) == _reference(first)
    # The flow mapping with content in the second document is outside the subset: the whole
    # stream goes the general way, first document included, with the same result.
    assert _plain(KUBECTL_STYLE) is None
    assert _decoded(KUBECTL_STYLE) == _reference(KUBECTL_STYLE)
    # parse_documents takes the subset for the first document alone, and never calls libyaml.
    monkeypatch.setattr(yaml_loader.yaml, "load_all", None)
    result = parse_documents(first, "pods.yaml")
    assert result.errors == () and [o.metadata.name for o in result.objects] == ["web-1"]


@pytest.mark.parametrize(
    "text",
    [
        "a: 1\n---\nb: c: d\n",  # the first document is plain, the second is not YAML
        "a: 1\n---\nb:\n  - 1\n - 2\n",
        "a: 1\nb: 2020-13-45\n",  # a constructor error inside the subset's shapes
        "a:\n- .nan\n- .nan\n",  # NaN: PyYAML makes two objects, the subset reader would share one
    ],
)
def test_plain_subset_leaves_errors_to_pyyaml(text: str) -> None:
    assert _plain(text) is None
    assert _decoded(text) == _reference(text)
    general = parse_documents(text, "bad.yaml")
    assert general.objects == () and len(general.errors) == 1  # the NaN document has no kind


def test_plain_subset_bounds_nesting_and_memos(monkeypatch) -> None:
    from ambient_mesh.kube import yaml_loader

    deep = (
        "".join(f"{'  ' * i}k{i}:\n" for i in range(yaml_loader.MAX_PLAIN_NESTING + 2)) + "  " * 70 + "v: 1\n"
    )
    assert _plain(deep) is None  # deeper than the subset goes: the general way decides
    assert _decoded(deep) == _reference(deep)
    shallow = "".join(f"{'  ' * i}k{i}:\n" for i in range(yaml_loader.MAX_PLAIN_NESTING - 2))
    assert _plain(shallow) == _reference(shallow)

    monkeypatch.setattr(yaml_loader, "MAX_PLAIN_SCALARS", 8)
    monkeypatch.setattr(yaml_loader, "MAX_SHARED_STRINGS", 8)
    text = "".join(f"k{i}:\n- v{i}\n- TCP\n- '{i}'\n- {i}\n" for i in range(100))
    reader = yaml_loader.PlainReader()
    docs = list(reader.documents(text))
    assert repr(docs) == repr(list(yaml.safe_load_all(text)))
    assert len(reader._lines) <= 8 and len(reader._scalars) <= 8 and len(reader._strings) <= 8
    assert docs[0]["k1"][1] is docs[0]["k99"][1]  # one "TCP" for the whole stream
    long_line = "a: " + "x" * (yaml_loader.MAX_SHARED_STRING_CHARS + 1) + "\n"
    reader = yaml_loader.PlainReader()
    assert list(reader.documents(long_line)) == list(yaml.safe_load_all(long_line))
    assert long_line.rstrip("\n") not in reader._lines  # too long to remember
    assert long_line.strip()[3:] not in reader._scalars


def test_plain_subset_reads_across_chunks(monkeypatch) -> None:
    from ambient_mesh.kube import yaml_loader

    text = KUBECTL_STYLE.split("---\n")[0] + "---\n\n---\nlast:\n- 1\n"
    expected = _reference(text)
    for chunk in (1, 2, 7, 64):
        monkeypatch.setattr(yaml_loader, "PLAIN_CHUNK_CHARS", chunk)
        assert _plain(text) == expected, chunk
