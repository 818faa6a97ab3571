"""Shared (in-pod) mode: one proxy set per pod, inside the pod's own network namespace.

Counterpart: ztunnel src/inpod/ (WorkloadProxyManager, statemanager, netns). The node agent
hands each enrolled pod's netns over ZDS (ambient_mesh.zds.client.ZdsClient drives this
manager); for each pod this opens 15001 / 15006 / 15008 (and SOCKS5 when enabled) inside that
namespace, marked 1337 and with SO_REUSEPORT so an upgraded proxy can bind beside the old one.
Outbound connections are created inside the client pod's namespace (so the far side sees the
pod's address), inbound ones are delivered to the app from the client's address (the in-pod
rules route the replies back). Certificates of every local HBONE workload are prefetched, and
forgotten when the last workload with that identity leaves the node.

Metrics as ztunnel's src/inpod/metrics.rs: `workload_manager_proxies_started_total` when a pod's
listeners are up, `..._stopped_total` when its drain has finished, and the active gauge set from
`pods` after every change (the pending gauge is the ZDS client's: it holds the retry queue).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..config import ProxyWorkloadInfo, ZtunnelConfig
from ..dns.server import DnsServer, DnsSocketFactory
from ..host.netns import NetnsHandle
from ..identity.manager import SecretManager
from ..identity.spiffe import Identity
from ..metrics import Metrics
from ..state.model import TunnelProtocol, Workload
from ..state.store import StateReader
from ..tls.context import TlsContextCache
from .inbound import InboundProxy
from .workload_proxy import ListenerAddresses, WorkloadProxy

log = logging.getLogger("ambient_mesh.inpod")


class PodProxySet(Protocol):
    """What the manager needs of a pod's proxy set: a WorkloadProxy, or (with worker
    processes) the owner's stand-in for the one the workers run (workers/owner.py)."""

    @property
    def inbound(self) -> InboundProxy | None: ...

    def start(self) -> None: ...

    def bound_addresses(self) -> dict[str, str]: ...

    def served_workload(self) -> Workload | None: ...

    def connections_dump(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]: ...

    async def drain(self, deadline_s: float) -> None: ...


# Builds (does not start) the proxy set of one pod, creating its sockets through `netns`.
PodProxyFactory = Callable[[ProxyWorkloadInfo, NetnsHandle], PodProxySet]


# (name, the served workload, the pod's socket factory) -> the pod's DNS proxy
DnsFactory = Callable[[str, Callable[[], Workload | None], DnsSocketFactory], DnsServer | None]


@dataclass(eq=False, slots=True)
class PodProxy:
    uid: str
    info: ProxyWorkloadInfo
    netns: NetnsHandle
    proxy: PodProxySet


class InpodManager:
    """The `WorkloadProxyManager` the ZDS client starts and stops pod proxies through."""

    def __init__(
        self,
        *,
        config: ZtunnelConfig,
        state: StateReader,
        cert_manager: SecretManager,
        tls: TlsContextCache,
        metrics: Metrics,
        proxy_factory: PodProxyFactory | None = None,
        dns_factory: DnsFactory | None = None,
    ) -> None:
        self.config = config
        self.state = state
        self.cert_manager = cert_manager
        self.tls = tls
        self.metrics = metrics
        self._manager_metrics = metrics.workload_manager
        self._proxy_factory = proxy_factory or self._new_proxy
        self._dns_factory = dns_factory
        self.pods: dict[str, PodProxy] = {}
        self._prefetched: set[Identity] = set()
        self._unsubscribe = state.add_listener(lambda _state: self.sync_certificates())

    def __repr__(self) -> str:
        return f"InpodManager({len(self.pods)} pods: {', '.join(str(p.info) for p in self.pods.values())})"

    def workload_for(self, info: ProxyWorkloadInfo) -> Workload | None:
        """The xDS workload of a pod the node agent named: same namespace, name and service
        account, on this node (ztunnel matches ZDS pods to WDS workloads this way)."""
        node = self.config.node_name
        for w in self.state.workloads.find_by_name(info.namespace, info.name):
            if node and w.node and w.node != node:
                continue
            if info.service_account and w.service_account and w.service_account != info.service_account:
                continue
            return w
        return None

    def _new_proxy(self, info: ProxyWorkloadInfo, netns: NetnsHandle) -> WorkloadProxy:
        return WorkloadProxy(
            name=f"{info.namespace}/{info.name}",
            config=self.config,
            state=self.state,
            cert_manager=self.cert_manager,
            tls=self.tls,
            metrics=self.metrics,
            served=lambda: self.workload_for(info),
            addresses=ListenerAddresses.from_config(self.config),
            transparent=self.config.enable_orig_src is not False,
            socket_factory=netns.socket,
            reuse_port=self.config.inpod_port_reuse,
            local_inbound=self.inbound_for,
            dns=(
                self._dns_factory(
                    f"{info.namespace}/{info.name}", lambda: self.workload_for(info), netns.socket
                )
                if self._dns_factory is not None
                else None
            ),
        )

    async def start_proxy(self, uid: str, info: ProxyWorkloadInfo, netns_fd: int) -> None:
        """Open the pod's listeners in its namespace; an exception becomes the ZDS NACK."""
        netns = NetnsHandle(os.dup(netns_fd))  # the fd is only lent for this call
        try:
            proxy = self._proxy_factory(info, netns)
            proxy.start()
        except BaseException:
            netns.close()
            raise
        self.pods[uid] = PodProxy(uid, info, netns, proxy)
        self._manager_metrics.proxy_started()
        self._manager_metrics.set_active(len(self.pods))
        log.info(
            "pod proxy started", extra={"fields": {"uid": uid, "pod": str(info), **proxy.bound_addresses()}}
        )

    def inbound_for(self, workload: Workload) -> InboundProxy | None:
        """The inbound proxy of a pod this node proxy serves (the same-node fast path)."""
        for pod in self.pods.values():
            served = pod.proxy.served_workload()
            if served is not None and served.uid == workload.uid:
                return pod.proxy.inbound
        return None

    async def stop_proxy(self, uid: str, graceful: bool) -> None:
        pod = self.pods.pop(uid, None)
        if pod is None:
            return
        # No longer active as soon as it is taken out, though its drain may still run (ztunnel's
        # count of workload states); counted as stopped once the drain is over.
        self._manager_metrics.set_active(len(self.pods))
        try:
            await pod.proxy.drain(self.config.termination_deadline_s if graceful else 0)
        finally:
            pod.netns.close()
            self._manager_metrics.proxy_stopped()
        log.info(
            "pod proxy stopped", extra={"fields": {"uid": uid, "pod": str(pod.info), "graceful": graceful}}
        )

    async def stop_all(self, graceful: bool = True) -> None:
        # Every pod drains at once, within one CONNECTION_TERMINATION_DEADLINE (as ztunnel does),
        # not one deadline after another.
        await asyncio.gather(*(self.stop_proxy(uid, graceful) for uid in list(self.pods)))
        self._unsubscribe()

    def sync_certificates(self) -> None:
        """Prefetch certificates of local HBONE workloads; forget identities no longer local."""
        node = self.config.node_name
        if not node:
            return
        wanted = {
            w.identity
            for w in self.state.workloads
            if w.node == node and (w.protocol is TunnelProtocol.HBONE or w.native_tunnel)
        }
        for identity in wanted - self._prefetched:
            self.cert_manager.prefetch(identity)
        for identity in self._prefetched - wanted:
            self.cert_manager.forget(identity)
            self.tls.forget(identity)
        self._prefetched = wanted

    def dump(self) -> dict[str, Any]:
        """`workloadState` in ztunnel's shape: each pod, its state and its connections."""
        from ..state.dump import dump_workload_state

        out: dict[str, Any] = {}
        for pod in self.pods.values():
            inbound, outbound = pod.proxy.connections_dump()
            out.update(
                dump_workload_state(
                    served=pod.proxy.served_workload(), info=pod.info, inbound=inbound, outbound=outbound
                )
            )
        return out
