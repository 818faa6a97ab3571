"""A TCP listener: bind as ztunnel binds, accept, and run one handler task per connection.

Each connection task has a crash barrier: an unexpected exception is logged with the listener's
name and the socket is closed; CancelledError always propagates. Draining stops accepting
first; the caller then waits for (or aborts) the connections.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

from ..errors import BindError
from ..net import SocketAddr
from .inputs import ConnectionTracker
from .sockets import SocketFactory, configure_accepted, listen_socket, plain_socket

log = logging.getLogger("ambient_mesh.proxy.listener")

Handler = Callable[[socket.socket], Awaitable[None]]


class Listener:
    def __init__(
        self,
        name: str,
        address: SocketAddr,
        handler: Handler,
        tracker: ConnectionTracker,
        *,
        mark: int | None = None,
        transparent: bool = False,
        reuse_port: bool = False,
        socket_factory: SocketFactory = plain_socket,
    ) -> None:
        self.name = name
        self.address = address
        self._handler = handler
        self._tracker = tracker
        self._mark = mark
        self._transparent = transparent
        self._reuse_port = reuse_port
        self._socket_factory = socket_factory
        self._sock: socket.socket | None = None
        self._task: asyncio.Task | None = None
        self.accepted = 0

    def __repr__(self) -> str:
        where = self.bound_address if self._sock else self.address
        return f"Listener({self.name} on {where}, {self.accepted} accepted)"

    def bind(self) -> None:
        try:
            self._sock = listen_socket(
                self.address,
                mark=self._mark,
                transparent=self._transparent,
                reuse_port=self._reuse_port,
                factory=self._socket_factory,
            )
        except OSError as e:
            raise BindError(self.name, str(self.address), e) from None

    @property
    def bound_address(self) -> SocketAddr:
        assert self._sock is not None, "listener is not bound"
        return SocketAddr.from_sockaddr(self._sock.getsockname())

    def start(self) -> None:
        if self._sock is None:
            self.bind()
        self._task = asyncio.get_running_loop().create_task(self._accept_loop(), name=f"listener {self.name}")

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            try:
                conn, _addr = await loop.sock_accept(self._sock)
            except OSError as e:
                if self._sock is None or self._sock.fileno() < 0:
                    return
                log.warning("%s listener: accept failed: %s", self.name, e)
                await asyncio.sleep(0.05)  # EMFILE and friends: do not spin
                continue
            self.accepted += 1
            configure_accepted(conn, keepalive=None)
            self._tracker.spawn(self._guard(conn))

    async def _guard(self, conn: socket.socket) -> None:
        try:
            await self._handler(conn)
        except asyncio.CancelledError:
            conn.close()
            raise
        except Exception:
            log.exception("%s listener: connection handler failed", self.name)
            conn.close()

    def close(self) -> None:
        """Stop accepting. Open connections are left to the caller's drain."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
