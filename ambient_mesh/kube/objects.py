"""A small Kubernetes object model, read from a directory of YAML files.

Counterpart of the informer caches istiod keeps for ambient (pilot/pkg/serviceregistry/ambient
reads Namespaces, Pods, Services, Nodes, Gateways and Istio's security/networking CRDs). Only the
fields the ambient translation uses are kept. Parsing is strict about types: an object with a field
of the wrong type is reported as a `LoadError` naming the file and the field path
(`pods.yaml: Pod default/web: spec.nodeName: expected a string`) and skipped, while the rest of the
directory still loads. Unknown kinds are ignored with a note.

`DirectoryWatcher` polls the directory (mtime and size of each file) and hands every changed
snapshot to a callback, with the objects that were added, updated and removed.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

import yaml

from .. import yamlload
from ..errors import ConfigError
from ..kube.labels import LabelSelector  # only matchLabels is parsed: these kinds have no expressions
from .yaml_loader import FastCSafeLoader, NotPlainYaml, plain_documents

log = logging.getLogger(__name__)

YAML_SUFFIXES = (".yaml", ".yml", ".json")
DEFAULT_POLL_INTERVAL_S = 1.0

# Label, annotation and value names used across the control plane (Istio's spelling).


# -- object model ---------------------------------------------------------------------------------


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


# -- field reader with paths ----------------------------------------------------------------------


class _FieldError(Exception):
    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


_MISSING = object()
# _Fields has methods named str, int and bool: in its body those names are the methods
_Str: TypeAlias = str
_Int: TypeAlias = int
_Bool: TypeAlias = bool


# Where a _Fields is in its document: the path itself, or (parent, key, list index or None), made
# into text only for an error (a 10,000-pod file has about 100,000 mappings and lists).
_At: TypeAlias = "str | tuple[_Fields, str, int | None]"


def _where(at: _At) -> str:
    if isinstance(at, str):
        return at
    parent, key, index = at
    path = parent._child(key)
    return path if index is None else f"{path}[{index}]"


class _Fields:
    """Typed access to one mapping of a decoded YAML document, tracking the field path."""

    __slots__ = ("_data", "_at")

    def __init__(self, data: Any, at: _At) -> None:
        if not isinstance(data, dict):
            raise _FieldError(_where(at) or "<document>", "expected a mapping")
        self._data = data
        self._at = at

    @property
    def _path(self) -> str:
        return _where(self._at)

    def _child(self, key: str) -> str:
        path = self._path
        return f"{path}.{key}" if path else key

    def _get(self, key: str) -> Any:
        value = self._data.get(key, _MISSING)
        return _MISSING if value is None else value

    def has(self, key: str) -> bool:
        return self._get(key) is not _MISSING

    def str(self, key: str, default: str = "") -> str:
        value = self._data.get(key)  # _get inlined: this is most of the per-field cost
        if value is None:
            return default
        if not isinstance(value, str):
            raise _FieldError(self._child(key), "expected a string")
        return value

    def int(self, key: _Str, default: _Int = 0, *, lo: _Int = 0, hi: _Int = 2**31 - 1) -> _Int:
        value = self._get(key)
        if value is _MISSING:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise _FieldError(self._child(key), "expected an integer")
        if not lo <= value <= hi:
            raise _FieldError(self._child(key), f"{value} out of range {lo}-{hi}")
        return value

    def bool(self, key: _Str, default: _Bool = False) -> _Bool:
        value = self._get(key)
        if value is _MISSING:
            return default
        if not isinstance(value, bool):
            raise _FieldError(self._child(key), "expected true or false")
        return value

    def enum(self, key: _Str, allowed: tuple[_Str, ...], default: _Str) -> _Str:
        value = self.str(key, default)
        if value not in allowed:
            raise _FieldError(self._child(key), f"{value!r} is not one of {', '.join(allowed)}")
        return value

    def sub(self, key: _Str) -> _Fields | None:
        value = self._data.get(key)
        if value is None:
            return None
        return _Fields(value, (self, key, None))

    def items(self, key: _Str) -> list[_Fields]:
        value = self._data.get(key)
        if value is None:
            return []
        if not isinstance(value, list):
            raise _FieldError(self._child(key), "expected a list")
        return [_Fields(v, (self, key, i)) for i, v in enumerate(value)]

    def strings(self, key: _Str) -> tuple[_Str, ...]:
        value = self._get(key)
        if value is _MISSING:
            return ()
        if not isinstance(value, list):
            raise _FieldError(self._child(key), "expected a list of strings")
        for i, v in enumerate(value):
            if not isinstance(v, str):
                raise _FieldError(f"{self._child(key)}[{i}]", "expected a string")
        return tuple(value)

    def string_map(self, key: _Str) -> dict[_Str, _Str]:
        value = self._get(key)
        if value is _MISSING:
            return {}
        if not isinstance(value, dict):
            raise _FieldError(self._child(key), "expected a mapping of strings")
        for k, v in value.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise _FieldError(f"{self._child(key)}.{k}", "expected a string")
        return dict(value)

    def only(self, *allowed: _Str) -> _Fields:
        """Refuse a field the CRD's schema does not have, as the API server's strict field
        validation does: a typo (`principal:`) must not silently widen or void a policy."""
        for key in self._data:
            if key not in allowed:
                raise _FieldError(
                    self._child(str(key)), f"unknown field (expected one of {', '.join(sorted(allowed))})"
                )
        return self

    def port_map(self, key: _Str) -> dict[_Str, _Int]:
        value = self._get(key)
        if value is _MISSING:
            return {}
        if not isinstance(value, dict):
            raise _FieldError(self._child(key), "expected a mapping of port numbers")
        out: dict[str, int] = {}
        for k, v in value.items():
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 65535:
                raise _FieldError(f"{self._child(key)}.{k}", "expected a port number 0-65535")
            out[str(k)] = v
        return out


# -- per-kind parsers -----------------------------------------------------------------------------


def _meta(doc: _Fields, *, namespaced: bool) -> ObjectMeta:
    m = doc.sub("metadata")
    if m is None:
        raise _FieldError("metadata", "missing")
    name = m.str("name")
    if not name:
        raise _FieldError("metadata.name", "missing")
    owners = tuple(
        OwnerReference(
            api_version=o.str("apiVersion"),
            kind=o.str("kind"),
            name=o.str("name"),
            controller=o.bool("controller"),
        )
        for o in m.items("ownerReferences")
    )
    return ObjectMeta(
        name=name,
        # Like kubectl apply, a namespaced object without a namespace lands in `default`.
        namespace=(m.str("namespace") or "default") if namespaced else "",
        uid=m.str("uid"),
        labels=m.string_map("labels"),
        annotations=m.string_map("annotations"),
        creation_timestamp=_timestamp(m, "creationTimestamp"),
        deletion_timestamp=_timestamp(m, "deletionTimestamp"),
        generate_name=m.str("generateName"),
        owner_references=owners,
    )


def _timestamp(m: _Fields, key: str) -> str:
    # PyYAML turns an unquoted RFC 3339 value into a datetime; keep the text form.
    raw = m._get(key)
    if raw is _MISSING:
        return ""
    if hasattr(raw, "isoformat"):
        return str(raw.isoformat()).replace("+00:00", "Z")
    return m.str(key)


def _selector(f: _Fields | None, key: str = "matchLabels") -> LabelSelector | None:
    if f is None:
        return None
    return LabelSelector(match_labels=f.string_map(key))


def _container(c: _Fields) -> Container:
    ports = tuple(
        ContainerPort(
            name=p.str("name"),
            container_port=p.int("containerPort", lo=0, hi=65535),
            protocol=p.enum("protocol", ("TCP", "UDP", "SCTP"), "TCP"),
        )
        for p in c.items("ports")
    )
    return Container(name=c.str("name"), ports=ports, restart_policy=c.str("restartPolicy"))


def _parse_namespace(doc: _Fields) -> Namespace:
    return Namespace(metadata=_meta(doc, namespaced=False))


def _parse_pod(doc: _Fields) -> Pod:
    meta = _meta(doc, namespaced=True)
    spec = doc.sub("spec") or _Fields({}, "spec")
    status = doc.sub("status") or _Fields({}, "status")
    return Pod(
        metadata=meta,
        node_name=spec.str("nodeName"),
        # serviceAccount is the deprecated spelling; the API server mirrors it.
        service_account_name=spec.str("serviceAccountName") or spec.str("serviceAccount"),
        host_network=spec.bool("hostNetwork"),
        containers=tuple(_container(c) for c in spec.items("containers")),
        init_containers=tuple(_container(c) for c in spec.items("initContainers")),
        pod_ip=status.str("podIP"),
        pod_ips=tuple(p.str("ip") for p in status.items("podIPs") if p.str("ip")),
        phase=status.str("phase"),
        conditions=tuple(
            PodCondition(type=c.str("type"), status=c.str("status")) for c in status.items("conditions")
        ),
    )


def _target_port(p: _Fields) -> int | str | None:
    raw = p._get("targetPort")
    if raw is _MISSING:
        return None
    if isinstance(raw, str):
        # Kubernetes accepts a numeric string as an IntOrString number.
        return int(raw) if raw.isdigit() else raw
    return p.int("targetPort", lo=0, hi=65535)


def _parse_service(doc: _Fields) -> Service:
    meta = _meta(doc, namespaced=True)
    spec = doc.sub("spec") or _Fields({}, "spec")
    ports = tuple(
        ServicePort(
            name=p.str("name"),
            port=p.int("port", lo=0, hi=65535),
            target_port=_target_port(p),
            protocol=p.enum("protocol", ("TCP", "UDP", "SCTP"), "TCP"),
            app_protocol=p.str("appProtocol") or None,
        )
        for p in spec.items("ports")
    )
    return Service(
        metadata=meta,
        type=spec.str("type", "ClusterIP"),
        selector=spec.string_map("selector"),
        cluster_ip=spec.str("clusterIP"),
        cluster_ips=spec.strings("clusterIPs"),
        ports=ports,
        ip_families=spec.strings("ipFamilies"),
        internal_traffic_policy=spec.str("internalTrafficPolicy"),
        traffic_distribution=spec.str("trafficDistribution"),
        publish_not_ready_addresses=spec.bool("publishNotReadyAddresses"),
    )


def _parse_service_account(doc: _Fields) -> ServiceAccount:
    return ServiceAccount(metadata=_meta(doc, namespaced=True))


def _parse_node(doc: _Fields) -> Node:
    return Node(metadata=_meta(doc, namespaced=False))


def _target_refs(spec: _Fields) -> tuple[PolicyTargetReference, ...]:
    refs = []
    single = spec.sub("targetRef")
    entries = ([single] if single is not None else []) + spec.items("targetRefs")
    for r in entries:
        refs.append(
            PolicyTargetReference(
                group=r.str("group"), kind=r.str("kind"), name=r.str("name"), namespace=r.str("namespace")
            )
        )
    return tuple(refs)


_SOURCE_FIELDS = (
    "principals",
    "notPrincipals",
    "requestPrincipals",
    "notRequestPrincipals",
    "namespaces",
    "notNamespaces",
    "serviceAccounts",
    "notServiceAccounts",
    "ipBlocks",
    "notIpBlocks",
    "remoteIpBlocks",
    "notRemoteIpBlocks",
    "trustDomains",
    "notTrustDomains",
)
_OPERATION_FIELDS = ("hosts", "notHosts", "ports", "notPorts", "methods", "notMethods", "paths", "notPaths")
# Istio's CRDs (security.istio.io, networking.istio.io): the top level and the spec fields.
_CRD_TOP_FIELDS = ("apiVersion", "kind", "metadata", "spec", "status")
_WORKLOAD_ENTRY_FIELDS = ("address", "labels", "locality", "network", "ports", "serviceAccount", "weight")


def _crd(doc: _Fields, *spec_fields: str) -> _Fields:
    """The spec of an Istio custom resource, with unknown fields refused at both levels."""
    doc.only(*_CRD_TOP_FIELDS)
    return (doc.sub("spec") or _Fields({}, "spec")).only(*spec_fields)


def _source(s: _Fields) -> Source:
    s.only(*_SOURCE_FIELDS)
    return Source(
        principals=s.strings("principals"),
        not_principals=s.strings("notPrincipals"),
        request_principals=s.strings("requestPrincipals"),
        not_request_principals=s.strings("notRequestPrincipals"),
        namespaces=s.strings("namespaces"),
        not_namespaces=s.strings("notNamespaces"),
        service_accounts=s.strings("serviceAccounts"),
        not_service_accounts=s.strings("notServiceAccounts"),
        ip_blocks=s.strings("ipBlocks"),
        not_ip_blocks=s.strings("notIpBlocks"),
        remote_ip_blocks=s.strings("remoteIpBlocks"),
        not_remote_ip_blocks=s.strings("notRemoteIpBlocks"),
        trust_domains=s.strings("trustDomains"),
        not_trust_domains=s.strings("notTrustDomains"),
    )


def _operation(o: _Fields) -> Operation:
    o.only(*_OPERATION_FIELDS)
    return Operation(
        hosts=o.strings("hosts"),
        not_hosts=o.strings("notHosts"),
        ports=o.strings("ports"),
        not_ports=o.strings("notPorts"),
        methods=o.strings("methods"),
        not_methods=o.strings("notMethods"),
        paths=o.strings("paths"),
        not_paths=o.strings("notPaths"),
    )


def _parse_authorization_policy(doc: _Fields) -> AuthorizationPolicy:
    meta = _meta(doc, namespaced=True)
    spec = _crd(doc, "selector", "targetRef", "targetRefs", "action", "provider", "rules")
    rules = []
    for r in spec.items("rules"):
        r.only("from", "to", "when")
        sources = tuple(
            _source(f.only("source").sub("source") or _Fields({}, f"{f._path}.source"))
            for f in r.items("from")
        )
        ops = tuple(
            _operation(t.only("operation").sub("operation") or _Fields({}, f"{t._path}.operation"))
            for t in r.items("to")
        )
        when = []
        for w in r.items("when"):
            key = w.only("key", "values", "notValues").str("key")
            if not key:
                raise _FieldError(f"{w._path}.key", "missing")
            when.append(Condition(key=key, values=w.strings("values"), not_values=w.strings("notValues")))
        rules.append(AuthorizationRule(sources=sources, operations=ops, when=tuple(when)))
    return AuthorizationPolicy(
        metadata=meta,
        selector=_selector(spec.sub("selector")),
        target_refs=_target_refs(spec),
        action=spec.enum("action", AUTHZ_ACTIONS, "ALLOW"),
        rules=tuple(rules),
    )


def _parse_peer_authentication(doc: _Fields) -> PeerAuthentication:
    meta = _meta(doc, namespaced=True)
    spec = _crd(doc, "selector", "mtls", "portLevelMtls")
    mtls = spec.sub("mtls")
    if mtls is not None:
        mtls.only("mode")
    mode = mtls.enum("mode", MTLS_MODES, "UNSET") if mtls is not None else None
    port_level: dict[int, str] = {}
    raw = spec.sub("portLevelMtls")
    if raw is not None:
        for key in raw._data:
            path = f"spec.portLevelMtls.{key}"
            try:
                port = int(key)
            except (TypeError, ValueError):
                raise _FieldError(path, "expected a port number as the key") from None
            if not 1 <= port <= 65535:
                raise _FieldError(path, "port out of range 1-65535")
            entry = _Fields(raw._data[key], path).only("mode")
            port_level[port] = entry.enum("mode", MTLS_MODES, "UNSET")
    return PeerAuthentication(
        metadata=meta, selector=_selector(spec.sub("selector")), mtls_mode=mode, port_level_mtls=port_level
    )


def _workload_entry_spec(f: _Fields) -> WorkloadEntrySpec:
    f.only(*_WORKLOAD_ENTRY_FIELDS)
    return WorkloadEntrySpec(
        address=f.str("address"),
        ports=f.port_map("ports"),
        labels=f.string_map("labels"),
        network=f.str("network"),
        locality=f.str("locality"),
        weight=f.int("weight"),
        service_account=f.str("serviceAccount"),
    )


def _parse_service_entry(doc: _Fields) -> ServiceEntry:
    meta = _meta(doc, namespaced=True)
    spec = _crd(
        doc,
        "addresses",
        "endpoints",
        "exportTo",
        "hosts",
        "location",
        "ports",
        "resolution",
        "subjectAltNames",
        "workloadSelector",
    )
    hosts = spec.strings("hosts")
    if not hosts:
        raise _FieldError("spec.hosts", "at least one host is required")
    ports = tuple(
        ServiceEntryPort(
            number=p.int("number", lo=1, hi=65535),
            protocol=p.str("protocol"),
            name=p.str("name"),
            target_port=p.int("targetPort", lo=0, hi=65535),
        )
        for p in (q.only("name", "number", "protocol", "targetPort") for q in spec.items("ports"))
    )
    ws = spec.sub("workloadSelector")
    return ServiceEntry(
        metadata=meta,
        hosts=hosts,
        addresses=spec.strings("addresses"),
        ports=ports,
        location=spec.enum("location", ("MESH_EXTERNAL", "MESH_INTERNAL"), "MESH_EXTERNAL"),
        resolution=spec.enum("resolution", SE_RESOLUTIONS, "NONE"),
        endpoints=tuple(_workload_entry_spec(e) for e in spec.items("endpoints")),
        workload_selector=_selector(ws, "labels"),
        subject_alt_names=spec.strings("subjectAltNames"),
    )


def _parse_workload_entry(doc: _Fields) -> WorkloadEntry:
    meta = _meta(doc, namespaced=True)
    spec = _crd(doc, *_WORKLOAD_ENTRY_FIELDS)
    return WorkloadEntry(metadata=meta, spec=_workload_entry_spec(spec))


def _parse_gateway(doc: _Fields) -> Gateway:
    meta = _meta(doc, namespaced=True)
    spec = doc.sub("spec") or _Fields({}, "spec")
    listeners = []
    for lf in spec.items("listeners"):
        allowed_from = ""
        allowed_selector = None
        routes = lf.sub("allowedRoutes")
        ns = routes.sub("namespaces") if routes is not None else None
        if ns is not None:
            allowed_from = ns.enum("from", ("Same", "All", "Selector", "None"), "Same")
            allowed_selector = _selector(ns.sub("selector"))
        listeners.append(
            GatewayListener(
                name=lf.str("name"),
                port=lf.int("port", lo=0, hi=65535),
                protocol=lf.str("protocol"),
                allowed_from=allowed_from,
                allowed_selector=allowed_selector,
            )
        )
    status = doc.sub("status")
    addresses: tuple[GatewayAddress, ...] = ()
    if status is not None:
        addresses = tuple(
            GatewayAddress(type=a.str("type", "IPAddress"), value=a.str("value"))
            for a in status.items("addresses")
        )
    return Gateway(
        metadata=meta,
        gateway_class_name=spec.str("gatewayClassName"),
        listeners=tuple(listeners),
        status_addresses=addresses,
    )


# -- HTTPRoute and VirtualService -------------------------------------------------------------------

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(h|ms|m|s)")
_DURATION_MS = {"h": 3_600_000, "m": 60_000, "s": 1000, "ms": 1}


def _duration_ms(f: _Fields, key: str) -> int | None:
    """A duration as Gateway API (`1h30m`, `500ms`) or Istio (`1.5s`) writes it, in milliseconds."""
    text = f.str(key)
    if not text:
        return None
    pos, total = 0, 0.0
    for m in _DURATION.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _DURATION_MS[m.group(2)]
        pos = m.end()
    if pos != len(text) or pos == 0 or len(text) > 32:
        raise _FieldError(f._child(key), f"{text!r} is not a duration (for example 10s, 500ms, 1m30s)")
    return int(total)


def _percent(f: _Fields | None, key: str = "value", default: float = 100.0) -> float:
    if f is None:
        return default
    value = f._get(key)
    if value is _MISSING:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 100:
        raise _FieldError(f._child(key), "expected a percentage 0-100")
    return float(value)


def _string_match(f: _Fields) -> StringMatch:
    f.only("exact", "prefix", "regex")
    for kind in ("exact", "prefix", "regex"):
        if f.has(kind):
            return StringMatch(kind=kind, value=f.str(kind))
    raise _FieldError(f._path, "one of exact, prefix or regex is required")


def _name_values(f: _Fields, key: str) -> tuple[tuple[str, str], ...]:
    out = []
    for h in f.items(key):
        h.only("name", "value")
        name = h.str("name")
        if not name:
            raise _FieldError(f"{h._path}.name", "missing")
        out.append((name.lower(), h.str("value")))
    return tuple(out)


def _gateway_header_ops(f: _Fields | None) -> HeaderOps:
    if f is None:
        return HeaderOps()
    f.only("set", "add", "remove")
    return HeaderOps(
        set=_name_values(f, "set"),
        add=_name_values(f, "add"),
        remove=tuple(h.lower() for h in f.strings("remove")),
    )


def _istio_header_ops(f: _Fields | None) -> HeaderOps:
    if f is None:
        return HeaderOps()
    f.only("set", "add", "remove")
    return HeaderOps(
        set=tuple((k.lower(), v) for k, v in f.string_map("set").items()),
        add=tuple((k.lower(), v) for k, v in f.string_map("add").items()),
        remove=tuple(h.lower() for h in f.strings("remove")),
    )


_GATEWAY_MATCH_TYPES = {"Exact": "exact", "PathPrefix": "prefix", "RegularExpression": "regex"}


def _gateway_string_match(f: _Fields, default: str) -> StringMatch:
    kind = f.enum("type", ("Exact", "PathPrefix", "RegularExpression"), default)
    return StringMatch(kind=_GATEWAY_MATCH_TYPES[kind], value=f.str("value"))


def _gateway_match(m: _Fields) -> RouteMatch:
    m.only("path", "headers", "queryParams", "method")
    path = None
    p = m.sub("path")
    if p is not None:
        p.only("type", "value")
        path = _gateway_string_match(p, "PathPrefix")
        if not path.value.startswith("/") and path.kind != "regex":
            raise _FieldError(f"{p._path}.value", "must start with /")
    headers = []
    for h in m.items("headers"):
        h.only("type", "name", "value")
        headers.append((h.str("name").lower(), _gateway_string_match(h, "Exact")))
    query = []
    for q in m.items("queryParams"):
        q.only("type", "name", "value")
        query.append((q.str("name"), _gateway_string_match(q, "Exact")))
    return RouteMatch(
        path=path or StringMatch(kind="prefix", value="/"),
        headers=tuple(headers),
        query_params=tuple(query),
        method=m.str("method"),
    )


def _backend(b: _Fields, namespace: str, notes: list[str], *, weighted: bool) -> RouteDestination | None:
    kind = b.str("kind", "Service")
    group = b.str("group")
    if kind != "Service" or group not in ("", "core"):
        notes.append(f"{b._path}: backend {group or 'core'}/{kind} is not served (only Service)")
        return None
    ns = b.str("namespace") or namespace
    if ns != namespace:
        notes.append(f"{b._path}: a backend in another namespace needs a ReferenceGrant, not served")
        return None
    return RouteDestination(
        host=b.str("name"),
        namespace=ns,
        port=b.int("port", lo=0, hi=65535),
        weight=b.int("weight", 1, lo=0, hi=1_000_000) if weighted else None,
    )


def _gateway_path_modifier(f: _Fields) -> tuple[str, str]:
    f.only("type", "replaceFullPath", "replacePrefixMatch")
    kind = f.enum("type", ("ReplaceFullPath", "ReplacePrefixMatch"), "ReplaceFullPath")
    return kind, f.str("replaceFullPath" if kind == "ReplaceFullPath" else "replacePrefixMatch")


_FILTER_FIELDS = (
    "type",
    "requestHeaderModifier",
    "responseHeaderModifier",
    "requestRedirect",
    "urlRewrite",
    "requestMirror",
    "extensionRef",
    "cors",
    "externalAuth",
)


def _gateway_rule(r: _Fields, index: int, route: ObjectMeta, notes: list[str]) -> list[HttpRouteRule]:
    r.only("name", "matches", "filters", "backendRefs", "timeouts", "retry", "sessionPersistence")
    if r.has("sessionPersistence"):
        notes.append(f"{r._path}.sessionPersistence: not served by the waypoint, ignored")
    request_headers = response_headers = HeaderOps()
    redirect: RouteRedirect | None = None
    rewrite: RouteRewrite | None = None
    mirrors: list[RouteMirror] = []
    for f in r.items("filters"):
        f.only(*_FILTER_FIELDS)
        kind = f.str("type")
        if kind == "RequestHeaderModifier":
            request_headers = _gateway_header_ops(f.sub("requestHeaderModifier"))
        elif kind == "ResponseHeaderModifier":
            response_headers = _gateway_header_ops(f.sub("responseHeaderModifier"))
        elif kind == "RequestRedirect":
            rr = f.sub("requestRedirect") or _Fields({}, f"{f._path}.requestRedirect")
            rr.only("scheme", "hostname", "path", "port", "statusCode")
            path_kind, path_value = ("", "")
            if rr.sub("path") is not None:
                path_kind, path_value = _gateway_path_modifier(rr.sub("path"))  # type: ignore[arg-type]
            redirect = RouteRedirect(
                scheme=rr.str("scheme"),
                host=rr.str("hostname"),
                port=rr.int("port", lo=0, hi=65535),
                path=path_value if path_kind == "ReplaceFullPath" else "",
                prefix=path_value if path_kind == "ReplacePrefixMatch" else "",
                code=rr.int("statusCode", 302, lo=300, hi=399),
            )
        elif kind == "URLRewrite":
            ur = f.sub("urlRewrite") or _Fields({}, f"{f._path}.urlRewrite")
            ur.only("hostname", "path")
            prefix = full = None
            if ur.sub("path") is not None:
                path_kind, path_value = _gateway_path_modifier(ur.sub("path"))  # type: ignore[arg-type]
                if path_kind == "ReplaceFullPath":
                    full = path_value
                else:
                    prefix = path_value
            rewrite = RouteRewrite(prefix=prefix, full_path=full, host=ur.str("hostname"))
        elif kind == "RequestMirror":
            rm = f.sub("requestMirror") or _Fields({}, f"{f._path}.requestMirror")
            rm.only("backendRef", "percent", "fraction")
            ref = rm.sub("backendRef")
            if ref is None:
                raise _FieldError(f"{rm._path}.backendRef", "missing")
            ref.only("group", "kind", "name", "namespace", "port")
            dest = _backend(ref, route.namespace, notes, weighted=False)
            percent = float(rm.int("percent", 100, lo=0, hi=100))
            fraction = rm.sub("fraction")
            if fraction is not None:
                fraction.only("numerator", "denominator")
                den = fraction.int("denominator", 100, lo=1)
                percent = 100.0 * fraction.int("numerator", lo=0, hi=den) / den
            if dest is not None:
                mirrors.append(RouteMirror(destination=dest, percent=percent))
        else:
            notes.append(f"{f._path}: filter type {kind!r} is not served by the waypoint, ignored")
    destinations = []
    for b in r.items("backendRefs"):
        b.only("group", "kind", "name", "namespace", "port", "weight", "filters")
        dest = _backend(b, route.namespace, notes, weighted=True)
        if dest is None:
            continue
        req = resp = HeaderOps()
        for f in b.items("filters"):
            f.only(*_FILTER_FIELDS)
            kind = f.str("type")
            if kind == "RequestHeaderModifier":
                req = _gateway_header_ops(f.sub("requestHeaderModifier"))
            elif kind == "ResponseHeaderModifier":
                resp = _gateway_header_ops(f.sub("responseHeaderModifier"))
            else:
                notes.append(f"{f._path}: backend filter {kind!r} is not served by the waypoint, ignored")
        destinations.append(
            RouteDestination(
                host=dest.host,
                namespace=dest.namespace,
                port=dest.port,
                weight=dest.weight,
                request_headers=req,
                response_headers=resp,
            )
        )
    timeout_ms = None
    retries: RouteRetry | None = None
    timeouts = r.sub("timeouts")
    per_try = None
    if timeouts is not None:
        timeouts.only("request", "backendRequest")
        timeout_ms = _duration_ms(timeouts, "request")
        per_try = _duration_ms(timeouts, "backendRequest")
    retry = r.sub("retry")
    if retry is not None:
        retry.only("codes", "attempts", "backoff")
        codes = []
        for i, c in enumerate(retry._get("codes") if retry.has("codes") else []):
            if isinstance(c, bool) or not isinstance(c, int) or not 400 <= c <= 599:
                raise _FieldError(f"{retry._path}.codes[{i}]", "expected an HTTP status 400-599")
            codes.append(c)
        retries = RouteRetry(
            attempts=retry.int("attempts", 2, lo=0, hi=100),
            per_try_timeout_ms=per_try,
            retry_on=("connect-failure", "refused-stream", "unavailable", "cancelled"),
            codes=tuple(codes),
            backoff_ms=_duration_ms(retry, "backoff"),
        )
    elif per_try is not None:
        retries = RouteRetry(attempts=2, per_try_timeout_ms=per_try)
    matches = [_gateway_match(m) for m in r.items("matches")] or [
        RouteMatch(path=StringMatch(kind="prefix", value="/"))
    ]
    name = r.str("name") or f"{route.namespace}.{route.name}.{index}"
    direct = None
    if redirect is None and (not destinations or all(d.weight == 0 for d in destinations)):
        direct = (500, None)  # no backend to send to: Gateway API's 500
    # One rule per match: Gateway API orders matches, not rules (translation sorts them).
    return [
        HttpRouteRule(
            name=name,
            matches=(m,),
            destinations=tuple(destinations),
            redirect=redirect,
            direct_response=direct,
            rewrite=rewrite,
            timeout_ms=timeout_ms,
            retries=retries,
            mirrors=tuple(mirrors),
            request_headers=request_headers,
            response_headers=response_headers,
        )
        for m in matches
    ]


def _parse_http_route(doc: _Fields) -> HTTPRoute:
    meta = _meta(doc, namespaced=True)
    doc.only(*_CRD_TOP_FIELDS)
    spec = (doc.sub("spec") or _Fields({}, "spec")).only(
        "parentRefs", "hostnames", "rules", "useDefaultGateways"
    )
    notes: list[str] = []
    parents = []
    for p in spec.items("parentRefs"):
        p.only("group", "kind", "namespace", "name", "sectionName", "port")
        kind = p.str("kind", "Gateway")
        group = p.str("group", "gateway.networking.k8s.io")
        if kind == "Service" and group in ("", "core"):
            parents.append(
                RouteParent(
                    kind=kind,
                    group="",
                    name=p.str("name"),
                    namespace=p.str("namespace") or meta.namespace,
                    port=p.int("port", lo=0, hi=65535),
                )
            )
        else:
            notes.append(
                f"{p._path}: parent {kind} {p.str('name')!r}: only Service parents (mesh routing) are served"
            )
    if spec.has("hostnames"):
        notes.append("spec.hostnames: ignored for Service parents (as istiod)")
    rules: list[HttpRouteRule] = []
    for i, r in enumerate(spec.items("rules")):
        rules.extend(_gateway_rule(r, i, meta, notes))
    return HTTPRoute(
        metadata=meta,
        parents=tuple(parents),
        hostnames=spec.strings("hostnames"),
        http=tuple(rules),
        unsupported=tuple(notes),
    )


def _istio_destination(d: _Fields, namespace: str) -> RouteDestination:
    d.only("host", "subset", "port")
    host = d.str("host")
    if not host:
        raise _FieldError(f"{d._path}.host", "missing")
    port = d.sub("port")
    number = 0
    if port is not None:
        number = port.only("number").int("number", lo=0, hi=65535)
    return RouteDestination(host=host, namespace=namespace, port=number, subset=d.str("subset"))


_VS_MATCH_FIELDS = (
    "name",
    "uri",
    "scheme",
    "method",
    "authority",
    "headers",
    "port",
    "sourceLabels",
    "gateways",
    "queryParams",
    "ignoreUriCase",
    "withoutHeaders",
    "sourceNamespace",
    "statPrefix",
)


def _istio_match(m: _Fields, notes: list[str]) -> RouteMatch:
    m.only(*_VS_MATCH_FIELDS)
    for unsupported in ("scheme", "withoutHeaders", "sourceNamespace", "gateways", "statPrefix"):
        if m.has(unsupported):
            notes.append(f"{m._path}.{unsupported}: not served by the waypoint, ignored")
    if m.has("sourceLabels"):
        notes.append(
            f"{m._path}.sourceLabels: a waypoint cannot match on sourceLabels; this match is dropped"
        )
    uri = m.sub("uri")
    headers: list[tuple[str, StringMatch]] = []
    raw = m.sub("headers")
    if raw is not None:
        for name in raw._data:
            headers.append(
                (str(name).lower(), _string_match(_Fields(raw._data[name], f"{raw._path}.{name}")))
            )
    authority = m.sub("authority")
    if authority is not None:
        headers.append((":authority", _string_match(authority)))
    query: list[tuple[str, StringMatch]] = []
    rawq = m.sub("queryParams")
    if rawq is not None:
        for name in rawq._data:
            query.append((str(name), _string_match(_Fields(rawq._data[name], f"{rawq._path}.{name}"))))
    method = ""
    mm = m.sub("method")
    if mm is not None:
        sm = _string_match(mm)
        if sm.kind == "exact":
            method = sm.value
        else:
            headers.append((":method", sm))
    return RouteMatch(
        name=m.str("name"),
        path=_string_match(uri) if uri is not None else None,
        headers=tuple(headers),
        query_params=tuple(query),
        method=method,
        port=m.int("port", lo=0, hi=65535),
        ignore_uri_case=m.bool("ignoreUriCase"),
        source_labels=m.has("sourceLabels"),
    )


_VS_HTTP_FIELDS = (
    "name",
    "match",
    "route",
    "redirect",
    "directResponse",
    "delegate",
    "rewrite",
    "timeout",
    "retries",
    "fault",
    "mirror",
    "mirrors",
    "mirrorPercentage",
    "mirror_percent",
    "mirrorPercent",
    "corsPolicy",
    "headers",
)


def _istio_http(h: _Fields, namespace: str, notes: list[str]) -> HttpRouteRule:
    h.only(*_VS_HTTP_FIELDS)
    for unsupported in ("delegate", "mirror_percent", "mirrorPercent"):
        if h.has(unsupported):
            notes.append(f"{h._path}.{unsupported}: not served by the waypoint, ignored")
    destinations = []
    for r in h.items("route"):
        r.only("destination", "weight", "headers")
        d = r.sub("destination")
        if d is None:
            raise _FieldError(f"{r._path}.destination", "missing")
        dest = _istio_destination(d, namespace)
        hdr = r.sub("headers")
        if hdr is not None:
            hdr.only("request", "response")
        destinations.append(
            RouteDestination(
                host=dest.host,
                namespace=namespace,
                port=dest.port,
                subset=dest.subset,
                weight=r.int("weight", lo=0, hi=1_000_000) if r.has("weight") else None,
                request_headers=_istio_header_ops(hdr.sub("request") if hdr else None),
                response_headers=_istio_header_ops(hdr.sub("response") if hdr else None),
            )
        )
    redirect = None
    rd = h.sub("redirect")
    if rd is not None:
        rd.only("uri", "authority", "port", "derivePort", "scheme", "redirectCode")
        redirect = RouteRedirect(
            scheme=rd.str("scheme"),
            host=rd.str("authority"),
            port=rd.int("port", lo=0, hi=65535),
            path=rd.str("uri"),
            code=rd.int("redirectCode", 301, lo=300, hi=399),
        )
    direct = None
    dr = h.sub("directResponse")
    if dr is not None:
        dr.only("status", "body")
        body = dr.sub("body")
        text = None
        if body is not None:
            body.only("string", "bytes")
            text = body.str("string")
        direct = (dr.int("status", lo=200, hi=599), text)
    rewrite = None
    rw = h.sub("rewrite")
    if rw is not None:
        rw.only("uri", "authority", "uriRegexRewrite")
        rr = rw.sub("uriRegexRewrite")
        regex = None
        if rr is not None:
            rr.only("match", "rewrite")
            regex = (rr.str("match"), rr.str("rewrite"))
        rewrite = RouteRewrite(prefix=rw.str("uri") or None, regex=regex, host=rw.str("authority"))
    retries = None
    rt = h.sub("retries")
    if rt is not None:
        rt.only(
            "attempts",
            "perTryTimeout",
            "retryOn",
            "retryRemoteLocalities",
            "retryIgnorePreviousHosts",
            "backoff",
        )
        on = tuple(x.strip() for x in rt.str("retryOn").split(",") if x.strip())
        retries = RouteRetry(
            attempts=rt.int("attempts", lo=0, hi=100),
            per_try_timeout_ms=_duration_ms(rt, "perTryTimeout"),
            retry_on=tuple(x for x in on if not x.isdigit()),
            codes=tuple(int(x) for x in on if x.isdigit()),
            backoff_ms=_duration_ms(rt, "backoff"),
        )
    fault = None
    ft = h.sub("fault")
    if ft is not None:
        ft.only("delay", "abort")
        delay, abort = ft.sub("delay"), ft.sub("abort")
        if delay is not None:
            delay.only("fixedDelay", "percentage", "percent", "exponentialDelay")
        if abort is not None:
            abort.only("httpStatus", "grpcStatus", "http2Error", "percentage")
        fault = RouteFault(
            delay_ms=_duration_ms(delay, "fixedDelay") if delay is not None else None,
            delay_percent=_percent(delay.sub("percentage")) if delay is not None else 100.0,
            abort_status=abort.int("httpStatus", lo=200, hi=599) if abort is not None else None,
            abort_percent=_percent(abort.sub("percentage")) if abort is not None else 100.0,
        )
    mirrors = []
    mirror = h.sub("mirror")
    if mirror is not None:
        mirrors.append(
            RouteMirror(
                destination=_istio_destination(mirror, namespace), percent=_percent(h.sub("mirrorPercentage"))
            )
        )
    for m in h.items("mirrors"):
        m.only("destination", "percentage")
        d = m.sub("destination")
        if d is None:
            raise _FieldError(f"{m._path}.destination", "missing")
        mirrors.append(
            RouteMirror(destination=_istio_destination(d, namespace), percent=_percent(m.sub("percentage")))
        )
    cors = None
    cp = h.sub("corsPolicy")
    if cp is not None:
        cp.only(
            "allowOrigin",
            "allowOrigins",
            "allowMethods",
            "allowHeaders",
            "exposeHeaders",
            "maxAge",
            "allowCredentials",
            "unmatchedPreflights",
        )
        max_age = _duration_ms(cp, "maxAge")
        cors = RouteCors(
            allow_origins=tuple(_string_match(o) for o in cp.items("allowOrigins"))
            + tuple(StringMatch(kind="exact", value=o) for o in cp.strings("allowOrigin")),
            allow_methods=cp.strings("allowMethods"),
            allow_headers=cp.strings("allowHeaders"),
            expose_headers=cp.strings("exposeHeaders"),
            max_age_s=max_age // 1000 if max_age is not None else None,
            allow_credentials=cp.bool("allowCredentials") if cp.has("allowCredentials") else None,
        )
    headers = h.sub("headers")
    if headers is not None:
        headers.only("request", "response")
    return HttpRouteRule(
        name=h.str("name"),
        matches=tuple(_istio_match(m, notes) for m in h.items("match")),
        destinations=tuple(destinations),
        redirect=redirect,
        direct_response=direct,
        rewrite=rewrite,
        timeout_ms=_duration_ms(h, "timeout"),
        retries=retries,
        fault=fault,
        mirrors=tuple(mirrors),
        cors=cors,
        request_headers=_istio_header_ops(headers.sub("request") if headers else None),
        response_headers=_istio_header_ops(headers.sub("response") if headers else None),
    )


def _parse_virtual_service(doc: _Fields) -> VirtualService:
    meta = _meta(doc, namespaced=True)
    spec = _crd(doc, "hosts", "gateways", "http", "tls", "tcp", "exportTo")
    notes: list[str] = []
    for unsupported in ("tls", "tcp"):
        if spec.has(unsupported):
            notes.append(f"spec.{unsupported}: {unsupported} routes are not served by the waypoint, ignored")
    http = []
    for h in spec.items("http"):
        rule = _istio_http(h, meta.namespace, notes)
        actions = sum(x is not None for x in (rule.redirect, rule.direct_response)) + bool(rule.destinations)
        if actions != 1:
            raise _FieldError(h._path, "exactly one of route, redirect or directResponse is required")
        http.append(rule)
    return VirtualService(
        metadata=meta,
        hosts=spec.strings("hosts"),
        gateways=spec.strings("gateways"),
        http=tuple(http),
        unsupported=tuple(notes),
    )


_PARSERS: dict[str, tuple[tuple[str, ...], Callable[[_Fields], KubeObject]]] = {
    "Namespace": (("v1",), _parse_namespace),
    "Pod": (("v1",), _parse_pod),
    "Service": (("v1",), _parse_service),
    "ServiceAccount": (("v1",), _parse_service_account),
    "Node": (("v1",), _parse_node),
    "AuthorizationPolicy": (
        ("security.istio.io/v1", "security.istio.io/v1beta1"),
        _parse_authorization_policy,
    ),
    "PeerAuthentication": (
        ("security.istio.io/v1", "security.istio.io/v1beta1"),
        _parse_peer_authentication,
    ),
    "ServiceEntry": (
        ("networking.istio.io/v1", "networking.istio.io/v1beta1", "networking.istio.io/v1alpha3"),
        _parse_service_entry,
    ),
    "WorkloadEntry": (
        ("networking.istio.io/v1", "networking.istio.io/v1beta1", "networking.istio.io/v1alpha3"),
        _parse_workload_entry,
    ),
    "Gateway": (("gateway.networking.k8s.io/v1", "gateway.networking.k8s.io/v1beta1"), _parse_gateway),
    "HTTPRoute": (("gateway.networking.k8s.io/v1", "gateway.networking.k8s.io/v1beta1"), _parse_http_route),
    "VirtualService": (
        ("networking.istio.io/v1", "networking.istio.io/v1beta1", "networking.istio.io/v1alpha3"),
        _parse_virtual_service,
    ),
}


# -- loading --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadError:
    """One object (or file) that could not be used; the rest of the directory still loads."""

    file: str
    object: str = ""  # e.g. "Pod default/web"; empty when the whole document or file is bad
    field: str = ""
    message: str

    def __str__(self) -> str:
        parts = [self.file]
        if self.object:
            parts.append(self.object)
        if self.field:
            parts.append(self.field)
        return ": ".join(parts + [self.message])

    def as_error(self) -> ConfigError:
        source = ": ".join(p for p in (self.file, self.object, self.field) if p)
        return ConfigError(source, self.message)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadResult:
    objects: tuple[KubeObject, ...]
    errors: tuple[LoadError, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def store(self) -> KubeStore:
        return KubeStore(self.objects)


# libyaml (PyYAML's C extension) decodes about 7x faster than the pure-Python loader, but the two
# disagree on some odd input: libyaml accepts tabs and Unicode line breaks where PyYAML refuses them,
# reads a bare `!` tag as "" rather than null, takes `|#` as a block scalar header, and lets a plain
# scalar inside `{}` or `[]` run on past a `?` where PyYAML ends it (found by comparing the two
# loaders on generated text). Text that could hit one of those goes to the pure-Python loader, and
# so does everything libyaml rejects, so error positions and messages stay PyYAML's own. Both
# loaders share SafeConstructor and its resolver: timestamps, integers and the rest come out of the
# same Python code either way.
# yaml_loader.FastCSafeLoader is libyaml's SafeLoader with a memoised resolver and a direct
# constructor for plain documents; it falls back to SafeConstructor for everything else.
_CSafeLoader = FastCSafeLoader
_LIBYAML_UNSAFE_CHARS = ("\t", "\ufeff", "\x85", "\u2028", "\u2029")
_LIBYAML_UNSAFE_TAG = re.compile(r"(?<![^\s\[\]{},])!")
_LIBYAML_UNSAFE_HEADER = re.compile(r"[|>][-+0-9]*#")


def _libyaml_agrees(text: str) -> bool:
    """Whether libyaml decodes `text` exactly as the pure-Python loader would, when it accepts it."""
    if any(c in text for c in _LIBYAML_UNSAFE_CHARS):
        return False
    if "!" in text and _LIBYAML_UNSAFE_TAG.search(text):
        return False
    if "?" in text and ("{" in text or "[" in text):
        return False
    return not ("#" in text and _LIBYAML_UNSAFE_HEADER.search(text))


def _libyaml_takes(text: str) -> bool:
    """Whether libyaml may decode `text`: it agrees with PyYAML there, and without aliases its
    missing alias bound does not matter."""
    return _CSafeLoader is not None and _libyaml_agrees(text) and not yamlload.may_have_aliases(text)


def decode_yaml(text: str) -> list[Any]:
    """Every document of a YAML stream, as `yaml.safe_load_all` returns them (same errors too),
    with aliases bounded by `yamlload` (libyaml is not, so it only gets alias-free text)."""
    with contextlib.suppress(NotPlainYaml):
        return list(plain_documents(text))  # the plain block subset: yaml_loader's docstring
    if _libyaml_takes(text):
        try:
            return list(yaml.load_all(text, Loader=_CSafeLoader))
        except (yaml.YAMLError, UnicodeError):
            pass  # decoded again below, so the error (or the result) is PyYAML's own
    return yamlload.load_all(text)


# What PyYAML's constructors raise for tags like `!!int x`; one bad file must not stop the rest of
# the directory from loading.
_CONSTRUCTOR_ERRORS = (ValueError, IndexError, AttributeError, TypeError, RecursionError)


def parse_documents(text: str, file: str) -> LoadResult:
    """Parse one file's text (one or more `---` separated documents, or a `kind: List`)."""
    # The plain block subset that tools write is read directly (yaml_loader's docstring); a text
    # that leaves it, even in its last document, is parsed again from the start below.
    with contextlib.suppress(NotPlainYaml):
        plain = _parse_stream(plain_documents(text), file)
        assert plain is not None  # plain_documents raises no YAMLError
        return plain
    if _libyaml_takes(text):
        # One document at a time: the decoded documents of a 10,000-pod file, all held at once,
        # were most of the parse's peak memory. Any YAML error goes the way below, so errors
        # (and what libyaml would get wrong) stay PyYAML's own.
        streamed = _parse_stream(yaml.load_all(text, Loader=_CSafeLoader), file)
        if streamed is not None:
            return streamed
    try:
        docs = decode_yaml(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1} column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        return LoadResult(objects=(), errors=(LoadError(file=file, message=f"{where}{problem}"),))
    except _CONSTRUCTOR_ERRORS as exc:
        return _unreadable(file, exc)
    result = _parse_stream(iter(docs), file)
    assert result is not None  # a list raises nothing while iterated
    return result


def _unreadable(file: str, exc: BaseException) -> LoadResult:
    return LoadResult(objects=(), errors=(LoadError(file=file, message=f"cannot read the YAML: {exc}"),))


def _parse_stream(docs: Iterator[Any], file: str) -> LoadResult | None:
    """Objects from decoded documents as they come; None if the decoder raised a YAML error."""
    objects: list[KubeObject] = []
    errors: list[LoadError] = []
    notes: list[str] = []
    for i in itertools.count():
        try:
            doc = next(docs)
        except StopIteration:
            break
        except (yaml.YAMLError, UnicodeError):
            return None
        except _CONSTRUCTOR_ERRORS as exc:
            return _unreadable(file, exc)
        if isinstance(doc, dict) and doc.get("kind") == "List" and isinstance(doc.get("items"), list):
            expanded = doc["items"]
        elif doc is not None:
            expanded = [doc]
        else:
            continue
        for item in expanded:
            obj, error, note = _parse_one(item, file, i)
            if obj is not None:
                objects.append(obj)
            if error is not None:
                errors.append(error)
            if note is not None:
                notes.append(note)
    return LoadResult(objects=tuple(objects), errors=tuple(errors), notes=tuple(notes))


def _parse_one(doc: Any, file: str, index: int) -> tuple[KubeObject | None, LoadError | None, str | None]:
    where = f"document {index + 1}"
    if not isinstance(doc, dict):
        return None, LoadError(file=file, object=where, message="expected a mapping"), None
    kind, api_version = doc.get("kind"), doc.get("apiVersion")
    if not isinstance(kind, str) or not kind:
        return None, LoadError(file=file, object=where, field="kind", message="missing"), None
    if not isinstance(api_version, str) or not api_version:
        return None, LoadError(file=file, object=where, field="apiVersion", message="missing"), None
    raw_meta = doc.get("metadata")
    meta: dict[str, Any] = raw_meta if isinstance(raw_meta, dict) else {}
    name = meta.get("name") if isinstance(meta.get("name"), str) else "?"
    ns = meta.get("namespace") if isinstance(meta.get("namespace"), str) else ""
    label = f"{kind} {ns}/{name}" if ns else f"{kind} {name}"
    entry = _PARSERS.get(kind)
    if entry is None or api_version not in entry[0]:
        return None, None, f"{file}: {label} ({api_version}): kind not used by the control plane, ignored"
    try:
        obj = entry[1](_Fields(doc, ""))
    except _FieldError as exc:
        return None, LoadError(file=file, object=label, field=exc.path, message=exc.message), None
    return obj, None, None


ParseFn = Callable[[str, str], LoadResult]  # (text, file name) -> result, like parse_documents


def load_file(file: Path, parse: ParseFn = parse_documents) -> LoadResult:
    """One file's objects; a file that cannot be read is one `LoadError`."""
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return LoadResult(objects=(), errors=(LoadError(file=file.name, message=f"cannot read: {exc}"),))
    return parse(text, file.name)


def load_directory(path: str | Path) -> LoadResult:
    """Read every *.yaml / *.yml / *.json file directly in `path`, in name order."""
    return merge_files((file.name, load_file(file)) for file in _list_files(Path(path)))


def merge_files(results: Iterable[tuple[str, LoadResult]]) -> LoadResult:
    """One snapshot from per-file results in name order; a later duplicate of an object is an error."""
    objects: list[KubeObject] = []
    errors: list[LoadError] = []
    notes: list[str] = []
    seen: dict[ObjectKey, str] = {}
    for name, result in results:
        errors.extend(result.errors)
        notes.extend(result.notes)
        for obj in result.objects:
            key = object_key(obj)
            if key in seen:
                errors.append(
                    LoadError(
                        file=name,
                        object=format_key(key),
                        message=f"duplicate of the object in {seen[key]}; the first one is kept",
                    )
                )
                continue
            seen[key] = name
            objects.append(obj)
    return LoadResult(objects=tuple(objects), errors=tuple(errors), notes=tuple(notes))


def _list_files(root: Path) -> list[Path]:
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return []
    return [p for p in entries if p.suffix in YAML_SUFFIXES and not p.name.startswith(".") and p.is_file()]


# -- the snapshot ---------------------------------------------------------------------------------


class KubeStore:
    """An immutable snapshot of the objects the translation reads, indexed by kind."""

    __slots__ = ("_by_key", "_by_kind")

    def __init__(self, objects: Iterable[KubeObject] = ()) -> None:
        self._by_key: dict[ObjectKey, KubeObject] = {}
        for obj in objects:
            self._by_key.setdefault(object_key(obj), obj)
        # Sorted per kind on first use: a snapshot handed to the incremental translation is only
        # looked up by key, and sorting 10,000 pods per directory change would be most of its cost.
        self._by_kind: dict[str, tuple[KubeObject, ...]] | None = None

    load_directory = staticmethod(load_directory)

    def __len__(self) -> int:
        return len(self._by_key)

    def __repr__(self) -> str:
        counts = ", ".join(f"{len(v)} {k}" for k, v in sorted(self._kinds().items()))
        return f"KubeStore({counts or 'empty'})"

    def _kinds(self) -> dict[str, tuple[KubeObject, ...]]:
        if self._by_kind is None:
            # Lists first: growing a tuple per object would copy it each time (quadratic).
            by_kind: dict[str, list[KubeObject]] = {}
            for key in sorted(self._by_key):
                by_kind.setdefault(key[0], []).append(self._by_key[key])
            self._by_kind = {k: tuple(v) for k, v in by_kind.items()}
        return self._by_kind

    def get(self, kind: str, namespace: str, name: str) -> KubeObject | None:
        return self._by_key.get((kind, namespace, name))

    def all(self) -> tuple[KubeObject, ...]:
        return tuple(self._by_key[k] for k in sorted(self._by_key))

    def keys(self) -> frozenset[ObjectKey]:
        return frozenset(self._by_key)

    def _kind(self, kind: str) -> tuple[Any, ...]:
        return self._kinds().get(kind, ())

    @property
    def namespaces(self) -> tuple[Namespace, ...]:
        return self._kind("Namespace")

    @property
    def pods(self) -> tuple[Pod, ...]:
        return self._kind("Pod")

    @property
    def services(self) -> tuple[Service, ...]:
        return self._kind("Service")

    @property
    def service_accounts(self) -> tuple[ServiceAccount, ...]:
        return self._kind("ServiceAccount")

    @property
    def nodes(self) -> tuple[Node, ...]:
        return self._kind("Node")

    @property
    def authorization_policies(self) -> tuple[AuthorizationPolicy, ...]:
        return self._kind("AuthorizationPolicy")

    @property
    def peer_authentications(self) -> tuple[PeerAuthentication, ...]:
        return self._kind("PeerAuthentication")

    @property
    def service_entries(self) -> tuple[ServiceEntry, ...]:
        return self._kind("ServiceEntry")

    @property
    def workload_entries(self) -> tuple[WorkloadEntry, ...]:
        return self._kind("WorkloadEntry")

    @property
    def gateways(self) -> tuple[Gateway, ...]:
        return self._kind("Gateway")

    @property
    def http_routes(self) -> tuple[HTTPRoute, ...]:
        return self._kind("HTTPRoute")

    @property
    def virtual_services(self) -> tuple[VirtualService, ...]:
        return self._kind("VirtualService")

    def namespace(self, name: str) -> Namespace | None:
        obj = self._by_key.get(("Namespace", "", name))
        return obj if isinstance(obj, Namespace) else None

    def node(self, name: str) -> Node | None:
        obj = self._by_key.get(("Node", "", name))
        return obj if isinstance(obj, Node) else None


# -- watching a directory -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class DirectoryChange:
    """What one poll found: the new snapshot and how it differs from the previous one."""

    result: LoadResult
    files_added: tuple[str, ...] = ()
    files_changed: tuple[str, ...] = ()
    files_removed: tuple[str, ...] = ()
    added: tuple[ObjectKey, ...] = ()
    updated: tuple[ObjectKey, ...] = ()
    removed: tuple[ObjectKey, ...] = ()

    @property
    def store(self) -> KubeStore:
        return self.result.store

    def summary(self) -> str:
        return (
            f"{len(self.added)} added, {len(self.updated)} updated, {len(self.removed)} removed, "
            f"{len(self.result.errors)} errors"
        )


Fingerprint = dict[str, tuple[int, int]]
OnChange = Callable[[DirectoryChange], None | Awaitable[None]]


class DirectoryWatcher:
    """Polls a directory and reports each changed snapshot to `on_change`.

    Polling (mtime and size per file) keeps it portable and simple; inotify would save a few
    syscalls per interval, which does not matter at one poll a second. Each file's parse result is
    kept under its (mtime, size), so a change re-parses only the files that changed: at 10,000 pods
    decoding the whole directory again takes seconds. `sleep` and `parse` are injectable so tests
    step the loop without waiting and count what gets parsed.
    """

    def __init__(
        self,
        path: str | Path,
        on_change: OnChange,
        poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
        *,
        sleep: Callable[[float], Awaitable[None]] | None = None,
        parse: ParseFn = parse_documents,
    ) -> None:
        self.path = Path(path)
        self._parse = parse
        # file name -> (its (mtime_ns, size) when it was read, what it parsed to)
        self._parsed: dict[str, tuple[tuple[int, int], LoadResult]] = {}
        self.poll_interval_s = poll_interval_s
        self._on_change = on_change
        self._sleep = sleep
        self._fingerprint: Fingerprint | None = None
        self._objects: dict[ObjectKey, KubeObject] = {}
        self._last: LoadResult | None = None
        self.polls = 0
        self.changes = 0

    def __repr__(self) -> str:
        if self._last is None:
            state = "not yet read"
        else:
            state = (
                f"{len(self._fingerprint or {})} files, {len(self._objects)} objects, "
                f"{len(self._last.errors)} errors"
            )
        return (
            f"DirectoryWatcher({self.path}: {state}, {self.changes} changes, every {self.poll_interval_s}s)"
        )

    @property
    def last(self) -> LoadResult | None:
        return self._last

    def _scan(self) -> Fingerprint:
        out: Fingerprint = {}
        for file in _list_files(self.path):
            try:
                st = file.stat()
            except OSError:
                continue
            out[file.name] = (st.st_mtime_ns, st.st_size)
        return out

    def _load(self, fingerprint: Fingerprint) -> LoadResult:
        """The directory's snapshot, parsing again only files whose (mtime, size) moved.

        The stat was taken before the read, so a write that lands in between changes the
        fingerprint again and the next poll reads the file once more.
        """
        parsed: dict[str, tuple[tuple[int, int], LoadResult]] = {}
        for name, stat in fingerprint.items():
            cached = self._parsed.get(name)
            if cached is not None and cached[0] == stat:
                parsed[name] = cached
            else:
                parsed[name] = (stat, load_file(self.path / name, self._parse))
        self._parsed = parsed
        return merge_files((name, result) for name, (_, result) in parsed.items())

    def poll(self) -> DirectoryChange | None:
        """Scan once; reload and return the change when any file was added, changed or removed.

        The first poll always reports (every object as added), so a consumer starts from a
        full snapshot even for an empty directory.
        """
        self.polls += 1
        fingerprint = self._scan()
        previous = self._fingerprint
        if previous is not None and fingerprint == previous:
            return None
        previous = previous or {}
        result = self._load(fingerprint)
        objects = {object_key(o): o for o in result.objects}
        added = tuple(sorted(k for k in objects if k not in self._objects))
        removed = tuple(sorted(k for k in self._objects if k not in objects))
        updated = tuple(sorted(k for k in objects if k in self._objects and self._objects[k] != objects[k]))
        change = DirectoryChange(
            result=result,
            files_added=tuple(sorted(set(fingerprint) - set(previous))),
            files_changed=tuple(
                sorted(f for f in fingerprint if f in previous and fingerprint[f] != previous[f])
            ),
            files_removed=tuple(sorted(set(previous) - set(fingerprint))),
            added=added,
            updated=updated,
            removed=removed,
        )
        first = self._fingerprint is None
        previous_errors = self._last.errors if self._last is not None else ()
        self._fingerprint = fingerprint
        self._objects = objects
        self._last = result
        if not first and not (added or updated or removed) and result.errors == previous_errors:
            # A file was touched but its objects did not change: nothing to push.
            return None
        self.changes += 1
        return change

    async def poll_and_notify(self) -> DirectoryChange | None:
        change = self.poll()
        if change is not None:
            log.info("config directory %s changed: %s", self.path, change.summary())
            for error in change.result.errors:
                log.warning("config object skipped: %s", error)
            outcome = self._on_change(change)
            if outcome is not None:
                await outcome
        return change

    async def run(self) -> None:
        """Poll until cancelled. The callback runs inline: a slow consumer delays the next poll."""
        while True:
            await self.poll_and_notify()
            if self._sleep is None:
                import asyncio  # here, not at the top: the CNI plugin imports this module and starts fast

                self._sleep = asyncio.sleep
            await self._sleep(self.poll_interval_s)
