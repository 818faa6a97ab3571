"""Admin, stats and readiness servers over loopback (port 0), and the HTTP/1.1 request parser
(ambient_mesh.http1) they share with the node agent's servers."""

from __future__ import annotations

import asyncio
import gzip
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ambient_mesh import logs
from ambient_mesh.admin import AdminServer, Readiness, ReadinessServer, StatsServer, StdlibLogControl
from ambient_mesh.errors import BindError, ConfigError, ProtocolError
from ambient_mesh.http1 import (
    MAX_REQUEST_BODY_BYTES,
    MAX_REQUEST_HEAD_BYTES,
    Request,
    Response,
    parse_request,
    render_response,
)
from ambient_mesh.http1.server import HttpServer
from ambient_mesh.metrics import ByteCount, Metrics
from ambient_mesh.net import SocketAddr
from ambient_mesh.proxy.telemetry import connection_labels

LOOPBACK = SocketAddr.of("127.0.0.1", 0)


# --- helpers -----------------------------------------------------------------------------------


async def exchange(addr: SocketAddr, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes, read to EOF, split the response."""
    reader, writer = await asyncio.open_connection(str(addr.ip), addr.port)
    try:
        writer.write(raw)
        await writer.drain()
        data = await reader.read()
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    assert int(headers["content-length"]) == len(body)
    assert headers["connection"] == "close"
    return status, headers, body


async def call(addr: SocketAddr, method: str, target: str, headers: dict[str, str] | None = None, body=b""):
    lines = [f"{method} {target} HTTP/1.1", "Host: test"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if body:
        lines.append(f"Content-Length: {len(body)}")
    return await exchange(addr, ("\r\n".join(lines) + "\r\n\r\n").encode() + body)


class FakeLogControl:
    def __init__(self) -> None:
        self.levels = "info"
        self.calls: list[str] = []

    def current_levels(self) -> str:
        return self.levels

    def set_levels(self, spec: str) -> str:
        self.calls.append(f"set {spec}")
        if spec == "bogus":
            raise ConfigError("log level", "'bogus' is not a level")
        self.levels = f"{self.levels},{spec}"
        return self.levels

    def reset_levels(self) -> str:
        self.calls.append("reset")
        self.levels = "info"
        return self.levels


@pytest.fixture
async def admin():
    shutdowns: list[str] = []
    control = FakeLogControl()
    server = AdminServer(LOOPBACK, shutdown=lambda: shutdowns.append("quit"), log_control=control)
    server.register_dump("workloads", lambda: [{"uid": "a"}])
    server.register_dump("config", lambda: {"proxyMode": "shared"})
    await server.start()
    server.shutdowns = shutdowns  # type: ignore[attr-defined]
    server.control = control  # type: ignore[attr-defined]
    try:
        yield server
    finally:
        await server.stop()


# --- the pure parser -----------------------------------------------------------------------------


def test_parse_complete_request():
    raw = b"POST /logging?level=access%3Ddebug&reset HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabcEXTRA"
    request, used = parse_request(raw)
    assert used == len(raw) - len(b"EXTRA")
    assert request == Request(
        method="POST",
        target="/logging?level=access%3Ddebug&reset",
        path="/logging",
        query=(("level", "access=debug"), ("reset", "")),
        headers=(("host", "x"), ("content-length", "3")),
        body=b"abc",
    )
    assert request.param("level") == "access=debug"
    assert request.has_param("reset") and not request.has_param("level=")
    assert request.header("Content-Length") == "3"


def test_parse_incomplete_returns_none():
    assert parse_request(b"GET / HTTP/1.1\r\nHost: x\r\n") is None
    assert parse_request(b"POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\nab") is None


@pytest.mark.parametrize(
    "raw",
    [
        b"GET /\r\n\r\n",
        b"GET / HTTP/2.0\r\n\r\n",
        b"GET http://x/ HTTP/1.1\r\n\r\n",
        b"G(T / HTTP/1.1\r\n\r\n",
        b"GET / HTTP/1.1\r\nBad Header: x\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost : x\r\n\r\n",
        b"GET / HTTP/1.1\r\n folded\r\n\r\n",
        b"GET / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        b"GET / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
        b"GET / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"GET /\xff HTTP/1.1\r\n\r\n",
        b"GET /%ff HTTP/1.1\r\n\r\n",
        b"GET / HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (MAX_REQUEST_BODY_BYTES + 1),
        b"GET /" + b"a" * MAX_REQUEST_HEAD_BYTES + b" HTTP/1.1\r\n\r\n",
        b"GET /" + b"a" * (MAX_REQUEST_HEAD_BYTES + 1),
    ],
)
def test_parse_rejects(raw):
    with pytest.raises(ProtocolError):
        parse_request(raw)


@given(
    st.tuples(
        st.sampled_from([b"", b"GET / HTTP/1.1\r\n", b"POST /x?a=%41 HTTP/1.0\r\nContent-Length: 4\r\n"]),
        st.binary(max_size=512),
        st.sampled_from([b"", b"\r\n\r\n"]),
    ).map(b"".join)
)
def test_parse_arbitrary_bytes(data):
    try:
        result = parse_request(data)
    except ProtocolError:
        return
    if result is not None:
        request, used = result
        assert 0 < used <= len(data)
        assert request.path.startswith("/")


_token = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=12)
_value = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=20)


@given(
    method=st.sampled_from(["GET", "POST", "HEAD", "PUT"]),
    path=st.lists(_token, max_size=3).map(lambda parts: "/" + "/".join(parts)),
    headers=st.lists(st.tuples(_token, _value), max_size=5),
    body=st.binary(max_size=64),
    split=st.integers(min_value=0, max_value=400),
)
def test_parse_generated_requests(method, path, headers, body, split):
    headers = [(k, v) for k, v in headers if k not in ("content-length", "transfer-encoding")]
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
    head += f"content-length: {len(body)}\r\n\r\n"
    raw = head.encode() + body
    # Any strict prefix is "need more"; the whole thing parses back to what was sent.
    if split < len(raw):
        assert parse_request(raw[:split]) is None
    request, used = parse_request(raw)
    assert used == len(raw)
    assert (request.method, request.path, request.body) == (method, path, body)
    assert request.headers[:-1] == tuple(headers)


def test_render_response():
    raw = render_response(Response(status=405, body=b"no\n", headers=(("Allow", "POST"),)))
    assert raw == (
        b"HTTP/1.1 405 Method Not Allowed\r\nContent-Type: text/plain; charset=utf-8\r\n"
        b"Content-Length: 3\r\nConnection: close\r\nAllow: POST\r\n\r\nno\n"
    )


# --- admin ---------------------------------------------------------------------------------------


async def test_admin_index(admin):
    status, headers, body = await call(admin.bound_address, "GET", "/")
    assert status == 200
    assert headers["content-type"].startswith("text/html")
    for path in ("/config_dump", "/logging", "/quitquitquit"):
        assert f'href="{path}"'.encode() in body


async def test_admin_config_dump(admin):
    status, headers, body = await call(admin.bound_address, "GET", "/config_dump")
    assert status == 200
    assert headers["content-type"] == "application/json"
    assert json.loads(body) == {"workloads": [{"uid": "a"}], "config": {"proxyMode": "shared"}}
    assert body.startswith(b'{\n  "workloads"')  # pretty-printed, in registration order


async def test_admin_config_dump_provider_failure_is_500(admin):
    admin.register_dump("broken", lambda: 1 / 0)
    status, _, body = await call(admin.bound_address, "GET", "/config_dump")
    assert status == 500
    assert b"division by zero" in body
    with pytest.raises(ValueError):
        admin.register_dump("broken", dict)


async def test_admin_logging_is_post_only(admin):
    status, headers, _ = await call(admin.bound_address, "GET", "/logging?level=debug")
    assert (status, headers["allow"]) == (405, "POST")
    assert admin.control.calls == []


async def test_admin_logging_show_set_reset(admin):
    addr = admin.bound_address
    status, _, body = await call(addr, "POST", "/logging")
    assert (status, body) == (200, b"current log level is info\n")
    status, _, body = await call(addr, "POST", "/logging?level=access%3Ddebug")
    assert (status, body) == (200, b"current log level is info,access=debug\n")
    status, _, body = await call(addr, "POST", "/logging?level=bogus")
    assert status == 400 and b"bogus" in body
    status, _, body = await call(addr, "POST", "/logging?reset")
    assert (status, body) == (200, b"current log level is info\n")
    assert admin.control.calls == ["set access=debug", "set bogus", "reset"]


async def test_admin_logging_with_stdlib_control():
    server = AdminServer(LOOPBACK, shutdown=lambda: None, log_control=StdlibLogControl())
    logs.configure_logging("plain", "warn", stream=None)
    await server.start()
    try:
        status, _, body = await call(server.bound_address, "POST", "/logging?level=xds=debug")
        assert (status, body) == (200, b"current log level is warn,xds=debug\n")
        status, _, body = await call(server.bound_address, "POST", "/logging?reset")
        assert (status, body) == (200, b"current log level is warn\n")
    finally:
        await server.stop()
        logs.unconfigure_logging()


async def test_admin_quitquitquit(admin):
    status, headers, _ = await call(admin.bound_address, "GET", "/quitquitquit")
    assert (status, headers["allow"]) == (405, "POST")
    assert admin.shutdowns == []
    status, _, body = await call(admin.bound_address, "POST", "/quitquitquit")
    assert (status, body) == (200, b"shutdown now\n")
    assert admin.shutdowns == ["quit"]


async def test_admin_quitquitquit_async_callback_may_stop_the_server():
    stopped = asyncio.Event()

    async def shutdown() -> None:
        await server.stop()
        stopped.set()

    server = AdminServer(LOOPBACK, shutdown=shutdown, log_control=FakeLogControl())
    await server.start()
    addr = server.bound_address
    status, _, body = await call(addr, "POST", "/quitquitquit")
    assert (status, body) == (200, b"shutdown now\n")
    await asyncio.wait_for(stopped.wait(), 5)
    with pytest.raises(OSError):
        await call(addr, "GET", "/")


async def test_admin_unknown_path_and_bad_request(admin):
    status, _, body = await call(admin.bound_address, "GET", "/debug/pprof/profile")
    assert (status, body) == (404, b"no endpoint at /debug/pprof/profile\n")
    status, _, body = await exchange(admin.bound_address, b"NONSENSE\r\n\r\n")
    assert status == 400 and body.startswith(b"bad request: ")
    status, _, _ = await exchange(admin.bound_address, b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 5000)
    assert status == 400


async def test_head_request_gets_no_body(admin):
    reader, writer = await asyncio.open_connection("127.0.0.1", admin.bound_address.port)
    writer.write(b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\n")
    data = await reader.read()
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and b"Content-Length: " in head and body == b""


async def test_slow_client_gets_408():
    async def handler(request: Request) -> Response:
        return Response.text(200, "ok")

    server = HttpServer("slow", LOOPBACK, handler, read_timeout_s=0.2)
    await server.start()
    try:
        status, _, body = await exchange(server.bound_address, b"GET / HTTP/1.1\r\n")
        assert (status, body) == (408, b"request timeout\n")
    finally:
        await server.stop()


async def test_handler_crash_is_500_and_server_keeps_serving():
    async def handler(request: Request) -> Response:
        if request.path == "/boom":
            raise RuntimeError("boom")
        return Response.text(200, "ok")

    server = HttpServer("crashy", LOOPBACK, handler)
    await server.start()
    try:
        assert (await call(server.bound_address, "GET", "/boom"))[0] == 500
        assert (await call(server.bound_address, "GET", "/"))[::2] == (200, b"ok")
        assert repr(server) == f"<crashy server {server.bound_address}: 0 connections, 2 served>"
    finally:
        await server.stop()
    assert "(stopped)" in repr(server)


async def test_stop_closes_idle_connections():
    async def handler(request: Request) -> Response:
        return Response.text(200, "ok")

    server = HttpServer("idle", LOOPBACK, handler)
    await server.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.bound_address.port)
    writer.write(b"GET / HTT")  # never finishes its request
    await writer.drain()

    async def accepted() -> None:
        while server.active_connections == 0:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(accepted(), 5)
    await server.stop()
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


async def test_bind_conflict_names_the_address(admin):
    taken = admin.bound_address
    other = AdminServer(taken, shutdown=lambda: None, log_control=FakeLogControl())
    with pytest.raises(BindError) as info:
        await other.start()
    assert info.value.address == str(taken)
    assert str(taken) in str(info.value)
    assert "admin" in str(info.value)
    with pytest.raises(RuntimeError):
        _ = other.bound_address


async def test_dual_stack_wildcard_accepts_ipv4():
    async def handler(request: Request) -> Response:
        return Response.text(200, "ok")

    server = HttpServer("wild", SocketAddr.of("::", 0), handler)
    try:
        await server.start()
    except BindError:
        pytest.skip("no IPv6 on this host")
    try:
        v4 = SocketAddr.of("127.0.0.1", server.bound_address.port)
        assert (await call(v4, "GET", "/"))[::2] == (200, b"ok")
    finally:
        await server.stop()


# --- stats ------------------------------------------------------------------------------------------


@pytest.fixture
async def stats():
    metrics = Metrics(istio_version="1.26.0", process_metrics=False)
    metrics.connection_opened(connection_labels("source")).follow(ByteCount(bytes_up=42))
    server = StatsServer(LOOPBACK, metrics)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.mark.parametrize("path", ["/metrics", "/stats/prometheus"])
async def test_stats_paths(stats, path):
    status, headers, body = await call(stats.bound_address, "GET", path)
    assert status == 200
    assert headers["content-type"].startswith("text/plain; version=0.0.4")
    assert b'istio_build{component="ztunnel",tag="1.26.0"} 1.0' in body
    assert b"istio_tcp_received_bytes_total{" in body
    assert b'istio_tcp_sockets_open{reporter="source"} 1.0' in body


async def test_stats_openmetrics_and_gzip(stats):
    status, headers, body = await call(
        stats.bound_address,
        "GET",
        "/metrics",
        headers={"Accept": "application/openmetrics-text;version=1.0.0", "Accept-Encoding": "gzip"},
    )
    assert status == 200
    assert headers["content-type"].startswith("application/openmetrics-text")
    assert headers["content-encoding"] == "gzip"
    assert gzip.decompress(body).endswith(b"# EOF\n")


async def test_stats_unknown_path(stats):
    assert (await call(stats.bound_address, "GET", "/stats"))[0] == 404


# --- readiness -------------------------------------------------------------------------------------


def test_readiness_bookkeeping():
    readiness = Readiness()
    assert readiness.ready and repr(readiness) == "<Readiness: ready>"
    proxy = readiness.register("proxy")
    readiness.register("state manager")
    assert readiness.pending == ("proxy", "state manager")
    assert repr(readiness) == "<Readiness: pending proxy, state manager>"
    with pytest.raises(ValueError):
        readiness.register("proxy")
    proxy.mark_ready()
    proxy.mark_ready()
    assert readiness.pending == ("state manager",)
    readiness.mark_ready("state manager")
    assert readiness.ready
    with pytest.raises(KeyError):
        readiness.mark_ready("dns proxy")


async def test_readiness_server():
    readiness = Readiness()
    state = readiness.register("state manager")
    readiness.register("proxy")
    server = ReadinessServer(LOOPBACK, readiness)
    await server.start()
    try:
        addr = server.bound_address
        status, _, body = await call(addr, "GET", "/healthz/ready")
        assert (status, body) == (500, b"not ready, pending: proxy, state manager\n")
        state.mark_ready()
        status, _, body = await call(addr, "GET", "/healthz/ready")
        assert (status, body) == (500, b"not ready, pending: proxy\n")
        readiness.mark_ready("proxy")
        status, _, body = await call(addr, "GET", "/healthz/ready")
        assert (status, body) == (200, b"ready\n")
        assert (await call(addr, "GET", "/healthz/live"))[0] == 404
    finally:
        await server.stop()
