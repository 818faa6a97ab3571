"""`KubeStore`: an immutable snapshot of the objects the translation reads, indexed by kind."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .model import (
    AuthorizationPolicy,
    Gateway,
    HTTPRoute,
    KubeObject,
    Namespace,
    Node,
    ObjectKey,
    PeerAuthentication,
    Pod,
    Service,
    ServiceAccount,
    ServiceEntry,
    VirtualService,
    WorkloadEntry,
    object_key,
)


class KubeStore:
    """An immutable snapshot of the objects the translation reads, indexed by kind."""

    __slots__ = ("_by_key", "_by_kind")

    def __init__(self, objects: Iterable[KubeObject] = ()) -> None:
        self._by_key: dict[ObjectKey, KubeObject] = {}
        for obj in objects:
            self._by_key.setdefault(object_key(obj), obj)
        # Sorted per kind on first use: a snapshot handed to the incremental translation is only
        # looked up by key, and sorting 10,000 pods per directory change would be most of its cost.
        self._by_kind: dict[str, tuple[KubeObject, ...]] | None = None

    def __len__(self) -> int:
        return len(self._by_key)

    def __repr__(self) -> str:
        counts = ", ".join(f"{len(v)} {k}" for k, v in sorted(self._kinds().items()))
        return f"KubeStore({counts or 'empty'})"

    def _kinds(self) -> dict[str, tuple[KubeObject, ...]]:
        if self._by_kind is None:
            # Lists first: growing a tuple per object would copy it each time (quadratic).
            by_kind: dict[str, list[KubeObject]] = {}
            for key in sorted(self._by_key):
                by_kind.setdefault(key[0], []).append(self._by_key[key])
            self._by_kind = {k: tuple(v) for k, v in by_kind.items()}
        return self._by_kind

    def get(self, kind: str, namespace: str, name: str) -> KubeObject | None:
        return self._by_key.get((kind, namespace, name))

    def all(self) -> tuple[KubeObject, ...]:
        return tuple(self._by_key[k] for k in sorted(self._by_key))

    def keys(self) -> frozenset[ObjectKey]:
        return frozenset(self._by_key)

    def _kind(self, kind: str) -> tuple[Any, ...]:
        return self._kinds().get(kind, ())

    @property
    def namespaces(self) -> tuple[Namespace, ...]:
        return self._kind("Namespace")

    @property
    def pods(self) -> tuple[Pod, ...]:
        return self._kind("Pod")

    @property
    def services(self) -> tuple[Service, ...]:
        return self._kind("Service")

    @property
    def service_accounts(self) -> tuple[ServiceAccount, ...]:
        return self._kind("ServiceAccount")

    @property
    def nodes(self) -> tuple[Node, ...]:
        return self._kind("Node")

    @property
    def authorization_policies(self) -> tuple[AuthorizationPolicy, ...]:
        return self._kind("AuthorizationPolicy")

    @property
    def peer_authentications(self) -> tuple[PeerAuthentication, ...]:
        return self._kind("PeerAuthentication")

    @property
    def service_entries(self) -> tuple[ServiceEntry, ...]:
        return self._kind("ServiceEntry")

    @property
    def workload_entries(self) -> tuple[WorkloadEntry, ...]:
        return self._kind("WorkloadEntry")

    @property
    def gateways(self) -> tuple[Gateway, ...]:
        return self._kind("Gateway")

    @property
    def http_routes(self) -> tuple[HTTPRoute, ...]:
        return self._kind("HTTPRoute")

    @property
    def virtual_services(self) -> tuple[VirtualService, ...]:
        return self._kind("VirtualService")

    def namespace(self, name: str) -> Namespace | None:
        obj = self._by_key.get(("Namespace", "", name))
        return obj if isinstance(obj, Namespace) else None

    def node(self, name: str) -> Node | None:
        obj = self._by_key.get(("Node", "", name))
        return obj if isinstance(obj, Node) else None
