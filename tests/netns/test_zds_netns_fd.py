"""A real network namespace handed over ZDS: the node proxy receives an fd for the same namespace
and recognises it as one (ztunnel's sanity check: NS_GET_NSTYPE, or the nsfs filesystem magic)."""

from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from ambient_mesh.config import ProxyWorkloadInfo
from ambient_mesh.host.netns import (
    CLONE_NEWNET,
    NETNS_RUN_DIR,
    NS_GET_NSTYPE,
    create_netns,
    delete_netns,
    netns_problem,
    run_prefix,
)
from ambient_mesh.zds.client import ZdsClient, netns_id_of
from ambient_mesh.zds.server import ZdsServer

WAIT_S = 5.0
INFO = ProxyWorkloadInfo(namespace="default", name="pod", service_account="sa")


@pytest.fixture
def pod_netns(runner):
    """(name, O_RDONLY fd of /run/netns/<name>) of a fresh namespace; removed afterwards."""
    name = f"{run_prefix()}zds"
    create_netns(runner, name)
    fd = os.open(NETNS_RUN_DIR / name, os.O_RDONLY | os.O_CLOEXEC)
    try:
        yield name, fd
    finally:
        os.close(fd)
        delete_netns(runner, name)


@pytest.fixture
def sock_path():
    directory = tempfile.mkdtemp(prefix="zds-", dir="/tmp")
    yield Path(directory) / "ztunnel.sock"
    shutil.rmtree(directory, ignore_errors=True)


class NetnsCheckingManager:
    """Records, for each started pod, what the received fd turned out to be."""

    def __init__(self) -> None:
        self.seen: dict[str, tuple[str | None, tuple[int, int], int]] = {}

    async def start_proxy(self, uid: str, info: ProxyWorkloadInfo, netns_fd: int) -> None:
        nstype = fcntl.ioctl(netns_fd, NS_GET_NSTYPE)
        self.seen[uid] = (netns_problem(netns_fd), netns_id_of(netns_fd), nstype)

    async def stop_proxy(self, uid: str, graceful: bool) -> None:
        self.seen.pop(uid, None)


def test_the_check_tells_namespaces_from_other_files(pod_netns, tmp_path):
    _, fd = pod_netns
    assert netns_problem(fd) is None
    with open(tmp_path / "plain", "w") as f:
        assert "not nsfs" in netns_problem(f.fileno())
    uts = os.open("/proc/self/ns/uts", os.O_RDONLY)
    try:
        assert "not a network namespace" in netns_problem(uts)
    finally:
        os.close(uts)


async def test_netns_fd_crosses_zds_and_is_the_same_namespace(pod_netns, sock_path):
    name, fd = pod_netns

    class Store:
        def snapshot(self):
            return [("snap-pod", INFO, fd)]

    server = ZdsServer(sock_path, Store(), accept_rate_per_s=0)
    await server.start()
    manager = NetnsCheckingManager()
    client = ZdsClient(sock_path, manager)
    client.start()
    try:
        async with asyncio.timeout(WAIT_S):
            await client.wait_ready()
        assert await server.add_workload("added-pod", INFO, fd) is None
        st = os.stat(NETNS_RUN_DIR / name)  # the nsfs inode the bind mount exposes
        expected_id = (st.st_dev, st.st_ino)
        for uid in ("snap-pod", "added-pod"):
            problem, netns_id, nstype = manager.seen[uid]
            assert problem is None
            assert nstype == CLONE_NEWNET
            assert netns_id == expected_id
    finally:
        await client.close(drain=True)
        await server.stop()
    assert manager.seen == {}
