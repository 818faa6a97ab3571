"""Outbound: connections the served workload opens, captured on 15001 (or SOCKS5 on 15080).

Counterpart: ztunnel src/proxy/outbound.rs and socks5.rs. The decision of where a connection
goes is the pure `routing.build_request`; this module carries the plan out: plain TCP for
TCP workloads and passthrough, or a CONNECT stream on a pooled HBONE connection for HBONE
workloads and waypoints.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

from ..net import SocketAddr
from ..state.model import Workload
from . import headers as hbone_headers
from .hbone import HboneError
from .inbound import InboundProxy, InboundRefusal, InboundTarget
from .inputs import ProxyInputs
from .pool import WorkloadKey
from .relay import Relay, TcpEndpoint, wrap_socket
from .routing import Route, RouteKind, RouteRefused, build_request
from .sockets import original_destination
from .socks5 import ConnectRequest as SocksConnect
from .socks5 import ReplyCode, Socks5Error, Socks5Handshake, encode_reply
from .telemetry import ConnectionResult

log = logging.getLogger("ambient_mesh.proxy.outbound")

SOCKS5_HANDSHAKE_TIMEOUT_S = 10.0


class OutboundProxy:
    """Carries the served workload's outgoing connections to their destinations."""

    def __init__(
        self,
        pi: ProxyInputs,
        source: Callable[[], Workload | None],
        local_inbound: Callable[[Workload], InboundProxy | None] | None = None,
        resolve_name: Callable[[str], Awaitable[list]] | None = None,
    ) -> None:
        self.pi = pi
        # SOCKS5 domain names go through the workload's DNS proxy logic (ztunnel needs DNS on).
        self._resolve_name = resolve_name
        self._source = source  # the workload this proxy serves
        # Shared mode: the inbound proxy of a pod this same node proxy serves, for the fast path.
        self._local_inbound = local_inbound
        self.fast_path_connections = 0

    def __repr__(self) -> str:
        return f"OutboundProxy({self.pi.pool!r})"

    async def handle_captured(self, sock: socket.socket) -> None:
        """A connection accepted on 15001: its real target is the pre-REDIRECT destination."""
        target = original_destination(sock)
        peer = SocketAddr.from_sockaddr(sock.getpeername())
        if target == SocketAddr.from_sockaddr(sock.getsockname()):
            # Not redirected: the client dialed the outbound listener itself. Forwarding would loop.
            ConnectionResult.failed(
                self.pi,
                src=peer,
                dst=target,
                direction="outbound",
                error="connection to the outbound listener itself (not redirected) refused",
            )
            sock.close()
            return
        downstream = await wrap_socket(sock)
        await self.proxy_to(downstream, peer, target)

    async def handle_socks5(self, sock: socket.socket) -> None:
        """SOCKS5 (RFC 1928, no auth, CONNECT): the requested address is the target."""
        loop = asyncio.get_running_loop()
        peer = SocketAddr.from_sockaddr(sock.getpeername())
        hs = Socks5Handshake()
        try:
            request = None
            async with asyncio.timeout(SOCKS5_HANDSHAKE_TIMEOUT_S):
                while request is None:
                    data = await loop.sock_recv(sock, 4096)
                    if not data:
                        raise Socks5Error("client closed during the SOCKS5 handshake")
                    event = hs.receive_data(data)
                    if isinstance(event, SocksConnect):
                        request = event
                    out = hs.data_to_send()
                    if out:
                        await loop.sock_sendall(sock, out)
        except (Socks5Error, TimeoutError, OSError) as e:
            out = hs.data_to_send()
            if out:
                try:
                    await loop.sock_sendall(sock, out)
                except OSError:
                    pass
            log.warning("SOCKS5 handshake from %s failed: %s", peer, e)
            sock.close()
            return
        if not isinstance(request.host, str):
            target = SocketAddr(request.host, request.port)
        else:
            addresses = await self._resolve_name(request.host) if self._resolve_name is not None else []
            if not addresses:
                reason = (
                    "no DNS proxy to resolve names (ISTIO_META_DNS_CAPTURE=false)"
                    if self._resolve_name is None
                    else "name did not resolve"
                )
                await loop.sock_sendall(sock, encode_reply(ReplyCode.HOST_UNREACHABLE))
                log.warning("SOCKS5 request for %r refused: %s", request.host, reason)
                sock.close()
                return
            # Prefer the family of the client's own connection, as ztunnel picks by family.
            addresses.sort(key=lambda ip: ip.version != peer.ip.version)
            target = SocketAddr(addresses[0], request.port)
        trailing = hs.trailing_data()
        await loop.sock_sendall(
            sock, encode_reply(ReplyCode.SUCCEEDED, SocketAddr.from_sockaddr(sock.getsockname()))
        )
        downstream = await wrap_socket(sock)
        if trailing:
            downstream._held.insert(0, trailing)
        await self.proxy_to(downstream, peer, target)

    async def proxy_to(self, downstream: TcpEndpoint, peer: SocketAddr, target: SocketAddr) -> None:
        pi = self.pi
        source: Workload | None = await pi.wait_for_workload(self._source)
        if source is None:
            log.warning("no workload information for the source of %s -> %s; closing", peer, target)
            ConnectionResult.failed(
                pi, src=peer, dst=target, direction="outbound", error="unknown source workload"
            )
            downstream.abort()
            return
        route = build_request(
            pi.state,
            source,
            target,
            network=pi.config.network,
            node=pi.config.node_name or "",
            illegal_ports=pi.config.illegal_ports,
            rng=pi.rng,
        )
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
            downstream.abort()
            return
        if route.kind is RouteKind.DIRECT_HBONE and route.same_node and self._local_inbound is not None:
            inbound = self._local_inbound(route.destination_workload)
            if inbound is not None:
                await self._same_node(inbound, route, downstream, peer)
                return
        result = ConnectionResult.outbound(pi, route, peer)
        try:
            if route.kind in (RouteKind.DIRECT_HBONE, RouteKind.WAYPOINT):
                upstream = await self._open_hbone(route, peer)
            else:
                sock = await pi.connect(
                    route.actual_destination, _source_ip(source, route.actual_destination)
                )
                upstream = await wrap_socket(sock)
        except (HboneError, OSError, TimeoutError) as e:
            flag = getattr(e, "response_flag", "CONNECT")
            result.fail(str(e), flag)
            downstream.abort()
            return
        relay = Relay(downstream, upstream, on_progress=result.progress)
        pi.connections.track(relay, result.dump_info())
        upstream.attach(relay)
        downstream.attach(relay)
        err = await relay.done
        result.complete(relay, err)

    async def _same_node(
        self, inbound: InboundProxy, route: Route, downstream: TcpEndpoint, peer: SocketAddr
    ) -> None:
        """The same-node fast path: both pods are served by this node proxy, so the destination
        pod's inbound checks run directly, without a TLS connection to ourselves. The source
        identity needs no certificate to prove it: this proxy is the one that would present it.
        Both reporters are recorded, as they would be over HBONE."""
        target = route.hbone_target
        workload = route.destination_workload
        result = ConnectionResult.outbound(self.pi, route, peer)
        decision = inbound.local_target(workload, target)
        admitted = decision
        if isinstance(decision, InboundTarget):
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
            result.fail(f"{admitted.reason} (same-node fast path)", admitted.response_flag)
            downstream.abort()
            return
        self.fast_path_connections += 1
        relay, err = await inbound.carry(admitted, downstream, also=result.progress)
        result.complete(relay, err)

    async def _open_hbone(self, route: Route, peer: SocketAddr):
        pi = self.pi
        src_id = route.source_workload.identity
        key = WorkloadKey.of(
            src_id,
            route.upstream_sans,
            route.actual_destination,
            _source_ip(route.source_workload, route.actual_destination),
        )
        service = route.destination_service
        headers = [
            ("forwarded", hbone_headers.forwarded_for(peer, service.hostname if service else None)),
            ("baggage", hbone_headers.baggage_for(route.source_workload)),
            ("traceparent", hbone_headers.new_traceparent()),
        ]
        stream, response = await pi.pool.open_stream(key, str(route.hbone_target), headers)
        if response.status != 200:
            flag = "DENY" if response.status == 401 else "CONNECT"
            raise HboneError(
                f"HBONE CONNECT to {route.hbone_target} via {route.actual_destination} "
                f"answered {response.status}",
                response_flag=flag,
                status=response.status,
            )
        return stream


def _source_ip(source: Workload, dst: SocketAddr):
    """The served workload's address in the destination's family, used as the source address."""
    return next((ip for ip in source.workload_ips if ip.version == dst.ip.version), None)
