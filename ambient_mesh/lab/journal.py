"""What a lab creates, written down before it exists, so that `ambient lab down` can undo any `up`.

Counterpart: the records a kubelet and a container runtime keep on disk (sandbox ids, pid files)
so that a restart after a crash can find and remove what the previous instance left. A lab's
`up` appends one JSON line per thing to `<state dir>/journal.jsonl` *before* creating it (a
network namespace, an `/etc/netns/<name>` directory) or right after starting it (a process: its
pid and its start time, so a reused pid is never killed). Every process the lab starts runs
inside one of its namespaces, so a process that started but was not recorded yet (the lab died
between fork and write) is still found: `down` kills everything inside each recorded namespace
before deleting it.

`sweep` is what `down` does with the journal, whatever state `up` died in; running it twice is
harmless. `prepare_state_dir` gives every run a clean state directory, refusing to touch a
directory that is not a lab's.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import AmbientError, ConfigError
from ..host.commands import CommandRunner
from ..host.netns import delete_netns, list_netns, netns_pids

JOURNAL_FILE = "journal.jsonl"
MARKER_FILE = ".ambient-lab"  # a directory without it is not a lab's: never emptied
MAX_JOURNAL_BYTES = 8 * 1024 * 1024  # a journal is a few KiB; more means it is not ours
LAB_STOP_GRACE_S = 45.0  # `up` drains its node agents (15 s each, side by side) before exiting
KILL_WAIT_S = 5.0
POLL_INTERVAL_S = 0.05


def process_start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks since boot); None when gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may contain spaces: split after it.
    rest = stat[stat.rfind(")") + 2 :].split()
    try:
        return int(rest[19])
    except (IndexError, ValueError):
        return None


def same_process(pid: int, start: int | None) -> bool:
    """Whether `pid` is still the process recorded with `start` (not a reused pid)."""
    ticks = process_start_ticks(pid)
    return ticks is not None and (start is None or ticks == start)


@dataclass(slots=True)
class Recorded:
    """What one journal says the lab created."""

    lab_pid: int | None = None
    lab_start: int | None = None
    namespaces: list[str] = field(default_factory=list)
    processes: list[tuple[int, int | None, str]] = field(default_factory=list)  # pid, start, name
    paths: list[Path] = field(default_factory=list)

    @property
    def lab_alive(self) -> bool:
        return self.lab_pid is not None and same_process(self.lab_pid, self.lab_start)


class Journal:
    """Append-only record of one run (one JSON object per line, flushed at once)."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / JOURNAL_FILE
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._lock = threading.Lock()  # the lab starts pods from worker threads

    def __repr__(self) -> str:
        return f"Journal({self.path})"

    def _write(self, entry: dict[str, Any]) -> None:
        with self._lock:
            self._file.write(json.dumps(entry) + "\n")
            self._file.flush()

    def lab(self, pid: int) -> None:
        self._write({"lab": pid, "start": process_start_ticks(pid)})

    def netns(self, name: str) -> None:
        self._write({"netns": name})

    def process(self, pid: int, name: str) -> None:
        self._write({"pid": pid, "start": process_start_ticks(pid), "name": name})

    def path_created(self, path: Path) -> None:
        self._write({"path": str(path)})

    def close(self) -> None:
        self._file.close()


def read_journal(state_dir: Path) -> Recorded | None:
    """The journal of the last run in `state_dir`, or None when there is none (lab down)."""
    path = state_dir / JOURNAL_FILE
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_JOURNAL_BYTES + 1)
    except FileNotFoundError:
        return None
    if len(data) > MAX_JOURNAL_BYTES:
        raise AmbientError(f"{path} is larger than {MAX_JOURNAL_BYTES} bytes: not a lab journal")
    rec = Recorded()
    for line in data.decode(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash mid-write
        if not isinstance(entry, dict):
            continue
        start = entry.get("start") if isinstance(entry.get("start"), int) else None
        if isinstance(entry.get("lab"), int):
            rec.lab_pid, rec.lab_start = entry["lab"], start
        elif isinstance(entry.get("netns"), str):
            rec.namespaces.append(entry["netns"])
        elif isinstance(entry.get("pid"), int):
            rec.processes.append((entry["pid"], start, str(entry.get("name", ""))))
        elif isinstance(entry.get("path"), str):
            rec.paths.append(Path(entry["path"]))
    return rec


def _wait_gone(pid: int, start: int | None, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while same_process(pid, start):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_INTERVAL_S)
    return True


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepReport:
    lab_stopped: bool  # the `up` process was running and has now exited
    namespaces: tuple[str, ...]  # deleted here (the lab had not)
    processes: tuple[int, ...]  # killed here


def sweep(
    state_dir: Path,
    runner: CommandRunner,
    *,
    lab_grace_s: float = LAB_STOP_GRACE_S,
    say: Callable[[str], None] = lambda _line: None,
) -> SweepReport | None:
    """Undo everything the journal records: stop the `up` process (SIGTERM, its own teardown, then
    SIGKILL after `lab_grace_s`), kill every process inside each recorded namespace and delete
    it, kill recorded processes still alive, remove recorded paths, and drop the journal.
    None when there is no journal (nothing to do)."""
    rec = read_journal(state_dir)
    if rec is None:
        return None
    lab_stopped = False
    if rec.lab_pid is not None and rec.lab_pid != os.getpid() and rec.lab_alive:
        say(f"stopping the lab (pid {rec.lab_pid})")
        with contextlib.suppress(ProcessLookupError):
            os.kill(rec.lab_pid, signal.SIGTERM)
        if not _wait_gone(rec.lab_pid, rec.lab_start, lab_grace_s):
            say(f"the lab (pid {rec.lab_pid}) did not stop in {lab_grace_s:.0f}s: killing it")
            with contextlib.suppress(ProcessLookupError):
                os.kill(rec.lab_pid, signal.SIGKILL)
            _wait_gone(rec.lab_pid, rec.lab_start, KILL_WAIT_S)
        lab_stopped = True
    killed: list[int] = []
    existing = set(list_netns(runner))
    deleted = []
    for name in reversed(rec.namespaces):
        if name not in existing:
            continue
        # A deleted namespace whose processes live on stays alive, unnamed: kill them first.
        for pid in netns_pids(runner, name):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        delete_netns(runner, name)
        deleted.append(name)
    for pid, start, _name in rec.processes:
        if same_process(pid, start):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    for pid in killed:
        _wait_gone(pid, None, KILL_WAIT_S)
    for path in rec.paths:
        shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        (state_dir / JOURNAL_FILE).unlink()
    return SweepReport(
        lab_stopped=lab_stopped, namespaces=tuple(deleted), processes=tuple(sorted(set(killed)))
    )


def prepare_state_dir(state_dir: Path, runner: CommandRunner, *, say: Callable[[str], None]) -> None:
    """A clean state directory for a new run: refuse when a lab runs from it or when it is not a
    lab's; otherwise undo whatever an earlier run left (a crash) and empty it."""
    if state_dir.exists() and not state_dir.is_dir():
        raise ConfigError("--state-dir", f"{state_dir} exists and is not a directory")
    if state_dir.is_dir() and any(state_dir.iterdir()):
        if not (state_dir / MARKER_FILE).exists():
            raise ConfigError(
                "--state-dir",
                f"{state_dir} is not empty and is not a lab's state directory (no {MARKER_FILE}): "
                "refusing to empty it",
                hint="pass an empty or new directory",
            )
        rec = read_journal(state_dir)
        if rec is not None and rec.lab_alive and rec.lab_pid != os.getpid():
            raise AmbientError(
                f"a lab is already running from {state_dir} (pid {rec.lab_pid})",
                hint="`ambient lab down`, or pass another --state-dir",
            )
        if rec is not None:
            report = sweep(state_dir, runner)
            if report and (report.namespaces or report.processes):
                say(
                    f"removed what an earlier run left: {len(report.namespaces)} namespaces, "
                    f"{len(report.processes)} processes"
                )
        for child in state_dir.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / MARKER_FILE).write_text("ambient lab state directory\n")


def leftover_namespaces(runner: CommandRunner, prefix: str) -> list[str]:
    """Namespaces still present whose names start with `prefix` (for tests and `down`'s report)."""
    return [n for n in list_netns(runner) if n.startswith(prefix)]
