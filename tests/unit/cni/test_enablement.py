"""The pure "is this pod ambient" decision, selector parsing and semantics, and the YAML-directory
pod lookup."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ambient_mesh.cni.enablement import (
    DEFAULT_ENABLEMENT_SELECTORS,
    EnablementSelector,
    LabelSelector,
    Requirement,
    could_be_ambient,
    decide,
    matches_namespace,
    parse_enablement_selectors,
    parse_label_selector,
)
from ambient_mesh.cni.podinfo import DirectoryPodLookup, NamespaceInfo, PodInfo, PodLookupError
from ambient_mesh.errors import ConfigError

AMBIENT = {"istio.io/dataplane-mode": "ambient"}
NONE = {"istio.io/dataplane-mode": "none"}


def pod(labels=None, **kw) -> PodInfo:
    return PodInfo(name="web-0", namespace=kw.pop("namespace", "default"), labels=labels or {}, **kw)


def ambient(p: PodInfo, ns_labels, selectors=DEFAULT_ENABLEMENT_SELECTORS, exclude=()) -> bool:
    return decide(p, ns_labels, selectors, exclude).ambient


# -- the chart's default selectors ----------------------------------------------------------------


def test_namespace_label_enrolls_pods():
    assert ambient(pod(), AMBIENT)
    assert decide(pod(), AMBIENT, DEFAULT_ENABLEMENT_SELECTORS).reason == "enablement selector 1 matches"


def test_pod_label_enrolls_in_any_namespace():
    assert ambient(pod(AMBIENT), {})
    assert ambient(pod(AMBIENT), {"istio.io/dataplane-mode": "none"})


def test_pod_opt_out_in_ambient_namespace():
    assert not ambient(pod(NONE), AMBIENT)


def test_unlabeled_pod_in_unlabeled_namespace():
    d = decide(pod(), {}, DEFAULT_ENABLEMENT_SELECTORS)
    assert (d.ambient, d.reason) == (False, "no enablement selector matches")
    assert not d


def test_other_pod_label_value_does_not_opt_out():
    assert ambient(pod({"istio.io/dataplane-mode": "sidecar"}), AMBIENT)


def test_host_network_never_ambient():
    d = decide(pod(AMBIENT, host_network=True), AMBIENT, DEFAULT_ENABLEMENT_SELECTORS)
    assert (d.ambient, d.reason) == (False, "pod uses the host network")


@pytest.mark.parametrize(
    "kw",
    [
        {"annotations": {"sidecar.istio.io/status": '{"containers":["istio-proxy"]}'}},
        {"containers": ("app", "istio-proxy")},
    ],
)
def test_sidecar_pod_never_ambient(kw):
    d = decide(pod(AMBIENT, **kw), AMBIENT, DEFAULT_ENABLEMENT_SELECTORS)
    assert (d.ambient, d.reason) == (False, "pod has an Istio sidecar")


def test_excluded_namespace_never_ambient():
    d = decide(pod(AMBIENT, namespace="kube-system"), AMBIENT, DEFAULT_ENABLEMENT_SELECTORS, ["kube-system"])
    assert (d.ambient, d.reason) == (False, "namespace kube-system is excluded")


def test_no_selectors_nothing_matches():
    assert not ambient(pod(AMBIENT), AMBIENT, selectors=())


def test_empty_selector_matches_everything():
    assert ambient(pod(), {}, selectors=(EnablementSelector(),))


# -- selector semantics -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "values", "labels", "expected"),
    [
        ("In", {"a", "b"}, {"k": "a"}, True),
        ("In", {"a"}, {"k": "c"}, False),
        ("In", {"a"}, {}, False),
        ("NotIn", {"a"}, {"k": "c"}, True),
        ("NotIn", {"a"}, {}, True),
        ("NotIn", {"a"}, {"k": "a"}, False),
        ("Exists", set(), {"k": ""}, True),
        ("Exists", set(), {}, False),
        ("DoesNotExist", set(), {}, True),
        ("DoesNotExist", set(), {"k": "x"}, False),
    ],
)
def test_requirement(op, values, labels, expected):
    assert Requirement(key="k", operator=op, values=frozenset(values)).matches(labels) is expected


def test_selector_needs_all_terms():
    sel = LabelSelector(
        match_labels={"app": "web"}, match_expressions=(Requirement(key="tier", operator="Exists"),)
    )
    assert sel.matches({"app": "web", "tier": "x"})
    assert not sel.matches({"app": "web"})
    assert not sel.matches({"tier": "x"})


def test_parse_default_selectors_round_trip():
    raw = [s.to_json() for s in DEFAULT_ENABLEMENT_SELECTORS]
    assert raw == [
        {"podSelector": {"matchLabels": AMBIENT}, "namespaceSelector": {}},
        {
            "podSelector": {
                "matchExpressions": [
                    {"key": "istio.io/dataplane-mode", "operator": "NotIn", "values": ["none"]}
                ]
            },
            "namespaceSelector": {"matchLabels": AMBIENT},
        },
    ]
    assert parse_enablement_selectors(raw) == DEFAULT_ENABLEMENT_SELECTORS


def test_parse_nulls_are_empty():
    assert parse_enablement_selectors(None) == ()
    assert parse_enablement_selectors([{"podSelector": None}]) == (EnablementSelector(),)
    assert parse_label_selector({"matchLabels": None, "matchExpressions": None}, "s") == LabelSelector()


@pytest.mark.parametrize(
    "raw",
    [
        {},
        [1],
        [{"podSelector": []}],
        [{"podSelector": {"matchLabels": {"a": 1}}}],
        [{"podSelector": {"matchExpressions": {}}}],
        [{"podSelector": {"matchExpressions": [{"key": "", "operator": "In", "values": ["a"]}]}}],
        [{"podSelector": {"matchExpressions": [{"key": "k", "operator": "Equals", "values": ["a"]}]}}],
        [{"podSelector": {"matchExpressions": [{"key": "k", "operator": "In", "values": []}]}}],
        [{"podSelector": {"matchExpressions": [{"key": "k", "operator": "Exists", "values": ["a"]}]}}],
        [{"namespaceSelector": {"matchExpressions": [{"key": "k", "operator": "NotIn", "values": [1]}]}}],
    ],
)
def test_parse_invalid_selectors(raw):
    with pytest.raises(ConfigError):
        parse_enablement_selectors(raw)


labels_st = st.dictionaries(
    st.sampled_from(["k", "j", "istio.io/dataplane-mode"]),
    st.sampled_from(["a", "b", "ambient", "none"]),
    max_size=3,
)


@given(labels_st, st.frozensets(st.sampled_from(["a", "b", "ambient", "none"]), min_size=1))
def test_not_in_is_the_complement_of_in(labels, values):
    for key in ("k", "istio.io/dataplane-mode"):
        is_in = Requirement(key=key, operator="In", values=values).matches(labels)
        not_in = Requirement(key=key, operator="NotIn", values=values).matches(labels)
        assert is_in != not_in
        exists = Requirement(key=key, operator="Exists").matches(labels)
        assert exists != Requirement(key=key, operator="DoesNotExist").matches(labels)


@given(labels_st, labels_st)
def test_could_be_ambient_is_sound(pod_labels, ns_labels):
    # If some pod in the namespace is ambient, could_be_ambient must have said so.
    p = pod(pod_labels)
    if ambient(p, ns_labels):
        assert could_be_ambient("default", ns_labels, DEFAULT_ENABLEMENT_SELECTORS)
        assert could_be_ambient("default", None, DEFAULT_ENABLEMENT_SELECTORS)


def test_could_be_ambient_cases():
    assert could_be_ambient("default", {}, DEFAULT_ENABLEMENT_SELECTORS)  # a pod label could still enroll it
    only_ns = DEFAULT_ENABLEMENT_SELECTORS[1:]
    assert not could_be_ambient("default", {}, only_ns)
    assert could_be_ambient("default", AMBIENT, only_ns)
    assert could_be_ambient("default", None, only_ns)
    assert not could_be_ambient("default", None, ())
    assert not could_be_ambient("kube-system", None, only_ns, ["kube-system"])


def test_matches_namespace_ignores_empty_namespace_selectors():
    assert matches_namespace(DEFAULT_ENABLEMENT_SELECTORS, AMBIENT)
    assert not matches_namespace(DEFAULT_ENABLEMENT_SELECTORS, {})
    assert not matches_namespace((EnablementSelector(),), {})


# -- the YAML directory lookup --------------------------------------------------------------------

YAML = """\
apiVersion: v1
kind: Namespace
metadata:
  name: default
  labels: {istio.io/dataplane-mode: ambient}
---
apiVersion: v1
kind: Pod
metadata:
  name: web-0
  namespace: default
  uid: 1b2c
  labels: {app: web}
  annotations: {note: x}
spec:
  nodeName: node-1
  hostNetwork: false
  containers: [{name: app}, {name: istio-proxy}]
  initContainers: [{name: init}]
status:
  podIPs: [{ip: 10.244.1.5}]
"""


def test_directory_lookup(tmp_path):
    (tmp_path / "objects.yaml").write_text(YAML)
    lookup = DirectoryPodLookup(tmp_path)
    assert "not read yet" in repr(lookup)
    assert lookup.get_pod("default", "web-0") == PodInfo(
        name="web-0",
        namespace="default",
        uid="1b2c",
        labels={"app": "web"},
        annotations={"note": "x"},
        containers=("app", "istio-proxy"),
        init_containers=("init",),
        node_name="node-1",
        ips=("10.244.1.5",),
    )
    assert lookup.get_namespace("default") == NamespaceInfo(name="default", labels=AMBIENT)
    assert lookup.get_pod("default", "nope") is None
    assert lookup.get_namespace("nope") is None
    assert repr(lookup).endswith(": 1 pods, 1 namespaces, 0 bad objects)")


def test_directory_lookup_missing_directory(tmp_path):
    lookup = DirectoryPodLookup(tmp_path / "absent")
    with pytest.raises(PodLookupError, match="does not exist"):
        lookup.get_pod("default", "web-0")
