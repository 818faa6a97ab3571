#!/usr/bin/env bash
# Install what ambient-mesh needs on a Debian machine, as root: system tools (iproute2,
# iptables, nftables, Node.js for the interop tests, curl for the lab's client pods), a virtual
# environment in .venv and the Python dependencies. Safe to run again; it skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
for tool in ip:iproute2 iptables:iptables nft:nftables node:nodejs gcc:gcc curl:curl; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || need_apt+=("${tool#*:}")
done
# The interpreter: the distribution's CPython, /usr/bin/python3 (AMBIENT_PYTHON names another).
# It is the one a fresh Debian machine runs and the node image ships (scripts/cluster/image.sh),
# and Debian builds it with profile-guided and link-time optimization. A python3 found first on
# PATH may be a build without them (pyenv's default here), on which the proxies spent 40% more
# CPU per small message (docs/performance.md, "How we measure").
python=${AMBIENT_PYTHON:-/usr/bin/python3}
if ! "$python" -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null; then
  if [ -n "${AMBIENT_PYTHON:-}" ]; then
    echo "setup: AMBIENT_PYTHON=$python is not a Python 3.11 or newer (check the path)" >&2
    exit 1
  fi
  need_apt+=(python3)
fi
"$python" -c 'import venv, ensurepip' 2>/dev/null || need_apt+=(python3-venv)
"$python" -c 'import sysconfig, os; assert os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))' \
  2>/dev/null || need_apt+=(python3-dev)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing system packages: ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# A .venv made from another interpreter is made again from this one.
want=$(readlink -f "$python")
if [ -x .venv/bin/python ] && [ "$(readlink -f .venv/bin/python)" != "$want" ]; then
  echo "setup: .venv runs $(readlink -f .venv/bin/python), not $want: making it again"
  rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $want"
  "$python" -m venv .venv
fi
if ! .venv/bin/python -c 'import ambient_mesh, h2, grpc, pytest, hypothesis' 2>/dev/null \
   || [ pyproject.toml -nt .venv/.installed ]; then
  echo "setup: installing Python dependencies"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[test]'
  touch .venv/.installed
fi
