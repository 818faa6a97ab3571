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

`down` runs as root on what the journal says, so the journal is believed only as far as it can be
proved ours (a planted journal once made root kill, delete and unmount what it listed):
- the state directory is root's alone (host/private.py: owned by root, not group/other writable,
  checked at every start and every read) and the journal a regular file owned by root;
- a process is killed only when its pid, its start time and its command line all match what was
  recorded when it was spawned;
- a namespace is deleted only when its name carries the lab's own prefix (`am-<lab pid>-<n>-`,
  recorded with the lab's pid);
- a path is removed only inside the state directory, or as `/etc/netns/<one of those namespaces>`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import AmbientError, ConfigError
from ..host.commands import CommandRunner
from ..host.netns import NETNS_PREFIX, delete_netns, list_netns, netns_pids
from ..host.private import PRIVATE_FILE_MODE, UnsafePathError, check_private_dir, private_dir

JOURNAL_FILE = "journal.jsonl"
MARKER_FILE = ".ambient-lab"  # a directory without it is not a lab's: never emptied
MAX_JOURNAL_BYTES = 8 * 1024 * 1024  # a journal is a few KiB; more means it is not ours
LAB_STOP_GRACE_S = 45.0  # `up` drains its node agents (15 s each, side by side) before exiting
KILL_WAIT_S = 5.0
POLL_INTERVAL_S = 0.05
# `ip netns exec <netns> <argv>` runs <argv> in place of itself (lab.py spawns every program so).
IP_NETNS_EXEC = ("ip", "netns", "exec")
# /etc/netns/<netns>: the resolv.conf `ip netns exec` bind-mounts, the one path outside the state
# directory the lab creates.
ETC_NETNS = Path("/etc/netns")


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


def process_cmdline(pid: int) -> tuple[str, ...] | None:
    """/proc/<pid>/cmdline as its arguments; None when the process is gone."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return tuple(arg.decode(errors="surrogateescape") for arg in raw.split(b"\0")[:-1])


def same_process(pid: int, start: int | None) -> bool:
    """Whether `pid` is still the process recorded with `start` (not a reused pid)."""
    ticks = process_start_ticks(pid)
    return ticks is not None and (start is None or ticks == start)


def proven_process(pid: int, start: int | None, argv: tuple[str, ...] | None) -> bool:
    """Whether `pid` is provably the process recorded at spawn: same start time (so not a reused
    pid) and the command line recorded then, as run or still inside `ip netns exec`."""
    if start is None or not argv or not same_process(pid, start):
        return False
    cmdline = process_cmdline(pid)
    if cmdline is None:
        return False
    return cmdline == argv or (cmdline[:3] == IP_NETNS_EXEC and len(cmdline) > 4 and cmdline[4:] == argv)


def lab_prefix_pattern(lab_pid: int) -> re.Pattern[str]:
    """The names a lab started by `lab_pid` gives its namespaces (host.netns.run_prefix)."""
    return re.compile(rf"{re.escape(NETNS_PREFIX)}{lab_pid}-\d+-")


@dataclass(slots=True)
class Recorded:
    """What one journal says the lab created."""

    lab_pid: int | None = None
    lab_start: int | None = None
    lab_argv: tuple[str, ...] | None = None
    namespaces: list[str] = field(default_factory=list)
    processes: list[tuple[int, int | None, str]] = field(default_factory=list)  # pid, start, name
    argvs: dict[int, tuple[str, ...]] = field(default_factory=dict)  # pid -> argv at spawn
    paths: list[Path] = field(default_factory=list)

    @property
    def lab_alive(self) -> bool:
        return self.lab_pid is not None and proven_process(self.lab_pid, self.lab_start, self.lab_argv)

    def owns_netns(self, name: str) -> bool:
        """Whether `name` is one of this lab's namespaces by its name (its prefix)."""
        return self.lab_pid is not None and lab_prefix_pattern(self.lab_pid).match(name) is not None


class Journal:
    """Append-only record of one run (one JSON object per line, flushed at once)."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / JOURNAL_FILE
        # O_NOFOLLOW: a symlink planted in its place is not followed; 0600, root's.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, PRIVATE_FILE_MODE)
        self._file = os.fdopen(fd, "a", encoding="utf-8")
        self._lock = threading.Lock()  # the lab starts pods from worker threads

    def __repr__(self) -> str:
        return f"Journal({self.path})"

    def _write(self, entry: dict[str, Any]) -> None:
        with self._lock:
            self._file.write(json.dumps(entry) + "\n")
            self._file.flush()

    def lab(self, pid: int) -> None:
        self._write({"lab": pid, "start": process_start_ticks(pid), "argv": process_cmdline(pid)})

    def netns(self, name: str) -> None:
        self._write({"netns": name})

    def process(self, pid: int, name: str, argv: Sequence[str]) -> None:
        """A process just spawned; `argv` is what it runs (after `ip netns exec <netns>`)."""
        self._write({"pid": pid, "start": process_start_ticks(pid), "name": name, "argv": list(argv)})

    def path_created(self, path: Path) -> None:
        self._write({"path": str(path)})

    def close(self) -> None:
        self._file.close()


def read_journal(state_dir: Path) -> Recorded | None:
    """The journal of the last run in `state_dir`, or None when there is none (lab down).
    UnsafePathError when the directory or the journal could have been written by another user."""
    if not os.path.lexists(state_dir):
        return None
    check_private_dir(state_dir)
    path = state_dir / JOURNAL_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise UnsafePathError(path, f"cannot be opened as a regular file: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        mode = stat.S_IMODE(st.st_mode)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or mode & 0o022:
            raise UnsafePathError(
                path,
                f"is owned by uid {st.st_uid} with mode {mode:04o}; a lab journal is a regular file "
                f"owned by uid {os.geteuid()} and writable by nobody else",
            )
        data = f.read(MAX_JOURNAL_BYTES + 1)
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
        argv = entry.get("argv")
        argv = tuple(argv) if isinstance(argv, list) and all(isinstance(a, str) for a in argv) else None
        if isinstance(entry.get("lab"), int):
            rec.lab_pid, rec.lab_start, rec.lab_argv = entry["lab"], start, argv
        elif isinstance(entry.get("netns"), str):
            rec.namespaces.append(entry["netns"])
        elif isinstance(entry.get("pid"), int):
            rec.processes.append((entry["pid"], start, str(entry.get("name", ""))))
            if argv:
                rec.argvs[entry["pid"]] = argv
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
    # Only what the journal can prove ours (module docstring); anything else is reported.
    namespaces = [n for n in rec.namespaces if rec.owns_netns(n)]
    for name in sorted(set(rec.namespaces) - set(namespaces)):
        say(f"not deleting namespace {name!r}: its name does not carry this lab's prefix")
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
    for name in reversed(namespaces):
        if name not in existing:
            continue
        # A deleted namespace whose processes live on stays alive, unnamed: kill them first.
        for pid in netns_pids(runner, name):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        delete_netns(runner, name)
        deleted.append(name)
    for pid, start, name in rec.processes:
        if not proven_process(pid, start, rec.argvs.get(pid)):
            if start is not None and same_process(pid, start):
                say(f"not killing pid {pid} ({name}): its command line is not the one recorded")
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        killed.append(pid)
    for pid in killed:
        _wait_gone(pid, None, KILL_WAIT_S)
    allowed_etc = {ETC_NETNS / n for n in namespaces}
    for path in rec.paths:
        if path in allowed_etc or _inside(path, state_dir):
            shutil.rmtree(path, ignore_errors=True)
        else:
            say(f"not removing {path}: outside the state directory {state_dir}")
    with contextlib.suppress(FileNotFoundError):
        (state_dir / JOURNAL_FILE).unlink()
    return SweepReport(
        lab_stopped=lab_stopped, namespaces=tuple(deleted), processes=tuple(sorted(set(killed)))
    )


def _inside(path: Path, directory: Path) -> bool:
    """Whether `path` is strictly inside `directory`, with symlinks resolved on both sides."""
    try:
        resolved, root = path.resolve(), directory.resolve()
    except OSError:
        return False
    return resolved != root and resolved.is_relative_to(root)


def prepare_state_dir(state_dir: Path, runner: CommandRunner, *, say: Callable[[str], None]) -> None:
    """A clean state directory for a new run: refuse when a lab runs from it or when it is not a
    lab's; otherwise undo whatever an earlier run left (a crash) and empty it."""
    if state_dir.exists() and not state_dir.is_dir():
        raise ConfigError("--state-dir", f"{state_dir} exists and is not a directory")
    private_dir(state_dir)  # created 0700, or checked: root's, writable by nobody else
    if any(state_dir.iterdir()):
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
    (state_dir / MARKER_FILE).write_text("ambient lab state directory\n")


def leftover_namespaces(runner: CommandRunner, prefix: str) -> list[str]:
    """Namespaces still present whose names start with `prefix` (for tests and `down`'s report)."""
    return [n for n in list_netns(runner) if n.startswith(prefix)]
