"""The node proxies' state for a mesh view: the control plane's translation, converted by the
data plane's own xDS conversion and written by its own updater.

What `describe` and `explain` reason over is therefore what a node proxy would hold after a full
push from `ambient control` (xds/convert.py's `*_from_proto`, xds/updater.py's `StateUpdater`),
not a second reading of the objects.
"""

from __future__ import annotations

from ..control.translate import Translation, translate
from ..state.localconfig import LocalConfig
from ..state.model import Service, Workload
from ..state.store import ProxyState
from ..xds.convert import authorization_from_proto, service_from_proto, workload_from_proto
from ..xds.updater import StateUpdater
from .view import MeshView


def translation_of(view: MeshView) -> Translation:
    return translate(view.store, view.settings)


def proxy_state(translation: Translation) -> ProxyState:
    workloads: list[Workload] = []
    services: list[Service] = []
    for name, address in translation.addresses.items():
        if address.WhichOneof("type") == "workload":
            workloads.append(workload_from_proto(address.workload, name=name))
        else:
            services.append(service_from_proto(address.service, name=name))
    policies = tuple(authorization_from_proto(pb, name=key) for key, pb in translation.authorizations.items())
    state = ProxyState()
    StateUpdater(state).apply_local_config(
        LocalConfig(workloads=tuple(workloads), services=tuple(services), policies=policies)
    )
    return state
