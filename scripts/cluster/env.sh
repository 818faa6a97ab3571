# Shared names for the one-node test cluster (sourced by up.sh, down.sh and tests/cluster).
# Everything lives under $AMBIENT_CACHE/cluster (kept: PKI, containerd's image store) and
# /run/ambient-mesh-cluster (runtime state); addresses are private ranges no one else here uses.
CACHE=${AMBIENT_CACHE:-/var/cache/ambient-mesh}
K8S_BIN=$CACHE/k8s/bin
CL=$CACHE/cluster
RUN=/run/ambient-mesh-cluster
NODE_NAME=ambient-node
NODE_IP=10.188.0.1
NODE_LINK=amk8s-node0
POD_CIDR=10.188.1.0/24
POD_GW=10.188.1.1
POD_BRIDGE=amk8s0
SERVICE_CIDR=10.189.0.0/16
# a fixed ClusterIP for istiod, so the node proxy's /etc/hosts can name it (no cluster DNS here)
ISTIOD_IP=10.189.0.15
ETCD_PORT=23890
API_PORT=16543
KUBELET_PORT=20350
CONTAINERD_SOCK=$RUN/containerd/containerd.sock
CNI_BIN=$CL/cni/bin
CNI_NET=$CL/cni/net.d
export KUBECONFIG=$CL/kubeconfig

# podman's image store for the project's images (image.sh builds, up.sh loads into containerd),
# under the same cache: a storage.conf written there, so another AMBIENT_CACHE is another store.
# The default cache keeps the run root it always had (podman refuses a store whose run root moved).
podman_env() {
  local runroot=/run/ambient-mesh-containers
  [ "$CACHE" = /var/cache/ambient-mesh ] || runroot=$runroot-$(printf %s "$CACHE" | sha256sum | cut -c1-8)
  mkdir -p "$CACHE/containers"
  printf '[storage]\ndriver = "overlay"\nrunroot = "%s"\ngraphroot = "%s"\n' "$runroot" "$CACHE/containers" \
    > "$CACHE/storage.conf"
  export CONTAINERS_CONF=$(dirname "${BASH_SOURCE[0]}")/containers.conf CONTAINERS_STORAGE_CONF=$CACHE/storage.conf
}
