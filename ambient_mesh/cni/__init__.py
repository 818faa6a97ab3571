"""The CNI side of ambient (istio-cni): the chained CNI plugin, its installation, and the node
agent that installs in-pod redirection and hands pod network namespaces to the node proxy."""
