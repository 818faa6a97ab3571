"""Is this pod ambient? The pure decision shared by the CNI plugin and the node agent.

Counterpart of istio-cni's cni/pkg/util/enablement_selector.go plus the namespace exclusion the
plugin and the agent apply on top. Enablement is an OR over selectors; each selector is a pod
LabelSelector AND a namespace LabelSelector with Kubernetes semantics (matchLabels and
matchExpressions In/NotIn/Exists/DoesNotExist; an empty selector matches everything). Before the
selectors, host-network pods and sidecar-injected pods are never ambient (ztunnel and a sidecar
on one pod is unsupported, and a host-network pod has no netns of its own to redirect).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..kube.labels import LabelSelector, Requirement, parse_label_selector
from ..metadata import (
    ANNOTATION_SIDECAR_STATUS,
    DATAPLANE_MODE_AMBIENT,
    DATAPLANE_MODE_NONE,
    LABEL_DATAPLANE_MODE,
)
from .podinfo import PodInfo

ISTIO_PROXY_CONTAINER = "istio-proxy"


@dataclass(frozen=True, slots=True, kw_only=True)
class EnablementSelector:
    pod_selector: LabelSelector = field(default_factory=LabelSelector)
    namespace_selector: LabelSelector = field(default_factory=LabelSelector)

    def matches(self, pod_labels: Mapping[str, str], namespace_labels: Mapping[str, str]) -> bool:
        return self.pod_selector.matches(pod_labels) and self.namespace_selector.matches(namespace_labels)

    def to_json(self) -> dict[str, Any]:
        return {
            "podSelector": self.pod_selector.to_json(),
            "namespaceSelector": self.namespace_selector.to_json(),
        }


# The Helm chart's default list, equal to the historical rule: a pod labeled ambient anywhere, or
# any pod in a namespace labeled ambient unless the pod opts out with dataplane-mode=none.
DEFAULT_ENABLEMENT_SELECTORS: tuple[EnablementSelector, ...] = (
    EnablementSelector(
        pod_selector=LabelSelector(match_labels={LABEL_DATAPLANE_MODE: DATAPLANE_MODE_AMBIENT})
    ),
    EnablementSelector(
        pod_selector=LabelSelector(
            match_expressions=(
                Requirement(
                    key=LABEL_DATAPLANE_MODE, operator="NotIn", values=frozenset({DATAPLANE_MODE_NONE})
                ),
            )
        ),
        namespace_selector=LabelSelector(match_labels={LABEL_DATAPLANE_MODE: DATAPLANE_MODE_AMBIENT}),
    ),
)


# -- parsing (the `enablement_selectors` key of the plugin config, JSON) ----------------------------


def parse_enablement_selectors(
    raw: Any, where: str = "enablement_selectors"
) -> tuple[EnablementSelector, ...]:
    """The plugin config's list of `{podSelector, namespaceSelector}`; null is an empty list."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError(where, "expected a list of {podSelector, namespaceSelector}")
    out: list[EnablementSelector] = []
    for i, item in enumerate(raw):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise ConfigError(at, "expected an object")
        out.append(
            EnablementSelector(
                pod_selector=parse_label_selector(item.get("podSelector"), f"{at}.podSelector"),
                namespace_selector=parse_label_selector(
                    item.get("namespaceSelector"), f"{at}.namespaceSelector"
                ),
            )
        )
    return tuple(out)


# -- the decision -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class AmbientDecision:
    ambient: bool
    reason: str

    def __bool__(self) -> bool:
        return self.ambient


def has_sidecar(pod: PodInfo) -> bool:
    # The injector's status annotation is what istio-cni checks; an `istio-proxy` container
    # without it (a hand-written sidecar) is still a sidecar, and ztunnel+sidecar is unsupported.
    return ANNOTATION_SIDECAR_STATUS in pod.annotations or ISTIO_PROXY_CONTAINER in pod.containers


def decide(
    pod: PodInfo,
    namespace_labels: Mapping[str, str],
    selectors: Iterable[EnablementSelector],
    exclude_namespaces: Iterable[str] = (),
) -> AmbientDecision:
    """Whether `pod` belongs in the ambient mesh, and why."""
    if pod.namespace in set(exclude_namespaces):
        return AmbientDecision(ambient=False, reason=f"namespace {pod.namespace} is excluded")
    if pod.host_network:
        return AmbientDecision(ambient=False, reason="pod uses the host network")
    if has_sidecar(pod):
        return AmbientDecision(ambient=False, reason="pod has an Istio sidecar")
    for i, sel in enumerate(selectors):
        if sel.matches(pod.labels, namespace_labels):
            return AmbientDecision(ambient=True, reason=f"enablement selector {i} matches")
    return AmbientDecision(ambient=False, reason="no enablement selector matches")


def could_be_ambient(
    namespace: str,
    namespace_labels: Mapping[str, str] | None,
    selectors: Iterable[EnablementSelector],
    exclude_namespaces: Iterable[str] = (),
) -> bool:
    """Whether some pod in `namespace` could be ambient, for when the pod itself is unknown.

    `namespace_labels` None means the namespace is unknown too. Used to fail closed: a pod we
    cannot see is only let through when no selector could ever pick it.
    """
    if namespace in set(exclude_namespaces):
        return False
    sels = tuple(selectors)
    if namespace_labels is None:
        return bool(sels)
    return any(s.namespace_selector.matches(namespace_labels) for s in sels)


def matches_namespace(selectors: Iterable[EnablementSelector], namespace_labels: Mapping[str, str]) -> bool:
    """Whether a namespace's labels matter to enablement (istio-cni's MatchesNamespace): only
    non-empty namespace selectors count, so a namespace relabel is ignored when no selector
    looks at namespaces."""
    return any(
        not s.namespace_selector.empty and s.namespace_selector.matches(namespace_labels) for s in selectors
    )
