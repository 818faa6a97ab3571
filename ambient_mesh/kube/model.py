"""The Kubernetes, Istio and Gateway API objects the mesh reads, as frozen dataclasses.

Only the fields the ambient translation uses are kept (istiod's informer caches for ambient read
Namespaces, Pods, Services, Nodes, Gateways and Istio's security and networking CRDs). The parsers
that fill these in are `kube.parse_core`, `kube.parse_istio` and `kube.parse_gateway`; `kube.load`
reads them from YAML or JSON text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .labels import LabelSelector  # only matchLabels is parsed: these kinds have no expressions


@dataclass(frozen=True, slots=True, kw_only=True)
class OwnerReference:
    api_version: str = ""
    kind: str = ""
    name: str = ""
    controller: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class ObjectMeta:
    name: str
    namespace: str = ""
    uid: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    # RFC 3339 as Kubernetes writes it; istiod breaks ties between policies by age.
    creation_timestamp: str = ""
    deletion_timestamp: str = ""
    generate_name: str = ""
    owner_references: tuple[OwnerReference, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Namespace:
    kind = "Namespace"
    metadata: ObjectMeta


@dataclass(frozen=True, slots=True, kw_only=True)
class ContainerPort:
    name: str = ""
    container_port: int = 0
    protocol: str = "TCP"


@dataclass(frozen=True, slots=True, kw_only=True)
class Container:
    name: str = ""
    ports: tuple[ContainerPort, ...] = ()
    # Only "Always" matters: native sidecars (init containers that keep running) expose ports too.
    restart_policy: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class PodCondition:
    type: str
    status: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Pod:
    kind = "Pod"
    metadata: ObjectMeta
    node_name: str = ""
    service_account_name: str = ""
    host_network: bool = False
    containers: tuple[Container, ...] = ()
    init_containers: tuple[Container, ...] = ()
    pod_ip: str = ""
    pod_ips: tuple[str, ...] = ()
    phase: str = ""
    conditions: tuple[PodCondition, ...] = ()

    @property
    def ready(self) -> bool:
        return any(c.type == "Ready" and c.status == "True" for c in self.conditions)

    @property
    def ips(self) -> tuple[str, ...]:
        """status.podIPs, falling back to status.podIP (older API servers fill only that)."""
        if self.pod_ips:
            return self.pod_ips
        return (self.pod_ip,) if self.pod_ip else ()


@dataclass(frozen=True, slots=True, kw_only=True)
class ServicePort:
    name: str = ""
    port: int
    # int or a container port name; None when absent (Kubernetes then defaults it to `port`).
    target_port: int | str | None = None
    protocol: str = "TCP"
    app_protocol: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Service:
    kind = "Service"
    metadata: ObjectMeta
    type: str = "ClusterIP"
    selector: Mapping[str, str] = field(default_factory=dict)
    cluster_ip: str = ""
    cluster_ips: tuple[str, ...] = ()
    ports: tuple[ServicePort, ...] = ()
    ip_families: tuple[str, ...] = ()
    internal_traffic_policy: str = ""
    traffic_distribution: str = ""
    publish_not_ready_addresses: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceAccount:
    kind = "ServiceAccount"
    metadata: ObjectMeta


@dataclass(frozen=True, slots=True, kw_only=True)
class Node:
    kind = "Node"
    metadata: ObjectMeta


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyTargetReference:
    group: str = ""
    kind: str = ""
    name: str = ""
    namespace: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Source:
    principals: tuple[str, ...] = ()
    not_principals: tuple[str, ...] = ()
    request_principals: tuple[str, ...] = ()
    not_request_principals: tuple[str, ...] = ()
    namespaces: tuple[str, ...] = ()
    not_namespaces: tuple[str, ...] = ()
    service_accounts: tuple[str, ...] = ()
    not_service_accounts: tuple[str, ...] = ()
    ip_blocks: tuple[str, ...] = ()
    not_ip_blocks: tuple[str, ...] = ()
    remote_ip_blocks: tuple[str, ...] = ()
    not_remote_ip_blocks: tuple[str, ...] = ()
    trust_domains: tuple[str, ...] = ()
    not_trust_domains: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Operation:
    hosts: tuple[str, ...] = ()
    not_hosts: tuple[str, ...] = ()
    ports: tuple[str, ...] = ()
    not_ports: tuple[str, ...] = ()
    methods: tuple[str, ...] = ()
    not_methods: tuple[str, ...] = ()
    paths: tuple[str, ...] = ()
    not_paths: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Condition:
    key: str
    values: tuple[str, ...] = ()
    not_values: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class AuthorizationRule:
    # One entry per `from[i].source` / `to[i].operation`.
    sources: tuple[Source, ...] = ()
    operations: tuple[Operation, ...] = ()
    when: tuple[Condition, ...] = ()


AUTHZ_ACTIONS = ("ALLOW", "DENY", "AUDIT", "CUSTOM")


@dataclass(frozen=True, slots=True, kw_only=True)
class AuthorizationPolicy:
    kind = "AuthorizationPolicy"
    metadata: ObjectMeta
    # None: no `selector` at all (namespace or mesh wide). Present but empty is kept distinct.
    selector: LabelSelector | None = None
    target_refs: tuple[PolicyTargetReference, ...] = ()
    action: str = "ALLOW"
    rules: tuple[AuthorizationRule, ...] = ()


MTLS_MODES = ("UNSET", "DISABLE", "PERMISSIVE", "STRICT")


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerAuthentication:
    kind = "PeerAuthentication"
    metadata: ObjectMeta
    selector: LabelSelector | None = None
    # None when `mtls` is absent; both mean UNSET to istiod.
    mtls_mode: str | None = None
    port_level_mtls: Mapping[int, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkloadEntrySpec:
    """A WorkloadEntry's spec; ServiceEntry `endpoints` use the same shape."""

    address: str = ""
    ports: Mapping[str, int] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    network: str = ""
    locality: str = ""
    weight: int = 0
    service_account: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceEntryPort:
    number: int
    protocol: str = ""
    name: str = ""
    target_port: int = 0


SE_RESOLUTIONS = ("NONE", "STATIC", "DNS", "DNS_ROUND_ROBIN", "DYNAMIC_DNS")


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceEntry:
    kind = "ServiceEntry"
    metadata: ObjectMeta
    hosts: tuple[str, ...] = ()
    addresses: tuple[str, ...] = ()
    ports: tuple[ServiceEntryPort, ...] = ()
    location: str = "MESH_EXTERNAL"
    resolution: str = "NONE"
    endpoints: tuple[WorkloadEntrySpec, ...] = ()
    workload_selector: LabelSelector | None = None
    subject_alt_names: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkloadEntry:
    kind = "WorkloadEntry"
    metadata: ObjectMeta
    spec: WorkloadEntrySpec


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayListener:
    name: str = ""
    port: int = 0
    protocol: str = ""
    # allowedRoutes.namespaces: from = Same | All | Selector (matchLabels only).
    allowed_from: str = ""
    allowed_selector: LabelSelector | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayAddress:
    type: str = "IPAddress"
    value: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Gateway:
    """gateway.networking.k8s.io Gateway: istiod builds its waypoints from these."""

    kind = "Gateway"
    metadata: ObjectMeta
    gateway_class_name: str = ""
    listeners: tuple[GatewayListener, ...] = ()
    status_addresses: tuple[GatewayAddress, ...] = ()


# -- L7 routes (waypoints) -------------------------------------------------------------------------
# HTTPRoute and VirtualService are kept in one shape, Istio's VirtualService `http` route: istiod
# converts an HTTPRoute whose parent is a Service into a VirtualService with gateway semantics
# (pilot/pkg/config/kube/gateway/conversion.go), and the waypoint reads only that form.


@dataclass(frozen=True, slots=True, kw_only=True)
class StringMatch:
    kind: str  # "exact", "prefix" or "regex"
    value: str


@dataclass(frozen=True, slots=True, kw_only=True)
class HeaderOps:
    set: tuple[tuple[str, str], ...] = ()
    add: tuple[tuple[str, str], ...] = ()
    remove: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.set or self.add or self.remove)


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteMatch:
    name: str = ""
    path: StringMatch | None = None
    headers: tuple[tuple[str, StringMatch], ...] = ()
    query_params: tuple[tuple[str, StringMatch], ...] = ()
    method: str = ""
    port: int = 0
    ignore_uri_case: bool = False
    # A VirtualService match with sourceLabels: never honoured by a waypoint (dropped).
    source_labels: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteDestination:
    host: str  # as written: a short name is resolved in `namespace`
    namespace: str
    port: int = 0
    subset: str = ""
    weight: int | None = None  # None: not given (a single destination takes everything)
    request_headers: HeaderOps = HeaderOps()
    response_headers: HeaderOps = HeaderOps()


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteRedirect:
    scheme: str = ""
    host: str = ""
    port: int = 0
    path: str = ""  # the whole path
    prefix: str = ""  # the matched prefix replaced by this
    code: int = 301


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteRewrite:
    prefix: str | None = None
    full_path: str | None = None
    regex: tuple[str, str] | None = None  # (pattern, substitution)
    host: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteRetry:
    attempts: int = 0
    per_try_timeout_ms: int | None = None
    retry_on: tuple[str, ...] = ()
    codes: tuple[int, ...] = ()
    backoff_ms: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteFault:
    delay_ms: int | None = None
    delay_percent: float = 100.0
    abort_status: int | None = None
    abort_percent: float = 100.0


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteMirror:
    destination: RouteDestination
    percent: float = 100.0


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteCors:
    allow_origins: tuple[StringMatch, ...] = ()
    allow_methods: tuple[str, ...] = ()
    allow_headers: tuple[str, ...] = ()
    expose_headers: tuple[str, ...] = ()
    max_age_s: int | None = None
    allow_credentials: bool | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpRouteRule:
    """One VirtualService `http` entry (an HTTPRoute rule converted as istiod converts it)."""

    name: str = ""
    matches: tuple[RouteMatch, ...] = ()
    destinations: tuple[RouteDestination, ...] = ()
    redirect: RouteRedirect | None = None
    direct_response: tuple[int, str | None] | None = None
    rewrite: RouteRewrite | None = None
    timeout_ms: int | None = None
    retries: RouteRetry | None = None
    fault: RouteFault | None = None
    mirrors: tuple[RouteMirror, ...] = ()
    cors: RouteCors | None = None
    request_headers: HeaderOps = HeaderOps()
    response_headers: HeaderOps = HeaderOps()


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteParent:
    """An HTTPRoute parentRef naming a Service (Istio's mesh routing)."""

    kind: str
    name: str
    namespace: str
    port: int = 0
    group: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class HTTPRoute:
    """gateway.networking.k8s.io HTTPRoute, its rules already in VirtualService form."""

    kind = "HTTPRoute"
    metadata: ObjectMeta
    parents: tuple[RouteParent, ...] = ()
    hostnames: tuple[str, ...] = ()
    http: tuple[HttpRouteRule, ...] = ()
    # What a waypoint cannot honour, said where the object is applied.
    unsupported: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class VirtualService:
    kind = "VirtualService"
    metadata: ObjectMeta
    hosts: tuple[str, ...] = ()
    gateways: tuple[str, ...] = ()
    http: tuple[HttpRouteRule, ...] = ()
    unsupported: tuple[str, ...] = ()


KubeObject = (
    Namespace
    | Pod
    | Service
    | ServiceAccount
    | Node
    | AuthorizationPolicy
    | PeerAuthentication
    | ServiceEntry
    | WorkloadEntry
    | Gateway
    | HTTPRoute
    | VirtualService
)

ObjectKey = tuple[str, str, str]  # (kind, namespace, name)


def object_key(obj: KubeObject) -> ObjectKey:
    return (obj.kind, obj.metadata.namespace, obj.metadata.name)


def format_key(key: ObjectKey) -> str:
    kind, ns, name = key
    return f"{kind} {ns}/{name}" if ns else f"{kind} {name}"
