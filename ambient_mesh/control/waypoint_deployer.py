"""What `ambient control --deploy-waypoints` deploys for each waypoint Gateway, into its directory.

Counterpart: istiod's gateway deployment controller (pilot/pkg/config/kube/gateway/
deploymentcontroller.go with the waypoint template, manifests/.../files/waypoint.yaml): for a
Gateway of class `istio-waypoint` a ServiceAccount, a Deployment of one `proxy waypoint` pod and
a Service with `status-port` 15021 and `mesh` 15008, each owned by the Gateway; and the
Gateway's `status.addresses`, which is what makes it usable. With a directory as the API server
(the lab's), creating an object is writing its file, one per object (`<kind>-<namespace>-<name>
.yaml`, the lab's layout); deleting the Gateway deletes the files of what it owned.

`plan` is pure: the store's Gateways and the directory's current files in, the files to write and
to remove out. `apply_plan` writes them atomically.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..host.files import atomic_write
from ..kube.model import Gateway
from ..kube.store import KubeStore
from ..metadata import LABEL_GATEWAY_MANAGED, LABEL_GATEWAY_NAME
from ..ports import HBONE_PORT, READINESS_PORT
from .translate import MeshSettings

log = logging.getLogger(__name__)

WAYPOINT_CLASS = "istio-waypoint"
MESH_CONTROLLER = "istio.io-mesh-controller"
LABEL_GATEWAY_CLASS = "gateway.networking.k8s.io/gateway-class-name"
# Files this deployer may have written, by kind (the directory's one-file-per-object layout).
OWNED_KINDS = ("ServiceAccount", "Deployment", "Service")
MAX_OBJECT_FILE_BYTES = 256 * 1024


def file_name(doc: Mapping[str, Any]) -> str:
    meta = doc["metadata"]
    return f"{doc['kind'].lower()}-{meta.get('namespace') or '_'}-{meta['name']}.yaml"


def _owner(gw: Gateway) -> list[dict[str, Any]]:
    ref: dict[str, Any] = {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "Gateway",
        "name": gw.metadata.name,
        "controller": True,
    }
    if gw.metadata.uid:
        ref["uid"] = gw.metadata.uid
    return [ref]


def _labels(gw: Gateway) -> dict[str, str]:
    return {
        LABEL_GATEWAY_NAME: gw.metadata.name,
        LABEL_GATEWAY_CLASS: WAYPOINT_CLASS,
        LABEL_GATEWAY_MANAGED: MESH_CONTROLLER,
    }


def deployed_objects(gw: Gateway, settings: MeshSettings) -> list[dict[str, Any]]:
    """The ServiceAccount, Deployment and Service istiod creates for one waypoint Gateway."""
    name, ns = gw.metadata.name, gw.metadata.namespace
    meta = {"name": name, "namespace": ns, "labels": _labels(gw), "ownerReferences": _owner(gw)}
    pod_labels = {
        LABEL_GATEWAY_NAME: name,
        LABEL_GATEWAY_MANAGED: MESH_CONTROLLER,
        # ztunnel must not capture the waypoint itself.
        "istio.io/dataplane-mode": "none",
        "sidecar.istio.io/inject": "false",
        "service.istio.io/canonical-name": name,
        "service.istio.io/canonical-revision": "latest",
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {LABEL_GATEWAY_NAME: name}},
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {
                    "serviceAccountName": name,
                    "containers": [
                        {
                            "name": "istio-proxy",
                            "image": "auto",
                            "args": [
                                "proxy",
                                "waypoint",
                                "--domain",
                                f"{ns}.svc.{settings.domain_suffix}",
                                "--serviceCluster",
                                f"{name}.{ns}",
                            ],
                            "ports": [{"containerPort": READINESS_PORT, "name": "status-port"}],
                            "readinessProbe": {"httpGet": {"path": "/healthz/ready", "port": READINESS_PORT}},
                        }
                    ],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {**meta, "annotations": {"networking.istio.io/traffic-distribution": "PreferClose"}},
        "spec": {
            "selector": {LABEL_GATEWAY_NAME: name},
            "ports": [
                {"name": "status-port", "port": READINESS_PORT, "appProtocol": "tcp"},
                {"name": "mesh", "port": HBONE_PORT, "appProtocol": "all"},
            ],
        },
    }
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta}
    return [account, deployment, service]


@dataclass(frozen=True, slots=True, kw_only=True)
class DeployPlan:
    write: dict[str, dict[str, Any]] = field(default_factory=dict)  # file name -> object
    remove: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.write or self.remove)


def plan(store: KubeStore, current: Mapping[str, Mapping[str, Any]], settings: MeshSettings) -> DeployPlan:
    """What to write and remove so the directory holds what istiod would have created.

    `current` is the directory's present objects by file name (only the owned kinds and the
    Gateways matter). A Gateway whose status lacks its Service's hostname gets it written back."""
    desired: dict[str, dict[str, Any]] = {}
    waypoints = [gw for gw in store.gateways if gw.gateway_class_name == WAYPOINT_CLASS]
    for gw in waypoints:
        for doc in deployed_objects(gw, settings):
            desired[file_name(doc)] = doc
        hostname = f"{gw.metadata.name}.{gw.metadata.namespace}.svc.{settings.domain_suffix}"
        gw_file = file_name(
            {"kind": "Gateway", "metadata": {"name": gw.metadata.name, "namespace": gw.metadata.namespace}}
        )
        stored = current.get(gw_file)
        if stored is not None and not any(a.value == hostname for a in gw.status_addresses):
            updated = dict(stored)
            updated["status"] = {
                **(stored.get("status") or {}),
                "addresses": [{"type": "Hostname", "value": hostname}],
            }
            desired[gw_file] = updated
    write = {name: doc for name, doc in desired.items() if current.get(name) != doc}
    owned_names = {
        name
        for name, doc in current.items()
        if doc.get("kind") in OWNED_KINDS
        and ((doc.get("metadata") or {}).get("labels") or {}).get(LABEL_GATEWAY_MANAGED) == MESH_CONTROLLER
        and any(
            ref.get("kind") == "Gateway" for ref in (doc.get("metadata") or {}).get("ownerReferences") or ()
        )
    }
    remove = tuple(sorted(owned_names - set(desired)))
    return DeployPlan(write=write, remove=remove)


def read_current(
    directory: Path, kinds: Iterable[str] = (*OWNED_KINDS, "Gateway")
) -> dict[str, dict[str, Any]]:
    """The directory's objects of `kinds`, by file name (files too large or unreadable skipped)."""
    out: dict[str, dict[str, Any]] = {}
    for kind in kinds:
        for path in sorted(directory.glob(f"{kind.lower()}-*.yaml")):
            try:
                if path.stat().st_size > MAX_OBJECT_FILE_BYTES:
                    continue
                doc = yaml.safe_load(path.read_text())
            except (OSError, yaml.YAMLError):
                continue
            if isinstance(doc, dict) and doc.get("kind") == kind:
                out[path.name] = doc
    return out


def apply_plan(directory: Path, deploy: DeployPlan) -> list[str]:
    """Write and remove the plan's files; returns what was done, one line each."""
    done = []
    for name, doc in sorted(deploy.write.items()):
        atomic_write(directory / name, yaml.safe_dump(doc, sort_keys=False).encode())
        done.append(f"wrote {name}")
    for name in deploy.remove:
        (directory / name).unlink(missing_ok=True)
        done.append(f"removed {name}")
    return done
