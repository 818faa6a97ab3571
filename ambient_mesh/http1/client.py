"""The blocking HTTP/1.1 client shell: one request, one reply, one connection, one deadline.

Used by the CNI plugin (a short-lived executable: plain sockets, no event loop) for the node
agent's unix socket and for its Kubernetes pod lookup. The bytes are `core`'s.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

from .core import ClientResponse, parse_response

RECV_CHUNK_BYTES = 64 * 1024


def deadline(timeout_s: float, what: str) -> Callable[[], float]:
    """A function returning the seconds left before `timeout_s` from now; raises TimeoutError
    naming `what` once none are left."""
    end = time.monotonic() + timeout_s

    def remaining() -> float:
        left = end - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no answer from {what} within {timeout_s:g} s")
        return left

    return remaining


def exchange(sock: socket.socket, request: bytes, remaining: Callable[[], float]) -> ClientResponse:
    """Send `request` on a connected socket and read the reply, every step bounded by `remaining`.
    Raises OSError/TimeoutError from the socket and ProtocolError for a reply that is not HTTP."""
    sock.settimeout(remaining())
    sock.sendall(request)
    data = b""
    while True:
        sock.settimeout(remaining())
        chunk = sock.recv(RECV_CHUNK_BYTES)
        data += chunk
        response = parse_response(data, eof=not chunk)
        if response is not None:
            return response
