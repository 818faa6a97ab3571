"""The lab's network: nodes and pods as network namespaces, the lab acting as the primary CNI.

Counterpart: what a kind/minikube cluster's primary CNI (a bridge plugin plus routes between node
pod CIDRs) gives Istio's ambient e2e tests. Layout, every piece inside namespaces created here
(the host's root namespace is never touched):

    <prefix>net     br0 = 10.250.0.1/24, ip_forward on; a route per node pod CIDR via that node.
                    The control plane listens here, on br0's address.
    <prefix><node>  eth0 = 10.250.0.<10+i>/24 (the node's address, where its node proxy's
                    metrics and readiness ports are), default via 10.250.0.1; bridge `cni0` =
                    10.244.<i>.1/24, the node's pod gateway and the kubelet-side host address:
                    connections the node itself opens to its pods (kubelet probes) leave from it.
    <prefix>p-<pod> eth0 = 10.244.<i>.<10+k>/24, default via 10.244.<i>.1; the veth peer sits on
                    the node's cni0.

`plan_*` functions decide addresses and names (pure, unit-tested); `Topology` carries them out
through a CommandRunner, and as a context manager always deletes what it created. The uplink
(the network namespace, its bridge, each node's namespace on a veth with its address and default
route) is `host/netns.py`'s `Fabric`, the same fabric the netns tests run on; this module adds
what makes a node a Kubernetes node: its pod bridge, pod CIDR routes and pod sandboxes.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import AmbientError
from ..host.commands import CommandRunner, SubprocessRunner
from ..host.netns import (
    NETNS_RUN_DIR,
    Fabric,
    add_address,
    add_bridge,
    add_route,
    add_veth,
    attach_to_bridge,
    link_up,
    set_sysctl,
)

UPLINK_SUBNET = ipaddress.IPv4Network("10.250.0.0/24")
POD_SUPERNET = ipaddress.IPv4Network("10.244.0.0/16")
FIRST_NODE_HOST = 10
FIRST_POD_HOST = 10
MAX_NODES = 200  # what the address plan can number
MAX_LAB_NODES = 32  # each node runs two Python processes (about 60 MB each): more does not fit a laptop
MAX_PODS_PER_NODE = 256 - FIRST_POD_HOST - 1  # a /24 per node, hosts from .10, .255 is broadcast
POD_BRIDGE = "cni0"
POD_IFNAME = "eth0"
HOST_VETH_PREFIX = "veth"
HOST_VETH_HASH_CHARS = 8  # "veth" + 8 hex = 12 <= IFNAMSIZ-1


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeNet:
    """One node's addresses and namespace name."""

    name: str
    index: int
    netns: str
    uplink_ip: ipaddress.IPv4Address
    pod_cidr: ipaddress.IPv4Network

    @property
    def pod_gateway(self) -> ipaddress.IPv4Address:
        """cni0's address: the pods' default gateway and the address kubelet probes leave from."""
        return self.pod_cidr.network_address + 1


@dataclass(frozen=True, slots=True, kw_only=True)
class PodNet:
    """One pod sandbox: its namespace, its address, and the host end of its veth."""

    name: str  # namespace/name
    node: str
    netns: str
    ip: ipaddress.IPv4Address
    host_ifname: str
    gateway: ipaddress.IPv4Address
    prefixlen: int

    @property
    def netns_path(self) -> str:
        """What a container runtime passes as CNI_NETNS."""
        return str(NETNS_RUN_DIR / self.netns)


def plan_node(prefix: str, name: str, index: int) -> NodeNet:
    if not 0 <= index < MAX_NODES:
        raise AmbientError(f"node index {index} is out of range; the lab has room for {MAX_NODES} nodes")
    return NodeNet(
        name=name,
        index=index,
        netns=f"{prefix}{name}",
        uplink_ip=UPLINK_SUBNET.network_address + FIRST_NODE_HOST + index,
        pod_cidr=ipaddress.IPv4Network((int(POD_SUPERNET.network_address) + (index + 1) * 256, 24)),
    )


def host_veth_name(pod: str) -> str:
    """A stable, short host-side veth name for a pod (CNI bridge plugins hash the same way)."""
    digest = hashlib.sha256(pod.encode()).hexdigest()[:HOST_VETH_HASH_CHARS]
    return f"{HOST_VETH_PREFIX}{digest}"


def pod_netns_name(prefix: str, pod: str) -> str:
    """`<prefix>p-<namespace>-<name>`; netns names are file names, so '/' cannot stay."""
    return f"{prefix}p-{pod.replace('/', '-')}"


def plan_pod(prefix: str, node: NodeNet, pod: str, slot: int) -> PodNet:
    host = FIRST_POD_HOST + slot
    if not 0 <= slot or host >= node.pod_cidr.num_addresses - 1:
        raise AmbientError(f"node {node.name}'s pod CIDR {node.pod_cidr} has no room for pod {pod!r}")
    return PodNet(
        name=pod,
        node=node.name,
        netns=pod_netns_name(prefix, pod),
        ip=node.pod_cidr.network_address + host,
        host_ifname=host_veth_name(pod),
        gateway=node.pod_gateway,
        prefixlen=node.pod_cidr.prefixlen,
    )


class Topology:
    """The lab's namespaces and links on a `Fabric`. Use as a context manager: teardown always runs."""

    def __init__(
        self,
        *,
        runner: CommandRunner | None = None,
        prefix: str | None = None,
        on_create: Callable[[str], None] | None = None,
    ) -> None:
        # The uplink: br0 on UPLINK_SUBNET, nodes from FIRST_NODE_HOST (plan_node's addresses);
        # IPv4 only. `on_create` (journal.py) is told each namespace's name before it is created.
        self.fabric = Fabric(
            runner=runner or SubprocessRunner(),
            subnet=UPLINK_SUBNET,
            subnet6=None,
            prefix=prefix,
            first_node_host=FIRST_NODE_HOST,
            on_create=on_create,
        )
        self.runner = self.fabric.runner
        self.prefix = self.fabric.prefix
        self.network_netns = self.fabric.network_netns
        self.nodes: dict[str, NodeNet] = {}
        self.pods: dict[str, PodNet] = {}
        self._slots: dict[str, set[int]] = {}

    def __repr__(self) -> str:
        state = "up" if self.fabric.is_open else "down"
        return f"Topology({self.prefix!r}, {state}, {len(self.nodes)} nodes, {len(self.pods)} pods)"

    @property
    def gateway(self) -> ipaddress.IPv4Address:
        """br0's address in the network namespace, where the control plane listens."""
        return self.fabric.gateway

    @property
    def namespaces(self) -> list[str]:
        return self.fabric.namespaces

    def __enter__(self) -> Topology:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def open(self) -> None:
        self.fabric.open()

    def add_node(self, name: str) -> NodeNet:
        """The node on the uplink (the fabric's node), then its pod bridge and pod CIDR route."""
        if name in self.nodes:
            raise AmbientError(f"the lab already has a node named {name!r}")
        node = plan_node(self.prefix, name, len(self.nodes))
        uplink = self.fabric.add_node(name)
        if uplink.netns != node.netns or uplink.ipv4 != node.uplink_ip:
            raise AmbientError(
                f"the fabric gave node {name!r} {uplink.netns} {uplink.ipv4}, the lab's plan "
                f"{node.netns} {node.uplink_ip}: check FIRST_NODE_HOST and UPLINK_SUBNET"
            )
        r = self.runner
        add_bridge(r, netns=node.netns, name=POD_BRIDGE)
        add_address(
            r,
            netns=node.netns,
            ifname=POD_BRIDGE,
            address=ipaddress.IPv4Interface(f"{node.pod_gateway}/{node.pod_cidr.prefixlen}"),
        )
        # The node routes between its pods and the rest of the cluster, as a kubelet host does.
        set_sysctl(r, netns=node.netns, key="net.ipv4.ip_forward", value=1)
        add_route(r, netns=self.network_netns, destination=str(node.pod_cidr), via=str(node.uplink_ip))
        self.nodes[name] = node
        self._slots[name] = set()
        return node

    def add_pod(self, node_name: str, pod: str) -> PodNet:
        """Create the pod's sandbox: netns, veth onto the node's cni0, address, default route."""
        if pod in self.pods:
            raise AmbientError(f"the lab already has a pod named {pod!r}")
        node = self.nodes[node_name]
        used = self._slots[node_name]
        slot = next(i for i in range(len(used) + 1) if i not in used)
        net = plan_pod(self.prefix, node, pod, slot)
        r = self.runner
        self.fabric.add_namespace(net.netns)
        try:
            add_veth(r, netns=net.netns, name=POD_IFNAME, peer_netns=node.netns, peer_name=net.host_ifname)
            attach_to_bridge(r, netns=node.netns, ifname=net.host_ifname, bridge=POD_BRIDGE)
            link_up(r, netns=node.netns, ifname=net.host_ifname)
            add_address(
                r,
                netns=net.netns,
                ifname=POD_IFNAME,
                address=ipaddress.IPv4Interface(f"{net.ip}/{net.prefixlen}"),
            )
            link_up(r, netns=net.netns, ifname=POD_IFNAME)
            add_route(r, netns=net.netns, destination="default", via=str(net.gateway))
        except BaseException:
            self.fabric.delete_namespace(net.netns)
            raise
        used.add(slot)
        self.pods[pod] = net
        return net

    def remove_pod(self, pod: str) -> None:
        """Delete the sandbox; its veth (and the host end) go with the namespace."""
        net = self.pods.pop(pod)
        slot = int(net.ip) - int(self.nodes[net.node].pod_cidr.network_address) - FIRST_POD_HOST
        self._slots[net.node].discard(slot)
        self.fabric.delete_namespace(net.netns)

    def close(self) -> None:
        """Delete every namespace created here, newest (pods) first. Safe to call more than once."""
        try:
            self.fabric.close()
        finally:
            self.pods.clear()
            self.nodes.clear()
            self._slots.clear()
