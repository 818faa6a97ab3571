"""What a per-object translation step may read: settings, other objects, and the indexes.

Counterpart of the krt collections istiod's ambient index joins against
(pilot/pkg/serviceregistry/kube/controller/ambient/ambientindex.go): a pod's workload reads its
namespace, its node, the waypoints, the services selecting it and the policies attaching to it.
Each step sees only this context, so whoever calls it (the full `translate` or the incremental
`AmbientIndex`) decides which objects it must be run for again when one of those changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ..kube import KubeObject, Namespace, Node
from .common import MeshSettings

if TYPE_CHECKING:
    from .policies import PolicyIndex
    from .services import ServiceIndex
    from .waypoints import Waypoint


class ObjectLookup(Protocol):
    """The object reads a translation step makes (a `KubeStore` is one)."""

    def get(self, kind: str, namespace: str, name: str) -> KubeObject | None: ...

    def namespace(self, name: str) -> Namespace | None: ...

    def node(self, name: str) -> Node | None: ...


@dataclass(slots=True, kw_only=True)
class Context:
    objects: ObjectLookup
    settings: MeshSettings
    waypoints: Mapping[str, Waypoint]
    services: ServiceIndex
    policies: PolicyIndex
    # What was skipped or changed and why; the caller swaps the list to attribute notes to objects.
    notes: list[str] = field(default_factory=list)

    def namespace_labels(self, name: str) -> Mapping[str, str]:
        ns = self.objects.namespace(name)
        return ns.metadata.labels if ns is not None else {}

    def namespace_annotations(self, name: str) -> Mapping[str, str]:
        ns = self.objects.namespace(name)
        return ns.metadata.annotations if ns is not None else {}
