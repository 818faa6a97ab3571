"""Where the node agent learns about pods and namespaces, and where it records enrollment.

Counterpart of istio-cni's informers (cni/pkg/nodeagent/informers.go: a Pod informer filtered by
`spec.nodeName`, a Namespace informer) and of its annotation patches (`ambient.istio.io/redirection`
on the `pods/status` subresource, docs/istio-behaviour.md, "Node agent pod lifecycle").

`PodSource` is the one small interface; two implementations:

- `KubeApiPodSource`: the Kubernetes REST API through kube/ (lightkube): a kube.Reflector per
  kind lists, then watches from the list's resourceVersion; a relist after 410 Gone is diffed
  against the cache and reported as events. Credentials from the in-cluster service account or a
  kubeconfig (kube.kubeconfig).
- `DirectoryPodSource`: the embedded control plane's YAML directory (kube/watch.py), polled
  by `DirectoryWatcher`. Those files are the operator's, so the enrollment mark lives in a
  state file in the agent's run dir and is overlaid on the pods as the annotation would be.

Both keep a cache of this node's pods and all namespaces, and report changes as `PodEvent` /
`NamespaceEvent` values with the old and new object (the informer needs the old one: Kubernetes
blanks a terminated pod's IP, kubernetes#125370).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import yaml

from ..errors import ConfigError, ProtocolError
from ..host.private import private_dir, write_private
from ..kube.client import DAEMONSETS, NAMESPACES, PODS, KubeApiError, KubeClient, WatchEvent
from ..kube.kubeconfig import KubeconfigError, KubeCredentials
from ..kube.reflector import Reflector
from ..metadata import ANNOTATION_REDIRECTION
from .kubeconfig import agent_credentials
from .podinfo import (
    NamespaceInfo,
    PodInfo,
    PodLookupError,
    namespace_info_from_json,
    object_field,
    pod_info_from_json,
    pod_info_from_store,
)

log = logging.getLogger("ambient_mesh.cni-agent")


REDIRECTION_ENABLED = "enabled"
REDIRECTION_PENDING = "pending"
TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
AGENT_DAEMONSET_NAME = "istio-cni-node"


class PodSourceError(PodLookupError):
    """The pod source (API server, YAML directory, state file) could not be read or written."""


# -- values ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class WatchedPod:
    """A pod as the agent tracks it: the plugin's `PodInfo` plus what only the agent needs."""

    info: PodInfo
    service_account: str = ""
    phase: str = ""
    resource_version: str = ""
    deleting: bool = False

    @property
    def uid(self) -> str:
        return self.info.uid

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def namespace(self) -> str:
        return self.info.namespace

    @property
    def key(self) -> tuple[str, str]:
        return (self.info.namespace, self.info.name)

    @property
    def ips(self) -> tuple[str, ...]:
        return self.info.ips

    @property
    def labels(self) -> Mapping[str, str]:
        return self.info.labels

    @property
    def annotations(self) -> Mapping[str, str]:
        return self.info.annotations

    @property
    def redirection(self) -> str:
        """`enabled`, `pending` or '' (the enrollment annotation)."""
        return self.info.annotations.get(ANNOTATION_REDIRECTION, "")

    @property
    def terminated(self) -> bool:
        return self.phase in TERMINAL_PHASES

    def with_redirection(self, value: str | None) -> WatchedPod:
        annotations = dict(self.info.annotations)
        if value is None:
            annotations.pop(ANNOTATION_REDIRECTION, None)
        else:
            annotations[ANNOTATION_REDIRECTION] = value
        return replace(self, info=replace(self.info, annotations=annotations))

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


class EventType(enum.Enum):
    ADDED = "add"
    UPDATED = "update"
    DELETED = "delete"


@dataclass(frozen=True, slots=True, kw_only=True)
class PodEvent:
    type: EventType
    old: WatchedPod | None = None
    new: WatchedPod | None = None

    @property
    def pod(self) -> WatchedPod:
        pod = self.new if self.new is not None else self.old
        assert pod is not None
        return pod


@dataclass(frozen=True, slots=True, kw_only=True)
class NamespaceEvent:
    type: EventType
    old: NamespaceInfo | None = None
    new: NamespaceInfo | None = None

    @property
    def namespace(self) -> NamespaceInfo:
        ns = self.new if self.new is not None else self.old
        assert ns is not None
        return ns


SourceEvent = PodEvent | NamespaceEvent
OnEvent = Callable[[SourceEvent], Awaitable[None]]


class PodSource(Protocol):
    """This node's pods and all namespaces, kept current, plus the enrollment mark."""

    async def start(self) -> None:
        """List everything; afterwards the cache is synced (istio-cni waits for cache sync)."""

    async def run(self, on_event: OnEvent) -> None:
        """Watch until cancelled, calling `on_event` for every change after `start`."""

    def pods(self) -> tuple[WatchedPod, ...]: ...

    def pod(self, namespace: str, name: str) -> WatchedPod | None: ...

    def namespace(self, name: str) -> NamespaceInfo | None: ...

    async def fetch_pod(self, namespace: str, name: str) -> WatchedPod | None:
        """A fresh read, for a CNI ADD that arrives before the watch has seen the pod."""

    async def mark_enrolled(self, pod: WatchedPod, value: str = REDIRECTION_ENABLED) -> None: ...

    async def unmark(self, pod: WatchedPod) -> None: ...

    async def agent_upgrading(self, pod_namespace: str) -> bool:
        """Whether the agent's DaemonSet still exists (shutdown for an upgrade or a reboot)."""

    async def close(self) -> None: ...


def diff_objects(old: Mapping[Any, Any], new: Mapping[Any, Any]) -> list[tuple[EventType, Any, Any]]:
    """Pure: (type, old, new) for every key added, changed or removed, in key order."""
    out: list[tuple[EventType, Any, Any]] = []
    for key in sorted(set(old) | set(new)):
        before, after = old.get(key), new.get(key)
        if before is None:
            out.append((EventType.ADDED, None, after))
        elif after is None:
            out.append((EventType.DELETED, before, None))
        elif before != after:
            out.append((EventType.UPDATED, before, after))
    return out


class _CachedSource:
    """The cache both sources keep, and the events a new snapshot produces."""

    def __init__(self, node_name: str) -> None:
        self.node_name = node_name
        self._pods: dict[tuple[str, str], WatchedPod] = {}
        self._namespaces: dict[str, NamespaceInfo] = {}
        self.events = 0

    def pods(self) -> tuple[WatchedPod, ...]:
        return tuple(self._pods[k] for k in sorted(self._pods))

    def pod(self, namespace: str, name: str) -> WatchedPod | None:
        return self._pods.get((namespace, name))

    def namespace(self, name: str) -> NamespaceInfo | None:
        return self._namespaces.get(name)

    def _on_node(self, pod: WatchedPod) -> bool:
        return not self.node_name or pod.info.node_name == self.node_name

    def _replace_all(
        self, pods: Mapping[tuple[str, str], WatchedPod], namespaces: Mapping[str, NamespaceInfo]
    ) -> list[SourceEvent]:
        pods = {k: p for k, p in pods.items() if self._on_node(p)}
        events: list[SourceEvent] = [
            NamespaceEvent(type=t, old=o, new=n) for t, o, n in diff_objects(self._namespaces, namespaces)
        ]
        events += [PodEvent(type=t, old=o, new=n) for t, o, n in diff_objects(self._pods, pods)]
        self._pods = dict(pods)
        self._namespaces = dict(namespaces)
        return events

    def _put_pod(self, pod: WatchedPod, deleted: bool = False) -> PodEvent | None:
        old = self._pods.get(pod.key)
        if deleted or not self._on_node(pod):
            if old is None:
                return None
            del self._pods[pod.key]
            return PodEvent(type=EventType.DELETED, old=old)
        self._pods[pod.key] = pod
        if old is None:
            return PodEvent(type=EventType.ADDED, new=pod)
        return None if old == pod else PodEvent(type=EventType.UPDATED, old=old, new=pod)

    def _put_namespace(self, ns: NamespaceInfo, deleted: bool = False) -> NamespaceEvent | None:
        old = self._namespaces.get(ns.name)
        if deleted:
            if old is None:
                return None
            del self._namespaces[ns.name]
            return NamespaceEvent(type=EventType.DELETED, old=old)
        self._namespaces[ns.name] = ns
        if old is None:
            return NamespaceEvent(type=EventType.ADDED, new=ns)
        return None if old == ns else NamespaceEvent(type=EventType.UPDATED, old=old, new=ns)


# -- the YAML directory -----------------------------------------------------------------------------


def synthesized_uid(namespace: str, name: str) -> str:
    """A stable uid for a hand-written pod without `metadata.uid` (ZDS needs one per pod)."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"ambient-mesh://pods/{namespace}/{name}"))


class EnrollmentState:
    """The directory source's enrollment marks: uid -> value, in one JSON file, written atomically."""

    __slots__ = ("path", "_marks")

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._marks: dict[str, dict[str, str]] = {}
        self._load()

    def __repr__(self) -> str:
        return f"EnrollmentState({str(self.path)!r}: {len(self._marks)} pods marked)"

    def _load(self) -> None:
        try:
            doc = json.loads(self.path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            raise PodSourceError(
                f"cannot read enrollment state {self.path}: {exc}",
                hint="delete the file; the agent rebuilds marks from the pods it enrolls",
            ) from None
        pods = doc.get("pods") if isinstance(doc, dict) else None
        if not isinstance(pods, dict):
            raise PodSourceError(f"enrollment state {self.path} has no `pods` object")
        self._marks = {
            uid: dict(v) for uid, v in pods.items() if isinstance(v, dict) and isinstance(v.get("value"), str)
        }

    def value(self, uid: str) -> str:
        mark = self._marks.get(uid)
        return mark["value"] if mark else ""

    def marks(self) -> dict[str, str]:
        return {uid: m["value"] for uid, m in self._marks.items()}

    def set(self, pod: WatchedPod, value: str | None) -> None:
        if value is None:
            if self._marks.pop(pod.uid, None) is None:
                return
        else:
            if self._marks.get(pod.uid, {}).get("value") == value:
                return
            self._marks[pod.uid] = {"value": value, "namespace": pod.namespace, "name": pod.name}
        self._save()

    def _save(self) -> None:
        # Which pods are enrolled, in the agent's run dir: root's alone (0700, checked), the file 0600.
        private_dir(self.path.parent)
        write_private(self.path, json.dumps({"pods": self._marks}, indent=2, sort_keys=True).encode())


def pod_from_store(obj: Any) -> WatchedPod:
    """kube/model.py's Pod -> WatchedPod."""
    meta = obj.metadata
    return WatchedPod(
        info=pod_info_from_store(obj, uid=meta.uid or synthesized_uid(meta.namespace, meta.name)),
        service_account=obj.service_account_name or "default",
        phase=obj.phase,
        deleting=bool(meta.deletion_timestamp),
    )


class DirectoryPodSource(_CachedSource):
    """Pods and namespaces from the embedded control plane's YAML directory."""

    def __init__(
        self,
        path: str | Path,
        *,
        node_name: str,
        state_file: str | Path,
        poll_interval_s: float = 1.0,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        from ..kube.watch import DirectoryWatcher

        super().__init__(node_name)
        self.path = Path(path)
        self.poll_interval_s = poll_interval_s
        self.state = EnrollmentState(state_file)
        self._watcher = DirectoryWatcher(self.path, lambda change: None, poll_interval_s)
        self._sleep = sleep
        self._lock = asyncio.Lock()
        # Events of a poll made for fetch_pod, delivered by the next run() round.
        self._held: list[SourceEvent] = []

    def __repr__(self) -> str:
        return (
            f"DirectoryPodSource({str(self.path)!r}, node {self.node_name!r}: {len(self._pods)} pods, "
            f"{len(self._namespaces)} namespaces, {len(self.state.marks())} marked, {self.events} events)"
        )

    def _overlay(self, pod: WatchedPod) -> WatchedPod:
        mark = self.state.value(pod.uid)
        return pod.with_redirection(mark) if mark else pod

    def _poll(self) -> list[SourceEvent] | None:
        from ..kube.model import Namespace, Pod

        if not self.path.is_dir():
            raise PodSourceError(
                f"pod source directory {self.path} does not exist",
                hint="POD_SOURCE_DIRECTORY must be the control plane's --config-dir",
            )
        change = self._watcher.poll()
        if change is None:
            return None
        pods: dict[tuple[str, str], WatchedPod] = {}
        namespaces: dict[str, NamespaceInfo] = {}
        for obj in change.result.objects:
            if isinstance(obj, Pod):
                pod = self._overlay(pod_from_store(obj))
                pods[pod.key] = pod
            elif isinstance(obj, Namespace):
                m = obj.metadata
                namespaces[m.name] = NamespaceInfo(
                    name=m.name, labels=dict(m.labels), annotations=dict(m.annotations)
                )
        return self._replace_all(pods, namespaces)

    async def start(self) -> None:
        async with self._lock:
            self._poll()

    async def poll_once(self) -> list[SourceEvent]:
        async with self._lock:
            events = self._held + (self._poll() or [])
            self._held = []
        self.events += len(events)
        return events

    async def run(self, on_event: OnEvent) -> None:
        while True:
            await self._sleep(self.poll_interval_s)
            try:
                events = await self.poll_once()
            except PodSourceError as exc:
                log.warning("pod source: %s", exc)
                continue
            for event in events:
                await on_event(event)

    async def fetch_pod(self, namespace: str, name: str) -> WatchedPod | None:
        # Re-read now: the plugin read the files itself and may be ahead of our last poll. The
        # events of this read are not lost: the next poll diffs against the same cache.
        async with self._lock:
            self._held += self._poll() or []
        return self.pod(namespace, name)

    async def mark_enrolled(self, pod: WatchedPod, value: str = REDIRECTION_ENABLED) -> None:
        try:
            self.state.set(pod, value)
        except OSError as exc:
            raise PodSourceError(f"cannot record enrollment of {pod}: {exc}") from None
        cached = self._pods.get(pod.key)
        if cached is not None and cached.uid == pod.uid:
            self._pods[pod.key] = cached.with_redirection(value)

    async def unmark(self, pod: WatchedPod) -> None:
        try:
            self.state.set(pod, None)
        except OSError as exc:
            raise PodSourceError(f"cannot clear enrollment of {pod}: {exc}") from None
        cached = self._pods.get(pod.key)
        if cached is not None and cached.uid == pod.uid:
            self._pods[pod.key] = cached.with_redirection(None)

    async def agent_upgrading(self, pod_namespace: str) -> bool:
        # kube/model.py does not model DaemonSets; a raw look for the one object is enough.
        for file in sorted(self.path.glob("*")):
            if file.suffix not in (".yaml", ".yml", ".json"):
                continue
            try:
                docs = list(yaml.safe_load_all(file.read_text()))
            except (OSError, yaml.YAMLError):
                continue
            for doc in docs:
                if (
                    isinstance(doc, dict)
                    and doc.get("kind") == "DaemonSet"
                    and isinstance(doc.get("metadata"), dict)
                    and doc["metadata"].get("name") == AGENT_DAEMONSET_NAME
                    and doc["metadata"].get("namespace", "default") == (pod_namespace or "default")
                    and not doc["metadata"].get("deletionTimestamp")
                ):
                    return True
        return False

    async def close(self) -> None:
        return None


# -- the Kubernetes API -----------------------------------------------------------------------------


def pod_from_json(obj: Any) -> WatchedPod:
    """A Pod object as the API server returns it -> WatchedPod. Missing fields take zero values;
    a non-object or a pod without name/namespace/uid is a ProtocolError."""
    # Checked here, before podinfo's parser: the agent needs a uid for ZDS (the plugin does not),
    # and a bad object in a list or watch is the API server breaking protocol, not a failed lookup.
    if not isinstance(obj, dict):
        raise ProtocolError("pod: expected an object")
    meta, spec, status = object_field(obj, "metadata"), object_field(obj, "spec"), object_field(obj, "status")
    if not all(isinstance(meta.get(k), str) and meta.get(k) for k in ("name", "namespace", "uid")):
        raise ProtocolError("pod: metadata.name, metadata.namespace and metadata.uid are required")
    sa = spec.get("serviceAccountName") or spec.get("serviceAccount") or "default"
    phase, version = status.get("phase"), meta.get("resourceVersion")
    return WatchedPod(
        info=pod_info_from_json(obj),
        service_account=sa if isinstance(sa, str) else "default",
        phase=phase if isinstance(phase, str) else "",
        resource_version=version if isinstance(version, str) else "",
        deleting=bool(meta.get("deletionTimestamp")),
    )


def namespace_from_json(obj: Any) -> NamespaceInfo:
    # Checked here for the same reason as in pod_from_json: ProtocolError, not PodLookupError.
    if not isinstance(obj, dict) or not isinstance(obj.get("metadata"), dict):
        raise ProtocolError("namespace: expected an object with metadata")
    if not isinstance(obj["metadata"].get("name"), str) or not obj["metadata"]["name"]:
        raise ProtocolError("namespace: metadata.name is required")
    return namespace_info_from_json(obj)


def credentials_for_agent(cfg: Any) -> KubeCredentials:
    """The agent's own API access (kubeconfig.agent_credentials), errors as ConfigError."""
    try:
        return agent_credentials(cfg)
    except KubeconfigError as exc:
        raise ConfigError(
            "KUBECONFIG" if cfg.kubeconfig else "KUBERNETES_SERVICE_HOST",
            exc.message,
            hint=exc.hint or "outside a cluster set POD_SOURCE_DIRECTORY or KUBECONFIG",
        ) from None


class KubeApiPodSource(_CachedSource):
    """This node's pods (field selector spec.nodeName) and all namespaces from the API server,
    each kept by a kube.Reflector (list, watch, bookmarks, relist on 410 Gone)."""

    def __init__(
        self, client: KubeClient, *, node_name: str, sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep
    ) -> None:
        super().__init__(node_name)
        self.client = client
        self._on_event: OnEvent | None = None
        self._pods_reflector = Reflector(
            client,
            PODS,
            fields={"spec.nodeName": node_name} if node_name else None,
            on_replace=self._replace_pods,
            on_event=self._pod_event,
            sleep=sleep,
        )
        self._namespaces_reflector = Reflector(
            client,
            NAMESPACES,
            on_replace=self._replace_namespaces,
            on_event=self._namespace_event,
            sleep=sleep,
        )

    def __repr__(self) -> str:
        return (
            f"KubeApiPodSource({self.client.credentials.server}, node {self.node_name!r}: {len(self._pods)} pods, "
            f"{len(self._namespaces)} namespaces, rv pods={self._pods_reflector.resource_version or '-'}, "
            f"{self.relists} relists, {self.events} events)"
        )

    @property
    def relists(self) -> int:
        return self._pods_reflector.relists + self._namespaces_reflector.relists

    async def _deliver(self, events: list[SourceEvent]) -> None:
        # Before run() (the first list in start()) there is nobody to tell: start() only syncs.
        if self._on_event is None:
            return
        self.events += len(events)
        for event in events:
            await self._on_event(event)

    async def _replace_pods(self, items: list[dict[str, Any]]) -> None:
        pods = {pod.key: pod for pod in map(pod_from_json, items)}
        await self._deliver(self._replace_all(pods, self._namespaces))

    async def _replace_namespaces(self, items: list[dict[str, Any]]) -> None:
        namespaces = {ns.name: ns for ns in map(namespace_from_json, items)}
        await self._deliver(self._replace_all(self._pods, namespaces))

    async def _pod_event(self, event: WatchEvent) -> None:
        change = self._put_pod(pod_from_json(event.object), event.type == "DELETED")
        await self._deliver([change] if change is not None else [])

    async def _namespace_event(self, event: WatchEvent) -> None:
        change = self._put_namespace(namespace_from_json(event.object), event.type == "DELETED")
        await self._deliver([change] if change is not None else [])

    async def start(self) -> None:
        try:
            await self._namespaces_reflector.list()
            await self._pods_reflector.list()
        except KubeApiError as exc:
            raise PodSourceError(str(exc)) from None

    async def run(self, on_event: OnEvent) -> None:
        # Both reflectors call one consumer, each awaiting it: events keep their arrival order.
        self._on_event = on_event
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._namespaces_reflector.run())
                group.create_task(self._pods_reflector.run())
        finally:
            self._on_event = None

    async def fetch_pod(self, namespace: str, name: str) -> WatchedPod | None:
        try:
            obj = await self.client.get(PODS, namespace, name)
        except KubeApiError as exc:
            raise PodSourceError(str(exc)) from None
        if obj is None:
            return None
        event = self._put_pod(pod_from_json(obj))
        if event is not None:
            self.events += 1
        return self.pod(namespace, name)

    async def _patch(self, pod: WatchedPod, value: str | None) -> None:
        # The pods/status subresource: istio-cni's RBAC grants patch there, not on pods.
        patch = {"metadata": {"annotations": {ANNOTATION_REDIRECTION: value}}}
        try:
            obj = await self.client.patch_merge(PODS, pod.namespace, pod.name, patch, subresource="status")
        except KubeApiError as exc:
            raise PodSourceError(str(exc)) from None
        if obj is None:
            if value is None:
                return  # gone already: nothing to unmark
            raise PodSourceError(f"cannot mark pod {pod}: it no longer exists")
        with contextlib.suppress(ProtocolError):
            self._put_pod(pod_from_json(obj))

    async def mark_enrolled(self, pod: WatchedPod, value: str = REDIRECTION_ENABLED) -> None:
        await self._patch(pod, value)

    async def unmark(self, pod: WatchedPod) -> None:
        await self._patch(pod, None)

    async def agent_upgrading(self, pod_namespace: str) -> bool:
        try:
            doc = await self.client.get(DAEMONSETS, pod_namespace, AGENT_DAEMONSET_NAME)
        except KubeApiError as exc:
            log.warning("safe-upgrade check failed (%s): treating shutdown as final", exc)
            return False
        meta = doc.get("metadata") if doc is not None else None
        return isinstance(meta, dict) and not meta.get("deletionTimestamp")

    async def close(self) -> None:
        await self.client.close()


def build_pod_source(cfg: Any) -> PodSource:
    """The source the config names: a YAML directory, a kubeconfig, or the in-cluster API."""
    if cfg.pod_source_directory:
        return DirectoryPodSource(
            cfg.pod_source_directory,
            node_name=cfg.node_name,
            state_file=cfg.enrollment_state_file,
            poll_interval_s=cfg.pod_source_poll_interval_s,
        )
    return KubeApiPodSource(KubeClient(credentials_for_agent(cfg)), node_name=cfg.node_name)


__all__ = [
    "ANNOTATION_REDIRECTION",
    "REDIRECTION_ENABLED",
    "REDIRECTION_PENDING",
    "DirectoryPodSource",
    "EnrollmentState",
    "EventType",
    "KubeApiPodSource",
    "NamespaceEvent",
    "PodEvent",
    "PodSource",
    "PodSourceError",
    "SourceEvent",
    "WatchedPod",
    "build_pod_source",
    "credentials_for_agent",
    "diff_objects",
    "namespace_from_json",
    "pod_from_json",
]
