"""The owner's side of ZTUNNEL_WORKER_THREADS: spawn the workers, feed them, hand them sockets.

Counterpart: ztunnel's runtime with N data-plane worker threads (src/app.rs builds a
multi-threaded tokio runtime for the proxies; xDS, the CA client, ZDS and the admin servers
stay on the main thread). Here the workers are processes (ambient_mesh/workers/worker.py) and
this module is what the main thread shares with them for free:

- state: the local config text, then every xDS resource this process accepted, forwarded as
  serialized DeltaDiscoveryResponses (`StateFeed`); a new or restarted worker gets a snapshot
  of what is held, in chunks, then the live stream; order is the channel's;
- certificates: a worker's SecretManager asks; the owner answers from its own SecretManager
  (one certificate per identity, one CA client), waiting for its rotation when the worker
  already holds the current one;
- listeners: for every listener of every proxy set, one listening socket (in the pod's network
  namespace in shared mode), handed to every worker with SCM_RIGHTS: one accept queue that all
  workers take from, so a worker takes new connections when it has time for them, as tokio's
  work-stealing runtime gives ztunnel's threads work. Not an SO_REUSEPORT group with one member
  per worker: the kernel splits that by a hash of the 4-tuple, in equal shares whatever each
  worker's core has free, and the proxy's rate was then twice what its slowest worker managed
  (the second core 30% idle; docs/performance.md, "Workers"). A worker that dies or stalls
  leaves new connections to the others; the owner keeps its copy, and a restarted worker gets
  the same sockets again;
- one view: /stats/prometheus sums every worker's samples with the owner's own (counters of a
  dead worker are kept, so totals never go back), /config_dump shows the workers' connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from envoy.service.discovery.v3.discovery_pb2 import DeltaDiscoveryResponse, Resource
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric

from ..config import ProxyWorkloadInfo, ZtunnelConfig
from ..dns.server import DnsServer
from ..errors import AmbientError
from ..host.netns import NetnsHandle
from ..host.sockets import KeepaliveSettings, SocketFactory, listen_socket, plain_socket
from ..identity.manager import SecretManager
from ..identity.spiffe import Identity
from ..metrics import Metrics
from ..net import SocketAddr
from ..proxy.inpod import InpodManager
from ..proxy.workload_proxy import ListenerAddresses, listener_specs
from ..state.model import Workload
from ..xds.session import WATCHED_TYPES, Push
from .channel import Channel
from .codec import (
    CertReply,
    CertRequest,
    Drain,
    Drained,
    Family,
    Hello,
    LocalConfig,
    Message,
    PodInfo,
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
    owner_decoder,
)
from .loads import DEAD, WorkerLoads

log = logging.getLogger("ambient_mesh.workers")

WORKER_START_TIMEOUT_S = 30.0  # interpreter start and imports on a loaded 2-core machine
STATS_TIMEOUT_S = 2.0  # a scrape or dump waits this long for each worker, then uses its last reply
STOP_MARGIN_S = 5.0  # beyond the drain deadline, before a worker is killed
EXIT_WAIT_S = 5.0  # from Drained to the process's exit (interpreter teardown, on a loaded machine)
RESTART_BACKOFF_MIN_S = 0.5
RESTART_BACKOFF_MAX_S = 30.0
RESTART_BACKOFF_RESET_S = 60.0  # up this long: the next death restarts at the minimum again
CERT_ROTATION_WAIT_S = 10.0
CERT_ROTATION_POLL_S = 0.2
MAX_CERT_REQUESTS_PER_WORKER = 64
SNAPSHOT_CHUNK_BYTES = 4 * 1024 * 1024
# Owner -> one worker: what may wait unread before that worker counts as stuck and is restarted.
MAX_QUEUED_TO_WORKER_BYTES = 512 * 1024 * 1024


# -- state ----------------------------------------------------------------------------------------


class StateFeed:
    """What every worker must apply to hold the owner's state: local config and xDS resources."""

    def __init__(self) -> None:
        self.local: LocalConfig | None = None
        # type URL -> resource name -> the accepted Resource, exactly what the owner applied.
        self.resources: dict[str, dict[str, Resource]] = {t: {} for t in WATCHED_TYPES}
        self.subscribers: list[Callable[[Message], None]] = []

    def __repr__(self) -> str:
        counts = ", ".join(f"{len(r)} {t.rsplit('.', 1)[-1]}" for t, r in self.resources.items())
        return f"StateFeed({counts}, local config {'yes' if self.local else 'no'})"

    def set_local_config(self, text: str, source: str) -> None:
        self.local = LocalConfig(text, source)

    def on_push(self, response: DeltaDiscoveryResponse, push: Push) -> None:
        """XdsClient's hook: forward the accepted part of `response` (rejected resources left out,
        as the owner's updater left them out) and remember it for later workers."""
        held = self.resources.setdefault(response.type_url, {})
        accepted = {added.name for added in push.added}
        forwarded = DeltaDiscoveryResponse(type_url=response.type_url, removed_resources=list(push.removed))
        for raw in response.resources:
            if raw.name in accepted:
                held[raw.name] = raw
                forwarded.resources.append(raw)
        for name in push.removed:
            held.pop(name, None)
        if forwarded.resources or forwarded.removed_resources:
            message = XdsResponse(forwarded.SerializeToString())
            for send in list(self.subscribers):
                send(message)

    def snapshot(self) -> Iterator[Message]:
        """Everything held, for a worker that starts empty: chunks of at most SNAPSHOT_CHUNK_BYTES."""
        if self.local is not None:
            yield self.local
        for type_url in WATCHED_TYPES:
            chunk = DeltaDiscoveryResponse(type_url=type_url)
            size = 0
            for raw in self.resources.get(type_url, {}).values():
                chunk.resources.append(raw)
                size += raw.ByteSize()
                if size >= SNAPSHOT_CHUNK_BYTES:
                    yield XdsResponse(chunk.SerializeToString())
                    chunk = DeltaDiscoveryResponse(type_url=type_url)
                    size = 0
            if chunk.resources:
                yield XdsResponse(chunk.SerializeToString())
        yield Synced()


# -- the workers ----------------------------------------------------------------------------------


@dataclass(eq=False)
class HandedProxy:
    """One proxy set as the workers serve it: its listening sockets, one per listener, each
    handed to every worker."""

    key: str
    pod: PodInfo | None
    netns: NetnsHandle | None
    sockets: dict[str, socket.socket]

    def start_message(self) -> ProxyStart:
        fds = [] if self.netns is None else [self.netns.fd]
        fds.extend(sock.fileno() for sock in self.sockets.values())
        return ProxyStart(self.key, self.pod, tuple(self.sockets), tuple(fds))

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close()


@dataclass(eq=False)
class WorkerHandle:
    index: int
    process: asyncio.subprocess.Process | None = None
    channel: Channel | None = None
    pid: int | None = None
    state: str = "starting"  # starting, up, dead, stopped
    restarts: int = 0
    started_at: float = 0.0
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    drained: asyncio.Event = field(default_factory=asyncio.Event)
    last_stats: StatsReply | None = None
    stats_waiters: dict[int, asyncio.Future[StatsReply]] = field(default_factory=dict)
    stop_waiters: dict[str, asyncio.Future[None]] = field(default_factory=dict)
    cert_tasks: set[asyncio.Task[None]] = field(default_factory=set)
    start_errors: dict[str, str] = field(default_factory=dict)

    def send(self, message: Message) -> bool:
        return self.channel is not None and self.channel.send(message)


class WorkerPool:
    """N worker processes, kept running until `drain`."""

    def __init__(
        self,
        *,
        config: ZtunnelConfig,
        env: Mapping[str, str],
        feed: StateFeed,
        cert_manager: SecretManager,
        metrics: Metrics,
        count: int | None = None,
    ) -> None:
        self.config = config
        self.env = dict(env)
        self.feed = feed
        self.cert_manager = cert_manager
        self.metrics = metrics
        self.count = count if count is not None else config.worker_threads
        self.workers = [WorkerHandle(i) for i in range(self.count)]
        # Each worker's open connections, which its shared listeners read (workers/loads.py).
        self.loads = WorkerLoads.create(self.count)
        self.proxies: dict[str, HandedProxy] = {}
        self.retired = RetiredCounters()
        self._request_ids = itertools.count(1)
        self._draining = False
        self._tasks: set[asyncio.Task[Any]] = set()
        feed.subscribers.append(self._broadcast)

    def __repr__(self) -> str:
        states = ", ".join(f"{w.index}:{w.state}" for w in self.workers)
        return f"WorkerPool({self.count} workers [{states}], {len(self.proxies)} proxy sets)"

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Spawn every worker and wait until each has its state (WorkerStartError otherwise)."""
        await asyncio.gather(*(self._spawn(w) for w in self.workers))
        try:
            async with asyncio.timeout(WORKER_START_TIMEOUT_S):
                await asyncio.gather(*(w.ready.wait() for w in self.workers))
        except TimeoutError:
            late = [w.index for w in self.workers if not w.ready.is_set()]
            raise AmbientError(
                f"worker processes {late} did not start within {WORKER_START_TIMEOUT_S:.0f}s",
                hint="see their log lines above; ZTUNNEL_WORKER_THREADS=1 runs without workers",
            ) from None

    async def _spawn(self, worker: WorkerHandle) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.loads.set(worker.index, 0)  # a restarted worker carries nothing yet
        try:
            worker.process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-X",
                "faulthandler",
                "-m",
                "ambient_mesh.workers",
                str(theirs.fileno()),
                str(worker.index),
                str(self.loads.fd),
                pass_fds=(theirs.fileno(), self.loads.fd),
                stdin=asyncio.subprocess.DEVNULL,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        worker.state = "starting"
        worker.ready.clear()
        worker.drained.clear()
        worker.started_at = asyncio.get_running_loop().time()
        worker.channel = Channel(
            ours,
            owner_decoder(),
            name=f"worker {worker.index} (pid {worker.process.pid})",
            on_message=lambda m: self._on_message(worker, m),
            on_close=lambda e: self._on_closed(worker, e),
            max_queued_bytes=MAX_QUEUED_TO_WORKER_BYTES,
        )
        worker.channel.start()
        worker.send(Hello(self.env))
        self._spawn_task(self._watch(worker, worker.process), f"worker {worker.index} watch")

    def _spawn_task(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _watch(self, worker: WorkerHandle, process: asyncio.subprocess.Process) -> None:
        code = await process.wait()
        if worker.process is not process:
            return
        if worker.channel is not None:
            worker.channel.close()
        if self._draining:
            worker.state = "stopped"
            worker.drained.set()
            return
        self._retire(worker)
        worker.state = "dead"
        self.loads.set(worker.index, DEAD)  # nobody leaves connections to it
        up_for = asyncio.get_running_loop().time() - worker.started_at
        backoff = (
            RESTART_BACKOFF_MIN_S
            if up_for >= RESTART_BACKOFF_RESET_S
            else min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_MIN_S * 2 ** min(worker.restarts, 16))
        )
        log.warning(
            "worker %d (pid %s) exited with %s; restarting in %.1fs (the other workers take new "
            "connections meanwhile)",
            worker.index,
            process.pid,
            code,
            backoff,
        )
        while not self._draining:
            await asyncio.sleep(backoff)
            if self._draining:
                return
            worker.restarts += 1
            try:
                await self._spawn(worker)
                return
            except Exception:  # noqa: BLE001 - e.g. out of processes: try again later
                log.exception("worker %d could not be started again", worker.index)
                backoff = min(RESTART_BACKOFF_MAX_S, backoff * 2)

    def _retire(self, worker: WorkerHandle) -> None:
        if worker.last_stats is not None:
            self.retired.add(worker.last_stats.families)
            worker.last_stats = None
        waiters: list[asyncio.Future[Any]] = [*worker.stats_waiters.values(), *worker.stop_waiters.values()]
        for waiter in waiters:
            if not waiter.done():
                waiter.cancel()
        worker.stats_waiters.clear()
        worker.stop_waiters.clear()
        for task in worker.cert_tasks:
            task.cancel()

    # -- messages from a worker ----------------------------------------------------------------------

    def _on_message(self, worker: WorkerHandle, message: Message) -> None:
        if isinstance(message, Ready):
            worker.pid = message.pid
            for item in self.feed.snapshot():
                worker.send(item)
            for proxy in self.proxies.values():
                worker.send(proxy.start_message())
            worker.state = "up"
            worker.ready.set()
            log.info("worker %d (pid %d) serving %d proxy sets", worker.index, message.pid, len(self.proxies))
        elif isinstance(message, CertRequest):
            if len(worker.cert_tasks) >= MAX_CERT_REQUESTS_PER_WORKER:
                worker.send(CertReply(message.request, "", (), "too many certificate requests in flight"))
                return
            task = self._spawn_task(self._answer_cert(worker, message), f"worker {worker.index} cert")
            worker.cert_tasks.add(task)
            task.add_done_callback(worker.cert_tasks.discard)
        elif isinstance(message, StatsReply):
            worker.last_stats = message
            waiter = worker.stats_waiters.pop(message.request, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(message)
        elif isinstance(message, ProxyStarted):
            if message.error:
                worker.start_errors[message.key] = message.error
                log.error("worker %d could not serve %s: %s", worker.index, message.key, message.error)
        elif isinstance(message, ProxyStopped):
            stopped = worker.stop_waiters.pop(message.key, None)
            if stopped is not None and not stopped.done():
                stopped.set_result(None)
        elif isinstance(message, Drained):
            worker.drained.set()

    def _on_closed(self, worker: WorkerHandle, error: BaseException | None) -> None:
        # A worker whose channel broke (protocol error, stuck) is ended; _watch restarts it.
        process = worker.process
        if process is not None and process.returncode is None and not self._draining:
            with contextlib.suppress(ProcessLookupError):
                process.kill()

    async def _answer_cert(self, worker: WorkerHandle, request: CertRequest) -> None:
        try:
            identity = Identity.parse(request.identity)
            cert = await self.cert_manager.fetch_certificate(identity)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + CERT_ROTATION_WAIT_S
            # The worker refreshes at the same half life as we do: wait for our new one.
            while cert.serial_number == request.have_serial and loop.time() < deadline:
                await asyncio.sleep(CERT_ROTATION_POLL_S)
                cert = await self.cert_manager.fetch_certificate(identity)
            if cert.serial_number == request.have_serial:
                raise AmbientError("rotation still pending at the owner; keep the current certificate")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the reply carries any failure; the worker backs off
            worker.send(CertReply(request.request, "", (), str(e) or type(e).__name__))
            return
        chain = tuple(pem.decode() for pem in (*cert.chain_pem, cert.roots_pem))
        worker.send(CertReply(request.request, cert.private_key_pem.decode(), chain, ""))

    def _broadcast(self, message: Message) -> None:
        for worker in self.workers:
            if worker.state == "up":
                worker.send(message)

    # -- proxy sets --------------------------------------------------------------------------------

    def add_proxy(self, proxy: HandedProxy) -> None:
        self.proxies[proxy.key] = proxy
        for worker in self.workers:
            if worker.state == "up":
                worker.send(proxy.start_message())

    async def remove_proxy(self, key: str, *, graceful: bool, deadline_s: float) -> None:
        """Stop `key` in every worker and wait (up to the deadline and a margin) for each."""
        proxy = self.proxies.pop(key, None)
        if proxy is None:
            return
        proxy.close()  # ours first: a socket still open here would queue clients nobody accepts
        loop = asyncio.get_running_loop()
        waits = []
        for worker in self.workers:
            if worker.state != "up":
                continue
            waiter: asyncio.Future[None] = loop.create_future()
            worker.stop_waiters[key] = waiter
            if worker.send(ProxyStop(key, graceful)):
                waits.append(waiter)
        if waits:
            await asyncio.wait(waits, timeout=deadline_s + STOP_MARGIN_S)

    # -- one view ----------------------------------------------------------------------------------

    async def refresh_stats(self) -> None:
        """Ask every live worker for its counters and connections; keep the last answers."""
        loop = asyncio.get_running_loop()
        waits = []
        for worker in self.workers:
            if worker.state != "up":
                continue
            request = next(self._request_ids)
            waiter: asyncio.Future[StatsReply] = loop.create_future()
            worker.stats_waiters[request] = waiter
            if worker.send(StatsRequest(request)):
                waits.append(waiter)
            else:
                worker.stats_waiters.pop(request, None)
        if waits:
            await asyncio.wait(waits, timeout=STATS_TIMEOUT_S)
        for worker in self.workers:
            for request, waiter in list(worker.stats_waiters.items()):
                if not waiter.done():
                    waiter.cancel()
                    worker.stats_waiters.pop(request, None)

    def worker_families(self) -> Iterator[Family]:
        for worker in self.workers:
            if worker.last_stats is not None:
                yield from worker.last_stats.families

    def proxy_stats(self, key: str) -> list[ProxyStats]:
        out = []
        for worker in self.workers:
            if worker.last_stats is not None and key in worker.last_stats.proxies:
                out.append(worker.last_stats.proxies[key])
        return out

    def connections(self, key: str) -> tuple[list[Any], list[Any]]:
        inbound: list[Any] = []
        outbound: list[Any] = []
        for stats in self.proxy_stats(key):
            inbound.extend(stats.inbound)
            outbound.extend(stats.outbound)
        return inbound, outbound

    def dump(self) -> list[dict[str, Any]]:
        """`/config_dump` section `workers`: each worker, its process and what it accepted."""
        out = []
        for worker in self.workers:
            stats = worker.last_stats
            out.append(
                {
                    "index": worker.index,
                    "pid": worker.pid,
                    "state": worker.state,
                    "restarts": worker.restarts,
                    "accepted": {} if stats is None else {k: p.accepted for k, p in stats.proxies.items()},
                    "startErrors": dict(worker.start_errors),
                }
            )
        return out

    # -- shutdown ----------------------------------------------------------------------------------

    async def drain(self, deadline_s: float) -> None:
        """Stop accepting everywhere, let every worker drain until the deadline, then end them."""
        self._draining = True
        for proxy in self.proxies.values():
            proxy.close()
        self.proxies.clear()
        for worker in self.workers:
            if worker.channel is not None:
                worker.channel.close_expected = True
            if worker.state in ("up", "starting") and not worker.send(Drain(deadline_s)):
                worker.drained.set()
        live = [w for w in self.workers if w.process is not None and w.process.returncode is None]
        if live:
            await asyncio.wait(
                [asyncio.ensure_future(w.drained.wait()) for w in live], timeout=deadline_s + STOP_MARGIN_S
            )
        for worker in live:
            process = worker.process
            assert process is not None
            try:
                await asyncio.wait_for(process.wait(), EXIT_WAIT_S)
            except TimeoutError:
                log.warning("worker %d did not exit after draining; killing it", worker.index)
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
            if worker.channel is not None:
                worker.channel.close()
            worker.state = "stopped"
        for task in list(self._tasks):
            task.cancel()
        self.feed.subscribers.remove(self._broadcast)
        self.loads.close()


class RetiredCounters:
    """Counter (and histogram) samples of workers that died, so summed totals never go back."""

    def __init__(self) -> None:
        self.families: dict[str, Family] = {}

    def add(self, families: Iterable[Family]) -> None:
        for family in families:
            name, kind, help_text, unit, samples = family
            if kind not in ("counter", "histogram"):
                continue  # gauges (open sockets) went with the worker
            if name in self.families:
                samples = self.families[name][4] + samples
            self.families[name] = (name, kind, help_text, unit, samples)


# -- metrics as one view ----------------------------------------------------------------------


def merge_families(families: Iterable[Family]) -> list[Metric]:
    """Families of the same name become one; samples with the same name and labels are summed."""
    merged: dict[str, tuple[Family, dict[tuple[str, tuple[tuple[str, str], ...]], float]]] = {}
    for family in families:
        name, _kind, _help, _unit, samples = family
        entry = merged.get(name)
        if entry is None:
            entry = (family, {})
            merged[name] = entry
        sums = entry[1]
        for sample_name, labels, value in samples:
            key = (sample_name, tuple(sorted(labels.items())))
            sums[key] = sums.get(key, 0.0) + value
    out = []
    for (name, kind, help_text, unit, _samples), sums in merged.values():
        metric = Metric(name, help_text, kind, unit)
        for (sample_name, label_items), value in sums.items():
            metric.add_sample(sample_name, dict(label_items), value)
        out.append(metric)
    return out


class PoolMetrics:
    """The StatsServer's renderer with workers: the owner's registry plus every worker's."""

    def __init__(self, metrics: Metrics, pool: WorkerPool) -> None:
        self._metrics = metrics
        self._pool = pool

    def collect(self) -> list[Metric]:
        pool = self._pool
        return merge_families(
            itertools.chain(
                families_of(self._metrics.registry.collect()),
                pool.worker_families(),
                pool.retired.families.values(),
            )
        )

    def render(self, accept_header: str | None = None) -> tuple[bytes, str]:
        encoder, content_type = choose_encoder(accept_header or "")
        # The encoders only call collect(): this object stands in for a registry.
        return encoder(self), content_type


# -- proxy sets served by the workers -------------------------------------------------------------


def open_listener_sockets(
    config: ZtunnelConfig,
    addresses: ListenerAddresses,
    transparent: bool,
    factory: SocketFactory = plain_socket,
    *,
    reuse_port: bool = False,
) -> dict[str, socket.socket]:
    """One listening socket per listener, for every worker to accept from (module docstring).
    `reuse_port` as the single-process proxy sets it (INPOD_PORT_REUSE for pods)."""
    opened: dict[str, socket.socket] = {}
    # Set before listen(), as a worker's own Listener would: a client that connects before any
    # worker serves the socket gets its options from the socket as it was then (listen_socket).
    keepalive = KeepaliveSettings.from_config(config)
    try:
        for spec in listener_specs(addresses, transparent):
            opened[spec.name] = listen_socket(
                spec.address,
                mark=config.packet_mark,
                transparent=spec.transparent,
                reuse_port=reuse_port,
                factory=factory,
                keepalive=keepalive,
            )
    except OSError as e:
        for sock in opened.values():
            sock.close()
        from ..errors import BindError

        raise BindError(spec.name, str(spec.address), e) from None
    return opened


class RemoteProxySet:
    """Stands where a WorkloadProxy stands in the single-process path, for proxy sets the
    workers serve: it opens the listening sockets, hands them over, and reports what the
    workers report. The DNS proxy of the set runs here, in the owner."""

    def __init__(
        self,
        pool: WorkerPool,
        *,
        key: str,
        config: ZtunnelConfig,
        served: Callable[[], Workload | None],
        transparent: bool,
        pod: ProxyWorkloadInfo | None = None,
        netns: NetnsHandle | None = None,
        dns: DnsServer | None = None,
    ) -> None:
        self.pool = pool
        self.key = key
        self.name = key
        self.config = config
        self._served = served
        self._transparent = transparent
        self._pod = pod
        self._netns = netns
        self.dns = dns
        self.inbound = None  # no same-node fast path into a worker's proxy from here
        self._handed: HandedProxy | None = None
        self._dns_task: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return f"RemoteProxySet({self.key}, {self.pool.count} workers)"

    @property
    def listeners(self) -> dict[str, Any]:
        return {}

    def served_workload(self) -> Workload | None:
        return self._served()

    def start(self) -> None:
        factory = self._netns.socket if self._netns is not None else plain_socket
        sockets = open_listener_sockets(
            self.config,
            ListenerAddresses.from_config(self.config),
            self._transparent,
            factory,
            reuse_port=self._pod is not None and self.config.inpod_port_reuse,
        )
        try:
            if self.dns is not None:
                self.dns.bind()
        except BaseException:
            for sock in sockets.values():
                sock.close()
            raise
        pod = None
        if self._pod is not None:
            pod = PodInfo(self._pod.namespace, self._pod.name, self._pod.service_account)
        self._handed = HandedProxy(self.key, pod, self._netns, sockets)
        self.pool.add_proxy(self._handed)
        if self.dns is not None:
            self._dns_task = asyncio.get_running_loop().create_task(self.dns.start(), name=f"dns {self.key}")

    def bound_addresses(self) -> dict[str, str]:
        if self._handed is None:
            return {}
        out = {
            name: str(SocketAddr.from_sockaddr(sock.getsockname()))
            for name, sock in self._handed.sockets.items()
        }
        if self.dns is not None:
            out["dns"] = str(self.dns.udp_address)
        out["workers"] = str(self.pool.count)
        return out

    def connections_dump(self) -> tuple[list[Any], list[Any]]:
        return self.pool.connections(self.key)

    async def drain(self, deadline_s: float) -> None:
        if self.dns is not None:
            await self.dns.stop(deadline_s)
        await self.pool.remove_proxy(self.key, graceful=deadline_s > 0, deadline_s=deadline_s)


class OwnerInpodManager(InpodManager):
    """Shared mode with workers: the ZDS client's manager, whose pod proxies the workers serve.

    Certificates are prefetched and forgotten here (InpodManager's rules); each pod's
    listening sockets are opened in its namespace here and handed to every worker with the
    namespace itself (the workers open their outbound sockets there).
    """

    def __init__(self, *, pool: WorkerPool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pool = pool
        self._starting_uid: str | None = None

    async def start_proxy(self, uid: str, info: ProxyWorkloadInfo, netns_fd: int) -> None:
        self._starting_uid = uid
        try:
            await super().start_proxy(uid, info, netns_fd)
        finally:
            self._starting_uid = None

    def _new_proxy(self, info: ProxyWorkloadInfo, netns: NetnsHandle) -> RemoteProxySet:  # type: ignore[override]
        assert self._starting_uid is not None, "pod proxies are built only by start_proxy"
        dns = None
        if self._dns_factory is not None:
            dns = self._dns_factory(
                f"{info.namespace}/{info.name}", lambda: self.workload_for(info), netns.socket
            )
        return RemoteProxySet(
            self.pool,
            key=self._starting_uid,
            config=self.config,
            served=lambda: self.workload_for(info),
            transparent=self.config.enable_orig_src is not False,
            pod=info,
            netns=netns,
            dns=dns,
        )


__all__ = [
    "OwnerInpodManager",
    "PoolMetrics",
    "RemoteProxySet",
    "StateFeed",
    "WorkerPool",
    "merge_families",
]
