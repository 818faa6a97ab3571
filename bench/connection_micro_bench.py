"""Microbenchmarks of the per-connection path's pieces, for two source trees, alternated.

Each piece is timed in a fresh process per tree (`--tree` picks the ambient_mesh package), the
trees alternated ABAB for `--rounds` rounds; a figure is the minimum over the rounds of the mean
CPU time (`time.thread_time`) per operation in a batch, which is what a loaded 2-vCPU host lets
one compare (docs/performance.md, "How we measure"). The pieces:

- accept: one connection accepted by a `Listener` with the proxy's default keepalive settings
  and its handler task run (uvloop; the client connects, the loop turns until the handler has
  run), per connection;
- accept + wrap: the same with a handler that hands the socket to the event loop
  (`relay.wrap_socket`), as the captured (15001) path does, per connection;
- connect: `inputs.connect_socket` to a loopback listener, per connect;
- app socket: what an inbound stream does to reach its app: `sockets.new_socket`, the
  proxy's keepalive options, `inputs.connect_socket` and `relay.wrap_socket`, per connection;
- socks5: the SOCKS5 handshake of a client that sent greeting and request together;
- finish: one `ConnectionResult` opened and completed (metrics and access line, to /dev/null);
- pool key: the pool key as the outbound path makes it (source identity, upstream SANs, a new
  destination address) and the pool's dict lookup;
- identity: a workload's Identity as the per-connection code reads it;
- authorize: `PolicyIndex.check` of an inbound connection to a workload with no applicable
  policy (no policies at all, as in hbone_bench; and with 40 NAMESPACE policies elsewhere);
- illegal ports: `ZtunnelConfig.illegal_ports`, read per inbound stream;
- forwarded host: `headers.parse_forwarded_host` of the `forwarded` value a CONNECT to a
  workload address carries (`for` only), per inbound stream;
- traceparent: `headers.new_traceparent()`, per CONNECT;
- pool ready: `HbonePool._ready_connection` finding the one pooled connection to a destination
  (usable, below its stream limit), per CONNECT.

    .venv/bin/python bench/connection_micro_bench.py before=<worktree of main> after=$PWD [--rounds 5]

Writes results/connection_micro.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PIECES = (
    "accept",
    "accept + wrap",
    "connect",
    "app socket",
    "socks5",
    "finish",
    "pool key",
    "identity",
    "authorize",
    "authorize, policies elsewhere",
    "illegal ports",
    "forwarded host",
    "traceparent",
    "pool ready",
)
BATCH = 300
MAX_ROUNDS = 50
CHILD_TIMEOUT_S = 120.0


def child(tree: str) -> dict[str, float]:
    """Run in a subprocess: every piece once, µs of CPU per operation."""
    sys.path.insert(0, tree)
    import asyncio
    import inspect
    import logging
    import socket
    import time
    import timeit
    import types

    import uvloop

    from ambient_mesh.host.sockets import KeepaliveSettings, new_socket
    from ambient_mesh.logs import configure_logging
    from ambient_mesh.metrics import Metrics
    from ambient_mesh.net import SocketAddr, ip_address
    from ambient_mesh.proxy import inputs, open_connections, routing, socks5_server
    from ambient_mesh.proxy.listener import Listener
    from ambient_mesh.proxy.pool import WorkloadKey
    from ambient_mesh.proxy.socks5 import Socks5Handshake
    from ambient_mesh.proxy.telemetry import ConnectionResult
    from ambient_mesh.state.model import Workload
    from ambient_mesh.transport import relay

    configure_logging("plain", "info", stream=open(os.devnull, "w"))  # noqa: SIM115 - process-long
    logging.getLogger("ambient_mesh.proxy.listener").setLevel(logging.WARNING)
    out: dict[str, float] = {}

    async def _wrapped(made: object) -> relay.TcpEndpoint:
        # relay.wrap_socket returns the endpoint itself since session 19's tcp_transport, before
        # that a coroutine: the same piece for both trees.
        return await made if inspect.isawaitable(made) else made  # type: ignore[return-value]

    async def pieces() -> None:
        loop = asyncio.get_running_loop()
        # accept
        served: list[int] = []

        async def handler(conn: socket.socket) -> None:
            served.append(1)
            conn.close()

        async def wrapping_handler(conn: socket.socket) -> None:
            endpoint = await _wrapped(relay.wrap_socket(conn))
            served.append(1)
            endpoint.abort()

        for piece, serve in (("accept", handler), ("accept + wrap", wrapping_handler)):
            listener = Listener(
                "bench",
                SocketAddr.parse("127.0.0.1:0"),
                serve,
                open_connections.OpenConnections(),
                keepalive=KeepaliveSettings(),  # KEEPALIVE_ENABLED's default, as the proxies run
            )
            listener.start()
            address = listener.bound_address.sockaddr()
            cpu = 0.0
            for _ in range(BATCH):
                client = socket.socket()
                client.setblocking(False)
                client.connect_ex(address)
                before = len(served)
                t0 = time.thread_time()
                while len(served) == before:
                    await asyncio.sleep(0)
                cpu += time.thread_time() - t0
                client.close()
            listener.close()
            out[piece] = cpu / BATCH * 1e6
        # connect
        server = socket.create_server(("127.0.0.1", 0), backlog=BATCH + 10)
        server.setblocking(False)
        cpu = 0.0
        for _ in range(BATCH):
            client = socket.socket()
            client.setblocking(False)
            t0 = time.thread_time()
            await inputs.connect_socket(client, server.getsockname(), 10.0)
            cpu += time.thread_time() - t0
            client.close()
            server.accept()[0].close()
        out["connect"] = cpu / BATCH * 1e6
        # app socket
        keepalive = KeepaliveSettings()
        cpu = 0.0
        for _ in range(BATCH):
            t0 = time.thread_time()
            app = new_socket(socket.AF_INET, mark=None)
            keepalive.apply(app)
            await inputs.connect_socket(app, server.getsockname(), 10.0)
            endpoint = await _wrapped(relay.wrap_socket(app))
            cpu += time.thread_time() - t0
            endpoint.abort()
            server.accept()[0].close()
        server.close()
        out["app socket"] = cpu / BATCH * 1e6
        # socks5
        request = b"\x05\x01\x00\x05\x01\x00\x01" + socket.inet_aton("10.0.0.3") + (8080).to_bytes(2, "big")
        peer = SocketAddr.parse("10.0.0.2:1")
        pairs = []
        for _ in range(BATCH):
            a, b = socket.socketpair()
            a.setblocking(False)
            b.sendall(request)
            pairs.append((a, b))
        t0 = time.thread_time()
        for a, _b in pairs:
            await socks5_server._handshake(a, Socks5Handshake(), peer)
        out["socks5"] = (time.thread_time() - t0) / BATCH * 1e6
        for a, b in pairs:
            a.close()
            b.close()
        del loop

    uvloop.run(pieces())

    # finish: the telemetry of one connection, open to access line
    class Inputs:
        metrics = Metrics(process_metrics=False)

    src = Workload(
        uid="c//Pod/default/client",
        name="client",
        namespace="default",
        trust_domain="td",
        service_account="a",
    )
    dst = Workload(
        uid="c//Pod/default/server",
        name="server",
        namespace="default",
        trust_domain="td",
        service_account="b",
    )
    peer_addr, app_addr = SocketAddr.parse("10.0.0.2:40000"), SocketAddr.parse("10.0.0.3:8080")
    ended = types.SimpleNamespace(bytes_up=1, bytes_down=1)  # what complete() reads of a relay

    def finish() -> None:
        result = ConnectionResult(
            Inputs,  # type: ignore[arg-type]
            direction="inbound",
            src_addr=peer_addr,
            dst_addr=app_addr,
            hbone_addr="10.0.0.3:8080",
            source=src,
            source_identity=src.identity,
            destination=dst,
            service=None,
            destination_identity=dst.identity,
            mtls=True,
        )
        result.complete(ended, None)  # type: ignore[arg-type]

    n = 2000
    out["finish"] = min(timeit.repeat(finish, number=n, repeat=5)) / n * 1e6
    # pool key, as the outbound path makes it per connection: the source identity, the upstream
    # SANs (routing), a new destination address (routing builds one per connection), the lookup
    read = getattr(routing, "workload_identity", None) or (lambda w: w.identity)
    dst_ip, src_ip = ip_address("10.0.0.3"), ip_address("10.0.0.2")
    pool = {WorkloadKey.of(read(src), routing._sans(dst, None), SocketAddr(dst_ip, 15008), src_ip): 1}

    key = WorkloadKey.of(read(src), routing._sans(dst, None), SocketAddr(dst_ip, 15008), src_ip)

    def pool_key() -> None:
        key = WorkloadKey.of(read(src), routing._sans(dst, None), SocketAddr(dst_ip, 15008), src_ip)
        assert pool.get(key) == 1

    n = 20000
    out["pool key"] = min(timeit.repeat(pool_key, number=n, repeat=5)) / n * 1e6
    # identity: what the code of this tree reads per connection
    out["identity"] = min(timeit.repeat(lambda: read(src), number=n, repeat=5)) / n * 1e6
    # authorize: what ConnectionManager.authorize asks of the policies per inbound connection
    from ambient_mesh.config import ZtunnelConfig
    from ambient_mesh.rbac import Authorization, PolicyIndex, RbacConnection, Scope

    rbac_conn = RbacConnection(src_identity=read(src), src_ip=src_ip, dst_ip=dst_ip, dst_port=8080)
    empty = PolicyIndex()
    out["authorize"] = min(timeit.repeat(lambda: empty.check(dst, rbac_conn), number=n, repeat=5)) / n * 1e6
    elsewhere = PolicyIndex(
        Authorization(name=f"p{i}", namespace=f"other{i % 4}", scope=Scope.NAMESPACE) for i in range(40)
    )
    out["authorize, policies elsewhere"] = (
        min(timeit.repeat(lambda: elsewhere.check(dst, rbac_conn), number=n, repeat=5)) / n * 1e6
    )
    config = ZtunnelConfig()
    out["illegal ports"] = min(timeit.repeat(lambda: config.illegal_ports, number=n, repeat=5)) / n * 1e6
    from ambient_mesh.proxy import headers

    forwarded = headers.forwarded_for(peer_addr, None)
    out["forwarded host"] = (
        min(timeit.repeat(lambda: headers.parse_forwarded_host(forwarded), number=n, repeat=5)) / n * 1e6
    )
    out["traceparent"] = min(timeit.repeat(headers.new_traceparent, number=n, repeat=5)) / n * 1e6
    from ambient_mesh.proxy.pool import HbonePool

    hbone_pool = HbonePool(lambda key: None)  # type: ignore[arg-type,return-value]
    pooled = types.SimpleNamespace(usable=True, open_streams=1, max_streams=100)
    hbone_pool._connections[key] = [pooled]  # type: ignore[list-item]
    assert hbone_pool._ready_connection(key) is pooled  # type: ignore[comparison-overlap]
    out["pool ready"] = (
        min(timeit.repeat(lambda: hbone_pool._ready_connection(key), number=n, repeat=5)) / n * 1e6
    )
    return out


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2])))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trees", nargs=2, metavar="NAME=PATH", help="two source trees: first the baseline")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "connection_micro.json"))
    args = p.parse_args()
    if not 1 <= args.rounds <= MAX_ROUNDS:
        raise SystemExit(f"--rounds 1-{MAX_ROUNDS}")
    trees = [tuple(t.split("=", 1)) for t in args.trees]
    for name, path in trees:
        if not (Path(path) / "ambient_mesh" / "proxy").is_dir():
            raise SystemExit(f"{name}={path}: no ambient_mesh package there")
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in trees}
    for i in range(args.rounds):
        for name, path in trees if i % 2 == 0 else trees[::-1]:
            done = subprocess.run(
                [sys.executable, __file__, "--child", path],
                capture_output=True,
                text=True,
                timeout=CHILD_TIMEOUT_S,
                check=False,
                env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
            )
            if done.returncode != 0:
                raise SystemExit(f"{name}: {done.stderr.strip()[-2000:]}")
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    from rich.console import Console
    from rich.table import Table

    (base, _), (other, _) = trees
    best = {name: {k: min(r[k] for r in rs) for k in PIECES} for name, rs in runs.items()}
    table = Table(title=f"per-connection pieces, µs CPU per operation, min of {args.rounds} rounds")
    for column in ("piece", base, other, f"{other} / {base}"):
        table.add_column(column)
    for k in PIECES:
        table.add_row(
            k, f"{best[base][k]:.2f}", f"{best[other][k]:.2f}", f"{best[other][k] / best[base][k]:.2f}"
        )
    Console(width=None if sys.stdout.isatty() else 120).print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "trees": dict(trees),
                "runs": runs,
                "best_us": best,
                "python": platform.python_version(),
                "load_average": os.getloadavg(),
            },
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
