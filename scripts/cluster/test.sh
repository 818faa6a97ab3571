#!/usr/bin/env bash
# The cluster tier: build the Kubernetes binaries (cached in /var/cache/ambient-mesh), then run
# tests/cluster with AMBIENT_CLUSTER_TIER=1, which brings a one-node cluster up (up.sh), loads
# the image (image.sh), applies the mesh overlay, checks, and takes it down (down.sh). As root.
#   bash scripts/cluster/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup.sh
# One cluster per host (fixed paths under the cache, the API server's port): a second run waits.
mkdir -p "${AMBIENT_CACHE:-/var/cache/ambient-mesh}"
exec 9>"${AMBIENT_CACHE:-/var/cache/ambient-mesh}/cluster-tier.lock"
flock -w 3600 9 || { echo "cluster tier: another run holds the lock for an hour" >&2; exit 1; }
t0=$(date +%s)
bash scripts/cluster/build.sh
status=0
AMBIENT_CLUSTER_TIER=1 .venv/bin/python -m pytest -p no:cacheprovider tests/cluster -s -v -rs "$@" || status=$?
echo "cluster tier: $(( $(date +%s) - t0 ))s (exit $status)"
exit $status
