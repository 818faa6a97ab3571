"""Kubernetes access shared by the node agent, the CNI plugin and the control plane.

- `kubeconfig`: the one reader of kubeconfigs and of the in-cluster service account (client-go's
  clientcmd and rest.InClusterConfig). Standard library only: the CNI plugin imports it on every
  pod start.
- `labels`: Kubernetes label selectors (apimachinery's labels/LabelSelector semantics).
- `client`: an asyncio API client on lightkube (list, get, patch, create, streamed watch).
- `reflector`: list, then watch from the list's resourceVersion, with bookmarks and a relist on
  410 Gone (client-go's Reflector).
- `objects`: the Kubernetes and Istio objects the mesh reads (Pods, Namespaces, Services,
  ServiceEntries, Gateways, policies), parsed strictly from YAML or the API's JSON, the
  `KubeStore` of them, and the YAML-directory loader and watcher (istiod's informer caches).
- `yaml_loader`: the faster libyaml loader `objects` decodes large directories with.

Nothing here is imported by this `__init__`, so importing `kube.kubeconfig` stays cheap.
"""
