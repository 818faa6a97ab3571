"""Istio's well-known label and annotation names, and the values the mesh compares them with.

Counterpart of istio/api's `label` and `annotation` packages and istiod's constants. One list, so
that the node agent, the capture rules, the control plane and the lab read the same names.
"""

from __future__ import annotations

ANNOTATION_AUTO_REGISTRATION_GROUP = "istio.io/autoRegistrationGroup"
ANNOTATION_BYPASS_INBOUND = "ambient.istio.io/bypass-inbound-capture"
ANNOTATION_DNS_CAPTURE = "ambient.istio.io/dns-capture"
ANNOTATION_DRY_RUN = "istio.io/dry-run"
ANNOTATION_INBOUND_BINDING = "ambient.istio.io/waypoint-inbound-binding"
ANNOTATION_REDIRECTION = "ambient.istio.io/redirection"
ANNOTATION_SIDECAR_STATUS = "sidecar.istio.io/status"
ANNOTATION_TRAFFIC_DISTRIBUTION = "networking.istio.io/traffic-distribution"
ANNOTATION_VIRTUAL_INTERFACES = "istio.io/reroute-virtual-interfaces"
DATAPLANE_MODE_AMBIENT = "ambient"
DATAPLANE_MODE_NONE = "none"
LABEL_DATAPLANE_MODE = "istio.io/dataplane-mode"
LABEL_GATEWAY_CLASS_NAME = "gateway.networking.k8s.io/gateway-class-name"
LABEL_GATEWAY_MANAGED = "gateway.istio.io/managed"
LABEL_GATEWAY_NAME = "gateway.networking.k8s.io/gateway-name"
LABEL_INGRESS_USE_WAYPOINT = "istio.io/ingress-use-waypoint"
LABEL_TOPOLOGY_REGION = "topology.kubernetes.io/region"
LABEL_TOPOLOGY_SUBZONE = "topology.istio.io/subzone"
LABEL_TOPOLOGY_ZONE = "topology.kubernetes.io/zone"
LABEL_TUNNEL = "networking.istio.io/tunnel"
LABEL_USE_WAYPOINT = "istio.io/use-waypoint"
LABEL_USE_WAYPOINT_NAMESPACE = "istio.io/use-waypoint-namespace"
LABEL_WAYPOINT_FOR = "istio.io/waypoint-for"
LABEL_WORKLOAD_NAME = "service.istio.io/workload-name"
# The GatewayClass whose Gateways are waypoints, and the value istiod's waypoint objects carry in
# `gateway.istio.io/managed`.
WAYPOINT_GATEWAY_CLASS = "istio-waypoint"
MANAGED_BY_MESH_CONTROLLER = "istio.io-mesh-controller"
