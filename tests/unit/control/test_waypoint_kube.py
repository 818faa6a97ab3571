"""The waypoint deployment controller (control/waypoint_kube.py): what it renders for a
Gateway, and what its shell writes, against a recording fake of the API client."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from ambient_mesh.control.waypoint_kube import (
    FIELD_MANAGER,
    DeploySettings,
    KubeWaypointDeployer,
    deploy_settings,
    status_patch,
    waypoint_objects,
)
from ambient_mesh.kube.client import KubeApiError, Resource
from ambient_mesh.kube.load import parse_documents
from ambient_mesh.kube.model import Gateway, GatewayAddress, ObjectMeta

SETTINGS = DeploySettings(image="localhost/ambient-mesh:abc", istiod_ip="10.96.0.9")


def gateway(name="waypoint", ns="shop", uid="u-1", cls="istio-waypoint", addresses=()) -> Gateway:
    return Gateway(
        metadata=ObjectMeta(name=name, namespace=ns, uid=uid),
        gateway_class_name=cls,
        status_addresses=tuple(GatewayAddress(type=t, value=v) for t, v in addresses),
    )


def test_the_three_objects_istiod_deploys_owned_by_the_gateway():
    objs = {body["kind"]: body for _, body in waypoint_objects(gateway(), SETTINGS)}
    assert list(objs) == ["ServiceAccount", "Deployment", "Service"]
    owner = {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "Gateway",
        "name": "waypoint",
        "uid": "u-1",
    }
    for body in objs.values():
        assert body["metadata"]["name"] == "waypoint" and body["metadata"]["namespace"] == "shop"
        assert body["metadata"]["ownerReferences"] == [owner]
        assert body["metadata"]["labels"]["gateway.networking.k8s.io/gateway-name"] == "waypoint"
        assert body["metadata"]["labels"]["gateway.networking.k8s.io/gateway-class-name"] == "istio-waypoint"
    template = objs["Deployment"]["spec"]["template"]
    assert objs["Deployment"]["spec"]["replicas"] == 1
    assert objs["Deployment"]["spec"]["selector"] == {
        "matchLabels": {"gateway.networking.k8s.io/gateway-name": "waypoint"}
    }
    labels = template["metadata"]["labels"]
    assert labels["istio.io/dataplane-mode"] == "none"
    assert labels["gateway.istio.io/managed"] == "istio.io-mesh-controller"
    pod = template["spec"]
    assert pod["serviceAccountName"] == "waypoint"
    assert pod["hostAliases"] == [{"ip": "10.96.0.9", "hostnames": ["istiod.istio-system.svc"]}]
    (container,) = pod["containers"]
    assert container["image"] == "localhost/ambient-mesh:abc"
    assert container["command"] == ["ambient"] and container["args"][0] == "waypoint"
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["XDS_ADDRESS"] == "https://istiod.istio-system.svc:15012"
    assert env["GATEWAY_NAME"] == "waypoint"
    assert env["INSTANCE_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz/ready", "port": 15021}
    assert container["securityContext"]["runAsUser"] == 1337
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    token = next(v for v in pod["volumes"] if v["name"] == "istio-token")
    assert token["projected"]["sources"][0]["serviceAccountToken"]["audience"] == "istio-ca"
    ports = {(p["name"], p["port"], p["appProtocol"]) for p in objs["Service"]["spec"]["ports"]}
    assert ports == {("status-port", 15021, "tcp"), ("mesh", 15008, "all")}
    # the waypoint's own Service is never sent through a waypoint (translate/waypoints.py)
    assert objs["Service"]["metadata"]["labels"]["gateway.istio.io/managed"] == "istio.io-mesh-controller"
    # and the control plane reads every one of them without complaint
    parsed = parse_documents(
        json.dumps({"kind": "List", "apiVersion": "v1", "items": list(objs.values())}), "x"
    )
    assert not parsed.errors


def test_status_addresses_the_service_hostname_once():
    want = {"status": {"addresses": [{"type": "Hostname", "value": "waypoint.shop.svc.cluster.local"}]}}
    assert status_patch(gateway(), "cluster.local") == want
    assert status_patch(gateway(addresses=[("IPAddress", "10.0.0.1")]), "cluster.local") == want
    assert (
        status_patch(gateway(addresses=[("Hostname", "waypoint.shop.svc.cluster.local")]), "cluster.local")
        is None
    )


class FakeClient:
    def __init__(self, fail: int = 0) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.fail = fail
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}

    async def apply(self, resource: Resource, body: dict[str, Any], *, field_manager: str) -> dict[str, Any]:
        assert field_manager == FIELD_MANAGER
        if self.fail:
            self.fail -= 1
            raise KubeApiError("boom", status=500)
        self.calls.append(("apply", resource.kind, body["metadata"]["name"]))
        return body

    async def patch_merge(self, resource, namespace, name, patch, *, subresource=""):
        self.calls.append(("patch", f"{resource.kind}/{subresource}", name))
        return patch

    async def get(self, resource, namespace, name):
        self.calls.append(("get", resource.kind, name))
        return self.objects.get((resource.kind, namespace, name))


async def drive(deployer: KubeWaypointDeployer) -> None:
    task = asyncio.create_task(deployer.run())
    for _ in range(50):
        await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_the_deployer_applies_once_per_change_and_retries():
    client = FakeClient(fail=2)
    deployer = KubeWaypointDeployer(client, SETTINGS, sleep=lambda _s: asyncio.sleep(0))  # type: ignore[arg-type]
    deployer.set_gateways([gateway(), gateway(name="other", cls="istio")])  # only the waypoint class
    await drive(deployer)
    assert client.calls == [
        ("apply", "ServiceAccount", "waypoint"),
        ("apply", "Deployment", "waypoint"),
        ("apply", "Service", "waypoint"),
        ("patch", "Gateway/status", "waypoint"),
    ]
    assert "1 applied, 1 addresses written, 0 failed" in repr(deployer)
    # the status write comes back as a changed Gateway: nothing more to do
    client.calls.clear()
    deployer.set_gateways([gateway(addresses=[("Hostname", "waypoint.shop.svc.cluster.local")])])
    await drive(deployer)
    assert client.calls == []
    # deleted and made again (a new uid): written again, with the new owner
    deployer.set_gateways([])
    deployer.set_gateways([gateway(uid="u-2")])
    await drive(deployer)
    assert [c[0] for c in client.calls] == ["apply", "apply", "apply", "patch"]


async def test_settings_take_the_control_planes_own_image_and_service_ip():
    client = FakeClient()
    client.objects[("Pod", "istio-system", "istiod-1")] = {"spec": {"containers": [{"image": "reg/am:1"}]}}
    client.objects[("Service", "istio-system", "istiod")] = {"spec": {"clusterIP": "10.96.0.9"}}
    settings = await deploy_settings(
        client,  # type: ignore[arg-type]
        image="",
        pod_name="istiod-1",
        pod_namespace="istio-system",
    )
    assert (settings.image, settings.istiod_ip) == ("reg/am:1", "10.96.0.9")
    try:
        await deploy_settings(client, image="", pod_name="", pod_namespace="")  # type: ignore[arg-type]
    except KubeApiError as exc:
        assert "--waypoint-image" in (exc.hint or "")
    else:
        raise AssertionError("no image must be an error")
