"""The lab's cluster services: DNS for its names, and kube-proxy's ClusterIP DNAT in each node.

Counterparts: CoreDNS's `kubernetes` plugin (A records for `<svc>.<ns>.svc.<domain>` -> the
ClusterIP; NXDOMAIN for other names in the cluster domain) and kube-proxy in iptables mode
(per ClusterIP and port a chain that picks one ready endpoint at random with `statistic`, then
DNAT; traffic a pod sends to a Service that lands back on a pod of the same node is masqueraded,
so the reply comes back through the node and is un-NATed). Both read Services and Pods from the
lab's objects directory with the control plane's parser, so `ambient lab apply` of a Service
acts on both. The lab answers nothing outside the cluster domain (REFUSED): it never contacts
the outside.

Mesh pods do not use either for mesh names: their DNS and their connections to a ClusterIP are
captured in the pod and answered by the node proxy (DNS proxy, VIP load balancing). Pods outside
the mesh, and the node proxies' own upstream lookups, use them.

Pure parts (`endpoints_by_service`, `render_kube_proxy_rules`, `answer`) first; the resolver's
UDP loop (`python -m ambient_mesh.lab.services --objects DIR --listen IP:53`) follows.
"""

from __future__ import annotations

import argparse
import hashlib
import ipaddress
import os
import signal
import socket
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

from ..dns.resolver import DnsRequest, encode_response, parse_request, refuse_response, udp_limit
from ..kube import model
from ..kube.load import load_directory

CLUSTER_DOMAIN = "cluster.local"
SERVICE_CIDR = ipaddress.IPv4Network("10.96.0.0/16")
FIRST_SERVICE_HOST = 10
ANSWER_TTL_S = 5  # the lab's Services change under `apply`: keep caches short
MAX_DATAGRAM_BYTES = 4096  # queries are small; anything larger is not a query we answer
RELOAD_INTERVAL_S = 0.5
RECV_TIMEOUT_S = 0.5

CHAIN_SERVICES = "LAB-SERVICES"
CHAIN_POSTROUTING = "LAB-POSTROUTING"
CHAIN_SERVICE_PREFIX = "LAB-SVC-"
CHAIN_HASH_CHARS = 12  # iptables chain names are at most 28 characters


@dataclass(frozen=True, slots=True, kw_only=True)
class ServicePort:
    """One ClusterIP port and where it leads (kube-proxy's view of a Service port)."""

    service: str  # namespace/name
    cluster_ip: str
    port: int
    protocol: str
    endpoints: tuple[tuple[str, int], ...]  # (pod ip, target port), sorted

    @property
    def chain(self) -> str:
        digest = hashlib.sha256(f"{self.service}/{self.port}/{self.protocol}".encode()).hexdigest()
        return f"{CHAIN_SERVICE_PREFIX}{digest[:CHAIN_HASH_CHARS].upper()}"


def _target(port: model.ServicePort, pod: model.Pod) -> int | None:
    target = port.target_port
    if target is None:
        return port.port
    if isinstance(target, int):
        return target
    for container in pod.containers:
        for cp in container.ports:
            if cp.name == target:
                return cp.container_port
    return None


def service_ports(objects: Iterable[object]) -> list[ServicePort]:
    """Every ClusterIP port of every Service, with its ready endpoints (selector over pods)."""
    objects = list(objects)
    pods = [o for o in objects if isinstance(o, model.Pod) and o.ready and o.pod_ip and not o.host_network]
    out = []
    for svc in (o for o in objects if isinstance(o, model.Service)):
        if not svc.cluster_ip or svc.cluster_ip == "None" or not svc.selector:
            continue
        selected = [
            p
            for p in pods
            if p.metadata.namespace == svc.metadata.namespace
            and all(p.metadata.labels.get(k) == v for k, v in svc.selector.items())
        ]
        for port in svc.ports:
            if port.protocol not in ("TCP", "UDP"):
                continue
            endpoints = sorted({(p.pod_ip, t) for p in selected if (t := _target(port, p)) is not None})
            out.append(
                ServicePort(
                    service=f"{svc.metadata.namespace}/{svc.metadata.name}",
                    cluster_ip=svc.cluster_ip,
                    port=port.port,
                    protocol=port.protocol,
                    endpoints=tuple(endpoints),
                )
            )
    return sorted(out, key=lambda p: (p.service, p.port, p.protocol))


def render_kube_proxy_rules(ports: Sequence[ServicePort], pod_cidr: str) -> str:
    """An `iptables-restore --noflush` input that replaces the lab's chains in the nat table.

    The jumps into them from PREROUTING/POSTROUTING are installed once (`kube_proxy_hooks`).
    A port without endpoints is REJECTed in the filter table by kube-proxy; here its packets
    simply find nothing listening at the ClusterIP, and the connection times out or is reset.
    """
    lines = ["*nat", f":{CHAIN_SERVICES} - [0:0]", f":{CHAIN_POSTROUTING} - [0:0]"]
    lines += [f":{p.chain} - [0:0]" for p in ports if p.endpoints]
    for p in ports:
        if not p.endpoints:
            continue
        proto = p.protocol.lower()
        lines.append(
            f"-A {CHAIN_SERVICES} -d {p.cluster_ip}/32 -p {proto} -m {proto} --dport {p.port} "
            f'-m comment --comment "{p.service}:{p.port}" -j {p.chain}'
        )
        count = len(p.endpoints)
        for i, (ip, target) in enumerate(p.endpoints):
            # kube-proxy's even spread: endpoint i is taken with probability 1/(n-i) of what is left.
            pick = (
                f"-m statistic --mode random --probability {1 / (count - i):.10f} " if i < count - 1 else ""
            )
            lines.append(f"-A {p.chain} -p {proto} {pick}-j DNAT --to-destination {ip}:{target}")
    # Hairpin: a pod of this node reaching a pod of this node through a ClusterIP.
    lines.append(
        f"-A {CHAIN_POSTROUTING} -s {pod_cidr} -d {pod_cidr} -m conntrack --ctstate DNAT -j MASQUERADE"
    )
    lines.append("COMMIT")
    return "\n".join(lines) + "\n"


def kube_proxy_hooks() -> list[list[str]]:
    """The commands that create the lab's chains and jump into them (once per node)."""
    return [
        ["iptables", "-w", "-t", "nat", "-N", CHAIN_SERVICES],
        ["iptables", "-w", "-t", "nat", "-N", CHAIN_POSTROUTING],
        ["iptables", "-w", "-t", "nat", "-A", "PREROUTING", "-j", CHAIN_SERVICES],
        ["iptables", "-w", "-t", "nat", "-A", "OUTPUT", "-j", CHAIN_SERVICES],
        ["iptables", "-w", "-t", "nat", "-A", "POSTROUTING", "-j", CHAIN_POSTROUTING],
    ]


def allocate_cluster_ip(used: Iterable[str]) -> str:
    """The lowest free address of the service CIDR (the API server's allocator, made predictable)."""
    taken = {str(u) for u in used}
    for i in range(FIRST_SERVICE_HOST, SERVICE_CIDR.num_addresses - 1):
        candidate = str(SERVICE_CIDR.network_address + i)
        if candidate not in taken:
            return candidate
    raise ValueError(f"the service CIDR {SERVICE_CIDR} is full")


def resolv_conf(nameserver: str, namespace: str | None) -> str:
    """What the kubelet writes into a pod (dnsPolicy ClusterFirst) or what a node uses."""
    search = (
        f"{namespace}.svc.{CLUSTER_DOMAIN} svc.{CLUSTER_DOMAIN} {CLUSTER_DOMAIN}"
        if namespace
        else CLUSTER_DOMAIN
    )
    return f"nameserver {nameserver}\nsearch {search}\noptions ndots:5\n"


# -- DNS ------------------------------------------------------------------------------------------


def service_addresses(objects: Iterable[object]) -> dict[str, str]:
    """`<name>.<namespace>.svc.<domain>.` -> ClusterIP."""
    out = {}
    for svc in (o for o in objects if isinstance(o, model.Service)):
        if svc.cluster_ip and svc.cluster_ip != "None":
            out[f"{svc.metadata.name}.{svc.metadata.namespace}.svc.{CLUSTER_DOMAIN}."] = svc.cluster_ip
    return out


def answer(wire: bytes, names: Mapping[str, str]) -> bytes | None:
    """The reply to one query (None: nothing to answer, the bytes had no header)."""
    request = parse_request(wire)
    if not isinstance(request, DnsRequest) or request.question is None:
        reply = refuse_response(request, dns.rcode.FORMERR)
        return None if reply is None else encode_response(reply, max_bytes=udp_limit(request))
    question = request.question
    name = question.name.to_text().lower()
    domain = f"{CLUSTER_DOMAIN}."
    if not (name == domain or name.endswith("." + domain)):
        reply = refuse_response(request, dns.rcode.REFUSED)
        return encode_response(reply, max_bytes=udp_limit(request)) if reply else None
    response = dns.message.make_response(request.message)
    response.flags |= dns.flags.AA
    address = names.get(name)
    if address is None:
        response.set_rcode(dns.rcode.NXDOMAIN)
    elif question.rdtype == dns.rdatatype.A:
        response.answer.append(
            dns.rrset.from_text(question.name, ANSWER_TTL_S, dns.rdataclass.IN, dns.rdatatype.A, address)
        )
    # AAAA or another type for a name that exists: NOERROR with no records (the lab is IPv4).
    return encode_response(response, max_bytes=udp_limit(request))


def serve_dns(objects_dir: str, listen: str) -> None:
    host, _, port = listen.rpartition(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((host, int(port)))
    sock.settimeout(RECV_TIMEOUT_S)
    print(f"lab DNS for *.{CLUSTER_DOMAIN} on {listen}, from {objects_dir}", flush=True)
    names: dict[str, str] = {}
    stamp: tuple[object, ...] | None = None
    next_reload = 0.0
    while True:
        now = time.monotonic()
        if now >= next_reload:
            next_reload = now + RELOAD_INTERVAL_S
            current = objects_stamp(objects_dir)
            if current != stamp:
                stamp = current
                names = service_addresses(load_directory(objects_dir).objects)
                print(f"serving {len(names)} service names", flush=True)
        try:
            wire, peer = sock.recvfrom(MAX_DATAGRAM_BYTES)
        except TimeoutError:
            continue
        reply = answer(wire, names)
        if reply is not None:
            sock.sendto(reply, peer)


def objects_stamp(directory: str | os.PathLike[str]) -> tuple[object, ...]:
    """Changes whenever a file in the objects directory is written, replaced or removed."""
    try:
        return tuple(sorted((e.name, e.stat().st_mtime_ns) for e in os.scandir(directory)))
    except OSError:
        return ()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ambient_mesh.lab.services", description="the lab's DNS for its Services"
    )
    parser.add_argument("--objects", required=True, help="the lab's objects directory")
    parser.add_argument("--listen", required=True, help="ip:port (UDP)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    serve_dns(args.objects, args.listen)
    return 0


if __name__ == "__main__":
    sys.exit(main())
