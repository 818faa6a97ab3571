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
            addresses = [rr.address for rrset in reply.answer for rr in rrset if rrset.rdtype == dns.rdatatype.A]
            assert addresses == [VIP], (name, reply)
            assert reply.flags & dns.flags.AA
        # found, but no IPv6 VIP: an empty NOERROR, not NXDOMAIN
        reply = await ask(address, "echo.default.svc.cluster.local.", dns.rdatatype.AAAA)
        assert reply.rcode() == dns.rcode.NOERROR and not reply.answer
        text = proxy.metrics.render()[0].decode()
        assert "istio_dns_requests_total" in text
    finally:
        await proxy.drain(0.5)
