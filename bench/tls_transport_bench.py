"""HBONE's two TLS record layers, both ends in one process (no HTTP/2).

`tls.transport.start_tls` after OpenSSL's handshake (pyOpenSSL): HBONE's own TLS 1.3 records
(`own-records`, `TlsTransport` over tls/records.py, the default) against OpenSSL's records over
the handshake's memory BIOs (`openssl-records`, `OpenSslTransport` with `openssl_records=True`:
what TLS 1.2 uses). Per trial and transport: CPU
(`time.process_time`, both ends together) per GiB sent one way in 256 KiB writes, and per 1-byte
round trip; trials alternate the transports, and the ratio is taken within each trial (the host is
shared: only paired ratios compare). The receiving protocols are BufferedProtocols with one
reused buffer, as HboneConnection is; the allocator is tuned as the proxy tunes it.

    .venv/bin/python bench/tls_transport_bench.py [--trials 12] [--size-mib 64] [--round-trips 2000]

`--aead` instead compares the cost of one TLS 1.3 application-data record, sealed and sent on
one socket of a socketpair, received and opened on the other, in one thread: through the system
OpenSSL that CPython's `_ssl` links (`SSLSocket` write / read after a real handshake, AES-128-GCM)
and through a record layer sketched in Python over `cryptography`'s AESGCM (the OpenSSL its
wheel carries): nonce = IV xor sequence number, the 5-byte header as associated data, the inner
content type, `encrypt_into` / `decrypt_into` (RFC 8446 5.2-5.3). The sketch has no key schedule
of its own (a random key), no KeyUpdate or alerts: it prices the per-record work only (docs/performance.md, "TLS: our own TLS 1.3 records on `cryptography`'s AES-GCM").

    .venv/bin/python bench/tls_transport_bench.py --aead [--trials 8] [--records 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import ssl
import statistics
import struct
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ambient_mesh.host.malloc import tune_allocator  # noqa: E402
from ambient_mesh.identity import CertificateAuthority, Identity  # noqa: E402
from ambient_mesh.tls.context import client_context, server_context  # noqa: E402
from ambient_mesh.tls.transport import OpenSslTransport, TlsTransport, start_tls  # noqa: E402

CHUNK_BYTES = 256 * 1024
RECEIVE_BUFFER_BYTES = 256 * 1024
WARMUP_ROUND_TRIPS = 200
STEP_TIMEOUT_S = 60.0
KINDS = ("openssl-records", "own-records")
MAX_RECORDS = 1_000_000


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
    sctx, cctx = contexts[kind]
    s, c = tcp_pair()
    transports = await asyncio.gather(
        start_tls(
            s,
            sctx,
            server,
            server_side=True,
            handshake_timeout_s=STEP_TIMEOUT_S,
            openssl_records=kind != "own-records",
        ),
        start_tls(
            c,
            cctx,
            client,
            server_side=False,
            handshake_timeout_s=STEP_TIMEOUT_S,
            openssl_records=kind != "own-records",
        ),
    )
    expected = TlsTransport if kind == "own-records" else OpenSslTransport
    assert all(type(t) is expected for t in transports), transports


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
    server_cert = ca.issue(Identity("cluster.local", "ns1", "server"), 3600, now=now)
    client_cert = ca.issue(Identity("cluster.local", "ns2", "client"), 3600, now=now)
    openssl = (server_context(server_cert), client_context(client_cert))
    contexts = {
        "own-records": (server_context(server_cert), client_context(client_cert)),
        "openssl-records": openssl,
    }
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


AEAD_SIZES = (1, 16 * 1024)
AEAD_KINDS = ("system-openssl", "cryptography-aesgcm")
_RECORD_HEADER = struct.Struct(">BHH")  # content type, legacy version, length (RFC 8446 5.1)


def _openssl_records(contexts, size: int, records: int) -> float:
    """CPU µs per record through the system OpenSSL (both ends in this thread)."""
    import threading

    sctx, cctx = contexts
    a, b = socket.socketpair()
    server = sctx.wrap_socket(a, server_side=True, do_handshake_on_connect=False)
    client = cctx.wrap_socket(b, server_side=False, do_handshake_on_connect=False)
    handshake = threading.Thread(target=server.do_handshake)
    handshake.start()
    client.do_handshake()
    handshake.join()
    try:
        data, buf = b"x" * size, bytearray(size + 64)
        started = time.thread_time()
        for _ in range(records):
            client.sendall(data)
            got = 0
            while got < size:
                got += server.recv_into(memoryview(buf)[got:], size - got)
        return (time.thread_time() - started) / records * 1e6
    finally:
        client.close()
        server.close()


def _aesgcm_records(size: int, records: int, aead: type) -> float:
    """CPU µs per record through a Python record layer over `aead` (cryptography's AESGCM)."""

    a, b = socket.socketpair()
    try:
        key, iv = os.urandom(16), int.from_bytes(os.urandom(12), "big")
        seal, open_ = aead(key), aead(key)
        inner = bytearray(size + 1)  # the payload, then its content type (application data)
        inner[size] = 23
        sealed = bytearray(5 + size + 1 + 16)
        header_in = bytearray(5)
        body_in = bytearray(size + 1 + 16)
        plain = bytearray(size + 1)
        out_view, body_view = memoryview(sealed), memoryview(body_in)
        send, recv_into = a.send, b.recv_into
        started = time.thread_time()
        for seq in range(records):
            nonce = (iv ^ seq).to_bytes(12, "big")
            _RECORD_HEADER.pack_into(sealed, 0, 23, 0x0303, size + 1 + 16)
            seal.encrypt_into(nonce, inner, out_view[:5], out_view[5:])
            send(sealed)
            recv_into(header_in, 5)
            length = _RECORD_HEADER.unpack(header_in)[2]
            got = 0
            while got < length:
                got += recv_into(body_view[got:length], length - got)
            open_.decrypt_into(nonce, body_view[:length], bytes(header_in), plain)
        return (time.thread_time() - started) / records * 1e6
    finally:
        a.close()
        b.close()


def aead_main(args) -> int:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from tests.helpers.tls_stdlib import stdlib_client_context, stdlib_server_context

    ca = CertificateAuthority.insecure_test_ca()
    now = datetime.now(UTC)
    contexts = (  # Python's `ssl` (the system OpenSSL), as a test peer makes them
        stdlib_server_context(ca.issue(Identity("cluster.local", "ns1", "server"), 3600, now=now)),
        stdlib_client_context(ca.issue(Identity("cluster.local", "ns2", "client"), 3600, now=now)),
    )
    us: dict[str, dict[int, list[float]]] = {k: {n: [] for n in AEAD_SIZES} for k in AEAD_KINDS}
    for _ in range(args.trials):
        for size in AEAD_SIZES:
            us["system-openssl"][size].append(_openssl_records(contexts, size, args.records))
            us["cryptography-aesgcm"][size].append(_aesgcm_records(size, args.records, AESGCM))
    from cryptography.hazmat.backends.openssl.backend import backend

    versions = {
        "system-openssl": ssl.OPENSSL_VERSION,
        "cryptography-aesgcm": backend.openssl_version_text(),
    }
    kinds = [k for k in AEAD_KINDS if us[k][AEAD_SIZES[0]]]
    print(
        f"{'record layer':<22} {'OpenSSL':<28} " + " ".join(f"{f'{n} B µs/record':>18}" for n in AEAD_SIZES)
    )
    for kind in kinds:
        cells = " ".join(f"{statistics.median(us[kind][n]):>18.2f}" for n in AEAD_SIZES)
        print(f"{kind:<22} {versions[kind]:<28} {cells}")
    full = AEAD_SIZES[-1]
    per_gib = {k: statistics.median(us[k][full]) * (2**30 // full) / 1e6 for k in kinds}
    print(
        "CPU s per GiB, both ends of one hop (sealing and sending + receiving and opening, 16 KiB records): "
        + ", ".join(f"{k} {v:.3f}" for k, v in per_gib.items())
    )
    result = {
        "records": args.records,
        "trials": args.trials,
        "openssl": versions,
        "cpu_us_per_record": {k: {str(n): v for n, v in us[k].items()} for k in kinds},
        "cpu_s_per_gib_one_hop": per_gib,
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"JSON: {args.json}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--aead", action="store_true", help="per-record cost: system OpenSSL and cryptography's AESGCM"
    )
    p.add_argument("--records", type=int, default=20000, help="--aead: records per trial and size")
    p.add_argument("--trials", type=int, default=12)
    p.add_argument("--size-mib", type=int, default=64)
    p.add_argument("--round-trips", type=int, default=2000)
    p.add_argument(
        "--json", type=Path, help="default results/tls_transport.json (--aead: tls_aead_records.json)"
    )
    args = p.parse_args()
    if args.json is None:
        args.json = (
            ROOT / "bench" / "results" / ("tls_aead_records.json" if args.aead else "tls_transport.json")
        )
    if not 1 <= args.trials <= 100 or not 1 <= args.records <= MAX_RECORDS:
        raise SystemExit(f"--trials 1-100, --records 1-{MAX_RECORDS}")
    if args.aead:
        return aead_main(args)
    tune_allocator()
    result = uvloop.run(run(args))
    print(f"{'transport':<16} {'CPU s/GiB min':>14} {'median':>8} {'CPU µs/RT min':>14} {'median':>8}")
    for kind in KINDS:
        g, r = result["cpu_s_per_gib"][kind], result["cpu_us_per_round_trip"][kind]
        print(
            f"{kind:<16} {min(g):>14.3f} {statistics.median(g):>8.3f} {min(r):>14.1f} {statistics.median(r):>8.1f}"
        )
    print(
        f"own-records / openssl-records, median of {args.trials} paired trials: CPU per GiB "
        f"{result['paired_ratio_cpu_per_gib']:.3f}, CPU per round trip {result['paired_ratio_cpu_per_round_trip']:.3f}"
    )
    result["when"] = datetime.now(UTC).isoformat(timespec="seconds")
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
