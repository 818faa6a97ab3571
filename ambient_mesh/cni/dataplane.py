"""The node agent's mesh data plane: put a pod into the ambient mesh and take it out again.

Counterparts: istio-cni's meshDataplane (cni/pkg/nodeagent/meshdataplane_linux.go), its netServer
(net_linux.go) and the pod cache (pod_cache.go); docs/istio-behaviour.md, "Node agent pod lifecycle" and
"Node agent start and shutdown".

AddPodToMesh, in istio-cni's order:
  1. open the pod's netns (the CNI event's path, the cached handle, or a /proc scan) and cache it;
  2. install the in-pod redirection rules inside it (idempotent: leftovers are reconciled);
  3. hand the netns to the node proxy over ZDS and wait for its ack;
  4. add the pod's IPs to the host probe set (kubelet probe SNAT);
  5. mark the pod enrolled (`ambient.istio.io/redirection: enabled`).
A failure in 1-2 is not retryable: the pod is dropped from the cache and nothing is marked. A
failure in 3 is retryable and marks the pod `pending` (rules stay: the pod is captured but not
yet proxied, so it has no traffic rather than unmeshed traffic). 4-5 failures are retryable.

RemovePodFromMesh: probe-set entries first (only those carrying the pod's UID), then the
in-pod rules, then `del` to every node proxy, then the mark. For a deleted pod istio-cni skips
the rules (the netns is going away); we still remove them, best effort, because we hold the
netns open and a sandbox that outlives its pod object must not keep redirecting to nothing.

Commands that touch the kernel (iptables-restore, nft, ip, ipset over netlink) block, so they
run in a worker thread; each pod's operations are serialised by a per-pod lock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..capture.apply import Backend, RulePlan, apply_inpod_rules, remove_inpod_rules
from ..capture.hostprobe import (
    HostProbeConfig,
    ProbeSet,
    add_pod_to_probe_set,
    apply_host_probe_rules,
    remove_host_probe_rules,
    remove_pod_from_probe_set,
    sync_probe_set,
)
from ..capture.inpod import HOST_PROBE_SNAT_IPV4, HOST_PROBE_SNAT_IPV6, InpodConfig, PodLevelOverrides
from ..config import ProxyWorkloadInfo
from ..errors import AmbientError
from ..host.commands import CommandRunner
from ..net import IPAddress
from ..zds.server import SnapshotEntry
from .netns_discovery import NetnsCandidate
from .pods import REDIRECTION_PENDING, WatchedPod
from .sandbox import NetnsGuard, SandboxCheck

if TYPE_CHECKING:
    from .agent_config import AgentConfig

log = logging.getLogger("ambient_mesh.cni-agent")


class DataplaneError(AmbientError):
    """Adding or removing a pod failed; `retryable` says whether the informer should try again."""

    def __init__(self, message: str, *, retryable: bool, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.retryable = retryable


# -- seams ----------------------------------------------------------------------------------------


class ZtunnelLink(Protocol):
    """The ZDS server as the data plane uses it (ZdsServer implements it)."""

    async def add_workload(self, uid: str, info: ProxyWorkloadInfo, netns_fd: int) -> str | None: ...

    async def del_workload(self, uid: str) -> str | None: ...


class EnrollmentMarker(Protocol):
    """Where the enrollment mark is kept (every PodSource implements it)."""

    async def mark_enrolled(self, pod: WatchedPod, value: str = ...) -> None: ...

    async def unmark(self, pod: WatchedPod) -> None: ...


class NetnsLocator(Protocol):
    """A /proc scan (NetnsFinder implements it)."""

    def find(self, wanted: Mapping[str, Sequence[str]]) -> dict[str, NetnsCandidate]: ...


class OpenNetns:
    """An open network namespace file: the fd handed to the node proxy, and its identity.

    Holding it keeps the namespace alive. Commands run in it through `command_path`: the path
    it was opened from while that still names the same namespace, else our own fd's /proc path
    (a `/proc/<pid>/ns/net` path dies with its process; the namespace may not).
    """

    __slots__ = ("path", "fd", "key")

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd = fd
        st = os.fstat(fd)
        self.key = (st.st_dev, st.st_ino)

    @classmethod
    def open(cls, path: str) -> OpenNetns:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return cls(path, fd)
        except BaseException:
            os.close(fd)
            raise

    @property
    def inode(self) -> int:
        return self.key[1]

    def command_path(self) -> str:
        with contextlib.suppress(OSError):
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self.key:
                return self.path
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __repr__(self) -> str:
        state = f"fd {self.fd}" if self.fd >= 0 else "closed"
        return f"OpenNetns({self.path}, inode {self.key[1]}, {state})"


class ThreadBoundProbeSet:
    """A ProbeSet whose every call runs on one dedicated thread.

    pyroute2's synchronous IPSet drives its own event loop: it cannot be made or used on the
    agent's loop thread, and must stay on the thread it was made on. Callers (already off the
    loop, in `asyncio.to_thread`) block on that thread's answer.
    """

    def __init__(self, factory: Callable[[], ProbeSet], name: str = "probe-set") -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._inner = self._executor.submit(factory).result()

    def __repr__(self) -> str:
        return f"ThreadBoundProbeSet({self._inner!r})"

    def _call(self, method: str, *args: object) -> Any:
        return self._executor.submit(getattr(self._inner, method), *args).result()

    def ensure(self) -> None:
        self._call("ensure")

    def entries(self) -> dict[IPAddress, str]:
        entries: dict[IPAddress, str] = self._call("entries")
        return entries

    def upsert(self, ip: IPAddress, uid: str) -> None:
        self._call("upsert", ip, uid)

    def delete(self, ip: IPAddress) -> None:
        self._call("delete", ip)

    def flush(self) -> None:
        self._call("flush")

    def destroy(self) -> None:
        self._call("destroy")

    def close(self) -> None:
        close = getattr(self._inner, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):
                self._executor.submit(close).result()
        self._executor.shutdown(wait=True)


# -- the pod cache (istio-cni PodNetnsCache) ------------------------------------------------------


@dataclass(slots=True)
class CachedPod:
    uid: str
    info: ProxyWorkloadInfo
    netns: OpenNetns | None = None
    ips: tuple[str, ...] = ()


class PodNetnsCache:
    """uid -> (workload info, open netns or None, IPs). Also the ZDS server's snapshot source."""

    def __init__(self) -> None:
        self._pods: dict[str, CachedPod] = {}

    def __repr__(self) -> str:
        with_netns = sum(1 for p in self._pods.values() if p.netns is not None)
        return f"PodNetnsCache({len(self._pods)} pods, {with_netns} with netns)"

    def __len__(self) -> int:
        return len(self._pods)

    def __contains__(self, uid: object) -> bool:
        return uid in self._pods

    def ensure(self, uid: str, info: ProxyWorkloadInfo, ips: Sequence[str] = ()) -> CachedPod:
        """A placeholder: the pod is known (ZDS `keep`) even without a netns."""
        entry = self._pods.get(uid)
        if entry is None:
            entry = self._pods[uid] = CachedPod(uid=uid, info=info, ips=tuple(ips))
        else:
            entry.info = info
            if ips:
                entry.ips = tuple(ips)
        return entry

    def upsert(
        self, uid: str, info: ProxyWorkloadInfo, netns: OpenNetns, ips: Sequence[str] = ()
    ) -> OpenNetns:
        """Cache `netns` for the pod; if the same namespace is cached already, keep that handle
        (and close the new one) so fds given to a node proxy stay the ones we hold."""
        entry = self.ensure(uid, info, ips)
        if entry.netns is not None and entry.netns.key == netns.key:
            if entry.netns is not netns:
                netns.close()
            return entry.netns
        if entry.netns is not None:
            entry.netns.close()  # the sandbox was recreated: the old namespace is not the pod's now
        entry.netns = netns
        return netns

    def get(self, uid: str) -> CachedPod | None:
        return self._pods.get(uid)

    def take(self, uid: str) -> CachedPod | None:
        return self._pods.pop(uid, None)

    def uids(self) -> tuple[str, ...]:
        return tuple(self._pods)

    def snapshot(self) -> list[SnapshotEntry]:
        return [(p.uid, p.info, p.netns.fd if p.netns is not None else None) for p in self._pods.values()]

    def dump(self) -> dict[str, dict[str, object]]:
        return {
            p.uid: {
                "workload": str(p.info),
                "ips": list(p.ips),
                "netns": None if p.netns is None else {"path": p.netns.path, "inode": p.netns.inode},
            }
            for p in self._pods.values()
        }

    def close(self) -> None:
        for entry in self._pods.values():
            if entry.netns is not None:
                entry.netns.close()
        self._pods.clear()


# -- settings and pure helpers --------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class DataplaneSettings:
    dns_capture: bool = True
    ipv6: bool = False
    backend: Backend = Backend.IPTABLES
    host_probe: HostProbeConfig = field(default_factory=HostProbeConfig)
    reconcile_on_start: bool = True
    host_prefix: str = ""

    @classmethod
    def from_agent_config(cls, cfg: AgentConfig, *, kubelet_uid: int | None = None) -> DataplaneSettings:
        host = HostProbeConfig(
            ipv6=cfg.ambient_ipv6,
            probe_ipv4=cfg.host_probe_snat_ip,
            probe_ipv6=cfg.host_probe_snat_ipv6,
            set_prefix=cfg.probe_set_prefix,
            kubelet_uid=cfg.kubelet_uid if cfg.kubelet_uid is not None else kubelet_uid,
        )
        return cls(
            dns_capture=cfg.ambient_dns_capture,
            ipv6=cfg.ambient_ipv6,
            backend=Backend.NFTABLES if cfg.native_nftables else Backend.IPTABLES,
            host_probe=host,
            reconcile_on_start=cfg.ambient_reconcile_pod_rules_on_startup,
            host_prefix=cfg.host_prefix,
        )

    def inpod_config(self, pod: WatchedPod) -> InpodConfig:
        """Global settings resolved against the pod's annotations (istio-cni PodLevelOverrides)."""
        overrides = PodLevelOverrides.from_annotations(pod.annotations)
        return InpodConfig.for_pod(
            dns_capture=self.dns_capture,
            ipv6=self.ipv6,
            overrides=overrides,
            probe_ipv4=self.host_probe.probe_ipv4 or HOST_PROBE_SNAT_IPV4,
            probe_ipv6=self.host_probe.probe_ipv6 or HOST_PROBE_SNAT_IPV6,
        )

    def host_path(self, path: str) -> str:
        return f"{self.host_prefix}{path}" if self.host_prefix and path.startswith("/") else path


def workload_info(pod: WatchedPod) -> ProxyWorkloadInfo:
    return ProxyWorkloadInfo(
        namespace=pod.namespace, name=pod.name, service_account=pod.service_account or "default"
    )


# -- the data plane -------------------------------------------------------------------------------


class MeshDataplane:
    """Adds pods to and removes them from the mesh on this node."""

    def __init__(
        self,
        settings: DataplaneSettings,
        *,
        runner: CommandRunner,
        probe_set: ProbeSet,
        ztunnel: ZtunnelLink,
        marker: EnrollmentMarker,
        locator: NetnsLocator,
        open_netns: Callable[[str], OpenNetns] = OpenNetns.open,
        netns_guard: SandboxCheck | None = None,
    ) -> None:
        self.settings = settings
        self.netns_guard: SandboxCheck = netns_guard if netns_guard is not None else NetnsGuard()
        self.runner = runner
        self.probe_set = probe_set
        self.ztunnel = ztunnel
        self.marker = marker
        self.locator = locator
        self.cache = PodNetnsCache()
        self._open_netns = open_netns
        self._locks: dict[str, asyncio.Lock] = {}
        self.added = 0
        self.removed = 0
        self.failures = 0
        self.last_plans: dict[str, RulePlan] = {}

    def __repr__(self) -> str:
        return (
            f"MeshDataplane({self.settings.backend.value}, {self.cache!r}, {self.added} added, "
            f"{self.removed} removed, {self.failures} failures)"
        )

    def snapshot(self) -> list[SnapshotEntry]:
        return self.cache.snapshot()

    def _lock(self, uid: str) -> asyncio.Lock:
        lock = self._locks.get(uid)
        if lock is None:
            lock = self._locks[uid] = asyncio.Lock()
        return lock

    # -- host side ------------------------------------------------------------------------------

    async def setup_host(self) -> RulePlan:
        """Create the probe sets and (re)install the host SNAT rule (delete, then create)."""
        return await asyncio.to_thread(
            apply_host_probe_rules,
            self.runner,
            None,
            self.settings.host_probe,
            self.settings.backend,
            self.probe_set,
        )

    async def teardown_host(self) -> RulePlan:
        """Remove the host rule and destroy the sets (a final, non-upgrade shutdown)."""
        return await asyncio.to_thread(
            remove_host_probe_rules,
            self.runner,
            None,
            self.settings.host_probe,
            self.settings.backend,
            self.probe_set,
        )

    # -- add ------------------------------------------------------------------------------------

    def _locate(self, uid: str, ips: Sequence[str]) -> str:
        found = self.locator.find({uid: list(ips)})
        if uid not in found:
            raise DataplaneError(
                f"can't find netns for pod {uid}: no process under /proc runs in a namespace holding {list(ips)}",
                retryable=False,
                hint="a new pod gets its netns from its CNI ADD; an old one needs a running process",
            )
        return found[uid].path

    async def _resolve_netns(self, pod: WatchedPod, ips: Sequence[str], netns_path: str) -> OpenNetns:
        info = workload_info(pod)
        if netns_path:
            path = self.settings.host_path(netns_path)
        else:
            cached = self.cache.get(pod.uid)
            if cached is not None and cached.netns is not None:
                return cached.netns
            if not ips:
                raise DataplaneError(f"pod {pod} has no IP yet: its netns cannot be found", retryable=False)
            path = await asyncio.to_thread(self._locate, pod.uid, ips)
        try:
            opened = self._open_netns(path)
        except OSError as exc:
            raise DataplaneError(
                f"open netns {path} of pod {pod}: {exc.strerror or exc}", retryable=False
            ) from None
        return self.cache.upsert(pod.uid, info, opened, ips)

    async def add_pod_to_mesh(self, pod: WatchedPod, ips: Sequence[str], netns_path: str = "") -> None:
        """Enroll `pod`: rules, node proxy, probe set, mark. Raises DataplaneError."""
        async with self._lock(pod.uid):
            try:
                await self._add(pod, tuple(ips), netns_path)
            except DataplaneError:
                self.failures += 1
                raise
            self.added += 1

    def _check_named_netns(self, pod: WatchedPod, netns_path: str) -> None:
        """A CNI add names the netns: it must be a pod sandbox's (sandbox.py), and an enrolled pod
        is not moved out of a sandbox that still runs. Checked before the cache is touched, so a
        refused add leaves the enrolled pod as it was."""
        path = self.settings.host_path(netns_path)
        refusal = self.netns_guard.refusal(path)
        cached = self.cache.get(pod.uid)
        if refusal is None and cached is not None and cached.netns is not None:
            refusal = self.netns_guard.move_refusal(cached.netns.key, path, str(pod))
        if refusal is not None:
            raise DataplaneError(
                f"refusing netns {netns_path} for pod {pod}: {refusal}",
                retryable=False,
                hint="CNI_NETNS must be the pod sandbox's network namespace",
            )

    async def _add(self, pod: WatchedPod, ips: tuple[str, ...], netns_path: str) -> None:
        info = workload_info(pod)
        if netns_path:
            self._check_named_netns(pod, netns_path)
        self.cache.ensure(pod.uid, info, ips)
        try:
            netns = await self._resolve_netns(pod, ips, netns_path)
            cfg = self.settings.inpod_config(pod)
            plan = await asyncio.to_thread(
                apply_inpod_rules, self.runner, netns.command_path(), cfg, self.settings.backend
            )
        except (DataplaneError, AmbientError, OSError) as exc:
            entry = self.cache.take(pod.uid)
            if entry is not None and entry.netns is not None:
                entry.netns.close()
            if isinstance(exc, DataplaneError):
                raise
            raise DataplaneError(
                f"failed to set up redirection in pod {pod}: {exc}", retryable=False
            ) from None
        self.last_plans[pod.uid] = plan
        log.info("in-pod rules for %s: %r", pod, plan)
        error = await self.ztunnel.add_workload(pod.uid, info, netns.fd)
        if error:
            with contextlib.suppress(AmbientError):
                await self.marker.mark_enrolled(pod, REDIRECTION_PENDING)
            raise DataplaneError(
                f"failed to add pod {pod} to the node proxy: {error}",
                retryable=True,
                hint="is the node proxy (ambient ztunnel, INPOD_UDS) running and connected?",
            )
        try:
            await asyncio.to_thread(
                add_pod_to_probe_set, self.probe_set, self.settings.host_probe, pod.uid, ips
            )
        except Exception as exc:  # netlink and nft failures come in several types
            raise DataplaneError(
                f"failed to add {list(ips)} of pod {pod} to the host probe set: {exc}", retryable=True
            ) from None
        try:
            await self.marker.mark_enrolled(pod)
        except AmbientError as exc:
            raise DataplaneError(f"failed to mark pod {pod} enrolled: {exc}", retryable=True) from None
        log.info("pod %s (%s) added to the mesh, netns inode %d", pod, pod.uid, netns.inode)

    async def update_pod_ips(self, pod: WatchedPod) -> None:
        """An enrolled pod's IPs changed: re-upsert them into the probe set."""
        entry = self.cache.get(pod.uid)
        if entry is not None:
            entry.ips = tuple(pod.ips)
        await asyncio.to_thread(
            add_pod_to_probe_set, self.probe_set, self.settings.host_probe, pod.uid, pod.ips
        )

    # -- remove ---------------------------------------------------------------------------------

    async def remove_pod_from_mesh(self, pod: WatchedPod, *, is_delete: bool) -> None:
        """Take `pod` out: probe set, rules, node proxies, mark. Raises DataplaneError(retryable)."""
        async with self._lock(pod.uid):
            try:
                await self._remove(pod, is_delete)
            except DataplaneError:
                self.failures += 1
                raise
            self.removed += 1
            self._locks.pop(pod.uid, None)

    async def _remove(self, pod: WatchedPod, is_delete: bool) -> None:
        entry = self.cache.get(pod.uid)
        # The IPs we added (the CNI's) and the ones the pod object has now: the probe set holds
        # whichever was current when it was written.
        ips = tuple(dict.fromkeys((*(entry.ips if entry is not None else ()), *pod.ips)))
        problems: list[str] = []
        try:
            kept = await asyncio.to_thread(
                remove_pod_from_probe_set, self.probe_set, self.settings.host_probe, pod.uid, ips
            )
            for ip, owner in kept:
                log.info("probe set entry %s belongs to pod %s now, not %s: kept", ip, owner, pod.uid)
        except Exception as exc:  # go on: the rest of the removal must not wait on the probe set
            problems.append(f"probe set: {exc}")
        netns = entry.netns if entry is not None else None
        if netns is None and not is_delete and ips:
            with contextlib.suppress(DataplaneError, OSError):
                path = await asyncio.to_thread(self._locate, pod.uid, ips)
                netns = self._open_netns(path)
                if entry is not None:
                    entry.netns = netns
        if netns is not None:
            cfg = self.settings.inpod_config(pod)
            try:
                plan = await asyncio.to_thread(
                    remove_inpod_rules, self.runner, netns.command_path(), cfg, self.settings.backend
                )
                log.info("in-pod rules removed for %s: %r", pod, plan)
            except AmbientError as exc:
                if not is_delete:
                    raise DataplaneError(
                        f"failed to remove redirection from pod {pod}: {exc}", retryable=True
                    ) from None
                log.info("rules of deleted pod %s not removed (its netns is going away): %s", pod, exc)
        error = await self.ztunnel.del_workload(pod.uid)
        if error:
            problems.append(f"node proxy: {error}")
        if not problems or is_delete:
            taken = self.cache.take(pod.uid)
            if taken is not None and taken.netns is not None:
                taken.netns.close()
            self.last_plans.pop(pod.uid, None)
        if problems:
            raise DataplaneError(
                f"failed to remove pod {pod} from the mesh: {'; '.join(problems)}", retryable=True
            )
        try:
            await self.marker.unmark(pod)
        except AmbientError as exc:
            if not is_delete:
                raise DataplaneError(
                    f"failed to clear the enrollment mark of {pod}: {exc}", retryable=True
                ) from None
            log.info("mark of deleted pod %s not cleared: %s", pod, exc)
        log.info("pod %s (%s) removed from the mesh%s", pod, pod.uid, " (deleted)" if is_delete else "")

    # -- start ----------------------------------------------------------------------------------

    async def rebuild(self, enrolled: Iterable[WatchedPod]) -> dict[str, str]:
        """Agent start (istio-cni Start + syncHostIPSets + ZDS snapshot): cache every enrolled pod,
        find its netns under /proc, re-apply its rules when reconciling, sync the probe set.
        Returns uid -> problem for pods that could not be fully restored (they are still kept,
        so the node proxy is told `keep`, not told to drop them)."""
        pods = list(enrolled)
        problems: dict[str, str] = {}
        cached = {pod.uid: self.cache.ensure(pod.uid, workload_info(pod), pod.ips) for pod in pods}
        wanted = {p.uid: list(p.ips) for p in pods if cached[p.uid].netns is None and p.ips}
        found = await asyncio.to_thread(self.locator.find, wanted) if wanted else {}
        for pod in pods:
            if pod.uid in found:
                try:
                    self.cache.upsert(
                        pod.uid, workload_info(pod), self._open_netns(found[pod.uid].path), pod.ips
                    )
                except OSError as exc:
                    problems[pod.uid] = f"open netns: {exc}"
            elif cached[pod.uid].netns is None:
                problems[pod.uid] = "netns not found under /proc" if pod.ips else "pod has no IP"
        if self.settings.reconcile_on_start:
            for pod in pods:
                entry = self.cache.get(pod.uid)
                if entry is None or entry.netns is None:
                    continue
                try:
                    plan = await asyncio.to_thread(
                        apply_inpod_rules,
                        self.runner,
                        entry.netns.command_path(),
                        self.settings.inpod_config(pod),
                        self.settings.backend,
                    )
                    self.last_plans[pod.uid] = plan
                    log.info("reconciled rules of %s: %r", pod, plan)
                except AmbientError as exc:
                    problems[pod.uid] = f"reconcile rules: {exc}"
        complete = all(p.ips for p in pods)
        pruned = await asyncio.to_thread(
            sync_probe_set,
            self.probe_set,
            self.settings.host_probe,
            {p.uid: p.ips for p in pods},
            complete=complete,
        )
        if pruned:
            log.info("pruned stale probe set entries: %s", ", ".join(map(str, pruned)))
        for uid, problem in problems.items():
            log.warning("enrolled pod %s not fully restored: %s", uid, problem)
        return problems

    def close(self) -> None:
        self.cache.close()
        close = getattr(self.probe_set, "close", None)
        if close is not None:
            close()


__all__ = [
    "CachedPod",
    "DataplaneError",
    "DataplaneSettings",
    "EnrollmentMarker",
    "MeshDataplane",
    "NetnsLocator",
    "OpenNetns",
    "PodNetnsCache",
    "ThreadBoundProbeSet",
    "ZtunnelLink",
    "workload_info",
]
