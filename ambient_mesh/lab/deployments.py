"""The lab's Deployment controller: one Pod per waypoint Deployment, gone with it.

Counterpart: the Deployment and ReplicaSet controllers and the scheduler, cut to what the lab
needs: `ambient control --deploy-waypoints` writes a Deployment per waypoint Gateway (as istiod
asks the API server), and this turns each into one Pod object, Pending on the node with the
fewest pods, whose container runs `ambient waypoint` (as control/waypoint_render.py renders it for
both the lab and Kubernetes; Istio's `proxy waypoint` container). The kubelet (`Lab.reconcile_pods`) then creates its sandbox and runs it. A Pod whose
Deployment is gone is deleted. Other Deployments are not run (the lab's apps are its own images).

`plan` is pure: the Deployments, the controller's Pods and the nodes in, what to create and
delete out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..control.waypoint_render import runs_waypoint
from .cluster import PodSpec

# On a Pod this controller created: the Deployment it belongs to (`namespace/name`).
DEPLOYMENT_LABEL = "ambient-lab/deployment"
# Deployment names are DNS labels; the pod's name adds `-0`.
POD_SUFFIX = "-0"


@dataclass(frozen=True, slots=True, kw_only=True)
class DeploymentPlan:
    create: tuple[PodSpec, ...] = ()
    delete: tuple[str, ...] = ()  # pod keys
    skipped: tuple[str, ...] = ()  # why a Deployment is not run, one line each


def plan(
    deployments: Sequence[Mapping[str, Any]],
    controlled_pods: Mapping[str, str],
    nodes: Sequence[str],
    pods_per_node: Mapping[str, int],
    other_pods: frozenset[str] = frozenset(),
) -> DeploymentPlan:
    """`controlled_pods`: pod key -> its DEPLOYMENT_LABEL, for the Pods this controller made;
    `other_pods`: the keys of every other Pod (a name taken is not created again)."""
    create: list[PodSpec] = []
    skipped: list[str] = []
    wanted: set[str] = set()
    load = {n: pods_per_node.get(n, 0) for n in nodes}
    for doc in deployments:
        meta = doc.get("metadata") or {}
        ns, name = meta.get("namespace") or "default", meta.get("name")
        if not isinstance(name, str) or not name:
            continue
        ref = f"{ns}/{name}"
        template = (doc.get("spec") or {}).get("template") or {}
        if not runs_waypoint(template):
            skipped.append(f"deployment {ref}: not run (the lab runs waypoint Deployments only)")
            continue
        pod_key = f"{ns}/{name}{POD_SUFFIX}"
        wanted.add(pod_key)
        if pod_key in other_pods:
            skipped.append(f"deployment {ref}: pod {pod_key} exists and is not this Deployment's")
            continue
        if pod_key in controlled_pods or not load:
            continue
        node = min(sorted(load), key=lambda n: load[n])
        load[node] += 1
        labels = {str(k): str(v) for k, v in ((template.get("metadata") or {}).get("labels") or {}).items()}
        labels[DEPLOYMENT_LABEL] = f"{ns}.{name}"
        create.append(
            PodSpec(
                namespace=ns,
                name=f"{name}{POD_SUFFIX}",
                node=node,
                service_account=str((template.get("spec") or {}).get("serviceAccountName") or "default"),
                labels=labels,
                app="waypoint",
            )
        )
    delete = tuple(sorted(key for key in controlled_pods if key not in wanted))
    return DeploymentPlan(create=tuple(create), delete=delete, skipped=tuple(skipped))
