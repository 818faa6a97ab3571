"""Translation from Kubernetes objects to the resources istiod serves ztunnel.

Counterpart of istiod's ambient index (pilot/pkg/serviceregistry/kube/controller/ambient), split
the way istiod splits it, one job per module:

  common.py              helpers.go and MeshConfig: settings, IPs, protocols, locality
  context.py             what each step may read (objects, waypoints, service and policy indexes)
  waypoints.py           waypoints.go: Gateways as waypoints, which waypoint an object uses
  services.py            services.go: Services and ServiceEntries as `istio.workload.Service`
  workloads.py           workloads.go: Pods, WorkloadEntries, ServiceEntry endpoints as workloads
  authorization.py       authorization.go: AuthorizationPolicy -> `istio.security.Authorization`
  peer_authentication.py authorization.go: PeerAuthentication -> static strict / converted DENY
  policies.py            policies.go, buildWorkloadPolicies: which policies a workload references
  index.py               ambientindex.go: `AmbientIndex`, the same translation kept up to date
                         per changed object

`translate` is a pure function: a `KubeStore` snapshot and `MeshSettings` in,
`istio.workload.Address` resources keyed by their xDS name (workload uid, or `namespace/hostname`)
and `istio.security.Authorization` resources keyed by `namespace/name` out, plus notes for what
was skipped and why (istiod writes those to object status).

Where this differs from istiod, on purpose:
- Enrollment. istiod sends HBONE for a pod only once istio-cni has annotated it
  (`ambient.istio.io/redirection: enabled`). Files on disk never carry that annotation, so a pod
  that the node agent would enroll (its own or its namespace's `istio.io/dataplane-mode=ambient`,
  not opted out with another value, no sidecar, not host-network) counts as enrolled too.
- API-server defaults are applied here because nobody else does: a pod without a service account
  runs as `default`, a service port without targetPort targets its own port.
- Not modelled: EndpointSlice-only endpoints, network gateways (multi-network), GatewayClass
  traffic types (a waypoint's type comes from its `istio.io/waypoint-for` label, default
  `service`), ServiceEntry address auto-allocation, service visibility, waypoint canaries and the
  implicit allow-from-waypoint policies (off by default in istiod).
"""

from __future__ import annotations

from ...kube.store import KubeStore
from ...wire.istio.workload import workload_pb2 as wl
from .common import MeshSettings, Translation
from .context import Context, ServiceIndex, ServiceInfo
from .index import AmbientIndex, TranslationDelta
from .policies import translate_authorizations
from .services import kube_service, select_services, service_entry_services
from .waypoints import build_waypoints
from .workloads import pod_workload, service_entry_workloads, workload_entry_workload

__all__ = ["AmbientIndex", "MeshSettings", "Translation", "TranslationDelta", "translate"]


def translate(store: KubeStore, settings: MeshSettings | None = None) -> Translation:
    """Everything istiod would serve ztunnel for this snapshot."""
    settings = settings or MeshSettings()
    authorizations, policies, notes = translate_authorizations(store, settings)
    ctx = Context(
        objects=store,
        settings=settings,
        waypoints=build_waypoints(store, settings),
        services=ServiceIndex(),
        policies=policies,
        notes=notes,
    )
    infos: list[ServiceInfo] = []
    for svc in store.services:
        info = kube_service(ctx, svc)
        if info is not None:
            infos.append(info)
    for se in store.service_entries:
        infos.extend(service_entry_services(ctx, se))
    winners = select_services(infos)
    ctx.services = ServiceIndex(winners)
    addresses: dict[str, wl.Address] = {}
    for info in winners:
        addresses[info.key] = wl.Address(service=info.service)
    workloads: list[wl.Workload] = []
    for pod in store.pods:
        w = pod_workload(ctx, pod)
        if w is not None:
            workloads.append(w)
    for we in store.workload_entries:
        workloads.append(workload_entry_workload(ctx, we))
    for se in store.service_entries:
        workloads.extend(service_entry_workloads(ctx, se))
    for w in workloads:
        if w.uid in addresses:
            ctx.notes.append(f"workload {w.uid}: duplicate uid, later one dropped")
            continue
        addresses[w.uid] = wl.Address(workload=w)
    return Translation(addresses=addresses, authorizations=authorizations, notes=tuple(ctx.notes))
