"""The node agent's end of the CNI plugin: HTTP/1.1 over unix sockets in the run dir.

Counterpart of istio-cni's CNIPluginServer (cni/pkg/nodeagent/cni-watcher.go) and its UDS log
server (cni/pkg/log/uds.go); facts from docs/istio-behaviour.md, "CNI plugin".

- `<run dir>/pluginevent.sock`, `POST /cmdadd`: the plugin's add event (Go-shaped JSON, decoded
  by cniconf.decode_add_event). 400 when the body is not an event; 500 with the reason when the
  pod is unknown after 10 lookups 10 ms apart (the watch may lag the runtime), when it is
  unexpectedly not eligible, or when enrolling it fails; 200 with an empty body once the pod is
  in the mesh. The CNI-provided IPs are used over the pod's status IPs (Kubernetes does not
  know them yet), and the CNI-provided netns path is opened (under HOST_PREFIX).
- `<run dir>/log.sock`, `POST /log`: a JSON array of JSON-object strings, the plugin's log lines,
  re-emitted under the `cni-plugin` scope.
- `<run dir>/pluginrun.sock` (ours): whole plugin runs handed over by the plugin's entry
  (plugin_handoff.py says the exchange). The plugin's own code runs them, in a thread, with the
  agent's pod cache as its pod lookup and this server's `/cmdadd` as its event socket, so the
  outcome is the one the plugin would reach by itself. Bounded: request size, read time, and at
  most MAX_CONCURRENT_PLUGIN_RUNS at once; a run over that or a bad request is closed without a
  reply, and the plugin then runs by itself.

Sockets: the run dir is root's alone (created 0700, checked at every start: owned by root and
writable by nobody else), a stale socket is removed, each socket is made 0600, and every
connection's peer must be root (SO_PEERCRED) before a byte of its request is read: the container
runtime runs the plugin as root, and any other local user could otherwise name pods and network
namespaces to the agent. On a plugin run, whether CNI_NETNS is the caller's own namespace is
decided from the caller's pid, not from its request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any, TypeVar

from ..errors import AmbientError, ProtocolError
from ..host.private import SOCKET_FILE_MODE, peer_credentials, peer_refusal, private_dir
from ..http1 import ClientResponse, Request, Response
from ..http1.server import serve_connection
from .cniconf import CNI_ADD_EVENT_PATH, UDS_LOG_PATH, CniAddEvent, decode_add_event
from .dataplane import DataplaneError, MeshDataplane
from .informer import Enablement
from .plugin import Outcome, Plugin
from .plugin_basics import DELEGATED_ENV_PREFIX, MAX_PLUGIN_STDIN_BYTES
from .podinfo import API_LOOKUP_TIMEOUT_S, NamespaceInfo, PodInfo, PodLookupError
from .pods import PodSource, PodSourceError, WatchedPod
from .sandbox import NetnsGuard

log = logging.getLogger("ambient_mesh.cni-agent")
T = TypeVar("T")
plugin_log = logging.getLogger("ambient_mesh.cni-plugin")

POD_LOOKUP_ATTEMPTS = 10
POD_LOOKUP_INTERVAL_S = 0.01
REQUEST_READ_TIMEOUT_S = 10.0
# Plugin log batches can exceed the admin servers' body limit.
MAX_LOG_BODY_BYTES = 4 * 1024 * 1024
# A run's request: the config (bounded as the plugin bounds its stdin) plus the CNI_* variables.
MAX_PLUGIN_RUN_REQUEST_BYTES = MAX_PLUGIN_STDIN_BYTES + 64 * 1024
MAX_PLUGIN_RUN_ENV_VARS = 32
# Runs in flight at once (each holds a thread while it looks a pod up or waits for /cmdadd);
# the kubelet starts a node's sandboxes a few at a time.
MAX_CONCURRENT_PLUGIN_RUNS = 8

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}

AddHandler = Callable[[CniAddEvent], Awaitable[str | None]]


class CniAddHandler:
    """Turns one add event into AddPodToMesh; returns None on success, else the 500 reason."""

    def __init__(
        self,
        source: PodSource,
        dataplane: MeshDataplane,
        enablement: Enablement,
        *,
        attempts: int = POD_LOOKUP_ATTEMPTS,
        interval_s: float = POD_LOOKUP_INTERVAL_S,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        self.source = source
        self.dataplane = dataplane
        self.enablement = enablement
        self.attempts = attempts
        self.interval_s = interval_s
        self._sleep = sleep

    def __repr__(self) -> str:
        return f"CniAddHandler({self.attempts} lookups x {self.interval_s * 1000:g} ms)"

    async def _lookup(self, namespace: str, name: str) -> WatchedPod | None:
        for attempt in range(self.attempts):
            pod = self.source.pod(namespace, name)
            if pod is None:
                with contextlib.suppress(PodSourceError):
                    pod = await self.source.fetch_pod(namespace, name)
            if pod is not None:
                return pod
            if attempt + 1 < self.attempts:
                await self._sleep(self.interval_s)
        return None

    async def __call__(self, event: CniAddEvent) -> str | None:
        pod = await self._lookup(event.pod_namespace, event.pod_name)
        if pod is None:
            return (
                f"failed to find pod {event.pod_namespace}/{event.pod_name} in the agent's pod source "
                f"after {self.attempts} attempts"
            )
        ns = self.source.namespace(pod.namespace)
        if not self.enablement.should_be_enrolled(pod, ns.labels if ns is not None else {}):
            return f"pod {pod} is unexpectedly not eligible for the ambient mesh"
        ips = [ip.address for ip in event.ips] if event.ips else list(pod.ips)
        try:
            await self.dataplane.add_pod_to_mesh(pod, ips, event.netns)
        except DataplaneError as exc:
            return str(exc)
        return None


def emit_plugin_lines(body: bytes) -> int:
    """Re-emit the plugin's log lines; ProtocolError when the body is not a list of strings."""
    try:
        lines = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"log body is not JSON: {exc}") from None
    if not isinstance(lines, list) or not all(isinstance(line, str) for line in lines):
        raise ProtocolError("log body must be a JSON array of strings")
    emit_plugin_records(lines)
    return len(lines)


def emit_plugin_records(lines: list[str]) -> None:
    """Log each of the plugin's JSON-object lines under the `cni-plugin` scope."""
    for line in lines:
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            record = {"msg": line}
        if not isinstance(record, dict):
            record = {"msg": line}
        level = _LEVELS.get(str(record.get("level", "info")).lower(), logging.INFO)
        fields = {k: v for k, v in record.items() if k not in ("level", "msg", "time")}
        plugin_log.log(level, "%s", record.get("msg", ""), extra={"fields": fields} if fields else None)


# -- plugin runs handed over by the plugin's entry ----------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class PluginRunRequest:
    environ: Mapping[str, str]
    stdin: bytes
    netns_is_own: bool


def decode_plugin_run(data: bytes) -> PluginRunRequest:
    """The plugin handoff's request (plugin_handoff.encode_request); ProtocolError otherwise."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"plugin run request is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ProtocolError("plugin run request must be a JSON object")
    env, stdin, own = doc.get("env"), doc.get("stdin"), doc.get("netns_is_own")
    if not isinstance(env, dict) or len(env) > MAX_PLUGIN_RUN_ENV_VARS:
        raise ProtocolError(
            f"plugin run request: env must be an object of at most {MAX_PLUGIN_RUN_ENV_VARS} names"
        )
    for key, value in env.items():
        if not key.startswith(DELEGATED_ENV_PREFIX) or not isinstance(value, str):
            raise ProtocolError(f"plugin run request: env may hold only CNI_* strings, not {key!r}")
    if not isinstance(stdin, str) or not isinstance(own, bool):
        raise ProtocolError("plugin run request: stdin must be a string and netns_is_own a boolean")
    return PluginRunRequest(environ=env, stdin=stdin.encode("utf-8"), netns_is_own=own)


def encode_outcome(outcome: Outcome) -> bytes:
    """The reply plugin_handoff.decode_reply reads."""
    reply = {
        "exit_code": outcome.exit_code,
        "stdout": outcome.stdout.decode("utf-8", "replace"),
        "stderr": outcome.stderr.decode("utf-8", "replace"),
    }
    return json.dumps(reply).encode("utf-8")


def run_on_loop(coro: Coroutine[Any, Any, T], loop: asyncio.AbstractEventLoop, timeout_s: float) -> T:
    """`coro`'s result, run on the agent's loop from a plugin run's thread; TimeoutError (the
    coroutine cancelled) when it takes longer than `timeout_s`."""
    future = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return future.result(timeout_s)
    except TimeoutError:
        future.cancel()
        raise


class AgentPodLookup:
    """The plugin's `PodLookup` over the agent's pod cache, for a run in a worker thread: a pod the
    watch has not delivered yet is fetched from the source on the agent's loop."""

    __slots__ = ("source", "loop")

    def __init__(self, source: PodSource, loop: asyncio.AbstractEventLoop) -> None:
        self.source = source
        self.loop = loop

    def __repr__(self) -> str:
        return f"AgentPodLookup({self.source!r})"

    def get_pod(self, namespace: str, name: str) -> PodInfo | None:
        pod = self.source.pod(namespace, name)
        if pod is None:
            try:
                pod = run_on_loop(self.source.fetch_pod(namespace, name), self.loop, API_LOOKUP_TIMEOUT_S)
            except TimeoutError:
                raise PodLookupError(
                    f"the agent's pod source did not return pod {namespace}/{name} within "
                    f"{API_LOOKUP_TIMEOUT_S:g}s"
                ) from None
        return None if pod is None else pod.info

    def get_namespace(self, name: str) -> NamespaceInfo | None:
        return self.source.namespace(name)


class InProcessTransport:
    """The plugin's `AgentTransport` for a run in a worker thread: its POST goes to this agent's
    own handler on the agent's loop instead of over the event socket."""

    __slots__ = ("server", "loop")

    def __init__(self, server: CniPluginServer, loop: asyncio.AbstractEventLoop) -> None:
        self.server = server
        self.loop = loop

    def __repr__(self) -> str:
        return f"InProcessTransport({self.server.event_socket})"

    def post(self, path: str, body: bytes, *, timeout_s: float) -> ClientResponse:
        request = Request(method="POST", target=path, path=path, body=body)
        try:
            response = run_on_loop(self.server.handle(request), self.loop, timeout_s)
        except TimeoutError:
            raise TimeoutError(f"the agent's add handler did not answer within {timeout_s:g}s") from None
        return ClientResponse(status=int(response.status), body=response.body)


class CniPluginServer:
    """Serves `/cmdadd` on the event socket and `/log` on the log socket."""

    def __init__(
        self,
        event_socket: str | Path,
        log_socket: str | Path | None,
        on_add: AddHandler,
        *,
        on_response: Callable[[int], None] | None = None,
        run_socket: str | Path | None = None,
        pods: PodSource | None = None,
        netns_guard: NetnsGuard | None = None,
    ) -> None:
        self.event_socket = Path(event_socket)
        self.netns_guard = netns_guard if netns_guard is not None else NetnsGuard()
        self.log_socket = Path(log_socket) if log_socket is not None else None
        # Plugin runs are served only with a pod cache to run them against.
        self.run_socket = Path(run_socket) if run_socket is not None and pods is not None else None
        self.pods = pods
        self._on_add = on_add
        self._on_response = on_response
        self._servers: list[asyncio.AbstractServer] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._runs: concurrent.futures.ThreadPoolExecutor | None = None
        self._runs_active = 0
        # Set at stop: a run's retry sleep in its thread then returns at once (its lookups and
        # its add then fail with the loop gone, and the run ends with an error object).
        self._stopping = threading.Event()
        self.requests = 0
        self.log_lines = 0
        self.plugin_runs = 0
        self.plugin_runs_refused = 0
        self.refused_peers = 0  # connections closed unread: the peer was not root

    def __repr__(self) -> str:
        state = "listening" if self._servers else "stopped"
        return f"CniPluginServer({self.event_socket}, {state}, {self.requests} requests, {len(self._tasks)} active)"

    async def start(self) -> None:
        sockets: list[tuple[Path, Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]]]
        sockets = [(self.event_socket, self._serve)]
        if self.log_socket is not None:
            sockets.append((self.log_socket, self._serve))
        if self.run_socket is not None:
            self._stopping.clear()
            self._runs = concurrent.futures.ThreadPoolExecutor(
                MAX_CONCURRENT_PLUGIN_RUNS, thread_name_prefix="plugin-run"
            )
            sockets.append((self.run_socket, self._serve_run))
        for path, serve in sockets:
            private_dir(path.parent)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # a previous agent's
            server = await asyncio.start_unix_server(serve, path=str(path))
            os.chmod(path, SOCKET_FILE_MODE)
            self._servers.append(server)
            log.info("CNI plugin server listening on %s", path)

    async def stop(self) -> None:
        servers, self._servers = self._servers, []
        for server in servers:
            server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for server in servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()
        for path in (self.event_socket, self.log_socket, self.run_socket):
            if path is not None:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        if self._runs is not None:
            self._stopping.set()
            self._runs.shutdown(wait=False, cancel_futures=True)
            self._runs = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            if self._refuse_peer(writer) is not None:
                return
            if await serve_connection(
                "CNI plugin",
                self.handle,
                reader,
                writer,
                read_timeout_s=REQUEST_READ_TIMEOUT_S,
                max_body_bytes=MAX_LOG_BODY_BYTES,
            ):
                self.requests += 1
        finally:
            self._tasks.discard(task)

    async def _serve_run(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            peer = self._refuse_peer(writer)
            if peer is not None:
                return
            if self._runs is None or self._runs_active >= MAX_CONCURRENT_PLUGIN_RUNS:
                self.plugin_runs_refused += 1
                log.warning(
                    "plugin run refused: %d runs in flight (the plugin runs by itself)", self._runs_active
                )
                return
            self._runs_active += 1
            try:
                reply = await self._run(reader, peer_credentials(writer.get_extra_info("socket")).pid)
            finally:
                self._runs_active -= 1
            if reply is not None:
                writer.write(reply)
                await writer.drain()
        except OSError as exc:  # the plugin went away, or the reply could not be written
            log.warning("plugin run connection failed: %s", exc)
        finally:
            self._tasks.discard(task)
            writer.close()

    def _refuse_peer(self, writer: asyncio.StreamWriter) -> str | None:
        """Why this connection's peer may not talk to the agent (it is then closed unread)."""
        refusal = peer_refusal(writer.get_extra_info("socket"))
        if refusal is not None:
            self.refused_peers += 1
            log.warning("CNI plugin connection refused: %s", refusal)
            writer.close()
        return refusal

    async def _run(self, reader: asyncio.StreamReader, peer_pid: int) -> bytes | None:
        try:
            async with asyncio.timeout(REQUEST_READ_TIMEOUT_S):
                data = await reader.read(MAX_PLUGIN_RUN_REQUEST_BYTES + 1)
                while len(data) <= MAX_PLUGIN_RUN_REQUEST_BYTES and not reader.at_eof():
                    data += await reader.read(MAX_PLUGIN_RUN_REQUEST_BYTES + 1 - len(data))
            if len(data) > MAX_PLUGIN_RUN_REQUEST_BYTES:
                raise ProtocolError(f"plugin run request is larger than {MAX_PLUGIN_RUN_REQUEST_BYTES} bytes")
            request = decode_plugin_run(data)
        except TimeoutError:
            log.warning("plugin run request not complete within %gs", REQUEST_READ_TIMEOUT_S)
            return None
        except ProtocolError as exc:
            log.warning("plugin run request rejected: %s", exc)
            return None
        pods = self.pods
        assert self._runs is not None and pods is not None
        loop = asyncio.get_running_loop()
        plugin = Plugin(
            lookup_factory=lambda _conf: AgentPodLookup(pods, loop),
            transport_factory=lambda _path: InProcessTransport(self, loop),
            # The request's netns_is_own is the caller's word; the kernel's pid of it is checked too.
            same_netns=lambda path: request.netns_is_own or self.netns_guard.is_callers(path, peer_pid),
            sleep=self._stopping.wait,
        )
        outcome = await loop.run_in_executor(self._runs, plugin.run, request.environ, request.stdin)
        self.plugin_runs += 1
        log.info(
            "plugin run handed over: %s of container %s, exit %d",
            request.environ.get("CNI_COMMAND", "?"),
            request.environ.get("CNI_CONTAINERID", "?"),
            outcome.exit_code,
        )
        level = outcome.conf.plugin_log_level if outcome.conf is not None else "info"
        emit_plugin_records(plugin.log.lines(level))
        return encode_outcome(outcome)

    async def handle(self, request: Request) -> Response:
        if request.path == UDS_LOG_PATH:
            if request.method != "POST":
                return Response.text(HTTPStatus.METHOD_NOT_ALLOWED, "use POST\n")
            try:
                self.log_lines += emit_plugin_lines(request.body)
            except ProtocolError as exc:
                return Response.text(HTTPStatus.BAD_REQUEST, f"{exc.message}\n")
            return Response(status=HTTPStatus.OK)
        if request.path != CNI_ADD_EVENT_PATH:
            return Response.text(HTTPStatus.NOT_FOUND, f"no handler for {request.path}\n")
        if request.method != "POST":
            return Response.text(HTTPStatus.METHOD_NOT_ALLOWED, "use POST\n")
        response = await self._cmdadd(request.body)
        if self._on_response is not None:
            self._on_response(response.status)
        return response

    async def _cmdadd(self, body: bytes) -> Response:
        try:
            event = decode_add_event(body)
        except ProtocolError as exc:
            log.warning("CNI add event rejected: %s", exc)
            return Response.text(HTTPStatus.BAD_REQUEST, f"{exc.message}\n")
        if not event.pod_name or not event.pod_namespace:
            return Response.text(HTTPStatus.BAD_REQUEST, "PodName and PodNamespace are required\n")
        log.info("CNI add event for %s/%s, netns %s", event.pod_namespace, event.pod_name, event.netns)
        try:
            error = await self._on_add(event)
        except asyncio.CancelledError:
            raise
        except AmbientError as exc:
            error = str(exc)
        except Exception as exc:  # crash barrier: the plugin gets a 500 with the reason, never a hang
            log.exception("CNI add of %s/%s failed unexpectedly", event.pod_namespace, event.pod_name)
            error = f"{type(exc).__name__}: {exc}"
        if error:
            log.error("CNI add of %s/%s failed: %s", event.pod_namespace, event.pod_name, error)
            return Response.text(HTTPStatus.INTERNAL_SERVER_ERROR, f"{error}\n")
        return Response(status=HTTPStatus.OK)


__all__ = ["AgentPodLookup", "CniAddHandler", "CniPluginServer", "InProcessTransport", "emit_plugin_lines"]
