"""kube/watch.py: the directory watcher reports what changed, and its per-file parse cache gives
what a full reload gives."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from ambient_mesh.kube.load import LoadResult, load_directory, parse_documents
from ambient_mesh.kube.watch import DirectoryChange, DirectoryWatcher
from tests.helpers.kube_files import POD_BAD_NODE, POD_OK, write_file

# -- the watcher ----------------------------------------------------------------------------------


class StepSleep:
    """An injected sleep that hands control back to the test after each poll."""

    def __init__(self) -> None:
        self.calls: list[float] = []
        self.slept = asyncio.Event()
        self.proceed = asyncio.Event()

    async def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)
        self.slept.set()
        await self.proceed.wait()
        self.proceed.clear()

    async def next_poll(self) -> None:
        self.slept.clear()
        self.proceed.set()
        await asyncio.wait_for(self.slept.wait(), 5)


def _bump_mtime(path: Path) -> None:
    st_ = path.stat()
    os.utime(path, ns=(st_.st_atime_ns, st_.st_mtime_ns + 1_000_000_000))


async def test_watcher_reports_added_updated_removed(tmp_path: Path) -> None:
    pods = write_file(tmp_path, "pods.yaml", POD_OK)
    changes: list[DirectoryChange] = []
    sleep = StepSleep()
    watcher = DirectoryWatcher(tmp_path, changes.append, poll_interval_s=0.5, sleep=sleep)
    task = asyncio.create_task(watcher.run())
    try:
        await asyncio.wait_for(sleep.slept.wait(), 5)
        assert len(changes) == 1 and changes[0].added == (("Pod", "default", "ok"),)
        assert changes[0].files_added == ("pods.yaml",)

        await sleep.next_poll()  # nothing touched: no report
        assert len(changes) == 1

        pods.write_text(POD_OK.replace("app: ok", "app: changed"))
        _bump_mtime(pods)
        svc = write_file(
            tmp_path, "svc.yaml", "apiVersion: v1\nkind: Service\nmetadata: {name: s}\nspec: {}\n"
        )
        await sleep.next_poll()
        change = changes[-1]
        assert change.updated == (("Pod", "default", "ok"),)
        assert change.added == (("Service", "default", "s"),)
        assert change.files_changed == ("pods.yaml",) and change.files_added == ("svc.yaml",)
        assert change.store.get("Pod", "default", "ok").metadata.labels == {"app": "changed"}

        svc.unlink()
        await sleep.next_poll()
        assert changes[-1].removed == (("Service", "default", "s"),)
        assert changes[-1].files_removed == ("svc.yaml",)
        assert repr(watcher).endswith("1 files, 1 objects, 0 errors, 3 changes, every 0.5s)")
        assert set(sleep.calls) == {0.5}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_watcher_touch_without_change_is_silent_and_async_callback_awaited(tmp_path: Path) -> None:
    pods = write_file(tmp_path, "pods.yaml", POD_OK)
    seen: list[str] = []

    async def on_change(change: DirectoryChange) -> None:
        seen.append(change.summary())

    watcher = DirectoryWatcher(tmp_path, on_change)
    assert repr(watcher).endswith("not yet read, 0 changes, every 1.0s)")
    assert await watcher.poll_and_notify() is not None
    _bump_mtime(pods)  # same content, new mtime
    assert await watcher.poll_and_notify() is None
    pods.write_text(POD_BAD_NODE)
    change = await watcher.poll_and_notify()
    assert change is not None and change.removed == (("Pod", "default", "ok"),)
    assert seen == ["1 added, 0 updated, 0 removed, 0 errors", "0 added, 0 updated, 1 removed, 1 errors"]
    assert watcher.polls == 3


async def test_watcher_real_interval_bounded_wait(tmp_path: Path) -> None:
    got = asyncio.Event()
    watcher = DirectoryWatcher(
        tmp_path, lambda change: got.set() if change.added else None, poll_interval_s=0.01
    )
    task = asyncio.create_task(watcher.run())
    try:
        await asyncio.sleep(0)
        write_file(tmp_path, "pods.yaml", POD_OK)
        await asyncio.wait_for(got.wait(), 5)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


# -- the directory watcher's parse cache ------------------------------------------------------------


def _pod_yaml(name: str, app: str = "web") -> str:
    return (
        f"apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: default, labels: {{app: {app}}}}}\n"
        f"status: {{podIP: 10.0.0.1}}\n"
    )


class CountingParse:
    """parse_documents, recording which files it was asked to parse."""

    def __init__(self) -> None:
        self.files: list[str] = []

    def __call__(self, text: str, file: str) -> LoadResult:
        self.files.append(file)
        return parse_documents(text, file)


def _write_at(path: Path, text: str, *, mtime_step_s: int = 0) -> None:
    path.write_text(text)
    if mtime_step_s:
        st = path.stat()
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + mtime_step_s * 1_000_000_000))


def test_watcher_parses_only_the_files_that_changed(tmp_path: Path) -> None:
    for name in ("a", "b", "c"):
        _write_at(tmp_path / f"{name}.yaml", _pod_yaml(name))
    parse = CountingParse()
    watcher = DirectoryWatcher(tmp_path, lambda change: None, parse=parse)

    first = watcher.poll()
    assert first is not None and parse.files == ["a.yaml", "b.yaml", "c.yaml"]
    assert first.result == load_directory(tmp_path)

    parse.files.clear()
    assert watcher.poll() is None and parse.files == []  # nothing moved: nothing read

    _write_at(tmp_path / "b.yaml", _pod_yaml("b", app="other"), mtime_step_s=1)
    change = watcher.poll()
    assert parse.files == ["b.yaml"]
    assert change is not None
    assert change.updated == (("Pod", "default", "b"),) and change.files_changed == ("b.yaml",)
    assert change.result == load_directory(tmp_path)

    parse.files.clear()
    _write_at(tmp_path / "d.yaml", _pod_yaml("d"))
    (tmp_path / "a.yaml").unlink()
    change = watcher.poll()
    assert parse.files == ["d.yaml"]
    assert change is not None
    assert change.added == (("Pod", "default", "d"),) and change.removed == (("Pod", "default", "a"),)
    assert change.files_added == ("d.yaml",) and change.files_removed == ("a.yaml",)
    assert change.result == load_directory(tmp_path)

    parse.files.clear()
    st = (tmp_path / "c.yaml").stat()
    os.utime(tmp_path / "c.yaml", ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    assert watcher.poll() is None  # touched, same objects: no report
    assert parse.files == ["c.yaml"]
    assert repr(watcher).endswith("3 files, 3 objects, 0 errors, 3 changes, every 1.0s)")


def test_watcher_cache_keeps_duplicates_and_errors_as_a_full_reload_does(tmp_path: Path) -> None:
    _write_at(tmp_path / "a.yaml", _pod_yaml("same"))
    _write_at(tmp_path / "b.yaml", _pod_yaml("same", app="dup") + "---\n" + "a: [1\n")
    parse = CountingParse()
    watcher = DirectoryWatcher(tmp_path, lambda change: None, parse=parse)
    first = watcher.poll()
    assert first is not None and first.result == load_directory(tmp_path)
    # b.yaml does not parse at all; a.yaml's pod is the only object.
    assert len(first.result.errors) == 1 and first.result.errors[0].file == "b.yaml"

    _write_at(tmp_path / "b.yaml", _pod_yaml("same", app="dup"), mtime_step_s=1)
    change = watcher.poll()
    assert parse.files == ["a.yaml", "b.yaml", "b.yaml"]
    assert change is not None and change.result == load_directory(tmp_path)
    assert [e.message for e in change.result.errors] == [
        "duplicate of the object in a.yaml; the first one is kept"
    ]
