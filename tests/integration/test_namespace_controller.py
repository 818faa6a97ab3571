"""istiod's namespace controller in `ambient control`: the root bundle as the
`istio-ca-root-cert` ConfigMap in every namespace, against kube_fake's API server (created,
repaired when edited or deleted, left alone in Kubernetes' own namespaces, bounded retries)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ambient_mesh.control.namespace_controller import (
    CA_ROOT_CERT_CONFIGMAP,
    CA_ROOT_CERT_KEY,
    MAX_RECONCILE_ATTEMPTS,
    Action,
    NamespaceController,
    reconcile,
)
from ambient_mesh.control.plane import ControlPlane, ControlPlaneConfig, build
from ambient_mesh.kube.client import KubeClient
from ambient_mesh.kube.kubeconfig import KubeCredentials
from ambient_mesh.net import SocketAddr

from .kube_fake import TOKEN, FakeApiServer

WAIT_S = 10.0
ROOT = "-----BEGIN CERTIFICATE-----\nroot\n-----END CERTIFICATE-----\n"


def test_reconcile_decides_create_patch_or_nothing():
    assert reconcile(None, ROOT) is Action.CREATE
    assert reconcile({"data": {CA_ROOT_CERT_KEY: "old"}}, ROOT) is Action.UPDATE
    assert reconcile({"metadata": {}}, ROOT) is Action.UPDATE
    assert reconcile({"data": "not a map"}, ROOT) is Action.UPDATE
    assert reconcile({"data": {CA_ROOT_CERT_KEY: ROOT, "other": "kept"}}, ROOT) is None


def namespace(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}


@pytest.fixture
async def api():
    server = FakeApiServer()
    await server.start()
    for name in ("shop", "kube-system", "kube-public"):
        await server.put(namespace(name))
    yield server
    await server.stop()


@contextlib.asynccontextmanager
async def running_plane(api: FakeApiServer, state_dir: Path) -> AsyncIterator[ControlPlane]:
    config = ControlPlaneConfig(
        state_dir=state_dir,
        kube=KubeCredentials(server=api.url, token=TOKEN),
        listen=SocketAddr.parse("127.0.0.1:0"),
    )
    plane = build(config)
    await plane.start()
    try:
        yield plane
    finally:
        await plane.stop(0)


@pytest.fixture
async def plane(api, tmp_path: Path):
    async with running_plane(api, tmp_path) as plane:
        yield plane


def configmap(api: FakeApiServer, ns: str) -> dict | None:
    return api.objects.get(("ConfigMap", ns, CA_ROOT_CERT_CONFIGMAP))


async def wait_until(predicate, what: str) -> None:
    try:
        async with asyncio.timeout(WAIT_S):
            while not predicate():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


def has_root(api: FakeApiServer, plane: ControlPlane, ns: str) -> bool:
    cm = configmap(api, ns)
    return cm is not None and cm.get("data", {}).get(CA_ROOT_CERT_KEY) == plane.ca.root_pem.decode()


async def test_every_namespace_but_kubernetes_own_gets_the_root(api, plane):
    await wait_until(
        lambda: has_root(api, plane, "shop") and has_root(api, plane, "kube-system"), "ConfigMaps"
    )
    cm = configmap(api, "shop")
    assert cm is not None and cm["metadata"]["labels"] == {"istio.io/config": "true"}
    assert "BEGIN CERTIFICATE" in cm["data"][CA_ROOT_CERT_KEY]
    assert configmap(api, "kube-public") is None
    # a namespace made later gets one too
    await api.put(namespace("later"))
    await wait_until(lambda: has_root(api, plane, "later"), "the new namespace's ConfigMap")


async def test_an_edited_configmap_is_updated_back_keeping_other_keys(api, plane):
    await wait_until(lambda: has_root(api, plane, "shop"), "the ConfigMap")
    edited = dict(configmap(api, "shop") or {})
    edited["data"] = {CA_ROOT_CERT_KEY: "tampered", "extra": "mine"}
    await api.put(edited)
    await wait_until(lambda: has_root(api, plane, "shop"), "the ConfigMap updated back")
    assert (configmap(api, "shop") or {})["data"]["extra"] == "mine"


async def test_a_deleted_configmap_comes_back(api, plane):
    await wait_until(lambda: has_root(api, plane, "shop"), "the ConfigMap")
    await api.delete("ConfigMap", "shop", CA_ROOT_CERT_CONFIGMAP)
    await wait_until(lambda: has_root(api, plane, "shop"), "the ConfigMap made again")


async def test_one_that_exists_with_another_root_at_start_is_updated(api, tmp_path: Path):
    await api.put(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": CA_ROOT_CERT_CONFIGMAP, "namespace": "shop"},
            "data": {CA_ROOT_CERT_KEY: "an older root"},
        }
    )
    async with running_plane(api, tmp_path) as plane:
        await wait_until(lambda: has_root(api, plane, "shop"), "the ConfigMap updated")
        writes = [
            m for m, t, _, _ in api.requests if "/namespaces/shop/configmaps" in t and m in ("POST", "PUT")
        ]
        assert writes == ["PUT"], writes


async def test_a_namespace_that_refuses_writes_is_given_up_after_bounded_attempts(api, plane):
    api.forbidden_namespaces.add("locked")
    await api.put(namespace("locked"))
    controller = plane.namespace_controller
    assert controller is not None
    await wait_until(lambda: controller.failed == 1, "the controller to give up")
    posts = [t for m, t, _, _ in api.requests if m == "POST" and "/namespaces/locked/configmaps" in t]
    assert len(posts) == MAX_RECONCILE_ATTEMPTS
    assert configmap(api, "locked") is None
    # the others are served all the same
    await wait_until(lambda: has_root(api, plane, "shop"), "shop's ConfigMap")


async def test_a_stale_update_is_read_again_and_retried(api):
    """The watch lags a change: the PUT from the old resourceVersion gets 409, the controller reads
    the ConfigMap again and writes from the new version, keeping what the change added. (A
    controller of its own, not running: its cache is set by hand as a lagging watch left it.)"""
    client = KubeClient(KubeCredentials(server=api.url, token=TOKEN))
    controller = NamespaceController(client, ROOT)
    try:
        old = await api.put(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": CA_ROOT_CERT_CONFIGMAP, "namespace": "shop"},
                "data": {CA_ROOT_CERT_KEY: "tampered"},
            }
        )
        await api.put({**old, "data": {CA_ROOT_CERT_KEY: "tampered", "extra": "newer"}})
        controller.set_namespaces(["shop"])
        controller.configmaps["shop"] = old  # the lagging watch's view: an older resourceVersion
        await controller._reconcile("shop")
        shop = [m for m, t, _, _ in api.requests if "/namespaces/shop/configmaps" in t]
        assert shop == ["PUT", "GET", "PUT"], shop
        data = api.objects[("ConfigMap", "shop", CA_ROOT_CERT_CONFIGMAP)]["data"]
        assert data == {CA_ROOT_CERT_KEY: ROOT, "extra": "newer"}
        assert controller.updated == 1 and controller.failed == 0
    finally:
        await client.close()
