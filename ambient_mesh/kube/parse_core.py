"""Parsers of the core/v1 kinds the mesh reads: Namespace, Pod, Service, ServiceAccount, Node."""

from __future__ import annotations

from collections.abc import Callable

from .fields import MISSING, Fields, object_meta
from .model import (
    Container,
    ContainerPort,
    KubeObject,
    Namespace,
    Node,
    Pod,
    PodCondition,
    Service,
    ServiceAccount,
    ServicePort,
)


def _container(c: Fields) -> Container:
    ports = tuple(
        ContainerPort(
            name=p.str("name"),
            container_port=p.int("containerPort", lo=0, hi=65535),
            protocol=p.enum("protocol", ("TCP", "UDP", "SCTP"), "TCP"),
        )
        for p in c.items("ports")
    )
    return Container(name=c.str("name"), ports=ports, restart_policy=c.str("restartPolicy"))


def _parse_namespace(doc: Fields) -> Namespace:
    return Namespace(metadata=object_meta(doc, namespaced=False))


def _parse_pod(doc: Fields) -> Pod:
    meta = object_meta(doc, namespaced=True)
    spec = doc.sub("spec") or Fields({}, "spec")
    status = doc.sub("status") or Fields({}, "status")
    return Pod(
        metadata=meta,
        node_name=spec.str("nodeName"),
        # serviceAccount is the deprecated spelling; the API server mirrors it.
        service_account_name=spec.str("serviceAccountName") or spec.str("serviceAccount"),
        host_network=spec.bool("hostNetwork"),
        containers=tuple(_container(c) for c in spec.items("containers")),
        init_containers=tuple(_container(c) for c in spec.items("initContainers")),
        pod_ip=status.str("podIP"),
        pod_ips=tuple(p.str("ip") for p in status.items("podIPs") if p.str("ip")),
        phase=status.str("phase"),
        conditions=tuple(
            PodCondition(type=c.str("type"), status=c.str("status")) for c in status.items("conditions")
        ),
    )


def _target_port(p: Fields) -> int | str | None:
    raw = p.value("targetPort")
    if raw is MISSING:
        return None
    if isinstance(raw, str):
        # Kubernetes accepts a numeric string as an IntOrString number.
        return int(raw) if raw.isdigit() else raw
    return p.int("targetPort", lo=0, hi=65535)


def _parse_service(doc: Fields) -> Service:
    meta = object_meta(doc, namespaced=True)
    spec = doc.sub("spec") or Fields({}, "spec")
    ports = tuple(
        ServicePort(
            name=p.str("name"),
            port=p.int("port", lo=0, hi=65535),
            target_port=_target_port(p),
            protocol=p.enum("protocol", ("TCP", "UDP", "SCTP"), "TCP"),
            app_protocol=p.str("appProtocol") or None,
        )
        for p in spec.items("ports")
    )
    return Service(
        metadata=meta,
        type=spec.str("type", "ClusterIP"),
        selector=spec.string_map("selector"),
        cluster_ip=spec.str("clusterIP"),
        cluster_ips=spec.strings("clusterIPs"),
        ports=ports,
        ip_families=spec.strings("ipFamilies"),
        internal_traffic_policy=spec.str("internalTrafficPolicy"),
        traffic_distribution=spec.str("trafficDistribution"),
        publish_not_ready_addresses=spec.bool("publishNotReadyAddresses"),
    )


def _parse_service_account(doc: Fields) -> ServiceAccount:
    return ServiceAccount(metadata=object_meta(doc, namespaced=True))


def _parse_node(doc: Fields) -> Node:
    return Node(metadata=object_meta(doc, namespaced=False))


# kind -> (the apiVersions read, the parser)
PARSERS: dict[str, tuple[tuple[str, ...], Callable[[Fields], KubeObject]]] = {
    "Namespace": (("v1",), _parse_namespace),
    "Pod": (("v1",), _parse_pod),
    "Service": (("v1",), _parse_service),
    "ServiceAccount": (("v1",), _parse_service_account),
    "Node": (("v1",), _parse_node),
}
