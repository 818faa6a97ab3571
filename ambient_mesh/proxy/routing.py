"""The outbound decision: where a connection captured on 15001 should go, and how.

Counterpart: ztunnel src/proxy/outbound.rs (`build_request`, `fetch_upstream`,
`fetch_waypoint`), behaviour from docs/istio-behaviour.md, "Outbound (15001)". A pure function over the
`StateReader`: it returns a `Route` plan (or a `RouteRefused` value) and the outbound shell
carries it out. Multi-network routing (double HBONE through an east-west gateway) and
hostname-only workloads (resolved by DNS on demand) are refused with a reason for now.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass

from ..errors import IdentityError, ResponseFlag
from ..identity.spiffe import Identity
from ..net import IPAddress, SocketAddr
from ..ports import HBONE_PORT
from ..state.model import (
    GatewayAddress,
    IpFamilies,
    LoadBalancingMode,
    NamespacedHostname,
    Service,
    TunnelProtocol,
    Workload,
)
from ..state.store import StateReader, load_balance

# Istio response flag for a connection we closed without reaching an upstream.


class RouteKind(enum.Enum):
    DIRECT_TCP = "direct_tcp"
    DIRECT_HBONE = "direct_hbone"
    WAYPOINT = "waypoint"
    PASSTHROUGH = "passthrough"


@dataclass(frozen=True, slots=True, kw_only=True)
class Route:
    kind: RouteKind
    # Where the proxy opens its TCP connection.
    actual_destination: SocketAddr
    # CONNECT :authority for the HBONE kinds; None for plain TCP.
    hbone_target: SocketAddr | None
    # Identities the HBONE server may present; empty for plain TCP.
    upstream_sans: tuple[Identity, ...]
    source_workload: Workload
    # The workload we connect to (for WAYPOINT: the waypoint itself).
    destination_workload: Workload | None
    # The service the client addressed, if it addressed one.
    destination_service: Service | None
    # The workload we connect to runs on this proxy's node.
    same_node: bool
    # No choice went into it (no load balancing, no weighted waypoint): the same state, source
    # and target give this same route again (outbound.py keeps such routes per state version).
    repeatable: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteRefused:
    reason: str
    response_flag: ResponseFlag = ResponseFlag.CONNECT
    self_call: bool = False  # the target is the proxy itself (ztunnel's Error::SelfCall)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Waypoint:
    workload: Workload
    port: int
    service: Service | None  # set when the waypoint was reached through its service


def build_request(
    state: StateReader,
    source: Workload,
    target: SocketAddr,
    *,
    network: str,
    node: str,
    illegal_ports: frozenset[int],
    rng: random.Random,
    self_ips: frozenset[IPAddress] = frozenset(),
) -> Route | RouteRefused:
    """Decide how to carry a connection from `source` to the original destination `target`.

    `illegal_ports` are the proxy's own listener ports; `self_ips` the addresses its listeners
    are bound to (besides the wildcard), which with loopback and the served workload's own
    addresses are where those ports would reach the proxy itself.
    """
    refused = _self_call(source, target, illegal_ports, self_ips)
    if refused is not None:
        return refused

    service = state.services.find_vip(network, target.ip, source.namespace)

    # Step 2: a service with a waypoint sends everything addressed to it through the waypoint.
    if service is not None:
        gateway = _pick_service_waypoint(service, rng)
        if gateway is not None:
            waypoint = _resolve_waypoint(state, gateway, source, network=network, node=node, rng=rng)
            if isinstance(waypoint, RouteRefused):
                return waypoint
            return _waypoint_route(waypoint, target, source, service, node=node)

    # Step 3: the upstream workload and port.
    if service is not None:
        lb = service.load_balancer
        if lb is not None and lb.mode is LoadBalancingMode.PASSTHROUGH:
            return _passthrough(source, target, service=service)
        upstream = load_balance(state, service, source, port=target.port, node=node, rng=rng)
        if upstream is None:
            return RouteRefused(reason=f"no healthy upstream for {service.key}:{target.port}")
        workload, port, service_addressed = upstream.workload, upstream.port, True
    else:
        found = state.workloads.find_address(network, target.ip)
        if found is None:
            # Not in the mesh as far as we know: plain TCP to where the client meant to go.
            return _passthrough(source, target, service=None)
        workload, port, service_addressed = found, target.port, False

    # Step 4: another network needs double HBONE through its east-west gateway.
    if workload.network != network:
        return RouteRefused(
            reason=f"workload {workload.uid} is on network {workload.network!r}, not {network!r}: "
            "multi-network (double HBONE) routing is not supported yet"
        )
    if not workload.workload_ips:
        return RouteRefused(
            reason=f"workload {workload.uid} has only a hostname: hostname workloads not supported yet"
        )

    # Step 5: a workload-addressed destination behind a waypoint, unless the waypoint is calling.
    if (
        not service_addressed
        and workload.waypoint is not None
        and not _is_source_the_waypoint(state, source, workload.waypoint)
    ):
        waypoint = _resolve_waypoint(state, workload.waypoint, source, network=network, node=node, rng=rng)
        if isinstance(waypoint, RouteRefused):
            return waypoint
        return _waypoint_route(waypoint, target, source, None, node=node)

    # Step 6: direct.
    ip = _select_ip(workload, target.ip, service)
    if ip is None:
        return RouteRefused(reason=f"workload {workload.uid} has no IP usable for {target}")
    same_node = bool(node) and workload.node == node
    # Addressed to the workload itself (no service): found by address, no choice made on the way.
    repeatable = service is None
    if workload.protocol is TunnelProtocol.HBONE:
        return Route(
            kind=RouteKind.DIRECT_HBONE,
            actual_destination=SocketAddr(ip, HBONE_PORT),
            hbone_target=SocketAddr(ip, port),
            upstream_sans=_sans(workload, service),
            source_workload=source,
            destination_workload=workload,
            destination_service=service,
            same_node=same_node,
            repeatable=repeatable,
        )
    return Route(
        kind=RouteKind.DIRECT_TCP,
        actual_destination=SocketAddr(ip, port),
        hbone_target=None,
        upstream_sans=(),
        source_workload=source,
        destination_workload=workload,
        destination_service=service,
        same_node=same_node,
        repeatable=repeatable,
    )


def _self_call(
    source: Workload, target: SocketAddr, illegal_ports: frozenset[int], self_ips: frozenset[IPAddress]
) -> RouteRefused | None:
    """Step 1: connections that would come back into this proxy (loops, trampolines).

    0.0.0.0 and :: name no host: connect() takes them as "this host", so on any port they reach
    the proxy's own network namespace (0.0.0.0:15008 reached our own HBONE listener). On one of
    the proxy's listener ports, loopback, the workload's own addresses and the listeners' bound
    addresses reach the proxy too (docs/istio-behaviour.md, "Ports", illegal_ports).
    """
    ip = target.ip
    if ip.is_unspecified:
        return RouteRefused(
            reason=f"self call to {target} refused: the unspecified address means this host; "
            "connect to the destination's real address",
            self_call=True,
        )
    if target.port in illegal_ports and (ip.is_loopback or ip in source.workload_ips or ip in self_ips):
        return RouteRefused(
            reason=f"self call to {target} refused: port {target.port} there is the proxy's own listener",
            self_call=True,
        )
    return None


def _passthrough(source: Workload, target: SocketAddr, *, service: Service | None) -> Route:
    return Route(
        kind=RouteKind.PASSTHROUGH,
        actual_destination=target,
        hbone_target=None,
        upstream_sans=(),
        source_workload=source,
        destination_workload=None,
        destination_service=service,
        same_node=False,
    )


def _pick_service_waypoint(service: Service, rng: random.Random) -> GatewayAddress | None:
    """A weighted waypoint chosen per connection; all-zero or none falls back to `waypoint`."""
    weighted = [w for w in service.weighted_waypoints if w.weight > 0]
    if weighted:
        return rng.choices([w.destination for w in weighted], weights=[w.weight for w in weighted])[0]
    return service.waypoint


def _resolve_waypoint(
    state: StateReader,
    gateway: GatewayAddress,
    source: Workload,
    *,
    network: str,
    node: str,
    rng: random.Random,
) -> _Waypoint | RouteRefused:
    destination = gateway.destination
    if isinstance(destination, NamespacedHostname):
        service = state.services.get(f"{destination.namespace}/{destination.hostname}")
        if service is None:
            return RouteRefused(reason=f"waypoint {destination} not found")
    else:
        workload = state.workloads.find_address(destination.network, destination.address)
        if workload is not None:
            return _checked_waypoint(workload, gateway.hbone_mtls_port, None, network)
        # istiod usually names a waypoint by its service VIP.
        service = state.services.find_vip(destination.network, destination.address, source.namespace)
        if service is None:
            return RouteRefused(reason=f"waypoint {destination} not found")
    upstream = load_balance(
        state, service, source, port=gateway.hbone_mtls_port, node=node, rng=rng, for_waypoint=True
    )
    if upstream is None:
        return RouteRefused(reason=f"no healthy upstream for waypoint {service.key}")
    return _checked_waypoint(upstream.workload, gateway.hbone_mtls_port, service, network)


def _checked_waypoint(
    workload: Workload, port: int, service: Service | None, network: str
) -> _Waypoint | RouteRefused:
    if workload.network != network:
        return RouteRefused(
            reason=f"waypoint {workload.uid} is on network {workload.network!r}, not {network!r}: "
            "multi-network (double HBONE) routing is not supported yet"
        )
    if not workload.workload_ips:
        return RouteRefused(
            reason=f"waypoint {workload.uid} has only a hostname: hostname workloads not supported yet"
        )
    return _Waypoint(workload=workload, port=port, service=service)


def _waypoint_route(
    waypoint: _Waypoint,
    target: SocketAddr,
    source: Workload,
    service: Service | None,
    *,
    node: str,
) -> Route | RouteRefused:
    ip = _select_ip(waypoint.workload, target.ip, waypoint.service)
    if ip is None:
        return RouteRefused(reason=f"waypoint {waypoint.workload.uid} has no IP usable for {target}")
    return Route(
        kind=RouteKind.WAYPOINT,
        actual_destination=SocketAddr(ip, waypoint.port),
        # The waypoint needs to know what the client asked for, so the authority is the original.
        hbone_target=target,
        upstream_sans=_sans(waypoint.workload, waypoint.service),
        source_workload=source,
        destination_workload=waypoint.workload,
        destination_service=service,
        same_node=bool(node) and waypoint.workload.node == node,
    )


def _is_source_the_waypoint(state: StateReader, source: Workload, gateway: GatewayAddress) -> bool:
    """Is the caller one of the workloads implementing `gateway`? (identity and IP must agree)"""
    destination = gateway.destination
    candidates: list[Workload] = []
    if isinstance(destination, NamespacedHostname):
        service = state.services.get(f"{destination.namespace}/{destination.hostname}")
    else:
        workload = state.workloads.find_address(destination.network, destination.address)
        if workload is not None:
            candidates.append(workload)
        service = state.services.find_vip(destination.network, destination.address, source.namespace)
    if service is not None:
        for endpoint in service.endpoints.values():
            workload = state.workloads.find_uid(endpoint.workload_uid)
            if workload is not None:
                candidates.append(workload)
    source_identity = _identity(source)
    source_ips = set(source.workload_ips)
    return any(
        _identity(w) == source_identity and source_ips.intersection(w.workload_ips) for w in candidates
    )


def _select_ip(workload: Workload, requested: IPAddress, service: Service | None) -> IPAddress | None:
    """The original IP if it is the workload's own; else one the service's families allow, preferring the
    family of the original request (docs/istio-behaviour.md, "Outbound (15001)")."""
    if requested in workload.workload_ips:
        return requested
    families = {4, 6}
    if service is not None:
        if service.ip_families is IpFamilies.IPV4_ONLY:
            families = {4}
        elif service.ip_families is IpFamilies.IPV6_ONLY:
            families = {6}
    allowed = [ip for ip in workload.workload_ips if ip.version in families]
    for ip in allowed:
        if ip.version == requested.version:
            return ip
    return allowed[0] if allowed else None


def _sans(workload: Workload, service: Service | None) -> tuple[Identity, ...]:
    """The workload's identity, then the service's subject alt names that are SPIFFE ids."""
    sans: list[Identity] = []
    identity = _identity(workload)
    if identity is not None:
        sans.append(identity)
    if service is not None:
        for name in service.subject_alt_names:
            try:
                parsed = Identity.parse(name)
            except IdentityError:
                continue  # not a SPIFFE id we could ever match a certificate against
            if parsed not in sans:
                sans.append(parsed)
    return tuple(sans)


def _identity(workload: Workload) -> Identity | None:
    try:
        return workload.identity
    except IdentityError:
        return None


__all__ = ["Route", "RouteKind", "RouteRefused", "build_request"]
