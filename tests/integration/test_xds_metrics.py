"""istio_xds_* metrics of a real XdsClient against the fake ADS server on loopback, read back from
Metrics.render() and from the stats server's /metrics, with exact values.

The client's reconnect sleep is a gate the test opens, so each stream end is observed on its own
before the next stream starts: no timing in the assertions.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
from prometheus_client.parser import text_string_to_metric_families

from ambient_mesh.admin import StatsServer
from ambient_mesh.config import ZtunnelConfig
from ambient_mesh.metrics import Metrics
from ambient_mesh.net import SocketAddr, ip_address
from ambient_mesh.state.store import ProxyState
from ambient_mesh.wire.istio.workload import workload_pb2 as W
from ambient_mesh.xds.client import XdsClient
from ambient_mesh.xds.updater import StateUpdater

from .fake_ads import ADDRESS, AUTHORIZATION, FakeAds, Response, authorization, raw_resource, resource

WAIT_S = 10.0
UNKNOWN_TYPE = "type.googleapis.com/example.Unknown"
ABORT_NONCE = "abort-unavailable"


class AbortingAds(FakeAds):
    """FakeAds that can end the newest stream with grpc-go's status for a rotated connection."""

    async def DeltaAggregatedResources(self, request_iterator, context):  # noqa: N802 - gRPC's name
        async for response in super().DeltaAggregatedResources(request_iterator, context):
            if response.nonce == ABORT_NONCE:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "transport is closing")
            yield response

    def abort_newest(self) -> None:
        self.streams[-1].outbox.put_nowait(Response(nonce=ABORT_NONCE))

    def end_newest_cleanly(self) -> None:
        self.streams[-1].outbox.put_nowait(None)


class Gate:
    """The client's reconnect sleep: records each wait and holds it until the test opens it."""

    def __init__(self) -> None:
        self.delays: asyncio.Queue[float] = asyncio.Queue()
        self._permits = asyncio.Semaphore(0)

    async def __call__(self, seconds: float) -> None:
        self.delays.put_nowait(seconds)
        await self._permits.acquire()

    async def reached(self) -> float:
        return await asyncio.wait_for(self.delays.get(), WAIT_S)

    def open(self) -> None:
        self._permits.release()


def wl(name: str, ip: str, version: str = "v1"):
    workload = W.Workload(
        uid=f"c1//Pod/ns/{name}", name=name, namespace="ns", addresses=[ip_address(ip).packed]
    )
    return resource(f"c1//Pod/ns/{name}", workload, version=version, aliases=[f"/{ip}"])


def terminations(metrics: Metrics) -> dict[str, float]:
    body, _ = metrics.render()
    for family in text_string_to_metric_families(body.decode()):
        if family.name == "istio_xds_connection_terminations":
            return {s.labels["reason"]: s.value for s in family.samples}
    raise AssertionError("istio_xds_connection_terminations is not served")


def by_url(metrics: Metrics, name: str) -> dict[str, float]:
    body, _ = metrics.render()
    for family in text_string_to_metric_families(body.decode()):
        if family.name == name:
            return {s.labels["url"]: s.value for s in family.samples}
    raise AssertionError(f"{name} is not served")


def payload_bytes(fake: FakeAds) -> dict[str, float]:
    """What the server sent, per type: the sum of the resources' payload sizes."""
    sent: dict[str, float] = {}
    for stream in fake.streams:
        for response in stream.responses:
            if response.nonce != ABORT_NONCE:
                sent[response.type_url] = sent.get(response.type_url, 0) + sum(
                    len(r.resource.value) for r in response.resources
                )
    return sent


async def scrape(stats: StatsServer) -> str:
    addr = stats.bound_address
    reader, writer = await asyncio.open_connection(str(addr.ip), addr.port)
    try:
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), WAIT_S)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    return body.decode()


async def test_terminations_messages_and_bytes_across_stream_ends() -> None:
    fake = AbortingAds()
    await fake.start()
    metrics = Metrics(process_metrics=False)
    stats = StatsServer(SocketAddr.of("127.0.0.1", 0), metrics)
    await stats.start()
    gate = Gate()
    config = ZtunnelConfig.from_env(
        {"XDS_ADDRESS": fake.address, "POD_NAME": "ztunnel-1", "POD_NAMESPACE": "istio-system"},
        ipv6_disabled_on_lo=lambda: False,
    )
    client = XdsClient(config, StateUpdater(ProxyState()), sleep=gate, metrics=metrics)
    try:
        fake.put(ADDRESS, wl("a", "10.0.0.1"), wl("b", "10.0.0.2"))
        fake.put(AUTHORIZATION, authorization("allow-all"))
        client.start()
        await asyncio.wait_for(client.ready.wait(), WAIT_S)
        first = fake.streams[0]
        await fake.wait_for(lambda: len(first.requests) == 4)  # both initial responses ACKed
        assert by_url(metrics, "istio_xds_message") == {ADDRESS: 1, AUTHORIZATION: 1}
        initial_bytes = payload_bytes(fake)
        assert initial_bytes[ADDRESS] > 0 and initial_bytes[AUTHORIZATION] > 0
        assert by_url(metrics, "istio_xds_message_bytes") == initial_bytes
        assert terminations(metrics) == {}

        # A push, a removal, a partly undecodable push (NACKed) and a type nobody asked for:
        # every response counts, before it is handled.
        for nonce in (
            await fake.push(ADDRESS, [wl("c", "10.0.0.3")]),
            await fake.push(ADDRESS, removed=["c1//Pod/ns/b"]),
            await fake.push(ADDRESS, [raw_resource("c1//Pod/ns/bad", b"\xff\xff\xff")]),
            await fake.push(UNKNOWN_TYPE, [raw_resource("u", b"0123456789")]),
        ):
            await fake.wait_reply(nonce)
        assert by_url(metrics, "istio_xds_message") == {ADDRESS: 4, AUTHORIZATION: 1, UNKNOWN_TYPE: 1}
        pushed = len(wl("c", "10.0.0.3").resource.value) + 3
        assert by_url(metrics, "istio_xds_message_bytes") == {
            ADDRESS: initial_bytes[ADDRESS] + pushed,
            AUTHORIZATION: initial_bytes[AUTHORIZATION],
            UNKNOWN_TYPE: 10,
        }

        # The server ends the stream with OK: Complete, and a reconnect without waiting.
        fake.end_newest_cleanly()
        await fake.wait_for(lambda: len(fake.streams) == 2 and len(fake.streams[1].requests) == 4)
        assert terminations(metrics) == {"Complete": 1}

        # grpc-go's "transport is closing": istiod rotating the connection.
        fake.abort_newest()
        assert await gate.reached() == 0.010
        assert terminations(metrics) == {"Complete": 1, "Reconnect": 1}
        gate.open()
        await fake.wait_for(lambda: len(fake.streams) == 3 and len(fake.streams[2].requests) == 4)

        # The server dies: the stream fails (Error), then connecting fails (ConnectionError).
        await fake.stop()
        await gate.reached()
        assert terminations(metrics) == {"Complete": 1, "Reconnect": 1, "Error": 1}
        gate.open()
        await gate.reached()
        assert terminations(metrics) == {"Complete": 1, "Reconnect": 1, "Error": 1, "ConnectionError": 1}

        # Back again: the new stream resumes; its initial responses count as messages too.
        await fake.start(fake.port)
        gate.open()
        await fake.wait_for(lambda: len(fake.streams) == 4 and len(fake.streams[3].requests) == 4)
        # Streams 2-4 each got one (empty: nothing changed) initial response per type.
        assert by_url(metrics, "istio_xds_message") == {ADDRESS: 7, AUTHORIZATION: 4, UNKNOWN_TYPE: 1}
        assert by_url(metrics, "istio_xds_message_bytes") == payload_bytes(fake)
        assert repr(metrics.xds) == (
            f"<XdsMetrics: 12 messages ({int(sum(payload_bytes(fake).values()))} B), 4 stream terminations>"
        )

        # The same numbers on the stats port (15020 in production).
        text = await scrape(stats)
        for reason in ("ConnectionError", "Reconnect", "Error", "Complete"):
            assert f'istio_xds_connection_terminations_total{{reason="{reason}"}} 1.0\n' in text
        assert f'istio_xds_message_total{{url="{ADDRESS}"}} 7.0\n' in text
        assert f'istio_xds_message_total{{url="{UNKNOWN_TYPE}"}} 1.0\n' in text
        assert f'istio_xds_message_bytes_total{{url="{UNKNOWN_TYPE}"}} 10.0\n' in text
    finally:
        await client.close()
        await stats.stop()
        await fake.stop()
    # Closing the client is not a stream termination.
    assert sum(terminations(metrics).values()) == 4
