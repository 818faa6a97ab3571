"""What a per-object translation step may read: settings, other objects, and the indexes.

Counterpart of the krt collections istiod's ambient index joins against
(pilot/pkg/serviceregistry/kube/controller/ambient/ambientindex.go): a pod's workload reads its
namespace, its node, the waypoints, the services selecting it and the policies attaching to it.
Each step sees only this context, so whoever calls it (the full `translate` or the incremental
`AmbientIndex`) decides which objects it must be run for again when one of those changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from ...kube.labels import LabelSelector
from ...kube.model import KubeObject, Namespace, Node
from ...wire.istio.workload import workload_pb2 as wl
from .common import MeshSettings, selects
from .policies import PolicyIndex


@dataclass(frozen=True, slots=True, kw_only=True)
class Waypoint:
    name: str
    namespace: str
    address: wl.GatewayAddress
    traffic_type: str
    allowed_from: str = "Same"
    allowed_selector: LabelSelector | None = None
    binding: tuple[wl.ApplicationTunnel.Protocol, int] | None = None  # (protocol, port)

    @property
    def resource_name(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(slots=True, kw_only=True)
class ServiceInfo:
    service: wl.Service
    # service port -> (port name, target port name or "")
    port_names: dict[int, tuple[str, str]]
    selector: Mapping[str, str]
    source_kind: str  # "Service" or "ServiceEntry"
    creation_timestamp: str

    @property
    def key(self) -> str:
        return f"{self.service.namespace}/{self.service.hostname}"


class ServiceIndex:
    """The winning services by namespace: workloads only select services of their own namespace."""

    __slots__ = ("_by_namespace",)

    def __init__(self, infos: Iterable[ServiceInfo] = ()) -> None:
        self._by_namespace: dict[str, dict[str, ServiceInfo]] = {}
        for info in infos:
            self.set(info)

    def set(self, info: ServiceInfo) -> None:
        self._by_namespace.setdefault(info.service.namespace, {})[info.key] = info

    def discard(self, namespace: str, key: str) -> None:
        infos = self._by_namespace.get(namespace)
        if infos is not None:
            infos.pop(key, None)
            if not infos:
                del self._by_namespace[namespace]

    def selecting(self, namespace: str, labels: Mapping[str, str]) -> list[ServiceInfo]:
        """The services of `namespace` whose selector matches `labels`."""
        return [s for s in self._by_namespace.get(namespace, {}).values() if selects(s.selector, labels)]

    def of_source(self, kind: str, namespace: str, name: str) -> list[ServiceInfo]:
        """The winning services one Service or ServiceEntry produced."""
        return [
            s
            for s in self._by_namespace.get(namespace, {}).values()
            if s.source_kind == kind and s.service.name == name
        ]


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
