"""A fake delta-ADS server for tests: a real grpc.aio server on 127.0.0.1 that records every
request and lets the test push responses.

It answers the way istiod does where the client depends on it (docs/istio-behaviour.md, "Delta xDS"):
the first request of a type on a stream (the one with a node) gets the current resources of
that type, minus those whose version the client already reported in
`initial_resource_versions`, plus removals for reported names that no longer exist; in
on-demand mode only reported names are "subscribed". A request that subscribes names without
a nonce is an on-demand lookup: resources whose name or alias matches are sent, unknown keys
come back in `removed_resources`. ACKs and NACKs get no answer.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import any_pb2

from ambient_mesh.identity.ca import CertificateAuthority
from ambient_mesh.wire.istio.security import authorization_pb2
from ambient_mesh.wire.istio.workload import workload_pb2

ADDRESS = "type.googleapis.com/istio.workload.Address"
AUTHORIZATION = "type.googleapis.com/istio.security.Authorization"

Request = discovery_pb2.DeltaDiscoveryRequest
Response = discovery_pb2.DeltaDiscoveryResponse


def resource(
    name: str, message, *, version: str = "v1", aliases: Iterable[str] = ()
) -> discovery_pb2.Resource:
    """A `Resource` wrapping an Address, Workload/Service (wrapped into an Address) or Authorization."""
    if isinstance(message, workload_pb2.Workload):
        message = workload_pb2.Address(workload=message)
    elif isinstance(message, workload_pb2.Service):
        message = workload_pb2.Address(service=message)
    payload = any_pb2.Any()
    payload.Pack(message)
    return discovery_pb2.Resource(name=name, version=version, resource=payload, aliases=list(aliases))


def raw_resource(name: str, value: bytes, *, version: str = "v1") -> discovery_pb2.Resource:
    """A resource whose payload bytes are given as is (for undecodable payloads)."""
    return discovery_pb2.Resource(
        name=name, version=version, resource=any_pb2.Any(type_url=ADDRESS, value=value)
    )


def authorization(name: str, namespace: str = "default", **kwargs) -> discovery_pb2.Resource:
    version = kwargs.pop("version", "")
    return resource(
        f"{namespace}/{name}",
        authorization_pb2.Authorization(name=name, namespace=namespace, **kwargs),
        version=version,
    )


@dataclass(eq=False)
class FakeStream:
    """One DeltaAggregatedResources call as the server saw it."""

    number: int
    metadata: dict[str, str]
    requests: list[Request] = field(default_factory=list)
    responses: list[Response] = field(default_factory=list)
    outbox: asyncio.Queue[Response | None] = field(default_factory=asyncio.Queue)
    ended: bool = False

    def initial(self, type_url: str) -> Request | None:
        return next((r for r in self.requests if r.type_url == type_url and r.HasField("node")), None)

    def reply_to(self, nonce: str) -> Request | None:
        return next((r for r in self.requests if r.response_nonce == nonce), None)


class FakeAds(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    """The fake server. `resources[type_url][name]` is its current state of the world."""

    def __init__(self, *, tls: tuple[bytes, bytes] | None = None) -> None:
        self.tls = tls  # (certificate chain PEM, private key PEM)
        self.resources: dict[str, dict[str, discovery_pb2.Resource]] = {ADDRESS: {}, AUTHORIZATION: {}}
        self.streams: list[FakeStream] = []
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._nonces = itertools.count(1)
        self._changed = asyncio.Condition()

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self, port: int = 0) -> int:
        server = grpc.aio.server()
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(self, server)
        address = f"127.0.0.1:{port}"
        if self.tls is None:
            self.port = server.add_insecure_port(address)
        else:
            chain, key = self.tls
            self.port = server.add_secure_port(address, grpc.ssl_server_credentials([(key, chain)]))
        await server.start()
        self._server = server
        return self.port

    async def stop(self, *, graceful: bool = False) -> None:
        """Stop listening. `graceful` ends open streams with status OK first; otherwise they are
        cut off as when the server process dies."""
        server, self._server = self._server, None
        if graceful:
            for stream in self.streams:
                if not stream.ended:
                    stream.outbox.put_nowait(None)
        if server is not None:
            await server.stop(grace=None)

    async def restart(self, *, graceful: bool = False) -> None:
        """Stop (ending every stream) and listen again on the same port."""
        await self.stop(graceful=graceful)
        await self.start(self.port)

    @property
    def address(self) -> str:
        scheme = "http" if self.tls is None else "https"
        return f"{scheme}://127.0.0.1:{self.port}"

    # -- state and pushes --------------------------------------------------------------------------

    def put(self, type_url: str, *resources: discovery_pb2.Resource) -> None:
        for r in resources:
            self.resources[type_url][r.name] = r

    async def push(
        self,
        type_url: str,
        resources: Iterable[discovery_pb2.Resource] = (),
        removed: Iterable[str] = (),
        *,
        stream: FakeStream | None = None,
    ) -> str:
        """Send one response on `stream` (default: the newest); returns its nonce."""
        target = stream or self.streams[-1]
        response = Response(
            type_url=type_url,
            resources=list(resources),
            removed_resources=list(removed),
            nonce=f"nonce-{next(self._nonces)}",
        )
        target.outbox.put_nowait(response)
        return response.nonce

    async def wait_for(self, predicate: Callable[[], object], timeout: float = 5.0):
        """Wait until `predicate()` is truthy (re-checked on every request or new stream)."""
        async with self._changed:
            return await asyncio.wait_for(self._changed.wait_for(predicate), timeout)

    async def wait_reply(self, nonce: str, timeout: float = 5.0) -> Request:
        """The ACK or NACK the client sent for `nonce`."""
        return await self.wait_for(
            lambda: next((r for s in self.streams for r in s.requests if r.response_nonce == nonce), None),
            timeout,
        )

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # -- the service -------------------------------------------------------------------------------

    async def DeltaAggregatedResources(self, request_iterator, context):  # noqa: N802 - gRPC's name
        stream = FakeStream(
            number=len(self.streams) + 1, metadata={k: v for k, v in context.invocation_metadata()}
        )
        self.streams.append(stream)
        await self._notify()
        reader = asyncio.create_task(self._read(stream, request_iterator))
        try:
            while True:
                response = await stream.outbox.get()
                if response is None:
                    return
                stream.responses.append(response)
                yield response
        finally:
            stream.ended = True
            reader.cancel()

    async def _read(self, stream: FakeStream, request_iterator) -> None:
        try:
            async for request in request_iterator:
                stream.requests.append(request)
                self._answer(stream, request)
                await self._notify()
        except (asyncio.CancelledError, grpc.RpcError):
            pass

    def _answer(self, stream: FakeStream, request: Request) -> None:
        type_url = request.type_url
        current = self.resources.get(type_url)
        if current is None:
            return
        if request.HasField("node"):
            reported = dict(request.initial_resource_versions)
            wildcard = "*" not in request.resource_names_unsubscribe
            names = set(current) if wildcard else set(reported)
            send = [
                current[n] for n in sorted(names) if n in current and reported.get(n) != current[n].version
            ]
            removed = sorted(n for n in reported if n not in current)
            self._queue(stream, type_url, send, removed)
        elif request.resource_names_subscribe and not request.response_nonce:
            send, removed = [], []
            for key in request.resource_names_subscribe:
                found = [r for r in current.values() if r.name == key or key in r.aliases]
                if found:
                    send.extend(found)
                else:
                    removed.append(key)
            self._queue(stream, type_url, send, removed)

    def _queue(self, stream: FakeStream, type_url: str, send, removed) -> None:
        stream.outbox.put_nowait(
            Response(
                type_url=type_url,
                resources=send,
                removed_resources=removed,
                nonce=f"nonce-{next(self._nonces)}",
            )
        )

    def __repr__(self) -> str:
        return (
            f"<FakeAds {self.address}: {len(self.streams)} streams, "
            f"{sum(len(v) for v in self.resources.values())} resources>"
        )


def server_certificate(ca: CertificateAuthority, dns_names: list[str]) -> tuple[bytes, bytes]:
    """A TLS server certificate for `dns_names` signed by `ca`: (chain PEM, key PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, dns_names[0])]))
        .issuer_name(ca.signing_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=1))
        .not_valid_after(now + timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in dns_names]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca.signing_key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem
