"""`ambient lab down` after `up` was killed (SIGKILL: no teardown ran), half way through its
start and after it was ready: nothing of the lab may remain, no namespace and no process, and
`down` stays a no-op when repeated. A new `up` on the same state directory starts clean.

Counterpart: kind's "delete cluster" after a crashed "create cluster", and the kubelet's
start-up cleanup of sandboxes a previous instance left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ambient_mesh.host.netns import list_netns
from ambient_mesh.lab.cluster import object_file_name
from ambient_mesh.lab.journal import read_journal

pytestmark = pytest.mark.timeout(180)

START_TIMEOUT_S = 90.0
POLICY = """\
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata:
  name: deny-client
  namespace: shop
spec:
  action: DENY
  rules:
  - from:
    - source:
        principals: ["cluster.local/ns/shop/sa/client"]
"""
EXTRA_POD = """\
apiVersion: v1
kind: Pod
metadata: {name: extra, namespace: shop, labels: {app: echo}}
spec:
  nodeName: node-2
  serviceAccountName: echo
  containers: [{name: app, image: ambient-lab/echo}]
"""
POLL_S = 0.05


def lab(state_dir: Path, *args: str, timeout_s: float = 90.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ambient_mesh.cli", "lab", "--state-dir", str(state_dir), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


UP_LOG_TAIL_CHARS = 4000


def up_log(state_dir: Path) -> Path:
    """`lab up`'s own output (its supervisor's events): beside the state directory, which `up`
    empties when it starts."""
    return state_dir.parent / f"{state_dir.name}-up.log"


def start_up(state_dir: Path) -> subprocess.Popen:
    with open(up_log(state_dir), "ab") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ambient_mesh.cli",
                "lab",
                "--state-dir",
                str(state_dir),
                "up",
                "--nodes",
                "2",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def up_tail(state_dir: Path) -> str:
    try:
        text = up_log(state_dir).read_text(errors="replace")[-UP_LOG_TAIL_CHARS:]
    except OSError:
        text = "(no output)"
    return f"\n--- `lab up` output (end) ---\n{text}"


def wait_for(predicate, what: str, up: subprocess.Popen) -> None:
    state_dir = Path(up.args[up.args.index("--state-dir") + 1])
    deadline = time.monotonic() + START_TIMEOUT_S
    while not predicate():
        assert up.poll() is None, f"`lab up` exited with {up.returncode} before {what}" + up_tail(state_dir)
        assert time.monotonic() < deadline, f"timed out waiting for {what}" + up_tail(state_dir)
        time.sleep(POLL_S)


def zc_workloads(state_dir: Path, node: str, *, check: bool = True) -> list[list[str]]:
    """`ambient zc w --node <node>`: the rows of that node proxy's workloads table (without
    `check`, none when the node proxy does not answer)."""
    zc = subprocess.run(
        [sys.executable, "-m", "ambient_mesh", "zc", "w", "--node", node, "--state-dir", str(state_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if zc.returncode != 0 and not check:
        return []
    assert zc.returncode == 0, zc.stdout + zc.stderr
    return [line.split() for line in zc.stdout.splitlines()]


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line or environment names `text` (every lab process carries its state
    directory in one or the other)."""
    found = []
    needle = text.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        for part in ("cmdline", "environ"):
            try:
                if needle in (entry / part).read_bytes():
                    found.append(int(entry.name))
                    break
            except OSError:
                continue
    return found


def assert_nothing_left(runner, state_dir: Path, up_pid: int) -> None:
    prefix = f"am-{up_pid}-"
    assert [ns for ns in list_netns(runner) if ns.startswith(prefix)] == []
    assert not list(Path("/etc/netns").glob(f"{prefix}*"))  # the pods' resolv.conf overrides
    assert processes_mentioning(str(state_dir)) == []
    assert read_journal(state_dir) is None


def kill_and_down(runner, state_dir: Path, up: subprocess.Popen) -> None:
    rec = read_journal(state_dir)
    assert rec is not None and rec.namespaces and rec.processes
    up.send_signal(signal.SIGKILL)
    up.wait(timeout=10)
    # Killed without teardown: the namespaces and the components are still there.
    assert any(ns.startswith(f"am-{up.pid}-") for ns in list_netns(runner))
    assert processes_mentioning(str(state_dir))
    first = lab(state_dir, "down")
    assert first.returncode == 0, first.stderr
    assert "lab is down (removed what it had left:" in first.stdout, first.stdout
    assert_nothing_left(runner, state_dir, up.pid)
    again = lab(state_dir, "down")
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stdout + again.stderr


@pytest.fixture
def state_dir(tmp_path_factory, runner):
    path = tmp_path_factory.mktemp("lab-down")
    yield path
    lab(path, "down")  # whatever a failed test left


def test_down_after_up_was_killed_half_way(runner, state_dir):
    up = start_up(state_dir)
    try:
        # Half way: the control plane runs, the nodes exist, the first node agent is starting.
        wait_for(
            lambda: any(
                name.startswith("agent-") for _, _, name in (read_journal(state_dir) or _empty()).processes
            ),
            "the first node agent to start",
            up,
        )
        assert not (state_dir / "lab.json").exists()  # not ready yet
        kill_and_down(runner, state_dir, up)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def test_down_after_up_was_killed_when_ready_and_a_new_run_starts_clean(runner, state_dir):
    (state_dir / ".ambient-lab").write_text("")
    (state_dir / "objects").mkdir()
    (state_dir / "objects" / "pod-demo-stale.yaml").write_text("kind: Pod\n")  # from an earlier run
    up = start_up(state_dir)
    try:
        wait_for(
            lambda: (
                (state_dir / "lab.json").exists()
                and json.loads((state_dir / "lab.json").read_text())["ready"]
            ),
            "the lab to be ready",
            up,
        )
        assert not (state_dir / "objects" / "pod-demo-stale.yaml").exists()
        # Secrets (issue 25, S3): the node proxy's token 0600, in 0700 directories.
        token = state_dir / "nodes" / "node-1" / "ztunnel.token"
        assert oct(token.stat().st_mode & 0o777) == oct(0o600)
        for d in (state_dir, token.parent, state_dir / "control", state_dir / "nodes" / "node-1" / "run"):
            assert oct(d.stat().st_mode & 0o777) == oct(0o700), d
        status = lab(state_dir, "status", "-o", "json")
        assert status.returncode == 0, status.stderr
        live = json.loads(status.stdout)
        assert live["ready"] and all(
            n["ztunnel"]["ready"] and n["agent"]["ready"] for n in live["nodes"].values()
        )
        assert live["pods"]["shop/client"]["enrolled"] and not live["pods"]["legacy/client"]["enrolled"]
        assert live["not_ready"] == [] and "READY" in lab(state_dir, "status").stdout
        # A second `up` from the same state dir is refused and touches nothing of this lab.
        record = (state_dir / "lab.json").read_bytes()
        second = lab(state_dir, "up", timeout_s=30)
        assert second.returncode == 1 and "already running" in second.stderr, second.stderr
        assert (state_dir / "lab.json").read_bytes() == record
        assert lab(state_dir, "status").returncode == 0
        # `rollout ztunnel`: the `up` supervisor starts node-1's new proxy beside the old one,
        # then the old one drains; status then shows the new pid, ready, on the surge ports.
        rolled = lab(state_dir, "rollout", "ztunnel", "--node", "node-1")
        assert rolled.returncode == 0 and "serves every pod" in rolled.stdout, rolled.stdout + rolled.stderr
        after = json.loads(lab(state_dir, "status", "-o", "json").stdout)
        proxy = after["nodes"]["node-1"]["ztunnel"]
        assert proxy["pid"] != live["nodes"]["node-1"]["ztunnel"]["pid"] and proxy["ready"], proxy
        assert after["nodes"]["node-1"]["admin"] == "127.0.0.1:15100" and after["ready"], after["not_ready"]
        live = after
        # Nodes are listed, with -o wide and label selectors.
        nodes = lab(state_dir, "get", "nodes").stdout.splitlines()
        assert [line.split()[:2] for line in nodes[1:]] == [["node-1", "Ready"], ["node-2", "Ready"]], nodes
        wide = lab(state_dir, "get", "nodes", "-o", "wide", "-l", "kubernetes.io/hostname=node-2").stdout
        assert wide.splitlines()[0].split()[-1] == "LABELS" and len(wide.splitlines()) == 2, wide
        pods = lab(state_dir, "get", "pods", "-A", "-l", "app=echo", "-o", "wide").stdout.splitlines()
        assert sorted(line.split()[1] for line in pods[1:]) == ["echo-1", "echo-2"], pods
        # kubectl-like verbs against the running lab: a typo is refused with its line; a Pod
        # applied gets a sandbox from the lab's kubelet, is enrolled and reachable; deleted, it goes.
        typo = state_dir.parent / f"{state_dir.name}-typo.yaml"
        typo.write_text(POLICY.replace("principals:", "principal:"))
        refused = lab(state_dir, "apply", "-f", str(typo))
        assert (
            refused.returncode == 1
            and f"{typo}:11:9:" in refused.stderr
            and "source.principal" in refused.stderr
        )
        extra = state_dir.parent / f"{state_dir.name}-pod.yaml"
        extra.write_text(EXTRA_POD)
        applied = lab(state_dir, "apply", "-f", str(extra))
        assert applied.returncode == 0 and "pod/extra created" in applied.stdout, applied.stderr
        # written with its uid, as the API server creates a Pod: the node agent never sees it
        # without the uid the lab's kubelet runs the sandbox under. (The object's own file: a
        # glob also caught the lab's kubelet's atomic_write temp file beside it, mid-update.)
        written = state_dir / "objects" / object_file_name(yaml.safe_load(EXTRA_POD))
        assert yaml.safe_load(written.read_text())["metadata"]["uid"], written.read_text()

        def extra_pod() -> dict | None:
            pods = json.loads(lab(state_dir, "status", "-o", "json").stdout)["pods"]
            return pods.get("shop/extra")

        wait_for(lambda: (extra_pod() or {}).get("enrolled"), "the applied pod to be enrolled", up)
        pod = extra_pod()
        # Enrolled is not yet reachable: the destination's node proxy turns away a connection
        # to a pod it has no workload for ("no local workload has address"), and the workload
        # comes by xDS once the control plane has read the pod's status. So, as Lab.add_pod
        # does with its wait: until both node proxies list it (`zc w`, their config_dump).
        wait_for(
            lambda: all(
                ["shop", "extra", pod["ip"], "node-2"]
                in [r[:4] for r in zc_workloads(state_dir, node, check=False)]
                for node in ("node-1", "node-2")
            ),
            "both node proxies to learn the applied pod from xDS",
            up,
        )
        assert pod["node"] == "node-2" and pod["services"] == ["echo"]
        call = lab(
            state_dir, "exec", "shop/client", "--", "curl", "-s", "-m", "5", f"http://{pod['ip']}:8080/"
        )
        assert "Hostname=shop/extra" in call.stdout, call.stdout + call.stderr
        assert lab(state_dir, "delete", "-f", str(extra)).returncode == 0
        wait_for(lambda: extra_pod() is None, "the deleted pod to go", up)
        assert pod["netns"] not in list_netns(runner)
        # ztunnel-config picks a lab node's proxy by node name; logs by component and node.
        rows = zc_workloads(state_dir, "node-2")
        assert ["shop", "echo-2", live["pods"]["shop/echo-2"]["ip"], "node-2"] in [r[:4] for r in rows], rows
        logs = lab(state_dir, "logs", "ztunnel", "--node", "node-2", "--tail", "50")
        assert (
            logs.returncode == 0
            and "ambient lab: starting ztunnel-node-2"
            in lab(state_dir, "logs", "ztunnel", "--node", "node-2").stdout
        )
        # The supervisor: a crashed node proxy is started again and status says so.
        os.kill(live["nodes"]["node-1"]["ztunnel"]["pid"], signal.SIGKILL)

        def restarted() -> bool:
            now = json.loads(lab(state_dir, "status", "-o", "json").stdout)["nodes"]["node-1"]["ztunnel"]
            return now["restarts"] == 1 and now["ready"]

        wait_for(restarted, "node-1's node proxy to be restarted and ready", up)
        text = lab(state_dir, "status").stdout
        assert "running (1 restarts) yes" in " ".join(text.split()), text
        kill_and_down(runner, state_dir, up)
        after = lab(state_dir, "status")
        assert after.returncode == 1 and "no lab is running" in after.stderr
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def _empty():
    from ambient_mesh.lab.journal import Recorded

    return Recorded()
