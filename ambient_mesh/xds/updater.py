"""The one writer of the node proxy's state, fed by xDS pushes and by the local config file.

Counterpart: ztunnel src/xds.rs (`ProxyStateUpdater` / `ProxyStateUpdateMutator`, and
`LocalClient::load_config`). Behaviour: docs/istio-behaviour.md, "Workloads and services",
"Policy changes on live connections" and "Delta xDS".

A push is applied as one batch: every resource goes straight into the stores (which keep
per-service endpoint dicts, so each endpoint costs O(1)), and the state's listeners hear about
it once at the end rather than once per resource (the connection manager re-checks live
connections from there).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..rbac import Authorization
from ..state.localconfig import LocalConfig
from ..state.model import Service, Workload
from ..state.store import ProxyState
from .convert import ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL
from .session import Push

log = logging.getLogger("ambient_mesh.xds")


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateSummary:
    """What one push (or one local config load) changed, for logs."""

    source: str
    workloads: int = 0
    services: int = 0
    policies: int = 0
    removed: int = 0
    # removals of names we never had: normal, and ignored (docs/istio-behaviour.md, "Delta xDS")
    not_found: int = 0
    rejected: int = 0

    def __str__(self) -> str:
        parts = [
            f"{self.workloads} workloads",
            f"{self.services} services",
            f"{self.policies} policies",
            f"{self.removed} removed",
        ]
        if self.not_found:
            parts.append(f"{self.not_found} unknown removals")
        if self.rejected:
            parts.append(f"{self.rejected} rejected")
        return f"{self.source}: " + ", ".join(parts)


class StateUpdater:
    """Applies xDS pushes and local config snapshots to a ProxyState."""

    def __init__(self, state: ProxyState) -> None:
        self.state = state
        self.pushes_applied = 0

    # -- xDS ---------------------------------------------------------------------------------------

    def apply_push(self, push: Push) -> UpdateSummary:
        """Apply the accepted part of one response; rejected resources were already left out."""
        counts = {"workloads": 0, "services": 0, "policies": 0, "removed": 0, "not_found": 0}
        if push.type_url == ADDRESS_TYPE_URL:
            # Inserts first, then removals: the order ztunnel's handler sees them in.
            for added in push.added:
                self._upsert_address(added.resource, counts)
            for name in push.removed:
                if self._remove_address(name):
                    counts["removed"] += 1
                else:
                    counts["not_found"] += 1
        elif push.type_url == AUTHORIZATION_TYPE_URL:
            for added in push.added:
                self._upsert_policy(added.resource, counts)
            for name in push.removed:
                if self.state.policies.pop(name, None) is not None:
                    counts["removed"] += 1
                else:
                    counts["not_found"] += 1
        else:
            return UpdateSummary(source=push.type_url)
        summary = UpdateSummary(
            source=push.type_url.rsplit(".", 1)[-1], rejected=len(push.rejected), **counts
        )
        applied = len(push.added) + len(push.removed)
        if applied:
            self._state_changed()
        self.pushes_applied += 1
        return summary

    def _upsert_address(self, resource: object, counts: dict[str, int]) -> None:
        if isinstance(resource, Workload):
            # WorkloadStore.insert replaces any entry with the same uid (docs/istio-behaviour.md,
            # "Workloads and services") and the service store re-derives only this workload's endpoints.
            self.state.workloads.insert(resource)
            self.state.services.update_workload(resource)
            counts["workloads"] += 1
        elif isinstance(resource, Service):
            # An update keeps the endpoints already known; staged ones are attached here.
            self.state.services.insert(resource)
            counts["services"] += 1
        else:
            raise TypeError(f"not an Address resource: {resource!r}")

    def _upsert_policy(self, resource: object, counts: dict[str, int]) -> None:
        if not isinstance(resource, Authorization):
            raise TypeError(f"not an Authorization resource: {resource!r}")
        self.state.policies[resource.key] = resource
        counts["policies"] += 1

    def _remove_address(self, name: str) -> bool:
        # A workload uid first; otherwise `namespace/hostname` of a service (docs/istio-behaviour.md,
        # "Workloads and services").
        if self.state.workloads.remove(name) is not None:
            self.state.services.remove_workload(name)
            return True
        return self.state.services.remove(name) is not None

    # -- local config ------------------------------------------------------------------------------

    def apply_local_config(self, local: LocalConfig) -> UpdateSummary:
        """Replace everything with a local config snapshot (LOCAL_XDS_PATH / LOCAL_XDS)."""
        state = self.state
        # Cleared in place: readers may hold on to the stores themselves.
        state.workloads.clear()
        state.services.clear()
        state.policies.clear()
        counts = {"workloads": 0, "services": 0, "policies": 0}
        for service in local.services:
            self._upsert_address(service, counts)
        for workload in local.workloads:
            self._upsert_address(workload, counts)
        for policy in local.policies:
            self._upsert_policy(policy, counts)
        self._state_changed()
        return UpdateSummary(source="local config", **counts)

    # -- notifications -----------------------------------------------------------------------------

    def _state_changed(self) -> None:
        # One version bump and one round of listener calls per batch.
        self.state.notify_changed()

    def __repr__(self) -> str:
        return f"<StateUpdater: {self.pushes_applied} pushes applied, {self.state!r}>"


__all__ = ["StateUpdater", "UpdateSummary"]
