"""The node proxy's view of the mesh: workloads, services, policies and their lookup indexes.

Counterparts: ztunnel src/state.rs (`ProxyState`, `DemandProxyState`, `load_balance`),
src/state/workload.rs (`WorkloadStore`) and src/state/service.rs (`ServiceStore`). Behaviour
follows docs/istio-behaviour.md, "Workloads and services".

One updater (xDS or the local config file) writes; the proxy reads. Everything runs on one
asyncio loop, so there are no locks. A stored `Service` owns its `endpoints` dict: the store
updates it in place so that adding one endpoint to a service with thousands of them stays O(1).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable

from ..errors import IdentityError
from ..identity.spiffe import Identity
from ..net import IPAddress
from ..rbac import Authorization, Decision, PolicyIndex, PolicyTarget, RbacConnection
from .model import (
    Endpoint,
    HealthPolicy,
    LoadBalancingMode,
    LoadBalancingScope,
    NetworkMode,
    Service,
    TunnelProtocol,
    Visibility,
    Workload,
    WorkloadStatus,
)

# Kubernetes pods get uids `<cluster>//Pod/<ns>/<name>`; when several workloads claim one (network, IP), the
# pod is the real owner (ztunnel's tie-break, docs/istio-behaviour.md, "Workloads and services").
_POD_UID_MARKER = "//Pod/"

_K = TypeVar("_K")
_V = TypeVar("_V")


def _address_rank(workload: Workload) -> tuple[bool, bool]:
    return (_POD_UID_MARKER in workload.uid, workload.protocol is TunnelProtocol.HBONE)


class WorkloadStore:
    """Workloads by uid, by (network, IP), by identity and by (namespace, name)."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._by_uid: dict[str, Workload] = {}
        # (network, ip) -> uids in arrival order; several may share one IP.
        self._by_address: dict[tuple[str, IPAddress], dict[str, None]] = {}
        self._by_identity: dict[Identity, dict[str, None]] = {}
        self._by_name: dict[tuple[str, str], dict[str, None]] = {}

    def insert(self, workload: Workload) -> Workload | None:
        """Insert or replace (same uid); returns the workload it replaced."""
        previous = self.remove(workload.uid)
        self._by_uid[workload.uid] = workload
        # Host-network pods share the node's IP, so an IP says nothing about which one it is.
        if workload.network_mode is not NetworkMode.HOST_NETWORK:
            for ip in workload.workload_ips:
                self._by_address.setdefault((workload.network, ip), {})[workload.uid] = None
        identity = _identity_or_none(workload)
        if identity is not None:
            self._by_identity.setdefault(identity, {})[workload.uid] = None
        self._by_name.setdefault((workload.namespace, workload.name), {})[workload.uid] = None
        return previous

    def remove(self, uid: str) -> Workload | None:
        workload = self._by_uid.pop(uid, None)
        if workload is None:
            return None
        for ip in workload.workload_ips:
            _discard(self._by_address, (workload.network, ip), uid)
        identity = _identity_or_none(workload)
        if identity is not None:
            _discard(self._by_identity, identity, uid)
        _discard(self._by_name, (workload.namespace, workload.name), uid)
        return workload

    def find_uid(self, uid: str) -> Workload | None:
        return self._by_uid.get(uid)

    def find_address(self, network: str, ip: IPAddress) -> Workload | None:
        uids = self._by_address.get((network, ip))
        if not uids:
            return None
        candidates = [self._by_uid[uid] for uid in uids]
        # max() keeps the first of equals, so arrival order breaks the remaining ties.
        return max(candidates, key=_address_rank)

    def find_by_identity(self, identity: Identity) -> list[Workload]:
        return sorted((self._by_uid[uid] for uid in self._by_identity.get(identity, ())), key=_uid)

    def find_by_name(self, namespace: str, name: str) -> list[Workload]:
        return sorted((self._by_uid[uid] for uid in self._by_name.get((namespace, name), ())), key=_uid)

    def __len__(self) -> int:
        return len(self._by_uid)

    def __contains__(self, uid: object) -> bool:
        return uid in self._by_uid

    def __iter__(self) -> Iterator[Workload]:
        return iter(sorted(self._by_uid.values(), key=_uid))

    def __repr__(self) -> str:
        return f"<WorkloadStore: {len(self._by_uid)} workloads, {len(self._by_address)} addresses>"


class ServiceStore:
    """Services by `namespace/hostname`, by VIP and by hostname, with their endpoints.

    Endpoints are derived from workloads' `services` maps and remembered whether or not the
    service is known yet; those whose service has not arrived are *staged* and attached when it
    does (docs/istio-behaviour.md, "Workloads and services").
    """

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._by_key: dict[str, Service] = {}
        self._by_vip: dict[tuple[str, IPAddress], dict[str, None]] = {}
        self._by_hostname: dict[str, dict[str, None]] = {}
        self._with_cidrs: dict[str, None] = {}
        # service key -> uid -> endpoint, as the workloads declare them (staged or attached).
        self._declared: dict[str, dict[str, Endpoint]] = {}
        # workload uid -> service keys it declared, so a workload update touches only its services.
        self._workload_services: dict[str, tuple[str, ...]] = {}

    # -- services -------------------------------------------------------------------------------

    def insert(self, service: Service) -> Service:
        """Insert or update a service; returns the stored copy (which owns its endpoints)."""
        key = service.key
        previous = self._by_key.get(key)
        endpoints: dict[str, Endpoint] = {}
        candidates: list[Endpoint] = list(service.endpoints.values())
        if previous is not None:
            # An update keeps what we already knew: xDS sends services without endpoints.
            candidates.extend(ep for uid, ep in previous.endpoints.items() if uid not in service.endpoints)
            self._unindex(previous)
        candidates.extend(self._declared.get(key, {}).values())
        for endpoint in candidates:
            if _include_endpoint(service, endpoint):
                endpoints[endpoint.workload_uid] = endpoint
        stored = dataclasses.replace(service, endpoints=endpoints)
        self._by_key[key] = stored
        self._index(stored)
        return stored

    def remove(self, key: str) -> Service | None:
        service = self._by_key.pop(key, None)
        if service is not None:
            self._unindex(service)
        return service

    def get(self, key: str) -> Service | None:
        return self._by_key.get(key)

    def _index(self, service: Service) -> None:
        key = service.key
        for vip in service.vips:
            self._by_vip.setdefault((vip.network, vip.address), {})[key] = None
        # Host names compare without case (RFC 4343): DNS lookups and routing share this index.
        self._by_hostname.setdefault(service.hostname.lower(), {})[key] = None
        if service.cidr_vips:
            self._with_cidrs[key] = None

    def _unindex(self, service: Service) -> None:
        key = service.key
        for vip in service.vips:
            _discard(self._by_vip, (vip.network, vip.address), key)
        _discard(self._by_hostname, service.hostname.lower(), key)
        self._with_cidrs.pop(key, None)

    # -- endpoints ------------------------------------------------------------------------------

    def update_workload(self, workload: Workload) -> None:
        """(Re)derive the endpoints a workload declares in its `services` map."""
        self.remove_workload(workload.uid)
        keys = tuple(workload.services)
        if not keys:
            return
        self._workload_services[workload.uid] = keys
        for key, ports in workload.services.items():
            endpoint = Endpoint(workload_uid=workload.uid, port=dict(ports), status=workload.status)
            self._declared.setdefault(key, {})[workload.uid] = endpoint
            service = self._by_key.get(key)
            if service is not None and _include_endpoint(service, endpoint):
                service.endpoints[workload.uid] = endpoint

    def remove_workload(self, uid: str) -> None:
        for key in self._workload_services.pop(uid, ()):
            _discard(self._declared, key, uid)
            service = self._by_key.get(key)
            if service is not None:
                service.endpoints.pop(uid, None)

    def staged_endpoints(self, key: str) -> list[Endpoint]:
        """Endpoints declared for a service that has not arrived yet."""
        if key in self._by_key:
            return []
        return list(self._declared.get(key, {}).values())

    # -- lookups --------------------------------------------------------------------------------

    def find_vip(self, network: str, ip: IPAddress, client_namespace: str | None = None) -> Service | None:
        """The service owning VIP `ip` on `network`, as seen by a client in `client_namespace`.

        Exact VIPs win over CIDR VIPs. Among exact matches: the client's namespace, then a canonical service,
        then the first to arrive. Among CIDR matches: the client's namespace, then the longest prefix, then
        canonical (docs/istio-behaviour.md, "Workloads and services").
        """
        keys = self._by_vip.get((network, ip))
        if keys:
            found = self._rank(
                (self._by_key[key] for key in keys),
                client_namespace,
                lambda s: _exact_rank(s, client_namespace),
            )
            if found is not None:
                return found
        best: Service | None = None
        best_rank: tuple[bool, int, bool] | None = None
        for key in self._with_cidrs:
            service = self._by_key[key]
            if not _visible(service, client_namespace):
                continue
            longest = -1
            for cidr_network, cidr in service.cidr_vips:
                if cidr_network == network and cidr.version == ip.version and ip in cidr:
                    longest = max(longest, cidr.prefixlen)
            if longest < 0:
                continue
            rank = (service.namespace == client_namespace, longest, service.canonical)
            if best_rank is None or rank > best_rank:
                best, best_rank = service, rank
        return best

    @property
    def hostname_count(self) -> int:
        return len(self._by_hostname)

    def services_for_hostname(self, hostname: str) -> list[Service]:
        """Every service with this host name, in arrival order (DNS ranks them itself)."""
        return [self._by_key[key] for key in self._by_hostname.get(hostname.lower(), ())]

    def find_hostname(self, hostname: str, client_namespace: str | None = None) -> Service | None:
        keys = self._by_hostname.get(hostname.lower())
        if not keys:
            return None
        return self._rank(
            (self._by_key[key] for key in keys), client_namespace, lambda s: _exact_rank(s, client_namespace)
        )

    @staticmethod
    def _rank(
        services: Iterable[Service], client_namespace: str | None, rank: Callable[[Service], tuple[bool, ...]]
    ) -> Service | None:
        visible = [s for s in services if _visible(s, client_namespace)]
        if not visible:
            return None
        return max(visible, key=rank)  # max() keeps the first of equals: arrival order

    def services_for_workload(self, uid: str) -> list[Service]:
        """Known services the workload declares itself an endpoint of, sorted by key."""
        keys = self._workload_services.get(uid, ())
        return [self._by_key[key] for key in sorted(keys) if key in self._by_key]

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def __iter__(self) -> Iterator[Service]:
        return iter([self._by_key[key] for key in sorted(self._by_key)])

    def __repr__(self) -> str:
        staged = sum(len(eps) for key, eps in self._declared.items() if key not in self._by_key)
        endpoints = sum(len(s.endpoints) for s in self._by_key.values())
        return f"<ServiceStore: {len(self._by_key)} services, {endpoints} endpoints, {staged} staged>"


Listener = Callable[["ProxyState"], None]


class ProxyState:
    """Workloads, services and authorization policies, with a version and change listeners.

    One writer: `xds.updater.StateUpdater` (fed by xDS or the local config file) changes the
    stores and then calls `notify_changed` once per batch. Everything else reads, through the
    `StateReader` view below (the proxy and the DNS proxy are typed against it).
    """

    def __init__(self) -> None:
        self.workloads = WorkloadStore()
        self.services = ServiceStore()
        self.policies: PolicyIndex = PolicyIndex()  # a dict of ns/name -> policy, indexed by scope
        self.version = 0
        self._listeners: list[Listener] = []

    # -- listeners ------------------------------------------------------------------------------

    def add_listener(self, callback: Listener) -> Callable[[], None]:
        """Call `callback(state)` after every change; returns a function that unsubscribes."""
        self._listeners.append(callback)

        def unsubscribe() -> None:
            if callback in self._listeners:
                self._listeners.remove(callback)

        return unsubscribe

    def notify_changed(self) -> None:
        """Bump the version and call the listeners once (writers that batch call this at the end)."""
        self.version += 1
        for callback in list(self._listeners):
            callback(self)

    def __repr__(self) -> str:
        return (
            f"<ProxyState v{self.version}: {len(self.workloads)} workloads, "
            f"{len(self.services)} services, {len(self.policies)} policies>"
        )


# -- the read-only view --------------------------------------------------------------------------
#
# What the proxy and the DNS proxy may do with the state: look things up and listen for changes.
# ProxyState (and its stores) fit these protocols; typing the readers against them makes a write
# from the proxy a type error (ARCHITECTURE.md: the proxy only reads state).


class WorkloadReader(Protocol):
    def find_uid(self, uid: str) -> Workload | None: ...

    def find_address(self, network: str, ip: IPAddress) -> Workload | None: ...

    def find_by_identity(self, identity: Identity) -> list[Workload]: ...

    def find_by_name(self, namespace: str, name: str) -> list[Workload]: ...

    def __len__(self) -> int: ...

    def __contains__(self, uid: object) -> bool: ...

    def __iter__(self) -> Iterator[Workload]: ...


class ServiceReader(Protocol):
    def get(self, key: str) -> Service | None: ...

    def staged_endpoints(self, key: str) -> list[Endpoint]: ...

    def find_vip(
        self, network: str, ip: IPAddress, client_namespace: str | None = None
    ) -> Service | None: ...

    @property
    def hostname_count(self) -> int: ...

    def services_for_hostname(self, hostname: str) -> list[Service]: ...

    def find_hostname(self, hostname: str, client_namespace: str | None = None) -> Service | None: ...

    def services_for_workload(self, uid: str) -> list[Service]: ...

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...

    def __iter__(self) -> Iterator[Service]: ...


class PolicyReader(Protocol):
    def check(self, workload: PolicyTarget, conn: RbacConnection) -> Decision: ...

    def __getitem__(self, key: str) -> Authorization: ...

    def __contains__(self, key: object) -> bool: ...

    def __iter__(self) -> Iterator[str]: ...

    def __len__(self) -> int: ...


@runtime_checkable  # the DNS server takes a StateReader or its own MeshView
class StateReader(Protocol):
    @property
    def workloads(self) -> WorkloadReader: ...

    @property
    def services(self) -> ServiceReader: ...

    @property
    def policies(self) -> PolicyReader: ...

    @property
    def version(self) -> int: ...

    def add_listener(self, callback: Callable[[ProxyState], None]) -> Callable[[], None]: ...


# -- load balancing (docs/istio-behaviour.md, "Load balancing") ------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Upstream:
    """The endpoint chosen for a service and the port to reach it on."""

    workload: Workload
    port: int


def target_port(service: Service, endpoint: Endpoint, workload: Workload, service_port: int) -> int | None:
    """Service port -> workload port: the endpoint's own map, then the service's non-zero map,
    else (application tunnel with a port) the service port itself; None when unmapped."""
    if service_port in endpoint.port:
        return endpoint.port[service_port]
    mapped = service.ports.get(service_port, 0)
    if mapped:
        return mapped
    if workload.application_tunnel is not None and workload.application_tunnel.port:
        return service_port
    return None


def _scope_matches(scope: LoadBalancingScope, source: Workload, candidate: Workload, node: str) -> bool:
    match scope:
        case LoadBalancingScope.REGION:
            return source.locality.region == candidate.locality.region
        case LoadBalancingScope.ZONE:
            return source.locality.zone == candidate.locality.zone
        case LoadBalancingScope.SUBZONE:
            return source.locality.subzone == candidate.locality.subzone
        case LoadBalancingScope.NODE:
            return (source.node or node) == candidate.node
        case LoadBalancingScope.CLUSTER:
            return source.cluster_id == candidate.cluster_id
        case LoadBalancingScope.NETWORK:
            return source.network == candidate.network
    raise AssertionError(scope)


def locality_rank(
    preferences: tuple[LoadBalancingScope, ...], source: Workload, candidate: Workload, node: str
) -> int:
    """How many leading routing preferences the candidate shares with the source.

    A leading NETWORK preference is a gate: when it matches it is worth (n - 1) more, so an endpoint on the
    caller's network always outranks one that is not (docs/istio-behaviour.md, "Load balancing").
    """
    rank = 0
    for scope in preferences:
        if not _scope_matches(scope, source, candidate, node):
            break
        rank += 1
    if preferences and preferences[0] is LoadBalancingScope.NETWORK and rank > 0:
        rank += len(preferences) - 1
    return rank


def load_balance(
    state: StateReader,
    service: Service,
    source_workload: Workload,
    *,
    port: int,
    node: str,
    rng: random.Random,
    for_waypoint: bool = False,
) -> Upstream | None:
    """Pick one endpoint of `service` for a connection to service port `port`, or None.

    PASSTHROUGH services are the caller's business (no endpoint is chosen for them). With
    `for_waypoint`, a waypoint with an application tunnel is usable whatever the port.
    """
    lb = service.load_balancer
    candidates: list[tuple[Workload, int]] = []
    for endpoint in service.endpoints.values():
        workload = state.workloads.find_uid(endpoint.workload_uid)
        if workload is None:
            continue
        if not workload.workload_ips and not workload.hostname:
            # Only reachable through its network's gateway, and only from another network.
            if workload.network_gateway is None or workload.network == source_workload.network:
                continue
        if for_waypoint and workload.application_tunnel is not None:
            candidates.append((workload, port))
            continue
        resolved = target_port(service, endpoint, workload, port)
        if resolved is None:
            continue
        candidates.append((workload, resolved))
    if not candidates:
        return None
    if lb is not None and lb.mode in (LoadBalancingMode.STRICT, LoadBalancingMode.FAILOVER):
        preferences = lb.routing_preferences
        if lb.mode is LoadBalancingMode.STRICT:
            candidates = [
                (w, p)
                for w, p in candidates
                if all(_scope_matches(scope, source_workload, w, node) for scope in preferences)
            ]
        ranked = [(locality_rank(preferences, source_workload, w, node), w, p) for w, p in candidates]
        if not ranked:
            return None
        top = max(r[0] for r in ranked)
        candidates = [(w, p) for rank, w, p in ranked if rank == top]
    weights = [w.capacity for w, _ in candidates]
    if sum(weights) <= 0:
        # All capacity zero: nothing is preferred, so treat them equally rather than fail.
        weights = [1] * len(candidates)
    workload, resolved = rng.choices(candidates, weights=weights)[0]
    return Upstream(workload=workload, port=resolved)


# -- helpers -----------------------------------------------------------------------------------


def _include_endpoint(service: Service, endpoint: Endpoint) -> bool:
    if endpoint.status is WorkloadStatus.HEALTHY:
        return True
    lb = service.load_balancer
    return lb is not None and lb.health_policy is HealthPolicy.ALLOW_ALL


def _visible(service: Service, client_namespace: str | None) -> bool:
    # NAMESPACE visibility: only clients in the service's own namespace may resolve it.
    return service.visibility is not Visibility.NAMESPACE or service.namespace == client_namespace


def _exact_rank(service: Service, client_namespace: str | None) -> tuple[bool, bool]:
    return (service.namespace == client_namespace, service.canonical)


def _identity_or_none(workload: Workload) -> Identity | None:
    try:
        return workload.identity
    except IdentityError:  # e.g. no namespace: such a workload cannot be found by identity
        return None


def _discard(index: MutableMapping[_K, dict[str, _V]], key: _K, member: str) -> None:
    members = index.get(key)
    if members is None:
        return
    members.pop(member, None)
    if not members:
        del index[key]


def _uid(workload: Workload) -> str:
    return workload.uid


__all__ = [
    "ProxyState",
    "ServiceStore",
    "Upstream",
    "WorkloadStore",
    "load_balance",
    "locality_rank",
    "target_port",
]
