"""HBONE's numbers: ztunnel's HTTP/2 settings, the shell's buffer bounds, and `HboneSettings`.

Settings follow ztunnel (docs/istio-behaviour.md, "HBONE"): stream window 4 MiB, connection
window 16 MiB, max frame 1 MiB, push disabled, header lists 16 KiB (client) and 64 KiB
(server), 200 concurrent streams on the server side, PING every 10 s and the connection
dropped after 20 s without an answer.
"""

from __future__ import annotations

from dataclasses import dataclass

STREAM_WINDOW_BYTES = 4 * 1024 * 1024
CONNECTION_WINDOW_BYTES = 16 * 1024 * 1024
MAX_FRAME_BYTES = 1024 * 1024
CLIENT_MAX_HEADER_LIST_BYTES = 16 * 1024
SERVER_MAX_HEADER_LIST_BYTES = 64 * 1024
SERVER_MAX_CONCURRENT_STREAMS = 200
PING_INTERVAL_S = 10.0
PING_TIMEOUT_S = 20.0
# TLS decrypts into one buffer per process (connection.py, `get_buffer`): what one read hands
# over at most (tls/transport.py fills it with the records that wait, uvloop's TLS reads this
# much). More than this is read in the next round. As large as the TLS transport's receive
# (tls/transport.py RECV_BYTES): one pass of HTTP/2 and relay per read.
RECEIVE_BUFFER_BYTES = 1024 * 1024
# What a socket carrying more than one stream holds unsent (connection.py's docstring). A 1-byte
# round trip beside a 2 GiB transfer on one pooled connection, one core: p99 23.1 ms -> 0.33 ms,
# p50 0.23 -> 0.21 ms, the transfer 1.05x as fast; 1 MiB (a bulk write's size) bounds nothing of
# it, p99 26.6 ms (docs/performance.md, "Streams sharing a connection").
SHARED_NOTSENT_LOWAT_BYTES = 256 * 1024
# What one stream may hold waiting for window or for the transport: the HTTP/2 core's send queue
# (`CoreSettings.max_stream_queued_bytes`). A blocked stream's relay stops reading, so it holds at
# most what was on its way: one bulk read (relay.APP_RECEIVE_BUFFER_BYTES, 1 MiB) and the part of
# one write past the window. Past this bound the relay did not stop, which must not become
# memory: the stream's relay fails with an error that names the bound, and the stream is reset.
MAX_STREAM_PENDING_BYTES = 8 * 1024 * 1024
# After a connection error (a flood, a protocol error) our GOAWAY goes out and the transport
# closes gracefully (TLS: close_notify, then reading and dropping until the peer's EOF), so
# that the peer's unread bytes do not make our close a TCP reset that can destroy the GOAWAY
# in flight (RFC 9113 5.4.1 and 6.8: the GOAWAY is sent before closing the connection). A
# peer that neither ends nor reads is cut off (abort) after this long: the connection was
# hostile or broken, so it gets less than the transport's own close bound.
ERROR_CLOSE_LINGER_S = 2.0
# After our drain ends (our final GOAWAY sent, no stream left) the peer is given this long to
# close the connection itself before we do. A peer may still hold the last DATA of a finished
# stream, read but not yet delivered (Envoy keeps it while its own downstream is slow, and
# drops it if the connection closes under it: `upstream_cx_destroy_remote_with_active_rq`); a
# client closes as soon as it has none (RFC 9113 6.8), so this bound is only for one that waits.
DRAIN_CLOSE_LINGER_S = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class HboneSettings:
    stream_window_bytes: int = STREAM_WINDOW_BYTES
    connection_window_bytes: int = CONNECTION_WINDOW_BYTES
    max_frame_bytes: int = MAX_FRAME_BYTES
    ping_interval_s: float = PING_INTERVAL_S
    ping_timeout_s: float = PING_TIMEOUT_S


DEFAULT_SETTINGS = HboneSettings()
