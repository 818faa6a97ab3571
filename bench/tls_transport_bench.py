"""HBONE's TLS transport against uvloop's SSL protocol, both ends in one process (no HTTP/2).

The two ways HBONE can run mutual TLS on uvloop: `loop.create_connection(..., ssl=ctx)` /
`connect_accepted_socket(..., ssl=ctx)` (OpenSSL over a memory BIO, uvloop's SSLProtocol) and
`proxy.tls_transport.start_tls` (OpenSSL on the socket itself). Per trial and transport: CPU
(`time.process_time`, both ends together) per GiB sent one way in 256 KiB writes, and per 1-byte
round trip; trials alternate the transports, and the ratio is taken within each trial (the host is
shared: only paired ratios compare). The receiving protocols are BufferedProtocols with one
reused buffer, as HboneConnection is; the allocator is tuned as the proxy tunes it.

    .venv/bin/python bench/tls_transport_bench.py [--trials 12] [--size-mib 64] [--round-trips 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ambient_mesh.host.malloc import tune_allocator  # noqa: E402
from ambient_mesh.identity import CertificateAuthority, Identity, client_context, server_context  # noqa: E402
from ambient_mesh.proxy.tls_transport import start_tls  # noqa: E402

CHUNK_BYTES = 256 * 1024
RECEIVE_BUFFER_BYTES = 256 * 1024
WARMUP_ROUND_TRIPS = 200
STEP_TIMEOUT_S = 60.0
KINDS = ("uvloop-ssl", "socket-bio")


class Side(asyncio.BufferedProtocol):
    def __init__(self, echo: bool = False) -> None:
        self.loop = asyncio.get_running_loop()
        self.buf = bytearray(RECEIVE_BUFFER_BYTES)
        self.echo = echo
        self.received = 0
        self.target = 0
        self.arrived: asyncio.Future[None] = self.loop.create_future()
        self.resume: asyncio.Future[None] | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport):
        self.transport = transport

    def get_buffer(self, sizehint):
        return memoryview(self.buf)

    def buffer_updated(self, nbytes):
        self.received += nbytes
        if self.echo:
            assert self.transport is not None
            self.transport.write(self.buf[:nbytes])
        if self.received >= self.target and not self.arrived.done():
            self.arrived.set_result(None)

    def expect(self, total: int) -> asyncio.Future[None]:
        self.target = total
        self.arrived = self.loop.create_future()
        if self.received >= total:
            self.arrived.set_result(None)
        return self.arrived

    def pause_writing(self):
        self.resume = self.loop.create_future()

    def resume_writing(self):
        if self.resume is not None and not self.resume.done():
            self.resume.set_result(None)
        self.resume = None

    def connection_lost(self, exc):
        if not self.arrived.done() and exc is not None:
            self.arrived.set_exception(exc)


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    for s in (server, client):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setblocking(False)
    return server, client


async def connect(kind: str, contexts, server: Side, client: Side) -> None:
    sctx, cctx = contexts
    s, c = tcp_pair()
    loop = asyncio.get_running_loop()
    if kind == "uvloop-ssl":
        accepted = loop.create_task(loop.connect_accepted_socket(lambda: server, s, ssl=sctx))
        await loop.create_connection(lambda: client, sock=c, ssl=cctx, server_hostname="")
        await accepted
    else:
        await asyncio.gather(
            start_tls(s, sctx, server, server_side=True, handshake_timeout_s=STEP_TIMEOUT_S),
            start_tls(c, cctx, client, server_side=False, handshake_timeout_s=STEP_TIMEOUT_S),
        )


def close(*sides: Side) -> None:
    for side in sides:
        if side.transport is not None:
            side.transport.abort()


async def bulk_cpu_s_per_gib(kind: str, contexts, size_mib: int) -> float:
    server, client = Side(), Side()
    await connect(kind, contexts, server, client)
    assert client.transport is not None
    total = size_mib * 1024 * 1024
    chunk = b"x" * CHUNK_BYTES
    arrived = server.expect(total)
    started = time.process_time()
    sent = 0
    async with asyncio.timeout(STEP_TIMEOUT_S):
        while sent < total:
            client.transport.write(chunk)
            sent += CHUNK_BYTES
            if client.resume is not None:
                await client.resume
        await arrived
    cpu = time.process_time() - started
    close(server, client)
    return cpu / (size_mib / 1024)


async def round_trip_cpu_us(kind: str, contexts, round_trips: int) -> float:
    server, client = Side(echo=True), Side()
    await connect(kind, contexts, server, client)
    assert client.transport is not None
    async with asyncio.timeout(STEP_TIMEOUT_S):
        for i in range(WARMUP_ROUND_TRIPS):
            got = client.expect(i + 1)
            client.transport.write(b"x")
            await got
        started = time.process_time()
        for i in range(WARMUP_ROUND_TRIPS, WARMUP_ROUND_TRIPS + round_trips):
            got = client.expect(i + 1)
            client.transport.write(b"x")
            await got
        cpu = time.process_time() - started
    close(server, client)
    return cpu / round_trips * 1e6


async def run(args) -> dict:
    ca = CertificateAuthority.insecure_test_ca()
    now = datetime.now(UTC)
    contexts = (
        server_context(ca.issue(Identity("cluster.local", "ns1", "server"), 3600, now=now)),
        client_context(ca.issue(Identity("cluster.local", "ns2", "client"), 3600, now=now)),
    )
    gib: dict[str, list[float]] = {k: [] for k in KINDS}
    rt: dict[str, list[float]] = {k: [] for k in KINDS}
    for _ in range(args.trials):
        for kind in KINDS:
            gib[kind].append(await bulk_cpu_s_per_gib(kind, contexts, args.size_mib))
            rt[kind].append(await round_trip_cpu_us(kind, contexts, args.round_trips))
    base, new = KINDS
    return {
        "trials": args.trials,
        "size_mib": args.size_mib,
        "round_trips": args.round_trips,
        "cpu_s_per_gib": gib,
        "cpu_us_per_round_trip": rt,
        "paired_ratio_cpu_per_gib": statistics.median(
            a / b for a, b in zip(gib[new], gib[base], strict=True)
        ),
        "paired_ratio_cpu_per_round_trip": statistics.median(
            a / b for a, b in zip(rt[new], rt[base], strict=True)
        ),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=12)
    p.add_argument("--size-mib", type=int, default=64)
    p.add_argument("--round-trips", type=int, default=2000)
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "tls_transport.json")
    args = p.parse_args()
    tune_allocator()
    result = uvloop.run(run(args))
    print(f"{'transport':<12} {'CPU s/GiB min':>14} {'median':>8} {'CPU µs/RT min':>14} {'median':>8}")
    for kind in KINDS:
        g, r = result["cpu_s_per_gib"][kind], result["cpu_us_per_round_trip"][kind]
        print(
            f"{kind:<12} {min(g):>14.3f} {statistics.median(g):>8.3f} {min(r):>14.1f} {statistics.median(r):>8.1f}"
        )
    print(
        f"socket-bio / uvloop-ssl, median of {args.trials} paired trials: CPU per GiB "
        f"{result['paired_ratio_cpu_per_gib']:.3f}, CPU per round trip {result['paired_ratio_cpu_per_round_trip']:.3f}"
    )
    result["when"] = datetime.now(UTC).isoformat(timespec="seconds")
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
