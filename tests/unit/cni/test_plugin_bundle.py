"""The frozen CNI plugin (scripts/cluster/plugin.sh) leaves out the modules listed in
deploy/plugin/excludes.txt. A plugin module that imports one of them works from the checkout and
fails on a node with ModuleNotFoundError, at ADD, inside the kubelet's pod set-up. These tests
hold the plugin's import graph to the list, without building the bundle."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from tests.helpers.paths import ROOT

EXCLUDES_FILE = ROOT / "deploy" / "plugin" / "excludes.txt"


def excluded_modules() -> list[str]:
    lines = EXCLUDES_FILE.read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def is_excluded(name: str, excludes: list[str]) -> bool:
    return any(name == e or name.startswith(e + ".") for e in excludes)


def plugin_modules_at_import() -> list[str]:
    """The modules a fresh interpreter holds after importing the plugin's entry module."""
    code = "import json, sys; import ambient_mesh.cni.plugin; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return list(json.loads(out.stdout))


def test_excludes_file_lists_modules():
    excludes = excluded_modules()
    assert "asyncio" in excludes and "ambient_mesh.proxy" in excludes
    assert len(excludes) == len(set(excludes))


def test_importing_the_plugin_loads_no_excluded_module():
    excludes = excluded_modules()
    loaded = [m for m in plugin_modules_at_import() if is_excluded(m, excludes)]
    assert loaded == [], f"the frozen plugin would fail: it imports {loaded} (deploy/plugin/excludes.txt)"


def test_no_plugin_module_imports_an_excluded_module_lazily():
    """Function-level imports run only on some paths (ADD, DEL, errors): read them from the
    source of every ambient_mesh module the plugin loads."""
    excludes = excluded_modules()
    offenders: list[str] = []
    for name in plugin_modules_at_import():
        if not name.startswith("ambient_mesh"):
            continue
        rel = Path(*name.split("."))
        path = ROOT / (str(rel) + ".py")
        if not path.exists():
            path = ROOT / rel / "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    anchor = ".".join(parts[: len(parts) - node.level + 1])
                    base = f"{anchor}.{base}" if base else anchor
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            offenders += [f"{name}:{node.lineno} imports {t}" for t in targets if is_excluded(t, excludes)]
    assert offenders == [], "\n".join(offenders)


def test_seeded_excluded_import_is_caught():
    assert is_excluded("asyncio.events", excluded_modules())
    assert not is_excluded("asynciox", excluded_modules())


# What the handoff may not load: each costs the start-up an ADD is measured by
# (bench/cni_plugin_bench.py); the whole plugin loads them only when the agent does not answer.
HEAVY_FOR_THE_HANDOFF = (
    "dataclasses",
    "typing",
    "inspect",
    "ast",
    "ssl",
    "yaml",
    "asyncio",
    "http",
    "logging",
)


def test_the_handoff_loads_only_what_sending_a_run_needs():
    code = (
        f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); before = set(sys.modules); "
        "import ambient_mesh.cni.plugin_handoff; print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    ours = [m for m in loaded if m.startswith("ambient_mesh")]
    assert ours == [
        "ambient_mesh",
        "ambient_mesh.cni",
        "ambient_mesh.cni.plugin_basics",
        "ambient_mesh.cni.plugin_handoff",
    ]
    heavy = [m for m in loaded if m.split(".")[0] in HEAVY_FOR_THE_HANDOFF]
    assert heavy == [], f"plugin_handoff imports {heavy}: the handoff's start-up grows"
