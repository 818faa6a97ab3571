#!/usr/bin/env bash
# Build the Kubernetes binaries the cluster test tier runs (kube-apiserver, kube-controller-manager,
# kube-scheduler, kubelet) and the pause binary, from Debian bookworm's `kubernetes` source package
# (1.20.5+really1.20.2: its orig tarball carries vendor/, so no module download) with Debian's Go 1.19.
# Everything lands in a cache outside the checkout and is skipped when already there:
#   $AMBIENT_CACHE/k8s/src      unpacked source (about 3.5 GB after a build)
#   $AMBIENT_CACHE/k8s/bin      kube-apiserver kube-controller-manager kube-scheduler kubelet pause
# Cold, this is the long part of the tier (see README: cluster tier); seconds when cached. Needs root (apt) and Debian's archive.
set -euo pipefail
CACHE=${AMBIENT_CACHE:-/var/cache/ambient-mesh}
K8S_DEB_VERSION=1.20.5+really1.20.2-1.1+deb12u1
K8S_SRC_DIR=kubernetes-1.20.2
SRC=$CACHE/k8s/src BIN=$CACHE/k8s/bin
WHAT=${WHAT:-"kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy"}
mkdir -p "$SRC" "$BIN"

missing=()
for b in $WHAT pause; do [ -x "$BIN/$b" ] || missing+=("$b"); done
if [ ${#missing[@]} -eq 0 ]; then echo "build: cached in $BIN ($WHAT pause)"; exit 0; fi
echo "build: to build: ${missing[*]}"

export DEBIAN_FRONTEND=noninteractive
apt_install() {
  local need=()
  for p in "$@"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || need+=("$p"); done
  [ ${#need[@]} -eq 0 ] || { echo "build: apt-get install ${need[*]}"; apt-get install -y -qq -o DPkg::Lock::Timeout=600 --no-install-recommends "${need[@]}" >/dev/null; }
}

# The source package needs a deb-src line; take the archive URI from this machine's own sources.
if ! grep -rqs '^Types:.*deb-src' /etc/apt/sources.list.d/ && ! grep -qs '^deb-src' /etc/apt/sources.list; then
  uri=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  uri=${uri:-http://deb.debian.org/debian}
  printf 'Types: deb-src\nURIs: %s\nSuites: bookworm\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
    "$uri" > /etc/apt/sources.list.d/ambient-mesh-src.sources
  apt-get update -qq -o DPkg::Lock::Timeout=600
fi
# rsync and make drive Kubernetes' build; gcc builds the static pause binary; Debian's reflect2
# 1.0.2 replaces the vendored 1.0.1 (below).
apt_install golang-1.19-go rsync make gcc libc6-dev golang-github-modern-go-reflect2-dev

cd "$SRC"
orig=kubernetes_${K8S_DEB_VERSION%%-*}.orig.tar.gz
[ -f "$orig" ] || apt-get source -qq --download-only "kubernetes=$K8S_DEB_VERSION"
[ -d "$K8S_SRC_DIR" ] || tar xzf "$orig"
cd "$K8S_SRC_DIR"

# Go >= 1.18 breaks the vendored github.com/modern-go/reflect2 v1.0.1: the apiserver faults in
# reflect2.(*UnsafeMapType).UnsafeIterate when it encodes some maps (applying Istio's CRDs does it).
# Bookworm only has Go 1.19, so put Debian's reflect2 v1.0.2 in its place (API-compatible).
marker='# github.com/modern-go/reflect2 v1.0.2 from Debian (ambient-mesh build.sh)'
if ! grep -qF "$marker" vendor/modules.txt; then
  rm -rf vendor/github.com/modern-go/reflect2
  cp -a /usr/share/gocode/src/github.com/modern-go/reflect2 vendor/github.com/modern-go/reflect2
  rm -rf vendor/github.com/modern-go/reflect2/debian vendor/github.com/modern-go/reflect2/*_test.go
  echo "$marker" >> vendor/modules.txt
  rm -f "$BIN"/kube-*
fi

export PATH=/usr/lib/go-1.19/bin:$PATH GOTOOLCHAIN=local
todo=()
for b in $WHAT; do [ -x "$BIN/$b" ] || todo+=("cmd/$b"); done
if [ ${#todo[@]} -gt 0 ]; then
  t0=$(date +%s)
  # One make for every missing binary: code generation runs once and one go build compiles the
  # packages the binaries share once (per binary, the generators alone ran again each time).
  echo "build: make WHAT=\"${todo[*]}\" (log: $CACHE/k8s/build.log)"
  make WHAT="${todo[*]}" >"$CACHE/k8s/build.log" 2>&1 || { tail -30 "$CACHE/k8s/build.log"; exit 1; }
  for t in "${todo[@]}"; do
    b=${t#cmd/}
    install -m 0755 "_output/local/bin/linux/amd64/$b" "$BIN/$b.tmp" && mv "$BIN/$b.tmp" "$BIN/$b"
  done
  echo "build: ${todo[*]} in $(( $(date +%s) - t0 ))s"
fi
# The sandbox ("pause") container's process, from the same source tree: a static binary so the
# image needs nothing else.
if [ ! -x "$BIN/pause" ]; then
  gcc -Os -static -DVERSION=3.4.1-ambient-mesh -o "$BIN/pause.tmp" build/pause/linux/pause.c && mv "$BIN/pause.tmp" "$BIN/pause"
fi
ls -la "$BIN"
