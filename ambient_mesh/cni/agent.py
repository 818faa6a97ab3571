"""`ambient cni-agent`: the CNI node agent (istio-cni's `install-cni` with the ambient node agent).

Counterparts: istio-cni's cni/pkg/cmd/root.go (the program), cni/pkg/install (installer and its
readiness), cni/pkg/nodeagent/server.go (the ambient agent: informers, plugin server, ZDS server, start
and stop), cni/pkg/monitoring; docs/istio-behaviour.md, "Node agent start and shutdown" and
"Node agent health and metrics".

Start-up, in order:
  1. health server (`/healthz` 200 always; `/readyz` 200 only once the plugin is installed AND
     the ambient agent has started) and metrics server, with istio-cni's metric names;
  2. ambient agent (when AMBIENT_ENABLED): host probe set and SNAT rule; pod source synced;
     state rebuilt from enrolled pods (/proc scan, rule reconcile, probe-set sync); ZDS server
     listening on ZTUNNEL_UDS_ADDRESS; plugin server on the run dir's sockets; watch and work
     queue running; every pod evaluated once;
  3. plugin installed (executable + chained entry) and watched for drift.

Shutdown (SIGTERM/SIGINT; docs/istio-behaviour.md, "Node agent start and shutdown"): unless
AMBIENT_DISABLE_SAFE_UPGRADE, ask the pod source whether the agent's DaemonSet still exists. If so this is
an upgrade (or a reboot): the plugin, the host rule and the probe set stay, so new ambient pods fail
closed until the next agent is ready, and running pods keep their rules and node proxy. Otherwise
everything installed is removed. In both cases in-pod rules and enrollment marks stay: enrolled pods keep
working without the agent.

Run with `python -m ambient_mesh.cni.agent [--flag=value ...]`; settings are the environment
variables of agent_config.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.exposition import generate_latest

from .. import logs
from ..capture.hostprobe import NetlinkIpset, NftProbeSet, ProbeSet
from ..errors import AmbientError, BindError, ConfigError
from ..host.commands import CommandRunner, SubprocessRunner
from ..http1 import Request, Response
from ..http1.server import Handler, HttpServer
from ..metrics import WithoutCreated
from ..net import SocketAddr
from ..zds.server import SnapshotEntry, ZdsServer
from .agent_config import AgentConfig, load
from .cni_server import CniAddHandler, CniPluginServer
from .dataplane import DataplaneSettings, MeshDataplane, ThreadBoundProbeSet
from .informer import Enablement, Informer
from .install import (
    Drift,
    Installer,
    InstallError,
    PluginInstall,
    launcher_script,
    packaged_plugin,
    plugin_entry,
    watch,
)
from .kubeconfig import KubeconfigError, KubeconfigInputs, KubeconfigWriter
from .netns_discovery import IpCommandProbe, NetnsFinder, find_kubelet_uid
from .plugin_token import PluginTokens
from .podinfo import PLUGIN_KUBECONFIG_NAME
from .pods import KubeApiPodSource, PodSource, build_pod_source
from .sandbox import NetnsGuard

log = logging.getLogger("ambient_mesh.cni-agent")

HEALTHZ_PATH = "/healthz"
READYZ_PATH = "/readyz"
METRICS_PATH = "/metrics"
INSTALL_WATCH_INTERVAL_S = 2.0
SHUTDOWN_TIMEOUT_S = 20.0  # within the DaemonSet's 30 s grace period

INSTALL_RESULTS = (
    "SUCCESS",
    "COPY_BINARIES_FAILURE",
    "CREATE_KUBECONFIG_FAILURE",
    "CREATE_CNI_CONFIG_FAILURE",
)


class AgentMetrics:
    """istio-cni's metrics (docs/istio-behaviour.md, "Node agent health and metrics"), in a registry of
    our own. Served without prometheus-client's `_created` series, which istio-cni (Go's client) does not
    export."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.installs = Counter(
            "istio_cni_installs", "Total number of CNI plugin installs.", ["result"], registry=None
        )
        self.install_ready = Gauge(
            "istio_cni_install_ready",
            "Whether the CNI plugin is installed (1) or not (0).",
            registry=None,
        )
        self.plugin_requests = Counter(
            "istio_cni_plugin_requests",
            "CNI plugin requests served, by response code.",
            ["response_code"],
            registry=None,
        )
        self.reconcile_events = Counter(
            "nodeagent_reconcile_events",
            "Pod and namespace events the node agent handled.",
            ["type"],
            registry=None,
        )
        self.ztunnel_connected = Gauge(
            "ztunnel_connected", "Number of node proxies connected over ZDS.", registry=None
        )
        self.registry.register(
            WithoutCreated(
                (
                    self.installs,
                    self.install_ready,
                    self.plugin_requests,
                    self.reconcile_events,
                    self.ztunnel_connected,
                )
            )
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class CniAgent:
    """The node agent: installer, ambient data plane, servers. `start()`, then `shutdown()`."""

    def __init__(
        self,
        cfg: AgentConfig,
        *,
        runner: CommandRunner,
        source: PodSource | None,
        probe_set: ProbeSet | None,
        installer: Installer | None,
        finder: NetnsFinder | None = None,
        metrics: AgentMetrics | None = None,
        install_interval_s: float = INSTALL_WATCH_INTERVAL_S,
        kubeconfig: KubeconfigWriter | None = None,
        netns_guard: NetnsGuard | None = None,
        plugin_tokens: PluginTokens | None = None,
    ) -> None:
        self.cfg = cfg
        # The plugin's own short-lived token, when the agent may request one (plugin_token.py).
        self.plugin_tokens = plugin_tokens
        # The plugin's kubeconfig (Kubernetes API pod source): written at install, refreshed when
        # the token rotates, removed on a final shutdown and kept on an upgrade, as istio-cni does.
        self.kubeconfig = kubeconfig
        self.runner = runner
        self.source = source
        self.installer = installer
        self.metrics = metrics or AgentMetrics()
        self.install_interval_s = install_interval_s
        self.installer_ready = False
        self.agent_ready = not cfg.ambient_enabled
        self.stopped = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self.dataplane: MeshDataplane | None = None
        self.zds: ZdsServer | None = None
        self.informer: Informer | None = None
        self.plugin_server: CniPluginServer | None = None
        self.enablement = Enablement(
            selectors=cfg.enablement_selectors,
            exclude_namespaces=cfg.exclude_namespaces,
            system_namespace=cfg.system_namespace,
        )
        if cfg.ambient_enabled:
            assert source is not None and probe_set is not None
            finder = finder or NetnsFinder(
                IpCommandProbe(runner), proc_root=cfg.proc_root, host_netns_path=cfg.host_netns_path
            )
            settings = DataplaneSettings.from_agent_config(cfg)
            self.zds = ZdsServer(cfg.ztunnel_uds_address, _LateSnapshot(self))
            self.dataplane = MeshDataplane(
                settings,
                runner=runner,
                probe_set=probe_set,
                ztunnel=self.zds,
                marker=source,
                locator=finder,
                netns_guard=netns_guard,
            )
            self.informer = Informer(
                source,
                self.dataplane,
                self.enablement,
                on_event=lambda kind: self.metrics.reconcile_events.labels(type=kind).inc(),
            )
            handler = CniAddHandler(source, self.dataplane, self.enablement)
            self.plugin_server = CniPluginServer(
                cfg.cni_event_address,
                cfg.log_uds_address,
                handler,
                on_response=lambda code: self.metrics.plugin_requests.labels(response_code=str(code)).inc(),
                run_socket=cfg.plugin_run_address,
                pods=source,
                netns_guard=netns_guard,
            )
            self.metrics.ztunnel_connected.set_function(lambda: self.zds.connected if self.zds else 0)
        self.health = self._server("health", cfg.health_port, self._health)
        self.monitoring = self._server("monitoring", cfg.monitoring_port, self._metrics)

    def __repr__(self) -> str:
        parts = [
            f"installer {'ready' if self.installer_ready else 'not ready'}",
            f"agent {'ready' if self.agent_ready else 'not ready'}",
        ]
        if self.zds is not None:
            parts.append(f"{self.zds.connected} node proxies")
        if self.dataplane is not None:
            parts.append(f"{len(self.dataplane.cache)} pods")
        return f"CniAgent({self.cfg.node_name}: {', '.join(parts)})"

    @property
    def ready(self) -> bool:
        return self.installer_ready and self.agent_ready

    @staticmethod
    def _server(name: str, port: int, handler: Handler) -> HttpServer | None:
        # istio-cni turns metrics off with a port <= 0; our HEALTH_PORT takes 0 (any free port).
        if port < 0 or (name == "monitoring" and port == 0):
            return None
        return HttpServer(name, SocketAddr(ipaddress.ip_address("::"), port), handler)

    async def _health(self, request: Request) -> Response:
        if request.path == HEALTHZ_PATH:
            return Response.text(HTTPStatus.OK, "ok\n")
        if request.path == READYZ_PATH:
            if self.ready:
                return Response.text(HTTPStatus.OK, "ready\n")
            why = [
                w
                for w, ok in (
                    ("plugin not installed", self.installer_ready),
                    ("ambient agent not started", self.agent_ready),
                )
                if not ok
            ]
            return Response.text(HTTPStatus.SERVICE_UNAVAILABLE, "not ready: " + ", ".join(why) + "\n")
        return Response.text(HTTPStatus.NOT_FOUND, "not found\n")

    async def _metrics(self, request: Request) -> Response:
        if request.path != METRICS_PATH:
            return Response.text(HTTPStatus.NOT_FOUND, "not found\n")
        return Response(
            status=HTTPStatus.OK,
            body=self.metrics.render(),
            content_type="text/plain; version=0.0.4; charset=utf-8",
        )

    # -- start ----------------------------------------------------------------------------------

    @staticmethod
    async def _start_http(server: HttpServer | None, handler: Handler) -> HttpServer | None:
        if server is None:
            return None
        try:
            await server.start()
        except BindError:
            # A netns or host without IPv6: fall back to IPv4 only.
            server = HttpServer(
                server.name, SocketAddr(ipaddress.ip_address("0.0.0.0"), server.address.port), handler
            )
            await server.start()
        return server

    async def start(self) -> None:
        self.health = await self._start_http(self.health, self._health)
        self.monitoring = await self._start_http(self.monitoring, self._metrics)
        if self.cfg.ambient_enabled:
            await self._start_ambient()
        if self.plugin_tokens is not None:
            # Before the kubeconfig is first written, so it carries the plugin's token at once.
            await self.plugin_tokens.refresh()
            self._tasks.append(asyncio.create_task(self._renew_plugin_token(), name="plugin token"))
        if self.installer is not None:
            self._install_once()
            self._tasks.append(asyncio.create_task(self._watch_install(), name="cni install watch"))
        else:
            self.installer_ready = True
        log.info("node agent started: %r", self)

    async def _start_ambient(self) -> None:
        assert self.source and self.dataplane and self.zds and self.informer and self.plugin_server
        plan = await self.dataplane.setup_host()
        log.info("host probe rules: %r", plan)
        await self.source.start()
        problems = await self.informer.rebuild()
        if problems:
            log.warning(
                "%d enrolled pods not fully restored (node proxy is told to keep them)", len(problems)
            )
        await self.zds.start()
        await self.plugin_server.start()
        self._tasks.append(asyncio.create_task(self.source.run(self.informer.on_event), name="pod watch"))
        self._tasks.append(asyncio.create_task(self.informer.run(), name="informer"))
        self.informer.enqueue_all()
        self.agent_ready = True

    def _install_once(self) -> bool:
        assert self.installer is not None
        try:
            if self.kubeconfig is not None:
                self.kubeconfig.sync()
            self.installer.install()
        except InstallError as exc:
            if isinstance(exc, KubeconfigError):
                result = "CREATE_KUBECONFIG_FAILURE"
            elif "config" in exc.message.lower():
                result = "CREATE_CNI_CONFIG_FAILURE"
            else:
                result = "COPY_BINARIES_FAILURE"
            self.metrics.installs.labels(result=result).inc()
            log.warning("CNI plugin install failed (will retry): %s", exc)
            self._set_installer_ready(False)
            return False
        self.metrics.installs.labels(result="SUCCESS").inc()
        self._set_installer_ready(True)
        return True

    def _set_installer_ready(self, ready: bool) -> None:
        self.installer_ready = ready
        self.metrics.install_ready.set(1 if ready else 0)

    async def _watch_install(self) -> None:
        assert self.installer is not None
        await asyncio.sleep(self.install_interval_s)

        def drifted(drift: Drift) -> None:
            # istio-cni marks itself not ready while it re-validates after a file event.
            self.metrics.installs.labels(result="SUCCESS").inc()
            log.info("CNI plugin install repaired: %s", "; ".join(drift.problems))

        if not self.installer_ready:
            while not self._install_once():
                await asyncio.sleep(self.install_interval_s)
        if self.kubeconfig is not None:
            self._tasks.append(asyncio.create_task(self._refresh_kubeconfig(), name="plugin kubeconfig"))
        await watch(self.installer, interval_s=self.install_interval_s, on_drift=drifted)

    async def _renew_plugin_token(self) -> None:
        """Request the plugin's next token before the current one expires, then rewrite the
        kubeconfig with it (on failures: backoff, and the kubeconfig falls back to the agent's
        own token once the plugin's has expired)."""
        tokens = self.plugin_tokens
        assert tokens is not None  # started only when there are
        failures = 0 if tokens.token is not None else 1
        while True:
            await asyncio.sleep(tokens.next_delay(failures))
            failures = 0 if await tokens.refresh() else failures + 1
            if self.kubeconfig is not None:
                try:
                    self.kubeconfig.sync()
                except KubeconfigError as exc:
                    log.warning("plugin kubeconfig not refreshed: %s", exc)

    async def _refresh_kubeconfig(self) -> None:
        """Rewrite the plugin's kubeconfig when the service-account token or CA changes."""
        kubeconfig = self.kubeconfig
        assert kubeconfig is not None  # started only when there is one
        while True:
            await asyncio.sleep(self.install_interval_s)
            try:
                kubeconfig.sync()
            except KubeconfigError as exc:
                log.warning("plugin kubeconfig not refreshed: %s", exc)

    # -- stop -----------------------------------------------------------------------------------

    async def is_upgrade(self) -> bool:
        if self.cfg.ambient_disable_safe_upgrade or not self.cfg.ambient_enabled or self.source is None:
            return False
        try:
            return await asyncio.wait_for(self.source.agent_upgrading(self.cfg.pod_namespace), 5.0)
        except (AmbientError, TimeoutError) as exc:
            log.warning("safe-upgrade check failed (%s): cleaning up", exc)
            return False

    async def shutdown(self, *, upgrade: bool | None = None) -> bool:
        """Stop; remove what was installed unless this is an upgrade. Returns `upgrade`."""
        if upgrade is None:
            upgrade = await self.is_upgrade()
        log.info(
            "node agent shutting down (%s)", "upgrade: leaving the plugin installed" if upgrade else "final"
        )
        self.agent_ready = False
        if self.plugin_server is not None:
            await self.plugin_server.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self.zds is not None:
            await self.zds.stop()
        if self.installer is not None:
            try:
                self.installer.remove(upgrade=upgrade)
                if self.kubeconfig is not None and not upgrade:
                    self.kubeconfig.remove()
            except (InstallError, OSError) as exc:
                log.warning("CNI plugin removal failed: %s", exc)
            self._set_installer_ready(False)
        if self.dataplane is not None:
            if not upgrade:
                try:
                    await self.dataplane.teardown_host()
                except AmbientError as exc:
                    log.warning("host probe rule removal failed: %s", exc)
            self.dataplane.close()
        if self.source is not None:
            await self.source.close()
        for server in (self.health, self.monitoring):
            if server is not None:
                await server.stop()
        self.stopped.set()
        return upgrade

    def dump(self) -> dict[str, Any]:
        out: dict[str, Any] = {"config": self.cfg.dump(), "ready": self.ready, "state": repr(self)}
        if self.dataplane is not None:
            out["pods"] = self.dataplane.cache.dump()
        if self.zds is not None:
            out["ztunnels"] = list(self.zds.connections)
        if self.plugin_tokens is not None:
            out["plugin_token"] = repr(self.plugin_tokens)
        if self.plugin_server is not None:
            out["plugin_runs"] = {
                "handed_over": self.plugin_server.plugin_runs,
                "refused": self.plugin_server.plugin_runs_refused,
            }
        return out


class _LateSnapshot:
    """The ZDS server is built before the data plane it reads the snapshot from."""

    __slots__ = ("agent",)

    def __init__(self, agent: CniAgent) -> None:
        self.agent = agent

    def snapshot(self) -> list[SnapshotEntry]:
        return self.agent.dataplane.snapshot() if self.agent.dataplane is not None else []


def build(cfg: AgentConfig, *, runner: CommandRunner | None = None) -> CniAgent:
    """The real wiring: subprocess runner, pod source from the config, kernel probe sets."""
    runner = runner or SubprocessRunner()
    if not cfg.chained_cni_plugin:
        raise ConfigError(
            "CHAINED_CNI_PLUGIN",
            "only chained mode is supported",
            hint="the plugin must run after the pod network's own plugin",
        )
    source = None
    probe_set: ProbeSet | None = None
    if cfg.ambient_enabled:
        source = build_pod_source(cfg)
        settings = DataplaneSettings.from_agent_config(cfg, kubelet_uid=find_kubelet_uid(cfg.proc_root))
        if cfg.native_nftables:
            if settings.host_probe.kubelet_uid is None:
                raise ConfigError(
                    "KUBELET_UID",
                    "NATIVE_NFTABLES needs the kubelet's uid and no kubelet process was found",
                    hint="set KUBELET_UID",
                )
            probe_set = NftProbeSet(runner, None, settings.host_probe)
        else:
            host_probe = settings.host_probe
            probe_set = ThreadBoundProbeSet(lambda: NetlinkIpset(host_probe), name="ipset")
    entry = plugin_entry(
        plugin_log_level=cfg.plugin_log_level,
        cni_agent_run_dir=str(cfg.cni_agent_run_dir),
        ambient_enabled=cfg.ambient_enabled,
        enablement_selectors=cfg.enablement_selectors,
        exclude_namespaces=cfg.exclude_namespaces,
        pod_namespace=cfg.pod_namespace,
        native_nftables=cfg.native_nftables,
        enable_ambient_detection_retry=cfg.enable_ambient_detection_retry,
        pod_source_directory=cfg.pod_source_directory,
    )
    installer = Installer(
        PluginInstall(
            cni_net_dir=cfg.mounted_cni_net_dir,
            cni_bin_dir=cfg.cni_bin_dir,
            entry=entry,
            launcher=launcher_script(),
            bundle=packaged_plugin(),
            cni_conf_name=cfg.cni_conf_name,
            conf_group_read=cfg.cni_conf_group_read,
        )
    )
    kubeconfig = None
    tokens: PluginTokens | None = None
    if cfg.ambient_enabled and not cfg.pod_source_directory:
        if isinstance(source, KubeApiPodSource) and cfg.plugin_service_account:
            tokens = PluginTokens(
                source.client,
                namespace=cfg.pod_namespace or cfg.system_namespace,
                service_account=cfg.plugin_service_account,
            )
        plugin_tokens = tokens
        kubeconfig = KubeconfigWriter(
            cfg.cni_agent_run_dir / PLUGIN_KUBECONFIG_NAME,
            lambda: KubeconfigInputs.for_plugin(cfg, plugin_tokens.current() if plugin_tokens else None),
            mode=cfg.kubeconfig_mode,
        )
    return CniAgent(
        cfg,
        runner=runner,
        source=source,
        probe_set=probe_set,
        installer=installer,
        kubeconfig=kubeconfig,
        plugin_tokens=tokens,
    )


async def run(cfg: AgentConfig) -> int:
    agent = build(cfg)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await agent.start()
        log.info(
            "ready: health on :%s, metrics on :%s, ZDS on %s, plugin events on %s",
            cfg.health_port,
            cfg.monitoring_port,
            cfg.ztunnel_uds_address,
            cfg.cni_event_address,
        )
        await stop.wait()
    finally:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(agent.shutdown(), SHUTDOWN_TIMEOUT_S)
    return 0


def main(argv: Sequence[str] | None = None, env: dict[str, str] | None = None) -> int:
    try:
        cfg = load(sys.argv[1:] if argv is None else argv, os.environ if env is None else env)
        logs.configure_logging("json" if cfg.log_as_json else "plain", cfg.log_output_level)
    except (ConfigError, AmbientError) as exc:
        print(f"ambient cni-agent: {exc}", file=sys.stderr)
        return 2
    log.info("config: %s", json.dumps(cfg.dump(), sort_keys=True))
    try:
        return asyncio.run(run(cfg))
    except AmbientError as exc:
        log.error("node agent failed: %s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
