"""Wire protobuf -> the node proxy's model, at the edge only.

Counterparts: ztunnel's `TryFrom` conversions in src/state/workload.rs, src/state/service.rs
and src/rbac.rs. Facts: docs/istio-behaviour.md, "Workloads and services" (what
ztunnel rejects) and "Authorization".

Each converter returns a finished, frozen model object or raises `XdsRejection`; the session
turns a rejection into one entry of a NACK and never stores a half-built object. What ztunnel
rejects we reject; what ztunnel tolerates (an empty StringMatch, an authorization Address whose
IP cannot be decoded, an unknown Service.Visibility or WorkloadType) we tolerate the same way.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from google.protobuf.message import DecodeError

from ..errors import ProtocolError
from ..identity.spiffe import DEFAULT_SERVICE_ACCOUNT, DEFAULT_TRUST_DOMAIN
from ..net import IPAddress, ip_address
from ..rbac import (
    Action,
    Authorization,
    Clause,
    IPNetwork,
    Match,
    Rule,
    Scope,
    ServiceAccountMatch,
    StringMatch,
)
from ..state.model import (
    ApplicationTunnel,
    AppTunnelProtocol,
    GatewayAddress,
    HealthPolicy,
    IpFamilies,
    LoadBalancing,
    LoadBalancingMode,
    LoadBalancingScope,
    Locality,
    NamespacedHostname,
    NetworkAddress,
    NetworkMode,
    Service,
    TunnelProtocol,
    Visibility,
    WeightedWaypoint,
    Workload,
    WorkloadStatus,
    WorkloadType,
)
from ..wire import ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL
from ..wire.istio.security import authorization_pb2
from ..wire.istio.workload import workload_pb2

# An empty cluster_id means the default cluster (docs/istio-behaviour.md, "Workloads and services", ztunnel
# src/state/workload.rs).
DEFAULT_CLUSTER_ID = "Kubernetes"
# Workload.capacity is a UInt32Value wrapper: absent means 1 (docs/istio-behaviour.md, "Wire types").
DEFAULT_CAPACITY = 1
# ztunnel narrows wire uint32 ports with `as u16`; we keep the same arithmetic so that a
# resource means the same thing to both proxies.
_U16_MASK = 0xFFFF
_E = TypeVar("_E")
_P = TypeVar("_P")
_R = TypeVar("_R")

W = workload_pb2
A = authorization_pb2


class XdsRejection(ProtocolError):
    """One xDS resource that cannot be used: it becomes `"<name>: <reason>"` in a NACK."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name}: {reason}")
        self.name = name
        self.reason = reason


class _Invalid(Exception):
    """Raised deep inside a conversion; the public entry point adds the resource name."""


# -- enums (wire number -> model); a number not in the table rejects the resource -------------

_TUNNEL = {W.NONE: TunnelProtocol.TCP, W.HBONE: TunnelProtocol.HBONE}
_STATUS = {W.HEALTHY: WorkloadStatus.HEALTHY, W.UNHEALTHY: WorkloadStatus.UNHEALTHY}
_NETWORK_MODE = {W.STANDARD: NetworkMode.STANDARD, W.HOST_NETWORK: NetworkMode.HOST_NETWORK}
_WORKLOAD_TYPE = {
    W.DEPLOYMENT: WorkloadType.DEPLOYMENT,
    W.CRONJOB: WorkloadType.CRONJOB,
    W.POD: WorkloadType.POD,
    W.JOB: WorkloadType.JOB,
}
_IP_FAMILIES = {
    W.AUTOMATIC: IpFamilies.AUTOMATIC,
    W.IPV4_ONLY: IpFamilies.IPV4_ONLY,
    W.IPV6_ONLY: IpFamilies.IPV6_ONLY,
    W.DUAL: IpFamilies.DUAL,
}
_APP_TUNNEL = {
    W.ApplicationTunnel.NONE: AppTunnelProtocol.NONE,
    W.ApplicationTunnel.PROXY: AppTunnelProtocol.PROXY,
}
# UNSPECIFIED_SCOPE is deliberately absent: ztunnel refuses it as a routing preference.
_LB_SCOPE = {
    W.LoadBalancing.REGION: LoadBalancingScope.REGION,
    W.LoadBalancing.ZONE: LoadBalancingScope.ZONE,
    W.LoadBalancing.SUBZONE: LoadBalancingScope.SUBZONE,
    W.LoadBalancing.NODE: LoadBalancingScope.NODE,
    W.LoadBalancing.CLUSTER: LoadBalancingScope.CLUSTER,
    W.LoadBalancing.NETWORK: LoadBalancingScope.NETWORK,
}
_LB_MODE = {
    W.LoadBalancing.UNSPECIFIED_MODE: LoadBalancingMode.STANDARD,
    W.LoadBalancing.STRICT: LoadBalancingMode.STRICT,
    W.LoadBalancing.FAILOVER: LoadBalancingMode.FAILOVER,
    W.LoadBalancing.PASSTHROUGH: LoadBalancingMode.PASSTHROUGH,
}
_HEALTH_POLICY = {
    W.LoadBalancing.ONLY_HEALTHY: HealthPolicy.ONLY_HEALTHY,
    W.LoadBalancing.ALLOW_ALL: HealthPolicy.ALLOW_ALL,
}
_SCOPE = {A.GLOBAL: Scope.GLOBAL, A.NAMESPACE: Scope.NAMESPACE, A.WORKLOAD_SELECTOR: Scope.WORKLOAD_SELECTOR}
_ACTION = {A.ALLOW: Action.ALLOW, A.DENY: Action.DENY}


def _enum(table: Mapping[Any, _E], value: int, what: str) -> _E:
    try:
        return table[value]
    except KeyError:
        if what == "tunnel_protocol" and value == W.LEGACY_ISTIO_MTLS:
            raise _Invalid("tunnel protocol LEGACY_ISTIO_MTLS is not supported") from None
        raise _Invalid(f"unknown {what} value {value}") from None


# -- shared pieces -----------------------------------------------------------------------------


def _ip(raw: bytes, what: str) -> IPAddress:
    # Exactly 4 or 16 bytes in network order (spec conventions); anything else is a decode error.
    if len(raw) not in (4, 16):
        raise _Invalid(f"{what}: an IP address must be 4 or 16 bytes, got {len(raw)}")
    return ip_address(raw)


def _ports(ports: Iterable[workload_pb2.Port]) -> dict[int, int]:
    return {p.service_port & _U16_MASK: p.target_port & _U16_MASK for p in ports}


def _network_address(pb: workload_pb2.NetworkAddress, what: str) -> NetworkAddress:
    return NetworkAddress(network=pb.network, address=_ip(pb.address, what))


def _gateway(pb: workload_pb2.GatewayAddress, what: str) -> GatewayAddress:
    kind = pb.WhichOneof("destination")
    if kind == "address":
        destination: NetworkAddress | NamespacedHostname = _network_address(pb.address, what)
    elif kind == "hostname":
        destination = NamespacedHostname(namespace=pb.hostname.namespace, hostname=pb.hostname.hostname)
    else:
        raise _Invalid(f"{what}: gateway address has no destination")
    return GatewayAddress(destination=destination, hbone_mtls_port=pb.hbone_mtls_port & _U16_MASK)


def _named(name: str, fn: Callable[[_P], _R], pb: _P) -> _R:
    try:
        return fn(pb)
    except _Invalid as e:
        raise XdsRejection(name, str(e)) from None


# -- workloads ---------------------------------------------------------------------------------


def workload_from_proto(pb: workload_pb2.Workload, *, name: str | None = None) -> Workload:
    """An `istio.workload.Workload` as a model Workload, with the xDS defaults applied."""
    return _named(pb.uid if name is None else name, _workload, pb)


def _workload(pb: workload_pb2.Workload) -> Workload:
    services: dict[str, dict[int, int]] = {}
    for key, port_list in pb.services.items():
        # The key names a service as `namespace/hostname`; the endpoint is useless without it.
        if "/" not in key:
            raise _Invalid(f"services key {key!r} is not of the form namespace/hostname")
        services[key] = _ports(port_list.ports)
    application_tunnel = None
    if pb.HasField("application_tunnel"):
        application_tunnel = ApplicationTunnel(
            protocol=_enum(_APP_TUNNEL, pb.application_tunnel.protocol, "application_tunnel.protocol"),
            port=pb.application_tunnel.port & _U16_MASK,
        )
    locality = Locality()
    if pb.HasField("locality"):
        locality = Locality(region=pb.locality.region, zone=pb.locality.zone, subzone=pb.locality.subzone)
    return Workload(
        uid=pb.uid,
        name=pb.name,
        namespace=pb.namespace,
        workload_ips=tuple(_ip(raw, "addresses") for raw in pb.addresses),
        hostname=pb.hostname,
        network=pb.network,
        protocol=_enum(_TUNNEL, pb.tunnel_protocol, "tunnel_protocol"),
        network_mode=_enum(_NETWORK_MODE, pb.network_mode, "network_mode"),
        trust_domain=pb.trust_domain or DEFAULT_TRUST_DOMAIN,
        service_account=pb.service_account or DEFAULT_SERVICE_ACCOUNT,
        waypoint=_gateway(pb.waypoint, "waypoint") if pb.HasField("waypoint") else None,
        network_gateway=(
            _gateway(pb.network_gateway, "network_gateway") if pb.HasField("network_gateway") else None
        ),
        node=pb.node,
        canonical_name=pb.canonical_name,
        canonical_revision=pb.canonical_revision,
        # ztunnel reads this enum through prost's lenient accessor: unknown numbers mean DEPLOYMENT.
        workload_type=_WORKLOAD_TYPE.get(pb.workload_type, WorkloadType.DEPLOYMENT),
        workload_name=pb.workload_name,
        native_tunnel=pb.native_tunnel,
        application_tunnel=application_tunnel,
        services=services,
        authorization_policies=tuple(pb.authorization_policies),
        status=_enum(_STATUS, pb.status, "status"),
        cluster_id=pb.cluster_id or DEFAULT_CLUSTER_ID,
        locality=locality,
        capacity=pb.capacity.value if pb.HasField("capacity") else DEFAULT_CAPACITY,
    )


# -- services ----------------------------------------------------------------------------------


def service_from_proto(pb: workload_pb2.Service, *, name: str | None = None) -> Service:
    """An `istio.workload.Service` as a model Service (without endpoints: workloads bring them)."""
    return _named(f"{pb.namespace}/{pb.hostname}" if name is None else name, _service, pb)


def _service(pb: workload_pb2.Service) -> Service:
    vips: list[NetworkAddress] = []
    cidr_vips: list[tuple[str, IPNetwork]] = []
    for entry in pb.addresses:
        ip = _ip(entry.address, "addresses")
        full = ip.max_prefixlen
        # A prefix length that is present and shorter than the address makes a CIDR VIP; absent or full length
        # is a single VIP (docs/istio-behaviour.md, "Workloads and services", NetworkAddress.length).
        if entry.HasField("length") and entry.length != full:
            if entry.length > full:
                raise _Invalid(f"addresses: prefix length {entry.length} is too long for {ip}")
            cidr_vips.append((entry.network, ipaddress.ip_network((ip, entry.length), strict=False)))
        else:
            vips.append(NetworkAddress(network=entry.network, address=ip))
    weighted = []
    for ww in pb.weighted_waypoints:
        if not ww.HasField("destination"):
            raise _Invalid("weighted_waypoints: entry has no destination")
        weighted.append(
            WeightedWaypoint(destination=_gateway(ww.destination, "weighted_waypoints"), weight=ww.weight)
        )
    load_balancer = None
    if pb.HasField("load_balancing"):
        lb = pb.load_balancing
        load_balancer = LoadBalancing(
            routing_preferences=tuple(
                _enum(_LB_SCOPE, scope, "load_balancing.routing_preference")
                for scope in lb.routing_preference
            ),
            mode=_enum(_LB_MODE, lb.mode, "load_balancing.mode"),
            health_policy=_enum(_HEALTH_POLICY, lb.health_policy, "load_balancing.health_policy"),
        )
    return Service(
        name=pb.name,
        namespace=pb.namespace,
        hostname=pb.hostname,
        vips=tuple(vips),
        cidr_vips=tuple(cidr_vips),
        ports=_ports(pb.ports),
        subject_alt_names=tuple(pb.subject_alt_names),
        waypoint=_gateway(pb.waypoint, "waypoint") if pb.HasField("waypoint") else None,
        weighted_waypoints=tuple(weighted),
        load_balancer=load_balancer,
        ip_families=_enum(_IP_FAMILIES, pb.ip_families, "ip_families"),
        canonical=pb.canonical,
        # Unknown visibility values are treated as PUBLIC, as ztunnel does (docs/istio-behaviour.md,
        # "Workloads and services").
        visibility=Visibility.NAMESPACE if pb.visibility == W.Service.NAMESPACE else Visibility.PUBLIC,
    )


# -- authorization -----------------------------------------------------------------------------


def authorization_from_proto(
    pb: authorization_pb2.Authorization, *, name: str | None = None
) -> Authorization:
    """An `istio.security.Authorization` as the rbac model."""
    return _named(f"{pb.namespace}/{pb.name}" if name is None else name, _authorization, pb)


def _authorization(pb: authorization_pb2.Authorization) -> Authorization:
    return Authorization(
        name=pb.name,
        namespace=pb.namespace,
        scope=_enum(_SCOPE, pb.scope, "scope"),
        action=_enum(_ACTION, pb.action, "action"),
        rules=tuple(
            Rule(clauses=tuple(Clause(matches=tuple(_match(m) for m in c.matches)) for c in r.clauses))
            for r in pb.rules
        ),
        dry_run=pb.dry_run,
    )


def _match(pb: authorization_pb2.Match) -> Match:
    return Match(
        namespaces=_string_matches(pb.namespaces),
        not_namespaces=_string_matches(pb.not_namespaces),
        principals=_string_matches(pb.principals),
        not_principals=_string_matches(pb.not_principals),
        service_accounts=_sa_matches(pb.service_accounts),
        not_service_accounts=_sa_matches(pb.not_service_accounts),
        source_ips=_cidrs(pb.source_ips),
        not_source_ips=_cidrs(pb.not_source_ips),
        destination_ips=_cidrs(pb.destination_ips),
        not_destination_ips=_cidrs(pb.not_destination_ips),
        destination_ports=tuple(p & _U16_MASK for p in pb.destination_ports),
        not_destination_ports=tuple(p & _U16_MASK for p in pb.not_destination_ports),
    )


def _string_matches(items: Iterable[authorization_pb2.StringMatch]) -> tuple[StringMatch, ...]:
    out = []
    for item in items:
        kind = item.WhichOneof("match_type")
        # A matcher with no member set says nothing; ztunnel drops it rather than rejecting.
        if kind == "exact":
            out.append(StringMatch.exact(item.exact))
        elif kind == "prefix":
            out.append(StringMatch.prefix(item.prefix))
        elif kind == "suffix":
            out.append(StringMatch.suffix(item.suffix))
        elif kind == "presence":
            out.append(StringMatch.presence())
    return tuple(out)


def _sa_matches(items: Iterable[authorization_pb2.ServiceAccountMatch]) -> tuple[ServiceAccountMatch, ...]:
    return tuple(ServiceAccountMatch(namespace=i.namespace, service_account=i.serviceAccount) for i in items)


def _cidrs(items: Iterable[authorization_pb2.Address]) -> tuple[IPNetwork, ...]:
    out = []
    for item in items:
        # ztunnel silently skips an entry it cannot decode (bad length, prefix too long).
        if len(item.address) not in (4, 16):
            continue
        ip = ip_address(item.address)
        if item.length > ip.max_prefixlen:
            continue
        out.append(ipaddress.ip_network((ip, item.length), strict=False))
    return tuple(out)


# -- whole resources ---------------------------------------------------------------------------


def address_from_resource(name: str, value: bytes) -> Workload | Service:
    """Decode `Resource.resource.value` as an `istio.workload.Address` named `name`.

    The Any's inner type_url is not checked, as in ztunnel: the response's type_url decides.
    """
    pb = workload_pb2.Address()
    try:
        pb.ParseFromString(value)
    except DecodeError as e:
        raise XdsRejection(name, f"decode: {e}") from None
    kind = pb.WhichOneof("type")
    if kind == "workload":
        return workload_from_proto(pb.workload, name=name)
    if kind == "service":
        return service_from_proto(pb.service, name=name)
    raise XdsRejection(name, "unknown address type: neither workload nor service is set")


def authorization_from_resource(name: str, value: bytes) -> Authorization:
    """Decode `Resource.resource.value` as an `istio.security.Authorization` named `name`."""
    pb = authorization_pb2.Authorization()
    try:
        pb.ParseFromString(value)
    except DecodeError as e:
        raise XdsRejection(name, f"decode: {e}") from None
    return authorization_from_proto(pb, name=name)


__all__ = [
    "ADDRESS_TYPE_URL",
    "AUTHORIZATION_TYPE_URL",
    "XdsRejection",
    "address_from_resource",
    "authorization_from_proto",
    "authorization_from_resource",
    "service_from_proto",
    "workload_from_proto",
]
