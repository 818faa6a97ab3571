"""Shared mode prefetches certificates of local HBONE workloads and forgets them when they go."""

from __future__ import annotations

import ipaddress

from ambient_mesh.config import ZtunnelConfig
from ambient_mesh.identity.spiffe import Identity
from ambient_mesh.metrics import Metrics
from ambient_mesh.proxy.inpod import InpodManager
from ambient_mesh.state.model import TunnelProtocol, Workload
from ambient_mesh.state.store import ProxyState
from ambient_mesh.tls.context import TlsContextCache
from tests.helpers.state_writes import remove, upsert


class RecordingSecretManager:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Identity]] = []

    def prefetch(self, identity: Identity) -> None:
        self.calls.append(("prefetch", identity))

    def forget(self, identity: Identity) -> None:
        self.calls.append(("forget", identity))


def workload(name: str, sa: str, node: str, protocol=TunnelProtocol.HBONE, ip: str = "10.0.0.1") -> Workload:
    return Workload(
        uid=f"c//Pod/ns/{name}",
        name=name,
        namespace="ns",
        service_account=sa,
        node=node,
        protocol=protocol,
        workload_ips=(ipaddress.ip_address(ip),),
    )


def test_prefetch_local_hbone_identities_and_forget_when_the_last_one_leaves():
    config = ZtunnelConfig.from_env(
        {
            "PROXY_MODE": "shared",
            "NODE_NAME": "node-1",
            "XDS_ADDRESS": "",
            "FAKE_CA": "true",
            "ISTIO_META_DNS_CAPTURE": "false",
        }
    )
    state = ProxyState()
    secrets = RecordingSecretManager()
    manager = InpodManager(
        config=config,
        state=state,
        cert_manager=secrets,
        tls=TlsContextCache(),
        metrics=Metrics(process_metrics=False),
    )
    a1 = workload("a-1", "a", "node-1", ip="10.0.0.1")
    a2 = workload("a-2", "a", "node-1", ip="10.0.0.2")
    b = workload("b-1", "b", "node-2", ip="10.0.0.3")  # another node: not ours to prefetch
    tcp = workload(
        "t-1", "t", "node-1", protocol=TunnelProtocol.TCP, ip="10.0.0.4"
    )  # no mTLS: nothing to fetch
    for w in (a1, a2, b, tcp):
        upsert(state, w)
    ident_a = Identity("cluster.local", "ns", "a")
    assert secrets.calls == [("prefetch", ident_a)]  # once per identity, not per workload
    remove(state, a1.uid)
    assert secrets.calls == [("prefetch", ident_a)]  # a-2 still runs as `a` here
    remove(state, a2.uid)
    assert secrets.calls == [("prefetch", ident_a), ("forget", ident_a)]
    assert repr(manager) == "InpodManager(0 pods: )"
