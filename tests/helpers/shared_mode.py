"""Shared (in-pod) mode on a network-namespace fabric: the pod table the node agent serves, the
proxy's local config, DNS queries, and waiting on a condition."""

from __future__ import annotations

import asyncio

import yaml

from ambient_mesh.config import ProxyWorkloadInfo
from ambient_mesh.host.netns import Node

NODE = "node-1"

APP_PORT = 8080

CLIENT_ID = "spiffe://cluster.local/ns/shop/sa/frontend"


class PodTable:
    """The node agent's pod cache as the ZDS server reads it."""

    def __init__(self) -> None:
        self.pods: dict[str, tuple[ProxyWorkloadInfo, int | None]] = {}

    def snapshot(self):
        return [(uid, info, fd) for uid, (info, fd) in self.pods.items()]


def local_config(client: Node, server: Node, plain: Node, server_node: str = NODE) -> str:
    def workload(name: str, sa: str, node: Node, protocol: str) -> dict:
        return {
            "uid": f"Kubernetes//Pod/shop/{name}",
            "name": name,
            "namespace": "shop",
            "serviceAccount": sa,
            "trustDomain": "cluster.local",
            "workloadIps": [str(node.ipv4)],
            "protocol": protocol,
            "node": server_node if node is server else NODE,
        }

    return yaml.safe_dump(
        {
            "workloads": [
                workload("client", "frontend", client, "HBONE"),
                workload("server", "echo", server, "HBONE"),
                workload("plain", "plain", plain, "TCP"),
            ]
        }
    )


async def wait_for(predicate, timeout: float = 15.0, what: str = "condition"):
    deadline = asyncio.get_running_loop().time() + timeout
    while not (value := predicate()):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)
    return value


def dns_query(netns: str, server: str, name: str) -> list[str]:
    """An A query sent from inside `netns` to `server`:53 over UDP; the answer's addresses."""
    import socket

    import dns.message
    import dns.rdatatype

    from ambient_mesh.host.netns import netns_socket

    query = dns.message.make_query(name, dns.rdatatype.A)
    with netns_socket(netns, socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(5)
        sock.sendto(query.to_wire(), (server, 53))
        reply = dns.message.from_wire(sock.recv(4096))
    return [rr.address for rrset in reply.answer for rr in rrset if rrset.rdtype == dns.rdatatype.A]
