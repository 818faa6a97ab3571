"""`ambient explain SRC DST`: why a connection is allowed, denied, not captured or sent to a
waypoint, hop by hop.

No Istio counterpart. The walk is the data plane's: capture is the translation's enrollment (the
workload's tunnel protocol, which the node agent's in-pod rules follow), outbound routing is
`proxy.routing.build_request` itself (VIP, load balancing, waypoint or direct, HBONE or TCP), the
policies are `rbac.policies_for`'s and the decision is `PolicyIndex.check`, the call the node
proxy makes per connection. This module only adds what each rule said: it walks the same
policies with `rbac.reference.match_holds` (the semantics the fast path is held to) to name the
rule that matched, or why none did, and reports a disagreement with the proxy's decision if one
ever appears instead of hiding it.

Not modelled: what a waypoint decides at L7 (its Envoy; the targetRefs policies bound to it are
listed with their condition), multi-network routing (refused by build_request, shown as such).
"""

from __future__ import annotations

import ipaddress
import random
from dataclasses import dataclass, field, fields, replace

from ..control.status import http_attributes
from ..control.translate.workloads import pod_enrolled
from ..errors import AmbientError
from ..kube.model import AuthorizationPolicy, Pod
from ..metadata import LABEL_DATAPLANE_MODE
from ..net import SocketAddr, ip_address
from ..ports import HBONE_PORT, INBOUND_PLAINTEXT_PORT, OUTBOUND_PORT
from ..proxy.routing import Route, RouteKind, RouteRefused, build_request
from ..rbac import (
    Action,
    Authorization,
    Decision,
    Match,
    RbacConnection,
    ServiceAccountMatch,
    StringMatch,
    StringMatchKind,
    reference,
)
from ..rbac.reference import match_holds
from ..state.model import Service, TunnelProtocol, Workload
from ..state.store import ProxyState, load_balance
from .describe import split_name
from .policies import AppliedPolicy, applied_policies, effective_peer_authentication
from .view import MeshView

# The node proxy's own listener ports, which no connection may target (config._ILLEGAL_PORTS).
ILLEGAL_PORTS = frozenset({OUTBOUND_PORT, INBOUND_PLAINTEXT_PORT, HBONE_PORT})
EXPLAIN_SEED = 0  # load balancing picks at random; a fixed seed makes the answer repeatable


@dataclass(frozen=True, slots=True, kw_only=True)
class Hop:
    step: str  # capture, outbound, waypoint, mtls, authorization, delivery
    where: str
    decision: str
    details: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Explanation:
    source: str
    destination: str
    hops: tuple[Hop, ...]
    verdict: str  # ALLOWED, DENIED, REFUSED, NOT CAPTURED (delivered), PASSTHROUGH
    reason: str
    policy: str | None = None  # the policy that decided, if one did
    rule: int | None = None  # its rule index in the AuthorizationPolicy's spec.rules
    route: RouteKind | None = None
    waypoint: str | None = None
    notes: tuple[str, ...] = field(default=())
    # The workload whose node proxy authorized, and the policies evaluated there (for --live).
    destination_uid: str | None = None
    destination_node: str | None = None
    evaluated: tuple[str, ...] = ()

    def lines(self) -> list[str]:
        out = [f"explain {self.source} -> {self.destination}"]
        for i, hop in enumerate(self.hops, 1):
            out.append(f"{i}. {hop.step:<13} {hop.where}: {hop.decision}")
            out.extend(f"      {d}" for d in hop.details)
        out.extend(f"note: {n}" for n in self.notes)
        out.append(f"verdict: {self.verdict}: {self.reason}")
        return out


# -- endpoints ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class _Source:
    label: str
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address
    workload: Workload | None
    pod: Pod | None


def _split_port(text: str) -> tuple[str, int | None]:
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") and rest[1:].isdigit() else None
    head, sep, tail = text.rpartition(":")
    if sep and tail.isdigit() and head.count(":") == 0:
        return head, int(tail)
    return text, None


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def resolve_source(view: MeshView, state: ProxyState, text: str, namespace: str) -> _Source:
    if _is_ip(text):
        ip = ip_address(text)
        for w in state.workloads:
            if ip in w.workload_ips:
                pod = view.store.get("Pod", w.namespace, w.name)
                return _Source(
                    label=f"{w.namespace}/{w.name} ({ip})",
                    ip=ip,
                    workload=w,
                    pod=pod if isinstance(pod, Pod) else None,
                )
        return _Source(label=f"{ip} (outside the mesh)", ip=ip, workload=None, pod=None)
    ns, name = split_name(text, namespace)
    pod = view.store.get("Pod", ns, name)
    workload = next(iter(state.workloads.find_by_name(ns, name)), None)
    if isinstance(pod, Pod) and pod.ips:
        return _Source(
            label=f"{ns}/{name} ({pod.ips[0]})", ip=ip_address(pod.ips[0]), workload=workload, pod=pod
        )
    if workload is not None and workload.workload_ips:  # a config dump: workloads, no pods
        ip = workload.workload_ips[0]
        return _Source(label=f"{ns}/{name} ({ip})", ip=ip, workload=workload, pod=None)
    raise AmbientError(f"source {ns}/{name}: no such pod with an IP in {view.where}")


def resolve_target(
    view: MeshView, state: ProxyState, text: str, namespace: str, port: int | None
) -> tuple[SocketAddr, str]:
    host, given = _split_port(text)
    port = given or port
    if _is_ip(host):
        if port is None:
            raise AmbientError(f"destination {text}: give a port (ADDRESS:PORT or --port)")
        return SocketAddr(ip_address(host), port), f"{host}:{port}"
    ns, name = split_name(host, namespace)
    svc = state.services.get(f"{ns}/{name}.{ns}.svc.{view.settings.domain_suffix}")
    if (
        svc is not None
        and svc.vips
        and (port is None or port in svc.ports or not isinstance(view.store.get("Pod", ns, name), Pod))
    ):
        port = port or min(svc.ports, default=None)
        if port is None:
            raise AmbientError(f"service {ns}/{name} has no port; give one")
        return SocketAddr(svc.vips[0].address, port), f"service {ns}/{name} ({svc.vips[0].address}:{port})"
    pod = view.store.get("Pod", ns, name)
    ips = [str(ip) for w in state.workloads.find_by_name(ns, name) for ip in w.workload_ips]
    if isinstance(pod, Pod) and pod.ips:
        ips = list(pod.ips)
    if ips:
        if port is None:
            raise AmbientError(f"destination pod {ns}/{name}: give a port (NS/POD:PORT or --port)")
        return SocketAddr(ip_address(ips[0]), port), f"pod {ns}/{name} ({ips[0]}:{port})"
    raise AmbientError(
        f"destination {host}: no service with a VIP, pod or address by that name in {view.where}"
    )


# -- rules -------------------------------------------------------------------------------------

_FIELD_NAMES = tuple(f.name for f in fields(Match))


def _value_text(value: object) -> str:
    if isinstance(value, StringMatch):
        return "*" if value.kind is StringMatchKind.PRESENCE else f"{value.kind.value.lower()}:{value.value}"
    if isinstance(value, ServiceAccountMatch):
        return f"{value.namespace}/{value.service_account}"
    return str(value)


def match_text(m: Match) -> str:
    parts = []
    for name in _FIELD_NAMES:
        values = getattr(m, name)
        if values:
            parts.append(f"{name}=[{', '.join(_value_text(v) for v in values)}]")
    return " ".join(parts) or "(empty: never matches)"


def _failing_fields(m: Match, conn: RbacConnection) -> list[str]:
    """The fields of a Match that do not hold, each tested alone with the data plane's function."""
    failing = []
    for name in _FIELD_NAMES:
        values = getattr(m, name)
        if values and not match_holds(Match(**{name: values}), conn):
            failing.append(f"{name}=[{', '.join(_value_text(v) for v in values)}]")
    return failing


def _conn_text(conn: RbacConnection) -> str:
    ident = conn.src_identity.principal if conn.src_identity is not None else "no identity"
    return f"source {conn.src_ip} ({ident}), destination {conn.dst_ip}:{conn.dst_port}"


def rule_outcome(policy: Authorization, index: int, conn: RbacConnection) -> tuple[bool, str]:
    """(holds, why) for one rule, as `reference.policy_matches` decides it."""
    rule = policy.rules[index]
    for clause in rule.clauses:
        live = [m for m in clause.matches if m != Match()]
        if not clause.matches:
            continue
        if not live:
            return False, "a clause has only HTTP parts (removed at L4): it never holds"
        if not any(match_holds(m, conn) for m in live):
            why = "; or ".join(", ".join(_failing_fields(m, conn)) for m in live)
            return False, f"does not hold: {why}"
    shown = (
        " AND ".join(" OR ".join(match_text(m) for m in c.matches) for c in rule.clauses) or "(no conditions)"
    )
    return True, f"holds: {shown}"


def source_rule_index(view: MeshView, policy: Authorization, index: int) -> int:
    """The index in the AuthorizationPolicy's spec.rules of the converted policy's rule `index`
    (an ALLOW policy loses its rules with HTTP attributes on the way to the node proxy)."""
    ap = view.store.get("AuthorizationPolicy", policy.namespace, policy.name)
    if not isinstance(ap, AuthorizationPolicy) or policy.action is Action.DENY:
        return index
    kept = [i for i, r in enumerate(ap.rules) if not http_attributes(replace(ap, rules=(r,)))]
    return kept[index] if index < len(kept) else index


@dataclass(frozen=True, slots=True, kw_only=True)
class _Walk:
    lines: tuple[str, ...]
    policy: str | None
    rule: int | None
    evaluated: tuple[str, ...] = ()


def walk_policies(
    view: MeshView, applied: list[AppliedPolicy], conn: RbacConnection, decision: Decision
) -> _Walk:
    """Each applied policy in evaluation order (DENY, then ALLOW; dry-run noted), each rule's
    outcome, and which one the proxy's decision names."""
    lines: list[str] = []
    ordered = [a for a in applied if a.policy.action is Action.DENY] + [
        a for a in applied if a.policy.action is Action.ALLOW
    ]
    decided_rule: int | None = None
    for a in ordered:
        p = a.policy
        head = f"{p.action.value.upper():<5} {p.key}{' (dry-run: logged, not enforced)' if p.dry_run else ''}"
        lines.append(f"{head}  [{a.source}; {a.why}]")
        if a.condition:
            lines.append(f"      {a.condition}")
        if not p.rules:
            lines.append("      no rules: matches nothing")
        first_match: int | None = None
        for i in range(len(p.rules)):
            holds, why = rule_outcome(p, i, conn)
            src_index = source_rule_index(view, p, i)
            from_spec = not view.dump and p.name == a.source.rsplit("/", 1)[-1]
            label = f"rules[{src_index}]" if from_spec else f"rule {i} (as the node proxy holds it)"
            lines.append(f"      {label}: {'MATCH' if holds else 'no match'}, {why}")
            if holds and first_match is None:
                first_match = src_index
        if decision.policy == p.key:
            decided_rule = first_match
    return _Walk(
        lines=tuple(lines),
        policy=decision.policy,
        rule=decided_rule,
        evaluated=tuple(a.policy.key for a in ordered),
    )


# -- the walk ------------------------------------------------------------------------------------


def _capture(view: MeshView, src: _Source) -> Hop:
    if src.workload is None and src.pod is None:
        return Hop(step="capture", where=str(src.ip), decision="not captured: not a pod of the mesh")
    pod = src.pod
    if pod is not None:
        ns = view.store.namespace(pod.metadata.namespace)
        enrolled = pod_enrolled(pod, dict(ns.metadata.labels) if ns is not None else {})
        node = pod.node_name or "?"
    else:
        enrolled = src.workload is not None and src.workload.protocol is TunnelProtocol.HBONE
        node = src.workload.node if src.workload is not None else "?"
    if pod is not None and pod.host_network:
        return Hop(step="capture", where=src.label, decision="not captured: the pod uses the host network")
    if not enrolled:
        return Hop(
            step="capture",
            where=src.label,
            decision=f"not captured: not in ambient mode ({LABEL_DATAPLANE_MODE} unset or not ambient); "
            "it leaves the pod as plain TCP with no identity",
        )
    return Hop(
        step="capture",
        where=src.label,
        decision=f"captured: in-pod rules send it to the node proxy on {node} (port {OUTBOUND_PORT})",
    )


def _route_hop(route: Route, state: ProxyState, src_node: str) -> Hop:
    details = []
    svc = route.destination_service
    if svc is not None:
        n = len(svc.endpoints)
        details.append(f"service {svc.namespace}/{svc.hostname}: {n} endpoint{'s' if n != 1 else ''}")
    dest = route.destination_workload
    if route.kind is RouteKind.WAYPOINT:
        decision = (
            f"to waypoint {dest.namespace}/{dest.name if dest else '?'} over HBONE {route.actual_destination} "
            f"(CONNECT {route.hbone_target})"
            if dest is not None
            else f"to a waypoint at {route.actual_destination}"
        )
    elif route.kind is RouteKind.DIRECT_HBONE:
        where = f"{dest.namespace}/{dest.name} on {dest.node or '?'}" if dest is not None else "?"
        decision = f"direct over HBONE to {where}: {route.actual_destination}, CONNECT {route.hbone_target}"
        if svc is not None and len(svc.endpoints) > 1:
            details.append("the endpoint is picked at random per connection; this answer follows one pick")
    elif route.kind is RouteKind.DIRECT_TCP:
        where = f"{dest.namespace}/{dest.name}" if dest is not None else "?"
        decision = (
            f"direct plain TCP to {where} at {route.actual_destination}: the destination is not captured"
        )
    else:
        decision = (
            f"passthrough: {route.actual_destination} is no workload or service of the mesh; sent as is"
        )
    if route.upstream_sans:
        details.append("expects the peer to be " + ", ".join(s.principal for s in route.upstream_sans))
    return Hop(step="outbound", where=f"node proxy {src_node}", decision=decision, details=tuple(details))


def _inbound(
    view: MeshView,
    state: ProxyState,
    dst: Workload,
    conn: RbacConnection,
    *,
    via: str,
) -> tuple[list[Hop], Decision, _Walk]:
    where = f"node proxy {dst.node or '?'} for {dst.namespace}/{dst.name}"
    obj = view.store.get("Pod", dst.namespace, dst.name)
    labels = dict(obj.metadata.labels) if obj is not None else {}
    mode, source = effective_peer_authentication(view, dst.namespace, labels)
    if view.dump:  # no PeerAuthentication objects: what the node proxy holds says it
        strict = any(key.endswith("/istio_converted_static_strict") for key in dst.authorization_policies)
        mode, source = ("STRICT" if strict else "not STRICT"), "the workload's policies in the config dump"
    peer = conn.src_identity.principal if conn.src_identity is not None else "none (plaintext)"
    mtls = Hop(
        step="mtls",
        where=where,
        decision=f"PeerAuthentication mode {mode} (from {source}); arrives {via}, peer identity: {peer}",
        details=("STRICT is enforced as the DENY policy istio_converted_static_strict below",)
        if mode == "STRICT"
        else (),
    )
    applied = applied_policies(view, state, dst)
    decision = state.policies.check(dst, conn)  # the node proxy's own call
    walk = walk_policies(view, applied, conn, decision)
    lines = [_conn_text(conn), *walk.lines] if applied else [_conn_text(conn), "no policy applies"]
    # The rule walk above is the reference semantics; the decision is the proxy's fast path. They
    # are held equal by property tests; should they ever differ here, say so rather than pick one.
    plain = reference.evaluate([a.policy for a in applied], conn)
    if (plain.allowed, plain.policy) != (decision.allowed, decision.policy):
        lines.append(
            f"DISAGREEMENT: the reference evaluation says {plain}; the node proxy's check says {decision}"
        )
    authz = Hop(
        step="authorization",
        where=where,
        decision=f"{'ALLOW' if decision.allowed else 'DENY'}: {decision.reason}",
        details=tuple(lines),
    )
    return [mtls, authz], decision, walk


def _at(dst: Workload, walk: _Walk) -> dict[str, object]:
    return {"destination_uid": dst.uid, "destination_node": dst.node, "evaluated": walk.evaluated}


def _verdict_from(decision: Decision, walk: _Walk, view: MeshView) -> tuple[str, str, str | None, int | None]:
    def rule_text(n: int | None) -> str:
        return "" if n is None else f" rule {n}" if view.dump else f" rules[{n}]"

    if decision.allowed:
        if decision.policy:
            rule = rule_text(walk.rule)
            return (
                "ALLOWED",
                f"allowed by AuthorizationPolicy {decision.policy}{rule}",
                decision.policy,
                walk.rule,
            )
        return "ALLOWED", "no ALLOW policy applies, so it is allowed (Istio's default)", None, None
    if decision.policy:
        name = decision.policy.rsplit("/", 1)[-1]
        kind = (
            "PeerAuthentication STRICT" if name == "istio_converted_static_strict" else "AuthorizationPolicy"
        )
        rule = rule_text(walk.rule) if kind == "AuthorizationPolicy" else ""
        return "DENIED", f"denied by {kind} {decision.policy}{rule}", decision.policy, walk.rule
    return "DENIED", "ALLOW policies apply, but none of their rules matches this connection", None, None


def explain(
    view: MeshView,
    state: ProxyState,
    source: str,
    destination: str,
    *,
    namespace: str = "default",
    port: int | None = None,
) -> Explanation:
    src = resolve_source(view, state, source, namespace)
    target, target_label = resolve_target(view, state, destination, namespace, port)
    hops = [_capture(view, src)]
    captured = hops[0].decision.startswith("captured")
    rng = random.Random(EXPLAIN_SEED)
    notes: list[str] = []

    def done(verdict: str, reason: str, **kw: object) -> Explanation:
        return Explanation(
            source=src.label,
            destination=target_label,
            hops=tuple(hops),
            verdict=verdict,
            reason=reason,
            notes=tuple(notes),
            **kw,  # type: ignore[arg-type]
        )

    if captured and src.workload is not None:
        w = src.workload
        route = build_request(
            state, w, target, network=w.network, node=w.node, illegal_ports=ILLEGAL_PORTS, rng=rng
        )
        if isinstance(route, RouteRefused):
            hops.append(
                Hop(step="outbound", where=f"node proxy {w.node}", decision=f"refused: {route.reason}")
            )
            return done("REFUSED", route.reason)
        hops.append(_route_hop(route, state, w.node))
        if route.kind is RouteKind.PASSTHROUGH:
            return done(
                "PASSTHROUGH",
                "sent unchanged to its original destination; no policy applies",
                route=route.kind,
            )
        if route.kind is RouteKind.DIRECT_TCP:
            return done(
                "ALLOWED",
                "plain TCP to a workload outside ambient mode: nothing on the way authorizes it",
                route=route.kind,
            )
        assert route.hbone_target is not None and route.destination_workload is not None
        if route.kind is RouteKind.WAYPOINT:
            return _through_waypoint(view, state, src, route, hops, notes, target_label, rng)
        conn = RbacConnection(
            src_identity=w.identity,
            src_ip=src.ip,
            dst_ip=route.hbone_target.ip,
            dst_port=route.hbone_target.port,
        )
        more, decision, walk = _inbound(
            view, state, route.destination_workload, conn, via="over HBONE (mTLS)"
        )
        hops.extend(more)
        verdict, reason, policy, rule = _verdict_from(decision, walk, view)
        return done(
            verdict,
            reason,
            policy=policy,
            rule=rule,
            route=route.kind,
            **_at(route.destination_workload, walk),
        )

    # Not captured: the packet leaves as plain TCP. A VIP is resolved by the node's service proxy
    # (kube-proxy), not by a node proxy; a captured destination's own in-pod rules take it to
    # its node proxy's plaintext inbound port, where it is authorized with no identity.
    dst_workload, dst_port = _uncaptured_destination(state, target, rng)
    if dst_workload is None:
        hops.append(
            Hop(step="delivery", where="network", decision=f"plain TCP to {target}: no workload of the mesh")
        )
        return done("NOT CAPTURED", "delivered as plain TCP; no node proxy is involved")
    hops.append(
        Hop(
            step="delivery",
            where="network",
            decision=f"plain TCP to {dst_workload.namespace}/{dst_workload.name} "
            f"({dst_workload.workload_ips[0]}:{dst_port})",
        )
    )
    if dst_workload.protocol is not TunnelProtocol.HBONE:
        return done("NOT CAPTURED", "neither end is in ambient mode: plain TCP, no node proxy authorizes it")
    conn = RbacConnection(
        src_identity=None, src_ip=src.ip, dst_ip=dst_workload.workload_ips[0], dst_port=dst_port
    )
    more, decision, walk = _inbound(
        view, state, dst_workload, conn, via=f"as plaintext on its in-pod port {INBOUND_PLAINTEXT_PORT}"
    )
    hops.extend(more)
    verdict, reason, policy, rule = _verdict_from(decision, walk, view)
    return done(
        verdict, f"(source not captured) {reason}", policy=policy, rule=rule, **_at(dst_workload, walk)
    )


def _uncaptured_destination(
    state: ProxyState, target: SocketAddr, rng: random.Random
) -> tuple[Workload | None, int]:
    svc = state.services.find_vip("", target.ip)
    if svc is not None:
        for uid, endpoint in sorted(svc.endpoints.items()):
            w = state.workloads.find_uid(uid)
            if w is not None and w.workload_ips:
                return w, endpoint.port.get(
                    target.port, svc.ports.get(target.port, target.port)
                ) or target.port
        return None, target.port
    return state.workloads.find_address("", target.ip), target.port


def _through_waypoint(
    view: MeshView,
    state: ProxyState,
    src: _Source,
    route: Route,
    hops: list[Hop],
    notes: list[str],
    target_label: str,
    rng: random.Random,
) -> Explanation:
    waypoint = route.destination_workload
    assert waypoint is not None and route.hbone_target is not None
    svc: Service | None = route.destination_service
    bound = [
        f"{p.metadata.namespace}/{p.metadata.name}: {'; '.join(str(c) for c in view.status.get(('AuthorizationPolicy', p.metadata.namespace, p.metadata.name), ()))}"
        for p in view.store.authorization_policies
        if p.target_refs
    ]
    hops.append(
        Hop(
            step="waypoint",
            where=f"waypoint {waypoint.namespace}/{waypoint.name}",
            decision="terminates HBONE, applies its L7 policies and routes (Envoy: not evaluated here)",
            details=tuple(f"targetRefs policy {b}" for b in bound) or ("no targetRefs AuthorizationPolicy",),
        )
    )
    # The waypoint then connects to an endpoint with its own identity.
    target = route.hbone_target
    if svc is not None:
        upstream = load_balance(state, svc, waypoint, port=target.port, node=waypoint.node, rng=rng)
        if upstream is None:
            return Explanation(
                source=src.label,
                destination=target_label,
                hops=tuple(hops),
                verdict="REFUSED",
                reason=f"the waypoint finds no healthy endpoint of {svc.key}",
                route=route.kind,
                waypoint=f"{waypoint.namespace}/{waypoint.name}",
            )
        dst, port = upstream.workload, upstream.port
    else:
        found = state.workloads.find_address(waypoint.network, target.ip)
        if found is None:
            raise AmbientError(f"the waypoint's target {target} is no workload")
        dst, port = found, target.port
    conn = RbacConnection(
        src_identity=waypoint.identity,
        src_ip=waypoint.workload_ips[0],
        dst_ip=dst.workload_ips[0],
        dst_port=port,
    )
    more, decision, walk = _inbound(view, state, dst, conn, via="over HBONE from the waypoint")
    hops.extend(more)
    notes.append("at the destination the peer is the waypoint's identity, not the original client's")
    verdict, reason, policy, rule = _verdict_from(decision, walk, view)
    return Explanation(
        source=src.label,
        destination=target_label,
        hops=tuple(hops),
        verdict=verdict,
        reason=reason,
        policy=policy,
        rule=rule,
        route=route.kind,
        waypoint=f"{waypoint.namespace}/{waypoint.name}",
        notes=tuple(notes),
        destination_uid=dst.uid,
        destination_node=dst.node,
        evaluated=walk.evaluated,
    )
