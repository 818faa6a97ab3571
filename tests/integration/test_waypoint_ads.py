"""The delta ADS server serving a waypoint's Envoy and a ztunnel side by side, over real gRPC on
loopback: each gets its own types, and a change is pushed to a waypoint only when it touches it."""

from __future__ import annotations

import asyncio

import grpc
from envoy.config.core.v3 import base_pb2
from google.protobuf import struct_pb2

from ambient_mesh.control.ads import AdsServer
from ambient_mesh.control.ads_state import (
    CLUSTER_TYPE_URL,
    ENDPOINT_TYPE_URL,
    LISTENER_TYPE_URL,
    ROUTE_TYPE_URL,
)
from ambient_mesh.control.translate import AmbientIndex, MeshSettings
from ambient_mesh.control.waypoint_index import WaypointIndex
from ambient_mesh.kube.load import load_directory
from ambient_mesh.wire import ADDRESS_TYPE_URL
from tests.helpers.ads import Proxy, ads_server, channel, names, node
from tests.helpers.paths import UNIT_GOLDEN

GOLDEN = UNIT_GOLDEN / "waypoint_envoy" / "echo" / "input"
ECHO_CLUSTER = "inbound-vip|80|http|echo.default.svc.cluster.local"


def waypoint_node() -> base_pb2.Node:
    metadata = struct_pb2.Struct()
    metadata.update(
        {"NAMESPACE": "default", "LABELS": {"gateway.networking.k8s.io/gateway-name": "waypoint"}}
    )
    return base_pb2.Node(
        id="waypoint~10.0.0.100~waypoint-0.default~default.svc.cluster.local", metadata=metadata
    )


async def test_waypoint_and_ztunnel_on_one_server():
    loaded = load_directory(GOLDEN)
    ambient = AmbientIndex(MeshSettings())
    ads = AdsServer(waypoints=WaypointIndex())
    delta = ambient.update(loaded.store)
    ads.apply(addresses=delta.addresses, removed_addresses=delta.removed_addresses)
    async with ads_server(ads) as port, channel(port) as ch:
        envoy = Proxy(ch)
        envoy.send(type_url=CLUSTER_TYPE_URL, node=waypoint_node())
        cds = await envoy.recv()
        assert ECHO_CLUSTER in names(cds)
        await envoy.ack(cds)
        envoy.send(
            type_url=ENDPOINT_TYPE_URL,
            resource_names_subscribe=[n for n in names(cds) if n.startswith("inbound-vip")],
        )
        eds = await envoy.recv()
        await envoy.ack(eds)
        envoy.send(type_url=LISTENER_TYPE_URL)
        lds = await envoy.recv()
        assert sorted(names(lds)) == [
            "connect_originate",
            "connect_terminate",
            "main_internal",
            "main_internal_sniffed",
        ]
        await envoy.ack(lds)
        # connect_terminate's routes, which the listener names, by name.
        envoy.send(type_url=ROUTE_TYPE_URL, resource_names_subscribe=["connect_terminate"])
        rds = await envoy.recv()
        assert names(rds) == ["connect_terminate"]
        await envoy.ack(rds)
        ztunnel = Proxy(ch)
        ztunnel.send(type_url=ADDRESS_TYPE_URL, node=node("ztunnel-a"))
        wds = await ztunnel.recv()
        assert any(n.endswith("echo.default.svc.cluster.local") for n in names(wds))
        await ztunnel.ack(wds)
        info = {c.node_id.split("~")[0]: c for c in ads.connections()}
        assert info["waypoint"].identity == "" and {t.type_url for t in info["waypoint"].types} == {
            CLUSTER_TYPE_URL,
            ENDPOINT_TYPE_URL,
            LISTENER_TYPE_URL,
            ROUTE_TYPE_URL,
        }
        # Removing the Gateway's services' label: the echo cluster is removed from the waypoint.
        echo_key = "default/echo.default.svc.cluster.local"
        service = delta.addresses[echo_key]
        unlabelled = type(service)()
        unlabelled.CopyFrom(service)
        unlabelled.service.ClearField("waypoint")
        ads.apply(addresses={echo_key: unlabelled})
        # Make before break: the listener stops naming echo first, then its endpoints and
        # cluster go.
        lds2, eds2, cds2 = await envoy.recv(), await envoy.recv(), await envoy.recv()
        assert (lds2.type_url, names(lds2)) == (LISTENER_TYPE_URL, ["main_internal"])
        assert (eds2.type_url, list(eds2.removed_resources)) == (ENDPOINT_TYPE_URL, [ECHO_CLUSTER])
        assert (cds2.type_url, list(cds2.removed_resources)) == (CLUSTER_TYPE_URL, [ECHO_CLUSTER])
        assert not cds2.resources
        assert (await ztunnel.recv()).type_url == ADDRESS_TYPE_URL
        # A change that touches no waypoint reaches ztunnel only.
        other_key = "default/other.default.svc.cluster.local"
        other = type(service)()
        other.CopyFrom(delta.addresses[other_key])
        other.service.name = "other"
        other.service.subject_alt_names.append("spiffe://cluster.local/ns/default/sa/x")
        ads.apply(addresses={other_key: other})
        assert (await ztunnel.recv()).type_url == ADDRESS_TYPE_URL
        try:
            extra = await asyncio.wait_for(envoy.call.read(), 0.3)
        except TimeoutError:
            extra = None
        assert extra is None, extra


async def test_waypoint_is_refused_by_a_server_without_generator():
    async with ads_server(AdsServer()) as port, channel(port) as ch:
        envoy = Proxy(ch)
        envoy.send(type_url=CLUSTER_TYPE_URL, node=waypoint_node())
        try:
            await envoy.recv()
        except grpc.aio.AioRpcError as e:
            assert e.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "generates no Envoy configuration" in e.details()
        else:
            raise AssertionError("a waypoint was served without a generator")
