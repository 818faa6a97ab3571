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
