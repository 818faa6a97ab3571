"""The node proxy's DNS proxy: UDP and TCP on 15053, one per pod in shared mode.

Counterparts: ztunnel src/dns/server.rs (`Server`, `SystemForwarder`), src/dns/forwarder.rs
and src/dns/metrics.rs. Behaviour follows docs/istio-behaviour.md, "DNS proxy"; metric names and
labels: "Metrics"; the access log: "Logs" (logger `ambient_mesh.dns`, so its scope is `dns`, at DEBUG).

The shell around `resolver.decide`: read a query, ask the resolver, carry out its decision
(reply, or forward to the nameservers of /etc/resolv.conf and relay what they say), count it,
log it. Every socket, listening or upstream, comes from one factory so that a shared-mode
proxy creates them inside the pod's network namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import random
import socket
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdatatype
from prometheus_client import Counter, Histogram
from prometheus_client.registry import Collector

from ..config import ProxyMode, ZtunnelConfig
from ..errors import BindError
from ..host.sockets import LISTEN_BACKLOG, plain_socket, set_mark
from ..metrics import UNKNOWN, WithoutCreated
from ..net import IPAddress, SocketAddr, ip_address
from ..ports import DNS_PORT
from ..state.model import Workload
from ..state.store import StateReader
from .resolver import (
    DnsRequest,
    DnsSettings,
    Forward,
    LocalAnswer,
    MalformedRequest,
    MeshView,
    Refuse,
    StateView,
    decide,
    encode_response,
    forwarded_response,
    parse_request,
    refuse_response,
    udp_limit,
)

log = logging.getLogger("ambient_mesh.dns")

RESOLV_CONF_PATH = "/etc/resolv.conf"
# ztunnel: a TCP client has 5 s to send each request; the upstream has 5 s to answer.
TCP_REQUEST_TIMEOUT_S = 5.0
UPSTREAM_TIMEOUT_S = 5.0
MAX_TCP_MESSAGE_BYTES = 65535  # RFC 1035 4.2.2: a two-byte length prefix
MAX_UDP_DATAGRAM_BYTES = 65535
UPSTREAM_DURATION_BUCKETS_S = (0.0005, 0.001, 0.01, 0.1, 1.0, 5.0)

PROTOCOL_UDP = "udp"
PROTOCOL_TCP = "tcp"

DnsSocketFactory = Callable[[int, int], socket.socket]
"""Creates a socket of (family, type); in shared mode `NetnsHandle.socket` of the pod."""


# -- resolv.conf --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ResolvConf:
    """The nameservers and search list of a resolv.conf (resolv.conf(5))."""

    nameservers: tuple[SocketAddr, ...] = ()
    search: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> ResolvConf:
        """Lenient, like the C resolver: lines it does not understand are skipped."""
        nameservers: list[SocketAddr] = []
        search: tuple[str, ...] = ()
        for line in text.splitlines():
            words = line.split("#", 1)[0].split(";", 1)[0].split()
            if not words:
                continue
            keyword, args = words[0], words[1:]
            if keyword == "nameserver" and args:
                try:
                    ip = ipaddress.ip_address(args[0].split("%", 1)[0])
                except ValueError:
                    continue
                nameservers.append(SocketAddr(ip, DNS_PORT))
            # The last `search` or `domain` line wins; `domain` is a one-entry search list.
            elif keyword in ("search", "domain") and args:
                search = tuple(d.strip(".").lower() for d in args if d.strip("."))
        return cls(nameservers=tuple(nameservers), search=search)

    @classmethod
    def read(cls, path: str = RESOLV_CONF_PATH) -> ResolvConf:
        with open(path, encoding="utf-8", errors="replace") as f:
            return cls.parse(f.read())


# -- metrics ------------------------------------------------------------------------------------

DNS_LABEL_NAMES = (
    "request_query_type",
    "request_protocol",
    "source_canonical_service",
    "source_canonical_revision",
)


class Registry(Protocol):
    """Where collectors go: `ambient_mesh.metrics.Metrics` is one."""

    def register(self, collector: Collector) -> None: ...


class DnsMetrics:
    """ztunnel's DNS metrics. One per process: every pod's DNS server records into it."""

    __slots__ = ("requests", "upstream_requests", "upstream_failures", "upstream_duration", "_counts")

    def __init__(self, registry: Registry | None = None) -> None:
        self.requests = Counter(
            "istio_dns_requests", "Total number of DNS requests (unstable)", DNS_LABEL_NAMES, registry=None
        )
        self.upstream_requests = Counter(
            "istio_dns_upstream_requests",
            "Total number of DNS requests forwarded to upstream (unstable)",
            DNS_LABEL_NAMES,
            registry=None,
        )
        self.upstream_failures = Counter(
            "istio_dns_upstream_failures",
            "Total number of DNS requests that failed to forward upstream (unstable)",
            DNS_LABEL_NAMES,
            registry=None,
        )
        self.upstream_duration = Histogram(
            "istio_dns_upstream_request_duration",
            "Total time in seconds Istio takes to get DNS response from upstream (unstable)",
            DNS_LABEL_NAMES,
            unit="seconds",
            buckets=UPSTREAM_DURATION_BUCKETS_S,
            registry=None,
        )
        self._counts = [0, 0, 0]  # requests, forwarded, failed: for repr only
        if registry is not None:
            registry.register(WithoutCreated(self.collectors()))

    def collectors(self) -> tuple[Collector, ...]:
        return (self.requests, self.upstream_requests, self.upstream_failures, self.upstream_duration)

    @staticmethod
    def labels(
        request: DnsRequest | MalformedRequest, protocol: str, client: Workload | None
    ) -> tuple[str, ...]:
        query_type = request.query_type if isinstance(request, DnsRequest) else UNKNOWN
        return (
            query_type,
            protocol,
            (client and client.canonical_name) or UNKNOWN,
            (client and client.canonical_revision) or UNKNOWN,
        )

    def request(self, labels: tuple[str, ...]) -> None:
        self.requests.labels(*labels).inc()
        self._counts[0] += 1

    def forwarded(self, labels: tuple[str, ...], duration_s: float, failed: bool) -> None:
        self.upstream_requests.labels(*labels).inc()
        self.upstream_duration.labels(*labels).observe(duration_s)
        self._counts[1] += 1
        if failed:
            self.upstream_failures.labels(*labels).inc()
            self._counts[2] += 1

    def __repr__(self) -> str:
        requests, forwarded, failed = self._counts
        return f"<DnsMetrics: {requests} requests, {forwarded} forwarded, {failed} upstream failures>"


# -- forwarding ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class UpstreamFailure:
    """No nameserver gave an answer; `reason` says what the last one did."""

    reason: str


class Forwarder(Protocol):
    async def forward(self, query: dns.message.Message) -> dns.message.Message | UpstreamFailure: ...


class UpstreamForwarder:
    """Asks the nameservers in order: UDP first, TCP when the UDP answer comes back truncated.

    The query goes out as the client asked it (the search list is not applied again), under a
    fresh id; a reply counts only if it answers that id and question.
    """

    def __init__(
        self,
        nameservers: Iterable[SocketAddr],
        *,
        socket_factory: DnsSocketFactory = plain_socket,
        mark: int | None = None,
        timeout_s: float = UPSTREAM_TIMEOUT_S,
        rng: random.Random | None = None,
    ) -> None:
        self.nameservers = tuple(nameservers)
        self._socket_factory = socket_factory
        self._mark = mark
        self._timeout_s = timeout_s
        self._rng = rng or random.SystemRandom()
        self.sent = 0
        self.failed = 0

    def __repr__(self) -> str:
        servers = ", ".join(str(ns) for ns in self.nameservers) or "no nameservers"
        return f"<UpstreamForwarder to {servers}: {self.sent} sent, {self.failed} failed>"

    async def forward(self, query: dns.message.Message) -> dns.message.Message | UpstreamFailure:
        if not self.nameservers:
            self.failed += 1
            return UpstreamFailure(reason="no nameservers configured")
        upstream_query = dns.message.Message(id=self._rng.getrandbits(16))
        upstream_query.flags = query.flags
        upstream_query.question = list(query.question)
        upstream_query.use_edns(query.edns, query.ednsflags, query.payload, options=list(query.options))
        wire = upstream_query.to_wire()
        reason = ""
        for server in self.nameservers:
            self.sent += 1
            try:
                answer = await asyncio.wait_for(self._ask(server, upstream_query, wire), self._timeout_s)
            except TimeoutError:
                reason = f"{server}: no answer within {self._timeout_s:g}s"
                continue
            except (
                OSError,
                EOFError,
                asyncio.IncompleteReadError,
                dns.exception.DNSException,
                ValueError,
            ) as e:
                reason = f"{server}: {type(e).__name__}: {e}"
                continue
            return answer
        self.failed += 1
        return UpstreamFailure(reason=reason)

    def _socket(self, family: int, type: int) -> socket.socket:
        sock = self._socket_factory(family, type)
        try:
            sock.setblocking(False)
            if self._mark is not None:
                set_mark(sock, self._mark)
        except BaseException:
            sock.close()
            raise
        return sock

    async def _ask(self, server: SocketAddr, query: dns.message.Message, wire: bytes) -> dns.message.Message:
        answer = await self._ask_udp(server, query, wire)
        if answer.flags & dns.flags.TC:
            return await self._ask_tcp(server, query, wire)
        return answer

    async def _ask_udp(
        self, server: SocketAddr, query: dns.message.Message, wire: bytes
    ) -> dns.message.Message:
        loop = asyncio.get_running_loop()
        sock = self._socket(server.family, socket.SOCK_DGRAM)
        waiter: asyncio.Future[dns.message.Message] = loop.create_future()
        try:
            # Connected: the kernel drops datagrams from anyone else, and reports ICMP
            # unreachable (nothing listening) at once instead of leaving us to time out.
            sock.connect(server.sockaddr())
            transport, _ = await loop.create_datagram_endpoint(
                lambda: _UpstreamDatagram(query, waiter), sock=sock
            )
        except BaseException:
            sock.close()
            raise
        try:
            transport.sendto(wire)
            return await waiter
        finally:
            transport.close()

    async def _ask_tcp(
        self, server: SocketAddr, query: dns.message.Message, wire: bytes
    ) -> dns.message.Message:
        loop = asyncio.get_running_loop()
        sock = self._socket(server.family, socket.SOCK_STREAM)
        try:
            await loop.sock_connect(sock, server.sockaddr())
            reader, writer = await asyncio.open_connection(sock=sock)
        except BaseException:
            sock.close()
            raise
        try:
            writer.write(len(wire).to_bytes(2, "big") + wire)
            await writer.drain()
            size = int.from_bytes(await reader.readexactly(2), "big")
            answer = dns.message.from_wire(await reader.readexactly(size))
            if not query.is_response(answer):
                raise ValueError("the reply does not answer the query")
            return answer
        finally:
            writer.close()


class _UpstreamDatagram(asyncio.DatagramProtocol):
    """Waits for the one datagram that answers our query; strays are dropped."""

    def __init__(self, query: dns.message.Message, waiter: asyncio.Future[dns.message.Message]) -> None:
        self._query = query
        self._waiter = waiter

    def datagram_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        if self._waiter.done():
            return
        try:
            answer = dns.message.from_wire(data)
        except (dns.exception.DNSException, ValueError):
            return
        if self._query.is_response(answer):
            self._waiter.set_result(answer)

    def error_received(self, exc: Exception) -> None:
        # ICMP port unreachable and friends: this nameserver will not answer.
        if not self._waiter.done():
            self._waiter.set_exception(exc)


def _upstream_failed(answer: dns.message.Message) -> bool:
    # ztunnel's resolver reports NXDOMAIN and empty answers as errors, so its
    # istio_dns_upstream_failures_total counts them; we count the same things.
    return answer.rcode() != dns.rcode.NOERROR or not answer.answer


# -- the server ---------------------------------------------------------------------------------


class DnsServer:
    """The DNS proxy of one workload (a pod in shared mode, the proxy itself in dedicated mode)."""

    def __init__(
        self,
        *,
        name: str,
        address: SocketAddr,
        state: StateReader | MeshView,
        settings: DnsSettings,
        client: Callable[[], Workload | None],
        forwarder: Forwarder,
        metrics: DnsMetrics,
        socket_factory: DnsSocketFactory = plain_socket,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        tcp_request_timeout_s: float = TCP_REQUEST_TIMEOUT_S,
        reuse_port: bool = False,
    ) -> None:
        self.name = name
        # INPOD_PORT_REUSE: a pod's DNS proxy shares 15053 with the next node proxy's during an upgrade
        # (ztunnel sets SO_REUSEPORT on its UDP sockets too, docs/istio-behaviour.md,
        # "Listeners inside the pod").
        self._reuse_port = reuse_port
        self.address = address
        self._view: MeshView = StateView(state) if isinstance(state, StateReader) else state
        self._settings = settings
        self._client = client
        self.forwarder = forwarder
        self._metrics = metrics
        self._socket_factory = socket_factory
        self._rng = rng or random.Random()
        self._clock = clock
        self._tcp_request_timeout_s = tcp_request_timeout_s
        self._udp_sock: socket.socket | None = None
        self._tcp_sock: socket.socket | None = None
        self._udp_transport: asyncio.DatagramTransport | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.answered = 0
        self.forwarded = 0
        self.refused = 0

    def __repr__(self) -> str:
        where = (
            f"udp {self.udp_address}, tcp {self.tcp_address}"
            if self._udp_sock
            else f"{self.address} (not bound)"
        )
        return (
            f"<DnsServer {self.name} on {where}: {self.answered} answered, {self.forwarded} forwarded, "
            f"{self.refused} refused, {len(self._tasks)} in flight>"
        )

    async def resolve(self, name: str) -> list[IPAddress]:
        """Addresses for `name` as this workload's DNS would give them: our answer for mesh
        services, else the upstream's (SOCKS5 domain names use this, as ztunnel's do)."""
        addresses: list[IPAddress] = []
        rdtypes = (dns.rdatatype.A, dns.rdatatype.AAAA) if self._settings.ipv6_enabled else (dns.rdatatype.A,)
        for rdtype in rdtypes:
            query = dns.message.make_query(dns.name.from_text(name), rdtype)
            request = parse_request(query.to_wire())
            if not isinstance(request, DnsRequest):
                continue
            decision = decide(request, self._client(), self._view, self._settings, self._rng)
            if isinstance(decision, LocalAnswer):
                answer = decision.response
            elif isinstance(decision, Forward):
                forwarded = await self.forwarder.forward(query)
                if isinstance(forwarded, UpstreamFailure):
                    continue
                answer = forwarded
            else:
                continue
            for rrset in answer.answer:
                if rrset.rdtype == rdtype:
                    addresses.extend(ip_address(rr.address) for rr in rrset)
        return addresses

    # -- lifecycle --

    def bind(self) -> None:
        """Bind UDP and TCP on the address (port 0: the same ephemeral port for both when free)."""
        udp = self._bind(socket.SOCK_DGRAM, self.address)
        try:
            tcp = self._bind(socket.SOCK_STREAM, SocketAddr.from_sockaddr(udp.getsockname()))
        except BindError:
            if self.address.port != 0:
                udp.close()
                raise
            tcp = self._bind(socket.SOCK_STREAM, self.address)
        except BaseException:
            udp.close()
            raise
        self._udp_sock, self._tcp_sock = udp, tcp

    def _bind(self, type: int, addr: SocketAddr) -> socket.socket:
        kind = "udp" if type == socket.SOCK_DGRAM else "tcp"
        try:
            sock = self._socket_factory(addr.family, type)
        except OSError as e:
            raise BindError(f"dns {kind}", str(addr), e) from None
        try:
            if type == socket.SOCK_STREAM:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if self._reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(addr.sockaddr())
            if type == socket.SOCK_STREAM:
                sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
        except OSError as e:
            sock.close()
            raise BindError(f"dns {kind}", str(addr), e) from None
        except BaseException:
            sock.close()
            raise
        return sock

    async def start(self) -> None:
        if self._udp_sock is None:
            self.bind()
        assert self._udp_sock is not None and self._tcp_sock is not None
        loop = asyncio.get_running_loop()
        self._udp_transport, _ = await loop.create_datagram_endpoint(
            lambda: _ServerDatagram(self), sock=self._udp_sock
        )
        self._accept_task = loop.create_task(self._accept_loop(), name=f"dns tcp {self.name}")
        log.info(
            "dns proxy started",
            extra={"fields": {"name": self.name, "udp": str(self.udp_address), "tcp": str(self.tcp_address)}},
        )

    @property
    def udp_address(self) -> SocketAddr:
        assert self._udp_sock is not None, "dns server is not bound"
        return SocketAddr.from_sockaddr(self._udp_sock.getsockname())

    @property
    def tcp_address(self) -> SocketAddr:
        assert self._tcp_sock is not None, "dns server is not bound"
        return SocketAddr.from_sockaddr(self._tcp_sock.getsockname())

    async def stop(self, deadline_s: float = 0.0) -> None:
        """Stop taking queries; let those in flight finish until the deadline, then cancel them."""
        if self._accept_task is not None:
            self._accept_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accept_task
            self._accept_task = None
        if self._tcp_sock is not None:
            self._tcp_sock.close()
            self._tcp_sock = None
        # UDP replies still being computed need the transport, so it closes after them.
        tasks = set(self._tasks)
        if tasks:
            _done, pending = (
                await asyncio.wait(tasks, timeout=deadline_s) if deadline_s > 0 else (set(), tasks)
            )
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
        if self._udp_transport is not None:
            self._udp_transport.close()
            self._udp_transport = None
        elif self._udp_sock is not None:
            self._udp_sock.close()
        self._udp_sock = None
        log.info("dns proxy stopped", extra={"fields": {"name": self.name}})

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- UDP --

    def _datagram(self, data: bytes, addr: tuple[Any, ...]) -> None:
        self._spawn(self._serve_datagram(data, addr))

    async def _serve_datagram(self, data: bytes, addr: tuple[Any, ...]) -> None:
        try:
            request = parse_request(data)
            reply = await self.handle(request, PROTOCOL_UDP, SocketAddr.from_sockaddr(addr))
            if reply is None:
                return
            wire = encode_response(reply, max_bytes=udp_limit(request))
            if self._udp_transport is not None and not self._udp_transport.is_closing():
                self._udp_transport.sendto(wire, addr)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("dns %s: udp query from %s failed", self.name, addr)

    # -- TCP --

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock = self._tcp_sock
            if sock is None:
                return
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as e:
                if self._tcp_sock is None or sock.fileno() < 0:
                    return
                log.warning("dns %s: accept failed: %s", self.name, e)
                await asyncio.sleep(0.05)  # EMFILE and friends: do not spin
                continue
            conn.setblocking(False)
            self._spawn(self._serve_connection(conn))

    async def _serve_connection(self, conn: socket.socket) -> None:
        peer = SocketAddr.from_sockaddr(conn.getpeername())
        try:
            reader, writer = await asyncio.open_connection(sock=conn)
        except BaseException:
            conn.close()
            raise
        try:
            while True:
                try:
                    head = await asyncio.wait_for(reader.readexactly(2), self._tcp_request_timeout_s)
                    data = await asyncio.wait_for(
                        reader.readexactly(int.from_bytes(head, "big")), self._tcp_request_timeout_s
                    )
                except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
                    return
                # Queries on one connection are answered as they complete (RFC 7766 6.2.1.1).
                self._spawn(self._serve_stream_query(data, peer, writer))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("dns %s: tcp connection from %s failed", self.name, peer)
        finally:
            writer.close()

    async def _serve_stream_query(self, data: bytes, peer: SocketAddr, writer: asyncio.StreamWriter) -> None:
        try:
            request = parse_request(data)
            reply = await self.handle(request, PROTOCOL_TCP, peer)
            if reply is None or writer.is_closing():
                return
            wire = encode_response(reply, max_bytes=MAX_TCP_MESSAGE_BYTES)
            writer.write(len(wire).to_bytes(2, "big") + wire)  # one write: replies never interleave
            await writer.drain()
        except asyncio.CancelledError:
            raise
        except (ConnectionError, OSError):
            return
        except Exception:
            log.exception("dns %s: tcp query from %s failed", self.name, peer)

    # -- one query --

    async def handle(
        self, request: DnsRequest | MalformedRequest, protocol: str, peer: SocketAddr
    ) -> dns.message.Message | None:
        """Decide and carry out: the reply to send, or None when there is nothing to say."""
        if isinstance(request, MalformedRequest):
            self.refused += 1
            log.debug("dns %s: malformed query from %s: %s", self.name, peer, request.reason)
            return refuse_response(request, dns.rcode.FORMERR)
        client = self._client()
        decision = decide(request, client, self._view, self._settings, self._rng)
        labels = self._metrics.labels(request, protocol, client)
        match decision:
            case Refuse():
                self.refused += 1
                if decision.counted:
                    self._metrics.request(labels)
                _access_log(request, client, f"refused ({decision.reason})", 0)
                return refuse_response(request, decision.rcode)
            case LocalAnswer():
                self.answered += 1
                self._metrics.request(labels)
                _access_log(request, client, decision.result, len(decision.addresses))
                return decision.response
            case Forward():
                return await self._forward(request, client, labels)
        raise AssertionError(decision)

    async def _forward(
        self, request: DnsRequest, client: Workload | None, labels: tuple[str, ...]
    ) -> dns.message.Message | None:
        self.forwarded += 1
        self._metrics.request(labels)
        start = self._clock()
        answer = await self.forwarder.forward(request.message)
        duration_s = max(0.0, self._clock() - start)
        if isinstance(answer, UpstreamFailure):
            self._metrics.forwarded(labels, duration_s, failed=True)
            _access_log(request, client, f"forwarding failed ({answer.reason})", 0)
            return refuse_response(request, dns.rcode.SERVFAIL)
        self._metrics.forwarded(labels, duration_s, failed=_upstream_failed(answer))
        _access_log(request, client, "forwarded", sum(len(rrset) for rrset in answer.answer))
        return forwarded_response(request, answer)


class _ServerDatagram(asyncio.DatagramProtocol):
    def __init__(self, server: DnsServer) -> None:
        self._server = server

    def datagram_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        self._server._datagram(data, addr)

    def error_received(self, exc: Exception) -> None:
        # An ICMP error for an earlier reply: that client has gone, nothing to do.
        log.debug("dns %s: udp error: %s", self._server.name, exc)


def _access_log(request: DnsRequest, client: Workload | None, result: str, endpoints: int) -> None:
    if not log.isEnabledFor(logging.DEBUG):
        return
    question = request.question
    log.debug(
        "dns request",
        extra={
            "fields": {
                "src.workload": (client and client.name) or UNKNOWN,
                "src.namespace": (client and client.namespace) or UNKNOWN,
                "query": question.rdtype.name if question is not None else UNKNOWN,
                "domain": request.name,
                "result": result,
                "endpoints": endpoints,
            }
        },
    )


def workload_dns_server(
    config: ZtunnelConfig,
    *,
    state: StateReader,
    resolv: ResolvConf,
    metrics: DnsMetrics,
    name: str,
    client: Callable[[], Workload | None],
    socket_factory: DnsSocketFactory,
) -> DnsServer:
    """The DNS proxy of one served workload, from the node proxy's config: dedicated mode uses our resolv.conf
    search list, shared mode synthesizes each pod's (docs/istio-behaviour.md, "DNS proxy")."""
    shared = config.proxy_mode is ProxyMode.SHARED
    settings = DnsSettings(
        cluster_domain=config.cluster_domain,
        search_domains=None if shared else tuple(resolv.search),
        prefered_service_namespace=config.prefered_service_namespace,
        ipv6_enabled=config.ipv6_enabled,
    )
    forwarder = UpstreamForwarder(resolv.nameservers, socket_factory=socket_factory, mark=config.packet_mark)
    return DnsServer(
        name=name,
        address=config.dns_proxy_addr,
        state=state,
        settings=settings,
        client=client,
        forwarder=forwarder,
        metrics=metrics,
        socket_factory=socket_factory,
        reuse_port=shared and config.inpod_port_reuse,
    )


__all__ = [
    "DNS_PORT",
    "DnsMetrics",
    "DnsServer",
    "DnsSocketFactory",
    "workload_dns_server",
    "Forwarder",
    "ResolvConf",
    "UpstreamFailure",
    "UpstreamForwarder",
    "plain_socket",
]
