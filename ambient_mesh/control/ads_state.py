"""istiod's side of delta xDS for ztunnel, without sockets: one object per connected proxy.

Counterparts: istiod pilot/pkg/xds/delta.go (request handling: first-request node, ACK/NACK, stale nonces,
subscription changes), pilot/pkg/xds/workload.go (the Address and Authorization generators: wildcard and
on-demand lookups), pilot/pkg/xds/auth.go (the caller's identity must match the proxy's namespace). Wire
rules: docs/istio-behaviour.md, "Workloads and services" and "Delta xDS".

`Snapshot` is the control plane's current view (every resource, packed, with its version and its
on-demand lookup keys). `DeltaConnectionState` is fed DeltaDiscoveryRequests (`receive`) and new
snapshots (`push`) and returns the DeltaDiscoveryResponses to send, in order. It never awaits,
sleeps or reads a clock; the gRPC shell in `ads.py` carries the responses out.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import any_pb2

from ..errors import IdentityError, ProtocolError
from ..identity.spiffe import Identity
from ..metadata import LABEL_GATEWAY_NAME
from ..wire import ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL
from ..wire.istio.security import authorization_pb2
from ..wire.istio.workload import workload_pb2

log = logging.getLogger(__name__)

# Pushes go out in this order, as ztunnel subscribes: workloads before the policies naming them.
TYPE_URLS = (ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL)
# What a waypoint's Envoy is served, in push order: clusters before the endpoints they name,
# both before the listeners and routes that send to them (Envoy's make-before-break order for
# ADS: CDS, EDS, LDS, RDS).
CLUSTER_TYPE_URL = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT_TYPE_URL = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
LISTENER_TYPE_URL = "type.googleapis.com/envoy.config.listener.v3.Listener"
ROUTE_TYPE_URL = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
ENVOY_TYPE_URLS = (CLUSTER_TYPE_URL, ENDPOINT_TYPE_URL, LISTENER_TYPE_URL, ROUTE_TYPE_URL)
SHORT_TYPE = {
    ADDRESS_TYPE_URL: "Address",
    AUTHORIZATION_TYPE_URL: "Authorization",
    CLUSTER_TYPE_URL: "Cluster",
    ENDPOINT_TYPE_URL: "ClusterLoadAssignment",
    LISTENER_TYPE_URL: "Listener",
    ROUTE_TYPE_URL: "RouteConfiguration",
}
WILDCARD = "*"

ZTUNNEL_NODE_TYPE = "ztunnel"
WAYPOINT_NODE_TYPE = "waypoint"
# istiod knows these node types; ztunnel and (when Envoy configuration is generated) waypoints
# are served here, sidecars and gateways are not.
KNOWN_NODE_TYPES = frozenset({"sidecar", "router", "ztunnel", "waypoint"})
SERVED_NODE_TYPES = frozenset({ZTUNNEL_NODE_TYPE, WAYPOINT_NODE_TYPE})

# Responses a client has not answered yet, kept only to count ACKed/NACKed resources; a client
# that never answers must not grow this without bound.
MAX_PENDING_RESPONSES = 256


class AdsRefused(ProtocolError):
    """A stream the control plane refuses; `code` names the gRPC status the shell ends it with."""

    def __init__(self, message: str, *, code: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.code = code


# ---------------------------------------------------------------------------------------------
# The proxy on the other end


@dataclass(frozen=True, slots=True, kw_only=True)
class ProxyInfo:
    """What the first request's Node says about the proxy (docs/istio-behaviour.md, "Delta xDS")."""

    node_id: str
    node_type: str
    ip_addresses: tuple[str, ...]
    proxy_id: str  # `<pod>.<namespace>`
    dns_domain: str
    pod_name: str
    namespace: str
    node_name: str
    cluster_id: str
    # For a waypoint: the Gateway it is an instance of (its pod's gateway-name label).
    gateway_name: str = ""

    @classmethod
    def from_node(cls, node: base_pb2.Node) -> ProxyInfo:
        metadata = {k: _struct_text(v) for k, v in node.metadata.fields.items()}
        labels = node.metadata.fields.get("LABELS")
        if labels is not None and labels.WhichOneof("kind") == "struct_value":
            gateway = labels.struct_value.fields.get(LABEL_GATEWAY_NAME)
            if gateway is not None:
                metadata[LABEL_GATEWAY_NAME] = _struct_text(gateway)
        return cls.parse(node.id, metadata)

    @classmethod
    def parse(cls, node_id: str, metadata: Mapping[str, str]) -> ProxyInfo:
        """Parse `ztunnel~<ip>~<pod>.<ns>~<ns>.svc.cluster.local` plus its metadata strings."""
        if not node_id:
            raise AdsRefused("missing node information", code="INVALID_ARGUMENT")
        parts = node_id.split("~")
        if len(parts) != 4:
            raise AdsRefused(
                f"node id {node_id!r} does not have four '~'-separated parts",
                code="INVALID_ARGUMENT",
                hint="expected ztunnel~<ip>~<pod>.<namespace>~<namespace>.svc.cluster.local",
            )
        node_type, ip_part, proxy_id, dns_domain = parts
        if node_type not in KNOWN_NODE_TYPES:
            raise AdsRefused(f"node id {node_id!r}: unknown node type {node_type!r}", code="INVALID_ARGUMENT")
        if node_type not in SERVED_NODE_TYPES:
            raise AdsRefused(
                f"node {node_id!r} is a {node_type}: this control plane serves only ztunnel and waypoints",
                code="INVALID_ARGUMENT",
                hint="point sidecars and gateways at istiod, not at `ambient control`",
            )
        # istiod prefers INSTANCE_IPS when every entry is an IP, else the id's second part.
        ips = tuple(ip.strip() for ip in metadata.get("INSTANCE_IPS", "").split(",") if ip.strip())
        if not ips or not all(_is_ip(ip) for ip in ips):
            ips = (ip_part,) if _is_ip(ip_part) else ()
        pod_name, _, pod_namespace = proxy_id.partition(".")
        return cls(
            node_id=node_id,
            node_type=node_type,
            ip_addresses=ips,
            proxy_id=proxy_id,
            dns_domain=dns_domain,
            pod_name=metadata.get("NAME", pod_name),
            namespace=metadata.get("NAMESPACE", pod_namespace),
            node_name=metadata.get("NODE_NAME", ""),
            cluster_id=metadata.get("CLUSTER_ID", ""),
            gateway_name=metadata.get(LABEL_GATEWAY_NAME, "") if node_type == WAYPOINT_NODE_TYPE else "",
        )


def check_connection_identity(proxy: ProxyInfo, identities: Sequence[str]) -> Identity:
    """The first caller identity whose namespace is the proxy's (istiod auth.go).

    ztunnel does not send SERVICE_ACCOUNT metadata, so only the namespace is compared.
    """
    for raw in identities:
        try:
            identity = Identity.parse(raw)
        except IdentityError:
            continue
        if proxy.namespace and identity.namespace != proxy.namespace:
            continue
        return identity
    raise AdsRefused(
        f"authorization failed: no identity in {list(identities)} matches namespace {proxy.namespace!r}",
        code="PERMISSION_DENIED",
        hint="the NAMESPACE node metadata must be the namespace of the service account token",
    )


def _struct_text(value: object) -> str:
    kind = value.WhichOneof("kind")  # type: ignore[attr-defined]
    if kind == "string_value":
        text: str = value.string_value  # type: ignore[attr-defined]
        return text
    if kind == "bool_value":
        return "true" if value.bool_value else "false"  # type: ignore[attr-defined]
    if kind == "number_value":
        return str(value.number_value)  # type: ignore[attr-defined]
    return ""


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# What the control plane currently serves


@dataclass(frozen=True, slots=True, kw_only=True)
class VersionedResource:
    name: str
    # What goes into Resource.version: a content hash for Address, empty for Authorization.
    version: str
    # Content hash of every type, so pushes can skip unchanged Authorizations too.
    digest: str
    resource: any_pb2.Any = field(repr=False, compare=False)
    # The resource's own lookup keys ("Workloads and services"), sent in Resource.aliases on on-demand
    # answers.
    aliases: tuple[str, ...] = ()
    # For a workload, the services it is an endpoint of (the keys of Workload.services), so a
    # patched snapshot can keep `Snapshot.endpoints` without unpacking the old resource.
    services: tuple[str, ...] = ()
    # The message it was packed from (`Snapshot.of_messages`): handed the very same message
    # again (a kept parse, envoy_parse_cache.py, whose messages are never changed), the next
    # snapshot keeps this entry without serializing the message again.
    source: object = field(default=None, repr=False, compare=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    """Every resource of both types at one push version, plus the on-demand lookup indexes."""

    version: str
    resources: Mapping[str, Mapping[str, VersionedResource]]  # type_url -> name -> resource
    owners: Mapping[str, tuple[str, ...]]  # alias key -> names of the Addresses carrying it
    endpoints: Mapping[str, tuple[str, ...]]  # service name -> uids of its workloads
    # Whether the aliases came from the resources themselves (`address_aliases`) rather than a
    # caller's mapping: only then does an unchanged resource keep its aliases in the next build.
    derived_aliases: bool = field(default=True, repr=False, compare=False)
    # Set by `patch`: the names per type that differ from the snapshot it was patched from, and
    # that snapshot's id(); a connection still holding that one compares only these names.
    changed: Mapping[str, frozenset[str]] | None = field(default=None, repr=False, compare=False)
    parent_id: int = field(default=0, repr=False, compare=False)

    def __repr__(self) -> str:
        counts = ", ".join(f"{len(self.of(t))} {SHORT_TYPE.get(t, t)}" for t in self.resources)
        return f"Snapshot(v{self.version}: {counts})"

    @classmethod
    def empty(cls) -> Snapshot:
        return cls(version="0", resources={t: {} for t in TYPE_URLS}, owners={}, endpoints={})

    @classmethod
    def build(
        cls,
        *,
        version: str,
        addresses: Mapping[str, workload_pb2.Address],
        authorizations: Mapping[str, authorization_pb2.Authorization],
        aliases: Mapping[str, Sequence[str]] | None = None,
        previous: Snapshot | None = None,
    ) -> Snapshot:
        """Pack and hash every resource. `aliases` (key -> names carrying it) defaults to the
        keys derived from the resources themselves (`address_aliases`).

        With `previous`, a resource whose serialized bytes (and aliases) are unchanged keeps
        the previous snapshot's entry instead of being packed and hashed again: after one pod
        changes in a mesh of 10,000, nearly every entry is reused."""
        explicit: dict[str, list[str]] | None = None
        if aliases is not None:
            explicit = {name: [] for name in addresses}
            for key, names in aliases.items():
                for name in names:
                    if name in explicit:
                        explicit[name].append(key)
        # Equal bytes mean equal content, so derived aliases can be taken over as they are.
        keep_derived = explicit is None and previous is not None and previous.derived_aliases
        before = previous.of(ADDRESS_TYPE_URL) if previous is not None else {}
        owned: dict[str, Sequence[str]] = {}
        packed_addresses: dict[str, VersionedResource] = {}
        for name, addr in addresses.items():
            data = _serialize(addr)
            unchanged = before.get(name)
            if unchanged is not None and unchanged.resource.value != data:
                unchanged = None
            keys: Sequence[str]
            if explicit is not None:
                keys = explicit[name]
            elif unchanged is not None and keep_derived:
                keys = unchanged.aliases
            else:
                keys = address_aliases(addr)
            owned[name] = keys
            sorted_keys = tuple(sorted(keys))
            if unchanged is not None and unchanged.aliases == sorted_keys:
                packed_addresses[name] = unchanged
            else:
                packed_addresses[name] = _pack_bytes(
                    name,
                    ADDRESS_TYPE_URL,
                    data,
                    versioned=True,
                    aliases=sorted_keys,
                    services=_services(addr),
                )
        before = previous.of(AUTHORIZATION_TYPE_URL) if previous is not None else {}
        packed_authorizations: dict[str, VersionedResource] = {}
        for name, policy in authorizations.items():
            data = _serialize(policy)
            unchanged = before.get(name)
            if unchanged is not None and unchanged.resource.value == data:
                packed_authorizations[name] = unchanged
            else:
                packed_authorizations[name] = _pack_bytes(
                    name, AUTHORIZATION_TYPE_URL, data, versioned=False, aliases=()
                )
        owners: dict[str, list[str]] = {}
        for name, keys in owned.items():
            for key in keys:
                owners.setdefault(key, []).append(name)
        endpoints: dict[str, list[str]] = {}
        for name, addr in addresses.items():
            if addr.WhichOneof("type") == "workload":
                for service in addr.workload.services:
                    endpoints.setdefault(service, []).append(name)
        return cls(
            version=version,
            resources={ADDRESS_TYPE_URL: packed_addresses, AUTHORIZATION_TYPE_URL: packed_authorizations},
            owners={k: tuple(sorted(v)) for k, v in owners.items()},
            endpoints={k: tuple(sorted(v)) for k, v in endpoints.items()},
            derived_aliases=explicit is None,
        )

    def patch(
        self,
        *,
        version: str,
        addresses: Mapping[str, workload_pb2.Address] = {},
        removed_addresses: Iterable[str] = (),
        authorizations: Mapping[str, authorization_pb2.Authorization] = {},
        removed_authorizations: Iterable[str] = (),
    ) -> Snapshot:
        """This snapshot with some resources replaced or removed: work in proportion to the
        change, not to the mesh (istiod's incremental push). Aliases are derived from the
        resources, so a snapshot built with explicit aliases cannot be patched."""
        if not self.derived_aliases:
            raise ValueError("a snapshot built with explicit aliases cannot be patched; build it again")
        packed = dict(self.of(ADDRESS_TYPE_URL))
        owners = dict(self.owners)
        endpoints = dict(self.endpoints)
        changed_addresses: set[str] = set()

        def unlink(entry: VersionedResource) -> None:
            for key in entry.aliases:
                _remove_from(owners, key, entry.name)
            for service in entry.services:
                _remove_from(endpoints, service, entry.name)

        for name in removed_addresses:
            entry = packed.pop(name, None)
            if entry is not None:
                unlink(entry)
                changed_addresses.add(name)
        for name, addr in addresses.items():
            data = _serialize(addr)
            entry = packed.get(name)
            if entry is not None and entry.resource.value == data:
                continue
            if entry is not None:
                unlink(entry)
            entry = _pack_bytes(
                name,
                ADDRESS_TYPE_URL,
                data,
                versioned=True,
                aliases=tuple(sorted(address_aliases(addr))),
                services=_services(addr),
            )
            packed[name] = entry
            for key in entry.aliases:
                _add_to(owners, key, name)
            for service in entry.services:
                _add_to(endpoints, service, name)
            changed_addresses.add(name)
        policies = dict(self.of(AUTHORIZATION_TYPE_URL))
        changed_authorizations: set[str] = set()
        for name in removed_authorizations:
            if policies.pop(name, None) is not None:
                changed_authorizations.add(name)
        for name, policy in authorizations.items():
            data = _serialize(policy)
            entry = policies.get(name)
            if entry is None or entry.resource.value != data:
                policies[name] = _pack_bytes(name, AUTHORIZATION_TYPE_URL, data, versioned=False, aliases=())
                changed_authorizations.add(name)
        return Snapshot(
            version=version,
            resources={ADDRESS_TYPE_URL: packed, AUTHORIZATION_TYPE_URL: policies},
            owners=owners,
            endpoints=endpoints,
            changed={
                ADDRESS_TYPE_URL: frozenset(changed_addresses),
                AUTHORIZATION_TYPE_URL: frozenset(changed_authorizations),
            },
            parent_id=id(self),
        )

    @classmethod
    def of_messages(
        cls, *, version: str, messages: Mapping[str, Mapping[str, Any]], previous: Snapshot | None = None
    ) -> Snapshot:
        """A snapshot of Envoy resources (type URL -> name -> message), all versioned by content.

        With `previous`, unchanged resources keep their packed entry and `changed` lists the
        names that differ, so a stream holding `previous` compares only those."""
        resources: dict[str, dict[str, VersionedResource]] = {}
        changed: dict[str, frozenset[str]] = {}
        for type_url, named in messages.items():
            before = previous.of(type_url) if previous is not None else {}
            packed: dict[str, VersionedResource] = {}
            for name, message in named.items():
                entry = before.get(name)
                if entry is not None and entry.source is message:
                    packed[name] = entry  # the same message object: no need to serialize it
                    continue
                data = _serialize(message)
                if entry is None or entry.resource.value != data:
                    entry = _pack_bytes(name, type_url, data, versioned=True, aliases=(), source=message)
                packed[name] = entry  # unchanged bytes keep their entry, and so its identity
            resources[type_url] = packed
            changed[type_url] = frozenset(
                n for n in set(packed) | set(before) if packed.get(n) is not before.get(n)
            )
        return cls(
            version=version,
            resources=resources,
            owners={},
            endpoints={},
            changed=changed if previous is not None else None,
            parent_id=id(previous) if previous is not None else 0,
        )

    def of(self, type_url: str) -> Mapping[str, VersionedResource]:
        return self.resources.get(type_url, {})

    def resolve(self, type_url: str, key: str) -> tuple[str, ...]:
        """Names answering an on-demand key: a primary name (workload uid, `ns/hostname`,
        policy name) or an alias (`<network>/<ip>`). A service also brings its endpoints, so
        the proxy can route to what it looked up."""
        present = self.of(type_url)
        if key in present:
            names = [key]
        elif type_url == ADDRESS_TYPE_URL:
            names = list(self.owners.get(key, ()))
        else:
            names = []
        if type_url == ADDRESS_TYPE_URL:
            for name in list(names):
                names.extend(uid for uid in self.endpoints.get(name, ()) if uid in present)
        return tuple(dict.fromkeys(names))


def address_name(address: workload_pb2.Address) -> str:
    """An Address's primary xDS name (docs/istio-behaviour.md, "Workloads and services"): workload uid, or
    `<namespace>/<hostname>`."""
    if address.WhichOneof("type") == "service":
        return f"{address.service.namespace}/{address.service.hostname}"
    return address.workload.uid


def address_aliases(address: workload_pb2.Address) -> list[str]:
    """An Address's on-demand keys (docs/istio-behaviour.md, "Workloads and services"): `<network>/<ip>`
    per workload address, and per service address `<network>/<vip>`, or `<network>/<ip>/<prefixlen>` for a
    CIDR."""
    kind = address.WhichOneof("type")
    if kind == "workload":
        wl = address.workload
        return [f"{wl.network}/{_ip_text(raw)}" for raw in wl.addresses if _ip_text(raw)]
    if kind == "service":
        keys = []
        for net in address.service.addresses:
            ip = _ip_text(net.address)
            if not ip:
                continue
            full = 32 if len(net.address) == 4 else 128
            if net.HasField("length") and net.length != full:
                keys.append(f"{net.network}/{ip}/{net.length}")
            else:
                keys.append(f"{net.network}/{ip}")
        return keys
    return []


def _services(address: workload_pb2.Address) -> tuple[str, ...]:
    if address.WhichOneof("type") != "workload":
        return ()
    return tuple(sorted(address.workload.services))


def _remove_from(index: dict[str, tuple[str, ...]], key: str, name: str) -> None:
    names = index.get(key)
    if names is None or name not in names:
        return
    rest = tuple(n for n in names if n != name)
    if rest:
        index[key] = rest
    else:
        del index[key]


def _add_to(index: dict[str, tuple[str, ...]], key: str, name: str) -> None:
    names = index.get(key, ())
    if name not in names:
        index[key] = tuple(sorted((*names, name)))


def _ip_text(raw: bytes) -> str:
    if len(raw) not in (4, 16):
        return ""
    return str(ipaddress.ip_address(raw))


def _serialize(message: Any) -> bytes:
    # Deterministic serialization keeps map order stable, so equal content hashes equal.
    data: bytes = message.SerializeToString(deterministic=True)
    return data


def _pack_bytes(
    name: str,
    type_url: str,
    data: bytes,
    *,
    versioned: bool,
    aliases: tuple[str, ...],
    services: tuple[str, ...] = (),
    source: object = None,
) -> VersionedResource:
    digest = hashlib.blake2b(data, digest_size=8).hexdigest()
    return VersionedResource(
        name=name,
        version=digest if versioned else "",
        digest=digest,
        resource=any_pb2.Any(type_url=type_url, value=data),
        aliases=aliases,
        services=services,
        source=source,
    )


# ---------------------------------------------------------------------------------------------
# One connection


class SubscriptionMode(Enum):
    WILDCARD = "wildcard"
    ON_DEMAND = "on-demand"


@dataclass(frozen=True, slots=True, kw_only=True)
class TypeStatus:
    """What one proxy has been sent of one type, for `ambient control` and /config_dump."""

    type_url: str
    mode: SubscriptionMode
    subscribed_keys: tuple[str, ...]  # on-demand keys; empty for wildcard
    resources_known: int  # names the proxy holds as far as we know
    responses_sent: int
    resources_sent: int
    removals_sent: int
    resources_acked: int
    resources_nacked: int
    acks: int
    nacks: int
    stale_nonces: int
    last_nonce_sent: str
    last_nonce_acked: str
    last_error: str


class _Subscription:
    """Bookkeeping for one type on one stream (istiod's WatchedResource)."""

    __slots__ = (
        "type_url",
        "mode",
        "keys",
        "sent",
        "pending",
        "nonce_sent",
        "nonce_acked",
        "last_error",
        "responses_sent",
        "resources_sent",
        "removals_sent",
        "resources_acked",
        "resources_nacked",
        "acks",
        "nacks",
        "stale",
    )

    def __init__(self, type_url: str, mode: SubscriptionMode) -> None:
        self.type_url = type_url
        self.mode = mode
        self.keys: set[str] = set()  # explicit on-demand lookup keys
        self.sent: dict[str, str] = {}  # name -> digest the proxy holds
        self.pending: dict[str, int] = {}  # nonce -> resources in that response
        self.nonce_sent = ""
        self.nonce_acked = ""
        self.last_error = ""
        self.responses_sent = self.resources_sent = self.removals_sent = 0
        self.resources_acked = self.resources_nacked = 0
        self.acks = self.nacks = self.stale = 0

    def status(self) -> TypeStatus:
        return TypeStatus(
            type_url=self.type_url,
            mode=self.mode,
            subscribed_keys=tuple(sorted(self.keys)),
            resources_known=len(self.sent),
            responses_sent=self.responses_sent,
            resources_sent=self.resources_sent,
            removals_sent=self.removals_sent,
            resources_acked=self.resources_acked,
            resources_nacked=self.resources_nacked,
            acks=self.acks,
            nacks=self.nacks,
            stale_nonces=self.stale,
            last_nonce_sent=self.nonce_sent,
            last_nonce_acked=self.nonce_acked,
            last_error=self.last_error,
        )


def random_nonce_prefix() -> str:
    return secrets.token_hex(4)


class DeltaConnectionState:
    """One delta ADS stream from one ztunnel: requests and snapshots in, responses out.

    `identities` are the caller's authenticated SPIFFE ids (None when the stream is not
    authenticated, as on istiod's plaintext port); they are checked against the node's
    namespace when the first request arrives.
    """

    def __init__(
        self,
        snapshot: Snapshot,
        *,
        identities: Sequence[str] | None = None,
        nonce_prefix: Callable[[], str] = random_nonce_prefix,
        waypoint_snapshot: Callable[[ProxyInfo, Identity | None], Snapshot] | None = None,
    ) -> None:
        self.snapshot = snapshot
        # ztunnel is served the mesh's Addresses; a waypoint its own Envoy resources, from
        # `waypoint_snapshot` (None: waypoints are refused).
        self.type_urls: tuple[str, ...] = TYPE_URLS
        self._waypoint_snapshot = waypoint_snapshot
        self.proxy: ProxyInfo | None = None
        self.verified_identity: Identity | None = None
        self._identities = tuple(identities) if identities is not None else None
        self._subs: dict[str, _Subscription] = {}
        self._nonce_prefix = nonce_prefix()
        self._nonce_seq = 0

    def __repr__(self) -> str:
        who = self.proxy.node_id if self.proxy else "awaiting first request"
        types = "; ".join(
            f"{SHORT_TYPE.get(t, t)}: {s.mode.value}, {len(s.sent)} held, "
            f"sent {s.resources_sent} acked {s.resources_acked} nacked {s.resources_nacked}"
            for t, s in self._subs.items()
        )
        return (
            f"DeltaConnectionState({who}, snapshot v{self.snapshot.version}{'; ' + types if types else ''})"
        )

    def status(self) -> tuple[TypeStatus, ...]:
        return tuple(sub.status() for sub in self._subs.values())

    # -- requests -------------------------------------------------------------------------------

    def receive(
        self, request: discovery_pb2.DeltaDiscoveryRequest
    ) -> list[discovery_pb2.DeltaDiscoveryResponse]:
        """Handle one request; raises AdsRefused if the stream must end."""
        if self.proxy is None:
            # istiod reads the node from the first request only; later Node fields are ignored.
            if not request.HasField("node") or not request.node.id:
                raise AdsRefused("missing node information", code="INVALID_ARGUMENT")
            proxy = ProxyInfo.from_node(request.node)
            if self._identities is not None:
                self.verified_identity = check_connection_identity(proxy, self._identities)
            if proxy.node_type == WAYPOINT_NODE_TYPE:
                if self._waypoint_snapshot is None:
                    raise AdsRefused(
                        f"node {proxy.node_id!r} is a waypoint: this server generates no Envoy configuration",
                        code="INVALID_ARGUMENT",
                    )
                self.snapshot = self._waypoint_snapshot(proxy, self.verified_identity)
                self.type_urls = ENVOY_TYPE_URLS
            self.proxy = proxy
        type_url = request.type_url
        if type_url not in self.type_urls:
            log.warning("%s: ignoring a request for unserved type %r", self.proxy.node_id, type_url)
            return []
        sub = self._subs.get(type_url)
        if sub is None:
            return self._initial(request)
        if request.HasField("error_detail"):
            # A NACK: the proxy kept what it could apply; answering would resend the same data.
            sub.nacks += 1
            sub.resources_nacked += sub.pending.pop(request.response_nonce, 0)
            sub.last_error = request.error_detail.message
            log.warning(
                "%s: NACK of %s (nonce %s): %s",
                self.proxy.node_id,
                SHORT_TYPE[type_url],
                request.response_nonce,
                request.error_detail.message,
            )
            return []
        if request.response_nonce:
            # The count is bookkeeping only; the protocol decision below ignores stale nonces.
            sub.resources_acked += sub.pending.pop(request.response_nonce, 0)
            if request.response_nonce != sub.nonce_sent:
                sub.stale += 1
                log.debug("%s: stale nonce %s for %s", self.proxy.node_id, request.response_nonce, type_url)
                return []
            sub.acks += 1
            sub.nonce_acked = request.response_nonce
            sub.last_error = ""
            if not request.resource_names_subscribe and not request.resource_names_unsubscribe:
                return []
        return self._change_subscription(sub, request)

    def _initial(
        self, request: discovery_pb2.DeltaDiscoveryRequest
    ) -> list[discovery_pb2.DeltaDiscoveryResponse]:
        type_url = request.type_url
        subscribe = set(request.resource_names_subscribe)
        unsubscribe = set(request.resource_names_unsubscribe)
        # docs/istio-behaviour.md, "Delta xDS": an empty subscribe list is wildcard; `*` is wildcard
        # unless also unsubscribed in the same message (ztunnel's on-demand "subscribed to nothing").
        wildcard = not subscribe or (WILDCARD in subscribe and WILDCARD not in unsubscribe)
        sub = _Subscription(type_url, SubscriptionMode.WILDCARD if wildcard else SubscriptionMode.ON_DEMAND)
        self._subs[type_url] = sub
        known = dict(request.initial_resource_versions)
        present = self.snapshot.of(type_url)
        if wildcard:
            wanted: Iterable[str] = present
            missing = [name for name in known if name not in present]
        else:
            # Names the proxy already holds stay subscribed, as istiod adds them to the watch.
            sub.keys = (subscribe | set(known)) - unsubscribe - {WILDCARD}
            wanted, missing = self._resolve(sub, sub.keys)
        send = []
        for name in wanted:
            res = present[name]
            # docs/istio-behaviour.md, "Delta xDS": skip what the proxy holds at the current version.
            # Authorization has no versions, so an empty version never matches and everything is re-sent.
            if res.version and known.get(name) == res.version:
                sub.sent[name] = res.digest
            else:
                send.append(name)
        # The initial request is always answered, even with nothing: ztunnel is not ready until
        # it has ACKed one response per wildcard type.
        return [self._respond(sub, send, missing, aliases=not wildcard)]

    def _change_subscription(
        self, sub: _Subscription, request: discovery_pb2.DeltaDiscoveryRequest
    ) -> list[discovery_pb2.DeltaDiscoveryResponse]:
        subscribe = [
            n for n in request.resource_names_subscribe if n not in request.resource_names_unsubscribe
        ]
        unsubscribe = set(request.resource_names_unsubscribe)
        if not subscribe and not unsubscribe:
            log.debug("%s: request without nonce or subscription change for %s", self.proxy, sub.type_url)
            return []
        if WILDCARD in unsubscribe and sub.mode is SubscriptionMode.WILDCARD:
            sub.mode = SubscriptionMode.ON_DEMAND
        if WILDCARD in subscribe and sub.mode is SubscriptionMode.ON_DEMAND:
            sub.mode = SubscriptionMode.WILDCARD
            sub.keys.clear()
            return self._nonempty(self._diff(sub, self.snapshot))
        for key in unsubscribe - {WILDCARD}:
            if key in sub.keys:
                sub.keys.discard(key)
                still = set(self._resolve(sub, sub.keys)[0])
                # The proxy drops unsubscribed names itself; we only stop tracking them.
                for name in self.snapshot.resolve(sub.type_url, key) or (key,):
                    if name not in still:
                        sub.sent.pop(name, None)
        keys = [k for k in dict.fromkeys(subscribe) if k != WILDCARD]
        if not keys:
            return []
        if sub.mode is SubscriptionMode.ON_DEMAND:
            sub.keys.update(keys)
        # An explicit lookup is always answered, found or not: ztunnel waits on exactly that name.
        found, missing = self._resolve(sub, keys)
        return [self._respond(sub, found, missing, aliases=True)]

    def _resolve(self, sub: _Subscription, keys: Iterable[str]) -> tuple[list[str], list[str]]:
        found: dict[str, None] = {}
        missing = []
        for key in sorted(keys):
            names = self.snapshot.resolve(sub.type_url, key)
            if names:
                found.update(dict.fromkeys(names))
            else:
                missing.append(key)
        return list(found), missing

    # -- pushes ---------------------------------------------------------------------------------

    def push(self, snapshot: Snapshot) -> list[discovery_pb2.DeltaDiscoveryResponse]:
        """Adopt a new snapshot; return per subscribed type only what changed for this proxy."""
        # Patched from the snapshot this stream holds: only the names it lists can differ.
        hint = snapshot.changed if snapshot.parent_id == id(self.snapshot) else None
        self.snapshot = snapshot
        changes = []
        for type_url in self.type_urls:
            sub = self._subs.get(type_url)
            if sub is not None:
                names = hint.get(type_url) if hint is not None else None
                change = self._changes(sub, snapshot, names)
                if change is not None:
                    changes.append((sub, *change))
        if self.type_urls is not ENVOY_TYPE_URLS:
            return [
                self._respond(sub, send, removed, aliases=aliases) for sub, send, removed, aliases in changes
            ]
        # Envoy, make before break: what is added or updated goes clusters, endpoints, listeners,
        # routes; what is removed goes after, in reverse, so nothing names a cluster that is gone.
        responses = [
            self._respond(sub, send, (), aliases=aliases) for sub, send, _, aliases in changes if send
        ]
        responses.extend(
            self._respond(sub, (), removed, aliases=aliases)
            for sub, _, removed, aliases in reversed(changes)
            if removed
        )
        return responses

    def _diff(
        self, sub: _Subscription, snapshot: Snapshot, changed: frozenset[str] | None = None
    ) -> discovery_pb2.DeltaDiscoveryResponse | None:
        change = self._changes(sub, snapshot, changed)
        if change is None:
            return None
        send, removed, aliases = change
        return self._respond(sub, send, removed, aliases=aliases)

    def _changes(
        self, sub: _Subscription, snapshot: Snapshot, changed: frozenset[str] | None = None
    ) -> tuple[list[str], list[str], bool] | None:
        """(names to send, names to remove, whether to send aliases), or None when nothing differs."""
        present = snapshot.of(sub.type_url)
        if changed is not None and sub.mode is SubscriptionMode.WILDCARD:
            # A wildcard stream holds every name of the previous snapshot at its digest (each
            # push and the initial answer keep `sent` so), so only changed names can differ.
            send = [n for n in changed if n in present and sub.sent.get(n) != present[n].digest]
            removed = [n for n in changed if n not in present and n in sub.sent]
            if not send and not removed:
                return None
            return send, removed, False
        if sub.mode is SubscriptionMode.WILDCARD:
            wanted: Iterable[str] = present
        else:
            # On-demand: what the keys resolve to now, plus whatever the proxy already holds.
            wanted = dict.fromkeys([*self._resolve(sub, sub.keys)[0], *(n for n in sub.sent if n in present)])
        send = [n for n in wanted if sub.sent.get(n) != present[n].digest]
        removed = [n for n in sub.sent if n not in present]
        if not send and not removed:
            return None
        return send, removed, sub.mode is SubscriptionMode.ON_DEMAND

    @staticmethod
    def _nonempty(
        response: discovery_pb2.DeltaDiscoveryResponse | None,
    ) -> list[discovery_pb2.DeltaDiscoveryResponse]:
        return [response] if response is not None else []

    # -- responses ------------------------------------------------------------------------------

    def _respond(
        self, sub: _Subscription, send: Iterable[str], removed: Iterable[str], *, aliases: bool
    ) -> discovery_pb2.DeltaDiscoveryResponse:
        present = self.snapshot.of(sub.type_url)
        resources = []
        for name in sorted(set(send)):
            res = present[name]
            resources.append(
                discovery_pb2.Resource(
                    name=name,
                    version=res.version,
                    resource=res.resource,
                    aliases=res.aliases if aliases else (),
                )
            )
            sub.sent[name] = res.digest
        removed = sorted(set(removed))
        for name in removed:
            sub.sent.pop(name, None)
        self._nonce_seq += 1
        nonce = f"{self.snapshot.version}-{self._nonce_prefix}-{self._nonce_seq}"
        sub.nonce_sent = nonce
        sub.pending[nonce] = len(resources)
        while len(sub.pending) > MAX_PENDING_RESPONSES:
            sub.pending.pop(next(iter(sub.pending)))
        sub.responses_sent += 1
        sub.resources_sent += len(resources)
        sub.removals_sent += len(removed)
        return discovery_pb2.DeltaDiscoveryResponse(
            type_url=sub.type_url,
            system_version_info=self.snapshot.version,
            nonce=nonce,
            resources=resources,
            removed_resources=removed,
        )
