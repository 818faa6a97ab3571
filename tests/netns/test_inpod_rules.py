"""In-pod redirection rules and host probe SNAT, applied for real in network namespaces.

Python listeners stand where ztunnel's in-pod listeners would be (15001, 15006, 15008) and read
the original destination with SO_ORIGINAL_DST, as the proxy does.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import struct

import pytest

from ambient_mesh.capture.apply import Backend, PlanAction, apply_inpod_rules, remove_inpod_rules
from ambient_mesh.capture.hostprobe import (
    HostProbeConfig,
    NetlinkIpset,
    NftProbeSet,
    add_pod_to_probe_set,
    apply_host_probe_rules,
    remove_host_probe_rules,
    remove_pod_from_probe_set,
)
from ambient_mesh.capture.inpod import HOST_PROBE_SNAT_IPV4, InpodConfig
from ambient_mesh.host.netns import add_address, add_route, netns_socket

SO_ORIGINAL_DST = 80
SO_MARK = 36
PACKET_MARK = 0x539
ACCEPT_TIMEOUT_S = 5.0
BACKENDS = [Backend.IPTABLES, Backend.NFTABLES]


def original_dst_v4(sock: socket.socket) -> tuple[str, int]:
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    return str(ipaddress.IPv4Address(raw[4:8])), struct.unpack("!H", raw[2:4])[0]


def listen(netns: str, port: int, host: str = "::") -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = netns_socket(netns, family)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind((host, port))
    sock.listen(16)
    sock.settimeout(ACCEPT_TIMEOUT_S)
    return sock


def connect(
    netns: str, host: str, port: int, *, mark: int | None = None, source: str | None = None
) -> socket.socket:
    sock = netns_socket(netns, socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.settimeout(ACCEPT_TIMEOUT_S)
    if mark is not None:
        sock.setsockopt(socket.SOL_SOCKET, SO_MARK, mark)
    if source is not None:
        sock.bind((source, 0))
    sock.connect((host, port))
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


def unmapped(text: str) -> str:
    addr = ipaddress.ip_address(text)
    return str(addr.ipv4_mapped) if addr.version == 6 and addr.ipv4_mapped else str(addr)


def ruleset(runner, netns: str, backend: Backend) -> str:
    if backend is Backend.NFTABLES:
        return runner.run(["nft", "list", "ruleset"], netns=netns).text
    text = runner.run(["iptables-save"], netns=netns).text + runner.run(["ip6tables-save"], netns=netns).text
    return "\n".join(line for line in text.splitlines() if not line.startswith("#"))  # drop timestamps


def without_counters(text: str) -> str:
    return re.sub(r"counter packets \d+ bytes \d+", "counter", text)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
def test_apply_is_exact_idempotent_and_removable(fabric, runner, backend):
    pod = fabric.add_node("pod")
    cfg = InpodConfig(ipv6=True)
    first = apply_inpod_rules(runner, pod.netns, cfg, backend)
    assert first.action is PlanAction.CREATE
    after_first = without_counters(ruleset(runner, pod.netns, backend))
    if backend is Backend.IPTABLES:
        for jump in ("-A PREROUTING -j ISTIO_PRERT", "-A OUTPUT -j ISTIO_OUTPUT"):
            assert after_first.count(jump) == 6  # mangle, nat, raw; v4 and v6
        assert after_first.count("-j REDIRECT --to-ports 15001") == 2
    else:
        for table in ("istio-ambient-nat", "istio-ambient-mangle", "istio-ambient-raw"):
            assert after_first.count(f"table inet {table} ") == 1
        assert after_first.count("redirect to :15001") == 2

    again = apply_inpod_rules(runner, pod.netns, cfg, backend)
    assert again.action is (PlanAction.NONE if backend is Backend.IPTABLES else PlanAction.RECONCILE)
    assert without_counters(ruleset(runner, pod.netns, backend)) == after_first
    rules = runner.run(["ip", "rule"], netns=pod.netns).text
    assert rules.count("fwmark 0x111/0xfff lookup 100") == 1

    # a different config replaces the old one cleanly (DNS off: no raw table left behind)
    apply_inpod_rules(runner, pod.netns, InpodConfig(ipv6=True, redirect_dns=False), backend)
    changed = ruleset(runner, pod.netns, backend)
    assert "15053" not in changed and "istio-ambient-raw" not in changed
    if backend is Backend.IPTABLES:
        assert changed.count("-A PREROUTING -j ISTIO_PRERT") == 4  # mangle and nat, v4 and v6
        assert "*raw" in changed and ":ISTIO_PRERT" not in changed.split("*raw")[1].split("COMMIT")[0]

    remove_inpod_rules(runner, pod.netns, cfg, backend)
    gone = ruleset(runner, pod.netns, backend)
    assert "ISTIO" not in gone and "istio-ambient" not in gone
    assert "lookup 100" not in runner.run(["ip", "rule"], netns=pod.netns).text
    assert remove_inpod_rules(runner, pod.netns, cfg, backend).action is PlanAction.REMOVE  # idempotent


@pytest.fixture(params=BACKENDS, ids=lambda b: b.value)
def captured(request, fabric, runner):
    pod = fabric.add_node("pod")
    peer = fabric.add_node("peer")
    apply_inpod_rules(runner, pod.netns, InpodConfig(ipv6=True), request.param)
    sockets = {
        "outbound": listen(pod.netns, 15001),
        "inbound": listen(pod.netns, 15006),
        "hbone": listen(pod.netns, 15008),
        "app": listen(pod.netns, 9090),
        "peer_app": listen(peer.netns, 8080),
    }
    try:
        yield pod, peer, sockets
    finally:
        for sock in sockets.values():
            sock.close()


def test_outbound_lands_on_15001_with_the_original_destination(captured):
    pod, peer, s = captured
    with connect(pod.netns, str(peer.ipv4), 8080):
        conn, _ = s["outbound"].accept()
        with conn:
            assert original_dst_v4(conn) == (str(peer.ipv4), 8080)
    assert nothing_pending(s["peer_app"])


def test_inbound_to_an_app_port_lands_on_15006(captured):
    pod, peer, s = captured
    with connect(peer.netns, str(pod.ipv4), 9090):
        conn, client = s["inbound"].accept()
        with conn:
            assert original_dst_v4(conn) == (str(pod.ipv4), 9090)
    assert unmapped(client[0]) == str(peer.ipv4)
    assert nothing_pending(s["app"])


def test_hbone_port_is_not_redirected(captured):
    pod, peer, s = captured
    with connect(peer.netns, str(pod.ipv4), 15008):
        s["hbone"].accept()[0].close()
    assert nothing_pending(s["inbound"])


def test_socket_with_ztunnels_mark_is_not_redirected(captured):
    pod, peer, s = captured
    with connect(pod.netns, str(peer.ipv4), 8080, mark=PACKET_MARK):
        conn, client = s["peer_app"].accept()
        conn.close()
    assert unmapped(client[0]) == str(pod.ipv4)
    assert nothing_pending(s["outbound"])


def test_traffic_from_the_probe_address_is_not_redirected(captured, runner):
    pod, peer, s = captured
    # the peer plays the node: it owns the probe address, and the pod routes it back via the peer
    add_address(
        runner,
        netns=peer.netns,
        ifname=peer.ifname,
        address=ipaddress.IPv4Interface(f"{HOST_PROBE_SNAT_IPV4}/32"),
    )
    add_route(runner, netns=pod.netns, destination=f"{HOST_PROBE_SNAT_IPV4}/32", via=str(peer.ipv4))
    with connect(peer.netns, str(pod.ipv4), 9090, source=str(HOST_PROBE_SNAT_IPV4)) as client:
        conn, source = s["app"].accept()
        with conn:
            client.sendall(b"probe")
            assert conn.recv(5) == b"probe"
    assert unmapped(source[0]) == str(HOST_PROBE_SNAT_IPV4)
    assert nothing_pending(s["inbound"])


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
def test_host_probe_snat_rewrites_node_to_pod_source(fabric, runner, backend):
    node = fabric.add_node("node")
    pod = fabric.add_node("pod")
    # In a cluster the pod's default route points at its node; here only the probe address does.
    add_route(runner, netns=pod.netns, destination=f"{HOST_PROBE_SNAT_IPV4}/32", via=str(node.ipv4))
    cfg = HostProbeConfig(kubelet_uid=0)  # the test process (uid 0) plays the kubelet
    sets = (
        NftProbeSet(runner, node.netns, cfg) if backend is Backend.NFTABLES else NetlinkIpset(cfg, node.netns)
    )
    try:
        apply_host_probe_rules(runner, node.netns, cfg, backend, sets)
        apply_host_probe_rules(runner, node.netns, cfg, backend, sets)  # delete-then-create: still once
        add_pod_to_probe_set(sets, cfg, "pod-uid", [str(pod.ipv4)])
        saved = ruleset(runner, node.netns, backend)
        if backend is Backend.IPTABLES:
            assert saved.count("-A POSTROUTING -j ISTIO_POSTRT") == 1
        else:
            assert saved.count("snat ip to 169.254.7.127") == 1
        with listen(pod.netns, 8080, host="0.0.0.0") as app:
            with connect(node.netns, str(pod.ipv4), 8080):
                conn, source = app.accept()
                conn.close()
            assert source[0] == str(HOST_PROBE_SNAT_IPV4)
            # once the pod leaves the set, the node's own address shows again
            assert remove_pod_from_probe_set(sets, cfg, "pod-uid", [str(pod.ipv4)]) == []
            with connect(node.netns, str(pod.ipv4), 8080):
                conn, source = app.accept()
                conn.close()
            assert source[0] == str(node.ipv4)
        remove_host_probe_rules(runner, node.netns, cfg, backend, sets)
        leftover = ruleset(runner, node.netns, backend)
        assert "ISTIO_POSTRT" not in leftover and "istio-ambient-nat" not in leftover
    finally:
        if isinstance(sets, NetlinkIpset):
            sets.close()


def test_forwarded_traffic_is_not_snated(fabric, runner):
    """`--socket-exists`: only the node's own connections are probes; routed traffic keeps its source."""
    node = fabric.add_node("node")
    pod = fabric.add_node("pod")
    client = fabric.add_node("client")
    cfg = HostProbeConfig()
    runner.run(["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"], netns=node.netns)
    add_route(runner, netns=client.netns, destination=f"{pod.ipv4}/32", via=str(node.ipv4))
    with NetlinkIpset(cfg, node.netns) as sets:
        apply_host_probe_rules(runner, node.netns, cfg, Backend.IPTABLES, sets)
        add_pod_to_probe_set(sets, cfg, "pod-uid", [str(pod.ipv4)])
        with listen(pod.netns, 8080, host="0.0.0.0") as app:
            with connect(client.netns, str(pod.ipv4), 8080):
                conn, source = app.accept()
                conn.close()
        assert source[0] == str(client.ipv4)
