"""The node agent's end of the CNI plugin: HTTP/1.1 over unix sockets in the run dir.

Counterpart of istio-cni's CNIPluginServer (cni/pkg/nodeagent/cni-watcher.go) and its UDS log
server (cni/pkg/log/uds.go); facts from reference/istio-cni.md 2.1 and 2.5.

- `<run dir>/pluginevent.sock`, `POST /cmdadd`: the plugin's add event (Go-shaped JSON, decoded
  by cniconf.decode_add_event). 400 when the body is not an event; 500 with the reason when the
  pod is unknown after 10 lookups 10 ms apart (the watch may lag the runtime), when it is
  unexpectedly not eligible, or when enrolling it fails; 200 with an empty body once the pod is
  in the mesh. The CNI-provided IPs are used over the pod's status IPs (Kubernetes does not
  know them yet), and the CNI-provided netns path is opened (under HOST_PREFIX).
- `<run dir>/log.sock`, `POST /log`: a JSON array of JSON-object strings, the plugin's log lines,
  re-emitted under the `cni-plugin` scope.

Sockets: the directory is created 0750, a stale socket is removed, the socket is made 0666 (the
runtime runs the plugin as whatever user it likes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from pathlib import Path

from ..errors import AmbientError, ProtocolError
from ..http1 import Request, Response
from ..http1.server import serve_connection
from .cniconf import CNI_ADD_EVENT_PATH, UDS_LOG_PATH, CniAddEvent, decode_add_event
from .dataplane import DataplaneError, MeshDataplane
from .informer import Enablement
from .pods import PodSource, PodSourceError, WatchedPod

log = logging.getLogger("ambient_mesh.cni-agent")
plugin_log = logging.getLogger("ambient_mesh.cni-plugin")

POD_LOOKUP_ATTEMPTS = 10
POD_LOOKUP_INTERVAL_S = 0.01
REQUEST_READ_TIMEOUT_S = 10.0
# Plugin log batches can exceed the admin servers' body limit.
MAX_LOG_BODY_BYTES = 4 * 1024 * 1024
RUN_DIR_MODE = 0o750
SOCKET_MODE = 0o666

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
    except ValueError as exc:
        raise ProtocolError(f"log body is not JSON: {exc}") from None
    if not isinstance(lines, list) or not all(isinstance(line, str) for line in lines):
        raise ProtocolError("log body must be a JSON array of strings")
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            record = {"msg": line}
        if not isinstance(record, dict):
            record = {"msg": line}
        level = _LEVELS.get(str(record.get("level", "info")).lower(), logging.INFO)
        fields = {k: v for k, v in record.items() if k not in ("level", "msg", "time")}
        plugin_log.log(level, "%s", record.get("msg", ""), extra={"fields": fields} if fields else None)
    return len(lines)


class CniPluginServer:
    """Serves `/cmdadd` on the event socket and `/log` on the log socket."""

    def __init__(
        self,
        event_socket: str | Path,
        log_socket: str | Path | None,
        on_add: AddHandler,
        *,
        on_response: Callable[[int], None] | None = None,
    ) -> None:
        self.event_socket = Path(event_socket)
        self.log_socket = Path(log_socket) if log_socket is not None else None
        self._on_add = on_add
        self._on_response = on_response
        self._servers: list[asyncio.AbstractServer] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.requests = 0
        self.log_lines = 0

    def __repr__(self) -> str:
        state = "listening" if self._servers else "stopped"
        return f"CniPluginServer({self.event_socket}, {state}, {self.requests} requests, {len(self._tasks)} active)"

    async def start(self) -> None:
        sockets = [self.event_socket] + ([self.log_socket] if self.log_socket is not None else [])
        for path in sockets:
            path.parent.mkdir(mode=RUN_DIR_MODE, parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # a previous agent's
            server = await asyncio.start_unix_server(self._serve, path=str(path))
            os.chmod(path, SOCKET_MODE)
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
        for path in (self.event_socket, self.log_socket):
            if path is not None:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
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


__all__ = ["CniAddHandler", "CniPluginServer", "emit_plugin_lines"]
