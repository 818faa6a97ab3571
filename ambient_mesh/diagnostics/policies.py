"""Which policies a node proxy applies to a workload, and why each one does.

The list is the data plane's own (`rbac.policies_for` over the state `mesh_state.py` builds);
this module only adds the reason in the user's terms: the AuthorizationPolicy's scope or
selector, or the PeerAuthentication a converted policy comes from, and the condition the control
plane wrote on its object.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..control.translate.peer_authentication import (
    CONVERTED_PEER_AUTHENTICATION_PREFIX,
    STATIC_STRICT_POLICY_NAME,
)
from ..kube.model import AuthorizationPolicy, PeerAuthentication
from ..rbac import Authorization, Scope, policies_for
from ..state.model import Workload
from ..state.store import ProxyState
from .view import MeshView


@dataclass(frozen=True, slots=True, kw_only=True)
class AppliedPolicy:
    policy: Authorization
    source: str  # the object it comes from: "AuthorizationPolicy demo/x", "PeerAuthentication demo/y"
    why: str  # why it applies to this workload
    condition: str = ""  # the control plane's condition on that object, if it wrote one


def _labels(selector_labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels.items()))


def effective_peer_authentication(view: MeshView, namespace: str, labels: dict[str, str]) -> tuple[str, str]:
    """(mode, which PeerAuthentication sets it) for a workload: workload, then namespace, then
    mesh; the oldest of each level wins (istiod's order); UNSET inherits."""
    root = view.settings.root_namespace

    def oldest(pas: list[PeerAuthentication]) -> PeerAuthentication | None:
        return min(pas, key=lambda p: (p.metadata.creation_timestamp, p.metadata.name), default=None)

    pas = view.store.peer_authentications
    levels = (
        oldest(
            [
                p
                for p in pas
                if p.metadata.namespace == namespace != root
                and p.selector is not None
                and p.selector.match_labels
                and p.selector.matches(labels)
            ]
        ),
        oldest(
            [
                p
                for p in pas
                if p.metadata.namespace == namespace and (p.selector is None or not p.selector.match_labels)
            ]
        ),
        oldest(
            [
                p
                for p in pas
                if p.metadata.namespace == root and (p.selector is None or not p.selector.match_labels)
            ]
        ),
    )
    for pa in levels:
        if pa is not None and (pa.mtls_mode or "UNSET") != "UNSET":
            return pa.mtls_mode or "UNSET", f"PeerAuthentication {pa.metadata.namespace}/{pa.metadata.name}"
    return "PERMISSIVE", "no PeerAuthentication (Istio's default)"


def applied_policies(view: MeshView, state: ProxyState, workload: Workload) -> list[AppliedPolicy]:
    status = view.status
    root = view.settings.root_namespace
    labels: dict[str, str] = {}
    obj = view.store.get("Pod", workload.namespace, workload.name)
    if obj is not None:
        labels = dict(obj.metadata.labels)
    out = []
    for p in policies_for(state.policies, workload):
        if p.name == STATIC_STRICT_POLICY_NAME:
            mode, source = effective_peer_authentication(view, workload.namespace, labels)
            out.append(
                AppliedPolicy(
                    policy=p,
                    source=source,
                    why=f"mTLS {mode} for this workload: connections without a peer identity are denied",
                )
            )
            continue
        if p.name.startswith(CONVERTED_PEER_AUTHENTICATION_PREFIX):
            name = p.name.removeprefix(CONVERTED_PEER_AUTHENTICATION_PREFIX)
            out.append(
                AppliedPolicy(
                    policy=p,
                    source=f"PeerAuthentication {p.namespace}/{name}",
                    why="its portLevelMtls selects this workload: per-port mTLS modes",
                )
            )
            continue
        ap = view.store.get("AuthorizationPolicy", p.namespace, p.name)
        if p.scope is Scope.GLOBAL:
            why = f"mesh-wide: in the root namespace {root} without a selector"
        elif p.scope is Scope.NAMESPACE:
            why = f"namespace-wide: in {p.namespace} without a selector"
        elif isinstance(ap, AuthorizationPolicy) and ap.selector is not None:
            why = f"its selector {_labels(dict(ap.selector.match_labels))} matches the workload's labels"
        else:
            why = "listed for this workload by the control plane"
        conditions = status.get(("AuthorizationPolicy", p.namespace, p.name), ())
        out.append(
            AppliedPolicy(
                policy=p,
                source=f"AuthorizationPolicy {p.namespace}/{p.name}",
                why=why,
                condition="; ".join(str(c) for c in conditions),
            )
        )
    return out
