"""An ADS client for the control plane's server tests: the proxy's Node, a scripted Proxy
stream, the server on a loopback port and a channel to it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import struct_pb2

from ambient_mesh.control.ads import SERVER_OPTIONS, AdsServer
from ambient_mesh.wire import ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL

A, AUTH = ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL

STEP_S = 5.0  # generous bound for one response on loopback; a hang fails instead of blocking


def node(pod_name: str, namespace: str = "istio-system") -> base_pb2.Node:
    md = {
        "NAME": pod_name,
        "NAMESPACE": namespace,
        "NODE_NAME": f"{pod_name}-node",
        "CLUSTER_ID": "Kubernetes",
    }
    return base_pb2.Node(
        id=f"ztunnel~10.0.0.9~{pod_name}.{namespace}~{namespace}.svc.cluster.local",
        metadata=struct_pb2.Struct(fields={k: struct_pb2.Value(string_value=v) for k, v in md.items()}),
    )


class Proxy:
    """A bare delta ADS stream: requests go into a queue, responses are read one at a time."""

    def __init__(self, channel: grpc.aio.Channel, *, metadata=()) -> None:
        self.requests: asyncio.Queue[discovery_pb2.DeltaDiscoveryRequest | None] = asyncio.Queue()
        self.call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).DeltaAggregatedResources(
            self._requests(), metadata=metadata
        )

    async def _requests(self) -> AsyncIterator[discovery_pb2.DeltaDiscoveryRequest]:
        while (request := await self.requests.get()) is not None:
            yield request

    def send(self, **fields) -> None:
        self.requests.put_nowait(discovery_pb2.DeltaDiscoveryRequest(**fields))

    async def recv(self) -> discovery_pb2.DeltaDiscoveryResponse:
        return await asyncio.wait_for(self.call.read(), STEP_S)

    async def ack(self, response) -> None:
        self.send(type_url=response.type_url, response_nonce=response.nonce)

    async def start(self, pod_name: str, *, known=None) -> tuple:
        """ztunnel's opening: Address then Authorization, both wildcard, each ACKed."""
        self.send(type_url=A, node=node(pod_name), initial_resource_versions=known or {})
        self.send(type_url=AUTH, node=node(pod_name))
        first, second = await self.recv(), await self.recv()
        await self.ack(first)
        await self.ack(second)
        return first, second


def names(response) -> list[str]:
    return [r.name for r in response.resources]


@asynccontextmanager
async def ads_server(ads: AdsServer, *, credentials=None) -> AsyncIterator[int]:
    server = grpc.aio.server(options=SERVER_OPTIONS)
    ads.serve(server)
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    try:
        yield port
    finally:
        await server.stop(grace=None)


@asynccontextmanager
async def channel(port: int, credentials=None, options=()) -> AsyncIterator[grpc.aio.Channel]:
    target = f"127.0.0.1:{port}" if credentials is None else f"localhost:{port}"
    ch = (
        grpc.aio.insecure_channel(target)
        if credentials is None
        else grpc.aio.secure_channel(target, credentials, options=options)
    )
    try:
        yield ch
    finally:
        await ch.close()
