"""Where the control plane's Kubernetes objects come from: a YAML directory or the API server.

Counterparts: istiod's kube config controller and service registry (pilot/pkg/config/kube/crdclient,
serviceregistry/kube), which keep informers on the kinds ambient reads; and, for the lab and the
tests, a directory of YAML files standing in for the cluster.

`ConfigSource` is the one interface; `ControlPlane` takes any implementation:
- `DirectorySource`: kube/watch.py's `DirectoryWatcher` over `--dir` (the lab writes its
  cluster there: its store is that directory).
- `KubeApiSource`: one kube.Reflector per kind (list, watch from the list's resourceVersion,
  bookmarks, relist on 410 Gone) against the API server. Every object goes through the same
  `parse_object` as a YAML document, so both sources give the same `KubeObject`s, the same
  validation, and the same `LoadError`s for a malformed object (skipped, the rest still served).
  A kind whose CRD is not installed (404: the Gateway API is a separate install) is reported
  once and listed again every `ABSENT_KIND_RETRY_S` until it appears, as istiod starts an
  informer when its CRD shows up. Changes are coalesced for `DEBOUNCE_S` (istiod debounces pushes
  by 100 ms) so a burst of pod updates is one snapshot and one translation.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from ..errors import ConfigError
from ..kube.client import GATEWAYS as GATEWAYS  # defined beside the other kinds; read here too
from ..kube.client import (
    NAMESPACES,
    NODES,
    PODS,
    SERVICE_ACCOUNTS,
    SERVICES,
    KubeApiError,
    KubeClient,
    Resource,
    WatchEvent,
)
from ..kube.load import LoadError, parse_object
from ..kube.model import KubeObject, ObjectKey
from ..kube.reflector import Reflector
from ..kube.store import KubeStore
from ..kube.watch import DirectoryChange, DirectoryWatcher
from .unserved_kinds import explain_note

log = logging.getLogger(__name__)

DEBOUNCE_S = 0.1
ABSENT_KIND_RETRY_S = 30.0
HTTP_NOT_FOUND = 404
API_SOURCE_NAME = "apiserver"  # the "file" of a LoadError for an object read from the API server

# Every kind kube/load.py parses, at the version istiod reads (Istio 1.22+ serves v1 for its
# security and networking CRDs; Gateway API v1).
AUTHORIZATION_POLICIES = Resource("security.istio.io", "v1", "AuthorizationPolicy", "authorizationpolicies")
PEER_AUTHENTICATIONS = Resource("security.istio.io", "v1", "PeerAuthentication", "peerauthentications")
SERVICE_ENTRIES = Resource("networking.istio.io", "v1", "ServiceEntry", "serviceentries")
WORKLOAD_ENTRIES = Resource("networking.istio.io", "v1", "WorkloadEntry", "workloadentries")
# A waypoint's routes: an HTTPRoute or a VirtualService whose parent or host is a Service.
HTTP_ROUTES = Resource("gateway.networking.k8s.io", "v1", "HTTPRoute", "httproutes")
VIRTUAL_SERVICES = Resource("networking.istio.io", "v1", "VirtualService", "virtualservices")
KINDS: tuple[Resource, ...] = (
    NAMESPACES,
    PODS,
    SERVICES,
    SERVICE_ACCOUNTS,
    NODES,
    AUTHORIZATION_POLICIES,
    PEER_AUTHENTICATIONS,
    SERVICE_ENTRIES,
    WORKLOAD_ENTRIES,
    GATEWAYS,
    HTTP_ROUTES,
    VIRTUAL_SERVICES,
)

__all__ = ["KINDS", "ConfigSource", "DirectorySource", "KubeApiSource", "SourceChange"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceChange:
    """One consistent snapshot, the objects that could not be used, and what changed."""

    store: KubeStore
    errors: tuple[LoadError, ...] = ()
    summary: str = "initial load"


OnChange = Callable[[SourceChange], Awaitable[None] | None]


class ConfigSource(Protocol):
    """What the control plane serves from."""

    location: str  # for logs and tables: the directory, or the API server's URL

    async def first(self) -> SourceChange:
        """The complete initial snapshot (istiod waits for its informers to sync)."""

    async def run(self, on_change: OnChange) -> None:
        """Report every later snapshot until cancelled."""

    async def close(self) -> None: ...


async def _deliver(on_change: OnChange, change: SourceChange) -> None:
    outcome = on_change(change)
    if outcome is not None:
        await outcome


class DirectorySource:
    """`--dir`: a directory of YAML files, polled (kube/watch.py's DirectoryWatcher)."""

    def __init__(self, path: str | Path, poll_interval_s: float) -> None:
        self.location = str(path)
        self._on_change: OnChange | None = None
        self.watcher = DirectoryWatcher(path, self._forward, poll_interval_s)
        self._notes_logged: frozenset[str] = frozenset()

    def __repr__(self) -> str:
        return f"DirectorySource({self.watcher!r})"

    def _change(self, change: DirectoryChange) -> SourceChange:
        # What was read and is not served (an Istio kind this mesh lacks), said once per object.
        notes = frozenset(change.result.notes)
        for note in sorted(notes - self._notes_logged):
            log.warning("not served: %s", explain_note(note))
        self._notes_logged = notes
        return SourceChange(store=change.store, errors=change.result.errors, summary=change.summary())

    async def _forward(self, change: DirectoryChange) -> None:
        if self._on_change is not None:
            await _deliver(self._on_change, self._change(change))

    async def first(self) -> SourceChange:
        change = self.watcher.poll()
        return self._change(change) if change is not None else SourceChange(store=KubeStore(()))

    async def run(self, on_change: OnChange) -> None:
        self._on_change = on_change
        await self.watcher.run()

    async def close(self) -> None:
        return None


class KubeApiSource:
    """The API server: every kind of `KINDS`, listed and watched."""

    def __init__(
        self,
        client: KubeClient,
        *,
        kinds: tuple[Resource, ...] = KINDS,
        debounce_s: float = DEBOUNCE_S,
        absent_retry_s: float = ABSENT_KIND_RETRY_S,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        self.client = client
        self.location = client.credentials.server
        self.debounce_s = debounce_s
        self.absent_retry_s = absent_retry_s
        self._sleep = sleep
        # Raw key (kind, namespace, name) -> what it parsed to, or why it did not.
        self._objects: dict[ObjectKey, KubeObject] = {}
        self._errors: dict[ObjectKey, LoadError] = {}
        self._reflectors = {
            kind: Reflector(
                client,
                kind,
                on_replace=partial(self._replace, kind),
                on_event=partial(self._event, kind),
                sleep=sleep,
            )
            for kind in kinds
        }
        self.absent: set[Resource] = set()
        self._dirty = asyncio.Event()
        self._counts = {"added": 0, "updated": 0, "removed": 0}
        self.snapshots = 0

    def __repr__(self) -> str:
        absent = f", not served: {', '.join(sorted(map(str, self.absent)))}" if self.absent else ""
        return (
            f"KubeApiSource({self.location}: {len(self._objects)} objects, {len(self._errors)} errors, "
            f"{self.snapshots} snapshots{absent})"
        )

    @property
    def reflectors(self) -> tuple[Reflector, ...]:
        return tuple(self._reflectors.values())

    # -- objects -----------------------------------------------------------------------------
    @staticmethod
    def _raw_key(kind: Resource, obj: dict[str, Any]) -> ObjectKey:
        raw_meta = obj.get("metadata")
        meta: dict[str, Any] = raw_meta if isinstance(raw_meta, dict) else {}
        name, namespace = meta.get("name"), meta.get("namespace")
        return (
            kind.kind,
            namespace if kind.namespaced and isinstance(namespace, str) else "",
            name if isinstance(name, str) else "",
        )

    def _store(self, kind: Resource, obj: dict[str, Any]) -> str:
        """Parse one object into the cache; returns added / updated / unchanged / error."""
        key = self._raw_key(kind, obj)
        parsed, error, _note = parse_object(obj, API_SOURCE_NAME, 0)
        old = self._objects.pop(key, None)
        self._errors.pop(key, None)
        if parsed is None:
            self._errors[key] = error or LoadError(
                file=API_SOURCE_NAME, object=str(key), message="not usable"
            )
            return "error"
        self._objects[key] = parsed
        if old is None:
            return "added"
        return "unchanged" if old == parsed else "updated"

    def _mark(self, outcome: str) -> None:
        if outcome in self._counts:
            self._counts[outcome] += 1
        if outcome != "unchanged":
            self._dirty.set()

    async def _replace(self, kind: Resource, items: list[dict[str, Any]]) -> None:
        before = {k: v for k, v in self._objects.items() if k[0] == kind.kind}
        for key in [k for k in self._objects if k[0] == kind.kind]:
            del self._objects[key]
        for key in [k for k in self._errors if k[0] == kind.kind]:
            del self._errors[key]
        for item in items:
            self._store(kind, item)
        after = {k: v for k, v in self._objects.items() if k[0] == kind.kind}
        self._counts["added"] += len(after.keys() - before.keys())
        self._counts["removed"] += len(before.keys() - after.keys())
        self._counts["updated"] += sum(1 for k in after.keys() & before.keys() if after[k] != before[k])
        self._dirty.set()

    async def _event(self, kind: Resource, event: WatchEvent) -> None:
        if event.type == "DELETED":
            key = self._raw_key(kind, event.object)
            removed = self._objects.pop(key, None) is not None
            had_error = self._errors.pop(key, None) is not None
            self._mark("removed" if removed else "error" if had_error else "unchanged")
        else:
            self._mark(self._store(kind, event.object))

    def snapshot(self, summary: str = "initial load") -> SourceChange:
        self.snapshots += 1
        errors = tuple(self._errors[k] for k in sorted(self._errors))
        return SourceChange(store=KubeStore(self._objects.values()), errors=errors, summary=summary)

    def _summary(self) -> str:
        counts, self._counts = self._counts, {"added": 0, "updated": 0, "removed": 0}
        return (
            f"{counts['added']} added, {counts['updated']} updated, {counts['removed']} removed, "
            f"{len(self._errors)} errors"
        )

    # -- lifecycle ---------------------------------------------------------------------------
    async def _list(self, kind: Resource) -> bool:
        """List one kind; False when the API server does not serve it (its CRD is absent)."""
        try:
            await self._reflectors[kind].list()
        except KubeApiError as exc:
            if exc.status != HTTP_NOT_FOUND:
                raise
            if kind not in self.absent:
                log.warning(
                    "the API server does not serve %s (%s/%s): is its CRD installed? Retrying every %gs",
                    kind,
                    kind.api_version,
                    kind.kind,
                    self.absent_retry_s,
                )
            self.absent.add(kind)
            return False
        if kind in self.absent:
            log.info("the API server now serves %s", kind)
        self.absent.discard(kind)
        return True

    async def first(self) -> SourceChange:
        try:
            for kind in self._reflectors:
                await self._list(kind)
        except KubeApiError as exc:
            raise ConfigError(
                "--kube",
                f"cannot list the cluster's objects: {exc.message}",
                hint=exc.hint
                or "does the control plane's service account have its ClusterRole (list, watch)?",
            ) from None
        self._dirty.clear()
        self._summary()
        return self.snapshot()

    async def _follow(self, kind: Resource) -> None:
        while kind in self.absent:
            await self._sleep(self.absent_retry_s)
            try:
                await self._list(kind)
            except KubeApiError as exc:
                log.warning("listing %s failed: %s", kind, exc)
        await self._reflectors[kind].run()  # lists first when first() did not

    async def _flush(self, on_change: OnChange) -> None:
        while True:
            await self._dirty.wait()
            await self._sleep(self.debounce_s)  # coalesce a burst into one snapshot
            self._dirty.clear()
            await _deliver(on_change, self.snapshot(self._summary()))

    async def run(self, on_change: OnChange) -> None:
        async with asyncio.TaskGroup() as group:
            for kind in self._reflectors:
                group.create_task(self._follow(kind), name=f"watch {kind}")
            group.create_task(self._flush(on_change), name="snapshots")

    async def close(self) -> None:
        return None  # the client is its owner's (the control plane shares it with TokenReview)
