"""`ambient lab ...`: drive a lab like a small cluster, from any shell.

Counterpart: `kind create/delete cluster` and the kubectl verbs a user needs around an ambient
mesh (`get`, `apply`, `delete`, `logs`, `exec`). `up` runs in the foreground as the lab's
supervisor; every other verb works from another shell through the state directory: lab.json
(layout and pids), journal.jsonl (what `down` must undo) and objects/ (the API server).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import yaml

from ..errors import AmbientError, ConfigError
from ..host.commands import SubprocessRunner
from ..host.private import check_private_dir
from ..ztunnel_config import Table, render_tables
from .cluster import parse_pod_spec, pod_uid
from .journal import read_journal, same_process, sweep
from .lab import (
    DEFAULT_STATE_DIR,
    READY_TIMEOUT_S,
    ROLLOUT_DIR,
    STATE_FILE,
    Lab,
    LabConfig,
)
from .selectors import Selector, parse_selector
from .status import headline, live_status, status_tables
from .topofile import DEFAULT_TOPOLOGY, load_topology, pod_spec_from_object
from .topology import MAX_LAB_NODES

if TYPE_CHECKING:
    from .apply import Manifest

SUPERVISE_INTERVAL_S = 0.2
FOLLOW_INTERVAL_S = 0.2
LOG_READ_BYTES = 1 << 20
COMPONENTS = ("control", "agent", "ztunnel")
ROLLOUT_TIMEOUT_S = READY_TIMEOUT_S + 30.0  # the new proxy's start, plus the supervisor's other work


def read_record(state_dir: Path) -> dict[str, Any]:
    if state_dir.exists():
        check_private_dir(state_dir)  # a record another user could write is not the lab's
    try:
        record: dict[str, Any] = json.loads((state_dir / STATE_FILE).read_text())
        return record
    except FileNotFoundError:
        state = journal_state(state_dir)
        if state == "running":
            raise AmbientError(
                f"the lab in {state_dir} is still starting", hint="try again in a moment"
            ) from None
        if state == "crashed":
            raise AmbientError(
                f"the lab in {state_dir} stopped before it was ready",
                hint="`ambient lab down` removes what it left; `ambient lab logs` shows why",
            ) from None
        raise AmbientError(
            f"no lab is running with state dir {state_dir}", hint="start one with `ambient lab up`"
        ) from None
    except ValueError as e:
        raise AmbientError(f"{state_dir / STATE_FILE} is not JSON: {e}") from None


def node_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 1 <= value <= MAX_LAB_NODES:
        raise argparse.ArgumentTypeError(f"{value}: the lab runs 1 to {MAX_LAB_NODES} nodes")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ambient lab",
        description="a multi-node ambient mesh in network namespaces, driven like a small cluster",
    )
    parser.add_argument("--state-dir", default=DEFAULT_STATE_DIR, help="(default: %(default)s)")
    sub = parser.add_subparsers(dest="action", required=True, metavar="COMMAND")
    up = sub.add_parser("up", help="start the lab and supervise it until Ctrl-C or `ambient lab down`")
    up.add_argument(
        "-f",
        "--filename",
        default=None,
        metavar="FILE",
        help="a topology file (Kubernetes YAML and a `kind: Lab` document; `ambient lab topology` "
        "prints the default one)",
    )
    up.add_argument(
        "--nodes",
        type=node_count,
        default=None,
        help=f"number of nodes, 1-{MAX_LAB_NODES} (default: the topology's)",
    )
    up.add_argument(
        "--pod",
        action="append",
        default=None,
        metavar="NODE:NS/NAME[@SA][,k=v]",
        help="instead of the topology's pods: a pod running the echo app (repeatable)",
    )
    up.add_argument(
        "--ambient-namespace",
        action="append",
        default=None,
        metavar="NS",
        help="with --pod: a namespace labelled istio.io/dataplane-mode=ambient",
    )
    up.add_argument("--nftables", action="store_true", help="the node agents use NATIVE_NFTABLES=true")
    sub.add_parser("topology", help="print the default topology file (a starting point for your own)")
    st = sub.add_parser("status", help="what is live: processes, readiness, restarts, pods")
    st.add_argument("-o", "--output", choices=("table", "json"), default="table")
    sub.add_parser("down", help="stop the lab and remove everything it created (safe to repeat)")
    ex = sub.add_parser("exec", help="run a command inside a pod's network namespace")
    ex.add_argument("pod", help="namespace/name")
    ex.add_argument("command", nargs=argparse.REMAINDER, help="-- command and arguments")
    lg = sub.add_parser("logs", help="a component's log: control, agent, ztunnel (with --node) or a pod")
    lg.add_argument("component", help="control | agent | ztunnel | NAMESPACE/POD")
    lg.add_argument("--node", default=None, help="the node, for agent and ztunnel (default: the first)")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing as the log grows")
    lg.add_argument("--tail", type=int, default=None, metavar="N", help="only the last N lines")
    ds = sub.add_parser(
        "describe", help="one object in detail: a pod or node (what is live), else the object"
    )
    ds.add_argument("kind", help="pod, node, or any kind `get` serves")
    ds.add_argument("name", help="the object's name (a pod's may be NAMESPACE/NAME)")
    ds.add_argument("-n", "--namespace", default="default", help="(default: %(default)s)")
    ro = sub.add_parser(
        "rollout",
        help="replace the node proxies one node at a time, the new one first (kubectl rollout restart)",
    )
    ro.add_argument("component", choices=("ztunnel",), help="what to roll: the node proxies")
    ro.add_argument("--node", action="append", default=None, help="only this node (repeatable; default: all)")
    for verb, text in (
        ("apply", "create or update objects from manifests (checked as the control plane checks them)"),
        ("delete", "delete the objects named in manifests"),
    ):
        v = sub.add_parser(verb, help=text)
        v.add_argument(
            "-f",
            "--filename",
            action="append",
            required=True,
            metavar="FILE",
            help="a file, a directory or -",
        )
        v.add_argument(
            "-n", "--namespace", default="default", help="for objects without one (default: %(default)s)"
        )
    gt = sub.add_parser("get", help="list objects of a kind (pods, svc, ns, ap, pa, se, we, ...)")
    gt.add_argument("kind", help="a kind, its plural or short name (kubectl's)")
    gt.add_argument("-n", "--namespace", default="default", help="(default: %(default)s)")
    gt.add_argument("-A", "--all-namespaces", action="store_true")
    gt.add_argument(
        "-o",
        "--output",
        choices=("table", "wide", "yaml", "json"),
        default="table",
        help="wide: the table with more columns (labels; for nodes their namespace and components)",
    )
    gt.add_argument(
        "-l",
        "--selector",
        default=None,
        metavar="SELECTOR",
        help="only objects whose labels match (kubectl's: k=v, k!=v, 'k in (a,b)', k, !k; comma = and)",
    )
    return parser


def lab_config(args: argparse.Namespace, state_dir: Path) -> LabConfig:
    """What `up` builds, from the flags and the topology file; everything checked."""
    if args.pod:
        if args.filename:
            raise ConfigError("--pod", "give pods either in the topology file (-f) or with --pod, not both")
        config = LabConfig(
            state_dir=state_dir,
            nodes=tuple(f"node-{i + 1}" for i in range(args.nodes or 2)),
            pods=tuple(parse_pod_spec(p) for p in args.pod),
            native_nftables=args.nftables,
            ambient_namespaces=frozenset(args.ambient_namespace or ()),
        )
    else:
        if args.ambient_namespace:
            raise ConfigError("--ambient-namespace", "label the Namespace in the topology file instead")
        topo = load_topology(args.filename)
        config = LabConfig(
            state_dir=state_dir,
            nodes=tuple(f"node-{i + 1}" for i in range(args.nodes)) if args.nodes else topo.nodes,
            pods=topo.pods,
            objects=topo.objects,
            ambient_namespaces=topo.ambient_namespaces,
            native_nftables=args.nftables or topo.nftables,
        )
    config.validate()
    return config


def _up(args: argparse.Namespace, state_dir: Path, out: IO[str]) -> int:
    config = lab_config(args, state_dir)  # before anything exists
    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True
        # A second signal during start-up interrupts it; teardown still runs.
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def say(line: str) -> None:
        print(line, file=out, flush=True)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    started = time.monotonic()
    lab = Lab(config)
    try:
        lab.start(say=say)
        if not stop:
            render_tables(status_tables(lab.status()), out)
            say(f"lab is up in {time.monotonic() - started:.1f}s")
            say(
                "`ambient lab status`, `ambient lab exec <ns/pod> -- <cmd>`, `ambient lab logs ztunnel "
                "--node node-1`; Ctrl-C or `ambient lab down` to stop"
            )
        while not stop:
            for event in lab.supervise():
                say(f"supervisor: {event}")
            time.sleep(SUPERVISE_INTERVAL_S)
        say("stopping the lab")
    finally:
        lab.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _down(state_dir: Path, out: IO[str]) -> int:
    def say(line: str) -> None:
        print(line, file=out, flush=True)

    report = sweep(state_dir, SubprocessRunner(), say=say)
    if report is None:
        say(f"no lab in {state_dir}: nothing to do")
        return 0
    with contextlib.suppress(FileNotFoundError):
        (state_dir / STATE_FILE).unlink()
    extra = []
    if report.namespaces:
        extra.append(f"{len(report.namespaces)} namespaces")
    if report.processes:
        extra.append(f"{len(report.processes)} processes")
    say("lab is down" + (f" (removed what it had left: {', '.join(extra)})" if extra else ""))
    return 0


def log_path(record: Mapping[str, Any], component: str, node: str | None) -> Path:
    """Which log file `ambient lab logs COMPONENT [--node N]` means."""
    logs = Path(record["state_dir"]) / "logs"
    nodes = list(record["nodes"])
    if component == "control":
        return logs / "control.log"
    if component in ("agent", "ztunnel", "cni", "istio-cni"):
        name = node or nodes[0]
        if name not in record["nodes"]:
            raise AmbientError(f"no node {name!r} in the lab; nodes: {', '.join(nodes)}")
        return logs / f"{'ztunnel' if component == 'ztunnel' else 'agent'}-{name}.log"
    if "/" in component:
        pod = record["pods"].get(component)
        if pod is None:
            raise AmbientError(f"no pod {component!r} in the lab; pods: {', '.join(record['pods'])}")
        return logs / f"app-{pod['namespace']}-{pod['name']}.log"
    raise AmbientError(
        f"unknown component {component!r}",
        hint="use control, agent, ztunnel (with --node NODE) or NAMESPACE/POD",
    )


def _logs(record: Mapping[str, Any], args: argparse.Namespace, out: IO[str]) -> int:
    path = log_path(record, args.component, args.node)
    try:
        f = open(path, "rb")  # noqa: SIM115 - kept open while following
    except FileNotFoundError:
        raise AmbientError(f"{path} does not exist (has the component started?)") from None
    with f:
        size = f.seek(0, 2)
        start = max(0, size - LOG_READ_BYTES)
        f.seek(start)
        data = f.read()
        if start > 0:
            # Only the last LOG_READ_BYTES are read: begin at the first whole line in them.
            data = data[data.find(b"\n") + 1 :] if b"\n" in data else b""
        text = data.decode(errors="replace")
        if args.tail is not None:
            text = "".join(text.splitlines(keepends=True)[-args.tail :]) if args.tail > 0 else ""
        out.write(text)
        out.flush()
        while args.follow:
            chunk = f.read(LOG_READ_BYTES)
            if chunk:
                out.write(chunk.decode(errors="replace"))
                out.flush()
            else:
                time.sleep(FOLLOW_INTERVAL_S)
    return 0


def _objects(record: Mapping[str, Any], args: argparse.Namespace, out: IO[str]) -> int:
    from . import apply as verbs

    if not same_process(int(record["pid"]), None):
        raise AmbientError(
            f"the lab in {record['state_dir']} is not running (pid {record['pid']} is gone)",
            hint="`ambient lab down`, then `ambient lab up`",
        )
    objects_dir = Path(record["objects_dir"])
    if args.action == "get":
        kind = verbs.kind_of(args.kind)
        namespace = None if args.all_namespaces else args.namespace
        selector = parse_selector(args.selector) if args.selector is not None else None
        if kind == "Node":
            return _nodes(record, args.output, selector, out)
        if args.output in ("table", "wide"):
            table = verbs.get_table(
                objects_dir, kind, namespace, selector=selector, wide=args.output == "wide"
            )
            if not table.rows:
                print(
                    f"No resources found{'' if namespace is None else ' in ' + namespace + ' namespace'}.",
                    file=out,
                )
                return 0
            render_tables([table], out)
        else:
            docs = verbs.get_documents(
                objects_dir, kind, namespace, selector=selector, status_dir=control_status_dir(record)
            )
            listed = {"apiVersion": "v1", "kind": "List", "items": docs}
            if args.output == "json":
                out.write(json.dumps(listed, indent=2, default=str) + "\n")
            else:
                out.write(yaml.safe_dump(listed, sort_keys=False))
        return 0
    manifests = []
    for name, text in verbs.read_sources(args.filename):
        manifests += verbs.check(text, name, default_namespace=args.namespace, allow_pods=True)
    if args.action == "apply":
        for m in manifests:
            if m.kind == "Pod":
                check_new_pod(record, m)
                # The API server gives a Pod its uid when it is created, before anything reads
                # it: the node agent must never see the object without the uid the lab's
                # kubelet then runs the sandbox (and ZDS) under.
                m.doc["metadata"]["uid"] = pod_uid(record["lab"], m.namespace, m.doc["metadata"]["name"])
        lines = verbs.apply(objects_dir, manifests)
        lines += verbs.apply_warnings(objects_dir, manifests)
        ok = True
    else:
        lines, ok = verbs.delete(objects_dir, manifests)
    for line in lines:
        print(line, file=out)
    return 0 if ok else 1


def node_objects(status: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The lab's nodes as the API server would list them: labels, addresses, pod CIDR, and the
    Ready condition (true while both its node agent and its node proxy are ready)."""
    docs = []
    for name, node in status["nodes"].items():
        ready = node["agent"]["ready"] and node["ztunnel"]["ready"]
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"},
                    "annotations": {"ambient.lab/netns": node["netns"]},
                },
                "spec": {"podCIDR": node["pod_cidr"], "podCIDRs": [node["pod_cidr"]]},
                "status": {
                    "addresses": [
                        {"type": "InternalIP", "address": node["address"]},
                        {"type": "Hostname", "address": name},
                    ],
                    "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                },
            }
        )
    return docs


def _nodes(record: Mapping[str, Any], output: str, selector: Selector | None, out: IO[str]) -> int:
    """`ambient lab get nodes`: nodes are the lab's own (lab.json), not objects a user applies."""
    from .apply import labels_text

    status = live_status(record, SubprocessRunner())
    docs = [d for d in node_objects(status) if selector is None or selector.matches(d["metadata"]["labels"])]
    if output in ("yaml", "json"):
        listed = {"apiVersion": "v1", "kind": "List", "items": docs}
        out.write(
            json.dumps(listed, indent=2) + "\n"
            if output == "json"
            else yaml.safe_dump(listed, sort_keys=False)
        )
        return 0
    if not docs:
        print("No resources found.", file=out)
        return 0
    wide = output == "wide"
    headers: tuple[str, ...] = ("NAME", "STATUS", "INTERNAL-IP", "POD CIDR")
    if wide:
        headers += ("NETNS", "AGENT", "ZTUNNEL", "LABELS")
    rows = []
    for doc in docs:
        name = doc["metadata"]["name"]
        node = status["nodes"][name]
        ready = doc["status"]["conditions"][0]["status"] == "True"
        row: tuple[str, ...] = ("Ready" if ready else "NotReady", node["address"], node["pod_cidr"])
        if wide:
            row += (
                node["netns"],
                node["agent"]["state"] + ("" if node["agent"]["ready"] else " (not ready)"),
                node["ztunnel"]["state"] + ("" if node["ztunnel"]["ready"] else " (not ready)"),
                labels_text(doc["metadata"]["labels"]),
            )
        rows.append((name, *row))
    render_tables([Table(title="Node", headers=headers, rows=tuple(rows))], out)
    return 0


def _lines(pairs: list[tuple[str, object]]) -> str:
    """kubectl describe's layout: `Key:  value`, the values aligned."""
    width = max(len(k) for k, _ in pairs) + 2
    return "".join(f"{k + ':':<{width}}{v}\n" for k, v in pairs)


def _process(component: Mapping[str, Any]) -> str:
    text = f"{component['state']}, {'ready' if component['ready'] else 'not ready'}"
    if component.get("pid"):
        text += f", pid {component['pid']}"
    if component.get("restarts"):
        text += f", {component['restarts']} restarts"
    return text


def _describe(record: Mapping[str, Any], args: argparse.Namespace, out: IO[str]) -> int:
    """`ambient lab describe KIND NAME`: for a pod or a node, its object joined with what is live
    (processes, readiness, enrollment, identity, services); for other kinds, the object."""
    from . import apply as verbs

    kind = verbs.kind_of(args.kind)
    if kind == "Node":
        status = live_status(record, SubprocessRunner())
        node = status["nodes"].get(args.name)
        if node is None:
            raise AmbientError(f"no node {args.name!r} in the lab; nodes: {', '.join(status['nodes'])}")
        pods = sorted(k for k, p in status["pods"].items() if p["node"] == args.name)
        pairs: list[tuple[str, object]] = [
            ("Name", args.name),
            ("Ready", node["agent"]["ready"] and node["ztunnel"]["ready"]),
            ("Address", node["address"]),
            ("Pod CIDR", node["pod_cidr"]),
            ("Netns", node["netns"]),
            ("Node agent", _process(node["agent"])),
            ("Node proxy", _process(node["ztunnel"])),
            ("Node proxy admin", f"{node['admin']} (stats {node['stats']})"),
        ]
        pairs += [("Draining proxy", _process(old)) for old in node.get("ztunnel_draining", ())]
        pairs.append(("Pods", ", ".join(pods) or "<none>"))
        out.write(_lines(pairs))
        return 0
    if kind == "Pod":
        key = args.name if "/" in args.name else f"{args.namespace}/{args.name}"
        status = live_status(record, SubprocessRunner())
        pod = status["pods"].get(key)
        if pod is None:
            raise AmbientError(f"no pod {key!r} in the lab; pods: {', '.join(status['pods'])}")
        rec = record["pods"][key]
        labels = ",".join(f"{k}={v}" for k, v in sorted(rec.get("labels", {}).items())) or "<none>"
        out.write(
            _lines(
                [
                    ("Name", rec["name"]),
                    ("Namespace", rec["namespace"]),
                    ("Node", pod["node"]),
                    ("IP", pod["ip"]),
                    ("UID", rec["uid"]),
                    ("Service account", rec["service_account"]),
                    ("Labels", labels),
                    ("Netns", pod["netns"]),
                    ("Ambient namespace", pod["ambient"]),
                    ("Enrolled", pod["enrolled"]),
                    ("Identity", pod["identity"] or "<none>"),
                    ("Services", ", ".join(pod["services"]) or "<none>"),
                    ("App", _process(pod["app"])),
                    ("Log", f"ambient lab logs {key}"),
                ]
            )
        )
        return 0
    namespace = None if kind in verbs.CLUSTER_SCOPED else args.namespace
    docs = [
        d
        for d in verbs.get_documents(Path(record["objects_dir"]), kind, namespace)
        if (d.get("metadata") or {}).get("name") == args.name
    ]
    if not docs:
        raise AmbientError(f"no {kind} {args.name!r}" + (f" in namespace {namespace}" if namespace else ""))
    out.write(yaml.safe_dump(docs[0], sort_keys=False))
    return 0


def _rollout(record: Mapping[str, Any], nodes: list[str], out: IO[str]) -> int:
    """Ask the `up` supervisor to roll each node's proxy (lab.py `rollout_proxy`), one node after
    the other as a DaemonSet with maxUnavailable 0 does, and wait for each to be done."""
    if not same_process(int(record["pid"]), None):
        raise AmbientError(f"the lab in {record['state_dir']} is not running (pid {record['pid']} is gone)")
    for name in nodes:
        if name not in record["nodes"]:
            raise AmbientError(f"no node {name!r} in the lab; nodes: {', '.join(record['nodes'])}")
    requests = Path(record["state_dir"]) / ROLLOUT_DIR
    requests.mkdir(exist_ok=True)
    failed = False
    for name in nodes:
        done = requests / f"done-ztunnel-{name}"
        done.unlink(missing_ok=True)
        started = time.monotonic()
        (requests / f"ztunnel-{name}").write_text("restart\n")
        deadline = started + ROLLOUT_TIMEOUT_S
        while not done.exists():
            if time.monotonic() > deadline or not same_process(int(record["pid"]), None):
                raise AmbientError(
                    f"the rollout of the node proxy on {name} did not finish within {ROLLOUT_TIMEOUT_S:.0f}s",
                    hint="`ambient lab logs ztunnel --node " + name + "` and the `up` output say why",
                )
            time.sleep(FOLLOW_INTERVAL_S)
        outcome = done.read_text().strip()
        done.unlink(missing_ok=True)
        if outcome.startswith("ok "):
            print(
                f"ztunnel on {name}: pid {outcome[3:]} serves every pod "
                f"({time.monotonic() - started:.1f}s); the old one drains its connections",
                file=out,
            )
        else:
            print(f"ztunnel on {name}: {outcome}", file=out)
            failed = True
    return 1 if failed else 0


def control_status_dir(record: Mapping[str, Any]) -> Path:
    """Where the lab's control plane writes its objects' status (control/plane.py, --state-dir)."""
    from ..control.plane import STATUS_DIR_NAME

    return Path(record["state_dir"]) / "control" / STATUS_DIR_NAME


def check_new_pod(record: Mapping[str, Any], manifest: Manifest) -> None:
    """A Pod applied to a running lab: the lab's kubelet (the `up` supervisor) will create its
    sandbox; it must name one of the lab's nodes and one of its apps, and be new (the lab does
    not change a running pod: delete it, then apply it again)."""
    spec = pod_spec_from_object(manifest.doc, manifest.file)
    if spec.node not in record["nodes"]:
        raise ConfigError(
            manifest.file, f"Pod {spec.key}: node {spec.node!r} is not one of {', '.join(record['nodes'])}"
        )
    if spec.key in record["pods"]:
        raise ConfigError(
            manifest.file, f"Pod {spec.key} exists: a running pod is not changed; delete it, then apply it"
        )


def _exec(record: Mapping[str, Any], args: argparse.Namespace) -> int:
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise AmbientError("ambient lab exec needs a command after the pod: `-- sh`")
    pod = record["pods"].get(args.pod)
    if pod is None:
        raise AmbientError(f"no pod {args.pod!r} in the lab; pods: {', '.join(record['pods'])}")
    return subprocess.call(["ip", "netns", "exec", pod["netns"], *command])


def main(argv: Iterable[str] | None = None, *, out: IO[str] | None = None) -> int:
    """`ambient lab COMMAND`: the CLI entry the `ambient` command delegates to."""
    out = out or sys.stdout
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    state_dir = Path(args.state_dir).resolve()
    try:
        if args.action == "up":
            return _up(args, state_dir, out)
        if args.action == "down":
            return _down(state_dir, out)
        if args.action == "topology":
            out.write(DEFAULT_TOPOLOGY)
            return 0
        record = read_record(state_dir)
        if args.action == "status":
            status = live_status(record, SubprocessRunner())
            if args.output == "json":
                out.write(json.dumps(status, indent=2) + "\n")
            else:
                print(headline(status), file=out)
                render_tables(status_tables(status), out)
            return 0 if status["running"] else 1
        if args.action == "logs":
            return _logs(record, args, out)
        if args.action == "describe":
            return _describe(record, args, out)
        if args.action == "rollout":
            return _rollout(record, args.node or list(record["nodes"]), out)
        if args.action in ("apply", "delete", "get"):
            return _objects(record, args, out)
        return _exec(record, args)
    except (AmbientError, ConfigError) as e:
        print(f"ambient lab: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def journal_state(state_dir: Path) -> str:
    """`running`, `crashed` (a journal whose lab process is gone) or `down`."""
    rec = read_journal(state_dir)
    if rec is None:
        return "down"
    return "running" if rec.lab_alive else "crashed"


if __name__ == "__main__":
    sys.exit(main())
