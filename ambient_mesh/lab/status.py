"""`ambient lab status`: what is live in a lab, from another shell.

Counterpart: `kubectl get pods -o wide` across istio-system and the workload namespaces, plus
`istioctl ztunnel-config workloads`: lab.json (written by the running lab, lab.py `record()`)
gives the layout and the pids; this module adds what is true now: whether each process is
still the one recorded (pid and start time), whether the node agents and node proxies answer
their readiness endpoints, each pod's enrollment (the node agent's marks), identity and the
Services selecting it (the objects directory, read with the control plane's parser).
"""

from __future__ import annotations

import http.client
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import AmbientError
from ..host.commands import CommandRunner
from ..host.netns import http_get, listening_ports
from ..kube.load import load_directory
from ..kube.model import Namespace, Service
from ..metadata import LABEL_DATAPLANE_MODE
from ..ports import CNI_HEALTH_PORT, READINESS_PORT, XDS_CA_PORT
from ..ztunnel_config import Table
from .journal import same_process

PROBE_TIMEOUT_S = 1.0
TRUST_DOMAIN = "cluster.local"


def _alive(program: Mapping[str, Any] | None) -> bool:
    if not program:
        return False
    return same_process(int(program["pid"]), program.get("start"))


def _probe(netns: str, port: int, path: str) -> bool:
    try:
        status, _ = http_get(netns, "127.0.0.1", port, path, timeout_s=PROBE_TIMEOUT_S)
    except (OSError, http.client.HTTPException):
        return False
    return status == 200


def _listens(runner: CommandRunner, netns: str, port: int) -> bool:
    """Whether something listens on `port` in `netns`; a namespace that is gone listens on nothing."""
    try:
        return port in listening_ports(runner, netns)
    except AmbientError:
        return False


def _marks(run_dir: str) -> dict[str, str]:
    import json

    try:
        doc = json.loads((Path(run_dir) / "enrolled-pods.json").read_text())
    except (OSError, ValueError):
        return {}
    pods = doc.get("pods", {}) if isinstance(doc, dict) else {}
    return {uid: m.get("value", "") for uid, m in pods.items() if isinstance(m, dict)}


def _component(program: Mapping[str, Any] | None, *, ready: bool | None) -> dict[str, Any]:
    """One process's state and readiness. `ready` is its probe's answer; None for a process
    without a readiness probe, which is ready while it runs (the kubelet's rule for a container
    without one). The table and the JSON both show this one `ready`."""
    alive = _alive(program)
    state = "running" if alive else "exited"
    if program and program.get("backoff_s") is not None and not alive:
        state = "backoff"
    if program is None:
        state = "stopped"
    return {
        "state": state,
        "pid": program["pid"] if program else None,
        "ready": alive and (ready is None or bool(ready)),
        "restarts": program.get("restarts", 0) if program else 0,
        "log": program.get("log") if program else None,
    }


def live_status(record: Mapping[str, Any], runner: CommandRunner) -> dict[str, Any]:
    """`record` (lab.json) with what is live added."""
    lab_alive = same_process(int(record["pid"]), None)
    control = record["control"]
    control_alive = _alive(control.get("process"))
    control_ready = lab_alive and control_alive and _listens(runner, control["netns"], XDS_CA_PORT)
    nodes = {}
    for name, node in record["nodes"].items():
        agent_ready = (
            lab_alive and _alive(node["agent"]) and _probe(node["netns"], CNI_HEALTH_PORT, "/readyz")
        )
        # The node proxy's readiness port moves while a rollout runs two of them (lab.py).
        readiness_port = int(str(node.get("readiness", f":{READINESS_PORT}")).rpartition(":")[2])
        proxy_ready = (
            lab_alive and _alive(node["ztunnel"]) and _probe(node["netns"], readiness_port, "/healthz/ready")
        )
        nodes[name] = {
            **{k: node[k] for k in ("netns", "address", "pod_cidr", "admin", "stats")},
            "agent": _component(node["agent"], ready=agent_ready),
            "ztunnel": _component(node["ztunnel"], ready=proxy_ready),
            "ztunnel_draining": [
                _component(p, ready=False) for p in node.get("ztunnel_draining", ()) if _alive(p)
            ],
        }
    loaded = load_directory(record["objects_dir"]) if Path(record["objects_dir"]).is_dir() else None
    services: list[Service] = [o for o in loaded.objects if isinstance(o, Service)] if loaded else []
    ambient_ns = {
        o.metadata.name
        for o in (loaded.objects if loaded else ())
        if isinstance(o, Namespace) and o.metadata.labels.get(LABEL_DATAPLANE_MODE) == "ambient"
    }
    marks = {name: _marks(node["run_dir"]) for name, node in record["nodes"].items()}
    pods = {}
    for key, pod in record["pods"].items():
        labels = pod.get("labels", {})
        enrolled = marks.get(pod["node"], {}).get(pod["uid"]) == "enabled"
        selecting = sorted(
            f"{s.metadata.name}"
            for s in services
            if s.metadata.namespace == pod["namespace"]
            and s.selector
            and all(labels.get(k) == v for k, v in s.selector.items())
        )
        pods[key] = {
            "node": pod["node"],
            "ip": pod["ip"],
            "netns": pod["netns"],
            "ambient": pod["namespace"] in ambient_ns,
            "enrolled": enrolled,
            "identity": (
                f"spiffe://{TRUST_DOMAIN}/ns/{pod['namespace']}/sa/{pod['service_account']}"
                if enrolled
                else ""
            ),
            "services": selecting,
            "app": _component(pod.get("app"), ready=None),
        }
    status = {
        "lab": record["lab"],
        "pid": record["pid"],
        "running": lab_alive,
        "started": bool(record.get("ready")) and lab_alive,
        "state_dir": record["state_dir"],
        "control": {
            "address": control["address"],
            "netns": control["netns"],
            **_component(control.get("process"), ready=control_ready),
        },
        "dns": {
            "address": record.get("dns", {}).get("address", ""),
            **_component(record.get("dns", {}).get("process"), ready=None),
        },
        "nodes": nodes,
        "pods": pods,
    }
    status["not_ready"] = not_ready(status)
    status["ready"] = status["started"] and not status["not_ready"]
    return status


def not_ready(status: Mapping[str, Any]) -> list[str]:
    """Every component whose `ready` is false, as `what (state)`: the one place the lab's own
    readiness comes from, so the headline, the tables and the JSON cannot disagree."""
    parts: list[tuple[str, Mapping[str, Any]]] = [("control", status["control"])]
    if status.get("dns", {}).get("pid"):
        parts.append(("dns", status["dns"]))
    for name, node in status["nodes"].items():
        parts += [(f"agent on {name}", node["agent"]), (f"ztunnel on {name}", node["ztunnel"])]
    parts += [(f"pod {key}", pod["app"]) for key, pod in status["pods"].items()]
    return [f"{what} ({c['state']})" for what, c in parts if not c["ready"]]


def _state(component: Mapping[str, Any]) -> str:
    text = str(component["state"])
    if component["restarts"]:
        text += f" ({component['restarts']} restarts)"
    return text


def _ready(component: Mapping[str, Any]) -> str:
    return "yes" if component["ready"] else "no"


def status_tables(status: Mapping[str, Any]) -> list[Table]:
    """The live status as three tables: components, nodes, pods."""
    components = [
        (
            "control",
            "-",
            str(status["control"]["pid"] or "-"),
            _state(status["control"]),
            _ready(status["control"]),
            status["control"]["address"],
        )
    ]
    dns = status.get("dns")
    if dns and dns["pid"]:
        components.append(("dns", "-", str(dns["pid"]), _state(dns), _ready(dns), f"{dns['address']} (udp)"))
    for name, node in status["nodes"].items():
        agent = node["agent"]
        components.append(("agent", name, str(agent["pid"] or "-"), _state(agent), _ready(agent), "-"))
        components.append(
            (
                "ztunnel",
                name,
                str(node["ztunnel"]["pid"] or "-"),
                _state(node["ztunnel"]),
                _ready(node["ztunnel"]),
                f"admin {node['admin']} in {node['netns']}",
            )
        )
        for old in node.get("ztunnel_draining", ()):
            components.append(("ztunnel", name, str(old["pid"]), "draining (replaced)", "no", "-"))
    pods = []
    for key, pod in status["pods"].items():
        pods.append(
            (
                key,
                pod["node"],
                pod["ip"],
                "yes" if pod["enrolled"] else "no",
                pod["identity"] or "-",
                ",".join(pod["services"]) or "-",
                _state(pod["app"]),
                _ready(pod["app"]),
            )
        )
    return [
        Table(
            title="components",
            headers=("COMPONENT", "NODE", "PID", "STATE", "READY", "ADDRESS"),
            rows=tuple(components),
        ),
        Table(
            title="nodes",
            headers=("NODE", "ADDRESS", "POD CIDR", "NETNS"),
            rows=tuple(
                (name, n["address"], n["pod_cidr"], n["netns"]) for name, n in status["nodes"].items()
            ),
        ),
        Table(
            title="pods",
            headers=("POD", "NODE", "IP", "ENROLLED", "IDENTITY", "SERVICES", "APP", "READY"),
            rows=tuple(pods),
        ),
    ]


def headline(status: Mapping[str, Any]) -> str:
    if not status["running"]:
        state = "not running"
    elif not status["started"]:
        state = "starting"
    elif status["ready"]:
        state = "ready"
    else:
        state = "not ready: " + ", ".join(status["not_ready"])
    return (
        f"lab {status['lab']} (pid {status['pid']}, {state}), control plane {status['control']['address']}, "
        f"state {status['state_dir']}"
    )
