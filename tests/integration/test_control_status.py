"""Object status written by `ambient control`: through the API server's status subresource
(kube_fake's fake, a merge PATCH of `<kind>/status` keeping other writers' conditions) and into
the YAML directory's status files (the lab), and only when the conditions change."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from ambient_mesh.control.plane import STATUS_DIR_NAME, ControlPlaneConfig, build
from ambient_mesh.control.sources import AUTHORIZATION_POLICIES
from ambient_mesh.control.status import Condition, DirectoryStatusWriter, KubeStatusWriter, read_status_dir
from ambient_mesh.kube.client import KubeClient
from ambient_mesh.kube.kubeconfig import KubeCredentials
from ambient_mesh.net import SocketAddr

from .kube_fake import TOKEN, FakeApiServer

WAIT_S = 5.0

OBJECTS = list(
    yaml.safe_load_all("""
apiVersion: v1
kind: Namespace
metadata: {name: shop, labels: {istio.io/dataplane-mode: ambient}}
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: custom, namespace: shop, generation: 3}
spec: {action: CUSTOM, provider: {name: ext}, rules: [{}]}
status:
  conditions:
  - {type: SomeoneElses, status: "True", reason: Mine, message: kept, lastTransitionTime: "2026-01-01T00:00:00Z"}
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: get-only, namespace: shop, generation: 1}
spec: {action: ALLOW, rules: [{to: [{operation: {methods: [GET]}}]}]}
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: fine, namespace: shop, generation: 1}
spec: {action: ALLOW, rules: [{from: [{source: {namespaces: [shop]}}]}]}
""")
)


@pytest.fixture
async def api():
    server = FakeApiServer()
    await server.start()
    for obj in OBJECTS:
        await server.put(obj)
    yield server
    await server.stop()


def conditions(api: FakeApiServer, name: str) -> dict[str, dict]:
    obj = api.objects[("AuthorizationPolicy", "shop", name)]
    return {c["type"]: c for c in obj.get("status", {}).get("conditions", [])}


async def test_control_plane_patches_status_through_the_api_server(api, tmp_path: Path):
    plane = build(
        ControlPlaneConfig(
            kube=KubeCredentials(server=api.url, token=TOKEN),
            state_dir=tmp_path / "state",
            listen=SocketAddr.parse("127.0.0.1:0"),
        )
    )
    await plane.start()
    try:
        async with asyncio.timeout(WAIT_S):
            while len(api.status_patches) < 3:
                await asyncio.sleep(0.02)
        await plane.wait_status()
        custom = conditions(api, "custom")
        assert custom["ZtunnelAccepted"]["status"] == "False"
        assert custom["ZtunnelAccepted"]["reason"] == "UnsupportedValue"
        assert "CUSTOM" in custom["ZtunnelAccepted"]["message"]
        assert custom["ZtunnelAccepted"]["observedGeneration"] == 3
        assert custom["SomeoneElses"]["message"] == "kept"  # another writer's condition survives
        get_only = conditions(api, "get-only")["ZtunnelAccepted"]
        assert (get_only["status"], get_only["reason"]) == ("True", "UnsupportedValue")
        assert "allows nothing" in get_only["message"]
        fine = conditions(api, "fine")["ZtunnelAccepted"]
        assert (fine["status"], fine["reason"], fine["message"]) == (
            "True",
            "Accepted",
            "attached to ztunnel",
        )
        # only status was sent, to the status subresource, one PATCH per object
        assert sorted(p[2] for p in api.status_patches) == ["custom", "fine", "get-only"]
        assert all(set(p[3]) == {"status"} for p in api.status_patches)
        # a change elsewhere re-computes but writes nothing that did not change
        ns = api.objects[("Namespace", "", "shop")]
        await api.put(
            {**ns, "metadata": {**ns["metadata"], "labels": {**ns["metadata"]["labels"], "x": "y"}}}
        )
        await asyncio.sleep(0.5)
        await plane.wait_status()
        assert len(api.status_patches) == 3
    finally:
        await plane.stop()


async def test_kube_writer_keeps_the_transition_time_while_the_status_holds(api):
    client = KubeClient(KubeCredentials(server=api.url, token=TOKEN))
    writer = KubeStatusWriter(client, {"AuthorizationPolicy": AUTHORIZATION_POLICIES})
    key = ("AuthorizationPolicy", "shop", "fine")
    first = Condition(type="ZtunnelAccepted", status=True, reason="Accepted", message="attached to ztunnel")
    try:
        assert await writer.write({key: (first,)}, datetime(2026, 1, 1, tzinfo=UTC)) == 1
        assert await writer.write({key: (first,)}, datetime(2026, 2, 1, tzinfo=UTC)) == 0  # unchanged
        changed = Condition(type="ZtunnelAccepted", status=True, reason="UnsupportedValue", message="m")
        assert await writer.write({key: (changed,)}, datetime(2026, 3, 1, tzinfo=UTC)) == 1
        cond = conditions(api, "fine")["ZtunnelAccepted"]
        assert cond["reason"] == "UnsupportedValue" and cond["lastTransitionTime"] == "2026-01-01T00:00:00Z"
        flipped = Condition(type="ZtunnelAccepted", status=False, reason="UnsupportedValue", message="m")
        await writer.write({key: (flipped,)}, datetime(2026, 4, 1, tzinfo=UTC))
        assert conditions(api, "fine")["ZtunnelAccepted"]["lastTransitionTime"] == "2026-04-01T00:00:00Z"
        # an object deleted meanwhile is skipped, not an error
        assert await writer.write({("AuthorizationPolicy", "shop", "gone"): (first,)}, datetime.now(UTC)) == 0
        assert writer.failures == 0
    finally:
        await client.close()


async def test_directory_source_writes_status_files_beside_the_state(tmp_path: Path):
    objects = tmp_path / "objects"
    objects.mkdir()
    (objects / "policies.yaml").write_text(yaml.safe_dump_all(OBJECTS))
    plane = build(
        ControlPlaneConfig(
            directory=objects,
            state_dir=tmp_path / "state",
            listen=SocketAddr.parse("127.0.0.1:0"),
            poll_interval_s=0.05,
        )
    )
    await plane.start()
    try:
        await plane.wait_status()
        status_dir = tmp_path / "state" / STATUS_DIR_NAME
        (custom,) = read_status_dir(status_dir, ("AuthorizationPolicy", "shop", "custom"))
        assert not custom.status and custom.reason == "UnsupportedValue"
        assert isinstance(plane.status_writer, DirectoryStatusWriter)
        # the policy removed: its status file goes with it
        (objects / "policies.yaml").write_text(yaml.safe_dump_all(OBJECTS[:1] + OBJECTS[2:]))
        async with asyncio.timeout(WAIT_S):
            while read_status_dir(status_dir, ("AuthorizationPolicy", "shop", "custom")):
                await asyncio.sleep(0.05)
                await plane.wait_status()
    finally:
        await plane.stop()


async def test_analyze_and_explain_read_a_cluster(api, tmp_path: Path):
    """`ambient analyze --kube` and `explain --kube`: the objects listed from the API server."""
    from ambient_mesh.diagnostics.analyze import analyze
    from ambient_mesh.diagnostics.view import cluster_view

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": api.url}}],
                "users": [{"name": "u", "user": {"token": TOKEN}}],
                "contexts": [{"name": "c", "context": {"cluster": "fake", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    view = await cluster_view(str(kubeconfig))
    assert view.where == api.url
    found = {(m.code, m.resource) for m in analyze(view)}
    assert ("IST0171", "AuthorizationPolicy custom.shop") in found  # ZtunnelAccepted=False
    assert ("AMB0103", "AuthorizationPolicy get-only.shop") in found
