"""Which served Addresses each waypoint carries, kept up to date per change, and each waypoint's
Envoy snapshot.

Counterpart: istiod's `findWaypointResources` (pilot/pkg/networking/core/waypoint.go: the services
and workloads whose waypoint is this proxy's Gateway) and the push context's per-proxy config
cache. The input is the change `AmbientIndex.apply` already computed (the Addresses it replaced
or removed), so nothing is translated twice: a service or workload is read from the same
`istio.workload.Address` message ztunnel is served. A change marks the waypoints it touches (its
old and new waypoint, and for a workload the waypoints of the services it serves); only those are
built again, and a rebuilt waypoint's snapshot keeps every resource whose bytes did not change,
so its Envoy is sent only the resources that did.

A waypoint is named by its Service's xDS name (`<namespace>/<gateway>.<namespace>.svc.<suffix>`):
that is what a `GatewayAddress.hostname` carries. A Gateway addressed by IP (`status.addresses`
of type IPAddress) is found through the Service owning that VIP.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from ..identity.spiffe import Identity
from ..kube.model import ObjectKey
from ..kube.store import KubeStore
from ..wire.istio.workload import workload_pb2 as wl
from .ads_state import ProxyInfo, Snapshot
from .envoy_parse_cache import ParseCache
from .translate import MeshSettings
from .translate.http_routes import namespace_of
from .waypoint_envoy import (
    EnvoyResources,
    ServicePort,
    WaypointInputs,
    build_resources,
    ip_text,
    service_ports,
    workload_port_protocols,
)
from .waypoint_l7 import ACCESS_LOG, WaypointL7

log = logging.getLogger(__name__)


def waypoint_key(namespace: str, gateway: str, domain_suffix: str) -> str:
    return f"{namespace}/{gateway}.{namespace}.svc.{domain_suffix}"


def _ref(address: wl.GatewayAddress) -> str | None:
    """What a GatewayAddress points at: a waypoint key, or `ip:<vip>` to resolve later."""
    kind = address.WhichOneof("destination")
    if kind == "hostname":
        return f"{address.hostname.namespace}/{address.hostname.hostname}"
    if kind == "address":
        ip = ip_text(address.address.address)
        return f"ip:{ip}" if ip else None
    return None


class WaypointIndex:
    """Addresses by the waypoint they name, and each connected waypoint's Envoy snapshot."""

    def __init__(self, settings: MeshSettings | None = None) -> None:
        self.settings = settings or MeshSettings()
        self._addresses: dict[str, wl.Address] = {}
        self._ref_of: dict[str, str] = {}  # address name -> the waypoint ref it names
        self._named_by: dict[str, set[str]] = {}  # waypoint ref -> address names naming it
        self._endpoints: dict[str, set[str]] = {}  # service name -> workload uids serving it
        self._vip_owner: dict[str, set[str]] = {}  # VIP -> service names carrying it
        self._snapshots: dict[str, Snapshot] = {}  # waypoint key -> snapshot, for those asked
        self._version = 0
        # Part 2 hook: routes and L7 policy (waypoint_l7.py); `_l7_dirty` holds the waypoints
        # an L7 change touched, built again on the next `apply`.
        self.l7 = WaypointL7(self.settings)
        self._l7_dirty: set[str] = set()
        self._parse_caches: dict[str, ParseCache] = {}
        # service name -> (its Address and its endpoints' Addresses, its ServicePorts)
        self._ports: dict[str, tuple[tuple[wl.Address, ...], tuple[ServicePort, ...]]] = {}

    def __repr__(self) -> str:
        return f"WaypointIndex({len(self._addresses)} addresses, {len(self._named_by)} waypoints named, {len(self._snapshots)} built)"

    # -- what a proxy is ------------------------------------------------------------------------

    def key_of(self, proxy: ProxyInfo, identity: Identity | None) -> str:
        """The waypoint a connected proxy is: its pod's gateway-name label, else (as istiod
        deploys a waypoint under a service account named after its Gateway) its identity's
        service account."""
        gateway = proxy.gateway_name or (identity.service_account if identity is not None else "")
        if not gateway:
            gateway = proxy.pod_name
        return waypoint_key(proxy.namespace, gateway, self.settings.domain_suffix)

    def snapshot(self, key: str) -> Snapshot:
        """The Envoy snapshot of one waypoint, built on first ask and kept up to date after."""
        snap = self._snapshots.get(key)
        if snap is None:
            snap = self._build(key, previous=None)
            self._snapshots[key] = snap
        return snap

    def resources(self, key: str) -> EnvoyResources:
        # Part 2 hook: each built waypoint keeps its parsed resources (envoy_parse_cache.py).
        cache = self._parse_caches.setdefault(key, ParseCache())
        return build_resources(self.inputs(key), cache)

    # -- changes --------------------------------------------------------------------------------

    def reset(self, addresses: Mapping[str, wl.Address]) -> set[str]:
        """Start again from the whole set; returns the built waypoints whose snapshot changed."""
        removed = [name for name in self._addresses if name not in addresses]
        return self.apply(addresses, removed)

    def apply(self, addresses: Mapping[str, wl.Address], removed: Iterable[str] = ()) -> set[str]:
        """Follow replaced and removed Addresses; returns the built waypoints whose snapshot changed."""
        refs: set[str] = set()
        for name in removed:
            old = self._addresses.pop(name, None)
            if old is not None:
                refs |= self._unlink(name, old)
        for name, addr in addresses.items():
            old = self._addresses.get(name)
            if old is addr:
                continue
            if old is not None:
                refs |= self._unlink(name, old)
            self._addresses[name] = addr
            refs |= self._link(name, addr)
        touched = self._resolve(refs) | self._l7_dirty
        self._l7_dirty = set()
        changed = set()
        for key in touched & set(self._snapshots):
            before = self._snapshots[key]
            after = self._build(key, previous=before)
            if any(after.changed.values()) if after.changed is not None else True:
                self._snapshots[key] = after
                changed.add(key)
        return changed

    def update_l7(self, store: KubeStore, changed: Iterable[ObjectKey] | None = None) -> None:
        """Part 2 hook: follow the route objects of `store`; the waypoints serving a hostname
        whose routes changed are built again on the next `apply`."""
        changed = list(changed) if changed is not None else None
        if self.l7.update_policies(store, changed):
            self._l7_dirty |= set(self._snapshots)
        hosts = self.l7.update(store, changed)
        refs = {
            self._ref_of[name] for name in (f"{namespace_of(h)}/{h}" for h in hosts) if name in self._ref_of
        }
        self._l7_dirty |= self._resolve(refs)

    def _link(self, name: str, addr: wl.Address) -> set[str]:
        refs = self._refs(name, addr)
        kind = addr.WhichOneof("type")
        own = addr.service.waypoint if kind == "service" else addr.workload.waypoint
        if kind in ("service", "workload") and own.WhichOneof("destination"):
            ref = _ref(own)
            if ref is not None:
                self._ref_of[name] = ref
                self._named_by.setdefault(ref, set()).add(name)
        if kind == "workload":
            for service in addr.workload.services:
                self._endpoints.setdefault(service, set()).add(name)
        elif kind == "service":
            for a in addr.service.addresses:
                ip = ip_text(a.address)
                if ip:
                    self._vip_owner.setdefault(ip, set()).add(name)
        return refs

    def _unlink(self, name: str, addr: wl.Address) -> set[str]:
        refs = self._refs(name, addr)
        ref = self._ref_of.pop(name, None)
        if ref is not None:
            _discard(self._named_by, ref, name)
        kind = addr.WhichOneof("type")
        if kind == "workload":
            for service in addr.workload.services:
                _discard(self._endpoints, service, name)
        elif kind == "service":
            for a in addr.service.addresses:
                ip = ip_text(a.address)
                if ip:
                    _discard(self._vip_owner, ip, name)
        return refs

    def _refs(self, name: str, addr: wl.Address) -> set[str]:
        """The waypoints one Address is part of: the one it names; for a workload, those of the
        services it serves; for a service, itself (a waypoint's own Service gives its VIPs)."""
        out: set[str] = set()
        kind = addr.WhichOneof("type")
        if kind == "service":
            ref = _ref(addr.service.waypoint) if addr.service.waypoint.WhichOneof("destination") else None
            out.add(name)
            # The waypoints of the workloads serving it: its ports give their ports' protocols.
            for uid in self._endpoints.get(name, ()):
                workload_ref = self._ref_of.get(uid)
                if workload_ref is not None:
                    out.add(workload_ref)
        elif kind == "workload":
            ref = _ref(addr.workload.waypoint) if addr.workload.waypoint.WhichOneof("destination") else None
            for service in addr.workload.services:
                svc_ref = self._ref_of.get(service)
                if svc_ref is not None:
                    out.add(svc_ref)
        else:
            ref = None
        if ref is not None:
            out.add(ref)
        return out

    def _resolve(self, refs: Iterable[str]) -> set[str]:
        keys: set[str] = set()
        for ref in refs:
            if ref.startswith("ip:"):
                keys.update(self._vip_owner.get(ref[3:], ()))
            else:
                keys.add(ref)
        return keys

    # -- building -------------------------------------------------------------------------------

    def inputs(self, key: str) -> WaypointInputs:
        """What the waypoint `key` serves: the services and workloads naming it (by its Service's
        hostname, or by one of that Service's VIPs)."""
        refs = {key}
        own = self._addresses.get(key)
        if own is not None and own.WhichOneof("type") == "service":
            refs.update(f"ip:{ip_text(a.address)}" for a in own.service.addresses)
        names = sorted({n for ref in refs for n in self._named_by.get(ref, ())})
        services: list[ServicePort] = []
        workload_ips: set[str] = set()
        workload_ports: dict[str, tuple[tuple[int, str], ...]] = {}
        for name in names:
            addr = self._addresses[name]
            if addr.WhichOneof("type") == "service":
                services.extend(self._service_ports(name, addr))
                continue
            # Its Services, whether or not they use a waypoint: their ports give its ports' protocols.
            served: dict[str, wl.Service] = {}
            for service_name in addr.workload.services:
                found = self._addresses.get(service_name)
                if found is not None and found.WhichOneof("type") == "service":
                    served[service_name] = found.service
            ports = workload_port_protocols(addr.workload, served)
            for ip in (ip_text(raw) for raw in addr.workload.addresses):
                if ip:
                    workload_ips.add(ip)
                    if ports:
                        workload_ports[ip] = ports
        return WaypointInputs(
            trust_domains=(self.settings.trust_domain,),
            services=tuple(services),
            workload_ips=tuple(sorted(workload_ips)),
            http_chains=self.l7.http_chains(_waypoint_of(key), services),
            tcp_filters=self.l7.tcp_filters(_waypoint_of(key), services),
            access_log=ACCESS_LOG,
            workload_ports=workload_ports,
        )

    def _service_ports(self, name: str, addr: wl.Address) -> tuple[ServicePort, ...]:
        """`service_ports` of one service, kept while the service's Address and its endpoints'
        Addresses are the same objects (`apply` replaces an Address that changed)."""
        endpoints = tuple(self._addresses[uid] for uid in sorted(self._endpoints.get(name, ())))
        held = (addr, *endpoints)
        hit = self._ports.get(name)
        if (
            hit is not None
            and len(hit[0]) == len(held)
            and all(a is b for a, b in zip(hit[0], held, strict=True))
        ):
            return hit[1]
        ports = tuple(service_ports(addr.service, [e.workload for e in endpoints]))
        self._ports[name] = (held, ports)
        return ports

    def _build(self, key: str, previous: Snapshot | None) -> Snapshot:
        self._version += 1
        resources = self.resources(key)
        return Snapshot.of_messages(
            version=str(self._version), messages=resources.by_type(), previous=previous
        )


def _waypoint_of(key: str) -> tuple[str, str]:
    """(namespace, Gateway name) of a waypoint key."""
    namespace, _, hostname = key.partition("/")
    return namespace, hostname.split(".", 1)[0]


def _discard(index: dict[str, set[str]], key: str, name: str) -> None:
    names = index.get(key)
    if names is not None:
        names.discard(name)
        if not names:
            del index[key]
