"""`ambient analyze`: the checks of `istioctl analyze` that apply to an ambient mesh.

Counterpart: istioctl analyze (pkg/config/analysis/analyzers). Messages print in Istio's format,
`Level [CODE] (Kind name.namespace) text`, with Istio's code where Istio has one:

  IST0101 ReferencedResourceNotFound   a use-waypoint label or a targetRef names no such object
  IST0127 NoMatchingWorkloadsFound     a policy's selector selects no workload
  IST0134 ServiceEntryAddressesRequired a ServiceEntry with TCP ports but no addresses (no VIP to
                                        capture)
  IST0171 NegativeConditionStatus      a False condition in the status the control plane writes
                                        (and WaypointAccepted PartiallyInvalid)

and codes of ours (AMB01xx) for what Istio's analyzers do not check:

  AMB0101 ServiceWithoutEndpoints      a Service whose selector matches no ready pod
  AMB0102 ConflictingPeerAuthentication two PeerAuthentications compete for one scope or workload
  AMB0103 L7FieldsAtL4                 a policy bound to the node proxy uses HTTP attributes
  AMB0104 WaypointOutsideAmbient        a use-waypoint label on a namespace not in ambient mode
  AMB0105 SchemaError                  an object the control plane cannot read (Istio: IST0106)
  AMB0106 PolicyOutsideAmbient          a policy selecting only pods outside ambient mode

Every check is a pure function of a `MeshView`; `analyze` runs them all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..control.status import (
    REASON_CONFLICTED,
    REASON_PARTIALLY_INVALID,
    REASON_UNSUPPORTED,
    WAYPOINT_ACCEPTED,
    ZTUNNEL_ACCEPTED,
)
from ..control.translate.workloads import pod_enrolled
from ..kube.labels import LabelSelector
from ..kube.model import Pod
from ..kube.store import KubeStore
from ..metadata import LABEL_DATAPLANE_MODE, LABEL_USE_WAYPOINT, LABEL_USE_WAYPOINT_NAMESPACE
from .view import MeshView

ERROR, WARNING, INFO = "Error", "Warning", "Info"
LEVEL_ORDER = {ERROR: 0, WARNING: 1, INFO: 2}


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    code: str
    name: str  # Istio's message name
    level: str
    kind: str
    namespace: str
    object_name: str
    text: str

    @property
    def resource(self) -> str:
        # Istio's `<kind> <name>.<namespace>`, the namespace left out for cluster-scoped kinds
        return f"{self.kind} {self.object_name}{'.' + self.namespace if self.namespace else ''}"

    def __str__(self) -> str:
        return f"{self.level} [{self.code}] ({self.resource}) {self.text}"

    def to_dict(self) -> dict[str, str]:
        return {
            "code": self.code,
            "name": self.name,
            "level": self.level,
            "resource": self.resource,
            "message": self.text,
        }


Check = Callable[[MeshView], Iterable[Message]]


def _workload_labels(store: KubeStore, namespace: str | None) -> list[dict[str, str]]:
    """Labels of every pod and WorkloadEntry (in `namespace`, or everywhere for None)."""
    out: list[dict[str, str]] = []
    for p in store.pods:
        if namespace is None or p.metadata.namespace == namespace:
            out.append(dict(p.metadata.labels))
    for we in store.workload_entries:
        if namespace is None or we.metadata.namespace == namespace:
            out.append(dict(we.metadata.labels))
    return out


def _labels_text(selector: LabelSelector) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector.match_labels.items()))


def check_selectors(view: MeshView) -> Iterable[Message]:
    """IST0127: a policy whose selector matches no workload (in its namespace; in the root
    namespace, in any namespace) does nothing."""
    store, root = view.store, view.settings.root_namespace
    for kind, policies in (
        ("AuthorizationPolicy", store.authorization_policies),
        ("PeerAuthentication", store.peer_authentications),
    ):
        for p in policies:
            sel = p.selector
            if sel is None or not sel.match_labels:
                continue
            ns = p.metadata.namespace
            candidates = _workload_labels(store, None if ns == root else ns)
            if not any(sel.matches(labels) for labels in candidates):
                yield Message(
                    code="IST0127",
                    name="NoMatchingWorkloadsFound",
                    level=WARNING,
                    kind=kind,
                    namespace=ns,
                    object_name=p.metadata.name,
                    text=f"No matching workloads for this resource with the following labels: {_labels_text(sel)}",
                )


def _waypoint_key(labels: dict[str, str], namespace: str) -> str | None:
    value = labels.get(LABEL_USE_WAYPOINT)
    if value is None or value == "none":
        return None
    return f"{labels.get(LABEL_USE_WAYPOINT_NAMESPACE, namespace)}/{value}"


def check_waypoint_references(view: MeshView) -> Iterable[Message]:
    """IST0101: `istio.io/use-waypoint` or a policy's targetRef naming a Gateway (or Service)
    that does not exist; AMB0104: a waypoint label on a namespace outside ambient mode."""
    store = view.store
    gateways = {f"{g.metadata.namespace}/{g.metadata.name}" for g in store.gateways}
    labelled: list[tuple[str, str, str, dict[str, str]]] = [
        ("Namespace", "", ns.metadata.name, dict(ns.metadata.labels)) for ns in store.namespaces
    ]
    labelled += [
        (s.kind, s.metadata.namespace, s.metadata.name, dict(s.metadata.labels)) for s in store.services
    ]
    labelled += [
        (s.kind, s.metadata.namespace, s.metadata.name, dict(s.metadata.labels))
        for s in store.service_entries
    ]
    labelled += [(p.kind, p.metadata.namespace, p.metadata.name, dict(p.metadata.labels)) for p in store.pods]
    for kind, namespace, name, labels in labelled:
        key = _waypoint_key(labels, namespace or name)
        if key is not None and key not in gateways:
            yield Message(
                code="IST0101",
                name="ReferencedResourceNotFound",
                level=ERROR,
                kind=kind,
                namespace=namespace,
                object_name=name,
                text=f'Referenced waypoint not found: "{key}"',
            )
        if kind == "Namespace" and key is not None and labels.get(LABEL_DATAPLANE_MODE) != "ambient":
            yield Message(
                code="AMB0104",
                name="WaypointOutsideAmbient",
                level=WARNING,
                kind=kind,
                namespace="",
                object_name=name,
                text=f"the namespace uses waypoint {key} but is not in ambient mode "
                f"({LABEL_DATAPLANE_MODE}=ambient): no node proxy captures its traffic, so none goes to the waypoint",
            )
    for p in store.authorization_policies:
        for ref in p.target_refs:
            ns = ref.namespace or p.metadata.namespace
            if ref.kind == "Gateway":
                exists = f"{ns}/{ref.name}" in gateways
            elif ref.kind in ("Service", "ServiceEntry"):
                exists = store.get(ref.kind, ns, ref.name) is not None
            else:
                continue
            if not exists:
                yield Message(
                    code="IST0101",
                    name="ReferencedResourceNotFound",
                    level=ERROR,
                    kind="AuthorizationPolicy",
                    namespace=p.metadata.namespace,
                    object_name=p.metadata.name,
                    text=f'Referenced {ref.kind.lower()} not found: "{ns}/{ref.name}"',
                )


def check_service_endpoints(view: MeshView) -> Iterable[Message]:
    """AMB0101: a Service with a selector and no ready pod behind it: node proxies have no
    endpoint to send it (the connection is refused: "no healthy upstream")."""
    store = view.store
    for svc in store.services:
        if not svc.selector or svc.type == "ExternalName":
            continue
        pods = [
            p
            for p in store.pods
            if p.metadata.namespace == svc.metadata.namespace
            and all(p.metadata.labels.get(k) == v for k, v in svc.selector.items())
        ]
        ready = [p for p in pods if p.ready or (p.phase == "Running" and not p.conditions)]
        if ready:
            continue
        sel = ",".join(f"{k}={v}" for k, v in sorted(svc.selector.items()))
        detail = f"{len(pods)} pods match but none is ready" if pods else "no pod matches"
        yield Message(
            code="AMB0101",
            name="ServiceWithoutEndpoints",
            level=WARNING,
            kind="Service",
            namespace=svc.metadata.namespace,
            object_name=svc.metadata.name,
            text=f"the Service has no endpoints ({detail} its selector {sel}): connections to it are refused",
        )


def _pods_selected(store: KubeStore, namespace: str, selector: LabelSelector) -> list[Pod]:
    return [
        p for p in store.pods if p.metadata.namespace == namespace and selector.matches(p.metadata.labels)
    ]


def check_peer_authentications(view: MeshView) -> Iterable[Message]:
    """AMB0102: two mesh- or namespace-wide PeerAuthentications in one namespace, or two
    workload PeerAuthentications selecting the same pod: only the oldest takes effect."""
    status = view.status
    for pa in view.store.peer_authentications:
        key = ("PeerAuthentication", pa.metadata.namespace, pa.metadata.name)
        for cond in status.get(key, ()):
            if cond.reason == REASON_CONFLICTED:
                yield Message(
                    code="AMB0102",
                    name="ConflictingPeerAuthentication",
                    level=ERROR,
                    kind="PeerAuthentication",
                    namespace=pa.metadata.namespace,
                    object_name=pa.metadata.name,
                    text=cond.message,
                )
    by_pod: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for pa in view.store.peer_authentications:
        if (
            pa.selector is None
            or not pa.selector.match_labels
            or pa.metadata.namespace == view.settings.root_namespace
        ):
            continue
        for pod in _pods_selected(view.store, pa.metadata.namespace, pa.selector):
            by_pod.setdefault((pod.metadata.namespace, pod.metadata.name), []).append(
                (pa.metadata.creation_timestamp, pa.metadata.name)
            )
    for (namespace, pod_name), pas in sorted(by_pod.items()):
        if len(pas) < 2:
            continue
        pas.sort()
        winner = pas[0][1]
        for _, loser in pas[1:]:
            yield Message(
                code="AMB0102",
                name="ConflictingPeerAuthentication",
                level=ERROR,
                kind="PeerAuthentication",
                namespace=namespace,
                object_name=loser,
                text=f"selects pod {namespace}/{pod_name} as the older {namespace}/{winner} does, "
                "which takes effect instead",
            )


def check_conditions(view: MeshView) -> Iterable[Message]:
    """IST0171 for negative conditions; AMB0103 for HTTP attributes at the node proxy."""
    for (kind, namespace, name), conditions in sorted(view.status.items()):
        for cond in conditions:
            if cond.type == ZTUNNEL_ACCEPTED and cond.status and cond.reason == REASON_UNSUPPORTED:
                yield Message(
                    code="AMB0103",
                    name="L7FieldsAtL4",
                    level=WARNING,
                    kind=kind,
                    namespace=namespace,
                    object_name=name,
                    text=cond.message,
                )
            elif not cond.status or (
                cond.type == WAYPOINT_ACCEPTED and cond.reason == REASON_PARTIALLY_INVALID
            ):
                if cond.reason == REASON_CONFLICTED:
                    continue  # AMB0102 says it
                yield Message(
                    code="IST0171",
                    name="NegativeConditionStatus",
                    level=WARNING,
                    kind=kind,
                    namespace=namespace,
                    object_name=name,
                    text=f"A condition with a negative status is present: type={cond.type}, "
                    f"reason={cond.reason}, message={cond.message}",
                )


def check_service_entries(view: MeshView) -> Iterable[Message]:
    """IST0134: a ServiceEntry with TCP (or unnamed protocol) ports and no addresses: without
    a VIP the node proxy cannot tell its traffic apart."""
    for se in view.store.service_entries:
        if se.addresses:
            continue
        tcp = [p for p in se.ports if p.protocol.upper() in ("", "TCP", "TLS", "MONGO", "MYSQL")]
        if tcp:
            yield Message(
                code="IST0134",
                name="ServiceEntryAddressesRequired",
                level=WARNING,
                kind="ServiceEntry",
                namespace=se.metadata.namespace,
                object_name=se.metadata.name,
                text="ServiceEntry addresses are required for this protocol.",
            )


def check_uncaptured_policies(view: MeshView) -> Iterable[Message]:
    """AMB0106: a policy whose selected pods are none of them in ambient mode."""
    store, root = view.store, view.settings.root_namespace
    for p in store.authorization_policies:
        if p.selector is None or not p.selector.match_labels or p.metadata.namespace == root or p.target_refs:
            continue
        pods = _pods_selected(store, p.metadata.namespace, p.selector)
        ns = store.namespace(p.metadata.namespace)
        ns_labels = ns.metadata.labels if ns is not None else {}
        if pods and not any(pod_enrolled(pod, ns_labels) for pod in pods):
            yield Message(
                code="AMB0106",
                name="PolicyOutsideAmbient",
                level=WARNING,
                kind="AuthorizationPolicy",
                namespace=p.metadata.namespace,
                object_name=p.metadata.name,
                text=f"none of the {len(pods)} pods it selects is in ambient mode: no node proxy enforces it",
            )


def check_load_errors(view: MeshView) -> Iterable[Message]:
    for e in view.errors:
        kind, _, rest = e.object.partition(" ")
        namespace, _, name = rest.rpartition("/")
        yield Message(
            code="AMB0105",
            name="SchemaError",
            level=ERROR,
            kind=kind or "File",
            namespace=namespace,
            object_name=name or e.file,
            text=f"{e.file}: {e.field + ': ' if e.field else ''}{e.message}",
        )


CHECKS: tuple[Check, ...] = (
    check_load_errors,
    check_selectors,
    check_waypoint_references,
    check_service_endpoints,
    check_peer_authentications,
    check_conditions,
    check_service_entries,
    check_uncaptured_policies,
)


def analyze(view: MeshView, *, namespace: str | None = None) -> list[Message]:
    """Every check's messages, errors first, then by resource (istioctl's order)."""
    found = {m for check in CHECKS for m in check(view)}
    if namespace is not None:
        found = {
            m
            for m in found
            if m.namespace == namespace or (m.kind == "Namespace" and m.object_name == namespace)
        }
    return sorted(
        found, key=lambda m: (LEVEL_ORDER[m.level], m.kind, m.namespace, m.object_name, m.code, m.text)
    )


def render(messages: list[Message], where: str) -> str:
    if not messages:
        return f"\u2714 No validation issues found when analyzing {where}.\n"
    return "".join(f"{m}\n" for m in messages)
