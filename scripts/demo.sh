#!/usr/bin/env bash
# Set up (see setup.sh) and run the demo: the lab's guided tour (a two-node mesh in network
# namespaces: calls over HBONE, who talked to whom, a DENY policy, STRICT mTLS). Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/ambient demo "$@"
