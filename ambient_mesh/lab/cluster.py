"""The Kubernetes objects the lab's control plane serves, as a directory of YAML files.

Counterpart: the API server of a kind cluster, reduced to what ambient reads. The lab plays the
API server by writing objects (one file per object, replaced atomically, so the control plane's
and the node agents' directory watchers see each change whole): Namespaces (labelled
`istio.io/dataplane-mode=ambient` when enrolled), Pods with uid, nodeName, serviceAccountName,
podIP and a Ready condition, Services, one `ztunnel` Pod per node in istio-system (the CA lets a
node proxy impersonate workloads only with a token bound to a pod that exists), and the
`istio-cni-node` DaemonSet (its presence tells a stopping node agent that it is being restarted,
not removed, so it leaves the plugin in place: docs/istio-behaviour.md, "Node agent start and shutdown").

Everything here is pure but `write_objects`/`remove_object`, which only touch the directory.
"""

from __future__ import annotations

import ipaddress
import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError
from ..host.files import atomic_write
from ..metadata import LABEL_DATAPLANE_MODE

DATAPLANE_AMBIENT = "ambient"
DATAPLANE_NONE = "none"
SYSTEM_NAMESPACE = "istio-system"
ZTUNNEL_SERVICE_ACCOUNT = "ztunnel"
AGENT_DAEMONSET = "istio-cni-node"
APP_IMAGE_PREFIX = "ambient-lab/"  # a Pod's image names the app it runs: ambient-lab/echo, ambient-lab/sleep
UID_NAMESPACE = uuid.UUID("6f1c5d2a-8a43-4c1e-9d57-1a2b3c4d5e6f")  # for stable per-lab pod uids

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def check_name(what: str, name: str) -> str:
    """Kubernetes names used here are DNS-1123 labels (they end up in file and netns names)."""
    if not _DNS_LABEL.match(name):
        raise ConfigError(
            what, f"{name!r} is not a DNS-1123 label (lowercase letters, digits, '-', at most 63)"
        )
    return name


def pod_uid(lab_id: str, namespace: str, name: str) -> str:
    """A UUID, like the API server's, stable for one lab and pod name."""
    return str(uuid.uuid5(UID_NAMESPACE, f"{lab_id}/{namespace}/{name}"))


@dataclass(frozen=True, slots=True, kw_only=True)
class PodSpec:
    """A pod as the lab user asks for it (`ambient lab up --pod node-1:shop/client`)."""

    namespace: str
    name: str
    node: str
    service_account: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    app: str = (
        "echo"  # runtime.py's apps: `echo` (a server) or `sleep` (a client); `waypoint`: `ambient waypoint`
    )

    @property
    def image(self) -> str:
        return f"{APP_IMAGE_PREFIX}{self.app}"

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def sa(self) -> str:
        return self.service_account or self.name


def parse_pod_spec(text: str) -> PodSpec:
    """`node:namespace/name[@serviceaccount][,label=value...]`, e.g. `node-1:shop/web@frontend,app=web`.

    Raises ConfigError naming what is wrong; nothing else.
    """
    head, _, label_text = text.partition(",")
    node, sep, rest = head.partition(":")
    if not sep:
        raise ConfigError("--pod", f"{text!r}: expected node:namespace/name")
    ref, _, sa = rest.partition("@")
    namespace, sep, name = ref.partition("/")
    if not sep:
        raise ConfigError("--pod", f"{text!r}: expected namespace/name after the node")
    labels: dict[str, str] = {}
    for item in label_text.split(",") if label_text else ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError("--pod", f"{text!r}: label {item!r} is not key=value")
        labels[key] = value
    return PodSpec(
        namespace=check_name("--pod", namespace),
        name=check_name("--pod", name),
        node=check_name("--pod", node),
        service_account=check_name("--pod", sa) if sa else "",
        labels=labels,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceSpec:
    namespace: str
    name: str
    cluster_ip: ipaddress.IPv4Address
    selector: Mapping[str, str]
    ports: Mapping[int, int]  # service port -> target port


def namespace_object(name: str, *, ambient: bool) -> dict[str, Any]:
    labels = {LABEL_DATAPLANE_MODE: DATAPLANE_AMBIENT} if ambient else {}
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}


def pod_object(
    spec: PodSpec,
    *,
    uid: str,
    ip: ipaddress.IPv4Address | str | None,
    ready: bool = True,
    ports: Iterable[int] = (),
) -> dict[str, Any]:
    """A Pod as the API server would show a running one (what the control plane translates and
    what the node agent enrolls)."""
    labels = dict(spec.labels)
    status: dict[str, Any] = {"phase": "Running" if ip is not None else "Pending"}
    if ip is not None:
        status["podIP"] = str(ip)
        status["podIPs"] = [{"ip": str(ip)}]
        status["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
    container: dict[str, Any] = {"name": "app", "image": spec.image}
    if ports:
        container["ports"] = [{"containerPort": p} for p in ports]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": spec.name, "namespace": spec.namespace, "uid": uid, "labels": labels},
        "spec": {"nodeName": spec.node, "serviceAccountName": spec.sa, "containers": [container]},
        "status": status,
    }


def ztunnel_pod_name(node: str) -> str:
    return f"ztunnel-{node}"


def ztunnel_pod_spec(node: str) -> PodSpec:
    return PodSpec(
        namespace=SYSTEM_NAMESPACE,
        name=ztunnel_pod_name(node),
        node=node,
        service_account=ZTUNNEL_SERVICE_ACCOUNT,
        labels={"app": "ztunnel"},
    )


def service_object(spec: ServiceSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": spec.name, "namespace": spec.namespace},
        "spec": {
            "selector": dict(spec.selector),
            "clusterIP": str(spec.cluster_ip),
            "ports": [
                {"name": f"tcp-{port}", "port": port, "targetPort": target}
                for port, target in sorted(spec.ports.items())
            ],
        },
    }


def agent_daemonset_object() -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": AGENT_DAEMONSET, "namespace": SYSTEM_NAMESPACE},
    }


def object_file_name(obj: Mapping[str, Any]) -> str:
    """One file per object: `<kind>-<namespace>-<name>.yaml` (lowercase kind)."""
    meta = obj["metadata"]
    namespace = meta.get("namespace") or "_"
    return f"{obj['kind'].lower()}-{namespace}-{meta['name']}.yaml"


def write_objects(directory: Path, objects: Iterable[Mapping[str, Any]]) -> list[Path]:
    """Write (or replace) each object in its own file, atomically (host/files.atomic_write)."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for obj in objects:
        path = directory / object_file_name(obj)
        # The temporary's name does not end in .yaml, so the control plane's directory source
        # never reads a half-written object.
        atomic_write(path, yaml.safe_dump(dict(obj), sort_keys=False).encode())
        written.append(path)
    return written


def remove_object(directory: Path, kind: str, namespace: str, name: str) -> bool:
    """Delete an object's file (the API server's DELETE); False when there was none."""
    path = directory / object_file_name({"kind": kind, "metadata": {"namespace": namespace, "name": name}})
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True
