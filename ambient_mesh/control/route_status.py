"""A route's conditions per parent: what Gateway API's `status.parents[]` tells a user of an
HTTPRoute whose parent is a Service (mesh routing, served by that service's waypoint).

Counterpart: istiod's Gateway API status for mesh routes (pilot/pkg/config/kube/gateway,
RouteParentStatus with controllerName `istio.io/gateway-controller`). Per parentRef, two
conditions: `Accepted` (the parent takes the route) and `ResolvedRefs` (every backend exists).

- Accepted True, reason `Accepted`, when the parent Service exists, the parentRef's port (if
  any) is one of its ports, and the Service uses a waypoint. Where istiod would accept the route
  for sidecars, this mesh has none: a Service without a waypoint, or a missing one, gives
  Accepted False with reason `NoMatchingParent` and a message saying what to fix (our reading:
  the route acts nowhere, and a setting that does not act is said).
- ResolvedRefs False, reason `BackendNotFound` ("backend(<host>) not found", as istiod words
  it), when a backendRef or mirror names a Service that does not exist; True, `ResolvedRefs`,
  otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..kube.model import HTTPRoute, RouteParent, Service
from .translate.context import Context
from .translate.http_routes import fqdn
from .translate.waypoints import waypoint_for_service

ACCEPTED = "Accepted"
RESOLVED_REFS = "ResolvedRefs"
REASON_NO_MATCHING_PARENT = "NoMatchingParent"
REASON_BACKEND_NOT_FOUND = "BackendNotFound"

ParentRef = tuple[tuple[str, str | int], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteCondition:
    """One condition of one parent (status.py makes it a `Condition`)."""

    parent: ParentRef
    type: str
    status: bool
    reason: str
    message: str


def parent_ref(parent: RouteParent) -> ParentRef:
    """The parentRef as status echoes it (Gateway API field order; the port only when given)."""
    ref: list[tuple[str, str | int]] = [
        ("group", parent.group),
        ("kind", parent.kind),
        ("name", parent.name),
        ("namespace", parent.namespace),
    ]
    if parent.port:
        ref.append(("port", parent.port))
    return tuple(ref)


def _accepted(ctx: Context, route: HTTPRoute, parent: RouteParent) -> tuple[bool, str, str]:
    what = f"Service {parent.namespace}/{parent.name}"
    svc = ctx.objects.get("Service", parent.namespace, parent.name)
    if not isinstance(svc, Service):
        return False, REASON_NO_MATCHING_PARENT, f"parent {what} not found"
    if parent.port and parent.port not in {p.port for p in svc.ports}:
        return False, REASON_NO_MATCHING_PARENT, f"port {parent.port} is not a port of {what}"
    ctx.notes = []
    if waypoint_for_service(ctx, svc.metadata, what) is None:
        why = f" ({ctx.notes[-1]})" if ctx.notes else ""
        return (
            False,
            REASON_NO_MATCHING_PARENT,
            f"{what} uses no waypoint{why}: in ambient mode only a waypoint routes HTTP, so this "
            "route is not served; label the Service or its namespace istio.io/use-waypoint",
        )
    return True, ACCEPTED, "Route was valid"


def _missing_backends(ctx: Context, route: HTTPRoute) -> list[str]:
    suffix = ctx.settings.domain_suffix
    missing: list[str] = []
    for rule in route.http:
        targets = [*rule.destinations, *(m.destination for m in rule.mirrors)]
        for dest in targets:
            host = fqdn(dest.host, dest.namespace, suffix)
            name, _, rest = host.partition(".")
            namespace = rest.partition(".")[0]
            if not host.endswith(f".svc.{suffix}"):
                continue  # not a Service name (a ServiceEntry host): nothing to look up
            if ctx.objects.get("Service", namespace, name) is None and host not in missing:
                missing.append(host)
    return missing


def route_conditions(ctx: Context, route: HTTPRoute) -> list[RouteCondition]:
    """`Accepted` and `ResolvedRefs` for each Service parent of `route`."""
    missing = _missing_backends(ctx, route)
    if missing:
        resolved = (False, REASON_BACKEND_NOT_FOUND, ", ".join(f"backend({h}) not found" for h in missing))
    else:
        resolved = (True, RESOLVED_REFS, "All references resolved")
    out: list[RouteCondition] = []
    for parent in route.parents:
        ref = parent_ref(parent)
        status, reason, message = _accepted(ctx, route, parent)
        out.append(RouteCondition(parent=ref, type=ACCEPTED, status=status, reason=reason, message=message))
        out.append(
            RouteCondition(
                parent=ref, type=RESOLVED_REFS, status=resolved[0], reason=resolved[1], message=resolved[2]
            )
        )
    return out
