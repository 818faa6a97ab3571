"""The waypoint Envoy's bootstrap: who it is, and that everything else comes from the pod agent.

Counterpart: Istio's Envoy bootstrap template (tools/packaging/common/envoy_bootstrap.json, as
pilot-agent renders it for `proxy waypoint`): node id `waypoint~<ip>~<pod>.<ns>~<ns>.svc.<suffix>`
with the pod's labels in the node metadata, ADS (delta) over the cluster `xds-grpc` and secrets
over `sds-grpc`, both unix sockets the agent serves, and the internal-listener bootstrap extension
the waypoint's `main_internal` and `connect_originate` need. The admin interface is a unix socket
in the agent's run directory (Istio binds 127.0.0.1:15000; a socket collides with nothing and is
not reachable from the network).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..metadata import LABEL_GATEWAY_NAME

XDS_CLUSTER = "xds-grpc"
ALS_CLUSTER = "als-grpc"  # the access log the control plane configures (waypoint_l7.ALS_CLUSTER)
SDS_CLUSTER = "sds-grpc"  # the name the control plane's resources use (waypoint_envoy.SDS_CLUSTER)
# Envoy's limit on one xDS message it accepts from the agent; the agent enforces the same.
MAX_XDS_MESSAGE_BYTES = 64 * 1024 * 1024
XDS_CONNECT_TIMEOUT = "1s"


@dataclass(frozen=True, slots=True, kw_only=True)
class BootstrapParams:
    pod_name: str
    namespace: str
    pod_ip: str
    gateway_name: str
    domain_suffix: str = "cluster.local"
    cluster_id: str = "Kubernetes"
    service_account: str = ""
    labels: Mapping[str, str] | None = None
    xds_socket: Path
    sds_socket: Path
    admin_socket: Path
    # Part 2 hook: the agent's access-log socket (waypoint/telemetry.py), cluster `als-grpc`.
    als_socket: Path | None = None

    @property
    def node_id(self) -> str:
        return f"waypoint~{self.pod_ip}~{self.pod_name}.{self.namespace}~{self.namespace}.svc.{self.domain_suffix}"


def _unix_cluster(name: str, path: Path) -> dict[str, Any]:
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": XDS_CONNECT_TIMEOUT,
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"pipe": {"path": str(path)}}}}]}],
        },
    }


def bootstrap(params: BootstrapParams) -> dict[str, Any]:
    labels = {**(params.labels or {}), LABEL_GATEWAY_NAME: params.gateway_name}
    ads_source = {"ads": {}, "resource_api_version": "V3", "initial_fetch_timeout": "0s"}
    return {
        "node": {
            "id": params.node_id,
            "cluster": f"{params.gateway_name}.{params.namespace}",
            "metadata": {
                "NAME": params.pod_name,
                "NAMESPACE": params.namespace,
                "CLUSTER_ID": params.cluster_id,
                "SERVICE_ACCOUNT": params.service_account or params.gateway_name,
                "INSTANCE_IPS": params.pod_ip,
                "LABELS": labels,
            },
        },
        "admin": {"address": {"pipe": {"path": str(params.admin_socket)}}},
        "bootstrap_extensions": [
            {
                "name": "envoy.bootstrap.internal_listener",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3.InternalListener"
                },
            }
        ],
        "dynamic_resources": {
            "ads_config": {
                "api_type": "DELTA_GRPC",
                "transport_api_version": "V3",
                "set_node_on_first_message_only": True,
                "grpc_services": [{"envoy_grpc": {"cluster_name": XDS_CLUSTER}}],
            },
            "cds_config": ads_source,
            "lds_config": ads_source,
        },
        "static_resources": {
            "clusters": [
                _unix_cluster(XDS_CLUSTER, params.xds_socket),
                _unix_cluster(SDS_CLUSTER, params.sds_socket),
                *([_unix_cluster(ALS_CLUSTER, params.als_socket)] if params.als_socket is not None else []),
            ]
        },
    }
