"""Dedicated-mode capture rules, applied for real inside a pod namespace.

A Python listener stands where the proxy's listeners would be (15001, 15006, 15008) and reads
the original destination with SO_ORIGINAL_DST, as the proxy does: option 80 on SOL_IP for IPv4,
IP6T_SO_ORIGINAL_DST (also 80) on SOL_IPV6 for IPv6.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from dataclasses import dataclass

import pytest

from ambient_mesh.capture.dedicated import (
    apply_dedicated_rules,
    remove_dedicated_rules,
    render_dedicated_rules,
)
from ambient_mesh.host.netns import Fabric, Node, netns_socket

SO_ORIGINAL_DST = 80
IP6T_SO_ORIGINAL_DST = 80
SOL_IPV6 = 41
IP_TRANSPARENT = 19
SO_MARK = 36
PACKET_MARK = 1337
ACCEPT_TIMEOUT_S = 5.0


def original_dst_v4(sock: socket.socket) -> tuple[str, int]:
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)  # struct sockaddr_in
    return str(ipaddress.IPv4Address(raw[4:8])), struct.unpack("!H", raw[2:4])[0]


def original_dst_v6(sock: socket.socket) -> tuple[str, int]:
    raw = sock.getsockopt(SOL_IPV6, IP6T_SO_ORIGINAL_DST, 28)  # struct sockaddr_in6
    return str(ipaddress.IPv6Address(raw[8:24])), struct.unpack("!H", raw[2:4])[0]


def listen(netns: str, port: int, *, host: str = "::") -> socket.socket:
    """A listener inside `netns`; `::` is dual-stack, as the proxy binds its listeners."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = netns_socket(netns, family)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind((host, port))
    sock.listen(16)
    sock.settimeout(ACCEPT_TIMEOUT_S)
    return sock


def nothing_pending(listener: socket.socket) -> bool:
    listener.setblocking(False)
    try:
        conn, _ = listener.accept()
    except BlockingIOError:
        return True
    finally:
        listener.settimeout(ACCEPT_TIMEOUT_S)
    conn.close()
    return False


def unmapped(ip: str) -> str:
    addr = ipaddress.ip_address(ip)
    if addr.version == 6 and addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(addr)


def connect(netns: str, host: str, port: int, *, mark: int | None = None) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = netns_socket(netns, family)
    sock.settimeout(ACCEPT_TIMEOUT_S)
    if mark is not None:
        sock.setsockopt(socket.SOL_SOCKET, SO_MARK, mark)
    sock.connect((host, port))
    return sock


@dataclass(slots=True)
class Captured:
    fabric: Fabric
    pod: Node  # captured: rules applied, "proxy" listeners on 15001/15006/15008
    peer: Node  # an ordinary node with an app on 8080
    outbound: socket.socket
    inbound: socket.socket
    hbone: socket.socket
    peer_app: socket.socket


@pytest.fixture
def captured(fabric, runner):
    pod = fabric.add_node("pod")
    peer = fabric.add_node("peer")
    apply_dedicated_rules(runner, pod.netns, render_dedicated_rules())
    apply_dedicated_rules(runner, pod.netns, render_dedicated_rules(ipv6=True), ipv6=True)
    sockets = [
        listen(pod.netns, 15001),
        listen(pod.netns, 15006),
        listen(pod.netns, 15008),
        listen(peer.netns, 8080),
    ]
    try:
        yield Captured(fabric, pod, peer, *sockets)
    finally:
        for sock in sockets:
            sock.close()


def test_outbound_v4_is_redirected_to_15001_with_the_original_destination(captured):
    c = captured
    with connect(c.pod.netns, str(c.peer.ipv4), 8080) as client:
        conn, _ = c.outbound.accept()
        with conn:
            assert original_dst_v4(conn) == (str(c.peer.ipv4), 8080)
            client.sendall(b"ping")
            assert conn.recv(4) == b"ping"
    assert nothing_pending(c.peer_app)


def test_outbound_v6_is_redirected_with_the_ipv6_original_destination(captured):
    c = captured
    with connect(c.pod.netns, str(c.peer.ipv6), 8080):
        conn, _ = c.outbound.accept()
        with conn:
            assert original_dst_v6(conn) == (str(c.peer.ipv6), 8080)
    assert nothing_pending(c.peer_app)


def test_connections_carrying_the_packet_mark_are_not_redirected(captured):
    c = captured
    with connect(c.pod.netns, str(c.peer.ipv4), 8080, mark=PACKET_MARK):
        conn, peer = c.peer_app.accept()
        conn.close()
    assert unmapped(peer[0]) == str(c.pod.ipv4)
    assert nothing_pending(c.outbound)


def test_loopback_and_own_pod_ip_are_not_redirected(captured):
    c = captured
    with listen(c.pod.netns, 7070) as local_app:
        for host in ("127.0.0.1", "::1", str(c.pod.ipv4)):
            with connect(c.pod.netns, host, 7070):
                local_app.accept()[0].close()
    assert nothing_pending(c.outbound)
    assert nothing_pending(c.inbound)


@pytest.mark.parametrize("version", [4, 6])
def test_inbound_to_an_app_port_lands_on_15006(captured, version):
    c = captured
    target = str(c.pod.ipv4 if version == 4 else c.pod.ipv6)
    with connect(c.peer.netns, target, 9090):
        conn, peer = c.inbound.accept()
        with conn:
            original = original_dst_v4(conn) if version == 4 else original_dst_v6(conn)
    assert original == (target, 9090)
    assert unmapped(peer[0]) == str(c.peer.ipv4 if version == 4 else c.peer.ipv6)


def test_inbound_hbone_port_is_not_redirected(captured):
    c = captured
    with connect(c.peer.netns, str(c.pod.ipv4), 15008):
        c.hbone.accept()[0].close()
    assert nothing_pending(c.inbound)


def test_removing_the_rules_restores_direct_connections(captured, runner):
    c = captured
    remove_dedicated_rules(runner, c.pod.netns)
    remove_dedicated_rules(runner, c.pod.netns, ipv6=True)
    saved = (
        runner.run(["iptables-save"], netns=c.pod.netns).text
        + runner.run(["ip6tables-save"], netns=c.pod.netns).text
    )
    assert "AMBIENT_" not in saved
    with connect(c.pod.netns, str(c.peer.ipv4), 8080):
        c.peer_app.accept()[0].close()
    assert nothing_pending(c.outbound)


def test_transparent_rules_bring_original_source_replies_back_to_the_proxy(fabric, runner):
    """The proxy connects to its app *from the client's IP*: the reply must stay in the pod."""
    pod = fabric.add_node("pod")
    client = fabric.add_node("client")
    apply_dedicated_rules(runner, pod.netns, render_dedicated_rules(transparent=True))
    with listen(pod.netns, 8080, host="0.0.0.0") as app:
        proxy_side = netns_socket(pod.netns)
        with proxy_side:
            proxy_side.settimeout(ACCEPT_TIMEOUT_S)
            proxy_side.setsockopt(socket.SOL_SOCKET, SO_MARK, PACKET_MARK)
            proxy_side.setsockopt(socket.SOL_IP, IP_TRANSPARENT, 1)
            proxy_side.bind((str(client.ipv4), 0))  # not an address of this pod
            proxy_side.connect((str(pod.ipv4), 8080))
            conn, peer = app.accept()
            with conn:
                assert peer[0] == str(client.ipv4)
                proxy_side.sendall(b"request")
                assert conn.recv(7) == b"request"
                conn.sendall(b"reply")  # routed back via fwmark 0x111 -> table 100 -> lo
                assert proxy_side.recv(5) == b"reply"
