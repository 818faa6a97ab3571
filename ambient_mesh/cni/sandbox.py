"""Which network namespace a CNI add may name: a pod sandbox's, never the host's or a caller's own.

Counterpart: CNI skel's check that CNI_NETNS is not the plugin's own namespace, made here by the
node agent from what the kernel says rather than from what a caller claims. Before the agent
writes in-pod rules into a namespace and hands it to the node proxy:
- the path must name a network namespace (an nsfs inode of type CLONE_NEWNET);
- it must not be the agent's own namespace (the host's), nor the namespace of the process that
  asked (the plugin runs in the host's; the runtime never names its own);
- an enrolled pod keeps its namespace while that namespace still holds a process (its sandbox
  lives): a second add naming another namespace is refused. Once the sandbox is gone (kubelet
  recreates it) the new namespace is taken.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from typing import Protocol

# linux/nsfs.h: NS_GET_NSTYPE = _IO(0xb7, 0x3); sched.h: CLONE_NEWNET.
NS_GET_NSTYPE = 0xB703
CLONE_NEWNET = 0x40000000
OWN_NETNS = "/proc/self/ns/net"

NetnsKey = tuple[int, int]  # (st_dev, st_ino) of the namespace's nsfs inode


def netns_key(path: str) -> NetnsKey | None:
    """The namespace `path` names, or None when it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def netns_in_use(key: NetnsKey, proc: str = "/proc") -> bool:
    """Whether any process is inside the namespace `key` (its sandbox is alive)."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(proc):
            if entry.name.isdigit() and netns_key(f"{proc}/{entry.name}/ns/net") == key:
                return True
    return False


class SandboxCheck(Protocol):
    """The seam MeshDataplane checks a named netns through (NetnsGuard; fakes in unit tests,
    where ordinary files stand in for namespaces)."""

    def refusal(self, path: str, *, peer_pid: int | None = None) -> str | None: ...

    def move_refusal(self, enrolled: NetnsKey, named: str, pod: str) -> str | None: ...


class NetnsGuard:
    """The node agent's checks on a netns a CNI add names (the module docstring says which).

    `allow_own_netns` is for in-process tests without root, where this process's namespace
    stands in for a pod's; a node agent never sets it."""

    __slots__ = ("allow_own_netns",)

    def __init__(self, *, allow_own_netns: bool = False) -> None:
        self.allow_own_netns = allow_own_netns

    def __repr__(self) -> str:
        return f"NetnsGuard(allow_own_netns={self.allow_own_netns})"

    def refusal(self, path: str, *, peer_pid: int | None = None) -> str | None:
        """Why `path` cannot be a pod sandbox's network namespace; None when it can be."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            return f"netns {path} cannot be opened: {e.strerror or e}"
        try:
            st = os.fstat(fd)
            try:
                kind = fcntl.ioctl(fd, NS_GET_NSTYPE)
            except OSError:
                return f"{path} is not a namespace file"
        finally:
            os.close(fd)
        if kind != CLONE_NEWNET:
            return f"{path} is a namespace, but not a network namespace"
        if self.allow_own_netns:
            return None
        key = (st.st_dev, st.st_ino)
        if key == netns_key(OWN_NETNS):
            return f"{path} is the node agent's own (the host's) network namespace"
        if peer_pid is not None and self.is_callers(path, peer_pid):
            return f"{path} is the caller's own network namespace (pid {peer_pid}), not a pod sandbox's"
        return None

    def is_callers(self, path: str, peer_pid: int) -> bool:
        """Whether `path` is the network namespace of the process `peer_pid` (skel's check, made
        by the agent from the kernel's pid of the caller rather than from the caller's word)."""
        if self.allow_own_netns:
            return False
        key = netns_key(path)
        return key is not None and key == netns_key(f"/proc/{peer_pid}/ns/net")

    def move_refusal(self, enrolled: NetnsKey, named: str, pod: str) -> str | None:
        """Why an enrolled pod may not be re-added into the namespace `named` (None: it may).

        Same namespace: a repeated add, fine. Another one: only once the enrolled namespace has
        no process left (the sandbox was recreated)."""
        key = netns_key(named)
        if key is None or key == enrolled:
            return None
        if netns_in_use(enrolled):
            return (
                f"pod {pod} is enrolled in another network namespace (inode {enrolled[1]}) whose "
                f"sandbox still runs; refusing to move it to {named}"
            )
        return None
