"""Kubernetes label selectors: `matchLabels` and `matchExpressions`.

Counterpart of apimachinery's metav1.LabelSelector and labels.Selector (LabelSelectorAsSelector):
every matchLabels pair must be present with that value, and every requirement must hold
(In/NotIn/Exists/DoesNotExist; an absent key satisfies NotIn). An empty selector matches every
label set. The one selector type for the node agent's enablement selectors and the control plane's
objects (AuthorizationPolicy/PeerAuthentication selectors, ServiceEntry workloadSelector, Gateway
allowedRoutes), whose own rules about empty selectors live with the code that applies them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

__all__ = ["OPERATORS", "LabelSelector", "Requirement", "parse_label_selector"]

OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


@dataclass(frozen=True, slots=True, kw_only=True)
class Requirement:
    key: str
    operator: str
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.operator == "In":
            return self.key in labels and labels[self.key] in self.values
        if self.operator == "NotIn":
            # Kubernetes: an absent key satisfies NotIn.
            return self.key not in labels or labels[self.key] not in self.values
        if self.operator == "Exists":
            return self.key in labels
        return self.key not in labels


@dataclass(frozen=True, slots=True, kw_only=True)
class LabelSelector:
    match_labels: Mapping[str, str] = field(default_factory=dict)
    match_expressions: tuple[Requirement, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.match_labels and not self.match_expressions

    def matches(self, labels: Mapping[str, str]) -> bool:
        if any(labels.get(k) != v for k, v in self.match_labels.items()):
            return False
        return all(r.matches(labels) for r in self.match_expressions)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.match_labels:
            out["matchLabels"] = dict(self.match_labels)
        if self.match_expressions:
            out["matchExpressions"] = [
                {"key": r.key, "operator": r.operator, **({"values": sorted(r.values)} if r.values else {})}
                for r in self.match_expressions
            ]
        return out


def _string_map(raw: Any, where: str) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(where, "expected an object of strings")
    for k, v in raw.items():
        if not isinstance(v, str):
            raise ConfigError(f"{where}.{k}", "expected a string")
    return dict(raw)


def parse_label_selector(raw: Any, where: str) -> LabelSelector:
    """A Kubernetes LabelSelector from JSON; null or {} is the empty (match-all) selector."""
    if raw is None:
        return LabelSelector()
    if not isinstance(raw, dict):
        raise ConfigError(where, "expected a label selector object")
    labels = _string_map(raw.get("matchLabels"), f"{where}.matchLabels")
    exprs_raw = raw.get("matchExpressions")
    if exprs_raw is None:
        exprs_raw = []
    if not isinstance(exprs_raw, list):
        raise ConfigError(f"{where}.matchExpressions", "expected a list")
    exprs: list[Requirement] = []
    for i, e in enumerate(exprs_raw):
        at = f"{where}.matchExpressions[{i}]"
        if not isinstance(e, dict):
            raise ConfigError(at, "expected an object")
        key, op, values = e.get("key"), e.get("operator"), e.get("values")
        if not isinstance(key, str) or not key:
            raise ConfigError(f"{at}.key", "expected a non-empty string")
        if op not in OPERATORS:
            raise ConfigError(f"{at}.operator", f"{op!r} is not one of {', '.join(OPERATORS)}")
        if values is None:
            values = []
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise ConfigError(f"{at}.values", "expected a list of strings")
        # The same rules metav1.LabelSelectorAsSelector enforces.
        if op in ("In", "NotIn") and not values:
            raise ConfigError(f"{at}.values", f"must be non-empty for operator {op}")
        if op in ("Exists", "DoesNotExist") and values:
            raise ConfigError(f"{at}.values", f"must be empty for operator {op}")
        exprs.append(Requirement(key=key, operator=op, values=frozenset(values)))
    return LabelSelector(match_labels=labels, match_expressions=tuple(exprs))
