"""The CNI node agent end to end, in network namespaces (root).

A fabric gives a node namespace (the agent runs there, as `python -m ambient_mesh.cni.agent`, so
its probe set and host rule live there) and pod namespaces with IPs. Pods and namespaces come
from a YAML directory (the embedded control plane's store). A recording node proxy connects to
the agent's ZDS socket from this process; the real plugin is run as a container runtime would.

One topology per module: the scenario is a sequence (CNI ADD, label change, delete, restart)
and every step depends on the previous one, so each test asserts one step in order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from ambient_mesh.capture.hostprobe import HostProbeConfig, NetlinkIpset
from ambient_mesh.config import ProxyWorkloadInfo
from ambient_mesh.host.commands import SubprocessRunner
from ambient_mesh.host.netns import NETNS_RUN_DIR, Fabric, netns_socket, stop_process
from ambient_mesh.zds.client import ZdsClient, netns_id_of

# The agent finds running pods by their IP under /proc, which every network namespace on the host
# shares: a fabric subnet of this run's own keeps another run's pods (another checkout's suite on
# the same host) out of what it finds.
RUN_SUBNET = f"10.253.{os.getpid() % 256}.0/24"

pytestmark = pytest.mark.timeout(120)

WAIT_S = 20.0
POLL_S = 0.05
NODE_NAME = "node-1"
NAMESPACE = "demo"
PROBE_PREFIX = "am-cni-test"  # ipsets are per netns; a distinct prefix still makes leftovers obvious
UIDS = {"pa": "11111111-aaaa-4aaa-8aaa-000000000001", "pb": "11111111-bbbb-4bbb-8bbb-000000000002"}


class RecordingProxies:
    """The node proxy's side of ZDS: which pods it runs, with the netns inode it was given."""

    def __init__(self) -> None:
        self.running: dict[str, int] = {}
        self.starts: list[tuple[str, int]] = []
        self.stops: list[str] = []

    async def start_proxy(self, uid: str, info: ProxyWorkloadInfo, netns_fd: int) -> None:
        inode = netns_id_of(netns_fd)[1]
        self.running[uid] = inode
        self.starts.append((uid, inode))

    async def stop_proxy(self, uid: str, graceful: bool) -> None:
        self.running.pop(uid, None)
        self.stops.append(uid)


LOGS: list[Path] = []


async def wait_for(predicate, what: str, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            tail = "\n".join(p.read_text(errors="replace") for p in LOGS if p.exists())[-4000:]
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; agent log:\n{tail}")
        await asyncio.sleep(POLL_S)


def pod_doc(name: str, ip: str, labels: dict[str, str] | None = None) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": UIDS[name], "labels": labels or {}},
        "spec": {"nodeName": NODE_NAME, "serviceAccountName": f"sa-{name}", "containers": [{"name": "app"}]},
        "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]},
    }


class Scenario:
    def __init__(self, fabric: Fabric, root: Path, **env: str) -> None:
        self.fabric = fabric
        self.root = root
        self.extra_env = env
        self.runner = SubprocessRunner()
        self.node = fabric.add_node("node")
        self.pods = {name: fabric.add_node(name) for name in ("pa", "pb")}
        self.run_dir = root / "run"
        self.net_dir = root / "net.d"
        self.bin_dir = root / "bin"
        self.pods_dir = root / "pods"
        self.zds_socket = root / "zt" / "ztunnel.sock"
        for d in (self.net_dir, self.bin_dir, self.pods_dir):
            d.mkdir(parents=True)
        (self.net_dir / "10-bridge.conflist").write_text(
            json.dumps(
                {"cniVersion": "1.0.0", "name": "lab", "plugins": [{"type": "bridge", "bridge": "cni0"}]}
            )
        )
        self.agent: subprocess.Popen | None = None
        self.agent_logs: list[Path] = []
        self.proxies = RecordingProxies()
        self.zds_client: ZdsClient | None = None
        self.write_pods(pb_labels={"istio.io/dataplane-mode": "none"})

    def ip(self, pod: str) -> str:
        return str(self.pods[pod].ipv4)

    def write_pods(self, *, pb_labels: dict[str, str], with_pa: bool = True) -> None:
        docs = [
            {
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {"name": NAMESPACE, "labels": {"istio.io/dataplane-mode": "ambient"}},
            }
        ]
        if with_pa:
            docs.append(pod_doc("pa", self.ip("pa")))
        docs.append(pod_doc("pb", self.ip("pb"), pb_labels))
        tmp = self.pods_dir / ".pods.yaml.tmp"
        tmp.write_text(yaml.safe_dump_all(docs))
        os.replace(tmp, self.pods_dir / "pods.yaml")

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG")}
        env.update(
            {
                "AMBIENT_ENABLED": "true",
                "CNI_AGENT_RUN_DIR": str(self.run_dir),
                "MOUNTED_CNI_NET_DIR": str(self.net_dir),
                "CNI_BIN_DIR": str(self.bin_dir),
                "ZTUNNEL_UDS_ADDRESS": str(self.zds_socket),
                "POD_SOURCE_DIRECTORY": str(self.pods_dir),
                "POD_SOURCE_POLL_INTERVAL": "100ms",
                "NODE_NAME": NODE_NAME,
                "AMBIENT_IPV6": "false",
                "AMBIENT_DNS_CAPTURE": "true",
                "PROBE_SET_PREFIX": PROBE_PREFIX,
                "POD_NAMESPACE": "istio-system",
                "LOG_OUTPUT_LEVEL": "debug",
                "MONITORING_PORT": "15014",
                "HEALTH_PORT": "8000",
            }
        )
        env.update(self.extra_env)
        return env

    def start_agent(self) -> None:
        log = self.root / f"agent-{len(self.agent_logs)}.log"
        self.agent_logs.append(log)
        LOGS.append(log)
        with open(log, "wb") as out:
            self.agent = self.fabric.spawn(
                self.node,
                [sys.executable, "-m", "ambient_mesh.cni.agent"],
                env=self.env(),
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def stop_agent(self) -> int:
        assert self.agent is not None
        code = stop_process(self.agent, grace_s=15.0)
        self.agent = None
        return code

    def agent_log(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in self.agent_logs if p.exists())

    def conflist(self) -> dict:
        return json.loads((self.net_dir / "10-bridge.conflist").read_text())

    def installed(self) -> bool:
        try:
            return any(p.get("type") == "istio-cni" for p in self.conflist()["plugins"])
        except (OSError, ValueError):
            return False

    def iptables_save(self, pod: str) -> str:
        return self.runner.run(["iptables-save"], netns=self.pods[pod].netns).text

    def istio_rules(self, pod: str) -> list[str]:
        return [
            line
            for line in self.iptables_save(pod).splitlines()
            if re.match(r"-A (ISTIO_\w+|\w+ -j ISTIO_)", line)
        ]

    def probe_set(self) -> dict[str, str]:
        """The node's probe set members; read on a thread of its own (pyroute2 runs its own loop)."""

        def read() -> dict[str, str]:
            with NetlinkIpset(HostProbeConfig(set_prefix=PROBE_PREFIX), netns=self.node.netns) as sets:
                try:
                    return {str(ip): uid for ip, uid in sets.entries().items()}
                except Exception:  # the set does not exist (yet, or any more)
                    return {}

        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            return pool.submit(read).result()

    def marks(self) -> dict[str, str]:
        try:
            doc = json.loads((self.run_dir / "enrolled-pods.json").read_text())
        except (OSError, ValueError):
            return {}
        return {uid: m["value"] for uid, m in doc["pods"].items()}

    async def cni_add(self, pod: str) -> subprocess.CompletedProcess:
        conflist = self.conflist()
        entry = next(p for p in conflist["plugins"] if p["type"] == "istio-cni")
        stdin = dict(
            entry,
            cniVersion=conflist["cniVersion"],
            name=conflist["name"],
            prevResult={
                "cniVersion": "1.0.0",
                "interfaces": [{"name": "eth0"}],
                "ips": [{"address": f"{self.ip(pod)}/24", "interface": 0}],
            },
        )
        env = {
            "PATH": os.environ["PATH"],
            "CNI_COMMAND": "ADD",
            "CNI_CONTAINERID": f"sandbox-{pod}",
            "CNI_NETNS": str(NETNS_RUN_DIR / self.pods[pod].netns),
            "CNI_IFNAME": "eth0",
            "CNI_PATH": str(self.bin_dir),
            "CNI_ARGS": f"IgnoreUnknown=1;K8S_POD_NAMESPACE={NAMESPACE};K8S_POD_NAME={pod};"
            f"K8S_POD_INFRA_CONTAINER_ID=sandbox-{pod}",
        }
        proc = await asyncio.create_subprocess_exec(
            str(self.bin_dir / "istio-cni"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        out, err = await asyncio.wait_for(proc.communicate(json.dumps(stdin).encode()), WAIT_S)
        return subprocess.CompletedProcess([], proc.returncode, out, err)


def http_get(netns: str, path: str, port: int) -> tuple[int, str]:
    """GET from inside the node's netns (where the agent's servers listen)."""
    with netns_socket(netns) as sock:
        sock.settimeout(5)
        sock.connect(("127.0.0.1", port))
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode(errors="replace")


@pytest.fixture(scope="module")
def scenario():
    root = Path(tempfile.mkdtemp(prefix="amcni-", dir="/tmp"))  # short: unix socket paths <= 107 bytes
    try:
        with Fabric(runner=SubprocessRunner(), subnet=RUN_SUBNET, subnet6=None) as fabric:
            sc = Scenario(fabric, root)
            # A process in pb's namespace, so the agent can find it under /proc.
            fabric.spawn(sc.pods["pb"], ["sleep", "600"])
            yield sc
            if sc.agent is not None:
                sc.stop_agent()
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
async def proxies(scenario):
    """A node proxy connected for the duration of one test (ZDS keeps its pods across reconnects)."""
    client = ZdsClient(scenario.zds_socket, scenario.proxies, max_backoff_s=0.2)
    client.start()
    try:
        if scenario.agent is not None:
            await asyncio.wait_for(client.wait_ready(), WAIT_S)  # snapshot taken: adds reach us
        yield scenario.proxies
    finally:
        await client.close(drain=False)


async def test_1_agent_installs_plugin_and_starts(scenario):
    scenario.start_agent()
    await wait_for(
        lambda: (
            scenario.installed()
            and (scenario.run_dir / "pluginevent.sock").exists()
            and scenario.zds_socket.exists()
        ),
        "plugin installed and sockets listening",
    )
    assert (scenario.bin_dir / "istio-cni").stat().st_mode & 0o111
    entry = next(p for p in scenario.conflist()["plugins"] if p["type"] == "istio-cni")
    assert entry["ambient_enabled"] is True and entry["cni_agent_run_dir"] == str(scenario.run_dir)
    assert scenario.conflist()["plugins"][-1]["type"] == "istio-cni"
    assert (
        "ISTIO_POSTRT" in scenario.runner.run(["iptables-save", "-t", "nat"], netns=scenario.node.netns).text
    )
    status, body = await asyncio.to_thread(http_get, scenario.node.netns, "/readyz", 8000)
    assert status == 200, body
    status, body = await asyncio.to_thread(http_get, scenario.node.netns, "/metrics", 15014)
    assert status == 200 and "istio_cni_install_ready 1.0" in body


async def test_2_cni_add_enrolls_pod(scenario, proxies):
    result = await scenario.cni_add("pa")
    assert result.returncode == 0, (result.stdout, result.stderr, scenario.agent_log()[-3000:])
    assert json.loads(result.stdout)["ips"][0]["address"] == f"{scenario.ip('pa')}/24"
    # the installed plugin handed the run to the agent (plugin_handoff.py) rather than deciding itself
    assert "plugin run handed over: ADD of container sandbox-pa, exit 0" in scenario.agent_log()
    rules = scenario.istio_rules("pa")
    assert (
        "-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -p tcp -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15001"
        in rules
    )
    assert any("--to-ports 15006" in r for r in rules)
    pa_inode = os.stat(NETNS_RUN_DIR / scenario.pods["pa"].netns).st_ino
    assert proxies.running[UIDS["pa"]] == pa_inode
    assert scenario.probe_set()[scenario.ip("pa")] == UIDS["pa"]
    assert scenario.marks()[UIDS["pa"]] == "enabled"
    # pb is labeled dataplane-mode=none: left alone.
    assert UIDS["pb"] not in proxies.running and scenario.istio_rules("pb") == []


async def test_3_cni_add_again_is_idempotent(scenario, proxies):
    before = scenario.istio_rules("pa")
    result = await scenario.cni_add("pa")
    assert result.returncode == 0, result.stdout
    assert scenario.istio_rules("pa") == before


async def test_4_label_change_enrolls_running_pod_found_under_proc(scenario, proxies):
    scenario.write_pods(pb_labels={})
    await wait_for(lambda: scenario.marks().get(UIDS["pb"]) == "enabled", "pb enrolled by the informer")
    pb_inode = os.stat(NETNS_RUN_DIR / scenario.pods["pb"].netns).st_ino
    assert proxies.running[UIDS["pb"]] == pb_inode
    assert any("--to-ports 15001" in r for r in scenario.istio_rules("pb"))
    assert scenario.probe_set()[scenario.ip("pb")] == UIDS["pb"]


async def test_5_pod_delete_removes_everything(scenario, proxies):
    scenario.write_pods(pb_labels={}, with_pa=False)
    await wait_for(lambda: UIDS["pa"] not in scenario.marks(), "pa's mark removed")
    await wait_for(lambda: UIDS["pa"] not in proxies.running, "pa's proxy stopped")
    assert scenario.ip("pa") not in scenario.probe_set()
    assert scenario.istio_rules("pa") == []
    assert UIDS["pb"] in proxies.running


async def test_6_unenroll_by_label_removes_rules(scenario, proxies):
    scenario.write_pods(pb_labels={"istio.io/dataplane-mode": "none"}, with_pa=False)
    await wait_for(lambda: UIDS["pb"] not in scenario.marks(), "pb's mark removed")
    await wait_for(lambda: UIDS["pb"] not in proxies.running, "pb's proxy stopped")
    assert scenario.istio_rules("pb") == []
    assert scenario.ip("pb") not in scenario.probe_set()


async def test_7_restart_rebuilds_state_without_duplicates(scenario, proxies):
    scenario.write_pods(pb_labels={}, with_pa=False)
    await wait_for(lambda: scenario.marks().get(UIDS["pb"]) == "enabled", "pb enrolled again")
    rules_before = scenario.istio_rules("pb")

    assert scenario.stop_agent() == 0, scenario.agent_log()[-3000:]
    # A final shutdown (no agent DaemonSet in the store): plugin and host rule are removed,
    # the pod keeps its rules and its node proxy.
    assert not scenario.installed()
    assert (
        "ISTIO_POSTRT"
        not in scenario.runner.run(["iptables-save", "-t", "nat"], netns=scenario.node.netns).text
    )
    assert scenario.istio_rules("pb") == rules_before
    assert UIDS["pb"] in proxies.running

    # A node proxy that connects fresh only learns pb from the new agent's snapshot: an `add`
    # with the netns fd when the agent found it under /proc (a `keep` would start nothing).
    fresh = RecordingProxies()
    client = ZdsClient(scenario.zds_socket, fresh, max_backoff_s=0.2)
    client.start()
    try:
        scenario.start_agent()
        await wait_for(lambda: UIDS["pb"] in fresh.running, "new agent's snapshot reached a fresh node proxy")
    finally:
        await client.close(drain=False)
    pb_inode = os.stat(NETNS_RUN_DIR / scenario.pods["pb"].netns).st_ino
    assert fresh.starts == [(UIDS["pb"], pb_inode)]
    assert UIDS["pb"] in proxies.running
    await wait_for(scenario.installed, "plugin reinstalled")
    await wait_for(lambda: scenario.probe_set().get(scenario.ip("pb")) == UIDS["pb"], "probe set rebuilt")
    assert scenario.istio_rules("pb") == rules_before  # reconciled in place, nothing duplicated
    assert scenario.marks() == {UIDS["pb"]: "enabled"}


async def test_8_upgrade_shutdown_keeps_plugin(scenario):
    (scenario.pods_dir / "agent.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "apps/v1",
                "kind": "DaemonSet",
                "metadata": {"name": "istio-cni-node", "namespace": "istio-system"},
            }
        )
    )
    assert scenario.stop_agent() == 0
    assert scenario.installed()
    assert (
        "ISTIO_POSTRT" in scenario.runner.run(["iptables-save", "-t", "nat"], netns=scenario.node.netns).text
    )
    assert scenario.probe_set()[scenario.ip("pb")] == UIDS["pb"]


async def test_nftables_backend_end_to_end():
    """NATIVE_NFTABLES=true: in-pod tables, the host nft set and rule, removed on a final shutdown."""
    root = Path(tempfile.mkdtemp(prefix="amcni-", dir="/tmp"))
    try:
        with Fabric(runner=SubprocessRunner(), subnet=RUN_SUBNET, subnet6=None) as fabric:
            sc = Scenario(fabric, root, NATIVE_NFTABLES="true", KUBELET_UID="0")
            proxies = RecordingProxies()
            client = ZdsClient(sc.zds_socket, proxies, max_backoff_s=0.2)
            client.start()
            try:
                sc.start_agent()
                await wait_for(
                    lambda: sc.installed() and (sc.run_dir / "pluginevent.sock").exists(), "agent up"
                )
                await asyncio.wait_for(client.wait_ready(), WAIT_S)
                result = await sc.cni_add("pa")
                assert result.returncode == 0, (result.stdout, sc.agent_log()[-3000:])
                tables = sc.runner.run(["nft", "list", "tables"], netns=sc.pods["pa"].netns).text
                assert (
                    "table inet istio-ambient-nat" in tables and "table inet istio-ambient-mangle" in tables
                )
                assert sc.istio_rules("pa") == []  # no iptables rules alongside
                members = sc.runner.run(
                    ["nft", "list", "set", "inet", "istio-ambient-nat", f"{PROBE_PREFIX}-v4"],
                    netns=sc.node.netns,
                ).text
                assert sc.ip("pa") in members
                assert proxies.running[UIDS["pa"]] == os.stat(NETNS_RUN_DIR / sc.pods["pa"].netns).st_ino
                assert sc.stop_agent() == 0
                host = sc.runner.run(["nft", "list", "tables"], netns=sc.node.netns).text
                assert "istio-ambient-nat" not in host
            finally:
                await client.close(drain=False)
                if sc.agent is not None:
                    sc.stop_agent()
    finally:
        shutil.rmtree(root, ignore_errors=True)
