"""The lab's waypoint scene, shared by tests/netns/test_lab_waypoint.py and the waypoint benches:
pods client and local on node-1 and server on node-2 in namespace demo, their Services, a
waypoint Gateway, and `lab apply`/`lab delete` of manifest text as the CLI does them."""

from __future__ import annotations

from ambient_mesh.lab import apply as lab_apply
from ambient_mesh.lab.cluster import PodSpec
from ambient_mesh.lab.lab import APP_PORT, Lab

WAYPOINT_ID = "spiffe://cluster.local/ns/demo/sa/waypoint"
CLIENT_ID = "spiffe://cluster.local/ns/demo/sa/client"
SERVER_VIP, LOCAL_VIP = "10.96.50.10", "10.96.50.11"


def demo_pods() -> tuple[PodSpec, ...]:
    return (
        PodSpec(
            namespace="demo", name="client", node="node-1", service_account="client", labels={"app": "client"}
        ),
        PodSpec(
            namespace="demo", name="local", node="node-1", service_account="local", labels={"app": "local"}
        ),
        PodSpec(
            namespace="demo", name="server", node="node-2", service_account="server", labels={"app": "server"}
        ),
    )


WAYPOINT = """
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: waypoint, namespace: demo, labels: {istio.io/waypoint-for: all}}
spec:
  gatewayClassName: istio-waypoint
  listeners: [{name: mesh, port: 15008, protocol: HBONE}]
"""
WAYPOINT_POD = "demo/waypoint-0"


def services(use_waypoint: bool) -> str:
    label = "labels: {istio.io/use-waypoint: waypoint}" if use_waypoint else "labels: {}"
    return f"""
apiVersion: v1
kind: Service
metadata: {{name: server, namespace: demo, {label}}}
spec: {{selector: {{app: server}}, clusterIP: {SERVER_VIP}, ports: [{{name: tcp-echo, port: 80, targetPort: {APP_PORT}}}]}}
---
apiVersion: v1
kind: Service
metadata: {{name: local, namespace: demo, {label}}}
spec: {{selector: {{app: local}}, clusterIP: {LOCAL_VIP}, ports: [{{name: tcp-echo, port: 80, targetPort: {APP_PORT}}}]}}
"""


def namespace(use_waypoint: bool) -> str:
    extra = ", istio.io/use-waypoint: waypoint" if use_waypoint else ""
    return f"""
apiVersion: v1
kind: Namespace
metadata: {{name: demo, labels: {{istio.io/dataplane-mode: ambient{extra}}}}}
"""


def apply_text(lab: Lab, text: str, file: str = "test.yaml") -> list[str]:
    manifests = lab_apply.check_documents(
        lab_apply.documents(text, file), file, default_namespace="demo", allow_pods=False
    )
    return lab_apply.apply(lab.objects_dir, manifests)


def delete_text(lab: Lab, text: str, file: str = "test.yaml") -> None:
    manifests = lab_apply.check_documents(
        lab_apply.documents(text, file), file, default_namespace="demo", allow_pods=False
    )
    lab_apply.delete(lab.objects_dir, manifests)
