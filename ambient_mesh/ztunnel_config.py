"""`ambient ztunnel-config`: read a node proxy's /config_dump and print it as istioctl does.

Counterpart: `istioctl ztunnel-config` (istio/istio istioctl/pkg/ztunnelconfig and
istioctl/pkg/writer/ztunnel/configdump). Same views, columns, sort orders and filters, but the
dump comes straight from the admin endpoint (`--admin`, default 127.0.0.1:15000) rather than
through a Kubernetes port-forward. Works against our proxy and against Istio's ztunnel alike.

Decide, then do I/O: `fetch_config_dump` is the only network call; everything else turns a
dump dict into rows (pure, tested without sockets) and hands them to rich.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import IO, Any

import yaml

from .errors import AmbientError
from .net import split_host_port
from .ports import ADMIN_PORT

DEFAULT_ADMIN = f"127.0.0.1:{ADMIN_PORT}"
FETCH_TIMEOUT_S = 5.0
KINDS = ("workloads", "services", "policies", "certificates", "all", "connections")
OUTPUTS = ("short", "table", "json", "yaml")  # istioctl's `short` summary; `table` is the same
# istioctl ztunnel-config's sub-commands and their aliases (`log` is handled by the CLI).
KIND_ALIASES = {
    **{a: "workloads" for a in ("workload", "workloads", "w")},
    **{a: "services" for a in ("service", "services", "svc", "s")},
    **{a: "policies" for a in ("policy", "policies", "pol", "p")},
    **{a: "certificates" for a in ("certificate", "certificates", "certs", "cert")},
    **{a: "connections" for a in ("connections", "cons")},
    "all": "all",
}
MAX_DUMP_FILE_BYTES = 64 * 1024 * 1024  # a dump of a large node is a few MB

Dump = dict[str, Any]
Row = tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Table:
    """What one istioctl summary prints: a header line and rows, already sorted and filtered."""

    title: str
    headers: Row
    rows: tuple[Row, ...] = field(default=())


@dataclass(frozen=True, slots=True, kw_only=True)
class Filters:
    """istioctl's `--namespace`, and `--node` / `--address` for workloads; empty means any."""

    namespace: str = ""
    node: str = ""  # workloads on this node (istioctl's --workload-node)
    address: str = ""
    direction: str = ""  # connections: inbound or outbound
    raw: bool = False  # connections: addresses, not names


# -- fetching ------------------------------------------------------------------------------------


def fetch_config_dump(admin: str, *, timeout_s: float = FETCH_TIMEOUT_S) -> Dump:
    """GET http://<admin>/config_dump and decode it; AmbientError with a hint when unreachable."""
    try:
        host, port = split_host_port(admin)
    except AmbientError as err:
        raise AmbientError(f"--admin: {err.message}", hint="give host:port, e.g. 127.0.0.1:15000") from None
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/config_dump"
    hint = "is the node proxy running? is --admin right? (ztunnel's ADMIN_ADDR, default 127.0.0.1:15000)"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 - http only, by construction
            body = response.read()
    except urllib.error.HTTPError as err:
        raise AmbientError(f"{url}: HTTP {err.code} {err.reason}", hint=hint) from None
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise AmbientError(f"cannot reach the admin endpoint {url}: {reason}", hint=hint) from None
    try:
        dump = json.loads(body)
    except ValueError as err:
        raise AmbientError(f"{url} did not answer JSON: {err}", hint=hint) from None
    if not isinstance(dump, dict):
        raise AmbientError(f"{url} answered JSON that is not an object", hint=hint)
    return dump


# -- rows (pure) ---------------------------------------------------------------------------------


def _services(dump: Dump) -> list[Dump]:
    services = dump.get("services") or []
    # Older ztunnels keyed services by VIP; take the values either way.
    return list(services.values()) if isinstance(services, dict) else list(services)


def _workloads(dump: Dump) -> list[Dump]:
    workloads = dump.get("workloads") or []
    return list(workloads.values()) if isinstance(workloads, dict) else list(workloads)


def _policies(dump: Dump) -> list[Dump]:
    policies = dump.get("policies") or {}
    return list(policies.values()) if isinstance(policies, dict) else list(policies)


def _same(a: str, b: str) -> bool:
    return a.casefold() == b.casefold()  # istioctl's filters use strings.EqualFold


def gateway_name(gateway: Dump | None, services: Iterable[Dump]) -> str:
    """The waypoint column: the waypoint service's name, `None` without one, `NA` if unknown.

    The destination is "network/ip" (a service VIP) or "namespace/hostname".
    """
    if not gateway:
        return "None"
    destination = str(gateway.get("destination", ""))
    for svc in services:
        if destination in (svc.get("vips") or []):
            return str(svc.get("name", ""))
        if destination == f"{svc.get('namespace', '')}/{svc.get('hostname', '')}":
            return str(svc.get("name", ""))
    return "NA"


def workload_table(dump: Dump, filters: Filters = Filters()) -> Table:
    services = _services(dump)
    chosen = []
    for w in _workloads(dump):
        if filters.namespace and not _same(str(w.get("namespace", "")), filters.namespace):
            continue
        if filters.node and not _same(str(w.get("node", "")), filters.node):
            continue
        if filters.address and not any(_same(str(ip), filters.address) for ip in w.get("workloadIps") or []):
            continue
        chosen.append(w)
    chosen.sort(key=lambda w: (f"{w.get('namespace', '')}.{w.get('name', '')}", str(w.get("node", ""))))
    rows = tuple(
        (
            str(w.get("namespace", "")),
            str(w.get("name", "")),
            str((w.get("workloadIps") or [""])[0]),
            str(w.get("node", "")),
            gateway_name(w.get("waypoint"), services),
            str(w.get("protocol", "")),
        )
        for w in chosen
    )
    return Table(
        title="workloads",
        headers=("NAMESPACE", "POD NAME", "ADDRESS", "NODE", "WAYPOINT", "PROTOCOL"),
        rows=rows,
    )


def _services_filtered(dump: Dump, filters: Filters) -> list[Dump]:
    services = [
        s
        for s in _services(dump)
        if not filters.namespace or _same(str(s.get("namespace", "")), filters.namespace)
    ]
    services.sort(
        key=lambda s: (str(s.get("namespace", "")), str(s.get("name", "")), str(s.get("hostname", "")))
    )
    return services


def service_table(dump: Dump, filters: Filters = Filters()) -> Table:
    every = _services(dump)
    rows = []
    for s in _services_filtered(dump, filters):
        vips = s.get("vips") or []
        vip = str(vips[0]).partition("/")[2] if vips else ""
        endpoints = (s.get("endpoints") or {}).values()
        healthy = sum(1 for ep in endpoints if ep.get("status", "Healthy") == "Healthy")
        rows.append(
            (
                str(s.get("namespace", "")),
                str(s.get("name", "")),
                vip,
                gateway_name(s.get("waypoint"), every),
                f"{healthy}/{len(endpoints)}",
            )
        )
    return Table(
        title="services",
        headers=("NAMESPACE", "SERVICE NAME", "SERVICE VIP", "WAYPOINT", "ENDPOINTS"),
        rows=tuple(rows),
    )


def _policies_filtered(dump: Dump, filters: Filters) -> list[Dump]:
    policies = [
        p
        for p in _policies(dump)
        if not filters.namespace or _same(str(p.get("namespace", "")), filters.namespace)
    ]
    policies.sort(key=lambda p: (str(p.get("namespace", "")), str(p.get("name", ""))))
    return policies


def policy_table(dump: Dump, filters: Filters = Filters()) -> Table:
    rows = tuple(
        (
            str(p.get("namespace", "")),
            str(p.get("name", "")),
            str(p.get("action", "")),
            str(p.get("scope", "")),
        )
        for p in _policies_filtered(dump, filters)
    )
    return Table(title="policies", headers=("NAMESPACE", "POLICY NAME", "ACTION", "SCOPE"), rows=rows)


def _parse_rfc3339(text: str) -> datetime | None:
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def cert_valid(cert: Dump, now: datetime) -> bool:
    """istioctl's VALID CERT: now is strictly inside the validity window."""
    start = _parse_rfc3339(str(cert.get("validFrom", "")))
    end = _parse_rfc3339(str(cert.get("expirationTime", "")))
    return start is not None and end is not None and start < now < end


def _serial_hex(serial: str) -> str:
    # The dump has the serial in decimal; istioctl prints it in hex.
    try:
        return format(int(serial, 10), "x")
    except ValueError:
        return "NA"


def _na(value: object) -> str:
    return str(value) if value else "NA"


def certificate_table(dump: Dump, now: datetime) -> Table:
    rows: list[Row] = []
    for entry in dump.get("certificates") or []:
        identity = str(entry.get("identity", ""))
        state = str(entry.get("state", ""))
        if "Unavailable" in state:
            state = "Unavailable"  # the reason is in the JSON view
        chain = entry.get("certChain") or []
        roots = entry.get("rootCerts") or []
        if not chain:
            rows.append((identity, "NA", state, "false", "NA", "NA", "NA"))
            continue
        # Before rootCerts existed, the root was the last element of certChain.
        legacy = not roots
        for i, cert in enumerate(chain):
            kind = "Leaf" if i == 0 else ("Root" if legacy and i == len(chain) - 1 else "Intermediate")
            rows.append(_cert_row(identity, kind, state, cert, now))
        for cert in roots:
            rows.append(_cert_row(identity, "Root", state, cert, now))
    return Table(
        title="certificates",
        headers=(
            "CERTIFICATE NAME",
            "TYPE",
            "STATUS",
            "VALID CERT",
            "SERIAL NUMBER",
            "NOT AFTER",
            "NOT BEFORE",
        ),
        rows=tuple(rows),
    )


def _cert_row(identity: str, kind: str, state: str, cert: Dump, now: datetime) -> Row:
    return (
        identity,
        kind,
        state,
        str(cert_valid(cert, now)).lower(),
        _serial_hex(str(cert.get("serialNumber", ""))),
        _na(cert.get("expirationTime")),
        _na(cert.get("validFrom")),
    )


def _names_by_ip(dump: Dump) -> dict[str, str]:
    names = {}
    for w in _workloads(dump):
        for ip in w.get("workloadIps") or []:
            names[str(ip)] = f"{w.get('name', '')}.{w.get('namespace', '')}"
    for svc in _services(dump):
        for vip in svc.get("vips") or []:
            names[str(vip).partition("/")[2] or str(vip)] = str(svc.get("hostname", ""))
    return names


def _addr(address: str, names: dict[str, str], raw: bool) -> str:
    if raw or not address:
        return address
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    return f"{names[host]}:{port}" if host in names else address


def connection_table(dump: Dump, filters: Filters = Filters()) -> Table:
    """istioctl's connections summary: every proxied pod's open connections, by direction."""
    names = _names_by_ip(dump)
    states = [v for v in (dump.get("workloadState") or {}).values() if isinstance(v, dict)]
    states.sort(
        key=lambda v: (str(v.get("info", {}).get("namespace", "")), str(v.get("info", {}).get("name", "")))
    )
    rows = []
    for state in states:
        info = state.get("info") or {}
        if filters.namespace and not _same(str(info.get("namespace", "")), filters.namespace):
            continue
        name = f"{info.get('name', '')}.{info.get('namespace', '')}"
        conns = state.get("connections") or {}
        if filters.direction != "outbound":
            for c in conns.get("inbound") or []:
                rows.append(
                    (
                        name,
                        "Inbound",
                        _addr(str(c.get("actualDst", c.get("originalDst", ""))), names, filters.raw),
                        _addr(str(c.get("src", "")), names, filters.raw),
                        "",
                        str(c.get("protocol", "")),
                    )
                )
        if filters.direction != "inbound":
            for c in conns.get("outbound") or []:
                rows.append(
                    (
                        name,
                        "Outbound",
                        _addr(str(c.get("src", "")), names, filters.raw),
                        _addr(str(c.get("actualDst", "")), names, filters.raw),
                        _addr(str(c.get("originalDst", "")), names, filters.raw),
                        str(c.get("protocol", "")),
                    )
                )
    return Table(
        title="connections",
        headers=("WORKLOAD", "DIRECTION", "LOCAL", "REMOTE", "REMOTE TARGET", "PROTOCOL"),
        rows=tuple(rows),
    )


def read_dump_file(path: str, stdin: IO[str] | None = None) -> Dump:
    """istioctl's `--file`: a saved /config_dump (`-` reads standard input)."""
    import sys

    try:
        if path == "-":
            text = (stdin or sys.stdin).read(MAX_DUMP_FILE_BYTES + 1)
        else:
            with open(path, encoding="utf-8") as f:
                text = f.read(MAX_DUMP_FILE_BYTES + 1)
    except (OSError, UnicodeDecodeError) as err:
        raise AmbientError(f"--file {path}: cannot read: {err}") from None
    if len(text) > MAX_DUMP_FILE_BYTES:
        raise AmbientError(f"--file {path}: larger than {MAX_DUMP_FILE_BYTES} bytes")
    try:
        dump = json.loads(text)
    except ValueError as err:
        raise AmbientError(
            f"--file {path}: not JSON: {err}", hint="save it with curl localhost:15000/config_dump"
        ) from None
    if not isinstance(dump, dict):
        raise AmbientError(f"--file {path}: JSON that is not an object")
    return dump


def tables(kind: str, dump: Dump, filters: Filters, now: datetime) -> list[Table]:
    if kind == "connections":
        return [connection_table(dump, filters)]
    builders: dict[str, Callable[[], Table]] = {
        "workloads": lambda: workload_table(dump, filters),
        "services": lambda: service_table(dump, filters),
        "policies": lambda: policy_table(dump, filters),
        "certificates": lambda: certificate_table(dump, now),
    }
    if kind == "all":
        return [build() for build in builders.values()]
    return [builders[kind]()]


def selection(kind: str, dump: Dump, filters: Filters) -> Any:
    """What `-o json|yaml` prints: the filtered items of one kind, or the whole dump for `all`."""
    if kind == "workloads":
        rows = workload_table(dump, filters)  # reuse the filter and order
        keep = {(r[0], r[1], r[3]) for r in rows.rows}
        return sorted(
            (
                w
                for w in _workloads(dump)
                if (str(w.get("namespace", "")), str(w.get("name", "")), str(w.get("node", ""))) in keep
            ),
            key=lambda w: (f"{w.get('namespace', '')}.{w.get('name', '')}", str(w.get("node", ""))),
        )
    if kind == "services":
        return _services_filtered(dump, filters)
    if kind == "policies":
        return _policies_filtered(dump, filters)
    if kind == "certificates":
        return dump.get("certificates") or []
    if kind == "connections":
        states = dump.get("workloadState") or {}
        return [
            v
            for v in states.values()
            if isinstance(v, dict)
            and (
                not filters.namespace
                or _same(str((v.get("info") or {}).get("namespace", "")), filters.namespace)
            )
        ]
    return dump


# -- which node proxy ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class AdminTarget:
    """A node proxy's admin endpoint: an address, inside a network namespace for a lab node
    (the admin API listens on the node's loopback, as ztunnel's does in its pod)."""

    address: str = DEFAULT_ADMIN
    netns: str | None = None
    label: str = ""

    def request(self, method: str, path: str, *, timeout_s: float = FETCH_TIMEOUT_S) -> tuple[int, bytes]:
        import http.client

        from .host.netns import entered

        host, port = split_host_port(self.address)
        conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
        where = f"{self.label or self.address} (admin {self.address})"
        hint = (
            "is the node proxy running? (`ambient lab status`; ztunnel's ADMIN_ADDR, default 127.0.0.1:15000)"
        )
        try:
            if self.netns is not None:
                with entered(self.netns):
                    conn.connect()  # the socket stays in the namespace it was made in
            conn.request(method, path)
            response = conn.getresponse()
            return response.status, response.read()
        except (OSError, http.client.HTTPException) as err:
            raise AmbientError(f"cannot reach the node proxy on {where}: {err}", hint=hint) from None
        finally:
            conn.close()

    def config_dump(self) -> Dump:
        status, body = self.request("GET", "/config_dump")
        if status != 200:
            raise AmbientError(f"{self.label or self.address}: /config_dump answered HTTP {status}")
        try:
            dump = json.loads(body)
        except ValueError as err:
            raise AmbientError(f"{self.label or self.address}: /config_dump is not JSON: {err}") from None
        if not isinstance(dump, dict):
            raise AmbientError(f"{self.label or self.address}: /config_dump is not a JSON object")
        return dump


def lab_target(state_dir: str, node: str) -> AdminTarget:
    """`--node NAME` in a lab: that node's proxy (istioctl picks the ztunnel pod on the node)."""
    from pathlib import Path

    path = Path(state_dir) / "lab.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        raise AmbientError(
            f"--node {node}: no lab is running with state dir {state_dir}",
            hint="start one with `ambient lab up`, or give the proxy's --admin address",
        ) from None
    nodes = record.get("nodes") or {}
    if node not in nodes:
        raise AmbientError(f"--node {node}: the lab has no such node; nodes: {', '.join(nodes)}")
    return AdminTarget(address=nodes[node]["admin"], netns=nodes[node]["netns"], label=f"node {node}")


LOG_LEVELS = ("trace", "debug", "info", "warning", "warn", "error", "critical", "off")


def log_query(level: str | None, reset: bool) -> str:
    """The `/logging` request istioctl sends: `level=<spec>`, or a reset to info; levels checked."""
    if level and reset:
        raise AmbientError("--level cannot be combined with --reset")
    if reset:
        return "/logging?level=info&reset"
    if not level:
        return "/logging"
    for part in level.split(","):
        name = part.rsplit(":", 1)[-1].rsplit("=", 1)[-1]
        if name not in LOG_LEVELS:
            raise AmbientError(
                f"unrecognized logging level: {name}", hint=f"use one of {', '.join(LOG_LEVELS)}"
            )
    # ztunnel's names: warn for warning, error for critical; `scope:level` is ztunnel's `scope=level`.
    spec = ",".join(p.replace(":", "=") for p in level.split(","))
    spec = spec.replace("warning", "warn").replace("critical", "error")
    return f"/logging?level={spec}"


def run_log(target: AdminTarget, *, level: str | None, reset: bool, out: IO[str]) -> int:
    status, body = target.request("POST", log_query(level, reset))
    out.write(f"{target.label or target.address}:\n{body.decode(errors='replace')}")
    if not body.endswith(b"\n"):
        out.write("\n")
    return 0 if status == 200 else 1


# -- printing ------------------------------------------------------------------------------------


def render_tables(items: list[Table], out: IO[str]) -> None:
    """Rich tables on a terminal; plain, space-aligned lines (no styling, no width limit) into a
    file or a pipe, so logs and `grep` see whole rows."""
    isatty = getattr(out, "isatty", None)
    if not (isatty and isatty()):
        for index, table in enumerate(items):
            if index:
                out.write("\n")
            out.write(plain_table(table))
        return
    from rich import box
    from rich.console import Console
    from rich.table import Table as RichTable

    console = Console(
        file=out,
        width=max(80, _wanted_width(items)),
        soft_wrap=True,
        highlight=False,
        emoji=False,
        markup=False,
    )
    for index, table in enumerate(items):
        if index:
            console.print()
        rich_table = RichTable(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
        for header in table.headers:
            rich_table.add_column(header, no_wrap=True, overflow="fold")
        for row in table.rows:
            rich_table.add_row(*row)
        console.print(rich_table)


def plain_table(table: Table) -> str:
    """Columns padded to their widest cell, two spaces apart, as kubectl prints them."""
    widths = [len(h) for h in table.headers]
    for row in table.rows:
        widths = [max(w, len(v)) for w, v in zip(widths, row, strict=False)]
    lines = []
    for row in (table.headers, *table.rows):
        lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=False)).rstrip())
    return "\n".join(lines) + "\n"


def _wanted_width(items: list[Table]) -> int:
    widest = 0
    for table in items:
        cols = [len(h) for h in table.headers]
        for row in table.rows:
            cols = [max(c, len(v)) for c, v in zip(cols, row, strict=False)]
        widest = max(widest, sum(cols) + 3 * len(cols))
    return widest


def render(kind: str, dump: Dump, *, output: str, filters: Filters, now: datetime, out: IO[str]) -> None:
    if output in ("short", "table"):
        render_tables(tables(kind, dump, filters, now), out)
    elif output == "json":
        out.write(json.dumps(selection(kind, dump, filters), indent=2) + "\n")
    elif output == "yaml":
        out.write(yaml.safe_dump(selection(kind, dump, filters), sort_keys=False, default_flow_style=False))
    else:
        raise AmbientError(f"unknown output format {output!r}", hint=f"use one of {', '.join(OUTPUTS)}")


def run(
    kind: str,
    *,
    admin: str = DEFAULT_ADMIN,
    output: str = "short",
    filters: Filters = Filters(),
    out: IO[str],
    fetch: Callable[[str], Dump] = fetch_config_dump,
    now: datetime | None = None,
) -> int:
    """Fetch, then print; errors surface as AmbientError for the CLI to show."""
    kind = KIND_ALIASES.get(kind, kind)
    if kind not in KINDS:
        raise AmbientError(f"unknown view {kind!r}", hint=f"use one of {', '.join(sorted(KIND_ALIASES))}")
    dump = fetch(admin)
    render(kind, dump, output=output, filters=filters, now=now or datetime.now(UTC), out=out)
    return 0


__all__ = [
    "DEFAULT_ADMIN",
    "KINDS",
    "KIND_ALIASES",
    "OUTPUTS",
    "AdminTarget",
    "Filters",
    "Table",
    "certificate_table",
    "connection_table",
    "fetch_config_dump",
    "gateway_name",
    "policy_table",
    "render",
    "run",
    "selection",
    "service_table",
    "tables",
    "workload_table",
]
