"""`ambient explain --live`: the node proxies' own view, and what a test connection moved.

In a lab: each node proxy on the path is asked for its /config_dump (does it hold the
destination workload and every policy explain evaluated?), and a test connection is made from
inside the source pod's network namespace while the proxies' counters are read before and
after; every counter that moved is printed, with the connection's outcome.
"""

from __future__ import annotations

import re
import socket
from typing import Any

from ..errors import AmbientError
from ..host.netns import http_get, netns_socket
from ..net import SocketAddr
from ..ports import STATS_PORT
from ..state.store import ProxyState
from ..ztunnel_config import lab_target
from .explain import Explanation, resolve_target
from .view import MeshView

TEST_CONNECT_TIMEOUT_S = 3.0
TEST_PAYLOAD = b"ambient explain --live\n"
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{.*\})?)\s+([0-9.eE+-]+)$")


def _counters(netns: str) -> dict[str, float]:
    status, body = http_get(netns, "127.0.0.1", STATS_PORT, "/metrics")
    if status != 200:
        return {}
    out = {}
    for line in body.decode(errors="replace").splitlines():
        m = _SAMPLE.match(line)
        if m and ("_total" in m.group(1) or "_count" in m.group(1)):
            out[m.group(1)] = float(m.group(2))
    return out


def _test_connection(netns: str, target: SocketAddr) -> str:
    family = socket.AF_INET6 if target.ip.version == 6 else socket.AF_INET
    try:
        with netns_socket(netns, family) as sock:
            sock.settimeout(TEST_CONNECT_TIMEOUT_S)
            sock.connect((str(target.ip), target.port))
            sock.sendall(TEST_PAYLOAD)
            sock.shutdown(socket.SHUT_WR)
            data = sock.recv(4096)
    except OSError as exc:
        return f"failed: {exc}"
    return f"connected; {len(data)} bytes came back" if data else "connected, then closed with no data"


def _dump_check(state_dir: str, node: str, uid: str | None, policies: list[str]) -> list[str]:
    try:
        dump = lab_target(state_dir, node).config_dump()
    except AmbientError as exc:
        return [f"{node}: {exc}"]
    uids = {w.get("uid") for w in dump.get("workloads", []) if isinstance(w, dict)}
    held = dump.get("policies", {})
    names = set(held) if isinstance(held, dict) else {f"{p.get('namespace')}/{p.get('name')}" for p in held}
    lines = [f"{node}'s proxy holds {len(uids)} workloads and {len(names)} policies"]
    if uid is not None:
        lines.append(f"  destination workload {uid}: {'held' if uid in uids else 'MISSING'}")
    missing = [p for p in policies if p not in names]
    if policies:
        held_text = "all held" if not missing else f"MISSING {', '.join(missing)}"
        lines.append(f"  the {len(policies)} policies evaluated above: {held_text}")
    return lines


# The labels that say what happened to a connection; the rest of Istio's 30 are left out.
SHOWN_LABELS = ("reporter", "response_flags", "source_principal", "destination_principal")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def short_sample(name: str) -> str:
    metric, _, labels = name.partition("{")
    kept = [f'{k}="{v}"' for k, v in _LABEL.findall(labels) if k in SHOWN_LABELS]
    return f"{metric}{{{','.join(kept)}}}" if kept else metric


def live_lines(
    view: MeshView,
    state: ProxyState,
    answer: Explanation,
    source: str,
    destination: str,
    *,
    namespace: str,
    port: int | None,
) -> list[str]:
    record: dict[str, Any] | None = view.lab
    if record is None:
        return ["--live: only in a lab (a cluster's proxies are reached through their pods; not done yet)"]
    state_dir = record["state_dir"]
    pod = record["pods"].get(source) or next(
        (
            p
            for p in record["pods"].values()
            if f"{p['name']}.{p['namespace']}" == source or p["ip"] == source
        ),
        None,
    )
    if pod is None:
        return ["--live: the source is not a pod of the lab; no test connection"]
    target, _ = resolve_target(view, state, destination, namespace, port)
    dst_node = answer.destination_node
    nodes = sorted({pod["node"], *([dst_node] if dst_node and dst_node in record["nodes"] else [])})
    out = ["live:"]
    for node in nodes:
        at_destination = node == dst_node
        checked = _dump_check(
            state_dir,
            node,
            answer.destination_uid if at_destination else None,
            list(answer.evaluated) if at_destination else [],
        )
        out.extend("  " + line for line in checked)
    before = {n: _counters(record["nodes"][n]["netns"]) for n in nodes}
    outcome = _test_connection(pod["netns"], target)
    after = {n: _counters(record["nodes"][n]["netns"]) for n in nodes}
    out.append(f"  test connection from {pod['namespace']}/{pod['name']} to {target}: {outcome}")
    denied_at_destination = False
    for n in nodes:
        moved = [
            (k, after[n][k] - before[n].get(k, 0.0))
            for k in sorted(after[n])
            if after[n][k] != before[n].get(k, 0.0) and k.startswith("istio_")
        ]
        out.append(f"  {n}: {len(moved)} istio counters moved")
        out.extend(f"    +{delta:g} {short_sample(name)}" for name, delta in moved)
        if n == dst_node:
            denied_at_destination = any('response_flags="DENY"' in name for name, _ in moved)
    if dst_node is not None and answer.verdict in ("ALLOWED", "DENIED"):
        agrees = denied_at_destination == (answer.verdict == "DENIED")
        out.append(
            f"  the destination's counters {'agree' if agrees else 'DISAGREE'}: "
            f"{'a DENY was' if denied_at_destination else 'no DENY was'} recorded on {dst_node}"
        )
    return out
