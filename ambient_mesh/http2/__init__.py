"""HBONE's HTTP/2: a sans-IO engine for CONNECT tunnels (see connection.py for what it enforces).

The asyncio shell around it is proxy/hbone/ (connection.py and stream.py).
"""

from .connection import Connection, CoreSettings, Http2Error, SendQueueFull, StreamClosedError
from .frames import ErrorCode

__all__ = ["Connection", "CoreSettings", "ErrorCode", "Http2Error", "SendQueueFull", "StreamClosedError"]
