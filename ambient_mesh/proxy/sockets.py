"""Where the proxy's socket helpers used to live; they are `ambient_mesh.host.sockets` now.

Kept only for helper edges' files in this session (proxy/listener.py and
tests/integration/test_socket_options.py), which still import from here; once they import
`ambient_mesh.host.sockets`, delete this module.
"""

from ..host.sockets import (
    TCP_USER_TIMEOUT,
    KeepaliveSettings,
    SocketFactory,
    configure_accepted,
    listen_socket,
    plain_socket,
)

__all__ = [
    "TCP_USER_TIMEOUT",
    "KeepaliveSettings",
    "SocketFactory",
    "configure_accepted",
    "listen_socket",
    "plain_socket",
]
