"""`ambient lab`: start and stop a whole multi-node ambient mesh on this host.

Counterpart: a kind cluster with Istio ambient installed (istiod, the istio-cni DaemonSet, the
ztunnel DaemonSet), reduced to network namespaces and processes. Each program runs as its own
process, configured as it would be in a cluster:

    control plane  `ambient control` in the lab's network namespace, TLS on <br0>:15012,
                   serving the objects directory (cluster.py) and signing certificates
    per node       `python -m ambient_mesh.cni.agent` (istio-cni's env vars; pods from the objects
                   directory; plugin installed into the node's CNI dirs) and `ambient ztunnel` in
                   shared mode (ZDS socket from the agent, token bound to the node's ztunnel Pod)
    per pod        a sandbox (topology.py), CNI ADD through the node's chain (runtime.py), and the
                   echo app (`python -m ambient_mesh.lab.runtime`)

State lives under the lab's state directory, emptied at every start (journal.py): `objects/` (the
API server), `control/` (CA, token key, root cert), `nodes/<node>/{run,net.d,bin,zt}` (agent run
dir, CNI conf and bin dirs, ZDS socket), `logs/<component>.log` (one per component, appended
across restarts), `journal.jsonl` (every namespace and process, recorded before it exists, for
`ambient lab down` after any crash) and `lab.json` (the layout, pids and restarts that `ambient
lab status|exec|logs` read from another shell; status.py adds what is live).

`Lab` is a context manager: teardown always stops every process it started and deletes every
namespace it created, whatever failed on the way. `Lab.supervise()` is the DaemonSet controller
and the kubelet's restart policy: a component that exits is started again with backoff.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from ..admin.readiness import DRAINING
from ..errors import AmbientError, ConfigError
from ..host.commands import CommandRunner, CompletedCommand, SubprocessRunner
from ..host.files import atomic_write
from ..host.netns import http_get as netns_http_get
from ..host.netns import listening_ports, spawn_in_netns, stop_process
from ..host.netns import tcp_roundtrip as tcp_roundtrip  # part of the lab's API: tests drive pods with it
from ..host.private import private_dir, write_private
from ..kube.load import load_directory
from ..logs import access_events
from ..ports import (
    ADMIN_PORT,
    CNI_HEALTH_PORT,
    CNI_MONITORING_PORT,
    DNS_PORT,
    HBONE_PORT,
    READINESS_PORT,
    STATS_PORT,
    XDS_CA_PORT,
)
from .apply import assign_cluster_ip
from .cluster import (
    AGENT_DAEMONSET,
    SYSTEM_NAMESPACE,
    ZTUNNEL_SERVICE_ACCOUNT,
    PodSpec,
    ServiceSpec,
    agent_daemonset_object,
    check_name,
    namespace_object,
    object_file_name,
    pod_object,
    pod_uid,
    remove_object,
    service_object,
    write_objects,
    ztunnel_pod_name,
    ztunnel_pod_spec,
)
from .journal import Journal, prepare_state_dir, process_start_ticks, sweep
from .runtime import CniCallError, CniRuntime
from .services import (
    kube_proxy_hooks,
    objects_stamp,
    render_kube_proxy_rules,
    resolv_conf,
    service_ports,
)
from .topology import MAX_LAB_NODES, MAX_PODS_PER_NODE, NodeNet, PodNet, Topology, pod_netns_name

APP_PORT = 8080
ISTIOD_HOSTNAME = "istiod.istio-system.svc"  # a name in the control plane's serving certificate
# Root's, under /run (journal.py: a state directory others can write is refused); short: unix
# socket paths must stay under 108 bytes.
DEFAULT_STATE_DIR = "/run/ambient-lab"
READY_TIMEOUT_S = 30.0
AGENT_STOP_GRACE_S = 15.0
PROCESS_STOP_GRACE_S = 5.0
POLL_INTERVAL_S = 0.05
HTTP_TIMEOUT_S = 3.0
LOG_TAIL_CHARS = 3000
MAX_PARALLEL_CNI_CALLS = 8  # plugin processes at once when the lab starts its pods
SANDBOX_RETRY_FIRST_S = 0.1
SANDBOX_RETRY_MAX_S = 2.0
STATE_FILE = "lab.json"
ROLLOUT_DIR = "rollouts"  # `ambient lab rollout` requests, read by the `up` supervisor
ETC_NETNS = Path("/etc/netns")  # per-namespace /etc overrides that `ip netns exec` mounts
MAX_LAB_PODS = 256
RESTART_BACKOFF_FIRST_S = 1.0  # kubelet's CrashLoopBackOff starts at 10 s and doubles to 5 min;
RESTART_BACKOFF_MAX_S = 30.0  # the lab's components start in about a second, so it is scaled down
RESTART_BACKOFF_RESET_S = 60.0  # a component that ran this long starts again from the first delay
# A node proxy that is replaced keeps its open connections this long (ztunnel's drain deadline,
# CONNECTION_TERMINATION_DEADLINE); the kubelet's SIGKILL comes PROXY_KILL_MARGIN_S later.
PROXY_DRAIN_S = 10.0
PROXY_KILL_MARGIN_S = 2.0
# During a rollout two node proxies run in the node's namespace (on Kubernetes each has its own
# pod namespace): the surge proxy's admin, stats and readiness ports are the usual ones plus this.
SURGE_PORT_OFFSET = 100
DRAIN_CHECK_INTERVAL_S = 0.5  # how often the supervisor asks each node proxy whether it drains
DRAIN_CHECK_TIMEOUT_S = 0.5
STOP_GRACE_S = {"agent": AGENT_STOP_GRACE_S, "ztunnel": PROXY_DRAIN_S + PROXY_KILL_MARGIN_S}
PASSED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "PYTHONPATH", "VIRTUAL_ENV", "TMPDIR")


@dataclass(frozen=True, slots=True, kw_only=True)
class LabConfig:
    """What to build. Pods listed here are started by `Lab.start()`; more can be added later."""

    state_dir: Path
    nodes: tuple[str, ...] = ("node-1", "node-2")
    pods: tuple[PodSpec, ...] = ()
    ambient_namespaces: frozenset[str] = frozenset()
    services: tuple[ServiceSpec, ...] = ()
    objects: tuple[Mapping[str, Any], ...] = ()  # more objects to serve from the start (topology file)
    cluster_dns: bool = True  # the lab's resolver, pods' resolv.conf, DNS capture in the mesh
    kube_proxy: bool = True  # ClusterIP DNAT in every node, for pods outside the mesh
    native_nftables: bool = False
    app_port: int = APP_PORT
    agent_env: Mapping[str, str] = field(default_factory=dict)
    ztunnel_env: Mapping[str, str] = field(default_factory=dict)
    ready_timeout_s: float = READY_TIMEOUT_S
    python: str = sys.executable

    def validate(self) -> None:
        """Everything that can be checked before anything starts; raises ConfigError naming it."""
        validate_layout(self.nodes, self.pods)


def validate_layout(nodes: Sequence[str], pods: Sequence[PodSpec]) -> None:
    if not 1 <= len(nodes) <= MAX_LAB_NODES:
        raise ConfigError("--nodes", f"{len(nodes)} nodes: the lab runs 1 to {MAX_LAB_NODES}")
    if len(set(nodes)) != len(nodes):
        raise ConfigError("nodes", f"node names repeat: {', '.join(nodes)}")
    for name in nodes:
        check_name("node", name)
    if len(pods) > MAX_LAB_PODS:
        raise ConfigError("pods", f"{len(pods)} pods: the lab runs at most {MAX_LAB_PODS}")
    seen: set[str] = set()
    per_node: dict[str, int] = {}
    for spec in pods:
        if spec.key in seen:
            raise ConfigError("pods", f"pod {spec.key} is listed twice")
        seen.add(spec.key)
        if spec.node not in nodes:
            raise ConfigError(
                "pods", f"pod {spec.key} is on node {spec.node!r}, which is not one of {', '.join(nodes)}"
            )
        per_node[spec.node] = per_node.get(spec.node, 0) + 1
        if per_node[spec.node] > MAX_PODS_PER_NODE:
            raise ConfigError("pods", f"node {spec.node} has room for {MAX_PODS_PER_NODE} pods")


@dataclass(slots=True)
class Program:
    """One process the lab started: where it runs, its log, and how to find it again."""

    name: str  # the component: control, agent-<node>, ztunnel-<node>, app-<ns>-<pod>
    netns: str
    log: Path
    process: subprocess.Popen[bytes]
    started_at: float = 0.0  # monotonic
    log_start: int = 0  # where this run's output begins in the log (it is appended across restarts)

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


@dataclass(slots=True)
class LabNode:
    net: NodeNet
    dir: Path
    uid: str  # of its ztunnel Pod
    runtime: CniRuntime
    agent: Program | None = None
    proxy: Program | None = None
    agent_starts: int = 0
    proxy_starts: int = 0
    proxy_slot: int = 0  # 0: the usual admin/stats/readiness ports, 1: plus SURGE_PORT_OFFSET

    def proxy_port(self, port: int) -> int:
        """Where the current node proxy serves one of its own well-known ports."""
        if port in (ADMIN_PORT, STATS_PORT, READINESS_PORT):
            return port + SURGE_PORT_OFFSET * self.proxy_slot
        return port

    @property
    def run_dir(self) -> Path:
        return self.dir / "run"

    @property
    def net_dir(self) -> Path:
        return self.dir / "net.d"

    @property
    def bin_dir(self) -> Path:
        return self.dir / "bin"

    @property
    def zds_socket(self) -> Path:
        return self.dir / "zt" / "ztunnel.sock"

    @property
    def token(self) -> Path:
        return self.dir / "ztunnel.token"


@dataclass(slots=True)
class LabPod:
    spec: PodSpec
    net: PodNet
    uid: str
    app: Program | None = None

    @property
    def ip(self) -> str:
        return str(self.net.ip)

    @property
    def netns(self) -> str:
        return self.net.netns


def http_get(
    netns: str, host: str, port: int, path: str, *, timeout_s: float = HTTP_TIMEOUT_S
) -> tuple[int, str]:
    """GET from inside `netns`; returns (status, body as text). Connection failures raise OSError
    (callers polling for readiness treat that as "not yet"), a reply that is not HTTP AmbientError."""
    try:
        status, body = netns_http_get(netns, host, port, path, timeout_s=timeout_s)
    except http.client.HTTPException as e:
        raise AmbientError(f"GET {host}:{port}{path} from {netns}: not an HTTP response: {e!r}") from e
    return status, body.decode(errors="replace")


def _read_objects(directory: Path, kind: str) -> list[dict[str, Any]]:
    """The objects of `kind` in the lab's objects directory (one file each)."""
    from ..control.waypoint_deployer import read_current

    return list(read_current(directory, (kind,)).values())


def wait_until(
    predicate: Callable[[], object],
    *,
    timeout_s: float,
    what: str,
    on_timeout: Callable[[], str] | None = None,
) -> object:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            detail = on_timeout() if on_timeout else ""
            raise AmbientError(
                f"timed out after {timeout_s}s waiting for {what}" + (f"\n{detail}" if detail else "")
            )
        time.sleep(POLL_INTERVAL_S)


class Lab:
    """The whole mesh. `with Lab(config) as lab:` starts it; leaving the block tears it down."""

    def __init__(self, config: LabConfig, *, runner: CommandRunner | None = None) -> None:
        self.config = config
        self.runner = runner or SubprocessRunner()
        self.state_dir = Path(config.state_dir).resolve()
        self.objects_dir = self.state_dir / "objects"
        self.control_dir = self.state_dir / "control"
        self.logs_dir = self.state_dir / "logs"
        self.topology = Topology(runner=self.runner, on_create=self._record_netns)
        self.lab_id = self.topology.prefix
        self.nodes: dict[str, LabNode] = {}
        self.pods: dict[str, LabPod] = {}
        self.control: Program | None = None
        self.dns: Program | None = None
        self.programs: list[Program] = []
        self.journal: Journal | None = None
        self.ready = False
        # The supervisor: components to keep running, how to start each again, and its backoff.
        self.restarts: dict[str, int] = {}
        self._supervised: dict[str, Program] = {}
        self._restart_fns: dict[str, Callable[[], object]] = {}
        self._restart_due: dict[str, float] = {}
        self._restart_delay: dict[str, float] = {}
        self._services_stamp: tuple[object, ...] | None = None
        self._pods_stamp: tuple[object, ...] | None = None
        self._deployments_stamp: tuple[object, ...] | None = None
        self._started = False
        # Node proxies replaced by a rollout, draining their open connections until they exit.
        self._draining: list[tuple[Program, float]] = []  # (program, SIGKILL due, monotonic)
        self._drain_checked: dict[str, float] = {}  # node -> when its proxy was last asked

    def __repr__(self) -> str:
        running = sum(1 for p in self.programs if p.running)
        return (
            f"Lab({self.lab_id!r}, {'up' if self._started else 'down'}: {len(self.nodes)} nodes, "
            f"{len(self.pods)} pods, {running}/{len(self.programs)} processes running)"
        )

    # -- lifecycle ---------------------------------------------------------------------------------

    def __enter__(self) -> Lab:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def control_address(self) -> str:
        return f"{self.topology.gateway}:{XDS_CA_PORT}"

    def _record_netns(self, name: str) -> None:
        if self.journal is not None:
            self.journal.netns(name)

    def start(self, *, say: Callable[[str], None] = lambda _line: None) -> None:
        self.config.validate()  # before anything exists
        prepare_state_dir(self.state_dir, self.runner, say=say)
        self._started = True
        self.journal = Journal(self.state_dir)
        self.journal.lab(os.getpid())
        for d in (self.objects_dir, self.control_dir, self.logs_dir):
            private_dir(d)  # 0700: the control plane's keys, the node proxies' tokens, pod records
        self.topology.open()
        for name in self.config.nodes:
            self._write_resolv_conf(f"{self.topology.prefix}{name}", None)
            net = self.topology.add_node(name)
            if self.config.kube_proxy:
                for argv in kube_proxy_hooks():
                    self.runner.run(argv, netns=net.netns)
            node_dir = self.state_dir / "nodes" / name
            node = LabNode(
                net=net,
                dir=node_dir,
                uid=pod_uid(self.lab_id, SYSTEM_NAMESPACE, ztunnel_pod_name(name)),
                runtime=CniRuntime(
                    self.runner, node_netns=net.netns, net_dir=node_dir / "net.d", bin_dir=node_dir / "bin"
                ),
            )
            for d in (node.dir, node.run_dir, node.net_dir, node.bin_dir, node.zds_socket.parent):
                private_dir(d)
            # The primary network the lab provides; the agent chains istio-cni after it.
            (node.net_dir / "10-ambient-lab.conflist").write_text(
                json.dumps(
                    {
                        "cniVersion": "1.0.0",
                        "name": "ambient-lab",
                        "plugins": [{"type": "ambient-lab-bridge"}],
                    }
                )
            )
            self.nodes[name] = node
        self._write_base_objects()
        # Side by side where nothing orders them: the node agents need only the objects, the
        # node proxies need the control plane (xDS, CA), the pods need their node's agent.
        self._start_control(wait=False)
        if self.config.cluster_dns:
            self._start_dns()
        for node in self.nodes.values():
            self.start_agent(node.net.name, wait=False)
        self._wait_control()
        for node in self.nodes.values():
            self.start_proxy(node.net.name)
        for node in self.nodes.values():
            self.wait_agent_ready(node.net.name)
        for node in self.nodes.values():
            self.wait_proxy_ready(node.net.name)
        # Sandboxes one by one (addresses are allocated in order), CNI ADDs side by side (each is a
        # plugin process and a round trip to its node's agent, as a runtime runs them), then apps.
        sandboxes = [self._create_sandbox(spec) for spec in self.config.pods]
        with concurrent.futures.ThreadPoolExecutor(max_workers=MAX_PARALLEL_CNI_CALLS) as pool:
            for done in [pool.submit(self._cni_add_with_retries, pod) for pod in sandboxes]:
                done.result()
        for pod in sandboxes:
            self._start_app(pod)
        for pod in sandboxes:
            self._pod_running(pod)
        self.write_state()
        self.reconcile_services()
        self.wait_converged()
        self.ready = True
        self.write_state()

    def stop(self) -> None:
        """Stop every process (all signalled first, so they drain side by side), then delete
        every namespace; finally sweep what the journal records, in case anything escaped. Safe
        to call more than once. A lab that never got its state directory (`start` refused: another
        lab runs from it) touches nothing there: lab.json and the journal are the running lab's."""
        owns_state = self._started
        self._supervised.clear()
        try:
            for program in self.programs:
                if program.running:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(program.process.pid, signal.SIGTERM)
            for program in reversed(self.programs):
                stop_process(
                    program.process,
                    grace_s=STOP_GRACE_S.get(program.name.split("-", 1)[0], PROCESS_STOP_GRACE_S),
                )
        finally:
            self.topology.close()
            self._started = False
            self.ready = False
            if self.journal is not None:
                self.journal.close()
                self.journal = None
                sweep(self.state_dir, self.runner)
            if owns_state:
                with contextlib.suppress(OSError):
                    (self.state_dir / STATE_FILE).unlink()

    # -- objects -----------------------------------------------------------------------------------

    def _write_base_objects(self) -> None:
        objects: list[dict[str, Any]] = [
            namespace_object(SYSTEM_NAMESPACE, ambient=False),
            agent_daemonset_object(),
        ]
        namespaces = {spec.namespace for spec in self.config.pods} | set(self.config.ambient_namespaces)
        objects += [
            namespace_object(ns, ambient=ns in self.config.ambient_namespaces) for ns in sorted(namespaces)
        ]
        for node in self.nodes.values():
            # The ztunnel Pod: what the CA checks the node proxy's pod-bound token against. Its
            # address is the node's (the node proxy runs in the node's namespace).
            objects.append(pod_object(ztunnel_pod_spec(node.net.name), uid=node.uid, ip=node.net.uplink_ip))
        objects += [service_object(s) for s in self.config.services]
        write_objects(self.objects_dir, objects)
        for doc in self.config.objects:
            obj = copy.deepcopy(dict(doc))
            if obj.get("kind") == "Service":
                assign_cluster_ip(self.objects_dir, obj)
            write_objects(self.objects_dir, [obj])

    def set_namespace(self, namespace: str, *, ambient: bool) -> None:
        write_objects(self.objects_dir, [namespace_object(namespace, ambient=ambient)])

    # -- cluster services: DNS and kube-proxy ------------------------------------------------------

    def _write_resolv_conf(self, netns: str, namespace: str | None) -> None:
        """`ip netns exec` bind-mounts /etc/netns/<netns>/resolv.conf over /etc/resolv.conf for
        everything started in that namespace: the kubelet's ClusterFirst DNS for a pod, and the
        upstream the node proxy forwards non-mesh names to."""
        if not self.config.cluster_dns:
            return
        directory = ETC_NETNS / netns
        if self.journal is not None:
            self.journal.path_created(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "resolv.conf").write_text(resolv_conf(str(self.topology.gateway), namespace))

    def _start_dns(self) -> Program:
        self.dns = self._spawn(
            "dns",
            self.topology.network_netns,
            [
                self.config.python,
                "-m",
                "ambient_mesh.lab.services",
                "--objects",
                str(self.objects_dir),
                "--listen",
                f"{self.topology.gateway}:{DNS_PORT}",
            ],
            {},
            restart=self._start_dns,
        )
        return self.dns

    def reconcile_services(self) -> bool:
        """kube-proxy's sync: when the objects changed, rewrite every node's ClusterIP rules.
        Returns whether it did."""
        if not self.config.kube_proxy:
            return False
        stamp = objects_stamp(self.objects_dir)
        if stamp == self._services_stamp:
            return False
        self._services_stamp = stamp
        ports = service_ports(load_directory(self.objects_dir).objects)
        for node in self.nodes.values():
            rules = render_kube_proxy_rules(ports, str(node.net.pod_cidr))
            self.runner.run(
                ["iptables-restore", "-w", "--noflush"], input=rules.encode(), netns=node.net.netns
            )
        return True

    # -- programs ----------------------------------------------------------------------------------

    def _env(self, extra: Mapping[str, str]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k in PASSED_ENV}
        env.update(extra)
        return env

    def _spawn(
        self,
        name: str,
        netns: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        *,
        restart: Callable[[], object] | None = None,
    ) -> Program:
        """Start one component (its output appended to logs/<name>.log); with `restart`, the
        supervisor starts it again that way when it exits."""
        log = self.logs_dir / f"{name}.log"
        with open(log, "ab") as out:
            log_start = out.tell()
            out.write(f"--- ambient lab: starting {name} at {time.strftime('%H:%M:%S')} ---\n".encode())
            out.flush()
            process = spawn_in_netns(netns, argv, env=self._env(env), stdout=out, stderr=subprocess.STDOUT)
        if self.journal is not None:
            self.journal.process(process.pid, name, argv)
        program = Program(
            name=name, netns=netns, log=log, process=process, started_at=time.monotonic(), log_start=log_start
        )
        old = self._supervised.get(name)
        if old is not None and old in self.programs and not old.running:
            self.programs.remove(old)
        self.programs.append(program)
        self.restarts.setdefault(name, 0)
        if restart is not None:
            self._supervised[name] = program
            self._restart_fns[name] = restart
        return program

    def _stop(self, program: Program, grace_s: float) -> int:
        """A deliberate stop: the supervisor lets it be."""
        if self._supervised.get(program.name) is program:
            del self._supervised[program.name]
        self._restart_due.pop(program.name, None)
        code = stop_process(program.process, grace_s=grace_s)
        with contextlib.suppress(ValueError):
            self.programs.remove(program)
        return code

    def supervise(self, now: float | None = None) -> list[str]:
        """One pass of the supervisor: a supervised component that exited is started again after
        a delay that doubles each time (RESTART_BACKOFF_*), as a DaemonSet's pods are by the
        kubelet. Returns what it did, one line each; lab.json is rewritten when anything changed."""
        now = time.monotonic() if now is None else now
        events: list[str] = self._reap_draining(now)
        if self._started and self.ready:
            events += self.reconcile_rollouts()
            events += self.replace_draining_proxies(now)
            events += self.reconcile_deployments()
            events += self.reconcile_pods()
            try:
                self.reconcile_services()
            except AmbientError as e:
                events.append(f"kube-proxy rules not applied: {e}")
        for name, program in list(self._supervised.items()):
            if program.running:
                if name in self._restart_delay and now - program.started_at >= RESTART_BACKOFF_RESET_S:
                    del self._restart_delay[name]
                continue
            delay = self._restart_delay.get(name, RESTART_BACKOFF_FIRST_S)
            due = self._restart_due.get(name)
            if due is None:
                self._restart_due[name] = now + delay
                events.append(
                    f"{name} exited with code {program.process.returncode}; restarting in {delay:.0f}s"
                )
                continue
            if now < due:
                continue
            del self._restart_due[name]
            self._restart_delay[name] = min(delay * 2, RESTART_BACKOFF_MAX_S)
            self.restarts[name] = self.restarts.get(name, 0) + 1
            try:
                self._restart_fns[name]()
                events.append(f"{name} restarted (restart {self.restarts[name]})")
            except (AmbientError, OSError) as e:
                events.append(f"{name} failed to restart: {e}")
        if events:
            self.write_state()
        return events

    def backoff(self, name: str) -> float | None:
        """Seconds until the supervisor starts `name` again (None: not waiting to)."""
        due = self._restart_due.get(name)
        return None if due is None else max(0.0, due - time.monotonic())

    def _start_control(self, *, wait: bool = True) -> None:
        argv = [
            self.config.python,
            "-m",
            "ambient_mesh.cli",
            "control",
            "--dir",
            str(self.objects_dir),
            "--state-dir",
            str(self.control_dir),
            "--listen",
            self.control_address,
            # istiod's gateway deployment controller: the lab's kubelet runs what it asks for.
            "--deploy-waypoints",
        ]
        self.control = self._spawn(
            "control", self.topology.network_netns, argv, {}, restart=lambda: self._start_control(wait=False)
        )
        if wait:
            self._wait_control()

    def _wait_control(self) -> None:
        control = self.control
        if control is None:
            raise AmbientError("the control plane was not started")
        wait_until(
            lambda: self._listening(self.topology.network_netns, XDS_CA_PORT, control),
            timeout_s=self.config.ready_timeout_s,
            what="the control plane to listen",
            on_timeout=control.tail,
        )

    def _listening(self, netns: str, port: int, program: Program) -> bool:
        if not program.running:
            raise AmbientError(
                f"{program.name} exited with code {program.process.returncode}:\n{program.tail()}"
            )
        return port in listening_ports(self.runner, netns)

    def agent_env(self, node: LabNode) -> dict[str, str]:
        """istio-cni's settings for one node (docs/istio-behaviour.md, "Node agent configuration")."""
        env = {
            "AMBIENT_ENABLED": "true",
            "CNI_AGENT_RUN_DIR": str(node.run_dir),
            "MOUNTED_CNI_NET_DIR": str(node.net_dir),
            "CNI_BIN_DIR": str(node.bin_dir),
            "ZTUNNEL_UDS_ADDRESS": str(node.zds_socket),
            "POD_SOURCE_DIRECTORY": str(self.objects_dir),
            "POD_SOURCE_POLL_INTERVAL": "100ms",
            "NODE_NAME": node.net.name,
            "AMBIENT_IPV6": "false",
            "AMBIENT_DNS_CAPTURE": "true" if self.config.cluster_dns else "false",
            "POD_NAMESPACE": SYSTEM_NAMESPACE,
            "POD_NAME": f"{AGENT_DAEMONSET}-{node.net.name}",
            "LOG_OUTPUT_LEVEL": "info",
            "MONITORING_PORT": str(CNI_MONITORING_PORT),
            "HEALTH_PORT": str(CNI_HEALTH_PORT),
            "NATIVE_NFTABLES": "true" if self.config.native_nftables else "false",
        }
        if self.config.native_nftables:
            # nftables has no `--socket-exists`: the host probe rule matches the kubelet's uid,
            # and the lab's kubelet (this process) runs as root.
            env["KUBELET_UID"] = str(os.geteuid())
        env.update(self.config.agent_env)
        return env

    def start_agent(self, name: str, *, wait: bool = True) -> Program:
        node = self.nodes[name]
        node.agent_starts += 1
        node.agent = self._spawn(
            f"agent-{name}",
            node.net.netns,
            [self.config.python, "-m", "ambient_mesh.cni.agent"],
            self.agent_env(node),
            restart=lambda: self.start_agent(name, wait=False),
        )
        if wait:
            self.wait_agent_ready(name)
            self.wait_proxy_synced(name)
        return node.agent

    def wait_agent_ready(self, name: str) -> None:
        node = self.nodes[name]
        agent = node.agent
        if agent is None:
            raise AmbientError(f"no node agent started on {name}")
        wait_until(
            lambda: self._agent_ready(node, agent),
            timeout_s=self.config.ready_timeout_s,
            what=f"the node agent on {name} to install the plugin and be ready",
            on_timeout=agent.tail,
        )

    def _agent_ready(self, node: LabNode, agent: Program) -> bool:
        if not agent.running:
            raise AmbientError(f"{agent.name} exited with code {agent.process.returncode}:\n{agent.tail()}")
        if not (node.run_dir / "pluginevent.sock").exists() or not self.plugin_installed(node.net.name):
            return False
        try:
            status, _ = http_get(node.net.netns, "127.0.0.1", CNI_HEALTH_PORT, "/readyz")
        except OSError:
            return False
        return status == 200

    def agent_connected_proxies(self, name: str) -> int | None:
        """istio-cni's `ztunnel_connected` on `name`'s node agent; None when it does not answer."""
        try:
            status, body = http_get(self.nodes[name].net.netns, "127.0.0.1", CNI_MONITORING_PORT, "/metrics")
        except (OSError, AmbientError):
            return None
        if status != 200:
            return None
        for family in text_string_to_metric_families(body):
            for sample in family.samples:
                if sample.name == "ztunnel_connected":
                    return int(sample.value)
        return None

    def wait_proxy_synced(self, name: str) -> None:
        """After a node agent (re)start: until the node proxy on `name`, if one runs, has
        connected to this agent and taken its snapshot. The agent counting a connection means
        the proxy's connection to the previous agent is over (it dials again only after that),
        and the proxy's readiness is then about the new one: ready once its snapshot is applied
        and no pod waits for a retry (ztunnel's rule). Until then the node's pods may be without
        a proxy, e.g. while one that the snapshot restarted waits out its retry."""
        node = self.nodes[name]
        proxy = node.proxy
        if proxy is None or not proxy.running:
            return

        def synced() -> bool:
            if not proxy.running:
                raise AmbientError(
                    f"{proxy.name} exited with code {proxy.process.returncode}:\n{proxy.tail()}"
                )
            return bool(self.agent_connected_proxies(name)) and self.proxy_ready(name)

        wait_until(
            synced,
            timeout_s=self.config.ready_timeout_s,
            what=f"the node proxy on {name} to take the node agent's snapshot and be ready",
            on_timeout=lambda: f"{proxy.name}:\n{proxy.tail()}",
        )

    def stop_agent(self, name: str) -> int:
        node = self.nodes[name]
        if node.agent is None:
            return 0
        code = self._stop(node.agent, AGENT_STOP_GRACE_S)
        node.agent = None
        return code

    def plugin_installed(self, name: str) -> bool:
        from .runtime import find_conflist

        try:
            conflist = json.loads(find_conflist(self.nodes[name].net_dir).read_text())
        except (OSError, ValueError, ConfigError):
            return False
        return any(isinstance(p, dict) and p.get("type") == "istio-cni" for p in conflist.get("plugins", []))

    def proxy_env(self, node: LabNode) -> dict[str, str]:
        """ztunnel's settings in shared mode (docs/istio-behaviour.md, "Proxy modes"), pointed at the lab's
        control plane."""
        root = str(self.control_dir / "root-cert.pem")
        env = {
            "PROXY_MODE": "shared",
            "INPOD_UDS": str(node.zds_socket),
            "NODE_NAME": node.net.name,
            "XDS_ADDRESS": f"https://{self.control_address}",
            "CA_ADDRESS": f"https://{self.control_address}",
            "XDS_ROOT_CA": root,
            "CA_ROOT_CA": root,
            "ALT_XDS_HOSTNAME": ISTIOD_HOSTNAME,
            "ALT_CA_HOSTNAME": ISTIOD_HOSTNAME,
            "AUTH_TOKEN": str(node.token),
            "POD_NAME": ztunnel_pod_name(node.net.name),
            "POD_NAMESPACE": SYSTEM_NAMESPACE,
            "SERVICE_ACCOUNT": ZTUNNEL_SERVICE_ACCOUNT,
            "INSTANCE_IP": str(node.net.uplink_ip),
            "ISTIO_META_DNS_CAPTURE": "true" if self.config.cluster_dns else "false",
            "TERMINATION_GRACE_PERIOD_SECONDS": str(int(PROXY_DRAIN_S + PROXY_KILL_MARGIN_S)),
            "CONNECTION_TERMINATION_DEADLINE": f"{PROXY_DRAIN_S:g}s",
            "ADMIN_ADDR": f"127.0.0.1:{node.proxy_port(ADMIN_PORT)}",
            "STATS_ADDR": f"[::]:{node.proxy_port(STATS_PORT)}",
            "READINESS_ADDR": f"[::]:{node.proxy_port(READINESS_PORT)}",
            "IPV6_ENABLED": "false",
        }
        env.update(self.config.ztunnel_env)
        return env

    def start_proxy(self, name: str) -> Program:
        from ..control.plane import mint_token

        node = self.nodes[name]
        # A projected service-account token bound to the node's ztunnel Pod, as the kubelet mounts it.
        # 0600: the token gets certificates for every workload on the node.
        write_private(
            node.token,
            mint_token(
                self.control_dir,
                account=(SYSTEM_NAMESPACE, ZTUNNEL_SERVICE_ACCOUNT),
                node=name,
                pod=ztunnel_pod_name(name),
                uid=node.uid,
            ).encode(),
        )
        node.proxy_starts += 1
        node.proxy = self._spawn(
            f"ztunnel-{name}",
            node.net.netns,
            [self.config.python, "-m", "ambient_mesh.cli", "ztunnel"],
            self.proxy_env(node),
            restart=lambda: self.start_proxy(name),
        )
        return node.proxy

    def proxy_ready(self, name: str) -> bool:
        node = self.nodes[name]
        if node.proxy is None or not node.proxy.running:
            return False
        try:
            status, _ = http_get(
                node.net.netns, "127.0.0.1", node.proxy_port(READINESS_PORT), "/healthz/ready"
            )
        except OSError:
            return False
        return status == 200

    def wait_proxy_ready(self, name: str) -> None:
        node = self.nodes[name]
        proxy = node.proxy
        if proxy is None:
            raise AmbientError(f"no node proxy started on {name}")

        def ready() -> bool:
            if not proxy.running:
                raise AmbientError(
                    f"{proxy.name} exited with code {proxy.process.returncode}:\n{proxy.tail()}"
                )
            return self.proxy_ready(name)

        wait_until(
            ready,
            timeout_s=self.config.ready_timeout_s,
            what=f"the node proxy on {name} to be ready",
            on_timeout=proxy.tail,
        )

    def config_dump(self, name: str) -> dict[str, Any]:
        """The node proxy's /config_dump on `name`; {} when it does not answer."""
        try:
            status, body = self.proxy_get(name, ADMIN_PORT, "/config_dump")
            return json.loads(body) if status == 200 else {}
        except (OSError, ValueError, AmbientError):
            return {}

    def known_ips(self, name: str) -> set[str]:
        """Workload IPs the node proxy on `name` has from xDS."""
        return {ip for w in self.config_dump(name).get("workloads", []) for ip in w.get("workloadIps", [])}

    def served_pods(self, name: str) -> set[str]:
        """`namespace/name` of every pod the node proxy on `name` runs a proxy for (workloadState)."""
        state = self.config_dump(name).get("workloadState", {})
        return {
            f"{v['info']['namespace']}/{v['info']['name']}"
            for v in state.values()
            if isinstance(v, dict) and isinstance(v.get("info"), dict)
        }

    def wait_converged(self) -> None:
        """Until every running node proxy knows every pod: the control plane has read the pods'
        status and pushed it (kubelet's "Ready" comes after that in a cluster, roughly)."""
        wanted = {pod.ip for pod in self.pods.values()}
        for name, node in self.nodes.items():
            if node.proxy is None or not node.proxy.running:
                continue
            # wait_until calls both within this iteration, so they may close over `name`.
            wait_until(
                lambda: wanted <= self.known_ips(name),  # noqa: B023
                timeout_s=self.config.ready_timeout_s,
                what=f"the node proxy on {name} to learn every pod from xDS",
                on_timeout=lambda: f"missing: {sorted(wanted - self.known_ips(name))}",  # noqa: B023
            )

    def stop_proxy(self, name: str) -> int:
        node = self.nodes[name]
        if node.proxy is None:
            return 0
        code = self._stop(node.proxy, PROXY_DRAIN_S + PROXY_KILL_MARGIN_S)
        node.proxy = None
        return code

    # -- node proxy rollouts -----------------------------------------------------------------------

    def rollout_proxy(self, name: str) -> Program:
        """Replace the node proxy on `name` without a moment without one, as the ztunnel
        DaemonSet rolls with maxSurge 1, maxUnavailable 0: the new proxy starts beside the old
        one, connects to the node agent (the newest connection gets every pod, in its snapshot)
        and opens its listeners in every pod beside the old one's (SO_REUSEPORT); once it is
        ready the old one gets SIGTERM, stops accepting, and drains its open connections until
        they end or its deadline passes (docs/istio-behaviour.md, "ZDS"). A new proxy that does not
        become ready is stopped and the old one keeps serving. Returns the new proxy."""
        node = self.nodes[name]
        old = node.proxy
        if old is None or not old.running:
            # Nothing to hand over from: start one (the supervisor may be waiting to).
            self._restart_due.pop(f"ztunnel-{name}", None)
            self.start_proxy(name)
            self.wait_proxy_ready(name)
            return self._require_proxy(node)
        old_slot = node.proxy_slot
        node.proxy_slot = 1 - old_slot
        try:
            new = self.start_proxy(name)
            self.wait_proxy_ready(name)
        except BaseException:
            failed = node.proxy
            if failed is not None and failed is not old:
                stop_process(failed.process, grace_s=PROCESS_STOP_GRACE_S)
                with contextlib.suppress(ValueError):
                    self.programs.remove(failed)
            node.proxy, node.proxy_slot = old, old_slot
            self._supervised[old.name] = old
            self.write_state()
            raise
        with contextlib.suppress(ProcessLookupError):
            os.killpg(old.process.pid, signal.SIGTERM)
        self._draining.append((old, time.monotonic() + PROXY_DRAIN_S + PROXY_KILL_MARGIN_S))
        self.write_state()
        return new

    def _require_proxy(self, node: LabNode) -> Program:
        if node.proxy is None:
            raise AmbientError(f"no node proxy runs on {node.net.name}")
        return node.proxy

    def _reap_draining(self, now: float) -> list[str]:
        """Replaced node proxies that exited are forgotten; one still running at its kill time
        gets SIGKILL (the kubelet's end of the grace period)."""
        events = []
        for entry in list(self._draining):
            program, kill_at = entry
            if program.running and now >= kill_at:
                stop_process(program.process, grace_s=0.1)
                events.append(f"{program.name} (pid {program.process.pid}) outlived its grace period: killed")
            if not program.running:
                self._draining.remove(entry)
                with contextlib.suppress(ValueError):
                    self.programs.remove(program)
                events.append(
                    f"{program.name} (pid {program.process.pid}, replaced) drained and exited "
                    f"with code {program.process.returncode}"
                )
        return events

    def proxy_draining(self, name: str) -> bool:
        """Whether the node proxy on `name` is shutting down: its readiness names `draining`."""
        node = self.nodes[name]
        try:
            status, body = http_get(
                node.net.netns,
                "127.0.0.1",
                node.proxy_port(READINESS_PORT),
                "/healthz/ready",
                timeout_s=DRAIN_CHECK_TIMEOUT_S,
            )
        except (OSError, AmbientError):
            return False
        return status != 200 and DRAINING in body

    def replace_draining_proxies(self, now: float) -> list[str]:
        """A node proxy told to stop by someone else (SIGTERM, POST /quitquitquit) closes its
        listeners and drains: start the next one at once, beside it, instead of after it exits
        and a backoff (its open connections keep draining on the old one)."""
        events = []
        for name, node in self.nodes.items():
            proxy = node.proxy
            if proxy is None or not proxy.running:
                continue
            if now < self._drain_checked.get(name, 0.0) + DRAIN_CHECK_INTERVAL_S:
                continue
            self._drain_checked[name] = now
            if not self.proxy_draining(name):
                continue
            self._supervised.pop(proxy.name, None)  # replaced: its exit is not a crash
            self._restart_due.pop(proxy.name, None)
            self._draining.append((proxy, now + PROXY_DRAIN_S + PROXY_KILL_MARGIN_S))
            node.proxy_slot = 1 - node.proxy_slot
            self.restarts[proxy.name] = self.restarts.get(proxy.name, 0) + 1
            try:
                new = self.start_proxy(name)
            except (AmbientError, OSError) as e:
                events.append(f"{proxy.name} is draining; its replacement failed to start: {e}")
                continue
            events.append(
                f"{proxy.name} (pid {proxy.process.pid}) is draining: started pid {new.process.pid} beside it"
            )
        return events

    def reconcile_rollouts(self) -> list[str]:
        """`ambient lab rollout ztunnel` asks through a file in the state directory (as `kubectl
        rollout restart` patches the DaemonSet): one request per node, done in turn."""
        events = []
        requests = self.state_dir / ROLLOUT_DIR
        for path in sorted(requests.glob("ztunnel-*")) if requests.is_dir() else ():
            name = path.name.removeprefix("ztunnel-")
            try:
                if name not in self.nodes:
                    raise AmbientError(f"no node {name!r} in the lab")
                new = self.rollout_proxy(name)
                events.append(f"ztunnel-{name} rolled out: pid {new.process.pid} serves every pod")
                outcome = f"ok {new.process.pid}\n"
            except AmbientError as e:
                events.append(f"ztunnel-{name} rollout failed: {e}")
                outcome = f"failed {e}\n"
            atomic_write(requests / f"done-{path.name}", outcome.encode())
            path.unlink(missing_ok=True)
        return events

    # -- pods --------------------------------------------------------------------------------------

    def add_pod(self, spec: PodSpec, *, wait: bool = True) -> LabPod:
        """What kubelet and the runtime do for a new pod: the API object (Pending), the sandbox,
        CNI ADD (the chain ends with istio-cni), the app, then the status with its IP (Running).
        With `wait`, returns once every node proxy has learned the pod from xDS."""
        if spec.node not in self.nodes:
            raise AmbientError(f"pod {spec.key} is scheduled on {spec.node!r}, which is not a lab node")
        uid = pod_uid(self.lab_id, spec.namespace, spec.name)
        if not (
            self.objects_dir / object_file_name(namespace_object(spec.namespace, ambient=False))
        ).exists():
            self.set_namespace(spec.namespace, ambient=spec.namespace in self.config.ambient_namespaces)
        pod = self._create_pod(spec, uid=uid)
        self._pod_running(pod)
        if wait:
            self.wait_converged()
        self.write_state()
        return pod

    def _create_pod(self, spec: PodSpec, *, uid: str | None = None) -> LabPod:
        """The Pod object (Pending), its sandbox, CNI ADD, and its app started (not waited for)."""
        pod = self._create_sandbox(spec, uid=uid)
        self._cni_add_with_retries(pod)
        self._start_app(pod)
        return pod

    def _create_sandbox(self, spec: PodSpec, *, uid: str | None = None) -> LabPod:
        """The Pod object (Pending) and its network namespace, wired to its node."""
        uid = uid or pod_uid(self.lab_id, spec.namespace, spec.name)
        if not (
            self.objects_dir / object_file_name(namespace_object(spec.namespace, ambient=False))
        ).exists():
            self.set_namespace(spec.namespace, ambient=spec.namespace in self.config.ambient_namespaces)
        write_objects(self.objects_dir, [pod_object(spec, uid=uid, ip=None)])
        self._write_resolv_conf(pod_netns_name(self.topology.prefix, spec.key), spec.namespace)
        net = self.topology.add_pod(spec.node, spec.key)
        pod = LabPod(spec=spec, net=net, uid=uid)
        self.pods[spec.key] = pod
        return pod

    def _pod_running(self, pod: LabPod) -> None:
        """Once its app listens, the status kubelet reports: Running, Ready, with its IP."""
        app, spec = pod.app, pod.spec
        serves = spec.app == "echo"
        if spec.app == "waypoint" and app is not None:
            # Ready once its Envoy holds a certificate and its first listeners (its 15021).
            wait_until(
                lambda: self._waypoint_ready(pod, app),
                timeout_s=self.config.ready_timeout_s,
                what=f"waypoint pod {spec.key} to be ready",
                on_timeout=app.tail,
            )
        if serves and app is not None:
            wait_until(
                lambda: self._listening(pod.netns, self.config.app_port, app),
                timeout_s=self.config.ready_timeout_s,
                what=f"pod {spec.key}'s app to listen",
                on_timeout=app.tail,
            )
        write_objects(
            self.objects_dir,
            [pod_object(spec, uid=pod.uid, ip=pod.net.ip, ports=(self.config.app_port,) if serves else ())],
        )

    def _start_app(self, pod: LabPod) -> Program:
        if pod.spec.app == "waypoint":
            return self._start_waypoint(pod)
        pod.app = self._spawn(
            f"app-{pod.spec.namespace}-{pod.spec.name}",
            pod.net.netns,
            [
                self.config.python,
                "-m",
                "ambient_mesh.lab.runtime",
                "--app",
                pod.spec.app,
                "--port",
                str(self.config.app_port),
                "--pod",
                pod.spec.key,
            ],
            {},
            restart=lambda: self._start_app(pod),
        )
        return pod.app

    def _start_waypoint(self, pod: LabPod) -> Program:
        """A waypoint pod's container: `ambient waypoint` (Envoy as its child) with the pod's
        projected token, the mesh root and the control plane's address, as istiod's waypoint
        Deployment mounts and passes them (its Gateway: the pod's gateway-name label)."""
        from ..control.plane import mint_token
        from ..metadata import LABEL_GATEWAY_NAME

        spec = pod.spec
        sa = spec.service_account or "default"
        run_dir = self.config.state_dir / "waypoints" / f"{spec.namespace}-{spec.name}"
        run_dir.mkdir(parents=True, exist_ok=True)
        token = run_dir / "istio-token"
        token.write_text(
            mint_token(
                self.control_dir, account=(spec.namespace, sa), node=spec.node, pod=spec.name, uid=pod.uid
            )
        )
        token.chmod(0o600)
        argv = [
            self.config.python, "-m", "ambient_mesh.cli", "waypoint",
            "--pod-name", spec.name, "--namespace", spec.namespace, "--pod-ip", str(pod.net.ip),
            "--service-account", sa, "--gateway", spec.labels.get(LABEL_GATEWAY_NAME, sa),
            "--xds-address", f"https://{self.control_address}",
            "--root-cert", str(self.control_dir / "root-cert.pem"), "--token", str(token),
            "--alt-hostname", ISTIOD_HOSTNAME, "--run-dir", str(run_dir),
        ]  # fmt: skip
        pod.app = self._spawn(
            f"app-{spec.namespace}-{spec.name}",
            pod.net.netns,
            argv,
            {},
            restart=lambda: self._start_waypoint(pod),
        )
        return pod.app

    def _cni_add_with_retries(self, pod: LabPod) -> None:
        """kubelet's sandbox retry: a failed ADD (the agent not ready, no node proxy connected yet:
        istio-cni fails closed) is undone with DEL and tried again, with backoff, until the deadline."""
        runtime = self.nodes[pod.spec.node].runtime
        args = {"namespace": pod.spec.namespace, "name": pod.spec.name, "uid": pod.uid}
        deadline = time.monotonic() + self.config.ready_timeout_s
        backoff_s = SANDBOX_RETRY_FIRST_S
        while True:
            try:
                runtime.add(pod.net, **args)
                return
            except CniCallError:
                if time.monotonic() + backoff_s > deadline:
                    raise
            with contextlib.suppress(CniCallError):
                runtime.delete(pod.net, **args)
            time.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, SANDBOX_RETRY_MAX_S)

    def _waypoint_ready(self, pod: LabPod, app: Program) -> bool:
        if not app.running:
            raise AmbientError(f"waypoint pod {pod.spec.key} exited:\n{app.tail()}")
        try:
            status, _ = http_get(pod.netns, "127.0.0.1", READINESS_PORT, "/healthz/ready", timeout_s=2.0)
        except (OSError, ValueError):
            return False
        return status == 200

    def reconcile_deployments(self) -> list[str]:
        """The lab's Deployment controller (deployments.py): a Pending Pod for each waypoint
        Deployment the control plane wrote, and the Pod deleted when its Deployment is. Returns
        what it did, one line each; the kubelet pass that follows runs the new Pods."""
        from collections import Counter

        from .deployments import DEPLOYMENT_LABEL
        from .deployments import plan as plan_deployments

        stamp = objects_stamp(self.objects_dir)
        if stamp == self._deployments_stamp:
            return []
        self._deployments_stamp = stamp
        deployments = _read_objects(self.objects_dir, "Deployment")
        controlled, others = {}, set()
        for doc in _read_objects(self.objects_dir, "Pod"):
            meta = doc.get("metadata") or {}
            key = f"{meta.get('namespace')}/{meta.get('name')}"
            owner = (meta.get("labels") or {}).get(DEPLOYMENT_LABEL)
            if owner:
                controlled[key] = str(owner)
            else:
                others.add(key)
        counts = Counter(pod.spec.node for pod in self.pods.values())
        deploy = plan_deployments(deployments, controlled, sorted(self.nodes), counts, frozenset(others))
        events = list(deploy.skipped)
        for spec in deploy.create:
            uid = pod_uid(self.lab_id, spec.namespace, spec.name)
            write_objects(self.objects_dir, [pod_object(spec, uid=uid, ip=None)])
            events.append(f"deployment: pod {spec.key} created on {spec.node}")
        for key in deploy.delete:
            namespace, _, name = key.partition("/")
            remove_object(self.objects_dir, "Pod", namespace, name)
            events.append(f"deployment: pod {key} deleted (its Deployment is gone)")
        return events

    def reconcile_pods(self) -> list[str]:
        """The kubelet's pod sync for objects changed while the lab runs (`ambient lab apply` or
        `delete` of a Pod): a Pod on one of the lab's nodes without a sandbox gets one, a lab pod
        whose object is gone is torn down. Returns what it did, one line each."""
        from .topofile import pod_spec_from_object

        # Stamped before reading, and only then: a write that lands while this pass runs (an
        # `apply` whose atomic_write was still a temp file when the pass listed the directory)
        # changes the stamp, so the next pass sees it. Stamping again at the end, to absorb the
        # pass's own writes, absorbed that one too and the Pod was never started. The pass's own
        # writes cost one more pass, which finds nothing to do.
        stamp = objects_stamp(self.objects_dir)
        if stamp == self._pods_stamp:
            return []
        self._pods_stamp = stamp
        present: dict[str, tuple[Path, dict[str, Any]]] = {}
        for path in sorted(self.objects_dir.glob("pod-*.yaml")):
            try:
                doc = yaml.safe_load(path.read_text())
            except (OSError, yaml.YAMLError):
                continue
            meta = doc.get("metadata") if isinstance(doc, dict) else None
            if (
                not isinstance(meta, dict)
                or doc.get("kind") != "Pod"
                or meta.get("namespace") == SYSTEM_NAMESPACE
            ):
                continue
            present[f"{meta.get('namespace')}/{meta.get('name')}"] = (path, doc)
        events = []
        for key, (path, doc) in present.items():
            if key in self.pods or (doc.get("status") or {}).get("podIP"):
                continue
            try:
                spec = pod_spec_from_object(doc, str(path))
                if spec.node not in self.nodes:
                    raise ConfigError(
                        str(path), f"Pod {key}: node {spec.node!r} is not one of {', '.join(self.nodes)}"
                    )
                self.add_pod(spec, wait=False)
                events.append(f"pod {key} started on {spec.node} ({self.pods[key].ip})")
            except AmbientError as e:
                events.append(f"pod {key} not started: {e}")
        for key in [k for k in self.pods if k not in present]:
            self.delete_pod(key)
            events.append(f"pod {key} deleted")
        return events

    def delete_pod(self, key: str) -> None:
        """The API DELETE, then what kubelet does: stop the app, CNI DEL, remove the sandbox."""
        pod = self.pods.pop(key)
        remove_object(self.objects_dir, "Pod", pod.spec.namespace, pod.spec.name)
        if pod.app is not None:
            self._stop(pod.app, PROCESS_STOP_GRACE_S)
        node = self.nodes[pod.spec.node]
        with contextlib.suppress(AmbientError):  # a runtime tears the sandbox down even if DEL fails
            node.runtime.delete(pod.net, namespace=pod.spec.namespace, name=pod.spec.name, uid=pod.uid)
        self.topology.remove_pod(key)
        self.write_state()

    # -- what is going on --------------------------------------------------------------------------

    def enrollment(self, node: str) -> dict[str, str]:
        """The agent's enrollment marks on `node` (uid -> `enabled`/`pending`): our stand-in for
        the pods' `ambient.istio.io/redirection` annotation."""
        try:
            doc = json.loads((self.nodes[node].run_dir / "enrolled-pods.json").read_text())
        except (OSError, ValueError):
            return {}
        return {uid: m.get("value", "") for uid, m in doc.get("pods", {}).items()}

    def enrolled(self, key: str) -> bool:
        pod = self.pods[key]
        return self.enrollment(pod.spec.node).get(pod.uid) == "enabled"

    def proxied(self, key: str) -> bool:
        """Whether a node proxy listens inside the pod (its HBONE port 15008 is bound there)."""
        return HBONE_PORT in listening_ports(self.runner, self.pods[key].netns)

    def exec(
        self, key: str, argv: Sequence[str], *, input: bytes | None = None, check: bool = True
    ) -> CompletedCommand:
        """Run a command inside a pod's network namespace (`kubectl exec`, network-wise)."""
        return self.runner.run(argv, input=input, netns=self.pods[key].netns, check=check)

    def node_exec(self, node: str, argv: Sequence[str], *, check: bool = True) -> CompletedCommand:
        return self.runner.run(argv, netns=self.nodes[node].net.netns, check=check)

    def proxy_get(self, node: str, port: int, path: str) -> tuple[int, str]:
        """GET one of a node proxy's endpoints (admin 15000, stats 15020, readiness 15021)."""
        n = self.nodes[node]
        return http_get(n.net.netns, "127.0.0.1", n.proxy_port(port), path)

    def proxy_log(self, node: str, since: int = 0) -> str:
        """The current node proxy's output on `node`, from byte offset `since` (or from its start)."""
        proxy = self.nodes[node].proxy
        if proxy is None:
            return ""
        with open(proxy.log, "rb") as f:
            f.seek(max(since, proxy.log_start))
            return f.read().decode(errors="replace")

    def proxy_log_offset(self, node: str) -> int:
        proxy = self.nodes[node].proxy
        return proxy.log.stat().st_size if proxy is not None else 0

    def access_log(self, node: str, since: int = 0) -> list[dict[str, str]]:
        return access_events(self.proxy_log(node, since))

    def app_peers(self, key: str) -> list[str]:
        """Source addresses of every connection a pod's app accepted (from its `accepted` lines)."""
        pod = self.pods[key]
        text = pod.app.tail(chars=10**7) if pod.app is not None else ""
        return [line.split()[1] for line in text.splitlines() if line.startswith("accepted ")]

    def record(self) -> dict[str, Any]:
        """The lab's layout, processes and restarts, as lab.json keeps them for other shells
        (status.py adds what is live: process alive, readiness, enrollment, services)."""

        def program(p: Program | None) -> dict[str, Any] | None:
            if p is None:
                return None
            backoff = self.backoff(p.name)
            return {
                "name": p.name,
                "pid": p.process.pid,
                "start": process_start_ticks(p.process.pid),
                "exit": p.process.poll(),
                "log": str(p.log),
                "restarts": self.restarts.get(p.name, 0),
                "backoff_s": None if backoff is None else round(backoff, 1),
            }

        nodes = {}
        for name, node in self.nodes.items():
            nodes[name] = {
                "netns": node.net.netns,
                "address": str(node.net.uplink_ip),
                "pod_cidr": str(node.net.pod_cidr),
                "host_address": str(node.net.pod_gateway),
                "run_dir": str(node.run_dir),
                "admin": f"127.0.0.1:{node.proxy_port(ADMIN_PORT)}",
                "stats": f"{node.net.uplink_ip}:{node.proxy_port(STATS_PORT)}",
                "readiness": f"127.0.0.1:{node.proxy_port(READINESS_PORT)}",
                "agent": program(node.agent),
                "ztunnel": program(node.proxy),
                "ztunnel_draining": [program(p) for p, _ in self._draining if p.name == f"ztunnel-{name}"],
            }
        pods = {}
        for key, pod in self.pods.items():
            pods[key] = {
                "namespace": pod.spec.namespace,
                "name": pod.spec.name,
                "node": pod.spec.node,
                "ip": pod.ip,
                "netns": pod.netns,
                "uid": pod.uid,
                "service_account": pod.spec.sa,
                "labels": dict(pod.spec.labels),
                "app": program(pod.app),
            }
        return {
            "lab": self.lab_id,
            "pid": os.getpid(),
            "ready": self.ready,
            "state_dir": str(self.state_dir),
            "objects_dir": str(self.objects_dir),
            "control": {
                "address": self.control_address,
                "netns": self.topology.network_netns,
                "process": program(self.control),
            },
            "dns": {"address": f"{self.topology.gateway}:{DNS_PORT}", "process": program(self.dns)},
            "nodes": nodes,
            "pods": pods,
        }

    def status(self) -> dict[str, Any]:
        """The live view `ambient lab status` prints (status.py)."""
        from .status import live_status

        return live_status(self.record(), self.runner)

    def write_state(self) -> None:
        atomic_write(self.state_dir / STATE_FILE, json.dumps(self.record(), indent=2).encode())
