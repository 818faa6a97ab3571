"""istiod's waypoint deployment controller, for the API server (`ambient control --kube`).

Counterpart of istiod's gateway deployment controller (pilot/pkg/config/kube/gateway
deploymentcontroller.go): for every Gateway of class `istio-waypoint` it applies the
ServiceAccount, Deployment and Service that waypoint_render.py renders (owned by the Gateway,
with its uid, so deleting the Gateway has the garbage collector delete them), and writes the
Gateway's `status.addresses` (the Service's hostname), which is what makes node proxies use the
waypoint.

Writes are server-side apply with one field manager (istiod's deployment controller applies
the same way), so a write is idempotent and a user's edit of another field is kept. RBAC:
create and patch of deployments, services and serviceaccounts, patch of gateways/status
(deploy/control/istiod.yaml); no delete (the garbage collector deletes).

`KubeWaypointDeployer` is the shell: the Gateways come from the control plane's snapshots
(`set_gateways`), a queue with bounded retries writes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from ..kube.client import (
    DEPLOYMENTS,
    GATEWAYS,
    SERVICE_ACCOUNTS,
    SERVICES,
    KubeApiError,
    KubeClient,
    Resource,
)
from ..kube.model import Gateway
from .waypoint_render import ISTIOD_SERVICE, DeploySettings, status_patch, waypoint_objects
from .waypoint_render import is_waypoint as is_waypoint_class

log = logging.getLogger(__name__)

FIELD_MANAGER = "ambient-control"
MAX_WRITE_ATTEMPTS = 5
RETRY_INITIAL_S = 0.05
RESOURCES = {r.kind: r for r in (SERVICE_ACCOUNTS, DEPLOYMENTS, SERVICES)}


def kube_objects(gw: Gateway, settings: DeploySettings) -> list[tuple[Resource, dict[str, Any]]]:
    """The rendered objects with the API resource each is applied to."""
    return [(RESOURCES[doc["kind"]], doc) for doc in waypoint_objects(gw, settings)]


def is_waypoint(gw: Gateway) -> bool:
    # On the API server an owner needs its uid (a Gateway read before it had one waits).
    return is_waypoint_class(gw) and bool(gw.metadata.uid)


def _fingerprint(objects: list[tuple[Resource, dict[str, Any]]]) -> str:
    return hashlib.sha256(json.dumps([o for _, o in objects], sort_keys=True).encode()).hexdigest()


class KubeWaypointDeployer:
    """Keeps each waypoint Gateway's objects and address written."""

    def __init__(
        self,
        client: KubeClient,
        settings: DeploySettings,
        *,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        self.client = client
        self.settings = settings
        self._sleep = sleep
        self._gateways: dict[tuple[str, str], Gateway] = {}
        self._written: dict[tuple[str, str], str] = {}  # key -> fingerprint of what was applied
        self._queue: dict[tuple[str, str], None] = {}
        self._wake = asyncio.Event()
        self.applied = 0
        self.addressed = 0
        self.failed = 0

    def __repr__(self) -> str:
        return (
            f"KubeWaypointDeployer({len(self._gateways)} waypoints, {len(self._queue)} queued; "
            f"{self.applied} applied, {self.addressed} addresses written, {self.failed} failed)"
        )

    def set_gateways(self, gateways: Iterable[Gateway]) -> None:
        """The Gateways of the control plane's latest snapshot; new or changed waypoints queued."""
        current = {(g.metadata.namespace, g.metadata.name): g for g in gateways if is_waypoint(g)}
        for key in list(self._written):
            old = self._gateways.get(key)
            new = current.get(key)
            if new is None or (old is not None and old.metadata.uid != new.metadata.uid):
                del self._written[key]  # deleted (its objects go with it) or made anew
        for key in [k for k in self._queue if k not in current]:
            del self._queue[key]
        self._gateways = current
        for key, gw in sorted(current.items()):
            if self._written.get(key) != _fingerprint(kube_objects(gw, self.settings)) or status_patch(
                gw, self.settings.domain_suffix
            ):
                self._queue[key] = None
                self._wake.set()

    async def _write(self, gw: Gateway) -> None:
        key = (gw.metadata.namespace, gw.metadata.name)
        objects = kube_objects(gw, self.settings)
        fingerprint = _fingerprint(objects)
        if self._written.get(key) != fingerprint:
            for resource, body in objects:
                await self.client.apply(resource, body, field_manager=FIELD_MANAGER)
            self._written[key] = fingerprint
            self.applied += 1
            log.info("waypoint %s/%s: ServiceAccount, Deployment and Service applied", *key)
        patch = status_patch(gw, self.settings.domain_suffix)
        if patch is not None:
            written = await self.client.patch_merge(GATEWAYS, key[0], key[1], patch, subresource="status")
            if written is not None:
                self.addressed += 1
                log.info(
                    "waypoint %s/%s: status.addresses %s", *key, patch["status"]["addresses"][0]["value"]
                )

    async def _reconcile(self, key: tuple[str, str]) -> None:
        delay = RETRY_INITIAL_S
        for attempt in range(1, MAX_WRITE_ATTEMPTS + 1):
            gw = self._gateways.get(key)
            if gw is None:
                return
            try:
                await self._write(gw)
                return
            except KubeApiError as exc:
                if attempt == MAX_WRITE_ATTEMPTS:
                    self.failed += 1
                    log.warning(
                        "waypoint %s/%s: not deployed after %d attempts: %s (the Gateway's next change "
                        "tries again)",
                        *key,
                        attempt,
                        exc,
                    )
                    return
                await self._sleep(delay)
                delay *= 2

    async def run(self) -> None:
        """Write queued waypoints until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                key = next(iter(self._queue))
                del self._queue[key]
                await self._reconcile(key)


async def deploy_settings(
    client: KubeClient, *, image: str, pod_name: str, pod_namespace: str, **mesh: str
) -> DeploySettings:
    """The settings, with the image of the control plane's own pod when none is given (so
    waypoints run the same build) and the control plane Service's ClusterIP."""
    from ..kube.client import PODS

    if not image and pod_name and pod_namespace:
        pod = await client.get(PODS, pod_namespace, pod_name)
        containers = (pod or {}).get("spec", {}).get("containers") or []
        image = str(containers[0].get("image", "")) if containers else ""
    if not image:
        raise KubeApiError(
            "no image for waypoint pods",
            hint="pass --waypoint-image, or run the control plane in a pod (POD_NAME, POD_NAMESPACE)",
        )
    root_namespace = mesh.get("root_namespace", "istio-system")
    service = await client.get(SERVICES, root_namespace, ISTIOD_SERVICE)
    cluster_ip = str((service or {}).get("spec", {}).get("clusterIP", ""))
    return DeploySettings(image=image, istiod_ip="" if cluster_ip in ("", "None") else cluster_ip, **mesh)


__all__ = [
    "FIELD_MANAGER",
    "KubeWaypointDeployer",
    "deploy_settings",
    "is_waypoint",
    "kube_objects",
]
