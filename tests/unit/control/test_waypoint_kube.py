"""The waypoint deployment controller (control/waypoint_kube.py): what its shell writes, against a
recording fake of the API client. What it writes is rendered by control/waypoint_render.py
(tests/unit/control/test_waypoint_render.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from ambient_mesh.control.waypoint_kube import FIELD_MANAGER, KubeWaypointDeployer, deploy_settings
from ambient_mesh.control.waypoint_render import DeploySettings
from ambient_mesh.kube.client import KubeApiError, Resource
from ambient_mesh.kube.model import Gateway, GatewayAddress, ObjectMeta

SETTINGS = DeploySettings(image="localhost/ambient-mesh:abc", istiod_ip="10.96.0.9")


def gateway(name="waypoint", ns="shop", uid="u-1", cls="istio-waypoint", addresses=()) -> Gateway:
    return Gateway(
        metadata=ObjectMeta(name=name, namespace=ns, uid=uid),
        gateway_class_name=cls,
        status_addresses=tuple(GatewayAddress(type=t, value=v) for t, v in addresses),
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
