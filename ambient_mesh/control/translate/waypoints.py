"""Waypoints: which Gateways are waypoints, and which waypoint a service or workload uses.

Counterpart of istiod's pilot/pkg/serviceregistry/kube/controller/ambient/waypoints.go: a
Gateway becomes a `Waypoint` once it has an address; `istio.io/use-waypoint` on the object (else
its namespace) picks one, subject to the waypoint's `istio.io/waypoint-for` traffic type and its
listener's `allowedRoutes` namespaces.
"""

from __future__ import annotations

from collections.abc import Mapping

from ...kube.model import Gateway, ObjectMeta
from ...kube.store import KubeStore
from ...metadata import (
    ANNOTATION_INBOUND_BINDING,
    LABEL_GATEWAY_MANAGED,
    LABEL_GATEWAY_NAME,
    LABEL_USE_WAYPOINT,
    LABEL_USE_WAYPOINT_NAMESPACE,
    LABEL_WAYPOINT_FOR,
)
from ...ports import HBONE_PORT
from ...wire.istio.workload import workload_pb2 as wl
from .common import MANAGED_BY_MESH_CONTROLLERS, MeshSettings, ip_bytes
from .context import Context, ObjectLookup, Waypoint


def _inbound_binding(gateway: Gateway) -> tuple[wl.ApplicationTunnel.Protocol, int] | None:
    raw = gateway.metadata.annotations.get(ANNOTATION_INBOUND_BINDING)
    if raw is None:
        return None
    parts = raw.split("/")
    if len(parts) > 2 or parts[0] not in ("NONE", "PROXY"):
        return None
    protocol = wl.ApplicationTunnel.PROXY if parts[0] == "PROXY" else wl.ApplicationTunnel.NONE
    port = int(parts[1]) if len(parts) == 2 and parts[1].isdigit() else 0
    return (protocol, port)


def gateway_waypoint(gw: Gateway, objects: ObjectLookup, settings: MeshSettings) -> Waypoint | None:
    """The waypoint one Gateway is, or None while it has no usable address.

    istiod uses a Gateway only once its status lists an address. On a file-driven control plane
    nobody writes that status, so a Gateway without one falls back to what Istio's gateway
    controller would write: the hostname of the Service of the same name, if that Service exists.
    """
    meta = gw.metadata
    address: wl.GatewayAddress | None = None
    for a in gw.status_addresses:
        if a.type == "Hostname":
            address = wl.GatewayAddress(
                hostname=wl.NamespacedHostname(namespace=meta.namespace, hostname=a.value),
                hbone_mtls_port=HBONE_PORT,
            )
            break
    if address is None:
        for a in gw.status_addresses:
            if a.type == "IPAddress":
                try:
                    ip = ip_bytes(a.value)
                except ValueError:
                    continue
                address = wl.GatewayAddress(
                    address=wl.NetworkAddress(network=settings.network, address=ip),
                    hbone_mtls_port=HBONE_PORT,
                )
                break
    if address is None and not gw.status_addresses:
        if objects.get("Service", meta.namespace, meta.name) is not None:
            hostname = f"{meta.name}.{meta.namespace}.svc.{settings.domain_suffix}"
            address = wl.GatewayAddress(
                hostname=wl.NamespacedHostname(namespace=meta.namespace, hostname=hostname),
                hbone_mtls_port=HBONE_PORT,
            )
    if address is None:
        return None
    binding = _inbound_binding(gw)
    allowed_from, allowed_selector = "Same", None
    listener = None
    if binding is not None:
        if binding[1]:
            listener = next((ln for ln in gw.listeners if ln.port == binding[1]), None)
        elif binding[0] == wl.ApplicationTunnel.PROXY:
            listener = next((ln for ln in gw.listeners if ln.protocol == "istio.io/PROXY"), None)
    if listener is None:
        listener = next((ln for ln in gw.listeners if ln.protocol == "HBONE" and ln.port == HBONE_PORT), None)
    if listener is not None and listener.allowed_from:
        allowed_from, allowed_selector = listener.allowed_from, listener.allowed_selector
    return Waypoint(
        name=meta.name,
        namespace=meta.namespace,
        address=address,
        traffic_type=meta.labels.get(LABEL_WAYPOINT_FOR, "service"),
        allowed_from=allowed_from,
        allowed_selector=allowed_selector,
        binding=binding,
    )


def build_waypoints(store: KubeStore, settings: MeshSettings) -> dict[str, Waypoint]:
    """Waypoints from Gateway objects, keyed `namespace/name`."""
    out: dict[str, Waypoint] = {}
    for gw in store.gateways:
        wp = gateway_waypoint(gw, store, settings)
        if wp is not None:
            out[wp.resource_name] = wp
    return out


def _allows(ctx: Context, wp: Waypoint, namespace: str) -> bool:
    if wp.allowed_from == "All":
        return True
    if wp.allowed_from == "Selector":
        labels = ctx.namespace_labels(namespace)
        return wp.allowed_selector is not None and wp.allowed_selector.matches(labels)
    return wp.namespace == namespace


def _use_waypoint(labels: Mapping[str, str], namespace: str) -> tuple[str | None, bool]:
    value = labels.get(LABEL_USE_WAYPOINT)
    if value is None:
        return None, False
    if value == "none":
        return None, True
    return f"{labels.get(LABEL_USE_WAYPOINT_NAMESPACE, namespace)}/{value}", False


def waypoint_for_target(ctx: Context, meta: ObjectMeta, what: str) -> Waypoint | None:
    key, opted_out = _use_waypoint(meta.labels, meta.namespace)
    if opted_out:
        return None
    if key is None:
        ns = ctx.objects.namespace(meta.namespace)
        if ns is None:
            return None
        key, _ = _use_waypoint(ns.metadata.labels, meta.namespace)
        if key is None:
            return None
    wp = ctx.waypoints.get(key)
    if wp is None:
        ctx.notes.append(f"{what}: waypoint {key} is not ready (no Gateway with an address)")
        return None
    if not _allows(ctx, wp, meta.namespace):
        ctx.notes.append(f"{what}: waypoint {key} does not allow attachment from {meta.namespace}")
        return None
    return wp


def waypoint_for_service(ctx: Context, meta: ObjectMeta, what: str) -> Waypoint | None:
    if meta.labels.get(LABEL_GATEWAY_MANAGED) in MANAGED_BY_MESH_CONTROLLERS:
        return None  # a waypoint or east-west gateway has no waypoint of its own
    wp = waypoint_for_target(ctx, meta, what)
    if wp is None or wp.traffic_type in ("service", "all"):
        return wp
    ctx.notes.append(f"{what}: waypoint {wp.resource_name} does not accept service traffic")
    return None


def waypoint_for_workload(
    ctx: Context, meta: ObjectMeta, what: str
) -> tuple[wl.ApplicationTunnel | None, Waypoint | None]:
    """(how ztunnel delivers inbound to a workload that is a waypoint, the waypoint it uses)."""
    instance_of = meta.labels.get(LABEL_GATEWAY_NAME)
    if instance_of:
        wp = ctx.waypoints.get(f"{meta.namespace}/{instance_of}")
        if wp is not None:
            # This workload IS the waypoint; tell ztunnel how to deliver inbound to it.
            if wp.binding is not None:
                return wl.ApplicationTunnel(protocol=wp.binding[0], port=wp.binding[1]), None
            return None, None
    wp = waypoint_for_target(ctx, meta, what)
    if wp is None or wp.traffic_type in ("workload", "all"):
        return None, wp
    if LABEL_USE_WAYPOINT in meta.labels:
        ctx.notes.append(f"{what}: waypoint {wp.resource_name} does not accept workload traffic")
    return None, None
