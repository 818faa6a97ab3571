"""ztunnel's `metrics` benchmark in Python: what Istio's TCP metrics cost per connection.

Counterpart: ztunnel benches/throughput.rs `metrics`: the cost of
building labels and incrementing, and of encoding the registry. Cases:

  connection, N chunks   connection_labels + Metrics.connection_opened + follow + N x
                         (the relay's byte counts, both ways) + close, for N = 1, 10, 100
                         (the recorder reads the counts at the close); once with the
                         same peers every time (series already exist) and once with a new source
                         workload per connection (a new series each time)
  render                 Metrics.render() of a registry holding 1,000 label sets, Prometheus text
                         and OpenMetrics

Every case runs at most --iterations times or --seconds seconds, whichever comes first.

    .venv/bin/python bench/metrics_bench.py [--seconds 1.0] [--iterations 200000] [--label-sets 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ambient_mesh.identity.spiffe import Identity  # noqa: E402
from ambient_mesh.metrics import REPORTER_DESTINATION, ByteCount, Metrics  # noqa: E402
from ambient_mesh.proxy.telemetry import connection_labels  # noqa: E402
from ambient_mesh.state.model import Locality, Service, Workload  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "metrics.json"
CHUNK_BYTES = 16 * 1024
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def source(i: int) -> Workload:
    return Workload(
        uid=f"cluster1//Pod/default/client-{i}",
        name=f"client-{i}",
        namespace="default",
        workload_name=f"client-{i}",
        canonical_name="client",
        canonical_revision="v1",
        cluster_id="cluster1",
        locality=Locality(region="eu-west", zone="eu-west-1a"),
    )


DST = Workload(
    uid="cluster1//Pod/apps/echo-5c4b",
    name="echo-5c4b",
    namespace="apps",
    canonical_name="echo",
    canonical_revision="v2",
    cluster_id="cluster1",
)
SVC = Service(name="echo", namespace="apps", hostname="echo.apps.svc.cluster.local")
SRC_ID = Identity("cluster.local", "default", "client")
DST_ID = Identity("cluster.local", "apps", "echo")


def one_connection(metrics: Metrics, src: Workload, chunks: int) -> None:
    labels = connection_labels(
        REPORTER_DESTINATION,
        source_workload=src,
        source_identity=SRC_ID,
        destination_workload=DST,
        destination_service=SVC,
        destination_identity=DST_ID,
        mtls=True,
    )
    recorder = metrics.connection_opened(labels)
    counts = ByteCount()  # what a Relay's bytes_up and bytes_down are
    recorder.follow(counts)
    for _ in range(chunks):
        counts.bytes_up += CHUNK_BYTES
        counts.bytes_down += CHUNK_BYTES
    recorder.close()


def measure(fn: Callable[[int], object], *, seconds: float, iterations: int) -> tuple[int, float]:
    fn(-1)  # warm up
    n = 0
    start = time.perf_counter()
    deadline = start + seconds
    while n < iterations:
        fn(n)
        n += 1
        if time.perf_counter() > deadline:
            break
    return n, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=1.0, help="time bound per case")
    parser.add_argument("--iterations", type=int, default=200_000, help="count bound per case")
    parser.add_argument("--label-sets", type=int, default=1_000, help="label sets in the rendered registry")
    args = parser.parse_args()

    console = Console(width=120)
    table = Table(title="Istio TCP metrics (ambient_mesh.metrics)")
    for col in ("case", "ops/s", "µs/op", "n", "note"):
        table.add_column(col, justify="left" if col in ("case", "note") else "right")
    rows = []

    def record(case: str, n: int, elapsed: float, note: str = "", **extra: object) -> None:
        per = elapsed / n
        rows.append({"case": case, "ops_per_s": 1 / per, "us_per_op": per * 1e6, "iterations": n, **extra})
        table.add_row(case, f"{1 / per:,.0f}", f"{per * 1e6:,.1f}", f"{n:,}", note)

    fixed = source(0)
    for chunks in (1, 10, 100):
        metrics = Metrics(process_metrics=False)
        n, elapsed = measure(
            lambda _i, m=metrics, c=chunks: one_connection(m, fixed, c),
            seconds=args.seconds,
            iterations=args.iterations,
        )
        record(
            f"connection, {chunks} chunk{'s' if chunks > 1 else ''}, same peers",
            n,
            elapsed,
            chunks=chunks,
            new_series=False,
        )
    # A new source workload per connection: prometheus-client creates a child per label set.
    metrics = Metrics(process_metrics=False)
    sources = [source(i) for i in range(min(args.iterations, 50_000) + 1)]
    n, elapsed = measure(
        lambda i, m=metrics: one_connection(m, sources[i], 1),
        seconds=args.seconds,
        iterations=len(sources) - 1,
    )
    record(
        "connection, 1 chunk, new series", n, elapsed, "labels differ each time", chunks=1, new_series=True
    )

    metrics = Metrics(process_metrics=False)
    for i in range(args.label_sets):
        one_connection(metrics, source(i), 1)
    for name, accept in (("render, Prometheus text", None), ("render, OpenMetrics", OPENMETRICS)):
        body, _content_type = metrics.render(accept)
        n, elapsed = measure(
            lambda _i, a=accept: metrics.render(a), seconds=args.seconds, iterations=args.iterations
        )
        record(
            f"{name}, {args.label_sets:,} label sets",
            n,
            elapsed,
            f"{len(body) / 1024:,.0f} KiB body",
            label_sets=args.label_sets,
            body_bytes=len(body),
        )

    console.print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "benchmark": "metrics",
                "chunk_bytes": CHUNK_BYTES,
                "bounds": {"seconds": args.seconds, "iterations": args.iterations},
                "python": sys.version.split()[0],
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "results": rows,
            },
            indent=2,
        )
        + "\n"
    )
    console.print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
