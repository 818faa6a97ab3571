"""The xDS client against a real gRPC server on loopback (tests/integration/fake_ads.py)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from ambient_mesh.config import ZtunnelConfig
from ambient_mesh.identity.ca import CertificateAuthority
from ambient_mesh.net import ip_address
from ambient_mesh.state.store import ProxyState
from ambient_mesh.wire.istio.workload import workload_pb2 as W
from ambient_mesh.xds.client import XdsClient
from ambient_mesh.xds.session import StreamEnd
from ambient_mesh.xds.updater import StateUpdater

from .fake_ads import ADDRESS, AUTHORIZATION, FakeAds, authorization, resource, server_certificate

SVC = "ns/echo.ns.svc.cluster.local"


def workload(name: str, ip: str, **kwargs) -> W.Workload:
    return W.Workload(
        uid=f"c1//Pod/ns/{name}", name=name, namespace="ns", addresses=[ip_address(ip).packed], **kwargs
    )


def wl_resource(name: str, ip: str, version: str = "v1", **kwargs):
    return resource(f"c1//Pod/ns/{name}", workload(name, ip, **kwargs), version=version, aliases=[f"/{ip}"])


def echo_service(version: str = "s1"):
    return resource(
        SVC,
        W.Service(
            name="echo",
            namespace="ns",
            hostname="echo.ns.svc.cluster.local",
            addresses=[W.NetworkAddress(address=ip_address("10.96.0.1").packed)],
            ports=[W.Port(service_port=80, target_port=8080)],
        ),
        version=version,
        aliases=["/10.96.0.1"],
    )


@contextlib.asynccontextmanager
async def running(fake: FakeAds, env: dict[str, str], **kwargs):
    config = ZtunnelConfig.from_env(
        {"XDS_ADDRESS": fake.address, "POD_NAME": "ztunnel-1", "POD_NAMESPACE": "istio-system", **env},
        ipv6_disabled_on_lo=lambda: False,
    )
    state = ProxyState()
    client = XdsClient(config, StateUpdater(state), **kwargs)
    client.start()
    try:
        yield client, state
    finally:
        await client.close()


@pytest.fixture
async def fake():
    server = FakeAds()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def ready(client: XdsClient) -> None:
    await asyncio.wait_for(client.ready.wait(), 10)


def find(state: ProxyState, ip: str):
    return state.workloads.find_address("", ip_address(ip))


# ------------------------------------------------------------------------------------ tests


async def test_initial_subscription_readiness_and_call_metadata(fake: FakeAds, tmp_path: Path) -> None:
    token = tmp_path / "istio-token"
    token.write_text("token-one\n")
    fake.put(
        ADDRESS,
        echo_service(),
        wl_resource(
            "a", "10.0.0.1", services={SVC: W.PortList(ports=[W.Port(service_port=80, target_port=8080)])}
        ),
    )
    fake.put(AUTHORIZATION, authorization("allow-all"))
    env = {"AUTH_TOKEN": str(token), "CLUSTER_ID": "cluster-9", "XDS_HEADER_X_TEAM": "mesh"}
    async with running(fake, env) as (client, state):
        await ready(client)
        assert find(state, "10.0.0.1").uid == "c1//Pod/ns/a"
        assert list(state.services.get(SVC).endpoints) == ["c1//Pod/ns/a"]
        assert list(state.policies) == ["default/allow-all"]
        (stream,) = fake.streams
        assert stream.metadata["authorization"] == "Bearer token-one"
        assert stream.metadata["clusterid"] == "cluster-9"
        assert stream.metadata["x_team"] == "mesh"
        first, second = stream.requests[:2]
        assert (first.type_url, second.type_url) == (ADDRESS, AUTHORIZATION)
        assert first.node.id == "ztunnel~1.1.1.1~ztunnel-1.istio-system~istio-system.svc.cluster.local"
        assert second.node.id == first.node.id
        assert list(first.resource_names_subscribe) == [] and dict(first.initial_resource_versions) == {}
        # Each response got exactly one ACK carrying its nonce and nothing else.
        await fake.wait_for(lambda: len(stream.requests) == 4)
        acks = stream.requests[2:]
        assert sorted(a.response_nonce for a in acks) == sorted(r.nonce for r in stream.responses)
        assert all(not a.HasField("node") and not a.HasField("error_detail") for a in acks)
        assert "connected (stream 1)" in repr(client) and repr(client).endswith(
            "3 resources known, 0 on-demand pending, ready>"
        )


async def test_pushes_and_removals_reach_the_state(fake: FakeAds) -> None:
    async with running(fake, {}) as (client, state):
        await ready(client)
        nonce = await fake.push(ADDRESS, [echo_service(), wl_resource("b", "10.0.0.2")])
        await fake.wait_reply(nonce)
        assert find(state, "10.0.0.2") is not None and SVC in state.services
        nonce = await fake.push(ADDRESS, removed=["c1//Pod/ns/b", SVC, "ns/not-there"])
        reply = await fake.wait_reply(nonce)
        assert not reply.HasField("error_detail")
        assert len(state.workloads) == 0 and len(state.services) == 0
        nonce = await fake.push(AUTHORIZATION, [authorization("deny", action=1)])
        await fake.wait_reply(nonce)
        assert list(state.policies) == ["default/deny"]


async def test_partly_bad_push_is_nacked_and_the_good_part_applied(fake: FakeAds) -> None:
    async with running(fake, {}) as (client, state):
        await ready(client)
        bad = resource("c1//Pod/ns/bad", workload("bad", "10.0.0.3", tunnel_protocol=W.LEGACY_ISTIO_MTLS))
        nonce = await fake.push(ADDRESS, [wl_resource("good", "10.0.0.4"), bad])
        reply = await fake.wait_reply(nonce)
        assert reply.type_url == ADDRESS and reply.response_nonce == nonce
        assert (
            reply.error_detail.message == "c1//Pod/ns/bad: tunnel protocol LEGACY_ISTIO_MTLS is not supported"
        )
        assert find(state, "10.0.0.4") is not None and find(state, "10.0.0.3") is None
        assert "c1//Pod/ns/bad" not in client.session.known[ADDRESS]


async def test_server_restart_resumes_with_initial_resource_versions(fake: FakeAds) -> None:
    fake.put(
        ADDRESS,
        wl_resource("keep", "10.0.0.5"),
        wl_resource("change", "10.0.0.6"),
        wl_resource("gone", "10.0.0.7"),
    )
    async with running(fake, {}) as (client, state):
        await ready(client)
        await fake.wait_for(lambda: len(fake.streams[0].requests) == 4)  # both ACKs in
        # While the client is away: one workload changes, one disappears.
        fake.put(ADDRESS, wl_resource("change", "10.0.0.16", version="v2"))
        del fake.resources[ADDRESS]["c1//Pod/ns/gone"]
        await fake.restart()
        second = await fake.wait_for(lambda: len(fake.streams) == 2 and fake.streams[1])
        await fake.wait_for(lambda: len(second.requests) >= 4)
        initial = second.initial(ADDRESS)
        assert dict(initial.initial_resource_versions) == {
            "c1//Pod/ns/keep": "v1",
            "c1//Pod/ns/change": "v1",
            "c1//Pod/ns/gone": "v1",
        }
        # The server re-sent only what changed; the unchanged workload survived the reconnect.
        (answer,) = [r for r in second.responses if r.type_url == ADDRESS]
        assert [r.name for r in answer.resources] == ["c1//Pod/ns/change"]
        assert list(answer.removed_resources) == ["c1//Pod/ns/gone"]
        assert find(state, "10.0.0.5") is not None
        assert find(state, "10.0.0.16") is not None and find(state, "10.0.0.6") is None
        assert find(state, "10.0.0.7") is None
        assert client.terminations[StreamEnd.ERROR] == 1
        assert client.session.known[ADDRESS] == {"c1//Pod/ns/keep": "v1", "c1//Pod/ns/change": "v2"}


async def test_token_file_is_read_again_for_each_stream(fake: FakeAds, tmp_path: Path) -> None:
    token = tmp_path / "istio-token"
    token.write_text("first")
    async with running(fake, {"AUTH_TOKEN": str(token)}) as (client, _state):
        await ready(client)
        token.write_text("second")
        await fake.restart(graceful=True)
        await fake.wait_for(lambda: len(fake.streams) == 2)
        assert [s.metadata["authorization"] for s in fake.streams] == ["Bearer first", "Bearer second"]
        assert fake.streams[0].metadata["clusterid"] == "Kubernetes"
        # A graceful server stop ends the stream cleanly or, depending on timing inside grpc,
        # with UNAVAILABLE "Cancelling all calls": either way exactly one stream ended.
        assert client.terminations[StreamEnd.COMPLETE] + client.terminations[StreamEnd.ERROR] == 1


async def test_on_demand_lookup_answered_through_an_alias(fake: FakeAds) -> None:
    fake.put(ADDRESS, wl_resource("od", "10.0.0.8"), echo_service())
    env = {"XDS_ON_DEMAND": "true", "ISTIO_META_DNS_CAPTURE": "false"}
    async with running(fake, env) as (client, state):
        await ready(client)  # Authorization alone makes an on-demand client ready
        assert len(state.workloads) == 0
        assert await client.on_demand("/10.0.0.8") is True
        assert find(state, "10.0.0.8").uid == "c1//Pod/ns/od"
        lookup = next(
            r for r in fake.streams[0].requests if list(r.resource_names_subscribe) == ["/10.0.0.8"]
        )
        assert not lookup.HasField("node") and lookup.response_nonce == ""
        # Not found: istiod answers with a removal of the key, which also releases the waiter.
        assert await client.on_demand("/10.0.0.99") is True
        assert find(state, "10.0.0.99") is None
        assert client.session.pending == {}


async def test_tls_with_alt_hostname_and_backoff_on_untrusted_server(tmp_path: Path) -> None:
    ca = CertificateAuthority.self_signed("cluster.local")
    root = tmp_path / "root-cert.pem"
    root.write_bytes(ca.root_pem)
    fake = FakeAds(tls=server_certificate(ca, ["istiod.istio-system.svc"]))
    await fake.start()
    try:
        fake.put(ADDRESS, wl_resource("tls", "10.0.0.9"))
        env = {"XDS_ROOT_CA": str(root), "ALT_XDS_HOSTNAME": "istiod.istio-system.svc"}
        async with running(fake, env) as (client, state):
            await ready(client)
            assert find(state, "10.0.0.9") is not None
        # A root that did not sign the server's certificate: no stream, growing backoff.
        other = tmp_path / "other-root.pem"
        other.write_bytes(CertificateAuthority.self_signed("elsewhere").root_pem)
        delays: list[float] = []
        enough = asyncio.Event()

        async def sleep(seconds: float) -> None:
            delays.append(seconds)
            if len(delays) >= 3:
                enough.set()
            await asyncio.sleep(0)

        env = {"XDS_ROOT_CA": str(other), "ALT_XDS_HOSTNAME": "istiod.istio-system.svc"}
        async with running(fake, env, sleep=sleep) as (client, _state):
            await asyncio.wait_for(enough.wait(), 10)
            assert delays[:3] == pytest.approx([0.02, 0.04, 0.08])
            assert not client.ready.is_set() and client.terminations[StreamEnd.CONNECTION_ERROR] >= 3
            assert "disconnected" in repr(client)
    finally:
        await fake.stop()
