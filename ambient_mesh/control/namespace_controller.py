"""istiod's namespace controller: the `istio-ca-root-cert` ConfigMap in every namespace.

Counterpart of istiod's NamespaceController (pilot/pkg/serviceregistry/kube/controller): every
namespace but Kubernetes' own bookkeeping ones (kube-public, kube-node-lease,
local-path-storage; kube-system is served, as ztunnel may run there) gets a ConfigMap
`istio-ca-root-cert`, labelled `istio.io/config=true`, whose `root-cert.pem` is the mesh's root
bundle. Proxies mount it to trust the control plane and each other (ztunnel's `CA_ROOT_CA`,
`XDS_ROOT_CA`). A missing one is created; one whose `root-cert.pem` differs (edited, or an older
root) is updated back, other keys left alone; a deleted one comes back from its watch event.
Writes are create and update (PUT with the resourceVersion read, 409 on a stale one), the verbs
istiod's ClusterRole grants on ConfigMaps.

`reconcile` is the decision (sans-IO); `NamespaceController` is the shell: the namespaces come
from the control plane's snapshots (`set_namespaces`), the ConfigMaps from a field-selected watch
of that one name, and a queue with bounded retries (istiod: five, from 5 ms doubling) does the
writes. Only with the API server: the lab's directory has no ConfigMaps to write.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from ..kube.client import CONFIG_MAPS, KubeApiError, KubeClient, WatchEvent
from ..kube.reflector import Reflector

log = logging.getLogger(__name__)

CA_ROOT_CERT_CONFIGMAP = "istio-ca-root-cert"
CA_ROOT_CERT_KEY = "root-cert.pem"
CONFIGMAP_LABELS = {"istio.io/config": "true"}
# Kubernetes' own namespaces that istiod leaves alone (kube-system is not one of them).
IGNORED_NAMESPACES = frozenset({"kube-public", "kube-node-lease", "local-path-storage"})
MAX_RECONCILE_ATTEMPTS = 5
RETRY_INITIAL_S = 0.005
HTTP_CONFLICT = 409


class Action(enum.Enum):
    CREATE = "create"
    UPDATE = "update"


def desired_configmap(namespace: str, root_pem: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": CA_ROOT_CERT_CONFIGMAP,
            "namespace": namespace,
            "labels": dict(CONFIGMAP_LABELS),
        },
        "data": {CA_ROOT_CERT_KEY: root_pem},
    }


def reconcile(existing: dict[str, Any] | None, root_pem: str) -> Action | None:
    """What the namespace's ConfigMap needs: created, updated back to the root, or nothing."""
    if existing is None:
        return Action.CREATE
    data = existing.get("data")
    if not isinstance(data, dict) or data.get(CA_ROOT_CERT_KEY) != root_pem:
        return Action.UPDATE
    return None


def updated_configmap(existing: dict[str, Any], root_pem: str) -> dict[str, Any]:
    """`existing` with the root in its data and our label, everything else (its other keys, its
    resourceVersion for the server's conflict check) as it was."""
    metadata = dict(existing.get("metadata") or {})
    metadata["labels"] = {**(metadata.get("labels") or {}), **CONFIGMAP_LABELS}
    data = existing.get("data")
    return {
        **existing,
        "metadata": metadata,
        "data": {**(data if isinstance(data, dict) else {}), CA_ROOT_CERT_KEY: root_pem},
    }


class NamespaceController:
    """Keeps `istio-ca-root-cert` right in each namespace the control plane sees."""

    def __init__(
        self,
        client: KubeClient,
        root_pem: str,
        *,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        self.client = client
        self.root_pem = root_pem
        self._sleep = sleep
        self.namespaces: frozenset[str] = frozenset()
        self.configmaps: dict[str, dict[str, Any]] = {}  # namespace -> its istio-ca-root-cert
        self._queue: dict[str, None] = {}  # namespaces to reconcile, in order, each once
        self._wake = asyncio.Event()
        self._synced = False
        self.reflector = Reflector(
            client,
            CONFIG_MAPS,
            on_replace=self._replace,
            on_event=self._event,
            fields={"metadata.name": CA_ROOT_CERT_CONFIGMAP},
        )
        self.created = 0
        self.updated = 0
        self.failed = 0

    def __repr__(self) -> str:
        return (
            f"NamespaceController({len(self.namespaces)} namespaces, {len(self.configmaps)} ConfigMaps, "
            f"{len(self._queue)} queued; {self.created} created, {self.updated} updated, {self.failed} failed)"
        )

    def _enqueue(self, namespace: str) -> None:
        if namespace in self.namespaces and namespace not in IGNORED_NAMESPACES:
            self._queue[namespace] = None
            self._wake.set()

    def set_namespaces(self, names: Iterable[str]) -> None:
        """The namespaces of the control plane's latest snapshot; new ones are reconciled."""
        current = frozenset(names)
        added = current - self.namespaces
        self.namespaces = current
        for gone in [ns for ns in self._queue if ns not in current]:
            del self._queue[gone]
        for namespace in sorted(added):
            self._enqueue(namespace)

    async def _replace(self, items: list[dict[str, Any]]) -> None:
        self.configmaps = {str(obj.get("metadata", {}).get("namespace", "")): obj for obj in items}
        self._synced = True
        for namespace in sorted(self.namespaces):
            self._enqueue(namespace)

    async def _event(self, event: WatchEvent) -> None:
        namespace = str(event.object.get("metadata", {}).get("namespace", ""))
        if event.type == "DELETED":
            self.configmaps.pop(namespace, None)
        else:
            self.configmaps[namespace] = event.object
        self._enqueue(namespace)

    async def _write(self, namespace: str, existing: dict[str, Any] | None) -> None:
        action = reconcile(existing, self.root_pem)
        if action is Action.CREATE:
            await self.client.create(CONFIG_MAPS, desired_configmap(namespace, self.root_pem))
            self.created += 1
            log.info("created %s/%s", namespace, CA_ROOT_CERT_CONFIGMAP)
        elif action is Action.UPDATE:
            assert existing is not None
            await self.client.replace(CONFIG_MAPS, updated_configmap(existing, self.root_pem))
            self.updated += 1
            log.info("updated %s/%s back to the mesh root", namespace, CA_ROOT_CERT_CONFIGMAP)

    async def _reconcile(self, namespace: str) -> None:
        existing = self.configmaps.get(namespace)
        action = reconcile(existing, self.root_pem)
        if action is None:
            return
        delay = RETRY_INITIAL_S
        for attempt in range(1, MAX_RECONCILE_ATTEMPTS + 1):
            try:
                await self._write(namespace, existing)
                return
            except KubeApiError as exc:
                if attempt == MAX_RECONCILE_ATTEMPTS:
                    self.failed += 1
                    log.warning(
                        "could not %s %s/%s after %d attempts: %s (a later change of the namespace or "
                        "the ConfigMap tries again)",
                        action.value,
                        namespace,
                        CA_ROOT_CERT_CONFIGMAP,
                        attempt,
                        exc,
                    )
                    return
                await self._sleep(delay)
                delay *= 2
                if exc.status == HTTP_CONFLICT:
                    # made or changed meanwhile, before our watch said so: read it again
                    try:
                        existing = await self.client.get(CONFIG_MAPS, namespace, CA_ROOT_CERT_CONFIGMAP)
                    except KubeApiError as read:
                        log.warning("reading %s/%s again: %s", namespace, CA_ROOT_CERT_CONFIGMAP, read)
                    if reconcile(existing, self.root_pem) is None:
                        return

    async def run(self) -> None:
        """Watch the ConfigMaps and reconcile queued namespaces until cancelled."""
        watch = asyncio.get_running_loop().create_task(self.reflector.run(), name="istio-ca-root-cert watch")
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if not self._synced:
                    continue  # the first list enqueues every namespace
                while self._queue:
                    namespace = next(iter(self._queue))
                    del self._queue[namespace]
                    await self._reconcile(namespace)
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)


__all__ = [
    "CA_ROOT_CERT_CONFIGMAP",
    "CA_ROOT_CERT_KEY",
    "Action",
    "NamespaceController",
    "desired_configmap",
    "reconcile",
    "updated_configmap",
]
