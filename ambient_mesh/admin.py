"""The node proxy's three small HTTP servers: admin (15000), stats (15020), readiness (15021).

Counterparts: ztunnel src/admin.rs, src/metrics/server.rs, src/readiness.rs and
src/readiness/server.rs; endpoints and replies follow reference/ztunnel.md 8.1 and 12.

The HTTP/1.1 handling is deliberately tiny: one request per connection (every reply says
`Connection: close`), a Content-Length body or none, bounded sizes and read timeouts. Request
parsing is a pure function (`parse_request`); the asyncio shell only reads, parses, calls a
handler and writes.

Admin imports no domain package: workloads, services, policies and certificates register a
provider with `AdminServer.register_dump`, and logging is reached through the `LogControl`
protocol.
"""

from __future__ import annotations

import asyncio
import gzip
import html
import inspect
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Protocol
from urllib.parse import parse_qsl, unquote

from . import logs
from .errors import BindError, ConfigError, ProtocolError
from .net import SocketAddr

log = logging.getLogger(__name__)

MAX_REQUEST_HEAD_BYTES = 16 * 1024
MAX_REQUEST_BODY_BYTES = 64 * 1024
MAX_HEADER_COUNT = 100
# A client that has not sent a whole request by then is dropped (slowloris protection).
REQUEST_READ_TIMEOUT_S = 10.0
RESPONSE_WRITE_TIMEOUT_S = 10.0
READ_CHUNK_BYTES = 4096
# After refusing a request, keep reading (and discarding) for a while before closing: closing
# with unread input makes the kernel send RST, which can destroy the error reply in flight.
LINGER_TIMEOUT_S = 2.0
LINGER_MAX_BYTES = 256 * 1024
LISTEN_BACKLOG = 128
# Smaller replies are not worth compressing.
MIN_GZIP_BYTES = 1024

_TOKEN_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
TEXT_PLAIN = "text/plain; charset=utf-8"


# --- the pure HTTP/1.1 core ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    method: str
    target: str
    path: str
    query: tuple[tuple[str, str], ...] = ()
    headers: tuple[tuple[str, str], ...] = ()  # names lower-cased, in arrival order
    body: bytes = b""

    def header(self, name: str) -> str | None:
        wanted = name.lower()
        for key, value in self.headers:
            if key == wanted:
                return value
        return None

    def has_param(self, name: str) -> bool:
        return any(key == name for key, _ in self.query)

    def param(self, name: str) -> str | None:
        for key, value in self.query:
            if key == name:
                return value
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class Response:
    status: int
    body: bytes = b""
    content_type: str = TEXT_PLAIN
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def text(cls, status: int, text: str) -> Response:
        return cls(status=status, body=text.encode())


def _is_token(text: str) -> bool:
    return bool(text) and all(c in _TOKEN_CHARS for c in text)


def parse_request(data: bytes, *, max_body_bytes: int = MAX_REQUEST_BODY_BYTES) -> tuple[Request, int] | None:
    """Parse one HTTP/1.1 request from the start of `data`.

    Returns (request, bytes consumed), or None while the request is incomplete; raises
    ProtocolError for anything malformed or over the size limits (the server answers 400).
    `max_body_bytes` is there for the CNI plugin's log socket, whose batches outgrow the admin limit.
    """
    end = data.find(b"\r\n\r\n")
    if end < 0:
        if len(data) > MAX_REQUEST_HEAD_BYTES:
            raise ProtocolError(f"request head longer than {MAX_REQUEST_HEAD_BYTES} bytes")
        return None
    if end > MAX_REQUEST_HEAD_BYTES:
        raise ProtocolError(f"request head longer than {MAX_REQUEST_HEAD_BYTES} bytes")
    try:
        head = data[:end].decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError("request head is not ASCII") from None
    lines = head.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        raise ProtocolError(f"malformed request line {lines[0][:80]!r}")
    method, target, version = parts
    if not _is_token(method):
        raise ProtocolError(f"malformed method {method[:20]!r}")
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise ProtocolError(f"unsupported HTTP version {version[:20]!r}")
    # Only origin-form targets (RFC 9112 3.2.1): these servers are never proxies.
    if not target.startswith("/") or any(c.isspace() or ord(c) < 0x21 or ord(c) == 0x7F for c in target):
        raise ProtocolError(f"malformed request target {target[:80]!r}")
    if len(lines) - 1 > MAX_HEADER_COUNT:
        raise ProtocolError(f"more than {MAX_HEADER_COUNT} header fields")
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        # RFC 9112 5.1: no whitespace between name and colon; 5.2: obsolete line folding is refused.
        if not sep or not _is_token(name):
            raise ProtocolError(f"malformed header field {line[:80]!r}")
        value = value.strip(" \t")
        if any(ord(c) < 0x20 and c != "\t" or ord(c) == 0x7F for c in value):
            raise ProtocolError(f"control character in header {name!r}")
        headers.append((name.lower(), value))

    length = 0
    lengths = {value for key, value in headers if key == "content-length"}
    if any(key == "transfer-encoding" for key, _ in headers):
        raise ProtocolError("Transfer-Encoding is not supported; send a Content-Length")
    if lengths:
        if len(lengths) != 1:
            raise ProtocolError("conflicting Content-Length fields")
        (text,) = lengths
        if not text.isdigit() or len(text) > 12:
            raise ProtocolError(f"malformed Content-Length {text[:20]!r}")
        length = int(text)
        if length > max_body_bytes:
            raise ProtocolError(f"request body longer than {max_body_bytes} bytes")
    body_start = end + 4
    if len(data) - body_start < length:
        return None

    raw_path, _, raw_query = target.partition("?")
    try:
        query = tuple(parse_qsl(raw_query, keep_blank_values=True, errors="strict"))
        path = unquote(raw_path, errors="strict")
    except (UnicodeDecodeError, ValueError):
        raise ProtocolError(f"malformed percent-encoding in {target[:80]!r}") from None
    request = Request(
        method=method,
        target=target,
        path=path,
        query=query,
        headers=tuple(headers),
        body=bytes(data[body_start : body_start + length]),
    )
    return request, body_start + length


def render_response(response: Response, *, head_only: bool = False) -> bytes:
    """Serialize a response; every response closes the connection."""
    try:
        reason = HTTPStatus(response.status).phrase
    except ValueError:
        reason = ""
    lines = [
        f"HTTP/1.1 {response.status} {reason}".rstrip(),
        f"Content-Type: {response.content_type}",
        f"Content-Length: {len(response.body)}",
        "Connection: close",
    ]
    lines.extend(f"{name}: {value}" for name, value in response.headers)
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head if head_only else head + response.body


Handler = Callable[[Request], Awaitable[Response]]


class HttpServer:
    """One listening socket, one task per connection, one request per connection."""

    def __init__(
        self,
        name: str,
        address: SocketAddr,
        handler: Handler,
        *,
        read_timeout_s: float = REQUEST_READ_TIMEOUT_S,
    ) -> None:
        self.name = name
        self.address = address
        self._handler = handler
        self._read_timeout_s = read_timeout_s
        self._server: asyncio.Server | None = None
        self._bound: SocketAddr | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self.requests_served = 0

    @property
    def active_connections(self) -> int:
        return len(self._connections)

    @property
    def bound_address(self) -> SocketAddr:
        """The address actually bound (the kernel's choice when the configured port is 0)."""
        if self._bound is None:
            raise RuntimeError(f"{self.name} server is not started")
        return self._bound

    def _bind(self) -> socket.socket:
        sock = socket.socket(self.address.family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if self.address.family == socket.AF_INET6:
                # `[::]` means both families, as it does for ztunnel's listeners.
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(self.address.sockaddr())
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
        except OSError as err:
            sock.close()
            raise BindError(self.name, str(self.address), err) from err
        return sock

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError(f"{self.name} server already started")
        sock = self._bind()
        self._bound = SocketAddr.from_sockaddr(sock.getsockname())
        self._server = await asyncio.start_server(self._serve, sock=sock)
        log.info("%s server listening", self.name, extra={"fields": {"address": str(self._bound)}})

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        current = asyncio.current_task()
        pending = [task for task in self._connections if task is not current]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await server.wait_closed()

    async def _read_request(self, reader: asyncio.StreamReader) -> Request | None:
        buffer = bytearray()
        while True:
            parsed = parse_request(bytes(buffer))
            if parsed is not None:
                return parsed[0]
            chunk = await reader.read(READ_CHUNK_BYTES)
            if not chunk:
                if buffer:
                    raise ProtocolError("connection closed in the middle of a request")
                return None
            buffer += chunk

    async def _respond(self, request: Request) -> Response:
        try:
            return await self._handler(request)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s handler failed", self.name, extra={"fields": {"path": request.path}})
            return Response.text(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error\n")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            try:
                request = await asyncio.wait_for(self._read_request(reader), self._read_timeout_s)
            except ProtocolError as err:
                response = Response.text(HTTPStatus.BAD_REQUEST, f"bad request: {err.message}\n")
                request = None
            except TimeoutError:
                response = Response.text(HTTPStatus.REQUEST_TIMEOUT, "request timeout\n")
                request = None
            else:
                if request is None:
                    return  # the peer connected and left without a byte
                response = await self._respond(request)
            self.requests_served += 1
            writer.write(
                render_response(response, head_only=request is not None and request.method == "HEAD")
            )
            await asyncio.wait_for(writer.drain(), RESPONSE_WRITE_TIMEOUT_S)
            if request is None:
                await self._linger(reader, writer)
        except (OSError, TimeoutError):
            pass  # the client went away or stopped reading; nothing to tell it
        finally:
            self._connections.discard(task)
            # close() flushes what is buffered; not awaiting wait_closed keeps cancellation prompt.
            writer.close()

    @staticmethod
    async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if writer.can_write_eof():
            writer.write_eof()

        async def discard() -> None:
            left = LINGER_MAX_BYTES
            while left > 0:
                chunk = await reader.read(min(left, READ_CHUNK_BYTES))
                if not chunk:
                    return
                left -= len(chunk)

        await asyncio.wait_for(discard(), LINGER_TIMEOUT_S)

    def __repr__(self) -> str:
        where = str(self._bound) if self._bound and self._server else f"{self.address} (stopped)"
        return f"<{self.name} server {where}: {len(self._connections)} connections, {self.requests_served} served>"


def _method_not_allowed(allowed: str) -> Response:
    return Response(
        status=HTTPStatus.METHOD_NOT_ALLOWED,
        body=f"method not allowed; use {allowed}\n".encode(),
        headers=(("Allow", allowed),),
    )


def _not_found(path: str) -> Response:
    return Response.text(HTTPStatus.NOT_FOUND, f"no endpoint at {path}\n")


# --- admin -----------------------------------------------------------------------------------------


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


class AdminServer:
    """The admin API on localhost (`/`, `/config_dump`, `/logging`, `/quitquitquit`)."""

    def __init__(
        self,
        address: SocketAddr,
        *,
        shutdown: ShutdownCallback,
        log_control: LogControl | None = None,
    ) -> None:
        self._shutdown = shutdown
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
            return self._handle_config_dump()
        if path == "/logging":
            if request.method != "POST":
                return _method_not_allowed("POST")
            return self._handle_logging(request)
        if path == "/quitquitquit":
            if request.method != "POST":
                return _method_not_allowed("POST")
            return self._handle_quit()
        return _not_found(path)

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

    @property
    def bound_address(self) -> SocketAddr:
        return self.http.bound_address

    async def start(self) -> None:
        await self.http.start()

    async def stop(self) -> None:
        await self.http.stop()

    def __repr__(self) -> str:
        return f"<AdminServer {self.http!r}, dumps: {', '.join(self._dumps) or 'none'}>"


# --- stats -------------------------------------------------------------------------------------------


class MetricsRenderer(Protocol):
    def render(self, accept_header: str | None = None) -> tuple[bytes, str]: ...


def _accepts_gzip(accept_encoding: str | None) -> bool:
    if not accept_encoding:
        return False
    for item in accept_encoding.split(","):
        coding, _, params = item.strip().partition(";")
        if coding.strip().lower() == "gzip":
            q = params.strip().replace(" ", "")
            return q not in ("q=0", "q=0.0", "q=0.00", "q=0.000")
    return False


class StatsServer:
    """Prometheus scrape endpoint (`/metrics`, `/stats/prometheus`)."""

    PATHS = frozenset({"/metrics", "/stats/prometheus"})

    def __init__(self, address: SocketAddr, metrics: MetricsRenderer) -> None:
        self._metrics = metrics
        self.http = HttpServer("stats", address, self.handle)

    async def handle(self, request: Request) -> Response:
        if request.path not in self.PATHS:
            return _not_found(request.path)
        body, content_type = self._metrics.render(request.header("accept"))
        if len(body) >= MIN_GZIP_BYTES and _accepts_gzip(request.header("accept-encoding")):
            return Response(
                status=HTTPStatus.OK,
                body=gzip.compress(body),
                content_type=content_type,
                headers=(("Content-Encoding", "gzip"), ("Vary", "Accept-Encoding")),
            )
        return Response(status=HTTPStatus.OK, body=body, content_type=content_type)

    @property
    def bound_address(self) -> SocketAddr:
        return self.http.bound_address

    async def start(self) -> None:
        await self.http.start()

    async def stop(self) -> None:
        await self.http.stop()

    def __repr__(self) -> str:
        return f"<StatsServer {self.http!r}>"


# --- readiness ---------------------------------------------------------------------------------------


class ReadinessToken:
    """Handle for one start-up task; `mark_ready()` once it is done."""

    __slots__ = ("_readiness", "name")

    def __init__(self, readiness: Readiness, name: str) -> None:
        self._readiness = readiness
        self.name = name

    def mark_ready(self) -> None:
        self._readiness.mark_ready(self.name)

    def __repr__(self) -> str:
        return f"<ReadinessToken {self.name!r}>"


class Readiness:
    """The start-up tasks still pending (ztunnel's: state manager, proxy, dns proxy, workload proxy manager)."""

    def __init__(self) -> None:
        self._pending: set[str] = set()
        self._known: set[str] = set()

    def register(self, name: str) -> ReadinessToken:
        if name in self._known:
            raise ValueError(f"readiness task {name!r} is already registered")
        self._known.add(name)
        self._pending.add(name)
        return ReadinessToken(self, name)

    def mark_ready(self, name: str) -> None:
        """Idempotent; marking a task that was never registered is a bug and raises KeyError."""
        if name not in self._known:
            raise KeyError(f"readiness task {name!r} was never registered")
        self._pending.discard(name)

    def mark_not_ready(self, name: str) -> None:
        """A task that was ready is pending again (e.g. the node agent connection was lost)."""
        if name not in self._known:
            raise KeyError(f"readiness task {name!r} was never registered")
        self._pending.add(name)

    @property
    def pending(self) -> tuple[str, ...]:
        return tuple(sorted(self._pending))

    @property
    def ready(self) -> bool:
        return not self._pending

    def __repr__(self) -> str:
        if self.ready:
            return "<Readiness: ready>"
        return f"<Readiness: pending {', '.join(self.pending)}>"


class ReadinessServer:
    """`/healthz/ready`: 200 once every registered task is ready, else 500 naming what is pending."""

    PATH = "/healthz/ready"

    def __init__(self, address: SocketAddr, readiness: Readiness) -> None:
        self.readiness = readiness
        self.http = HttpServer("readiness", address, self.handle)

    async def handle(self, request: Request) -> Response:
        if request.path != self.PATH:
            return _not_found(request.path)
        if self.readiness.ready:
            return Response.text(HTTPStatus.OK, "ready\n")
        return Response.text(
            HTTPStatus.INTERNAL_SERVER_ERROR, f"not ready, pending: {', '.join(self.readiness.pending)}\n"
        )

    @property
    def bound_address(self) -> SocketAddr:
        return self.http.bound_address

    async def start(self) -> None:
        await self.http.start()

    async def stop(self) -> None:
        await self.http.stop()

    def __repr__(self) -> str:
        return f"<ReadinessServer {self.http!r}, {self.readiness!r}>"


__all__ = [
    "ADMIN_ENDPOINTS",
    "AdminServer",
    "HttpServer",
    "LogControl",
    "MetricsRenderer",
    "Readiness",
    "ReadinessServer",
    "ReadinessToken",
    "Request",
    "Response",
    "StatsServer",
    "StdlibLogControl",
    "parse_request",
    "render_response",
]
