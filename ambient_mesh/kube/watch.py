"""Watching a directory of YAML files: `DirectoryWatcher` polls it (mtime and size of each file)
and hands every changed snapshot to a callback, with the objects added, updated and removed.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from .load import LoadResult, ParseFn, list_files, load_file, merge_files, parse_documents
from .model import KubeObject, ObjectKey, object_key
from .store import KubeStore

log = logging.getLogger(__name__)

DEFAULT_POLL_INTERVAL_S = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class DirectoryChange:
    """What one poll found: the new snapshot and how it differs from the previous one."""

    result: LoadResult
    files_added: tuple[str, ...] = ()
    files_changed: tuple[str, ...] = ()
    files_removed: tuple[str, ...] = ()
    added: tuple[ObjectKey, ...] = ()
    updated: tuple[ObjectKey, ...] = ()
    removed: tuple[ObjectKey, ...] = ()

    @property
    def store(self) -> KubeStore:
        return self.result.store

    def summary(self) -> str:
        return (
            f"{len(self.added)} added, {len(self.updated)} updated, {len(self.removed)} removed, "
            f"{len(self.result.errors)} errors"
        )


Fingerprint = dict[str, tuple[int, int]]
OnChange = Callable[[DirectoryChange], None | Awaitable[None]]


class DirectoryWatcher:
    """Polls a directory and reports each changed snapshot to `on_change`.

    Polling (mtime and size per file) keeps it portable and simple; inotify would save a few
    syscalls per interval, which does not matter at one poll a second. Each file's parse result is
    kept under its (mtime, size), so a change re-parses only the files that changed: at 10,000 pods
    decoding the whole directory again takes seconds. `sleep` and `parse` are injectable so tests
    step the loop without waiting and count what gets parsed.
    """

    def __init__(
        self,
        path: str | Path,
        on_change: OnChange,
        poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
        *,
        sleep: Callable[[float], Awaitable[None]] | None = None,
        parse: ParseFn = parse_documents,
    ) -> None:
        self.path = Path(path)
        self._parse = parse
        # file name -> (its (mtime_ns, size) when it was read, what it parsed to)
        self._parsed: dict[str, tuple[tuple[int, int], LoadResult]] = {}
        self.poll_interval_s = poll_interval_s
        self._on_change = on_change
        self._sleep = sleep
        self._fingerprint: Fingerprint | None = None
        self._objects: dict[ObjectKey, KubeObject] = {}
        self._last: LoadResult | None = None
        self.polls = 0
        self.changes = 0

    def __repr__(self) -> str:
        if self._last is None:
            state = "not yet read"
        else:
            state = (
                f"{len(self._fingerprint or {})} files, {len(self._objects)} objects, "
                f"{len(self._last.errors)} errors"
            )
        return (
            f"DirectoryWatcher({self.path}: {state}, {self.changes} changes, every {self.poll_interval_s}s)"
        )

    @property
    def last(self) -> LoadResult | None:
        return self._last

    def _scan(self) -> Fingerprint:
        out: Fingerprint = {}
        for file in list_files(self.path):
            try:
                st = file.stat()
            except OSError:
                continue
            out[file.name] = (st.st_mtime_ns, st.st_size)
        return out

    def _load(self, fingerprint: Fingerprint) -> LoadResult:
        """The directory's snapshot, parsing again only files whose (mtime, size) moved.

        The stat was taken before the read, so a write that lands in between changes the
        fingerprint again and the next poll reads the file once more.
        """
        parsed: dict[str, tuple[tuple[int, int], LoadResult]] = {}
        for name, stat in fingerprint.items():
            cached = self._parsed.get(name)
            if cached is not None and cached[0] == stat:
                parsed[name] = cached
            else:
                parsed[name] = (stat, load_file(self.path / name, self._parse))
        self._parsed = parsed
        return merge_files((name, result) for name, (_, result) in parsed.items())

    def poll(self) -> DirectoryChange | None:
        """Scan once; reload and return the change when any file was added, changed or removed.

        The first poll always reports (every object as added), so a consumer starts from a
        full snapshot even for an empty directory.
        """
        self.polls += 1
        fingerprint = self._scan()
        previous = self._fingerprint
        if previous is not None and fingerprint == previous:
            return None
        previous = previous or {}
        result = self._load(fingerprint)
        objects = {object_key(o): o for o in result.objects}
        added = tuple(sorted(k for k in objects if k not in self._objects))
        removed = tuple(sorted(k for k in self._objects if k not in objects))
        updated = tuple(sorted(k for k in objects if k in self._objects and self._objects[k] != objects[k]))
        change = DirectoryChange(
            result=result,
            files_added=tuple(sorted(set(fingerprint) - set(previous))),
            files_changed=tuple(
                sorted(f for f in fingerprint if f in previous and fingerprint[f] != previous[f])
            ),
            files_removed=tuple(sorted(set(previous) - set(fingerprint))),
            added=added,
            updated=updated,
            removed=removed,
        )
        first = self._fingerprint is None
        previous_errors = self._last.errors if self._last is not None else ()
        self._fingerprint = fingerprint
        self._objects = objects
        self._last = result
        if not first and not (added or updated or removed) and result.errors == previous_errors:
            # A file was touched but its objects did not change: nothing to push.
            return None
        self.changes += 1
        return change

    async def poll_and_notify(self) -> DirectoryChange | None:
        change = self.poll()
        if change is not None:
            log.info("config directory %s changed: %s", self.path, change.summary())
            for error in change.result.errors:
                log.warning("config object skipped: %s", error)
            outcome = self._on_change(change)
            if outcome is not None:
                await outcome
        return change

    async def run(self) -> None:
        """Poll until cancelled. The callback runs inline: a slow consumer delays the next poll."""
        while True:
            await self.poll_and_notify()
            if self._sleep is None:
                import asyncio  # here, not at the top: the CNI plugin imports this module and starts fast

                self._sleep = asyncio.sleep
            await self._sleep(self.poll_interval_s)
