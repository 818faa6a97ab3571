"""SOCKS5 at its edges, against a running node proxy: every input gets an RFC 1928 reply, no
input makes a traceback, and the proxy refuses to call itself."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import struct

import pytest

from .mesh import CLIENT_IP, ECHO_PORT, SERVER_IP, running_mesh

GREETING = b"\x05\x01\x00"


def request(atyp: int, addr: bytes, port: int, command: int = 1) -> bytes:
    return bytes([5, command, 0, atyp]) + addr + port.to_bytes(2, "big")


def v4(ip: str, port: int) -> bytes:
    return request(1, socket.inet_aton(ip), port)


def domain(name: bytes, port: int) -> bytes:
    return request(3, bytes([len(name)]) + name, port)


async def exchange(mesh, data: bytes, expect: int) -> bytes:
    socks = mesh.client.listeners["socks5"].bound_address
    reader, writer = await asyncio.open_connection(str(socks.ip), socks.port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.readexactly(expect), 10)
    finally:
        writer.close()


def no_tracebacks(caplog) -> None:
    # Access-log lines of failed connections are at error level, as ztunnel's are; not a crash.
    bad = [
        r
        for r in caplog.records
        if r.exc_info or (r.levelno >= logging.ERROR and r.name != "ambient_mesh.access")
    ]
    assert not bad, [r.getMessage() for r in bad]


def failed_count(mesh, flag: str) -> float:
    text = mesh.client.metrics.render()[0].decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("istio_tcp_connections_failed_total{") and f'response_flags="{flag}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.parametrize(
    ("data", "reply"),
    [
        (b"\x04\x01\x00\x50\x7f\x00\x00\x01\x00", b"\x05\xff"),  # a SOCKS4 client
        (b"\x05\x00", b"\x05\xff"),  # no methods
        (b"\x05\x01\x02", b"\x05\xff"),  # username/password only
        (GREETING + b"\x04\x01\x00\x01\x7f\x00\x00\x01\x00\x50", b"\x05\x00\x05\x01"),  # bad version
        (GREETING + request(1, b"\x7f\x00\x00\x01", 80, command=2), b"\x05\x00\x05\x07"),  # BIND
        (GREETING + request(1, b"\x7f\x00\x00\x01", 80, command=3), b"\x05\x00\x05\x07"),  # UDP
        (GREETING + b"\x05\x01\x00\x09", b"\x05\x00\x05\x08"),  # address type 9
        (GREETING + domain(b"x" * 255, 80), b"\x05\x00\x05\x01"),  # a 255-byte label
        (GREETING + domain(b"a..b", 80), b"\x05\x00\x05\x01"),
        (GREETING + domain(b"no-such-name.invalid", 80), b"\x05\x00\x05\x04"),  # does not resolve
    ],
)
async def test_every_bad_input_gets_an_rfc1928_reply(caplog, data: bytes, reply: bytes):
    async with running_mesh() as mesh:
        got = await exchange(mesh, data, len(reply))
        assert got == reply
    no_tracebacks(caplog)


@pytest.mark.parametrize(
    "target",
    [
        ("0.0.0.0", 15008),  # reached the proxy's own HBONE listener before
        ("0.0.0.0", ECHO_PORT),
        ("127.0.0.1", 15008),
        (CLIENT_IP, 15008),  # the workload's own address on the proxy's port
    ],
)
async def test_self_calls_are_refused_not_allowed(caplog, target):
    caplog.set_level(logging.INFO, logger="ambient_mesh.proxy.socks5")
    async with running_mesh() as mesh:
        before = failed_count(mesh, "CONNECT")
        got = await exchange(mesh, GREETING + v4(*target), 12)
        assert got == b"\x05\x00\x05\x02" + b"\x00\x01" + bytes(6)  # REP 2: not allowed by ruleset
        assert failed_count(mesh, "CONNECT") == before + 1
    lines = [r.getMessage() for r in caplog.records if r.name == "ambient_mesh.proxy.socks5"]
    assert any("self call" in line and "NOT_ALLOWED" in line for line in lines), lines
    no_tracebacks(caplog)


async def test_the_proxys_own_listener_ports_are_refused(caplog):
    async with running_mesh() as mesh:
        for name in ("outbound", "socks5", "inbound plaintext"):
            own = mesh.client.listeners[name].bound_address
            got = await exchange(mesh, GREETING + v4(str(own.ip), own.port), 4)
            assert got == b"\x05\x00\x05\x02", name
    no_tracebacks(caplog)


async def test_connection_refused_is_reply_5_and_success_comes_after_connecting(caplog):
    async with running_mesh() as mesh:
        # Nothing listens on 127.0.0.9:9 (plain passthrough): refused, not "succeeded".
        got = await exchange(mesh, GREETING + v4("127.0.0.9", 9), 4)
        assert got == b"\x05\x00\x05\x05"
        reader, writer = await mesh.socks_connect(SERVER_IP, ECHO_PORT)
        writer.write(b"ping")
        assert await asyncio.wait_for(reader.readexactly(4), 10) == b"ping"
        writer.close()
    no_tracebacks(caplog)


async def test_clients_that_reset_early_leave_no_traceback_and_no_connection(caplog):
    async with running_mesh() as mesh:
        socks = mesh.client.listeners["socks5"].bound_address
        payloads = [b"", GREETING, GREETING + v4(SERVER_IP, ECHO_PORT)]
        for payload in payloads * 5:
            s = socket.create_connection((str(socks.ip), socks.port))
            if payload:
                s.sendall(payload)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()  # RST: before the handler, mid-handshake, or before the success reply
        for _ in range(200):
            if not mesh.client.pi.connections.tasks and not mesh.client.pi.connections.relays:
                break
            await asyncio.sleep(0.02)
        assert not mesh.client.pi.connections.relays
        # Still serving.
        reader, writer = await mesh.socks_connect(SERVER_IP, ECHO_PORT)
        writer.write(b"ok")
        assert await asyncio.wait_for(reader.readexactly(2), 10) == b"ok"
        writer.close()
    no_tracebacks(caplog)
    assert not [r for r in caplog.records if re.search("Traceback", r.getMessage())]
