#!/usr/bin/env bash
# Freeze the chained CNI plugin (ambient_mesh.cni.plugin) into a self-contained bundle that runs
# on a node with no Python: PyInstaller "onedir" (the executable `istio-cni` beside its own
# interpreter, stdlib and libraries), stripped, without the modules the plugin never imports.
# onedir rather than onefile: a onefile executable unpacks itself into a temp dir on every run,
# which alone costs several times the 100 ms an ADD may take (bench/cni_plugin_bench.py).
# The node agent copies the whole directory into the host's CNI bin dir (cni/install.py).
#
# Output: $AMBIENT_CACHE/plugin/dist/istio-cni/ (rebuilt only when the plugin's sources or the
# tool versions change).  Usage: scripts/cluster/plugin.sh [--print-dir]
set -euo pipefail
cd "$(dirname "$0")/../.."
CACHE=${AMBIENT_CACHE:-/var/cache/ambient-mesh}
P=$CACHE/plugin
PYINSTALLER_VERSION=6.22.3
OUT=$P/dist/istio-cni
mkdir -p "$P"

# Everything the static analysis would drag in that the plugin never imports is left out
# (deploy/plugin/excludes.txt says why, and a unit test holds the plugin to it).
mapfile -t EXCLUDES < <(grep -v '^\s*\(#\|$\)' deploy/plugin/excludes.txt)

stamp=$( { echo "$PYINSTALLER_VERSION ${EXCLUDES[*]}"; python3 -VV; sed -n '/^sed -i/p' "$0";
  cat deploy/plugin/istio-cni.py; find ambient_mesh -name '*.py' | sort | xargs cat; } | sha256sum | cut -c1-16)
if [ -x "$OUT/istio-cni" ] && [ "$(cat "$P/dist/.stamp" 2>/dev/null)" = "$stamp" ]; then
  [ "${1:-}" = --print-dir ] && echo "$OUT" || echo "plugin: cached $OUT"
  exit 0
fi
if [ ! -x "$P/venv/bin/pyinstaller" ] || ! "$P/venv/bin/pyinstaller" --version 2>/dev/null | grep -qx "$PYINSTALLER_VERSION"; then
  rm -rf "$P/venv"
  python3 -m venv "$P/venv"
  # PyYAML: the plugin reads a YAML pod directory (the lab) or a hand-written kubeconfig
  "$P/venv/bin/pip" install -q "pyinstaller==$PYINSTALLER_VERSION" "pyyaml>=6" 2>&1 | grep -v '^WARNING: Location' >&2 || true
fi
command -v objdump >/dev/null || { export DEBIAN_FRONTEND=noninteractive; apt-get install -y -qq -o DPkg::Lock::Timeout=600 binutils >/dev/null; }
t0=$(date +%s)
args=()
for m in "${EXCLUDES[@]}"; do args+=(--exclude-module "$m"); done
rm -rf "$P/work" "$P/dist.new"
mkdir -p "$P/work"
"$P/venv/bin/pyi-makespec" --log-level WARN --onedir --strip --name istio-cni "${args[@]}" \
  --paths "$PWD" --specpath "$P/work" deploy/plugin/istio-cni.py >/dev/null
# PyInstaller adds a runtime hook that imports `inspect` (with ast, dis, tokenize...) at every
# start, so that inspect can find the source of frozen modules; nothing here asks for source,
# and the import is about a third of a handed-over ADD's CPU (bench/cni_plugin_bench.py).
sed -i 's/^pyz = PYZ(a.pure)$/a.scripts = [s for s in a.scripts if s[0] != "pyi_rth_inspect"]\n&/' "$P/work/istio-cni.spec"
grep -q pyi_rth_inspect "$P/work/istio-cni.spec" || { echo "plugin.sh: the spec's PYZ line moved; fix the runtime-hook filter" >&2; exit 1; }
"$P/venv/bin/pyinstaller" -y --log-level WARN --distpath "$P/dist.new" --workpath "$P/work" "$P/work/istio-cni.spec" >&2
! grep -aq pyi_rth_inspect "$P/dist.new/istio-cni/istio-cni" || { echo "plugin.sh: the inspect runtime hook is still in the bundle" >&2; exit 1; }
# the bundle must answer VERSION before it replaces the cached one
CNI_COMMAND=VERSION "$P/dist.new/istio-cni/istio-cni" | grep -q supportedVersions
rm -rf "$P/dist"; mv "$P/dist.new" "$P/dist"; echo "$stamp" > "$P/dist/.stamp"
[ "${1:-}" = --print-dir ] && echo "$OUT" || echo "plugin: built $OUT in $(( $(date +%s) - t0 ))s, $(du -sh "$OUT" | cut -f1)"
