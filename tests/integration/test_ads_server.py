"""The delta ADS server over real gRPC on loopback, driven by a raw client built on the xds-protos stubs, the
way ztunnel talks to istiod (docs/istio-behaviour.md, "Delta xDS")."""

from __future__ import annotations

import asyncio
import ipaddress
from datetime import UTC, datetime, timedelta

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.rpc import status_pb2

from ambient_mesh.control.ads import AdsServer, Authenticated, Unauthenticated
from ambient_mesh.identity.ca import CertificateAuthority
from ambient_mesh.wire.istio.security import authorization_pb2
from ambient_mesh.wire.istio.workload import workload_pb2
from tests.helpers.ads import AUTH, STEP_S, A, Proxy, ads_server, channel, names, node


def pod(name: str, ip: str, *, rev: str = "v1") -> tuple[str, workload_pb2.Address]:
    uid = f"Kubernetes//Pod/default/{name}"
    return uid, workload_pb2.Address(
        workload=workload_pb2.Workload(
            uid=uid,
            name=name,
            namespace="default",
            addresses=[ipaddress.ip_address(ip).packed],
            canonical_revision=rev,
        )
    )


def policy(name: str) -> tuple[str, authorization_pb2.Authorization]:
    return f"default/{name}", authorization_pb2.Authorization(
        name=name, namespace="default", scope=authorization_pb2.NAMESPACE, action=authorization_pb2.ALLOW
    )


async def settle(ads: AdsServer, predicate) -> None:
    """Wait until the server has processed what the client sent (ACKs carry no answer)."""
    for _ in range(500):
        if predicate(ads.connections()):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"server never reached the expected state: {ads.connections()}")


def initial_world() -> tuple[dict, dict]:
    return dict([pod("a", "10.0.0.1"), pod("b", "10.0.0.2")]), dict([policy("allow")])


async def test_two_proxies_get_only_the_changed_resource():
    ads = AdsServer()
    addresses, policies = initial_world()
    ads.update(addresses, policies)
    async with ads_server(ads) as port, channel(port) as ch:
        p1, p2 = Proxy(ch), Proxy(ch)
        for proxy, name in ((p1, "z1"), (p2, "z2")):
            addr, auth = await proxy.start(name)
            assert names(addr) == ["Kubernetes//Pod/default/a", "Kubernetes//Pod/default/b"]
            assert names(auth) == ["default/allow"]
        await settle(ads, lambda cs: len(cs) == 2 and all(t.acks == 1 for c in cs for t in c.types))

        addresses.update([pod("b", "10.0.0.2", rev="v2")])
        assert ads.update(addresses, policies) == 2
        for proxy in (p1, p2):
            push = await proxy.recv()
            assert push.type_url == A and names(push) == ["Kubernetes//Pod/default/b"]
            assert list(push.removed_resources) == []
            await proxy.ack(push)
        await settle(ads, lambda cs: all(c.types[0].acks == 2 for c in cs))

        by_node = {c.node_name: c for c in ads.connections()}
        assert set(by_node) == {"z1-node", "z2-node"}
        z1 = by_node["z1-node"]
        assert z1.node_id == "ztunnel~10.0.0.9~z1.istio-system~istio-system.svc.cluster.local"
        assert [(t.resources_sent, t.resources_acked) for t in z1.types] == [(3, 3), (1, 1)]
        assert z1.to_dict()["types"][0]["type"] == "Address"
        assert repr(ads) == "AdsServer(2 connections, Snapshot(v2: 2 Address, 1 Authorization))"
        p1.requests.put_nowait(None)
        p2.requests.put_nowait(None)
        await settle(ads, lambda cs: cs == ())


async def test_reconnect_with_initial_resource_versions_gets_only_changes_and_removals():
    ads = AdsServer()
    addresses, policies = initial_world()
    ads.update(addresses, policies)
    async with ads_server(ads) as port, channel(port) as ch:
        first = Proxy(ch)
        addr, _ = await first.start("z1")
        held = {r.name: r.version for r in addr.resources}
        first.call.cancel()
        await settle(ads, lambda cs: cs == ())

        # While the proxy is away: a changes, b goes, c arrives.
        addresses = dict([pod("a", "10.0.0.1", rev="v2"), pod("c", "10.0.0.3")])
        ads.update(addresses, policies)
        again = Proxy(ch)
        known = {**held, "Kubernetes//Pod/default/c": ads.snapshot.of(A)["Kubernetes//Pod/default/c"].version}
        addr, auth = await again.start("z1", known=known)
        assert names(addr) == ["Kubernetes//Pod/default/a"]
        assert list(addr.removed_resources) == ["Kubernetes//Pod/default/b"]
        assert names(auth) == ["default/allow"]
        again.requests.put_nowait(None)


async def test_nack_is_not_answered_and_is_shown():
    ads = AdsServer()
    addresses, policies = initial_world()
    ads.update(addresses, policies)
    async with ads_server(ads) as port, channel(port) as ch:
        proxy = Proxy(ch)
        await proxy.start("z1")
        addresses.update([pod("d", "10.0.0.4")])
        ads.update(addresses, policies)
        push = await proxy.recv()
        proxy.send(
            type_url=A,
            response_nonce=push.nonce,
            error_detail=status_pb2.Status(message="Kubernetes//Pod/default/d: rejected"),
        )
        await settle(ads, lambda cs: cs[0].types[0].nacks == 1)
        (conn,) = ads.connections()
        assert conn.types[0].last_error == "Kubernetes//Pod/default/d: rejected"
        assert conn.types[0].resources_nacked == 1
        # No answer to the NACK: the next thing on the stream is the next real push.
        ads.update(addresses, dict([policy("allow"), policy("extra")]))
        nxt = await proxy.recv()
        assert nxt.type_url == AUTH and names(nxt) == ["default/extra"]
        proxy.requests.put_nowait(None)


async def test_on_demand_lookup_over_the_wire():
    ads = AdsServer()
    addresses, policies = initial_world()
    ads.update(addresses, policies)
    async with ads_server(ads) as port, channel(port) as ch:
        proxy = Proxy(ch)
        proxy.send(
            type_url=A, node=node("z1"), resource_names_subscribe=["*"], resource_names_unsubscribe=["*"]
        )
        empty = await proxy.recv()
        assert list(empty.resources) == []
        await proxy.ack(empty)
        proxy.send(type_url=A, resource_names_subscribe=["/10.0.0.2", "/10.9.9.9"])
        found = await proxy.recv()
        assert names(found) == ["Kubernetes//Pod/default/b"]
        assert list(found.resources[0].aliases) == ["/10.0.0.2"]
        assert list(found.removed_resources) == ["/10.9.9.9"]
        proxy.requests.put_nowait(None)


async def test_sidecar_is_refused_with_invalid_argument():
    ads = AdsServer()
    async with ads_server(ads) as port, channel(port) as ch:
        proxy = Proxy(ch)
        proxy.send(
            type_url=A, node=base_pb2.Node(id="sidecar~10.0.0.1~app.default~default.svc.cluster.local")
        )
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await proxy.recv()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "serves only ztunnel" in e.value.details()


async def test_state_of_the_world_is_unimplemented():
    ads = AdsServer()
    async with ads_server(ads) as port, channel(port) as ch:
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(ch).StreamAggregatedResources(
            iter([discovery_pb2.DiscoveryRequest(type_url=A)])
        )
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.wait_for(call.read(), STEP_S)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_authenticator_refuses_and_checks_the_namespace():
    seen: list[dict] = []

    async def authenticate(metadata):
        seen.append(dict(metadata))
        if metadata.get("authorization") != "Bearer good-token":
            return Unauthenticated(reason="missing or invalid bearer token")
        return Authenticated(identities=("spiffe://cluster.local/ns/istio-system/sa/ztunnel",))

    ads = AdsServer(authenticate=authenticate)
    ads.update(*initial_world())
    async with ads_server(ads) as port, channel(port) as ch:
        # Nothing sent: the server refuses the stream on its metadata before reading, and a
        # request written while it aborts can fail on the client as INTERNAL instead.
        anonymous = Proxy(ch)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await anonymous.recv()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "bearer token" in e.value.details()

        wrong_ns = Proxy(ch, metadata=(("authorization", "Bearer good-token"),))
        wrong_ns.send(type_url=A, node=node("z1", namespace="default"))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await wrong_ns.recv()
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED

        good = Proxy(ch, metadata=(("authorization", "Bearer good-token"), ("clusterid", "Kubernetes")))
        await good.start("z1")
        (conn,) = ads.connections()
        assert conn.identity == "spiffe://cluster.local/ns/istio-system/sa/ztunnel"
        assert seen[-1]["clusterid"] == "Kubernetes"
        good.requests.put_nowait(None)


def serving_cert(ca: CertificateAuthority, host: str) -> tuple[bytes, bytes]:
    """istiod's serving certificate: a DNS SAN, signed by the mesh root."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([]))
        .issuer_name(ca.signing_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=1))
        .not_valid_after(now + timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=True)
        .sign(ca.signing_key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


async def test_over_tls_with_the_mesh_root():
    ca = CertificateAuthority.self_signed("cluster.local")
    key_pem, cert_pem = serving_cert(ca, "istiod.istio-system.svc")
    server_creds = grpc.ssl_server_credentials([(key_pem, cert_pem)])
    client_creds = grpc.ssl_channel_credentials(root_certificates=ca.root_pem)
    ads = AdsServer()
    ads.update(*initial_world())
    # ztunnel verifies istiod's name; ALT_XDS_HOSTNAME-style override onto the loopback target.
    options = (("grpc.ssl_target_name_override", "istiod.istio-system.svc"),)
    async with ads_server(ads, credentials=server_creds) as port, channel(port, client_creds, options) as ch:
        proxy = Proxy(ch)
        addr, auth = await proxy.start("z1")
        assert len(addr.resources) == 2 and len(auth.resources) == 1
        proxy.requests.put_nowait(None)

    untrusted = CertificateAuthority.self_signed("cluster.local")
    bad_creds = grpc.ssl_channel_credentials(root_certificates=untrusted.root_pem)
    async with ads_server(ads, credentials=server_creds) as port, channel(port, bad_creds, options) as ch:
        proxy = Proxy(ch)
        proxy.send(type_url=A, node=node("z1"))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await proxy.recv()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
