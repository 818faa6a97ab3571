"""The node proxy's CA client: CreateCertificate on istiod (or our control plane) over gRPC.

Counterpart: ztunnel src/identity/caclient.rs. Per request: a fresh P-256 key and CSR, the
lifetime from SECRET_TTL, `ImpersonatedIdentity` in the metadata only in shared mode (a shared
node proxy asks for the identities of the workloads it serves), and call metadata
`authorization: Bearer <token>` (the token file re-read on every call, so kubelet rotation is
picked up), `clusterid` and the CA_HEADER_* entries. The returned chain is checked before it is
used: the leaf must name the identity asked for and chain to the root the response ends with.

The channel is TLS to CA_ADDRESS verified with CA_ROOT_CA (ALT_CA_HOSTNAME overriding the name
checked); an `http://` address is plaintext, for tests. A root given as a file is re-read on
each call and the channel rebuilt when it changed (ztunnel watches the file for the same end).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import grpc
from google.protobuf import struct_pb2

from ..config import AuthKind, RootCertKind, ZtunnelConfig
from ..errors import ConfigError, IdentityError
from ..wire.istio.v1.auth import ca_pb2, ca_pb2_grpc
from .certificate import WorkloadCertificate, generate_csr
from .grpc_tls import channel_credentials, channel_options
from .spiffe import Identity

IMPERSONATED_IDENTITY = "ImpersonatedIdentity"
# A call never holds one of the SecretManager's in-flight slots forever; its backoff retries.
CA_CALL_TIMEOUT_S = 30.0


def _hint(address: str, code: grpc.StatusCode | None) -> str:
    if code is grpc.StatusCode.UNAUTHENTICATED:
        return (
            f"the CA at {address} refused our credentials: is the token valid (AUTH_TOKEN), "
            "is the cluster id right (CLUSTER_ID), and does this workload run on this node?"
        )
    return f"is the CA at {address} reachable? is the token valid? (CA_ADDRESS, CA_ROOT_CA, AUTH_TOKEN)"


class GrpcCaClient:
    """CaClient that asks a CA over gRPC (istiod's IstioCertificateService)."""

    def __init__(
        self,
        config: ZtunnelConfig,
        *,
        shared_mode: bool,
        channel: grpc.aio.Channel | None = None,
        token_reader: Callable[[], str | None] | None = None,
    ) -> None:
        if not config.ca_address:
            raise ConfigError("CA_ADDRESS", "no CA address; set CA_ADDRESS or FAKE_CA=true")
        self._config = config
        self.address = config.ca_address
        self.shared_mode = shared_mode
        self._read_token = token_reader or self._token_from_config
        parts = urlsplit(config.ca_address)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError("CA_ADDRESS", f"{config.ca_address!r} is not an http(s)://host:port URL")
        self._secure = parts.scheme == "https"
        port = parts.port or (443 if self._secure else 80)
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        self._target = f"{host}:{port}"
        self._owns_channel = channel is None
        self._channel = channel
        self._root_pem: bytes | None = None
        self._retiring: set[asyncio.Task[None]] = set()
        self.issued = 0
        self.failed = 0

    def __repr__(self) -> str:
        mode = "shared" if self.shared_mode else "dedicated"
        return f"GrpcCaClient({self.address}, {mode}, {self.issued} issued, {self.failed} failed)"

    async def fetch_certificate(self, identity: Identity) -> WorkloadCertificate:
        try:
            cert = await self._fetch(identity)
        except Exception:
            self.failed += 1
            raise
        self.issued += 1
        return cert

    async def close(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None and self._owns_channel:
            await channel.close()
        for task in list(self._retiring):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _fetch(self, identity: Identity) -> WorkloadCertificate:
        channel = self._current_channel()
        key_pem, csr_pem = generate_csr(identity)
        request = ca_pb2.IstioCertificateRequest(
            csr=csr_pem.decode(), validity_duration=int(self._config.secret_ttl_s)
        )
        if self.shared_mode:
            request.metadata.CopyFrom(
                struct_pb2.Struct(
                    fields={IMPERSONATED_IDENTITY: struct_pb2.Value(string_value=str(identity))}
                )
            )
        # grpcio-tools generates the stub without annotations.
        stub = ca_pb2_grpc.IstioCertificateServiceStub(channel)  # type: ignore[no-untyped-call]
        try:
            response = await stub.CreateCertificate(
                request, metadata=self._call_metadata(), timeout=CA_CALL_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as e:
            raise IdentityError(
                f"CA at {self.address} did not issue a certificate for {identity}: "
                f"{e.code().name}: {e.details()}",
                hint=_hint(self.address, e.code()),
            ) from e
        # CertificateError (an IdentityError) when the leaf names someone else or does not chain.
        return WorkloadCertificate.from_ca_response(identity, key_pem, list(response.cert_chain))

    def _call_metadata(self) -> list[tuple[str, str]]:
        metadata: list[tuple[str, str]] = []
        token = self._read_token()
        if token:
            metadata.append(("authorization", f"Bearer {token}"))
        metadata.append(("clusterid", self._config.cluster_id))
        metadata.extend(self._config.ca_headers.items())
        return metadata

    def _token_from_config(self) -> str | None:
        auth = self._config.auth_token
        if auth.kind is AuthKind.STATIC:
            return auth.value
        if auth.kind is AuthKind.TOKEN_FILE:
            try:
                return Path(auth.value).read_text().strip()
            except OSError as e:
                raise IdentityError(
                    f"cannot read the service-account token {auth.value}: {e.strerror or e}",
                    hint="is the projected token volume mounted? (AUTH_TOKEN)",
                ) from e
        return None

    def _roots(self) -> bytes | None:
        root = self._config.ca_root_ca
        if root.kind is RootCertKind.SYSTEM:
            return None
        if root.kind is RootCertKind.STATIC:
            return root.value.encode()
        try:
            return Path(root.value).read_bytes()
        except OSError as e:
            raise IdentityError(
                f"cannot read the CA root certificate {root.value}: {e.strerror or e}",
                hint="is the istio-ca-root-cert ConfigMap mounted? (CA_ROOT_CA)",
            ) from e

    def _current_channel(self) -> grpc.aio.Channel:
        if not self._owns_channel:
            assert self._channel is not None
            return self._channel
        if not self._secure:
            if self._channel is None:
                self._channel = grpc.aio.insecure_channel(self._target, options=channel_options())
            return self._channel
        roots = self._roots()
        if self._channel is None or roots != self._root_pem:
            old = self._channel
            self._channel = grpc.aio.secure_channel(
                self._target,
                channel_credentials(roots),
                options=channel_options(self._config.alt_ca_hostname),
            )
            self._root_pem = roots
            if old is not None:
                # Calls still running on the old channel get their own deadline to finish.
                task = asyncio.get_running_loop().create_task(old.close(grace=CA_CALL_TIMEOUT_S))
                self._retiring.add(task)
                task.add_done_callback(self._retiring.discard)
        return self._channel
