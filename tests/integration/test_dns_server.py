"""The DNS proxy over real UDP and TCP on loopback, with a fake upstream nameserver beside it."""

from __future__ import annotations

import asyncio
import errno
import random
import socket

import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset
import pytest

from ambient_mesh.dns.resolver import DnsSettings
from ambient_mesh.dns.server import DnsMetrics, DnsServer, ResolvConf, UpstreamFailure, UpstreamForwarder
from ambient_mesh.metrics import Metrics
from ambient_mesh.net import SocketAddr, ip_address
from ambient_mesh.state.model import NetworkAddress, Service, Workload
from ambient_mesh.state.store import ProxyState
from tests.helpers.state_writes import load

LOOPBACK = SocketAddr.of("127.0.0.1", 0)
PORT_ATTEMPTS = 20
CLIENT = Workload(
    uid="client",
    name="client",
    namespace="ns1",
    network="nw1",
    workload_ips=(ip_address("10.0.0.1"),),
    canonical_name="client-app",
    canonical_revision="v1",
)


class FakeUpstream:
    """A nameserver on UDP and TCP answering A queries from a table; NXDOMAIN otherwise.

    Over UDP it truncates what does not fit 512 bytes, so a resolver must retry over TCP.
    """

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table
        self.queries: list[tuple[str, str]] = []  # (protocol, name)
        self._transport: asyncio.DatagramTransport | None = None
        self._server: asyncio.Server | None = None
        self.address = LOOPBACK

    def answer(self, wire: bytes, protocol: str) -> bytes:
        query = dns.message.from_wire(wire)
        name = query.question[0].name.to_text()
        self.queries.append((protocol, name))
        response = dns.message.make_response(query)
        ips = self.table.get(name)
        if ips is None:
            response.set_rcode(dns.rcode.NXDOMAIN)
        elif query.question[0].rdtype == dns.rdatatype.A:
            response.answer.append(dns.rrset.from_text(name, 60, "IN", "A", *ips))
        return response.to_wire(max_size=512 if protocol == "udp" else 65535, prefer_truncation=True)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        upstream = self

        class Datagram(asyncio.DatagramProtocol):
            def connection_made(self, transport) -> None:
                self.transport = transport

            def datagram_received(self, data: bytes, addr) -> None:
                self.transport.sendto(upstream.answer(data, "udp"), addr)

        # UDP and TCP on one port: the kernel picks a free UDP port, and the TCP one may be taken
        # by someone else's ephemeral connection meanwhile, so try a bounded number of ports.
        for attempt in range(PORT_ATTEMPTS):
            self._transport, _ = await loop.create_datagram_endpoint(Datagram, local_addr=("127.0.0.1", 0))
            port = self._transport.get_extra_info("sockname")[1]
            try:
                self._server = await asyncio.start_server(self._serve, "127.0.0.1", port)
                break
            except OSError as e:
                self._transport.close()
                if e.errno != errno.EADDRINUSE or attempt == PORT_ATTEMPTS - 1:
                    raise
        self.address = SocketAddr.of("127.0.0.1", port)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                size = int.from_bytes(await reader.readexactly(2), "big")
                wire = self.answer(await reader.readexactly(size), "tcp")
                writer.write(len(wire).to_bytes(2, "big") + wire)
                await writer.drain()
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        if self._transport is not None:
            self._transport.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


def make_state() -> ProxyState:
    state = ProxyState()
    load(
        state,
        [CLIENT],
        [
            Service(
                name="productpage",
                namespace="ns1",
                hostname="productpage.ns1.svc.cluster.local",
                vips=(NetworkAddress(network="nw1", address=ip_address("9.9.9.9")),),
                ports={80: 80},
            )
        ],
        [],
    )
    return state


class RecordingFactory:
    def __init__(self) -> None:
        self.made: list[tuple[int, int]] = []

    def __call__(self, family: int, type: int) -> socket.socket:
        self.made.append((family, type))
        return socket.socket(family, type)


@pytest.fixture
async def upstream():
    server = FakeUpstream(
        {
            "test.example.com.": ["1.1.1.1"],
            "large.example.com.": [f"240.0.0.{i}" for i in range(256)],
        }
    )
    await server.start()
    yield server
    await server.stop()


def build(forwarder, *, client=lambda: CLIENT, factory=None, metrics: Metrics | None = None) -> DnsServer:
    metrics = metrics or Metrics(process_metrics=False)
    return DnsServer(
        name="ns1/client",
        address=LOOPBACK,
        state=make_state(),
        settings=DnsSettings(),
        client=client,
        forwarder=forwarder,
        metrics=DnsMetrics(metrics),
        socket_factory=factory or RecordingFactory(),
        rng=random.Random(0),
    )


async def udp_ask(server: DnsServer, wire: bytes) -> dns.message.Message:
    loop = asyncio.get_running_loop()
    got: asyncio.Future[bytes] = loop.create_future()

    class Client(asyncio.DatagramProtocol):
        def datagram_received(self, data: bytes, addr) -> None:
            if not got.done():
                got.set_result(data)

    transport, _ = await loop.create_datagram_endpoint(Client, remote_addr=server.udp_address.sockaddr())
    try:
        transport.sendto(wire)
        return dns.message.from_wire(await asyncio.wait_for(got, 10))
    finally:
        transport.close()


async def tcp_ask(server: DnsServer, *wires: bytes) -> list[dns.message.Message]:
    reader, writer = await asyncio.open_connection(*server.tcp_address.sockaddr())
    try:
        writer.write(b"".join(len(w).to_bytes(2, "big") + w for w in wires))
        await writer.drain()
        out = []
        for _ in wires:
            size = int.from_bytes(await asyncio.wait_for(reader.readexactly(2), 10), "big")
            out.append(dns.message.from_wire(await reader.readexactly(size)))
        return out
    finally:
        writer.close()


def q(name: str, qtype: str = "A", **kw) -> bytes:
    return dns.message.make_query(name, qtype, **kw).to_wire()


def sample(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


LABELS_A_UDP = {
    "request_query_type": "a",
    "request_protocol": "udp",
    "source_canonical_service": "client-app",
    "source_canonical_revision": "v1",
}


async def test_local_answers_over_udp_and_tcp(upstream: FakeUpstream) -> None:
    metrics = Metrics(process_metrics=False)
    server = build(UpstreamForwarder([upstream.address]), metrics=metrics)
    await server.start()
    try:
        udp = await udp_ask(server, q("productpage.ns1."))
        (tcp,) = await tcp_ask(server, q("productpage.", "A"))
        for response in (udp, tcp):
            assert response.rcode() == dns.rcode.NOERROR and response.flags & dns.flags.AA
            assert [r.to_text() for r in response.answer[0]] == ["9.9.9.9"] and response.answer[0].ttl == 30
        assert upstream.queries == []
        assert sample(metrics, "istio_dns_requests_total", **LABELS_A_UDP) == 1
        assert sample(metrics, "istio_dns_requests_total", **{**LABELS_A_UDP, "request_protocol": "tcp"}) == 1
        assert sample(metrics, "istio_dns_upstream_requests_total", **LABELS_A_UDP) is None
        assert ": 2 answered, 0 forwarded, 0 refused, " in repr(server)
    finally:
        await server.stop()


async def test_unknown_names_and_types_are_forwarded(upstream: FakeUpstream) -> None:
    metrics = Metrics(process_metrics=False)
    server = build(UpstreamForwarder([upstream.address]), metrics=metrics)
    await server.start()
    try:
        found = await udp_ask(server, q("test.example.com."))
        assert (
            found.rcode() == dns.rcode.NOERROR
            and not found.flags & dns.flags.AA
            and found.flags & dns.flags.RA
        )
        assert [r.to_text() for r in found.answer[0]] == ["1.1.1.1"]
        missing = await udp_ask(server, q("nowhere.example.com."))
        assert missing.rcode() == dns.rcode.NXDOMAIN
        # Not A/AAAA: forwarded even for a mesh service name.
        (srv,) = await tcp_ask(server, q("productpage.ns1.svc.cluster.local.", "SRV"))
        assert srv.rcode() == dns.rcode.NXDOMAIN and not srv.answer
        assert upstream.queries == [
            ("udp", "test.example.com."),
            ("udp", "nowhere.example.com."),
            ("udp", "productpage.ns1.svc.cluster.local."),
        ]
        assert sample(metrics, "istio_dns_requests_total", **LABELS_A_UDP) == 2
        assert sample(metrics, "istio_dns_upstream_requests_total", **LABELS_A_UDP) == 2
        # As in ztunnel, an upstream NXDOMAIN (and an empty answer) counts as a failure.
        assert sample(metrics, "istio_dns_upstream_failures_total", **LABELS_A_UDP) == 1
        srv_labels = {**LABELS_A_UDP, "request_query_type": "srv", "request_protocol": "tcp"}
        assert sample(metrics, "istio_dns_upstream_failures_total", **srv_labels) == 1
        assert sample(metrics, "istio_dns_upstream_request_duration_seconds_count", **LABELS_A_UDP) == 2
        text = metrics.render()[0].decode()
        assert 'istio_dns_upstream_request_duration_seconds_bucket{le="0.0005"' in text
        assert "_created" not in text
    finally:
        await server.stop()


async def test_large_answers_truncate_over_udp_but_not_tcp(upstream: FakeUpstream) -> None:
    server = build(UpstreamForwarder([upstream.address]))
    await server.start()
    try:
        (tcp,) = await tcp_ask(server, q("large.example.com."))
        assert not tcp.flags & dns.flags.TC and len(tcp.answer[0]) == 256
        udp = await udp_ask(server, q("large.example.com."))
        assert udp.flags & dns.flags.TC
        # The upstream truncated its UDP reply, so the forwarder asked again over TCP.
        assert upstream.queries == [("udp", "large.example.com."), ("tcp", "large.example.com.")] * 2
    finally:
        await server.stop()


async def test_pipelined_tcp_queries_are_all_answered(upstream: FakeUpstream) -> None:
    server = build(UpstreamForwarder([upstream.address]))
    await server.start()
    try:
        wires = [
            dns.message.make_query(n, "A") for n in ("productpage.", "test.example.com.", "productpage.ns1.")
        ]
        responses = await tcp_ask(server, *(w.to_wire() for w in wires))
        assert sorted(r.id for r in responses) == sorted(w.id for w in wires)
        assert all(r.rcode() == dns.rcode.NOERROR and r.answer for r in responses)
    finally:
        await server.stop()


async def test_upstream_failures_become_servfail() -> None:
    metrics = Metrics(process_metrics=False)
    # A bound UDP socket that never answers, and a port where nothing listens.
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))
    closed = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    closed.bind(("127.0.0.1", 0))
    closed_addr = SocketAddr.from_sockaddr(closed.getsockname())
    closed.close()
    forwarder = UpstreamForwarder(
        [closed_addr, SocketAddr.from_sockaddr(silent.getsockname())], timeout_s=0.3
    )
    server = build(forwarder, metrics=metrics)
    await server.start()
    try:
        response = await udp_ask(server, q("test.example.com."))
        assert response.rcode() == dns.rcode.SERVFAIL and not response.answer
        assert sample(metrics, "istio_dns_upstream_failures_total", **LABELS_A_UDP) == 1
        assert sample(metrics, "istio_dns_requests_total", **LABELS_A_UDP) == 1
        assert repr(forwarder) == (
            f"<UpstreamForwarder to {closed_addr}, {SocketAddr.from_sockaddr(silent.getsockname())}"
            ": 2 sent, 1 failed>"
        )
    finally:
        await server.stop()
        silent.close()


async def test_next_nameserver_is_tried_after_a_failure(upstream: FakeUpstream) -> None:
    closed = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    closed.bind(("127.0.0.1", 0))
    closed_addr = SocketAddr.from_sockaddr(closed.getsockname())
    closed.close()
    forwarder = UpstreamForwarder([closed_addr, upstream.address], timeout_s=2)
    answer = await forwarder.forward(dns.message.make_query("test.example.com.", "A"))
    assert not isinstance(answer, UpstreamFailure)
    assert [r.to_text() for r in answer.answer[0]] == ["1.1.1.1"]
    assert forwarder.failed == 0 and forwarder.sent == 2


async def test_no_nameservers_is_a_failure() -> None:
    assert await UpstreamForwarder([]).forward(dns.message.make_query("x.", "A")) == UpstreamFailure(
        reason="no nameservers configured"
    )


async def test_unknown_client_gets_servfail_and_is_counted(upstream: FakeUpstream) -> None:
    metrics = Metrics(process_metrics=False)
    server = build(UpstreamForwarder([upstream.address]), client=lambda: None, metrics=metrics)
    await server.start()
    try:
        response = await udp_ask(server, q("productpage.ns1."))
        assert response.rcode() == dns.rcode.SERVFAIL
        unknown = {
            **LABELS_A_UDP,
            "source_canonical_service": "unknown",
            "source_canonical_revision": "unknown",
        }
        assert sample(metrics, "istio_dns_requests_total", **unknown) == 1
        assert upstream.queries == []
    finally:
        await server.stop()


async def test_malformed_query_gets_formerr(upstream: FakeUpstream) -> None:
    server = build(UpstreamForwarder([upstream.address]))
    await server.start()
    try:
        response = await udp_ask(server, b"\xab\xcd\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x07exam")
        assert response.id == 0xABCD and response.rcode() == dns.rcode.FORMERR
        (tcp,) = await tcp_ask(server, b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x03ab")
        assert tcp.id == 0x1234 and tcp.rcode() == dns.rcode.FORMERR
    finally:
        await server.stop()


async def test_every_socket_comes_from_the_factory(upstream: FakeUpstream) -> None:
    factory = RecordingFactory()
    server = build(UpstreamForwarder([upstream.address], socket_factory=factory), factory=factory)
    server.bind()
    assert server.udp_address.port == server.tcp_address.port != 0
    await server.start()
    try:
        await udp_ask(server, q("large.example.com."))
        assert factory.made == [
            (socket.AF_INET, socket.SOCK_DGRAM),
            (socket.AF_INET, socket.SOCK_STREAM),
            (socket.AF_INET, socket.SOCK_DGRAM),
            (socket.AF_INET, socket.SOCK_STREAM),
        ]
    finally:
        await server.stop()


async def test_stop_closes_both_listeners(upstream: FakeUpstream) -> None:
    server = build(UpstreamForwarder([upstream.address]))
    await server.start()
    tcp = server.tcp_address
    await server.stop()
    assert repr(server).startswith("<DnsServer ns1/client on 127.0.0.1:0 (not bound)")
    with pytest.raises(OSError):
        await asyncio.open_connection(*tcp.sockaddr())


def test_resolv_conf() -> None:
    conf = ResolvConf.parse(
        "# generated\n"
        "nameserver 10.96.0.10\n"
        "nameserver fe80::1%eth0\n"
        "nameserver not-an-ip\n"
        "search istio-system.svc.cluster.local svc.cluster.local cluster.local.\n"
        "options ndots:5 ; trailing\n"
    )
    assert conf.nameservers == (SocketAddr.of("10.96.0.10", 53), SocketAddr.of("fe80::1", 53))
    assert conf.search == ("istio-system.svc.cluster.local", "svc.cluster.local", "cluster.local")
    assert ResolvConf.parse("search a.example\ndomain b.example\n").search == ("b.example",)
    assert ResolvConf.parse("") == ResolvConf()


async def test_access_log_at_debug(upstream: FakeUpstream, caplog: pytest.LogCaptureFixture) -> None:
    server = build(UpstreamForwarder([upstream.address]))
    await server.start()
    try:
        with caplog.at_level("DEBUG", logger="ambient_mesh.dns"):
            await udp_ask(server, q("productpage.ns1."))
            await udp_ask(server, q("test.example.com."))
    finally:
        await server.stop()
    lines = [r.fields for r in caplog.records if r.getMessage() == "dns request"]
    assert lines == [
        {
            "src.workload": "client",
            "src.namespace": "ns1",
            "query": "A",
            "domain": "productpage.ns1.",
            "result": "success",
            "endpoints": 1,
        },
        {
            "src.workload": "client",
            "src.namespace": "ns1",
            "query": "A",
            "domain": "test.example.com.",
            "result": "forwarded",
            "endpoints": 1,
        },
    ]


async def test_a_pods_dns_port_is_shared_with_the_next_node_proxy_only_with_port_reuse(
    upstream: FakeUpstream,
) -> None:
    """INPOD_PORT_REUSE: during a node proxy upgrade both proxies' DNS servers hold a pod's 15053
    (UDP and TCP), as ztunnel's per-pod sockets do; the old one's stop leaves the new one answering."""
    from ambient_mesh.errors import BindError

    def on_port(reuse: bool, port: int) -> DnsServer:
        return DnsServer(
            name="ns1/client",
            address=SocketAddr.of("127.0.0.1", port),
            state=make_state(),
            settings=DnsSettings(),
            client=lambda: CLIENT,
            forwarder=UpstreamForwarder([upstream.address]),
            metrics=DnsMetrics(Metrics(process_metrics=False)),
            socket_factory=RecordingFactory(),
            reuse_port=reuse,
        )

    old = on_port(True, 0)
    await old.start()
    port = old.udp_address.port
    new = on_port(True, port)
    plain = on_port(False, port)
    try:
        await new.start()
        with pytest.raises(BindError):
            await plain.start()
        await old.stop()
        (tcp,) = await tcp_ask(new, q("productpage.ns1."))
        udp = await udp_ask(new, q("productpage.ns1."))
        for response in (udp, tcp):
            assert [r.to_text() for r in response.answer[0]] == ["9.9.9.9"]
    finally:
        await new.stop()
        await old.stop()
