"""Parsers of the Gateway API kinds the mesh reads: Gateway (waypoints) and HTTPRoute.

An HTTPRoute whose parent is a Service is read into the same rule shape as a VirtualService's
`http` route (`model.HttpRouteRule`), as istiod converts one into the other; what the waypoint does
not serve is kept as a note on the route.
"""

from __future__ import annotations

from collections.abc import Callable

from .fields import CRD_TOP_FIELDS, FieldError, Fields, duration_ms, label_selector, object_meta
from .model import (
    Gateway,
    GatewayAddress,
    GatewayListener,
    HeaderOps,
    HTTPRoute,
    HttpRouteRule,
    KubeObject,
    ObjectMeta,
    RouteDestination,
    RouteMatch,
    RouteMirror,
    RouteParent,
    RouteRedirect,
    RouteRetry,
    RouteRewrite,
    StringMatch,
)


def _parse_gateway(doc: Fields) -> Gateway:
    meta = object_meta(doc, namespaced=True)
    spec = doc.sub("spec") or Fields({}, "spec")
    listeners = []
    for lf in spec.items("listeners"):
        allowed_from = ""
        allowed_selector = None
        routes = lf.sub("allowedRoutes")
        ns = routes.sub("namespaces") if routes is not None else None
        if ns is not None:
            allowed_from = ns.enum("from", ("Same", "All", "Selector", "None"), "Same")
            allowed_selector = label_selector(ns.sub("selector"))
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


def _name_values(f: Fields, key: str) -> tuple[tuple[str, str], ...]:
    out = []
    for h in f.items(key):
        h.only("name", "value")
        name = h.str("name")
        if not name:
            raise FieldError(f"{h.path}.name", "missing")
        out.append((name.lower(), h.str("value")))
    return tuple(out)


def _gateway_header_ops(f: Fields | None) -> HeaderOps:
    if f is None:
        return HeaderOps()
    f.only("set", "add", "remove")
    return HeaderOps(
        set=_name_values(f, "set"),
        add=_name_values(f, "add"),
        remove=tuple(h.lower() for h in f.strings("remove")),
    )


_GATEWAY_MATCH_TYPES = {"Exact": "exact", "PathPrefix": "prefix", "RegularExpression": "regex"}


def _gateway_string_match(f: Fields, default: str) -> StringMatch:
    kind = f.enum("type", ("Exact", "PathPrefix", "RegularExpression"), default)
    return StringMatch(kind=_GATEWAY_MATCH_TYPES[kind], value=f.str("value"))


def _gateway_match(m: Fields) -> RouteMatch:
    m.only("path", "headers", "queryParams", "method")
    path = None
    p = m.sub("path")
    if p is not None:
        p.only("type", "value")
        path = _gateway_string_match(p, "PathPrefix")
        if not path.value.startswith("/") and path.kind != "regex":
            raise FieldError(f"{p.path}.value", "must start with /")
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


def _backend(b: Fields, namespace: str, notes: list[str], *, weighted: bool) -> RouteDestination | None:
    kind = b.str("kind", "Service")
    group = b.str("group")
    if kind != "Service" or group not in ("", "core"):
        notes.append(f"{b.path}: backend {group or 'core'}/{kind} is not served (only Service)")
        return None
    ns = b.str("namespace") or namespace
    if ns != namespace:
        notes.append(f"{b.path}: a backend in another namespace needs a ReferenceGrant, not served")
        return None
    return RouteDestination(
        host=b.str("name"),
        namespace=ns,
        port=b.int("port", lo=0, hi=65535),
        weight=b.int("weight", 1, lo=0, hi=1_000_000) if weighted else None,
    )


def _gateway_path_modifier(f: Fields) -> tuple[str, str]:
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


def _gateway_rule(r: Fields, index: int, route: ObjectMeta, notes: list[str]) -> list[HttpRouteRule]:
    r.only("name", "matches", "filters", "backendRefs", "timeouts", "retry", "sessionPersistence")
    if r.has("sessionPersistence"):
        notes.append(f"{r.path}.sessionPersistence: not served by the waypoint, ignored")
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
            rr = f.sub("requestRedirect") or Fields({}, f"{f.path}.requestRedirect")
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
            ur = f.sub("urlRewrite") or Fields({}, f"{f.path}.urlRewrite")
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
            rm = f.sub("requestMirror") or Fields({}, f"{f.path}.requestMirror")
            rm.only("backendRef", "percent", "fraction")
            ref = rm.sub("backendRef")
            if ref is None:
                raise FieldError(f"{rm.path}.backendRef", "missing")
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
            notes.append(f"{f.path}: filter type {kind!r} is not served by the waypoint, ignored")
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
                notes.append(f"{f.path}: backend filter {kind!r} is not served by the waypoint, ignored")
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
        timeout_ms = duration_ms(timeouts, "request")
        per_try = duration_ms(timeouts, "backendRequest")
    retry = r.sub("retry")
    if retry is not None:
        retry.only("codes", "attempts", "backoff")
        codes = []
        for i, c in enumerate(retry.value("codes") if retry.has("codes") else []):
            if isinstance(c, bool) or not isinstance(c, int) or not 400 <= c <= 599:
                raise FieldError(f"{retry.path}.codes[{i}]", "expected an HTTP status 400-599")
            codes.append(c)
        retries = RouteRetry(
            attempts=retry.int("attempts", 2, lo=0, hi=100),
            per_try_timeout_ms=per_try,
            retry_on=("connect-failure", "refused-stream", "unavailable", "cancelled"),
            codes=tuple(codes),
            backoff_ms=duration_ms(retry, "backoff"),
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


def _parse_http_route(doc: Fields) -> HTTPRoute:
    meta = object_meta(doc, namespaced=True)
    doc.only(*CRD_TOP_FIELDS)
    spec = (doc.sub("spec") or Fields({}, "spec")).only(
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
                f"{p.path}: parent {kind} {p.str('name')!r}: only Service parents (mesh routing) are served"
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


# kind -> (the apiVersions read, the parser)
PARSERS: dict[str, tuple[tuple[str, ...], Callable[[Fields], KubeObject]]] = {
    "Gateway": (("gateway.networking.k8s.io/v1", "gateway.networking.k8s.io/v1beta1"), _parse_gateway),
    "HTTPRoute": (("gateway.networking.k8s.io/v1", "gateway.networking.k8s.io/v1beta1"), _parse_http_route),
}
