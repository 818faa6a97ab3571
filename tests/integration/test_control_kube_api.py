"""The control plane reading the API server (control/sources.KubeApiSource) from kube_fake's fake:
the same objects as the YAML loader, changes and deletions as snapshots, a malformed object
skipped with its field named, 410 relists, a CRD that is not installed, `ambient control`'s
ControlPlane serving translated workloads from it, and its CA authenticating callers with the
API server's TokenReview and authorizing a node proxy by its pod's node."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import pytest
import yaml

from ambient_mesh.config import ZtunnelConfig
from ambient_mesh.control.plane import ControlPlane, ControlPlaneConfig, build
from ambient_mesh.control.sources import GATEWAYS, KubeApiSource, SourceChange
from ambient_mesh.errors import ConfigError, IdentityError
from ambient_mesh.identity.caclient import GrpcCaClient
from ambient_mesh.identity.spiffe import Identity
from ambient_mesh.kube.client import KubeClient
from ambient_mesh.kube.kubeconfig import KubeCredentials
from ambient_mesh.kube.load import LoadError, parse_documents
from ambient_mesh.net import SocketAddr

from .kube_fake import TOKEN, FakeApiServer

WAIT_S = 5.0

OBJECTS = yaml.safe_load_all("""
apiVersion: v1
kind: Namespace
metadata: {name: shop, labels: {istio.io/dataplane-mode: ambient}}
---
apiVersion: v1
kind: Node
metadata: {name: node-1, labels: {topology.kubernetes.io/zone: z1}}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: cart, namespace: shop}
---
apiVersion: v1
kind: Pod
metadata: {name: cart-0, namespace: shop, uid: uid-cart-0, labels: {app: cart},
           creationTimestamp: "2026-01-01T00:00:00Z"}
spec: {nodeName: node-1, serviceAccountName: cart, containers: [{name: app, ports: [{containerPort: 8080}]}]}
status: {phase: Running, podIP: 10.1.0.5, podIPs: [{ip: 10.1.0.5}], conditions: [{type: Ready, status: "True"}]}
---
apiVersion: v1
kind: Service
metadata: {name: cart, namespace: shop}
spec: {selector: {app: cart}, clusterIP: 10.96.0.10, ports: [{name: http, port: 80, targetPort: 8080}]}
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: deny-all, namespace: shop}
spec: {action: DENY, rules: [{from: [{source: {namespaces: [evil]}}]}]}
---
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: strict, namespace: shop}
spec: {mtls: {mode: STRICT}}
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: ext, namespace: shop}
spec: {hosts: [api.example.com], addresses: [240.0.0.1], ports: [{number: 443, name: tls, protocol: TLS}],
       resolution: STATIC, workloadSelector: {labels: {app: ext}}}
---
apiVersion: networking.istio.io/v1
kind: WorkloadEntry
metadata: {name: vm-1, namespace: shop, labels: {app: ext}}
spec: {address: 10.2.0.9, serviceAccount: cart}
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: waypoint, namespace: shop, labels: {istio.io/waypoint-for: service}}
spec:
  gatewayClassName: istio-waypoint
  listeners: [{name: mesh, port: 15008, protocol: HBONE}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: cart-canary, namespace: shop}
spec:
  parentRefs: [{group: "", kind: Service, name: cart, port: 80}]
  rules:
  - matches: [{headers: [{name: x-canary, value: "true"}]}]
    backendRefs: [{name: cart, port: 80}]
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: cart-closed, namespace: shop}
spec:
  hosts: [cart]
  http: [{directResponse: {status: 503, body: {string: closed}}}]
""")
OBJECTS = [o for o in OBJECTS if o]


@pytest.fixture
async def api():
    server = FakeApiServer()
    await server.start()
    for obj in OBJECTS:
        await server.put(obj)
    yield server
    await server.stop()


def client(api: FakeApiServer) -> KubeClient:
    return KubeClient(KubeCredentials(server=api.url, token=TOKEN))


class Changes:
    def __init__(self) -> None:
        self.seen: list[SourceChange] = []
        self._cond = asyncio.Condition()

    async def __call__(self, change: SourceChange) -> None:
        self.seen.append(change)
        async with self._cond:
            self._cond.notify_all()

    async def wait_for(self, predicate) -> SourceChange:
        async with asyncio.timeout(WAIT_S), self._cond:
            await self._cond.wait_for(lambda: self.seen and predicate(self.seen[-1]))
        return self.seen[-1]


@contextlib.asynccontextmanager
async def following(source: KubeApiSource):
    changes = Changes()
    task = asyncio.create_task(source.run(changes))
    try:
        yield changes
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await source.client.close()


async def test_every_kind_is_read_into_the_same_objects_as_from_yaml(api):
    source = KubeApiSource(client(api))
    first = await source.first()
    from_yaml = parse_documents(yaml.safe_dump_all(OBJECTS), "objects.yaml")
    assert not from_yaml.errors and not first.errors
    assert first.store.all() == from_yaml.store.all()
    assert len(first.store) == len(OBJECTS) == 12
    # Every list was cluster-wide, and the node agent's kinds came from the core group.
    lists = sorted(t.split("?")[0] for m, t, _, _ in api.requests if "watch" not in t)
    assert "/api/v1/pods" in lists and "/apis/gateway.networking.k8s.io/v1/gateways" in lists
    assert repr(source) == f"KubeApiSource({api.url}: 12 objects, 0 errors, 1 snapshots)"
    await source.client.close()


async def test_changes_arrive_as_coalesced_snapshots(api):
    source = KubeApiSource(client(api), debounce_s=0.05)
    await source.first()
    async with following(source) as changes:
        pod = api.objects[("Pod", "shop", "cart-0")]
        await api.put({**pod, "metadata": {**pod["metadata"], "name": "cart-1", "uid": "uid-cart-1"}})
        await api.put({**pod, "metadata": {**pod["metadata"], "name": "cart-2", "uid": "uid-cart-2"}})
        change = await changes.wait_for(lambda c: len(c.store.pods) == 3)
        assert change.summary.startswith("2 added, 0 updated, 0 removed")
        await api.delete("AuthorizationPolicy", "shop", "deny-all")
        relabelled = api.objects[("Namespace", "", "shop")]
        await api.put({**relabelled, "metadata": {**relabelled["metadata"], "labels": {}}})
        change = await changes.wait_for(lambda c: not c.store.authorization_policies)
        assert change.store.namespace("shop").metadata.labels == {}
    assert len(changes.seen) <= 4  # bursts were coalesced, not one snapshot per event


async def test_a_malformed_object_is_skipped_with_its_field_named(api):
    source = KubeApiSource(client(api), debounce_s=0.01)
    await source.first()
    async with following(source) as changes:
        pod = api.objects[("Pod", "shop", "cart-0")]
        bad = {**pod, "spec": {**pod["spec"], "nodeName": 7}}
        await api.put(bad)
        change = await changes.wait_for(lambda c: c.errors)
        assert change.errors == (
            LoadError(
                file="apiserver", object="Pod shop/cart-0", field="spec.nodeName", message="expected a string"
            ),
        )
        assert change.store.pods == ()  # dropped, as the directory loader drops it
        assert len(change.store) == len(OBJECTS) - 1
        await api.put(pod)
        change = await changes.wait_for(lambda c: not c.errors and c.store.pods)


async def test_expired_watch_relists_and_finds_what_was_deleted_meanwhile(api):
    source = KubeApiSource(client(api), debounce_s=0.01)
    await source.first()
    await api.delete("Service", "shop", "cart")
    api.compacted_before = api.rv + 1
    async with following(source) as changes:
        change = await changes.wait_for(lambda c: not c.store.services)
    assert change.store.pods and source.reflectors[2].relists >= 1


async def test_a_kind_that_is_not_served_is_retried_until_its_crd_appears(api):
    api.unserved.add("gateways")
    source = KubeApiSource(client(api), debounce_s=0.01, absent_retry_s=0.05)
    first = await source.first()
    assert source.absent == {GATEWAYS} and first.store.gateways == ()
    assert "not served: gateways.gateway.networking.k8s.io" in repr(source)
    async with following(source) as changes:
        api.unserved.clear()
        change = await changes.wait_for(lambda c: c.store.gateways)
    assert change.store.gateways[0].metadata.name == "waypoint" and not source.absent


async def test_refused_credentials_stop_the_start_with_the_reason(api):
    source = KubeApiSource(KubeClient(KubeCredentials(server=api.url, token="wrong")))
    with pytest.raises(ConfigError, match="HTTP 401"):
        await source.first()
    await source.client.close()


async def start_plane(api: FakeApiServer, tmp_path: Path) -> ControlPlane:
    config = ControlPlaneConfig(
        kube=KubeCredentials(server=api.url, token=TOKEN),
        state_dir=tmp_path / "state",
        listen=SocketAddr.parse("127.0.0.1:0"),
    )
    plane = build(config)
    await plane.start()
    return plane


async def test_control_plane_serves_workloads_from_the_api_server(api, tmp_path: Path):
    plane = await start_plane(api, tmp_path)
    try:
        assert plane.translation is not None
        assert "Kubernetes//Pod/shop/cart-0" in str(list(plane.translation.addresses))
        assert repr(plane).startswith(f"ControlPlane({api.url}: ")
        pod = api.objects[("Pod", "shop", "cart-0")]
        await api.put({**pod, "metadata": {**pod["metadata"], "name": "cart-9", "uid": "uid-cart-9"}})
        async with asyncio.timeout(WAIT_S):
            while "cart-9" not in str(list(plane.translation.addresses)):
                await asyncio.sleep(0.02)
    finally:
        await plane.stop(0)


WAYPOINT_GATEWAY = {
    "apiVersion": "gateway.networking.k8s.io/v1",
    "kind": "Gateway",
    "metadata": {"name": "waypoint", "namespace": "shop", "uid": "uid-gw"},
    "spec": {
        "gatewayClassName": "istio-waypoint",
        "listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE"}],
    },
}


async def test_control_plane_deploys_a_waypoint_gateway_and_writes_its_address(api, tmp_path: Path):
    await api.put(WAYPOINT_GATEWAY)
    config = ControlPlaneConfig(
        kube=KubeCredentials(server=api.url, token=TOKEN),
        state_dir=tmp_path / "state",
        listen=SocketAddr.parse("127.0.0.1:0"),
        waypoint_image="reg/ambient-mesh:1",
    )
    plane = build(config)
    await plane.start()
    try:
        async with asyncio.timeout(WAIT_S):
            while ("Service", "shop", "waypoint") not in api.objects or not api.objects[
                ("Gateway", "shop", "waypoint")
            ].get("status", {}).get("addresses"):
                await asyncio.sleep(0.02)
        assert [a[:3] for a in api.applies] == [
            ("ServiceAccount", "shop", "waypoint"),
            ("Deployment", "shop", "waypoint"),
            ("Service", "shop", "waypoint"),
        ]
        assert {a[3] for a in api.applies} == {"ambient-control"}
        deployment = api.objects[("Deployment", "shop", "waypoint")]
        assert deployment["metadata"]["ownerReferences"][0]["uid"] == "uid-gw"
        assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "reg/ambient-mesh:1"
        gw = api.objects[("Gateway", "shop", "waypoint")]
        assert gw["status"]["addresses"] == [{"type": "Hostname", "value": "waypoint.shop.svc.cluster.local"}]
        # the next snapshots (the Gateway's status, the new objects) write nothing more
        await asyncio.sleep(0.5)
        assert len(api.applies) == 3
        assert "1 applied, 1 addresses written, 0 failed" in repr(plane.waypoint_deployer)
    finally:
        await plane.stop(0)


def test_exactly_one_source_is_configured(tmp_path: Path):
    with pytest.raises(ConfigError, match="exactly one source"):
        ControlPlaneConfig(state_dir=tmp_path)
    with pytest.raises(ConfigError, match="exactly one source"):
        ControlPlaneConfig(state_dir=tmp_path, directory=tmp_path, kube=KubeCredentials(server="https://h"))


# -- CSRs authenticated by TokenReview -------------------------------------------------------------


def review(namespace: str, account: str, *, pod: str | None = None, uid: str | None = None, aud="istio-ca"):
    user = {
        "username": f"system:serviceaccount:{namespace}:{account}",
        "uid": f"sa-uid-{account}",
        "groups": ["system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"],
    }
    if pod is not None:
        user["extra"] = {
            "authentication.kubernetes.io/pod-name": [pod],
            "authentication.kubernetes.io/pod-uid": [uid],
        }
    return {"authenticated": True, "audiences": [aud], "user": user}


def pod_doc(name: str, namespace: str, account: str, node: str, uid: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": uid},
        "spec": {"nodeName": node, "serviceAccountName": account, "containers": [{"name": "c"}]},
        "status": {"phase": "Running", "podIP": "10.1.0.99"},
    }


@pytest.fixture
async def reviewed_plane(api, tmp_path: Path):
    await api.put(pod_doc("ztunnel-x", "istio-system", "ztunnel", "node-1", "uid-zt"))
    await api.put(pod_doc("db-0", "shop", "db", "node-2", "uid-db"))
    api.token_reviews["zt-token"] = review("istio-system", "ztunnel", pod="ztunnel-x", uid="uid-zt")
    api.token_reviews["stale-token"] = review("istio-system", "ztunnel", pod="ztunnel-x", uid="uid-gone")
    api.token_reviews["cart-token"] = review("shop", "cart")
    api.token_reviews["apiserver-aud"] = review("shop", "cart", aud="https://kubernetes.default.svc")
    plane = await start_plane(api, tmp_path)
    clients: list[GrpcCaClient] = []

    def client_with(token: str, *, shared: bool) -> GrpcCaClient:
        (tmp_path / "token").write_text(token)
        config = ZtunnelConfig.from_env(
            {
                "CA_ADDRESS": f"https://127.0.0.1:{plane.bound['tls'].port}",
                "CA_ROOT_CA": str(tmp_path / "state" / "root-cert.pem"),
                "AUTH_TOKEN": str(tmp_path / "token"),
                "XDS_ADDRESS": "",
                "ISTIO_META_DNS_CAPTURE": "false",
            }
        )
        clients.append(GrpcCaClient(config, shared_mode=shared))
        return clients[-1]

    try:
        yield plane, client_with
    finally:
        for client in clients:
            await client.close()
        await plane.stop(0)


CART = Identity("cluster.local", "shop", "cart")
DB = Identity("cluster.local", "shop", "db")


async def test_a_workload_token_reviewed_by_the_api_server_gets_its_own_certificate(api, reviewed_plane):
    plane, client_with = reviewed_plane
    cert = await client_with("cart-token", shared=False).fetch_certificate(CART)
    assert cert.identity == CART
    [body] = [b for m, t, _, b in api.requests if t.endswith("/tokenreviews")]
    sent = json.loads(body)
    assert sent["kind"] == "TokenReview" and sent["spec"] == {
        "token": "cart-token",
        "audiences": ["istio-ca"],
    }
    assert "1 reviews, 0 refused" in repr(plane.authenticator)


@pytest.mark.parametrize(
    ("token", "message"),
    [
        ("unknown-token", "the API server refused the token: invalid bearer token"),
        ("apiserver-aud", "the API server refused the token: token audiences are invalid"),
    ],
)
async def test_a_token_the_api_server_denies_gets_nothing(reviewed_plane, token, message):
    _plane, client_with = reviewed_plane
    with pytest.raises(IdentityError, match=f"request authenticate failure: {message}"):
        await client_with(token, shared=False).fetch_certificate(CART)


async def test_the_node_proxy_may_impersonate_only_workloads_on_its_pods_node(reviewed_plane):
    _plane, client_with = reviewed_plane
    ztunnel = client_with("zt-token", shared=True)
    assert (await ztunnel.fetch_certificate(CART)).identity == CART  # cart-0 runs on node-1
    with pytest.raises(IdentityError, match=f"no workload running as {DB} on node 'node-1'"):
        await ztunnel.fetch_certificate(DB)  # db-0 runs on node-2
    stale = client_with("stale-token", shared=True)
    with pytest.raises(IdentityError, match="but its UID uid-zt is not the token's uid-gone"):
        await stale.fetch_certificate(CART)
    workload = client_with("cart-token", shared=True)
    with pytest.raises(IdentityError, match="caller shop/cart is not allowed to impersonate"):
        await workload.fetch_certificate(DB)


async def test_xds_callers_are_authenticated_by_token_review_too(reviewed_plane):
    plane, _client_with = reviewed_plane
    ok = await plane._authenticate({"authorization": "Bearer zt-token"})
    assert ok.identities == ("spiffe://cluster.local/ns/istio-system/sa/ztunnel",)
    refused = await plane._authenticate({"authorization": "Bearer unknown-token"})
    assert "invalid bearer token" in refused.reason
