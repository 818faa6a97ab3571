"""The node proxy's admin API (15000): `/`, `/config_dump`, `/logging`, `/quitquitquit`.

Counterpart: ztunnel src/admin.rs; endpoints and replies follow docs/istio-behaviour.md, "Admin and readiness"
and "Lifecycle and draining". Admin imports no domain package: workloads, services, policies and certificates
register a provider with `AdminServer.register_dump`, and logging is reached through `LogControl`.
"""

from __future__ import annotations

import asyncio
import html
import inspect
import json
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any, Protocol

from .. import logs
from ..errors import ConfigError
from ..http1 import Request, Response, method_not_allowed, not_found
from ..http1.server import HttpServer, HttpService
from ..net import SocketAddr

log = logging.getLogger(__name__)


class LogControl(Protocol):
    """What `/logging` needs from the logging setup."""

    def current_levels(self) -> str: ...

    def set_levels(self, spec: str) -> str: ...

    def reset_levels(self) -> str: ...


class StdlibLogControl:
    """LogControl over ambient_mesh.logs (the process-wide stdlib logging setup)."""

    def current_levels(self) -> str:
        return logs.current_levels()

    def set_levels(self, spec: str) -> str:
        return logs.set_levels(spec)

    def reset_levels(self) -> str:
        return logs.reset_levels()


DumpProvider = Callable[[], Any]
ShutdownCallback = Callable[[], object]

ADMIN_ENDPOINTS: tuple[tuple[str, str], ...] = (
    ("/config_dump", "dump the proxy's state: workloads, services, policies, certificates, config"),
    ("/logging", "POST: show log levels; ?level=<level> or ?level=<scope>=<level>,... to change; ?reset"),
    ("/quitquitquit", "POST: shut down gracefully"),
)


class AdminServer(HttpService):
    """The admin API on localhost (`/`, `/config_dump`, `/logging`, `/quitquitquit`)."""

    def __init__(
        self,
        address: SocketAddr,
        *,
        shutdown: ShutdownCallback,
        log_control: LogControl | None = None,
        refresh: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._shutdown = shutdown
        # Awaited before /config_dump is built: worker processes report their connections.
        self._refresh = refresh
        self._log_control: LogControl = log_control if log_control is not None else StdlibLogControl()
        self._dumps: dict[str, DumpProvider] = {}
        self._shutdown_task: asyncio.Future[Any] | None = None
        self.http = HttpServer("admin", address, self.handle)

    def register_dump(self, name: str, fn: DumpProvider) -> None:
        """Add a section to `/config_dump`; `fn` returns a JSON-able value when called."""
        if name in self._dumps:
            raise ValueError(f"config_dump section {name!r} is already registered")
        self._dumps[name] = fn

    def config_dump(self) -> dict[str, Any]:
        return {name: fn() for name, fn in self._dumps.items()}

    async def handle(self, request: Request) -> Response:
        path = request.path
        if path == "/":
            return self._index()
        if path == "/config_dump":
            if self._refresh is not None:
                await self._refresh()
            return self._handle_config_dump()
        if path == "/logging":
            if request.method != "POST":
                return method_not_allowed("POST")
            return self._handle_logging(request)
        if path == "/quitquitquit":
            if request.method != "POST":
                return method_not_allowed("POST")
            return self._handle_quit()
        return not_found(path)

    def _index(self) -> Response:
        rows = "\n".join(
            f'<tr><td><a href="{html.escape(p)}">{html.escape(p)}</a></td><td>{html.escape(d)}</td></tr>'
            for p, d in ADMIN_ENDPOINTS
        )
        body = (
            "<!DOCTYPE html>\n<html><head><title>ambient ztunnel admin</title></head><body>\n"
            "<h1>ambient ztunnel admin</h1>\n<table>\n"
            f"{rows}\n</table>\n</body></html>\n"
        )
        return Response(status=HTTPStatus.OK, body=body.encode(), content_type="text/html; charset=utf-8")

    def _handle_config_dump(self) -> Response:
        try:
            dump = self.config_dump()
            body = json.dumps(dump, indent=2, default=str) + "\n"
        except Exception as err:
            log.exception("config_dump failed")
            return Response.text(HTTPStatus.INTERNAL_SERVER_ERROR, f"config_dump failed: {err}\n")
        return Response(status=HTTPStatus.OK, body=body.encode(), content_type="application/json")

    def _handle_logging(self, request: Request) -> Response:
        control = self._log_control
        try:
            if request.has_param("reset"):
                levels = control.reset_levels()
            else:
                levels = control.current_levels()
            level = request.param("level")
            if level is not None:
                levels = control.set_levels(level)
        except ConfigError as err:
            return Response.text(HTTPStatus.BAD_REQUEST, f"invalid level: {err.message}\n")
        return Response.text(HTTPStatus.OK, f"current log level is {levels}\n")

    def _handle_quit(self) -> Response:
        # The callback may stop this very server; it runs in its own task so the reply is
        # written before our connection is torn down.
        result = self._shutdown()
        if inspect.isawaitable(result):
            self._shutdown_task = asyncio.ensure_future(result)
        return Response.text(HTTPStatus.OK, "shutdown now\n")

    def __repr__(self) -> str:
        return f"<AdminServer {self.http!r}, dumps: {', '.join(self._dumps) or 'none'}>"
