"""Issue 25's attacks on the node's local surfaces, each refused (root; tier 3).

Every attack is made as an unprivileged local user (`amattacker`, created here when missing and
removed again if so) through `setpriv`, or without credentials, and every test checks the
victim's side too: nothing of the attacker's choosing is deleted, killed or moved.

- S1 a journal planted in a lab state directory the attacker owns (or can write) listing a root
  process, a namespace and a root directory: `ambient lab down` and `up` refuse the directory by
  path, owner and mode; root's own journal listing things that are not the lab's does not get
  them killed or deleted either.
- S2 the node agent's sockets: 0600 in a 0700 run dir (the attacker cannot connect), and when
  loosened by hand, closed unread for a peer that is not root; a run dir others can write is
  refused at start; a plugin run cannot name the caller's own netns whatever it claims, and an
  enrolled pod is not moved into the attacker's netns.
- S3 the node proxy's token, the CA key, the token key and the pod records cannot be read.
- S4/S5/S6/JWT against a real `ambient control`: 3 x 150 MB unauthenticated CA requests leave
  its RSS where it was; the plaintext port has no CA; forged tokens (alg none, HS256 with the
  public key) and weak CSR keys are refused with the reason.
- Parsers: nested JSON on the plugin's stdin gets a CNI error object.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from ambient_mesh.cni.cni_server import CniPluginServer
from ambient_mesh.cni.dataplane import DataplaneError, DataplaneSettings, MeshDataplane
from ambient_mesh.cni.enablement import DEFAULT_ENABLEMENT_SELECTORS
from ambient_mesh.cni.pods import DirectoryPodSource, EnrollmentState
from ambient_mesh.cni.sandbox import NetnsGuard, netns_key
from ambient_mesh.control.plane import ControlPlaneConfig, build, mint_token
from ambient_mesh.control.tokens import load_or_create_issuer
from ambient_mesh.host.private import UnsafePathError, private_dir, write_private
from ambient_mesh.lab.journal import Journal, process_cmdline, process_start_ticks
from ambient_mesh.zds.server import ZdsServer
from tests.helpers.cni_fakes import (
    FakeLocator,
    FakeMarker,
    FakeProbeSet,
    FakeZtunnel,
    OrderedRunner,
    pod,
)
from tests.helpers.weak_keys import REFUSED_KEYS, csr_pem
from tests.integration.cni_plugin_run import POD_YAML

pytestmark = pytest.mark.timeout(300)

ATTACKER = "amattacker"
ATTACKER_SCRIPT = Path(__file__).with_name("surface_attacker.py")
ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 30.0
# What three refused 150 MB requests may add to the control plane's peak RSS (it was +757 MiB).
OVERSIZE_RSS_BUDGET_MIB = 64


# -- the attacker and the victims -------------------------------------------------------------------


@pytest.fixture(scope="module")
def attacker() -> Iterator[pwd.struct_passwd]:
    created = False
    try:
        pw = pwd.getpwnam(ATTACKER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", ATTACKER],
            check=True,
        )
        created = True
        pw = pwd.getpwnam(ATTACKER)
    yield pw
    if created:
        subprocess.run(["userdel", ATTACKER], check=False)


def as_attacker(pw: pwd.struct_passwd, argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
        **kw,  # type: ignore[arg-type]
    )


def attack(pw: pwd.struct_passwd, *args: str) -> dict[str, object]:
    done = as_attacker(pw, [sys.executable, str(ATTACKER_SCRIPT), *args])
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture
def scratch() -> Iterator[Path]:
    # Short (unix socket paths), and the attacker may enter it: only what is inside is private.
    path = Path(tempfile.mkdtemp(prefix="amsurf-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Victims:
    """A root process, a namespace and a root directory that an attacker names as the lab's."""

    def __init__(self, runner_pid: int) -> None:
        self.netns = f"amvictim-{runner_pid}"
        subprocess.run(["ip", "netns", "add", self.netns], check=True)
        self.process = subprocess.Popen(["sleep", "300"])
        self.dir = Path(tempfile.mkdtemp(prefix="amvictim-", dir="/tmp"))
        (self.dir / "data").write_text("precious")

    def journal_lines(self) -> list[dict[str, object]]:
        pid = self.process.pid
        start, argv = process_start_ticks(pid), list(process_cmdline(pid) or ())
        return [
            {"lab": pid, "start": start, "argv": argv},
            {"netns": self.netns},
            {"pid": pid, "start": start, "name": "agent-node-1", "argv": argv},
            {"path": str(self.dir)},
        ]

    def assert_untouched(self) -> None:
        assert self.process.poll() is None, "the attacker's journal got a root process killed"
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert self.netns in names, "the attacker's journal got a namespace deleted"
        assert (self.dir / "data").read_text() == "precious", "the attacker's journal got a dir removed"

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        subprocess.run(["ip", "netns", "delete", self.netns], check=False)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def victims() -> Iterator[Victims]:
    v = Victims(os.getpid())
    try:
        yield v
    finally:
        v.close()


def lab_cli(state_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ambient_mesh.cli", "lab", "--state-dir", str(state_dir), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


# -- S1: the lab's state directory and journal ---------------------------------------------------------


def test_a_journal_planted_in_an_attackers_state_dir_is_refused(attacker, scratch, victims):
    home = scratch / "attacker"  # the attacker's own corner of /tmp
    home.mkdir()
    os.chown(home, attacker.pw_uid, attacker.pw_gid)
    state = home / "lab"
    lines = "\n".join(json.dumps(line) for line in victims.journal_lines())
    plant = (
        f"import os; os.mkdir({str(state)!r}); "
        f"open({str(state / '.ambient-lab')!r}, 'w').write(''); "
        f"open({str(state / 'journal.jsonl')!r}, 'w').write({lines!r} + '\\n')"
    )
    assert as_attacker(attacker, [sys.executable, "-c", plant]).returncode == 0
    mode = oct(state.stat().st_mode & 0o777)[2:]
    for action in (["down"], ["status"], ["up"]):
        done = lab_cli(state, *action)
        assert done.returncode != 0, (action, done.stdout, done.stderr)
        assert f"{state}: is owned by uid {attacker.pw_uid} with mode 0{mode}" in done.stderr, done.stderr
    victims.assert_untouched()


def test_a_journal_in_a_root_dir_others_can_write_is_refused(attacker, scratch, victims):
    state = scratch / "lab"
    state.mkdir(mode=0o700)
    state.chmod(0o777)  # root's, but anyone may write: the old /tmp default's weakness
    lines = "\n".join(json.dumps(line) for line in victims.journal_lines())
    plant = f"open({str(state / 'journal.jsonl')!r}, 'w').write({lines!r} + '\\n')"
    assert as_attacker(attacker, [sys.executable, "-c", plant]).returncode == 0
    done = lab_cli(state, "down")
    assert done.returncode != 0 and f"{state}: is owned by uid 0 with mode 0777" in done.stderr, done.stderr
    victims.assert_untouched()


def test_roots_own_journal_is_believed_only_where_it_proves_itself(scratch, victims):
    state = private_dir(scratch / "lab")
    (state / ".ambient-lab").write_text("")
    journal = Journal(state)
    journal.lab(victims.process.pid + 1_000_000)  # a lab that is gone
    journal.netns(victims.netns)  # not named with the lab's prefix
    journal.process(victims.process.pid, "agent-node-1", ["ambient", "cni-agent"])  # another program
    journal.path_created(victims.dir)  # outside the state directory
    journal.close()
    done = lab_cli(state, "down")
    assert done.returncode == 0, done.stderr
    victims.assert_untouched()
    said = done.stdout + done.stderr
    assert f"not deleting namespace {victims.netns!r}" in said and f"not removing {victims.dir}" in said


# -- S2: the node agent's sockets and the netns a CNI add may name -------------------------------------


class RecordingAdd:
    def __init__(self) -> None:
        self.events: list[object] = []

    async def __call__(self, event: object) -> str | None:
        self.events.append(event)
        return None


async def start_agent_sockets(
    run: Path,
) -> tuple[CniPluginServer, ZdsServer, RecordingAdd, DirectoryPodSource]:
    pods = run.parent / "pods"
    pods.mkdir(exist_ok=True)
    (pods / "objects.yaml").write_text(POD_YAML)
    source = DirectoryPodSource(pods, node_name="", state_file=run / "state.json")
    await source.start()
    adds = RecordingAdd()
    server = CniPluginServer(
        run / "pluginevent.sock", run / "log.sock", adds, run_socket=run / "pluginrun.sock", pods=source
    )
    zds = ZdsServer(run / "zt" / "ztunnel.sock", pods=None)  # type: ignore[arg-type]
    await server.start()
    await zds.start()
    return server, zds, adds, source


ADD_EVENT = json.dumps({"Netns": "/proc/1/ns/net", "PodName": "web-0", "PodNamespace": "apps", "IPs": []})
HTTP_ADD = (
    "POST /cmdadd HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    f"Content-Length: {len(ADD_EVENT)}\r\n\r\n{ADD_EVENT}"
)


async def test_the_agents_sockets_refuse_a_local_user(attacker, scratch):
    run = scratch / "run"
    server, zds, adds, _ = await start_agent_sockets(run)
    try:
        sockets = [run / "pluginevent.sock", run / "pluginrun.sock", run / "zt" / "ztunnel.sock"]
        assert oct(run.stat().st_mode & 0o777) == oct(0o700)
        assert all(oct(p.stat().st_mode & 0o777) == oct(0o600) for p in sockets)
        # As started: the attacker cannot even connect.
        for path in sockets:
            kind = ["--seqpacket"] if path.name == "ztunnel.sock" else []
            result = await asyncio.to_thread(attack, attacker, "connect", str(path), *kind)
            assert result == {"connected": False, "error": "Permission denied"}, (path, result)
        # Loosened by hand (a careless chmod): the peer check closes them unread.
        for d in (run, run / "zt"):
            d.chmod(0o755)
        for path in sockets:
            path.chmod(0o666)
        run_request = json.dumps(
            {
                "env": {"CNI_COMMAND": "ADD", "CNI_NETNS": "/proc/1/ns/net", "CNI_CONTAINERID": "c"},
                "stdin": "{}",
                "netns_is_own": False,
            }
        )
        event = await asyncio.to_thread(attack, attacker, "connect", str(sockets[0]), "--send", HTTP_ADD)
        run_reply = await asyncio.to_thread(
            attack, attacker, "connect", str(sockets[1]), "--send", run_request
        )
        zds_reply = await asyncio.to_thread(attack, attacker, "connect", str(sockets[2]), "--seqpacket")
        assert event["received"] == "" and run_reply["received"] == "" and zds_reply["received"] == ""
        assert adds.events == [] and server.plugin_runs == 0 and server.refused_peers == 2
        assert zds.refused == 1 and zds.accepted == 0
    finally:
        await server.stop()
        await zds.stop()


async def test_a_run_dir_others_can_write_is_refused_at_start(scratch):
    run = scratch / "run"
    run.mkdir()
    run.chmod(0o777)
    server = CniPluginServer(run / "pluginevent.sock", None, RecordingAdd())
    with pytest.raises(UnsafePathError, match=f"{run}: is owned by uid 0 with mode 0777"):
        await server.start()
    with pytest.raises(UnsafePathError, match="mode 0777"):
        await ZdsServer(run / "ztunnel.sock", pods=None).start()  # type: ignore[arg-type]
    assert list(run.iterdir()) == []


def raw_exchange(path: Path, data: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(str(path))
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


async def test_a_plugin_run_cannot_name_the_callers_own_netns_whatever_it_claims(scratch):
    run = scratch / "run"
    server, zds, adds, _ = await start_agent_sockets(run)
    try:
        stdin = json.dumps(
            {
                "cniVersion": "1.0.0",
                "name": "k8s-pod-network",
                "type": "istio-cni",
                "cni_agent_run_dir": str(run),
                "ambient_enabled": True,
                "enablement_selectors": [sel.to_json() for sel in DEFAULT_ENABLEMENT_SELECTORS],
                "prevResult": {"cniVersion": "1.0.0", "ips": [{"address": "10.244.1.5/24", "interface": 0}]},
            }
        )
        request = {
            "env": {
                "CNI_COMMAND": "ADD",
                "CNI_CONTAINERID": "c0ffee",
                "CNI_NETNS": f"/proc/{os.getpid()}/ns/net",  # the caller's own: this process
                "CNI_IFNAME": "eth0",
                "CNI_PATH": "/opt/cni/bin",
                "CNI_ARGS": "IgnoreUnknown=1;K8S_POD_NAMESPACE=apps;K8S_POD_NAME=web-0",
            },
            "stdin": stdin,
            "netns_is_own": False,  # the claim the agent used to believe
        }
        reply = json.loads(
            await asyncio.to_thread(raw_exchange, run / "pluginrun.sock", json.dumps(request).encode())
        )
        assert reply["exit_code"] == 1 and "should not be the same" in reply["stdout"], reply
        assert adds.events == []
    finally:
        await server.stop()
        await zds.stop()


@pytest.fixture
def pod_sandbox() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    name = f"amsandbox-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    pause = subprocess.Popen(["ip", "netns", "exec", name, "sleep", "300"])
    try:
        deadline = time.monotonic() + 10
        while netns_key(f"/proc/{pause.pid}/ns/net") != netns_key(f"/run/netns/{name}"):
            assert time.monotonic() < deadline, "the sandbox's process did not enter its netns"
            time.sleep(0.02)
        yield f"/run/netns/{name}", pause
    finally:
        pause.kill()
        pause.wait()
        subprocess.run(["ip", "netns", "delete", name], check=False)


@pytest.fixture
def attackers_netns(attacker) -> Iterator[str]:
    proc = subprocess.Popen(
        [
            "setpriv",
            f"--reuid={attacker.pw_uid}",
            f"--regid={attacker.pw_gid}",
            "--clear-groups",
            "unshare",
            "-rn",
            "sleep",
            "300",
        ]
    )
    try:
        deadline = time.monotonic() + 10
        while netns_key(f"/proc/{proc.pid}/ns/net") == netns_key("/proc/self/ns/net"):
            if proc.poll() is not None:
                pytest.skip("unprivileged user namespaces are disabled here: no attacker netns to name")
            assert time.monotonic() < deadline, "unshare did not make a netns"
            time.sleep(0.02)
        yield f"/proc/{proc.pid}/ns/net"
    finally:
        proc.kill()
        proc.wait()


async def test_an_enrolled_pod_is_not_moved_into_the_attackers_netns(pod_sandbox, attackers_netns, scratch):
    sandbox, pause = pod_sandbox
    log: list[tuple] = []
    dataplane = MeshDataplane(
        DataplaneSettings(reconcile_on_start=False),
        runner=OrderedRunner(log),
        probe_set=FakeProbeSet(log),
        ztunnel=FakeZtunnel(log),
        marker=FakeMarker(log),
        locator=FakeLocator({}),
    )
    try:
        web = pod()
        await dataplane.add_pod_to_mesh(web, ["10.0.0.5"], sandbox)
        enrolled = dataplane.cache.get(web.uid).netns
        assert enrolled is not None and enrolled.key == netns_key(sandbox)
        calls = len(dataplane.runner.calls)
        with pytest.raises(DataplaneError, match="whose sandbox still runs; refusing to move it"):
            await dataplane.add_pod_to_mesh(web, ["10.9.9.9"], attackers_netns)
        # Nothing moved: same netns handle, same IPs, no rules written anywhere.
        entry = dataplane.cache.get(web.uid)
        assert entry.netns is enrolled and enrolled.fd >= 0 and entry.ips == ("10.0.0.5",)
        assert len(dataplane.runner.calls) == calls
        # Neither the host's netns nor a plain file is a pod sandbox's.
        for path, why in (("/proc/self/ns/net", "node agent's own"), (str(scratch), "not a namespace file")):
            with pytest.raises(DataplaneError, match=why):
                await dataplane.add_pod_to_mesh(pod(uid="uid-2"), ["10.0.0.6"], path)
        # Once the sandbox is gone (kubelet recreates it), the pod's new netns is taken.
        pause.kill()
        pause.wait()
        assert NetnsGuard().move_refusal(enrolled.key, attackers_netns, "demo/web") is None
    finally:
        dataplane.close()


# -- S3: secrets on disk -------------------------------------------------------------------------------


def test_tokens_keys_and_pod_records_cannot_be_read_by_a_local_user(attacker, scratch):
    control = scratch / "control"
    build(ControlPlaneConfig(directory=scratch, state_dir=control))
    load_or_create_issuer(control / "token-key.pem")
    node = private_dir(scratch / "nodes" / "node-1")
    token = node / "ztunnel.token"
    write_private(token, mint_token(control, account=("istio-system", "ztunnel"), node="node-1").encode())
    records = EnrollmentState(private_dir(scratch / "run") / "state.json")
    records.set(pod(), "enabled")
    secrets = [
        control / "token-key.pem",
        control / "cacerts" / "ca-key.pem",
        token,
        scratch / "run" / "state.json",
    ]
    for path in secrets:
        assert oct(path.stat().st_mode & 0o777) == oct(0o600), path
        assert oct(path.parent.stat().st_mode & 0o777) == oct(0o700), path.parent
        done = as_attacker(attacker, ["cat", str(path)])
        assert done.returncode != 0 and "Permission denied" in done.stderr, (path, done.stdout[:40])


# -- S4, S5, S6 and the JWTs against a running control plane --------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int) -> tuple[float, float]:
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


@pytest.fixture
def control_plane(scratch) -> Iterator[tuple[int, int, Path, subprocess.Popen[bytes]]]:
    tls, plain = free_port(), free_port()
    (scratch / "cfg").mkdir()
    state = scratch / "state"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ambient_mesh",
            "control",
            "--dir",
            str(scratch / "cfg"),
            "--state-dir",
            str(state),
            "--listen",
            f"127.0.0.1:{tls}",
            "--plaintext-listen",
            f"127.0.0.1:{plain}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                with socket.create_connection(("127.0.0.1", tls), timeout=0.2):
                    break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "the control plane did not start"
                time.sleep(0.1)
        # The attacker may read the root (public, as istio-ca-root-cert is): a copy outside the state.
        public = scratch / "root-cert.pem"
        shutil.copy(state / "root-cert.pem", public)
        public.chmod(0o644)
        yield tls, plain, state, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def test_the_control_plane_refuses_oversized_and_forged_requests(attacker, scratch, control_plane):
    tls, plain, state, proc = control_plane
    root = str(scratch / "root-cert.pem")
    time.sleep(1.0)
    before, _ = rss_mib(proc.pid)
    Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # VmHWM from here
    oversize = attack(attacker, "ca-oversize", str(tls), root, "150", "3")
    after, peak = rss_mib(proc.pid)
    assert all(s.startswith("RESOURCE_EXHAUSTED") for s in oversize["statuses"]), oversize
    assert peak - before < OVERSIZE_RSS_BUDGET_MIB, (before, peak, after)

    token = mint_token(state, account=("ns1", "sa1"), node=None)
    # S5: no CA on the plaintext port, even with a valid token.
    assert attack(attacker, "ca-token", str(plain), root, token, "--plaintext")["status"].startswith(
        "UNIMPLEMENTED"
    )

    # JWTs: alg none, and HS256 keyed with the verifier's public key.
    head, claims, _ = token.split(".")
    none = f"{b64(json.dumps({'alg': 'none'}).encode())}.{claims}."
    public_pem = load_or_create_issuer(state / "token-key.pem").public_key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    signing_input = f"{b64(json.dumps({'alg': 'HS256'}).encode())}.{claims}"
    hs256 = f"{signing_input}.{b64(hmac.new(public_pem, signing_input.encode(), hashlib.sha256).digest())}"
    for forged, alg in ((none, "'none'"), (hs256, "'HS256'")):
        status = attack(attacker, "ca-token", str(tls), root, forged)["status"]
        assert status.startswith("UNAUTHENTICATED") and f"alg {alg}" in status, status

    # S6: weak CSR keys, with a valid token.
    for name, (make, reason) in REFUSED_KEYS.items():
        csr = scratch / f"{name}.csr"
        csr.write_bytes(csr_pem(make()))  # type: ignore[no-untyped-call]
        csr.chmod(0o644)
        status = attack(attacker, "ca-token", str(tls), root, token, str(csr))["status"]
        assert status.startswith("INVALID_ARGUMENT") and reason in status, (name, status)


# -- parsers ---------------------------------------------------------------------------------------------


def test_nested_json_on_the_plugins_stdin_gets_a_cni_error(attacker):
    env = {
        "CNI_COMMAND": "ADD",
        "CNI_CONTAINERID": "c0ffee",
        "CNI_NETNS": "/var/run/netns/x",
        "CNI_IFNAME": "eth0",
        "CNI_PATH": "/opt/cni/bin",
        "PATH": "/usr/bin:/bin",
    }
    done = as_attacker(
        attacker, [sys.executable, "-m", "ambient_mesh.cni.plugin_handoff"], input="[" * 100_000, env=env
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-500:]
    assert json.loads(done.stdout)["code"] == 6
