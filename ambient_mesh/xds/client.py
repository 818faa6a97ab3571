"""The node proxy's delta ADS client: one gRPC stream to istiod at a time, reconnecting forever.

Counterpart: ztunnel src/xds/client.rs (`AdsClient::run`, `run_loop`, `run_internal`) and the
channel setup of src/tls/control.rs. Facts: docs/istio-behaviour.md, "Delta xDS"
(transport, call metadata, limits, reconnect).

This is the thin asyncio shell around `XdsSession`: it opens `DeltaAggregatedResources`, writes
the session's initial requests, then loops read -> decode (session) -> apply (updater) -> wake
on-demand waiters -> write the ACK/NACK -> read again. When a stream ends it waits as
`reconnect_delay` says and starts another; the session keeps what was accepted, so nothing is
lost and the new stream resumes with `initial_resource_versions`. Given the node proxy's
`Metrics`, it counts what ztunnel's src/xds/metrics.rs counts: every response by type URL (and
its resources' payload bytes) and every stream end by reason (`TERMINATION_REASON`).

Deliberate differences from ztunnel: a failure to set up the channel (unreadable root cert or
token file) backs off like a connection failure instead of retrying at once; grpc-core's own
spelling of a GOAWAY ("GOAWAY received") counts as benign next to grpc-go's; and TLS 1.3-only
cannot be enforced through grpcio's channel credentials (grpc-core negotiates 1.2 or 1.3).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import urlsplit

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc
from envoy.service.discovery.v3.discovery_pb2 import DeltaDiscoveryRequest, DeltaDiscoveryResponse

from ..config import AuthKind, AuthToken, RootCert, RootCertKind, ZtunnelConfig
from ..errors import AmbientError, ConfigError
from ..metrics import (
    TERMINATION_COMPLETE,
    TERMINATION_CONNECTION_ERROR,
    TERMINATION_ERROR,
    TERMINATION_RECONNECT,
    Metrics,
    XdsMetrics,
)
from .session import (
    INITIAL_BACKOFF_S,
    MAX_RECEIVE_BYTES,
    Push,
    StreamEnd,
    XdsSession,
    reconnect_delay,
)
from .updater import StateUpdater

log = logging.getLogger("ambient_mesh.xds")
# One delta ADS stream: requests out, responses in.
AdsCall = grpc.aio.StreamStreamCall[DeltaDiscoveryRequest, DeltaDiscoveryResponse]

KEEPALIVE_TIME_S = 30.0
KEEPALIVE_TIMEOUT_S = 10.0
ON_DEMAND_TIMEOUT_S = 5.0

# Statuses that mean "istiod is rotating this connection" (max connection age, shutdown):
# reconnect after the initial 10 ms without growing the backoff (docs/istio-behaviour.md, "Delta xDS").
_BENIGN_CODES = frozenset(
    {grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED}
)
_BENIGN_UNAVAILABLE = ("transport is closing", "received prior goaway", "goaway received")

# istio_xds_connection_terminations_total{reason}. ztunnel has no reason of its own for a
# failure on its side mid-stream (a request it could not send): it counts that as Error.
TERMINATION_REASON: dict[StreamEnd, str] = {
    StreamEnd.CONNECTION_ERROR: TERMINATION_CONNECTION_ERROR,
    StreamEnd.RECONNECT: TERMINATION_RECONNECT,
    StreamEnd.ERROR: TERMINATION_ERROR,
    StreamEnd.LOCAL_ERROR: TERMINATION_ERROR,
    StreamEnd.COMPLETE: TERMINATION_COMPLETE,
}

ChannelFactory = Callable[[], grpc.aio.Channel]
TokenReader = Callable[[], str | None]
Sleep = Callable[[float], Awaitable[None]]


def classify_status(code: grpc.StatusCode, details: str | None) -> StreamEnd:
    """How a gRPC status ends a stream, for the backoff (ztunnel's `run_loop`)."""
    if code in _BENIGN_CODES:
        return StreamEnd.RECONNECT
    text = (details or "").lower()
    if code == grpc.StatusCode.UNAVAILABLE and any(s in text for s in _BENIGN_UNAVAILABLE):
        return StreamEnd.RECONNECT
    return StreamEnd.ERROR


def resource_bytes(response: DeltaDiscoveryResponse) -> int:
    """What istio_xds_message_bytes_total adds for a response: its resources' payload bytes."""
    return sum(len(r.resource.value) for r in response.resources if r.HasField("resource"))


def read_token(auth: AuthToken) -> str | None:
    """The bearer token for this call: a token file is read again every time (rotation)."""
    match auth.kind:
        case AuthKind.NONE:
            return None
        case AuthKind.STATIC:
            return auth.value
        case AuthKind.TOKEN_FILE:
            try:
                return Path(auth.value).read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(
                    "AUTH_TOKEN",
                    f"cannot read token file {auth.value!r}: {e}",
                    hint="is the projected service-account token mounted?",
                ) from None
    raise AssertionError(auth.kind)


def _root_certificates(root: RootCert) -> bytes | None:
    match root.kind:
        case RootCertKind.SYSTEM:
            return None  # grpc-core falls back to the system trust store
        case RootCertKind.STATIC:
            return root.value.encode()
        case RootCertKind.FILE:
            try:
                return Path(root.value).read_bytes()
            except OSError as e:
                raise ConfigError(
                    "XDS_ROOT_CA",
                    f"cannot read root certificate {root.value!r}: {e}",
                    hint="is the istio-ca-root-cert ConfigMap mounted?",
                ) from None
    raise AssertionError(root.kind)


def grpc_target(address: str) -> tuple[str, bool]:
    """`host:port` for gRPC and whether to use TLS, from an XDS_ADDRESS URL."""
    parts = urlsplit(address)
    secure = parts.scheme == "https"
    host = parts.hostname or ""
    port = parts.port or (443 if secure else 80)
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{port}", secure


def channel_options(config: ZtunnelConfig) -> list[tuple[str, object]]:
    options: list[tuple[str, object]] = [
        ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
        ("grpc.keepalive_time_ms", int(KEEPALIVE_TIME_S * 1000)),
        ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
        # A quiet ADS stream is the normal case; pings must keep flowing without data.
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
    ]
    if config.alt_xds_hostname:
        options.append(("grpc.ssl_target_name_override", config.alt_xds_hostname))
    return options


def make_channel(config: ZtunnelConfig) -> grpc.aio.Channel:
    """A fresh channel to XDS_ADDRESS: TLS verified against XDS_ROOT_CA for https://,
    plaintext for http:// (tests and embedded setups)."""
    if not config.xds_address:
        raise ConfigError("XDS_ADDRESS", "no xDS address configured")
    target, secure = grpc_target(config.xds_address)
    options = channel_options(config)
    if not secure:
        return grpc.aio.insecure_channel(target, options=options)
    credentials = grpc.ssl_channel_credentials(root_certificates=_root_certificates(config.xds_root_ca))
    return grpc.aio.secure_channel(target, credentials, options=options)


class XdsClient:
    """Keeps one delta ADS stream to the control plane and feeds its pushes to the updater."""

    def __init__(
        self,
        config: ZtunnelConfig,
        updater: StateUpdater,
        *,
        session: XdsSession | None = None,
        channel_factory: ChannelFactory | None = None,
        token_reader: TokenReader | None = None,
        sleep: Sleep = asyncio.sleep,
        on_ready: Callable[[], None] | None = None,
        metrics: Metrics | None = None,
        on_push: Callable[[DeltaDiscoveryResponse, Push], None] | None = None,
    ) -> None:
        self.config = config
        self.updater = updater
        self.session = session or XdsSession.from_config(config)
        self._channel_factory = channel_factory or (lambda: make_channel(config))
        self._token_reader = token_reader or (lambda: read_token(config.auth_token))
        self._sleep = sleep
        self._on_ready = on_ready
        # After each applied push: the worker owner forwards what was accepted to its workers.
        self._on_push = on_push
        self._metrics: XdsMetrics | None = metrics.xds if metrics is not None else None
        self.ready = asyncio.Event()
        self._call: AdsCall | None = None
        self._write_lock = asyncio.Lock()
        self._waiters: dict[str, asyncio.Future[bool]] = {}
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.streams = 0
        self.pushes = 0
        self.terminations: collections.Counter[StreamEnd] = collections.Counter()
        self.last_error: str | None = None

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> asyncio.Task[None]:
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name="xds client")
        return self._task

    async def close(self) -> None:
        """Stop the run loop, end the stream and release on-demand waiters (with False)."""
        self._closing = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_result(False)
        self._waiters.clear()

    async def run(self) -> None:
        """Connect, serve the stream, and reconnect with ztunnel's backoff until closed."""
        backoff = INITIAL_BACKOFF_S
        while not self._closing:
            end, detail = await self._stream_once()
            if self._closing:
                return
            self.terminations[end] += 1
            if self._metrics is not None:
                self._metrics.connection_terminated(TERMINATION_REASON[end])
            self.last_error = None if end is StreamEnd.COMPLETE else detail
            delay, backoff = reconnect_delay(end, backoff)
            level = logging.DEBUG if end is StreamEnd.RECONNECT else logging.WARNING
            log.log(
                level,
                "xDS stream %d ended (%s: %s); reconnecting in %.3fs",
                self.streams,
                end.value,
                detail,
                delay,
            )
            if delay > 0:
                await self._sleep(delay)

    # -- one stream --------------------------------------------------------------------------------

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        metadata: list[tuple[str, str]] = []
        token = self._token_reader()
        if token is not None:
            metadata.append(("authorization", f"Bearer {token}"))
        metadata.append(("clusterid", self.config.cluster_id))
        metadata.extend(self.config.xds_headers.items())
        return tuple(metadata)

    async def _stream_once(self) -> tuple[StreamEnd, str]:
        self.streams += 1
        try:
            metadata = self._metadata()
            channel = self._channel_factory()
        except (AmbientError, OSError, ValueError) as e:
            return StreamEnd.CONNECTION_ERROR, f"cannot set up the channel: {e}"
        call: AdsCall | None = None
        try:
            stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
            call = stub.DeltaAggregatedResources(metadata=metadata)
            try:
                for request in self.session.initial_requests():
                    await call.write(request)
                # Like tonic, the stream counts as connected once response headers arrive.
                await call.initial_metadata()
            except grpc.aio.AioRpcError as e:
                return StreamEnd.CONNECTION_ERROR, _describe(e)
            self._call = call
            log.info("xDS stream %d established to %s", self.streams, self.config.xds_address)
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    code = await call.code()
                    if code == grpc.StatusCode.OK:
                        return StreamEnd.COMPLETE, "stream closed by the server"
                    return classify_status(code, await call.details()), f"{code.name}: {await call.details()}"
                await self._handle(call, response)
        except grpc.aio.AioRpcError as e:
            return classify_status(e.code(), e.details()), _describe(e)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the crash barrier of one stream: log and reconnect
            log.exception("xDS stream %d failed", self.streams)
            return StreamEnd.LOCAL_ERROR, repr(e)
        finally:
            self._call = None
            if call is not None:
                call.cancel()
            await channel.close()

    async def _handle(self, call: AdsCall, response: DeltaDiscoveryResponse) -> None:
        if self._metrics is not None:
            # Before handling, as ztunnel does: responses of unknown types and NACKed ones count too.
            self._metrics.message_received(response.type_url, resource_bytes(response))
        outcome = self.session.handle_response(response)
        push = outcome.push
        self.pushes += 1
        if not push.known_type:
            log.error("xDS response of unknown type %r: ACKed and ignored", push.type_url)
        else:
            summary = self.updater.apply_push(push)
            log.info("xDS push applied: %s", summary)
            if self._on_push is not None:
                self._on_push(response, push)
        # The state is updated before waiters wake, so a woken lookup finds its answer.
        for key in outcome.answered:
            waiter = self._waiters.pop(key, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(True)
        if outcome.nack:
            log.error("xDS NACK for %s: %s", push.type_url, outcome.reply.error_detail.message)
        await self._send(call, outcome.reply)
        if self.session.ready and not self.ready.is_set():
            self.ready.set()
            log.info("xDS initial state received; ready")
            if self._on_ready is not None:
                self._on_ready()

    async def _send(self, call: AdsCall, request: DeltaDiscoveryRequest) -> None:
        # One writer at a time: ACKs from the read loop and on-demand subscriptions interleave.
        async with self._write_lock:
            await call.write(request)

    # -- on demand ---------------------------------------------------------------------------------

    async def on_demand(self, key: str, *, timeout_s: float = ON_DEMAND_TIMEOUT_S) -> bool:
        """Subscribe an Address key (`network/ip`, workload uid, `namespace/hostname`) and wait
        up to `timeout_s` for the control plane's answer, found or not.

        True once a response named the key (as resource name, alias, or removal) and has been
        applied; False on timeout, after close(), or when XDS_ON_DEMAND is off (in wildcard
        mode everything is pushed anyway). The caller looks the state up afterwards.
        """
        if not self.session.on_demand or self._closing:
            return False
        waiter = self._waiters.get(key)
        if waiter is None or waiter.done():
            waiter = asyncio.get_running_loop().create_future()
            self._waiters[key] = waiter
        request = self.session.demand(key)
        call = self._call
        if request is not None and call is not None:
            try:
                await self._send(call, request)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                # The stream is ending; the key is in the session's known names, so the next
                # stream's initial request re-subscribes it.
                log.debug("on-demand request for %s not sent: stream ending", key)
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(waiter)
        except TimeoutError:
            return False

    # -- views ---------------------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._call is not None

    def __repr__(self) -> str:
        link = f"connected (stream {self.streams})" if self.connected else "disconnected"
        known = sum(len(names) for names in self.session.known.values())
        ready = "ready" if self.ready.is_set() else "not ready"
        return (
            f"<XdsClient {self.config.xds_address}: {link}, {self.pushes} pushes, "
            f"{known} resources known, {len(self.session.pending)} on-demand pending, {ready}>"
        )


def _describe(error: grpc.aio.AioRpcError) -> str:
    return f"{error.code().name}: {error.details()}"


__all__ = [
    "TERMINATION_REASON",
    "XdsClient",
    "classify_status",
    "grpc_target",
    "make_channel",
    "read_token",
    "resource_bytes",
]
