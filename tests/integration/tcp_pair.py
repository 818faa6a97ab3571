"""One loopback TCP connection for the relay tests: (the proxy's side, the peer's side)."""

from __future__ import annotations

import socket


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """(the proxy's side, blocking as accepted; the peer's side, non-blocking) of one loopback
    TCP connection."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        peer = socket.create_connection(listener.getsockname())
        proxy, _ = listener.accept()
    peer.setblocking(False)
    return proxy, peer
