"""The node proxy's side of delta xDS: wire conversion, stream bookkeeping, the state updater and
the gRPC client (counterpart: ztunnel src/xds.rs, src/xds/client.rs).

Layers, bottom up: `convert` (protobuf -> model, rejections), `session` (sans-IO requests,
ACK/NACK, resume, readiness, on-demand), `updater` (the one writer of ProxyState), `client`
(the grpc.aio shell).
"""

# Nothing is imported here: the worker processes use the session and the updater without the
# gRPC client, and importing gRPC costs each of them about 10 MiB (ZTUNNEL_WORKER_THREADS).
