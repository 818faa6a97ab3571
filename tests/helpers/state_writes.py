"""Tests change a ProxyState the way the node proxy does: through the one updater.

`StateUpdater` (ambient_mesh/xds/updater.py) is the only writer of ProxyState; these helpers only
wrap what a test would otherwise spell out: a local-config snapshot, or an xDS push of resources
(Address for workloads and services, Authorization for policies) and removals by resource name.
"""

from __future__ import annotations

from collections.abc import Iterable

from ambient_mesh.rbac import Authorization
from ambient_mesh.state.localconfig import LocalConfig
from ambient_mesh.state.model import Service, Workload
from ambient_mesh.state.store import ProxyState
from ambient_mesh.xds.convert import ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL
from ambient_mesh.xds.session import Added, Push
from ambient_mesh.xds.updater import StateUpdater, UpdateSummary


def load(
    state: ProxyState,
    workloads: Iterable[Workload] = (),
    services: Iterable[Service] = (),
    policies: Iterable[Authorization] = (),
) -> UpdateSummary:
    """Replace everything with one snapshot, as LOCAL_XDS_PATH does (one notification)."""
    local = LocalConfig(workloads=tuple(workloads), services=tuple(services), policies=tuple(policies))
    return StateUpdater(state).apply_local_config(local)


def upsert(state: ProxyState, *resources: Workload | Service | Authorization) -> None:
    """Add or replace resources, one push per resource type, as istiod's pushes do."""
    updater = StateUpdater(state)
    addresses = [r for r in resources if not isinstance(r, Authorization)]
    policies = [r for r in resources if isinstance(r, Authorization)]
    if addresses:
        added = tuple(Added(r.uid if isinstance(r, Workload) else r.key, "", r) for r in addresses)
        updater.apply_push(Push(type_url=ADDRESS_TYPE_URL, added=added))
    if policies:
        updater.apply_push(
            Push(type_url=AUTHORIZATION_TYPE_URL, added=tuple(Added(p.key, "", p) for p in policies))
        )


def remove(state: ProxyState, *names: str, policies: bool = False) -> UpdateSummary:
    """Remove Address resources (workload uid or `namespace/hostname`) or, with `policies`,
    Authorization resources (`namespace/name`) by name."""
    type_url = AUTHORIZATION_TYPE_URL if policies else ADDRESS_TYPE_URL
    return StateUpdater(state).apply_push(Push(type_url=type_url, removed=names))
