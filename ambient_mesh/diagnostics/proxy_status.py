"""`ambient proxy-status`: every node proxy connected to the control plane, and whether it has
what it was sent.

Counterpart: `istioctl proxy-status` (istioctl/pkg/proxystatus), which asks istiod's debug
endpoint. Ours asks `ambient control`'s (control/debug.py `/debug/connections`): in a lab from
inside the lab's network namespace, elsewhere at `--control ADDRESS` (a port-forward to the
control plane's debug port, 15014). One row per proxy; per type (Address, Authorization)
SYNCED, STALE, NACKED or NOT SENT, with how many resources were sent and acknowledged.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable
from typing import Any

from ..control.debug import DEBUG_PORT
from ..errors import AmbientError
from ..net import split_host_port
from ..ztunnel_config import Table

Fetch = Callable[[str], tuple[int, bytes]]


def lab_fetch(record: dict[str, Any]) -> Fetch:
    from ..host.netns import http_get

    netns = record["control"]["netns"]
    return lambda path: http_get(netns, "127.0.0.1", DEBUG_PORT, path)


def address_fetch(address: str) -> Fetch:
    host, port = split_host_port(address)

    def fetch(path: str) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(host, port, timeout=5.0)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    return fetch


def fetch_connections(fetch: Fetch, where: str) -> dict[str, Any]:
    try:
        status, body = fetch("/debug/connections")
    except (OSError, http.client.HTTPException) as exc:
        raise AmbientError(
            f"cannot reach the control plane's debug endpoint ({where}): {exc}",
            hint="is `ambient control` running with --debug-listen (default 127.0.0.1:15014)?",
        ) from None
    if status != 200:
        raise AmbientError(f"{where}: /debug/connections answered HTTP {status}")
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise AmbientError(f"{where}: /debug/connections is not JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("proxies"), list):
        raise AmbientError(f"{where}: /debug/connections has no proxies list")
    return doc


def _cell(entry: dict[str, Any]) -> str:
    sync = str(entry.get("sync", "?"))
    counts = f"{entry.get('resources_acked', 0)}/{entry.get('resources_sent', 0)}"
    if sync == "NACKED":
        return f"NACKED {counts}: {entry.get('last_error', '')}"
    return f"{sync} {counts}"


def proxy_status_table(doc: dict[str, Any], control: str) -> Table:
    """istioctl's NAME, CLUSTER, the per-type sync columns, ISTIOD, VERSION; plus the node."""
    rows = []
    for proxy in sorted(doc["proxies"], key=lambda p: (p.get("node_name", ""), p.get("node_id", ""))):
        node_id = str(proxy.get("node_id", ""))
        parts = node_id.split("~")
        name = parts[2] if len(parts) > 2 else node_id or str(proxy.get("peer", ""))
        types = {t.get("type"): t for t in proxy.get("types", [])}
        rows.append(
            (
                name,
                str(proxy.get("node_name") or "-"),
                str(proxy.get("cluster_id") or "-"),
                _cell(types["Address"]) if "Address" in types else "NOT SUBSCRIBED",
                _cell(types["Authorization"]) if "Authorization" in types else "NOT SUBSCRIBED",
                control,
                f"v{doc.get('version', '')}",
            )
        )
    return Table(
        title="node proxies",
        headers=(
            "NAME",
            "NODE",
            "CLUSTER",
            "ADDRESS (ACKED/SENT)",
            "AUTHORIZATION (ACKED/SENT)",
            "ISTIOD",
            "VERSION",
        ),
        rows=tuple(rows),
    )
