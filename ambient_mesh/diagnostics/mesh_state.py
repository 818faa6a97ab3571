"""The node proxies' state for a mesh view: the control plane's translation, converted by the
data plane's own xDS conversion and written by its own updater.

What `describe` and `explain` reason over is therefore what a node proxy would hold after a full
push from `ambient control` (xds/convert.py's `*_from_proto`, xds/updater.py's `StateUpdater`),
not a second reading of the objects.
"""

from __future__ import annotations

from typing import Any

import yaml

from ..control.translate import Translation, translate
from ..state.localconfig import LocalConfig, parse_local_config
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


def dump_state(dump: dict[str, Any], source: str) -> ProxyState:
    """A node proxy's state from its saved /config_dump (`ambient zc --file` style).

    The dump's workloads, services and policies are ztunnel's serde shapes, which its local
    config file also reads; only a workload's `services` differ (names in the dump, name ->
    port map in the file), and the map is rebuilt from the services' endpoints. The data plane's
    own local-config parser then checks every field.
    """

    def ports(value: Any) -> dict[Any, Any]:
        # JSON has only string keys; YAML (what the parser reads) keeps the ports integers.
        if not isinstance(value, dict):
            return {}
        return {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in value.items()}

    services = []
    for s in dump.get("services", []):
        if isinstance(s, dict):
            endpoints = {
                uid: {**e, "port": ports(e.get("port"))} if isinstance(e, dict) else e
                for uid, e in (s.get("endpoints") or {}).items()
            }
            services.append({**s, "ports": ports(s.get("ports")), "endpoints": endpoints})
    ports_by_uid: dict[str, dict[str, Any]] = {}
    for s in services:
        key = f"{s.get('namespace')}/{s.get('hostname')}"
        for uid, endpoint in (s.get("endpoints") or {}).items():
            if isinstance(endpoint, dict):
                ports_by_uid.setdefault(str(endpoint.get("workloadUid") or uid), {})[key] = endpoint.get(
                    "port", {}
                )
    workloads = []
    for w in dump.get("workloads", []):
        if isinstance(w, dict):
            workloads.append({**w, "services": ports_by_uid.get(str(w.get("uid", "")), {})})
    raw_policies = dump.get("policies", {})
    policies = list(raw_policies.values()) if isinstance(raw_policies, dict) else list(raw_policies)
    doc = {"workloads": workloads, "services": services, "policies": policies}
    state = ProxyState()
    StateUpdater(state).apply_local_config(parse_local_config(yaml.safe_dump(doc), source))
    return state
