"""What a diagnostic looks at: the mesh's objects, from a lab, a directory of YAML or a cluster.

The objects go through the control plane's own parser (kube/load.py) and its status code
(control/status.py), so a diagnostic sees what `ambient control` would serve and write.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..control.status import StatusMap, compute_status
from ..control.translate import MeshSettings
from ..errors import AmbientError
from ..kube.load import LoadError, load_directory, load_file, merge_files
from ..kube.store import KubeStore


@dataclass(frozen=True, slots=True, kw_only=True)
class MeshView:
    where: str  # for headings and messages: the lab, the directory, the API server
    store: KubeStore
    settings: MeshSettings = field(default_factory=MeshSettings)
    errors: tuple[LoadError, ...] = ()
    # A lab's layout (lab.json): node proxies' admin addresses and network namespaces.
    lab: dict[str, Any] | None = None
    # A node proxy's saved /config_dump: its state only, no objects (explain --dump).
    dump: bool = False

    @property
    def status(self) -> StatusMap:
        return compute_status(self.store, self.settings)


def directory_view(paths: list[str], settings: MeshSettings | None = None) -> MeshView:
    """Files and directories of YAML, as `istioctl analyze a.yaml dir/` reads them."""
    results = []
    for arg in paths:
        path = Path(arg)
        if path.is_dir():
            results.append((str(path), load_directory(path)))
        elif path.is_file():
            results.append((str(path), load_file(path)))
        else:
            raise AmbientError(f"{arg}: no such file or directory")
    loaded = merge_files(results)
    return MeshView(
        where=", ".join(paths),
        store=KubeStore(loaded.objects),
        settings=settings or MeshSettings(),
        errors=loaded.errors,
    )


def read_lab_record(state_dir: str) -> dict[str, Any]:
    path = Path(state_dir) / "lab.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        raise AmbientError(
            f"no lab is running with state dir {state_dir}", hint="start one with `ambient lab up`"
        ) from None
    if not isinstance(record, dict):
        raise AmbientError(f"{path} is not a lab record")
    return record


def lab_view(state_dir: str) -> MeshView:
    """A running lab: its API server (the objects directory) and its layout."""
    record = read_lab_record(state_dir)
    loaded = load_directory(record["objects_dir"])
    return MeshView(
        where=f"lab {state_dir}", store=KubeStore(loaded.objects), errors=loaded.errors, lab=record
    )


async def cluster_view(kubeconfig: str = "", settings: MeshSettings | None = None) -> MeshView:
    """A cluster: every kind the control plane reads, listed once from the API server."""
    from ..control.sources import KubeApiSource
    from ..kube.client import KubeClient
    from ..kube.kubeconfig import KubeconfigError, credentials

    try:
        creds = credentials(kubeconfig)
    except KubeconfigError as exc:
        raise AmbientError(f"--kube: {exc.message}", hint=exc.hint) from None
    client = KubeClient(creds, user_agent="ambient-diagnostics")
    try:
        change = await KubeApiSource(client).first()
    finally:
        await client.close()
    return MeshView(
        where=creds.server, store=change.store, settings=settings or MeshSettings(), errors=change.errors
    )
