"""Tier 3: network-namespace tests (root).

Every test here is marked `netns` and skipped, with the reason, when it cannot run (not root,
or `ip netns` unavailable). Fixtures build their namespaces through `Fabric`, which deletes them
and stops every process it started even when a test fails. Helpers (echo servers, in-namespace
clients, HTTP GET) are handed to tests as fixtures.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from ambient_mesh.host.commands import CommandError, SubprocessRunner
from ambient_mesh.host.netns import Fabric, Node, cleanup_stale_namespaces, http_get, tcp_roundtrip
from tests.helpers.waypoint_mesh import ALLOW_CLIENT_AND_WAYPOINT, running_waypoint_mesh
from tests.helpers.waypoint_routes import APP_PORTS, SERVICES, request, served

ECHO_SCRIPT = Path(__file__).with_name("echo.py")


@functools.cache
def netns_unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "network-namespace tests need root (CI runs them as root)"
    if shutil.which("ip") is None:
        return "iproute2 `ip` is not installed"
    probe = f"am-{os.getpid()}-0-probe"
    try:
        runner = SubprocessRunner()
        runner.run(["ip", "netns", "add", probe])
        runner.run(["ip", "netns", "delete", probe])
    except CommandError as e:
        return f"`ip netns` does not work here: {e}"
    return None


def pytest_report_header(config):
    reason = netns_unavailable_reason()
    return f"netns tier: {'SKIPPED: ' + reason if reason else 'enabled'}"


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.netns)


@pytest.fixture(scope="session", autouse=True)
def _require_netns():
    # Session scope: set up before any module-scoped topology, so those never run half-way.
    reason = netns_unavailable_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def runner():
    return SubprocessRunner()


@pytest.fixture(scope="session", autouse=True)
def _remove_stale_namespaces():
    # Namespaces from runs that were killed before their teardown (their pid is gone).
    if netns_unavailable_reason() is None:
        cleanup_stale_namespaces(SubprocessRunner())


@pytest.fixture
def fabric(runner):
    with Fabric(runner=runner) as fab:
        yield fab


# --- workloads and clients -------------------------------------------------------------------------


@dataclass(slots=True)
class EchoServer:
    node: Node
    port: int
    process: subprocess.Popen
    log: Path

    def peers(self) -> list[str]:
        """Client IPs of every accepted connection so far."""
        return [line.split()[1] for line in self.log.read_text().splitlines() if line.startswith("accepted ")]


def start_echo_server(fab: Fabric, node: Node, port: int, log_dir: Path) -> EchoServer:
    """Start an echo server process in a node's namespace and wait until it listens."""
    log = log_dir / f"echo-{node.name}-{port}.log"
    with open(log, "wb") as out:
        process = fab.spawn(
            node,
            [sys.executable, str(ECHO_SCRIPT), "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    fab.wait_for_listen(node, port, process=process)
    return EchoServer(node=node, port=port, process=process, log=log)


@pytest.fixture(scope="session")
def start_echo():
    """`start_echo(fabric, node, port, log_dir) -> EchoServer`; the fabric stops it at teardown."""
    return start_echo_server


@pytest.fixture(scope="session")
def roundtrip():
    """`roundtrip(netns, host, port, payload, *, mark=None, timeout_s=5.0) -> bytes`."""
    return tcp_roundtrip


def wait_until(predicate, *, timeout_s: float, what: str, interval_s: float = 0.1):
    """Poll `predicate` until it returns something truthy; fail with `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


@pytest.fixture(scope="session")
def get():
    """`get(netns, host, port, path, *, timeout_s=5.0) -> (status, body bytes)`."""
    return http_get


@pytest.fixture(scope="session")
def poll():
    return wait_until


def pytest_asyncio_loop_factories(config, item):
    """In-process netns tests run on uvloop, the event loop the programs use."""
    import uvloop

    return {"uvloop": uvloop.new_event_loop}


# -- the waypoint route tests' mesh (test_waypoint_routes, _authz, _metrics): one per module ----


@pytest.fixture(scope="module")
def rmesh(runner, get, start_echo, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("waypoint-routes")
    with running_waypoint_mesh(runner, get, start_echo, tmp, ALLOW_CLIENT_AND_WAYPOINT) as mesh:
        app = Path(__file__).with_name("http_echo.py")
        for name, port in APP_PORTS.items():
            with open(tmp / f"app-{name}.out", "wb") as out:
                mesh.fabric.spawn(
                    mesh.server,
                    [
                        sys.executable,
                        str(app),
                        "--port",
                        str(port),
                        "--name",
                        name,
                        "--log",
                        str(tmp / f"app-{name}.jsonl"),
                    ],
                    stdout=out,
                    stderr=out,
                )
            mesh.fabric.wait_for_listen(mesh.server, port)
        mesh.write("routed.yaml", SERVICES)
        served(mesh, lambda: request(mesh).echo.get("name") == "v1", "the routed service")
        yield mesh


@pytest.fixture
def routes(rmesh):
    """Writes route objects for one test; removed (and the default route back) after it."""
    written = []

    def write(text: str, file: str = "route.yaml") -> None:
        rmesh.write(file, text)
        written.append(file)

    yield write
    for file in written:
        rmesh.remove(file)
    served(
        rmesh, lambda: request(rmesh, "/x/after").echo.get("path") == "/x/after", "the default route again"
    )
