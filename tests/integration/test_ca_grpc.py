"""Certificates over real gRPC on loopback: GrpcCaClient against CaServer, over TLS.

The server listens on 127.0.0.1:0 with a serving certificate from grpc_tls; node proxies and
workloads authenticate with tokens from TokenIssuer; the node index is a fake that says which
identities run on which node.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from ambient_mesh.config import AuthKind, AuthToken, ProxyMode, RootCert, RootCertKind, ZtunnelConfig
from ambient_mesh.control.ca_server import BoundPod, CaServer
from ambient_mesh.control.tokens import TokenIssuer
from ambient_mesh.errors import CertificateError, IdentityError
from ambient_mesh.identity import CertificateAuthority, Identity, SecretManager
from ambient_mesh.identity.caclient import GrpcCaClient
from ambient_mesh.identity.certificate import load_pem_certificates, spiffe_ids
from ambient_mesh.identity.grpc_tls import channel_credentials, server_credentials, serving_certificate
from ambient_mesh.wire.istio.v1.auth import ca_pb2, ca_pb2_grpc

TD = "cluster.local"
APP = Identity(TD, "ns1", "app")
DB = Identity(TD, "ns2", "db")
ZTUNNEL_POD = ("istio-system", "ztunnel-a", "uid-a")


@dataclass
class FakeNodeIndex:
    nodes: dict[str, set[Identity]] = field(default_factory=dict)
    pods: set[tuple[str, str, str]] = field(default_factory=set)  # (namespace, name, uid) on node-1

    def identities_on_node(self, node: str) -> set[Identity]:
        return set(self.nodes.get(node, set()))

    def bound_pod(self, namespace: str, name: str) -> BoundPod | None:
        for ns, pod, uid in self.pods:
            if (ns, pod) == (namespace, name):
                return BoundPod(uid=uid, service_account="ztunnel", node_name="node-1")
        return None


@dataclass
class ControlPlane:
    ca: CertificateAuthority
    issuer: TokenIssuer
    server: CaServer
    port: int
    tmp: Path

    def config(self, token: str, **changes: object) -> ZtunnelConfig:
        """A node proxy's config: CA at our port, our root, the token in a file."""
        token_file = self.tmp / "istio-token"
        token_file.write_text(token)
        base = ZtunnelConfig(
            ca_address=f"https://127.0.0.1:{self.port}",
            ca_root_ca=RootCert(kind=RootCertKind.STATIC, value=self.ca.root_pem.decode()),
            auth_token=AuthToken(kind=AuthKind.TOKEN_FILE, value=str(token_file)),
            secret_ttl_s=3600.0,
        )
        return replace(base, **changes)  # type: ignore[arg-type]

    def ztunnel_token(self, **changes: str) -> str:
        args = dict(
            namespace="istio-system",
            service_account="ztunnel",
            pod_name="ztunnel-a",
            pod_uid="uid-a",
            node="node-1",
        )
        args.update(changes)
        return self.issuer.mint(**args, now=datetime.now(UTC).timestamp())  # type: ignore[arg-type]

    def workload_token(self, identity: Identity) -> str:
        return self.issuer.mint(
            namespace=identity.namespace,
            service_account=identity.service_account,
            now=datetime.now(UTC).timestamp(),
        )


@pytest.fixture
async def control_plane(tmp_path: Path) -> AsyncIterator[ControlPlane]:
    now = datetime.now(UTC)
    ca = CertificateAuthority.self_signed(TD, now=now - timedelta(minutes=1))
    issuer = TokenIssuer.generate()
    node_index = FakeNodeIndex(nodes={"node-1": {APP}, "node-2": {DB}}, pods={ZTUNNEL_POD})
    ca_server = CaServer(ca, issuer.verifier(), trust_domain=TD, node_index=node_index)
    server = grpc.aio.server()
    ca_server.register(server)
    serving = serving_certificate(ca, ["istiod.istio-system.svc", "localhost"], ["127.0.0.1"], 3600, now)
    port = server.add_secure_port("127.0.0.1:0", server_credentials(serving))
    await server.start()
    try:
        yield ControlPlane(ca=ca, issuer=issuer, server=ca_server, port=port, tmp=tmp_path)
    finally:
        await server.stop(None)


@pytest.fixture
async def clients() -> AsyncIterator[list[GrpcCaClient]]:
    """Every client a test makes, closed at the end."""
    made: list[GrpcCaClient] = []
    yield made
    for client in made:
        await client.close()


def client_for(clients: list[GrpcCaClient], config: ZtunnelConfig, *, shared: bool) -> GrpcCaClient:
    client = GrpcCaClient(config, shared_mode=shared)
    clients.append(client)
    return client


def assert_chains_to(root_pem: bytes, cert_chain: tuple[bytes, ...], roots_pem: bytes) -> None:
    root = load_pem_certificates(root_pem)[0]
    leaf = x509.load_pem_x509_certificate(cert_chain[0])
    leaf.verify_directly_issued_by(root)  # raises if not
    assert load_pem_certificates(roots_pem) == [root]


async def test_dedicated_mode_gets_its_own_certificate(
    control_plane: ControlPlane, clients: list[GrpcCaClient]
) -> None:
    config = control_plane.config(control_plane.workload_token(APP), proxy_mode=ProxyMode.DEDICATED)
    client = client_for(clients, config, shared=False)
    cert = await client.fetch_certificate(APP)
    assert cert.identity == APP
    assert cert.not_after - cert.not_before == timedelta(seconds=3600)
    assert_chains_to(control_plane.ca.root_pem, cert.chain_pem, cert.roots_pem)
    assert (
        repr(client) == f"GrpcCaClient(https://127.0.0.1:{control_plane.port}, dedicated, 1 issued, 0 failed)"
    )
    assert control_plane.server.issued == 1


async def test_dedicated_mode_cannot_get_someone_elses_certificate(
    control_plane: ControlPlane, clients: list[GrpcCaClient]
) -> None:
    # Without impersonation the CA signs the caller's identity, whatever is asked for; the
    # client notices the leaf names someone else.
    client = client_for(clients, control_plane.config(control_plane.workload_token(APP)), shared=False)
    with pytest.raises(CertificateError, match=f"CA issued a certificate for {APP}, but {DB} was requested"):
        await client.fetch_certificate(DB)
    assert "1 failed" in repr(client)


async def test_shared_mode_node_proxy_gets_certificates_for_workloads_on_its_node(
    control_plane: ControlPlane, clients: list[GrpcCaClient]
) -> None:
    client = client_for(clients, control_plane.config(control_plane.ztunnel_token()), shared=True)
    cert = await client.fetch_certificate(APP)
    leaf = x509.load_pem_x509_certificate(cert.leaf_pem)
    assert spiffe_ids(leaf.public_bytes(serialization.Encoding.DER)) == [APP]
    assert_chains_to(control_plane.ca.root_pem, cert.chain_pem, cert.roots_pem)


async def test_shared_mode_identity_not_on_the_node_is_refused_with_the_reason(
    control_plane: ControlPlane, clients: list[GrpcCaClient]
) -> None:
    client = client_for(clients, control_plane.config(control_plane.ztunnel_token()), shared=True)
    with pytest.raises(IdentityError) as info:
        await client.fetch_certificate(DB)
    message = str(info.value)
    assert "UNAUTHENTICATED: request impersonation authentication failure: " in message
    assert f"no workload running as {DB} on node 'node-1'" in message
    assert "is the token valid" in message  # the hint
    assert control_plane.server.refused == 1 and control_plane.server.issued == 0


async def test_shared_mode_from_a_stale_pod_is_refused(
    control_plane: ControlPlane, clients: list[GrpcCaClient]
) -> None:
    client = client_for(
        clients, control_plane.config(control_plane.ztunnel_token(pod_uid="uid-old")), shared=True
    )
    with pytest.raises(
        IdentityError, match="pod istio-system/ztunnel-a found, but its UID uid-a is not the token.s uid-old"
    ):
        await client.fetch_certificate(APP)


async def test_bad_tokens_are_refused(control_plane: ControlPlane, clients: list[GrpcCaClient]) -> None:
    stranger = TokenIssuer.generate().mint(
        namespace="ns1", service_account="app", now=datetime.now(UTC).timestamp()
    )
    client = client_for(clients, control_plane.config(stranger), shared=False)
    with pytest.raises(IdentityError, match="UNAUTHENTICATED: request authenticate failure: .*another key"):
        await client.fetch_certificate(APP)

    garbled = client_for(clients, control_plane.config("not-a-jwt"), shared=False)
    with pytest.raises(IdentityError, match="UNAUTHENTICATED: request authenticate failure: .*not a JWS"):
        await garbled.fetch_certificate(APP)

    none = control_plane.config("", auth_token=AuthToken(kind=AuthKind.NONE))
    with pytest.raises(
        IdentityError, match="UNAUTHENTICATED: request authenticate failure: no authorization header"
    ):
        await client_for(clients, none, shared=False).fetch_certificate(APP)


async def test_unknown_cluster_is_refused(control_plane: ControlPlane, clients: list[GrpcCaClient]) -> None:
    config = control_plane.config(control_plane.workload_token(APP), cluster_id="east")
    with pytest.raises(IdentityError, match="unknown cluster 'east'"):
        await client_for(clients, config, shared=False).fetch_certificate(APP)


async def test_token_file_is_read_again_on_every_call(
    control_plane: ControlPlane, clients: list[GrpcCaClient]
) -> None:
    config = control_plane.config(control_plane.workload_token(APP))
    client = client_for(clients, config, shared=False)
    assert (await client.fetch_certificate(APP)).identity == APP
    # The kubelet rotates the token: here the new one names another account, so only a
    # client that re-reads the file gets DB's certificate.
    Path(config.auth_token.value).write_text(control_plane.workload_token(DB) + "\n")
    assert (await client.fetch_certificate(DB)).identity == DB
    Path(config.auth_token.value).unlink()
    with pytest.raises(IdentityError, match="cannot read the service-account token"):
        await client.fetch_certificate(DB)


async def test_alt_ca_hostname_and_ca_headers_and_static_token(
    control_plane: ControlPlane, clients: list[GrpcCaClient]
) -> None:
    seen: list[dict[str, str]] = []

    class Recorder(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation, details):  # noqa: ANN001, ANN201
            seen.append({k: v for k, v in details.invocation_metadata if isinstance(v, str)})
            return await continuation(details)

    server = grpc.aio.server(interceptors=[Recorder()])
    control_plane.server.register(server)
    serving = serving_certificate(control_plane.ca, ["istiod.istio-system.svc"], [], 3600, datetime.now(UTC))
    port = server.add_secure_port("127.0.0.1:0", server_credentials(serving))
    await server.start()
    try:
        token = control_plane.workload_token(APP)
        # The certificate has no 127.0.0.1 SAN: only the ALT_CA_HOSTNAME check can pass.
        config = control_plane.config(
            "",
            ca_address=f"https://127.0.0.1:{port}",
            alt_ca_hostname="istiod.istio-system.svc",
            auth_token=AuthToken(kind=AuthKind.STATIC, value=token),
            ca_headers={"x-tenant": "blue"},
            cluster_id="Kubernetes",
        )
        assert (await client_for(clients, config, shared=False).fetch_certificate(APP)).identity == APP
        assert seen[-1]["authorization"] == f"Bearer {token}"
        assert seen[-1]["clusterid"] == "Kubernetes"
        assert seen[-1]["x-tenant"] == "blue"

        without_alt = replace(config, alt_ca_hostname=None)
        with pytest.raises(IdentityError, match="UNAVAILABLE"):
            await client_for(clients, without_alt, shared=False).fetch_certificate(APP)
    finally:
        await server.stop(None)


async def test_wrong_root_is_refused_and_a_rotated_root_file_is_picked_up(
    control_plane: ControlPlane, clients: list[GrpcCaClient]
) -> None:
    root_file = control_plane.tmp / "root-cert.pem"
    other_root = CertificateAuthority.self_signed(TD).root_pem
    root_file.write_bytes(other_root)
    config = control_plane.config(
        control_plane.workload_token(APP), ca_root_ca=RootCert(kind=RootCertKind.FILE, value=str(root_file))
    )
    client = client_for(clients, config, shared=False)
    with pytest.raises(IdentityError, match="UNAVAILABLE"):
        await client.fetch_certificate(APP)
    root_file.write_bytes(control_plane.ca.root_pem)
    assert (await client.fetch_certificate(APP)).identity == APP


async def test_plaintext_http_address_for_tests(clients: list[GrpcCaClient], tmp_path: Path) -> None:
    ca = CertificateAuthority.insecure_test_ca()
    issuer = TokenIssuer.generate()
    ca_server = CaServer(ca, issuer.verifier(), trust_domain=TD, node_index=FakeNodeIndex())
    server = grpc.aio.server()
    ca_server.register(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        token = issuer.mint(namespace="ns1", service_account="app", now=datetime.now(UTC).timestamp())
        config = ZtunnelConfig(
            ca_address=f"http://127.0.0.1:{port}", auth_token=AuthToken(kind=AuthKind.STATIC, value=token)
        )
        assert (await client_for(clients, config, shared=False).fetch_certificate(APP)).identity == APP
    finally:
        await server.stop(None)


class BlockingSleep:
    """SecretManager's sleep: records the delay and waits until cancelled (no real waiting)."""

    def __init__(self) -> None:
        self.delays: list[float] = []
        self.called = asyncio.Event()

    async def __call__(self, delay_s: float) -> None:
        self.delays.append(delay_s)
        self.called.set()
        await asyncio.Event().wait()


async def test_secret_manager_end_to_end_with_a_ten_second_certificate(
    control_plane: ControlPlane, clients: list[GrpcCaClient]
) -> None:
    config = control_plane.config(control_plane.ztunnel_token(), secret_ttl_s=10.0)
    client = client_for(clients, config, shared=True)
    clock_at = datetime.now(UTC).timestamp()
    sleep = BlockingSleep()
    manager = SecretManager(client, clock=lambda: clock_at, sleep=sleep)
    try:
        cert = await manager.fetch_certificate(APP)
        assert cert.identity == APP
        assert cert.not_after - cert.not_before == timedelta(seconds=10)
        assert cert.refresh_at == cert.not_before + timedelta(seconds=5)
        await sleep.called.wait()
        # The refresh is scheduled at half life, measured from the (frozen) clock.
        expected = (cert.refresh_at - datetime.fromtimestamp(clock_at, UTC)).total_seconds()
        assert sleep.delays == [pytest.approx(max(0.0, expected))]
        assert 3.0 <= sleep.delays[0] <= 5.5
        assert repr(manager) == "SecretManager(1 certificates: 1 available, 0 pending)"
    finally:
        await manager.close()


async def test_garbled_csr_is_invalid_argument(control_plane: ControlPlane) -> None:
    token = control_plane.workload_token(APP)
    async with grpc.aio.secure_channel(
        f"127.0.0.1:{control_plane.port}", channel_credentials(control_plane.ca.root_pem)
    ) as channel:
        stub = ca_pb2_grpc.IstioCertificateServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.CreateCertificate(
                ca_pb2.IstioCertificateRequest(csr="not a csr"),
                metadata=[("authorization", f"Bearer {token}")],
            )
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "CSR signing error" in (info.value.details() or "")
    assert repr(control_plane.server) == (
        "CaServer(trust domain 'cluster.local', cluster 'Kubernetes', 0 issued, 1 refused)"
    )
