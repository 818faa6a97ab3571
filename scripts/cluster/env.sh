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
