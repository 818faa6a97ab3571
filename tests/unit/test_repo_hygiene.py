"""The repository's own rules that no linter holds: the pre-commit hooks are the test command's
checks, in the same order."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _test_command_checks() -> list[str]:
    """The `.venv/bin/...` check lines of scripts/test.sh, comments stripped."""
    lines = (ROOT / "scripts" / "test.sh").read_text().splitlines()
    return [line.split("#", 1)[0].strip() for line in lines if line.startswith(".venv/bin/")]


def test_the_pre_commit_hooks_run_the_test_commands_checks() -> None:
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    hooks = [hook for repo in config["repos"] for hook in repo["hooks"]]
    assert [hook["entry"] for hook in hooks] == _test_command_checks()
    assert all(hook["language"] == "system" and hook["pass_filenames"] is False for hook in hooks)


def test_the_test_command_runs_the_four_checks() -> None:
    assert [line.split()[0] for line in _test_command_checks()] == [
        ".venv/bin/ruff",
        ".venv/bin/ruff",
        ".venv/bin/mypy",
        ".venv/bin/lint-imports",
    ]
