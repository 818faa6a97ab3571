"""`ambient demo` in its loopback layout: real `ambient ztunnel` processes, SOCKS5 client, no root.

Each test uses its own pair of loopback addresses so a leftover listener from one cannot change
another's outcome. The pure helpers (config rendering, log and metrics parsing, the plugged-in
CA files) are checked here too, next to the one command that uses them.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import socket
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from rich.console import Console

from ambient_mesh.demo import (
    CLIENT,
    SERVER,
    DemoMode,
    access_lines,
    parse_log_fields,
    render_local_config,
    run_demo,
    traffic_counters,
    write_plugged_in_ca,
)
from ambient_mesh.identity.ca import CertificateAuthority
from ambient_mesh.state.localconfig import parse_local_config

pytestmark = pytest.mark.timeout(60)

DEMO_BUDGET_S = 10.0
_PID = re.compile(r"pid (\d+)")


def recording_console(file=None) -> tuple[Console, io.StringIO]:
    buf = file or io.StringIO()
    return Console(file=buf, width=140, color_system=None, force_terminal=False), buf


def demo_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("ambient-demo-*")}


def assert_stopped(pids: list[int]) -> None:
    assert pids, "no proxy pid in the output"
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# --- pure helpers ------------------------------------------------------------------------------------


def test_local_config_parses_with_the_proxys_own_parser():
    config = render_local_config(client_ip="127.0.0.2", server_ip="127.0.0.3", vip="127.10.0.1")
    parsed = parse_local_config(yaml.safe_dump(config, sort_keys=False), "demo")
    assert [w.name for w in parsed.workloads] == ["client", "server"]
    assert [s.hostname for s in parsed.services] == ["echo.shop.svc.cluster.local"]


def test_plugged_in_ca_files_load_back(tmp_path):
    ca = CertificateAuthority.self_signed("cluster.local", now=datetime.now(UTC))
    write_plugged_in_ca(ca, tmp_path / "cacerts")
    loaded = CertificateAuthority.from_plugged_in_dir(tmp_path / "cacerts")
    assert loaded.root_pem == ca.root_pem
    assert (tmp_path / "cacerts" / "ca-key.pem").stat().st_mode & 0o077 == 0


def test_access_log_fields_are_parsed_with_quoted_values():
    text = (
        "2026-01-01T00:00:00Z\tinfo\taccess\tconnection complete\tsrc.addr=127.0.0.2:4000 "
        "src.identity=spiffe://cluster.local/ns/shop/sa/frontend direction=inbound bytes_sent=10 "
        'error="a \\"quoted\\" reason"\n'
        "2026-01-01T00:00:00Z\tinfo\tztunnel\tnode proxy ready\tmode=dedicated\n"
    )
    [line] = access_lines(text)
    assert line["src.identity"] == CLIENT.spiffe_id
    assert line["direction"] == "inbound"
    assert line["error"] == 'a "quoted" reason'
    assert parse_log_fields('x="unterminated') == {"x": '"unterminated'}


def test_traffic_counters_sum_per_peer_pair():
    registry = CollectorRegistry()
    names = (
        "reporter",
        "source_principal",
        "destination_principal",
        "destination_service",
        "connection_security_policy",
        "response_flags",
    )
    opened = Counter("istio_tcp_connections_opened", "", names, registry=registry)
    received = Counter("istio_tcp_received_bytes", "", names, registry=registry)
    Gauge("istio_build", "", ("component",), registry=registry).labels("ztunnel").set(1)
    values = ("destination", CLIENT.spiffe_id, SERVER.spiffe_id, "unknown", "mutual_tls")
    opened.labels(*values, "-").inc(2)
    opened.labels(*values, "CONNECT").inc()  # a failed one: same peers, another response flag
    received.labels(*values, "-").inc(131072)
    [row] = traffic_counters(generate_latest(registry).decode())
    assert (row.reporter, row.source_principal, row.destination_principal) == (
        "destination",
        CLIENT.spiffe_id,
        SERVER.spiffe_id,
    )
    assert (row.opened, row.received, row.sent, row.security_policy) == (3, 131072, 0, "mutual_tls")


# --- the demo --------------------------------------------------------------------------------------------


async def test_loopback_demo_shows_an_mtls_connection_and_cleans_up():
    before = demo_dirs()
    console, buf = recording_console()
    loop = asyncio.get_running_loop()
    started = loop.time()
    rc = await run_demo(
        verbose=True, mode=DemoMode.LOOPBACK, console=console, loopback_ips=("127.0.61.2", "127.0.61.3")
    )
    elapsed = loop.time() - started
    out = buf.getvalue()
    assert rc == 0, out
    assert elapsed < DEMO_BUDGET_S, out
    for expected in (
        "loopback",
        "via SOCKS5",
        "pod IP 127.0.61.3:8080",
        "service VIP",
        "65536 B echoed intact",
        "node-a proxy",
        "node-b proxy",
        CLIENT.spiffe_id,
        SERVER.spiffe_id,
        "mutual_tls",
        "reporter=source",
        "reporter=destination",
        "Available",
        "signed by this run's operator root",
        "PASS",
        "connection complete",  # the last one from --verbose's logs
    ):
        assert expected in out, f"{expected!r} missing from:\n{out}"
    assert "insecure built-in test CA" not in out, "the proxies did not use ROOT_CA_DIR"
    assert_stopped([int(p) for p in _PID.findall(out)])
    assert demo_dirs() == before


async def test_loopback_demo_fails_when_a_proxy_cannot_start():
    # Something else holds the server's HBONE port: its proxy cannot bind and exits.
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("127.0.62.3", 15008))
    squatter.listen(1)
    try:
        console, buf = recording_console()
        rc = await run_demo(mode="loopback", console=console, loopback_ips=("127.0.62.2", "127.0.62.3"))
    finally:
        squatter.close()
    out = buf.getvalue()
    assert rc == 1, out
    assert "node proxy on node-b exited" in out, out
    assert "node-b proxy log" in out, out
    assert "PASS" not in out
    assert_stopped([int(p) for p in _PID.findall(out)])


class CancelOnText(io.StringIO):
    """Console output that cancels a task once `text` has been written (a Ctrl-C stand-in)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.task: asyncio.Task | None = None

    def write(self, s: str) -> int:
        n = super().write(s)
        if self.task is not None and self.text in self.getvalue():
            self.task.cancel()
            self.task = None
        return n


async def test_loopback_demo_cleans_up_when_cancelled():
    before = demo_dirs()
    buf = CancelOnText("node-b: ambient ztunnel ready")
    console, _ = recording_console(buf)
    task = asyncio.create_task(
        run_demo(mode="loopback", console=console, loopback_ips=("127.0.63.2", "127.0.63.3"))
    )
    buf.task = task
    with pytest.raises(asyncio.CancelledError):
        await task
    out = buf.getvalue()
    assert "node-b: ambient ztunnel ready" in out
    assert "interrupted: proxies stopped" in out
    assert_stopped([int(p) for p in _PID.findall(out)])
    assert demo_dirs() == before
    # The echo app's port is free again.
    with socket.socket() as s:
        s.bind(("127.0.63.3", 8080))
