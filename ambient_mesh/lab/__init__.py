"""`ambient lab`: a whole multi-node ambient mesh on one host, in network namespaces: the lab is
the primary CNI and the kubelet; it runs the control plane and, per node, the node agent and the
node proxy as their own processes."""
