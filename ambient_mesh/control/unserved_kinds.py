"""Istio and Gateway API kinds a waypoint user may apply that this mesh does not serve, and the
sentence that says so where they are applied (`lab apply` refuses them, `ambient control` logs
them when it reads its directory). A setting that would not act is never taken in silence."""

from __future__ import annotations

_NO_ROUTES = "only HTTPRoute and VirtualService `http` routes are served by the waypoint"

UNSERVED_KINDS: dict[str, str] = {
    "RequestAuthentication": (
        "JWT authentication is not supported: no request is checked for a token, and "
        "AuthorizationPolicy rules on requestPrincipals or request.auth.claims never match"
    ),
    "DestinationRule": (
        "not supported: its subsets, TLS, load balancing, connection pool and outlier detection "
        "are not applied, and a route to a subset is not served"
    ),
    "EnvoyFilter": "not supported: the waypoint's Envoy configuration cannot be patched",
    "WasmPlugin": "not supported: the waypoint loads no Wasm plugins",
    "Telemetry": "not supported: the waypoint's metrics and access log are Istio's defaults, fixed",
    "Sidecar": "not used: ambient mode has no sidecars",
    "TCPRoute": f"not supported: {_NO_ROUTES}",
    "TLSRoute": f"not supported: {_NO_ROUTES}",
    "GRPCRoute": f"not supported: {_NO_ROUTES}",
}


def unserved_kind(kind: str) -> str | None:
    """What it means that `kind` is not served, or None for a kind this module does not know."""
    return UNSERVED_KINDS.get(kind)


def explain_note(note: str) -> str:
    """A loader note ("<file>: <Kind> <ns>/<name> (<apiVersion>): kind not used by the control
    plane, ignored") with what that kind's absence means, when it is one of Istio's."""
    _, _, rest = note.partition(": ")
    meaning = unserved_kind(rest.split(" ", 1)[0]) if rest else None
    return f"{note}: {meaning}" if meaning else note
