"""Inbound: HBONE on 15008 and plaintext capture on 15006.

Counterparts: ztunnel src/proxy/inbound.rs and inbound_passthrough.rs (docs/istio-behaviour.md,
"Inbound HBONE (15008)" and "Inbound passthrough (15006)"). The HBONE server presents the certificate of the
destination workload (chosen by the address the connection arrived on), requires a client certificate from our
trust domain, then checks each CONNECT stream and answers 200 / 400 / 401 / 503 as ztunnel does.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import AmbientError, ProtocolError, ResponseFlag
from ..host.sockets import is_own_listener, original_destination
from ..identity.spiffe import Identity
from ..metrics import ConnectionRecorder
from ..net import IPAddress, SocketAddr, ip_address, split_host_port
from ..rbac import RbacConnection
from ..state.memo import StateMemo
from ..state.model import AppTunnelProtocol, GatewayAddress, NetworkAddress, Service, Workload
from ..tls.transport import start_tls
from ..transport.relay import Relay, TcpEndpoint, wrap_socket
from . import headers as hbone_headers
from .connection_manager import PolicyDenied
from .hbone import DEFAULT_SETTINGS, ConnectRequest, HboneConnection, HboneSettings, HboneStream
from .inputs import ProxyInputs
from .proxy_protocol import TLV_PEER_IDENTITY, encode_v2
from .telemetry import ConnectionResult

log = logging.getLogger("ambient_mesh.proxy.inbound")

TLS_HANDSHAKE_TIMEOUT_S = 10.0
APP_CONNECT_TIMEOUT_S = 10.0
# CONNECT :authority values parsed, kept (a StateMemo at version 0: the parse reads no state).
# Bounded, the text being the peer's: entries, and the length of a value kept (a longer one is
# parsed each time). Why they are kept: docs/architecture.md, "Decisions and caches".
MAX_AUTHORITIES_KEPT = 1024
MAX_KEPT_AUTHORITY_CHARS = 300
# CONNECT checks kept (`InboundProxy._decided`) per state version and request.
MAX_DECISIONS_KEPT = 1024
_authorities: StateMemo[str, tuple[str, int, IPAddress | None]] = StateMemo(
    "parsed authorities", MAX_AUTHORITIES_KEPT
)


def parse_authority(authority: str) -> tuple[str, int, IPAddress | None]:
    """`host`, `port` and the host as an IP address (None for a name) of a CONNECT :authority;
    ProtocolError as `split_host_port` raises it."""
    hit = _authorities.get(0, authority)
    if hit is not None:
        return hit
    host, port = split_host_port(authority)
    try:
        ip: IPAddress | None = ip_address(host)
    except ValueError:
        ip = None
    parsed = (host, port, ip)
    if len(authority) <= MAX_KEPT_AUTHORITY_CHARS:
        _authorities.put(0, authority, parsed)
    return parsed


LocalWorkload = Callable[[IPAddress], Workload | None]


@dataclass(frozen=True, slots=True, kw_only=True)
class InboundTarget:
    """Where an accepted CONNECT stream is delivered (the decision, before any I/O)."""

    address: SocketAddr
    service: Service | None
    # What the client asked for (:authority as an address): the PROXY header's destination for
    # application tunnels; a hostname authority maps to a VIP of the service
    # (docs/istio-behaviour.md, "PROXY protocol and application tunnels").
    authority_target: SocketAddr | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Admitted:
    """A connection that passed authorization and reached the app, ready to be relayed."""

    result: ConnectionResult
    upstream: TcpEndpoint
    rbac_conn: RbacConnection
    workload: Workload
    peer: SocketAddr


def _service_vip(service: Service, network: str, port: int) -> SocketAddr | None:
    """A VIP of `service` on our network, IPv4 preferred, with the requested port."""
    vips = sorted((v.address for v in service.vips if v.network == network), key=lambda ip: ip.version)
    return SocketAddr(vips[0], port) if vips else None


@dataclass(frozen=True, slots=True, kw_only=True)
class InboundRefusal:
    status: int
    reason: str
    response_flag: ResponseFlag = ResponseFlag.CONNECT


@dataclass(frozen=True, slots=True, kw_only=True)
class _Decided:
    """A CONNECT's checks before authorization (`InboundProxy.decide`) and the caller's workload
    (by the peer's address), as the state was when the stream arrived (`InboundProxy._decided`)."""

    decision: InboundTarget | InboundRefusal
    source: Workload | None


@dataclass(frozen=True, slots=True, kw_only=True)
class _Connecting:
    """An admitted stream whose app connection is still being made (`InboundProxy.admit`)."""

    sock: socket.socket
    address: SocketAddr
    proxy_header: bytes | None
    result: ConnectionResult
    rbac_conn: RbacConnection
    workload: Workload
    peer: SocketAddr


def _admitted(connecting: _Connecting) -> Admitted:
    """The app connection is made: its endpoint, with the PROXY header first if any."""
    try:
        upstream = wrap_socket(connecting.sock)
    except BaseException:
        connecting.sock.close()
        raise
    if connecting.proxy_header is not None:
        upstream.write(connecting.proxy_header)  # the app reads who called before any stream byte
    return Admitted(
        result=connecting.result,
        upstream=upstream,
        rbac_conn=connecting.rbac_conn,
        workload=connecting.workload,
        peer=connecting.peer,
    )


def _connect_failed(result: ConnectionResult, address: SocketAddr, e: OSError | TimeoutError) -> str:
    """Record an app connect that failed; the reason."""
    reason = f"connect to {address} failed: {getattr(e, 'strerror', None) or e or 'timeout'}"
    result.fail(reason, ResponseFlag.CONNECT)
    return reason


class InboundProxy:
    """The HBONE server of one proxy."""

    def __init__(
        self, pi: ProxyInputs, local_workload: LocalWorkload, settings: HboneSettings = DEFAULT_SETTINGS
    ) -> None:
        self.pi = pi
        self._local_workload = local_workload
        self.settings = settings
        self.connections: set[HboneConnection] = set()
        self._decisions: StateMemo[tuple[object, ...], _Decided] = StateMemo(
            "inbound decisions", MAX_DECISIONS_KEPT
        )

    def __repr__(self) -> str:
        streams = sum(c.open_streams for c in self.connections)
        return f"InboundProxy({len(self.connections)} connections, {streams} streams)"

    async def handle(self, sock: socket.socket) -> None:
        local = SocketAddr.from_sockaddr(sock.getsockname())
        peer = SocketAddr.from_sockaddr(sock.getpeername())
        workload = self._local_workload(local.ip)
        if workload is None:
            # Without a destination workload there is no certificate to present.
            log.warning(
                "HBONE connection from %s to %s: no local workload has that address; closing", peer, local
            )
            sock.close()
            return
        try:
            ctx = await self.pi.server_context(workload.identity)
        except AmbientError as e:
            log.warning(
                "HBONE connection from %s to %s: no certificate for %s: %s", peer, local, workload.identity, e
            )
            sock.close()
            return
        trust_domain = workload.identity.trust_domain

        def check_client(conn: HboneConnection) -> None:
            # Called once the TLS handshake is done, so the transport is there.
            assert conn.transport is not None
            # CRL_PATH, then the SPIFFE identity and trust domain (TlsContextCache.verify_client).
            conn.peer_identity = self.pi.tls.verify_client(
                conn.transport.get_extra_info("ssl_object"), trust_domain
            )

        # What the connection was made for: the certificate presented is this identity's. Each
        # stream looks its destination up again (`serve_stream`); nothing else is kept.
        server_identity = workload.identity
        conn = HboneConnection(
            client_side=False,
            settings=self.settings,
            on_connected=check_client,
            on_request=lambda s: self._on_request(s, local, peer, server_identity),
        )
        try:
            # OpenSSL for the handshake, then our own records (tls/transport.py).
            await start_tls(sock, ctx, conn, server_side=True, handshake_timeout_s=TLS_HANDSHAKE_TIMEOUT_S)
        except (OSError, TimeoutError) as e:
            log.info("HBONE TLS handshake from %s failed: %s", peer, e)
            sock.close()
            return
        if conn.error is not None:
            log.info("HBONE connection from %s refused: %s", peer, conn.error)
            return
        self.connections.add(conn)
        try:
            # Shielded: cancelling this task must not cancel the connection's own future.
            await asyncio.shield(conn.closed)
        except asyncio.CancelledError:
            # A drain's deadline: the TLS transport owns the socket now and closes it itself,
            # after taking its descriptor off the event loop (the listener's guard then closes
            # a closed socket). Closed under a live transport, the socket's descriptor number
            # stayed watched by the loop for whichever socket was given that number next.
            conn.abort()
            raise
        finally:
            self.connections.discard(conn)

    def _on_request(
        self, stream: HboneStream, local: SocketAddr, peer: SocketAddr, server_identity: Identity
    ) -> asyncio.Task[None] | None:
        """A CONNECT on one of our HBONE connections, served here and now (`serve_stream`); a
        task only when the app connection is not made at once, returned to the HBONE shell,
        which cancels it if the peer resets the stream unanswered.

        The crash barrier of a stream served without a task: a bug in serving it resets that
        stream (logged), not the HBONE connection whose read callback this is."""
        try:
            return self.serve_stream(stream, local, peer, server_identity)
        except Exception:
            log.exception("HBONE stream %d from %s: serving it failed", stream.stream_id, peer)
            stream.abort()
            return None

    def decide(
        self,
        request: ConnectRequest | None,
        local: SocketAddr,
        workload: Workload,
        forwarded_host: str | None = None,
    ) -> InboundTarget | InboundRefusal:
        """The checks of docs/istio-behaviour.md, "Inbound HBONE (15008)", steps 1-6, as a pure decision.
        `forwarded_host`: the `host=` of the request's `forwarded` header
        (`hbone_headers.parse_forwarded_host`)."""
        if request is None or request.method != "CONNECT":
            return InboundRefusal(
                status=400, reason=f"method {request.method if request else '?'} is not CONNECT"
            )
        try:
            host, port, ip = parse_authority(request.authority)
        except ProtocolError as e:
            return InboundRefusal(status=400, reason=f"bad :authority: {e}")
        state = self.pi.state
        if ip is None:
            # hostname:port (through an east-west gateway): service port -> this endpoint's port
            service = state.services.find_hostname(host, workload.namespace)
            if service is None:
                return InboundRefusal(status=503, reason=f"unknown service {host}")
            endpoint = service.endpoints.get(workload.uid)
            target_port = (endpoint.port.get(port) if endpoint else None) or service.ports.get(port)
            if (
                not target_port
                and workload.application_tunnel is not None
                and workload.application_tunnel.port
            ):
                target_port = port  # the tunnel decides the port; keep the service port
            if not target_port:
                return InboundRefusal(status=503, reason=f"service {host} has no target for port {port}")
            address = SocketAddr(local.ip, target_port)
            authority_target = _service_vip(service, self.pi.config.network, port)
        else:
            service = None
            if (
                ip != local.ip
                and workload.application_tunnel is None
                and not self._is_waypoint_for(workload, ip)
            ):
                return InboundRefusal(
                    status=400,
                    reason=f"authority {request.authority} does not match the destination address {local.ip}",
                )
            address = SocketAddr(local.ip, port)
            authority_target = SocketAddr(ip, port)
        if address.port in self.pi.config.illegal_ports:
            return InboundRefusal(status=400, reason=f"port {address.port} is one of the proxy's own ports")
        if service is None:
            service = self._service_for_port(forwarded_host, workload, address.port)
        return InboundTarget(address=address, service=service, authority_target=authority_target)

    def _is_waypoint_for(self, local: Workload, ip: IPAddress) -> bool:
        """The local workload is the waypoint the target service or workload points to."""
        state = self.pi.state
        target = state.services.find_vip(self.pi.config.network, ip, None) or state.workloads.find_address(
            self.pi.config.network, ip
        )
        waypoint: GatewayAddress | None = getattr(target, "waypoint", None)
        if waypoint is None:
            return False
        dest = waypoint.destination
        if isinstance(dest, NetworkAddress):
            return dest.address in local.workload_ips
        service = state.services.get(f"{dest.namespace}/{dest.hostname}")
        return service is not None and local.uid in service.endpoints

    def _service_for_port(self, host: str | None, workload: Workload, port: int) -> Service | None:
        """Destination service for telemetry: `Forwarded: host=` if it is one of ours, else by port."""
        services = self.pi.state.services.services_for_workload(workload.uid)
        if host:
            for service in services:
                if service.hostname == host:
                    return service
        for service in services:
            endpoint = service.endpoints.get(workload.uid)
            if port in service.ports.values() or (endpoint and port in endpoint.port.values()):
                return service
        return None

    def serve_stream(
        self, stream: HboneStream, local: SocketAddr, peer: SocketAddr, server_identity: Identity
    ) -> asyncio.Task[None] | None:
        """Check, authorize, connect to the app, answer and relay one CONNECT stream (reference
        3.2). Every check reads the state as it is now: the destination workload is looked up
        for this stream (step 3), not taken from the connection, whose only fixed facts are the
        two certificates; a workload at our address that no longer has the identity whose
        certificate we presented is refused. Without a task and without awaiting anything when
        the app connection is made at once (an app on this host, the usual case:
        `inputs.connect_started`); otherwise the returned task waits for it and does the rest."""
        pi = self.pi
        src_id: Identity | None = stream.conn.peer_identity
        workload = self._local_workload(local.ip)
        if workload is None or workload.identity != server_identity:
            reason = (
                f"no local workload has address {local.ip}"
                if workload is None
                else f"the workload at {local.ip} is now {workload.identity}, not {server_identity}"
            )
            self._refuse(
                stream, peer, local, src_id, None, workload, InboundRefusal(status=503, reason=reason)
            )
            return None
        decided = self._decided(stream.request, local, peer, workload)
        source, decision = decided.source, decided.decision
        if isinstance(decision, InboundRefusal):
            self._refuse(stream, peer, local, src_id, source, workload, decision)
            return None
        admitting = self._start_admit(
            peer=peer,
            src_id=src_id,
            source=source,
            workload=workload,
            local=local,
            target=decision,
            authority=stream.request.authority if stream.request is not None else "",
        )
        if isinstance(admitting, _Connecting):
            return pi.connections.spawn(self._serve_connecting(stream, admitting))
        self._answer(stream, admitting)
        return None

    def _refuse(
        self,
        stream: HboneStream,
        peer: SocketAddr,
        local: SocketAddr,
        src_id: Identity | None,
        source: Workload | None,
        workload: Workload | None,
        refusal: InboundRefusal,
    ) -> None:
        log.info(
            "HBONE stream from %s (%s) refused with %d: %s", peer, src_id, refusal.status, refusal.reason
        )
        ConnectionResult.failed(
            self.pi,
            src=peer,
            dst=local,
            direction="inbound",
            error=refusal.reason,
            source=source,
            destination=workload,
            response_flag=refusal.response_flag,
        )
        stream.conn.respond(stream, refusal.status)

    def _decided(
        self, request: ConnectRequest | None, local: SocketAddr, peer: SocketAddr, workload: Workload
    ) -> _Decided:
        """`decide` and the caller's workload, kept in a StateMemo by the state version and
        every input they read: the destination workload, both addresses, the method,
        :authority and `forwarded` host (no choice is made, so the answer depends on nothing
        else). Authorization is not part of it: `_start_admit` asks the policy index for every
        stream. Peer-named text is kept only up to MAX_KEPT_AUTHORITY_CHARS per value."""
        pi = self.pi
        forwarded = request.header("forwarded") if request is not None else None
        host = hbone_headers.parse_forwarded_host(forwarded) if forwarded else None
        authority = request.authority if request is not None else None
        key = (
            workload.uid,
            local.ip,
            peer.ip,
            request.method if request is not None else None,
            authority,
            host,
        )
        version = pi.state.version
        kept = self._decisions.get(version, key)
        if kept is not None:
            return kept
        decided = _Decided(
            decision=self.decide(request, local, workload, host),
            source=pi.state.workloads.find_address(pi.config.network, peer.ip),
        )
        if len(authority or "") <= MAX_KEPT_AUTHORITY_CHARS and len(host or "") <= MAX_KEPT_AUTHORITY_CHARS:
            self._decisions.put(version, key, decided)
        return decided

    async def _serve_connecting(self, stream: HboneStream, connecting: _Connecting) -> None:
        self._answer(stream, await self._finish_admit(connecting))

    def _answer(self, stream: HboneStream, admitted: Admitted | InboundRefusal) -> None:
        conn = stream.conn
        if isinstance(admitted, InboundRefusal):
            conn.respond(stream, admitted.status)
            return
        response_headers = []
        if self.pi.config.enable_response_baggage:
            response_headers.append(
                ("baggage", hbone_headers.baggage_at(self.pi.state.version, admitted.workload))
            )
        conn.respond(stream, 200, response_headers)
        # The request's headers have served their purpose (routing, telemetry); an idle tunnel
        # would otherwise keep their decoded text (about 700 B) for its whole life.
        stream.request = None
        self.start_carry(admitted, stream)  # the relay carries on from here

    async def admit(
        self,
        *,
        peer: SocketAddr,
        src_id: Identity | None,
        source: Workload | None,
        workload: Workload,
        local: SocketAddr,
        target: InboundTarget,
        authority: str,
    ) -> Admitted | InboundRefusal:
        """Steps 7-8 of docs/istio-behaviour.md, "Inbound HBONE (15008)": authorize, then connect to the app.
        Failures are recorded."""
        admitting = self._start_admit(
            peer=peer,
            src_id=src_id,
            source=source,
            workload=workload,
            local=local,
            target=target,
            authority=authority,
        )
        if isinstance(admitting, _Connecting):
            return await self._finish_admit(admitting)
        return admitting

    def _start_admit(
        self,
        *,
        peer: SocketAddr,
        src_id: Identity | None,
        source: Workload | None,
        workload: Workload,
        local: SocketAddr,
        target: InboundTarget,
        authority: str,
    ) -> Admitted | InboundRefusal | _Connecting:
        """`admit` up to the app connect: admitted when the connect finished at once, refused,
        or still connecting (`_finish_admit` waits)."""
        pi = self.pi
        connect_from: IPAddress | None
        if workload.application_tunnel is None:  # `_delivery`'s first case, inline: per stream
            address, connect_from, proxy_header = target.address, peer.ip, None
        else:
            address, connect_from, proxy_header = self._delivery(workload, target, peer, src_id)
        result = ConnectionResult(
            pi,
            direction="inbound",
            src_addr=peer,
            dst_addr=address,
            hbone_addr=authority,
            source=source,
            source_identity=src_id,
            destination=workload,
            service=target.service,
            destination_identity=workload.identity,
            mtls=True,
        )
        # Authorization sees the peer's address, its certificate identity and the real target
        # (never 15008), docs/istio-behaviour.md, "Inbound HBONE (15008)" step 7.
        rbac_conn = RbacConnection(
            src_identity=src_id,
            src_ip=peer.ip,
            dst_ip=local.ip,
            dst_port=target.address.port,
            dst_network=pi.config.network,
        )
        verdict = pi.connection_manager.authorize(rbac_conn, workload)
        if not verdict.allowed:
            denied = PolicyDenied(verdict)
            result.fail(str(denied), denied.response_flag)
            return InboundRefusal(status=401, reason=str(denied), response_flag=denied.response_flag)
        try:
            sock, connected = pi.start_connect(address, connect_from)
        except OSError as e:
            return InboundRefusal(status=503, reason=_connect_failed(result, address, e))
        connecting = _Connecting(
            sock=sock,
            address=address,
            proxy_header=proxy_header,
            result=result,
            rbac_conn=rbac_conn,
            workload=workload,
            peer=peer,
        )
        return _admitted(connecting) if connected else connecting

    async def _finish_admit(self, connecting: _Connecting) -> Admitted | InboundRefusal:
        try:
            # Closes the socket on failure, timeout and cancellation (the stream reset).
            await self.pi.finish_connect(connecting.sock, connecting.address, APP_CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError) as e:
            return InboundRefusal(
                status=503, reason=_connect_failed(connecting.result, connecting.address, e)
            )
        return _admitted(connecting)

    def start_carry(
        self,
        admitted: Admitted,
        downstream: TcpEndpoint | HboneStream,
        also: ConnectionRecorder | None = None,
        on_done: Callable[[Relay, BaseException | None], None] | None = None,
    ) -> Relay:
        """Relay between the caller's side and the app, tracked for policy re-checks; returns at
        once. The end (untrack, metrics, access log, then `on_done`) runs from `relay.done`."""
        pi = self.pi
        result = admitted.result
        relay = Relay(downstream, admitted.upstream)
        # Client -> server bytes are "received" in Istio's metric vocabulary, the reverse "sent":
        # the relay's bytes_up and bytes_down, read by the recorders when they count.
        result.recorder.follow(relay)
        if also is not None:
            also.follow(relay)
        untrack = pi.connection_manager.register(
            admitted.rbac_conn, admitted.workload, relay.abort, admitted.peer, result.dst_addr
        )

        def finished(relay: Relay, err: BaseException | None) -> None:
            untrack()
            result.complete(relay, err)
            if on_done is not None:
                on_done(relay, err)

        pi.connections.track(relay, result, on_end=finished)
        admitted.upstream.attach(relay)
        downstream.attach(relay)
        return relay

    async def carry(
        self,
        admitted: Admitted,
        downstream: TcpEndpoint | HboneStream,
        also: ConnectionRecorder | None = None,
    ) -> tuple[Relay, BaseException | None]:
        """`start_carry`, then wait until the relay has ended and been recorded."""
        relay = self.start_carry(admitted, downstream, also)
        err = await relay.done  # the tracker's callback was registered first: it has run by now
        return relay, err

    def _delivery(
        self, workload: Workload, target: InboundTarget, peer: SocketAddr, src_id: Identity | None
    ) -> tuple[SocketAddr, IPAddress | None, bytes | None]:
        """Where the app gets the connection, from which source, and the PROXY header if any.

        Workloads with an application tunnel (e.g. a sandwiched waypoint) may ask for another port, and with
        protocol PROXY get a PROXY v2 header naming the real client and target, delivered over loopback unless
        LOCALHOST_APP_TUNNEL=false (docs/istio-behaviour.md, "PROXY protocol and application tunnels").
        """
        address = target.address
        connect_from: IPAddress | None = peer.ip
        tunnel = workload.application_tunnel
        if tunnel is None:
            return address, connect_from, None
        if tunnel.port:
            address = SocketAddr(address.ip, tunnel.port)
        if tunnel.protocol is not AppTunnelProtocol.PROXY:
            return address, connect_from, None
        tlvs = [(TLV_PEER_IDENTITY, str(src_id).encode())] if src_id is not None else []
        header = encode_v2(peer, target.authority_target or target.address, tlvs)
        if self.pi.config.localhost_app_tunnel:
            loopback = ip_address("::1" if address.ip.version == 6 else "127.0.0.1")
            address, connect_from = SocketAddr(loopback, address.port), None
        return address, connect_from, header

    def local_target(self, workload: Workload, target: SocketAddr) -> InboundTarget | InboundRefusal:
        """The same-node fast path's version of steps 4-6: the target is this pod's IP:port."""
        if target.port in self.pi.config.illegal_ports:
            return InboundRefusal(status=400, reason=f"port {target.port} is one of the proxy's own ports")
        return InboundTarget(address=target, service=self._service_for_port(None, workload, target.port))

    def drain(self) -> None:
        for conn in list(self.connections):
            conn.drain()


class InboundPassthroughProxy:
    """Plaintext traffic to the workload, captured on 15006 (no identity, so no mTLS)."""

    def __init__(self, pi: ProxyInputs, local_workload: LocalWorkload) -> None:
        self.pi = pi
        self._local_workload = local_workload

    async def handle(self, sock: socket.socket) -> None:
        pi = self.pi
        target = original_destination(sock)
        peer = SocketAddr.from_sockaddr(sock.getpeername())
        if is_own_listener(sock, target, pi.illegal_ports):
            # Not redirected: the client dialed the listener itself. Forwarding would loop.
            ConnectionResult.failed(
                pi,
                src=peer,
                dst=target,
                direction="inbound",
                error="connection to the plaintext listener itself (not redirected) refused",
            )
            sock.close()
            return
        if target.port in pi.config.illegal_ports:
            ConnectionResult.failed(
                pi,
                src=peer,
                dst=target,
                direction="inbound",
                error=f"port {target.port} is one of the proxy's own ports",
            )
            sock.close()
            return
        workload = self._local_workload(target.ip)
        if workload is None:
            ConnectionResult.failed(
                pi,
                src=peer,
                dst=target,
                direction="inbound",
                error=f"no local workload has address {target.ip}",
            )
            sock.close()
            return
        source = pi.state.workloads.find_address(pi.config.network, peer.ip)
        services = pi.state.services.services_for_workload(workload.uid)
        service = next((s for s in services if target.port in s.ports.values()), None)
        downstream = wrap_socket(sock)
        result = ConnectionResult(
            pi,
            direction="inbound",
            src_addr=peer,
            dst_addr=target,
            hbone_addr=None,
            source=source,
            source_identity=None,
            destination=workload,
            service=service,
            destination_identity=None,
            mtls=False,
        )
        # Plaintext has no identity: STRICT mTLS and principal-based ALLOW policies deny it.
        rbac_conn = RbacConnection(
            src_identity=None,
            src_ip=peer.ip,
            dst_ip=target.ip,
            dst_port=target.port,
            dst_network=pi.config.network,
        )
        verdict = pi.connection_manager.authorize(rbac_conn, workload)
        if not verdict.allowed:
            result.fail(str(PolicyDenied(verdict)), PolicyDenied.response_flag)
            downstream.abort()
            return
        try:
            upstream_sock = await pi.connect(target, peer.ip, timeout_s=APP_CONNECT_TIMEOUT_S)
            upstream = wrap_socket(upstream_sock)
        except (OSError, TimeoutError) as e:
            _connect_failed(result, target, e)
            downstream.abort()
            return
        relay = Relay(downstream, upstream)
        result.recorder.follow(relay)
        untrack = pi.connection_manager.register(rbac_conn, workload, relay.abort, peer, target)

        def finished(relay: Relay, err: BaseException | None) -> None:
            untrack()
            result.complete(relay, err)

        pi.connections.track(relay, result, on_end=finished)  # the task ends here; the relay carries on
        upstream.attach(relay)
        downstream.attach(relay)
