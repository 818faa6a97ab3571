"""`/config_dump` in ztunnel's JSON shape.

Counterparts: ztunnel src/admin.rs (`ConfigDump`, `CertsDump`, `dump_certs`) and the serde derives of
src/state/workload.rs, src/state/service.rs and src/rbac.rs (docs/istio-behaviour.md, "Local config file" and
"Admin and readiness"). `istioctl ztunnel-config` and our `ambient ztunnel-config` read this.

Each function maps one of our frozen values to the dict serde would print for ztunnel's type:
the same keys, the same key order, and the same omissions (serde's `skip_serializing_if`), so
a dump from either proxy reads the same. Where ztunnel iterates a HashMap (endpoints, ports,
policies) we sort, so that the dump is deterministic and can be compared with a golden file.
"""

from __future__ import annotations

import base64
import logging
import platform
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any

from cryptography import x509

from ..config import ProxyWorkloadInfo
from ..errors import AmbientError
from ..rbac import Authorization, Match, ServiceAccountMatch, StringMatch, StringMatchKind
from .localconfig import LocalConfig, parse_local_config
from .model import (
    ApplicationTunnel,
    Endpoint,
    GatewayAddress,
    IpFamilies,
    LoadBalancing,
    Locality,
    Service,
    Visibility,
    Workload,
)
from .store import ProxyState

log = logging.getLogger("ambient_mesh.state.dump")

JSON = dict[str, Any]

_PEM_END = b"-----END CERTIFICATE-----"
_PEM_BEGIN = b"-----BEGIN CERTIFICATE-----"


# -- workloads -----------------------------------------------------------------------------------


def dump_gateway(gateway: GatewayAddress) -> JSON:
    # ztunnel's `gatewayaddress::Destination` is serde-untagged: either "network/ip" or
    # "namespace/hostname", both as one string.
    return {"destination": str(gateway.destination), "hboneMtlsPort": gateway.hbone_mtls_port}


def _locality(locality: Locality) -> JSON:
    return {"region": locality.region, "zone": locality.zone, "subzone": locality.subzone}


def _app_tunnel(tunnel: ApplicationTunnel) -> JSON:
    # ztunnel holds the port as Option<u16>: 0 on the wire becomes None, printed as null.
    return {"protocol": tunnel.protocol.value, "port": tunnel.port or None}


def dump_workload(w: Workload) -> JSON:
    """One workload as ztunnel's `Workload` serializes (field order and omissions as serde's)."""
    out: JSON = {"workloadIps": [str(ip) for ip in w.workload_ips]}
    if w.waypoint is not None:
        out["waypoint"] = dump_gateway(w.waypoint)
    if w.network_gateway is not None:
        out["networkGateway"] = dump_gateway(w.network_gateway)
    out["protocol"] = w.protocol.value
    out["networkMode"] = w.network_mode.value
    if w.uid:
        out["uid"] = w.uid
    out["name"] = w.name
    out["namespace"] = w.namespace
    for key, value in (
        ("trustDomain", w.trust_domain),
        ("serviceAccount", w.service_account),
        ("network", w.network),
        ("workloadName", w.workload_name),
        ("workloadType", w.workload_type.value),
        ("canonicalName", w.canonical_name),
        ("canonicalRevision", w.canonical_revision),
        ("hostname", w.hostname),
        ("node", w.node),
    ):
        if value:
            out[key] = value
    if w.native_tunnel:
        out["nativeTunnel"] = True
    if w.application_tunnel is not None:
        out["applicationTunnel"] = _app_tunnel(w.application_tunnel)
    if w.authorization_policies:
        out["authorizationPolicies"] = list(w.authorization_policies)
    out["status"] = w.status.value
    out["clusterId"] = w.cluster_id
    if w.locality != Locality():
        out["locality"] = _locality(w.locality)
    if w.services:
        # ztunnel's state keeps only the service names here (`Vec<NamespacedHostname>`); the
        # per-service port maps live in each service's `endpoints`, and in `staticConfig`.
        out["services"] = sorted(w.services)
    out["capacity"] = w.capacity
    return out


def dump_workloads(state: ProxyState) -> list[JSON]:
    """`workloads`: every workload, sorted by uid (the store iterates in uid order)."""
    return [dump_workload(w) for w in state.workloads]


# -- services ------------------------------------------------------------------------------------


def _port_map(ports: Mapping[int, int]) -> dict[str, int]:
    # JSON object keys are strings; serde_json prints a HashMap<u16, u16> the same way.
    return {str(port): target for port, target in sorted(ports.items())}


def dump_endpoint(endpoint: Endpoint) -> JSON:
    return {
        "workloadUid": endpoint.workload_uid,
        "port": _port_map(endpoint.port),
        "status": endpoint.status.value,
    }


def _load_balancer(lb: LoadBalancing) -> JSON:
    return {
        "routingPreferences": [scope.value for scope in lb.routing_preferences],
        "mode": lb.mode.value,
        "healthPolicy": lb.health_policy.value,
    }


def dump_service(s: Service) -> JSON:
    """One service as ztunnel's `Service` serializes."""
    out: JSON = {
        "name": s.name,
        "namespace": s.namespace,
        "hostname": s.hostname,
        "vips": [str(vip) for vip in s.vips],
        "ports": _port_map(s.ports),
        "endpoints": {uid: dump_endpoint(s.endpoints[uid]) for uid in sorted(s.endpoints)},
        "subjectAltNames": list(s.subject_alt_names),
    }
    if s.waypoint is not None:
        out["waypoint"] = dump_gateway(s.waypoint)
    if s.load_balancer is not None:
        out["loadBalancer"] = _load_balancer(s.load_balancer)
    # ztunnel holds Option<IpFamily>, None for AUTOMATIC, and omits it then.
    if s.ip_families is not IpFamilies.AUTOMATIC:
        out["ipFamilies"] = s.ip_families.value
    out["canonical"] = s.canonical
    # Fields ztunnel's dump does not (yet) show but our model holds: printed only when set, so
    # a dump of a plain mesh has exactly ztunnel's keys.
    if s.cidr_vips:
        out["cidrVips"] = [{"network": network, "cidr": str(cidr)} for network, cidr in s.cidr_vips]
    if s.weighted_waypoints:
        out["weightedWaypoints"] = [
            {"destination": dump_gateway(ww.destination), "weight": ww.weight} for ww in s.weighted_waypoints
        ]
    if s.visibility is not Visibility.PUBLIC:
        out["visibility"] = s.visibility.value
    return out


def dump_services(state: ProxyState) -> list[JSON]:
    """`services`: every service, sorted by hostname (then namespace: ServiceEntry may repeat one)."""
    return [dump_service(s) for s in sorted(state.services, key=lambda s: (s.hostname, s.namespace))]


def dump_staged_services(state: ProxyState) -> dict[str, dict[str, JSON]]:
    """`stagedServices`: endpoints that workloads declared for services not received yet."""
    keys = sorted({key for w in state.workloads for key in w.services if key not in state.services})
    out: dict[str, dict[str, JSON]] = {}
    for key in keys:
        endpoints = state.services.staged_endpoints(key)
        if endpoints:
            out[key] = {
                ep.workload_uid: dump_endpoint(ep) for ep in sorted(endpoints, key=lambda e: e.workload_uid)
            }
    return out


# -- authorization -------------------------------------------------------------------------------


def _string_match(m: StringMatch) -> JSON:
    # serde's externally tagged enum; ztunnel's `Presence()` is an empty tuple variant: [].
    if m.kind is StringMatchKind.PRESENCE:
        return {"Presence": []}
    return {m.kind.value: m.value}


def _sa_match(m: ServiceAccountMatch) -> JSON:
    return {"namespace": m.namespace, "serviceAccount": m.service_account}


def dump_match(m: Match) -> JSON:
    """ztunnel's `RbacMatch`: empty lists are left out."""
    fields: tuple[tuple[str, list[Any]], ...] = (
        ("namespaces", [_string_match(x) for x in m.namespaces]),
        ("notNamespaces", [_string_match(x) for x in m.not_namespaces]),
        ("serviceAccounts", [_sa_match(x) for x in m.service_accounts]),
        ("notServiceAccounts", [_sa_match(x) for x in m.not_service_accounts]),
        ("principals", [_string_match(x) for x in m.principals]),
        ("notPrincipals", [_string_match(x) for x in m.not_principals]),
        ("sourceIps", [str(x) for x in m.source_ips]),
        ("notSourceIps", [str(x) for x in m.not_source_ips]),
        ("destinationIps", [str(x) for x in m.destination_ips]),
        ("notDestinationIps", [str(x) for x in m.not_destination_ips]),
        ("destinationPorts", list(m.destination_ports)),
        ("notDestinationPorts", list(m.not_destination_ports)),
    )
    return {key: values for key, values in fields if values}


def dump_policy(p: Authorization) -> JSON:
    """ztunnel's `Authorization`: rules are three nested lists, rule -> clause -> match."""
    return {
        "name": p.name,
        "namespace": p.namespace,
        "scope": p.scope.value,
        "action": p.action.value,
        "rules": [[[dump_match(m) for m in clause.matches] for clause in rule.clauses] for rule in p.rules],
        "dryRun": p.dry_run,
    }


def dump_policies(state: ProxyState) -> dict[str, JSON]:
    """`policies`: by key (`namespace/name`)."""
    return {key: dump_policy(state.policies[key]) for key in sorted(state.policies)}


# -- static config -------------------------------------------------------------------------------


def dump_local_config(local: LocalConfig) -> JSON:
    """`staticConfig`: the local file as ztunnel's `LocalConfig` prints it.

    Unlike in `workloads`, a local workload's `services` is the full map from the file:
    `{"namespace/hostname": {service port: target port}}` (ztunnel's `LocalWorkload`).
    """
    workloads = []
    for w in local.workloads:
        entry = dump_workload(w)
        entry.pop("services", None)
        entry["services"] = {key: _port_map(ports) for key, ports in sorted(w.services.items())}
        workloads.append(entry)
    return {
        "workloads": workloads,
        "services": [dump_service(s) for s in local.services],
        "policies": [dump_policy(p) for p in local.policies],
    }


def dump_static_config(read_source: Callable[[], tuple[str, str] | None]) -> JSON | None:
    """`staticConfig`: the local config read again, as ztunnel's /config_dump handler does.

    `read_source` is the program's reader (`ZtunnelConfig.local_config_source`: the text and its
    name, None when there is none); state/ reads no files. None also when it can no longer be
    read or parsed (the error is logged: the dump must still answer, and the running state is in
    `workloads`/`services`/`policies` anyway).
    """
    try:
        source = read_source()
        if source is None:
            return None
        local = parse_local_config(*source)
    except AmbientError as err:
        log.error("config_dump: cannot re-read the local config: %s", err)
        return None
    return dump_local_config(local)


# -- version -------------------------------------------------------------------------------------


def build_info(version: str) -> JSON:
    """`version`: ztunnel's `BuildInfo` keys where we have a value; `pythonVersion` stands where
    ztunnel has `rustVersion`. Git details are not known to an installed package, so not shown."""
    return {"version": version, "pythonVersion": platform.python_version(), "implementation": "ambient-mesh"}


# -- certificates --------------------------------------------------------------------------------


def split_pems(bundle: bytes) -> list[bytes]:
    """The PEM certificates of a bundle, each ending with a newline."""
    parts = []
    for chunk in bundle.split(_PEM_END):
        start = chunk.find(_PEM_BEGIN)
        if start >= 0:
            parts.append(chunk[start:] + _PEM_END + b"\n")
    return parts


def _rfc3339(moment: datetime) -> str:
    # chrono's to_rfc3339_opts(Secs, true): whole seconds, `Z` for UTC.
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def dump_cert(pem: bytes) -> JSON:
    """ztunnel's `CertDump`: base64 of the PEM text, the serial in decimal (istioctl parses it
    as base 10 and prints hex), validity in RFC 3339."""
    cert = x509.load_pem_x509_certificate(pem)
    return {
        "pem": base64.b64encode(pem).decode("ascii"),
        "serialNumber": str(cert.serial_number),
        "validFrom": _rfc3339(cert.not_valid_before_utc),
        "expirationTime": _rfc3339(cert.not_valid_after_utc),
    }


def dump_certificates(states: Iterable[Any]) -> list[JSON]:
    """`certificates`: one entry per identity the SecretManager holds, sorted by identity.

    `states` are `identity.manager.CertificateState` values (identity, state, cert); typed
    loosely because `state` sits below `identity.manager` in the package layering.
    """
    out = []
    for cs in sorted(states, key=lambda c: str(c.identity)):
        entry: JSON = {"identity": str(cs.identity), "state": cs.state, "certChain": [], "rootCerts": []}
        if cs.cert is not None and cs.state == "Available":
            entry["certChain"] = [dump_cert(pem) for pem in cs.cert.chain_pem]
            entry["rootCerts"] = [dump_cert(pem) for pem in split_pems(cs.cert.roots_pem)]
        out.append(entry)
    return out


# -- workload state (our dedicated mode, in ztunnel's shared-mode shape) -------------------------


def _connection(info: Mapping[str, Any]) -> JSON:
    return {key: info[key] for key in ("src", "originalDst", "actualDst", "protocol") if key in info}


def dump_workload_state(
    *,
    served: Workload | None,
    info: ProxyWorkloadInfo | None,
    inbound: Iterable[Mapping[str, Any]],
    outbound: Iterable[Mapping[str, Any]],
) -> dict[str, JSON]:
    """`workloadState`: ztunnel prints this in shared mode, one entry per pod it serves.

    A dedicated proxy serves one workload, so we print one entry: keyed by its uid and `Up`
    once the state knows it; keyed by PROXY_WORKLOAD_INFO and `Pending` until then.
    """
    if served is None and info is None:
        return {}
    if served is not None:
        key, state = served.uid, "Up"
        who = {"name": served.name, "namespace": served.namespace, "serviceAccount": served.service_account}
    else:
        assert info is not None
        key, state = str(info), "Pending"
        who = {"name": info.name, "namespace": info.namespace, "serviceAccount": info.service_account}
    return {
        key: {
            "state": state,
            "info": who,
            "connections": {
                "inbound": [_connection(c) for c in inbound],
                "outbound": [_connection(c) for c in outbound],
            },
        }
    }


__all__ = [
    "build_info",
    "dump_cert",
    "dump_certificates",
    "dump_endpoint",
    "dump_gateway",
    "dump_local_config",
    "dump_match",
    "dump_policies",
    "dump_policy",
    "dump_service",
    "dump_services",
    "dump_staged_services",
    "dump_static_config",
    "dump_workload",
    "dump_workload_state",
    "dump_workloads",
    "split_pems",
]
