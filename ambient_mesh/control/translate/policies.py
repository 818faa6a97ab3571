"""Which Authorization resources exist, and which of them each workload references.

Counterpart of istiod's policy collections for ambient
(pilot/pkg/serviceregistry/kube/controller/ambient/policies.go) and buildWorkloadPolicies
(workloads.go): every AuthorizationPolicy and PeerAuthentication is converted on its own; a
workload lists the selector policies of its namespace and the root namespace whose selector
matches its labels, then the PeerAuthentication-derived keys that apply to it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeVar

from ...kube.labels import LabelSelector
from ...kube.model import AuthorizationPolicy, PeerAuthentication
from ...kube.store import KubeStore
from ...wire.istio.security import authorization_pb2 as sec
from .authorization import convert_authorization_policy
from .common import MeshSettings
from .peer_authentication import (
    convert_peer_authentication,
    effective_peer_authentication_keys,
    namespace_peer_authentications,
    static_strict_policy,
)

_V = TypeVar("_V")


def policy_attachment(
    policy: AuthorizationPolicy, converted: sec.Authorization | None
) -> LabelSelector | None:
    """The selector by which a converted policy attaches to workloads (None: it does not;
    an empty selector attaches to nothing here, scope is enough)."""
    if converted is None or policy.selector is None or not policy.selector.match_labels:
        return None
    return policy.selector


class PolicyIndex:
    """Selector policies and PeerAuthentications by namespace: a workload only ever looks at its
    own namespace's and the root namespace's, so scanning the whole mesh per pod is avoided."""

    __slots__ = ("settings", "_selectors", "_peer_authentications")

    def __init__(self, settings: MeshSettings) -> None:
        self.settings = settings
        # namespace -> policy name -> selector
        self._selectors: dict[str, dict[str, LabelSelector]] = {}
        # namespace -> name -> PeerAuthentication
        self._peer_authentications: dict[str, dict[str, PeerAuthentication]] = {}

    def set_selector(self, namespace: str, name: str, selector: LabelSelector | None) -> None:
        _set_nested(self._selectors, namespace, name, selector)

    def attachment(self, namespace: str, name: str) -> LabelSelector | None:
        return self._selectors.get(namespace, {}).get(name)

    def set_peer_authentication(self, namespace: str, name: str, pa: PeerAuthentication | None) -> None:
        _set_nested(self._peer_authentications, namespace, name, pa)

    def workload_policies(self, labels: Mapping[str, str], namespace: str) -> list[str]:
        root = self.settings.root_namespace
        names = []
        for ns in {root, namespace}:
            for name, selector in self._selectors.get(ns, {}).items():
                if selector.matches(labels):
                    names.append(f"{ns}/{name}")
        names.sort()
        pas = []
        for pa in self._peer_authentications.get(root, {}).values():
            if pa.selector is None:
                pas.append(pa)
        if namespace != root:
            for pa in self._peer_authentications.get(namespace, {}).values():
                if pa.selector is None or pa.selector.matches(labels):
                    pas.append(pa)
        # `effective_peer_authentication_keys` picks the oldest of each kind on a total key, so
        # the order of `pas` does not matter.
        return names + effective_peer_authentication_keys(pas, self.settings)


def _set_nested(by_namespace: dict[str, dict[str, _V]], namespace: str, name: str, value: _V | None) -> None:
    """Set or (with None) remove one entry, dropping namespaces left empty."""
    if value is not None:
        by_namespace.setdefault(namespace, {})[name] = value
        return
    entries = by_namespace.get(namespace)
    if entries is not None:
        entries.pop(name, None)
        if not entries:
            del by_namespace[namespace]


def peer_authentication_resources(
    policies: Iterable[PeerAuthentication], settings: MeshSettings
) -> dict[str, sec.Authorization]:
    """Every Authorization derived from PeerAuthentications: the converted port-level ones and,
    when any PeerAuthentication exists, the static strict policy."""
    pas = list(policies)
    out: dict[str, sec.Authorization] = {}
    namespace_wide = namespace_peer_authentications(pas)
    root_pa = namespace_wide.get(settings.root_namespace)
    for pa in pas:
        pb = convert_peer_authentication(pa, namespace_wide.get(pa.metadata.namespace), root_pa, settings)
        if pb is not None:
            out[f"{pb.namespace}/{pb.name}"] = pb
    if pas:
        strict = static_strict_policy(settings)
        out[f"{strict.namespace}/{strict.name}"] = strict
    return out


def translate_authorizations(
    store: KubeStore, settings: MeshSettings
) -> tuple[dict[str, sec.Authorization], PolicyIndex, list[str]]:
    """Authorization resources, the index workloads attach by, and notes."""
    out: dict[str, sec.Authorization] = {}
    index = PolicyIndex(settings)
    notes: list[str] = []
    for policy in store.authorization_policies:
        pb, note = convert_authorization_policy(policy, settings)
        if note:
            notes.append(note)
        index.set_selector(policy.metadata.namespace, policy.metadata.name, policy_attachment(policy, pb))
        if pb is not None:
            out[f"{pb.namespace}/{pb.name}"] = pb
    for pa in store.peer_authentications:
        index.set_peer_authentication(pa.metadata.namespace, pa.metadata.name, pa)
    out.update(peer_authentication_resources(store.peer_authentications, settings))
    return out, index, notes
