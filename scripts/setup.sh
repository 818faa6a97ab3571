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
python3 -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null || need_apt+=(python3)
python3 -c 'import venv, ensurepip' 2>/dev/null || need_apt+=(python3-venv)
python3 -c 'import sysconfig, os; assert os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))' \
  2>/dev/null || need_apt+=(python3-dev)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing system packages: ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  python3 -m venv .venv
fi
if ! .venv/bin/python -c 'import ambient_mesh, h2, grpc, pytest, hypothesis' 2>/dev/null \
   || [ pyproject.toml -nt .venv/.installed ]; then
  echo "setup: installing Python dependencies"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[test]'
  touch .venv/.installed
fi
