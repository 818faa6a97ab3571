"""Object status: the conditions the control plane writes into the objects it reads.

Counterpart: istiod's ambient status (pilot/pkg/serviceregistry/kube/controller/ambient/
statusqueue and the `GetConditions` of its collections). istiod tells the user, in the object's
own `status.conditions` (where `kubectl get -o yaml` shows it), what it did with the object:

- AuthorizationPolicy without targetRefs: `ZtunnelAccepted`. True, reason `Accepted` ("attached to
  ztunnel") when sent whole; True, reason `UnsupportedValue` when sent without its HTTP
  attributes; False, reason `UnsupportedValue` when not sent at all (CUSTOM and AUDIT actions,
  dry-run without ENABLE_WDS_DRY_RUN_AUTHZ_POLICY). istiod's message says "more restrictive than
  requested" for both actions; ours says what the node proxy will actually do (an ALLOW whose
  rules all need HTTP attributes allows nothing, a DENY whose rules are all HTTP-only denies
  nothing, a DENY with L4 parts is enforced on those parts alone).
- AuthorizationPolicy with targetRefs: `WaypointAccepted`, one binding per target flattened as
  istiod does: reasons `Accepted`, `TargetNotFound`, `AncestorNotBound`, and for several targets
  `PartiallyInvalid` / `Invalid` with "Invalid targetRefs: ...". Bound but not honoured as
  written (CUSTOM, requestPrincipals, an unknown `when` key: l7_authz.py `policy_notes`): ours,
  reason `UnsupportedValue` with what the waypoint does instead.
- Service and ServiceEntry using a waypoint: `istio.io/WaypointBound`, True with reason
  `WaypointAccepted`, or False with a reason of ours (`WaypointNotFound`, `NotAllowed`,
  `TrafficTypeMismatch`); no condition without `istio.io/use-waypoint`.
- PeerAuthentication and waypoint Gateways: istiod writes nothing for ambient here; we write
  `ZtunnelAccepted` on a PeerAuthentication the node proxies will not honour (a selector in the
  root namespace is ignored, the younger of two mesh- or namespace-wide policies loses) and
  Gateway API's `Programmed` on an `istio-waypoint` Gateway (False, `AddressNotAssigned`, until
  it has an address node proxies can send to).
- HTTPRoute with Service parents: per parent, a `status.parents[]` entry (parentRef,
  controllerName `istio.io/gateway-controller`) with `Accepted` and `ResolvedRefs`
  (route_status.py). VirtualService: istiod writes no such status, nor do we (what a waypoint
  cannot honour in one is said by `lab apply` and the control plane's log).

`compute_status` is pure (a snapshot in, conditions per object out); a `StatusWriter` carries
them out: `DirectoryStatusWriter` for a YAML directory (the lab's API server keeps status beside
the objects, in the control plane's state directory) and `KubeStatusWriter` for the API server
(a merge patch of the status subresource, keeping other writers' condition types).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from ..host.files import atomic_write
from ..kube.client import KubeApiError, KubeClient, Resource
from ..kube.model import (
    AuthorizationPolicy,
    Gateway,
    ObjectKey,
    ObjectMeta,
    PeerAuthentication,
    Service,
    ServiceEntry,
)
from ..kube.store import KubeStore
from ..metadata import LABEL_USE_WAYPOINT
from ..wire.istio.security import authorization_pb2 as sec
from ..wire.istio.workload import workload_pb2 as wl
from .route_status import route_conditions
from .translate.authorization import (
    L4_WHEN_KEYS,
    _http_operation_fields,
    _http_source_fields,
    convert_authorization_policy,
)
from .translate.common import MeshSettings, app_protocol, kube_app_protocol
from .translate.context import Context, ServiceIndex
from .translate.l7_authz import policy_notes
from .translate.policies import PolicyIndex
from .translate.tcp_authz import tcp_notes
from .translate.waypoints import _allows, _use_waypoint, build_waypoints, waypoint_for_service

log = logging.getLogger(__name__)

ZTUNNEL_ACCEPTED = "ZtunnelAccepted"
WAYPOINT_ACCEPTED = "WaypointAccepted"
WAYPOINT_BOUND = "istio.io/WaypointBound"
PROGRAMMED = "Programmed"
# The condition types this control plane owns; other writers' types are left alone.
OWNED_TYPES = frozenset({ZTUNNEL_ACCEPTED, WAYPOINT_ACCEPTED, WAYPOINT_BOUND, PROGRAMMED})

REASON_ACCEPTED = "Accepted"
REASON_UNSUPPORTED = "UnsupportedValue"
REASON_TARGET_NOT_FOUND = "TargetNotFound"
REASON_ANCESTOR_NOT_BOUND = "AncestorNotBound"
REASON_PARTIALLY_INVALID = "PartiallyInvalid"
REASON_INVALID = "Invalid"
REASON_WAYPOINT_ACCEPTED = "WaypointAccepted"
REASON_WAYPOINT_NOT_FOUND = "WaypointNotFound"
REASON_NOT_ALLOWED = "NotAllowed"
REASON_TRAFFIC_TYPE = "TrafficTypeMismatch"
REASON_IGNORED = "Ignored"
REASON_CONFLICTED = "Conflicted"
REASON_ADDRESS_NOT_ASSIGNED = "AddressNotAssigned"
WAYPOINT_CLASS = "istio-waypoint"
# Who writes a route's `status.parents[]` entries (istiod's Gateway API controller name).
GATEWAY_CONTROLLER = "istio.io/gateway-controller"
ROUTE_KINDS = frozenset({"HTTPRoute"})

# Kinds whose status this control plane writes, and every kind the conditions are computed from
# (37 ms for 6,050 objects with 1,000 policies: not redone for a pod's change).
STATUS_KINDS = (
    "AuthorizationPolicy",
    "PeerAuthentication",
    "Service",
    "ServiceEntry",
    "Gateway",
    "HTTPRoute",
)
STATUS_INPUT_KINDS = frozenset({*STATUS_KINDS, "Namespace"})


@dataclass(frozen=True, slots=True, kw_only=True)
class Condition:
    """One `status.conditions` entry (Kubernetes' metav1.Condition)."""

    type: str
    status: bool
    reason: str
    message: str
    observed_generation: int = 0
    last_transition_time: str = ""
    # A route's condition is per parent (Gateway API `status.parents[]`): the parentRef's
    # fields in order; () for an object's own `status.conditions`.
    parent: tuple[tuple[str, str | int], ...] = ()

    @property
    def negative(self) -> bool:
        """What Istio's analyzer (IST0171) reports: a False condition, or a partial acceptance."""
        return not self.status or self.reason in (REASON_PARTIALLY_INVALID, REASON_UNSUPPORTED)

    def same(self, other: Condition) -> bool:
        return (self.type, self.status, self.reason, self.message, self.parent) == (
            other.type,
            other.status,
            other.reason,
            other.message,
            other.parent,
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": self.type,
            "status": "True" if self.status else "False",
            "reason": self.reason,
            "message": self.message,
            "lastTransitionTime": self.last_transition_time,
        }
        if self.observed_generation:
            out["observedGeneration"] = self.observed_generation
        return out

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Condition | None:
        if not isinstance(doc, Mapping) or not isinstance(doc.get("type"), str):
            return None
        generation = doc.get("observedGeneration")
        return cls(
            type=doc["type"],
            status=str(doc.get("status")) == "True",
            reason=str(doc.get("reason", "")),
            message=str(doc.get("message", "")),
            observed_generation=generation if isinstance(generation, int) else 0,
            last_transition_time=str(doc.get("lastTransitionTime") or ""),
        )

    def __str__(self) -> str:
        text = f"{self.type}={'True' if self.status else 'False'} ({self.reason}): {self.message}"
        if self.parent:
            ref = dict(self.parent)
            text = f"parent {ref.get('kind')} {ref.get('namespace')}/{ref.get('name')}: {text}"
        return text


StatusMap = dict[ObjectKey, tuple[Condition, ...]]


# -- AuthorizationPolicy ------------------------------------------------------------------------


def http_attributes(policy: AuthorizationPolicy) -> list[str]:
    """The HTTP-only fields a policy uses, sorted (what ztunnel cannot check)."""
    found: set[str] = set()
    for rule in policy.rules:
        for op in rule.operations:
            found.update(_http_operation_fields(op))
        for src in rule.sources:
            found.update(_http_source_fields(src))
        found.update(c.key for c in rule.when if c.key not in L4_WHEN_KEYS)
    return sorted(found)


def _rule_is_http_only(policy: AuthorizationPolicy, index: int) -> bool:
    """A DENY rule whose every part needs HTTP: with those parts removed nothing is left to match."""
    rule = policy.rules[index]
    for op in rule.operations:
        if op.ports or op.not_ports:
            return False
    for src in rule.sources:
        if any(
            (
                src.principals,
                src.not_principals,
                src.namespaces,
                src.not_namespaces,
                src.ip_blocks,
                src.not_ip_blocks,
                src.service_accounts,
                src.not_service_accounts,
            )
        ):
            return False
    if any(c.key in L4_WHEN_KEYS for c in rule.when):
        return False
    return bool(rule.operations or rule.sources or rule.when)


def ztunnel_condition(policy: AuthorizationPolicy, settings: MeshSettings) -> Condition | None:
    """`ZtunnelAccepted` for a policy without targetRefs (None for one bound to a waypoint)."""
    if policy.target_refs:
        return None
    converted, note = convert_authorization_policy(policy, settings)
    if converted is None:
        # Not sent: the action, or dry-run without WDS dry-run support.
        detail = note.split(": ", 1)[1] if note else "not sent to ztunnel"
        return Condition(type=ZTUNNEL_ACCEPTED, status=False, reason=REASON_UNSUPPORTED, message=detail)
    http = http_attributes(policy)
    if not http:
        return Condition(
            type=ZTUNNEL_ACCEPTED, status=True, reason=REASON_ACCEPTED, message="attached to ztunnel"
        )
    found = f"ztunnel does not support HTTP attributes (found: {', '.join(http)}); a waypoint enforces them. "
    if converted.action == sec.ALLOW:
        if not converted.rules:
            effect = (
                "Every rule of this ALLOW policy uses them, so ztunnel gets it with no rules: it allows "
                "nothing, and the workloads it applies to refuse every connection no other ALLOW policy allows."
            )
        else:
            effect = "ztunnel omits the ALLOW rules that use them (more restrictive than requested)."
    else:
        http_only = [i for i in range(len(policy.rules)) if _rule_is_http_only(policy, i)]
        if len(http_only) == len(policy.rules):
            effect = (
                "Every rule of this DENY policy is HTTP-only, so with them removed it matches nothing: "
                "ztunnel denies nothing for it."
            )
        else:
            effect = (
                "ztunnel enforces this DENY policy on its L4 parts alone, without the HTTP ones "
                "(more restrictive than requested)."
            )
            if http_only:
                effect += f" Rules {', '.join(str(i) for i in http_only)} are HTTP-only and deny nothing."
    return Condition(type=ZTUNNEL_ACCEPTED, status=True, reason=REASON_UNSUPPORTED, message=found + effect)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Binding:
    ancestor: str
    bound: bool
    reason: str
    message: str


def _waypoint_of(ctx: Context, meta: ObjectMeta, what: str) -> tuple[str | None, str, str]:
    """(waypoint resource name or None, reason, message) for a Service or ServiceEntry: the
    translation's own answer (`waypoint_for_service`), and when it is none, which of its
    conditions failed."""
    ctx.notes = []
    wp = waypoint_for_service(ctx, meta, what)
    if wp is not None:
        return (
            wp.resource_name,
            REASON_WAYPOINT_ACCEPTED,
            f"Successfully attached to waypoint {wp.resource_name}",
        )
    key, opted_out = _use_waypoint(meta.labels, meta.namespace)
    if key is None and not opted_out:
        key, _ = _use_waypoint(ctx.namespace_labels(meta.namespace), meta.namespace)
    if key is None:
        return None, "", ""  # opted out, or a waypoint's own service
    found = ctx.waypoints.get(key)
    if found is None:
        return None, REASON_WAYPOINT_NOT_FOUND, f"waypoint {key} does not exist or has no address yet"
    if not _allows(ctx, found, meta.namespace):
        return None, REASON_NOT_ALLOWED, f"waypoint {key} does not allow attachment from {meta.namespace}"
    if found.traffic_type not in ("service", "all"):
        return (
            None,
            REASON_TRAFFIC_TYPE,
            f"waypoint {key} is for {found.traffic_type} traffic, not service traffic",
        )
    return None, "", ""


def waypoint_condition(ctx: Context, policy: AuthorizationPolicy) -> Condition | None:
    """`WaypointAccepted` for a policy with targetRefs, flattened across its targets as istiod does."""
    if not policy.target_refs:
        return None
    bindings = []
    for ref in policy.target_refs:
        namespace = ref.namespace or policy.metadata.namespace
        key = f"{namespace}/{ref.name}"
        ancestor = f"{ref.kind}.{ref.group or 'core'}:{key}"
        if ref.kind == "Gateway":
            if key in ctx.waypoints:
                bindings.append(
                    _Binding(ancestor=ancestor, bound=True, reason=REASON_ACCEPTED, message=f"bound to {key}")
                )
            else:
                bindings.append(
                    _Binding(
                        ancestor=ancestor,
                        bound=False,
                        reason=REASON_TARGET_NOT_FOUND,
                        message=f"waypoint {key} was not found",
                    )
                )
            continue
        if ref.kind in ("Service", "ServiceEntry"):
            target = ctx.objects.get(ref.kind, namespace, ref.name)
            if target is None:
                bindings.append(
                    _Binding(
                        ancestor=ancestor,
                        bound=False,
                        reason=REASON_TARGET_NOT_FOUND,
                        message=f"{ref.kind} {key} was not found",
                    )
                )
                continue
            name, _, _ = _waypoint_of(ctx, target.metadata, f"{ref.kind} {key}")
            if name is not None:
                bindings.append(
                    _Binding(
                        ancestor=ancestor, bound=True, reason=REASON_ACCEPTED, message=f"bound to {name}"
                    )
                )
            else:
                bindings.append(
                    _Binding(
                        ancestor=ancestor,
                        bound=False,
                        reason=REASON_ANCESTOR_NOT_BOUND,
                        message=f"{ref.kind} {key} is not bound to a waypoint",
                    )
                )
            continue
        bindings.append(
            _Binding(
                ancestor=ancestor,
                bound=False,
                reason=REASON_TARGET_NOT_FOUND,
                message=f"unsupported target kind {ref.kind!r}",
            )
        )
    if len(bindings) == 1:
        b = bindings[0]
        return Condition(type=WAYPOINT_ACCEPTED, status=b.bound, reason=b.reason, message=b.message)
    unbound = [b.ancestor for b in bindings if not b.bound]
    bound = len(unbound) < len(bindings)
    reason = REASON_INVALID if not bound else REASON_PARTIALLY_INVALID if unbound else REASON_ACCEPTED
    message = f"Invalid targetRefs: {', '.join(unbound)}" if unbound else ""
    return Condition(type=WAYPOINT_ACCEPTED, status=bound, reason=reason, message=message)


# -- PeerAuthentication -------------------------------------------------------------------------


def _older(a: PeerAuthentication, b: PeerAuthentication) -> bool:
    return (a.metadata.creation_timestamp, a.metadata.name) < (b.metadata.creation_timestamp, b.metadata.name)


def peer_authentication_conditions(
    pas: Iterable[PeerAuthentication], settings: MeshSettings
) -> dict[ObjectKey, Condition]:
    """`ZtunnelAccepted` on every PeerAuthentication (ours: istiod writes none for ambient)."""
    pas = list(pas)
    wide: dict[str, PeerAuthentication] = {}
    for pa in pas:
        if pa.selector is None or not pa.selector.match_labels:
            current = wide.get(pa.metadata.namespace)
            if current is None or _older(pa, current):
                wide[pa.metadata.namespace] = pa
    out: dict[ObjectKey, Condition] = {}
    root = settings.root_namespace
    for pa in pas:
        key = ("PeerAuthentication", pa.metadata.namespace, pa.metadata.name)
        selected = pa.selector is not None and bool(pa.selector.match_labels)
        winner = wide.get(pa.metadata.namespace)
        if selected and pa.metadata.namespace == root:
            out[key] = Condition(
                type=ZTUNNEL_ACCEPTED,
                status=False,
                reason=REASON_IGNORED,
                message=f"a PeerAuthentication with a selector in the root namespace {root!r} applies to no workload "
                "(mesh-wide policies have no selector)",
            )
        elif not selected and winner is not None and winner is not pa:
            scope = "mesh" if pa.metadata.namespace == root else f"namespace {pa.metadata.namespace}"
            out[key] = Condition(
                type=ZTUNNEL_ACCEPTED,
                status=False,
                reason=REASON_CONFLICTED,
                message=f"the {scope} already has the older PeerAuthentication "
                f"{winner.metadata.namespace}/{winner.metadata.name}, which takes effect instead",
            )
        else:
            out[key] = Condition(
                type=ZTUNNEL_ACCEPTED, status=True, reason=REASON_ACCEPTED, message="attached to ztunnel"
            )
    return out


# -- the whole snapshot -------------------------------------------------------------------------


def status_context(store: KubeStore, settings: MeshSettings) -> Context:
    """A translation context for status questions (waypoints resolved, no services built)."""
    return Context(
        objects=store,
        settings=settings,
        waypoints=build_waypoints(store, settings),
        services=ServiceIndex(),
        policies=PolicyIndex(settings),
    )


def compute_status(store: KubeStore, settings: MeshSettings | None = None) -> StatusMap:
    """The conditions of every object this control plane writes status for."""
    settings = settings or MeshSettings()
    ctx = status_context(store, settings)
    out: StatusMap = {}
    for policy in store.authorization_policies:
        key = ("AuthorizationPolicy", policy.metadata.namespace, policy.metadata.name)
        cond = ztunnel_condition(policy, settings) or waypoint_condition(ctx, policy)
        unserved = policy_notes(policy) if cond is not None and policy.target_refs else ()
        if cond is not None and unserved:
            # Bound, but not honoured as written: said where the user looks.
            reason = REASON_UNSUPPORTED if cond.status else cond.reason
            cond = replace(cond, reason=reason, message="; ".join((cond.message, *unserved)))
        if cond is not None:
            out[key] = (cond,)
    for key, cond in peer_authentication_conditions(store.peer_authentications, settings).items():
        out[key] = (cond,)
    targets: list[Service | ServiceEntry] = [*store.services, *store.service_entries]
    for obj in targets:
        ns = store.namespace(obj.metadata.namespace)
        labelled = LABEL_USE_WAYPOINT in obj.metadata.labels or (
            ns is not None and LABEL_USE_WAYPOINT in ns.metadata.labels
        )
        if not labelled:
            continue
        what = f"{obj.kind} {obj.metadata.namespace}/{obj.metadata.name}"
        name, reason, message = _waypoint_of(ctx, obj.metadata, what)
        if reason:
            out[(obj.kind, obj.metadata.namespace, obj.metadata.name)] = (
                Condition(type=WAYPOINT_BOUND, status=name is not None, reason=reason, message=message),
            )
    for gw in store.gateways:
        if gw.gateway_class_name == WAYPOINT_CLASS:
            out[("Gateway", gw.metadata.namespace, gw.metadata.name)] = (_gateway_programmed(ctx, gw),)
    for route in store.http_routes:
        conditions = tuple(
            Condition(type=c.type, status=c.status, reason=c.reason, message=c.message, parent=c.parent)
            for c in route_conditions(ctx, route)
        )
        if conditions:
            out[("HTTPRoute", route.metadata.namespace, route.metadata.name)] = conditions
    return out


def _gateway_programmed(ctx: Context, gw: Gateway) -> Condition:
    wp = ctx.waypoints.get(f"{gw.metadata.namespace}/{gw.metadata.name}")
    if wp is None:
        return Condition(
            type=PROGRAMMED,
            status=False,
            reason=REASON_ADDRESS_NOT_ASSIGNED,
            message="no address yet (neither status.addresses nor a Service of the same name): "
            "node proxies cannot send traffic to this waypoint",
        )
    address = wp.address.hostname.hostname if wp.address.HasField("hostname") else "an IP address"
    return Condition(
        type=PROGRAMMED, status=True, reason="Programmed", message=f"node proxies reach it at {address}"
    )


# A port of these protocols has an HTTP chain only; any other (TCP, TLS, unknown) has a TCP one.
_HTTP_ONLY_PROTOCOLS = (wl.HTTP11, wl.HTTP2, wl.GRPC)


def _has_tcp_port(obj: Service | ServiceEntry) -> bool:
    """Whether a waypoint serving `obj` has a TCP chain for it (a port not declared HTTP)."""
    if isinstance(obj, Service):
        protocols = [kube_app_protocol(p.port, p.name, p.protocol, p.app_protocol) for p in obj.ports]
    else:
        protocols = [app_protocol(p.protocol or p.name) for p in obj.ports]
    return any(p not in _HTTP_ONLY_PROTOCOLS for p in protocols)


def _binds_tcp(ctx: Context, store: KubeStore, policy: AuthorizationPolicy) -> bool:
    """Whether a targetRef policy reaches a TCP chain of a waypoint: a target Service with a
    port that is not HTTP, a target Gateway that serves workload traffic (`direct-tcp`) or such
    a Service, or the GatewayClass (it binds every waypoint)."""
    services: list[Service | ServiceEntry] = [*store.services, *store.service_entries]
    for ref in policy.target_refs:
        namespace = ref.namespace or policy.metadata.namespace
        if ref.kind == "GatewayClass":
            return True
        if ref.kind in ("Service", "ServiceEntry"):
            target = ctx.objects.get(ref.kind, namespace, ref.name)
            if isinstance(target, Service | ServiceEntry) and _has_tcp_port(target):
                return True
        elif ref.kind == "Gateway":
            wp = ctx.waypoints.get(f"{namespace}/{ref.name}")
            if wp is None:
                continue
            if wp.traffic_type in ("workload", "all"):
                return True
            for obj in services:
                bound, _, _ = _waypoint_of(ctx, obj.metadata, f"{obj.kind} {obj.metadata.name}")
                if bound == wp.resource_name and _has_tcp_port(obj):
                    return True
    return False


def tcp_warnings(
    store: KubeStore, keys: Iterable[ObjectKey], settings: MeshSettings | None = None
) -> list[str]:
    """kubectl-style warning lines for the policies of `keys` whose rules name HTTP-only fields
    and that bind a TCP chain of a waypoint: what istiod's TCP semantics make of them there
    (translate/tcp_authz.py `tcp_notes`). Not a condition: the policy is served as istiod serves it."""
    wanted = {key for key in keys if key[0] == "AuthorizationPolicy"}
    if not wanted:
        return []
    ctx = status_context(store, settings or MeshSettings())
    lines: list[str] = []
    for policy in store.authorization_policies:
        key = ("AuthorizationPolicy", policy.metadata.namespace, policy.metadata.name)
        if key in wanted and policy.target_refs and _binds_tcp(ctx, store, policy):
            lines.extend(f"Warning: {note}" for note in tcp_notes(policy))
    return lines


def warnings_for(status: Mapping[ObjectKey, tuple[Condition, ...]], keys: Iterable[ObjectKey]) -> list[str]:
    """kubectl-style warning lines for the negative conditions of `keys`."""
    lines = []
    for key in keys:
        for cond in status.get(key, ()):
            if cond.negative:
                kind, namespace, name = key
                lines.append(f"Warning: {kind} {namespace + '/' if namespace else ''}{name}: {cond}")
    return lines


# -- writers ------------------------------------------------------------------------------------


def merge_conditions(
    existing: Iterable[Condition], ours: Iterable[Condition], now: datetime
) -> tuple[Condition, ...]:
    """Other writers' types kept; ours replaced, keeping lastTransitionTime when status is unchanged."""
    stamp = now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    old = {(c.parent, c.type): c for c in existing}
    # A route's parent entries read back are this controller's own (`conditions_of_status`).
    out = [c for c in old.values() if not c.parent and c.type not in OWNED_TYPES]
    for cond in ours:
        prev = old.get((cond.parent, cond.type))
        if prev is not None and prev.status == cond.status and prev.last_transition_time:
            out.append(replace(cond, last_transition_time=prev.last_transition_time))
        else:
            out.append(replace(cond, last_transition_time=stamp))
    return tuple(out)


def status_document(conditions: Iterable[Condition]) -> dict[str, Any]:
    """The `status` an object shows: its own `conditions`, and for a route one `parents[]` entry
    per parentRef (Gateway API RouteParentStatus, `controllerName` istiod's)."""
    own = [c.to_dict() for c in conditions if not c.parent]
    by_parent: dict[tuple[tuple[str, str | int], ...], list[dict[str, Any]]] = {}
    for c in conditions:
        if c.parent:
            by_parent.setdefault(c.parent, []).append(c.to_dict())
    doc: dict[str, Any] = {}
    if own:
        doc["conditions"] = own
    if by_parent:
        doc["parents"] = [
            {"parentRef": dict(ref), "controllerName": GATEWAY_CONTROLLER, "conditions": conds}
            for ref, conds in by_parent.items()
        ]
    return doc


def conditions_of_status(status: Any) -> tuple[Condition, ...]:
    """This controller's conditions in a `status` as `status_document` writes it (another
    controller's `parents[]` entries are not ours)."""
    if not isinstance(status, Mapping):
        return ()
    out = [Condition.from_dict(i) for i in status.get("conditions") or () if isinstance(i, dict)]
    for entry in status.get("parents") or ():
        if not isinstance(entry, Mapping) or entry.get("controllerName") != GATEWAY_CONTROLLER:
            continue
        ref = entry.get("parentRef")
        if not isinstance(ref, Mapping):
            continue
        parent = tuple((str(k), v) for k, v in ref.items() if isinstance(v, str | int))
        for item in entry.get("conditions") or ():
            cond = Condition.from_dict(item) if isinstance(item, dict) else None
            if cond is not None:
                out.append(replace(cond, parent=parent))
    return tuple(c for c in out if c is not None)


class StatusWriter(Protocol):
    async def write(self, changes: Mapping[ObjectKey, tuple[Condition, ...]], now: datetime) -> int:
        """Write each object's conditions (empty: remove ours); returns how many were written."""


def status_file_name(key: ObjectKey) -> str:
    kind, namespace, name = key
    return f"{kind}.{namespace or '_'}.{name}.json"


def read_status_dir(directory: Path, key: ObjectKey) -> tuple[Condition, ...]:
    """What a DirectoryStatusWriter stored for one object."""
    try:
        doc = json.loads((directory / status_file_name(key)).read_text())
    except (OSError, ValueError):
        return ()
    return conditions_of_status(doc)


class DirectoryStatusWriter:
    """A YAML directory's status subresource: one JSON file per object, its `status_document`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.writes = 0

    def __repr__(self) -> str:
        return f"DirectoryStatusWriter({self.directory}, {self.writes} writes)"

    async def write(self, changes: Mapping[ObjectKey, tuple[Condition, ...]], now: datetime) -> int:
        self.directory.mkdir(parents=True, exist_ok=True)
        for key, conditions in changes.items():
            path = self.directory / status_file_name(key)
            merged = merge_conditions(read_status_dir(self.directory, key), conditions, now)
            if not merged:
                path.unlink(missing_ok=True)
                continue
            text = json.dumps(status_document(merged), indent=2) + "\n"
            atomic_write(path, text.encode())
            self.writes += 1
        return len(changes)


class KubeStatusWriter:
    """The API server: GET the object (for its generation and others' conditions), then a merge
    PATCH of its status subresource (RBAC: `<resource>/status` patch, nothing else)."""

    def __init__(self, client: KubeClient, resources: Mapping[str, Resource]) -> None:
        self.client = client
        self.resources = dict(resources)
        self.writes = 0
        self.failures = 0

    def __repr__(self) -> str:
        return f"KubeStatusWriter({self.writes} writes, {self.failures} failures)"

    async def write(self, changes: Mapping[ObjectKey, tuple[Condition, ...]], now: datetime) -> int:
        written = 0
        for key, conditions in changes.items():
            kind, namespace, name = key
            resource = self.resources.get(kind)
            if resource is None:
                continue
            try:
                current = await self.client.get(resource, namespace or None, name)
                if current is None:
                    continue  # deleted meanwhile
                generation = current.get("metadata", {}).get("generation")
                status = current.get("status") if isinstance(current.get("status"), dict) else {}
                existing = conditions_of_status(status)
                ours = [
                    replace(c, observed_generation=generation) if isinstance(generation, int) else c
                    for c in conditions
                ]
                merged = merge_conditions(existing, ours, now)
                if status_document(merged) == status_document(existing):
                    continue
                await self.client.patch_merge(
                    resource,
                    namespace or None,
                    name,
                    {"status": _status_patch(kind, status or {}, merged)},
                    subresource="status",
                )
                written += 1
                self.writes += 1
            except KubeApiError as exc:
                self.failures += 1
                log.warning("cannot write the status of %s %s/%s: %s", kind, namespace, name, exc)
        return written


def _status_patch(kind: str, status: Mapping[str, Any], merged: Iterable[Condition]) -> dict[str, Any]:
    """A merge patch of `status`: a route's `parents` list (a merge patch replaces a list whole,
    so other controllers' entries are sent back as they were), anything else's `conditions`."""
    doc = status_document(merged)
    if kind in ROUTE_KINDS:
        others = [
            p
            for p in status.get("parents") or ()
            if isinstance(p, Mapping) and p.get("controllerName") != GATEWAY_CONTROLLER
        ]
        return {"parents": [*others, *doc.get("parents", [])]}
    return {"conditions": doc.get("conditions", [])}


def changed_status(previous: Mapping[ObjectKey, tuple[Condition, ...]], current: StatusMap) -> StatusMap:
    """What to write: objects whose conditions differ, and () for objects that lost theirs."""
    out: StatusMap = {}
    for key, conditions in current.items():
        old = previous.get(key)
        if (
            old is None
            or len(old) != len(conditions)
            or not all(a.same(b) for a, b in zip(old, conditions, strict=True))
        ):
            out[key] = conditions
    for key in previous.keys() - current.keys():
        out[key] = ()
    return out
