"""One worker process: serves the listening sockets its owner hands it, with the owner's state.

Counterpart: one of ztunnel's data-plane worker threads (ZTUNNEL_WORKER_THREADS). Started by
the owner as `python -m ambient_mesh.workers <channel fd> <index>`; everything else arrives on
the channel, in order: `Hello` (the node proxy's environment, so the configuration is the
owner's), the local config, the xDS resources the owner holds, `Synced`, then `ProxyStart`
with the listening sockets, which every worker accepts from (and, in shared mode, the
pod's network namespace, for the sockets the proxy opens towards apps and peers).

The worker runs no xDS client, CA client, ZDS client nor admin server: certificates come from
the owner (`OwnerCaClient`, behind the usual SecretManager), and its counters and connections
go to the owner on request (`StatsRequest`), which serves one view of all workers. The DNS
proxy (15053) stays in the owner; SOCKS5 domain names are resolved here with the same logic. It exits when told to drain, or when the owner goes away (the
channel closes); SIGINT is the owner's to handle (a terminal's Ctrl-C reaches the whole group).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import socket
from collections.abc import Callable, Mapping
from typing import Any

from envoy.service.discovery.v3.discovery_pb2 import DeltaDiscoveryResponse
from google.protobuf.message import DecodeError

from ..config import ProxyMode, ProxyWorkloadInfo, ZtunnelConfig
from ..dns.server import DnsMetrics, DnsServer, DnsSocketFactory, ResolvConf, workload_dns_server
from ..errors import AmbientError, IdentityError
from ..host.netns import NetnsHandle
from ..host.sockets import plain_socket
from ..identity.certificate import WorkloadCertificate
from ..identity.manager import SecretManager
from ..identity.spiffe import Identity
from ..metrics import Metrics, WithoutCreated
from ..proxy.inpod import InpodManager
from ..proxy.open_connections import count_connections_in
from ..proxy.workload_proxy import ListenerAddresses, WorkloadProxy, served_workload
from ..state.localconfig import parse_local_config
from ..state.model import Workload
from ..state.store import ProxyState
from ..tls.context import TlsContextCache
from ..tls.crl import CrlChecker
from ..xds.session import XdsSession
from ..xds.updater import StateUpdater
from .channel import Channel
from .codec import (
    CertReply,
    CertRequest,
    Drain,
    Drained,
    Hello,
    LocalConfig,
    Message,
    ProxyStart,
    ProxyStarted,
    ProxyStats,
    ProxyStop,
    ProxyStopped,
    Ready,
    StatsReply,
    StatsRequest,
    Synced,
    XdsResponse,
    families_of,
    worker_decoder,
)
from .loads import WorkerLoads

log = logging.getLogger("ambient_mesh.workers")

# What the owner counts itself (or what is per process): not summed across workers.
OWNER_METRIC_PREFIXES = ("process_", "istio_build", "istio_xds_", "workload_manager_")
CERT_REPLY_TIMEOUT_S = 60.0  # the owner's own CA call, plus its wait for a rotation
MAX_QUEUED_TO_OWNER_BYTES = 64 * 1024 * 1024
MAX_QUEUED_MESSAGES = 100_000  # owner messages waiting for the worker's sequential handler
DEDICATED_KEY = "dedicated"


class OwnerCaClient:
    """The CaClient of a worker's SecretManager: asks the owner, which holds the certificates.

    With the serial it already holds, so that at rotation time (both sides refresh at the same
    half life) the owner answers only once it has the new one.
    """

    def __init__(self, worker: Worker) -> None:
        self._worker = worker
        self._serials: dict[Identity, str] = {}

    def __repr__(self) -> str:
        return f"OwnerCaClient({len(self._serials)} identities)"

    async def fetch_certificate(self, identity: Identity) -> WorkloadCertificate:
        reply = await self._worker.request_certificate(identity, self._serials.get(identity, ""))
        if reply.error:
            raise IdentityError(
                f"the node proxy's owner process has no certificate for {identity}: {reply.error}"
            )
        chain = list(reply.chain)
        cert = WorkloadCertificate.from_ca_response(identity, reply.key_pem.encode(), chain)
        self._serials[identity] = cert.serial_number
        return cert


class WorkerInpodManager(InpodManager):
    """In-pod proxies in a worker: the listening sockets are the owner's, handed over."""

    def __init__(self, *, resolver: ResolverFactory | None, loads: WorkerLoads | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.handed: dict[str, socket.socket] = {}
        self.built: WorkloadProxy | None = None
        self._resolver = resolver
        self._loads = loads

    def _new_proxy(self, info: ProxyWorkloadInfo, netns: NetnsHandle) -> WorkloadProxy:
        proxy = super()._new_proxy(info, netns)
        adopt_listeners(proxy, self.handed, self._loads)
        if self._resolver is not None:
            dns = self._resolver(
                f"{info.namespace}/{info.name}", lambda: self.workload_for(info), netns.socket
            )
            proxy.outbound.resolve_name = dns.resolve
        self.built = proxy
        return proxy


# (name, the served workload, socket factory) -> a DNS proxy that is never bound: the owner
# serves 15053; a worker only resolves SOCKS5 domain names with the same logic.
ResolverFactory = Callable[[str, Callable[[], Workload | None], DnsSocketFactory], DnsServer]


def adopt_listeners(
    proxy: WorkloadProxy, handed: Mapping[str, socket.socket], loads: WorkerLoads | None
) -> None:
    unknown = set(handed) - set(proxy.listeners)
    missing = set(proxy.listeners) - set(handed)
    if unknown or missing:
        raise AmbientError(
            f"{proxy.name}: the owner handed listeners {sorted(handed)}, this proxy has {sorted(proxy.listeners)}",
            hint="owner and worker must run the same configuration",
        )
    for name, sock in handed.items():
        proxy.listeners[name].adopt(sock, loads)


class Worker:
    def __init__(self, sock: socket.socket, index: int, loads: WorkerLoads | None = None) -> None:
        self.index = index
        # This worker's slot of the owner's connection counts (workers/loads.py): its open
        # connections count into it, its shared listeners compare it with the other workers'.
        self.loads = loads
        self.channel = Channel(
            sock,
            worker_decoder(),
            name=f"worker {index}",
            on_message=self._on_message,
            on_close=self._on_channel_closed,
            max_queued_bytes=MAX_QUEUED_TO_OWNER_BYTES,
        )
        self._queue: asyncio.Queue[Message] = asyncio.Queue()
        self._cert_waiters: dict[int, asyncio.Future[CertReply]] = {}
        self._request_ids = itertools.count(1)
        self._done = asyncio.Event()
        self.config: ZtunnelConfig | None = None
        self.proxies: dict[str, WorkloadProxy] = {}
        self.inpod: WorkerInpodManager | None = None

    def __repr__(self) -> str:
        return f"Worker({self.index}, {len(self.proxies)} proxies, {self.channel!r})"

    # -- the channel -------------------------------------------------------------------------------

    def _on_message(self, message: Message) -> None:
        # Replies and stats are answered at once; everything that changes what we serve is
        # handled in arrival order by one task.
        if isinstance(message, CertReply):
            waiter = self._cert_waiters.pop(message.request, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(message)
        elif isinstance(message, StatsRequest):
            self.channel.send(self._stats(message.request))
        elif self._queue.qsize() >= MAX_QUEUED_MESSAGES:
            self.channel.close(AmbientError(f"more than {MAX_QUEUED_MESSAGES} owner messages queued"))
        else:
            self._queue.put_nowait(message)

    def _on_channel_closed(self, error: BaseException | None) -> None:
        if error is None and not self._done.is_set():
            log.info("worker %d: the owner closed the channel; stopping", self.index)
        for waiter in self._cert_waiters.values():
            if not waiter.done():
                waiter.set_exception(IdentityError("the node proxy's owner process is gone"))
        self._cert_waiters.clear()
        self._queue.put_nowait(Drain(0.0))

    async def request_certificate(self, identity: Identity, have_serial: str) -> CertReply:
        if self.channel.closed:
            raise IdentityError("the node proxy's owner process is gone")
        request = next(self._request_ids)
        waiter: asyncio.Future[CertReply] = asyncio.get_running_loop().create_future()
        self._cert_waiters[request] = waiter
        self.channel.send(CertRequest(request, str(identity), have_serial))
        try:
            return await asyncio.wait_for(waiter, CERT_REPLY_TIMEOUT_S)
        except TimeoutError:
            raise IdentityError(
                f"the node proxy's owner process did not answer for {identity} in {CERT_REPLY_TIMEOUT_S:.0f}s"
            ) from None
        finally:
            self._cert_waiters.pop(request, None)

    # -- the sequential handler ---------------------------------------------------------------------

    async def run(self) -> None:
        self.channel.start()
        while True:
            message = await self._queue.get()
            if isinstance(message, Drain):
                await self._drain(message.deadline_s)
                return
            try:
                await self._handle(message)
            except Exception:  # noqa: BLE001 - one bad message must not take the worker down
                log.exception("worker %d: handling %s failed", self.index, type(message).__name__)

    async def _handle(self, message: Message) -> None:
        if isinstance(message, Hello):
            self._setup(message.env)
            self.channel.send(Ready(os.getpid()))
        elif self.config is None:
            raise AmbientError(f"{type(message).__name__} before Hello")
        elif isinstance(message, LocalConfig):
            self.updater.apply_local_config(parse_local_config(message.text, message.source))
        elif isinstance(message, XdsResponse):
            self._apply_xds(message.data)
        elif isinstance(message, Synced):
            log.debug("worker %d: initial state received (%r)", self.index, self.state)
        elif isinstance(message, ProxyStart):
            self.channel.send(ProxyStarted(message.key, await self._start_proxy(message)))
        elif isinstance(message, ProxyStop):
            await self._stop_proxy(message.key, message.graceful)
            self.channel.send(ProxyStopped(message.key))
        else:
            raise AmbientError(f"unexpected {type(message).__name__}")

    def _setup(self, env: Mapping[str, str]) -> None:
        from ..logs import configure_logging

        config = ZtunnelConfig.from_env(env)
        configure_logging(config.log_format, config.log_level)
        self.config = config
        self.state = ProxyState()
        self.updater = StateUpdater(self.state)
        self.session = XdsSession.from_config(config)  # decodes what the owner forwards
        self.metrics = Metrics(process_metrics=False)
        crl = None
        if config.crl_path:
            crl = CrlChecker(config.crl_path)
            self.metrics.register(WithoutCreated((crl.metrics.rejections,)))
        self.cert_manager = SecretManager(OwnerCaClient(self))
        self.tls = TlsContextCache(tls12=config.tls12_enabled, crl=crl)
        self.resolver: ResolverFactory | None = None
        if config.dns_proxy_enabled and config.socks5_enabled:
            dns_metrics, resolv = DnsMetrics(self.metrics), ResolvConf.read()
            self.resolver = lambda name, client, factory: workload_dns_server(
                config,
                state=self.state,
                resolv=resolv,
                metrics=dns_metrics,
                name=name,
                client=client,
                socket_factory=factory,
            )
        if config.proxy_mode is ProxyMode.SHARED:
            self.inpod = WorkerInpodManager(
                resolver=self.resolver,
                loads=self.loads,
                config=config,
                state=self.state,
                cert_manager=self.cert_manager,
                tls=self.tls,
                metrics=self.metrics,
            )

    def _apply_xds(self, data: bytes) -> None:
        try:
            response = DeltaDiscoveryResponse.FromString(data)
        except DecodeError as e:
            raise AmbientError(f"xDS frame from the owner does not decode: {e}") from None
        outcome = self.session.handle_response(response)
        if outcome.push.rejected:
            # The owner forwards only what it accepted: the same code must accept it here.
            log.error(
                "worker %d: rejected resources the owner accepted: %s", self.index, outcome.push.rejected
            )
        if outcome.push.known_type:
            self.updater.apply_push(outcome.push)

    async def _start_proxy(self, message: ProxyStart) -> str:
        config = self.config
        assert config is not None
        fds = list(message.fds)
        netns_fd = fds.pop(0) if message.pod is not None else None
        handed = {name: socket.socket(fileno=fd) for name, fd in zip(message.listeners, fds, strict=True)}
        try:
            if message.pod is None:
                proxy = WorkloadProxy(
                    name=DEDICATED_KEY,
                    config=config,
                    state=self.state,
                    cert_manager=self.cert_manager,
                    tls=self.tls,
                    metrics=self.metrics,
                    served=lambda: served_workload(config, self.state),
                    addresses=ListenerAddresses.from_config(config),
                    transparent=config.enable_orig_src is True,
                )
                adopt_listeners(proxy, handed, self.loads)
                if self.resolver is not None:
                    dns = self.resolver(
                        DEDICATED_KEY, lambda: served_workload(config, self.state), plain_socket
                    )
                    proxy.outbound.resolve_name = dns.resolve
                proxy.start()
                self.proxies[message.key] = proxy
                if config.proxy_workload_info is not None:
                    self.state.add_listener(lambda _s: self._prefetch_served())
                    self._prefetch_served()
            else:
                assert self.inpod is not None and netns_fd is not None
                info = ProxyWorkloadInfo(
                    namespace=message.pod.namespace,
                    name=message.pod.name,
                    service_account=message.pod.service_account,
                )
                self.inpod.handed, self.inpod.built = handed, None
                try:
                    await self.inpod.start_proxy(message.key, info, netns_fd)
                finally:
                    self.inpod.handed = {}
                assert self.inpod.built is not None
                self.proxies[message.key] = self.inpod.built
        except Exception as e:  # noqa: BLE001 - reported to the owner, which logs it
            for sock in handed.values():
                sock.close()
            log.exception("worker %d: proxy %s did not start", self.index, message.key)
            return str(e) or type(e).__name__
        finally:
            if netns_fd is not None:
                os.close(netns_fd)  # start_proxy keeps its own duplicate
        return ""

    def _prefetch_served(self) -> None:
        assert self.config is not None
        served = served_workload(self.config, self.state)
        if served is not None:
            self.cert_manager.prefetch(served.identity)

    async def _stop_proxy(self, key: str, graceful: bool) -> None:
        assert self.config is not None
        proxy = self.proxies.pop(key, None)
        if proxy is None:
            return
        if self.inpod is not None and key in self.inpod.pods:
            await self.inpod.stop_proxy(key, graceful)
        else:
            await proxy.drain(self.config.termination_deadline_s if graceful else 0)

    def _stats(self, request: int) -> StatsReply:
        if self.config is None:
            return StatsReply(request, (), {})
        proxies: dict[str, ProxyStats] = {}
        for key, proxy in self.proxies.items():
            inbound, outbound = proxy.connections_dump()
            accepted = {name: lst.accepted for name, lst in proxy.listeners.items()}
            proxies[key] = ProxyStats(accepted=accepted, inbound=inbound, outbound=outbound)
        return StatsReply(
            request, families_of(self.metrics.registry.collect(), OWNER_METRIC_PREFIXES), proxies
        )

    async def _drain(self, deadline_s: float) -> None:
        log.debug("worker %d: draining (deadline %.1fs)", self.index, deadline_s)
        if self.config is not None:
            keys = list(self.proxies)
            await asyncio.gather(*(self._stop_proxy(key, deadline_s > 0) for key in keys))
            await self.cert_manager.close()
        self._done.set()
        self.channel.send(Drained())
        # Let the reply leave before the socket closes with the process.
        for _ in range(100):
            if self.channel.closed or not self.channel.pending:
                break
            await asyncio.sleep(0.01)
        self.channel.close()


async def serve(channel_fd: int, index: int, loads_fd: int) -> None:
    loads = WorkerLoads(loads_fd, index)
    count_connections_in(loads)  # every OpenConnections of this process counts into its slot
    worker = Worker(socket.socket(fileno=channel_fd), index, loads)
    loop = asyncio.get_running_loop()
    # SIGTERM sent to a worker directly (not through the owner): drain with the configured deadline.
    loop.add_signal_handler(
        signal.SIGTERM,
        lambda: worker._queue.put_nowait(
            Drain(worker.config.termination_deadline_s if worker.config is not None else 0.0)
        ),
    )
    await worker.run()


def main(argv: list[str]) -> int:
    if len(argv) != 3 or not all(a.isdigit() for a in argv):
        print(
            "usage: python -m ambient_mesh.workers <channel fd> <index> <loads fd> (started by the node proxy)"
        )
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from ..host.malloc import tune_allocator

    tune_allocator()
    try:
        import uvloop

        uvloop.run(serve(int(argv[0]), int(argv[1]), int(argv[2])))
    except ImportError:  # pragma: no cover - uvloop is a dependency
        asyncio.run(serve(int(argv[0]), int(argv[1]), int(argv[2])))
    return 0
