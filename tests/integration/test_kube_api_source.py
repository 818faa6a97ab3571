"""The pod-source contract, run against both implementations: `KubeApiPodSource` talking to a tiny
fake Kubernetes API server (list, watch as JSON lines over chunked HTTP, GET, PATCH on pods/status,
410 Gone, bearer auth), and `DirectoryPodSource` over a YAML directory."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import pytest
import yaml

from ambient_mesh.admin import parse_request
from ambient_mesh.cni.pods import (
    DirectoryPodSource,
    EventType,
    KubeAccess,
    KubeApiPodSource,
    KubeClient,
    NamespaceEvent,
    PodEvent,
    PodSourceError,
)

NODE = "node-1"
TOKEN = "sekret"
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


class FakeApiServer:
    """Pods and namespaces with resource versions, watchers fed from one event log."""

    def __init__(self) -> None:
        self.rv = 100
        self.objects: dict[tuple[str, str, str], dict] = {}  # (kind, ns, name)
        self.log: list[tuple[int, str, str, dict]] = []  # (rv, kind, type, object)
        self.compacted_before = 0  # watches from an older version get 410
        self.daemonset = False
        self.requests: list[tuple[str, str, str]] = []  # method, path, content-type
        self.changed = asyncio.Condition()
        self.server: asyncio.Server | None = None
        self.port = 0
        self.watchers = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 1)

    async def put(self, obj: dict, *, delete: bool = False) -> None:
        kind = obj["kind"]
        key = (kind, obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        self.rv += 1
        obj = json.loads(json.dumps(obj))
        obj["metadata"]["resourceVersion"] = str(self.rv)
        existed = key in self.objects
        if delete:
            self.objects.pop(key, None)
            kind_of_event = "DELETED"
        else:
            self.objects[key] = obj
            kind_of_event = "MODIFIED" if existed else "ADDED"
        self.log.append((self.rv, kind, kind_of_event, obj))
        async with self.changed:
            self.changed.notify_all()

    def _list(self, kind: str, node: str | None) -> dict:
        items = [
            o
            for (k, _, _), o in sorted(self.objects.items())
            if k == kind and (node is None or o["spec"].get("nodeName") == node)
        ]
        return {"kind": f"{kind}List", "metadata": {"resourceVersion": str(self.rv)}, "items": items}

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            data = b""
            while (parsed := parse_request(data)) is None:
                chunk = await reader.read(65536)
                if not chunk:
                    return
                data += chunk
            request = parsed[0]
            self.requests.append((request.method, request.target, request.header("content-type") or ""))
            if request.header("authorization") != f"Bearer {TOKEN}":
                await self._reply(writer, 401, {"kind": "Status", "code": 401})
                return
            url = urlsplit(request.target)
            query = {k: v[0] for k, v in parse_qs(url.query).items()}
            parts = [unquote(p) for p in url.path.strip("/").split("/")]
            node = query.get("fieldSelector", "").removeprefix("spec.nodeName=") or None
            if parts == ["api", "v1", "pods"] or parts == ["api", "v1", "namespaces"]:
                kind = "Pod" if parts[-1] == "pods" else "Namespace"
                if query.get("watch") == "1":
                    await self._watch(writer, kind, node, int(query.get("resourceVersion") or 0))
                else:
                    await self._reply(writer, 200, self._list(kind, node))
            elif parts[:3] == ["api", "v1", "namespaces"] and len(parts) >= 6 and parts[4] == "pods":
                key = ("Pod", parts[3], parts[5])
                if key not in self.objects:
                    await self._reply(writer, 404, {"kind": "Status", "code": 404})
                elif request.method == "PATCH" and parts[6:] == ["status"]:
                    patch = json.loads(request.body)
                    obj = json.loads(json.dumps(self.objects[key]))
                    annotations = obj["metadata"].setdefault("annotations", {})
                    for k, v in patch["metadata"]["annotations"].items():
                        if v is None:
                            annotations.pop(k, None)
                        else:
                            annotations[k] = v
                    await self.put(obj)
                    await self._reply(writer, 200, self.objects[key])
                else:
                    await self._reply(writer, 200, self.objects[key])
            elif parts[:2] == ["apis", "apps"] and parts[-1] == "istio-cni-node":
                await self._reply(
                    writer,
                    200 if self.daemonset else 404,
                    {"kind": "DaemonSet", "metadata": {"name": "istio-cni-node"}},
                )
            else:
                await self._reply(writer, 404, {"kind": "Status", "code": 404})
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    @staticmethod
    async def _reply(writer: asyncio.StreamWriter, status: int, doc: dict) -> None:
        body = json.dumps(doc).encode()
        writer.write(
            f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n".encode()
            + body
        )
        await writer.drain()

    async def _watch(self, writer: asyncio.StreamWriter, kind: str, node: str | None, since: int) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )

        def send(doc: dict) -> None:
            line = json.dumps(doc).encode() + b"\n"
            writer.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")

        if since < self.compacted_before:
            send({"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}})
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return
        self.watchers += 1
        sent = since
        try:
            while True:
                for rv, k, kind_of_event, obj in self.log:
                    if rv > sent and k == kind and (node is None or obj["spec"].get("nodeName") == node):
                        send({"type": kind_of_event, "object": obj})
                    sent = max(sent, rv)
                await writer.drain()
                async with self.changed:
                    await self.changed.wait_for(lambda s=sent: self.rv > s)
        finally:
            self.watchers -= 1


# -- the two worlds the contract runs in ----------------------------------------------------------


class ApiWorld:
    def __init__(self, server: FakeApiServer) -> None:
        self.server = server
        self.source = KubeApiPodSource(
            KubeClient(KubeAccess(server=f"http://127.0.0.1:{server.port}", token=TOKEN)), node_name=NODE
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
    patches = [r for r in api_server.requests if r[0] == "PATCH"]
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
    watches = [
        target for method, target, _ in api_server.requests if "watch=1" in target and "/pods" in target
    ]
    assert watches and f"resourceVersion={api_server.rv - 1}" in watches[0]
    assert "fieldSelector=spec.nodeName%3Dnode-1" in watches[0]


async def test_expired_watch_relists_and_reports_the_difference(api_server):
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


async def test_wrong_token_is_a_pod_source_error(api_server):
    source = KubeApiPodSource(
        KubeClient(KubeAccess(server=f"http://127.0.0.1:{api_server.port}", token="bad")), node_name=NODE
    )
    with pytest.raises(PodSourceError, match="401"):
        await source.start()


async def test_unreachable_api_server_is_a_pod_source_error():
    source = KubeApiPodSource(
        KubeClient(KubeAccess(server="http://127.0.0.1:1", token=TOKEN), timeout_s=1), node_name=NODE
    )
    with pytest.raises(PodSourceError):
        await source.start()


async def test_agent_upgrading_asks_for_the_daemonset(api_server):
    world = ApiWorld(api_server)
    assert not await world.source.agent_upgrading("istio-system")
    api_server.daemonset = True
    assert await world.source.agent_upgrading("istio-system")
    assert repr(world.source).startswith("KubeApiPodSource(http://127.0.0.1")
