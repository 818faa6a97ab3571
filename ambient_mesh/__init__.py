"""ambient-mesh: Istio's ambient-mode data plane in Python.

Counterparts: istio/ztunnel (node proxy), istio/istio cni/ (node agent and plugin),
istio/istio pilot ambient index and CA (embedded control plane).
"""

import os

__version__ = "0.1.0"

# gRPC's fork handlers run in every forked child, including the short-lived child that only
# execs a worker process or a command. With gRPC's threads busy they are skipped half-way and the
# child has been seen to die of SIGSEGV before its exec. Nothing here uses gRPC in a forked child,
# so the handlers are turned off before gRPC is first imported (an operator's setting wins).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
