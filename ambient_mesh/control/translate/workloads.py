"""Workloads: Pods, WorkloadEntries and ServiceEntry endpoints as `istio.workload.Workload`.

Counterpart of istiod's pilot/pkg/serviceregistry/kube/controller/ambient/workloads.go: one
workload per running pod with an IP (uid `<cluster>//Pod/<ns>/<name>`), per WorkloadEntry and per
ServiceEntry endpoint (or implicit DNS endpoint), with the services selecting it and their
target ports, the policies attaching to it, its waypoint, locality, tunnel protocol and the
canonical service labels.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from google.protobuf import wrappers_pb2

from ...kube.model import ObjectMeta, Pod, ServiceEntry, WorkloadEntry, WorkloadEntrySpec
from ...metadata import (
    ANNOTATION_AUTO_REGISTRATION_GROUP,
    ANNOTATION_REDIRECTION,
    ANNOTATION_SIDECAR_STATUS,
    LABEL_DATAPLANE_MODE,
    LABEL_TUNNEL,
    LABEL_WORKLOAD_NAME,
)
from ...wire.istio.workload import workload_pb2 as wl
from .common import canonical_service, ip_bytes, locality_from_labels, locality_from_string, wire_trust_domain
from .context import Context, ServiceInfo, Waypoint
from .waypoints import waypoint_for_workload

_CRONJOB_NAME = re.compile(r"(.+)-\d{8,10}$")


def pod_workload_name(pod: Pod) -> str:
    """The controller name istiod derives from a pod (Deployment from the ReplicaSet name, CronJob
    from the Job name); `service.istio.io/workload-name` overrides it."""
    override = pod.metadata.labels.get(LABEL_WORKLOAD_NAME)
    if override is not None:
        return override
    name = pod.metadata.name
    if pod.metadata.generate_name:
        controller = next((o for o in pod.metadata.owner_references if o.controller), None)
        if controller is not None:
            name = controller.name
            labels = pod.metadata.labels
            for hash_label in ("pod-template-hash", "rollouts-pod-template-hash"):
                value = labels.get(hash_label, "")
                if controller.kind == "ReplicaSet" and value and controller.name.endswith(value):
                    name = controller.name.removesuffix("-" + value)
                    break
            else:
                if controller.kind == "ReplicationController" and labels.get("deploymentconfig"):
                    name = labels["deploymentconfig"]
                elif controller.kind == "Job" and (m := _CRONJOB_NAME.fullmatch(controller.name)):
                    name = m.group(1)
    return name or pod.metadata.name


def _find_port_name(pod: Pod, name: str) -> int | None:
    for c in pod.containers:
        for p in c.ports:
            if p.name == name and p.protocol == "TCP":
                return p.container_port
    for c in pod.init_containers:
        if c.restart_policy != "Always":
            continue
        for p in c.ports:
            if p.name == name and p.protocol == "TCP":
                return p.container_port
    return None


# (service info, its port, the port's name, its target port's name or "") -> the target port, or
# None when this workload has no mapping for the port at all.
_TargetFor = Callable[[ServiceInfo, wl.Port, str, str], int | None]


def _port_lists(infos: list[ServiceInfo], target_for: _TargetFor) -> dict[str, wl.PortList]:
    out: dict[str, wl.PortList] = {}
    for info in infos:
        pl = wl.PortList()
        for port in info.service.ports:
            named = info.port_names.get(port.service_port)
            target = port.target_port if named is None else target_for(info, port, *named)
            if target is not None:
                pl.ports.add(service_port=port.service_port, target_port=target)
        out[info.key] = pl
    return out


def _pod_services(pod: Pod, infos: list[ServiceInfo]) -> dict[str, wl.PortList]:
    def target_for(info: ServiceInfo, port: wl.Port, port_name: str, target_name: str) -> int | None:
        if target_name:
            # A named targetPort the pod does not expose: no mapping for this port at all.
            return _find_port_name(pod, target_name)
        if info.source_kind == "ServiceEntry" and port_name:
            resolved = _find_port_name(pod, port_name)
            if resolved is not None:
                return resolved
            if port.target_port == 0:
                return port.service_port
        return port.target_port

    return _port_lists(infos, target_for)


def _entry_services(spec: WorkloadEntrySpec, infos: list[ServiceInfo]) -> dict[str, wl.PortList]:
    def target_for(info: ServiceInfo, port: wl.Port, port_name: str, target_name: str) -> int | None:
        if info.source_kind == "Service":
            if target_name:
                return spec.ports.get(target_name)  # not declared by the entry: no mapping
            return spec.ports.get(port_name, port.target_port)
        if port_name in spec.ports:
            return spec.ports[port_name]
        return port.service_port if port.target_port == 0 else port.target_port

    return _port_lists(infos, target_for)


def pod_enrolled(pod: Pod, namespace_labels: Mapping[str, str]) -> bool:
    """Whether the node agent would capture this pod (istio-cni's rule)."""
    annotations = pod.metadata.annotations
    if annotations.get(ANNOTATION_REDIRECTION) == "enabled":
        return True  # already enrolled by a real node agent: istiod's own signal
    if ANNOTATION_SIDECAR_STATUS in annotations or pod.host_network:
        return False
    label = pod.metadata.labels.get(LABEL_DATAPLANE_MODE)
    if label is not None:
        return label == "ambient"  # the pod's own label wins; `none` opts out
    return namespace_labels.get(LABEL_DATAPLANE_MODE) == "ambient"


def _set_tunnel(
    w: wl.Workload, labels: Mapping[str, str], annotations: Mapping[str, str], enrolled: bool
) -> None:
    if enrolled or annotations.get(ANNOTATION_REDIRECTION) == "enabled":
        w.tunnel_protocol = wl.HBONE
    if labels.get(LABEL_TUNNEL) == "http":
        # The workload speaks HBONE itself.
        w.tunnel_protocol = wl.HBONE
        w.native_tunnel = True


def _common(
    w: wl.Workload,
    ctx: Context,
    meta_labels: Mapping[str, str],
    namespace: str,
    waypoint: Waypoint | None,
    app_tunnel: wl.ApplicationTunnel | None,
) -> None:
    w.cluster_id = ctx.settings.cluster_id
    w.trust_domain = wire_trust_domain(ctx.settings)
    w.authorization_policies.extend(ctx.policies.workload_policies(meta_labels, namespace))
    if waypoint is not None:
        w.waypoint.CopyFrom(waypoint.address)
    if app_tunnel is not None:
        w.application_tunnel.CopyFrom(app_tunnel)


def pod_workload(ctx: Context, pod: Pod) -> wl.Workload | None:
    meta = pod.metadata
    what = f"Pod {meta.namespace}/{meta.name}"
    if pod.phase in ("Succeeded", "Failed"):
        return None  # terminal pods are not workloads
    ips = pod.ips
    if not ips:
        return None  # not scheduled or no IP yet
    try:
        addresses = [ip_bytes(ip) for ip in ips]
    except ValueError as exc:
        ctx.notes.append(f"{what}: bad pod IP ({exc}); workload skipped")
        return None
    infos = ctx.services.selecting(meta.namespace, meta.labels)
    app_tunnel, waypoint = waypoint_for_workload(ctx, meta, what)
    w = wl.Workload(
        uid=f"{ctx.settings.cluster_id}//Pod/{meta.namespace}/{meta.name}",
        name=meta.name,
        namespace=meta.namespace,
        network=ctx.settings.network,
        addresses=addresses,
        service_account=pod.service_account_name or "default",
        node=pod.node_name,
        status=wl.HEALTHY if pod.ready and not meta.deletion_timestamp else wl.UNHEALTHY,
        workload_type=wl.POD,  # istiod always sends POD here, for compatibility
    )
    _common(w, ctx, meta.labels, meta.namespace, waypoint, app_tunnel)
    for key, pl in _pod_services(pod, infos).items():
        w.services[key].CopyFrom(pl)
    node = ctx.objects.node(pod.node_name) if pod.node_name else None
    locality = locality_from_labels(node.metadata.labels) if node is not None else None
    if locality is not None:
        w.locality.CopyFrom(locality)
    if pod.host_network:
        w.network_mode = wl.HOST_NETWORK
    w.workload_name = pod_workload_name(pod)
    w.canonical_name, w.canonical_revision = canonical_service(meta.labels, w.workload_name)
    ns = ctx.objects.namespace(meta.namespace)
    enrolled = pod_enrolled(pod, ns.metadata.labels if ns is not None else {})
    _set_tunnel(w, meta.labels, meta.annotations, enrolled)
    return w


def _set_address(w: wl.Workload, address: str) -> None:
    try:
        w.addresses.append(ip_bytes(address))
    except ValueError:
        w.hostname = address  # a DNS name: ztunnel resolves it on demand


def workload_entry_workload(ctx: Context, we: WorkloadEntry) -> wl.Workload:
    meta = we.metadata
    what = f"WorkloadEntry {meta.namespace}/{meta.name}"
    labels = {**meta.labels, **we.spec.labels}
    infos = ctx.services.selecting(meta.namespace, labels)
    labelled = ObjectMeta(
        name=meta.name, namespace=meta.namespace, labels=labels, annotations=meta.annotations
    )
    app_tunnel, waypoint = waypoint_for_workload(ctx, labelled, what)
    w = wl.Workload(
        uid=f"{ctx.settings.cluster_id}/networking.istio.io/WorkloadEntry/{meta.namespace}/{meta.name}",
        name=meta.name,
        namespace=meta.namespace,
        network=we.spec.network or ctx.settings.network,
        service_account=we.spec.service_account,
        status=wl.HEALTHY,
        workload_type=wl.POD,
    )
    _common(w, ctx, labels, meta.namespace, waypoint, app_tunnel)
    for key, pl in _entry_services(we.spec, infos).items():
        w.services[key].CopyFrom(pl)
    locality = locality_from_string(we.spec.locality)
    if locality is not None:
        w.locality.CopyFrom(locality)
    if we.spec.weight > 0:
        w.capacity.CopyFrom(wrappers_pb2.UInt32Value(value=we.spec.weight))
    _set_address(w, we.spec.address)
    w.workload_name = (
        meta.annotations.get(ANNOTATION_AUTO_REGISTRATION_GROUP)
        or labels.get(LABEL_WORKLOAD_NAME)
        or meta.name
    )
    w.canonical_name, w.canonical_revision = canonical_service(labels, w.workload_name)
    _set_tunnel(w, labels, meta.annotations, enrolled=False)
    return w


def service_entry_workloads(ctx: Context, se: ServiceEntry) -> list[wl.Workload]:
    meta = se.metadata
    what = f"ServiceEntry {meta.namespace}/{meta.name}"
    endpoints = list(se.endpoints)
    # A DNS ServiceEntry without endpoints or selector has one implicit endpoint per host.
    implicit = (
        not endpoints
        and se.resolution in ("DNS", "DYNAMIC_DNS", "DNS_ROUND_ROBIN")
        and se.workload_selector is None
    )
    if not endpoints and not implicit:
        return []
    # The hosts this ServiceEntry won (a Kubernetes Service or an older entry may own others).
    mine = sorted(ctx.services.of_source("ServiceEntry", meta.namespace, meta.name), key=lambda i: i.key)
    if not mine:
        return []
    if implicit:
        endpoints = [WorkloadEntrySpec(address=i.service.hostname) for i in mine]
    out = []
    for index, ep in enumerate(endpoints):
        services = [mine[index]] if implicit else mine
        app_tunnel, waypoint = None, None
        if not implicit:
            ep_meta = ObjectMeta(name=meta.name, namespace=meta.namespace, labels=ep.labels)
            app_tunnel, waypoint = waypoint_for_workload(ctx, ep_meta, what)
        w = wl.Workload(
            uid=f"{ctx.settings.cluster_id}/networking.istio.io/ServiceEntry/{meta.namespace}/{meta.name}/{ep.address}",
            name=meta.name,
            namespace=meta.namespace,
            network=ep.network or ctx.settings.network,
            service_account=ep.service_account,
            status=wl.HEALTHY,
            workload_type=wl.POD,
        )
        _common(w, ctx, meta.labels, meta.namespace, waypoint, app_tunnel)
        for key, pl in _entry_services(ep, services).items():
            w.services[key].CopyFrom(pl)
        locality = locality_from_string(ep.locality)
        if locality is not None:
            w.locality.CopyFrom(locality)
        if ep.weight > 0:
            w.capacity.CopyFrom(wrappers_pb2.UInt32Value(value=ep.weight))
        _set_address(w, ep.address)
        w.workload_name = meta.name
        w.canonical_name, w.canonical_revision = canonical_service(meta.labels, meta.name)
        _set_tunnel(w, meta.labels, meta.annotations, enrolled=False)
        out.append(w)
    return out
