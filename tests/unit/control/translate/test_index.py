"""control/translate/index.py: a workload sees the Services and policies of its own namespace and
of the root namespace only."""

from __future__ import annotations

from ambient_mesh.control.translate import translate
from ambient_mesh.kube.load import parse_documents
from ambient_mesh.kube.store import KubeStore

# -- translation indexes ----------------------------------------------------------------------------


MESH = """\
apiVersion: v1
kind: Namespace
metadata: {name: istio-system}
---
apiVersion: v1
kind: Namespace
metadata: {name: a, labels: {istio.io/dataplane-mode: ambient}}
---
apiVersion: v1
kind: Namespace
metadata: {name: b, labels: {istio.io/dataplane-mode: ambient}}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: a}
spec: {clusterIP: 10.96.0.1, selector: {app: web}, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: b}
spec: {clusterIP: 10.96.0.2, selector: {app: web}, ports: [{port: 80}]}
---
apiVersion: v1
kind: Pod
metadata: {name: web-a, namespace: a, labels: {app: web}}
spec: {nodeName: n1}
status: {podIP: 10.0.0.1, conditions: [{type: Ready, status: "True"}]}
---
apiVersion: v1
kind: Pod
metadata: {name: web-b, namespace: b, labels: {app: web}}
spec: {nodeName: n1}
status: {podIP: 10.0.0.2, conditions: [{type: Ready, status: "True"}]}
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: in-a, namespace: a}
spec: {selector: {matchLabels: {app: web}}, action: ALLOW}
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: everywhere, namespace: istio-system}
spec: {selector: {matchLabels: {app: web}}, action: DENY}
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: empty-selector, namespace: b}
spec: {selector: {matchLabels: {}}, action: ALLOW}
---
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: default, namespace: istio-system}
spec: {mtls: {mode: STRICT}}
---
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: relaxed, namespace: b}
spec: {selector: {matchLabels: {app: web}}, mtls: {mode: PERMISSIVE}}
"""


def test_workloads_see_only_their_namespace_and_the_root_namespace() -> None:
    loaded = parse_documents(MESH, "mesh.yaml")
    assert loaded.errors == ()
    out = translate(KubeStore(loaded.objects))
    web_a = out.addresses["Kubernetes//Pod/a/web-a"].workload
    web_b = out.addresses["Kubernetes//Pod/b/web-b"].workload
    assert list(web_a.services) == ["a/web.a.svc.cluster.local"]
    assert list(web_b.services) == ["b/web.b.svc.cluster.local"]
    assert list(web_a.authorization_policies) == [
        "a/in-a",
        "istio-system/everywhere",
        "istio-system/istio_converted_static_strict",
    ]
    # b's workload PeerAuthentication is PERMISSIVE, and its empty selector attaches nothing.
    assert list(web_b.authorization_policies) == ["istio-system/everywhere"]
