"""The control plane's gRPC limits over real loopback gRPC: receive size, the caller gate, and the
CA on the TLS port only (issue 25, S4 and S5)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc
from envoy.service.discovery.v3.discovery_pb2 import DeltaDiscoveryRequest

from ambient_mesh.control.ads import AdsServer
from ambient_mesh.control.caller_gate import MAX_RECEIVE_MESSAGE_BYTES
from ambient_mesh.control.plane import ControlPlane, ControlPlaneConfig, build, mint_token
from ambient_mesh.identity.grpc_tls import channel_options
from ambient_mesh.net import SocketAddr
from ambient_mesh.wire import ADDRESS_TYPE_URL
from ambient_mesh.wire.istio.v1.auth import ca_pb2, ca_pb2_grpc
from ambient_mesh.wire.istio.workload import workload_pb2
from tests.helpers.ads import Proxy, ads_server, node
from tests.helpers.weak_keys import csr_pem

SEND_ANY = [("grpc.max_send_message_length", -1), ("grpc.ssl_target_name_override", "localhost")]
WORKLOAD_TOKEN_SA = ("ns1", "sa1")


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[ControlPlane]:
    (tmp_path / "objects").mkdir()
    config = ControlPlaneConfig(
        directory=tmp_path / "objects",
        state_dir=tmp_path / "state",
        listen=SocketAddr.parse("127.0.0.1:0"),
        plaintext_listen=SocketAddr.parse("127.0.0.1:0"),
        poll_interval_s=0.05,
    )
    p = build(config)
    await p.start()
    try:
        yield p
    finally:
        await p.stop(0)


def tls_channel(plane: ControlPlane) -> grpc.aio.Channel:
    root = (plane.config.state_dir / "root-cert.pem").read_bytes()
    return grpc.aio.secure_channel(
        str(plane.bound["tls"]), grpc.ssl_channel_credentials(root_certificates=root), options=SEND_ANY
    )


async def create_certificate(
    channel: grpc.aio.Channel, csr: str, token: str | None = None
) -> grpc.StatusCode:
    stub = ca_pb2_grpc.IstioCertificateServiceStub(channel)
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    try:
        await stub.CreateCertificate(
            ca_pb2.IstioCertificateRequest(csr=csr, validity_duration=3600), metadata=metadata, timeout=10
        )
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def workload_token(plane: ControlPlane) -> str:
    return mint_token(plane.config.state_dir, account=WORKLOAD_TOKEN_SA, node=None)


async def test_a_request_over_4_mib_is_refused_before_it_is_buffered(plane: ControlPlane) -> None:
    async with tls_channel(plane) as channel:
        big = "A" * (MAX_RECEIVE_MESSAGE_BYTES + 1)
        assert (
            await create_certificate(channel, big, workload_token(plane))
            is grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        # The same over xDS, with a valid token.
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
        call = stub.DeltaAggregatedResources(
            iter([DeltaDiscoveryRequest(type_url=big)]),
            metadata=(("authorization", f"Bearer {workload_token(plane)}"),),
            timeout=10,
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert plane.ca_server.refused == 0  # nothing reached the servicer


async def test_a_caller_without_a_valid_token_is_refused_before_the_servicer_runs(
    plane: ControlPlane,
) -> None:
    assert plane.gate is not None
    async with tls_channel(plane) as channel:
        body = "A" * (MAX_RECEIVE_MESSAGE_BYTES // 2)
        assert await create_certificate(channel, body) is grpc.StatusCode.UNAUTHENTICATED
        assert await create_certificate(channel, body, "not.a.token") is grpc.StatusCode.UNAUTHENTICATED
        assert plane.gate.refused == 2
        assert plane.ca_server.refused == 0 and plane.ca_server.issued == 0
        # A valid token reaches the servicer, which signs.
        csr = csr_pem(ec.generate_private_key(ec.SECP256R1())).decode()
        assert await create_certificate(channel, csr, workload_token(plane)) is grpc.StatusCode.OK
        assert plane.ca_server.issued == 1 and plane.gate.refused == 2
    assert "2 refused" in repr(plane.gate)


async def test_the_plaintext_port_serves_xds_but_not_the_ca(plane: ControlPlane) -> None:
    async with grpc.aio.insecure_channel(str(plane.bound["plaintext"]), options=SEND_ANY) as channel:
        csr = csr_pem(ec.generate_private_key(ec.SECP256R1())).decode()
        assert await create_certificate(channel, csr, workload_token(plane)) is grpc.StatusCode.UNIMPLEMENTED
        assert plane.ca_server.issued == 0 and plane.ca_server.refused == 0
        # xDS answers there (istiod's 15010): a subscription gets its first response.
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
        call = stub.DeltaAggregatedResources(
            metadata=(("authorization", f"Bearer {workload_token(plane)}"),), timeout=10
        )
        node = base_pb2.Node(id="ztunnel~127.0.0.9~sa1-pod.ns1~ns1.svc.cluster.local")
        await call.write(
            DeltaDiscoveryRequest(node=node, type_url="type.googleapis.com/istio.workload.Address")
        )
        response = await call.read()
        assert response.type_url == "type.googleapis.com/istio.workload.Address"
        call.cancel()


async def test_a_push_larger_than_the_receive_limit_still_reaches_a_node_proxy():
    """Only what the control plane receives is capped: a big mesh's push (here one 6 MiB
    resource) still goes out, and the node proxy's channel (grpc_tls.channel_options) takes it."""
    big = workload_pb2.Address(
        workload=workload_pb2.Workload(uid="Kubernetes//Pod/default/big", name="big", namespace="default")
    )
    big.workload.canonical_name = "x" * (6 * 1024 * 1024)
    ads = AdsServer()
    ads.update({"Kubernetes//Pod/default/big": big}, {})
    async with ads_server(ads) as port:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options()) as ch:
            proxy = Proxy(ch)
            proxy.send(type_url=ADDRESS_TYPE_URL, node=node("ztunnel-a"))
            response = await proxy.recv()
            assert response.ByteSize() > MAX_RECEIVE_MESSAGE_BYTES
            assert [r.name for r in response.resources] == ["Kubernetes//Pod/default/big"]
            proxy.requests.put_nowait(None)
            proxy.call.cancel()
