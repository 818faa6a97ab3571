"""istioctl's diagnostics for the ambient mesh, and `ambient explain`.

Counterparts: `istioctl analyze` (analyze.py), `istioctl x describe pod|service` (describe.py),
`istioctl proxy-status` (proxy_status.py); `ambient explain` (explain.py) has none. Each reads
one `MeshView` (view.py): the objects of a lab, a directory of YAML or a cluster, with the
conditions the control plane computes for them, and answers with the control plane's and the
data plane's own functions (translation, routing, authorization), never a copy of their rules.
"""

from .view import MeshView, cluster_view, directory_view, lab_view

__all__ = ["MeshView", "cluster_view", "directory_view", "lab_view"]
