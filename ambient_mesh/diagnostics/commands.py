"""The diagnostics' sub-commands: `analyze`, `x describe`, `proxy-status`, `explain`.

Only argument parsing and dispatch; the work is in the modules beside this one, imported when a
command runs (so `ambient --help` stays quick).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from ..errors import AmbientError

if TYPE_CHECKING:
    from .view import MeshView

DEFAULT_LAB_STATE_DIR = "/run/ambient-lab"  # lab.lab.DEFAULT_STATE_DIR (not imported: --help stays quick)


def _target_args(p: argparse.ArgumentParser, *, files: bool) -> None:
    p.add_argument("--lab", action="store_true", help="a running lab (the default without files or --kube)")
    p.add_argument("--state-dir", default=DEFAULT_LAB_STATE_DIR, help="the lab's (default: %(default)s)")
    p.add_argument(
        "--kube", action="store_true", help="a cluster: in-cluster account, --kubeconfig or KUBECONFIG"
    )
    p.add_argument("--kubeconfig", default=None, help="kubeconfig for --kube (implies --kube)")
    if files:
        p.add_argument("files", nargs="*", metavar="FILE", help="YAML files or directories instead of a mesh")


def view_of(args: argparse.Namespace) -> MeshView:
    from .view import cluster_view, directory_view, lab_view

    files = getattr(args, "files", None) or []
    kube = args.kube or args.kubeconfig
    if sum(bool(x) for x in (files, kube, args.lab)) > 1:
        raise AmbientError("give one of: files, --kube, --lab")
    if files:
        return directory_view(files)
    if kube:
        import asyncio

        return asyncio.run(cluster_view(args.kubeconfig or ""))
    return lab_view(args.state_dir)


def cmd_analyze(args: argparse.Namespace) -> int:
    from .analyze import ERROR, analyze, render

    view = view_of(args)
    messages = analyze(view, namespace=None if args.all_namespaces else args.namespace)
    if args.output == "json":
        sys.stdout.write(json.dumps([m.to_dict() for m in messages], indent=2) + "\n")
    else:
        sys.stdout.write(render(messages, view.where))
    return 1 if any(m.level == ERROR for m in messages) else 0


def cmd_describe(args: argparse.Namespace) -> int:
    from .describe import describe_pod, describe_service, split_name
    from .mesh_state import proxy_state, translation_of

    view = view_of(args)
    state = proxy_state(translation_of(view))
    namespace, name = split_name(args.name, args.namespace)
    describe = describe_pod if args.kind in ("pod", "pods", "po") else describe_service
    sys.stdout.write("".join(line + "\n" for line in describe(view, state, namespace, name)))
    return 0


def cmd_proxy_status(args: argparse.Namespace) -> int:
    from ..ztunnel_config import render_tables
    from .proxy_status import address_fetch, fetch_connections, lab_fetch, proxy_status_table
    from .view import read_lab_record

    if args.control:
        fetch, where = address_fetch(args.control), args.control
    else:
        record = read_lab_record(args.state_dir)
        fetch, where = lab_fetch(record), f"lab {args.state_dir} control plane"
    doc = fetch_connections(fetch, where)
    if args.output == "json":
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return 0
    table = proxy_status_table(doc, where)
    if not table.rows:
        print(f"no node proxy is connected to {where}")
        return 0
    render_tables([table], sys.stdout)
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from .explain import explain
    from .mesh_state import proxy_state, translation_of

    if args.dump:
        from ..kube.store import KubeStore
        from ..ztunnel_config import read_dump_file
        from .mesh_state import dump_state
        from .view import MeshView

        view = MeshView(where=f"config dump {args.dump}", store=KubeStore(()), dump=True)
        state = dump_state(read_dump_file(args.dump), args.dump)
    else:
        view = view_of(args)
        state = proxy_state(translation_of(view))
    answer = explain(view, state, args.source, args.destination, namespace=args.namespace, port=args.port)
    lines = answer.lines()
    if args.live:
        from .live import live_lines

        lines += live_lines(
            view, state, answer, args.source, args.destination, namespace=args.namespace, port=args.port
        )
    if args.output == "json":
        doc = {
            "source": answer.source,
            "destination": answer.destination,
            "verdict": answer.verdict,
            "reason": answer.reason,
            "policy": answer.policy,
            "rule": answer.rule,
            "route": answer.route.value if answer.route else None,
            "waypoint": answer.waypoint,
            "hops": [
                {"step": h.step, "where": h.where, "decision": h.decision, "details": list(h.details)}
                for h in answer.hops
            ],
        }
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        sys.stdout.write("".join(line + "\n" for line in lines))
    return 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "analyze",
        help="check a mesh's configuration for problems (istioctl analyze's ambient checks, IST codes)",
    )
    _target_args(p, files=True)
    p.add_argument("-n", "--namespace", default=None, help="only this namespace")
    p.add_argument("-A", "--all-namespaces", action="store_true", help="every namespace (the default)")
    p.add_argument("-o", "--output", choices=["text", "json"], default="text")
    p.set_defaults(func=cmd_analyze)

    p = sub.add_parser("x", help="experimental commands, as istioctl x: describe")
    xs = p.add_subparsers(dest="x_command", required=True, metavar="COMMAND")
    d = xs.add_parser(
        "describe",
        help="a pod or service as the mesh sees it: identity, capture, waypoint, policies and why",
    )
    d.add_argument("kind", choices=["pod", "pods", "po", "service", "services", "svc"])
    d.add_argument("name", help="NAME, NAMESPACE/NAME or NAME.NAMESPACE")
    d.add_argument("-n", "--namespace", default="default", help="(default: %(default)s)")
    _target_args(d, files=False)
    d.add_argument(
        "-f", "--file", dest="files", action="append", default=None, help="YAML files instead of a mesh"
    )
    d.set_defaults(func=cmd_describe)
    p = sub.add_parser(
        "proxy-status",
        aliases=["ps"],
        help="every node proxy connected to the control plane: what it was sent, ACKed or NACKed, in sync",
    )
    p.add_argument("--state-dir", default=DEFAULT_LAB_STATE_DIR, help="the lab's (default: %(default)s)")
    p.add_argument(
        "--control", default=None, help="the control plane's debug address (a port-forward to its 15014)"
    )
    p.add_argument("-o", "--output", choices=["table", "json"], default="table")
    p.set_defaults(func=cmd_proxy_status)
    p = sub.add_parser(
        "explain",
        help="why a connection is allowed, denied, not captured or sent to a waypoint, hop by hop",
    )
    p.add_argument("source", metavar="SRC", help="a pod (NS/NAME or NAME.NS) or an IP address")
    p.add_argument(
        "destination", metavar="DST", help="a pod or service (NS/NAME[:PORT], NAME.NS[:PORT]) or ADDRESS:PORT"
    )
    p.add_argument(
        "--port", type=int, default=None, help="the destination port (default: the service's first)"
    )
    p.add_argument(
        "-n", "--namespace", default="default", help="for names without one (default: %(default)s)"
    )
    _target_args(p, files=False)
    p.add_argument(
        "-f", "--file", dest="files", action="append", default=None, help="YAML files instead of a mesh"
    )
    p.add_argument(
        "--dump",
        default=None,
        metavar="FILE",
        help="a node proxy's saved /config_dump (as `ambient zc --file`)",
    )
    p.add_argument(
        "--live",
        action="store_true",
        help="in a lab: the node proxies' own config dumps, and the counters a test connection moves",
    )
    p.add_argument("-o", "--output", choices=["text", "json"], default="text")
    p.set_defaults(func=cmd_explain)
