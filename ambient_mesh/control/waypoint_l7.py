"""The L7 part of each waypoint's configuration: routes (HTTPRoute, VirtualService) and L7
authorization (AuthorizationPolicy with targetRefs) per HTTP chain, and the same policies with
TCP semantics per TCP chain (translate/tcp_authz.py).

Counterpart: what istiod's waypoint listener builder reads beside the services
(listener_waypoint.go: the VirtualServices of each service, the policies attached to the
waypoint). The route objects are indexed by the service hostname they route
(translate/http_routes.py), so a changed route names the hostnames, and through them the
waypoints, that must be built again; `WaypointIndex` asks this for the HTTP chains of one
waypoint while it builds it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

# Types named by an `@type` below must be in the descriptor pool when the listener is parsed.
from envoy.extensions.access_loggers.grpc.v3 import als_pb2  # noqa: F401

from ..kube.model import AuthorizationPolicy, HTTPRoute, ObjectKey, VirtualService
from ..kube.store import KubeStore
from .translate.common import MeshSettings
from .translate.http_routes import (
    CORS_FILTER,
    FAULT_FILTER,
    RouteTable,
    cluster_resolver,
    mixed_note,
    notes,
    route_configuration,
)
from .translate.l7_authz import Attachment, applies, attachments, policy_notes, rbac_filters
from .translate.tcp_authz import network_rbac_filters
from .waypoint_envoy import DIRECT_HTTP, DIRECT_TCP, ServicePort

log = logging.getLogger(__name__)

# The waypoint agent's access-log cluster (waypoint/bootstrap.py ALS_CLUSTER): every request of a
# service's HTTP chain is sent to the agent, which keeps Istio's HTTP metrics from it.
ALS_CLUSTER = "als-grpc"
ACCESS_LOG_NAME = "istio-http-metrics"
ACCESS_LOG_FLUSH = "0.25s"
ROUTE_CLUSTER_TAG = "route_cluster"
ACCESS_LOG: tuple[dict[str, Any], ...] = (
    {
        "name": "envoy.access_loggers.http_grpc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            "common_config": {
                "log_name": ACCESS_LOG_NAME,
                "grpc_service": {"envoy_grpc": {"cluster_name": ALS_CLUSTER}},
                "transport_api_version": "V3",
                "buffer_flush_interval": ACCESS_LOG_FLUSH,
                "filter_state_objects_to_log": ["io.istio.peer_principal"],
                # The route's cluster, known even when no upstream host was picked (a request
                # the waypoint answers itself), where the entry's `upstream_cluster` is empty.
                "custom_tags": [{"tag": ROUTE_CLUSTER_TAG, "value": "%UPSTREAM_CLUSTER_RAW%"}],
            },
            "additional_request_headers_to_log": ["content-type"],
            # `grpc_response_status`: from the trailers, else the headers of a trailers-only
            # reply (waypoint/telemetry.py, `grpc_response_status`).
            "additional_response_headers_to_log": ["grpc-status"],
            "additional_response_trailers_to_log": ["grpc-status"],
        },
    },
)

_T = "type.googleapis.com/"

HttpChain = tuple[Mapping[str, Any] | None, Sequence[Mapping[str, Any]]]
HttpChains = dict[str, HttpChain]


def _filter(name: str, type_name: str) -> dict[str, Any]:
    return {"name": name, "typed_config": {"@type": _T + type_name}}


class WaypointL7:
    """Route objects by hostname, and the HTTP chains they make for one waypoint."""

    def __init__(self, settings: MeshSettings) -> None:
        self.settings = settings
        self.domain_suffix = settings.domain_suffix
        self.routes = RouteTable(settings.domain_suffix)
        self.notes: dict[ObjectKey, tuple[str, ...]] = {}
        # targetRef policies: the object (compared by identity) and where it binds.
        self.policies: dict[ObjectKey, tuple[AuthorizationPolicy, list[Attachment]]] = {}
        # Built once per set of bound policies (every chain of a waypoint usually shares one),
        # and per chain while its rules and the waypoint's services stay the same.
        self._rbac: dict[tuple[int, ...], tuple[tuple[AuthorizationPolicy, ...], list[dict[str, Any]]]] = {}
        self._tcp_rbac: dict[
            tuple[int, ...], tuple[tuple[AuthorizationPolicy, ...], list[dict[str, Any]]]
        ] = {}
        self._chains: dict[str, tuple[tuple[Any, ...], object, Any]] = {}
        self._owned: tuple[tuple[str, tuple[int, ...]], ...] = ()
        # Per chain name: what its output was made of (compared by identity), and the output.
        self._out: dict[str, tuple[tuple[object, ...], HttpChain]] = {}
        # Hostnames routed by both kinds, with the objects (said once per change).
        self._mixed: dict[str, tuple[str, ...]] = {}

    def __repr__(self) -> str:
        return f"WaypointL7({len(self.routes)} route objects, {len(self.policies)} targetRef policies)"

    def update_policies(self, store: KubeStore, changed: Iterable[ObjectKey] | None = None) -> bool:
        """Follow the targetRef AuthorizationPolicies of `store`; True when one changed."""
        if changed is None:
            keys = {k for k in store.keys() if k[0] == "AuthorizationPolicy"} | set(self.policies)
        else:
            keys = {k for k in changed if k[0] == "AuthorizationPolicy"}
        moved = False
        for key in keys:
            obj = store.get(*key)
            old = self.policies.get(key)
            if old is not None and old[0] is obj:
                continue
            if isinstance(obj, AuthorizationPolicy) and obj.target_refs:
                self.policies[key] = (
                    obj,
                    attachments(obj, self.settings.root_namespace, self.settings.domain_suffix),
                )
                moved = True
                found = policy_notes(obj)
                if found != self.notes.get(key):
                    for note in found:
                        log.warning("not served: %s", note)
                self.notes[key] = found
            elif old is not None:
                del self.policies[key]
                self.notes.pop(key, None)
                moved = True
        return moved

    def update(self, store: KubeStore, changed: Iterable[ObjectKey] | None = None) -> set[str]:
        """Follow the route objects of `store`; returns the service hostnames whose chains may differ."""
        changed = list(changed) if changed is not None else None
        hosts = self.routes.update(store, changed)
        for host in sorted(hosts):
            mixed = self.routes.mixed(host)
            if mixed != self._mixed.get(host, ()):
                if mixed:
                    log.warning("not served as written: %s", mixed_note(host, mixed))
                self._mixed[host] = mixed
        keys = [
            k
            for k in (changed if changed is not None else store.keys())
            if k[0] in ("HTTPRoute", "VirtualService")
        ]
        for key in keys:
            obj = store.get(*key)
            if isinstance(obj, HTTPRoute | VirtualService):
                found = notes(obj)
                if found != self.notes.get(key):
                    for note in found:
                        log.warning("not served: %s", note)
                self.notes[key] = found
            else:
                self.notes.pop(key, None)
        return hosts

    def http_chains(self, waypoint: tuple[str, str], services: Sequence[ServicePort]) -> HttpChains:
        """Per HTTP chain of `waypoint` (namespace, gateway name) with a route or a policy: its
        route configuration (None: the default route) and filters; `direct-http` (workload-
        addressed HTTP) when a policy binds the whole waypoint. An unchanged chain is the
        same tuple object as in the previous call, so the build memo (envoy_parse_cache.py) can
        tell it by identity."""
        waypoint_namespace = waypoint[0]
        owned: dict[str, list[int]] = {}
        for sp in services:
            if sp.protocol in ("http", "auto"):
                owned.setdefault(sp.hostname, []).append(sp.port)
        owned_now = tuple((h, tuple(p)) for h, p in sorted(owned.items()))
        if owned_now != self._owned:
            self._owned = owned_now  # a new object: chains built for the old services miss
        owned_key: object = self._owned
        wide, by_service = self._bound(waypoint)
        wide_filters = self._rbac_filters(wide)
        out: HttpChains = {}
        chains: dict[str, tuple[tuple[object, ...], HttpChain]] = {}
        for sp in services:
            if sp.protocol not in ("http", "auto"):
                continue
            rules = self.routes.rules(sp.hostname, sp.port, waypoint_namespace)
            bound = by_service.get(sp.hostname, wide)
            if not rules and not bound:
                continue
            name = sp.cluster("http")
            rbac = wide_filters if bound is wide else self._rbac_filters(bound)
            route_config = None
            fault = cors = False
            if rules:
                chain = self._route_configuration(name, sp, rules, owned, owned_key)
                route_config = chain.route_config
                fault, cors = chain.needs_fault, chain.needs_cors
            parts = (route_config, rbac, fault, cors)
            hit = self._kept(name, parts)
            if hit is not None:
                out[name] = hit[1]
                chains[name] = hit
                continue
            # istiod's order: authorization, then fault and CORS, then the router.
            filters: list[Mapping[str, Any]] = list(rbac)
            if fault:
                filters.append(_filter(FAULT_FILTER, "envoy.extensions.filters.http.fault.v3.HTTPFault"))
            if cors:
                filters.append(_filter(CORS_FILTER, "envoy.extensions.filters.http.cors.v3.Cors"))
            out[name] = (route_config, filters)
            chains[name] = (parts, out[name])
        if wide:
            # Workload-addressed HTTP (`direct-http`): the policies bound to the whole waypoint,
            # as istiod's direct chain has no service to bind the others by; no routes (an
            # HTTPRoute's or VirtualService's parent is a Service).
            parts = (None, wide_filters, False, False)
            chains[DIRECT_HTTP] = self._kept(DIRECT_HTTP, parts) or (parts, (None, list(wide_filters)))
            out[DIRECT_HTTP] = chains[DIRECT_HTTP][1]
        self._out = chains
        live = set(out)
        for gone in [n for n in self._chains if n not in live]:
            del self._chains[gone]
        return out

    def tcp_filters(
        self, waypoint: tuple[str, str], services: Sequence[ServicePort]
    ) -> dict[str, list[dict[str, Any]]]:
        """Per TCP chain of `waypoint` with a bound policy: its network RBAC filters, bound as
        the HTTP chains' are (a Service's policies to that service's chain, the waypoint's and
        the class's to every chain and to `direct-tcp`). One set of bound policies gives the
        same list object while it holds, so the build memo can tell an unchanged chain."""
        wide, by_service = self._bound(waypoint)
        out: dict[str, list[dict[str, Any]]] = {}
        for sp in services:
            if sp.protocol not in ("tcp", "auto"):
                continue
            bound = by_service.get(sp.hostname, wide)
            if bound:
                out[sp.cluster("tcp")] = self._tcp_rbac_filters(bound)
        if wide:
            out[DIRECT_TCP] = self._tcp_rbac_filters(wide)
        return out

    def _bound(
        self, waypoint: tuple[str, str]
    ) -> tuple[list[AuthorizationPolicy], dict[str, list[AuthorizationPolicy]]]:
        """The policies bound to the whole `waypoint`, and per service hostname named by a
        policy, the policies bound to that service's chains (the whole waypoint's included)."""
        wide: list[AuthorizationPolicy] = []
        by_service: dict[str, list[AuthorizationPolicy]] = {}
        for policy, where in self.policies.values():
            if applies(where, waypoint, ""):
                wide.append(policy)
            else:
                for a in where:
                    if a.service:
                        by_service.setdefault(a.service, [])
        for host in by_service:
            by_service[host] = [p for p, where in self.policies.values() if applies(where, waypoint, host)]
        return wide, by_service

    def _kept(self, name: str, parts: tuple[object, ...]) -> tuple[tuple[object, ...], HttpChain] | None:
        """The previous call's chain `name` when it was made of the same objects as `parts`."""
        hit = self._out.get(name)
        if (
            hit is not None
            and len(hit[0]) == len(parts)
            and all(a is b for a, b in zip(hit[0], parts, strict=True))
        ):
            return hit
        return None

    def _rbac_filters(self, bound: list[AuthorizationPolicy]) -> list[dict[str, Any]]:
        return self._memo_filters(self._rbac, bound, rbac_filters)

    def _tcp_rbac_filters(self, bound: list[AuthorizationPolicy]) -> list[dict[str, Any]]:
        return self._memo_filters(self._tcp_rbac, bound, network_rbac_filters)

    @staticmethod
    def _memo_filters(
        memo: dict[tuple[int, ...], tuple[tuple[AuthorizationPolicy, ...], list[dict[str, Any]]]],
        bound: list[AuthorizationPolicy],
        build: Callable[[Sequence[AuthorizationPolicy]], list[dict[str, Any]]],
    ) -> list[dict[str, Any]]:
        key = tuple(sorted(id(p) for p in bound))
        hit = memo.get(key)
        if hit is not None and len(hit[0]) == len(bound) and all(any(p is q for q in hit[0]) for p in bound):
            return hit[1]
        filters = build(bound)
        if len(memo) > 256:  # a few sets per waypoint; start again rather than grow
            memo.clear()
        memo[key] = (tuple(bound), filters)
        return filters

    def _route_configuration(
        self,
        name: str,
        sp: ServicePort,
        rules: Sequence[Any],
        owned: Mapping[str, Sequence[int]],
        owned_key: object,
    ) -> Any:
        kept = tuple(b.rule for b in rules)
        hit = self._chains.get(name)
        if (
            hit is not None
            and hit[1] is owned_key
            and len(hit[0]) == len(kept)
            and all(a is b for a, b in zip(hit[0], kept, strict=True))
        ):
            return hit[2]
        cluster_of = cluster_resolver(owned, sp.hostname, sp.port, self.domain_suffix)
        chain = route_configuration(name, sp.port, rules, cluster_of)
        # Compared by identity: an unchanged route object keeps its rule objects.
        self._chains[name] = (kept, owned_key, chain)
        return chain
