"""Workloads and services as the node proxy holds them.

Counterparts: ztunnel src/state/workload.rs and src/state/service.rs; the wire form is
`istio.workload.Address` (docs/istio-behaviour.md, "Workloads and services"). These are frozen, typed values:
the xDS and local-config converters build them, the store indexes them, the proxy reads them.
"""

from __future__ import annotations

import enum
import ipaddress
from dataclasses import dataclass, field

from ..identity.spiffe import Identity
from ..net import IPAddress
from ..ports import HBONE_PORT


class TunnelProtocol(enum.Enum):
    TCP = "TCP"  # wire NONE = 0
    HBONE = "HBONE"  # wire HBONE = 1


class WorkloadStatus(enum.Enum):
    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"


class NetworkMode(enum.Enum):
    STANDARD = "Standard"
    HOST_NETWORK = "HostNetwork"


class WorkloadType(enum.Enum):
    DEPLOYMENT = "deployment"
    CRONJOB = "cronjob"
    POD = "pod"
    JOB = "job"


class AppTunnelProtocol(enum.Enum):
    NONE = "NONE"
    PROXY = "PROXY"


class LoadBalancingScope(enum.Enum):
    REGION = "Region"
    ZONE = "Zone"
    SUBZONE = "Subzone"
    NODE = "Node"
    CLUSTER = "Cluster"
    NETWORK = "Network"


class LoadBalancingMode(enum.Enum):
    STANDARD = "Standard"  # wire UNSPECIFIED_MODE
    STRICT = "Strict"
    FAILOVER = "Failover"
    PASSTHROUGH = "Passthrough"


class HealthPolicy(enum.Enum):
    ONLY_HEALTHY = "OnlyHealthy"
    ALLOW_ALL = "AllowAll"


class IpFamilies(enum.Enum):
    AUTOMATIC = "Automatic"
    IPV4_ONLY = "IPv4"
    IPV6_ONLY = "IPv6"
    DUAL = "Dual"


class Visibility(enum.Enum):
    PUBLIC = "Public"
    NAMESPACE = "Namespace"


@dataclass(frozen=True, slots=True, kw_only=True)
class NetworkAddress:
    network: str
    address: IPAddress

    def __str__(self) -> str:
        return f"{self.network}/{self.address}"


@dataclass(frozen=True, slots=True, kw_only=True)
class NamespacedHostname:
    namespace: str
    hostname: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.hostname}"


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayAddress:
    """A waypoint or network gateway: an IP on a network, or a service by hostname."""

    destination: NetworkAddress | NamespacedHostname
    hbone_mtls_port: int = HBONE_PORT


@dataclass(frozen=True, slots=True, kw_only=True)
class Locality:
    region: str = ""
    zone: str = ""
    subzone: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class ApplicationTunnel:
    protocol: AppTunnelProtocol = AppTunnelProtocol.NONE
    port: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    uid: str
    name: str = ""
    namespace: str
    workload_ips: tuple[IPAddress, ...] = ()
    hostname: str = ""
    network: str = ""
    protocol: TunnelProtocol = TunnelProtocol.TCP
    network_mode: NetworkMode = NetworkMode.STANDARD
    trust_domain: str = ""
    service_account: str = ""
    waypoint: GatewayAddress | None = None
    network_gateway: GatewayAddress | None = None
    node: str = ""
    canonical_name: str = ""
    canonical_revision: str = ""
    workload_type: WorkloadType = WorkloadType.DEPLOYMENT
    workload_name: str = ""
    native_tunnel: bool = False
    application_tunnel: ApplicationTunnel | None = None
    # "namespace/hostname" -> {service port: target port} for this endpoint
    services: dict[str, dict[int, int]] = field(default_factory=dict, hash=False, compare=True)
    authorization_policies: tuple[str, ...] = ()
    status: WorkloadStatus = WorkloadStatus.HEALTHY
    cluster_id: str = ""
    locality: Locality = field(default_factory=Locality)
    capacity: int = 1
    # `identity`, made and checked on the first read and kept: a workload is frozen and replaced,
    # never changed, by state updates (`dataclasses.replace` starts the copy without it). The
    # per-connection path reads it three or four times (docs/performance.md, "The per-connection
    # path"). Not kept
    # when the fields make no valid Identity: every read raises IdentityError again.
    _identity: Identity | None = field(default=None, init=False, repr=False, compare=False, hash=False)

    @property
    def identity(self) -> Identity:
        identity = self._identity
        if identity is None:
            identity = Identity.for_workload(
                trust_domain=self.trust_domain, namespace=self.namespace, service_account=self.service_account
            )
            object.__setattr__(self, "_identity", identity)  # frozen: a cache, set once
        return identity


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoint:
    """One workload backing a service, with that workload's own port map."""

    workload_uid: str
    port: dict[int, int] = field(default_factory=dict, hash=False)
    status: WorkloadStatus = WorkloadStatus.HEALTHY


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadBalancing:
    routing_preferences: tuple[LoadBalancingScope, ...] = ()
    mode: LoadBalancingMode = LoadBalancingMode.STANDARD
    health_policy: HealthPolicy = HealthPolicy.ONLY_HEALTHY


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightedWaypoint:
    destination: GatewayAddress
    weight: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Service:
    name: str
    namespace: str
    hostname: str
    vips: tuple[NetworkAddress, ...] = ()
    cidr_vips: tuple[tuple[str, ipaddress.IPv4Network | ipaddress.IPv6Network], ...] = ()
    ports: dict[int, int] = field(default_factory=dict, hash=False)  # service port -> target port
    endpoints: dict[str, Endpoint] = field(default_factory=dict, hash=False)  # workload uid -> endpoint
    subject_alt_names: tuple[str, ...] = ()
    waypoint: GatewayAddress | None = None
    weighted_waypoints: tuple[WeightedWaypoint, ...] = ()
    load_balancer: LoadBalancing | None = None
    ip_families: IpFamilies = IpFamilies.AUTOMATIC
    canonical: bool = False
    visibility: Visibility = Visibility.PUBLIC

    @property
    def key(self) -> str:
        """xDS resource name of the service: `namespace/hostname`."""
        return f"{self.namespace}/{self.hostname}"
