"""Outbound: connections the served workload opens, captured on 15001 (or SOCKS5 on 15080,
whose handshake is `socks5_server`).

Counterpart: ztunnel src/proxy/outbound.rs and socks5.rs. The decision of where a connection
goes is the pure `routing.build_request`; this module carries the plan out: plain TCP for
TCP workloads and passthrough, or a CONNECT stream on a pooled HBONE connection for HBONE
workloads and waypoints.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ..errors import ProxyError, ResponseFlag
from ..host.sockets import is_own_listener, original_destination
from ..net import IPAddress, SocketAddr
from ..state.memo import StateMemo
from ..state.model import Workload
from ..transport.relay import Relay, TcpEndpoint, read_waiting, wrap_socket
from . import headers as hbone_headers
from .hbone import HboneError, HboneStream
from .inbound import Admitted, InboundProxy, InboundRefusal, InboundTarget
from .inputs import ProxyInputs
from .pool import WorkloadKey
from .routing import Route, RouteKind, RouteRefused, build_request
from .telemetry import ConnectionResult, response_flag_of

log = logging.getLogger("ambient_mesh.proxy.outbound")

# Repeatable routes kept (`OutboundProxy._plan`): one per source workload and target address
# this proxy's clients reach directly, per state version.
MAX_PLANS_KEPT = 1024
_HBONE_KINDS = (RouteKind.DIRECT_HBONE, RouteKind.WAYPOINT)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Plan:
    """An HBONE route with what carrying it out needs from it, and what it was made for."""

    route: Route
    key: WorkloadKey  # the pool's key
    authority: str  # the CONNECT :authority


@dataclass(frozen=True, slots=True, kw_only=True)
class OutboundFailure:
    """A connection that could not be set up; already counted and logged by `open`."""

    reason: str
    response_flag: ResponseFlag
    error: BaseException | None = None
    self_call: bool = False  # refused because it would reach the proxy itself


@dataclass(eq=False, slots=True, kw_only=True)
class OutboundUpstream:
    """A reached upstream, not yet relayed: an endpoint, or (same-node) an admitted inbound."""

    route: Route
    result: ConnectionResult
    endpoint: HboneStream | TcpEndpoint | None = None
    inbound: InboundProxy | None = None
    admitted: Admitted | None = None
    early_sent: bool = False  # the client's early bytes went with the CONNECT (`open`)

    def abandon(self, reason: str) -> None:
        """The client left before the relay started: close the upstream and record why."""
        if self.admitted is not None:
            self.admitted.upstream.abort()
            self.admitted.result.fail(reason, ResponseFlag.CONNECT)
        if self.endpoint is not None:
            self.endpoint.abort()
        self.result.fail(reason, ResponseFlag.CONNECT)


class OutboundProxy:
    """Carries the served workload's outgoing connections to their destinations."""

    def __init__(
        self,
        pi: ProxyInputs,
        source: Callable[[], Workload | None],
        local_inbound: Callable[[Workload], InboundProxy | None] | None = None,
        resolve_name: Callable[[str], Awaitable[list[IPAddress]]] | None = None,
    ) -> None:
        self.pi = pi
        # SOCKS5 domain names go through the workload's DNS proxy logic (ztunnel needs DNS on).
        self.resolve_name = resolve_name
        self._source = source  # the workload this proxy serves
        # Shared mode: the inbound proxy of a pod this same node proxy serves, for the fast path.
        self._local_inbound = local_inbound
        self.fast_path_connections = 0
        self._plans: StateMemo[tuple[object, ...], _Plan] = StateMemo("outbound plans", MAX_PLANS_KEPT)

    def __repr__(self) -> str:
        return f"OutboundProxy({self.pi.pool!r})"

    async def handle_captured(self, sock: socket.socket) -> None:
        """A connection accepted on 15001: its real target is the pre-REDIRECT destination."""
        target = original_destination(sock)
        if is_own_listener(sock, target, self.pi.illegal_ports):
            # Not redirected: the client dialed the outbound listener itself. Forwarding would loop.
            ConnectionResult.failed(
                self.pi,
                src=SocketAddr.from_sockaddr(sock.getpeername()),
                dst=target,
                direction="outbound",
                error="connection to the outbound listener itself (not redirected) refused",
            )
            sock.close()
            return
        early = read_waiting(sock)
        downstream = wrap_socket(sock)
        # The client's address as the transport read it when it was made (uvloop and asyncio
        # both read and keep it): not a getpeername of our own before the same call of theirs
        # (docs/performance.md, "The per-connection path"). None: the client reset before it was served.
        transport = downstream.transport
        peername = transport.get_extra_info("peername") if transport is not None else None
        if peername is None:
            log.debug("captured connection to %s: client gone before it was served", target)
            downstream.abort()
            return
        await self.proxy_to(downstream, SocketAddr.from_sockaddr(peername), target, early)

    async def proxy_to(
        self, downstream: TcpEndpoint, peer: SocketAddr, target: SocketAddr, early: bytes = b""
    ) -> None:
        """Reach `target` for `peer` and relay. `early`: bytes the client sent before it was served,
        read from its socket already (`read_waiting`): they go with the CONNECT when the route
        is HBONE, otherwise first through the relay."""
        upstream = await self.open(peer, target, early)
        if isinstance(upstream, OutboundFailure):
            downstream.abort()
            return
        if early:
            if upstream.early_sent:
                downstream.bytes_read += len(early)  # relayed: the stream carried them
            else:
                downstream.hold_first(early)
        await self.carry(upstream, downstream)

    async def open(
        self, peer: SocketAddr, target: SocketAddr, early: bytes = b""
    ) -> OutboundUpstream | OutboundFailure:
        """Route `peer -> target` and reach the upstream; a failure is recorded and returned.

        `early` (the client's first bytes, at most MAX_EARLY_DATA_BYTES) goes out as DATA right
        behind an HBONE route's CONNECT, in the same TLS record (`OutboundUpstream.early_sent`);
        other routes do not take it."""
        pi = self.pi
        # Known already (the usual case): no coroutine to wait for it.
        source: Workload | None = self._source() or await pi.wait_for_workload(self._source)
        if source is None:
            log.warning("no workload information for the source of %s -> %s; closing", peer, target)
            ConnectionResult.failed(
                pi, src=peer, dst=target, direction="outbound", error="unknown source workload"
            )
            return OutboundFailure(reason="unknown source workload", response_flag=ResponseFlag.CONNECT)
        plan = self._plan(source, target)
        route = plan.route if isinstance(plan, _Plan) else plan
        if isinstance(route, RouteRefused):
            ConnectionResult.failed(
                pi,
                src=peer,
                dst=target,
                direction="outbound",
                error=route.reason,
                source=source,
                response_flag=route.response_flag,
            )
            return OutboundFailure(
                reason=route.reason, response_flag=route.response_flag, self_call=route.self_call
            )
        if (
            route.kind is RouteKind.DIRECT_HBONE
            and route.same_node
            and self._local_inbound is not None
            and route.destination_workload is not None
        ):
            inbound = self._local_inbound(route.destination_workload)
            if inbound is not None:
                return await self._same_node(inbound, route, peer)
        result = ConnectionResult.outbound(pi, route, peer)
        try:
            if isinstance(plan, _Plan):  # an HBONE route (direct or through a waypoint)
                endpoint: HboneStream | TcpEndpoint = await self._open_hbone(plan, peer, early)
                return OutboundUpstream(route=route, result=result, endpoint=endpoint, early_sent=bool(early))
            else:
                sock = await pi.connect(
                    route.actual_destination, _source_ip(source, route.actual_destination)
                )
                endpoint = wrap_socket(sock)
        except (ProxyError, HboneError, OSError, TimeoutError) as e:
            flag = response_flag_of(e)
            result.fail(str(e), flag)
            return OutboundFailure(reason=str(e), response_flag=flag, error=e)
        return OutboundUpstream(route=route, result=result, endpoint=endpoint)

    async def carry(self, upstream: OutboundUpstream, downstream: TcpEndpoint) -> None:
        """Relay between the client and an upstream `open` reached: starts it and returns.

        The calling task ends here and an idle tunnel keeps no task or coroutine frames; the
        relay's end is recorded from `relay.done` (a callback), as the open connections (`pi.connections`) drain.
        """
        result = upstream.result
        if upstream.admitted is not None:
            assert upstream.inbound is not None
            upstream.inbound.start_carry(
                upstream.admitted, downstream, also=result.recorder, on_done=result.complete
            )
            return
        assert upstream.endpoint is not None
        relay = Relay(downstream, upstream.endpoint)
        result.recorder.follow(relay)
        self.pi.connections.track(relay, result, on_end=result.complete)
        upstream.endpoint.attach(relay)
        downstream.attach(relay)

    async def _same_node(
        self, inbound: InboundProxy, route: Route, peer: SocketAddr
    ) -> OutboundUpstream | OutboundFailure:
        """The same-node fast path: both pods are served by this node proxy, so the destination
        pod's inbound checks run directly, without a TLS connection to ourselves. The source
        identity needs no certificate to prove it: this proxy is the one that would present it.
        Both reporters are recorded, as they would be over HBONE."""
        target = route.hbone_target
        workload = route.destination_workload
        # A same-node route is a direct HBONE route to a workload: both are always set.
        assert target is not None and workload is not None, route
        result = ConnectionResult.outbound(self.pi, route, peer)
        decision = inbound.local_target(workload, target)
        admitted: Admitted | InboundRefusal
        if not isinstance(decision, InboundTarget):
            admitted = decision
        else:
            admitted = await inbound.admit(
                peer=peer,
                src_id=route.source_workload.identity,
                source=route.source_workload,
                workload=workload,
                local=target,
                target=decision,
                authority=str(target),
            )
        if isinstance(admitted, InboundRefusal):
            reason = f"{admitted.reason} (same-node fast path)"
            result.fail(reason, admitted.response_flag)
            return OutboundFailure(reason=reason, response_flag=admitted.response_flag)
        self.fast_path_connections += 1
        return OutboundUpstream(route=route, result=result, inbound=inbound, admitted=admitted)

    def _plan(self, source: Workload, target: SocketAddr) -> _Plan | Route | RouteRefused:
        """`build_request`'s route from `source` to `target`, with its pool key and :authority
        when it is HBONE; kept in a StateMemo by the state version and every input of the route
        (source workload, target, the proxy's own ports and addresses) when no choice went into
        it (`Route.repeatable`: a workload addressed directly)."""
        pi = self.pi
        version = pi.state.version
        key = (source.uid, target.ip, target.port, pi.illegal_ports, pi.self_ips)
        kept = self._plans.get(version, key)
        if kept is not None:
            return kept
        route = build_request(
            pi.state,
            source,
            target,
            network=pi.config.network,
            node=pi.config.node_name or "",
            illegal_ports=pi.illegal_ports,
            self_ips=pi.self_ips,
            rng=pi.rng,
        )
        if isinstance(route, RouteRefused) or route.kind not in _HBONE_KINDS:
            return route
        plan = _Plan(
            route=route,
            # HBONE routes always have the source identity (workload_identity is required for them).
            key=WorkloadKey.of(
                route.source_workload.identity,
                route.upstream_sans,
                route.actual_destination,
                _source_ip(route.source_workload, route.actual_destination),
            ),
            authority=str(route.hbone_target),
        )
        if route.repeatable:
            self._plans.put(version, key, plan)
        return plan

    async def _open_hbone(self, plan: _Plan, peer: SocketAddr, early: bytes) -> HboneStream:
        pi = self.pi
        if pi.pool is None:
            raise ProxyError("no HBONE connection pool: the proxy is not started")
        route = plan.route
        service = route.destination_service
        headers = [
            ("forwarded", hbone_headers.forwarded_for(peer, service.hostname if service else None)),
            ("baggage", hbone_headers.baggage_at(pi.state.version, route.source_workload)),
            ("traceparent", hbone_headers.new_traceparent()),
        ]
        stream, response = await pi.pool.open_stream(plan.key, plan.authority, headers, early)
        if response.status != 200:
            flag = ResponseFlag.DENY if response.status == 401 else ResponseFlag.CONNECT
            raise ProxyError(
                f"HBONE CONNECT to {route.hbone_target} via {route.actual_destination} "
                f"answered {response.status}",
                response_flag=flag,
                status=response.status,
            )
        return stream


def _source_ip(source: Workload, dst: SocketAddr) -> IPAddress | None:
    """The served workload's address in the destination's family, used as the source address."""
    # A loop, not next() over a generator: two Python frames fewer per connection.
    version = dst.ip.version
    for ip in source.workload_ips:
        if ip.version == version:
            return ip
    return None
