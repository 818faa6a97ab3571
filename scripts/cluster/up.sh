#!/usr/bin/env bash
# A one-node Kubernetes cluster from the cache: etcd (Debian's etcd-server), kube-apiserver,
# kube-controller-manager, kube-scheduler, kube-proxy and a kubelet (built by build.sh from
# Debian's source package), containerd + runc as the kubelet's runtime, the standard bridge /
# host-local / portmap plugins as the primary CNI. Loads the pause image and IMAGE (podman save
# -> ctr import). Stop with down.sh. Prints `export KUBECONFIG=...` at the end.
#   scripts/cluster/up.sh IMAGE
# Facts it relies on (found on this kind of machine): the kubelet refuses a loopback node IP, so
# the node address sits on a veth; kube-controller-manager must run nodelifecycle or the
# not-ready taint stays; containerd 1.6 takes a single CNI bin_dir; the apiserver needs
# --kubelet-preferred-address-types=InternalIP,Hostname for logs and exec.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/env.sh"
IMAGE=${1:?usage: up.sh IMAGE (from image.sh)}
podman_env
log() { echo "cluster: $*" >&2; }
t_start=$(date +%s)

for b in kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy pause; do
  [ -x "$K8S_BIN/$b" ] || { log "missing $K8S_BIN/$b: run scripts/cluster/build.sh"; exit 1; }
done
need=()
for t in etcd:etcd-server containerd:containerd runc:runc ctr:containerd conntrack:conntrack; do
  command -v "${t%%:*}" >/dev/null || need+=("${t#*:}")
done
[ -x /usr/lib/cni/bridge ] || need+=(containernetworking-plugins)
if [ ${#need[@]} -gt 0 ]; then
  log "apt-get install ${need[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=600 --no-install-recommends \
    "${need[@]}" >/dev/null
fi
for p in etcd apiserver kcm containerd kubelet scheduler kube-proxy; do
  if [ -f "$RUN/$p.pid" ] && kill -0 "$(cat "$RUN/$p.pid")" 2>/dev/null; then
    log "$p already running (pid $(cat "$RUN/$p.pid")); run scripts/cluster/down.sh first"; exit 1
  fi
done
mkdir -p "$RUN/containerd" "$CL/pki" "$CL/log" "$CL/kubelet" "$CNI_BIN" "$CNI_NET" "$CL/containerd"

# -- PKI and credentials (kept in the cache) --------------------------------------------------
P=$CL/pki
if [ ! -f "$P/sa.key" ]; then
  openssl genrsa -out "$P/sa.key" 2048 2>/dev/null
  openssl rsa -in "$P/sa.key" -pubout -out "$P/sa.pub" 2>/dev/null
fi
if [ ! -f "$P/apiserver.crt" ] || ! openssl x509 -in "$P/apiserver.crt" -noout -text | grep -q "IP Address:$NODE_IP"; then
  openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj /CN=ambient-mesh-test-ca \
    -keyout "$P/ca.key" -out "$P/ca.crt" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj /CN=kube-apiserver -keyout "$P/apiserver.key" -out "$P/apiserver.csr" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1,IP:%s,IP:%s,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\n' \
    "$NODE_IP" "${SERVICE_CIDR%.0/16}.1" > "$P/san.ext"
  openssl x509 -req -in "$P/apiserver.csr" -CA "$P/ca.crt" -CAkey "$P/ca.key" -CAcreateserial -days 3650 \
    -extfile "$P/san.ext" -out "$P/apiserver.crt" 2>/dev/null
fi
if [ ! -f "$CL/tokens.csv" ]; then
  admin=$(openssl rand -hex 16) kcm=$(openssl rand -hex 16) node=$(openssl rand -hex 16)
  { echo "$admin,admin,admin,system:masters"; echo "$kcm,system:kube-controller-manager,kcm";
    echo "$node,system:node:$NODE_NAME,node,system:nodes"; } > "$CL/tokens.csv"
  chmod 600 "$CL/tokens.csv"
fi
kubeconfig() {  # kubeconfig USER-LINE-NUMBER FILE
  local token; token=$(sed -n "${1}p" "$CL/tokens.csv" | cut -d, -f1)
  cat > "$2" <<KC
apiVersion: v1
kind: Config
clusters:
- name: ambient-test
  cluster: {server: "https://$NODE_IP:$API_PORT", certificate-authority: "$P/ca.crt"}
users:
- name: u
  user: {token: $token}
contexts:
- name: ambient-test
  context: {cluster: ambient-test, user: u}
current-context: ambient-test
KC
  chmod 600 "$2"
}
kubeconfig 1 "$CL/kubeconfig"; kubeconfig 2 "$CL/kubeconfig-kcm"; kubeconfig 3 "$CL/kubeconfig-node"

# -- the node's address: a /32 on a veth (no loopback, no dummy links on this kernel) ----------
if ! ip link show "$NODE_LINK" >/dev/null 2>&1; then
  ip link add "$NODE_LINK" type veth peer name "${NODE_LINK%0}1"
  ip addr add "$NODE_IP/32" dev "$NODE_LINK"
  ip link set "${NODE_LINK%0}1" up; ip link set "$NODE_LINK" up
fi
# The node agent mounts /var/run/netns with HostToContainer propagation, which needs a shared
# mount there (as on a systemd host); `ip netns` makes it one the standard way.
if [ "$(findmnt -n -o TARGET,PROPAGATION --target /run/netns 2>/dev/null)" != "/run/netns shared" ]; then
  ip netns add amk8s-probe && ip netns delete amk8s-probe
fi
# Service traffic to a pod on the same bridge is routed through the node.
cat /proc/sys/net/ipv4/ip_forward > "$RUN/ip_forward"
echo 1 > /proc/sys/net/ipv4/ip_forward

# -- etcd, apiserver, controller-manager -------------------------------------------------------
# Bound service-account tokens, as every Kubernetes since 1.22 has them: pods get projected
# tokens bound to the pod (refused once the pod is deleted), which the node agent's restart and
# the CNI plugin's own token (cni/plugin_token.py) are tested against. On 1.20-1.21 that is the
# BoundServiceAccountTokenVolume gate (with the issuer and signing key flags below); from 1.22 it
# is always on and the gate is gone (naming it then is an error).
minor=$("$K8S_BIN/kube-apiserver" --version | sed -n 's/^Kubernetes v1\.\([0-9]*\)\..*/\1/p')
GATES=()
[ -n "$minor" ] && [ "$minor" -lt 22 ] && GATES=(--feature-gates=BoundServiceAccountTokenVolume=true)
rm -rf "$RUN/etcd"
etcd --name ambient-test --data-dir "$RUN/etcd" \
  --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
  --listen-peer-urls "http://127.0.0.1:$((ETCD_PORT + 10))" --initial-advertise-peer-urls "http://127.0.0.1:$((ETCD_PORT + 10))" \
  --initial-cluster "ambient-test=http://127.0.0.1:$((ETCD_PORT + 10))" \
  --listen-metrics-urls "http://127.0.0.1:$((ETCD_PORT + 20))" > "$CL/log/etcd.log" 2>&1 &
echo $! > "$RUN/etcd.pid"
"$K8S_BIN/kube-apiserver" --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
  --bind-address="$NODE_IP" --advertise-address="$NODE_IP" --secure-port="$API_PORT" --insecure-port=0 \
  --tls-cert-file="$P/apiserver.crt" --tls-private-key-file="$P/apiserver.key" --client-ca-file="$P/ca.crt" \
  --token-auth-file="$CL/tokens.csv" --authorization-mode=Node,RBAC \
  --service-cluster-ip-range="$SERVICE_CIDR" \
  --service-account-key-file="$P/sa.pub" --service-account-signing-key-file="$P/sa.key" \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --api-audiences=https://kubernetes.default.svc.cluster.local,istio-ca \
  --allow-privileged=true --profiling=false --kubelet-preferred-address-types=InternalIP,Hostname \
  "${GATES[@]}" > "$CL/log/apiserver.log" 2>&1 &
echo $! > "$RUN/apiserver.pid"
for _ in $(seq 1 600); do
  [ "$(kubectl get --raw /readyz 2>/dev/null)" = ok ] && break
  kill -0 "$(cat "$RUN/apiserver.pid")" 2>/dev/null || { tail -20 "$CL/log/apiserver.log" >&2; exit 1; }
  sleep 0.2
done
[ "$(kubectl get --raw /readyz 2>/dev/null)" = ok ] || { log "apiserver not ready"; exit 1; }
log "apiserver ready after $(( $(date +%s) - t_start ))s"
kubectl create clusterrolebinding ambient-test-kcm --clusterrole=cluster-admin \
  --user=system:kube-controller-manager >/dev/null 2>&1 || true
"$K8S_BIN/kube-controller-manager" --kubeconfig="$CL/kubeconfig-kcm" --bind-address=127.0.0.1 --secure-port=0 --port=0 \
  --leader-elect=false --use-service-account-credentials=false --service-account-private-key-file="$P/sa.key" \
  --root-ca-file="$P/ca.crt" --cluster-signing-cert-file="$P/ca.crt" --cluster-signing-key-file="$P/ca.key" \
  --controllers='*,-nodeipam,-ttl,-bootstrapsigner,-tokencleaner' "${GATES[@]}" > "$CL/log/kcm.log" 2>&1 &
echo $! > "$RUN/kcm.pid"
"$K8S_BIN/kube-scheduler" --kubeconfig="$CL/kubeconfig-kcm" --leader-elect=false --bind-address=127.0.0.1 \
  --secure-port=0 --port=0 > "$CL/log/scheduler.log" 2>&1 &
echo $! > "$RUN/scheduler.pid"

# -- CNI: bridge/host-local -> portmap (the node agent appends istio-cni) ----------------------
for f in bridge host-local portmap loopback; do ln -sf "/usr/lib/cni/$f" "$CNI_BIN/$f"; done
rm -f "$CNI_NET"/*
cat > "$CNI_NET/10-ambient-test.conflist" <<JSON
{ "cniVersion": "1.0.0", "name": "ambient-test",
  "plugins": [
    { "type": "bridge", "bridge": "$POD_BRIDGE", "isGateway": true, "ipMasq": true, "hairpinMode": true,
      "ipam": { "type": "host-local", "dataDir": "$CL/ipam",
                "ranges": [[{ "subnet": "$POD_CIDR", "gateway": "$POD_GW" }]], "routes": [{ "dst": "0.0.0.0/0" }] } },
    { "type": "portmap", "capabilities": { "portMappings": true } } ] }
JSON
rm -rf "$CL/ipam"

# -- containerd (its image store is kept in the cache) ----------------------------------------
cat > "$CL/containerd/config.toml" <<TOML
version = 2
root = "$CL/containerd/root"
state = "$RUN/containerd/state"
[grpc]
  address = "$CONTAINERD_SOCK"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/ambient-mesh-pause:3.4.1"
  restrict_oom_score_adj = true
  disable_apparmor = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$CNI_BIN"
    conf_dir = "$CNI_NET"
    max_conf_num = 1
TOML
containerd --config "$CL/containerd/config.toml" > "$CL/log/containerd.log" 2>&1 &
echo $! > "$RUN/containerd.pid"
for _ in $(seq 1 100); do [ -S "$CONTAINERD_SOCK" ] && break; sleep 0.1; done
CTR=(ctr --address "$CONTAINERD_SOCK" -n k8s.io)

# -- images: pause (from the Kubernetes source) and ours --------------------------------------
load_image() {  # load_image NAME: podman save -> ctr import, skipped when containerd has it
  local ref=$1 id
  id=$(podman image inspect --format '{{.Id}}' "$ref")
  if "${CTR[@]}" images ls -q | grep -qx "$ref" && [ "$(cat "$CL/containerd/$(echo "$ref" | tr '/:' '__').id" 2>/dev/null)" = "$id" ]; then
    return 0
  fi
  podman save -q --format docker-archive -o "$CL/image.tar" "$ref"
  "${CTR[@]}" images import --no-unpack=false "$CL/image.tar" >/dev/null
  rm -f "$CL/image.tar"
  echo "$id" > "$CL/containerd/$(echo "$ref" | tr '/:' '__').id"
  log "imported $ref into containerd"
}
if ! podman image exists localhost/ambient-mesh-pause:3.4.1; then
  mkdir -p "$CL/pause-ctx/rootfs"
  cp "$K8S_BIN/pause" "$CL/pause-ctx/rootfs/pause"
  printf 'FROM scratch\nCOPY rootfs/ /\nUSER 65535:65535\nENTRYPOINT ["/pause"]\n' > "$CL/pause-ctx/Containerfile"
  podman build -q --network=none -t localhost/ambient-mesh-pause:3.4.1 "$CL/pause-ctx" >/dev/null
fi
load_image localhost/ambient-mesh-pause:3.4.1
load_image "$IMAGE"

# -- kubelet and kube-proxy ---------------------------------------------------------------------
cat > "$CL/kubelet/config.yaml" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $NODE_IP
port: $KUBELET_PORT
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $((KUBELET_PORT - 2))
authentication: {anonymous: {enabled: true}, webhook: {enabled: false}, x509: {clientCAFile: $P/ca.crt}}
authorization: {mode: AlwaysAllow}
cgroupDriver: cgroupfs
cgroupsPerQOS: false
enforceNodeAllocatable: []
failSwapOn: false
clusterDNS: [${SERVICE_CIDR%.0/16}.10]
clusterDomain: cluster.local
resolvConf: /etc/resolv.conf
makeIPTablesUtilChains: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%"}
YAML
# 1.20: the runtime endpoint is a flag (dockershim is the default)
"$K8S_BIN/kubelet" --container-runtime=remote --container-runtime-endpoint="unix://$CONTAINERD_SOCK" \
  --config="$CL/kubelet/config.yaml" --kubeconfig="$CL/kubeconfig-node" --hostname-override="$NODE_NAME" \
  --node-ip="$NODE_IP" --root-dir="$CL/kubelet/root" --cert-dir="$CL/kubelet/pki" --v=1 \
  "${GATES[@]}" > "$CL/log/kubelet.log" 2>&1 &
echo $! > "$RUN/kubelet.pid"
"$K8S_BIN/kube-proxy" --kubeconfig="$CL/kubeconfig" --proxy-mode=iptables --cluster-cidr="$POD_CIDR" \
  --hostname-override="$NODE_NAME" --bind-address="$NODE_IP" --healthz-bind-address=127.0.0.1:$((KUBELET_PORT + 6)) \
  --metrics-bind-address=127.0.0.1:$((KUBELET_PORT + 7)) --conntrack-max-per-core=0 \
  > "$CL/log/kube-proxy.log" 2>&1 &
echo $! > "$RUN/kube-proxy.pid"
for _ in $(seq 1 120); do kubectl get node "$NODE_NAME" >/dev/null 2>&1 && break; sleep 0.5; done
kubectl wait --for=condition=Ready "node/$NODE_NAME" --timeout=120s >/dev/null
# the default ServiceAccount appears once the controller-manager runs; pods need it
for _ in $(seq 1 120); do kubectl get sa default -n default >/dev/null 2>&1 && break; sleep 0.5; done
log "node $NODE_NAME ready after $(( $(date +%s) - t_start ))s"
echo "export KUBECONFIG=$CL/kubeconfig"
