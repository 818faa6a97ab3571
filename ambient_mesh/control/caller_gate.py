"""The control plane's gRPC gate: who may send a body, and how large it may be.

Counterpart: istiod's gRPC server options (`--grpcMaxRecvMsgSize`, 4 MiB by default) and its
authenticators, which run before a CSR is looked at. gRPC reads a unary request whole before the
servicer runs, so a check inside `CreateCertificate` comes after the body was taken in. This
interceptor runs when the call's headers arrive: a call to a gated method without a caller the
`precheck` accepts gets UNAUTHENTICATED from a handler that drops the body unparsed, and a stream
is refused before its first message is read. The servicers still authenticate every call in
full; the gate only keeps unauthenticated bytes from being kept or parsed.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeAlias

import grpc

log = logging.getLogger(__name__)

# istiod's default --grpcMaxRecvMsgSize. A node proxy's requests (a CSR, xDS subscriptions and
# ACKs) are a few KiB; a larger limit only lets any caller make the control plane buffer.
MAX_RECEIVE_MESSAGE_BYTES = 4 * 1024 * 1024

CA_METHOD = "/istio.v1.auth.IstioCertificateService/CreateCertificate"
ADS_METHODS = frozenset(
    {
        "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources",
        "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources",
    }
)
GATED_METHODS = frozenset({CA_METHOD, *ADS_METHODS})

Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"  # generic in the stubs only
# Returns the reason a caller is refused, or None to let the call through to its servicer.
Precheck = Callable[[Iterable[tuple[str, Any]]], Awaitable[str | None]]


def _drop(_body: bytes) -> None:
    """A request deserializer that keeps nothing: the refused caller's body is never parsed."""
    return None


def _refusing_handler(handler: Handler, reason: str) -> Handler:
    async def refuse(_request: object, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    serializer = handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            refuse, request_deserializer=_drop, response_serializer=serializer
        )
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            refuse, request_deserializer=_drop, response_serializer=serializer
        )
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(
            refuse, request_deserializer=_drop, response_serializer=serializer
        )
    return grpc.stream_stream_rpc_method_handler(
        refuse, request_deserializer=_drop, response_serializer=serializer
    )


class CallerGate(grpc.aio.ServerInterceptor):
    """Refuses calls to `methods` whose metadata `precheck` refuses, before their body is read."""

    def __init__(self, precheck: Precheck, methods: frozenset[str] = GATED_METHODS) -> None:
        self._precheck = precheck
        self._methods = methods
        self.refused = 0

    def __repr__(self) -> str:
        return f"CallerGate({len(self._methods)} methods, {self.refused} refused)"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self._methods:
            return handler
        reason = await self._precheck(handler_call_details.invocation_metadata or ())
        if reason is None:
            return handler
        self.refused += 1
        log.warning(
            "call refused before its body was read",
            extra={"fields": {"method": handler_call_details.method, "reason": reason}},
        )
        return _refusing_handler(handler, reason)
