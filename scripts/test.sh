#!/usr/bin/env bash
# Set up (see setup.sh) and run the whole test suite: unit, in-process integration and
# network-namespace tiers (the last needs root; it skips loudly without it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "test: ruff check, ruff format --check"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
