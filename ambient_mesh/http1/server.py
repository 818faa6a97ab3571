"""The asyncio HTTP/1.1 server shell: read one request, call a handler, write the reply, close.

Counterparts: ztunnel's hyper servers for admin/stats/readiness (src/admin.rs, src/hyper_util.rs)
and istio-cni's net/http servers on unix sockets (cni/pkg/nodeagent/cni-watcher.go). The bytes
are `core`'s; this module only reads, parses, calls and writes, under named time and size limits.
`serve_connection` serves any stream (the CNI agent's unix sockets use it); `HttpServer` adds a
TCP listener with one task per connection.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from http import HTTPStatus

from ..errors import BindError, ProtocolError
from ..net import SocketAddr
from .core import MAX_REQUEST_BODY_BYTES, Request, Response, parse_request, render_response

log = logging.getLogger(__name__)

# A client that has not sent a whole request by then is dropped (slowloris protection).
REQUEST_READ_TIMEOUT_S = 10.0
RESPONSE_WRITE_TIMEOUT_S = 10.0
READ_CHUNK_BYTES = 64 * 1024
# After refusing a request, keep reading (and discarding) for a while before closing: closing
# with unread input makes the kernel send RST, which can destroy the error reply in flight.
LINGER_TIMEOUT_S = 2.0
LINGER_MAX_BYTES = 256 * 1024
LISTEN_BACKLOG = 128

Handler = Callable[[Request], Awaitable[Response]]


async def read_request(
    reader: asyncio.StreamReader, *, max_body_bytes: int = MAX_REQUEST_BODY_BYTES
) -> Request | None:
    """One request from the stream; None when the peer left without sending a byte."""
    buffer = bytearray()
    while True:
        parsed = parse_request(bytes(buffer), max_body_bytes=max_body_bytes)
        if parsed is not None:
            return parsed[0]
        chunk = await reader.read(READ_CHUNK_BYTES)
        if not chunk:
            if buffer:
                raise ProtocolError("connection closed in the middle of a request")
            return None
        buffer += chunk


async def _respond(name: str, handler: Handler, request: Request) -> Response:
    try:
        return await handler(request)
    except asyncio.CancelledError:
        raise
    except Exception:  # crash barrier: the client gets a 500, the server keeps serving
        log.exception("%s handler failed", name, extra={"fields": {"path": request.path}})
        return Response.text(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error\n")


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


async def serve_connection(
    name: str,
    handler: Handler,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    *,
    read_timeout_s: float = REQUEST_READ_TIMEOUT_S,
    max_body_bytes: int = MAX_REQUEST_BODY_BYTES,
) -> bool:
    """Serve one request on one connection and close it; True when a reply was written (400 and
    408 included), False when the peer connected and left without a byte or went away."""
    try:
        try:
            request = await asyncio.wait_for(
                read_request(reader, max_body_bytes=max_body_bytes), read_timeout_s
            )
        except ProtocolError as err:
            response = Response.text(HTTPStatus.BAD_REQUEST, f"bad request: {err.message}\n")
            request = None
        except TimeoutError:
            response = Response.text(HTTPStatus.REQUEST_TIMEOUT, "request timeout\n")
            request = None
        else:
            if request is None:
                return False
            response = await _respond(name, handler, request)
        writer.write(render_response(response, head_only=request is not None and request.method == "HEAD"))
        await asyncio.wait_for(writer.drain(), RESPONSE_WRITE_TIMEOUT_S)
        if request is None:
            await _linger(reader, writer)
        return True
    except (OSError, TimeoutError):
        return False  # the client went away or stopped reading; nothing to tell it
    finally:
        # close() flushes what is buffered; not awaiting wait_closed keeps cancellation prompt.
        writer.close()


class HttpServer:
    """One listening TCP socket, one task per connection, one request per connection."""

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

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            if await serve_connection(
                self.name, self._handler, reader, writer, read_timeout_s=self._read_timeout_s
            ):
                self.requests_served += 1
        finally:
            self._connections.discard(task)

    def __repr__(self) -> str:
        where = str(self._bound) if self._bound and self._server else f"{self.address} (stopped)"
        return f"<{self.name} server {where}: {len(self._connections)} connections, {self.requests_served} served>"


class HttpService:
    """Something served by one HttpServer (`self.http`): started, stopped, and where it listens."""

    http: HttpServer

    @property
    def bound_address(self) -> SocketAddr:
        return self.http.bound_address

    async def start(self) -> None:
        await self.http.start()

    async def stop(self) -> None:
        await self.http.stop()
