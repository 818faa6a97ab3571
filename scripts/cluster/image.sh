#!/usr/bin/env bash
# Build the ambient-mesh image (deploy/Containerfile) without a registry: the base is a
# debootstrap bookworm root from Debian's archive, imported into podman; dependencies go in as
# wheels; the CNI plugin is frozen by plugin.sh. Everything is cached under $AMBIENT_CACHE:
#   rootfs-bookworm/   the debootstrap root (about 1 min cold)
#   containers/        podman's image store (base and built images)
#   image-context/     wheels/ and cni-plugin/ for the build
# Tags it localhost/ambient-mesh:<id> and localhost/ambient-mesh:latest (what deploy/overlays
# name); prints localhost/ambient-mesh:<id> on the last line of stdout. The same commit builds
# the same image ID: file times and the image's dates are SOURCE_DATE_EPOCH (the commit's time,
# or 1980-01-01 outside a git checkout), and Python's bytecode is hash-checked, not dated.
#   scripts/cluster/image.sh [--base IMAGE]   (--base: an ordinary Debian image instead)
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=$PWD/scripts/cluster
. "$HERE/env.sh"
podman_env
BASE_TAG=localhost/ambient-mesh-base:bookworm
IMAGE=localhost/ambient-mesh
BASE=""
[ "${1:-}" = --base ] && BASE=${2:?--base needs an image}
log() { echo "image: $*" >&2; }

need=()
for t in podman:podman buildah:buildah runc:runc debootstrap:debootstrap objdump:binutils; do
  command -v "${t%%:*}" >/dev/null || need+=("${t#*:}")
done
if [ ${#need[@]} -gt 0 ]; then
  log "apt-get install ${need[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=600 --no-install-recommends \
    "${need[@]}" fuse-overlayfs >/dev/null
fi
[ -x .venv/bin/pip ] || bash scripts/setup.sh >&2

if [ -z "$BASE" ]; then
  BASE=$BASE_TAG
  R=$CACHE/rootfs-bookworm
  if [ ! -f "$R/.complete" ]; then
    uri=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
    rm -rf "$R"; mkdir -p "$R"
    t0=$(date +%s)
    debootstrap --variant=minbase --include=python3,iptables,nftables,iproute2,procps,ca-certificates \
      bookworm "$R" "${uri:-http://deb.debian.org/debian}" > "$CACHE/debootstrap.log" 2>&1 \
      || { tail -20 "$CACHE/debootstrap.log" >&2; exit 1; }
    # what a slim Debian image leaves out too: package caches, docs, man pages, translations
    rm -rf "$R"/var/cache/apt/archives/*.deb "$R"/var/lib/apt/lists/* "$R"/usr/share/doc/* \
      "$R"/usr/share/man/* "$R"/usr/share/locale/* "$R"/usr/share/info/*
    touch "$R/.complete"
    log "debootstrap in $(( $(date +%s) - t0 ))s, $(du -sh "$R" | cut -f1)"
  fi
  if ! podman image exists "$BASE_TAG" || [ "$R/.complete" -nt "$CACHE/containers/.base-imported" ]; then
    tar -C "$R" --exclude=./.complete --exclude='./dev/*' --exclude='./proc/*' --exclude='./sys/*' -c . \
      | podman import -q - "$BASE_TAG" >/dev/null
    touch "$CACHE/containers/.base-imported"
    log "imported $BASE_TAG"
  fi
fi

CTX=$CACHE/image-context
mkdir -p "$CTX/wheels"
# Dependencies: re-fetched only when pyproject.toml changes; ours rebuilt every time, with a fixed
# timestamp so unchanged sources give the same wheel and podman's layer cache holds.
deps_stamp=$(sha256sum pyproject.toml | cut -c1-16)
if [ "$(cat "$CTX/wheels/.deps" 2>/dev/null)" != "$deps_stamp" ]; then
  rm -rf "$CTX/wheels"; mkdir -p "$CTX/wheels"
  .venv/bin/pip wheel -q --wheel-dir "$CTX/wheels" . pip 2>&1 | grep -v '^WARNING: Location' >&2 || true
  echo "$deps_stamp" > "$CTX/wheels/.deps"
fi
rm -f "$CTX"/wheels/ambient_mesh-*.whl
rm -rf "$CACHE/wheel-build"; mkdir -p "$CACHE/wheel-build"
cp -a pyproject.toml ambient_mesh "$CACHE/wheel-build/"
find "$CACHE/wheel-build" -name '*.so' -delete  # no compiled module of ours: a stale one must not ride along
(cd "$CACHE/wheel-build" && find . -exec touch -h -d @315532800 {} + \
  && SOURCE_DATE_EPOCH=315532800 "$OLDPWD/.venv/bin/pip" wheel -q --no-deps --no-build-isolation \
       --wheel-dir "$CTX/wheels" . 2>&1 | grep -v '^WARNING: Location' >&2 || true)
ls "$CTX"/wheels/ambient_mesh-*.whl >/dev/null
plugin=$(bash scripts/cluster/plugin.sh --print-dir)
rm -rf "$CTX/cni-plugin"; cp -a "$plugin" "$CTX/cni-plugin"
cp deploy/Containerfile "$CTX/Containerfile"

# The commit's time (a tree with changes gets the same: they still change the image's content).
SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 315532800)}
export SOURCE_DATE_EPOCH
t0=$(date +%s)
net=()
[ "$BASE" = "$BASE_TAG" ] && net=(--network=none)   # everything is local: no network in RUN
# --timestamp: every layer's file times and the image's created date are SOURCE_DATE_EPOCH;
# the build argument reaches RUN, where pip's bytecode compiling then writes hash-checked .pyc.
podman build -q "${net[@]}" --timestamp "$SOURCE_DATE_EPOCH" --build-arg "BASE_IMAGE=$BASE" \
  --build-arg "SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH" -t "$IMAGE:build" "$CTX" >/dev/null
id=$(podman image inspect --format '{{.Id}}' "$IMAGE:build" | cut -c1-12)
podman tag "$IMAGE:build" "$IMAGE:$id"
podman tag "$IMAGE:build" "$IMAGE:latest"
# the build stage and images of earlier builds would pile up in the cache
for old in $(podman images --format '{{.Repository}}:{{.Tag}}' "$IMAGE" | grep -v -e ":build$" -e ":$id$" -e ":latest$"); do
  podman rmi -f "$old" >/dev/null 2>&1 || true
done
podman image prune -f >/dev/null 2>&1 || true
size=$(podman image inspect --format '{{.Size}}' "$IMAGE:$id")
log "built $IMAGE:$id in $(( $(date +%s) - t0 ))s, $(( size / 1000000 )) MB"
echo "$IMAGE:$id"
