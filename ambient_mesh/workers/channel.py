"""The asyncio shell around the codec: one end of the owner <-> worker socketpair.

Reads with recvmsg (bytes and SCM_RIGHTS descriptors) when the loop says the socket is
readable and feeds the sans-IO `Decoder`; writes queue frames and flush with sendmsg, the
descriptors going with a frame's first bytes. The write queue is bounded: a peer that stops
reading (a stuck worker) is cut off rather than allowed to grow our memory.
"""

from __future__ import annotations

import array
import asyncio
import logging
import socket
from collections import deque
from collections.abc import Callable, Sequence

from .codec import MAX_FDS_PER_FRAME, Decoder, Message, WorkerProtocolError, encode

log = logging.getLogger("ambient_mesh.workers")

READ_BYTES = 1024 * 1024
_ANCILLARY_BYTES = socket.CMSG_SPACE(MAX_FDS_PER_FRAME * array.array("i").itemsize)


def _received_fds(ancillary: Sequence[tuple[int, int, bytes]]) -> list[int]:
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % fds.itemsize
            fds.frombytes(data[:usable])
    return list(fds)


class Channel:
    """One end of a socketpair speaking the worker codec."""

    def __init__(
        self,
        sock: socket.socket,
        decoder: Decoder,
        *,
        name: str,
        on_message: Callable[[Message], None],
        on_close: Callable[[BaseException | None], None],
        max_queued_bytes: int,
    ) -> None:
        self.name = name
        self._sock = sock
        sock.setblocking(False)
        self._decoder = decoder
        self._on_message = on_message
        self._on_close = on_close
        self._max_queued_bytes = max_queued_bytes
        self._queue: deque[tuple[memoryview, Sequence[int]]] = deque()
        self._queued_bytes = 0
        self._writing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.closed = False
        self.sent_frames = 0
        # Set when the other side is being stopped: its end closing then is news, not trouble
        # (a worker signalled with the owner's process group drains and exits by itself).
        self.close_expected = False

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self._queued_bytes} bytes queued"
        return f"Channel({self.name}: {state}, {self.sent_frames} sent, {self._decoder!r})"

    @property
    def pending(self) -> int:
        """Bytes queued and not yet written."""
        return self._queued_bytes

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._sock.fileno(), self._on_readable)

    # -- writing ---------------------------------------------------------------------------------

    def send(self, message: Message) -> bool:
        """Queue one message; False when the channel is closed (or was just closed for being full)."""
        if self.closed:
            return False
        frame, fds = encode(message)
        if self._queued_bytes + len(frame) > self._max_queued_bytes:
            self.close(
                WorkerProtocolError(
                    f"{self.name}: peer is not reading ({self._queued_bytes} bytes queued, limit "
                    f"{self._max_queued_bytes})"
                )
            )
            return False
        self._queue.append((memoryview(frame), fds))
        self._queued_bytes += len(frame)
        self.sent_frames += 1
        if not self._writing:
            self._flush()
        return not self.closed

    def _flush(self) -> None:
        while self._queue:
            data, fds = self._queue[0]
            try:
                if fds:
                    sent = self._sock.sendmsg(
                        [data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
                    )
                else:
                    sent = self._sock.send(data)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                self.close(e)
                return
            self._queued_bytes -= sent
            if sent == len(data):
                self._queue.popleft()
            else:
                # The descriptors went with the first bytes; the rest is plain data.
                self._queue[0] = (data[sent:], ())
        want_write = bool(self._queue)
        if want_write != self._writing and self._loop is not None:
            if want_write:
                self._loop.add_writer(self._sock.fileno(), self._flush)
            else:
                self._loop.remove_writer(self._sock.fileno())
            self._writing = want_write

    # -- reading ---------------------------------------------------------------------------------

    def _on_readable(self) -> None:
        try:
            data, ancillary, flags, _addr = self._sock.recvmsg(READ_BYTES, _ANCILLARY_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self.close(e)
            return
        fds = _received_fds(ancillary)
        if flags & socket.MSG_CTRUNC:
            for fd in fds:
                socket.close(fd)
            self.close(
                WorkerProtocolError(f"{self.name}: descriptors truncated (more than {MAX_FDS_PER_FRAME})")
            )
            return
        if not data and not fds:
            self.close(None)
            return
        try:
            messages = self._decoder.feed(data, fds)
        except WorkerProtocolError as e:
            self.close(e)
            return
        for message in messages:
            if self.closed:
                break
            self._on_message(message)

    # -- closing ---------------------------------------------------------------------------------

    def close(self, error: BaseException | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        if self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
            if self._writing:
                self._loop.remove_writer(self._sock.fileno())
                self._writing = False
        self._queue.clear()
        self._queued_bytes = 0
        self._decoder.close()
        self._sock.close()
        if error is not None:
            log.log(
                logging.INFO if self.close_expected else logging.WARNING,
                "%s: channel closed: %s",
                self.name,
                error,
            )
        self._on_close(error)
