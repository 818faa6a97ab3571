"""Services: Kubernetes Services and ServiceEntries as `istio.workload.Service` addresses.

Counterpart of istiod's pilot/pkg/serviceregistry/kube/controller/ambient/services.go: cluster
IPs (or ServiceEntry addresses, CIDRs allowed) as VIPs, ports with their app protocol, load
balancing from internalTrafficPolicy / trafficDistribution, the waypoint the service uses, and one
winner per (hostname, namespace) with one canonical service per hostname.
"""

from __future__ import annotations

from collections.abc import Mapping

from ...kube.model import Service, ServiceEntry
from ...metadata import ANNOTATION_TRAFFIC_DISTRIBUTION, LABEL_INGRESS_USE_WAYPOINT
from ...wire.istio.workload import workload_pb2 as wl
from .common import app_protocol, kube_app_protocol, network_address
from .context import Context, ServiceInfo
from .waypoints import waypoint_for_service


def traffic_lb(spec_value: str, annotations: list[Mapping[str, str]]) -> wl.LoadBalancing | None:
    value = spec_value
    if value not in ("PreferClose", "PreferSameZone", "PreferSameNode"):
        value = next(
            (a[ANNOTATION_TRAFFIC_DISTRIBUTION] for a in annotations if ANNOTATION_TRAFFIC_DISTRIBUTION in a),
            "",
        )
    value = value.lower()
    if value in ("preferclose", "prefersamezone"):
        return wl.LoadBalancing(
            routing_preference=[wl.LoadBalancing.NETWORK, wl.LoadBalancing.REGION, wl.LoadBalancing.ZONE],
            mode=wl.LoadBalancing.FAILOVER,
        )
    if value == "prefersamenode":
        return wl.LoadBalancing(
            routing_preference=[
                wl.LoadBalancing.NETWORK,
                wl.LoadBalancing.REGION,
                wl.LoadBalancing.ZONE,
                wl.LoadBalancing.SUBZONE,
                wl.LoadBalancing.NODE,
            ],
            mode=wl.LoadBalancing.FAILOVER,
        )
    return None


def _ingress_use_waypoint(labels: Mapping[str, str], ns_labels: Mapping[str, str]) -> bool:
    value = labels.get(LABEL_INGRESS_USE_WAYPOINT, ns_labels.get(LABEL_INGRESS_USE_WAYPOINT))
    return value is not None and value.lower() in ("1", "t", "true")


def kube_service(ctx: Context, svc: Service) -> ServiceInfo | None:
    meta = svc.metadata
    what = f"Service {meta.namespace}/{meta.name}"
    if svc.type == "ExternalName":
        return None  # DNS aliases are left to the upstream resolver, as in istiod
    settings = ctx.settings
    ports = []
    port_names: dict[int, tuple[str, str]] = {}
    for p in svc.ports:
        # The API server defaults a missing targetPort to the port; a named one is resolved per pod.
        target = p.port if p.target_port is None else p.target_port
        ports.append(
            wl.Port(
                service_port=p.port,
                target_port=target if isinstance(target, int) else 0,
                app_protocol=kube_app_protocol(p.port, p.name, p.protocol, p.app_protocol),
            )
        )
        port_names[p.port] = (p.name, target if isinstance(target, str) else "")
    vips = [ip for ip in (svc.cluster_ips or (svc.cluster_ip,)) if ip and ip != "None"]
    try:
        addresses = [network_address(ip, settings.network, allow_cidr=False) for ip in vips]
    except ValueError as exc:
        ctx.notes.append(f"{what}: bad cluster IP ({exc}); service skipped")
        return None
    ns = ctx.objects.namespace(meta.namespace)
    ns_labels = ns.metadata.labels if ns is not None else {}
    ns_annotations = ns.metadata.annotations if ns is not None else {}
    lb = None
    if svc.internal_traffic_policy == "Local":
        lb = wl.LoadBalancing(routing_preference=[wl.LoadBalancing.NODE], mode=wl.LoadBalancing.STRICT)
    else:
        lb = traffic_lb(svc.traffic_distribution, [meta.annotations, ns_annotations])
    if svc.publish_not_ready_addresses:
        lb = lb if lb is not None else wl.LoadBalancing()
        lb.health_policy = wl.LoadBalancing.ALLOW_ALL
    families = {1: wl.IPV4_ONLY if svc.ip_families[:1] == ("IPv4",) else wl.IPV6_ONLY, 2: wl.DUAL}
    out = wl.Service(
        name=meta.name,
        namespace=meta.namespace,
        hostname=f"{meta.name}.{meta.namespace}.svc.{settings.domain_suffix}",
        addresses=addresses,
        ports=ports,
        ip_families=families.get(len(svc.ip_families), wl.AUTOMATIC),
        # A Kubernetes Service always owns its hostname.
        canonical=True,
    )
    if lb is not None:
        out.load_balancing.CopyFrom(lb)
    wp = waypoint_for_service(ctx, meta, what)
    if wp is not None:
        out.waypoint.CopyFrom(wp.address)
        out.ingress_use_waypoint = _ingress_use_waypoint(meta.labels, ns_labels)
    return ServiceInfo(
        service=out,
        port_names=port_names,
        selector=svc.selector,
        source_kind="Service",
        creation_timestamp=meta.creation_timestamp,
    )


def service_entry_services(ctx: Context, se: ServiceEntry) -> list[ServiceInfo]:
    meta = se.metadata
    what = f"ServiceEntry {meta.namespace}/{meta.name}"
    settings = ctx.settings
    try:
        addresses = [network_address(a, settings.network, allow_cidr=True) for a in se.addresses]
    except ValueError as exc:
        ctx.notes.append(f"{what}: bad address ({exc}); no services built")
        return []
    ports = [
        wl.Port(
            service_port=p.number,
            target_port=p.target_port or p.number,
            app_protocol=app_protocol(p.protocol),
        )
        for p in se.ports
    ]
    port_names = {p.number: (p.name, "") for p in se.ports}
    lb = None
    if se.resolution == "NONE":
        # Passthrough: ztunnel connects to the original destination, health is moot.
        lb = wl.LoadBalancing(mode=wl.LoadBalancing.PASSTHROUGH, health_policy=wl.LoadBalancing.ALLOW_ALL)
    else:
        ns = ctx.objects.namespace(meta.namespace)
        lb = traffic_lb("", [meta.annotations, ns.metadata.annotations if ns is not None else {}])
    ns = ctx.objects.namespace(meta.namespace)
    ns_labels = ns.metadata.labels if ns is not None else {}
    wp = waypoint_for_service(ctx, meta, what)
    out = []
    for host in se.hosts:
        svc = wl.Service(
            name=meta.name,
            namespace=meta.namespace,
            hostname=host,
            addresses=addresses,
            ports=ports,
            subject_alt_names=se.subject_alt_names,
        )
        if lb is not None:
            svc.load_balancing.CopyFrom(lb)
        if wp is not None:
            svc.waypoint.CopyFrom(wp.address)
            svc.ingress_use_waypoint = _ingress_use_waypoint(meta.labels, ns_labels)
        selector = se.workload_selector.match_labels if se.workload_selector is not None else {}
        out.append(
            ServiceInfo(
                service=svc,
                port_names=port_names,
                selector=selector,
                source_kind="ServiceEntry",
                creation_timestamp=meta.creation_timestamp,
            )
        )
    return out


def select_services(infos: list[ServiceInfo]) -> list[ServiceInfo]:
    """One winner per (hostname, namespace), and one canonical service per hostname.

    A Kubernetes Service wins its namespace; otherwise the oldest ServiceEntry does. The canonical
    one is the Kubernetes Service if any, else the oldest winning ServiceEntry.
    """
    by_host: dict[str, list[ServiceInfo]] = {}
    for info in infos:
        by_host.setdefault(info.service.hostname, []).append(info)
    out = []

    def age(i: ServiceInfo) -> tuple[str, str, str]:
        return (i.creation_timestamp, i.service.namespace, i.service.name)

    for info in infos:
        # Chosen again from scratch: only a Kubernetes Service is canonical by itself.
        info.service.canonical = info.source_kind == "Service"
    for host in sorted(by_host):
        best: dict[str, ServiceInfo] = {}
        for info in sorted(by_host[host], key=age):
            ns = info.service.namespace
            current = best.get(ns)
            if current is None or (info.source_kind == "Service" and current.source_kind != "Service"):
                best[ns] = info
        winners = sorted(best.values(), key=lambda i: (i.source_kind != "Service",) + age(i))
        if winners:
            winners[0].service.canonical = True
        out.extend(sorted(best.values(), key=lambda i: i.service.namespace))
    return out
