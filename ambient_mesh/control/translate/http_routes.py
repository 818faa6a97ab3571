"""HTTPRoute and VirtualService -> the Envoy RouteConfiguration of one waypoint HTTP chain.

Counterpart: istiod pilot/pkg/networking/core/{listener_waypoint.go, route/route.go} and
pilot/pkg/config/kube/gateway/conversion.go. An HTTPRoute whose parent is a Service is read in
VirtualService form (kube/parse_gateway.py converts it as istiod does, with gateway semantics); the
waypoint takes every route for one of its services that lives in the service's namespace or the
waypoint's, HTTPRoute rules first (ordered by Gateway API precedence: exact path, then regex,
then the longest prefix, then method, header and query-parameter counts, then the oldest route),
then VirtualServices by age, drops matches on `sourceLabels`, and stops after the first catch-all.
With no route, the chain keeps istiod's default route to its own cluster.

The output is the JSON form of `envoy.config.route.v3.RouteConfiguration`, inlined in the chain's
HTTP connection manager (waypoints use no RDS).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Types named by an `@type` below must be in the descriptor pool when the listener is parsed.
from envoy.extensions.filters.http.cors.v3 import cors_pb2  # noqa: F401
from envoy.extensions.filters.http.fault.v3 import fault_pb2  # noqa: F401

from ...kube.model import (
    HeaderOps,
    HTTPRoute,
    HttpRouteRule,
    ObjectKey,
    RouteDestination,
    RouteMatch,
    StringMatch,
    VirtualService,
)
from ...kube.store import KubeStore

FAULT_FILTER = "envoy.filters.http.fault"
CORS_FILTER = "envoy.filters.http.cors"
UNKNOWN_CLUSTER = "UnknownService"
_T = "type.googleapis.com/"
# Envoy refuses a direct response body above 4 KiB unless the route configuration raises it.
ENVOY_DEFAULT_BODY_LIMIT = 4096
MAX_DIRECT_BODY = 1024 * 1024
DEFAULT_RETRY_ON = "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes"
_REDIRECT_CODES = {
    301: "MOVED_PERMANENTLY",
    302: "FOUND",
    303: "SEE_OTHER",
    307: "TEMPORARY_REDIRECT",
    308: "PERMANENT_REDIRECT",
}
ROUTE_KINDS = ("HTTPRoute", "VirtualService")


def _typed(type_name: str, **fields: Any) -> dict[str, Any]:
    return {"@type": _T + type_name, **fields}


def _seconds(ms: int) -> str:
    return f"{ms / 1000:.3f}".rstrip("0").rstrip(".") + "s"


def fqdn(host: str, namespace: str, domain_suffix: str) -> str:
    """A route's host as the service hostname it names (`web` -> `web.<ns>.svc.<suffix>`)."""
    host = host.lower().rstrip(".")
    parts = host.split(".")
    if len(parts) == 1:
        return f"{host}.{namespace}.svc.{domain_suffix}"
    if len(parts) == 2:
        return f"{host}.svc.{domain_suffix}"
    if len(parts) == 3 and parts[2] == "svc":
        return f"{host}.{domain_suffix}"
    return host


def namespace_of(service_fqdn: str) -> str:
    parts = service_fqdn.split(".")
    return parts[1] if len(parts) > 2 else ""


# ---------------------------------------------------------------------------------------------
# Which rules apply to one service port, in order


@dataclass(frozen=True, slots=True)
class BoundRule:
    """One rule of one route object, as it applies to one chain."""

    rule: HttpRouteRule
    gateway_semantics: bool
    source: str  # "HTTPRoute ns/name" or "VirtualService ns/name", for reports


RouteObject = HTTPRoute | VirtualService


class RouteTable:
    """The HTTPRoutes and VirtualServices by the service hostname they route, kept per change."""

    def __init__(self, domain_suffix: str) -> None:
        self.domain_suffix = domain_suffix
        self._objects: dict[ObjectKey, RouteObject] = {}
        self._hosts: dict[ObjectKey, frozenset[str]] = {}
        self._by_host: dict[str, set[ObjectKey]] = {}

    def __len__(self) -> int:
        return len(self._objects)

    def hosts_of(self, obj: RouteObject) -> frozenset[str]:
        if isinstance(obj, HTTPRoute):
            return frozenset(fqdn(p.name, p.namespace, self.domain_suffix) for p in obj.parents)
        if obj.gateways and "mesh" not in obj.gateways:
            return frozenset()
        return frozenset(
            fqdn(h, obj.metadata.namespace, self.domain_suffix) for h in obj.hosts if "*" not in h
        )

    def update(self, store: KubeStore, changed: Iterable[ObjectKey] | None = None) -> set[str]:
        """Follow `store`; returns the hostnames whose routes may have changed."""
        if changed is None:
            keys = {k for k in store.keys() if k[0] in ROUTE_KINDS} | set(self._objects)
        else:
            keys = {k for k in changed if k[0] in ROUTE_KINDS}
        touched: set[str] = set()
        for key in keys:
            obj = store.get(*key)
            old = self._objects.get(key)
            if obj is old:
                continue
            if old is not None:
                for host in self._hosts.pop(key, frozenset()):
                    touched.add(host)
                    names = self._by_host.get(host)
                    if names is not None:
                        names.discard(key)
                        if not names:
                            del self._by_host[host]
                del self._objects[key]
            if isinstance(obj, HTTPRoute | VirtualService):
                self._objects[key] = obj
                hosts = self.hosts_of(obj)
                self._hosts[key] = hosts
                for host in hosts:
                    touched.add(host)
                    self._by_host.setdefault(host, set()).add(key)
        return touched

    def mixed(self, host: str) -> tuple[str, ...]:
        """The route objects of `host` when both kinds route it (else ())."""
        objs = [self._objects[k] for k in sorted(self._by_host.get(host, ()))]
        if len({o.kind for o in objs}) < 2:
            return ()
        return tuple(f"{o.kind} {o.metadata.namespace}/{o.metadata.name}" for o in objs)

    def rules(self, host: str, port: int, waypoint_namespace: str) -> list[BoundRule]:
        """The rules for `host`:`port` in the order Envoy tries them, up to the first catch-all."""
        keys = self._by_host.get(host)
        if not keys:
            return []
        service_ns = namespace_of(host)
        gateway: list[tuple[tuple[Any, ...], BoundRule]] = []
        mesh: list[tuple[tuple[Any, ...], BoundRule]] = []
        for key in keys:
            obj = self._objects[key]
            ns = obj.metadata.namespace
            if ns not in (service_ns, waypoint_namespace):
                continue
            age = (obj.metadata.creation_timestamp or "~", ns, obj.metadata.name)
            source = f"{obj.kind} {ns}/{obj.metadata.name}"
            if isinstance(obj, HTTPRoute):
                if not any(
                    fqdn(p.name, p.namespace, self.domain_suffix) == host and p.port in (0, port)
                    for p in obj.parents
                ):
                    continue
                for i, rule in enumerate(obj.http):
                    gateway.append(((_precedence(rule.matches[0]), age, i), BoundRule(rule, True, source)))
            else:
                for i, rule in enumerate(obj.http):
                    mesh.append(((age, i), BoundRule(rule, False, source)))
        out: list[BoundRule] = []
        for _, bound in sorted(gateway, key=lambda e: e[0]) + sorted(mesh, key=lambda e: e[0]):
            matches = _usable_matches(bound.rule, port)
            if matches is None:
                continue  # every match was dropped: the rule never applies here
            out.append(bound)
            if not matches or any(_catch_all(m) for m in matches):
                break
        return out


def _precedence(m: RouteMatch) -> tuple[Any, ...]:
    path = m.path or StringMatch(kind="prefix", value="/")
    kind = {"exact": 0, "regex": 1, "prefix": 2}[path.kind]
    return (kind, -len(path.value), 0 if m.method else 1, -len(m.headers), -len(m.query_params))


def _usable_matches(rule: HttpRouteRule, port: int) -> tuple[RouteMatch, ...] | None:
    """The rule's matches a waypoint honours on `port` (empty: matches everything; None: none)."""
    if not rule.matches:
        return ()
    kept = tuple(m for m in rule.matches if not m.source_labels and m.port in (0, port))
    return kept or None


def _catch_all(m: RouteMatch) -> bool:
    return (
        (m.path is None or (m.path.kind == "prefix" and m.path.value == "/"))
        and not m.headers
        and not m.query_params
        and not m.method
    )


# ---------------------------------------------------------------------------------------------
# Envoy's route configuration


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpChainRoutes:
    """What one HTTP chain carries: its route configuration and the HTTP filters it needs."""

    route_config: Mapping[str, Any]
    needs_fault: bool = False
    needs_cors: bool = False


ClusterOf = Callable[[RouteDestination], str]


def _string_match(m: StringMatch, *, ignore_case: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"safe_regex": {"regex": m.value}} if m.kind == "regex" else {m.kind: m.value}
    if ignore_case and m.kind != "regex":
        out["ignore_case"] = True
    return out


def _match(m: RouteMatch | None, gateway_semantics: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    path = m.path if m is not None else None
    if path is None:
        out["prefix"] = "/"
    elif path.kind == "exact":
        out["path"] = path.value
    elif path.kind == "regex":
        out["safe_regex"] = {"regex": path.value}
    elif gateway_semantics and path.value.rstrip("/"):
        out["path_separated_prefix"] = path.value.rstrip("/")
    else:
        out["prefix"] = path.value
    if m is None:
        return out
    if m.ignore_uri_case:
        out["case_sensitive"] = False
    headers = [{"name": name, "string_match": _string_match(sm)} for name, sm in m.headers]
    if m.method:
        headers.append({"name": ":method", "string_match": {"exact": m.method}})
    if headers:
        out["headers"] = sorted(headers, key=lambda h: h["name"])
    if m.query_params:
        out["query_parameters"] = [{"name": n, "string_match": _string_match(sm)} for n, sm in m.query_params]
    return out


def _header_fields(ops: HeaderOps, direction: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    add = [
        {"header": {"key": k, "value": v}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"} for k, v in ops.set
    ] + [{"header": {"key": k, "value": v}, "append_action": "APPEND_IF_EXISTS_OR_ADD"} for k, v in ops.add]
    if add:
        out[f"{direction}_headers_to_add"] = add
    if ops.remove:
        out[f"{direction}_headers_to_remove"] = list(ops.remove)
    return out


def _merge(a: HeaderOps, b: HeaderOps) -> HeaderOps:
    return HeaderOps(set=a.set + b.set, add=a.add + b.add, remove=a.remove + b.remove)


def _fraction(percent: float) -> dict[str, Any]:
    return {"numerator": round(percent * 10_000), "denominator": "MILLION"}


def _retry_policy(rule: HttpRouteRule) -> dict[str, Any] | None:
    r = rule.retries
    predicate = [
        {
            "name": "envoy.retry_host_predicates.previous_hosts",
            "typed_config": _typed("envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"),
        }
    ]
    if r is None:
        return {
            "retry_on": DEFAULT_RETRY_ON,
            "num_retries": 2,
            "host_selection_retry_max_attempts": "5",
            "retry_host_predicate": predicate,
        }
    if r.attempts == 0:
        return None
    on = list(r.retry_on) or DEFAULT_RETRY_ON.split(",")
    if r.codes and "retriable-status-codes" not in on:
        on.append("retriable-status-codes")
    policy: dict[str, Any] = {
        "retry_on": ",".join(on),
        "num_retries": r.attempts,
        "host_selection_retry_max_attempts": "5",
        "retry_host_predicate": predicate,
    }
    if r.codes:
        policy["retriable_status_codes"] = list(r.codes)
    if r.per_try_timeout_ms is not None:
        policy["per_try_timeout"] = _seconds(r.per_try_timeout_ms)
    if r.backoff_ms:
        policy["retry_back_off"] = {"base_interval": _seconds(r.backoff_ms)}
    return policy


def _rewrite(rule: HttpRouteRule, m: RouteMatch | None, gateway_semantics: bool) -> dict[str, Any]:
    rw = rule.rewrite
    out: dict[str, Any] = {}
    if rw is None:
        return out
    if rw.host:
        out["host_rewrite_literal"] = rw.host
    if rw.full_path is not None:
        out["regex_rewrite"] = {"pattern": {"regex": "/.*"}, "substitution": rw.full_path}
    elif rw.regex is not None:
        out["regex_rewrite"] = {"pattern": {"regex": rw.regex[0]}, "substitution": rw.regex[1]}
    elif rw.prefix is not None:
        matched = m.path if m is not None else None
        if (
            gateway_semantics
            and rw.prefix == "/"
            and matched is not None
            and matched.kind == "prefix"
            and matched.value.rstrip("/")
        ):
            # `/v1` -> `/` must give `/items`, not `//items`, for `/v1/items`.
            out["regex_rewrite"] = {
                "pattern": {"regex": f"^{re.escape(matched.value.rstrip('/'))}(/?)(.*)"},
                "substitution": "/\\2",
            }
        else:
            out["prefix_rewrite"] = rw.prefix
    return out


def _route_action(
    rule: HttpRouteRule, m: RouteMatch | None, gateway_semantics: bool, cluster_of: ClusterOf
) -> dict[str, Any]:
    action: dict[str, Any] = {}
    dests = [d for d in rule.destinations if d.weight != 0]
    if len(rule.destinations) == 1:
        action["cluster"] = cluster_of(rule.destinations[0])
    else:
        clusters = []
        for d in dests:
            entry: dict[str, Any] = {"name": cluster_of(d), "weight": d.weight if d.weight is not None else 1}
            entry.update(_header_fields(d.request_headers, "request"))
            entry.update(_header_fields(d.response_headers, "response"))
            clusters.append(entry)
        action["weighted_clusters"] = {"clusters": clusters}
    if gateway_semantics:
        action["cluster_not_found_response_code"] = "INTERNAL_SERVER_ERROR"
    timeout = _seconds(rule.timeout_ms) if rule.timeout_ms is not None else "0s"
    action["timeout"] = timeout
    action["max_grpc_timeout"] = timeout
    retry = _retry_policy(rule)
    if retry is not None:
        action["retry_policy"] = retry
    action.update(_rewrite(rule, m, gateway_semantics))
    if rule.mirrors:
        mirrors = []
        for mirror in rule.mirrors:
            entry = {"cluster": cluster_of(mirror.destination)}
            if mirror.percent < 100:
                entry["runtime_fraction"] = {"default_value": _fraction(mirror.percent)}
            mirrors.append(entry)
        action["request_mirror_policies"] = mirrors
    return action


def _redirect(rule: HttpRouteRule) -> dict[str, Any]:
    r = rule.redirect
    assert r is not None
    out: dict[str, Any] = {"response_code": _REDIRECT_CODES.get(r.code, "MOVED_PERMANENTLY")}
    if r.scheme:
        out["scheme_redirect"] = r.scheme
    if r.host:
        out["host_redirect"] = r.host
    if r.port:
        out["port_redirect"] = r.port
    if r.path:
        out["path_redirect"] = r.path
    elif r.prefix:
        out["prefix_rewrite"] = r.prefix
    return out


def _per_filter(rule: HttpRouteRule) -> dict[str, Any]:
    out: dict[str, Any] = {}
    f = rule.fault
    if f is not None and (f.delay_ms is not None or f.abort_status is not None):
        fault: dict[str, Any] = {}
        if f.delay_ms is not None:
            fault["delay"] = {"fixed_delay": _seconds(f.delay_ms), "percentage": _fraction(f.delay_percent)}
        if f.abort_status is not None:
            fault["abort"] = {"http_status": f.abort_status, "percentage": _fraction(f.abort_percent)}
        out[FAULT_FILTER] = _typed("envoy.extensions.filters.http.fault.v3.HTTPFault", **fault)
    c = rule.cors
    if c is not None:
        cors: dict[str, Any] = {}
        if c.allow_origins:
            cors["allow_origin_string_match"] = [_string_match(o) for o in c.allow_origins]
        if c.allow_methods:
            cors["allow_methods"] = ",".join(c.allow_methods)
        if c.allow_headers:
            cors["allow_headers"] = ",".join(c.allow_headers)
        if c.expose_headers:
            cors["expose_headers"] = ",".join(c.expose_headers)
        if c.max_age_s is not None:
            cors["max_age"] = str(c.max_age_s)
        if c.allow_credentials is not None:
            cors["allow_credentials"] = c.allow_credentials
        out[CORS_FILTER] = _typed("envoy.extensions.filters.http.cors.v3.CorsPolicy", **cors)
    return out


def envoy_routes(bound: BoundRule, port: int, cluster_of: ClusterOf) -> list[dict[str, Any]]:
    """The Envoy routes of one rule: one per match it keeps (one catch-all without matches)."""
    rule = bound.rule
    matches: Sequence[RouteMatch | None] = _usable_matches(rule, port) or ()
    if not matches:
        matches = [None]
    out = []
    for m in matches:
        route: dict[str, Any] = {"match": _match(m, bound.gateway_semantics)}
        name = ".".join(x for x in (rule.name, m.name if m is not None else "") if x)
        if name:
            route = {"name": name, **route}
        if rule.redirect is not None:
            route["redirect"] = _redirect(rule)
        elif rule.direct_response is not None:
            status, body = rule.direct_response
            direct: dict[str, Any] = {"status": status}
            if body is not None:
                direct["body"] = {"inline_string": body}
            route["direct_response"] = direct
        else:
            route["route"] = _route_action(rule, m, bound.gateway_semantics, cluster_of)
        request, response = rule.request_headers, rule.response_headers
        if len(rule.destinations) == 1 and rule.redirect is None and rule.direct_response is None:
            request = _merge(request, rule.destinations[0].request_headers)
            response = _merge(response, rule.destinations[0].response_headers)
        route.update(_header_fields(request, "request"))
        route.update(_header_fields(response, "response"))
        per_filter = _per_filter(rule)
        if per_filter:
            route["typed_per_filter_config"] = per_filter
        out.append(route)
    return out


def route_configuration(
    name: str, port: int, rules: Sequence[BoundRule], cluster_of: ClusterOf
) -> HttpChainRoutes:
    """The inline RouteConfiguration of one waypoint HTTP chain from its ordered rules."""
    routes = [r for bound in rules for r in envoy_routes(bound, port, cluster_of)]
    config: dict[str, Any] = {
        "name": name,
        "validate_clusters": False,
        "virtual_hosts": [{"name": f"inbound|http|{port}", "domains": ["*"], "routes": routes}],
    }
    longest = max(
        (len(b.rule.direct_response[1] or "") for b in rules if b.rule.direct_response is not None), default=0
    )
    if longest > ENVOY_DEFAULT_BODY_LIMIT:
        # istiod leaves Envoy's 4 KiB limit on waypoints, where a longer body is a rejected
        # listener; raising it keeps every other route of the chain served.
        config["max_direct_response_body_size_bytes"] = MAX_DIRECT_BODY
    return HttpChainRoutes(
        route_config=config,
        needs_fault=any(b.rule.fault is not None for b in rules),
        needs_cors=any(b.rule.cors is not None for b in rules),
    )


def cluster_resolver(
    owned: Mapping[str, Sequence[int]], chain_host: str, chain_port: int, domain_suffix: str
) -> ClusterOf:
    """Names the cluster of a route destination: the waypoint's own `inbound-vip` cluster for a
    service it serves, else istiod's outbound name (which this waypoint does not build, so Envoy
    answers it as an unknown cluster)."""

    def cluster_of(d: RouteDestination) -> str:
        host = fqdn(d.host, d.namespace, domain_suffix)
        ports = owned.get(host, ())
        port = d.port or (chain_port if host == chain_host else (ports[0] if len(ports) == 1 else 0))
        if port and port in ports:
            protocol = f"http/{d.subset}" if d.subset else "http"
            return f"inbound-vip|{port}|{protocol}|{host}"
        if not port:
            return UNKNOWN_CLUSTER
        return f"outbound|{port}|{d.subset}|{host}"

    return cluster_of


def mixed_note(host: str, objects: Sequence[str]) -> str:
    """Istio documents mixing its own routing API with Gateway API's as unsupported (undefined
    behaviour); what this waypoint does instead: docs/architecture.md, "Waypoint L7: routes,
    authorization, HTTP metrics"."""
    return (
        f"{host} is routed by {', '.join(objects)}: Istio does not support mixing HTTPRoute and "
        "VirtualService for one service (undefined behaviour); here HTTPRoute rules are tried "
        "first, then VirtualService rules"
    )


def notes(obj: RouteObject) -> tuple[str, ...]:
    """What a waypoint cannot honour in one route object, for `lab apply` and the control log."""
    out = list(obj.unsupported)
    for rule in obj.http:
        for d in rule.destinations:
            if d.subset:
                out.append(
                    f"destination {d.host} subset {d.subset!r}: subsets need a DestinationRule, not served"
                )
    return tuple(f"{obj.kind} {obj.metadata.namespace}/{obj.metadata.name}: {n}" for n in out)
