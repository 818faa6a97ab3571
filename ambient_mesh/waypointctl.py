"""`ambient waypoint apply|generate|list|status|delete`: waypoints from the command line.

Counterpart of `istioctl waypoint` (istioctl/pkg/waypoint): the same verbs and flags (`-n`,
`--name`, default `waypoint`, `--for service|workload|all|none`, `--enroll-namespace`, `--wait`,
`--all`, `-A`). A waypoint is a Gateway of class `istio-waypoint` with one HBONE listener on
15008 and its traffic type in `istio.io/waypoint-for`; enrolling a namespace labels it
`istio.io/use-waypoint: <name>`. What the control plane deploys for it is not this module's
business: it only writes, reads and deletes the Gateway.

Three places it writes to: a lab (`--lab`, its objects directory, checked as `ambient lab apply`
checks), a cluster (`--kube`/`--kubeconfig`, server-side apply of the Gateway and a merge patch of
the Namespace's labels), or standard output (`generate`, or `apply -o yaml`). `Target` is the
seam: `LabTarget` and `KubeTarget`; the rendering and the tables are pure functions.

`ambient waypoint` with no verb is the waypoint pod's agent (cli.py `cmd_waypoint`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

import yaml

from .errors import AmbientError, ConfigError
from .metadata import LABEL_USE_WAYPOINT, LABEL_WAYPOINT_FOR, WAYPOINT_GATEWAY_CLASS
from .ports import HBONE_PORT
from .ztunnel_config import Table, render_tables

ACTIONS = ("apply", "generate", "list", "status", "delete")
TRAFFIC_TYPES = ("service", "workload", "all", "none")
DEFAULT_NAME = "waypoint"
GATEWAY_API_VERSION = "gateway.networking.k8s.io/v1"
FIELD_MANAGER = "ambient-waypoint"  # istioctl's server-side apply manager is "istioctl"
WAIT_TIMEOUT_S = 90.0
WAIT_POLL_S = 0.5
PROGRAMMED = "Programmed"
LABEL_REVISION = "istio.io/rev"

__all__ = [
    "ACTIONS",
    "KubeTarget",
    "LabTarget",
    "Target",
    "build_parser",
    "list_table",
    "main",
    "programmed",
    "status_table",
    "waypoint_gateway",
]


# -- what is written (pure) -------------------------------------------------------------------------


def waypoint_gateway(name: str, namespace: str, traffic_type: str, revision: str = "") -> dict[str, Any]:
    """The Gateway `istioctl waypoint apply` writes: class istio-waypoint, one listener `mesh`
    on 15008 speaking HBONE, the traffic type as a label."""
    if traffic_type not in TRAFFIC_TYPES:
        raise ConfigError("--for", f"{traffic_type!r}: use one of {', '.join(TRAFFIC_TYPES)}")
    labels = {LABEL_WAYPOINT_FOR: traffic_type}
    if revision:
        labels[LABEL_REVISION] = revision
    return {
        "apiVersion": GATEWAY_API_VERSION,
        "kind": "Gateway",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "gatewayClassName": WAYPOINT_GATEWAY_CLASS,
            "listeners": [{"name": "mesh", "port": HBONE_PORT, "protocol": "HBONE"}],
        },
    }


def is_waypoint(doc: Mapping[str, Any]) -> bool:
    spec = doc.get("spec")
    return isinstance(spec, dict) and spec.get("gatewayClassName") == WAYPOINT_GATEWAY_CLASS


def conditions(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    status = doc.get("status")
    found = status.get("conditions") if isinstance(status, dict) else None
    return [c for c in found if isinstance(c, dict)] if isinstance(found, list) else []


def programmed(doc: Mapping[str, Any]) -> str:
    """The Gateway's `Programmed` condition status: True, False, or Unknown when none is written."""
    for c in conditions(doc):
        if c.get("type") == PROGRAMMED:
            return str(c.get("status", "Unknown"))
    return "Unknown"


def addresses(doc: Mapping[str, Any]) -> str:
    status = doc.get("status")
    found = status.get("addresses") if isinstance(status, dict) else None
    values = (
        [str(a.get("value", "")) for a in found if isinstance(a, dict)] if isinstance(found, list) else []
    )
    return ",".join(values) or "<none>"


def _meta(doc: Mapping[str, Any]) -> tuple[str, str]:
    meta = doc.get("metadata") or {}
    return str(meta.get("namespace", "")), str(meta.get("name", ""))


def list_table(gateways: Iterable[Mapping[str, Any]], *, all_namespaces: bool) -> Table:
    """`istioctl waypoint list`: NAME, REVISION, PROGRAMMED (NAMESPACE first with -A), and where
    node proxies reach it."""
    rows = []
    for doc in sorted(gateways, key=_meta):
        namespace, name = _meta(doc)
        labels = (doc.get("metadata") or {}).get("labels") or {}
        row = (
            name,
            str(labels.get(LABEL_REVISION, "default")),
            programmed(doc),
            str(labels.get(LABEL_WAYPOINT_FOR, "service")),
            addresses(doc),
        )
        rows.append((namespace, *row) if all_namespaces else row)
    headers = ("NAME", "REVISION", "PROGRAMMED", "FOR", "ADDRESS")
    return Table(
        title="waypoints", headers=("NAMESPACE", *headers) if all_namespaces else headers, rows=tuple(rows)
    )


def status_table(gateways: Iterable[Mapping[str, Any]]) -> Table:
    """`istioctl waypoint status`: every condition of every waypoint, one line each."""
    rows = []
    for doc in sorted(gateways, key=_meta):
        namespace, name = _meta(doc)
        found = conditions(doc)
        if not found:
            rows.append((namespace, name, "Unknown", PROGRAMMED, "Pending", "no status written yet"))
        for c in found:
            rows.append(
                (
                    namespace,
                    name,
                    str(c.get("status", "")),
                    str(c.get("type", "")),
                    str(c.get("reason", "")),
                    str(c.get("message", "")),
                )
            )
    return Table(
        title="waypoint status",
        headers=("NAMESPACE", "NAME", "STATUS", "TYPE", "REASON", "MESSAGE"),
        rows=tuple(rows),
    )


# -- where it is written ----------------------------------------------------------------------------


class Target(Protocol):
    """A place Gateways live: the lab's objects directory or the API server."""

    where: str

    def apply(self, gateway: dict[str, Any]) -> str: ...

    def enroll(self, namespace: str, waypoint: str) -> str: ...

    def gateways(self, namespace: str | None) -> list[dict[str, Any]]:
        """Waypoint Gateways (with their status), in one namespace or all (None)."""

    def delete(self, namespace: str, name: str) -> bool: ...


class LabTarget:
    """A running lab: `ambient lab apply|get|delete` on its objects directory."""

    def __init__(self, state_dir: Path) -> None:
        from .lab.cli import control_status_dir, read_record

        record = read_record(state_dir)
        self.objects_dir = Path(record["objects_dir"])
        self.status_dir = control_status_dir(record)
        self.where = f"the lab in {state_dir}"

    def _apply(self, doc: dict[str, Any], file: str) -> str:
        from .lab import apply as verbs

        manifests = verbs.check(json.dumps(doc), file, default_namespace=_meta(doc)[0])
        lines = verbs.apply(self.objects_dir, manifests)
        lines += verbs.apply_warnings(self.objects_dir, manifests)
        return "\n".join(lines)

    def apply(self, gateway: dict[str, Any]) -> str:
        return self._apply(gateway, "<waypoint>")

    def enroll(self, namespace: str, waypoint: str) -> str:
        from .lab import apply as verbs

        found = verbs.get_documents(self.objects_dir, "Namespace", None)
        doc = next((d for d in found if _meta(d)[1] == namespace), None)
        if doc is None:
            doc = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
        doc.pop("status", None)
        meta = doc.setdefault("metadata", {})
        meta["labels"] = {**(meta.get("labels") or {}), LABEL_USE_WAYPOINT: waypoint}
        return self._apply(doc, "<namespace>")

    def gateways(self, namespace: str | None) -> list[dict[str, Any]]:
        from .lab import apply as verbs

        docs = verbs.get_documents(self.objects_dir, "Gateway", namespace, status_dir=self.status_dir)
        return [d for d in docs if is_waypoint(d)]

    def delete(self, namespace: str, name: str) -> bool:
        from .lab.cluster import remove_object

        return bool(remove_object(self.objects_dir, "Gateway", namespace, name))


class KubeTarget:
    """The API server: server-side apply of the Gateway, a merge patch of the Namespace."""

    def __init__(self, kubeconfig: str) -> None:
        from .kube.kubeconfig import KubeconfigError, credentials

        try:
            self.credentials = credentials(kubeconfig)
        except KubeconfigError as exc:
            raise AmbientError(f"--kubeconfig: {exc.message}", hint=exc.hint) from None
        self.where = self.credentials.server

    def _call(self, verb: str, *args: Any, **kwargs: Any) -> Any:
        """One API call on a client of its own (the CLI makes a handful, one after another)."""
        from .kube.client import KubeClient

        async def run() -> Any:
            client = KubeClient(self.credentials, user_agent=FIELD_MANAGER)
            try:
                return await getattr(client, verb)(*args, **kwargs)
            finally:
                await client.close()

        return asyncio.run(run())

    def apply(self, gateway: dict[str, Any]) -> str:
        from .kube.client import GATEWAYS

        namespace, name = _meta(gateway)
        existed = self._call("get", GATEWAYS, namespace, name) is not None
        self._call("apply", GATEWAYS, gateway, field_manager=FIELD_MANAGER)
        return f"waypoint {namespace}/{name} {'applied' if existed else 'created'}"

    def enroll(self, namespace: str, waypoint: str) -> str:
        from .kube.client import NAMESPACES

        patch = {"metadata": {"labels": {LABEL_USE_WAYPOINT: waypoint}}}
        if self._call("patch_merge", NAMESPACES, None, namespace, patch) is None:
            raise AmbientError(f"namespace {namespace} does not exist")
        return f'namespace {namespace} labelled with "{LABEL_USE_WAYPOINT}: {waypoint}"'

    def gateways(self, namespace: str | None) -> list[dict[str, Any]]:
        from .kube.client import GATEWAYS

        result = self._call("list", GATEWAYS, namespace=namespace)
        return [d for d in result.items if is_waypoint(d)]

    def delete(self, namespace: str, name: str) -> bool:
        from .kube.client import GATEWAYS

        return bool(self._call("delete", GATEWAYS, namespace, name))


def choose_target(args: argparse.Namespace) -> Target:
    """`--lab` or `--kube`/`--kubeconfig` as asked; else a running lab at --state-dir, else
    the cluster KUBECONFIG (or the in-cluster account) names."""
    if args.lab and (args.kube or args.kubeconfig):
        raise AmbientError("give either --lab or --kube/--kubeconfig, not both")
    if args.lab:
        return LabTarget(Path(args.state_dir).resolve())
    if args.kube or args.kubeconfig:
        return KubeTarget(args.kubeconfig or "")
    from .lab.lab import STATE_FILE

    if (Path(args.state_dir) / STATE_FILE).exists():
        return LabTarget(Path(args.state_dir).resolve())
    try:
        return KubeTarget("")
    except AmbientError as exc:
        raise AmbientError(
            f"no lab running in {args.state_dir} and no cluster: {exc}",
            hint="start a lab (`ambient lab up`), or pass --kubeconfig, or print the Gateway with -o yaml",
        ) from None


# -- the verbs ----------------------------------------------------------------------------------------


def wait_programmed(target: Target, namespace: str, name: str, timeout_s: float, out: IO[str]) -> bool:
    """Poll until the Gateway's `Programmed` is True (istioctl's `--wait`); bounded."""
    deadline = time.monotonic() + timeout_s
    started = time.monotonic()
    while time.monotonic() < deadline:
        found = [g for g in target.gateways(namespace) if _meta(g)[1] == name]
        if found and programmed(found[0]) == "True":
            print(f"waypoint {namespace}/{name} programmed in {time.monotonic() - started:.1f}s", file=out)
            return True
        time.sleep(WAIT_POLL_S)
    return False


def _apply(args: argparse.Namespace, out: IO[str]) -> int:
    gateway = waypoint_gateway(args.name, args.namespace, args.traffic_type, args.revision)
    if args.action == "generate" or args.output == "yaml":
        out.write(yaml.safe_dump(gateway, sort_keys=False))
        return 0
    target = choose_target(args)
    print(target.apply(gateway), file=out)
    if args.enroll_namespace:
        print(target.enroll(args.namespace, args.name), file=out)
    if args.wait and not wait_programmed(target, args.namespace, args.name, args.timeout, out):
        raise AmbientError(
            f"waypoint {args.namespace}/{args.name} not programmed after {args.timeout:g}s",
            hint="`ambient waypoint status` shows its conditions; is the control plane deploying it?",
        )
    return 0


def _delete(args: argparse.Namespace, out: IO[str]) -> int:
    target = choose_target(args)
    names = list(args.names)
    if args.all:
        if names:
            raise AmbientError("give waypoint names or --all, not both")
        names = [_meta(g)[1] for g in target.gateways(args.namespace)]
    elif not names:
        names = [DEFAULT_NAME]
    ok = True
    for name in names:
        if target.delete(args.namespace, name):
            print(f"waypoint {args.namespace}/{name} deleted", file=out)
        else:
            ok = False
            print(f"waypoint {args.namespace}/{name} not found", file=out)
    return 0 if ok else 1


def _show(args: argparse.Namespace, out: IO[str]) -> int:
    target = choose_target(args)
    namespace = None if args.all_namespaces else args.namespace
    gateways = target.gateways(namespace)
    if args.action == "status":
        gateways = [g for g in gateways if args.name is None or _meta(g)[1] == args.name]
    if not gateways:
        where = "" if namespace is None else f" in namespace {namespace}"
        print(f"No waypoints found{where}.", file=out)
        return 0
    if args.output == "yaml":
        out.write(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": gateways}, sort_keys=False))
        return 0
    table = (
        status_table(gateways)
        if args.action == "status"
        else list_table(gateways, all_namespaces=namespace is None)
    )
    render_tables([table], out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .lab.lab import DEFAULT_STATE_DIR

    parser = argparse.ArgumentParser(
        prog="ambient waypoint",
        description="Waypoints as istioctl manages them: a Gateway of class istio-waypoint. "
        "`ambient waypoint` without a verb runs the waypoint pod's agent.",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-n", "--namespace", default="default", help="(default: %(default)s)")
    common.add_argument("--lab", action="store_true", help="a running lab (its --state-dir)")
    common.add_argument("--state-dir", default=DEFAULT_STATE_DIR, help="the lab's (default: %(default)s)")
    common.add_argument("--kube", action="store_true", help="the cluster of KUBECONFIG or in-cluster")
    common.add_argument("--kubeconfig", default=None, help="a kubeconfig file (implies --kube)")
    sub = parser.add_subparsers(dest="action", required=True, metavar="COMMAND")
    for verb, text in (
        ("apply", "create or update a waypoint (and enroll its namespace)"),
        ("generate", "print the waypoint's Gateway as YAML"),
    ):
        p = sub.add_parser(verb, parents=[common], help=text)
        p.add_argument("--name", default=DEFAULT_NAME, help="(default: %(default)s)")
        p.add_argument(
            "--for",
            dest="traffic_type",
            choices=TRAFFIC_TYPES,
            default="service",
            help="the traffic it takes (istio.io/waypoint-for; default: %(default)s)",
        )
        p.add_argument("--revision", "-r", default="", help="istio.io/rev label")
        p.add_argument(
            "--enroll-namespace",
            action="store_true",
            help="label the namespace istio.io/use-waypoint=<name>",
        )
        p.add_argument("--wait", action="store_true", help="wait until the waypoint is programmed")
        p.add_argument("--timeout", type=float, default=WAIT_TIMEOUT_S, help="for --wait, seconds")
        p.add_argument("-o", "--output", choices=("", "yaml"), default="", help="yaml: print, write nothing")
    p = sub.add_parser("list", parents=[common], help="the waypoints of a namespace (-A: all)")
    p.add_argument("-A", "--all-namespaces", action="store_true")
    p.add_argument("-o", "--output", choices=("table", "yaml"), default="table")
    p = sub.add_parser("status", parents=[common], help="the conditions the control plane wrote")
    p.add_argument("--name", default=None, help="only this waypoint")
    p.add_argument("-A", "--all-namespaces", action="store_true")
    p.add_argument("-o", "--output", choices=("table", "yaml"), default="table")
    p = sub.add_parser("delete", parents=[common], help="delete waypoints (default: `waypoint`)")
    p.add_argument("names", nargs="*", metavar="NAME")
    p.add_argument("--all", action="store_true", help="every waypoint of the namespace")
    return parser


def main(argv: Sequence[str], *, out: IO[str] | None = None) -> int:
    out = out or sys.stdout
    args = build_parser().parse_args(list(argv))
    if args.action in ("apply", "generate"):
        return _apply(args, out)
    if args.action == "delete":
        return _delete(args, out)
    return _show(args, out)
