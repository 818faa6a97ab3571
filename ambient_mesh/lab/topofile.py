"""The lab's topology file: Kubernetes YAML plus one small `Lab` document.

Counterpart: a kind cluster config (`kind: Cluster`, its nodes) followed by the manifests one
would `kubectl apply` to it. Every Kubernetes object is checked by the control plane's parser
(apply.py: unknown fields in Istio's kinds refused, errors at `file:line:column`); Pods need
`spec.nodeName` (the lab schedules nothing) and run the app their image names
(`ambient-lab/echo`: an HTTP/TCP echo server on the container port, `ambient-lab/sleep`: a
client). Namespaces labelled `istio.io/dataplane-mode=ambient` are in the mesh.

    apiVersion: lab.ambient-mesh.io/v1
    kind: Lab
    nodes: [node-1, node-2]        # or a count: `nodes: 3` -> node-1..node-3
    nftables: false                # the node agents' NATIVE_NFTABLES
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..metadata import LABEL_DATAPLANE_MODE
from . import apply as manifests
from .cluster import APP_IMAGE_PREFIX, PodSpec, check_name
from .topology import MAX_LAB_NODES

LAB_API_VERSION = "lab.ambient-mesh.io/v1"
LAB_KIND = "Lab"
LAB_FIELDS = ("apiVersion", "kind", "nodes", "nftables")
# `waypoint`: `ambient waypoint` (Envoy and its agent), the container istiod's waypoint Deployment runs.
APP_IMAGES = {
    f"{APP_IMAGE_PREFIX}echo": "echo",
    f"{APP_IMAGE_PREFIX}sleep": "sleep",
    f"{APP_IMAGE_PREFIX}waypoint": "waypoint",
}

DEFAULT_TOPOLOGY = """\
# The default lab: two nodes; `shop` in the mesh with a client and an HTTP echo service
# (two replicas, one per node); `legacy` outside the mesh with a client of its own.
apiVersion: lab.ambient-mesh.io/v1
kind: Lab
nodes: [node-1, node-2]
---
apiVersion: v1
kind: Namespace
metadata:
  name: shop
  labels:
    istio.io/dataplane-mode: ambient
---
apiVersion: v1
kind: Namespace
metadata:
  name: legacy
---
apiVersion: v1
kind: Pod
metadata:
  name: client
  namespace: shop
  labels: {app: client}
spec:
  nodeName: node-1
  serviceAccountName: client
  containers: [{name: app, image: ambient-lab/sleep}]
---
apiVersion: v1
kind: Pod
metadata:
  name: echo-1
  namespace: shop
  labels: {app: echo, version: v1}
spec:
  nodeName: node-1
  serviceAccountName: echo
  containers: [{name: app, image: ambient-lab/echo, ports: [{containerPort: 8080}]}]
---
apiVersion: v1
kind: Pod
metadata:
  name: echo-2
  namespace: shop
  labels: {app: echo, version: v1}
spec:
  nodeName: node-2
  serviceAccountName: echo
  containers: [{name: app, image: ambient-lab/echo, ports: [{containerPort: 8080}]}]
---
apiVersion: v1
kind: Service
metadata:
  name: echo
  namespace: shop
spec:
  selector: {app: echo}
  ports: [{name: http, port: 80, targetPort: 8080}]
---
apiVersion: v1
kind: Pod
metadata:
  name: client
  namespace: legacy
  labels: {app: client}
spec:
  nodeName: node-2
  serviceAccountName: client
  containers: [{name: app, image: ambient-lab/sleep}]
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class TopologyFile:
    nodes: tuple[str, ...]
    pods: tuple[PodSpec, ...]
    ambient_namespaces: frozenset[str]
    objects: tuple[dict[str, Any], ...]  # everything but the pods, written as given
    nftables: bool = False


def _lab_section(doc: Mapping[str, Any], where: str) -> tuple[tuple[str, ...], bool]:
    for key in doc:
        if key not in LAB_FIELDS:
            raise ConfigError(where, f"Lab: unknown field {key!r} (expected one of {', '.join(LAB_FIELDS)})")
    if doc.get("apiVersion") != LAB_API_VERSION:
        raise ConfigError(where, f"Lab: apiVersion must be {LAB_API_VERSION}")
    nodes = doc.get("nodes", 2)
    if isinstance(nodes, int) and not isinstance(nodes, bool):
        if not 1 <= nodes <= MAX_LAB_NODES:
            raise ConfigError(where, f"Lab: nodes: {nodes}: the lab runs 1 to {MAX_LAB_NODES}")
        names = tuple(f"node-{i + 1}" for i in range(nodes))
    elif isinstance(nodes, list) and all(isinstance(n, str) for n in nodes):
        names = tuple(check_name(f"{where}: Lab: nodes", n) for n in nodes)
    else:
        raise ConfigError(where, "Lab: nodes must be a count or a list of node names")
    nftables = doc.get("nftables", False)
    if not isinstance(nftables, bool):
        raise ConfigError(where, "Lab: nftables must be true or false")
    return names, nftables


def pod_spec_from_object(doc: Mapping[str, Any], where: str) -> PodSpec:
    """The lab pod a Pod object asks for (its node, service account, labels, app)."""
    meta, spec = doc["metadata"], doc.get("spec") or {}
    key = f"{meta.get('namespace')}/{meta['name']}"
    node = spec.get("nodeName")
    if not isinstance(node, str) or not node:
        raise ConfigError(where, f"Pod {key}: spec.nodeName is required (the lab schedules nothing)")
    containers = spec.get("containers") or [{}]
    image = containers[0].get("image", f"{APP_IMAGE_PREFIX}echo") if isinstance(containers[0], dict) else ""
    app = APP_IMAGES.get(image)
    if app is None:
        raise ConfigError(
            where, f"Pod {key}: image {image!r}: the lab runs {' or '.join(APP_IMAGES)} (its apps)"
        )
    labels = meta.get("labels") or {}
    return PodSpec(
        namespace=check_name(f"{where}: Pod {key}: namespace", meta.get("namespace", "default")),
        name=check_name(f"{where}: Pod {key}: name", meta["name"]),
        node=node,
        service_account=spec.get("serviceAccountName") or "default",
        labels={str(k): str(v) for k, v in labels.items()},
        app=app,
    )


def parse_topology(text: str, file: str) -> TopologyFile:
    """Raises ConfigError naming `file:line:column` for anything wrong; checks nothing that
    needs the lab (validate_layout does the rest before it starts)."""
    pairs = manifests.documents(text, file)
    lab_docs = [(n, d) for n, d in pairs if isinstance(d, dict) and d.get("kind") == LAB_KIND]
    if len(lab_docs) > 1:
        raise ConfigError(manifests.where(file, lab_docs[1][0]), "more than one Lab document")
    nodes: tuple[str, ...] = ("node-1", "node-2")
    nftables = False
    if lab_docs:
        nodes, nftables = _lab_section(lab_docs[0][1], manifests.where(file, lab_docs[0][0]))
    rest = [(n, d) for n, d in pairs if not (isinstance(d, dict) and d.get("kind") == LAB_KIND)]
    checked = manifests.check_documents(rest, file, default_namespace="default", allow_pods=True)
    positions = {id(d): n for n, d in rest}
    pods, objects, ambient = [], [], set()
    for m in checked:
        if m.kind == "Pod":
            pods.append(pod_spec_from_object(m.doc, manifests.where(file, positions[id(m.doc)])))
            continue
        if (
            m.kind == "Namespace"
            and (m.doc["metadata"].get("labels") or {}).get(LABEL_DATAPLANE_MODE) == "ambient"
        ):
            ambient.add(m.name)
        objects.append(m.doc)
    return TopologyFile(
        nodes=nodes,
        pods=tuple(pods),
        ambient_namespaces=frozenset(ambient),
        objects=tuple(objects),
        nftables=nftables,
    )


def load_topology(path: str | None) -> TopologyFile:
    """The file at `path`, or the default topology."""
    if path is None:
        return parse_topology(DEFAULT_TOPOLOGY, "<default topology>")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(path, f"cannot read: {e}") from None
    if len(text) > manifests.MAX_MANIFEST_BYTES:
        raise ConfigError(path, f"larger than {manifests.MAX_MANIFEST_BYTES} bytes")
    return parse_topology(text, path)
