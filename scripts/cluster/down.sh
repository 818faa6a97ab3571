#!/usr/bin/env bash
# Stop the test cluster that up.sh started: pods first (through the kubelet, so CNI DEL runs),
# then each process by its PID file, then the links, mounts and iptables chains it made.
# Safe to run when nothing is up. Keeps the cache (binaries, images, PKI).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/env.sh"
stop() {  # stop NAME: the process in $RUN/NAME.pid, TERM then KILL
  local f=$RUN/$1.pid pid
  [ -f "$f" ] || return 0
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null
  fi
  rm -f "$f"
}
if [ -f "$RUN/apiserver.pid" ] && kill -0 "$(cat "$RUN/apiserver.pid")" 2>/dev/null && [ -f "$RUN/kubelet.pid" ]; then
  for ns in $(kubectl get ns -l ambient-mesh-test=true -o name 2>/dev/null); do
    kubectl delete "$ns" --wait=false >/dev/null 2>&1
  done
fi
for p in kube-proxy scheduler kubelet; do stop $p; done
if [ -S "$CONTAINERD_SOCK" ]; then
  for t in $(ctr --address "$CONTAINERD_SOCK" -n k8s.io tasks ls -q 2>/dev/null); do
    ctr --address "$CONTAINERD_SOCK" -n k8s.io tasks kill -s KILL "$t" >/dev/null 2>&1
  done
  sleep 1
  # the next cluster's etcd starts empty: containers of this one would be stale sandboxes there
  for t in $(ctr --address "$CONTAINERD_SOCK" -n k8s.io tasks ls -q 2>/dev/null); do
    ctr --address "$CONTAINERD_SOCK" -n k8s.io tasks delete -f "$t" >/dev/null 2>&1
  done
  netns=()
  for c in $(ctr --address "$CONTAINERD_SOCK" -n k8s.io containers ls -q 2>/dev/null); do
    # the pod network namespaces containerd made (their names are in the containers' specs)
    netns+=($(ctr --address "$CONTAINERD_SOCK" -n k8s.io containers info "$c" 2>/dev/null \
      | grep -o '"/var/run/netns/cni-[0-9a-f-]*"' | tr -d '"'))
    ctr --address "$CONTAINERD_SOCK" -n k8s.io containers rm "$c" >/dev/null 2>&1
  done
  for n in $(printf '%s\n' "${netns[@]}" | sort -u); do
    ip netns delete "$(basename "$n")" 2>/dev/null
  done
fi
stop containerd
# shims outlive containerd; these are ours (their -address is our socket)
for pid in $(pgrep -f "containerd-shim-runc-v2 -namespace k8s.io -id [0-9a-f]+ -address $CONTAINERD_SOCK" 2>/dev/null); do
  kill "$pid" 2>/dev/null
done
for p in kcm apiserver etcd; do stop $p; done
# the kubelet makes its root dir and pod volumes mounts; netns files are bind mounts too; and
# containerd mounts each sandbox's /dev/shm (a tmpfs) under its state dir in $RUN, which
# `rm -rf $RUN` below cannot remove while mounted (three were left after each run)
grep -o -e " $CL/[^ ]*" -e " $RUN/[^ ]*" /proc/mounts | sort -r | while read -r m; do umount -l "$m" 2>/dev/null; done
for l in $POD_BRIDGE $NODE_LINK; do ip link del "$l" 2>/dev/null; done
# kube-proxy's and portmap's chains (they only exist because this cluster made them)
for table in nat filter mangle; do
  iptables-save -t $table 2>/dev/null | grep -q -- '-j KUBE-\|:KUBE-\|:CNI-' || continue
  iptables-save -t $table | grep -v -- '-j KUBE-\|^:KUBE-\|-A KUBE-\|-j CNI-\|^:CNI-\|-A CNI-' | iptables-restore -T $table 2>/dev/null
done
for top in /sys/fs/cgroup/*/k8s.io /sys/fs/cgroup/k8s.io /sys/fs/cgroup/*/kubepods* /sys/fs/cgroup/kubepods*; do
  [ -d "$top" ] && find "$top" -depth -type d -exec rmdir {} \; 2>/dev/null
done
[ -f "$RUN/ip_forward" ] && cat "$RUN/ip_forward" > /proc/sys/net/ipv4/ip_forward
rm -rf "$RUN" "$CL/ipam" "$CL/kubelet/pods"
left=$(grep -c -e " $CL/" -e " $RUN/" /proc/mounts)
[ "$left" -eq 0 ] || echo "cluster: $left mounts under $CL or $RUN remain (see /proc/mounts)" >&2
echo "cluster: down"
