"""The ZDS socket itself, shared by both ends: AF_UNIX SOCK_SEQPACKET datagrams carrying fds.

Both the node proxy (client.py) and the node agent (server.py) speak ZDS over one such socket, so
the channel lives here rather than in either side: the agent must not depend on the proxy's code.
Facts: docs/istio-behaviour.md, "ZDS".
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .codec import ANCILLARY_BUFFER_BYTES, RECEIVE_BUFFER_BYTES

# --- the SEQPACKET socket seam ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Datagram:
    data: bytes
    fds: tuple[int, ...] = ()
    flags: int = 0


def _received_fds(ancdata: Sequence[tuple[int, int, bytes]]) -> tuple[int, ...]:
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(payload[: len(payload) - len(payload) % arr.itemsize])
            fds.extend(arr)
    return tuple(fds)


class SeqpacketChannel:
    """One connected AF_UNIX SOCK_SEQPACKET socket on the event loop: datagrams with fds.

    asyncio has no recvmsg/sendmsg, so readiness comes from add_reader/add_writer and the
    syscalls run non-blocking. Received fds are close-on-exec (MSG_CMSG_CLOEXEC).
    """

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._fileno = sock.fileno()
        self._loop = asyncio.get_running_loop()

    async def _wait(
        self,
        add: Callable[[int, Callable[[], None]], None],
        remove: Callable[[int], object],
        timeout_s: float | None,
    ) -> bool:
        fut: asyncio.Future[None] = self._loop.create_future()

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        add(self._fileno, ready)
        try:
            async with asyncio.timeout(timeout_s):
                await fut
            return True
        except TimeoutError:
            return False
        finally:
            remove(self._fileno)

    async def wait_readable(self, timeout_s: float | None = None) -> bool:
        """True when a datagram (or EOF) is there to read; False after `timeout_s`."""
        return await self._wait(self._loop.add_reader, self._loop.remove_reader, timeout_s)

    def try_recv(self) -> Datagram | None:
        """One datagram, or None at EOF; BlockingIOError if there is none yet."""
        data, ancdata, flags, _ = self.sock.recvmsg(
            RECEIVE_BUFFER_BYTES, ANCILLARY_BUFFER_BYTES, socket.MSG_CMSG_CLOEXEC
        )
        fds = _received_fds(ancdata)
        if not data and not fds and not flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            return None
        return Datagram(data=data, fds=fds, flags=flags)

    async def recv(self, timeout_s: float | None = None) -> Datagram | None:
        """The next datagram (None at EOF); TimeoutError after `timeout_s`."""
        deadline = None if timeout_s is None else self._loop.time() + timeout_s
        while True:
            try:
                return self.try_recv()
            except BlockingIOError:
                pass
            remaining = None if deadline is None else max(0.0, deadline - self._loop.time())
            if not await self.wait_readable(remaining):
                raise TimeoutError(f"no datagram within {timeout_s}s")

    async def send(self, data: bytes, fds: Sequence[int] = (), *, timeout_s: float | None = None) -> None:
        ancdata = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        deadline = None if timeout_s is None else self._loop.time() + timeout_s
        while True:
            try:
                self.sock.sendmsg([data], ancdata)
                return
            except BlockingIOError:
                pass
            remaining = None if deadline is None else max(0.0, deadline - self._loop.time())
            if not await self._wait(self._loop.add_writer, self._loop.remove_writer, remaining):
                raise TimeoutError(f"socket not writable within {timeout_s}s")

    def close(self) -> None:
        self.sock.close()


def close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


__all__ = ["Datagram", "SeqpacketChannel", "close_fds"]
