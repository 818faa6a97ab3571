"""Local state only root can touch: checked private directories, 0600 files, unix-socket peers.

Counterparts: kubelet's and containerd's root-owned state under /var/lib and /run, and
istio-cni's unix sockets, which only the container runtime (root) talks to. A directory another
user can write lets that user plant what we later read (a journal, a pod record) or swap a socket
for theirs; a world-readable token hands out its identity; a socket anyone may connect to makes
every local user a caller of the node agent.

- `private_dir`: creates a directory 0700, and checks one that exists, at every start: owned by
  us (root, or the user running the tests) and writable by nobody else. Otherwise
  `UnsafePathError` names the path, its owner and its mode.
- `write_private`: a file replaced atomically, 0600.
- `peer_refusal`: SO_PEERCRED on an accepted unix socket; only root or our own user may talk.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..errors import ConfigError
from .files import atomic_write

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
SOCKET_FILE_MODE = 0o600
# Bits that let another user change what a directory holds.
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid (socket(7), SO_PEERCRED)


class UnsafePathError(ConfigError):
    """A directory we keep private state in that another user could write, or that is not ours."""

    def __init__(self, path: Path, message: str) -> None:
        super().__init__(
            str(path),
            message,
            hint=f"remove it, or make it owned by uid {os.geteuid()} with mode 0700 (chown, chmod)",
        )
        self.path = path


def check_private_dir(path: Path) -> None:
    """Raise UnsafePathError unless `path` is a real directory (not a symlink), owned by our
    effective uid (root on a node) and not writable by group or others."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise UnsafePathError(path, "does not exist") from None
    if not stat.S_ISDIR(st.st_mode):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise UnsafePathError(path, f"is {kind}; a private state directory must be a real directory")
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.geteuid() or mode & _WRITABLE_BY_OTHERS:
        raise UnsafePathError(
            path,
            f"is owned by uid {st.st_uid} with mode {mode:04o}; it must be owned by uid "
            f"{os.geteuid()} and not writable by group or others",
        )


def private_dir(path: str | Path) -> Path:
    """`path` as a checked private directory: created 0700 (with missing parents) when absent,
    checked (check_private_dir) every time, new or not."""
    path = Path(path)
    if not os.path.lexists(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir(mode=PRIVATE_DIR_MODE)
        except FileExistsError:
            pass  # made meanwhile: checked below like any other
    check_private_dir(path)
    return path


def write_private(path: Path, data: bytes) -> None:
    """Replace `path` with `data` atomically, readable and writable by its owner only."""
    atomic_write(path, data, mode=PRIVATE_FILE_MODE)


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    pid: int
    uid: int
    gid: int


class _Socket(Protocol):
    """A socket.socket, or the TransportSocket asyncio hands out (get_extra_info("socket"))."""

    def getsockopt(self, level: int, optname: int, buflen: int) -> bytes: ...


def peer_credentials(sock: _Socket) -> PeerCredentials:
    """Who is at the other end of a connected AF_UNIX socket, as the kernel recorded it at
    connect() (SO_PEERCRED): it cannot be forged by the peer."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return PeerCredentials(pid=pid, uid=uid, gid=gid)


def peer_refusal(sock: _Socket | None) -> str | None:
    """Why the peer of `sock` may not talk to us (None: root or our own user may)."""
    if sock is None:
        return "the connection has no socket to check its peer on"
    try:
        peer = peer_credentials(sock)
    except OSError as e:
        return f"the peer's credentials cannot be read: {e.strerror or e}"
    if peer.uid not in (0, os.geteuid()):
        return f"peer pid {peer.pid} runs as uid {peer.uid}; only root may use this socket"
    return None
