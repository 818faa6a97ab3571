"""The agent's xDS proxy: Envoy's delta ADS stream, carried to the control plane over TLS.

Counterpart: pilot-agent's XDS proxy (pkg/istio-agent/xds_proxy.go): Envoy talks plaintext gRPC
to a unix socket in the pod; the agent opens the upstream stream to istiod's 15012 with TLS
verified against the mesh root and the pod's service-account token as a bearer token (re-read
for each stream, so a rotated token is used on reconnect), and copies messages both ways
unchanged. When either side ends, the other is ended too; Envoy reconnects with backoff, which
opens a fresh upstream stream. Messages are bounded both ways (`MAX_XDS_MESSAGE_BYTES`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import urlsplit

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc
from envoy.service.discovery.v3.discovery_pb2 import DeltaDiscoveryRequest, DeltaDiscoveryResponse

from ..errors import ConfigError
from ..identity.grpc_tls import channel_credentials, channel_options
from .bootstrap import MAX_XDS_MESSAGE_BYTES

log = logging.getLogger(__name__)

# Envoy opens one ADS stream; a second at once is a reconnect racing the old one's end.
MAX_DOWNSTREAM_STREAMS = 4
XDS_SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", MAX_XDS_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_XDS_MESSAGE_BYTES),
    ("grpc.max_concurrent_streams", MAX_DOWNSTREAM_STREAMS),
)


def upstream_target(address: str) -> tuple[str, bool]:
    """`https://host:port` -> (`host:port`, TLS); `http://` is plaintext (tests only)."""
    parts = urlsplit(address)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError("--xds-address", f"{address!r} is not an http(s)://host:port URL")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{parts.port or 15012}", parts.scheme == "https"


class XdsProxy(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):  # type: ignore[misc]
    """Forwards each Envoy ADS stream to the control plane, with the pod's credentials."""

    def __init__(
        self,
        address: str,
        *,
        root_pem: Callable[[], bytes | None],
        token: Callable[[], str | None],
        cluster_id: str,
        alt_hostname: str | None = None,
    ) -> None:
        self.address = address
        self._target, self._secure = upstream_target(address)
        self._root_pem = root_pem
        self._token = token
        self._cluster_id = cluster_id
        self._alt_hostname = alt_hostname
        self._channel: grpc.aio.Channel | None = None
        self._channel_root: bytes | None = None
        self.streams = 0
        self.active = 0
        self.requests = 0
        self.responses = 0
        self.last_error = ""

    def __repr__(self) -> str:
        return (
            f"XdsProxy({self.address}: {self.active} active of {self.streams} streams, "
            f"{self.requests} requests up, {self.responses} responses down)"
        )

    def serve(self, server: grpc.aio.Server) -> None:
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(self, server)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    def _channel_now(self) -> grpc.aio.Channel:
        options = [
            *channel_options(self._alt_hostname),
            ("grpc.max_send_message_length", MAX_XDS_MESSAGE_BYTES),
        ]
        options = [o for o in options if o[0] != "grpc.max_receive_message_length"]
        options.append(("grpc.max_receive_message_length", MAX_XDS_MESSAGE_BYTES))
        if not self._secure:
            if self._channel is None:
                self._channel = grpc.aio.insecure_channel(self._target, options=options)
            return self._channel
        root = self._root_pem()
        if self._channel is None or root != self._channel_root:
            # A new root (the mesh's roots rotated): dial with it from now on.
            self._channel = grpc.aio.secure_channel(self._target, channel_credentials(root), options=options)
            self._channel_root = root
        return self._channel

    def _metadata(self) -> list[tuple[str, str]]:
        metadata = [("clusterid", self._cluster_id)]
        token = self._token()
        if token:
            metadata.append(("authorization", f"Bearer {token}"))
        return metadata

    async def StreamAggregatedResources(  # noqa: N802
        self, request_iterator: AsyncIterator[object], context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the waypoint bootstrap asks for delta ADS")

    async def DeltaAggregatedResources(  # noqa: N802
        self,
        request_iterator: AsyncIterator[DeltaDiscoveryRequest],
        context: grpc.aio.ServicerContext[DeltaDiscoveryRequest, DeltaDiscoveryResponse],
    ) -> None:
        self.streams += 1
        self.active += 1
        try:
            stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(self._channel_now())
            upstream = stub.DeltaAggregatedResources(metadata=self._metadata())
            log.info("xDS: Envoy stream %d opened to %s", self.streams, self.address)

            async def up() -> None:
                async for request in request_iterator:
                    self.requests += 1
                    await upstream.write(request)
                await upstream.done_writing()

            async def down() -> None:
                while True:
                    response = await upstream.read()
                    if response is grpc.aio.EOF:
                        return
                    self.responses += 1
                    await context.write(response)

            failed: grpc.aio.AioRpcError | None = None
            try:
                async with asyncio.TaskGroup() as tg:
                    sender = tg.create_task(up())
                    await down()
                    sender.cancel()
            except* grpc.aio.AioRpcError as group:
                first = group.exceptions[0]
                assert isinstance(first, grpc.aio.AioRpcError)
                failed = first
            finally:
                upstream.cancel()
            if failed is not None:
                self.last_error = f"{failed.code().name}: {failed.details()}"
                log.warning("xDS: control plane %s ended the stream: %s", self.address, self.last_error)
                # Envoy sees the control plane's status and retries with backoff.
                await context.abort(failed.code(), f"control plane: {failed.details()}")
        finally:
            self.active -= 1
