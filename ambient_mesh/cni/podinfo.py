"""What the CNI plugin and the node agent need to know about a pod and its namespace.

Counterpart of the pod/namespace GETs in istio-cni's plugin (cni/pkg/plugin) and of the pod
fields its node agent reads. `PodLookup` is the seam: the plugin asks it for one pod and one
namespace. `DirectoryPodLookup` answers from the embedded control plane's YAML directory (the
lab's source of truth); the Kubernetes-API implementation lives with the node agent.

`get_pod`/`get_namespace` return None when the object does not exist and raise
`PodLookupError` when the source cannot be read at all: the caller fails closed on the latter
and decides what "absent" means on the former.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ..errors import AmbientError

if TYPE_CHECKING:
    from ..control.kube import KubeStore


class PodLookupError(AmbientError):
    """The pod source (API server, YAML directory) could not be read."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PodInfo:
    name: str
    namespace: str
    uid: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    host_network: bool = False
    # Names only: the enablement decision looks for an injected `istio-proxy` sidecar.
    containers: tuple[str, ...] = ()
    init_containers: tuple[str, ...] = ()
    node_name: str = ""
    ips: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class NamespaceInfo:
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)


class PodLookup(Protocol):
    def get_pod(self, namespace: str, name: str) -> PodInfo | None: ...

    def get_namespace(self, name: str) -> NamespaceInfo | None: ...


class DirectoryPodLookup:
    """Pods and namespaces from a directory of Kubernetes YAML (`ambient control --config-dir`).

    The directory is read once, on first use, so one plugin run sees one consistent snapshot;
    make a new lookup to see later changes.
    """

    __slots__ = ("path", "_store", "_errors")

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._store: KubeStore | None = None
        self._errors = 0

    def __repr__(self) -> str:
        if self._store is None:
            return f"DirectoryPodLookup({str(self.path)!r}: not read yet)"
        return (
            f"DirectoryPodLookup({str(self.path)!r}: {len(self._store.pods)} pods, "
            f"{len(self._store.namespaces)} namespaces, {self._errors} bad objects)"
        )

    def _load(self) -> KubeStore:
        if self._store is None:
            # Imported here: the plugin pays for YAML parsing only when it needs a pod.
            from ..control.kube import KubeStore, load_directory

            if not self.path.is_dir():
                raise PodLookupError(
                    f"pod source directory {self.path} does not exist",
                    hint="is `ambient_pod_source.directory` in the CNI config the control plane's --config-dir?",
                )
            result = load_directory(self.path)
            self._errors = len(result.errors)
            self._store = KubeStore(result.objects)
        return self._store

    def get_pod(self, namespace: str, name: str) -> PodInfo | None:
        from ..control.kube import Pod

        obj = self._load().get("Pod", namespace, name)
        if not isinstance(obj, Pod):
            return None
        meta = obj.metadata
        return PodInfo(
            name=meta.name,
            namespace=meta.namespace,
            uid=meta.uid,
            labels=dict(meta.labels),
            annotations=dict(meta.annotations),
            host_network=obj.host_network,
            containers=tuple(c.name for c in obj.containers),
            init_containers=tuple(c.name for c in obj.init_containers),
            node_name=obj.node_name,
            ips=obj.ips,
        )

    def get_namespace(self, name: str) -> NamespaceInfo | None:
        from ..control.kube import Namespace

        obj = self._load().get("Namespace", "", name)
        if not isinstance(obj, Namespace):
            return None
        return NamespaceInfo(
            name=obj.metadata.name,
            labels=dict(obj.metadata.labels),
            annotations=dict(obj.metadata.annotations),
        )
