"""Bookkeeping of one node proxy's delta ADS session: requests out, responses in, no I/O.

Counterpart: ztunnel src/xds/client.rs (`Config::construct_initial_request`, `AdsClient`'s
`handle_stream_event` / `handle_demand_event`, `State.known_resources`) and the run loop's
backoff rules. Facts: docs/istio-behaviour.md, "Delta xDS" (node,
subscriptions, ACK and NACK, reconnect and resume).

The session outlives streams: what it accepted (name -> version per type), the on-demand keys
it still waits for and whether it is ready all carry over a reconnect. Each new stream starts
with `initial_requests()`; each response goes through `handle_response()`, which returns the
decoded `Push` for the updater, the ACK or NACK to send, and the on-demand keys it answered.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3.discovery_pb2 import DeltaDiscoveryRequest, DeltaDiscoveryResponse
from google.protobuf import json_format, struct_pb2
from google.rpc import status_pb2

from ..config import MIB, ZtunnelConfig
from ..rbac import Authorization
from ..state.model import Service, Workload
from .convert import (
    ADDRESS_TYPE_URL,
    AUTHORIZATION_TYPE_URL,
    XdsRejection,
    address_from_resource,
    authorization_from_resource,
)

# Address first, then Authorization: the order ztunnel registers its handlers in, and so the
# order of the initial requests on every stream (docs/istio-behaviour.md, "Delta xDS").
WATCHED_TYPES = (ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL)

# Node.id's last part is literally this suffix, whatever the cluster domain (docs/istio-behaviour.md,
# "Delta xDS").
NODE_ID_SUFFIX = "svc.cluster.local"

# The largest response accepted: istiod's pushes can be large; gRPC's 4 MiB default is too small.
MAX_RECEIVE_BYTES = 200 * MIB

# Reconnect backoff (docs/istio-behaviour.md, "Delta xDS", ztunnel INITIAL_BACKOFF / MAX_BACKOFF).
INITIAL_BACKOFF_S = 0.010
MAX_BACKOFF_S = 15.0

Resource = Workload | Service | Authorization
_DECODERS: dict[str, Callable[[str, bytes], Resource]] = {
    ADDRESS_TYPE_URL: address_from_resource,
    AUTHORIZATION_TYPE_URL: authorization_from_resource,
}


class Added(NamedTuple):
    name: str
    version: str
    resource: Resource


class Rejected(NamedTuple):
    name: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Push:
    """One response, decoded: what to insert, what to remove, what could not be used."""

    type_url: str
    added: tuple[Added, ...] = ()
    removed: tuple[str, ...] = ()
    rejected: tuple[Rejected, ...] = ()

    @property
    def known_type(self) -> bool:
        return self.type_url in _DECODERS


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """What handling one response decided: the push to apply, the reply to send, and which
    on-demand keys it answered (to wake their waiters once the push is applied)."""

    push: Push
    reply: DeltaDiscoveryRequest
    answered: tuple[str, ...] = ()

    @property
    def nack(self) -> bool:
        return bool(self.reply.HasField("error_detail"))


class StreamEnd(enum.Enum):
    """How a stream ended; decides the wait before the next one (docs/istio-behaviour.md, "Delta xDS")."""

    CONNECTION_ERROR = "ConnectionError"  # could not connect, or no response headers
    RECONNECT = "Reconnect"  # benign gRPC status: istiod rotating connections
    ERROR = "Error"  # any other gRPC status
    LOCAL_ERROR = "LocalError"  # our side failed mid-stream
    COMPLETE = "Complete"  # the server ended the stream cleanly


def reconnect_delay(end: StreamEnd, backoff_s: float) -> tuple[float, float]:
    """(seconds to wait before reconnecting, backoff to carry to the next failure).

    ztunnel's rules: connection failures and non-benign statuses double the backoff (capped)
    and wait that long; benign statuses wait the initial 10 ms and reset it; a clean end or a
    local error reconnects at once and resets it.
    """
    match end:
        case StreamEnd.CONNECTION_ERROR | StreamEnd.ERROR:
            doubled = min(MAX_BACKOFF_S, backoff_s * 2)
            return doubled, doubled
        case StreamEnd.RECONNECT:
            return INITIAL_BACKOFF_S, INITIAL_BACKOFF_S
        case StreamEnd.LOCAL_ERROR | StreamEnd.COMPLETE:
            return 0.0, INITIAL_BACKOFF_S
    raise AssertionError(end)


def build_node(config: ZtunnelConfig) -> base_pb2.Node:
    """`envoy.config.core.v3.Node` as ztunnel sends it: id and metadata only
    (docs/istio-behaviour.md, "Delta xDS")."""
    ip = str(config.instance_ip)
    pod_name = config.pod_name or ""
    namespace = config.pod_namespace or ""
    metadata = struct_pb2.Struct()
    fields = {
        "NAME": pod_name,
        "NAMESPACE": namespace,
        "INSTANCE_IPS": ip,
        "NODE_NAME": config.node_name or "",
    }
    # ISTIO_META_* entries come after the fixed keys and win over them, as in ztunnel.
    fields.update(config.istio_meta)
    metadata.update(fields)
    for key, value in config.istio_meta_json.items():
        json_format.ParseDict(value, metadata.fields[key])
    return base_pb2.Node(
        id=f"ztunnel~{ip}~{pod_name}.{namespace}~{namespace}.{NODE_ID_SUFFIX}", metadata=metadata
    )


class XdsSession:
    """One node proxy's delta ADS bookkeeping, kept across streams (sans-IO)."""

    def __init__(self, node: base_pb2.Node, on_demand: bool) -> None:
        self.node = node
        self.on_demand = on_demand
        # type_url -> name -> version of every resource we accepted (docs/istio-behaviour.md, "Delta xDS").
        self.known: dict[str, dict[str, str]] = {t: {} for t in WATCHED_TYPES}
        # On-demand keys asked for and not answered yet (Address type only).
        self.pending: dict[str, None] = {}
        # Types that must see one ACKed response before the proxy is ready (docs/istio-behaviour.md,
        # "Delta xDS").
        self._awaiting: dict[str, None] = {t: None for t in WATCHED_TYPES if not self._is_on_demand(t)}
        self.responses = 0
        self.nacks = 0

    @classmethod
    def from_config(cls, config: ZtunnelConfig) -> XdsSession:
        return cls(build_node(config), config.xds_on_demand)

    def _is_on_demand(self, type_url: str) -> bool:
        # Authorization is always a wildcard subscription: policies are never fetched on demand.
        return self.on_demand and type_url == ADDRESS_TYPE_URL

    @property
    def ready(self) -> bool:
        return not self._awaiting

    # -- requests ---------------------------------------------------------------------------------

    def initial_requests(self) -> list[DeltaDiscoveryRequest]:
        """The first request of each type on a new stream, carrying what we already hold."""
        requests = []
        for type_url in WATCHED_TYPES:
            request = DeltaDiscoveryRequest(type_url=type_url, initial_resource_versions=self.known[type_url])
            request.node.CopyFrom(self.node)
            if self._is_on_demand(type_url):
                # xDS cannot say "subscribe to nothing"; subscribing and unsubscribing the
                # wildcard in one message does (docs/istio-behaviour.md, "Delta xDS").
                request.resource_names_subscribe.append("*")
                request.resource_names_unsubscribe.append("*")
            requests.append(request)
        return requests

    def demand(self, key: str) -> DeltaDiscoveryRequest | None:
        """Ask for one Address by key (`network/ip`, workload uid or `namespace/hostname`).

        Returns the request to send, or None when the key is already being waited for. The key is remembered
        with an empty version, so a reconnect re-subscribes it (docs/istio-behaviour.md, "Delta xDS").
        """
        if not self.on_demand:
            raise ValueError("on-demand lookups need XDS_ON_DEMAND=true")
        if key in self.pending:
            return None
        self.pending[key] = None
        self.known[ADDRESS_TYPE_URL].setdefault(key, "")
        return DeltaDiscoveryRequest(type_url=ADDRESS_TYPE_URL, resource_names_subscribe=[key])

    # -- responses --------------------------------------------------------------------------------

    def handle_response(self, response: DeltaDiscoveryResponse) -> Outcome:
        """Decode a response into a Push and decide the ACK or NACK."""
        self.responses += 1
        type_url = response.type_url
        decode = _DECODERS.get(type_url)
        reply = DeltaDiscoveryRequest(type_url=type_url, response_nonce=response.nonce)
        if decode is None:
            # ztunnel ACKs a type it did not ask for (and logs it); the caller logs.
            return Outcome(push=Push(type_url=type_url), reply=reply)
        known = self.known[type_url]
        added: list[Added] = []
        rejected: list[Rejected] = []
        answered: dict[str, None] = {}
        for raw in response.resources:
            self._answer(answered, raw.name, raw.aliases)
            if not raw.HasField("resource"):
                rejected.append(Rejected(raw.name, "XDS payload without resource"))
                known.pop(raw.name, None)
                continue
            try:
                resource = decode(raw.name, raw.resource.value)
            except XdsRejection as e:
                rejected.append(Rejected(raw.name, e.reason))
                # Not remembered, so that a reconnect asks for it again (docs/istio-behaviour.md,
                # "Delta xDS").
                known.pop(raw.name, None)
                continue
            added.append(Added(raw.name, raw.version, resource))
            known[raw.name] = raw.version
        removed = tuple(response.removed_resources)
        for name in removed:
            known.pop(name, None)
            self._answer(answered, name, ())
        if rejected:
            self.nacks += 1
            reply.error_detail.CopyFrom(
                status_pb2.Status(message="; ".join(f"{r.name}: {r.reason}" for r in rejected))
            )
        else:
            self._awaiting.pop(type_url, None)
        push = Push(type_url=type_url, added=tuple(added), removed=removed, rejected=tuple(rejected))
        return Outcome(push=push, reply=reply, answered=tuple(answered))

    def _answer(self, answered: dict[str, None], name: str, aliases: Iterable[str]) -> None:
        # ztunnel releases a waiter only on an exact name; istiod names the answer by its
        # primary name and lists the requested key among the aliases, so we look there too.
        for key in (name, *aliases):
            if key in self.pending:
                del self.pending[key]
                answered[key] = None

    def __repr__(self) -> str:
        mode = "on-demand" if self.on_demand else "wildcard"
        counts = ", ".join(f"{len(self.known[t])} {t.rsplit('.', 1)[-1]}" for t in WATCHED_TYPES)
        state = (
            "ready"
            if self.ready
            else "waiting for " + ", ".join(t.rsplit(".", 1)[-1] for t in self._awaiting)
        )
        return (
            f"<XdsSession {mode}: {counts} known, {len(self.pending)} pending on-demand, "
            f"{self.responses} responses ({self.nacks} NACKed), {state}>"
        )


__all__ = [
    "INITIAL_BACKOFF_S",
    "MAX_BACKOFF_S",
    "WATCHED_TYPES",
    "Added",
    "Outcome",
    "Push",
    "Rejected",
    "StreamEnd",
    "XdsSession",
    "build_node",
    "reconnect_delay",
]
