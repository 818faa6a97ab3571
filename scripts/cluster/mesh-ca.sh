#!/usr/bin/env bash
# Give a whole-mesh install (deploy/overlays/mesh) its CA, in Istio's plugged-in CA layout:
# Secret istio-system/cacerts (ca-cert.pem, ca-key.pem, root-cert.pem, cert-chain.pem), which
# `ambient control` signs with (ROOT_CA_DIR). The proxies' ConfigMap istio-ca-root-cert is
# written by `ambient control` itself into every namespace, as istiod's namespace controller
# does. An existing DIR with those files is used as is.
#   scripts/cluster/mesh-ca.sh DIR     (kubectl talks to the cluster in $KUBECONFIG)
set -euo pipefail
D=${1:?usage: mesh-ca.sh DIR}
mkdir -p "$D"
if [ ! -f "$D/ca-key.pem" ]; then
  # one self-signed EC P-256 root that signs workload certificates directly
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 3650 \
    -subj "/O=cluster.local/CN=ambient-mesh root CA" \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign \
    -keyout "$D/ca-key.pem" -out "$D/ca-cert.pem" 2>/dev/null
  chmod 600 "$D/ca-key.pem"
  cp "$D/ca-cert.pem" "$D/root-cert.pem"
  cp "$D/ca-cert.pem" "$D/cert-chain.pem"
fi
kubectl create namespace istio-system --dry-run=client -o yaml | kubectl apply -f - >/dev/null
kubectl create secret generic cacerts -n istio-system --from-file="$D/ca-cert.pem" --from-file="$D/ca-key.pem" \
  --from-file="$D/root-cert.pem" --from-file="$D/cert-chain.pem" --dry-run=client -o yaml | kubectl apply -f - >/dev/null
echo "mesh-ca: cacerts in istio-system from $D"
