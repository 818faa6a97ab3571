"""Settings and small helpers every part of the translation shares.

Counterpart of istiod's pilot/pkg/serviceregistry/kube/controller/ambient/helpers.go (and the
MeshConfig fields ambient reads): IP and locality conversion, protocol names, canonical service
labels, label selection.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass

from ...metadata import LABEL_TOPOLOGY_REGION, LABEL_TOPOLOGY_SUBZONE, LABEL_TOPOLOGY_ZONE
from ...wire.istio.security import authorization_pb2 as sec
from ...wire.istio.workload import workload_pb2 as wl

MANAGED_BY_MESH_CONTROLLERS = ("istio.io-mesh-controller", "istio.io-eastwest-controller")

CANONICAL_NAME_LABELS = ("service.istio.io/canonical-name", "app.kubernetes.io/name", "app")
CANONICAL_REVISION_LABELS = ("service.istio.io/canonical-revision", "app.kubernetes.io/version", "version")


@dataclass(frozen=True, slots=True, kw_only=True)
class MeshSettings:
    trust_domain: str = "cluster.local"
    cluster_id: str = "Kubernetes"
    root_namespace: str = "istio-system"
    network: str = ""
    domain_suffix: str = "cluster.local"
    # istiod's ENABLE_WDS_DRY_RUN_AUTHZ_POLICY: without it, dry-run policies are not sent at all.
    enable_wds_dry_run: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Translation:
    addresses: dict[str, wl.Address]
    authorizations: dict[str, sec.Authorization]
    # What was skipped or changed and why; istiod reports these as object status conditions.
    notes: tuple[str, ...] = ()

    def __repr__(self) -> str:
        workloads = sum(1 for a in self.addresses.values() if a.WhichOneof("type") == "workload")
        return (
            f"Translation({workloads} workloads, {len(self.addresses) - workloads} services, "
            f"{len(self.authorizations)} authorizations, {len(self.notes)} notes)"
        )


def ip_bytes(text: str) -> bytes:
    return ipaddress.ip_address(text).packed


def wire_trust_domain(settings: MeshSettings) -> str:
    # istiod leaves the default trust domain out to keep resources small; ztunnel fills it back in.
    return "" if settings.trust_domain == "cluster.local" else settings.trust_domain


def _lookup(labels: Mapping[str, str], keys: tuple[str, ...]) -> str | None:
    for key in keys:
        if key in labels:
            return labels[key]
    return None


def canonical_service(labels: Mapping[str, str], workload_name: str) -> tuple[str, str]:
    name = _lookup(labels, CANONICAL_NAME_LABELS)
    revision = _lookup(labels, CANONICAL_REVISION_LABELS)
    return (name if name is not None else workload_name, revision if revision is not None else "latest")


_ISTIO_PROTOCOLS = frozenset(
    {
        "tcp",
        "udp",
        "grpc",
        "grpc-web",
        "http",
        "http_proxy",
        "http2",
        "https",
        "tls",
        "mongo",
        "redis",
        "mysql",
    }
)
_APP_PROTOCOLS = {
    "http": wl.HTTP11,
    "http2": wl.HTTP2,
    "grpc": wl.GRPC,
    "tls": wl.TLS,
    "https": wl.TLS,
    "tcp": wl.TCP,
}
# Ports where protocol sniffing would break the application: TCP unless declared otherwise.
_WELL_KNOWN_TCP_PORTS = frozenset({25, 53, 3306, 27017})


def _istio_protocol(name: str) -> str | None:
    """Istio's protocol for a port name prefix or appProtocol value; None when unsupported."""
    lowered = name.lower()
    if lowered.startswith("grpc-web"):
        return "grpc-web"
    if lowered == "kubernetes.io/h2c":
        return "http2"
    prefix = lowered.split("-", 1)[0]
    return prefix if prefix in _ISTIO_PROTOCOLS else None


def app_protocol(name: str) -> wl.AppProtocol:
    """The wire AppProtocol of a ServiceEntry port's protocol name."""
    proto = _istio_protocol(name)
    return _APP_PROTOCOLS.get(proto, wl.UNKNOWN) if proto is not None else wl.UNKNOWN


def kube_app_protocol(port: int, name: str, protocol: str, app_protocol: str | None) -> wl.AppProtocol:
    """The wire AppProtocol of a Kubernetes Service port (appProtocol, else the name's prefix)."""
    if protocol == "UDP":
        return wl.UNKNOWN
    proto = _istio_protocol(app_protocol if app_protocol is not None else name)
    if proto is None:
        return wl.TCP if port in _WELL_KNOWN_TCP_PORTS else wl.UNKNOWN
    return _APP_PROTOCOLS.get(proto, wl.UNKNOWN)


def network_address(text: str, network: str, *, allow_cidr: bool) -> wl.NetworkAddress:
    if allow_cidr and "/" in text:
        net = ipaddress.ip_network(text, strict=False)
        addr = wl.NetworkAddress(network=network, address=net.network_address.packed)
        if net.prefixlen != net.max_prefixlen:
            addr.length = net.prefixlen
        return addr
    return wl.NetworkAddress(network=network, address=ip_bytes(text))


def locality_from_labels(labels: Mapping[str, str]) -> wl.Locality | None:
    region = labels.get(LABEL_TOPOLOGY_REGION, "")
    zone = labels.get(LABEL_TOPOLOGY_ZONE, "")
    subzone = labels.get(LABEL_TOPOLOGY_SUBZONE, "")
    if not (region or zone or subzone):
        return None
    return wl.Locality(region=region, zone=zone, subzone=subzone)


def locality_from_string(text: str) -> wl.Locality | None:
    parts = (text.split("/") + ["", "", ""])[:3]
    if not any(parts):
        return None
    return wl.Locality(region=parts[0], zone=parts[1], subzone=parts[2])


def selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """A non-empty selector that is a subset of labels (an empty one selects nothing here)."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())
