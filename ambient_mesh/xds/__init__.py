"""The node proxy's side of delta xDS: wire conversion, stream bookkeeping, the state updater and
the gRPC client (counterpart: ztunnel src/xds.rs, src/xds/client.rs)."""
