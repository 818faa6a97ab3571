"""What `ambient control --deploy-waypoints` deploys for each waypoint Gateway, into its directory.

Counterpart: istiod's gateway deployment controller, with a directory as the API server (the
lab's): the objects waypoint_render.py renders for a Gateway of class `istio-waypoint`
(ServiceAccount, Deployment, Service, each owned by the Gateway) and the Gateway's
`status.addresses`. Creating an object is writing its file, one per object
(`<kind>-<namespace>-<name>.yaml`, the lab's layout); deleting the Gateway deletes the files of
what it owned (the garbage collector's part).

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
from ..kube.store import KubeStore
from ..metadata import LABEL_GATEWAY_MANAGED, MANAGED_BY_MESH_CONTROLLER
from .waypoint_render import RENDERED_KINDS, DeploySettings, is_waypoint, status_patch, waypoint_objects

log = logging.getLogger(__name__)

MAX_OBJECT_FILE_BYTES = 256 * 1024


def file_name(doc: Mapping[str, Any]) -> str:
    meta = doc["metadata"]
    return f"{doc['kind'].lower()}-{meta.get('namespace') or '_'}-{meta['name']}.yaml"


def _owned(doc: Mapping[str, Any]) -> bool:
    """Written by this deployer: a rendered kind, labelled managed by the mesh controller and
    owned by a Gateway."""
    meta = doc.get("metadata") or {}
    return (
        doc.get("kind") in RENDERED_KINDS
        and (meta.get("labels") or {}).get(LABEL_GATEWAY_MANAGED) == MANAGED_BY_MESH_CONTROLLER
        and any(ref.get("kind") == "Gateway" for ref in meta.get("ownerReferences") or ())
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class DeployPlan:
    write: dict[str, dict[str, Any]] = field(default_factory=dict)  # file name -> object
    remove: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.write or self.remove)


def plan(store: KubeStore, current: Mapping[str, Mapping[str, Any]], settings: DeploySettings) -> DeployPlan:
    """What to write and remove so the directory holds what istiod would have created.

    `current` is the directory's present objects by file name (only the rendered kinds and the
    Gateways matter). A Gateway whose status lacks its Service's hostname gets it written back."""
    desired: dict[str, dict[str, Any]] = {}
    for gw in (g for g in store.gateways if is_waypoint(g)):
        for doc in waypoint_objects(gw, settings):
            desired[file_name(doc)] = doc
        gw_file = file_name(
            {"kind": "Gateway", "metadata": {"name": gw.metadata.name, "namespace": gw.metadata.namespace}}
        )
        stored = current.get(gw_file)
        patch = status_patch(gw, settings.domain_suffix)
        if stored is not None and patch is not None:
            desired[gw_file] = {**stored, "status": {**(stored.get("status") or {}), **patch["status"]}}
    write = {name: doc for name, doc in desired.items() if current.get(name) != doc}
    owned_names = {name for name, doc in current.items() if _owned(doc)}
    remove = tuple(sorted(owned_names - set(desired)))
    return DeployPlan(write=write, remove=remove)


def read_current(
    directory: Path, kinds: Iterable[str] = (*RENDERED_KINDS, "Gateway")
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
