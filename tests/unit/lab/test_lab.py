"""The lab's bookkeeping without namespaces: input validation before anything starts, the
journal `down` works from, the clean state directory, the supervisor's backoff, status tables."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from ambient_mesh.errors import AmbientError, ConfigError
from ambient_mesh.host.commands import RecordingRunner
from ambient_mesh.host.private import UnsafePathError
from ambient_mesh.lab import cli as lab_cli
from ambient_mesh.lab.cluster import parse_pod_spec
from ambient_mesh.lab.journal import (
    MARKER_FILE,
    Journal,
    prepare_state_dir,
    process_cmdline,
    process_start_ticks,
    proven_process,
    read_journal,
    same_process,
    sweep,
)
from ambient_mesh.lab.lab import RESTART_BACKOFF_FIRST_S, Lab, LabConfig, Program
from ambient_mesh.lab.status import headline, live_status, status_tables
from ambient_mesh.lab.topology import MAX_LAB_NODES
from ambient_mesh.ztunnel_config import Table, plain_table, render_tables


def test_too_many_nodes_is_refused_before_anything_starts(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        lab_cli.main(["--state-dir", str(tmp_path / "s"), "up", "--nodes", "300"])
    assert exc.value.code == 2
    assert f"300: the lab runs 1 to {MAX_LAB_NODES} nodes" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    ("nodes", "pods", "message"),
    [
        ((), (), "0 nodes"),
        (("node-1", "node-1"), (), "repeat"),
        (("node-1",), ("node-2:demo/a",), "not one of node-1"),
        (("node-1",), ("node-1:demo/a", "node-1:demo/a"), "listed twice"),
        (("Node_1",), (), "DNS-1123"),
    ],
)
def test_lab_config_is_validated_before_the_state_dir_is_touched(tmp_path, nodes, pods, message):
    config = LabConfig(state_dir=tmp_path / "s", nodes=nodes, pods=tuple(parse_pod_spec(p) for p in pods))
    runner = RecordingRunner()
    with pytest.raises(ConfigError, match=message):
        Lab(config, runner=runner).start()
    assert runner.calls == [] and not (tmp_path / "s").exists()


def test_journal_records_and_reads_back(tmp_path):
    j = Journal(tmp_path)
    j.lab(os.getpid())
    j.netns("am-1-1-net")
    j.process(os.getpid(), "control", process_cmdline(os.getpid()) or ())
    j.path_created(tmp_path / "etc")
    j.close()
    with open(tmp_path / "journal.jsonl", "a") as f:
        f.write('{"netns": "am-1-1-no')  # cut short by a crash mid-write: skipped
    rec = read_journal(tmp_path)
    assert rec.lab_pid == os.getpid() and rec.lab_alive
    assert rec.namespaces == ["am-1-1-net"]
    assert rec.processes == [(os.getpid(), process_start_ticks(os.getpid()), "control")]
    assert rec.paths == [tmp_path / "etc"]
    assert read_journal(tmp_path / "nothing") is None


def test_a_reused_pid_is_not_the_recorded_process():
    ticks = process_start_ticks(os.getpid())
    assert same_process(os.getpid(), ticks)
    assert not same_process(os.getpid(), ticks + 1)
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True
    )
    assert not same_process(int(done.stdout), None)


def test_a_process_is_proven_by_pid_start_time_and_command_line():
    me, ticks, argv = os.getpid(), process_start_ticks(os.getpid()), process_cmdline(os.getpid())
    assert argv and proven_process(me, ticks, argv)
    assert proven_process(me, ticks, argv[4:]) == (argv[:3] == ("ip", "netns", "exec"))
    assert not proven_process(me, ticks, ("sleep", "60"))  # same pid and start, another program
    assert not proven_process(me, (ticks or 0) + 1, argv)  # a reused pid
    assert not proven_process(me, None, argv) and not proven_process(me, ticks, None)


def test_sweep_believes_the_journal_only_as_far_as_it_proves_itself(tmp_path):
    """Root's own journal with entries that are not the lab's: a live process recorded with
    another command line, a namespace without the lab's prefix, paths outside the state dir."""
    prepare_state_dir(tmp_path / "lab", RecordingRunner(), say=print)
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "data").write_text("keep")
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        j = Journal(tmp_path / "lab")
        j.lab(os.getpid() + 100_000)  # no such process: nothing to stop
        j.netns("victim-ns")
        j.process(decoy.pid, "agent-node-1", ["ambient", "cni-agent"])
        j.path_created(outside)
        j.path_created(tmp_path / "lab" / ".." / "precious")
        j.close()
        runner = RecordingRunner()
        runner.respond(["ip", "netns", "list"], stdout="victim-ns\n")
        said: list[str] = []
        report = sweep(tmp_path / "lab", runner, say=said.append)
        assert report is not None and report.processes == () and report.namespaces == ()
        assert decoy.poll() is None and (outside / "data").read_text() == "keep"
        assert not any("delete" in " ".join(c.argv) for c in runner.calls)
        assert any("not deleting namespace 'victim-ns'" in line for line in said)
        assert any(f"not killing pid {decoy.pid}" in line for line in said)
        assert sum("outside the state directory" in line for line in said) == 2
    finally:
        decoy.kill()
        decoy.wait()


def test_a_state_dir_others_can_write_is_refused_and_its_journal_not_read(tmp_path):
    lab_dir = tmp_path / "lab"
    prepare_state_dir(lab_dir, RecordingRunner(), say=print)
    assert oct(lab_dir.stat().st_mode & 0o777) == oct(0o700)
    Journal(lab_dir).close()
    assert oct((lab_dir / "journal.jsonl").stat().st_mode & 0o777) == oct(0o600)
    lab_dir.chmod(0o777)
    for action in (
        lambda: read_journal(lab_dir),
        lambda: prepare_state_dir(lab_dir, RecordingRunner(), say=print),
    ):
        with pytest.raises(
            UnsafePathError, match=rf"{lab_dir}: is owned by uid {os.geteuid()} with mode 0777"
        ):
            action()
    lab_dir.chmod(0o700)
    (lab_dir / "journal.jsonl").chmod(0o666)
    with pytest.raises(UnsafePathError, match="a lab journal is a regular file"):
        read_journal(lab_dir)


def test_state_dir_is_emptied_only_when_it_is_a_labs(tmp_path):
    say = []
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep")
    with pytest.raises(ConfigError, match="not a lab's state directory"):
        prepare_state_dir(foreign, RecordingRunner(), say=say.append)
    assert (foreign / "precious.txt").exists()
    lab_dir = tmp_path / "lab"
    prepare_state_dir(lab_dir, RecordingRunner(), say=say.append)
    (lab_dir / "objects").mkdir()
    (lab_dir / "objects" / "pod-old.yaml").write_text("stale")
    prepare_state_dir(lab_dir, RecordingRunner(), say=say.append)
    assert sorted(p.name for p in lab_dir.iterdir()) == [MARKER_FILE]


def running_child() -> subprocess.Popen[bytes]:
    """A child that has exec'd: the journal records a lab's command line from /proc, and a child
    read before its exec still shows pytest's (then it is not proven the lab, and not refused)."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"], stdout=subprocess.PIPE
    )
    assert child.stdout is not None and child.stdout.readline() == b"up\n"
    child.stdout.close()  # it writes nothing more
    return child


def test_state_dir_of_a_running_lab_is_refused(tmp_path):
    prepare_state_dir(tmp_path, RecordingRunner(), say=print)
    child = running_child()
    try:
        j = Journal(tmp_path)
        j.lab(child.pid)
        j.close()
        with pytest.raises(AmbientError, match=f"already running .*pid {child.pid}"):
            prepare_state_dir(tmp_path, RecordingRunner(), say=print)
    finally:
        child.kill()
        child.wait()


def test_supervisor_restarts_with_doubling_backoff(tmp_path):
    config = LabConfig(state_dir=tmp_path)
    lab = Lab(config, runner=RecordingRunner())
    lab.logs_dir.mkdir(parents=True)
    starts = []

    def start():
        process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
        process.wait()
        starts.append(process)
        program = Program(
            name="ztunnel-node-1", netns="x", log=tmp_path / "log", process=process, started_at=0.0
        )
        lab._supervised["ztunnel-node-1"] = program
        return program

    lab._restart_fns["ztunnel-node-1"] = start
    start()
    assert lab.supervise(now=100.0) == [
        f"ztunnel-node-1 exited with code 3; restarting in {RESTART_BACKOFF_FIRST_S:.0f}s"
    ]
    assert lab.supervise(now=100.5) == []  # still backing off
    assert lab.supervise(now=100.0 + RESTART_BACKOFF_FIRST_S) == ["ztunnel-node-1 restarted (restart 1)"]
    assert len(starts) == 2 and lab.restarts["ztunnel-node-1"] == 1
    events = lab.supervise(now=200.0)
    assert events == [f"ztunnel-node-1 exited with code 3; restarting in {2 * RESTART_BACKOFF_FIRST_S:.0f}s"]
    record = json.loads((tmp_path / "lab.json").read_text())
    assert record["nodes"] == {} and record["ready"] is False


def test_a_pod_applied_while_the_kubelet_pass_runs_is_started_by_the_next_pass(tmp_path, monkeypatch):
    lab = Lab(LabConfig(state_dir=tmp_path), runner=RecordingRunner())
    lab.objects_dir.mkdir(parents=True)
    lab.logs_dir.mkdir(parents=True)
    lab.nodes["node-2"] = None  # type: ignore[assignment]  # only its name is looked at
    lab.pods["shop/old"] = None  # type: ignore[assignment]  # its object is gone: the pass deletes it
    pending = lab.objects_dir / "pod-shop-extra.yaml.tmp.abc123"  # `apply`'s atomic_write, mid-way
    pending.write_text(
        "apiVersion: v1\nkind: Pod\nmetadata: {name: extra, namespace: shop, uid: u-1}\n"
        "spec: {nodeName: node-2, serviceAccountName: echo, containers: [{name: app}]}\n"
    )
    added = []

    def delete_pod(key):
        del lab.pods[key]
        pending.replace(lab.objects_dir / "pod-shop-extra.yaml")  # the apply lands mid-pass

    def add_pod(spec, *, wait=True):
        added.append(spec.key)
        lab.pods[spec.key] = type("Pod", (), {"ip": "10.244.2.12"})()

    monkeypatch.setattr(lab, "delete_pod", delete_pod)
    monkeypatch.setattr(lab, "add_pod", add_pod)
    assert lab.reconcile_pods() == ["pod shop/old deleted"]
    assert lab.reconcile_pods() == ["pod shop/extra started on node-2 (10.244.2.12)"]
    assert added == ["shop/extra"] and lab.reconcile_pods() == []


def test_status_tables_show_state_restarts_and_pods():
    component = {"state": "running", "pid": 7, "ready": True, "restarts": 2, "log": "x"}
    status = {
        "control": {**component, "restarts": 0, "address": "10.250.0.1:15012"},
        "nodes": {
            "node-1": {
                "netns": "am-1-1-node-1",
                "address": "10.250.0.10",
                "pod_cidr": "10.244.1.0/24",
                "admin": "127.0.0.1:15000",
                "stats": "10.250.0.10:15020",
                "agent": {**component, "ready": False},
                "ztunnel": component,
            }
        },
        "pods": {
            "shop/client": {
                "node": "node-1",
                "ip": "10.244.1.10",
                "enrolled": True,
                "identity": "spiffe://cluster.local/ns/shop/sa/client",
                "services": ["echo"],
                "app": {**component, "restarts": 0},
            }
        },
    }
    lines = [" ".join(line.split()) for t in status_tables(status) for line in plain_table(t).splitlines()]
    assert "ztunnel node-1 7 running (2 restarts) yes admin 127.0.0.1:15000 in am-1-1-node-1" in lines
    assert "agent node-1 7 running (2 restarts) no -" in lines
    assert (
        "shop/client node-1 10.244.1.10 yes spiffe://cluster.local/ns/shop/sa/client echo running yes"
        in lines
    )


def _record(tmp_path, *, ready=True):
    """A lab.json as a running lab writes it, every process this test process (alive)."""
    me = {"pid": os.getpid(), "start": process_start_ticks(os.getpid()), "restarts": 0, "log": "x"}
    return {
        "lab": "am-1-1-",
        "pid": os.getpid(),
        "ready": ready,
        "state_dir": str(tmp_path),
        "objects_dir": str(tmp_path / "objects"),
        "control": {"address": "10.250.0.1:15012", "netns": "am-none-net", "process": me},
        "dns": {"address": "10.250.0.1:53", "process": me},
        "nodes": {
            "node-1": {
                "netns": "am-none-node-1",
                "address": "10.250.0.10",
                "pod_cidr": "10.244.1.0/24",
                "run_dir": str(tmp_path / "run"),
                "admin": "127.0.0.1:15000",
                "stats": "10.250.0.10:15020",
                "agent": me,
                "ztunnel": {**me, "pid": 2**22 + 1, "start": 1},  # gone
            }
        },
        "pods": {
            "shop/client": {
                "namespace": "shop",
                "name": "client",
                "node": "node-1",
                "ip": "10.244.1.10",
                "netns": "am-none-p",
                "uid": "u1",
                "service_account": "client",
                "labels": {},
                "app": me,
            }
        },
    }


def test_one_readiness_truth_for_the_headline_the_tables_and_the_json(tmp_path):
    """The JSON's `ready` of each component is what the table's READY column shows; the lab is
    ready only when every component is, and the headline says which are not. A process without
    a readiness probe (a pod's app, the resolver) is ready while it runs, in both."""
    runner = RecordingRunner()  # no namespaces: the probes of control, agent and ztunnel fail
    status = live_status(_record(tmp_path), runner)
    assert status["pods"]["shop/client"]["app"] == {**status["pods"]["shop/client"]["app"], "ready": True}
    assert status["dns"]["ready"] is True
    assert status["nodes"]["node-1"]["ztunnel"]["state"] == "exited"
    assert status["started"] is True and status["ready"] is False
    assert "ztunnel on node-1 (exited)" in status["not_ready"]
    assert "control (running)" in status["not_ready"]
    assert "pod shop/client (running)" not in status["not_ready"]
    assert headline(status).startswith("lab am-1-1- (pid ") and "not ready: control (running)" in headline(
        status
    )
    table = {t.title: t for t in status_tables(status)}
    ready_col = table["components"].headers.index("READY")
    cells = {(r[0], r[1]): r[ready_col] for r in table["components"].rows}
    assert cells == {
        ("control", "-"): "no",
        ("dns", "-"): "yes",
        ("agent", "node-1"): "no",
        ("ztunnel", "node-1"): "no",
    }
    pods = table["pods"]
    assert pods.rows[0][pods.headers.index("READY")] == "yes"
    # Every READY cell is the JSON's field, never a second reading.
    assert [c == "yes" for c in cells.values()] == [
        status["control"]["ready"],
        status["dns"]["ready"],
        status["nodes"]["node-1"]["agent"]["ready"],
        status["nodes"]["node-1"]["ztunnel"]["ready"],
    ]


def test_a_refused_second_up_touches_nothing_of_the_running_lab(tmp_path, capsys):
    """Issue 31: the refused `up` deleted the running lab's lab.json ("still starting" after)."""
    state = tmp_path / "s"
    prepare_state_dir(state, RecordingRunner(), say=print)
    child = running_child()
    try:
        j = Journal(state)
        j.lab(child.pid)
        j.close()
        (state / "lab.json").write_text('{"lab": "running"}')
        before = {p.relative_to(state): p.read_bytes() for p in state.rglob("*") if p.is_file()}
        code = lab_cli.main(["--state-dir", str(state), "up", "--pod", "node-1:demo/a"])
        assert code == 1
        assert f"a lab is already running from {state} (pid {child.pid})" in capsys.readouterr().err
        after = {p.relative_to(state): p.read_bytes() for p in state.rglob("*") if p.is_file()}
        assert after == before
    finally:
        child.kill()
        child.wait()


def test_logs_without_tail_start_at_a_line_start(tmp_path):
    """Only the last LOG_READ_BYTES of a big log are printed, from the first whole line in them."""
    (tmp_path / "logs").mkdir()
    line = "x" * 99 + "\n"
    count = lab_cli.LOG_READ_BYTES // len(line) + 50
    (tmp_path / "logs" / "control.log").write_text("".join(f"{i:08d}{line}" for i in range(count)))
    (tmp_path / "lab.json").write_text(json.dumps(_record(tmp_path)))
    out = io.StringIO()
    assert lab_cli.main(["--state-dir", str(tmp_path), "logs", "control"], out=out) == 0
    lines = out.getvalue().splitlines()
    assert all(len(x) == 107 for x in lines)
    assert int(lines[-1][:8]) == count - 1 and int(lines[0][:8]) > 0
    assert int(lines[0][:8]) + len(lines) == count  # whole lines, none lost at the end
    out = io.StringIO()
    lab_cli.main(["--state-dir", str(tmp_path), "logs", "control", "--tail", "2"], out=out)
    assert [int(x[:8]) for x in out.getvalue().splitlines()] == [count - 2, count - 1]


def test_nodes_are_listed_with_labels_readiness_and_addresses(tmp_path):
    status = live_status(_record(tmp_path), RecordingRunner())
    (doc,) = lab_cli.node_objects(status)
    assert doc["metadata"]["name"] == "node-1"
    assert doc["metadata"]["labels"]["kubernetes.io/hostname"] == "node-1"
    assert doc["status"]["conditions"] == [{"type": "Ready", "status": "False"}]  # its ztunnel exited
    assert doc["status"]["addresses"][0] == {"type": "InternalIP", "address": "10.250.0.10"}
    assert doc["spec"]["podCIDR"] == "10.244.1.0/24"


def test_get_nodes_wide_and_selected(tmp_path):
    (tmp_path / "objects").mkdir()
    (tmp_path / "lab.json").write_text(json.dumps(_record(tmp_path)))
    base = ["--state-dir", str(tmp_path), "get"]
    out = io.StringIO()
    assert lab_cli.main([*base, "nodes"], out=out) == 0
    assert out.getvalue().splitlines()[1].split() == ["node-1", "NotReady", "10.250.0.10", "10.244.1.0/24"]
    out = io.StringIO()
    assert lab_cli.main([*base, "no", "-o", "wide"], out=out) == 0
    header, row = out.getvalue().splitlines()
    assert header.split()[-4:] == ["NETNS", "AGENT", "ZTUNNEL", "LABELS"]
    assert "exited (not ready)" in row and "kubernetes.io/hostname=node-1" in row
    out = io.StringIO()
    assert lab_cli.main([*base, "nodes", "-l", "kubernetes.io/hostname=node-2"], out=out) == 0
    assert out.getvalue() == "No resources found.\n"
    out = io.StringIO()
    assert lab_cli.main([*base, "nodes", "-o", "json", "-l", "kubernetes.io/os"], out=out) == 0
    assert [d["metadata"]["name"] for d in json.loads(out.getvalue())["items"]] == ["node-1"]


def test_tables_are_plain_lines_in_a_file_and_rich_on_a_terminal():
    table = Table(title="t", headers=("A", "LONG HEADER"), rows=(("x" * 120, "y"),))
    buf = io.StringIO()
    render_tables([table], buf)
    assert buf.getvalue() == f"A{' ' * 121}LONG HEADER\n{'x' * 120}  y\n"

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    render_tables([table], tty)
    assert "x" * 120 in tty.getvalue() and "\x1b[" in tty.getvalue()  # styled header


def test_logs_picks_the_component_file(tmp_path):
    record = {
        "state_dir": str(tmp_path),
        "nodes": {"node-1": {}, "node-2": {}},
        "pods": {"shop/client": {"namespace": "shop", "name": "client"}},
    }
    assert lab_cli.log_path(record, "control", None) == tmp_path / "logs" / "control.log"
    assert lab_cli.log_path(record, "ztunnel", "node-2") == tmp_path / "logs" / "ztunnel-node-2.log"
    assert lab_cli.log_path(record, "agent", None) == tmp_path / "logs" / "agent-node-1.log"
    assert lab_cli.log_path(record, "shop/client", None) == tmp_path / "logs" / "app-shop-client.log"
    with pytest.raises(AmbientError, match="no node 'node-3'"):
        lab_cli.log_path(record, "ztunnel", "node-3")
    with pytest.raises(AmbientError, match="unknown component"):
        lab_cli.log_path(record, "proxy", None)


def test_down_without_a_lab_is_a_no_op(tmp_path):
    out = io.StringIO()
    assert lab_cli.main(["--state-dir", str(tmp_path), "down"], out=out) == 0
    assert "nothing to do" in out.getvalue()


def test_describe_a_node_a_pod_and_another_object(tmp_path):
    from ambient_mesh.lab import apply as verbs

    (tmp_path / "objects").mkdir()
    verbs.apply(
        tmp_path / "objects",
        verbs.check("kind: Namespace\napiVersion: v1\nmetadata: {name: shop}\n", "n.yaml"),
    )
    (tmp_path / "lab.json").write_text(json.dumps(_record(tmp_path)))
    base = ["--state-dir", str(tmp_path), "describe"]
    out = io.StringIO()
    assert lab_cli.main([*base, "node", "node-1"], out=out) == 0
    text = out.getvalue()
    assert "Ready:" in text and "False" in text.split("Ready:")[1].splitlines()[0]
    assert "Node proxy:" in text and "exited, not ready" in text and "Pods:" in text and "shop/client" in text
    out = io.StringIO()
    assert lab_cli.main([*base, "pod", "client", "-n", "shop"], out=out) == 0
    fields = dict(line.split(":", 1) for line in out.getvalue().splitlines())
    assert fields["IP"].strip() == "10.244.1.10" and fields["App"].strip().startswith("running, ready")
    assert fields["Enrolled"].strip() == "False" and fields["Service account"].strip() == "client"
    out = io.StringIO()
    assert lab_cli.main([*base, "ns", "shop"], out=out) == 0
    assert "name: shop" in out.getvalue()
    assert lab_cli.main([*base, "pod", "shop/nope"], out=io.StringIO()) == 1
