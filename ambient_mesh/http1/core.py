"""HTTP/1.1 as the mesh's small servers and clients speak it: a sans-IO core.

Counterparts: none to copy (ztunnel and istio-cni use hyper and Go's net/http); the rules are
RFC 9112's. Every HTTP/1.1 speaker uses this module: the node proxy's admin, stats and readiness
servers, the node agent's CNI event and health servers (`http1.server`), and the CNI plugin's
and its Kubernetes lookup's blocking clients (`http1.client`).

Why our own and not h11: what these speakers need is one request per connection with a
Content-Length body (every reply says `Connection: close`), and on the client side a reply that
may also be chunked or closed-delimited. That is about 250 lines with every limit named; h11 would
accept chunked requests and pipelining that these servers refuse, so the same limits would still
be needed around it, and the CNI plugin, a host executable started for every pod, would carry one
more dependency.

Parsing is pure: bytes in, a `Request` / `ClientResponse` (or None while incomplete) out;
anything malformed or over a limit raises ProtocolError, which the servers answer with 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus
from urllib.parse import parse_qsl, unquote

from ..errors import ProtocolError

MAX_REQUEST_HEAD_BYTES = 16 * 1024
MAX_REQUEST_BODY_BYTES = 64 * 1024
MAX_HEADER_COUNT = 100
# A client reads at most this much of one reply. The CNI plugin quotes the node agent's error
# body into its own error up to MAX_ERROR_BODY_BYTES (istio-cni reads 1 MiB).
MAX_ERROR_BODY_BYTES = 1024 * 1024
MAX_RESPONSE_BYTES = MAX_ERROR_BODY_BYTES + 64 * 1024

_TOKEN_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
TEXT_PLAIN = "text/plain; charset=utf-8"


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


def method_not_allowed(allowed: str) -> Response:
    return Response(
        status=HTTPStatus.METHOD_NOT_ALLOWED,
        body=f"method not allowed; use {allowed}\n".encode(),
        headers=(("Allow", allowed),),
    )


def not_found(path: str) -> Response:
    return Response.text(HTTPStatus.NOT_FOUND, f"no endpoint at {path}\n")


# --- the client side -----------------------------------------------------------------------------


def render_request(
    method: str,
    path: str,
    *,
    host: str = "unix",
    headers: tuple[tuple[str, str], ...] = (),
    body: bytes | None = None,
) -> bytes:
    """One request that asks the server to close after replying. Host is required by HTTP/1.1;
    Go's client sends "unix" for requests over a unix socket, and so do we."""
    fields = (("Host", host), *headers)
    for name, value in fields:
        # A value from outside (a token file, a path) must not end the head or add a field.
        if not _is_token(name) or not value.isascii() or any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
            raise ProtocolError(f"request header {name[:40]!r} has a value that cannot be sent in HTTP/1.1")
    if (
        not _is_token(method)
        or not path.startswith("/")
        or not path.isascii()
        or any(c.isspace() for c in path)
    ):
        raise ProtocolError(f"malformed request target {path[:80]!r}")
    lines = [f"{method} {path} HTTP/1.1"]
    lines.extend(f"{name}: {value}" for name, value in fields)
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + (body or b"")


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientResponse:
    """A reply as a client reads it (`parse_response`)."""

    status: int
    reason: str = ""
    body: bytes = b""


def _dechunk(data: bytes, eof: bool) -> bytes | None:
    body = bytearray()
    pos = 0
    while True:
        line_end = data.find(b"\r\n", pos)
        if line_end < 0:
            break
        size_text = data[pos:line_end].split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16) if size_text and size_text.isalnum() else -1
        except ValueError:
            size = -1
        if size < 0:
            raise ProtocolError(f"bad chunk size {bytes(size_text[:20])!r}")
        if size == 0:
            return bytes(body)
        start = line_end + 2
        if len(data) < start + size + 2:
            break
        if data[start + size : start + size + 2] != b"\r\n":
            raise ProtocolError("chunk not terminated by CRLF")
        body += data[start : start + size]
        pos = start + size + 2
    if eof:
        raise ProtocolError("connection closed inside a chunked body")
    return None


def parse_response(data: bytes, *, eof: bool) -> ClientResponse | None:
    """One HTTP/1.x response from the bytes read so far: None while more are needed, ProtocolError
    when the bytes cannot be a response. Interim 1xx responses are skipped."""
    while True:
        if len(data) > MAX_RESPONSE_BYTES:
            raise ProtocolError(f"response larger than {MAX_RESPONSE_BYTES} bytes")
        head_end = data.find(b"\r\n\r\n")
        if head_end < 0:
            if eof:
                raise ProtocolError("connection closed before the response headers ended")
            return None
        lines = data[:head_end].split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if (
            len(parts) < 2
            or not parts[0].startswith(b"HTTP/1.")
            or len(parts[1]) != 3
            or not parts[1].isdigit()
        ):
            raise ProtocolError(f"bad status line {bytes(lines[0][:80])!r}")
        status = int(parts[1])
        reason = parts[2].decode("latin-1") if len(parts) == 3 else ""
        headers: dict[bytes, bytes] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip():
                raise ProtocolError(f"bad header line {bytes(line[:80])!r}")
            headers[name.lower()] = value.strip()
        rest = data[head_end + 4 :]
        if 100 <= status < 200:
            data = rest
            continue
        if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
            body = _dechunk(rest, eof)
            return None if body is None else ClientResponse(status=status, reason=reason, body=body)
        if b"content-length" in headers:
            raw_len = headers[b"content-length"]
            if not raw_len.isdigit() or len(raw_len) > 12:
                raise ProtocolError(f"bad Content-Length {bytes(raw_len[:20])!r}")
            length = int(raw_len)
            if len(rest) >= length:
                return ClientResponse(status=status, reason=reason, body=rest[:length])
            if eof:
                raise ProtocolError("connection closed before the response body ended")
            return None
        if status in (204, 304):
            return ClientResponse(status=status, reason=reason)
        return ClientResponse(status=status, reason=reason, body=rest) if eof else None
