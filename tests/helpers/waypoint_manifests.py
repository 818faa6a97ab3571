"""Small waypoint meshes as manifests, shared by the control plane's unit tests and benches."""

# A waypoint with an address, a Service that uses it (web) and one that does not (plain), in
# an ambient namespace `demo`.
ROUTE_STATUS_MESH = """
apiVersion: v1
kind: Namespace
metadata: {name: demo, labels: {istio.io/dataplane-mode: ambient}}
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: waypoint, namespace: demo}
spec: {gatewayClassName: istio-waypoint, listeners: [{name: mesh, port: 15008, protocol: HBONE}]}
status: {addresses: [{type: IPAddress, value: 10.0.0.9}]}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: demo, labels: {istio.io/use-waypoint: waypoint}}
spec: {clusterIP: 10.96.0.3, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: plain, namespace: demo}
spec: {clusterIP: 10.96.0.4, ports: [{port: 80}]}
"""

# A waypoint (with its own Service) in the ambient namespace `default`, and nothing else: the
# base the route and service changes of the build-memo property test go on.
WAYPOINT_BASE = """apiVersion: v1
kind: Namespace
metadata: {name: default, labels: {istio.io/dataplane-mode: ambient}}
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: waypoint, namespace: default, labels: {istio.io/waypoint-for: service}}
spec: {gatewayClassName: istio-waypoint, listeners: [{name: mesh, port: 15008, protocol: HBONE}]}
status: {addresses: [{type: Hostname, value: waypoint.default.svc.cluster.local}]}
---
apiVersion: v1
kind: Service
metadata: {name: waypoint, namespace: default, labels: {gateway.networking.k8s.io/gateway-name: waypoint}}
spec: {selector: {gateway.networking.k8s.io/gateway-name: waypoint}, clusterIP: 10.96.0.2, ports: [{name: mesh, port: 15008}]}"""
