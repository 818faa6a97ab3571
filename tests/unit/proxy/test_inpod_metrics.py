"""Workload manager metrics of shared mode: started/stopped counters and the active gauge from the
InpodManager, the pending gauge from the ZDS client's retry queue.

Pod proxies are recording fakes built through InpodManager's `proxy_factory` seam; netns fds are
stood in for by files (the namespace itself is tests/netns' business). The ZDS test talks to the
project's own node agent server over a Unix SOCK_SEQPACKET socket in a private /tmp directory.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from ambient_mesh.config import ProxyWorkloadInfo, ZtunnelConfig
from ambient_mesh.host.netns import NetnsHandle
from ambient_mesh.metrics import Metrics
from ambient_mesh.proxy.inpod import InpodManager
from ambient_mesh.state.store import ProxyState
from ambient_mesh.tls.context import TlsContextCache
from ambient_mesh.zds.client import ZdsClient, close_fds
from ambient_mesh.zds.server import ZdsServer

WAIT_S = 5.0


class FakeProxy:
    """What InpodManager needs of a pod's WorkloadProxy, recording what was done to it."""

    def __init__(
        self, name: str, netns: NetnsHandle, *, fail: bool, drain_gate: asyncio.Event | None
    ) -> None:
        self.name = name
        self.netns = netns
        self.fail = fail
        self.drain_gate = drain_gate
        self.events: list[str] = []

    def start(self) -> None:
        if self.fail:
            raise OSError(98, f"address in use for {self.name}")
        self.events.append("start")

    def bound_addresses(self) -> dict[str, str]:
        return {}

    async def drain(self, deadline_s: float) -> None:
        self.events.append(f"drain {deadline_s:g}")
        if self.drain_gate is not None:
            await self.drain_gate.wait()


class FakeProxyFactory:
    def __init__(self) -> None:
        self.failures: dict[str, int] = {}  # pod name -> how many starts fail
        self.drain_gate: asyncio.Event | None = None
        self.built: list[FakeProxy] = []

    def __call__(self, info: ProxyWorkloadInfo, netns: NetnsHandle) -> FakeProxy:
        fail = self.failures.get(info.name, 0) > 0
        if fail:
            self.failures[info.name] -= 1
        proxy = FakeProxy(info.name, netns, fail=fail, drain_gate=self.drain_gate)
        self.built.append(proxy)
        return proxy


class NoSecrets:
    """No workload here is an HBONE workload of this node, so nothing is ever prefetched."""

    def prefetch(self, identity) -> None:
        raise AssertionError(f"unexpected prefetch of {identity}")

    def forget(self, identity) -> None:
        raise AssertionError(f"unexpected forget of {identity}")


def info(name: str) -> ProxyWorkloadInfo:
    return ProxyWorkloadInfo(namespace="default", name=name, service_account=f"{name}-sa")


def sample(metrics: Metrics, name: str) -> float | None:
    return metrics.registry.get_sample_value(name)


def counts(metrics: Metrics) -> tuple[float | None, ...]:
    """(active, pending, started, stopped) as /metrics would show them."""
    return (
        sample(metrics, "workload_manager_active_proxy_count"),
        sample(metrics, "workload_manager_pending_proxy_count"),
        sample(metrics, "workload_manager_proxies_started_total"),
        sample(metrics, "workload_manager_proxies_stopped_total"),
    )


@pytest.fixture
def setup(tmp_path):
    config = ZtunnelConfig.from_env(
        {
            "PROXY_MODE": "shared",
            "NODE_NAME": "node-1",
            "XDS_ADDRESS": "",
            "FAKE_CA": "true",
            "ISTIO_META_DNS_CAPTURE": "false",
        }
    )
    metrics = Metrics(process_metrics=False)
    factory = FakeProxyFactory()
    manager = InpodManager(
        config=config,
        state=ProxyState(),
        cert_manager=NoSecrets(),
        tls=TlsContextCache(),
        metrics=metrics,
        proxy_factory=factory,
    )
    opened: list[int] = []

    def netns_fd(name: str) -> int:
        fd = os.open(tmp_path / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
        opened.append(fd)
        return fd

    yield config, metrics, factory, manager, netns_fd
    manager._unsubscribe()
    close_fds(opened)


def test_manager_serves_its_metrics_from_construction(setup):
    _config, metrics, _factory, _manager, _fd = setup
    assert counts(metrics) == (0, 0, 0, 0)


async def test_started_stopped_and_active(setup):
    config, metrics, factory, manager, netns_fd = setup
    await manager.start_proxy("uid-a", info("a"), netns_fd("a"))
    await manager.start_proxy("uid-b", info("b"), netns_fd("b"))
    assert counts(metrics) == (2, 0, 2, 0)

    factory.failures["c"] = 1
    with pytest.raises(OSError, match="address in use for c"):
        await manager.start_proxy("uid-c", info("c"), netns_fd("c"))
    assert counts(metrics) == (2, 0, 2, 0)  # a failed start is neither started nor active
    assert factory.built[-1].netns.fd == -1  # and its namespace handle was released

    await manager.stop_proxy("uid-a", graceful=False)
    assert counts(metrics) == (1, 0, 2, 1)
    await manager.stop_proxy("uid-a", graceful=False)  # already gone: nothing changes
    assert counts(metrics) == (1, 0, 2, 1)

    await manager.stop_all()
    assert counts(metrics) == (0, 0, 2, 2)
    assert factory.built[0].events == ["start", "drain 0"]
    assert factory.built[1].events == ["start", f"drain {config.termination_deadline_s:g}"]
    assert (
        repr(metrics.workload_manager)
        == "<WorkloadManagerMetrics: 0 active, 0 pending, 2 started, 2 stopped>"
    )


async def test_a_draining_proxy_is_no_longer_active_but_not_yet_stopped(setup):
    _config, metrics, factory, manager, netns_fd = setup
    factory.drain_gate = asyncio.Event()
    await manager.start_proxy("uid-a", info("a"), netns_fd("a"))
    stopping = asyncio.create_task(manager.stop_proxy("uid-a", graceful=True))
    async with asyncio.timeout(WAIT_S):
        while factory.built[0].events[-1] == "start":
            await asyncio.sleep(0)
    assert counts(metrics) == (0, 0, 1, 0)
    factory.drain_gate.set()
    await asyncio.wait_for(stopping, WAIT_S)
    assert counts(metrics) == (0, 0, 1, 1)
    assert factory.built[0].netns.fd == -1


# --- through ZDS: the pending gauge ------------------------------------------------------------


class PodStore:
    def __init__(self) -> None:
        self.pods: dict[str, tuple[ProxyWorkloadInfo, int | None]] = {}

    def snapshot(self):
        return [(uid, i, fd) for uid, (i, fd) in self.pods.items()]


@pytest.fixture
def sock_path():
    # Short, private directory: Unix socket paths are limited to 107 bytes.
    directory = tempfile.mkdtemp(prefix="zds-metrics-", dir="/tmp")
    yield Path(directory) / "ztunnel.sock"
    shutil.rmtree(directory, ignore_errors=True)


async def until(predicate, what: str) -> None:
    async with asyncio.timeout(WAIT_S):
        while not predicate():
            await asyncio.sleep(0.005)
    assert predicate(), what


async def test_pending_gauge_follows_the_retry_queue(setup, sock_path):
    _config, metrics, factory, manager, netns_fd = setup
    server = ZdsServer(sock_path, PodStore(), accept_rate_per_s=0)
    await server.start()
    # A long retry interval: the pending pod stays pending until the test lets the clock move.
    now = [0.0]
    client = ZdsClient(
        sock_path, manager, retry_interval_s=3600.0, max_backoff_s=0.05, clock=lambda: now[0], metrics=metrics
    )
    client.start()
    try:
        async with asyncio.timeout(WAIT_S):
            await client.wait_ready()
        assert counts(metrics) == (0, 0, 0, 0)

        factory.failures["a"] = 1
        error = await server.add_workload("uid-a", info("a"), netns_fd("a"))
        assert error is not None and "address in use for a" in error
        assert client.state.pending == ("uid-a",)
        assert counts(metrics) == (0, 1, 0, 0)

        assert await server.add_workload("uid-b", info("b"), netns_fd("b")) is None
        assert counts(metrics) == (1, 1, 1, 0)

        # The retry comes due once the (fake) clock passes it; the client reads the clock each
        # time it wakes, here for the next add.
        now[0] = 7200.0
        assert await server.add_workload("uid-c", info("c"), netns_fd("c")) is None
        await until(lambda: not client.state.pending, "the pending pod was retried")
        assert counts(metrics) == (3, 0, 3, 0)

        assert await server.del_workload("uid-b") is None
        assert counts(metrics) == (2, 0, 3, 1)
    finally:
        await client.close(drain=True)
        await server.stop()
    assert counts(metrics) == (0, 0, 3, 3)
