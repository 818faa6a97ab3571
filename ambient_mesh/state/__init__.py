"""What the node proxy knows about the mesh (ztunnel src/state*): model, store, local config."""

from .model import (
    Endpoint,
    GatewayAddress,
    NamespacedHostname,
    NetworkAddress,
    Service,
    Workload,
)
from .store import ProxyState, ServiceStore, Upstream, WorkloadStore, load_balance

__all__ = [
    "Endpoint",
    "GatewayAddress",
    "NamespacedHostname",
    "NetworkAddress",
    "ProxyState",
    "Service",
    "ServiceStore",
    "Upstream",
    "Workload",
    "WorkloadStore",
    "load_balance",
]
