"""The node agent's plugin server over a real unix socket, and the whole agent in-process.

Part one drives `CniPluginServer` with the plugin's own HTTP client (`UnixHttpTransport`):
status codes, the add event as the handler receives it, the log socket. Part two runs `CniAgent`
with a YAML pod source, a real ZDS server and a recording node proxy, rules recorded instead of
applied (RecordingRunner), and this process's own network namespace standing in for the pod's
(a real netns fd, so the node proxy's checks pass without root). The plugin runs in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import ipaddress
import json
import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path

import pytest
import yaml

from ambient_mesh.cni.agent import CniAgent
from ambient_mesh.cni.agent_config import AgentConfig
from ambient_mesh.cni.cni_server import CniAddHandler, CniPluginServer
from ambient_mesh.cni.cniconf import CniAddEvent, IPConfig, encode_add_event
from ambient_mesh.cni.dataplane import DataplaneError
from ambient_mesh.cni.enablement import DEFAULT_ENABLEMENT_SELECTORS
from ambient_mesh.cni.informer import Enablement, PodAction
from ambient_mesh.cni.install import Installer, PluginInstall, plugin_entry
from ambient_mesh.cni.netns_discovery import NetnsCandidate
from ambient_mesh.cni.plugin import Plugin, UnixHttpTransport
from ambient_mesh.cni.pods import DirectoryPodSource
from ambient_mesh.cni.sandbox import NetnsGuard
from ambient_mesh.host.commands import RecordingRunner
from ambient_mesh.zds.client import ZdsClient, netns_id_of

WAIT_S = 5.0


@pytest.fixture
def short_dir():
    # unix socket paths must stay under 108 bytes; pytest's tmp_path can be longer
    path = Path(tempfile.mkdtemp(prefix="amcni-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def post(path: Path, url: str, body: bytes, timeout_s: float = WAIT_S):
    return UnixHttpTransport(str(path)).post(url, body, timeout_s=timeout_s)


EVENT = CniAddEvent(
    netns="/var/run/netns/cni-1",
    pod_name="web",
    pod_namespace="demo",
    ips=(IPConfig(address="10.1.0.7", prefix_len=24, interface=0),),
)


class RecordingHandler:
    def __init__(self, answer: str | None = None) -> None:
        self.events: list[CniAddEvent] = []
        self.answer = answer

    async def __call__(self, event):
        self.events.append(event)
        return self.answer


@pytest.fixture
async def served(short_dir):
    handler = RecordingHandler()
    codes: list[int] = []
    server = CniPluginServer(
        short_dir / "run" / "pluginevent.sock",
        short_dir / "run" / "log.sock",
        handler,
        on_response=codes.append,
    )
    await server.start()
    yield server, handler, codes
    await server.stop()


async def test_good_event_is_200_and_reaches_the_handler(served):
    server, handler, codes = served
    response = await asyncio.to_thread(post, server.event_socket, "/cmdadd", encode_add_event(EVENT))
    assert response.status == 200 and response.body == b""
    assert handler.events == [EVENT]
    assert codes == [200]
    assert oct(os.stat(server.event_socket).st_mode & 0o777) == oct(0o600)
    assert oct(os.stat(server.event_socket.parent).st_mode & 0o777) == oct(0o700)


async def test_failure_is_500_with_the_reason(served):
    server, handler, codes = served
    handler.answer = "no ztunnel connection"
    response = await asyncio.to_thread(post, server.event_socket, "/cmdadd", encode_add_event(EVENT))
    assert response.status == 500 and b"no ztunnel connection" in response.body
    assert codes == [500]


@pytest.mark.parametrize(
    "body",
    [
        b"{",
        b"[]",
        b'{"PodName": 3}',
        b'{"Netns": "/x", "PodName": "", "PodNamespace": ""}',
        b'{"PodName": "a", "PodNamespace": "b", "IPs": [{"Address": {"IP": "1.2.3.4", "Mask": "!!"}}]}',
    ],
)
async def test_bad_body_is_400(served, body):
    server, handler, codes = served
    response = await asyncio.to_thread(post, server.event_socket, "/cmdadd", body)
    assert response.status == 400
    assert handler.events == [] and codes == [400]


async def test_other_paths_and_methods(served):
    server, _, _ = served
    assert (await asyncio.to_thread(post, server.event_socket, "/nope", b"")).status == 404

    def get() -> bytes:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(WAIT_S)
            s.connect(str(server.event_socket))
            s.sendall(b"GET /cmdadd HTTP/1.1\r\nHost: unix\r\n\r\n")
            return s.recv(1024)

    assert (await asyncio.to_thread(get)).startswith(b"HTTP/1.1 405")


async def test_log_socket_reemits_plugin_lines(served, caplog):
    server, _, _ = served
    lines = [
        json.dumps({"level": "warn", "time": "t", "msg": "detection retry", "pod": "demo/web"}),
        "not json",
    ]
    with caplog.at_level(logging.DEBUG, logger="ambient_mesh.cni-plugin"):
        response = await asyncio.to_thread(post, server.log_socket, "/log", json.dumps(lines).encode())
    assert response.status == 200
    records = [r for r in caplog.records if r.name == "ambient_mesh.cni-plugin"]
    assert [(r.levelno, r.getMessage()) for r in records] == [
        (logging.WARNING, "detection retry"),
        (logging.INFO, "not json"),
    ]
    bad = await asyncio.to_thread(post, server.log_socket, "/log", b'{"a": 1}')
    assert bad.status == 400


# -- CniAddHandler: pod lookup and eligibility ------------------------------------------------------


class FakeDataplane:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str], str]] = []
        self.error: DataplaneError | None = None

    async def add_pod_to_mesh(self, pod, ips, netns_path=""):
        self.calls.append((pod.uid, list(ips), netns_path))
        if self.error:
            raise self.error


def write_pods(dir_: Path, *pods: dict, ns_labels=None) -> None:
    docs = [
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {
                "name": "demo",
                "labels": ns_labels if ns_labels is not None else {"istio.io/dataplane-mode": "ambient"},
            },
        }
    ]
    for p in pods:
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": p["name"],
                    "namespace": "demo",
                    "uid": f"uid-{p['name']}",
                    "labels": p.get("labels", {}),
                },
                "spec": {"nodeName": "node-1", "serviceAccountName": "sa", "containers": [{"name": "app"}]},
                "status": {"phase": "Running", "podIP": "10.1.0.99"},
            }
        )
    (dir_ / "pods.yaml").write_text(yaml.safe_dump_all(docs))


@pytest.fixture
async def lookup(tmp_path):
    pods = tmp_path / "pods"
    pods.mkdir()
    write_pods(pods, {"name": "web"}, {"name": "opted-out", "labels": {"istio.io/dataplane-mode": "none"}})
    source = DirectoryPodSource(pods, node_name="node-1", state_file=tmp_path / "state.json")
    await source.start()
    sleeps: list[float] = []

    async def sleep(s):
        sleeps.append(s)

    dataplane = FakeDataplane()
    handler = CniAddHandler(
        source, dataplane, Enablement(selectors=DEFAULT_ENABLEMENT_SELECTORS), sleep=sleep
    )
    return handler, dataplane, sleeps, pods


async def test_handler_uses_cni_ips_and_netns(lookup):
    handler, dataplane, _, _ = lookup
    assert await handler(EVENT) is None
    assert dataplane.calls == [("uid-web", ["10.1.0.7"], "/var/run/netns/cni-1")]


async def test_handler_falls_back_to_pod_ips_without_prev_result(lookup):
    handler, dataplane, _, _ = lookup
    assert await handler(CniAddEvent(netns="/n", pod_name="web", pod_namespace="demo", ips=None)) is None
    assert dataplane.calls[0][1] == ["10.1.0.99"]


async def test_handler_unknown_pod_after_ten_lookups(lookup):
    handler, dataplane, sleeps, _ = lookup
    error = await handler(CniAddEvent(netns="/n", pod_name="ghost", pod_namespace="demo"))
    assert "failed to find pod demo/ghost" in error and len(sleeps) == 9 and dataplane.calls == []


async def test_handler_sees_a_pod_that_appears_during_the_retries(lookup):
    handler, dataplane, sleeps, pods = lookup

    async def sleep(s):
        sleeps.append(s)
        if len(sleeps) == 3:
            write_pods(pods, {"name": "web"}, {"name": "late"})

    handler._sleep = sleep
    assert await handler(CniAddEvent(netns="/n", pod_name="late", pod_namespace="demo")) is None
    assert len(sleeps) == 3 and dataplane.calls[0][0] == "uid-late"


async def test_handler_refuses_an_ineligible_pod_and_reports_dataplane_errors(lookup):
    handler, dataplane, _, _ = lookup
    error = await handler(CniAddEvent(netns="/n", pod_name="opted-out", pod_namespace="demo"))
    assert "unexpectedly not eligible" in error
    dataplane.error = DataplaneError(
        "failed to add pod demo/web to the node proxy: no ztunnel connection", retryable=True
    )
    assert "no ztunnel connection" in await handler(EVENT)


# -- the whole agent in-process -----------------------------------------------------------------------


class FakeProbeSet:
    def __init__(self) -> None:
        self.members: dict = {}
        self.destroyed = False

    def ensure(self):
        self.destroyed = False

    def entries(self):
        return dict(self.members)

    def upsert(self, ip, uid):
        self.members[ip] = uid

    def delete(self, ip):
        self.members.pop(ip, None)

    def flush(self):
        self.members.clear()

    def destroy(self):
        self.destroyed = True
        self.members.clear()


class NoProc:
    def find(self, wanted):
        return {}


class Proxies:
    def __init__(self) -> None:
        self.running: dict[str, int] = {}

    async def start_proxy(self, uid, info, netns_fd):
        self.running[uid] = netns_id_of(netns_fd)[1]

    async def stop_proxy(self, uid, graceful):
        self.running.pop(uid, None)


def http_get(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


@pytest.fixture
async def agent_world(short_dir, request):
    for d in ("net.d", "bin", "pods"):
        (short_dir / d).mkdir()
    write_pods(short_dir / "pods", {"name": "web"})
    cfg = AgentConfig.from_env(
        {
            "AMBIENT_ENABLED": "true",
            "CNI_AGENT_RUN_DIR": str(short_dir / "run"),
            "MOUNTED_CNI_NET_DIR": str(short_dir / "net.d"),
            "CNI_BIN_DIR": str(short_dir / "bin"),
            "ZTUNNEL_UDS_ADDRESS": str(short_dir / "zt" / "ztunnel.sock"),
            "POD_SOURCE_DIRECTORY": str(short_dir / "pods"),
            "POD_SOURCE_POLL_INTERVAL": "50ms",
            "NODE_NAME": "node-1",
            "HEALTH_PORT": "0",
            "MONITORING_PORT": "0",
            "AMBIENT_IPV6": "false",
        },
        hostname="h",
    )
    # An enrollment state left by a previous agent (indirect parametrization): it must exist
    # before the pod source is built, which reads it once, as a restarted agent's source does.
    left_state = getattr(request, "param", {}).get("enrollment_state")
    if left_state is not None:
        cfg.cni_agent_run_dir.mkdir(parents=True)
        cfg.enrollment_state_file.write_text(json.dumps(left_state))
    source = DirectoryPodSource(
        cfg.pod_source_directory,
        node_name=cfg.node_name,
        state_file=cfg.enrollment_state_file,
        poll_interval_s=cfg.pod_source_poll_interval_s,
    )
    installer = Installer(
        PluginInstall(
            cni_net_dir=cfg.mounted_cni_net_dir,
            cni_bin_dir=cfg.cni_bin_dir,
            entry=plugin_entry(
                cni_agent_run_dir=str(cfg.cni_agent_run_dir), pod_source_directory=str(short_dir / "pods")
            ),
        )
    )
    probe = FakeProbeSet()
    runner = RecordingRunner()
    agent = CniAgent(
        cfg,
        runner=runner,
        source=source,
        probe_set=probe,
        installer=installer,
        finder=NoProc(),
        install_interval_s=0.05,
        # This process's own namespace stands in for the pod's (module docstring).
        netns_guard=NetnsGuard(allow_own_netns=True),
    )
    proxies = Proxies()
    client = ZdsClient(cfg.ztunnel_uds_address, proxies, max_backoff_s=0.1)
    try:
        yield agent, cfg, proxies, client, probe, runner
    finally:
        await client.close(drain=False)
        if not agent.stopped.is_set():
            await agent.shutdown(upgrade=False)


async def wait_until(predicate, what: str):
    async with asyncio.timeout(WAIT_S):
        while not predicate():
            await asyncio.sleep(0.02)


def run_plugin(cfg: AgentConfig, conflist: dict) -> tuple[int, bytes]:
    entry = next(p for p in conflist["plugins"] if p["type"] == "istio-cni")
    stdin = dict(
        entry,
        cniVersion=conflist["cniVersion"],
        name=conflist["name"],
        prevResult={"cniVersion": "1.0.0", "ips": [{"address": "10.1.0.7/24", "interface": 0}]},
    )
    env = {
        "CNI_COMMAND": "ADD",
        "CNI_CONTAINERID": "c1",
        "CNI_NETNS": "/proc/self/ns/net",
        "CNI_IFNAME": "eth0",
        "CNI_PATH": "/opt/cni/bin",
        "CNI_ARGS": "IgnoreUnknown=1;K8S_POD_NAMESPACE=demo;K8S_POD_NAME=web",
    }
    # This process's namespace stands in for the pod's: the plugin's own-netns guard is told so.
    outcome = Plugin(same_netns=lambda path: False).run(env, json.dumps(stdin).encode())
    return outcome.exit_code, outcome.stdout


async def test_agent_readiness_install_and_cni_add_end_to_end(agent_world):
    agent, cfg, proxies, client, probe, runner = agent_world
    await agent.start()
    port = agent.health.bound_address.port
    # No primary CNI config yet: the plugin cannot be installed, so not ready.
    status, text = await asyncio.to_thread(http_get, port, "/readyz")
    assert status == 503 and "plugin not installed" in text
    assert (await asyncio.to_thread(http_get, port, "/healthz"))[0] == 200
    (cfg.mounted_cni_net_dir / "10-net.conf").write_text(
        json.dumps({"cniVersion": "0.3.1", "name": "net", "type": "bridge"})
    )
    await wait_until(lambda: agent.ready, "installed")
    assert (await asyncio.to_thread(http_get, port, "/readyz"))[0] == 200
    conflist = json.loads((cfg.mounted_cni_net_dir / "10-net.conflist").read_text())  # .conf converted
    assert [p["type"] for p in conflist["plugins"]] == ["bridge", "istio-cni"]

    # Without a node proxy the add fails closed, and the pod is marked pending.
    code, out = await asyncio.to_thread(run_plugin, cfg, conflist)
    assert code == 1 and b"no ztunnel connection" in out
    assert json.loads(cfg.enrollment_state_file.read_text())["pods"]["uid-web"]["value"] == "pending"

    client.start()
    await wait_until(lambda: agent.zds.connected == 1, "node proxy connected")
    code, out = await asyncio.to_thread(run_plugin, cfg, conflist)
    assert code == 0, out
    assert proxies.running == {"uid-web": os.stat("/proc/self/ns/net").st_ino}
    assert probe.members == {ipaddress.ip_address("10.1.0.7"): "uid-web"}
    assert json.loads(cfg.enrollment_state_file.read_text())["pods"]["uid-web"]["value"] == "enabled"
    assert any(c.argv[0] == "iptables-restore" and c.netns == "/proc/self/ns/net" for c in runner.calls)

    metrics = agent.metrics.render().decode()
    assert 'istio_cni_plugin_requests_total{response_code="200"} 1.0' in metrics
    assert 'istio_cni_plugin_requests_total{response_code="500"} 1.0' in metrics
    assert "ztunnel_connected 1.0" in metrics
    assert "istio_cni_install_ready 1.0" in metrics
    assert 'istio_cni_installs_total{result="SUCCESS"}' in metrics
    assert "1 node proxies" in repr(agent) and "1 pods" in repr(agent)

    # Un-enrolling by label: the informer takes the pod out.
    write_pods(Path(cfg.pod_source_directory), {"name": "web", "labels": {"istio.io/dataplane-mode": "none"}})
    await wait_until(lambda: "uid-web" not in proxies.running, "pod released")
    assert probe.members == {}
    assert "nodeagent_reconcile_events_total" in agent.metrics.render().decode()

    # A final shutdown removes the plugin entry, the executable and the host sets.
    assert await agent.shutdown(upgrade=None) is False
    conflist = json.loads((cfg.mounted_cni_net_dir / "10-net.conflist").read_text())
    assert [p["type"] for p in conflist["plugins"]] == ["bridge"]
    assert not (cfg.cni_bin_dir / "istio-cni").exists()
    assert probe.destroyed
    assert not cfg.cni_event_address.exists() and not cfg.ztunnel_uds_address.exists()


async def test_agent_upgrade_shutdown_keeps_the_plugin(agent_world):
    agent, cfg, *_ = agent_world
    probe = agent_world[4]
    (cfg.mounted_cni_net_dir / "10-net.conflist").write_text(
        json.dumps({"cniVersion": "0.3.1", "name": "net", "plugins": [{"type": "bridge"}]})
    )
    (Path(cfg.pod_source_directory) / "agent.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "apps/v1",
                "kind": "DaemonSet",
                "metadata": {"name": "istio-cni-node", "namespace": "default"},
            }
        )
    )
    await agent.start()
    assert agent.ready
    assert await agent.shutdown() is True
    conflist = json.loads((cfg.mounted_cni_net_dir / "10-net.conflist").read_text())
    assert [p["type"] for p in conflist["plugins"]] == ["bridge", "istio-cni"]
    assert (cfg.cni_bin_dir / "istio-cni").exists()
    assert not probe.destroyed


@pytest.mark.parametrize(
    "agent_world",
    [{"enrollment_state": {"pods": {"uid-web": {"value": "enabled", "namespace": "demo", "name": "web"}}}}],
    indirect=True,
)
async def test_agent_restores_enrolled_pods_before_serving_node_proxies(agent_world):
    agent, cfg, proxies, client, probe, runner = agent_world
    assert agent.source.state.marks() == {"uid-web": "enabled"}  # the state the source started from
    (cfg.mounted_cni_net_dir / "10-net.conflist").write_text(
        json.dumps({"cniVersion": "0.3.1", "name": "net", "plugins": [{"type": "bridge"}]})
    )

    class ProcHasIt:
        def find(self, wanted):
            return {
                uid: NetnsCandidate(pid=os.getpid(), path="/proc/self/ns/net", dev=0, inode=0, starttime=0)
                for uid in wanted
            }

    agent.dataplane.locator = ProcHasIt()
    # What the probe set held when the node proxy was handed each pod.
    probe_when_started: dict[str, dict] = {}
    start_proxy = proxies.start_proxy

    async def recording_start_proxy(uid, info, netns_fd):
        probe_when_started[uid] = dict(probe.members)
        await start_proxy(uid, info, netns_fd)

    proxies.start_proxy = recording_start_proxy
    client.start()  # already dialling (and retrying) while the agent starts, as a node proxy would
    await agent.start()
    await wait_until(lambda: "uid-web" in proxies.running, "snapshot delivered")
    # Restored before the ZDS server listened: the node proxy's snapshot had the pod, and the
    # probe set held it by then.
    assert probe_when_started == {"uid-web": {ipaddress.ip_address("10.1.0.99"): "uid-web"}}
    assert probe.members == {ipaddress.ip_address("10.1.0.99"): "uid-web"}
    assert any(c.argv[0] == "iptables-restore" for c in runner.calls)  # reconciled on start
    # The start-up pass finds the pod already enrolled: it came back through the restore and the
    # snapshot, not through a fresh ADD (whose node proxy call precedes its probe set write).
    await wait_until(lambda: ("demo", "web") in agent.informer.last_actions, "start-up pass")
    assert agent.informer.last_actions[("demo", "web")] is PodAction.NONE
    with contextlib.suppress(Exception):
        await agent.shutdown(upgrade=True)
