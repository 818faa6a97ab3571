"""One set of listeners serving one workload: outbound 15001, inbound HBONE 15008, inbound
plaintext 15006 and optionally SOCKS5 15080.

Counterpart: ztunnel's per-pod proxy set (src/proxy.rs `Proxy`, built by the ProxyFactory).
A dedicated-mode node proxy has one, in its own network namespace; a shared-mode node proxy has
one per pod, with every socket created inside that pod's namespace.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config import ZtunnelConfig
from ..dns.server import DnsServer
from ..errors import AmbientError
from ..host.sockets import SocketFactory, plain_socket
from ..identity.manager import SecretManager
from ..metrics import Metrics
from ..net import IPAddress, SocketAddr
from ..state.memo import StateMemo
from ..state.model import Workload
from ..state.store import StateReader
from ..tls.context import TlsContextCache
from .hbone import HboneSettings
from .inbound import InboundPassthroughProxy, InboundProxy
from .inputs import ProxyInputs
from .listener import Handler, Listener
from .outbound import OutboundProxy
from .pool import HboneConnector, HbonePool
from .socks5_server import serve_socks5
from .telemetry import record_ended_connections

log = logging.getLogger("ambient_mesh.proxy")


@dataclass(frozen=True, slots=True, kw_only=True)
class ListenerAddresses:
    outbound: SocketAddr
    inbound: SocketAddr
    inbound_plaintext: SocketAddr
    socks5: SocketAddr | None  # None: SOCKS5 off (UNSTABLE_ENABLE_SOCKS5 unset)

    @classmethod
    def from_config(cls, config: ZtunnelConfig) -> ListenerAddresses:
        return cls(
            outbound=config.outbound_addr,
            inbound=config.inbound_addr,
            inbound_plaintext=config.inbound_plaintext_addr,
            socks5=config.socks5_addr if config.socks5_enabled else None,
        )


@dataclass(frozen=True, slots=True)
class ListenerSpec:
    name: str
    address: SocketAddr
    transparent: bool  # IP_TRANSPARENT: the inbound sides, when original source is kept


def listener_specs(addresses: ListenerAddresses, transparent: bool) -> tuple[ListenerSpec, ...]:
    """The listeners of one proxy set, in bind order (the worker owner opens the same ones)."""
    specs = [
        ListenerSpec("outbound", addresses.outbound, False),
        ListenerSpec("inbound", addresses.inbound, transparent),
        ListenerSpec("inbound plaintext", addresses.inbound_plaintext, transparent),
    ]
    if addresses.socks5 is not None:
        specs.append(ListenerSpec("socks5", addresses.socks5, False))
    return tuple(specs)


def served_workload(config: ZtunnelConfig, state: StateReader) -> Workload | None:
    """The workload PROXY_WORKLOAD_INFO names (dedicated mode), once the state has it."""
    info = config.proxy_workload_info
    if info is None:
        return None
    for w in state.workloads.find_by_name(info.namespace, info.name):
        if not w.service_account or not info.service_account or w.service_account == info.service_account:
            return w
    return None


class ServedWorkload:
    """The workload a proxy serves (`find`: by PROXY_WORKLOAD_INFO, or the pod the node agent
    named), looked up once per state version (a StateMemo): every connection asks for it, and
    the lookup by name sorts its matches. Not found is not kept: the next call looks again."""

    __slots__ = ("state", "_find", "_memo")

    def __init__(self, state: StateReader, find: Callable[[], Workload | None]) -> None:
        self.state = state
        self._find = find
        self._memo: StateMemo[None, Workload] = StateMemo("served workload", 1)

    def __call__(self) -> Workload | None:
        version = self.state.version
        served = self._memo.get(version, None)
        if served is None:
            served = self._find()
            if served is not None:
                self._memo.put(version, None, served)
        return served


def hbone_settings(config: ZtunnelConfig) -> HboneSettings:
    return HboneSettings(
        stream_window_bytes=config.http2_stream_window_size,
        connection_window_bytes=config.http2_connection_window_size,
        max_frame_bytes=config.http2_frame_size,
    )


class WorkloadProxy:
    def __init__(
        self,
        *,
        name: str,
        config: ZtunnelConfig,
        state: StateReader,
        cert_manager: SecretManager,
        tls: TlsContextCache,
        metrics: Metrics,
        served: Callable[[], Workload | None],
        addresses: ListenerAddresses,
        transparent: bool,
        socket_factory: SocketFactory = plain_socket,
        reuse_port: bool = False,
        local_inbound: Callable[[Workload], InboundProxy | None] | None = None,
        dns: DnsServer | None = None,
    ) -> None:
        self.name = name
        self.dns = dns  # the DNS proxy (15053) serving the same workload, when enabled
        # Looked up per state version, so every connection sees the workload as it is now.
        self._served = served = ServedWorkload(state, served)
        self.pi = ProxyInputs(
            config=config,
            state=state,
            cert_manager=cert_manager,
            tls=tls,
            metrics=metrics,
            transparent=transparent,
            socket_factory=socket_factory,
        )
        settings = hbone_settings(config)
        self.pi.pool = HbonePool(
            HboneConnector(
                fetch_client_context=self.pi.client_context,
                # CRL_PATH, then the SPIFFE identity; hbone.py (helper hbone-core's) types the
                # certificate source as `object`.
                verify_server=tls.verify_server,  # type: ignore[arg-type]
                open_socket=self.pi.connect,
                settings=settings,
            ),
            max_streams_per_connection=config.pool_max_streams_per_connection,
            unused_release_timeout_s=config.pool_unused_release_timeout_s,
        )
        self.outbound = OutboundProxy(
            self.pi, served, local_inbound, resolve_name=dns.resolve if dns is not None else None
        )
        self.inbound = InboundProxy(self.pi, self.local_workload, settings)
        self.passthrough = InboundPassthroughProxy(self.pi, self.local_workload)
        mark, tracker = config.packet_mark, self.pi.connections

        def listener(
            name: str, address: SocketAddr, handler: Handler, *, transparent: bool = False
        ) -> Listener:
            return Listener(
                name,
                address,
                handler,
                tracker,
                transparent=transparent,
                mark=mark,
                reuse_port=reuse_port,
                socket_factory=socket_factory,
                keepalive=self.pi.keepalive,
            )

        handlers: dict[str, Handler] = {
            "outbound": self.outbound.handle_captured,
            "inbound": self.inbound.handle,
            "inbound plaintext": self.passthrough.handle,
            "socks5": functools.partial(serve_socks5, outbound=self.outbound),
        }
        self.listeners: dict[str, Listener] = {
            spec.name: listener(spec.name, spec.address, handlers[spec.name], transparent=spec.transparent)
            for spec in listener_specs(addresses, transparent)
        }

    def __repr__(self) -> str:
        return f"WorkloadProxy({self.name}, {self.pi.pool!r}, {self.pi.connections!r})"

    def served_workload(self) -> Workload | None:
        return self._served()

    def local_workload(self, ip: IPAddress) -> Workload | None:
        """The destination workload for traffic arriving at `ip`: only the served one."""
        served = self._served()
        if served is not None and ip in served.workload_ips:
            return served
        return None

    def start(self) -> None:
        """Bind every listener (a failure binds none: BindError names the address), then accept."""
        try:
            for listener in self.listeners.values():
                listener.bind()
            if self.dns is not None:
                self.dns.bind()  # bind errors surface here, with the listeners'
        except BaseException:
            for listener in self.listeners.values():
                listener.close()
            raise
        self.pi.set_listener_addresses([listener.bound_address for listener in self.listeners.values()])
        for listener in self.listeners.values():
            listener.start()
        if self.dns is not None:
            self._dns_start = asyncio.get_running_loop().create_task(
                self.dns.start(), name=f"dns {self.name}"
            )

    def bound_addresses(self) -> dict[str, str]:
        addresses = {name: str(lst.bound_address) for name, lst in self.listeners.items()}
        if self.dns is not None:
            addresses["dns"] = str(self.dns.udp_address)
        return addresses

    def connections_dump(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        return self.pi.connections.dump("inbound"), self.pi.connections.dump("outbound")

    async def drain(self, deadline_s: float) -> None:
        """Stop accepting, GOAWAY, let connections finish until the deadline, then close them."""
        for listener in self.listeners.values():
            listener.close()
        if self.dns is not None:
            await self.dns.stop(deadline_s)
        self.inbound.drain()
        if self.pi.pool is not None:
            self.pi.pool.close()
        tasks = self.pi.connections.pending()
        if tasks:
            _done, pending = (
                await asyncio.wait(tasks, timeout=deadline_s) if deadline_s > 0 else (set(), tasks)
            )
            if pending:
                log.warning("%s: drain deadline passed, closing %d connections", self.name, len(pending))
                for relay in list(self.pi.connections.relays):
                    relay.abort(AmbientError("node proxy shutting down"))
                for task in pending:
                    task.cancel()  # setup tasks; a relay's `done` is already resolved by abort
                await asyncio.wait(pending, timeout=1.0)
        record_ended_connections()  # what telemetry keeps for its next batch (metrics, access lines)
        self.pi.connection_manager.close()
