"""Asyncio transports and buffers: the event loop's side of a connected socket, Istio-neutral.

What moves bytes between sockets and protocols, knowing nothing of the mesh: `tcp` (a plain TCP
transport on the loop's readiness callbacks), `write_backlog` (what a socket has not taken yet,
bounded, with asyncio's flow-control marks; HBONE's TLS transport keeps one too) and `relay` (the
bidirectional copy between two endpoints with backpressure and half-close, ztunnel's copy.rs).

Where the other layers are: bytes are encrypted in `tls/`, HTTP/2 is the sans-IO core `http2/`,
Istio's logic (HBONE, routing, inbound, outbound, the pool, telemetry) is `proxy/`. This package
imports none of them (pyproject.toml's import contracts): the proxy sits above it.
"""
