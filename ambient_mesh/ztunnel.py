"""`ambient ztunnel`: the node proxy program.

Counterpart: ztunnel src/app.rs. Start order as ztunnel's: readiness server, metrics, state
(local config), identity, admin, proxies, stats server. Shutdown (SIGTERM, SIGINT,
POST /quitquitquit): stop accepting, send GOAWAY on HBONE connections, let open connections
finish until the termination deadline, then close what is left.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import __version__
from .admin import AdminServer, Readiness, ReadinessServer, StatsServer
from .admin.readiness import DRAINING
from .config import ProxyMode, ZtunnelConfig, log_startup
from .dns.server import DnsMetrics, DnsServer, DnsSocketFactory, ResolvConf, workload_dns_server
from .errors import AmbientError, ConfigError
from .host.netns import NetnsHandle
from .host.sockets import plain_socket, set_mark
from .identity.ca import CaClient, CertificateAuthority, EmbeddedCaClient
from .identity.caclient import GrpcCaClient
from .identity.manager import SecretManager
from .identity.spiffe import Identity
from .metrics import Metrics, WithoutCreated
from .proxy.inpod import InpodManager
from .proxy.inputs import ProxyInputs
from .proxy.listener import Listener
from .proxy.workload_proxy import ListenerAddresses, ServedWorkload, WorkloadProxy, served_workload
from .state.dump import dump_policies, dump_services, dump_workloads
from .state.localconfig import parse_local_config
from .state.model import Workload
from .state.store import ProxyState
from .tls.context import TlsContextCache, remove_stale_key_files
from .tls.crl import CrlChecker
from .workers.owner import (
    OwnerInpodManager,
    PoolMetrics,
    RemoteProxySet,
    StateFeed,
    WorkerPool,
)
from .xds.client import XdsClient
from .xds.updater import StateUpdater
from .zds.client import ZdsClient

log = logging.getLogger("ambient_mesh.ztunnel")


def build_certificate_authority(config: ZtunnelConfig) -> CertificateAuthority:
    """FAKE_CA: the operator's plugged-in CA when ROOT_CA_DIR is set, else the shared test root."""
    if config.root_ca_dir:
        return CertificateAuthority.from_plugged_in_dir(config.root_ca_dir)
    log.warning(
        "FAKE_CA=true without ROOT_CA_DIR: signing with the insecure built-in test CA; "
        "set ROOT_CA_DIR to a directory with Istio's plugged-in CA files to use your own root"
    )
    return CertificateAuthority.insecure_test_ca()


def load_local_state(config: ZtunnelConfig, updater: StateUpdater, feed: StateFeed | None = None) -> None:
    """LOCAL_XDS_PATH / LOCAL_XDS through the same updater xDS pushes go through (and, with
    worker processes, the same text to every worker)."""
    source = config.local_config_source()
    if source is None:
        return
    text, name = source
    updater.apply_local_config(parse_local_config(text, name))
    if feed is not None:
        feed.set_local_config(text, name)


def check_supported(config: ZtunnelConfig) -> None:
    """Refuse, at start, configurations this build cannot serve."""
    if config.proxy_mode is ProxyMode.SHARED and config.packet_mark is None:
        raise ConfigError(
            "PACKET_MARK",
            "shared mode needs a packet mark on the proxy's sockets",
            hint="unset PACKET_MARK (default 1337) or give the mark the in-pod rules skip",
        )


def check_inpod_capabilities(config: ZtunnelConfig) -> None:
    """Shared mode enters pod namespaces and marks sockets: fail fast when it cannot (ztunnel does)."""
    try:
        with open("/proc/self/ns/net", "rb") as own:
            handle = NetnsHandle(os.dup(own.fileno()))
        try:
            sock = handle.socket(socket.AF_INET)
            try:
                if config.packet_mark is not None:
                    set_mark(sock, config.packet_mark)
            finally:
                sock.close()
        finally:
            handle.close()
    except (OSError, AmbientError) as e:
        raise ConfigError(
            "PROXY_MODE",
            f"shared mode cannot enter network namespaces or mark sockets: {e}",
            hint="the node proxy needs CAP_SYS_ADMIN (setns) and CAP_NET_ADMIN (SO_MARK); "
            "run it as root or grant them",
        ) from None


@dataclass(eq=False)
class Ztunnel:
    """A running node proxy (dedicated mode: one workload)."""

    config: ZtunnelConfig
    state: ProxyState
    updater: StateUpdater
    ca: CertificateAuthority | None  # the embedded signer with FAKE_CA=true, else None (istiod signs)
    readiness: Readiness = field(default_factory=Readiness)
    metrics: Metrics = field(default_factory=Metrics)
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    env: Mapping[str, str] = field(default_factory=dict)  # handed to worker processes
    feed: StateFeed | None = None  # what worker processes apply (ZTUNNEL_WORKER_THREADS > 1)

    def __post_init__(self) -> None:
        config = self.config
        self._served = ServedWorkload(self.state, lambda: served_workload(config, self.state))
        self.ca_client: CaClient
        if self.ca is not None:
            self.ca_client = EmbeddedCaClient(self.ca, ttl_s=int(config.secret_ttl_s))
        else:
            self.ca_client = GrpcCaClient(config, shared_mode=config.proxy_mode is ProxyMode.SHARED)
        self.cert_manager = SecretManager(self.ca_client)
        remove_stale_key_files()  # an older version's, left by a kill -9 (tls/context.py)
        self.tls = TlsContextCache(tls12=config.tls12_enabled, crl=self._crl_checker(config))
        self.workload_proxy: WorkloadProxy | None = None
        self.inpod: InpodManager | None = None
        self.zds: ZdsClient | None = None
        # ZTUNNEL_WORKER_THREADS > 1: worker processes serve the listeners (workers/owner.py);
        # this process keeps xDS, certificates, ZDS, DNS and the admin servers.
        self.pool: WorkerPool | None = None
        self.remote: RemoteProxySet | None = None
        # The DNS proxy (15053, ISTIO_META_DNS_CAPTURE): one per served workload; metrics shared.
        self.dns_metrics = DnsMetrics(self.metrics) if config.dns_proxy_enabled else None
        self.resolv = ResolvConf.read() if config.dns_proxy_enabled else None
        if config.worker_threads > 1:
            if self.feed is None:
                self.feed = StateFeed()
            self.pool = WorkerPool(
                config=config,
                env=self.env,
                feed=self.feed,
                cert_manager=self.cert_manager,
                metrics=self.metrics,
            )
        if self.pool is not None and config.proxy_mode is ProxyMode.DEDICATED:
            self.remote = RemoteProxySet(
                self.pool,
                key="dedicated",
                config=config,
                served=self.served_workload,
                transparent=config.enable_orig_src is True,
                dns=self._dns_server("dedicated", self.served_workload, plain_socket),
            )
        elif config.proxy_mode is ProxyMode.DEDICATED:
            # One proxy set in our own network namespace, serving PROXY_WORKLOAD_INFO.
            self.workload_proxy = WorkloadProxy(
                name="dedicated",
                config=config,
                state=self.state,
                cert_manager=self.cert_manager,
                tls=self.tls,
                metrics=self.metrics,
                served=self.served_workload,
                addresses=ListenerAddresses.from_config(config),
                transparent=config.enable_orig_src is True,
                dns=self._dns_server("dedicated", self.served_workload, plain_socket),
            )
        else:
            # One proxy set per pod, inside each pod's netns, as the node agent hands them over
            # (with workers: the pod's sockets opened here, its proxies run by the workers).
            manager: Callable[..., InpodManager] = (
                InpodManager if self.pool is None else functools.partial(OwnerInpodManager, pool=self.pool)
            )
            self.inpod = manager(
                config=config,
                state=self.state,
                cert_manager=self.cert_manager,
                tls=self.tls,
                metrics=self.metrics,
                dns_factory=self._dns_server if config.dns_proxy_enabled else None,
            )
        if self.inpod is not None:
            self._pods_ready = self.readiness.register("workload proxy manager")
            self.zds = ZdsClient(
                config.inpod_uds, self.inpod, on_ready_change=self._on_zds_ready, metrics=self.metrics
            )
        pool = self.pool
        refresh = pool.refresh_stats if pool is not None else None
        self.admin = AdminServer(config.admin_addr, shutdown=self._request_shutdown, refresh=refresh)
        self.stats = StatsServer(
            config.stats_addr,
            PoolMetrics(self.metrics, pool) if pool is not None else self.metrics,
            refresh=refresh,
        )
        self.readiness_server = ReadinessServer(config.readiness_addr, self.readiness)
        self._proxy_ready = self.readiness.register("proxy")
        self._state_ready = self.readiness.register("state manager")
        self.xds = (
            XdsClient(
                config,
                self.updater,
                on_ready=self._on_state_synced,
                metrics=self.metrics,
                on_push=self.feed.on_push if self.feed is not None else None,
            )
            if config.xds_address
            else None
        )
        self._shutdown_requested = asyncio.Event()
        self._state_synced = asyncio.Event()
        self._prefetched: Identity | None = None

    def __repr__(self) -> str:
        proxies = self.workload_proxy if self.workload_proxy is not None else self.inpod
        return f"Ztunnel({self.config.proxy_mode.value}, {self.state!r}, {proxies!r}, {self.readiness!r})"

    # The dedicated proxy set, under the names the tests and dumps use ---------------------
    def _crl_checker(self, config: ZtunnelConfig) -> CrlChecker | None:
        """CRL_PATH: loaded now (a bad file stops the start), its rejections counted in /metrics."""
        if not config.crl_path:
            return None
        checker = CrlChecker(config.crl_path)
        self.metrics.register(WithoutCreated((checker.metrics.rejections,)))
        return checker

    @property
    def pi(self) -> ProxyInputs:
        if self.workload_proxy is None:
            raise AttributeError("a shared-mode node proxy has one proxy set per pod: see .inpod.pods")
        return self.workload_proxy.pi

    @property
    def listeners(self) -> dict[str, Listener]:
        return self.workload_proxy.listeners if self.workload_proxy is not None else {}

    def _dns_server(
        self, name: str, client: Callable[[], Workload | None], socket_factory: DnsSocketFactory
    ) -> DnsServer | None:
        """A DNS proxy for one workload; dedicated mode uses our resolv.conf search list, shared mode
        synthesizes each pod's (docs/istio-behaviour.md, "DNS proxy")."""
        if self.dns_metrics is None or self.resolv is None:
            return None
        return workload_dns_server(
            self.config,
            state=self.state,
            resolv=self.resolv,
            metrics=self.dns_metrics,
            name=name,
            client=client,
            socket_factory=socket_factory,
        )

    def _on_zds_ready(self, ready: bool) -> None:
        if ready:
            self._pods_ready.mark_ready()
        else:
            self.readiness.mark_not_ready("workload proxy manager")

    # Which workload this proxy serves ---------------------------------------------------
    def served_workload(self) -> Workload | None:
        return self._served()

    def _prefetch_served(self) -> None:
        """Fetch the served workload's certificate as soon as the workload is known, so the
        first connection does not wait for the CA, and a CA outage later finds it cached."""
        served = self.served_workload()
        if served is not None and served.identity != self._prefetched:
            self._prefetched = served.identity
            self.cert_manager.prefetch(served.identity)

    # Lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        config = self.config
        await self.readiness_server.start()
        if self.xds is None:
            self._on_state_synced()
        else:
            self.xds.start()  # ready once every subscribed type got its first push
        self._register_dumps()
        await self.admin.start()
        if self.pool is not None:
            await self.pool.start()
        if self.remote is not None:
            self.remote.start()
            self.state.add_listener(lambda _state: self._prefetch_served())
            self._prefetch_served()
            listeners = self.remote.bound_addresses()
        elif self.workload_proxy is not None:
            self.workload_proxy.start()
            self.state.add_listener(lambda _state: self._prefetch_served())
            self._prefetch_served()
            listeners = self.workload_proxy.bound_addresses()
        else:
            check_inpod_capabilities(config)
            assert self.inpod is not None  # shared mode
            self.inpod.sync_certificates()
            self._zds_starter = asyncio.get_running_loop().create_task(self._start_zds(), name="zds start")
            listeners = {"node agent socket": config.inpod_uds}
        self._proxy_ready.mark_ready()
        await self.stats.start()
        log.info(
            "node proxy ready",
            extra={
                "fields": {
                    "mode": config.proxy_mode.value,
                    "workload": str(config.proxy_workload_info),
                    **listeners,
                    "admin": str(self.admin.bound_address),
                    "stats": str(self.stats.bound_address),
                    "readiness": str(self.readiness_server.bound_address),
                }
            },
        )

    def _on_state_synced(self) -> None:
        self._state_ready.mark_ready()
        self._state_synced.set()

    async def _start_zds(self) -> None:
        """Pods are taken over only once the state is synced (ztunnel: after the first xDS push)."""
        await self._state_synced.wait()
        assert self.zds is not None  # shared mode
        self.zds.start()

    def _register_dumps(self) -> None:
        # Sections in ztunnel's order (src/admin.rs `ConfigDump`, state flattened first); the
        # shapes live in state/dump.py.
        from .state.dump import (
            build_info,
            dump_staged_services,
            dump_static_config,
            dump_workload_state,
        )

        a = self.admin
        a.register_dump("workloads", lambda: dump_workloads(self.state))
        a.register_dump("services", lambda: dump_services(self.state))
        a.register_dump("policies", lambda: dump_policies(self.state))
        a.register_dump("stagedServices", lambda: dump_staged_services(self.state))
        a.register_dump("staticConfig", lambda: dump_static_config(self.config.local_config_source))
        a.register_dump("version", lambda: build_info(__version__))
        a.register_dump("config", self.config.to_dump)
        a.register_dump("certificates", self._dump_certificates)
        if self.pool is not None:
            a.register_dump("workers", self.pool.dump)
        # Our open connections, where ztunnel's shared mode shows them: per served workload.
        if self.remote is not None:
            remote = self.remote
            a.register_dump(
                "workloadState",
                lambda: dump_workload_state(
                    served=self.served_workload(),
                    info=self.config.proxy_workload_info,
                    inbound=remote.connections_dump()[0],
                    outbound=remote.connections_dump()[1],
                ),
            )
            return
        if self.inpod is not None:
            a.register_dump("workloadState", self.inpod.dump)
            return
        a.register_dump(
            "workloadState",
            lambda: dump_workload_state(
                served=self.served_workload(),
                info=self.config.proxy_workload_info,
                inbound=self.pi.connections.dump("inbound"),
                outbound=self.pi.connections.dump("outbound"),
            ),
        )

    def _dump_certificates(self) -> list[dict[str, Any]]:
        from .state.dump import dump_certificates

        return dump_certificates(self.cert_manager.certificates())

    def _request_shutdown(self) -> None:
        self._shutdown_requested.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT start the drain; a second SIGINT exits at once (ztunnel's rule)."""
        loop = asyncio.get_running_loop()
        sigints = 0

        def on_sigint() -> None:
            nonlocal sigints
            sigints += 1
            if sigints > 1:
                log.warning("second SIGINT: exiting now")
                os._exit(130)
            self._shutdown_requested.set()

        loop.add_signal_handler(signal.SIGTERM, self._shutdown_requested.set)
        loop.add_signal_handler(signal.SIGINT, on_sigint)

    async def run_until_shutdown(self) -> None:
        await self._shutdown_requested.wait()
        loop = asyncio.get_running_loop()
        loop.remove_signal_handler(signal.SIGTERM)
        loop.remove_signal_handler(signal.SIGINT)
        await self.drain()

    async def drain(self, deadline_s: float | None = None) -> None:
        """Stop accepting, GOAWAY, wait for open connections up to the deadline, then abort them."""
        deadline = self.config.termination_deadline_s if deadline_s is None else deadline_s
        # Not ready from the first moment of the drain, and saying why: the kubelet stops sending
        # probes' traffic our way, and a supervisor (the lab's) can start the next node proxy now
        # rather than after this one exits (its listeners are about to close).
        if DRAINING not in self.readiness.pending:
            try:
                self.readiness.register(DRAINING)
            except ValueError:
                self.readiness.mark_not_ready(DRAINING)
        if self.remote is not None:
            assert self.pool is not None
            log.info("draining %d worker processes, deadline %.1fs", self.pool.count, deadline)
            if self.remote.dns is not None:
                await self.remote.dns.stop(deadline)
        elif self.workload_proxy is not None:
            log.info(
                "draining: %d open connections, deadline %.1fs", len(self.pi.connections.relays), deadline
            )
            await self.workload_proxy.drain(deadline)
        else:
            assert self.inpod is not None and self.zds is not None  # shared mode
            log.info("draining %d pod proxies, deadline %.1fs", len(self.inpod.pods), deadline)
            starter = getattr(self, "_zds_starter", None)
            if starter is not None:
                starter.cancel()
            await self.zds.close(drain=False)
            await self.inpod.stop_all(graceful=deadline > 0)
        if self.pool is not None:
            await self.pool.drain(deadline)
        await self.stop_servers()
        self.stopped.set()

    async def stop_servers(self) -> None:
        if self.xds is not None:
            await self.xds.close()
        await self.cert_manager.close()
        if isinstance(self.ca_client, GrpcCaClient):
            await self.ca_client.close()
        for server in (self.stats, self.admin, self.readiness_server):
            try:
                await server.stop()
            except Exception:  # noqa: BLE001 - stopping must not fail the shutdown
                log.debug("stopping %r failed", server, exc_info=True)


async def build(env: Mapping[str, str]) -> Ztunnel:
    config = ZtunnelConfig.from_env(env)
    log_startup(config, env)
    check_supported(config)
    state = ProxyState()
    updater = StateUpdater(state)
    feed = StateFeed() if config.worker_threads > 1 else None
    load_local_state(config, updater, feed)
    ca = build_certificate_authority(config) if config.fake_ca else None
    return Ztunnel(config=config, state=state, updater=updater, ca=ca, env=dict(env), feed=feed)


async def run(env: Mapping[str, str]) -> int:
    proxy = await build(env)
    proxy.install_signal_handlers()  # before start: a SIGTERM during start-up still drains
    try:
        await proxy.start()
    except BaseException:
        await proxy.drain(0)
        raise
    await proxy.run_until_shutdown()
    return 0
