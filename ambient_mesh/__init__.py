"""ambient-mesh: Istio's ambient-mode data plane in Python.

Counterparts: istio/ztunnel (node proxy), istio/istio cni/ (node agent and plugin),
istio/istio pilot ambient index and CA (embedded control plane).
"""

__version__ = "0.1.0"
