"""The few CPython-private behaviours the data path leans on for speed, in one place.

Each one is here for a measured reason (docs/architecture.md, "Speed behind seams") and each has a
test in tests/unit/host/test_cpython.py that fails loudly when the interpreter changes under it:

- `raw_accept`: `socket.socket._accept`, the C accept (accept4 with SOCK_CLOEXEC) that
  `socket.accept()` wraps; without the wrapper's enum reads of family and type per connection.
- `new_frozen` and `slot_setter`: build a frozen, slotted dataclass without its generated
  `__init__` (a Python frame that sets each field through `object.__setattr__`): the slots are set
  through their member descriptors, giving the same object for about half the cost.
- `ReusableBuffer`: one receive buffer per process, handed out again only while no memoryview of
  it is alive, which CPython's reference count tells (`sys.getrefcount`).

Nothing here reads interpreter memory.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def raw_accept(sock: socket.socket) -> Callable[[], tuple[int, Any]]:
    """The listening socket's C accept: a function returning `(fd, address)`, raising
    BlockingIOError when the backlog is empty. The caller owns the descriptor."""
    accept: Callable[[], tuple[int, Any]] = sock._accept  # type: ignore[attr-defined]
    return accept


def new_frozen(cls: type[T]) -> T:
    """An instance of a slotted class with no field set yet (`slot_setter` sets them)."""
    return object.__new__(cls)


def slot_setter(cls: type, name: str) -> Callable[[Any, Any], None]:
    """The member descriptor's `__set__` of slot `name` of `cls`: sets it on a frozen instance."""
    setter: Callable[[Any, Any], None] = vars(cls)[name].__set__
    return setter


# `sys.getrefcount(buffer)` inside `ReusableBuffer.take` when nothing else holds the buffer: the
# attribute, the local name and getrefcount's own argument.
_UNSHARED_REFS = 3


class ReusableBuffer:
    """A process's one buffer for a kind of read (the event loop runs one read callback at a
    time). `take` returns it again unless a memoryview of it is still alive (every view holds a
    reference), in which case a new one of `size` bytes replaces it; the old one is freed when
    its last view is. Made on the first `take`."""

    __slots__ = ("buf", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.buf = bytearray()

    def take(self) -> bytearray:
        buf = self.buf
        if sys.getrefcount(buf) > _UNSHARED_REFS or not buf:
            buf = self.buf = bytearray(self.size)
        return buf


__all__ = ["ReusableBuffer", "new_frozen", "raw_accept", "slot_setter"]
