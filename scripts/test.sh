#!/usr/bin/env bash
# Set up (see setup.sh) and run the whole test suite: the lint, format, type and import checks,
# then the unit, in-process integration and network-namespace tiers (the last needs root; it
# skips loudly without it), then the cluster tier (scripts/cluster/test.sh: a one-node
# Kubernetes built from Debian's sources, cached in /var/cache/ambient-mesh; needs root).
#   bash scripts/test.sh                          # everything (what CI runs)
#   AMBIENT_CLUSTER_TIER=0 bash scripts/test.sh   # everything but the cluster tier
#   bash scripts/test.sh [pytest args]            # the checks and the chosen tests; no cluster tier
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "test: ruff check, ruff format --check, mypy, lint-imports"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy            # configuration: [tool.mypy] in pyproject.toml
.venv/bin/lint-imports    # contracts: [tool.importlinter] in pyproject.toml (docs/architecture.md)
# tests/cluster is collected here too and skips itself: the cluster tier runs below, on its own.
env -u AMBIENT_CLUSTER_TIER .venv/bin/python -m pytest -p no:cacheprovider "$@"
if [ $# -eq 0 ]; then
  # The floor on the sans-IO cores ([tool.coverage] in pyproject.toml), measured by their own unit
  # tests run again under coverage: tracing the whole suite slows its timed asyncio tests into
  # failures, while these are pure and take about 35 s traced.
  echo "test: coverage of the sans-IO cores by their unit tests (floor: fail_under in pyproject.toml)"
  rm -f .coverage
  .venv/bin/python -m coverage run -m pytest -q -p no:cacheprovider \
    tests/unit/http2 tests/unit/proxy/hbone/test_protocol.py tests/unit/tls/test_records.py \
    tests/unit/rbac tests/unit/zds/test_codec.py tests/unit/xds/test_convert.py
  .venv/bin/python -m coverage report
fi
if [ $# -gt 0 ]; then
  echo "test: cluster tier not run (pytest arguments given; bash scripts/cluster/test.sh runs it)"
elif [ "${AMBIENT_CLUSTER_TIER:-}" = 0 ]; then
  echo "test: cluster tier not run (AMBIENT_CLUSTER_TIER=0)"
elif [ "$(id -u)" != 0 ]; then
  echo "test: cluster tier SKIPPED: it needs root (it runs a kubelet, containerd and the mesh)"
else
  bash scripts/cluster/test.sh
fi
