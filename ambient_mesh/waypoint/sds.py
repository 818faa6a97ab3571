"""SDS for the waypoint's Envoy: its certificate (`default`) and the mesh roots (`ROOTCA`).

Counterpart: pilot-agent's SDS server (security/pkg/nodeagent/sds/sdsservice.go): Envoy asks over
a unix socket for the two names the waypoint configuration uses, the agent answers with what its
CA client holds and pushes a new version on rotation. Envoy uses a new certificate for new
handshakes; connections already open keep theirs, so a rotation drops no tunnel.

`SdsStream` is one state-of-the-world stream without sockets: requests and new secret sets in,
DiscoveryResponses out (ACKs, NACKs and stale nonces answered with nothing, as the xDS protocol
has it). `SdsServer` is the gRPC shell: one queue per stream, a push fans out to every stream.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2, secret_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.secret.v3 import sds_pb2_grpc
from google.protobuf import any_pb2

from ..identity.certificate import WorkloadCertificate

log = logging.getLogger(__name__)

SECRET_TYPE_URL = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
DEFAULT_SECRET = "default"
ROOT_SECRET = "ROOTCA"
SERVED_NAMES = frozenset({DEFAULT_SECRET, ROOT_SECRET})
# Envoy opens one stream per secret it uses (two); anything beyond a handful is not Envoy.
MAX_STREAMS = 16
MAX_NAMES_PER_REQUEST = 8
MAX_REQUEST_BYTES = 64 * 1024
SDS_SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
    ("grpc.max_concurrent_streams", MAX_STREAMS),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class SecretSet:
    """The two secrets at one version (the certificate's content hash)."""

    version: str
    secrets: dict[str, secret_pb2.Secret] = field(repr=False)

    @classmethod
    def from_certificate(cls, cert: WorkloadCertificate) -> SecretSet:
        chain = b"".join(cert.chain_pem)
        default = secret_pb2.Secret(
            name=DEFAULT_SECRET,
            tls_certificate=common_pb2.TlsCertificate(
                certificate_chain=_inline(chain), private_key=_inline(cert.private_key_pem)
            ),
        )
        root = secret_pb2.Secret(
            name=ROOT_SECRET,
            validation_context=common_pb2.CertificateValidationContext(trusted_ca=_inline(cert.roots_pem)),
        )
        digest = hashlib.blake2b(chain + cert.roots_pem, digest_size=8).hexdigest()
        return cls(version=digest, secrets={DEFAULT_SECRET: default, ROOT_SECRET: root})


def _inline(data: bytes) -> base_pb2.DataSource:
    return base_pb2.DataSource(inline_bytes=data)


class SdsStream:
    """One SotW SDS stream: what it asked for, what it was last sent."""

    def __init__(self, stream_id: str) -> None:
        self.stream_id = stream_id
        self.names: tuple[str, ...] = ()
        self.version_sent = ""
        self.nonce_sent = ""
        self.acked_version = ""
        self.nacks = 0
        self._nonces = itertools.count(1)

    def __repr__(self) -> str:
        return f"SdsStream({self.stream_id}: {list(self.names)}, sent {self.version_sent or '-'}, acked {self.acked_version or '-'})"

    def receive(
        self, request: discovery_pb2.DiscoveryRequest, secrets: SecretSet | None
    ) -> list[discovery_pb2.DiscoveryResponse]:
        if request.type_url and request.type_url != SECRET_TYPE_URL:
            log.warning("SDS %s: ignoring a request for %s", self.stream_id, request.type_url)
            return []
        names = tuple(sorted(set(request.resource_names)))
        if len(names) > MAX_NAMES_PER_REQUEST:
            raise ValueError(
                f"SDS request names {len(names)} secrets; at most {MAX_NAMES_PER_REQUEST} are served"
            )
        unknown = [n for n in names if n not in SERVED_NAMES]
        if unknown:
            log.warning("SDS %s: no secret named %s (served: default, ROOTCA)", self.stream_id, unknown)
        if request.HasField("error_detail"):
            self.nacks += 1
            log.warning(
                "SDS %s: Envoy rejected version %s: %s",
                self.stream_id,
                self.version_sent,
                request.error_detail.message,
            )
            return []
        if request.response_nonce:
            if request.response_nonce != self.nonce_sent:
                return []  # stale: an answer to a response already superseded
            if names == self.names:
                self.acked_version = request.version_info
                return []
        self.names = names
        self.version_sent = ""
        return self.push(secrets)

    def push(self, secrets: SecretSet | None) -> list[discovery_pb2.DiscoveryResponse]:
        """Send the secrets this stream asked for, if they changed since it was last sent."""
        if secrets is None or not self.names or secrets.version == self.version_sent:
            return []
        resources = [
            any_pb2.Any(type_url=SECRET_TYPE_URL, value=secrets.secrets[n].SerializeToString())
            for n in self.names
            if n in secrets.secrets
        ]
        if not resources:
            return []
        self.version_sent = secrets.version
        self.nonce_sent = f"{secrets.version}-{next(self._nonces)}"
        return [
            discovery_pb2.DiscoveryResponse(
                version_info=secrets.version,
                resources=resources,
                type_url=SECRET_TYPE_URL,
                nonce=self.nonce_sent,
            )
        ]


_END = object()


# xds-protos has no type information, so the servicer base is Any to mypy.
class SdsServer(sds_pb2_grpc.SecretDiscoveryServiceServicer):  # type: ignore[misc]
    """Serves the current SecretSet to Envoy; `update` pushes a new one to every stream."""

    def __init__(self) -> None:
        self.secrets: SecretSet | None = None
        self._streams: dict[str, tuple[SdsStream, asyncio.Queue[object]]] = {}
        self._ids = itertools.count(1)
        self.pushes = 0

    def __repr__(self) -> str:
        version = self.secrets.version if self.secrets else "none yet"
        return f"SdsServer(secrets {version}, {len(self._streams)} streams, {self.pushes} pushes)"

    def streams(self) -> Sequence[SdsStream]:
        return [s for s, _ in self._streams.values()]

    def serve(self, server: grpc.aio.Server) -> None:
        sds_pb2_grpc.add_SecretDiscoveryServiceServicer_to_server(self, server)

    def update(self, secrets: SecretSet) -> None:
        if self.secrets is not None and secrets.version == self.secrets.version:
            return
        self.secrets = secrets
        self.pushes += 1
        for stream, queue in self._streams.values():
            for response in stream.push(secrets):
                queue.put_nowait(response)

    async def StreamSecrets(  # noqa: N802 - the generated servicer's method name
        self,
        request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        if len(self._streams) >= MAX_STREAMS:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"at most {MAX_STREAMS} SDS streams")
        stream = SdsStream(f"sds-{next(self._ids)}")
        # Bounded in practice: one response per push per stream, and the writer drains it.
        queue: asyncio.Queue[object] = asyncio.Queue()
        self._streams[stream.stream_id] = (stream, queue)

        async def receive() -> None:
            try:
                async for request in request_iterator:
                    for response in stream.receive(request, self.secrets):
                        queue.put_nowait(response)
            except ValueError as e:
                queue.put_nowait(e)
                return
            queue.put_nowait(_END)

        try:
            async with asyncio.TaskGroup() as tg:
                reader = tg.create_task(receive())
                while True:
                    item = await queue.get()
                    if item is _END:
                        break
                    if isinstance(item, ValueError):
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(item))
                    await context.write(item)
                reader.cancel()
        finally:
            del self._streams[stream.stream_id]

    async def DeltaSecrets(  # noqa: N802
        self, request_iterator: AsyncIterator[object], context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        # The waypoint configuration asks for SDS over state-of-the-world gRPC (`api_type: GRPC`).
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "only StreamSecrets is served")
