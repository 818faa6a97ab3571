"""`ambient demo`: two node proxies, a client and a server, one connection over HBONE with mTLS.

Everything runs on this host, nothing outside is contacted. Two real `ambient ztunnel`
processes (dedicated mode, one per simulated node) sign their workloads' certificates with an
operator root the demo generates (FAKE_CA + ROOT_CA_DIR, Istio's plugged-in CA layout) and read
a generated local config (LOCAL_XDS_PATH). The demo then sends bytes from the client to the
server's pod IP and to a service VIP, and reports what the proxies saw: their access logs
(`connection complete` lines), their /metrics and the server workload's certificate.

Two layouts, chosen automatically:

- netns (root, `ip netns`, iptables): one network namespace per node on a private bridge
  (`host.netns.Fabric`), dedicated-mode capture rules in each pod; the client is a plain
  connect() that iptables hands to its proxy, as in ztunnel's namespaced tests.
- loopback (anyone): the proxies listen on two loopback addresses and the client enters through
  its proxy's SOCKS5 listener, as in ztunnel's direct tests.

Counterparts: ztunnel's local "try it" setups (local xDS file + FAKE_CA) and the namespaced
test harness. The pure parts (config rendering, log and metrics parsing, certificate summary)
come first; the asyncio shell that starts and stops things follows.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import enum
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families
from rich import box
from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from .errors import AmbientError
from .identity import ca as ca_files
from .identity.ca import CertificateAuthority

TRUST_DOMAIN = "cluster.local"
NAMESPACE = "shop"
APP_PORT = 8080
SERVICE_PORT = 80
SERVICE_NAME = "echo"
SERVICE_HOST = f"{SERVICE_NAME}.{NAMESPACE}.svc.cluster.local"
HBONE_PORT = 15008
OUTBOUND_PORT = 15001
INBOUND_PLAINTEXT_PORT = 15006
SOCKS5_PORT = 15080
DNS_PROXY_ADDR = "127.0.0.1:15053"
PACKET_MARK = 1337
ADMIN_PORT = 15000
STATS_PORT = 15020
READINESS_PORT = 15021

LOOPBACK_CLIENT_IP = "127.0.0.2"
LOOPBACK_SERVER_IP = "127.0.0.3"
LOOPBACK_VIP = "127.10.0.1"
NETNS_VIP = "10.96.0.50"

PAYLOAD_BYTES = 64 * 1024
READ_BYTES = 64 * 1024
PROXY_READY_TIMEOUT_S = 10.0
HTTP_TIMEOUT_S = 2.0
CONNECT_TIMEOUT_S = 3.0
TRANSFER_TIMEOUT_S = 5.0
ACCESS_LOG_TIMEOUT_S = 5.0
POLL_INTERVAL_S = 0.05
# The proxies drain for max(1, grace - 1) seconds on SIGTERM: keep shutdown quick.
PROXY_TERMINATION_GRACE_S = 2
LOG_TAIL_LINES = 25

ACCESS_LINE_MARKER = "connection complete"
TRAFFIC_METRICS = {
    "istio_tcp_connections_opened": "opened",
    "istio_tcp_connections_closed": "closed",
    "istio_tcp_received_bytes": "received",
    "istio_tcp_sent_bytes": "sent",
}

_FIELD = re.compile(r'([\w.]+)=("(?:[^"\\]|\\.)*"|\S+)')


class DemoMode(enum.Enum):
    NETNS = "netns"
    LOOPBACK = "loopback"


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoWorkload:
    name: str
    service_account: str
    node: str
    namespace: str = NAMESPACE

    @property
    def spiffe_id(self) -> str:
        return f"spiffe://{TRUST_DOMAIN}/ns/{self.namespace}/sa/{self.service_account}"

    @property
    def proxy_workload_info(self) -> str:
        return f"{self.namespace}/{self.name}/{self.service_account}"

    @property
    def label(self) -> str:
        return f"{self.namespace}/{self.name}"


CLIENT = DemoWorkload(name="client", service_account="frontend", node="node-a")
SERVER = DemoWorkload(name="server", service_account="echo", node="node-b")


# --- pure parts: config, logs, metrics, certificates ---------------------------------------------


def render_local_config(*, client_ip: str, server_ip: str, vip: str) -> dict[str, Any]:
    """ztunnel's local xDS file: the two HBONE pods and the service in front of the server."""

    def workload(w: DemoWorkload, ip: str) -> dict[str, Any]:
        return {
            "uid": f"Kubernetes//Pod/{w.namespace}/{w.name}",
            "name": w.name,
            "namespace": w.namespace,
            "serviceAccount": w.service_account,
            "trustDomain": TRUST_DOMAIN,
            "workloadIps": [ip],
            "protocol": "HBONE",
            "node": w.node,
            "canonicalName": w.name,
            "canonicalRevision": "v1",
            "workloadName": w.name,
        }

    server = workload(SERVER, server_ip)
    server["services"] = {f"{NAMESPACE}/{SERVICE_HOST}": {SERVICE_PORT: APP_PORT}}
    return {
        "workloads": [workload(CLIENT, client_ip), server],
        "services": [
            {
                "name": SERVICE_NAME,
                "namespace": NAMESPACE,
                "hostname": SERVICE_HOST,
                "vips": [f"/{vip}"],
                "ports": {SERVICE_PORT: APP_PORT},
            }
        ],
    }


def write_plugged_in_ca(ca: CertificateAuthority, directory: Path) -> None:
    """Istio's plugged-in CA files (the `cacerts` secret layout) for a root that signs directly."""
    from cryptography.hazmat.primitives import serialization

    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    cert_pem = ca.signing_cert.public_bytes(serialization.Encoding.PEM)
    key_pem = ca.signing_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    key_path = directory / ca_files.CA_KEY_FILE
    key_path.touch(mode=0o600)
    key_path.write_bytes(key_pem)
    (directory / ca_files.CA_CERT_FILE).write_bytes(cert_pem)
    (directory / ca_files.ROOT_CERT_FILE).write_bytes(ca.root_pem)
    (directory / ca_files.CERT_CHAIN_FILE).write_bytes(cert_pem)


def parse_log_fields(line: str) -> dict[str, str]:
    """`key=value` fields of a plain-text log line; quoted values are JSON strings."""
    fields = {}
    for key, value in _FIELD.findall(line):
        if value.startswith('"'):
            with contextlib.suppress(ValueError):
                value = json.loads(value)
        fields[key] = value
    return fields


def access_lines(text: str) -> list[dict[str, str]]:
    return [parse_log_fields(line) for line in text.splitlines() if ACCESS_LINE_MARKER in line]


@dataclass(frozen=True, slots=True, kw_only=True)
class TrafficCounters:
    """One proxy's TCP counters for one (reporter, source, destination, security) label set."""

    reporter: str
    source_principal: str
    destination_principal: str
    destination_service: str
    security_policy: str
    opened: int = 0
    closed: int = 0
    received: int = 0
    sent: int = 0


def traffic_counters(metrics_text: str) -> list[TrafficCounters]:
    """The istio_tcp_* counters of a Prometheus text exposition, summed per peer pair."""
    rows: dict[tuple[str, ...], dict[str, int]] = {}
    for family in text_string_to_metric_families(metrics_text):
        # The 0.0.4 text format names counter families with their `_total` suffix.
        column = TRAFFIC_METRICS.get(family.name.removesuffix("_total"))
        if column is None:
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            labels = sample.labels
            key = (
                labels.get("reporter", "unknown"),
                labels.get("source_principal", "unknown"),
                labels.get("destination_principal", "unknown"),
                labels.get("destination_service", "unknown"),
                labels.get("connection_security_policy", "unknown"),
            )
            counts = rows.setdefault(key, {})
            counts[column] = counts.get(column, 0) + int(sample.value)
    return [
        TrafficCounters(
            reporter=k[0],
            source_principal=k[1],
            destination_principal=k[2],
            destination_service=k[3],
            security_policy=k[4],
            **counts,
        )
        for k, counts in sorted(rows.items())
    ]


@dataclass(frozen=True, slots=True, kw_only=True)
class CertificateSummary:
    identity: str
    state: str
    serial: str
    valid_from: str
    expires: str
    issuer: str
    san: str
    chains_to_demo_root: bool


def summarize_certificate(dump: dict[str, Any], identity: str, root_pem: bytes) -> CertificateSummary | None:
    """The `certificates` entry of a /config_dump for `identity`, checked against the demo root."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature

    for entry in dump.get("certificates", []):
        if entry.get("identity") != identity:
            continue
        chain = entry.get("certChain") or [{}]
        leaf_info = chain[0]
        issuer = san = ""
        chains = False
        try:
            leaf = x509.load_pem_x509_certificate(base64.b64decode(leaf_info.get("pem", "")))
            root = x509.load_pem_x509_certificate(root_pem)
            issuer = leaf.issuer.rfc4514_string()
            sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            san = ", ".join(sans.get_values_for_type(x509.UniformResourceIdentifier))
            try:
                leaf.verify_directly_issued_by(root)
                chains = True
            except (ValueError, TypeError, InvalidSignature):
                chains = False
        except (ValueError, binascii.Error, x509.ExtensionNotFound):
            pass
        return CertificateSummary(
            identity=identity,
            state=str(entry.get("state", "?")),
            serial=str(leaf_info.get("serialNumber", "?")),
            valid_from=str(leaf_info.get("validFrom", "?")),
            expires=str(leaf_info.get("expirationTime", "?")),
            issuer=issuer,
            san=san,
            chains_to_demo_root=chains,
        )
    return None


def fingerprint(cert_pem: bytes) -> str:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    digest = x509.load_pem_x509_certificate(cert_pem).fingerprint(hashes.SHA256()).hex()
    return ":".join(digest[i : i + 2] for i in range(0, 16, 2)) + "…"


def netns_unavailable_reason() -> str | None:
    """Why the namespace layout cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "not root"
    for tool in ("ip", "iptables-restore", "iptables"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    if not Path("/run/netns").parent.exists():
        return "/run is missing"
    return None


# --- the shell: processes, sockets, HTTP ---------------------------------------------------------


@dataclass(slots=True)
class NodeProxy:
    """One `ambient ztunnel` process and where the demo reaches its admin endpoints."""

    node: str
    workload: DemoWorkload
    ip: str
    netns: str | None
    http_host: str
    admin_port: int
    stats_port: int
    readiness_port: int
    log: Path
    process: subprocess.Popen | None = None
    socks_port: int | None = None

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def log_size(self) -> int:
        try:
            return self.log.stat().st_size
        except OSError:
            return 0

    def access_lines_since(self, offset: int) -> list[dict[str, str]]:
        try:
            with open(self.log, "rb") as f:
                f.seek(offset)
                return access_lines(f.read().decode(errors="replace"))
        except OSError:
            return []


@dataclass(slots=True)
class Attempt:
    """One client connection and what each side reported about it."""

    path: str
    target: str
    sent: int = 0
    received: int = 0
    intact: bool = False
    error: str | None = None
    elapsed_ms: float = 0.0
    app_peer: str | None = None
    client_line: dict[str, str] | None = None
    server_line: dict[str, str] | None = None

    @property
    def ok(self) -> bool:
        return (
            self.intact
            and self.server_line is not None
            and self.server_line.get("src.identity") == CLIENT.spiffe_id
        )


@dataclass(slots=True)
class Demo:
    mode: DemoMode
    workdir: Path
    client_ip: str
    server_ip: str
    vip: str
    proxies: list[NodeProxy] = field(default_factory=list)
    app_peers: list[str] = field(default_factory=list)
    root_pem: bytes = b""
    ca_dir: Path | None = None
    config_path: Path | None = None

    @property
    def client_proxy(self) -> NodeProxy:
        return self.proxies[0]

    @property
    def server_proxy(self) -> NodeProxy:
        return self.proxies[1]


def proxy_argv() -> list[str]:
    script = Path(sys.executable).with_name("ambient")
    if script.exists():
        return [str(script), "ztunnel"]
    return [sys.executable, "-m", "ambient_mesh.cli", "ztunnel"]


def free_port(ip: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def _new_socket(netns: str | None, family: int = socket.AF_INET) -> socket.socket:
    if netns is None:
        return socket.socket(family, socket.SOCK_STREAM)
    from .host.netns import netns_socket

    return netns_socket(netns, family)


async def open_tcp(
    netns: str | None,
    host: str,
    port: int,
    *,
    bind_ip: str | None = None,
    timeout_s: float = CONNECT_TIMEOUT_S,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A TCP connection made from inside `netns` (or from here), as asyncio streams."""
    sock = _new_socket(netns)
    sock.setblocking(False)
    try:
        if bind_ip:
            sock.bind((bind_ip, 0))
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (host, port)), timeout_s)
        return await asyncio.open_connection(sock=sock)
    except BaseException:
        sock.close()
        raise


async def http_get(
    netns: str | None, host: str, port: int, path: str, *, timeout_s: float = HTTP_TIMEOUT_S
) -> tuple[int, bytes]:
    """GET over HTTP/1.1 with `Connection: close` (the admin servers answer one request each)."""

    async def go() -> tuple[int, bytes]:
        reader, writer = await open_tcp(netns, host, port, timeout_s=timeout_s)
        try:
            writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            await writer.drain()
            data = await reader.read(-1)
        finally:
            writer.close()
        head, _, body = data.partition(b"\r\n\r\n")
        status_line = head.split(b"\r\n", 1)[0].split()
        if len(status_line) < 2 or not status_line[1].isdigit():
            raise ConnectionError(f"not an HTTP response from {host}:{port}")
        return int(status_line[1]), body

    return await asyncio.wait_for(go(), timeout_s)


async def admin_get(proxy: NodeProxy, port: int, path: str) -> bytes:
    """The body of a 200 answer from one of the proxy's HTTP endpoints (ValueError otherwise)."""
    status, body = await http_get(proxy.netns, proxy.http_host, port, path)
    if status != 200:
        first = body.decode(errors="replace").strip().splitlines()[:1]
        raise ValueError(f"HTTP {status} {first[0] if first else ''}".strip())
    return body


async def socks5_connect(proxy_ip: str, socks_port: int, dst_ip: str, dst_port: int, *, bind_ip: str):
    """CONNECT through a SOCKS5 listener (RFC 1928, no authentication, IPv4 destination)."""
    reader, writer = await open_tcp(None, proxy_ip, socks_port, bind_ip=bind_ip)
    try:
        writer.write(
            b"\x05\x01\x00" + b"\x05\x01\x00\x01" + socket.inet_aton(dst_ip) + dst_port.to_bytes(2, "big")
        )
        await writer.drain()
        greeting = await asyncio.wait_for(reader.readexactly(2), CONNECT_TIMEOUT_S)
        reply = await asyncio.wait_for(reader.readexactly(10), CONNECT_TIMEOUT_S)
    except BaseException:
        writer.close()
        raise
    if greeting != b"\x05\x00" or reply[1] != 0:
        writer.close()
        raise ConnectionRefusedError(f"SOCKS5 refused the connection (reply code {reply[1]})")
    return reader, writer


async def echo_handler(peers: list[str], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    peer = writer.get_extra_info("peername")
    peers.append(str(peer[0]) if peer else "?")
    try:
        while data := await reader.read(READ_BYTES):
            writer.write(data)
            await writer.drain()
        writer.write_eof()
    except OSError:
        pass
    finally:
        writer.close()


async def start_echo_app(demo: Demo, netns: str | None) -> asyncio.Server:
    """The server workload's app: an echo server on the server pod's port 8080."""

    def handler(reader, writer):
        return echo_handler(demo.app_peers, reader, writer)

    if netns is None:
        return await asyncio.start_server(handler, demo.server_ip, APP_PORT)
    sock = _new_socket(netns)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("0.0.0.0", APP_PORT))
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return await asyncio.start_server(handler, sock=sock)


def proxy_env(demo: Demo, proxy: NodeProxy) -> dict[str, str]:
    env = dict(os.environ)
    for name in list(env):
        # Inherited proxy settings would change what the demo shows.
        if name.endswith("_ADDR") or name in (
            "PROXY_MODE",
            "PACKET_MARK",
            "LOG_FORMAT",
            "RUST_LOG",
            "ROOT_CA_DIR",
        ):
            env.pop(name)
    env.update(
        {
            "PROXY_MODE": "dedicated",
            "PROXY_WORKLOAD_INFO": proxy.workload.proxy_workload_info,
            "NODE_NAME": proxy.node,
            "FAKE_CA": "true",
            "XDS_ADDRESS": "",
            "LOCAL_XDS_PATH": str(demo.config_path),
            "TERMINATION_GRACE_PERIOD_SECONDS": str(PROXY_TERMINATION_GRACE_S),
            "ADMIN_ADDR": f"{proxy.http_host}:{proxy.admin_port}",
            "STATS_ADDR": f"{proxy.http_host}:{proxy.stats_port}",
            "READINESS_ADDR": f"{proxy.http_host}:{proxy.readiness_port}",
            # In the loopback layout both proxies share one namespace: each takes its own address.
            "ISTIO_META_DNS_PROXY_ADDR": DNS_PROXY_ADDR
            if demo.mode is DemoMode.NETNS
            else f"{proxy.http_host}:0",
        }
    )
    if demo.ca_dir is not None:
        env["ROOT_CA_DIR"] = str(demo.ca_dir)
    if demo.mode is DemoMode.NETNS:
        # Every listener spelled out, so /config_dump shows the layout the capture rules expect.
        env.update(
            {
                "PACKET_MARK": str(PACKET_MARK),
                "OUTBOUND_ADDR": f"0.0.0.0:{OUTBOUND_PORT}",
                "INBOUND_ADDR": f"0.0.0.0:{HBONE_PORT}",
                "INBOUND_PLAINTEXT_ADDR": f"0.0.0.0:{INBOUND_PLAINTEXT_PORT}",
                "SOCKS5_ADDR": f"127.0.0.1:{SOCKS5_PORT}",  # not enabled; named so the dump shows it
            }
        )
    else:
        ip = proxy.ip
        env.update(
            {
                "UNSTABLE_ENABLE_SOCKS5": "true",
                "OUTBOUND_ADDR": f"{ip}:0",
                "INBOUND_ADDR": f"{ip}:{HBONE_PORT}",
                "INBOUND_PLAINTEXT_ADDR": f"{ip}:0",
                "SOCKS5_ADDR": f"{ip}:{proxy.socks_port}",
            }
        )
    return env


async def wait_ready(proxy: NodeProxy, deadline: float) -> None:
    while True:
        if proxy.process is not None and proxy.process.poll() is not None:
            raise AmbientError(
                f"the node proxy on {proxy.node} exited with code {proxy.process.returncode}",
                hint=f"its log is below (is port {HBONE_PORT} on {proxy.ip} taken?)",
            )
        with contextlib.suppress(OSError, asyncio.TimeoutError, ConnectionError):
            status, _ = await http_get(proxy.netns, proxy.http_host, proxy.readiness_port, "/healthz/ready")
            if status == 200:
                return
        if time.monotonic() >= deadline:
            raise AmbientError(
                f"the node proxy on {proxy.node} was not ready after {PROXY_READY_TIMEOUT_S:g}s"
            )
        await asyncio.sleep(POLL_INTERVAL_S)


def stop_proxy(proxy: NodeProxy) -> None:
    from .host.netns import stop_process

    if proxy.process is not None:
        stop_process(proxy.process)


async def roundtrip(demo: Demo, attempt: Attempt, dst_ip: str, dst_port: int) -> None:
    """Send the payload, half-close, read the echo; record the outcome in `attempt`.

    Connection failures are results (attempt.error), not exceptions; cancellation propagates.
    """
    payload = hashlib.sha256(b"ambient demo").digest() * (PAYLOAD_BYTES // 32)
    peers_before = len(demo.app_peers)
    started = time.monotonic()
    try:
        echoed = await asyncio.wait_for(_echo_roundtrip(demo, dst_ip, dst_port, payload), TRANSFER_TIMEOUT_S)
    except* (TimeoutError, OSError, asyncio.IncompleteReadError) as group:
        e = group.exceptions[0]
        attempt.error = (
            f"{type(e).__name__}: {e}" if str(e) else f"{type(e).__name__} after {TRANSFER_TIMEOUT_S:g}s"
        )
    else:
        attempt.sent, attempt.received = len(payload), len(echoed)
        attempt.intact = echoed == payload
        if not attempt.intact:
            attempt.error = f"echo differs: sent {len(payload)} bytes, got {len(echoed)} back"
    attempt.elapsed_ms = (time.monotonic() - started) * 1000
    if len(demo.app_peers) > peers_before:
        attempt.app_peer = demo.app_peers[peers_before]


async def _echo_roundtrip(demo: Demo, dst_ip: str, dst_port: int, payload: bytes) -> bytes:
    if demo.mode is DemoMode.NETNS:
        reader, writer = await open_tcp(demo.client_proxy.netns, dst_ip, dst_port)
    else:
        reader, writer = await socks5_connect(
            demo.client_ip, demo.client_proxy.socks_port or 0, dst_ip, dst_port, bind_ip=demo.client_ip
        )

    async def send() -> None:
        writer.write(payload)
        await writer.drain()
        writer.write_eof()

    async def receive() -> bytes:
        chunks = []
        while chunk := await reader.read(READ_BYTES):
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        # Send and receive together: the echo comes back while we are still sending.
        async with asyncio.TaskGroup() as tg:
            tg.create_task(send())
            received = tg.create_task(receive())
        return received.result()
    finally:
        writer.close()


async def wait_access_lines(demo: Demo, attempt: Attempt, client_since: int, server_since: int) -> None:
    """The client proxy's outbound and the server proxy's inbound line for this connection."""
    deadline = time.monotonic() + ACCESS_LOG_TIMEOUT_S
    while True:
        if attempt.client_line is None:
            attempt.client_line = next(
                (
                    f
                    for f in demo.client_proxy.access_lines_since(client_since)
                    if f.get("direction") == "outbound"
                ),
                None,
            )
        if attempt.server_line is None:
            attempt.server_line = next(
                (
                    f
                    for f in demo.server_proxy.access_lines_since(server_since)
                    if f.get("direction") == "inbound"
                ),
                None,
            )
        if (attempt.client_line and attempt.server_line) or time.monotonic() >= deadline:
            return
        await asyncio.sleep(POLL_INTERVAL_S)


# --- output ----------------------------------------------------------------------------------------


class Steps:
    """Progress lines: `✓ what (time)` when a step ends, `✗ what` when it raises."""

    def __init__(self, console: Console) -> None:
        self.console = console

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        except BaseException:
            self.console.print(f"  [bold red]✗[/] {what}")
            raise
        elapsed_ms = (time.monotonic() - started) * 1000
        self.console.print(f"  [green]✓[/] {what} [dim]{elapsed_ms:.0f} ms[/]")

    def note(self, text: str) -> None:
        self.console.print(f"    [dim]{text}[/]")


def _grid() -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold cyan", no_wrap=True)
    grid.add_column()
    return grid


def header(demo: Demo, why_loopback: str | None) -> Panel:
    grid = _grid()
    if demo.mode is DemoMode.NETNS:
        grid.add_row("layout", "[bold]netns[/]: a network namespace per pod, iptables capture")
    else:
        grid.add_row("layout", f"[bold]loopback[/]: client enters via SOCKS5 [dim]({why_loopback})[/]")
    grid.add_row(CLIENT.node, f"{demo.client_ip:<12} pod [bold]{CLIENT.label}[/] + ambient ztunnel")
    grid.add_row(
        SERVER.node, f"{demo.server_ip:<12} pod [bold]{SERVER.label}[/] (echo :{APP_PORT}) + ambient ztunnel"
    )
    grid.add_row("service", f"{SERVICE_HOST} = {demo.vip}:{SERVICE_PORT}")
    grid.add_row("CA", "an operator root made for this run (FAKE_CA + ROOT_CA_DIR)")
    return Panel(
        grid,
        title="[bold]ambient demo[/]: one connection over HBONE + mTLS",
        title_align="left",
        box=box.ROUNDED,
        expand=False,
    )


def _identity(spiffe: str | None) -> str:
    return f"[green]{spiffe}[/]" if spiffe else "[red]no peer identity (not mTLS)[/]"


def _endpoint(line: dict[str, str], side: str) -> str:
    name = f"{line.get(f'{side}.namespace', '?')}/{line.get(f'{side}.workload', '?')}"
    if side == "dst" and line.get("dst.service"):
        name += f" [dim]via {line['dst.service']}[/]"
    return f"{name}\n  {_identity(line.get(f'{side}.identity'))}"


def calls_table(attempt: Attempt, index: int) -> Table:
    if attempt.intact:
        outcome = f"[green]{attempt.received} B echoed intact[/]"
    else:
        outcome = f"[red]{attempt.error or 'failed'}[/]"
    table = Table(
        title=f"[bold]{index}. {attempt.path}[/] {attempt.target}: {outcome}",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        padding=(0, 1),
    )
    table.add_column("seen by", no_wrap=True)
    table.add_column("source → destination")
    table.add_column("bytes", justify="right", no_wrap=True)
    rows = [
        (f"{CLIENT.node} proxy\noutbound", attempt.client_line),
        (f"{SERVER.node} proxy\ninbound", attempt.server_line),
    ]
    for who, line in rows:
        if line is None:
            table.add_row(who, "[red]no `connection complete` line in its log[/]", "")
            continue
        flow = f"{_endpoint(line, 'src')}\n→ {_endpoint(line, 'dst')}"
        if line.get("error"):
            flow += f"\n[red]error: {line['error']}[/]"
        sent_recv = f"{line.get('bytes_sent', '?')} sent\n{line.get('bytes_recv', '?')} recv"
        if line.get("duration"):
            sent_recv += f"\n[dim]{line['duration']}[/]"
        table.add_row(who, flow, sent_recv)
    return table


def counters_table(counted: Sequence[tuple[NodeProxy, list[TrafficCounters]]]) -> Table:
    table = Table(
        title="[bold]What each proxy counted[/] (/metrics, istio_tcp_*)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        padding=(0, 1),
    )
    table.add_column("source_principal → destination_principal")
    table.add_column("conns", justify="right", no_wrap=True)
    table.add_column("bytes", justify="right", no_wrap=True)
    for n, (proxy, rows) in enumerate(counted):
        if n:
            table.add_section()
        table.add_row(f"[bold]{proxy.node} proxy[/]", "", "")
        if not rows:
            table.add_row("  [red]no istio_tcp_* samples[/]", "", "")
        for i, row in enumerate(rows):
            if i:
                table.add_row("", "", "")
            style = "green" if row.security_policy == "mutual_tls" else "yellow"
            flow = (
                f"  {row.source_principal}\n  → {row.destination_principal}\n"
                f"  [{style}]{row.security_policy}[/] [dim]reporter={row.reporter}[/]"
            )
            if row.destination_service != "unknown":
                flow += f"\n  [dim]service {row.destination_service}[/]"
            table.add_row(
                flow, f"{row.opened} opened\n{row.closed} closed", f"{row.received} recv\n{row.sent} sent"
            )
    return table


def certificate_panel(summary: CertificateSummary | None, proxy: NodeProxy) -> Panel:
    if summary is None:
        body: Any = Text(f"no certificate for {SERVER.spiffe_id} in {proxy.node}'s /config_dump", style="red")
    else:
        grid = _grid()
        grid.add_row("identity", summary.identity)
        grid.add_row("state", f"[green]{summary.state}[/]" if summary.state == "Available" else summary.state)
        grid.add_row("URI SAN", summary.san or "?")
        grid.add_row("valid", f"{summary.valid_from} → {summary.expires}")
        grid.add_row("serial", summary.serial)
        chains = (
            "[green]signed by this run's operator root[/]"
            if summary.chains_to_demo_root
            else "[red]not signed by this run's root[/]"
        )
        grid.add_row("issuer", f"{summary.issuer or '?'}, {chains}")
        body = grid
    return Panel(
        body,
        title=f"[bold]Server workload certificate[/] ({proxy.node} /config_dump)",
        title_align="left",
        box=box.ROUNDED,
        expand=False,
    )


def verdict(attempts: Sequence[Attempt]) -> Text:
    if attempts and all(a.ok for a in attempts):
        return Text.from_markup(
            f"[bold green]PASS[/] {CLIENT.label} called {SERVER.label} {len(attempts)} times over HBONE; the "
            f"server's proxy verified the caller as {CLIENT.spiffe_id}; every byte came back."
        )
    problems = []
    for a in attempts:
        if not a.intact:
            problems.append(f"{a.path}: {a.error or 'echo failed'}")
        elif a.server_line is None:
            problems.append(f"{a.path}: the server proxy logged no inbound connection")
        elif a.server_line.get("src.identity") != CLIENT.spiffe_id:
            problems.append(
                f"{a.path}: the server proxy saw identity {a.server_line.get('src.identity')!r}, "
                f"expected {CLIENT.spiffe_id}"
            )
    return Text.from_markup("[bold red]FAIL[/] " + "; ".join(problems or ["no connection was made"]))


def print_logs(console: Console, demo: Demo, *, tail: int | None) -> None:
    for proxy in demo.proxies:
        lines = proxy.log_text().splitlines()
        if tail is not None:
            lines = lines[-tail:]
        title = f"{proxy.node} proxy log" + (f" (last {tail} lines)" if tail else "")
        console.print(
            Panel(
                Text("\n".join(lines) or "(empty)", overflow="fold"),
                title=title,
                title_align="left",
                box=box.MINIMAL,
            )
        )


# --- orchestration ---------------------------------------------------------------------------------


async def start_proxies(demo: Demo, steps: Steps, spawn) -> None:
    spawned = time.monotonic()
    deadline = spawned + PROXY_READY_TIMEOUT_S
    for proxy in demo.proxies:
        with open(proxy.log, "wb") as out:
            proxy.process = spawn(
                proxy, proxy_argv(), env=proxy_env(demo, proxy), cwd=demo.workdir, stdout=out, stderr=out
            )
    for proxy in demo.proxies:
        what = f"{proxy.node}: ambient ztunnel ready [dim](pid {proxy.process.pid}, HBONE on {proxy.ip}:{HBONE_PORT})[/]"
        try:
            await wait_ready(proxy, deadline)
        except BaseException:
            steps.console.print(f"  [bold red]✗[/] {what}")
            raise
        # Both start together: time since the spawn, not since the previous step.
        steps.console.print(f"  [green]✓[/] {what} [dim]{(time.monotonic() - spawned) * 1000:.0f} ms[/]")


async def exercise(demo: Demo, steps: Steps) -> list[Attempt]:
    attempts = [
        Attempt(path="pod IP", target=f"{demo.server_ip}:{APP_PORT}"),
        Attempt(path="service VIP", target=f"{demo.vip}:{SERVICE_PORT}"),
    ]
    how = "plain connect()" if demo.mode is DemoMode.NETNS else "via SOCKS5"
    for attempt, (ip, port) in zip(
        attempts, [(demo.server_ip, APP_PORT), (demo.vip, SERVICE_PORT)], strict=True
    ):
        client_since, server_since = demo.client_proxy.log_size(), demo.server_proxy.log_size()
        await roundtrip(demo, attempt, ip, port)
        what = f"client → {attempt.path} {attempt.target} [dim]({how})[/]"
        if attempt.intact:
            steps.console.print(
                f"  [green]✓[/] {what}: {attempt.received} B echoed [dim]{attempt.elapsed_ms:.0f} ms[/]"
            )
        else:
            steps.console.print(f"  [bold red]✗[/] {what}: {attempt.error}")
        await wait_access_lines(demo, attempt, client_since, server_since)
    return attempts


async def report(demo: Demo, console: Console, attempts: list[Attempt]) -> None:
    counted = []
    for proxy in demo.proxies:
        try:
            body = await admin_get(proxy, proxy.stats_port, "/metrics")
            counted.append((proxy, traffic_counters(body.decode(errors="replace"))))
        except (TimeoutError, OSError, ValueError) as e:
            console.print(f"  [red]could not read /metrics of {proxy.node}: {e}[/]")
            counted.append((proxy, []))
    summary = None
    try:
        body = await admin_get(demo.server_proxy, demo.server_proxy.admin_port, "/config_dump")
        summary = summarize_certificate(json.loads(body), SERVER.spiffe_id, demo.root_pem)
    except (TimeoutError, OSError, ValueError) as e:
        console.print(f"  [red]could not read /config_dump of {demo.server_proxy.node}: {e}[/]")
    console.print()
    console.print("[bold]Who called whom[/] (the proxies' access logs)")
    for index, attempt in enumerate(attempts, 1):
        console.print(calls_table(attempt, index))
    console.print(counters_table(counted))
    console.print(certificate_panel(summary, demo.server_proxy))


def setup_files(demo: Demo, steps: Steps) -> None:
    with steps.step("operator root CA generated"):
        ca = CertificateAuthority.self_signed(TRUST_DOMAIN, now=datetime.now(UTC))
        demo.ca_dir = demo.workdir / "cacerts"
        write_plugged_in_ca(ca, demo.ca_dir)
        CertificateAuthority.from_plugged_in_dir(demo.ca_dir)  # what the proxies will load
        demo.root_pem = ca.root_pem
    steps.note(f"{ca.signing_cert.subject.rfc4514_string()}, sha256 {fingerprint(demo.root_pem)}")
    steps.note(f"ROOT_CA_DIR={demo.ca_dir}")
    with steps.step(f"local config written: 2 workloads, 1 service [dim]({demo.config_path.name})[/]"):
        config = render_local_config(client_ip=demo.client_ip, server_ip=demo.server_ip, vip=demo.vip)
        demo.config_path.write_text(yaml.safe_dump(config, sort_keys=False))


async def run_loopback(demo: Demo, steps: Steps, stack: contextlib.AsyncExitStack) -> None:
    def spawn(proxy: NodeProxy, argv, **kwargs) -> subprocess.Popen:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True, **kwargs)
        stack.callback(stop_proxy, proxy)
        return process

    for node, workload, ip in ((CLIENT.node, CLIENT, demo.client_ip), (SERVER.node, SERVER, demo.server_ip)):
        try:
            ports = [free_port(ip) for _ in range(4)]
        except OSError as e:
            raise AmbientError(
                f"cannot bind {ip}: {e.strerror or e}",
                hint="the loopback layout needs 127.0.0.0/8 on lo (Linux has it)",
            ) from None
        demo.proxies.append(
            NodeProxy(
                node=node,
                workload=workload,
                ip=ip,
                netns=None,
                http_host=ip,
                admin_port=ports[0],
                stats_port=ports[1],
                readiness_port=ports[2],
                socks_port=ports[3],
                log=demo.workdir / f"ztunnel-{node}.log",
            )
        )
    with steps.step(f"echo app listening on {demo.server_ip}:{APP_PORT}"):
        try:
            server = await start_echo_app(demo, None)
        except OSError as e:
            raise AmbientError(
                f"cannot listen on {demo.server_ip}:{APP_PORT}: {e.strerror or e}",
                hint="is an earlier demo still running?",
            ) from None
        stack.push_async_callback(_close_server, server)
    await start_proxies(demo, steps, spawn)


async def run_netns(demo: Demo, steps: Steps, stack: contextlib.AsyncExitStack) -> None:
    from .capture.dedicated import apply_dedicated_rules, render_dedicated_rules
    from .host.commands import SubprocessRunner
    from .host.netns import Fabric, cleanup_stale_namespaces

    runner = SubprocessRunner()
    with steps.step(f"namespaces {CLIENT.node} and {SERVER.node} on a private bridge"):
        cleanup_stale_namespaces(runner, kill_processes=True)
        fabric = Fabric(runner=runner, subnet6=None)
        stack.callback(fabric.close)  # stops the proxies, then deletes every namespace
        fabric.open()
        node_a, node_b = fabric.add_node(CLIENT.node), fabric.add_node(SERVER.node)
    demo.client_ip, demo.server_ip = str(node_a.ipv4), str(node_b.ipv4)
    with steps.step(f"dedicated-mode capture rules installed [dim](iptables, mark {PACKET_MARK})[/]"):
        for node in (node_a, node_b):
            apply_dedicated_rules(runner, node.netns, render_dedicated_rules(mark=PACKET_MARK))
    for node, workload in ((node_a, CLIENT), (node_b, SERVER)):
        demo.proxies.append(
            NodeProxy(
                node=node.name,
                workload=workload,
                ip=str(node.ipv4),
                netns=node.netns,
                http_host="127.0.0.1",
                admin_port=ADMIN_PORT,
                stats_port=STATS_PORT,
                readiness_port=READINESS_PORT,
                log=demo.workdir / f"ztunnel-{node.name}.log",
            )
        )
    with steps.step(f"echo app listening on {demo.server_ip}:{APP_PORT} [dim](in {SERVER.node})[/]"):
        server = await start_echo_app(demo, node_b.netns)
        stack.push_async_callback(_close_server, server)

    def spawn(proxy: NodeProxy, argv, **kwargs) -> subprocess.Popen:
        return fabric.spawn(proxy.netns, argv, **kwargs)

    await start_proxies(demo, steps, spawn)


async def _close_server(server: asyncio.Server) -> None:
    server.close()
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(server.wait_closed(), 1.0)


async def run_demo(
    verbose: bool = False,
    *,
    mode: DemoMode | str | None = None,
    console: Console | None = None,
    loopback_ips: tuple[str, str] = (LOOPBACK_CLIENT_IP, LOOPBACK_SERVER_IP),
) -> int:
    """Run the demo; 0 when every connection echoed intact and the server proxy saw the client's id.

    `mode` forces a layout (tests use it); by default netns when possible, else loopback. Ctrl-C
    (the runner cancels this task) and SIGTERM both stop the proxies and remove the namespaces
    and temporary files before returning or re-raising.
    """
    console = console or Console()
    reason = netns_unavailable_reason()
    if mode is None:
        mode = DemoMode.LOOPBACK if reason else DemoMode.NETNS
    mode = DemoMode(mode)
    if mode is DemoMode.NETNS and reason:
        console.print(f"[red]ambient demo: the netns layout cannot run here: {reason}[/]")
        return 2
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    terminated = False

    def on_sigterm() -> None:
        nonlocal terminated
        terminated = True
        if task is not None:
            task.cancel()

    try:
        loop.add_signal_handler(signal.SIGTERM, on_sigterm)
        handler_installed = True
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
        handler_installed = False
    started = time.monotonic()
    try:
        return await _run_demo(console, mode, reason, verbose, loopback_ips, started)
    except asyncio.CancelledError:
        console.print(
            f"[yellow]interrupted: proxies stopped, {'namespaces deleted, ' if mode is DemoMode.NETNS else ''}"
            "temporary files removed[/]"
        )
        if terminated and task is not None and task.uncancel() == 0:
            return 128 + signal.SIGTERM
        raise
    finally:
        if handler_installed:
            loop.remove_signal_handler(signal.SIGTERM)


async def _run_demo(
    console: Console,
    mode: DemoMode,
    reason: str | None,
    verbose: bool,
    loopback_ips: tuple[str, str],
    started: float,
) -> int:
    steps = Steps(console)
    attempts: list[Attempt] = []
    with tempfile.TemporaryDirectory(prefix="ambient-demo-") as tmp:
        workdir = Path(tmp)
        demo = Demo(
            mode=mode,
            workdir=workdir,
            client_ip=loopback_ips[0],
            server_ip=loopback_ips[1],
            vip=LOOPBACK_VIP if mode is DemoMode.LOOPBACK else NETNS_VIP,
            config_path=workdir / "local-xds.yaml",
        )
        failed = False
        if mode is DemoMode.NETNS:
            why = None
        else:
            why = f"netns layout unavailable: {reason}" if reason else "loopback layout requested"
        async with contextlib.AsyncExitStack() as stack:
            try:
                if mode is DemoMode.NETNS:
                    # The header names the pod IPs the fabric will assign (.11 and .12).
                    from .host.netns import DEFAULT_SUBNET, Fabric

                    first = DEFAULT_SUBNET.network_address + Fabric.FIRST_NODE_HOST
                    demo.client_ip, demo.server_ip = str(first), str(first + 1)
                console.print(header(demo, why))
                setup_files(demo, steps)
                if mode is DemoMode.NETNS:
                    await run_netns(demo, steps, stack)
                else:
                    await run_loopback(demo, steps, stack)
                attempts = await exercise(demo, steps)
                await report(demo, console, attempts)
            except (AmbientError, OSError) as e:
                failed = True
                console.print(f"[bold red]ambient demo: {getattr(e, 'message', None) or e}[/]")
                if getattr(e, "hint", None):
                    console.print(f"  hint: {e.hint}")
        # The proxies are stopped now, so their logs are complete.
        ok = not failed and bool(attempts) and all(a.ok for a in attempts)
        if verbose or not ok:
            print_logs(console, demo, tail=None if verbose else LOG_TAIL_LINES)
        if not failed:
            console.print(verdict(attempts))
    cleaned = "proxies stopped, " + ("namespaces deleted, " if mode is DemoMode.NETNS else "")
    console.print(
        f"[dim]cleaned up: {cleaned}temporary files removed; {time.monotonic() - started:.1f}s in all[/]"
    )
    return 0 if ok else 1
