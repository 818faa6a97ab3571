"""The embedded control plane: the part of istiod that ambient needs (workload discovery over
delta xDS, authorization translation, and the CA), serving node proxies from Kubernetes-style
objects read from YAML files."""
