"""Kubernetes access shared by the node agent, the CNI plugin and the control plane.

- `kubeconfig`: the one reader of kubeconfigs and of the in-cluster service account (client-go's
  clientcmd and rest.InClusterConfig). Standard library only: the CNI plugin imports it on every
  pod start.
- `labels`: Kubernetes label selectors (apimachinery's labels/LabelSelector semantics).
- `client`: an asyncio API client on lightkube (list, get, patch, create, streamed watch).
- `reflector`: list, then watch from the list's resourceVersion, with bookmarks and a relist on
  410 Gone (client-go's Reflector).
- The objects the mesh reads (Pods, Namespaces, Services, ServiceEntries, Gateways, routes,
  policies), parsed strictly from YAML or the API's JSON (istiod's informer caches):
  - `model`: the objects, as frozen dataclasses;
  - `fields`: typed, path-tracking reads of a decoded document, and what every kind shares
    (metadata, selectors, a custom resource's top level, durations);
  - `parse_core`, `parse_istio`, `parse_gateway`: one parser per kind, by API group;
  - `decode`: which YAML decoder reads a text (`yaml_loader`'s plain reader, libyaml, or the
    bounded pure-Python loader);
  - `load`: one text, file or directory -> objects, with a `LoadError` per bad object;
  - `store`: `KubeStore`, the immutable snapshot indexed by kind;
  - `watch`: `DirectoryWatcher`, polling a directory and reporting each changed snapshot.
- `yaml_loader`: the faster libyaml loader `decode` reads large directories with.

Nothing here is imported by this `__init__`, so importing `kube.kubeconfig` stays cheap.
"""
