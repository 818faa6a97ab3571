"""The pod-source contract, run against both implementations: `KubeApiPodSource` talking to the
fake Kubernetes API server of kube_fake.py (list, watch as JSON lines over chunked HTTP with
bookmarks, GET, PATCH on pods/status, 410 Gone, bearer auth), and `DirectoryPodSource` over a YAML
directory."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
import yaml

from ambient_mesh.cni.pods import (
    DirectoryPodSource,
    EventType,
    KubeApiPodSource,
    NamespaceEvent,
    PodEvent,
    PodSourceError,
)
from ambient_mesh.kube.client import KubeClient
from ambient_mesh.kube.kubeconfig import KubeCredentials

from .kube_fake import TOKEN, FakeApiServer, api_tls, self_signed

NODE = "node-1"
WAIT_S = 5.0


def pod_obj(name: str, *, node: str = NODE, labels: dict | None = None, ip: str = "10.0.0.5") -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "demo",
            "uid": f"uid-{name}",
            "labels": labels or {},
            "annotations": {},
        },
        "spec": {"nodeName": node, "serviceAccountName": "sa", "containers": [{"name": "app"}]},
        "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]},
    }


def ns_obj(labels: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "demo", "labels": labels}}


# -- the two worlds the contract runs in ----------------------------------------------------------


class ApiWorld:
    def __init__(self, server: FakeApiServer) -> None:
        self.server = server
        self.source = KubeApiPodSource(
            KubeClient(KubeCredentials(server=f"http://127.0.0.1:{server.port}", token=TOKEN)), node_name=NODE
        )

    async def set_namespace(self, labels: dict) -> None:
        await self.server.put(ns_obj(labels))

    async def set_pod(self, obj: dict) -> None:
        await self.server.put(obj)

    async def delete_pod(self, name: str) -> None:
        await self.server.put(self.server.objects[("Pod", "demo", name)], delete=True)


class DirectoryWorld:
    def __init__(self, root: Path) -> None:
        self.dir = root / "pods"
        self.dir.mkdir()
        self.objects: dict[tuple[str, str], dict] = {}
        self.source = DirectoryPodSource(
            self.dir, node_name=NODE, state_file=root / "run" / "state.json", poll_interval_s=0.02
        )

    def _write(self) -> None:
        (self.dir / "objects.yaml").write_text(yaml.safe_dump_all(list(self.objects.values())))

    async def set_namespace(self, labels: dict) -> None:
        self.objects[("Namespace", "demo")] = ns_obj(labels)
        self._write()

    async def set_pod(self, obj: dict) -> None:
        self.objects[("Pod", obj["metadata"]["name"])] = obj
        self._write()

    async def delete_pod(self, name: str) -> None:
        del self.objects[("Pod", name)]
        self._write()


@pytest.fixture
async def api_server():
    server = FakeApiServer()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture(params=["kube-api", "directory"])
async def world(request, tmp_path, api_server):
    w = ApiWorld(api_server) if request.param == "kube-api" else DirectoryWorld(tmp_path)
    await w.set_namespace({"istio.io/dataplane-mode": "ambient"})
    await w.set_pod(pod_obj("a"))
    await w.set_pod(pod_obj("elsewhere", node="node-2"))
    yield w
    await w.source.close()


class Collector:
    def __init__(self) -> None:
        self.events: list = []
        self._changed = asyncio.Condition()

    async def __call__(self, event) -> None:
        self.events.append(event)
        async with self._changed:
            self._changed.notify_all()

    async def wait_for(self, predicate) -> object:
        async with asyncio.timeout(WAIT_S):
            async with self._changed:
                await self._changed.wait_for(lambda: any(predicate(e) for e in self.events))
        return next(e for e in self.events if predicate(e))


@contextlib.asynccontextmanager
async def watching(source):
    collector = Collector()
    task = asyncio.create_task(source.run(collector))
    try:
        yield collector
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# -- the contract ---------------------------------------------------------------------------------


async def test_start_lists_this_nodes_pods_and_all_namespaces(world):
    await world.source.start()
    assert [p.name for p in world.source.pods()] == ["a"]
    assert world.source.pod("demo", "a").uid == "uid-a"
    assert world.source.namespace("demo").labels == {"istio.io/dataplane-mode": "ambient"}
    assert world.source.pod("demo", "elsewhere") is None


async def test_watch_reports_pod_updates_with_old_and_new(world):
    await world.source.start()
    async with watching(world.source) as seen:
        await world.set_pod(pod_obj("a", labels={"istio.io/dataplane-mode": "none"}))
        event = await seen.wait_for(lambda e: isinstance(e, PodEvent) and e.type is EventType.UPDATED)
    assert event.old.labels == {} and event.new.labels == {"istio.io/dataplane-mode": "none"}
    assert world.source.pod("demo", "a").labels == {"istio.io/dataplane-mode": "none"}


async def test_watch_reports_deletions_and_namespace_changes(world):
    await world.source.start()
    async with watching(world.source) as seen:
        await world.delete_pod("a")
        deleted = await seen.wait_for(lambda e: isinstance(e, PodEvent) and e.type is EventType.DELETED)
        await world.set_namespace({})
        ns = await seen.wait_for(lambda e: isinstance(e, NamespaceEvent) and e.type is EventType.UPDATED)
    assert deleted.pod.name == "a" and deleted.old.ips == ("10.0.0.5",)
    assert ns.old.labels and ns.new.labels == {}
    assert world.source.pods() == ()


async def test_new_pod_on_other_node_is_not_reported(world):
    await world.source.start()
    async with watching(world.source) as seen:
        await world.set_pod(pod_obj("far", node="node-9"))
        await world.set_pod(pod_obj("near"))
        await seen.wait_for(lambda e: isinstance(e, PodEvent) and e.pod.name == "near")
    assert all(not (isinstance(e, PodEvent) and e.pod.name == "far") for e in seen.events)


async def test_mark_and_unmark(world):
    await world.source.start()
    pod = world.source.pod("demo", "a")
    await world.source.mark_enrolled(pod)
    assert world.source.pod("demo", "a").redirection == "enabled"
    await world.source.mark_enrolled(pod, "pending")
    assert world.source.pod("demo", "a").redirection == "pending"
    await world.source.unmark(pod)
    assert world.source.pod("demo", "a").redirection == ""


async def test_fetch_pod_sees_a_pod_before_the_watch_does(world):
    await world.source.start()
    await world.set_pod(pod_obj("fresh", ip="10.0.0.9"))
    pod = await world.source.fetch_pod("demo", "fresh")
    assert pod is not None and pod.ips == ("10.0.0.9",)
    assert await world.source.fetch_pod("demo", "never") is None


# -- the Kubernetes API only ----------------------------------------------------------------------


async def test_mark_patches_pod_status_with_a_merge_patch(api_server):
    world = ApiWorld(api_server)
    await world.set_pod(pod_obj("a"))
    await world.source.start()
    await world.source.mark_enrolled(world.source.pod("demo", "a"))
    patches = [r[:3] for r in api_server.requests if r[0] == "PATCH"]
    assert patches == [("PATCH", "/api/v1/namespaces/demo/pods/a/status", "application/merge-patch+json")]
    stored = api_server.objects[("Pod", "demo", "a")]
    assert stored["metadata"]["annotations"] == {"ambient.istio.io/redirection": "enabled"}


async def test_watch_resumes_from_the_list_version_with_a_node_field_selector(api_server):
    world = ApiWorld(api_server)
    await world.set_pod(pod_obj("a"))
    await world.source.start()
    async with watching(world.source) as seen:
        await world.set_pod(pod_obj("b"))
        await seen.wait_for(lambda e: isinstance(e, PodEvent) and e.pod.name == "b")
    watches = api_server.watches("pods")
    assert watches and f"resourceVersion={api_server.rv - 1}" in watches[0]
    assert "fieldSelector=spec.nodeName%3Dnode-1" in watches[0]


@pytest.mark.parametrize("as_http_status", [False, True], ids=["error-event", "http-410"])
async def test_expired_watch_relists_and_reports_the_difference(api_server, as_http_status):
    api_server.gone_as_http_status = as_http_status
    world = ApiWorld(api_server)
    await world.set_pod(pod_obj("a"))
    await world.set_pod(pod_obj("b"))
    await world.source.start()
    # While no watch runs, b is deleted and the history compacted: the watch gets 410 Gone.
    await api_server.put(api_server.objects[("Pod", "demo", "b")], delete=True)
    await world.set_pod(pod_obj("c"))
    api_server.compacted_before = api_server.rv + 1
    async with watching(world.source) as seen:
        await seen.wait_for(lambda e: isinstance(e, PodEvent) and e.pod.name == "c")
        await seen.wait_for(lambda e: isinstance(e, PodEvent) and e.type is EventType.DELETED)
    assert world.source.relists >= 1
    assert sorted(p.name for p in world.source.pods()) == ["a", "c"]
    assert "410 Gone" in repr(world.source._pods_reflector)


async def test_bookmarks_move_the_watch_version_past_unrelated_changes(api_server):
    world = ApiWorld(api_server)
    await world.set_pod(pod_obj("a"))
    await world.source.start()
    listed_at = api_server.rv
    async with watching(world.source) as seen:
        # Pods on another node are filtered out by the field selector: this watch sees none of
        # them, only the bookmarks that carry their resourceVersions.
        for i in range(3):
            await world.set_pod(pod_obj(f"far-{i}", node="node-9"))
        async with asyncio.timeout(WAIT_S):
            while world.source._pods_reflector.resource_version != str(api_server.rv):
                await asyncio.sleep(0.01)
        assert not seen.events
    reflector = world.source._pods_reflector
    assert reflector.bookmarks >= 1 and int(reflector.resource_version) > listed_at
    assert all("allowWatchBookmarks=true" in w for w in api_server.watches("pods"))


async def test_wrong_token_is_a_pod_source_error(api_server):
    source = KubeApiPodSource(
        KubeClient(KubeCredentials(server=f"http://127.0.0.1:{api_server.port}", token="bad")), node_name=NODE
    )
    with pytest.raises(PodSourceError, match="401"):
        await source.start()


async def test_unreachable_api_server_is_a_pod_source_error():
    source = KubeApiPodSource(
        KubeClient(KubeCredentials(server="http://127.0.0.1:1", token=TOKEN), timeout_s=1), node_name=NODE
    )
    with pytest.raises(PodSourceError):
        await source.start()


async def test_agent_upgrading_asks_for_the_daemonset(api_server):
    world = ApiWorld(api_server)
    assert not await world.source.agent_upgrading("istio-system")
    daemonset = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "istio-cni-node", "namespace": "istio-system"},
    }
    await api_server.put(daemonset)
    assert await world.source.agent_upgrading("istio-system")
    daemonset["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    await api_server.put(daemonset)
    assert not await world.source.agent_upgrading("istio-system")
    assert repr(world.source).startswith("KubeApiPodSource(http://127.0.0.1")


async def test_the_agents_client_trusts_exactly_the_configured_ca_over_tls(tmp_path):
    cert, key = self_signed("kube-apiserver")
    server = FakeApiServer(tls=api_tls(cert, key, tmp_path))
    await server.start()
    try:
        await server.put(ns_obj({"istio.io/dataplane-mode": "ambient"}))
        trusted = KubeApiPodSource(
            KubeClient(KubeCredentials(server=server.url, token=TOKEN, ca_data=cert)), node_name=NODE
        )
        await trusted.start()
        assert trusted.namespace("demo") is not None
        await trusted.close()
        other, _ = self_signed("someone-else")
        untrusted = KubeApiPodSource(
            KubeClient(KubeCredentials(server=server.url, token=TOKEN, ca_data=other)), node_name=NODE
        )
        with pytest.raises(PodSourceError, match="CERTIFICATE_VERIFY_FAILED"):
            await untrusted.start()
        await untrusted.close()
    finally:
        await server.stop()
