"""Install the chained plugin on the node: the executable in the CNI bin dir and our entry in the
primary CNI network config, kept there against drift, removed on shutdown unless upgrading.

Counterpart of istio-cni's cni/pkg/install (cniconfig.go, binaries.go, install.go). The primary
config is the lexically first *valid* `.conf`/`.conflist` in the net dir, as kubelet and the
runtimes pick it (libcni: a conflist needs a name and at least one plugin, a lone conf needs a
`type`); CNI_CONF_NAME pins it instead. Our entry (`type: istio-cni`) is appended last to
`plugins`, replacing an older one; a lone `.conf` is wrapped into a `.conflist`. Every write is a
temp file in the same directory plus rename, so a runtime never reads half a file, and an
unchanged file is not rewritten (a rewrite is itself a change that watchers react to).

The JSON transformations are pure functions over dicts; `Installer` is the thin I/O around them.
On a normal shutdown our entry and executable are removed; on an upgrade shutdown they stay, so
new pods keep failing closed until the new agent is up instead of starting outside the mesh.

The executable is one of two things. In a container image (deploy/Containerfile) it is the frozen
plugin bundle (scripts/cluster/plugin.sh: PyInstaller onedir, its own interpreter inside), which
needs no Python on the node: the bundle directory is copied into the bin dir as
`.istio-cni-<digest>/` and `istio-cni` becomes a symlink into it, switched by rename, so the
runtime runs either the old or the new plugin, never half of one (istio-cni copies its Go binary
the same way, file by file). Run straight from a checkout (the lab, tests) it is a shell launcher
that execs this interpreter on the plugin module.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import AmbientError
from ..host.files import atomic_write
from .cniconf import PLUGIN_TYPE
from .enablement import DEFAULT_ENABLEMENT_SELECTORS, EnablementSelector
from .plugin_basics import DEFAULT_CNI_AGENT_RUN_DIR

log = logging.getLogger(__name__)

CONFIG_SUFFIXES = (".conf", ".conflist")
# The list a lone .conf is wrapped into (istio-cni's names).
WRAPPED_LIST_NAME = "k8s-pod-network"
WRAPPED_LIST_VERSION = "0.3.1"
ENTRY_CNI_VERSION = "0.3.1"
DEFAULT_CONFIG_MODE = 0o644
EXECUTABLE_MODE = 0o755
DEFAULT_WATCH_INTERVAL_S = 2.0
# Repairs in this many consecutive rounds mean something keeps rewriting the config.
REWRITE_LOOP_ROUNDS = 3
# Where the image keeps the frozen plugin bundle (deploy/Containerfile); without it, the launcher.
PACKAGED_PLUGIN_DIR = Path("/opt/ambient-mesh/cni-plugin")
BUNDLE_PREFIX = "."
# A bundle larger than this is not a plugin bundle (ours is about 16 MB): refuse to copy it.
MAX_BUNDLE_BYTES = 256 * 1024 * 1024
MAX_BUNDLE_FILES = 4096
BUNDLE_DIGEST_CHARS = 16


class InstallError(AmbientError):
    """The plugin could not be installed (no primary config yet, unreadable or unwritable files)."""


# -- pure: the entry, the launcher, the config transformations ----------------------------------


def plugin_entry(
    *,
    plugin_log_level: str = "info",
    cni_agent_run_dir: str = DEFAULT_CNI_AGENT_RUN_DIR,
    ambient_enabled: bool = True,
    enablement_selectors: Iterable[EnablementSelector] = DEFAULT_ENABLEMENT_SELECTORS,
    exclude_namespaces: Iterable[str] = (),
    pod_namespace: str = "",
    native_nftables: bool = False,
    enable_ambient_detection_retry: bool = False,
    pod_source_directory: str = "",
) -> dict[str, Any]:
    """Our chained entry, with istio-cni's keys (its install testdata golden) plus
    `ambient_pod_source` when pods come from a YAML directory."""
    entry: dict[str, Any] = {
        "ambient_enabled": ambient_enabled,
        "cni_agent_run_dir": cni_agent_run_dir,
        "cniVersion": ENTRY_CNI_VERSION,
        "dns": {},
        "enable_ambient_detection_retry": enable_ambient_detection_retry,
        "enablement_selectors": [s.to_json() for s in enablement_selectors],
        "exclude_namespaces": list(exclude_namespaces),
        "ipam": {},
        "name": PLUGIN_TYPE,
        "native_nftables": native_nftables,
        "plugin_log_level": plugin_log_level,
        "pod_namespace": pod_namespace,
        "type": PLUGIN_TYPE,
    }
    if pod_source_directory:
        entry["ambient_pod_source"] = {"directory": pod_source_directory}
    return entry


def launcher_script(python: str = sys.executable, *, sys_path: Sequence[str] | None = None) -> str:
    """The executable the runtime runs: a shell script that execs Python on the plugin module.

    `-I` keeps the runtime's environment and working directory out of the import path. With
    `sys_path`, `-S` also skips site initialisation (the venv's .pth processing) and puts those
    directories on the path directly, which starts faster; see bench/cni_plugin_bench.py.
    """
    if sys_path is None:
        return f'#!/bin/sh\nexec {shlex.quote(python)} -I -m ambient_mesh.cni.plugin_handoff "$@"\n'
    code = (
        f"import sys; sys.path[:0] = {json.dumps(list(sys_path))}; "
        "from ambient_mesh.cni.plugin_handoff import main; sys.exit(main())"
    )
    return f'#!/bin/sh\nexec {shlex.quote(python)} -I -S -c {shlex.quote(code)} "$@"\n'


def fast_sys_path() -> list[str]:
    """The directories the `-S` launcher needs: this package's root and PyYAML's."""
    import yaml

    import ambient_mesh

    roots = [
        str(Path(ambient_mesh.__file__).resolve().parent.parent),
        str(Path(yaml.__file__).resolve().parent.parent),
    ]
    return list(dict.fromkeys(roots))


@dataclass(frozen=True, slots=True, kw_only=True)
class PluginBundle:
    """A frozen plugin directory (its executable is `<source>/<executable_name>`) and the digest
    of its contents, which names the copy in the bin dir."""

    source: Path
    digest: str
    executable_name: str = PLUGIN_TYPE

    @classmethod
    def load(cls, source: Path, executable_name: str = PLUGIN_TYPE) -> PluginBundle:
        """Hash `source` (names, modes, contents); InstallError when it is not a usable bundle."""
        if not os.access(source / executable_name, os.X_OK):
            raise InstallError(
                f"plugin bundle {source} has no executable {executable_name}",
                hint="the image builds it with scripts/cluster/plugin.sh",
            )
        digest = hashlib.sha256()
        total = files = 0
        for path in sorted(p for p in source.rglob("*") if not p.is_dir()):
            files += 1
            if path.is_symlink() or not path.is_file():
                raise InstallError(f"plugin bundle {source} holds {path}, which is not a plain file")
            size = path.stat().st_size
            total += size
            if files > MAX_BUNDLE_FILES or total > MAX_BUNDLE_BYTES:
                raise InstallError(
                    f"plugin bundle {source} exceeds {MAX_BUNDLE_FILES} files or {MAX_BUNDLE_BYTES} bytes"
                )
            rel = path.relative_to(source).as_posix()
            digest.update(f"{rel}\0{path.stat().st_mode & 0o777:o}\0{size}\0".encode())
            with path.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
        return cls(
            source=source, digest=digest.hexdigest()[:BUNDLE_DIGEST_CHARS], executable_name=executable_name
        )

    @property
    def dir_name(self) -> str:
        return f"{BUNDLE_PREFIX}{self.executable_name}-{self.digest}"

    @property
    def link_target(self) -> str:
        """The symlink's relative target, so the bin dir can be mounted anywhere (`/host/opt/cni/bin`)."""
        return f"{self.dir_name}/{self.executable_name}"


def packaged_plugin(source: Path = PACKAGED_PLUGIN_DIR) -> PluginBundle | None:
    """The image's frozen plugin, or None outside an image (the launcher is used then)."""
    return PluginBundle.load(source) if source.is_dir() else None


def _plugins(config: Mapping[str, Any]) -> list[Any] | None:
    plugins = config.get("plugins")
    return plugins if isinstance(plugins, list) else None


def is_valid_config(name: str, data: bytes) -> bool:
    """libcni's test for a usable network config file."""
    try:
        doc = json.loads(data)
    except ValueError:
        return False
    if not isinstance(doc, dict):
        return False
    if name.endswith(".conflist"):
        plugins = _plugins(doc)
        return (
            isinstance(doc.get("name"), str)
            and bool(doc["name"])
            and bool(plugins)
            and all(
                isinstance(p, dict) and isinstance(p.get("type"), str) and p["type"] for p in plugins or ()
            )
        )
    return isinstance(doc.get("type"), str) and bool(doc["type"])


def select_primary(files: Mapping[str, bytes], conf_name: str = "") -> str | None:
    """The file the runtime uses: CNI_CONF_NAME (or its .conf/.conflist twin) if set, else the
    lexically first valid config."""
    if conf_name:
        for candidate in (conf_name, conf_name + "list", conf_name.removesuffix("list")):
            if candidate in files and candidate.endswith(CONFIG_SUFFIXES):
                return candidate
        return None
    for name in sorted(files):
        if name.endswith(CONFIG_SUFFIXES) and is_valid_config(name, files[name]):
            return name
    return None


def _is_ours(plugin: Any) -> bool:
    return isinstance(plugin, dict) and plugin.get("type") == PLUGIN_TYPE


def insert_plugin(existing: Mapping[str, Any], entry: Mapping[str, Any]) -> dict[str, Any]:
    """`existing` with our entry last in `plugins` (a lone conf becomes a list). The entry's
    cniVersion is dropped: a list's plugins run at the list's version."""
    ours = {k: v for k, v in entry.items() if k != "cniVersion"}
    if "type" in existing:
        single = {k: v for k, v in existing.items() if k != "cniVersion"}
        if _is_ours(single):
            return {"name": WRAPPED_LIST_NAME, "cniVersion": WRAPPED_LIST_VERSION, "plugins": [ours]}
        return {"name": WRAPPED_LIST_NAME, "cniVersion": WRAPPED_LIST_VERSION, "plugins": [single, ours]}
    plugins = _plugins(existing)
    if plugins is None:
        raise InstallError("existing CNI config has no plugins list")
    out = dict(existing)
    out["plugins"] = [p for p in plugins if not _is_ours(p)] + [ours]
    return out


def remove_plugin(existing: Mapping[str, Any]) -> dict[str, Any]:
    """`existing` without our entry; a list converted from a lone conf stays a list."""
    plugins = _plugins(existing)
    if plugins is None:
        return dict(existing)
    out = dict(existing)
    out["plugins"] = [p for p in plugins if not _is_ours(p)]
    return out


def entry_state(config: Mapping[str, Any], entry: Mapping[str, Any]) -> str:
    """ "ok", "missing", "outdated" (ours differs from `entry`) or "not-last"."""
    plugins = _plugins(config) or []
    ours = [i for i, p in enumerate(plugins) if _is_ours(p)]
    if not ours:
        return "missing"
    want = {k: v for k, v in entry.items() if k != "cniVersion"}
    have = {k: v for k, v in plugins[ours[-1]].items() if k != "cniVersion"}
    if have != want or len(ours) > 1:
        return "outdated"
    if ours[-1] != len(plugins) - 1:
        return "not-last"
    return "ok"


def render_config(config: Mapping[str, Any]) -> bytes:
    return (json.dumps(config, indent=2) + "\n").encode("utf-8")


# -- I/O ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class PluginInstall:
    """Where and what to install (istio-cni's MOUNTED_CNI_NET_DIR, CNI bin dir, CNI_CONF_NAME)."""

    cni_net_dir: Path
    cni_bin_dir: Path
    entry: Mapping[str, Any] = field(default_factory=plugin_entry)
    launcher: str = field(default_factory=launcher_script)
    # When set, this frozen bundle is installed instead of the launcher.
    bundle: PluginBundle | None = None
    cni_conf_name: str = ""
    executable_name: str = PLUGIN_TYPE
    # CNI_CONF_GROUP_READ: mode of a config file we create (an existing file keeps its mode).
    conf_group_read: bool = False

    @property
    def executable_path(self) -> Path:
        return self.cni_bin_dir / self.executable_name


@dataclass(frozen=True, slots=True, kw_only=True)
class Drift:
    config_path: Path | None
    problems: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems


class Installer:
    """Installs, checks and removes the plugin for one node."""

    __slots__ = ("spec", "config_path", "installs", "repairs")

    def __init__(self, spec: PluginInstall) -> None:
        self.spec = spec
        self.config_path: Path | None = None
        self.installs = 0
        self.repairs = 0

    def __repr__(self) -> str:
        where = self.config_path.name if self.config_path else "not installed"
        return f"Installer({where}, {self.installs} installs, {self.repairs} repairs)"

    def _listing(self) -> dict[str, bytes]:
        files: dict[str, bytes] = {}
        try:
            entries = list(self.spec.cni_net_dir.iterdir())
        except OSError as exc:
            raise InstallError(f"cannot list CNI net dir {self.spec.cni_net_dir}: {exc}") from None
        for path in entries:
            if path.suffix in CONFIG_SUFFIXES and path.is_file():
                with contextlib.suppress(OSError):
                    files[path.name] = path.read_bytes()
        return files

    def _primary(self, files: Mapping[str, bytes]) -> str:
        name = select_primary(files, self.spec.cni_conf_name)
        if name is None:
            raise InstallError(
                f"no CNI network config in {self.spec.cni_net_dir}",
                hint="the primary CNI (the pod network plugin) writes it; retrying until it appears",
            )
        return name

    def _bundle_copies(self) -> list[Path]:
        bundle = self.spec.bundle
        assert bundle is not None
        prefix = f"{BUNDLE_PREFIX}{bundle.executable_name}-"
        try:
            return sorted(p for p in self.spec.cni_bin_dir.iterdir() if p.name.startswith(prefix))
        except OSError:
            return []

    def _install_bundle(self, bundle: PluginBundle) -> bool:
        target = self.spec.executable_path
        previous = ""
        with contextlib.suppress(OSError):
            previous = os.readlink(target)
        if previous == bundle.link_target and os.access(target, os.X_OK):
            return False
        copy = self.spec.cni_bin_dir / bundle.dir_name
        for stale in self._bundle_copies():
            if ".tmp." in stale.name:  # an interrupted copy
                shutil.rmtree(stale, ignore_errors=True)
        try:
            if not os.access(copy / bundle.executable_name, os.X_OK):
                tmp = Path(tempfile.mkdtemp(dir=self.spec.cni_bin_dir, prefix=f"{copy.name}.tmp."))
                try:
                    shutil.copytree(bundle.source, tmp, dirs_exist_ok=True)
                    shutil.rmtree(copy, ignore_errors=True)
                    os.rename(tmp, copy)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
            link_tmp = self.spec.cni_bin_dir / f"{self.spec.executable_name}.tmp.{os.getpid()}"
            with contextlib.suppress(FileNotFoundError):
                link_tmp.unlink()
            os.symlink(bundle.link_target, link_tmp)
            os.replace(link_tmp, target)
        except OSError as exc:
            raise InstallError(
                f"cannot install the plugin bundle into {self.spec.cni_bin_dir}: {exc}",
                hint="a read-only CNI bin dir needs the platform's writable location (GKE: /home/kubernetes/bin)",
            ) from None
        # Older copies go, except the one just replaced: a plugin run that started a moment ago
        # may still be loading its modules from it.
        keep = {copy.name, previous.split("/", 1)[0]}
        for old in self._bundle_copies():
            if old.name not in keep and ".tmp." not in old.name:
                shutil.rmtree(old, ignore_errors=True)
        return True

    def install_executable(self) -> bool:
        """Write the launcher (or the bundle and its symlink) into the bin dir; False when it was
        already there."""
        if self.spec.bundle is not None:
            return self._install_bundle(self.spec.bundle)
        target = self.spec.executable_path
        data = self.spec.launcher.encode("utf-8")
        with contextlib.suppress(OSError):
            if target.read_bytes() == data and os.access(target, os.X_OK):
                return False
        # Leftovers of an interrupted copy would otherwise pile up (istio-cni does the same).
        for stale in self.spec.cni_bin_dir.glob(f"{self.spec.executable_name}.tmp.*"):
            with contextlib.suppress(OSError):
                stale.unlink()
        try:
            atomic_write(target, data, EXECUTABLE_MODE)
        except OSError as exc:
            raise InstallError(
                f"cannot write {target}: {exc}",
                hint="a read-only CNI bin dir needs the platform's writable location (GKE: /home/kubernetes/bin)",
            ) from None
        return True

    def install_config(self) -> Path:
        files = self._listing()
        name = self._primary(files)
        source = self.spec.cni_net_dir / name
        try:
            existing = json.loads(files[name])
        except ValueError as exc:
            raise InstallError(f"{source} is not JSON: {exc}") from None
        if not isinstance(existing, dict):
            raise InstallError(f"{source} is not a JSON object")
        updated = insert_plugin(existing, self.spec.entry)
        converted = "type" in existing and name.endswith(".conf")
        target = source.with_name(name + "list") if converted else source
        data = render_config(updated)
        try:
            mode = source.stat().st_mode & 0o777
        except OSError:
            mode = 0o640 if self.spec.conf_group_read else 0o600
        if converted or files[name] != data:
            try:
                atomic_write(target, data, mode)
                if converted:
                    # The list is in place before the lone conf goes, so a valid config always exists.
                    source.unlink()
            except OSError as exc:
                raise InstallError(f"cannot write {target}: {exc}") from None
            log.info("installed %s plugin entry into %s", PLUGIN_TYPE, target)
        self.config_path = target
        return target

    def install(self) -> Path:
        """Executable, then config entry; returns the config file we wrote into."""
        self.install_executable()
        path = self.install_config()
        self.installs += 1
        return path

    def check_drift(self) -> Drift:
        problems: list[str] = []
        exe = self.spec.executable_path
        bundle = self.spec.bundle
        try:
            if bundle is not None:
                exe.lstat()  # missing: reported below
                link = os.readlink(exe) if exe.is_symlink() else ""
                if link != bundle.link_target:
                    problems.append(f"executable {exe} does not point at our bundle {bundle.dir_name}")
                elif not os.access(exe, os.X_OK):
                    problems.append(f"executable {exe}: bundle {bundle.dir_name} is missing or incomplete")
            elif exe.read_bytes() != self.spec.launcher.encode("utf-8"):
                problems.append(f"executable {exe} differs from ours")
            elif not os.access(exe, os.X_OK):
                problems.append(f"executable {exe} is not executable")
        except OSError:
            problems.append(f"executable {exe} is missing")
        try:
            files = self._listing()
            name = self._primary(files)
        except InstallError as exc:
            return Drift(config_path=None, problems=(*problems, exc.message))
        path = self.spec.cni_net_dir / name
        if self.config_path is not None and path != self.config_path and not self.spec.cni_conf_name:
            problems.append(f"CNI config {self.config_path.name} preempted by {name}")
        try:
            state = entry_state(json.loads(files[name]), self.spec.entry)
        except (ValueError, AttributeError, TypeError):
            state = "unreadable"
        if state != "ok":
            problems.append(f"our plugin entry in {name}: {state}")
        return Drift(config_path=path, problems=tuple(problems))

    def repair(self) -> Drift:
        """Reinstall if anything drifted; returns what was found before repairing."""
        drift = self.check_drift()
        if not drift.ok:
            log.warning("CNI install drifted (%s); reinstalling", "; ".join(drift.problems))
            self.install()
            self.repairs += 1
        return drift

    def remove(self, *, upgrade: bool) -> None:
        """Undo the install on a real shutdown; keep everything on an upgrade shutdown."""
        if upgrade:
            log.info(
                "upgrade shutdown: leaving the %s plugin installed so new pods wait for the new agent",
                PLUGIN_TYPE,
            )
            return
        files = self._listing()
        names = [self.config_path.name] if self.config_path is not None else []
        names += [n for n in sorted(files) if n not in names]
        for name in names:
            if name not in files:
                continue
            try:
                doc = json.loads(files[name])
            except ValueError:
                continue
            if not isinstance(doc, dict) or not any(_is_ours(p) for p in _plugins(doc) or ()):
                continue
            path = self.spec.cni_net_dir / name
            atomic_write(path, render_config(remove_plugin(doc)), path.stat().st_mode & 0o777)
            log.info("removed %s plugin entry from %s", PLUGIN_TYPE, path)
        with contextlib.suppress(FileNotFoundError):
            self.spec.executable_path.unlink()
        if self.spec.bundle is not None:
            for copy in self._bundle_copies():
                shutil.rmtree(copy, ignore_errors=True)
        self.config_path = None


async def watch(
    installer: Installer,
    *,
    interval_s: float = DEFAULT_WATCH_INTERVAL_S,
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    on_drift: Callable[[Drift], None] | None = None,
) -> None:
    """Poll for drift and repair it, until cancelled. Failures (no primary config yet, an
    unwritable dir) are logged and retried next round."""
    consecutive = 0
    while True:
        try:
            drift = installer.repair()
        except (InstallError, OSError) as exc:
            log.warning("CNI install repair failed: %s", exc)
        else:
            if not drift.ok:
                consecutive += 1
                if on_drift is not None:
                    on_drift(drift)
                if consecutive >= REWRITE_LOOP_ROUNDS:
                    log.warning(
                        "CNI config rewritten %d rounds in a row: another agent keeps replacing it%s",
                        consecutive,
                        " (Cilium needs cni.exclusive=false)" if "cilium" in str(drift.config_path) else "",
                    )
            else:
                consecutive = 0
        await sleep(interval_s)
