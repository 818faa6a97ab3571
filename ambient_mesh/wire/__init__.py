"""Protobuf and gRPC code generated from our own `.proto` files in `protos/`, nothing else.

- `istio.workload.workload_pb2`: `istio.workload.Address` and friends (WDS resources).
- `istio.security.authorization_pb2`: `istio.security.Authorization` (L4 policies).
- `istio.v1.auth.ca_pb2`, `ca_pb2_grpc`: `istio.v1.auth.IstioCertificateService` (the CA).
- `istio.workload.zds.zds_pb2`: ZDS messages between the node agent and the node proxy.

The `.proto` files are our own, with Istio's numbers (docs/istio-behaviour.md, "Wire types"). Never edit
the generated modules: change the `.proto` and run `python -m ambient_mesh.wire.regenerate`.
These types stop at the edge: `xds` and `zds` convert them into `state` and `rbac` values.
The xDS type URLs of the two resource types are defined here, once, for both ends of ADS.
"""

ADDRESS_TYPE_URL = "type.googleapis.com/istio.workload.Address"
AUTHORIZATION_TYPE_URL = "type.googleapis.com/istio.security.Authorization"
