"""`ambient x describe pod|service`: one workload or service as the mesh sees it.

Counterpart: `istioctl x describe pod|service` (istioctl/pkg/describe). For a pod: identity,
node, addresses, whether a node proxy captures it and why, its waypoint, the services it backs,
and every policy the node proxy applies to it, in the data plane's order, with why it applies
and what the control plane said about it. For a service: its VIPs and ports, waypoint binding,
endpoints and load balancing. Everything comes from the node proxies' state for the view
(mesh_state.py) and the control plane's conditions, so it cannot say other than they do.
"""

from __future__ import annotations

from ..control.translate.workloads import pod_enrolled
from ..errors import AmbientError
from ..kube.model import Pod
from ..metadata import LABEL_DATAPLANE_MODE, LABEL_USE_WAYPOINT
from ..state.model import GatewayAddress, NamespacedHostname, TunnelProtocol, Workload
from ..state.store import ProxyState
from .policies import applied_policies, effective_peer_authentication
from .view import MeshView


def split_name(text: str, default_namespace: str) -> tuple[str, str]:
    """`ns/name`, `name.ns` (istioctl's form) or `name` in the default namespace."""
    if "/" in text:
        namespace, name = text.split("/", 1)
        return namespace, name
    if "." in text:
        name, namespace = text.split(".", 1)
        return namespace, name
    return default_namespace, text


def gateway_text(gateway: GatewayAddress | None) -> str:
    if gateway is None:
        return "none"
    dest = gateway.destination
    if isinstance(dest, NamespacedHostname):
        return f"{dest.namespace}/{dest.hostname} (HBONE port {gateway.hbone_mtls_port})"
    return f"{dest.address} (HBONE port {gateway.hbone_mtls_port})"


def find_pod_workload(state: ProxyState, namespace: str, name: str) -> Workload | None:
    for w in state.workloads.find_by_name(namespace, name):
        return w
    return None


def capture_text(view: MeshView, pod: Pod, workload: Workload | None) -> str:
    ns = view.store.namespace(pod.metadata.namespace)
    ns_labels = dict(ns.metadata.labels) if ns is not None else {}
    if pod.host_network:
        return "not captured: the pod uses the host network"
    if not pod_enrolled(pod, ns_labels):
        own = pod.metadata.labels.get(LABEL_DATAPLANE_MODE)
        why = (
            f"the pod is labelled {LABEL_DATAPLANE_MODE}={own}"
            if own is not None
            else f"neither the pod nor namespace {pod.metadata.namespace} is labelled {LABEL_DATAPLANE_MODE}=ambient"
        )
        return f"not captured: {why}; its traffic bypasses the node proxy (plain TCP, no identity)"
    source = (
        "the pod's"
        if LABEL_DATAPLANE_MODE in pod.metadata.labels
        else f"namespace {pod.metadata.namespace}'s"
    )
    protocol = workload.protocol.value if workload is not None else "?"
    return (
        f"captured in ambient mode ({source} {LABEL_DATAPLANE_MODE}=ambient): the node proxy on "
        f"{pod.node_name or '?'} handles its traffic, inbound over {protocol}"
    )


def describe_pod(view: MeshView, state: ProxyState, namespace: str, name: str) -> list[str]:
    pod = view.store.get("Pod", namespace, name)
    if not isinstance(pod, Pod):
        raise AmbientError(f"pod {namespace}/{name} not found in {view.where}")
    w = find_pod_workload(state, namespace, name)
    lines = [f"Pod: {namespace}/{name}"]
    lines.append(f"   Node: {pod.node_name or '<none>'}   IP: {', '.join(pod.ips) or '<none>'}")
    sa = pod.service_account_name or "default"
    lines.append(f"   Identity: spiffe://{view.settings.trust_domain}/ns/{namespace}/sa/{sa}")
    lines.append(f"   Capture: {capture_text(view, pod, w)}")
    if w is None:
        lines.append(
            "   Workload: not sent to node proxies (no IP yet, or not a workload the control plane serves)"
        )
        return lines
    lines.append(f"   Workload: {w.uid} ({w.protocol.value}, {w.status.value})")
    wp = "none" if w.waypoint is None else gateway_text(w.waypoint)
    via = ""
    if w.waypoint is not None:
        label_on = "pod" if LABEL_USE_WAYPOINT in pod.metadata.labels else f"namespace {namespace}"
        via = f" (istio.io/use-waypoint on the {label_on}; workload-addressed traffic goes through it)"
    lines.append(f"   Waypoint: {wp}{via}")
    services = sorted(w.services)
    if services:
        lines.append("   Services:")
        for key in services:
            svc = state.services.get(key)
            ports = ", ".join(f"{p} -> {t}" for p, t in sorted(w.services[key].items()))
            waypoint = f"; waypoint {gateway_text(svc.waypoint)}" if svc is not None and svc.waypoint else ""
            lines.append(f"      {key} ({ports}){waypoint}")
    mode, source = effective_peer_authentication(view, namespace, dict(pod.metadata.labels))
    lines.append(f"   mTLS: {mode} (from {source})")
    applied = applied_policies(view, state, w)
    if not applied:
        lines.append("   Authorization: no policy applies; every connection is allowed (Istio's default)")
        return lines
    lines.append("   Authorization (evaluated by the node proxy: DENY policies first, then ALLOW):")
    for a in sorted(applied, key=lambda a: a.policy.action.value != "Deny"):
        dry = " (dry-run)" if a.policy.dry_run else ""
        lines.append(f"      {a.policy.action.value.upper()} {a.policy.key}{dry}: {a.source}; {a.why}")
        if a.condition:
            lines.append(f"         {a.condition}")
    if w.protocol is not TunnelProtocol.HBONE:
        lines.append(
            "   Note: this workload is not captured, so its own node proxy enforces none of these; "
            "traffic to it is plain TCP"
        )
    return lines


def describe_service(view: MeshView, state: ProxyState, namespace: str, name: str) -> list[str]:
    obj = view.store.get("Service", namespace, name)
    if obj is None:
        raise AmbientError(f"service {namespace}/{name} not found in {view.where}")
    hostname = f"{name}.{namespace}.svc.{view.settings.domain_suffix}"
    svc = state.services.get(f"{namespace}/{hostname}")
    lines = [f"Service: {namespace}/{name} ({hostname})"]
    if svc is None:
        lines.append("   not sent to node proxies (no cluster IP, or a headless or ExternalName service)")
        return lines
    lines.append(f"   VIPs: {', '.join(str(v.address) for v in svc.vips) or '<none>'}")
    lines.append(f"   Ports: {', '.join(f'{p} -> {t}' for p, t in sorted(svc.ports.items())) or '<none>'}")
    for cond in view.status.get(("Service", namespace, name), ()):
        lines.append(f"   Waypoint: {gateway_text(svc.waypoint)}; {cond}")
        break
    else:
        lines.append(f"   Waypoint: {gateway_text(svc.waypoint)}")
    lb = svc.load_balancer
    if lb is not None:
        prefs = ", ".join(p.value for p in lb.routing_preferences) or "none"
        lines.append(f"   Load balancing: {lb.mode.value}, routing preferences: {prefs}")
    if not svc.endpoints:
        lines.append("   Endpoints: none: connections to it are refused (no healthy upstream)")
        return lines
    lines.append(f"   Endpoints ({len(svc.endpoints)}):")
    for uid, endpoint in sorted(svc.endpoints.items()):
        w = state.workloads.find_uid(uid)
        where = (
            f"{w.namespace}/{w.name} on {w.node or '?'} {', '.join(map(str, w.workload_ips))} {w.protocol.value}"
            if w is not None
            else uid
        )
        ports = ", ".join(f"{p} -> {t}" for p, t in sorted(endpoint.port.items()))
        lines.append(f"      {where} ({ports}) {endpoint.status.value}")
    return lines
