"""Private local state (host/private.py) and the netns a CNI add may name (cni/sandbox.py),
without root: the checks on directories, files, socket peers and namespace files."""

from __future__ import annotations

import os
import socket

import pytest

from ambient_mesh.cni.sandbox import NetnsGuard, netns_in_use, netns_key
from ambient_mesh.host.private import (
    UnsafePathError,
    check_private_dir,
    peer_credentials,
    peer_refusal,
    private_dir,
    write_private,
)


def test_private_dir_is_created_0700_and_checked_every_time(tmp_path):
    made = private_dir(tmp_path / "a" / "b")
    assert oct(made.stat().st_mode & 0o777) == oct(0o700)
    made.chmod(0o755)  # readable by others is fine: nobody else can change what it holds
    assert private_dir(made) == made
    for mode in (0o775, 0o757, 0o777):
        made.chmod(mode)
        with pytest.raises(UnsafePathError) as info:
            private_dir(made)
        assert f"{made}: is owned by uid {os.geteuid()} with mode {mode:04o}" in str(info.value)
        assert "chmod" in (info.value.hint or "")


def test_a_symlink_or_a_file_is_not_a_private_dir(tmp_path):
    target = private_dir(tmp_path / "real")
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(UnsafePathError, match="is a symlink"):
        private_dir(link)
    plain = tmp_path / "file"
    plain.write_text("")
    with pytest.raises(UnsafePathError, match="not a directory"):
        check_private_dir(plain)
    with pytest.raises(UnsafePathError, match="does not exist"):
        check_private_dir(tmp_path / "missing")


def test_write_private_replaces_the_file_0600(tmp_path):
    path = tmp_path / "token"
    path.write_text("old")
    path.chmod(0o644)
    write_private(path, b"secret")
    assert path.read_bytes() == b"secret" and oct(path.stat().st_mode & 0o777) == oct(0o600)


def test_the_peer_of_a_socket_is_who_the_kernel_says():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        peer = peer_credentials(ours)
        assert (peer.pid, peer.uid, peer.gid) == (os.getpid(), os.geteuid(), os.getegid())
        assert peer_refusal(ours) is None
    assert "no socket" in (peer_refusal(None) or "")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:  # no peer: uid -1
        assert "only root may use this socket" in (peer_refusal(tcp) or "")


def test_the_netns_guard_refuses_what_cannot_be_a_pod_sandbox(tmp_path):
    guard = NetnsGuard()
    assert "node agent's own" in (guard.refusal("/proc/self/ns/net") or "")
    assert "node agent's own" in (guard.refusal(f"/proc/{os.getpid()}/ns/net", peer_pid=1) or "")
    plain = tmp_path / "netns"
    plain.write_text("")
    assert "not a namespace file" in (guard.refusal(str(plain)) or "")
    assert "cannot be opened" in (guard.refusal(str(tmp_path / "missing")) or "")
    assert "not a network namespace" in (guard.refusal("/proc/self/ns/uts") or "")
    assert guard.is_callers("/proc/self/ns/net", os.getpid())
    assert not guard.is_callers(str(plain), os.getpid())
    # In-process tests stand this process's namespace in for a pod's.
    lenient = NetnsGuard(allow_own_netns=True)
    assert lenient.refusal("/proc/self/ns/net") is None
    assert not lenient.is_callers("/proc/self/ns/net", os.getpid())
    assert "not a namespace file" in (lenient.refusal(str(plain)) or "")


def test_a_namespace_with_a_process_is_in_use_and_moves_are_refused_then():
    own = netns_key("/proc/self/ns/net")
    assert own is not None and netns_in_use(own)
    assert not netns_in_use((own[0], 1))  # no namespace has inode 1
    guard = NetnsGuard()
    assert guard.move_refusal(own, "/proc/self/ns/net", "demo/web") is None  # the same one
    assert guard.move_refusal(own, "/nonexistent", "demo/web") is None  # open() reports it later
    # Enrolled in a namespace no process is in any more (the sandbox was recreated): the new
    # one is taken. (A move out of a live sandbox: tests/netns/test_local_surfaces.py.)
    assert guard.move_refusal((own[0], 1), "/proc/self/ns/net", "demo/web") is None
