#!/usr/bin/env bash
# Set up (see setup.sh) and run the whole test suite: unit, in-process integration and
# network-namespace tiers (the last needs root; it skips loudly without it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "test: ruff check, ruff format --check, mypy, lint-imports"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy            # configuration: [tool.mypy] in pyproject.toml
.venv/bin/lint-imports    # contracts: [tool.importlinter] in pyproject.toml (docs/architecture.md)
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
