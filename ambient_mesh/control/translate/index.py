"""Incremental translation: one object changed, only what it affects translated again.

Counterpart of istiod's ambient index (pilot/pkg/serviceregistry/kube/controller/ambient/
ambientindex.go), which builds its outputs as krt collections so that an informer event
recomputes only the derived objects depending on the changed input. Here the dependencies are
written down once, per kind of input, and `AmbientIndex.apply` follows them:

  Pod / WorkloadEntry        its workload
  ServiceEntry               its services (and the other sources of their hostnames), its
                             endpoint workloads, the workloads its selector picks
  Service                    its service (and the hostname's other sources), the workloads its
                             old and new selector pick; the waypoints (a Gateway may fall back to it)
  AuthorizationPolicy        that policy; if its attachment moved, the workloads its old and new
                             selector pick in its namespace (every namespace for the root one)
  PeerAuthentication         every PeerAuthentication-derived policy (converted ones depend on
                             their namespace's and the root's), the workloads of its namespace
                             (every namespace for the root one)
  Namespace                  the services and workloads in it (waypoint use, enrollment,
                             traffic distribution and allowed-routes selectors read its labels)
  Node                       the pods on it (locality)
  Gateway                    the waypoints; if any waypoint changed, everything

Each step is the same per-object function `translate` uses, so a fresh index and the full
translation agree (tests/unit/control/translate/test_incremental.py checks that after any sequence of
changes). A recomputed resource equal to the one already served is not reported as changed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TypeAlias

from ...kube.model import (
    AuthorizationPolicy,
    KubeObject,
    Namespace,
    Node,
    ObjectKey,
    PeerAuthentication,
    Pod,
    Service,
    ServiceEntry,
    WorkloadEntry,
    object_key,
)
from ...kube.store import KubeStore
from ...wire.istio.security import authorization_pb2 as sec
from ...wire.istio.workload import workload_pb2 as wl
from .authorization import convert_authorization_policy
from .common import MeshSettings, Translation, selects
from .context import Context, ServiceIndex, ServiceInfo, Waypoint
from .policies import PolicyIndex, peer_authentication_resources, policy_attachment
from .services import kube_service, select_services, service_entry_services
from .waypoints import gateway_waypoint
from .workloads import pod_workload, service_entry_workloads, workload_entry_workload

# Kinds whose objects become workloads, in the order `translate` gives them precedence when two
# claim one uid (the first keeps it).
_WORKLOAD_KINDS = ("Pod", "WorkloadEntry", "ServiceEntry")
_SERVICE_KINDS = ("Service", "ServiceEntry")
_SERVICE_PRIORITY = (0,)
# A change of at least this many objects, half the index or more, is translated from scratch.
FULL_RECOMPUTE_MIN_CHANGES = 64

Priority: TypeAlias = tuple[
    int | str, ...
]  # (0,) for services; (1 + kind rank, namespace, name, endpoint index) for workloads


@dataclass(frozen=True, slots=True, kw_only=True)
class TranslationDelta:
    """What one `AmbientIndex.apply` changed in the served resources (names are xDS names)."""

    addresses: Mapping[str, wl.Address]
    removed_addresses: frozenset[str]
    authorizations: Mapping[str, sec.Authorization]
    removed_authorizations: frozenset[str]
    # The keys of the Kubernetes objects this apply added, replaced or removed.
    objects: frozenset[ObjectKey] = frozenset()

    def __bool__(self) -> bool:
        return bool(
            self.addresses or self.removed_addresses or self.authorizations or self.removed_authorizations
        )

    def __repr__(self) -> str:
        return (
            f"TranslationDelta({len(self.addresses)} addresses, -{len(self.removed_addresses)}; "
            f"{len(self.authorizations)} authorizations, -{len(self.removed_authorizations)})"
        )


class _Objects:
    """The current Kubernetes objects, with the lookups translation steps and dependencies need."""

    __slots__ = ("by_key", "_by_kind_namespace", "_pods_by_node")

    def __init__(self) -> None:
        self.by_key: dict[ObjectKey, KubeObject] = {}
        # (kind, namespace) -> name -> object
        self._by_kind_namespace: dict[tuple[str, str], dict[str, KubeObject]] = {}
        # node name -> keys of the pods scheduled there
        self._pods_by_node: dict[str, set[ObjectKey]] = {}

    def put(self, key: ObjectKey, obj: KubeObject | None) -> KubeObject | None:
        """Set (or with None remove) one object; returns the one it replaced."""
        kind, namespace, name = key
        old = self.by_key.pop(key, None)
        group = self._by_kind_namespace.get((kind, namespace))
        if old is not None and group is not None:
            group.pop(name, None)
            if not group:
                del self._by_kind_namespace[(kind, namespace)]
        if isinstance(old, Pod):
            pods = self._pods_by_node.get(old.node_name)
            if pods is not None:
                pods.discard(key)
                if not pods:
                    del self._pods_by_node[old.node_name]
        if obj is not None:
            self.by_key[key] = obj
            self._by_kind_namespace.setdefault((kind, namespace), {})[name] = obj
            if isinstance(obj, Pod):
                self._pods_by_node.setdefault(obj.node_name, set()).add(key)
        return old

    # ObjectLookup
    def get(self, kind: str, namespace: str, name: str) -> KubeObject | None:
        return self.by_key.get((kind, namespace, name))

    def namespace(self, name: str) -> Namespace | None:
        obj = self.by_key.get(("Namespace", "", name))
        return obj if isinstance(obj, Namespace) else None

    def node(self, name: str) -> Node | None:
        obj = self.by_key.get(("Node", "", name))
        return obj if isinstance(obj, Node) else None

    def in_namespace(self, kind: str, namespace: str) -> Iterable[KubeObject]:
        return self._by_kind_namespace.get((kind, namespace), {}).values()

    def of_kind(self, kind: str) -> Iterable[KubeObject]:
        for (k, _), group in self._by_kind_namespace.items():
            if k == kind:
                yield from group.values()

    def namespaces_of(self, kinds: Iterable[str]) -> set[str]:
        wanted = set(kinds)
        return {ns for (kind, ns) in self._by_kind_namespace if kind in wanted}

    def pods_on(self, node: str) -> Iterable[ObjectKey]:
        return self._pods_by_node.get(node, ())


def _workload_labels(obj: KubeObject) -> Mapping[str, str]:
    """The labels selectors match a workload source by (a WorkloadEntry's spec labels too)."""
    if isinstance(obj, WorkloadEntry):
        return {**obj.metadata.labels, **obj.spec.labels}
    return obj.metadata.labels


class _Claims:
    """xDS names -> the Address served under each, when several sources claim one name.

    `translate` keeps the first claimant in its order (services, then pods, WorkloadEntries and
    ServiceEntry endpoints by key) and notes each later one as dropped; here every claim is kept
    with its priority so a change to the winner promotes the next one.
    """

    __slots__ = ("winners", "losers")

    def __init__(self) -> None:
        self.winners: dict[str, tuple[Priority, wl.Address]] = {}
        self.losers: dict[str, dict[Priority, wl.Address]] = {}

    def claim(self, name: str, priority: Priority, address: wl.Address) -> None:
        current = self.winners.get(name)
        if current is None or current[0] == priority:
            self.winners[name] = (priority, address)
        elif priority < current[0]:
            self.losers.setdefault(name, {})[current[0]] = current[1]
            self.winners[name] = (priority, address)
        else:
            self.losers.setdefault(name, {})[priority] = address

    def release(self, name: str, priority: Priority) -> None:
        current = self.winners.get(name)
        shadowed = self.losers.get(name)
        if current is not None and current[0] == priority:
            if shadowed:
                best = min(shadowed)
                self.winners[name] = (best, shadowed.pop(best))
                if not shadowed:
                    del self.losers[name]
            else:
                del self.winners[name]
        elif shadowed is not None:
            shadowed.pop(priority, None)
            if not shadowed:
                del self.losers[name]

    def get(self, name: str) -> wl.Address | None:
        current = self.winners.get(name)
        return current[1] if current is not None else None


class AmbientIndex:
    """The translation of a changing set of Kubernetes objects, kept up to date per change.

    `apply` takes added/updated objects and removed keys and returns what changed in the served
    resources; `update` does the same from a new `KubeStore` snapshot; `translation()` is the
    current whole, equal to `translate()` of the same objects.
    """

    def __init__(self, settings: MeshSettings | None = None) -> None:
        self.settings = settings or MeshSettings()
        self._objects = _Objects()
        self._waypoints: dict[str, Waypoint] = {}
        self._policies = PolicyIndex(self.settings)
        self._services = ServiceIndex()
        self._ctx = Context(
            objects=self._objects,
            settings=self.settings,
            waypoints=self._waypoints,
            services=self._services,
            policies=self._policies,
        )
        self._claims = _Claims()
        self._policy_resources: dict[str, sec.Authorization] = {}
        self._peer_resources: dict[str, sec.Authorization] = {}
        # Service/ServiceEntry key -> the services it would serve (before winners are chosen)
        self._source_infos: dict[ObjectKey, list[ServiceInfo]] = {}
        # hostname -> Service/ServiceEntry keys with a service of that hostname
        self._hosts: dict[str, set[ObjectKey]] = {}
        self._host_winners: dict[str, list[ServiceInfo]] = {}
        # workload source key -> the (name, priority) claims it made
        self._workload_claims: dict[ObjectKey, list[tuple[str, Priority]]] = {}
        # (step, source key) -> the notes of its last translation
        self._notes: dict[tuple[str, ObjectKey], list[str]] = {}

    def __repr__(self) -> str:
        return (
            f"AmbientIndex({len(self._objects.by_key)} objects: {len(self._claims.winners)} addresses, "
            f"{len(self._policy_resources) + len(self._peer_resources)} authorizations)"
        )

    # -- the current whole ----------------------------------------------------------------------

    @property
    def addresses(self) -> dict[str, wl.Address]:
        return {name: address for name, (_, address) in self._claims.winners.items()}

    @property
    def authorizations(self) -> dict[str, sec.Authorization]:
        return {**self._policy_resources, **self._peer_resources}

    @property
    def notes(self) -> tuple[str, ...]:
        out = [note for _, notes in sorted(self._notes.items()) for note in notes]
        for name, shadowed in sorted(self._claims.losers.items()):
            out.extend(f"workload {name}: duplicate uid, later one dropped" for _ in shadowed)
        return tuple(out)

    def translation(self) -> Translation:
        """The current whole, as `translate` would give it for the same objects."""
        return Translation(addresses=self.addresses, authorizations=self.authorizations, notes=self.notes)

    def _authorization(self, name: str) -> sec.Authorization | None:
        pb = self._policy_resources.get(name)
        return pb if pb is not None else self._peer_resources.get(name)

    def _set_notes(self, step: str, key: ObjectKey, notes: list[str]) -> None:
        if notes:
            self._notes[(step, key)] = notes
        else:
            self._notes.pop((step, key), None)

    # -- changes --------------------------------------------------------------------------------

    def update(self, store: KubeStore, changed: Iterable[ObjectKey] | None = None) -> TranslationDelta:
        """Move to the objects of `store`. `changed` names the keys that may differ (as a
        `DirectoryChange` lists them); without it every key is compared, by identity first."""
        upserts: list[KubeObject] = []
        removals: list[ObjectKey] = []
        if changed is not None:
            for key in changed:
                obj = store.get(*key)
                if obj is None:
                    removals.append(key)
                else:
                    upserts.append(obj)
        else:
            current = self._objects.by_key
            keys = store.keys()
            for key in keys:
                obj = store.get(*key)
                old = current.get(key)
                if obj is not old and obj != old:
                    upserts.append(obj)  # type: ignore[arg-type]
            removals.extend(key for key in current if key not in keys)
        return self.apply(upserts, removals)

    def apply(
        self, upserts: Iterable[KubeObject] = (), removals: Iterable[ObjectKey] = ()
    ) -> TranslationDelta:
        """Add or replace `upserts`, remove `removals`, translate again what they affect."""
        run = _Run(self)
        for obj in upserts:
            run.put(object_key(obj), obj)
        for key in removals:
            run.put(key, None)
        return run.finish()


class _Run:
    """One `apply`: the changed objects, what they make dirty, and the resources that moved."""

    def __init__(self, index: AmbientIndex) -> None:
        self.index = index
        self.changed: dict[ObjectKey, tuple[KubeObject | None, KubeObject | None]] = {}
        self.dirty_services: set[ObjectKey] = set()
        self.dirty_workloads: set[ObjectKey] = set()
        self.address_before: dict[str, wl.Address | None] = {}
        self.authorization_before: dict[str, sec.Authorization | None] = {}
        self.everything = False

    def put(self, key: ObjectKey, obj: KubeObject | None) -> None:
        old = self.index._objects.put(key, obj)
        if old is None and obj is None:
            return
        first = self.changed.get(key)
        self.changed[key] = (first[0] if first is not None else old, obj)

    # -- dependencies ---------------------------------------------------------------------------

    def _workloads_matching(self, namespace: str, selectors: Iterable[Mapping[str, str]]) -> None:
        """Mark the workload sources of `namespace` whose labels a selector matches."""
        selectors = [s for s in selectors if s]
        if not selectors or self.everything:
            return
        objects = self.index._objects
        for kind in _WORKLOAD_KINDS:
            for obj in objects.in_namespace(kind, namespace):
                labels = _workload_labels(obj)
                if any(selects(s, labels) for s in selectors):
                    self.dirty_workloads.add(object_key(obj))

    def _all_workloads_in(self, namespace: str | None) -> None:
        """Mark every workload source of `namespace` (None: of every namespace)."""
        if self.everything:
            return
        objects = self.index._objects
        for kind in _WORKLOAD_KINDS:
            group = objects.of_kind(kind) if namespace is None else objects.in_namespace(kind, namespace)
            self.dirty_workloads.update(object_key(obj) for obj in group)

    def _mark(self, key: ObjectKey, old: KubeObject | None, new: KubeObject | None) -> None:
        kind, namespace, name = key
        root = self.index.settings.root_namespace
        if kind in ("Pod", "WorkloadEntry"):
            self.dirty_workloads.add(key)
        elif kind in _SERVICE_KINDS:
            self.dirty_services.add(key)
            if kind == "ServiceEntry":
                self.dirty_workloads.add(key)
            selectors = [_service_selector(o) for o in (old, new) if o is not None]
            self._workloads_matching(namespace, selectors)
        elif kind == "Namespace":
            for service_kind in _SERVICE_KINDS:
                self.dirty_services.update(
                    object_key(o) for o in self.index._objects.in_namespace(service_kind, name)
                )
            self._all_workloads_in(name)
        elif kind == "Node":
            self.dirty_workloads.update(self.index._objects.pods_on(name))
        elif kind == "AuthorizationPolicy":
            self._policy(key, new)
        elif kind == "PeerAuthentication":
            pa = new if isinstance(new, PeerAuthentication) else None
            self.index._policies.set_peer_authentication(namespace, name, pa)
            self._all_workloads_in(None if namespace == root else namespace)

    def _policy(self, key: ObjectKey, new: KubeObject | None) -> None:
        index = self.index
        _, namespace, name = key
        notes: list[str] = []
        pb, attachment = None, None
        if isinstance(new, AuthorizationPolicy):
            pb, note = convert_authorization_policy(new, index.settings)
            if note:
                notes.append(note)
            attachment = policy_attachment(new, pb)
        # The resource is named after the policy (`namespace/name`), or absent when not for ztunnel.
        self._set_authorization(index._policy_resources, f"{namespace}/{name}", pb)
        index._set_notes("policy", key, notes)
        old_attachment = index._policies.attachment(namespace, name)
        if attachment == old_attachment:
            return
        index._policies.set_selector(namespace, name, attachment)
        selectors = [s.match_labels for s in (old_attachment, attachment) if s is not None]
        if namespace == index.settings.root_namespace:
            namespaces: Iterable[str] = index._objects.namespaces_of(_WORKLOAD_KINDS)
        else:
            namespaces = (namespace,)
        for ns in namespaces:
            self._workloads_matching(ns, selectors)

    # -- recomputation --------------------------------------------------------------------------

    def _set_authorization(
        self, resources: dict[str, sec.Authorization], name: str, pb: sec.Authorization | None
    ) -> None:
        if name not in self.authorization_before:
            self.authorization_before[name] = self.index._authorization(name)
        if pb is None:
            resources.pop(name, None)
        else:
            resources[name] = pb

    def _claim(self, name: str, priority: Priority, address: wl.Address | None) -> None:
        claims = self.index._claims
        if name not in self.address_before:
            self.address_before[name] = claims.get(name)
        if address is None:
            claims.release(name, priority)
        else:
            claims.claim(name, priority, address)

    def _waypoints(self) -> None:
        index = self.index
        if not any(k[0] in ("Gateway", "Service") for k in self.changed) and not self.everything:
            return
        fresh: dict[str, Waypoint] = {}
        for gw in index._objects.of_kind("Gateway"):
            wp = gateway_waypoint(gw, index._objects, index.settings)  # type: ignore[arg-type]
            if wp is not None:
                fresh[wp.resource_name] = wp
        if fresh != index._waypoints:
            index._waypoints.clear()
            index._waypoints.update(fresh)
            self.everything = True

    def _peer_authentications(self) -> None:
        index = self.index
        if not any(k[0] == "PeerAuthentication" for k in self.changed):
            return
        fresh = peer_authentication_resources(
            index._objects.of_kind("PeerAuthentication"),  # type: ignore[arg-type]
            index.settings,
        )
        for name in set(index._peer_resources) | set(fresh):
            pb = fresh.get(name)
            if pb != index._peer_resources.get(name):
                self._set_authorization(index._peer_resources, name, pb)

    def _recompute_services(self) -> None:
        index = self.index
        objects = index._objects
        if self.everything:
            self.dirty_services.update(
                object_key(o) for kind in _SERVICE_KINDS for o in objects.of_kind(kind)
            )
            self.dirty_services.update(index._source_infos)
        hosts: set[str] = set()
        for key in self.dirty_services:
            old_infos = index._source_infos.pop(key, [])
            hosts.update(i.service.hostname for i in old_infos)
            obj = objects.by_key.get(key)
            infos: list[ServiceInfo] = []
            notes: list[str] = []
            index._ctx.notes = notes
            if isinstance(obj, Service):
                info = kube_service(index._ctx, obj)
                infos = [info] if info is not None else []
            elif isinstance(obj, ServiceEntry):
                infos = service_entry_services(index._ctx, obj)
            index._set_notes("service", key, notes)
            for info in old_infos:
                sources = index._hosts.get(info.service.hostname)
                if sources is not None:
                    sources.discard(key)
                    if not sources:
                        del index._hosts[info.service.hostname]
            if infos:
                index._source_infos[key] = infos
                for info in infos:
                    index._hosts.setdefault(info.service.hostname, set()).add(key)
                    hosts.add(info.service.hostname)
        for host in hosts:
            self._select(host)

    def _select(self, host: str) -> None:
        """Choose the winners of one hostname again and follow what moved."""
        index = self.index
        candidates = [
            info
            for key in sorted(index._hosts.get(host, ()))
            for info in index._source_infos.get(key, ())
            if info.service.hostname == host
        ]
        winners = select_services(candidates)
        old = index._host_winners.pop(host, [])
        if winners:
            index._host_winners[host] = winners
        if old == winners:
            return
        new_keys = {w.key for w in winners}
        for info in old:
            if info.key not in new_keys:
                index._services.discard(info.service.namespace, info.key)
                self._claim(info.key, _SERVICE_PRIORITY, None)
        for info in winners:
            index._services.set(info)
            self._claim(info.key, _SERVICE_PRIORITY, wl.Address(service=info.service))
        for info in old + winners:
            namespace = info.service.namespace
            self._workloads_matching(namespace, [info.selector])
            if info.source_kind == "ServiceEntry":
                self.dirty_workloads.add(("ServiceEntry", namespace, info.service.name))

    def _recompute_workloads(self) -> None:
        index = self.index
        objects = index._objects
        if self.everything:
            self.dirty_workloads.update(
                object_key(o) for kind in _WORKLOAD_KINDS for o in objects.of_kind(kind)
            )
            self.dirty_workloads.update(index._workload_claims)
        ctx = index._ctx
        rank = {kind: i + 1 for i, kind in enumerate(_WORKLOAD_KINDS)}
        for key in self.dirty_workloads:
            kind, namespace, name = key
            obj = objects.by_key.get(key)
            notes: list[str] = []
            ctx.notes = notes
            workloads: list[wl.Workload] = []
            if isinstance(obj, Pod):
                w = pod_workload(ctx, obj)
                workloads = [w] if w is not None else []
            elif isinstance(obj, WorkloadEntry):
                workloads = [workload_entry_workload(ctx, obj)]
            elif isinstance(obj, ServiceEntry):
                workloads = service_entry_workloads(ctx, obj)
            index._set_notes("workload", key, notes)
            claims: list[tuple[str, Priority]] = []
            for i, w in enumerate(workloads):
                priority: Priority = (rank[kind], namespace, name, i)
                claims.append((w.uid, priority))
                current = index._claims.winners.get(w.uid)
                address = wl.Address(workload=w)
                if current is not None and current[0] == priority and current[1] == address:
                    continue  # translated again to the same resource
                self._claim(w.uid, priority, address)
            kept = set(claims)
            for claim in index._workload_claims.pop(key, ()):
                if claim not in kept:
                    self._claim(claim[0], claim[1], None)
            if claims:
                index._workload_claims[key] = claims

    def finish(self) -> TranslationDelta:
        # At start-up (or when most objects changed) following dependencies one by one costs
        # more than translating everything again.
        self.everything = len(self.changed) >= FULL_RECOMPUTE_MIN_CHANGES and 2 * len(self.changed) >= len(
            self.index._objects.by_key
        )
        for key, (old, new) in self.changed.items():
            self._mark(key, old, new)
        self._waypoints()
        self._peer_authentications()
        self._recompute_services()
        self._recompute_workloads()
        index = self.index
        addresses: dict[str, wl.Address] = {}
        removed_addresses = set()
        for name, before in self.address_before.items():
            after = index._claims.get(name)
            if after is None:
                if before is not None:
                    removed_addresses.add(name)
            elif before is None or after != before:
                addresses[name] = after
        authorizations: dict[str, sec.Authorization] = {}
        removed_authorizations = set()
        for name, policy_before in self.authorization_before.items():
            policy_after = index._authorization(name)
            if policy_after is None:
                if policy_before is not None:
                    removed_authorizations.add(name)
            elif policy_before is None or policy_after != policy_before:
                authorizations[name] = policy_after
        return TranslationDelta(
            addresses=addresses,
            removed_addresses=frozenset(removed_addresses),
            authorizations=authorizations,
            removed_authorizations=frozenset(removed_authorizations),
            objects=frozenset(self.changed),
        )


def _service_selector(obj: KubeObject) -> Mapping[str, str]:
    if isinstance(obj, Service):
        return obj.selector
    if isinstance(obj, ServiceEntry) and obj.workload_selector is not None:
        return obj.workload_selector.match_labels
    return {}
