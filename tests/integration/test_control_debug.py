"""The control plane's debug endpoint and `ambient proxy-status`: a node proxy fed over real
gRPC shows up SYNCED with what it was sent and acknowledged; the control plane's own tables
are plain whole lines when its output is a file (its log)."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

from rich.console import Console

from ambient_mesh.control.plane import ControlPlaneConfig, build, print_table, status_table
from ambient_mesh.diagnostics.proxy_status import address_fetch, fetch_connections, proxy_status_table
from ambient_mesh.net import SocketAddr
from ambient_mesh.ztunnel_config import plain_table
from tests.helpers.control_plane import NAMESPACE, PODS, SERVICE, proxy_env, start_proxy, wait_for, write

# Its own loopback address, and no HBONE listener: other tests (and waypoints) hold 15008.
DEBUG_TEST_IP = "127.0.0.57"


async def test_proxy_status_reads_the_debug_endpoint(tmp_path: Path):
    objects = tmp_path / "objects"
    objects.mkdir()
    for name, text in (("ns.yaml", NAMESPACE), ("pods.yaml", PODS), ("svc.yaml", SERVICE)):
        write(objects, name, text)
    plane = build(
        ControlPlaneConfig(
            directory=objects,
            state_dir=tmp_path / "state",
            listen=SocketAddr.parse("127.0.0.1:0"),
            poll_interval_s=0.05,
            debug_listen=SocketAddr.parse("127.0.0.1:0"),
        )
    )
    await plane.start()
    proxy = None
    try:
        proxy = await start_proxy(
            proxy_env(
                tmp_path, plane.bound["tls"].port, "client", DEBUG_TEST_IP, INBOUND_ADDR=f"{DEBUG_TEST_IP}:0"
            )
        )
        await wait_for(lambda: proxy.readiness.ready, what="proxy readiness")
        debug = str(plane.bound["debug"])

        async def synced() -> bool:
            doc = await asyncio.to_thread(fetch_connections, address_fetch(debug), debug)
            return bool(doc["proxies"]) and all(t["sync"] == "SYNCED" for t in doc["proxies"][0]["types"])

        await wait_for(synced, what="every type SYNCED")
        doc = await asyncio.to_thread(fetch_connections, address_fetch(debug), debug)
        (row,) = proxy_status_table(doc, debug).rows
        name, node, cluster, address, authorization, istiod, version = row
        assert name == "client.default" and istiod == debug and version == f"v{plane.ads.snapshot.version}"
        assert address.startswith("SYNCED ") and authorization.startswith("SYNCED ")
        acked, sent = address.split()[1].split("/")
        assert acked == sent and int(sent) >= 2  # two pods and a service, on demand or not
        status = await asyncio.to_thread(address_fetch(debug), "/debug/status")
        assert status[0] == 200 and isinstance(json.loads(status[1]), list)
        # the control plane's own table, into a file: plain lines, one per row, never cut
        out = io.StringIO()
        print_table(Console(file=out, width=40), *status_table(plane))
        lines = out.getvalue().splitlines()
        assert lines[0] == "connected node proxies"
        assert lines[1].split() == [
            "NODE",
            "PROXY",
            "IDENTITY",
            "TYPE",
            "MODE",
            "SENT",
            "ACKED",
            "NACKED",
            "SYNC",
            "LAST",
            "ERROR",
        ]
        assert len(lines) == 4 and all(len(line) > 40 for line in lines[2:])  # wider than the console
        assert not any(ch in out.getvalue() for ch in "┃│━─")
    finally:
        if proxy is not None:
            await proxy.drain(0.5)
        await plane.stop(0)


def test_plain_rendering_matches_the_lab_tables():
    # ztunnel_config's plain rules (aligned columns, two spaces apart), under a title line.
    from ambient_mesh.ztunnel_config import Table

    out = io.StringIO()
    print_table(Console(file=out), "t", ("A", "BB"), [("x", "y")])
    assert out.getvalue() == "t\n" + plain_table(Table(title="t", headers=("A", "BB"), rows=(("x", "y"),)))
