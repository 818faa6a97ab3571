"""HBONE: HTTP/2 CONNECT streams over a mutual-TLS connection (port 15008), the asyncio shell.

`connection.py` is the connection (read -> feed the HTTP/2 core -> dispatch -> flush),
`stream.py` one CONNECT stream (a relay endpoint), `settings.py` ztunnel's numbers. The HTTP/2
protocol itself, send queues and flow control included, is the sans-IO core in http2/.
"""

from .connection import HboneConnection
from .settings import (
    CLIENT_MAX_HEADER_LIST_BYTES,
    CONNECTION_WINDOW_BYTES,
    DEFAULT_SETTINGS,
    ERROR_CLOSE_LINGER_S,
    MAX_FRAME_BYTES,
    MAX_STREAM_PENDING_BYTES,
    PING_INTERVAL_S,
    PING_TIMEOUT_S,
    RECEIVE_BUFFER_BYTES,
    SERVER_MAX_CONCURRENT_STREAMS,
    SERVER_MAX_HEADER_LIST_BYTES,
    SHARED_NOTSENT_LOWAT_BYTES,
    STREAM_WINDOW_BYTES,
    HboneSettings,
)
from .stream import (
    Cancellable,
    ConnectRequest,
    ConnectResponse,
    HboneError,
    HboneStream,
    HboneStreamRefused,
    StreamState,
)

__all__ = [
    "CLIENT_MAX_HEADER_LIST_BYTES",
    "CONNECTION_WINDOW_BYTES",
    "DEFAULT_SETTINGS",
    "ERROR_CLOSE_LINGER_S",
    "MAX_FRAME_BYTES",
    "MAX_STREAM_PENDING_BYTES",
    "PING_INTERVAL_S",
    "PING_TIMEOUT_S",
    "RECEIVE_BUFFER_BYTES",
    "SERVER_MAX_CONCURRENT_STREAMS",
    "SERVER_MAX_HEADER_LIST_BYTES",
    "SHARED_NOTSENT_LOWAT_BYTES",
    "STREAM_WINDOW_BYTES",
    "Cancellable",
    "ConnectRequest",
    "ConnectResponse",
    "HboneConnection",
    "HboneError",
    "HboneSettings",
    "HboneStream",
    "HboneStreamRefused",
    "StreamState",
]
