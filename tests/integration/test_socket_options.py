"""KEEPALIVE_* and USER_TIMEOUT_ENABLED act on the proxy's sockets, as ztunnel sets them: read
back with getsockopt from the sockets a running proxy accepted and opened."""

from __future__ import annotations

import asyncio
import logging
import select
import socket
import struct

from ambient_mesh.config import ZtunnelConfig
from ambient_mesh.host.sockets import TCP_USER_TIMEOUT, KeepaliveSettings, is_own_listener
from ambient_mesh.logs import access_logger
from ambient_mesh.net import SocketAddr
from ambient_mesh.proxy.listener import Listener
from ambient_mesh.proxy.open_connections import OpenConnections
from ambient_mesh.proxy.workload_proxy import ListenerAddresses
from ambient_mesh.workers.owner import open_listener_sockets

from .mesh import ECHO_PORT, SERVER_IP, TCP_IP, echo_handler, running_mesh

PLAIN_PORT = 8081
# What KEEPALIVE_TIME 45s, KEEPALIVE_INTERVAL 7s, KEEPALIVE_RETRIES 4 and USER_TIMEOUT_ENABLED
# give: TCP_USER_TIMEOUT = time + retries * interval (ztunnel's rule), 45 + 4 * 7 = 73 s.
CONFIGURED_KEEPALIVE = KeepaliveSettings(enabled=True, time_s=45, interval_s=7, retries=4, user_timeout=True)
CONFIGURED_OPTIONS = {
    "keepalive": 1,
    "idle": 45,
    "interval": 7,
    "count": 4,
    "user_timeout_ms": 73_000,
    "nodelay": 1,
}


def options(sock) -> dict[str, int]:
    return {
        "keepalive": sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
        "idle": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
        "interval": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
        "count": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
        "user_timeout_ms": sock.getsockopt(socket.IPPROTO_TCP, TCP_USER_TIMEOUT),
        "nodelay": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY),
    }


def _option_recorder():
    """A listener handler that records the options of each socket it is handed, and closes it."""
    seen: list[dict[str, int]] = []
    done = asyncio.Event()

    async def handler(conn: socket.socket) -> None:
        seen.append(options(conn))
        conn.close()
        done.set()

    return seen, done, handler


async def test_listener_applies_keepalive_to_accepted_sockets():
    # Also to a client that connected before the listener started: Linux copies a listener's
    # options into the socket it makes when the handshake completes, not at accept(), so a
    # client already waiting in the backlog (WorkloadProxy.start binds every listener before
    # starting any) finds them only because they are set before listen().
    seen, done, handler = _option_recorder()
    listener = Listener(
        "ka", SocketAddr.parse("127.0.0.1:0"), handler, OpenConnections(), keepalive=CONFIGURED_KEEPALIVE
    )
    listener.bind()
    try:
        port = listener.bound_address.port
        with socket.create_connection(("127.0.0.1", port)):  # waits in the backlog
            await asyncio.sleep(0.05)
            listener.start()
            await asyncio.wait_for(done.wait(), 5)
        done.clear()
        with socket.create_connection(("127.0.0.1", port)):
            await asyncio.wait_for(done.wait(), 5)
    finally:
        listener.close()
    assert seen == [CONFIGURED_OPTIONS, CONFIGURED_OPTIONS]


async def _relayed_sockets(env: dict[str, str]):
    """A connection through the client proxy to a plain-TCP workload: its two sockets."""
    app = await asyncio.start_server(echo_handler, TCP_IP, PLAIN_PORT)
    try:
        async with running_mesh(client_env=env) as mesh:
            reader, writer = await mesh.socks_connect(TCP_IP, PLAIN_PORT)
            writer.write(b"x")
            assert await asyncio.wait_for(reader.readexactly(1), 10) == b"x"
            (relay,) = mesh.client.pi.connections.relays
            down = options(relay.downstream.transport.get_extra_info("socket"))
            up = options(relay.upstream.transport.get_extra_info("socket"))
            writer.close()
            return down, up
    finally:
        app.close()
        await app.wait_closed()


async def test_configured_keepalive_and_user_timeout_on_accepted_and_upstream_sockets():
    env = {
        "KEEPALIVE_TIME": "45s",
        "KEEPALIVE_INTERVAL": "7s",
        "KEEPALIVE_RETRIES": "4",
        "USER_TIMEOUT_ENABLED": "true",
    }
    down, up = await _relayed_sockets(env)
    assert down == CONFIGURED_OPTIONS
    assert up == CONFIGURED_OPTIONS


async def test_defaults_are_ztunnels_and_keepalive_can_be_turned_off():
    down, up = await _relayed_sockets({})
    # 180 s / 180 s / 9 probes, no user timeout (USER_TIMEOUT_ENABLED defaults to false).
    for got in (down, up):
        assert (got["keepalive"], got["idle"], got["interval"], got["count"]) == (1, 180, 180, 9)
        assert got["user_timeout_ms"] == 0
    down, up = await _relayed_sockets({"KEEPALIVE_ENABLED": "false"})
    assert down["keepalive"] == 0 and up["keepalive"] == 0


# /proc/net/tcp's "tr" column (timer_active): 2 is the keepalive timer of an established socket.
PROC_TIMER_KEEPALIVE = 2


def _timer_of(local_port: int, remote_port: int) -> int:
    """The timer_active of the established loopback socket with these ports (IPv4 or IPv6)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for row in f:
                cols = row.split()
                local, remote, state, timer = cols[1], cols[2], cols[3], cols[5]
                if state == "01" and int(local.rsplit(":", 1)[1], 16) == local_port:
                    if int(remote.rsplit(":", 1)[1], 16) == remote_port:
                        return int(timer.split(":")[0], 16)
    raise AssertionError(f"no established socket {local_port} <- {remote_port} in /proc/net/tcp")


async def _accepted_options(listener_address: str, keepalive: KeepaliveSettings | None, change=None):
    """Options read back from a socket the listener accepted (and its keepalive timer), after
    `change(listening_socket)` if given."""
    seen: list[tuple[dict[str, int], int]] = []
    done = asyncio.Event()

    async def handler(conn: socket.socket) -> None:
        local, peer = conn.getsockname()[1], conn.getpeername()[1]
        seen.append((options(conn), _timer_of(local, peer)))
        conn.close()
        done.set()

    listener = Listener(
        "ka", SocketAddr.parse(listener_address), handler, OpenConnections(), keepalive=keepalive
    )
    listener.start()
    try:
        listening = listener._sock
        assert listening is not None
        if change is not None:
            change(listening)
        with socket.create_connection(("127.0.0.1", listener.bound_address.port)):
            await asyncio.wait_for(done.wait(), 5)
        return options(listening), seen[0]
    finally:
        listener.close()


async def test_accepted_sockets_inherit_the_listeners_options_and_keepalive_timer():
    # The options are set once on the listening socket; the accepted socket carries them because
    # Linux copies them at accept(), not because anything sets them again per connection: a value
    # changed on the listening socket after start is the one the accepted socket has.
    keepalive = CONFIGURED_KEEPALIVE
    for address in ("127.0.0.1:0", "[::]:0"):  # and a dual-stack listener with an IPv4 client
        listening, (accepted, timer) = await _accepted_options(address, keepalive)
        assert listening == CONFIGURED_OPTIONS
        assert accepted == CONFIGURED_OPTIONS
        assert timer == PROC_TIMER_KEEPALIVE  # keepalive probing is armed on the accepted socket
    _, (accepted, _) = await _accepted_options(
        "127.0.0.1:0", keepalive, lambda s: s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 99)
    )
    assert accepted["idle"] == 99


async def test_accepted_sockets_without_keepalive_have_none():
    listening, (accepted, timer) = await _accepted_options("127.0.0.1:0", KeepaliveSettings(enabled=False))
    assert listening["keepalive"] == 0 and accepted["keepalive"] == 0
    assert accepted["nodelay"] == 1
    assert timer != PROC_TIMER_KEEPALIVE
    _, (accepted, _) = await _accepted_options("127.0.0.1:0", None)
    assert accepted["keepalive"] == 0 and accepted["nodelay"] == 1


class _NoSockname:
    """An accepted socket whose local address must not be needed."""

    def getsockname(self):
        raise AssertionError("getsockname called for a target on a port no listener has")


class _Sockname:
    def __init__(self, addr: SocketAddr) -> None:
        self.addr = addr

    def getsockname(self):
        return self.addr.sockaddr()


def test_own_listener_is_decided_by_port_first_then_the_local_address():
    listener_ports = frozenset({15001, 15006})
    # Redirected to an app port: no listener has it, so the local address is never read.
    assert not is_own_listener(_NoSockname(), SocketAddr.parse("10.0.0.3:8080"), listener_ports)  # type: ignore[arg-type]
    local = SocketAddr.parse("10.0.0.2:15001")
    assert is_own_listener(_Sockname(local), local, listener_ports)  # type: ignore[arg-type]
    # A listener port, but another address (redirected to a proxy port of another host): not ours.
    assert not is_own_listener(_Sockname(local), SocketAddr.parse("10.0.0.9:15001"), listener_ports)  # type: ignore[arg-type]


async def test_a_client_that_dials_the_outbound_listener_itself_is_refused(caplog):
    # No redirect: the original destination is the listener's own address (the kernel-chosen
    # port, which ProxyInputs.illegal_ports holds once bound), so forwarding would loop.
    caplog.set_level(logging.WARNING, logger=access_logger().name)
    async with running_mesh(echo=False) as mesh:
        outbound = mesh.client.listeners["outbound"].bound_address
        assert outbound.port in mesh.client.pi.illegal_ports
        reader, writer = await asyncio.open_connection(str(outbound.ip), outbound.port)
        try:
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed unserved
        finally:
            writer.close()
    failed = [r for r in caplog.records if r.getMessage() == "connection failed"]
    assert [r.fields["error"] for r in failed] == [  # type: ignore[attr-defined]
        "connection to the outbound listener itself (not redirected) refused"
    ]
    assert failed[0].fields["dst.addr"] == str(outbound)  # type: ignore[attr-defined]


async def test_the_app_socket_of_an_inbound_stream_has_nodelay_and_keepalive():
    # ProxyInputs.connect sets TCP_NODELAY (our TCP transport sets no option of its own): read
    # back, the app socket of an HBONE stream has it.
    env = {
        "KEEPALIVE_TIME": "45s",
        "KEEPALIVE_INTERVAL": "7s",
        "KEEPALIVE_RETRIES": "4",
        "USER_TIMEOUT_ENABLED": "true",
    }
    async with running_mesh(server_env=env) as mesh:
        reader, writer = await mesh.socks_connect(SERVER_IP, ECHO_PORT)
        try:
            writer.write(b"x")
            assert await asyncio.wait_for(reader.readexactly(1), 10) == b"x"
            (relay,) = mesh.server.pi.connections.relays
            app = options(relay.upstream.transport.get_extra_info("socket"))
        finally:
            writer.close()
    assert app == CONFIGURED_OPTIONS


async def test_a_captured_client_that_reset_before_it_was_served_is_one_debug_line(caplog):
    # handle_captured takes the client's address from the transport (which read it when it was
    # made) instead of its own getpeername: for a client that reset first, the transport has
    # none, and the connection ends quietly, as the getpeername error did before.
    caplog.set_level(logging.DEBUG, logger="ambient_mesh.proxy")
    async with running_mesh(echo=False) as mesh:
        assert mesh.client.workload_proxy is not None
        outbound = mesh.client.workload_proxy.outbound
        listening = socket.create_server(("127.0.0.1", 0))
        try:
            client = socket.create_connection(listening.getsockname())
            accepted, _ = listening.accept()
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()  # RST before the proxy serves it
            await asyncio.sleep(0.05)
            accepted.setblocking(False)
            await asyncio.wait_for(outbound.handle_captured(accepted), 5)
        finally:
            listening.close()
        assert not mesh.client.pi.connections.relays
    records = [r for r in caplog.records if r.name.startswith("ambient_mesh.proxy")]
    assert not [r for r in records if r.exc_info or r.levelno >= logging.WARNING], records
    assert [r for r in records if "client gone before it was served" in r.getMessage()]


def test_worker_listener_sockets_carry_the_options_before_any_worker_serves_them():
    # ZTUNNEL_WORKER_THREADS: the owner binds and listens; the workers adopt the socket later. A
    # client that connects in between is accepted with the options the socket had before listen().
    config = ZtunnelConfig(
        keepalive_time_s=45, keepalive_interval_s=7, keepalive_retries=4, user_timeout_enabled=True
    )
    here = SocketAddr.parse("127.0.0.1:0")
    addresses = ListenerAddresses(outbound=here, inbound=here, inbound_plaintext=here, socks5=None)
    opened = open_listener_sockets(config, addresses, False)
    try:
        assert set(opened) == {"outbound", "inbound", "inbound plaintext"}
        for sock in opened.values():
            assert options(sock) == CONFIGURED_OPTIONS
            # One socket, one accept queue for every worker: no SO_REUSEPORT group unless asked
            # (INPOD_PORT_REUSE, as the single-process proxy sets it for pods).
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 0
        listener = opened["outbound"]
        with socket.create_connection(listener.getsockname()):
            ready, _, _ = select.select([listener], [], [], 5)
            accepted, _ = ready[0].accept()
            with accepted:
                assert options(accepted) == CONFIGURED_OPTIONS
    finally:
        for sock in opened.values():
            sock.close()
    pod = open_listener_sockets(config, addresses, False, reuse_port=True)
    try:
        assert {s.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) for s in pod.values()} == {1}
    finally:
        for sock in pod.values():
            sock.close()
