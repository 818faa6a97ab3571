"""Enroll and unenroll already-running pods as pods and namespaces change; rebuild state at start.

Counterpart of istio-cni's InformerHandlers (cni/pkg/nodeagent/informers.go) and the start-up half of its
Server (server.go), docs/istio-behaviour.md, "Node agent pod lifecycle" and "Node agent start and shutdown".

New pods reach the mesh through their CNI ADD; this module handles everything else: a namespace
or pod label change that enrolls or releases a running pod, a pod that terminates or is deleted,
an enrolled pod whose IP changed. The decision for one pod is the pure `decide_update`; the
`Informer` shell feeds events through one work queue with per-pod exponential backoff for
retryable failures (a node proxy that is not connected yet is the common one).

At start, state is rebuilt before the ZDS server accepts a node proxy: every pod marked
enrolled is cached, its netns found under /proc, its rules re-applied, the probe set synced, so
the snapshot the node proxy receives holds every enrolled pod (`add`, or `keep` when the netns
is lost). Then every pod on the node is evaluated once, so a pod whose labels changed while
the agent was down is enrolled or released (istio-cni waits for the next change to that pod).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from .dataplane import DataplaneError, MeshDataplane
from .enablement import EnablementSelector, decide, matches_namespace
from .pods import (
    REDIRECTION_ENABLED,
    REDIRECTION_PENDING,
    EventType,
    NamespaceEvent,
    PodEvent,
    PodSource,
    SourceEvent,
    WatchedPod,
)

log = logging.getLogger("ambient_mesh.cni-agent")

RETRY_INITIAL_S = 0.005
RETRY_MAX_S = 5.0
ZTUNNEL_APP_LABEL = ("app", "ztunnel")


class PodAction(enum.Enum):
    NONE = "none"
    ADD = "add"  # enroll: rules, node proxy, probe set, mark
    REMOVE = "remove"  # release a running pod (labels changed)
    DELETE = "delete"  # the pod is gone or terminated
    UPDATE_IPS = "update-ips"  # enrolled pod got new IPs: refresh the probe set
    WAIT_FOR_IP = "wait-for-ip"  # should be enrolled but has no IP yet


@dataclass(frozen=True, slots=True, kw_only=True)
class Enablement:
    """The inputs of "should this pod be in the mesh" that are not the pod itself."""

    selectors: tuple[EnablementSelector, ...]
    exclude_namespaces: tuple[str, ...] = ()
    system_namespace: str = "istio-system"

    def is_ztunnel(self, pod: WatchedPod) -> bool:
        key, value = ZTUNNEL_APP_LABEL
        return pod.namespace == self.system_namespace and pod.labels.get(key) == value

    def should_be_enrolled(self, pod: WatchedPod, namespace_labels: Mapping[str, str]) -> bool:
        if self.is_ztunnel(pod) or pod.deleting:
            return False
        return decide(pod.info, namespace_labels, self.selectors, self.exclude_namespaces).ambient


def decide_update(
    old: WatchedPod | None,
    new: WatchedPod,
    namespace_labels: Mapping[str, str],
    enablement: Enablement,
    *,
    known: bool = False,
) -> PodAction:
    """What to do for a pod that changed (istio-cni's pod UPDATE handler). `known`: the agent's
    cache holds the pod (it may have been enrolled without the mark being written)."""
    enrolled = new.redirection == REDIRECTION_ENABLED
    pending = new.redirection == REDIRECTION_PENDING
    if new.terminated:
        # Kubernetes may blank a terminated pod's IP (kubernetes#125370): act on the old object.
        return PodAction.DELETE if (enrolled or pending or known) else PodAction.NONE
    should = enablement.should_be_enrolled(new, namespace_labels)
    if not should:
        return PodAction.REMOVE if (enrolled or pending or known) else PodAction.NONE
    if enrolled:
        if old is not None and new.ips and old.ips != new.ips:
            return PodAction.UPDATE_IPS
        return PodAction.NONE
    return PodAction.ADD if new.ips else PodAction.WAIT_FOR_IP


def decide_delete(
    pod: WatchedPod, namespace_labels: Mapping[str, str], enablement: Enablement, *, known: bool = False
) -> PodAction:
    """A deleted pod is removed if it was (or may have been) in the mesh."""
    if (
        pod.redirection in (REDIRECTION_ENABLED, REDIRECTION_PENDING)
        or known
        or enablement.should_be_enrolled(pod, namespace_labels)
    ):
        return PodAction.DELETE
    return PodAction.NONE


def enrolled_snapshot(pods: Iterable[WatchedPod], enablement: Enablement) -> list[WatchedPod]:
    """The pods to restore at start: marked enabled, not terminated, not a node proxy pod."""
    return [
        p
        for p in pods
        if p.redirection == REDIRECTION_ENABLED and not p.terminated and not enablement.is_ztunnel(p)
    ]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Item:
    key: tuple[str, str]
    delete: WatchedPod | None = None  # set for a deletion: the last object seen
    old: WatchedPod | None = None


class Informer:
    """One work queue over pod and namespace events, with per-pod retries."""

    def __init__(
        self,
        source: PodSource,
        dataplane: MeshDataplane,
        enablement: Enablement,
        *,
        on_event: Callable[[str], None] | None = None,
        retry_initial_s: float = RETRY_INITIAL_S,
        retry_max_s: float = RETRY_MAX_S,
    ) -> None:
        self.source = source
        self.dataplane = dataplane
        self.enablement = enablement
        self._on_event = on_event
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._backoff: dict[tuple[str, str], float] = {}
        self._retry_handles: dict[tuple[str, str], asyncio.TimerHandle] = {}
        self.processed = 0
        self.retries = 0
        self.dropped = 0
        self.last_actions: dict[tuple[str, str], PodAction] = {}

    def __repr__(self) -> str:
        return (
            f"Informer({self._queue.qsize()} queued, {len(self._retry_handles)} waiting to retry, "
            f"{self.processed} processed, {self.retries} retries, {self.dropped} dropped)"
        )

    def _ns_labels(self, namespace: str) -> Mapping[str, str]:
        ns = self.source.namespace(namespace)
        return ns.labels if ns is not None else {}

    # -- start ----------------------------------------------------------------------------------

    async def rebuild(self) -> dict[str, str]:
        """Restore every enrolled pod into the data plane (before the ZDS server starts)."""
        snapshot = enrolled_snapshot(self.source.pods(), self.enablement)
        log.info("restoring %d enrolled pods", len(snapshot))
        return await self.dataplane.rebuild(snapshot)

    def enqueue_all(self) -> None:
        for pod in self.source.pods():
            self._enqueue(_Item(key=pod.key))

    # -- events ---------------------------------------------------------------------------------

    async def on_event(self, event: SourceEvent) -> None:
        """The pod source's callback: turn an event into queued work."""
        if self._on_event is not None:
            self._on_event(event.type.value)
        if isinstance(event, NamespaceEvent):
            old_labels = event.old.labels if event.old is not None else {}
            new_labels = event.new.labels if event.new is not None else {}
            if event.type is EventType.DELETED:
                return  # its pods' own deletions follow
            if event.type is EventType.ADDED or matches_namespace(
                self.enablement.selectors, old_labels
            ) != matches_namespace(self.enablement.selectors, new_labels):
                name = event.namespace.name
                if name in self.enablement.exclude_namespaces and matches_namespace(
                    self.enablement.selectors, new_labels
                ):
                    log.warning("namespace %s is labeled for ambient but excluded (EXCLUDE_NAMESPACES)", name)
                for pod in self.source.pods():
                    if pod.namespace == name and not self.enablement.is_ztunnel(pod):
                        self._enqueue(_Item(key=pod.key))
            return
        assert isinstance(event, PodEvent)
        if event.type is EventType.ADDED:
            return  # new pods come through their CNI ADD; running ones through the start-up pass
        if event.type is EventType.DELETED:
            self._enqueue(_Item(key=event.pod.key, delete=event.old))
            return
        self._enqueue(_Item(key=event.pod.key, old=event.old))

    def _enqueue(self, item: _Item) -> None:
        handle = self._retry_handles.pop(item.key, None)
        if handle is not None:
            handle.cancel()
        self._queue.put_nowait(item)

    def _retry(self, item: _Item, why: str) -> None:
        delay = self._backoff.get(item.key, self.retry_initial_s)
        self._backoff[item.key] = min(delay * 2, self.retry_max_s)
        self.retries += 1
        log.info("pod %s/%s: will retry in %.3fs: %s", *item.key, delay, why)
        loop = asyncio.get_running_loop()
        self._retry_handles[item.key] = loop.call_later(delay, self._fire_retry, item)

    def _fire_retry(self, item: _Item) -> None:
        self._retry_handles.pop(item.key, None)
        self._queue.put_nowait(item)

    # -- the worker -----------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            item = await self._queue.get()
            try:
                await self._process(item)
            finally:
                self.processed += 1

    async def _process(self, item: _Item) -> None:
        def known_uid(pod: WatchedPod) -> bool:
            return pod.uid in self.dataplane.cache

        if item.delete is not None:
            pod = item.delete
            action = decide_delete(pod, self._ns_labels(pod.namespace), self.enablement, known=known_uid(pod))
            current = self.source.pod(*item.key)
            if current is not None and current.uid != pod.uid:
                action = PodAction.DELETE if action is PodAction.DELETE else PodAction.NONE
        else:
            found = self.source.pod(*item.key)
            if found is None:
                return  # gone since: its deletion is queued separately
            pod = found
            action = decide_update(
                item.old, pod, self._ns_labels(pod.namespace), self.enablement, known=known_uid(pod)
            )
            if action is PodAction.DELETE and item.old is not None and item.old.ips:
                pod = item.old if item.old.uid == pod.uid else pod
        self.last_actions[item.key] = action
        if action in (PodAction.NONE, PodAction.WAIT_FOR_IP):
            self._backoff.pop(item.key, None)
            return
        log.info("pod %s: %s", pod, action.value)
        try:
            if action is PodAction.ADD:
                await self.dataplane.add_pod_to_mesh(pod, pod.ips)
            elif action is PodAction.UPDATE_IPS:
                await self.dataplane.update_pod_ips(pod)
            else:
                await self.dataplane.remove_pod_from_mesh(pod, is_delete=action is PodAction.DELETE)
        except DataplaneError as exc:
            if exc.retryable:
                self._retry(item, str(exc))
            else:
                self.dropped += 1
                log.warning("pod %s: %s failed, not retrying: %s", pod, action.value, exc)
            return
        except Exception as exc:  # crash barrier: one pod's surprise must not stop the queue
            self._retry(item, f"{type(exc).__name__}: {exc}")
            return
        self._backoff.pop(item.key, None)


__all__ = [
    "Enablement",
    "Informer",
    "PodAction",
    "decide_delete",
    "decide_update",
    "enrolled_snapshot",
]
