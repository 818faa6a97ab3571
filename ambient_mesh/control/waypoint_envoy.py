"""The Envoy configuration of one waypoint: Listeners, Clusters, ClusterLoadAssignments and
connect_terminate's RouteConfiguration.

Counterpart: istiod pilot/pkg/networking/core/{listener_waypoint.go, cluster_waypoint.go,
waypoint.go} and pilot/pkg/xds/endpoints/endpoint_builder.go, for a single network. The routes
and the HTTP authorization of each HTTP chain come from waypoint_l7.py (translate/http_routes.py,
translate/l7_authz.py; an HTTP port without routes gets istiod's default route), the network
authorization of each TCP chain from translate/tcp_authz.py.

The input is what this control plane already serves ztunnel (`istio.workload.Address`): a
Service whose `waypoint` names this waypoint is served by it (chains by VIP and port), a
Workload whose `waypoint` names it likewise (chains by pod IP), and a service's endpoints are the
workloads listing it in `Workload.services`. The resources are built as the JSON form of the
Envoy v3 messages and parsed into `xds-protos` messages at the end, so the golden files read like
Envoy's own configuration dumps.

Path of one request (docs/architecture.md, "Waypoints"): ztunnel -> `connect_terminate` (15008,
HBONE; its routes pick the internal listener by the CONNECT's target) -> `main_internal`, or
`main_internal_sniffed` for a target of unknown protocol (internal listeners, chain by original
destination) -> HTTP connection manager or TCP proxy -> `inbound-vip|<port>|<http|tcp>|<host>` (EDS; endpoints are the internal
address `connect_originate` with the pod's `ip:targetPort` as original destination) ->
`connect_originate` (internal listener, CONNECT `ip:targetPort`) -> cluster `connect_originate`
(ORIGINAL_DST, port 15008, mTLS h2 with the waypoint's SDS certificate) -> the destination's
node proxy. Workload-addressed (a pod IP): `direct-http` (HTTP connection manager) or
`direct-tcp`, by the protocol the pod's Services give its port or the inspector's verdict ->
cluster `encap` ->
`connect_originate`, to the CONNECT's own target.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

# Every message type named by an `@type` below must be in the descriptor pool before ParseDict.
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2  # noqa: F401
from envoy.extensions.filters.http.set_filter_state.v3 import set_filter_state_pb2  # noqa: F401
from envoy.extensions.filters.listener.http_inspector.v3 import http_inspector_pb2  # noqa: F401
from envoy.extensions.filters.listener.original_dst.v3 import original_dst_pb2  # noqa: F401
from envoy.extensions.filters.network.http_connection_manager.v3 import (  # noqa: F401
    http_connection_manager_pb2,
)
from envoy.extensions.filters.network.set_filter_state.v3 import (  # noqa: F401
    set_filter_state_pb2 as network_set_filter_state_pb2,
)
from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2  # noqa: F401
from envoy.extensions.matching.common_inputs.network.v3 import network_inputs_pb2  # noqa: F401
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2  # noqa: F401
from envoy.extensions.transport_sockets.internal_upstream.v3 import internal_upstream_pb2  # noqa: F401
from envoy.extensions.transport_sockets.raw_buffer.v3 import raw_buffer_pb2  # noqa: F401
from envoy.extensions.transport_sockets.tls.v3 import tls_pb2  # noqa: F401
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2  # noqa: F401
from google.protobuf import json_format, wrappers_pb2  # noqa: F401
from google.protobuf.message import Message
from xds.type.matcher.v3 import ip_pb2  # noqa: F401

from ..ports import HBONE_PORT
from ..wire.istio.workload import workload_pb2 as wl
from .ads_state import CLUSTER_TYPE_URL, ENDPOINT_TYPE_URL, LISTENER_TYPE_URL, ROUTE_TYPE_URL
from .envoy_parse_cache import ParseCache

CONNECT_TERMINATE = "connect_terminate"
MAIN_INTERNAL = "main_internal"
# Targets of unknown protocol: main_internal with an HTTP inspector (`dispatch`).
MAIN_INTERNAL_SNIFFED = "main_internal_sniffed"
CONNECT_ORIGINATE = "connect_originate"
ENCAP = "encap"
# The chains of workload-addressed traffic (istiod's names).
DIRECT_HTTP = "direct-http"
DIRECT_TCP = "direct-tcp"
BLACKHOLE = "BlackHoleCluster"
# SDS names the pod agent serves (Istio's pilot-agent names).
SDS_DEFAULT = "default"
SDS_ROOT = "ROOTCA"
# The bootstrap's cluster that reaches the pod agent's SDS socket (Istio's name).
SDS_CLUSTER = "sds-grpc"

CONNECT_TIMEOUT = "10s"
# istiod: mesh hboneIdleTimeout, default one hour.
HBONE_IDLE_TIMEOUT = "3600s"
ORIGINAL_DST_CLEANUP_INTERVAL = "60s"
# How long main_internal_sniffed's HTTP inspector waits for a client's first bytes on a target
# of unknown protocol before taking the connection as TCP (Envoy's default, 15 s, stalls
# server-first protocols; istiod's protocolDetectionTimeout once defaulted to 100 ms).
SNIFF_TIMEOUT = "1s"
# HTTP/2 keepalive on HBONE termination: a dead node proxy is noticed within half a minute.
HBONE_KEEPALIVE_INTERVAL = "10s"
HBONE_KEEPALIVE_TIMEOUT = "20s"
HBONE_MAX_CONCURRENT_STREAMS = 100

_T = "type.googleapis.com/"
_ORIGINAL_DST = "envoy.filters.listener.original_dst"
_LOCAL_IP_KEY = "envoy.filters.listener.original_dst.local_ip"
_REMOTE_IP_KEY = "envoy.filters.listener.original_dst.remote_ip"
PEER_PRINCIPAL_KEY = "io.istio.peer_principal"
LOCAL_PRINCIPAL_KEY = "io.istio.local_principal"
_HTTP_PROTOCOLS = (wl.HTTP11, wl.HTTP2, wl.GRPC)


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoint:
    """One backend of a service port: the pod's IP and the port its node proxy delivers to."""

    ip: str
    port: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ServicePort:
    """One port of one service this waypoint serves."""

    hostname: str
    vips: tuple[str, ...]
    port: int
    protocol: str  # "http", "tcp" or "auto" (sniffed: HTTP when it looks like HTTP)
    endpoints: tuple[Endpoint, ...]

    def cluster(self, protocol: str) -> str:
        return f"inbound-vip|{self.port}|{protocol}|{self.hostname}"


@dataclass(frozen=True, slots=True, kw_only=True)
class WaypointInputs:
    """Everything one waypoint's configuration is made of, already resolved from the Addresses."""

    trust_domains: tuple[str, ...]
    services: tuple[ServicePort, ...]
    workload_ips: tuple[str, ...]
    # Part 2 hook (waypoint_l7.py): per HTTP chain name, its route configuration (HTTPRoute,
    # VirtualService; None: istiod's default route) and the HTTP filters before the router (RBAC,
    # fault, CORS). A chain not listed keeps the default route and the router alone.
    http_chains: Mapping[str, tuple[Mapping[str, Any] | None, Sequence[Mapping[str, Any]]]] = field(
        default_factory=dict
    )
    # Per TCP chain name (a service's `inbound-vip|<port>|tcp|<host>`, `direct-tcp`): the network
    # filters before the TCP proxy (network RBAC: translate/tcp_authz.py). A chain not listed has
    # the TCP proxy alone.
    tcp_filters: Mapping[str, Sequence[Mapping[str, Any]]] = field(default_factory=dict)
    # Part 2 hook: the access log of every service HTTP chain (Istio's HTTP metrics).
    access_log: Sequence[Mapping[str, Any]] = ()
    # Per workload IP of `workload_ips`: the protocol of each of its ports that a Service port
    # names as a target ((target port, "http", "tcp" or "auto"), ...; `workload_port_protocols`).
    # A port no Service names is TCP.
    workload_ports: Mapping[str, tuple[tuple[int, str], ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class EnvoyResources:
    """One waypoint's resources by type URL and name (Envoy's names are the xDS names)."""

    listeners: Mapping[str, listener_pb2.Listener]
    clusters: Mapping[str, cluster_pb2.Cluster]
    endpoints: Mapping[str, endpoint_pb2.ClusterLoadAssignment]
    routes: Mapping[str, route_pb2.RouteConfiguration]

    def by_type(self) -> dict[str, Mapping[str, Message]]:
        return {
            CLUSTER_TYPE_URL: self.clusters,
            ENDPOINT_TYPE_URL: self.endpoints,
            LISTENER_TYPE_URL: self.listeners,
            ROUTE_TYPE_URL: self.routes,
        }


# ---------------------------------------------------------------------------------------------
# From the served Addresses to one waypoint's inputs


def port_protocol(app_protocol: int) -> str:
    if app_protocol in _HTTP_PROTOCOLS:
        return "http"
    if app_protocol in (wl.TCP, wl.TLS):
        return "tcp"
    return "auto"


def ip_text(raw: bytes) -> str:
    return str(ipaddress.ip_address(raw)) if len(raw) in (4, 16) else ""


def service_ports(service: wl.Service, workloads: Iterable[wl.Workload]) -> list[ServicePort]:
    """The ports of `service` with their healthy endpoints (istiod's endpoint builder: a
    workload's own target port for the service wins over the service's)."""
    key = f"{service.namespace}/{service.hostname}"
    vips = tuple(sorted(ip for ip in (ip_text(a.address) for a in service.addresses) if ip))
    out = []
    for p in service.ports:
        endpoints = set()
        for w in workloads:
            if w.status != wl.HEALTHY or key not in w.services:
                continue
            own = next((q.target_port for q in w.services[key].ports if q.service_port == p.service_port), 0)
            target = own or p.target_port
            if not target:
                continue  # a named target port this pod does not declare
            for raw in w.addresses:
                ip = ip_text(raw)
                if ip:
                    endpoints.add(Endpoint(ip=ip, port=target))
        out.append(
            ServicePort(
                hostname=service.hostname,
                vips=vips,
                port=p.service_port,
                protocol=port_protocol(p.app_protocol),
                endpoints=tuple(sorted(endpoints, key=lambda e: (e.ip, e.port))),
            )
        )
    return out


def workload_port_protocols(
    workload: wl.Workload, services: Mapping[str, wl.Service]
) -> tuple[tuple[int, str], ...]:
    """The protocol of each port of `workload` that one of its Services targets, from that
    Service port's protocol (`services`: by `namespace/hostname`, as `Workload.services` names
    them). Two Service ports that target one pod port with different known protocols leave it
    to the inspector ("auto"), as a Service port of unknown protocol does."""
    found: dict[int, str] = {}
    for key in sorted(workload.services):
        service = services.get(key)
        if service is None:
            continue
        own = {q.service_port: q.target_port for q in workload.services[key].ports}
        for p in service.ports:
            target = own.get(p.service_port) or p.target_port
            if not target or not 0 < target < 65536:
                continue  # a named target port this pod does not declare
            protocol = port_protocol(p.app_protocol)
            before = found.get(target)
            found[target] = protocol if before in (None, protocol) else "auto"
    return tuple(sorted(found.items()))


# ---------------------------------------------------------------------------------------------
# Building blocks


def _typed(type_name: str, **fields: Any) -> dict[str, Any]:
    return {"@type": _T + type_name, **fields}


def _raw_buffer() -> dict[str, Any]:
    return {
        "name": "raw_buffer",
        "typed_config": _typed("envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer"),
    }


def _internal_upstream(passthrough: bool) -> dict[str, Any]:
    config: dict[str, Any] = {"transport_socket": _raw_buffer()}
    if passthrough:
        # Copies the endpoint's original destination to the internal connection, where
        # `connect_originate`'s original_dst filter makes it the local address.
        config["passthrough_metadata"] = [
            {"kind": {"host": {}}, "name": _ORIGINAL_DST},
            {"kind": {"host": {}}, "name": "istio"},
        ]
    return {
        "name": "internal_upstream",
        "typed_config": _typed(
            "envoy.extensions.transport_sockets.internal_upstream.v3.InternalUpstreamTransport", **config
        ),
    }


def _common_tls(trust_domains: Iterable[str]) -> dict[str, Any]:
    # HBONE is TLS 1.3 and h2 only; the peer is checked against the mesh root and its SPIFFE
    # trust domain (any listed domain passes, as istiod lists the domain and its aliases).
    return {
        "alpn_protocols": ["h2"],
        "tls_params": {"tls_minimum_protocol_version": "TLSv1_3", "tls_maximum_protocol_version": "TLSv1_3"},
        "tls_certificate_sds_secret_configs": [{"name": SDS_DEFAULT, "sds_config": _sds_source()}],
        "combined_validation_context": {
            "default_validation_context": {
                "match_typed_subject_alt_names": [
                    {"san_type": "URI", "matcher": {"prefix": f"spiffe://{td}/"}} for td in trust_domains
                ]
            },
            "validation_context_sds_secret_config": {"name": SDS_ROOT, "sds_config": _sds_source()},
        },
    }


def _ads_source() -> dict[str, Any]:
    return {"ads": {}, "resource_api_version": "V3"}


def _sds_source() -> dict[str, Any]:
    # Secrets come from the pod agent over its unix socket (bootstrap cluster `sds-grpc`), never
    # from the control plane: the waypoint's private key does not leave the pod.
    return {
        "api_config_source": {
            "api_type": "GRPC",
            "transport_api_version": "V3",
            "set_node_on_first_message_only": True,
            "grpc_services": [{"envoy_grpc": {"cluster_name": SDS_CLUSTER}}],
        },
        "resource_api_version": "V3",
    }


def _router() -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.router",
        "typed_config": _typed("envoy.extensions.filters.http.router.v3.Router"),
    }


def _listener_filter(name: str, type_name: str) -> dict[str, Any]:
    return {"name": name, "typed_config": _typed(type_name)}


def _string_action(name: str) -> dict[str, Any]:
    return {"action": {"name": name, "typed_config": _typed("google.protobuf.StringValue", value=name)}}


def _input(name: str, type_name: str) -> dict[str, Any]:
    return {
        "name": name,
        "typed_config": _typed("envoy.extensions.matching.common_inputs.network.v3." + type_name),
    }


def _prefix(ip: str) -> dict[str, Any]:
    # `ip` is an address as ip_text writes it: a colon says IPv6.
    return {"address_prefix": ip, "prefix_len": 128 if ":" in ip else 32}


def _packed(ip: str) -> bytes:
    """The address's bytes (ipaddress's `packed`), for ordering; inet_pton is C."""
    return socket.inet_pton(socket.AF_INET6 if ":" in ip else socket.AF_INET, ip)


def _copy_filter_state() -> dict[str, Any]:
    """The CONNECT's target and the client's identity, set by connect_terminate for one hop,
    handed on to the next internal listener."""
    entries = []
    for key, factory in ((_LOCAL_IP_KEY, None), (PEER_PRINCIPAL_KEY, "envoy.string")):
        entry: dict[str, Any] = {
            "object_key": key,
            "format_string": {"text_format_source": {"inline_string": f"%FILTER_STATE({key}:PLAIN)%"}},
            "shared_with_upstream": "ONCE",
        }
        if factory:
            entry["factory_key"] = factory
        entries.append(entry)
    return {
        "name": "connect_authority",
        "typed_config": _typed(
            "envoy.extensions.filters.network.set_filter_state.v3.Config", on_new_connection=entries
        ),
    }


def _tcp_proxy(stat_prefix: str, cluster: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": "envoy.filters.network.tcp_proxy",
        "typed_config": _typed(
            "envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
            stat_prefix=stat_prefix,
            cluster=cluster,
            **extra,
        ),
    }


def _hcm(stat_prefix: str, **fields: Any) -> dict[str, Any]:
    """An HTTP connection manager; `fields` name its routes (`route_config` or `rds`) and more."""
    return {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": _typed(
            "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            stat_prefix=stat_prefix,
            use_remote_address=False,
            http_filters=[_router()],
            **fields,
        ),
    }


# ---------------------------------------------------------------------------------------------
# Listeners


def connect_terminate(trust_domains: Iterable[str]) -> dict[str, Any]:
    set_state = [
        # The CONNECT target becomes main_internal's original destination (VIP:port or pod:port).
        (_LOCAL_IP_KEY, "%REQ(:AUTHORITY)%", None),
        (_REMOTE_IP_KEY, "%DOWNSTREAM_REMOTE_ADDRESS%", None),
        # The client's identity, for L7 policy and metrics on the internal listener.
        (PEER_PRINCIPAL_KEY, "%DOWNSTREAM_PEER_URI_SAN%", "envoy.string"),
        (LOCAL_PRINCIPAL_KEY, "%DOWNSTREAM_LOCAL_URI_SAN%", "envoy.string"),
    ]
    on_request = []
    for key, fmt, factory in set_state:
        entry: dict[str, Any] = {
            "object_key": key,
            "format_string": {"text_format_source": {"inline_string": fmt}},
            "shared_with_upstream": "ONCE",
        }
        if factory:
            entry["factory_key"] = factory
        on_request.append(entry)
    hcm = _hcm(
        CONNECT_TERMINATE,
        # Over RDS, so that a change of which targets are sniffed keeps the open tunnels
        # (`connect_terminate_routes`); istiod inlines one route to main_internal.
        rds={"config_source": _ads_source(), "route_config_name": CONNECT_TERMINATE},
        server_name="istio-envoy",
        forward_client_cert_details="APPEND_FORWARD",
        set_current_client_cert_details={"subject": True, "uri": True, "dns": True},
        stream_idle_timeout="0s",
        upgrade_configs=[{"upgrade_type": "CONNECT"}],
        http2_protocol_options={
            "allow_connect": True,
            "max_concurrent_streams": HBONE_MAX_CONCURRENT_STREAMS,
            "connection_keepalive": {
                "interval": HBONE_KEEPALIVE_INTERVAL,
                "timeout": HBONE_KEEPALIVE_TIMEOUT,
            },
        },
    )
    hcm["typed_config"]["http_filters"] = [
        {
            "name": "connect_authority",
            "typed_config": _typed(
                "envoy.extensions.filters.http.set_filter_state.v3.Config", on_request_headers=on_request
            ),
        },
        _router(),
    ]
    return {
        "name": CONNECT_TERMINATE,
        "address": {"socket_address": {"address": "0.0.0.0", "port_value": HBONE_PORT}},
        "additional_addresses": [
            {"address": {"socket_address": {"address": "::", "port_value": HBONE_PORT}}}
        ],
        "connection_balance_config": {"exact_balance": {}},
        "filter_chains": [
            {
                "name": "default",
                "transport_socket": {
                    "name": "tls",
                    "typed_config": _typed(
                        "envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
                        require_client_certificate=True,
                        common_tls_context=_common_tls(trust_domains),
                    ),
                },
                "filters": [hcm],
            }
        ],
    }


def _default_route(name: str, vhost: str, cluster: str) -> dict[str, Any]:
    """istiod's default route: everything to `cluster`, no timeout, its default retries."""
    return {
        "name": name,
        "validate_clusters": False,
        "virtual_hosts": [
            {
                "name": vhost,
                "domains": ["*"],
                "routes": [
                    {
                        "name": "default",
                        "match": {"prefix": "/"},
                        "route": {
                            "cluster": cluster,
                            "timeout": "0s",
                            "max_grpc_timeout": "0s",
                            # istiod's default retry policy.
                            "retry_policy": {
                                "retry_on": "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes",
                                "num_retries": 2,
                                "host_selection_retry_max_attempts": "5",
                                "retry_host_predicate": [
                                    {
                                        "name": "envoy.retry_host_predicates.previous_hosts",
                                        "typed_config": _typed(
                                            "envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
                                        ),
                                    }
                                ],
                            },
                        },
                    }
                ],
            }
        ],
    }


def _waypoint_hcm(name: str, stat_prefix: str, inputs: WaypointInputs) -> dict[str, Any]:
    """The HTTP connection manager of one inbound HTTP chain, with the chain's HTTP filters and
    the access log from `inputs`. Its routes come over RDS under the chain's name
    (`http_routes_doc`): a change of routes then leaves the chain, and the connections on it,
    as they are (inline routes, as istiod writes a waypoint's, make it a new chain, and Envoy
    closes the old chain's connections when its drain ends)."""
    hcm = _hcm(
        stat_prefix,
        rds={"config_source": _ads_source(), "route_config_name": name},
        server_name="istio-envoy",
        normalize_path=True,
        merge_slashes=True,
        path_with_escaped_slashes_action="KEEP_UNCHANGED",
        forward_client_cert_details="APPEND_FORWARD",
        set_current_client_cert_details={"subject": True, "uri": True, "dns": True},
    )
    # Part 2 hook: this chain's routes, L7 filters and access log (waypoint_l7.py).
    if inputs.access_log:
        hcm["typed_config"]["access_log"] = list(inputs.access_log)
    l7 = inputs.http_chains.get(name)
    if l7 is not None:
        hcm["typed_config"]["http_filters"] = [*l7[1], _router()]
    return hcm


def http_routes_doc(name: str, sp: ServicePort | None, inputs: WaypointInputs) -> dict[str, Any]:
    """The RouteConfiguration of the HTTP chain `name` (a service port's, or `direct-http` when
    `sp` is None): its routes from `inputs.http_chains` (HTTPRoute, VirtualService), else
    istiod's default route, to the service's cluster or, for `direct-http`, to `encap`."""
    l7 = inputs.http_chains.get(name)
    if l7 is not None and l7[0] is not None:
        return dict(l7[0])
    if sp is None:
        return _default_route(name, "inbound|http|direct", ENCAP)
    return _default_route(name, f"inbound|http|{sp.port}", name)


def _http_chain(sp: ServicePort, vip: str, inputs: WaypointInputs) -> dict[str, Any]:
    name = sp.cluster("http")
    return {"name": name, "filters": [_waypoint_hcm(name, f"inbound_{vip}_{sp.port}", inputs)]}


def direct_http_chain(inputs: WaypointInputs) -> dict[str, Any]:
    """`direct-http`: workload-addressed HTTP, with the L7 filters bound to the whole waypoint
    (`inputs.http_chains["direct-http"]`; a Service's routes and policies are not its) and the
    access log, routed to `encap`: connect_originate's CONNECT to the original destination."""
    return {
        "name": DIRECT_HTTP,
        "filters": [_copy_filter_state(), _waypoint_hcm(DIRECT_HTTP, DIRECT_HTTP, inputs)],
    }


def _direct_tcp_chain(inputs: WaypointInputs) -> dict[str, Any]:
    """`direct-tcp`: workload-addressed TCP, with the authorization bound to the whole waypoint
    (`inputs.tcp_filters["direct-tcp"]`), to `encap`."""
    rbac = inputs.tcp_filters.get(DIRECT_TCP, ())
    return {"name": DIRECT_TCP, "filters": [*rbac, _copy_filter_state(), _tcp_proxy(DIRECT_TCP, ENCAP)]}


# (kind "http" or "tcp", service port, VIP for its stats) -> the filter chain, as JSON or parsed.
ChainMaker = Callable[[str, ServicePort, str], Any]


def chain_doc(kind: str, sp: ServicePort, vip: str, inputs: WaypointInputs) -> dict[str, Any]:
    """The filter chain of one service port: HTTP (with its L7 part from `inputs`) or TCP."""
    return _http_chain(sp, vip, inputs) if kind == "http" else _tcp_chain(sp, vip, inputs)


def _tcp_chain(sp: ServicePort, vip: str, inputs: WaypointInputs) -> dict[str, Any]:
    """A service's TCP chain: its authorization (`inputs.tcp_filters`), then the TCP proxy."""
    name = sp.cluster("tcp")
    filters = [*inputs.tcp_filters.get(name, ()), _tcp_proxy(f"inbound_{vip}_{sp.port}", name)]
    return {"name": name, "filters": filters}


def _http_or_tcp(http: str, tcp: str) -> dict[str, Any]:
    """Sniffed: the http_inspector's verdict picks the HTTP chain, anything else is TCP."""
    return {
        "matcher": {
            "matcher_tree": {
                "input": _input("application-protocol", "ApplicationProtocolInput"),
                "exact_match_map": {
                    "map": {"'http/1.1'": _string_action(http), "'h2c'": _string_action(http)}
                },
            },
            "on_no_match": _string_action(tcp),
        }
    }


def _ip_matcher(ranges: list[dict[str, Any]]) -> dict[str, Any]:
    # Anything else (an unknown VIP or port) is closed: istiod's BlackHoleCluster.
    matcher: dict[str, Any] = {"on_no_match": _string_action("blackhole")}
    if ranges:
        matcher["matcher_tree"] = {
            "input": _input("ip", "DestinationIPInput"),
            "custom_match": {
                "name": "ip",
                "typed_config": _typed("xds.type.matcher.v3.IPMatcher", range_matchers=ranges),
            },
        }
    return matcher


def _by_ip(by_ip: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    ranges = []
    for ip in sorted(by_ip, key=_packed):
        ports = dict(by_ip[ip])
        other = ports.pop("*", None)  # every port not listed
        if not ports and other is not None:
            on_match = other
        else:
            on_match = {
                "matcher": {
                    "matcher_tree": {
                        "input": _input("port", "DestinationPortInput"),
                        "exact_match_map": {"map": dict(sorted(ports.items()))},
                    }
                }
            }
            if other is not None:
                on_match["matcher"]["on_no_match"] = other
        ranges.append({"ranges": [_prefix(ip)], "on_match": on_match})
    return ranges


def _blackhole() -> dict[str, Any]:
    return {"name": "blackhole", "filters": [_tcp_proxy(BLACKHOLE, BLACKHOLE)]}


def authority(ip: str, port: int | str) -> str:
    """A CONNECT target as node proxies write it (`ip_text`'s address; IPv6 in brackets)."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _connect_route(cluster: str) -> dict[str, Any]:
    return {
        "match": {"connect_matcher": {}},
        "route": {"cluster": cluster, "upgrade_configs": [{"upgrade_type": "CONNECT", "connect_config": {}}]},
    }


def connect_terminate_routes(sniffed: Iterable[str], known: Iterable[str]) -> dict[str, Any]:
    """`connect_terminate`'s routes (RDS): which internal listener a CONNECT goes to, by its
    target. Targets of unknown protocol (`sniffed`: a service's VIP:port, and `<pod ip>:*` for
    a waypoint's workload) go to main_internal_sniffed, whose HTTP inspector tells HTTP from
    TCP; everything else (`known`: a workload's ports of known protocol, and `*`) to
    main_internal, which has no inspector. Envoy matches exact targets first, then the
    `<ip>:*` prefixes, then `*`."""
    hosts = [
        {"name": MAIN_INTERNAL, "domains": ["*", *sorted(known)], "routes": [_connect_route(MAIN_INTERNAL)]}
    ]
    sniffed = sorted(sniffed)
    if sniffed:
        hosts.append(
            {
                "name": MAIN_INTERNAL_SNIFFED,
                "domains": sniffed,
                "routes": [_connect_route(MAIN_INTERNAL_SNIFFED)],
            }
        )
    return {"name": CONNECT_TERMINATE, "virtual_hosts": hosts}


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Where a CONNECT's target goes: the two internal listeners, and the routes that pick one."""

    main: dict[str, Any]
    sniffed: dict[str, Any]
    routes: dict[str, Any]
    # The HTTP chains placed in either listener, each with the service port it serves (None:
    # direct-http): each takes its routes over RDS under its name (`http_routes_doc`).
    http_chains: tuple[tuple[str, ServicePort | None], ...]


def dispatch(inputs: WaypointInputs, make_chain: ChainMaker | None = None) -> Dispatch:
    """`main_internal` and `main_internal_sniffed`: chains by original destination (IP, then
    port, then in the sniffed listener the HTTP inspector's verdict), and connect_terminate's
    routes, which send each target to the listener of its protocol.

    Targets of known protocol never meet an HTTP inspector (a TCP client that half-closes before
    a line end would be closed by it, and a server-first protocol would wait for it). Targets of
    unknown protocol always do: a service port with neither name nor appProtocol, and, as in
    istiod, every port of a workload that no Service declares HTTP or TCP (`WaypointInputs.
    workload_ports`). Both listeners' listener filters are fixed, so no push replaces a
    listener whole: the set of sniffed targets lives in the routes, which Envoy updates under
    open tunnels. (istiod keeps one listener whose inspector skips known port numbers, and a
    change of that list drains every tunnel; an earlier design of ours sniffed behind a second
    TCP proxy hop, which lost responses whose HTTP connection closed after them:
    docs/architecture.md, "Waypoints".)"""
    chain = make_chain or (lambda kind, sp, vip: chain_doc(kind, sp, vip, inputs))
    main = _Dispatched()
    sniffed = _Dispatched()
    sniffed_targets: set[str] = set()
    known_targets: set[str] = set()
    http_chains: dict[str, ServicePort | None] = {}
    for sp in inputs.services:
        if not sp.vips:
            continue
        stat_vip = sp.vips[0]
        if sp.protocol in ("http", "auto"):
            http_chains[sp.cluster("http")] = sp
        if sp.protocol == "auto":
            for kind in ("http", "tcp"):
                sniffed.add_chain(sp.cluster(kind), partial(chain, kind, sp, stat_vip))
            for vip in sp.vips:
                sniffed.target(vip, str(sp.port), _http_or_tcp(sp.cluster("http"), sp.cluster("tcp")))
                sniffed_targets.add(authority(vip, sp.port))
            continue
        main.add_chain(sp.cluster(sp.protocol), partial(chain, sp.protocol, sp, stat_vip))
        for vip in sp.vips:
            main.target(vip, str(sp.port), _string_action(sp.cluster(sp.protocol)))
    workload_ips = [ip for ip in inputs.workload_ips if ip not in main.by_ip and ip not in sniffed.by_ip]
    if workload_ips:
        # Workload-addressed: straight to the pod through HBONE (`encap`), HTTP on direct-http
        # and TCP on direct-tcp, by the protocol the pod's Services give its port; any other
        # port is sniffed. In main_internal an unlisted port is TCP: only a target Envoy did not
        # match exactly (another spelling of the address) gets there.
        for ip in workload_ips:
            main.target(ip, "*", _string_action(DIRECT_TCP))
            sniffed.target(ip, "*", _http_or_tcp(DIRECT_HTTP, DIRECT_TCP))
            sniffed_targets.add(authority(ip, "*"))
            for port, protocol in inputs.workload_ports.get(ip, ()):
                if protocol == "auto":
                    continue  # sniffed, with the pod's ports no Service names
                known_targets.add(authority(ip, port))
                if protocol == "http":
                    main.target(ip, str(port), _string_action(DIRECT_HTTP))
                    main.add_chain(DIRECT_HTTP, partial(direct_http_chain, inputs))
        main.add_chain(DIRECT_TCP, partial(_direct_tcp_chain, inputs))
        sniffed.add_chain(DIRECT_TCP, partial(_direct_tcp_chain, inputs))
        sniffed.add_chain(DIRECT_HTTP, partial(direct_http_chain, inputs))
        http_chains[DIRECT_HTTP] = None
    inspector = _listener_filter(
        "envoy.filters.listener.http_inspector",
        "envoy.extensions.filters.listener.http_inspector.v3.HttpInspector",
    )
    return Dispatch(
        main=main.listener(MAIN_INTERNAL, []),
        sniffed={
            **sniffed.listener(MAIN_INTERNAL_SNIFFED, [inspector]),
            # A server-first protocol on a sniffed target waits this long for the client's
            # first bytes, then is TCP.
            "listener_filters_timeout": SNIFF_TIMEOUT,
            "continue_on_listener_filters_timeout": True,
        },
        routes=connect_terminate_routes(sniffed_targets, known_targets),
        http_chains=tuple(http_chains.items()),
    )


class _Dispatched:
    """One internal listener's chains and its matcher's table, as `dispatch` fills them."""

    def __init__(self) -> None:
        self.chains: dict[str, Any] = {}
        self.by_ip: dict[str, dict[str, dict[str, Any]]] = {}

    def add_chain(self, name: str, make: Callable[[], Any]) -> None:
        if name not in self.chains:
            self.chains[name] = make()

    def target(self, ip: str, port: str, action: dict[str, Any]) -> None:
        """Send `ip`:`port` (`*`: its every other port) to `action`."""
        self.by_ip.setdefault(ip, {})[port] = action

    def listener(self, name: str, inspectors: list[dict[str, Any]]) -> dict[str, Any]:
        chains = {**self.chains, "blackhole": _blackhole()}
        return {
            "name": name,
            "internal_listener": {},
            "traffic_direction": "INBOUND",
            "listener_filters": [
                _listener_filter(
                    _ORIGINAL_DST, "envoy.extensions.filters.listener.original_dst.v3.OriginalDst"
                ),
                *inspectors,
            ],
            "filter_chain_matcher": _ip_matcher(_by_ip(self.by_ip)),
            "filter_chains": [chains[n] for n in sorted(chains)],
        }


def connect_originate_listener() -> dict[str, Any]:
    return {
        "name": CONNECT_ORIGINATE,
        "use_original_dst": False,
        "internal_listener": {},
        "listener_filters": [
            _listener_filter(_ORIGINAL_DST, "envoy.extensions.filters.listener.original_dst.v3.OriginalDst")
        ],
        "filter_chains": [
            {
                "filters": [
                    _tcp_proxy(
                        CONNECT_ORIGINATE,
                        CONNECT_ORIGINATE,
                        tunneling_config={"hostname": "%DOWNSTREAM_LOCAL_ADDRESS%"},
                    )
                ]
            }
        ],
    }


# ---------------------------------------------------------------------------------------------
# Clusters and endpoints


def _static_internal(name: str, listener: str) -> dict[str, Any]:
    return {
        "name": name,
        "type": "STATIC",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {"envoy_internal_address": {"server_listener_name": listener}}
                            }
                        }
                    ]
                }
            ],
        },
        "transport_socket": _internal_upstream(passthrough=False),
    }


def connect_originate_cluster(trust_domains: Iterable[str]) -> dict[str, Any]:
    return {
        "name": CONNECT_ORIGINATE,
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": CONNECT_TIMEOUT,
        "cleanup_interval": ORIGINAL_DST_CLEANUP_INTERVAL,
        "original_dst_lb_config": {
            "upstream_port_override": HBONE_PORT,
            "metadata_key": {"key": _ORIGINAL_DST, "path": [{"key": "waypoint"}]},
        },
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": _typed(
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                common_http_protocol_options={"idle_timeout": HBONE_IDLE_TIMEOUT},
                explicit_http_config={"http2_protocol_options": {"allow_connect": True}},
            )
        },
        "transport_socket": {
            "name": "tls",
            "typed_config": _typed(
                "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                common_tls_context=_common_tls(trust_domains),
            ),
        },
    }


def _eds_cluster(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "type": "EDS",
        "eds_cluster_config": {"eds_config": _ads_source(), "service_name": name},
        "connect_timeout": CONNECT_TIMEOUT,
        "transport_socket": _internal_upstream(passthrough=True),
    }


def _load_assignment(name: str, endpoints: Iterable[Endpoint]) -> dict[str, Any]:
    lb = []
    for e in endpoints:
        target = authority(e.ip, e.port)
        lb.append(
            {
                "endpoint": {
                    "address": {
                        "envoy_internal_address": {
                            "server_listener_name": CONNECT_ORIGINATE,
                            "endpoint_id": target,
                        }
                    }
                },
                "metadata": {"filter_metadata": {_ORIGINAL_DST: {"local": target}}},
            }
        )
    return {"cluster_name": name, "endpoints": [{"lb_endpoints": lb}] if lb else []}


# ---------------------------------------------------------------------------------------------
# The whole


def build_resources(inputs: WaypointInputs, cache: ParseCache | None = None) -> EnvoyResources:
    """The Listeners, Clusters and ClusterLoadAssignments of one waypoint (with `cache`, the
    resources of its previous build whose inputs did not change are neither built nor parsed
    again: `_cached_build`)."""
    if cache is not None:  # part 2 hook: envoy_parse_cache.py
        return _cached_build(inputs, cache)
    targets = dispatch(inputs)
    listeners = [
        connect_terminate(inputs.trust_domains),
        targets.main,
        targets.sniffed,
        connect_originate_listener(),
    ]
    clusters = _fixed_clusters(inputs)
    assignments = []
    for name, sp in _eds_clusters(inputs):
        clusters.append(_eds_cluster(name))
        assignments.append(_load_assignment(name, sp.endpoints))
    return EnvoyResources(
        listeners={d["name"]: _parse(d, listener_pb2.Listener()) for d in listeners},
        clusters={d["name"]: _parse(d, cluster_pb2.Cluster()) for d in clusters},
        endpoints={d["cluster_name"]: _parse(d, endpoint_pb2.ClusterLoadAssignment()) for d in assignments},
        routes={
            CONNECT_TERMINATE: _parse(targets.routes, route_pb2.RouteConfiguration()),
            **{
                name: _parse(http_routes_doc(name, sp, inputs), route_pb2.RouteConfiguration())
                for name, sp in targets.http_chains
            },
        },
    )


def _fixed_clusters(inputs: WaypointInputs) -> list[dict[str, Any]]:
    return [
        _static_internal(MAIN_INTERNAL, MAIN_INTERNAL),
        _static_internal(MAIN_INTERNAL_SNIFFED, MAIN_INTERNAL_SNIFFED),
        _static_internal(ENCAP, CONNECT_ORIGINATE),
        connect_originate_cluster(inputs.trust_domains),
        {"name": BLACKHOLE, "type": "STATIC", "connect_timeout": CONNECT_TIMEOUT},
    ]


def _eds_clusters(inputs: WaypointInputs) -> list[tuple[str, ServicePort]]:
    return [
        (sp.cluster(protocol), sp)
        for sp in inputs.services
        for protocol in ("http", "tcp")
        if sp.protocol in (protocol, "auto")
    ]


def _cached_build(inputs: WaypointInputs, cache: ParseCache) -> EnvoyResources:
    """`build_resources` with each service's chains, cluster and endpoints taken from `cache`
    by what they are made of (held to the uncached build by tests/unit/control/
    test_envoy_parse_cache.py)."""

    def make_chain(kind: str, sp: ServicePort, vip: str) -> Any:
        l7 = inputs.http_chains.get(sp.cluster("http")) if kind == "http" else None
        if kind == "http":
            # The chain holds the filters; its routes are a resource of their own.
            held: tuple[object, ...] = (l7[1] if l7 is not None else None, inputs.access_log)
        else:
            held = (inputs.tcp_filters.get(sp.cluster("tcp")),)
        return cache.memo(
            ("chain", kind, sp, vip),
            held,
            lambda: chain_doc(kind, sp, vip, inputs),
            listener_components_pb2.FilterChain,
        )

    targets = dispatch(inputs, make_chain)
    listeners = [
        connect_terminate(inputs.trust_domains),
        targets.main,
        targets.sniffed,
        connect_originate_listener(),
    ]
    clusters = {d["name"]: cache.parse(d, cluster_pb2.Cluster) for d in _fixed_clusters(inputs)}
    endpoints: dict[str, endpoint_pb2.ClusterLoadAssignment] = {}
    for name, sp in _eds_clusters(inputs):
        clusters[name] = cache.memo(("eds", name), (), partial(_eds_cluster, name), cluster_pb2.Cluster)
        endpoints[name] = cache.memo(
            ("endpoints", name, sp.endpoints),
            (),
            partial(_load_assignment, name, sp.endpoints),
            endpoint_pb2.ClusterLoadAssignment,
        )
    resources = EnvoyResources(
        listeners={
            d["name"]: cache.parse_listener(d, listener_pb2.Listener, listener_components_pb2.FilterChain)
            for d in listeners
        },
        clusters=clusters,
        endpoints=endpoints,
        routes={
            CONNECT_TERMINATE: cache.parse(targets.routes, route_pb2.RouteConfiguration),
            **{
                name: cache.memo(
                    ("routes", name, sp),
                    (_routes_of(inputs, name),),
                    partial(http_routes_doc, name, sp, inputs),
                    route_pb2.RouteConfiguration,
                )
                for name, sp in targets.http_chains
            },
        },
    )
    cache.end_build()
    return resources


def _routes_of(inputs: WaypointInputs, name: str) -> object:
    """The route object an HTTP chain's RouteConfiguration is made of (None: the default)."""
    l7 = inputs.http_chains.get(name)
    return l7[0] if l7 is not None else None


def _parse(doc: dict[str, Any], message: Any) -> Any:
    json_format.ParseDict(doc, message)
    return message
