#!/usr/bin/env bash
# Set up (see setup.sh) and run the demo: two node proxies, one connection over HBONE/mTLS.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/ambient demo "$@"
