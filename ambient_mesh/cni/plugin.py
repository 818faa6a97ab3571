"""The chained CNI plugin (`ambient cni-plugin`, installed as `istio-cni`).

Counterpart of istio-cni's cni/cmd/istio-cni and cni/pkg/plugin (ambient path only). A container
runtime runs it last in the pod network's chain with the config on stdin and CNI_* in the
environment. On ADD it decides whether the pod is ambient (enablement.py, from the pod and
namespace a `PodLookup` returns) and, if so, POSTs the pod's netns path and IPs to the node agent
over `<cni_agent_run_dir>/pluginevent.sock` and waits for 200. Every failure for a pod that is or
might be ambient fails the ADD (fail closed: the runtime tears the sandbox down and kubelet
retries), so no pod starts outside the mesh by accident. DEL and CHECK do nothing: pod removal is
the agent's job, driven by its pod watch.

stdout carries only the CNI result or error object. Log lines are kept in memory and, when the
run ends, POSTed to the agent's `<run dir>/log.sock` (`/log`, a JSON array of JSON-object
strings); without that socket they go to stderr, and only at `plugin_log_level: debug`.

The executable's entry is plugin_handoff.py: it hands the run to the node agent, which runs this
module's `Plugin` over its pod cache (cni_server.py). This module runs in the plugin's own process
only when the agent does not answer. Even then imports stay few: no asyncio, no logging, no HTTP
library (the requests are written by hand), and YAML only when a pod must be looked up in a
directory; `ssl` only when the API server is asked.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from .. import __version__
from ..errors import AmbientError, ConfigError, ProtocolError
from ..http1 import MAX_ERROR_BODY_BYTES, ClientResponse, deadline, exchange, render_request
from .cniconf import (
    AGENT_POD_NAME_PREFIX,
    CNI_ADD_EVENT_PATH,
    CNI_ADD_TIMEOUT_S,
    CURRENT_VERSION,
    LOG_UDS_TIMEOUT_S,
    PLUGIN_TYPE,
    SUPPORTED_VERSIONS,
    UDS_LOG_PATH,
    CniAddEvent,
    CniEnv,
    CniError,
    ErrorCode,
    K8sArgs,
    PluginConf,
    encode_add_event,
    parse_cni_args,
    parse_env,
    parse_plugin_conf,
    render_error,
    render_result,
    render_version,
    validate_container_id,
    validate_interface_name,
    version_tuple,
)
from .enablement import AmbientDecision, could_be_ambient, decide
from .plugin_basics import MAX_PLUGIN_STDIN_BYTES, netns_is_own
from .podinfo import (
    PLUGIN_KUBECONFIG_NAME,
    DirectoryPodLookup,
    KubeApiPodLookup,
    PodLookup,
    PodLookupError,
)

# istio-cni retries pod detection once at 1 s, or 30 times with enable_ambient_detection_retry.
DETECTION_ATTEMPTS = 2
DETECTION_ATTEMPTS_WITH_RETRY = 30
DETECTION_INTERVAL_S = 1.0
ABOUT = f"CNI plugin {PLUGIN_TYPE} (ambient-mesh {__version__})"


# -- HTTP/1.1 over a unix socket (the bytes are ambient_mesh.http1's) ----------------------------


class AgentTransport(Protocol):
    """POSTs one request to the node agent; raises OSError (refused, missing socket, timeout) or
    ProtocolError (a reply that is not HTTP)."""

    def post(self, path: str, body: bytes, *, timeout_s: float) -> ClientResponse: ...


class UnixHttpTransport:
    """HTTP/1.1 over one AF_UNIX stream connection per request."""

    __slots__ = ("socket_path",)

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path

    def __repr__(self) -> str:
        return f"UnixHttpTransport({self.socket_path!r})"

    def post(self, path: str, body: bytes, *, timeout_s: float) -> ClientResponse:
        remaining = deadline(timeout_s, f"the node agent at {self.socket_path}")
        request = render_request(
            "POST",
            path,
            headers=(("User-Agent", PLUGIN_TYPE), ("Content-Type", "application/json")),
            body=body,
        )
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(remaining())
            sock.connect(self.socket_path)
            return exchange(sock, request, remaining)


# -- logging ----------------------------------------------------------------------------------------

_LEVEL_ORDER = {"debug": 0, "info": 1, "warn": 2, "error": 3, "none": 4}


def _iso_time(t: float) -> str:
    whole = int(t)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{int((t - whole) * 1e6):06d}Z"


class PluginLog:
    """The log records of one plugin run, held until the run ends (the agent re-emits them
    under its `cni-plugin` scope)."""

    __slots__ = ("records", "_clock")

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.records: list[tuple[str, dict[str, Any]]] = []
        self._clock = clock

    def __repr__(self) -> str:
        return f"PluginLog({len(self.records)} records)"

    def log(self, level: str, msg: str, **fields: Any) -> None:
        self.records.append((level, {"level": level, "time": _iso_time(self._clock()), "msg": msg, **fields}))

    def debug(self, msg: str, **fields: Any) -> None:
        self.log("debug", msg, **fields)

    def info(self, msg: str, **fields: Any) -> None:
        self.log("info", msg, **fields)

    def warn(self, msg: str, **fields: Any) -> None:
        self.log("warn", msg, **fields)

    def error(self, msg: str, **fields: Any) -> None:
        self.log("error", msg, **fields)

    def lines(self, level: str = "debug") -> list[str]:
        floor = _LEVEL_ORDER.get(level, 1)
        return [json.dumps(rec, default=str) for lvl, rec in self.records if _LEVEL_ORDER[lvl] >= floor]


# -- the plugin -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """What one run prints and how it exits."""

    exit_code: int
    stdout: bytes = b""
    stderr: bytes = b""
    conf: PluginConf | None = None


LookupFactory = Callable[[PluginConf], PodLookup]
TransportFactory = Callable[[str], AgentTransport]


def default_lookup(conf: PluginConf) -> PodLookup:
    """Where this run reads pods: the lab's YAML directory when the entry names one
    (`ambient_pod_source.directory`, ours); else the API server, with the kubeconfig named by
    `kubernetes.kubeconfig` (istio-cni's key up to 1.23) or, as istio-cni does since 1.24,
    `<cni_agent_run_dir>/istio-cni-kubeconfig`, which the node agent writes."""
    if conf.pod_source_directory:
        return DirectoryPodLookup(conf.pod_source_directory)
    kubeconfig = conf.kubeconfig or (f"{conf.cni_agent_run_dir.rstrip('/')}/{PLUGIN_KUBECONFIG_NAME}")
    return KubeApiPodLookup(kubeconfig)


def _peek_version(stdin: bytes) -> str:
    try:
        version = json.loads(stdin).get("cniVersion")
    except Exception:  # any garbage: the error object then uses our own version
        return CURRENT_VERSION
    return version if isinstance(version, str) and version in SUPPORTED_VERSIONS else CURRENT_VERSION


class Plugin:
    """One plugin invocation: `run(environ, stdin) -> Outcome`, then `flush_log(outcome)`."""

    __slots__ = ("log", "_lookup_factory", "_transport_factory", "_sleep", "_same_netns")

    def __init__(
        self,
        *,
        lookup_factory: LookupFactory = default_lookup,
        transport_factory: TransportFactory = UnixHttpTransport,
        sleep: Callable[[float], object] = time.sleep,
        same_netns: Callable[[str], bool] = netns_is_own,
        log: PluginLog | None = None,
    ) -> None:
        self.log = log if log is not None else PluginLog()
        self._lookup_factory = lookup_factory
        self._transport_factory = transport_factory
        self._sleep = sleep
        self._same_netns = same_netns

    def __repr__(self) -> str:
        return f"Plugin({self.log!r})"

    def run(self, environ: Mapping[str, str], stdin: bytes) -> Outcome:
        conf: PluginConf | None = None
        try:
            if not environ.get("CNI_COMMAND"):
                # skel prints what it is when run by hand, and succeeds.
                about = f"{ABOUT}\nCNI protocol versions supported: {', '.join(SUPPORTED_VERSIONS)}\n"
                return Outcome(exit_code=0, stderr=about.encode())
            command = environ["CNI_COMMAND"]
            if command == "DEL":
                return self._delete(environ, stdin)
            env = parse_env(environ)
            if env.command == "VERSION":
                return Outcome(exit_code=0, stdout=render_version())
            if len(stdin) > MAX_PLUGIN_STDIN_BYTES:
                raise CniError(
                    ErrorCode.INVALID_NETWORK_CONFIG,
                    "invalid network config",
                    f"the config on stdin is larger than {MAX_PLUGIN_STDIN_BYTES} bytes",
                )
            conf = parse_plugin_conf(stdin)
            if env.command in ("ADD", "CHECK"):
                validate_container_id(env.container_id)
                validate_interface_name(env.ifname)
            if env.command == "ADD":
                return Outcome(exit_code=0, stdout=self._add(env, conf), conf=conf)
            minimum = "0.4.0" if env.command == "CHECK" else "1.1.0"
            if version_tuple(conf.cni_version) < version_tuple(minimum):
                raise CniError(
                    ErrorCode.INCOMPATIBLE_CNI_VERSION, f"config version does not allow {env.command}"
                )
            # CHECK, GC and STATUS: nothing of ours to verify or collect; the agent owns pod state.
            return Outcome(exit_code=0, conf=conf)
        except CniError as exc:
            return self._failure(exc, stdin, conf)
        except ConfigError as exc:
            return self._failure(
                CniError(ErrorCode.INVALID_NETWORK_CONFIG, "invalid network config", str(exc)), stdin, conf
            )
        except Exception as exc:  # crash barrier: the runtime gets an error object, never a traceback
            error = CniError(
                ErrorCode.INTERNAL, f"{PLUGIN_TYPE} failed unexpectedly", f"{type(exc).__name__}: {exc}"
            )
            return self._failure(error, stdin, conf)

    def _failure(self, exc: CniError, stdin: bytes, conf: PluginConf | None) -> Outcome:
        self.log.error(f"{PLUGIN_TYPE} error: {exc}")
        version = conf.cni_version if conf is not None else _peek_version(stdin)
        return Outcome(exit_code=1, stdout=render_error(exc, version), conf=conf)

    def _delete(self, environ: Mapping[str, str], stdin: bytes) -> Outcome:
        # DEL must succeed whatever it is given: the runtime retries a failed DEL forever, and
        # there is nothing of ours to undo (the agent's pod watch removes the pod).
        conf = None
        try:
            conf = parse_plugin_conf(stdin)
        except (AmbientError, ValueError) as exc:
            self.log.debug(f"DEL with a config we cannot read: {exc}")
        self.log.debug("DEL: nothing to do", container=environ.get("CNI_CONTAINERID", ""))
        return Outcome(exit_code=0, conf=conf)

    def _add(self, env: CniEnv, conf: PluginConf) -> bytes:
        k8s = parse_cni_args(env.args)
        pod = f"{k8s.pod_namespace}/{k8s.pod_name}"
        if (
            conf.ambient_enabled
            and k8s.pod_name.startswith(AGENT_POD_NAME_PREFIX)
            and k8s.pod_namespace == conf.pod_namespace
        ):
            # The agent's own pod must start even when we cannot look pods up (istio/istio#57438).
            self.log.info(f"{k8s.pod_name} looks like our own node agent pod, skipping", pod=pod)
            return render_result(conf)
        if not k8s.pod_name or not k8s.pod_namespace:
            self.log.debug("not a kubernetes pod", container=env.container_id)
            return render_result(conf)
        if k8s.pod_namespace in conf.exclude_namespaces:
            self.log.info("pod namespace excluded", pod=pod)
            return render_result(conf)
        if not conf.ambient_enabled:
            self.log.debug("ambient is not enabled; sidecar mode is not handled by this plugin", pod=pod)
            return render_result(conf)
        decision = self._detect(conf, k8s)
        self.log.debug(f"ambient: {decision.ambient} ({decision.reason})", pod=pod)
        if decision.ambient:
            if self._same_netns(env.netns):
                raise CniError(
                    ErrorCode.INVALID_NETNS,
                    "plugin's netns and netns from CNI_NETNS should not be the same",
                    env.netns,
                )
            self._push(conf, env, k8s)
            self.log.info("pod added to the ambient mesh by the node agent", pod=pod, netns=env.netns)
        return render_result(conf)

    def _detect(self, conf: PluginConf, k8s: K8sArgs) -> AmbientDecision:
        if not conf.enablement_selectors:
            return AmbientDecision(ambient=False, reason="no enablement selectors configured")
        attempts = (
            DETECTION_ATTEMPTS_WITH_RETRY if conf.enable_ambient_detection_retry else DETECTION_ATTEMPTS
        )
        problem = ""
        for attempt in range(attempts):
            if attempt:
                self._sleep(DETECTION_INTERVAL_S)
            try:
                lookup = self._lookup_factory(conf)
                namespace = lookup.get_namespace(k8s.pod_namespace)
                pod = lookup.get_pod(k8s.pod_namespace, k8s.pod_name)
            except PodLookupError as exc:
                problem = str(exc)
                self.log.warn(f"pod lookup failed (attempt {attempt + 1}/{attempts}): {exc}")
                continue
            ns_labels = None if namespace is None else namespace.labels
            if pod is None:
                if not could_be_ambient(
                    k8s.pod_namespace, ns_labels, conf.enablement_selectors, conf.exclude_namespaces
                ):
                    return AmbientDecision(
                        ambient=False, reason="pod unknown, and no selector can match its namespace"
                    )
                problem = f"pod {k8s.pod_namespace}/{k8s.pod_name} not found in the pod source"
                self.log.warn(f"{problem} (attempt {attempt + 1}/{attempts})")
                continue
            # A namespace with no object of its own has no labels (the YAML directory may omit it).
            return decide(pod, ns_labels or {}, conf.enablement_selectors, conf.exclude_namespaces)
        raise CniError(
            ErrorCode.TRY_AGAIN_LATER,
            f"{PLUGIN_TYPE} cmdAdd failed to decide whether the pod is ambient",
            problem,
            hint="the pod may be ambient, so it is not started outside the mesh",
        )

    def _push(self, conf: PluginConf, env: CniEnv, k8s: K8sArgs) -> None:
        event = CniAddEvent(
            netns=env.netns,
            pod_name=k8s.pod_name,
            pod_namespace=k8s.pod_namespace,
            ips=None if conf.prev_result is None else conf.prev_result.ips,
        )
        transport = self._transport_factory(conf.cni_event_socket)
        msg = f"{PLUGIN_TYPE} cmdAdd failed to contact node Istio CNI agent"
        try:
            response = transport.post(
                CNI_ADD_EVENT_PATH, encode_add_event(event), timeout_s=CNI_ADD_TIMEOUT_S
            )
        except (OSError, ProtocolError) as exc:
            raise CniError(
                ErrorCode.INTERNAL,
                msg,
                f"failed to send event request to {conf.cni_event_socket}: {exc}",
                hint="is the node agent (ambient cni-agent) running on this node?",
            ) from None
        if response.status != 200:
            text = response.body[:MAX_ERROR_BODY_BYTES].decode("utf-8", "replace").strip()
            raise CniError(
                ErrorCode.INTERNAL, msg, f"unable to push CNI event (status code {response.status}): {text}"
            )

    def flush_log(self, outcome: Outcome, stderr: Any = None) -> None:
        """Hand the run's log lines to the agent, or to stderr at debug level when it has no
        log socket. Never raises: logging must not change the outcome."""
        conf = outcome.conf
        level = conf.plugin_log_level if conf is not None else "info"
        lines = self.log.lines(level)
        if not lines:
            return
        if conf is not None and os.path.exists(conf.log_socket):
            try:
                self._transport_factory(conf.log_socket).post(
                    UDS_LOG_PATH, json.dumps(lines).encode("utf-8"), timeout_s=LOG_UDS_TIMEOUT_S
                )
                return
            except (OSError, ProtocolError):
                pass
        if level == "debug":
            out = stderr if stderr is not None else sys.stderr
            try:
                out.write("".join(line + "\n" for line in lines))
                out.flush()
            except (OSError, ValueError):
                pass


def main(stdin: bytes | None = None) -> int:
    """Run here; `stdin` when plugin_handoff has read it already."""
    environ = os.environ
    command = environ.get("CNI_COMMAND", "")
    if stdin is None:
        # VERSION's stdin is ignored (skel does the same); reading a terminal by hand would block.
        wanted = command and command != "VERSION"
        stdin = sys.stdin.buffer.read(MAX_PLUGIN_STDIN_BYTES + 1) if wanted else b""
    plugin = Plugin()
    outcome = plugin.run(environ, stdin)
    if outcome.stdout:
        sys.stdout.buffer.write(outcome.stdout)
        sys.stdout.buffer.flush()
    if outcome.stderr:
        sys.stderr.buffer.write(outcome.stderr)
        sys.stderr.buffer.flush()
    plugin.flush_log(outcome)
    return outcome.exit_code
