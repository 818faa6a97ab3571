"""The node proxy's side of delta xDS: wire conversion, stream bookkeeping, the state updater and
the gRPC client (counterpart: ztunnel src/xds.rs, src/xds/client.rs).

Layers, bottom up: `convert` (protobuf -> model, rejections), `session` (sans-IO requests,
ACK/NACK, resume, readiness, on-demand), `updater` (the one writer of ProxyState), `client`
(the grpc.aio shell).
"""

from .client import XdsClient, make_channel
from .convert import (
    ADDRESS_TYPE_URL,
    AUTHORIZATION_TYPE_URL,
    XdsRejection,
    address_from_resource,
    authorization_from_proto,
    authorization_from_resource,
    service_from_proto,
    workload_from_proto,
)
from .session import Added, Outcome, Push, Rejected, StreamEnd, XdsSession, build_node, reconnect_delay
from .updater import StateUpdater, UpdateSummary

__all__ = [
    "ADDRESS_TYPE_URL",
    "AUTHORIZATION_TYPE_URL",
    "Added",
    "Outcome",
    "Push",
    "Rejected",
    "StateUpdater",
    "StreamEnd",
    "UpdateSummary",
    "XdsClient",
    "XdsRejection",
    "XdsSession",
    "address_from_resource",
    "authorization_from_proto",
    "authorization_from_resource",
    "build_node",
    "make_channel",
    "reconnect_delay",
    "service_from_proto",
    "workload_from_proto",
]
