"""Tier 2: the node proxy's DNS proxy answers service names for the workload it serves."""

from __future__ import annotations

import asyncio

import dns.message
import dns.rdatatype

from .mesh import CLIENT_IP, VIP, local_config, start_proxy


async def ask(address, name: str, rdtype=dns.rdatatype.A) -> dns.message.Message:
    query = dns.message.make_query(name, rdtype)
    loop = asyncio.get_running_loop()
    reply: asyncio.Future[bytes] = loop.create_future()

    class Client(asyncio.DatagramProtocol):
        def datagram_received(self, data, addr):
            if not reply.done():
                reply.set_result(data)

    transport, _ = await loop.create_datagram_endpoint(Client, remote_addr=(str(address.ip), address.port))
    try:
        transport.sendto(query.to_wire())
        return dns.message.from_wire(await asyncio.wait_for(reply, 5))
    finally:
        transport.close()


async def test_service_names_resolve_to_the_vip_for_the_served_workload():
    proxy = await start_proxy("client", CLIENT_IP, local_config())
    try:
        address = proxy.workload_proxy.dns.udp_address
        for name in ("echo.default.svc.cluster.local.", "echo.default.svc.", "echo.default."):
            reply = await ask(address, name)
            addresses = [
                rr.address for rrset in reply.answer for rr in rrset if rrset.rdtype == dns.rdatatype.A
            ]
            assert addresses == [VIP], (name, reply)
            assert reply.flags & dns.flags.AA
        # found, but no IPv6 VIP: an empty NOERROR, not NXDOMAIN
        reply = await ask(address, "echo.default.svc.cluster.local.", dns.rdatatype.AAAA)
        assert reply.rcode() == dns.rcode.NOERROR and not reply.answer
        text = proxy.metrics.render()[0].decode()
        assert "istio_dns_requests_total" in text
    finally:
        await proxy.drain(0.5)


async def socks_by_name(proxy, name: bytes, port: int):
    socks = proxy.listeners["socks5"].bound_address
    reader, writer = await asyncio.open_connection(str(socks.ip), socks.port)
    writer.write(b"\x05\x01\x00" + b"\x05\x01\x00\x03" + bytes([len(name)]) + name + port.to_bytes(2, "big"))
    await writer.drain()
    assert await reader.readexactly(2) == b"\x05\x00"
    return reader, writer, await reader.readexactly(4)


async def test_socks5_domain_names_resolve_through_the_dns_proxy():
    """RFC 1928 address type 3: the name goes through the workload's DNS logic (mesh service
    -> its VIP), then the same outbound path as an address. Only mesh names are asked here:
    other names would be forwarded to the host's nameserver, which tests must not reach."""
    from .mesh import ECHO_PORT, SERVER_IP, echo_handler, start_proxy

    echo = await asyncio.start_server(echo_handler, SERVER_IP, ECHO_PORT)
    client = await start_proxy("client", CLIENT_IP, local_config())
    server = await start_proxy("server", SERVER_IP, local_config())
    try:
        reader, writer, reply = await socks_by_name(client, b"echo.default.svc.cluster.local", 80)
        assert reply[1] == 0, reply
        await reader.readexactly(6)  # bound IPv4 address and port
        writer.write(b"by name")
        writer.write_eof()
        assert await asyncio.wait_for(reader.read(), 10) == b"by name"
        writer.close()
    finally:
        await client.drain(0.5)
        await server.drain(0.5)
        echo.close()
        await echo.wait_closed()


async def test_socks5_domain_names_are_refused_without_the_dns_proxy():
    proxy = await start_proxy("client", CLIENT_IP, local_config(), ISTIO_META_DNS_CAPTURE="false")
    try:
        _reader, writer, reply = await socks_by_name(proxy, b"echo.default.svc.cluster.local", 80)
        assert reply[1] == 4  # host unreachable: nothing can resolve the name
        writer.close()
    finally:
        await proxy.drain(0.5)
