"""The L7 part of each waypoint's configuration: routes (HTTPRoute, VirtualService) per HTTP chain.

Counterpart: what istiod's waypoint listener builder reads beside the services
(listener_waypoint.go: the VirtualServices of each service, the policies attached to the
waypoint). The route objects are indexed by the service hostname they route
(translate/http_routes.py), so a changed route names the hostnames, and through them the
waypoints, that must be built again; `WaypointIndex` asks this for the HTTP chains of one
waypoint while it builds it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..kube.objects import HTTPRoute, KubeStore, ObjectKey, VirtualService
from .translate.http_routes import (
    CORS_FILTER,
    FAULT_FILTER,
    RouteTable,
    cluster_resolver,
    notes,
    route_configuration,
)
from .waypoint_envoy import ServicePort

log = logging.getLogger(__name__)

_T = "type.googleapis.com/"

HttpChains = dict[str, tuple[Mapping[str, Any], Sequence[Mapping[str, Any]]]]


def _filter(name: str, type_name: str) -> dict[str, Any]:
    return {"name": name, "typed_config": {"@type": _T + type_name}}


class WaypointL7:
    """Route objects by hostname, and the HTTP chains they make for one waypoint."""

    def __init__(self, domain_suffix: str) -> None:
        self.domain_suffix = domain_suffix
        self.routes = RouteTable(domain_suffix)
        self.notes: dict[ObjectKey, tuple[str, ...]] = {}

    def __repr__(self) -> str:
        return f"WaypointL7({len(self.routes)} route objects)"

    def update(self, store: KubeStore, changed: Iterable[ObjectKey] | None = None) -> set[str]:
        """Follow `store`; returns the service hostnames whose chains may differ."""
        hosts = self.routes.update(store, changed)
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

    def http_chains(self, waypoint_namespace: str, services: Sequence[ServicePort]) -> HttpChains:
        """Per HTTP chain with at least one route: its route configuration and filters."""
        owned: dict[str, list[int]] = {}
        for sp in services:
            if sp.protocol in ("http", "auto"):
                owned.setdefault(sp.hostname, []).append(sp.port)
        out: HttpChains = {}
        for sp in services:
            if sp.protocol not in ("http", "auto"):
                continue
            rules = self.routes.rules(sp.hostname, sp.port, waypoint_namespace)
            if not rules:
                continue
            name = sp.cluster("http")
            cluster_of = cluster_resolver(owned, sp.hostname, sp.port, self.domain_suffix)
            chain = route_configuration(name, sp.port, rules, cluster_of)
            filters: list[Mapping[str, Any]] = []
            if chain.needs_fault:
                filters.append(_filter(FAULT_FILTER, "envoy.extensions.filters.http.fault.v3.HTTPFault"))
            if chain.needs_cors:
                filters.append(_filter(CORS_FILTER, "envoy.extensions.filters.http.cors.v3.Cors"))
            out[name] = (chain.route_config, filters)
        return out
