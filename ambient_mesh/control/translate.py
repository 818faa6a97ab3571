"""Translation from Kubernetes objects to the resources istiod serves ztunnel.

Counterpart of istiod's ambient index (pilot/pkg/serviceregistry/ambient: workloads.go,
services.go, waypoints.go, authorization.go, policies.go, helpers.go). Pure functions: a
`KubeStore` snapshot and `MeshSettings` in, `istio.workload.Address` resources keyed by their xDS
name (workload uid, or `namespace/hostname`) and `istio.security.Authorization` resources keyed by
`namespace/name` out, plus notes for what was skipped and why (istiod writes those to object
status).

Where this differs from istiod, on purpose:
- Enrollment. istiod sends HBONE for a pod only once istio-cni has annotated it
  (`ambient.istio.io/redirection: enabled`). Files on disk never carry that annotation, so a pod
  that the node agent would enroll (its own or its namespace's `istio.io/dataplane-mode=ambient`,
  not opted out with another value, no sidecar, not host-network) counts as enrolled too.
- API-server defaults are applied here because nobody else does: a pod without a service account
  runs as `default`, a service port without targetPort targets its own port.
- Not modelled: EndpointSlice-only endpoints, network gateways (multi-network), GatewayClass
  traffic types (a waypoint's type comes from its `istio.io/waypoint-for` label, default
  `service`), ServiceEntry address auto-allocation, service visibility, waypoint canaries and the
  implicit allow-from-waypoint policies (off by default in istiod).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from google.protobuf import wrappers_pb2

from ..wire.istio.security import authorization_pb2 as sec
from ..wire.istio.workload import workload_pb2 as wl
from .kube import (
    LABEL_DATAPLANE_MODE,
    LABEL_GATEWAY_NAME,
    LABEL_TOPOLOGY_REGION,
    LABEL_TOPOLOGY_SUBZONE,
    LABEL_TOPOLOGY_ZONE,
    LABEL_USE_WAYPOINT,
    LABEL_USE_WAYPOINT_NAMESPACE,
    LABEL_WAYPOINT_FOR,
    AuthorizationPolicy,
    AuthorizationRule,
    Gateway,
    KubeStore,
    LabelSelector,
    ObjectMeta,
    PeerAuthentication,
    Pod,
    Service,
    ServiceEntry,
    WorkloadEntry,
    WorkloadEntrySpec,
)

STATIC_STRICT_POLICY_NAME = "istio_converted_static_strict"  # '_' cannot appear in a Kubernetes name
CONVERTED_PEER_AUTHENTICATION_PREFIX = "converted_peer_authentication_"
HBONE_MTLS_PORT = 15008

ANNOTATION_REDIRECTION = "ambient.istio.io/redirection"
ANNOTATION_SIDECAR_STATUS = "sidecar.istio.io/status"
ANNOTATION_DRY_RUN = "istio.io/dry-run"
ANNOTATION_TRAFFIC_DISTRIBUTION = "networking.istio.io/traffic-distribution"
ANNOTATION_INBOUND_BINDING = "ambient.istio.io/waypoint-inbound-binding"
ANNOTATION_AUTO_REGISTRATION_GROUP = "istio.io/autoRegistrationGroup"
LABEL_TUNNEL = "networking.istio.io/tunnel"
LABEL_WORKLOAD_NAME = "service.istio.io/workload-name"
LABEL_GATEWAY_MANAGED = "gateway.istio.io/managed"
LABEL_INGRESS_USE_WAYPOINT = "istio.io/ingress-use-waypoint"
MANAGED_BY_MESH_CONTROLLERS = ("istio.io-mesh-controller", "istio.io-eastwest-controller")

CANONICAL_NAME_LABELS = ("service.istio.io/canonical-name", "app.kubernetes.io/name", "app")
CANONICAL_REVISION_LABELS = ("service.istio.io/canonical-revision", "app.kubernetes.io/version", "version")

# Keys of `when` conditions that ztunnel can check; anything else is an HTTP attribute.
L4_WHEN_KEYS = frozenset(
    {"source.ip", "source.namespace", "source.principal", "destination.ip", "destination.port"}
)

_CRONJOB_NAME = re.compile(r"(.+)-\d{8,10}$")


@dataclass(frozen=True, slots=True, kw_only=True)
class MeshSettings:
    trust_domain: str = "cluster.local"
    cluster_id: str = "Kubernetes"
    root_namespace: str = "istio-system"
    network: str = ""
    domain_suffix: str = "cluster.local"
    # istiod's ENABLE_WDS_DRY_RUN_AUTHZ_POLICY: without it, dry-run policies are not sent at all.
    enable_wds_dry_run: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Translation:
    addresses: dict[str, wl.Address]
    authorizations: dict[str, sec.Authorization]
    # What was skipped or changed and why; istiod reports these as object status conditions.
    notes: tuple[str, ...] = ()

    def __repr__(self) -> str:
        workloads = sum(1 for a in self.addresses.values() if a.WhichOneof("type") == "workload")
        return (
            f"Translation({workloads} workloads, {len(self.addresses) - workloads} services, "
            f"{len(self.authorizations)} authorizations, {len(self.notes)} notes)"
        )


# -- resource versions and diffs ------------------------------------------------------------------


# -- small helpers --------------------------------------------------------------------------------


def _ip_bytes(text: str) -> bytes:
    return ipaddress.ip_address(text).packed


def _pick_trust_domain(settings: MeshSettings) -> str:
    # istiod leaves the default trust domain out to keep resources small; ztunnel fills it back in.
    return "" if settings.trust_domain == "cluster.local" else settings.trust_domain


def _lookup(labels: Mapping[str, str], keys: tuple[str, ...]) -> str | None:
    for key in keys:
        if key in labels:
            return labels[key]
    return None


def canonical_service(labels: Mapping[str, str], workload_name: str) -> tuple[str, str]:
    name = _lookup(labels, CANONICAL_NAME_LABELS)
    revision = _lookup(labels, CANONICAL_REVISION_LABELS)
    return (name if name is not None else workload_name, revision if revision is not None else "latest")


def pod_workload_name(pod: Pod) -> str:
    """The controller name istiod derives from a pod (Deployment from the ReplicaSet name, CronJob
    from the Job name); `service.istio.io/workload-name` overrides it."""
    override = pod.metadata.labels.get(LABEL_WORKLOAD_NAME)
    if override is not None:
        return override
    name = pod.metadata.name
    if pod.metadata.generate_name:
        controller = next((o for o in pod.metadata.owner_references if o.controller), None)
        if controller is not None:
            name = controller.name
            labels = pod.metadata.labels
            for hash_label in ("pod-template-hash", "rollouts-pod-template-hash"):
                value = labels.get(hash_label, "")
                if controller.kind == "ReplicaSet" and value and controller.name.endswith(value):
                    name = controller.name.removesuffix("-" + value)
                    break
            else:
                if controller.kind == "ReplicationController" and labels.get("deploymentconfig"):
                    name = labels["deploymentconfig"]
                elif controller.kind == "Job" and (m := _CRONJOB_NAME.fullmatch(controller.name)):
                    name = m.group(1)
    return name or pod.metadata.name


_ISTIO_PROTOCOLS = frozenset(
    {
        "tcp",
        "udp",
        "grpc",
        "grpc-web",
        "http",
        "http_proxy",
        "http2",
        "https",
        "tls",
        "mongo",
        "redis",
        "mysql",
    }
)
_APP_PROTOCOLS = {
    "http": wl.HTTP11,
    "http2": wl.HTTP2,
    "grpc": wl.GRPC,
    "tls": wl.TLS,
    "https": wl.TLS,
    "tcp": wl.TCP,
}
# Ports where protocol sniffing would break the application: TCP unless declared otherwise.
_WELL_KNOWN_TCP_PORTS = frozenset({25, 53, 3306, 27017})


def _istio_protocol(name: str) -> str | None:
    """Istio's protocol for a port name prefix or appProtocol value; None when unsupported."""
    lowered = name.lower()
    if lowered.startswith("grpc-web"):
        return "grpc-web"
    if lowered == "kubernetes.io/h2c":
        return "http2"
    prefix = lowered.split("-", 1)[0]
    return prefix if prefix in _ISTIO_PROTOCOLS else None


def _app_protocol(name: str) -> int:
    proto = _istio_protocol(name)
    return _APP_PROTOCOLS.get(proto, wl.UNKNOWN) if proto is not None else wl.UNKNOWN


def _kube_app_protocol(port: int, name: str, protocol: str, app_protocol: str | None) -> int:
    if protocol == "UDP":
        return wl.UNKNOWN
    proto = _istio_protocol(app_protocol if app_protocol is not None else name)
    if proto is None:
        return wl.TCP if port in _WELL_KNOWN_TCP_PORTS else wl.UNKNOWN
    return _APP_PROTOCOLS.get(proto, wl.UNKNOWN)


def _network_address(text: str, network: str, *, allow_cidr: bool) -> wl.NetworkAddress:
    if allow_cidr and "/" in text:
        net = ipaddress.ip_network(text, strict=False)
        addr = wl.NetworkAddress(network=network, address=net.network_address.packed)
        if net.prefixlen != net.max_prefixlen:
            addr.length = net.prefixlen
        return addr
    return wl.NetworkAddress(network=network, address=_ip_bytes(text))


def _locality_from_labels(labels: Mapping[str, str]) -> wl.Locality | None:
    region = labels.get(LABEL_TOPOLOGY_REGION, "")
    zone = labels.get(LABEL_TOPOLOGY_ZONE, "")
    subzone = labels.get(LABEL_TOPOLOGY_SUBZONE, "")
    if not (region or zone or subzone):
        return None
    return wl.Locality(region=region, zone=zone, subzone=subzone)


def _locality_from_string(text: str) -> wl.Locality | None:
    parts = (text.split("/") + ["", "", ""])[:3]
    if not any(parts):
        return None
    return wl.Locality(region=parts[0], zone=parts[1], subzone=parts[2])


def _selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """A non-empty selector that is a subset of labels (an empty one selects nothing here)."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# -- waypoints ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Waypoint:
    name: str
    namespace: str
    address: wl.GatewayAddress
    traffic_type: str
    allowed_from: str = "Same"
    allowed_selector: LabelSelector | None = None
    binding: tuple[int, int] | None = None  # (ApplicationTunnel.Protocol, port)

    @property
    def resource_name(self) -> str:
        return f"{self.namespace}/{self.name}"


def _inbound_binding(gateway: Gateway) -> tuple[int, int] | None:
    raw = gateway.metadata.annotations.get(ANNOTATION_INBOUND_BINDING)
    if raw is None:
        return None
    parts = raw.split("/")
    if len(parts) > 2 or parts[0] not in ("NONE", "PROXY"):
        return None
    protocol = wl.ApplicationTunnel.PROXY if parts[0] == "PROXY" else wl.ApplicationTunnel.NONE
    port = int(parts[1]) if len(parts) == 2 and parts[1].isdigit() else 0
    return (protocol, port)


def build_waypoints(store: KubeStore, settings: MeshSettings) -> dict[str, Waypoint]:
    """Waypoints from Gateway objects, keyed `namespace/name`.

    istiod uses a Gateway only once its status lists an address. On a file-driven control plane
    nobody writes that status, so a Gateway without one falls back to what Istio's gateway
    controller would write: the hostname of the Service of the same name, if that Service exists.
    """
    out: dict[str, Waypoint] = {}
    for gw in store.gateways:
        meta = gw.metadata
        address: wl.GatewayAddress | None = None
        for a in gw.status_addresses:
            if a.type == "Hostname":
                address = wl.GatewayAddress(
                    hostname=wl.NamespacedHostname(namespace=meta.namespace, hostname=a.value),
                    hbone_mtls_port=HBONE_MTLS_PORT,
                )
                break
        if address is None:
            for a in gw.status_addresses:
                if a.type == "IPAddress":
                    try:
                        ip = _ip_bytes(a.value)
                    except ValueError:
                        continue
                    address = wl.GatewayAddress(
                        address=wl.NetworkAddress(network=settings.network, address=ip),
                        hbone_mtls_port=HBONE_MTLS_PORT,
                    )
                    break
        if address is None and not gw.status_addresses:
            if store.get("Service", meta.namespace, meta.name) is not None:
                hostname = f"{meta.name}.{meta.namespace}.svc.{settings.domain_suffix}"
                address = wl.GatewayAddress(
                    hostname=wl.NamespacedHostname(namespace=meta.namespace, hostname=hostname),
                    hbone_mtls_port=HBONE_MTLS_PORT,
                )
        if address is None:
            continue
        binding = _inbound_binding(gw)
        allowed_from, allowed_selector = "Same", None
        listener = None
        if binding is not None:
            if binding[1]:
                listener = next((ln for ln in gw.listeners if ln.port == binding[1]), None)
            elif binding[0] == wl.ApplicationTunnel.PROXY:
                listener = next((ln for ln in gw.listeners if ln.protocol == "istio.io/PROXY"), None)
        if listener is None:
            listener = next((ln for ln in gw.listeners if ln.protocol == "HBONE" and ln.port == 15008), None)
        if listener is not None and listener.allowed_from:
            allowed_from, allowed_selector = listener.allowed_from, listener.allowed_selector
        wp = Waypoint(
            name=meta.name,
            namespace=meta.namespace,
            address=address,
            traffic_type=meta.labels.get(LABEL_WAYPOINT_FOR, "service"),
            allowed_from=allowed_from,
            allowed_selector=allowed_selector,
            binding=binding,
        )
        out[wp.resource_name] = wp
    return out


# -- authorization --------------------------------------------------------------------------------


def _string_matches(values: tuple[str, ...]) -> list[sec.StringMatch]:
    out = []
    for v in values:
        if v == "*":
            m = sec.StringMatch()
            m.presence.SetInParent()
        elif v.startswith("*"):
            m = sec.StringMatch(suffix=v[1:])
        elif v.endswith("*"):
            m = sec.StringMatch(prefix=v[:-1])
        else:
            m = sec.StringMatch(exact=v)
        out.append(m)
    return out


def _service_accounts(values: tuple[str, ...], namespace: str) -> list[sec.ServiceAccountMatch]:
    out = []
    for v in values:
        ns, sep, sa = v.partition("/")
        out.append(
            sec.ServiceAccountMatch(namespace=ns, serviceAccount=sa)
            if sep
            else sec.ServiceAccountMatch(namespace=namespace, serviceAccount=v)
        )
    return out


def _ports(values: tuple[str, ...]) -> list[int]:
    # Unparsable ports are dropped, as istiod does (validation would have rejected them).
    return [int(v) for v in values if v.isdigit() and int(v) <= 65535]


def _ips(values: tuple[str, ...]) -> list[sec.Address]:
    out = []
    for v in values:
        if not v:
            continue
        try:
            if "/" in v:
                net = ipaddress.ip_network(v, strict=False)
                # istiod keeps the address as written, with the prefix length beside it.
                ip = ipaddress.ip_address(v.split("/", 1)[0])
                out.append(sec.Address(address=ip.packed, length=net.prefixlen))
            else:
                ip = ipaddress.ip_address(v)
                out.append(sec.Address(address=ip.packed, length=ip.max_prefixlen))
        except ValueError:
            continue
    return out


def _http_operation_fields(op) -> list[str]:
    names = ("hosts", "notHosts", "methods", "notMethods", "paths", "notPaths")
    values = (op.hosts, op.not_hosts, op.methods, op.not_methods, op.paths, op.not_paths)
    return [n for n, v in zip(names, values, strict=True) if v]


def _http_source_fields(src) -> list[str]:
    names = (
        "remoteIpBlocks",
        "notRemoteIpBlocks",
        "requestPrincipals",
        "notRequestPrincipals",
        "trustDomains",
        "notTrustDomains",
    )
    values = (
        src.remote_ip_blocks,
        src.not_remote_ip_blocks,
        src.request_principals,
        src.not_request_principals,
        src.trust_domains,
        src.not_trust_domains,
    )
    return [n for n, v in zip(names, values, strict=True) if v]


def _convert_rule(
    action: int, rule: AuthorizationRule, namespace: str
) -> tuple[list[sec.Clause] | None, set[str]]:
    """One AuthorizationPolicy rule as the clauses of one wire Rule (istio: Group).

    Returns None for the clauses when the rule must be dropped: an ALLOW rule that needs HTTP
    attributes can never match at L4, so istiod omits it (more restrictive than asked).
    """
    http: set[str] = set()
    to_matches = []
    for op in rule.operations:
        http.update(_http_operation_fields(op))
        to_matches.append(
            sec.Match(destination_ports=_ports(op.ports), not_destination_ports=_ports(op.not_ports))
        )
    from_matches = []
    for src in rule.sources:
        http.update(_http_source_fields(src))
        from_matches.append(
            sec.Match(
                source_ips=_ips(src.ip_blocks),
                not_source_ips=_ips(src.not_ip_blocks),
                namespaces=_string_matches(src.namespaces),
                not_namespaces=_string_matches(src.not_namespaces),
                service_accounts=_service_accounts(src.service_accounts, namespace),
                not_service_accounts=_service_accounts(src.not_service_accounts, namespace),
                principals=_string_matches(src.principals),
                not_principals=_string_matches(src.not_principals),
            )
        )
    clauses = []
    if to_matches:
        clauses.append(sec.Clause(matches=to_matches))
    if from_matches:
        clauses.append(sec.Clause(matches=from_matches))
    for cond in rule.when:
        if cond.key not in L4_WHEN_KEYS:
            http.add(cond.key)
        m = sec.Match()
        # A non-L4 key leaves the match empty: ztunnel skips empty matches, so in a DENY policy
        # the HTTP part is removed (and if nothing else remains, the rule never fires).
        if cond.key == "source.namespace":
            m.namespaces.extend(_string_matches(cond.values))
            m.not_namespaces.extend(_string_matches(cond.not_values))
        elif cond.key == "source.principal":
            m.principals.extend(_string_matches(cond.values))
            m.not_principals.extend(_string_matches(cond.not_values))
        elif cond.key == "source.ip":
            m.source_ips.extend(_ips(cond.values))
            m.not_source_ips.extend(_ips(cond.not_values))
        elif cond.key == "destination.port":
            m.destination_ports.extend(_ports(cond.values))
            m.not_destination_ports.extend(_ports(cond.not_values))
        elif cond.key == "destination.ip":
            m.destination_ips.extend(_ips(cond.values))
            m.not_destination_ips.extend(_ips(cond.not_values))
        clauses.append(sec.Clause(matches=[m]))
    if action == sec.ALLOW and http:
        return None, http
    return clauses, http


def _has_effective_rules(rules) -> bool:
    for rule in rules:
        if not rule.clauses:
            return True
        if all(any(m.ByteSize() for m in clause.matches) for clause in rule.clauses):
            return True
    return False


def convert_authorization_policy(
    policy: AuthorizationPolicy, settings: MeshSettings
) -> tuple[sec.Authorization | None, str | None]:
    """(resource or None when it is not for ztunnel, a status note or None)."""
    meta = policy.metadata
    key = f"AuthorizationPolicy {meta.namespace}/{meta.name}"
    dry_run = meta.annotations.get(ANNOTATION_DRY_RUN, "").lower() in ("1", "t", "true")
    if dry_run and not settings.enable_wds_dry_run:
        return None, f"{key}: dry-run policies are not sent to ztunnel (WDS dry-run support disabled)"
    if policy.target_refs:
        # targetRef(s) bind the policy to a waypoint, not to ztunnel.
        return None, None
    if policy.selector is None:
        scope = sec.GLOBAL if meta.namespace == settings.root_namespace else sec.NAMESPACE
    else:
        scope = sec.WORKLOAD_SELECTOR
    if policy.action not in ("ALLOW", "DENY"):
        return None, f"{key}: ztunnel does not support the {policy.action} action"
    action = sec.ALLOW if policy.action == "ALLOW" else sec.DENY
    out = sec.Authorization(
        name=meta.name, namespace=meta.namespace, scope=scope, action=action, dry_run=dry_run
    )
    http: set[str] = set()
    for rule in policy.rules:
        clauses, found = _convert_rule(action, rule, meta.namespace)
        http |= found
        if clauses is not None:
            out.rules.add().clauses.extend(clauses)
    if not http:
        return out, None
    if action == sec.DENY and not _has_effective_rules(out.rules):
        effect = "with the HTTP attributes removed this DENY policy has no effect at ztunnel"
    elif action == sec.DENY:
        effect = "the DENY policy is enforced without its HTTP parts (more restrictive than asked)"
    else:
        effect = "ALLOW rules using them are omitted (more restrictive than asked)"
    return out, f"{key}: ztunnel does not support HTTP attributes ({', '.join(sorted(http))}); {effect}"


def _mode(pa: PeerAuthentication | None) -> str:
    return "UNSET" if pa is None or pa.mtls_mode is None else pa.mtls_mode


def _deny_without_identity(match: sec.Match | None = None) -> sec.Match:
    m = match if match is not None else sec.Match()
    m.not_principals.add().presence.SetInParent()
    return m


def static_strict_policy(settings: MeshSettings) -> sec.Authorization:
    """Deny any peer without an mTLS identity: what STRICT PeerAuthentication means at L4."""
    out = sec.Authorization(
        name=STATIC_STRICT_POLICY_NAME,
        namespace=settings.root_namespace,
        scope=sec.WORKLOAD_SELECTOR,
        action=sec.DENY,
    )
    out.rules.add().clauses.add().matches.append(_deny_without_identity())
    return out


def _oldest(policies: list[PeerAuthentication]) -> PeerAuthentication | None:
    if not policies:
        return None
    return min(policies, key=lambda p: (p.metadata.creation_timestamp, p.metadata.namespace, p.metadata.name))


def _is_workload_pa(pa: PeerAuthentication) -> bool:
    return pa.selector is not None and bool(pa.selector.match_labels)


def convert_peer_authentication(
    pa: PeerAuthentication,
    namespace_pa: PeerAuthentication | None,
    root_pa: PeerAuthentication | None,
    settings: MeshSettings,
) -> sec.Authorization | None:
    """A workload PeerAuthentication with port-level modes as a DENY policy (istiod's rules).

    Only workload-selector policies outside the root namespace with portLevelMtls are converted;
    everything else is covered by the static strict policy.
    """
    if pa.metadata.namespace == settings.root_namespace or pa.selector is None or not pa.port_level_mtls:
        return None
    mode = _mode(pa)
    ns_mode, root_mode = _mode(namespace_pa), _mode(root_pa)
    clauses: list[sec.Clause] = []
    rules: list[sec.Rule] = []
    if mode == "STRICT":
        clauses.append(sec.Clause(matches=[_deny_without_identity()]))
    found_non_strict = False
    for port in sorted(pa.port_level_mtls):
        port_mode = pa.port_level_mtls[port]
        if port_mode == "STRICT":
            parent_strict = mode == "STRICT" or (
                mode == "UNSET"
                and (
                    (namespace_pa is not None and ns_mode == "STRICT")
                    or (
                        (namespace_pa is None or ns_mode == "UNSET")
                        and root_pa is not None
                        and root_mode == "STRICT"
                    )
                )
            )
            if parent_strict:
                continue
            # Rules are OR-ed, so each STRICT port gets its own.
            rule = sec.Rule()
            rule.clauses.add().matches.append(_deny_without_identity(sec.Match(destination_ports=[port])))
            rules.append(rule)
        elif port_mode in ("PERMISSIVE", "DISABLE"):
            if mode in ("PERMISSIVE", "DISABLE"):
                continue
            if mode == "UNSET" and (
                (namespace_pa is not None and ns_mode != "STRICT")
                or (namespace_pa is None and root_pa is not None and root_mode != "STRICT")
                or (namespace_pa is None and root_pa is None)
            ):
                continue
            found_non_strict = True
            # Deny unless the connection is for this port (no identity needed there).
            clauses.append(sec.Clause(matches=[sec.Match(not_destination_ports=[port])]))
    if mode == "STRICT" and not found_non_strict:
        return None
    if not clauses and not rules:
        return None
    merge_strict = (
        root_pa is not None
        and root_mode == "STRICT"
        and (namespace_pa is None or ns_mode in ("UNSET", "STRICT"))
    ) or (namespace_pa is not None and ns_mode == "STRICT")
    if merge_strict and found_non_strict:
        clauses.append(sec.Clause(matches=[_deny_without_identity()]))
    if clauses:
        rule = sec.Rule()
        rule.clauses.extend(clauses)
        rules.append(rule)
    out = sec.Authorization(
        name=CONVERTED_PEER_AUTHENTICATION_PREFIX + pa.metadata.name,
        namespace=pa.metadata.namespace,
        scope=sec.WORKLOAD_SELECTOR,
        action=sec.DENY,
    )
    out.rules.extend(rules)
    return out


def _namespace_peer_authentications(store: KubeStore) -> dict[str, PeerAuthentication]:
    """Namespace -> its oldest selector-less PeerAuthentication (the namespace-wide one)."""
    by_namespace: dict[str, list[PeerAuthentication]] = {}
    for pa in store.peer_authentications:
        if pa.selector is None:
            by_namespace.setdefault(pa.metadata.namespace, []).append(pa)
    return {ns: oldest for ns, pas in by_namespace.items() if (oldest := _oldest(pas)) is not None}


def effective_peer_authentication_keys(
    policies: list[PeerAuthentication], settings: MeshSettings
) -> list[str]:
    """Keys of the static strict policy and/or a converted port-level policy for one workload."""
    root = settings.root_namespace
    mesh_pa = _oldest([p for p in policies if not _is_workload_pa(p) and p.metadata.namespace == root])
    ns_pa = _oldest([p for p in policies if not _is_workload_pa(p) and p.metadata.namespace != root])
    wl_pa = _oldest([p for p in policies if _is_workload_pa(p) and p.metadata.namespace != root])
    strict = False
    port_key = ""
    if mesh_pa is not None:
        strict = _mode(mesh_pa) == "STRICT"
    if ns_pa is not None and _mode(ns_pa) != "UNSET":
        strict = _mode(ns_pa) == "STRICT"
    if wl_pa is not None:
        mode = _mode(wl_pa)
        if mode == "STRICT":
            strict = True
        if mode in ("PERMISSIVE", "DISABLE"):
            strict = False
        ports = list(wl_pa.port_level_mtls.values())
        converted = f"{wl_pa.metadata.namespace}/{CONVERTED_PEER_AUTHENTICATION_PREFIX}{wl_pa.metadata.name}"
        if ports:
            if mode == "STRICT":
                if any(m in ("PERMISSIVE", "DISABLE") for m in ports):
                    # The converted policy carries the STRICT default itself.
                    port_key, strict = converted, False
            elif mode in ("PERMISSIVE", "DISABLE"):
                if "STRICT" in ports:
                    port_key = converted
            elif strict:
                if "PERMISSIVE" in ports:
                    port_key, strict = converted, False
            else:
                strict = False
                if "STRICT" in ports:
                    port_key = converted
    keys = set()
    if strict:
        keys.add(f"{root}/{STATIC_STRICT_POLICY_NAME}")
    if port_key:
        keys.add(port_key)
    return sorted(keys)


# -- the translation context ----------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class _ServiceInfo:
    service: wl.Service
    # service port -> (port name, target port name or "")
    port_names: dict[int, tuple[str, str]]
    selector: Mapping[str, str]
    source_kind: str  # "Service" or "ServiceEntry"
    creation_timestamp: str

    @property
    def key(self) -> str:
        return f"{self.service.namespace}/{self.service.hostname}"


@dataclass(slots=True, kw_only=True)
class _Context:
    store: KubeStore
    settings: MeshSettings
    waypoints: dict[str, Waypoint] = field(default_factory=dict)
    services: list[_ServiceInfo] = field(default_factory=list)
    policy_selectors: list[tuple[str, str, LabelSelector]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # Per-namespace views built once by `index()`: a workload only ever looks at services and
    # policies of its own namespace (and the root namespace's), so scanning the whole mesh for
    # each of 10,000 pods would dominate the translation.
    _services_by_namespace: dict[str, list[_ServiceInfo]] = field(default_factory=dict)
    _selectors_by_namespace: dict[str, list[tuple[str, str, LabelSelector]]] = field(default_factory=dict)
    _peer_authentications_by_namespace: dict[str, list[PeerAuthentication]] = field(default_factory=dict)

    def index(self) -> None:
        """Group services, selector policies and PeerAuthentications by namespace, keeping order."""
        self._services_by_namespace = {}
        for info in self.services:
            self._services_by_namespace.setdefault(info.service.namespace, []).append(info)
        self._selectors_by_namespace = {}
        for entry in self.policy_selectors:
            if entry[2].match_labels:  # an empty selector attaches to nothing here
                self._selectors_by_namespace.setdefault(entry[0], []).append(entry)
        self._peer_authentications_by_namespace = {}
        for pa in self.store.peer_authentications:
            self._peer_authentications_by_namespace.setdefault(pa.metadata.namespace, []).append(pa)

    # waypoints (waypoints.go)

    def _allows(self, wp: Waypoint, namespace: str) -> bool:
        if wp.allowed_from == "All":
            return True
        if wp.allowed_from == "Selector":
            ns = self.store.namespace(namespace)
            labels = ns.metadata.labels if ns is not None else {}
            return wp.allowed_selector is not None and wp.allowed_selector.matches(labels)
        return wp.namespace == namespace

    def _use_waypoint(self, labels: Mapping[str, str], namespace: str) -> tuple[str | None, bool]:
        value = labels.get(LABEL_USE_WAYPOINT)
        if value is None:
            return None, False
        if value == "none":
            return None, True
        return f"{labels.get(LABEL_USE_WAYPOINT_NAMESPACE, namespace)}/{value}", False

    def waypoint_for_target(self, meta: ObjectMeta, what: str) -> Waypoint | None:
        key, opted_out = self._use_waypoint(meta.labels, meta.namespace)
        if opted_out:
            return None
        if key is None:
            ns = self.store.namespace(meta.namespace)
            if ns is None:
                return None
            key, _ = self._use_waypoint(ns.metadata.labels, meta.namespace)
            if key is None:
                return None
        wp = self.waypoints.get(key)
        if wp is None:
            self.notes.append(f"{what}: waypoint {key} is not ready (no Gateway with an address)")
            return None
        if not self._allows(wp, meta.namespace):
            self.notes.append(f"{what}: waypoint {key} does not allow attachment from {meta.namespace}")
            return None
        return wp

    def waypoint_for_service(self, meta: ObjectMeta, what: str) -> Waypoint | None:
        if meta.labels.get(LABEL_GATEWAY_MANAGED) in MANAGED_BY_MESH_CONTROLLERS:
            return None  # a waypoint or east-west gateway has no waypoint of its own
        wp = self.waypoint_for_target(meta, what)
        if wp is None or wp.traffic_type in ("service", "all"):
            return wp
        self.notes.append(f"{what}: waypoint {wp.resource_name} does not accept service traffic")
        return None

    def compute_waypoint(
        self, meta: ObjectMeta, what: str
    ) -> tuple[wl.ApplicationTunnel | None, Waypoint | None]:
        instance_of = meta.labels.get(LABEL_GATEWAY_NAME)
        if instance_of:
            wp = self.waypoints.get(f"{meta.namespace}/{instance_of}")
            if wp is not None:
                # This workload IS the waypoint; tell ztunnel how to deliver inbound to it.
                if wp.binding is not None:
                    return wl.ApplicationTunnel(protocol=wp.binding[0], port=wp.binding[1]), None
                return None, None
        wp = self.waypoint_for_target(meta, what)
        if wp is None or wp.traffic_type in ("workload", "all"):
            return None, wp
        if LABEL_USE_WAYPOINT in meta.labels:
            self.notes.append(f"{what}: waypoint {wp.resource_name} does not accept workload traffic")
        return None, None

    # services (services.go)

    def services_selecting(
        self, namespace: str, labels: Mapping[str, str], kinds: tuple[str, ...]
    ) -> list[_ServiceInfo]:
        return [
            s
            for s in self._services_by_namespace.get(namespace, ())
            if s.source_kind in kinds and _selects(s.selector, labels)
        ]

    # policies (workloads.go buildWorkloadPolicies)

    def workload_policies(self, labels: Mapping[str, str], namespace: str) -> list[str]:
        root = self.settings.root_namespace
        by_ns = self._selectors_by_namespace
        candidates = by_ns.get(root, []) + (by_ns.get(namespace, []) if namespace != root else [])
        names = sorted(f"{ns}/{name}" for ns, name, sel in candidates if sel.matches(labels))
        # Same order as the store's (namespace-sorted) list; `_oldest` breaks ties on a total key anyway.
        pas = []
        for pns in sorted({root, namespace}):
            for pa in self._peer_authentications_by_namespace.get(pns, ()):
                if pns == root and pa.selector is None:
                    pas.append(pa)
                elif pns == namespace and (pa.selector is None or pa.selector.matches(labels)):
                    pas.append(pa)
        return names + effective_peer_authentication_keys(pas, self.settings)


# -- services -------------------------------------------------------------------------------------


def _traffic_lb(spec_value: str, annotations: list[Mapping[str, str]]) -> wl.LoadBalancing | None:
    value = spec_value
    if value not in ("PreferClose", "PreferSameZone", "PreferSameNode"):
        value = next(
            (a[ANNOTATION_TRAFFIC_DISTRIBUTION] for a in annotations if ANNOTATION_TRAFFIC_DISTRIBUTION in a),
            "",
        )
    value = value.lower()
    if value in ("preferclose", "prefersamezone"):
        return wl.LoadBalancing(
            routing_preference=[wl.LoadBalancing.NETWORK, wl.LoadBalancing.REGION, wl.LoadBalancing.ZONE],
            mode=wl.LoadBalancing.FAILOVER,
        )
    if value == "prefersamenode":
        return wl.LoadBalancing(
            routing_preference=[
                wl.LoadBalancing.NETWORK,
                wl.LoadBalancing.REGION,
                wl.LoadBalancing.ZONE,
                wl.LoadBalancing.SUBZONE,
                wl.LoadBalancing.NODE,
            ],
            mode=wl.LoadBalancing.FAILOVER,
        )
    return None


def _ingress_use_waypoint(labels: Mapping[str, str], ns_labels: Mapping[str, str]) -> bool:
    value = labels.get(LABEL_INGRESS_USE_WAYPOINT, ns_labels.get(LABEL_INGRESS_USE_WAYPOINT))
    return value is not None and value.lower() in ("1", "t", "true")


def _kube_service(ctx: _Context, svc: Service) -> _ServiceInfo | None:
    meta = svc.metadata
    what = f"Service {meta.namespace}/{meta.name}"
    if svc.type == "ExternalName":
        return None  # DNS aliases are left to the upstream resolver, as in istiod
    settings = ctx.settings
    ports = []
    port_names: dict[int, tuple[str, str]] = {}
    for p in svc.ports:
        # The API server defaults a missing targetPort to the port; a named one is resolved per pod.
        target = p.port if p.target_port is None else p.target_port
        ports.append(
            wl.Port(
                service_port=p.port,
                target_port=target if isinstance(target, int) else 0,
                app_protocol=_kube_app_protocol(p.port, p.name, p.protocol, p.app_protocol),
            )
        )
        port_names[p.port] = (p.name, target if isinstance(target, str) else "")
    vips = [ip for ip in (svc.cluster_ips or (svc.cluster_ip,)) if ip and ip != "None"]
    try:
        addresses = [_network_address(ip, settings.network, allow_cidr=False) for ip in vips]
    except ValueError as exc:
        ctx.notes.append(f"{what}: bad cluster IP ({exc}); service skipped")
        return None
    ns = ctx.store.namespace(meta.namespace)
    ns_labels = ns.metadata.labels if ns is not None else {}
    ns_annotations = ns.metadata.annotations if ns is not None else {}
    lb = None
    if svc.internal_traffic_policy == "Local":
        lb = wl.LoadBalancing(routing_preference=[wl.LoadBalancing.NODE], mode=wl.LoadBalancing.STRICT)
    else:
        lb = _traffic_lb(svc.traffic_distribution, [meta.annotations, ns_annotations])
    if svc.publish_not_ready_addresses:
        lb = lb if lb is not None else wl.LoadBalancing()
        lb.health_policy = wl.LoadBalancing.ALLOW_ALL
    families = {1: wl.IPV4_ONLY if svc.ip_families[:1] == ("IPv4",) else wl.IPV6_ONLY, 2: wl.DUAL}
    out = wl.Service(
        name=meta.name,
        namespace=meta.namespace,
        hostname=f"{meta.name}.{meta.namespace}.svc.{settings.domain_suffix}",
        addresses=addresses,
        ports=ports,
        ip_families=families.get(len(svc.ip_families), wl.AUTOMATIC),
        # A Kubernetes Service always owns its hostname.
        canonical=True,
    )
    if lb is not None:
        out.load_balancing.CopyFrom(lb)
    wp = ctx.waypoint_for_service(meta, what)
    if wp is not None:
        out.waypoint.CopyFrom(wp.address)
        out.ingress_use_waypoint = _ingress_use_waypoint(meta.labels, ns_labels)
    return _ServiceInfo(
        service=out,
        port_names=port_names,
        selector=svc.selector,
        source_kind="Service",
        creation_timestamp=meta.creation_timestamp,
    )


def _service_entry_services(ctx: _Context, se: ServiceEntry) -> list[_ServiceInfo]:
    meta = se.metadata
    what = f"ServiceEntry {meta.namespace}/{meta.name}"
    settings = ctx.settings
    try:
        addresses = [_network_address(a, settings.network, allow_cidr=True) for a in se.addresses]
    except ValueError as exc:
        ctx.notes.append(f"{what}: bad address ({exc}); no services built")
        return []
    ports = [
        wl.Port(
            service_port=p.number,
            target_port=p.target_port or p.number,
            app_protocol=_app_protocol(p.protocol),
        )
        for p in se.ports
    ]
    port_names = {p.number: (p.name, "") for p in se.ports}
    lb = None
    if se.resolution == "NONE":
        # Passthrough: ztunnel connects to the original destination, health is moot.
        lb = wl.LoadBalancing(mode=wl.LoadBalancing.PASSTHROUGH, health_policy=wl.LoadBalancing.ALLOW_ALL)
    else:
        ns = ctx.store.namespace(meta.namespace)
        lb = _traffic_lb("", [meta.annotations, ns.metadata.annotations if ns is not None else {}])
    ns = ctx.store.namespace(meta.namespace)
    ns_labels = ns.metadata.labels if ns is not None else {}
    wp = ctx.waypoint_for_service(meta, what)
    out = []
    for host in se.hosts:
        svc = wl.Service(
            name=meta.name,
            namespace=meta.namespace,
            hostname=host,
            addresses=addresses,
            ports=ports,
            subject_alt_names=se.subject_alt_names,
        )
        if lb is not None:
            svc.load_balancing.CopyFrom(lb)
        if wp is not None:
            svc.waypoint.CopyFrom(wp.address)
            svc.ingress_use_waypoint = _ingress_use_waypoint(meta.labels, ns_labels)
        selector = se.workload_selector.match_labels if se.workload_selector is not None else {}
        out.append(
            _ServiceInfo(
                service=svc,
                port_names=port_names,
                selector=selector,
                source_kind="ServiceEntry",
                creation_timestamp=meta.creation_timestamp,
            )
        )
    return out


def _select_services(infos: list[_ServiceInfo]) -> list[_ServiceInfo]:
    """One winner per (hostname, namespace), and one canonical service per hostname.

    A Kubernetes Service wins its namespace; otherwise the oldest ServiceEntry does. The canonical
    one is the Kubernetes Service if any, else the oldest winning ServiceEntry.
    """
    by_host: dict[str, list[_ServiceInfo]] = {}
    for info in infos:
        by_host.setdefault(info.service.hostname, []).append(info)
    out = []

    def age(i: _ServiceInfo) -> tuple[str, str, str]:
        return (i.creation_timestamp, i.service.namespace, i.service.name)

    for host in sorted(by_host):
        best: dict[str, _ServiceInfo] = {}
        for info in sorted(by_host[host], key=age):
            ns = info.service.namespace
            current = best.get(ns)
            if current is None or (info.source_kind == "Service" and current.source_kind != "Service"):
                best[ns] = info
        winners = sorted(best.values(), key=lambda i: (i.source_kind != "Service",) + age(i))
        if winners:
            winners[0].service.canonical = True
        out.extend(sorted(best.values(), key=lambda i: i.service.namespace))
    return out


# -- workloads ------------------------------------------------------------------------------------


def _find_port_name(pod: Pod, name: str) -> int | None:
    for c in pod.containers:
        for p in c.ports:
            if p.name == name and p.protocol == "TCP":
                return p.container_port
    for c in pod.init_containers:
        if c.restart_policy != "Always":
            continue
        for p in c.ports:
            if p.name == name and p.protocol == "TCP":
                return p.container_port
    return None


def _pod_services(pod: Pod, infos: list[_ServiceInfo]) -> dict[str, wl.PortList]:
    out: dict[str, wl.PortList] = {}
    for info in infos:
        pl = wl.PortList()
        for port in info.service.ports:
            target = port.target_port
            named = info.port_names.get(port.service_port)
            if named is not None:
                port_name, target_name = named
                if target_name:
                    resolved = _find_port_name(pod, target_name)
                    if resolved is None:
                        continue  # this pod does not expose the named port: no mapping at all
                    target = resolved
                elif info.source_kind == "ServiceEntry" and port_name:
                    resolved = _find_port_name(pod, port_name)
                    if resolved is not None:
                        target = resolved
                    elif target == 0:
                        target = port.service_port
            pl.ports.add(service_port=port.service_port, target_port=target)
        out[info.key] = pl
    return out


def _entry_services(spec: WorkloadEntrySpec, infos: list[_ServiceInfo]) -> dict[str, wl.PortList]:
    out: dict[str, wl.PortList] = {}
    for info in infos:
        pl = wl.PortList()
        for port in info.service.ports:
            target = port.target_port
            named = info.port_names.get(port.service_port)
            if named is not None:
                port_name, target_name = named
                if info.source_kind == "Service":
                    if target_name:
                        if target_name not in spec.ports:
                            continue
                        target = spec.ports[target_name]
                    elif port_name in spec.ports:
                        target = spec.ports[port_name]
                elif port_name in spec.ports:
                    target = spec.ports[port_name]
                elif target == 0:
                    target = port.service_port
            pl.ports.add(service_port=port.service_port, target_port=target)
        out[info.key] = pl
    return out


def pod_enrolled(pod: Pod, namespace_labels: Mapping[str, str]) -> bool:
    """Whether the node agent would capture this pod (istio-cni's rule)."""
    annotations = pod.metadata.annotations
    if annotations.get(ANNOTATION_REDIRECTION) == "enabled":
        return True  # already enrolled by a real node agent: istiod's own signal
    if ANNOTATION_SIDECAR_STATUS in annotations or pod.host_network:
        return False
    label = pod.metadata.labels.get(LABEL_DATAPLANE_MODE)
    if label is not None:
        return label == "ambient"  # the pod's own label wins; `none` opts out
    return namespace_labels.get(LABEL_DATAPLANE_MODE) == "ambient"


def _set_tunnel(
    w: wl.Workload, labels: Mapping[str, str], annotations: Mapping[str, str], enrolled: bool
) -> None:
    if enrolled or annotations.get(ANNOTATION_REDIRECTION) == "enabled":
        w.tunnel_protocol = wl.HBONE
    if labels.get(LABEL_TUNNEL) == "http":
        # The workload speaks HBONE itself.
        w.tunnel_protocol = wl.HBONE
        w.native_tunnel = True


def _common(
    w: wl.Workload,
    ctx: _Context,
    meta_labels: Mapping[str, str],
    namespace: str,
    waypoint: Waypoint | None,
    app_tunnel: wl.ApplicationTunnel | None,
) -> None:
    w.cluster_id = ctx.settings.cluster_id
    w.trust_domain = _pick_trust_domain(ctx.settings)
    w.authorization_policies.extend(ctx.workload_policies(meta_labels, namespace))
    if waypoint is not None:
        w.waypoint.CopyFrom(waypoint.address)
    if app_tunnel is not None:
        w.application_tunnel.CopyFrom(app_tunnel)


def _pod_workload(ctx: _Context, pod: Pod) -> wl.Workload | None:
    meta = pod.metadata
    what = f"Pod {meta.namespace}/{meta.name}"
    if pod.phase in ("Succeeded", "Failed"):
        return None  # terminal pods are not workloads
    ips = pod.ips
    if not ips:
        return None  # not scheduled or no IP yet
    try:
        addresses = [_ip_bytes(ip) for ip in ips]
    except ValueError as exc:
        ctx.notes.append(f"{what}: bad pod IP ({exc}); workload skipped")
        return None
    infos = ctx.services_selecting(meta.namespace, meta.labels, ("Service", "ServiceEntry"))
    app_tunnel, waypoint = ctx.compute_waypoint(meta, what)
    w = wl.Workload(
        uid=f"{ctx.settings.cluster_id}//Pod/{meta.namespace}/{meta.name}",
        name=meta.name,
        namespace=meta.namespace,
        network=ctx.settings.network,
        addresses=addresses,
        service_account=pod.service_account_name or "default",
        node=pod.node_name,
        status=wl.HEALTHY if pod.ready and not meta.deletion_timestamp else wl.UNHEALTHY,
        workload_type=wl.POD,  # istiod always sends POD here, for compatibility
    )
    _common(w, ctx, meta.labels, meta.namespace, waypoint, app_tunnel)
    for key, pl in _pod_services(pod, infos).items():
        w.services[key].CopyFrom(pl)
    node = ctx.store.node(pod.node_name) if pod.node_name else None
    locality = _locality_from_labels(node.metadata.labels) if node is not None else None
    if locality is not None:
        w.locality.CopyFrom(locality)
    if pod.host_network:
        w.network_mode = wl.HOST_NETWORK
    w.workload_name = pod_workload_name(pod)
    w.canonical_name, w.canonical_revision = canonical_service(meta.labels, w.workload_name)
    ns = ctx.store.namespace(meta.namespace)
    enrolled = pod_enrolled(pod, ns.metadata.labels if ns is not None else {})
    _set_tunnel(w, meta.labels, meta.annotations, enrolled)
    return w


def _set_address(w: wl.Workload, address: str) -> None:
    try:
        w.addresses.append(_ip_bytes(address))
    except ValueError:
        w.hostname = address  # a DNS name: ztunnel resolves it on demand


def _workload_entry_workload(ctx: _Context, we: WorkloadEntry) -> wl.Workload:
    meta = we.metadata
    what = f"WorkloadEntry {meta.namespace}/{meta.name}"
    labels = {**meta.labels, **we.spec.labels}
    infos = ctx.services_selecting(meta.namespace, labels, ("Service", "ServiceEntry"))
    labelled = ObjectMeta(
        name=meta.name, namespace=meta.namespace, labels=labels, annotations=meta.annotations
    )
    app_tunnel, waypoint = ctx.compute_waypoint(labelled, what)
    w = wl.Workload(
        uid=f"{ctx.settings.cluster_id}/networking.istio.io/WorkloadEntry/{meta.namespace}/{meta.name}",
        name=meta.name,
        namespace=meta.namespace,
        network=we.spec.network or ctx.settings.network,
        service_account=we.spec.service_account,
        status=wl.HEALTHY,
        workload_type=wl.POD,
    )
    _common(w, ctx, labels, meta.namespace, waypoint, app_tunnel)
    for key, pl in _entry_services(we.spec, infos).items():
        w.services[key].CopyFrom(pl)
    locality = _locality_from_string(we.spec.locality)
    if locality is not None:
        w.locality.CopyFrom(locality)
    if we.spec.weight > 0:
        w.capacity.CopyFrom(wrappers_pb2.UInt32Value(value=we.spec.weight))
    _set_address(w, we.spec.address)
    w.workload_name = (
        meta.annotations.get(ANNOTATION_AUTO_REGISTRATION_GROUP)
        or labels.get(LABEL_WORKLOAD_NAME)
        or meta.name
    )
    w.canonical_name, w.canonical_revision = canonical_service(labels, w.workload_name)
    _set_tunnel(w, labels, meta.annotations, enrolled=False)
    return w


def _service_entry_workloads(ctx: _Context, se: ServiceEntry, infos: list[_ServiceInfo]) -> list[wl.Workload]:
    meta = se.metadata
    what = f"ServiceEntry {meta.namespace}/{meta.name}"
    endpoints = list(se.endpoints)
    # A DNS ServiceEntry without endpoints or selector has one implicit endpoint per host.
    implicit = (
        not endpoints
        and se.resolution in ("DNS", "DYNAMIC_DNS", "DNS_ROUND_ROBIN")
        and se.workload_selector is None
    )
    if not endpoints and not implicit:
        return []
    mine = [
        i
        for i in infos
        if i.source_kind == "ServiceEntry"
        and i.service.name == meta.name
        and i.service.namespace == meta.namespace
    ]
    if not mine:
        return []
    if implicit:
        endpoints = [WorkloadEntrySpec(address=i.service.hostname) for i in mine]
    out = []
    for index, ep in enumerate(endpoints):
        services = [mine[index]] if implicit else mine
        app_tunnel, waypoint = None, None
        if not implicit:
            ep_meta = ObjectMeta(name=meta.name, namespace=meta.namespace, labels=ep.labels)
            app_tunnel, waypoint = ctx.compute_waypoint(ep_meta, what)
        w = wl.Workload(
            uid=f"{ctx.settings.cluster_id}/networking.istio.io/ServiceEntry/{meta.namespace}/{meta.name}/{ep.address}",
            name=meta.name,
            namespace=meta.namespace,
            network=ep.network or ctx.settings.network,
            service_account=ep.service_account,
            status=wl.HEALTHY,
            workload_type=wl.POD,
        )
        _common(w, ctx, meta.labels, meta.namespace, waypoint, app_tunnel)
        for key, pl in _entry_services(ep, services).items():
            w.services[key].CopyFrom(pl)
        locality = _locality_from_string(ep.locality)
        if locality is not None:
            w.locality.CopyFrom(locality)
        if ep.weight > 0:
            w.capacity.CopyFrom(wrappers_pb2.UInt32Value(value=ep.weight))
        _set_address(w, ep.address)
        w.workload_name = meta.name
        w.canonical_name, w.canonical_revision = canonical_service(meta.labels, meta.name)
        _set_tunnel(w, meta.labels, meta.annotations, enrolled=False)
        out.append(w)
    return out


# -- entry points ---------------------------------------------------------------------------------


def translate_authorizations(
    store: KubeStore, settings: MeshSettings
) -> tuple[dict[str, sec.Authorization], list[tuple[str, str, LabelSelector]], list[str]]:
    """Authorization resources, the selectors of those that attach by label, and notes."""
    out: dict[str, sec.Authorization] = {}
    selectors: list[tuple[str, str, LabelSelector]] = []
    notes: list[str] = []
    for policy in store.authorization_policies:
        pb, note = convert_authorization_policy(policy, settings)
        if note:
            notes.append(note)
        if pb is None:
            continue
        out[f"{pb.namespace}/{pb.name}"] = pb
        if policy.selector is not None:
            selectors.append((policy.metadata.namespace, policy.metadata.name, policy.selector))
    pas = store.peer_authentications
    namespace_wide = _namespace_peer_authentications(store)
    root_pa = namespace_wide.get(settings.root_namespace)
    for pa in pas:
        pb = convert_peer_authentication(pa, namespace_wide.get(pa.metadata.namespace), root_pa, settings)
        if pb is not None:
            out[f"{pb.namespace}/{pb.name}"] = pb
    if pas:
        strict = static_strict_policy(settings)
        out[f"{strict.namespace}/{strict.name}"] = strict
    return out, selectors, notes


def translate(store: KubeStore, settings: MeshSettings | None = None) -> Translation:
    """Everything istiod would serve ztunnel for this snapshot."""
    settings = settings or MeshSettings()
    authorizations, selectors, notes = translate_authorizations(store, settings)
    ctx = _Context(store=store, settings=settings, policy_selectors=selectors, notes=notes)
    ctx.waypoints = build_waypoints(store, settings)
    infos: list[_ServiceInfo] = []
    for svc in store.services:
        info = _kube_service(ctx, svc)
        if info is not None:
            infos.append(info)
    for se in store.service_entries:
        infos.extend(_service_entry_services(ctx, se))
    ctx.services = _select_services(infos)
    ctx.index()
    addresses: dict[str, wl.Address] = {}
    for info in ctx.services:
        addresses[info.key] = wl.Address(service=info.service)
    workloads: list[wl.Workload] = []
    for pod in store.pods:
        w = _pod_workload(ctx, pod)
        if w is not None:
            workloads.append(w)
    for we in store.workload_entries:
        workloads.append(_workload_entry_workload(ctx, we))
    for se in store.service_entries:
        workloads.extend(_service_entry_workloads(ctx, se, ctx.services))
    for w in workloads:
        if w.uid in addresses:
            ctx.notes.append(f"workload {w.uid}: duplicate uid, later one dropped")
            continue
        addresses[w.uid] = wl.Address(workload=w)
    return Translation(addresses=addresses, authorizations=authorizations, notes=tuple(ctx.notes))
