"""kube/labels.py: label selector semantics (apimachinery's labels.Selector)."""

from __future__ import annotations

from ambient_mesh.kube.labels import LabelSelector, Requirement

# -- label selectors ------------------------------------------------------------------------------------


def test_label_selector_semantics():
    sel = LabelSelector(
        match_labels={"app": "web"},
        match_expressions=(
            Requirement(key="tier", operator="In", values=frozenset({"a", "b"})),
            Requirement(key="canary", operator="NotIn", values=frozenset({"true"})),
            Requirement(key="legacy", operator="DoesNotExist"),
        ),
    )
    assert sel.matches({"app": "web", "tier": "a"})
    assert not sel.matches({"app": "web", "tier": "c"})
    assert not sel.matches({"app": "web", "tier": "a", "canary": "true"})
    assert not sel.matches({"app": "web", "tier": "a", "legacy": ""})
    assert LabelSelector().matches({}) and LabelSelector().empty
