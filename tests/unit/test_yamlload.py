"""YAML aliases bounded (yamlload): the alias bombs that passed the schema, as tests, in both
readers that take YAML from outside (the local config and the control plane's directory)."""

from __future__ import annotations

import time

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from ambient_mesh import yamlload
from ambient_mesh.errors import ConfigError
from ambient_mesh.kube.decode import decode_yaml
from ambient_mesh.kube.load import parse_documents
from ambient_mesh.state.localconfig import parse_local_config
from ambient_mesh.yamlload import MAX_YAML_ALIAS_NODES, AliasLimitError

BOMB_SECONDS = 2.0  # refused long before this; the old reader spent minutes of CPU


def _more(anchor: str, k: int) -> str:
    return ", ".join([f"*{anchor}"] * (k - 1))


def local_config_bomb(k: int = 70) -> str:
    """A valid-looking AuthorizationPolicy list whose every nesting level repeats the one below
    k times: k^4 matches (24 million at k=70) in 1.9 KB."""
    principals = ", ".join(['{Exact: "cluster.local/ns/default/sa/a"}'] * 2)
    rules = (
        f"[&rule [&clause [&match {{principals: [{principals}]}}, {_more('match', k)}], "
        f"{_more('clause', k)}], {_more('rule', k)}]"
    )
    return (
        "policies:\n- &pol\n  name: bomb\n  namespace: default\n  scope: Global\n"
        f"  action: Allow\n  dryRun: false\n  rules: {rules}\n- *pol\n- *pol\n"
    )


def policy_bomb(k: int = 950) -> str:
    """An AuthorizationPolicy for `ambient control --dir`: k rules x k/2 sources x k/4
    principals, about 100 million strings in 7 KB."""
    return (
        "apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\n"
        "metadata: {name: bomb, namespace: default}\n"
        "spec:\n  action: ALLOW\n"
        f"  rules: [&r {{from: [&f {{source: {{principals: [&p cluster.local/ns/default/sa/a, "
        f"{_more('p', k // 4)}]}}}}, {_more('f', k // 2)}]}}, {_more('r', k)}]\n"
    )


def test_the_local_config_bomb_is_refused_with_where_and_what_to_change():
    text = local_config_bomb()
    assert 1800 <= len(text.encode()) <= 2000  # the 1.9 KB of the report
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        parse_local_config(text, "local.yaml")
    assert time.monotonic() - started < BOMB_SECONDS
    err = info.value
    line, column = err.source.split(":")[1:]
    assert err.source.startswith("local.yaml:8:") and int(column) > 1
    assert text.splitlines()[int(line) - 1][int(column) - 1] == "*"  # points at the alias
    assert f"limit of {MAX_YAML_ALIAS_NODES} nodes" in err.message
    assert "fewer and smaller aliases" in err.message


def test_the_policy_bomb_is_a_load_error_for_that_file_only():
    text = policy_bomb()
    assert 6 * 1024 <= len(text.encode()) <= 8 * 1024  # the 7 KB of the report
    started = time.monotonic()
    result = parse_documents(text, "policy.yaml")
    assert time.monotonic() - started < BOMB_SECONDS
    assert result.objects == ()
    (error,) = result.errors
    assert error.file == "policy.yaml"
    assert error.message.startswith("line 6 column ")
    assert "alias bomb" in error.message and "fewer and smaller aliases" in error.message
    with pytest.raises(AliasLimitError):
        decode_yaml(text)


def test_the_budget_is_for_the_whole_stream_not_each_document():
    # Each document alone stays under the limit; together they do not.
    per_doc = MAX_YAML_ALIAS_NODES // 3
    doc = "a: &x [" + ", ".join(["1"] * 1000) + "]\nb: [" + _more("x", per_doc // 1001 + 1) + "]\n"
    yamlload.load_all(doc)
    with pytest.raises(AliasLimitError):
        yamlload.load_all("---\n".join([doc] * 4))


def test_recursive_alias_is_refused():
    with pytest.raises(AliasLimitError, match="recursive alias"):
        yamlload.load_all("a: &a [1, *a]\n")
    with pytest.raises(AliasLimitError, match="recursive alias"):
        yamlload.compose("&m {k: *m}\n")


ORDINARY = """\
defaults: &defaults {app: web, tier: frontend}
pods:
- metadata: {name: a, labels: *defaults}
- metadata: {name: b, labels: {<<: *defaults, tier: backend}}
---
x: &s "shared"
y: [*s, *s]
"""


def test_ordinary_anchors_load_as_pyyaml_loads_them():
    assert yamlload.load_all(ORDINARY) == list(yaml.safe_load_all(ORDINARY))
    assert decode_yaml(ORDINARY) == list(yaml.safe_load_all(ORDINARY))
    assert yaml.serialize(yamlload.compose("a: &x [1]\nb: *x\n")) == yaml.serialize(
        yaml.compose("a: &x [1]\nb: *x\n")
    )


def test_ordinary_anchors_in_a_local_config_still_work():
    config = parse_local_config(
        "workloads:\n"
        "- {uid: a, name: a, namespace: ns, workloadIps: ['10.0.0.1'], locality: &l {region: eu}}\n"
        "- {uid: b, name: b, namespace: ns, workloadIps: ['10.0.0.2'], locality: *l}\n",
        "local.yaml",
    )
    assert [w.name for w in config.workloads] == ["a", "b"]
    assert config.workloads[1].locality.region == "eu"


def test_undefined_alias_keeps_pyyamls_error():
    with pytest.raises(yaml.composer.ComposerError, match="undefined alias"):
        yamlload.load_all("a: *nope\n")


_SHARED = st.lists(st.integers(), min_size=1, max_size=3)


@settings(max_examples=200)
@given(
    st.lists(st.one_of(st.text(max_size=10), _SHARED), max_size=6),
    st.booleans(),
    st.text(alphabet="*&ab :-[]{},'\"\n", max_size=30),
)
def test_may_have_aliases_never_misses_an_alias(items, flow: bool, junk: str):
    """Whatever PyYAML reads as an alias, the pre-check flags: libyaml never gets it."""
    shared = [1, 2]
    doc = {"items": items, "one": shared, "two": shared}  # dump writes &id001 / *id001
    for text in (yaml.safe_dump(doc, default_flow_style=flow), junk, f"k: {junk}\n"):
        try:
            events = list(yaml.parse(text, Loader=yaml.SafeLoader))
        except yaml.YAMLError:
            continue
        if any(isinstance(e, yaml.AliasEvent) for e in events):
            assert yamlload.may_have_aliases(text), text


def test_may_have_aliases_lets_ordinary_text_through():
    assert not yamlload.may_have_aliases("hosts: ['*.example.com']\npath: a*b\n")
    assert yamlload.may_have_aliases("x: *a\n")
    assert yamlload.may_have_aliases("- [*a]\n")


# --- the fast path (libyaml parses) is held to the pure-Python loader (issue 25) -------------------


def _tree(node: yaml.Node | None) -> object:
    """A node tree as plain values: tags, scalar values and where each node starts."""
    if node is None:
        return None
    where = (node.start_mark.line, node.start_mark.column)
    if isinstance(node, yaml.ScalarNode):
        return (node.tag, node.value, where)
    if isinstance(node, yaml.SequenceNode):
        return (node.tag, [_tree(n) for n in node.value], where)
    return (node.tag, [(_tree(k), _tree(v)) for k, v in node.value], where)


_plain = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
_docs = st.recursive(
    _plain,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=200)
@given(_docs, st.booleans(), st.booleans())
def test_the_fast_loader_composes_what_the_python_loader_composes(doc, flow, shared):
    # `shared` repeats one object, so yaml.dump writes an anchor and aliases to it.
    value = {"a": doc, "b": doc, "c": [doc]} if shared else doc
    text = yaml.dump(value, default_flow_style=flow, allow_unicode=True)
    try:
        slow = _tree(yamlload.compose(text, fast=False))
    except yaml.YAMLError:
        with pytest.raises(yaml.YAMLError):
            yamlload.compose(text)
        return
    assert _tree(yamlload.compose(text)) == slow


def test_the_fast_loader_keeps_the_alias_bound():
    assert yamlload.compose_loader_name() == "BoundedCSafeLoader"
    text = local_config_bomb()
    for fast in (True, False):
        start = time.monotonic()
        with pytest.raises(AliasLimitError) as info:
            yamlload.compose(text, fast=fast)
        assert time.monotonic() - start < BOMB_SECONDS
        assert info.value.problem_mark is not None and info.value.problem_mark.line > 0
