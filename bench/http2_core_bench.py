"""HBONE's HTTP/2 engine in isolation: our sans-IO core against python-hyper `h2` 4.4.1.

Counterpart: none in ztunnel (its `h2` crate is not benchmarked alone); this measures what the
protocol layer costs a proxy per message and per byte, without sockets, TLS or the event loop,
so the number moves only with the engine. Two connections of the same engine talk in-process:

  ping-pong     1-byte DATA each way on one stream, acknowledged: CPU µs per round trip
  bulk          --bulk-mib one way on one stream, 1 MiB frames, fed in 64 KiB reads as TLS
                delivers them, acknowledged: Gbit/s of CPU time
  streams       open a CONNECT stream, answer 200, half-close both ways: CPU µs per stream
  hbone streams the same with the header lists our proxies send (outbound.py's forwarded,
                baggage and traceparent; the 200 with inbound.py's response baggage), and the
                Python calls per stream (counted by cProfile over --count-streams streams,
                outside the timed runs)
  hpack block   decode one header block of N literal fields (the issue 8 HEADERS+CONTINUATION
                attack, without its size limit): our linear decoder against hpack.Decoder

Times are CPU time of this process (time.process_time), so other load on a shared host slows
them less than wall time would; every case is bounded by --seconds and a count.

    .venv/bin/python bench/http2_core_bench.py [--seconds 2] [--bulk-mib 512] [--cases streams,hbone]
        [--tree <another worktree>]

`--tree` runs that tree's `ambient_mesh` (an A/B of the core: run it once per tree, alternated).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import h2.settings
import hpack
from rich.console import Console
from rich.table import Table


def _tree() -> str:
    """--tree, read before the imports below so that they come from that tree."""
    for i, arg in enumerate(sys.argv):
        if arg == "--tree" and i + 1 < len(sys.argv):
            return str(Path(sys.argv[i + 1]).resolve())
        if arg.startswith("--tree="):
            return str(Path(arg.split("=", 1)[1]).resolve())
    return str(Path(__file__).resolve().parent.parent)


sys.path.insert(0, _tree())

from ambient_mesh.http2 import Connection, CoreSettings  # noqa: E402
from ambient_mesh.http2 import events as ev  # noqa: E402
from ambient_mesh.http2.hpack_block import BlockDecoder  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "http2_core.json"
MiB = 1024 * 1024
READ_BYTES = 64 * 1024
CONNECT = [(b":method", b"CONNECT"), (b":authority", b"10.0.0.3:8080")]
# What outbound.py sends on a CONNECT (ztunnel's set) and inbound.py answers, with values of the
# sizes the proxies send (headers.forwarded_for, baggage_for, new_traceparent).
HBONE_CONNECT = CONNECT + [
    (b"forwarded", b'for="10.0.0.1:43210"'),
    (
        b"baggage",
        b"k8s.cluster.name=Kubernetes,k8s.namespace.name=default,k8s.deployment.name=client,"
        b"service.name=client,service.version=v1",
    ),
    (b"traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"),
]
HBONE_RESPONSE = [
    (
        b"baggage",
        b"k8s.cluster.name=Kubernetes,k8s.namespace.name=default,k8s.deployment.name=server,"
        b"service.name=server,service.version=v1",
    )
]
CASES = ("ping-pong", "bulk", "streams", "hbone", "hpack")


def _join(chunks) -> bytes:
    return b"".join(bytes(c) if isinstance(c, memoryview) else c for c in chunks)


class Ours:
    name = "ours (http2)"

    def __init__(self) -> None:
        self.c = Connection(
            CoreSettings(client_side=True, max_header_list_bytes=16 * 1024, max_concurrent_streams=None)
        )
        self.s = Connection(CoreSettings(client_side=False, max_concurrent_streams=None))
        self.c.initiate(0.0)
        self.s.initiate(0.0)
        for _ in range(3):
            self.s.receive(_join(self.c.data_to_send()), 0.0)
            self.c.receive(_join(self.s.data_to_send()), 0.0)

    def open(
        self, request: list[tuple[bytes, bytes]] = CONNECT, response: Sequence[tuple[bytes, bytes]] = ()
    ) -> int:
        sid = self.c.send_request(request)
        self.s.receive(_join(self.c.data_to_send()), 0.0)
        self.s.send_response(sid, 200, response)
        self.c.receive(_join(self.s.data_to_send()), 0.0)
        return sid

    def close(self, sid: int) -> None:
        self.c.end_stream(sid)
        self.s.receive(_join(self.c.data_to_send()), 0.0)
        self.s.end_stream(sid)
        self.c.receive(_join(self.s.data_to_send()), 0.0)

    @staticmethod
    def _deliver(core: Connection, wire: bytes) -> int:
        got = 0
        for i in range(0, len(wire), READ_BYTES):
            for e in core.receive(wire[i : i + READ_BYTES], 0.0):
                if type(e) is ev.DataReceived:
                    got += len(e.data)
                    core.acknowledge(e.stream_id, len(e.data))
        return got

    def round_trip(self, sid: int, msg: bytes) -> None:
        self.c.send_data(sid, msg)
        self._deliver(self.s, _join(self.c.data_to_send()))
        self.s.send_data(sid, msg)
        self._deliver(self.c, _join(self.s.data_to_send()))

    def push(self, sid: int, data: bytes) -> int:
        self.c.send_data(sid, data)
        got = self._deliver(self.s, _join(self.c.data_to_send()))
        self.c.receive(_join(self.s.data_to_send()), 0.0)
        return got


class H2:
    name = "h2 4.4.1"

    def __init__(self) -> None:
        def conn(client: bool) -> h2.connection.H2Connection:
            c = h2.connection.H2Connection(
                h2.config.H2Configuration(client_side=client, header_encoding=None)
            )
            c.local_settings = h2.settings.Settings(
                client=client,
                initial_values={
                    h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 4 * MiB,
                    h2.settings.SettingCodes.MAX_FRAME_SIZE: MiB,
                    h2.settings.SettingCodes.ENABLE_PUSH: 0,
                },
            )
            c.max_inbound_frame_size = MiB
            c.initiate_connection()
            c.increment_flow_control_window(16 * MiB - 65535)
            return c

        self.c, self.s = conn(True), conn(False)
        for _ in range(3):
            self.s.receive_data(self.c.data_to_send())
            self.c.receive_data(self.s.data_to_send())

    def open(
        self, request: list[tuple[bytes, bytes]] = CONNECT, response: Sequence[tuple[bytes, bytes]] = ()
    ) -> int:
        sid = self.c.get_next_available_stream_id()
        self.c.send_headers(sid, request)
        self.s.receive_data(self.c.data_to_send())
        self.s.send_headers(sid, [(b":status", b"200"), *response])
        self.c.receive_data(self.s.data_to_send())
        return sid

    def close(self, sid: int) -> None:
        self.c.end_stream(sid)
        self.s.receive_data(self.c.data_to_send())
        self.s.end_stream(sid)
        self.c.receive_data(self.s.data_to_send())

    @staticmethod
    def _deliver(conn, wire: bytes) -> int:
        got = 0
        for i in range(0, len(wire), READ_BYTES):
            for e in conn.receive_data(wire[i : i + READ_BYTES]):
                if type(e) is h2.events.DataReceived:
                    got += len(e.data)
                    conn.acknowledge_received_data(e.flow_controlled_length, e.stream_id)
        return got

    def round_trip(self, sid: int, msg: bytes) -> None:
        self.c.send_data(sid, msg)
        self._deliver(self.s, self.c.data_to_send())
        self.s.send_data(sid, msg)
        self._deliver(self.c, self.s.data_to_send())

    def push(self, sid: int, data: bytes) -> int:
        sent = 0
        while sent < len(data):
            n = min(self.c.local_flow_control_window(sid), self.c.max_outbound_frame_size, len(data) - sent)
            if n <= 0:
                break
            self.c.send_data(sid, data[sent : sent + n])
            sent += n
        got = self._deliver(self.s, self.c.data_to_send())
        self.c.receive_data(self.s.data_to_send())
        return got


def timed(fn, seconds: float, count: int) -> tuple[int, float]:
    start = time.process_time()
    n = 0
    while n < count and time.process_time() - start < seconds:
        fn()
        n += 1
    return n, time.process_time() - start


def best_of(fn, seconds: float, count: int, rounds: int = 5) -> tuple[int, float]:
    """`timed` in `rounds` parts: (calls in all, the least CPU seconds per call of a part). Other
    load on the shared host only ever adds time, so the least is the engine's own cost."""
    total, best = 0, float("inf")
    for _ in range(rounds):
        n, cpu = timed(fn, seconds / rounds, max(1, count // rounds))
        total += n
        best = min(best, cpu / n)
    return total, best


def calls_per_stream(pair, streams: int) -> float:
    """Python and C calls cProfile counts per HBONE stream (open, 200, half-close both ways)."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(streams):
        pair.close(pair.open(HBONE_CONNECT, HBONE_RESPONSE))
    profile.disable()
    profile.create_stats()
    return sum(ncalls for _cc, ncalls, *_ in profile.stats.values()) / streams  # type: ignore[attr-defined]


def literal_block(fields: int) -> bytes:
    headers = [(f"x-h{i}".encode(), b"v" * 24) for i in range(fields)]
    return hpack.Encoder().encode(headers, huffman=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=2.0, help="bound per case")
    p.add_argument("--round-trips", type=int, default=20_000)
    p.add_argument("--bulk-mib", type=int, default=512)
    p.add_argument("--streams", type=int, default=5_000)
    p.add_argument("--count-streams", type=int, default=500, help="streams whose calls are counted")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {','.join(CASES)}")
    p.add_argument("--tree", default=_tree(), help="the source tree whose ambient_mesh runs (A/B)")
    p.add_argument("--json", default=str(RESULTS))
    args = p.parse_args()
    cases = args.cases.split(",")
    if unknown := set(cases) - set(CASES):
        raise SystemExit(f"unknown --cases {sorted(unknown)}: choose from {', '.join(CASES)}")
    console = Console(width=120)
    rows: list[dict] = []
    table = Table(title="HTTP/2 engine alone, CPU time (time.process_time)")
    for col in ("case", "engine", "count", "result", "ours / h2"):
        table.add_column(col)

    def add(case: str, engine: str, n: int, value: float, unit: str, ratio: str = "") -> None:
        rows.append({"case": case, "engine": engine, "count": n, "value": value, "unit": unit})
        table.add_row(case, engine, f"{n:,}", f"{value:,.2f} {unit}", ratio)

    for case in [c for c in CASES[:4] if c in cases]:
        results = {}
        for engine in (Ours, H2):
            pair = engine()
            if case == "ping-pong":
                sid = pair.open()
                n, cpu = timed(lambda p=pair, s=sid: p.round_trip(s, b"x"), args.seconds, args.round_trips)
                results[engine] = (n, cpu / n * 1e6, "µs per round trip")
            elif case == "bulk":
                sid = pair.open()
                chunk = b"b" * (4 * MiB)
                moved = [0]

                def step(p=pair, s=sid, m=moved, c=chunk) -> None:
                    m[0] += p.push(s, c)

                n, cpu = timed(step, args.seconds * 3, args.bulk_mib // 4)
                results[engine] = (moved[0] // MiB, moved[0] * 8 / cpu / 1e9, "Gbit/s")
            elif case == "streams":

                def one(p=pair) -> None:
                    p.close(p.open())

                n, per = best_of(one, args.seconds, args.streams)
                results[engine] = (n, per * 1e6, "µs per stream")
            else:

                def hbone(p=pair) -> None:
                    p.close(p.open(HBONE_CONNECT, HBONE_RESPONSE))

                n, per = best_of(hbone, args.seconds, args.streams)
                results[engine] = (n, per * 1e6, "µs per stream")
                calls = calls_per_stream(pair, args.count_streams)
                rows.append(
                    {
                        "case": "hbone calls",
                        "engine": engine.name,
                        "count": args.count_streams,
                        "value": calls,
                        "unit": "calls per stream",
                    }
                )
                table.add_row(
                    "hbone, calls",
                    engine.name,
                    f"{args.count_streams:,}",
                    f"{calls:,.1f} calls per stream",
                    "",
                )
        ours, theirs = results[Ours], results[H2]
        ratio = f"{ours[1] / theirs[1]:.2f}"
        add(case, Ours.name, *ours, ratio)
        add(case, H2.name, *theirs)

    for fields in (2_000, 20_000) if "hpack" in cases else ():
        block = literal_block(fields)
        ours = BlockDecoder(max_list_bytes=1 << 30)
        n, cpu_ours = timed(lambda d=ours, b=block: d.decode(b), args.seconds, 50)
        ref = hpack.Decoder()
        ref.max_header_list_size = 1 << 30
        m, cpu_ref = timed(lambda d=ref, b=block: d.decode(b, raw=True), args.seconds * 5, 50)
        label = f"hpack block, {fields:,} literals ({len(block) / 1024:,.0f} KiB)"
        add(label, "ours (hpack_block)", n, cpu_ours / n * 1e3, "ms", f"{(cpu_ours / n) / (cpu_ref / m):.3f}")
        add(label, "hpack.Decoder", m, cpu_ref / m * 1e3, "ms")

    console.print(table)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "http2_core",
                "bounds": {
                    "seconds": args.seconds,
                    "round_trips": args.round_trips,
                    "bulk_mib": args.bulk_mib,
                },
                "tree": args.tree,
                "load_average": os.getloadavg(),
                "python": sys.version.split()[0],
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "results": rows,
            },
            indent=2,
        )
        + "\n"
    )
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
