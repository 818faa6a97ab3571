"""Parsers of Istio's CRDs: AuthorizationPolicy and PeerAuthentication (security.istio.io);
ServiceEntry, WorkloadEntry and VirtualService (networking.istio.io).

Unknown fields are refused at the top level and in the spec (`Fields.only`): a typo such as
`principal:` must not silently widen or void a policy.
"""

from __future__ import annotations

from collections.abc import Callable

from .fields import MISSING, FieldError, Fields, crd_spec, duration_ms, label_selector, object_meta
from .model import (
    AUTHZ_ACTIONS,
    MTLS_MODES,
    SE_RESOLUTIONS,
    AuthorizationPolicy,
    AuthorizationRule,
    Condition,
    HeaderOps,
    HttpRouteRule,
    KubeObject,
    Operation,
    PeerAuthentication,
    PolicyTargetReference,
    RouteCors,
    RouteDestination,
    RouteFault,
    RouteMatch,
    RouteMirror,
    RouteRedirect,
    RouteRetry,
    RouteRewrite,
    ServiceEntry,
    ServiceEntryPort,
    Source,
    StringMatch,
    VirtualService,
    WorkloadEntry,
    WorkloadEntrySpec,
)


def _target_refs(spec: Fields) -> tuple[PolicyTargetReference, ...]:
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
# A WorkloadEntry's spec, which is also the shape of each of a ServiceEntry's endpoints.
_WORKLOAD_ENTRY_FIELDS = ("address", "labels", "locality", "network", "ports", "serviceAccount", "weight")


def _source(s: Fields) -> Source:
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


def _operation(o: Fields) -> Operation:
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


def _parse_authorization_policy(doc: Fields) -> AuthorizationPolicy:
    meta = object_meta(doc, namespaced=True)
    spec = crd_spec(doc, "selector", "targetRef", "targetRefs", "action", "provider", "rules")
    rules = []
    for r in spec.items("rules"):
        r.only("from", "to", "when")
        sources = tuple(
            _source(f.only("source").sub("source") or Fields({}, f"{f.path}.source")) for f in r.items("from")
        )
        ops = tuple(
            _operation(t.only("operation").sub("operation") or Fields({}, f"{t.path}.operation"))
            for t in r.items("to")
        )
        when = []
        for w in r.items("when"):
            key = w.only("key", "values", "notValues").str("key")
            if not key:
                raise FieldError(f"{w.path}.key", "missing")
            when.append(Condition(key=key, values=w.strings("values"), not_values=w.strings("notValues")))
        rules.append(AuthorizationRule(sources=sources, operations=ops, when=tuple(when)))
    return AuthorizationPolicy(
        metadata=meta,
        selector=label_selector(spec.sub("selector")),
        target_refs=_target_refs(spec),
        action=spec.enum("action", AUTHZ_ACTIONS, "ALLOW"),
        rules=tuple(rules),
    )


def _parse_peer_authentication(doc: Fields) -> PeerAuthentication:
    meta = object_meta(doc, namespaced=True)
    spec = crd_spec(doc, "selector", "mtls", "portLevelMtls")
    mtls = spec.sub("mtls")
    if mtls is not None:
        mtls.only("mode")
    mode = mtls.enum("mode", MTLS_MODES, "UNSET") if mtls is not None else None
    port_level: dict[int, str] = {}
    raw = spec.sub("portLevelMtls")
    if raw is not None:
        for key in raw.data:
            path = f"spec.portLevelMtls.{key}"
            try:
                port = int(key)
            except (TypeError, ValueError):
                raise FieldError(path, "expected a port number as the key") from None
            if not 1 <= port <= 65535:
                raise FieldError(path, "port out of range 1-65535")
            entry = Fields(raw.data[key], path).only("mode")
            port_level[port] = entry.enum("mode", MTLS_MODES, "UNSET")
    return PeerAuthentication(
        metadata=meta,
        selector=label_selector(spec.sub("selector")),
        mtls_mode=mode,
        port_level_mtls=port_level,
    )


def _workload_entry_spec(f: Fields) -> WorkloadEntrySpec:
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


def _parse_service_entry(doc: Fields) -> ServiceEntry:
    meta = object_meta(doc, namespaced=True)
    spec = crd_spec(
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
        raise FieldError("spec.hosts", "at least one host is required")
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
        workload_selector=label_selector(ws, "labels"),
        subject_alt_names=spec.strings("subjectAltNames"),
    )


def _parse_workload_entry(doc: Fields) -> WorkloadEntry:
    meta = object_meta(doc, namespaced=True)
    spec = crd_spec(doc, *_WORKLOAD_ENTRY_FIELDS)
    return WorkloadEntry(metadata=meta, spec=_workload_entry_spec(spec))


def _percent(f: Fields | None, key: str = "value", default: float = 100.0) -> float:
    if f is None:
        return default
    value = f.value(key)
    if value is MISSING:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 100:
        raise FieldError(f.child(key), "expected a percentage 0-100")
    return float(value)


def _string_match(f: Fields) -> StringMatch:
    f.only("exact", "prefix", "regex")
    for kind in ("exact", "prefix", "regex"):
        if f.has(kind):
            return StringMatch(kind=kind, value=f.str(kind))
    raise FieldError(f.path, "one of exact, prefix or regex is required")


def _istio_header_ops(f: Fields | None) -> HeaderOps:
    if f is None:
        return HeaderOps()
    f.only("set", "add", "remove")
    return HeaderOps(
        set=tuple((k.lower(), v) for k, v in f.string_map("set").items()),
        add=tuple((k.lower(), v) for k, v in f.string_map("add").items()),
        remove=tuple(h.lower() for h in f.strings("remove")),
    )


def _istio_destination(d: Fields, namespace: str) -> RouteDestination:
    d.only("host", "subset", "port")
    host = d.str("host")
    if not host:
        raise FieldError(f"{d.path}.host", "missing")
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


def _istio_match(m: Fields, notes: list[str]) -> RouteMatch:
    m.only(*_VS_MATCH_FIELDS)
    for unsupported in ("scheme", "withoutHeaders", "sourceNamespace", "gateways", "statPrefix"):
        if m.has(unsupported):
            notes.append(f"{m.path}.{unsupported}: not served by the waypoint, ignored")
    if m.has("sourceLabels"):
        notes.append(f"{m.path}.sourceLabels: a waypoint cannot match on sourceLabels; this match is dropped")
    uri = m.sub("uri")
    headers: list[tuple[str, StringMatch]] = []
    raw = m.sub("headers")
    if raw is not None:
        for name in raw.data:
            headers.append((str(name).lower(), _string_match(Fields(raw.data[name], f"{raw.path}.{name}"))))
    authority = m.sub("authority")
    if authority is not None:
        headers.append((":authority", _string_match(authority)))
    query: list[tuple[str, StringMatch]] = []
    rawq = m.sub("queryParams")
    if rawq is not None:
        for name in rawq.data:
            query.append((str(name), _string_match(Fields(rawq.data[name], f"{rawq.path}.{name}"))))
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


def _istio_http(h: Fields, namespace: str, notes: list[str]) -> HttpRouteRule:
    h.only(*_VS_HTTP_FIELDS)
    for unsupported in ("delegate", "mirror_percent", "mirrorPercent"):
        if h.has(unsupported):
            notes.append(f"{h.path}.{unsupported}: not served by the waypoint, ignored")
    destinations = []
    for r in h.items("route"):
        r.only("destination", "weight", "headers")
        d = r.sub("destination")
        if d is None:
            raise FieldError(f"{r.path}.destination", "missing")
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
            per_try_timeout_ms=duration_ms(rt, "perTryTimeout"),
            retry_on=tuple(x for x in on if not x.isdigit()),
            codes=tuple(int(x) for x in on if x.isdigit()),
            backoff_ms=duration_ms(rt, "backoff"),
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
            delay_ms=duration_ms(delay, "fixedDelay") if delay is not None else None,
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
            raise FieldError(f"{m.path}.destination", "missing")
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
        max_age = duration_ms(cp, "maxAge")
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
        timeout_ms=duration_ms(h, "timeout"),
        retries=retries,
        fault=fault,
        mirrors=tuple(mirrors),
        cors=cors,
        request_headers=_istio_header_ops(headers.sub("request") if headers else None),
        response_headers=_istio_header_ops(headers.sub("response") if headers else None),
    )


def _parse_virtual_service(doc: Fields) -> VirtualService:
    meta = object_meta(doc, namespaced=True)
    spec = crd_spec(doc, "hosts", "gateways", "http", "tls", "tcp", "exportTo")
    notes: list[str] = []
    for unsupported in ("tls", "tcp"):
        if spec.has(unsupported):
            notes.append(f"spec.{unsupported}: {unsupported} routes are not served by the waypoint, ignored")
    http = []
    for h in spec.items("http"):
        rule = _istio_http(h, meta.namespace, notes)
        actions = sum(x is not None for x in (rule.redirect, rule.direct_response)) + bool(rule.destinations)
        if actions != 1:
            raise FieldError(h.path, "exactly one of route, redirect or directResponse is required")
        http.append(rule)
    return VirtualService(
        metadata=meta,
        hosts=spec.strings("hosts"),
        gateways=spec.strings("gateways"),
        http=tuple(http),
        unsupported=tuple(notes),
    )


# kind -> (the apiVersions read, the parser)
PARSERS: dict[str, tuple[tuple[str, ...], Callable[[Fields], KubeObject]]] = {
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
    "VirtualService": (
        ("networking.istio.io/v1", "networking.istio.io/v1beta1", "networking.istio.io/v1alpha3"),
        _parse_virtual_service,
    ),
}
