"""The Envoy configuration of waypoints: golden files, incremental upkeep, and delta ADS for Envoy.

Each tests/unit/golden/waypoint_envoy/<case>/input/*.yaml is translated as `ambient control` does
and every waypoint Gateway's Envoy resources (json_format.MessageToDict per resource, keys sorted)
compared with <case>/expected.json. `UPDATE_GOLDEN=1` rewrites the expected files: read each one
before accepting it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.config.route.v3 import route_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import json_format, struct_pb2

from ambient_mesh.control.ads_state import (
    CLUSTER_TYPE_URL,
    ENDPOINT_TYPE_URL,
    LISTENER_TYPE_URL,
    ROUTE_TYPE_URL,
    AdsRefused,
    DeltaConnectionState,
    ProxyInfo,
    Snapshot,
)
from ambient_mesh.control.translate import AmbientIndex, MeshSettings, translate
from ambient_mesh.control.waypoint_envoy import (
    Endpoint,
    ServicePort,
    WaypointInputs,
    authority,
    build_resources,
    dispatch,
)
from ambient_mesh.control.waypoint_index import WaypointIndex, waypoint_key
from ambient_mesh.identity.spiffe import Identity
from ambient_mesh.kube.load import load_directory
from ambient_mesh.kube.model import Service
from tests.helpers.paths import UNIT_GOLDEN

GOLDEN = UNIT_GOLDEN / "waypoint_envoy"
UPDATE_GOLDEN = os.environ.get("UPDATE_GOLDEN") == "1"
CASES = sorted(p.name for p in GOLDEN.iterdir() if (p / "input").is_dir())
WAYPOINT = "default/waypoint.default.svc.cluster.local"


def _store(case: str):  # type: ignore[no-untyped-def]
    loaded = load_directory(GOLDEN / case / "input")
    assert loaded.errors == (), [str(e) for e in loaded.errors]
    return loaded.store


def _render(case: str) -> str:
    store = _store(case)
    index = WaypointIndex(MeshSettings())
    index.update_l7(store, None)
    index.reset(translate(store, MeshSettings()).addresses)
    doc = {}
    for gw in store.gateways:
        key = waypoint_key(gw.metadata.namespace, gw.metadata.name, "cluster.local")
        resources = index.resources(key)
        doc[key] = {
            kind: {name: json_format.MessageToDict(m) for name, m in named.items()}
            for kind, named in (
                ("listeners", resources.listeners),
                ("clusters", resources.clusters),
                ("endpoints", resources.endpoints),
                ("routes", resources.routes),
            )
        }
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


@pytest.mark.parametrize("case", CASES)
def test_golden(case: str) -> None:
    text = _render(case)
    path = GOLDEN / case / "expected.json"
    if UPDATE_GOLDEN:
        path.write_text(text)
    assert path.exists(), f"golden file {path} missing: run with UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(), f"waypoint resources differ from {path} (UPDATE_GOLDEN=1 regenerates)"


def test_generated_configuration_has_the_waypoint_path() -> None:
    index = WaypointIndex()
    index.reset(translate(_store("echo"), MeshSettings()).addresses)
    r = index.resources(WAYPOINT)
    assert set(r.listeners) == LISTENERS
    assert {
        "inbound-vip|80|http|echo.default.svc.cluster.local",
        "inbound-vip|5432|tcp|db.default.svc.cluster.local",
        "inbound-vip|9000|http|misc.default.svc.cluster.local",
        "inbound-vip|9000|tcp|misc.default.svc.cluster.local",
    } <= set(r.clusters)
    assert not any("other.default" in name for name in r.clusters)
    tls = r.listeners["connect_terminate"].filter_chains[0].transport_socket.typed_config
    assert b"spiffe://cluster.local/" in tls.value
    echo = r.endpoints["inbound-vip|80|http|echo.default.svc.cluster.local"]
    ids = [e.endpoint.address.envoy_internal_address.endpoint_id for e in echo.endpoints[0].lb_endpoints]
    assert ids == ["10.0.0.2:8080", "10.0.1.2:8080"]
    # Destinations of known protocol are served in main_internal, with no inspector; the port of
    # unknown protocol in main_internal_sniffed, by its HTTP inspector's verdict.
    main = r.listeners["main_internal"]
    assert {c.name for c in main.filter_chains} == {
        "inbound-vip|80|http|echo.default.svc.cluster.local",
        "inbound-vip|5432|tcp|db.default.svc.cluster.local",
        "direct-tcp",
        "blackhole",
    }
    assert [f.name for f in main.listener_filters] == ["envoy.filters.listener.original_dst"]
    sniffed = r.listeners["main_internal_sniffed"]
    assert {c.name for c in sniffed.filter_chains} == {
        "inbound-vip|9000|http|misc.default.svc.cluster.local",
        "inbound-vip|9000|tcp|misc.default.svc.cluster.local",
        "direct-http",
        "direct-tcp",
        "blackhole",
    }
    assert [(f.name, f.HasField("filter_disabled")) for f in sniffed.listener_filters] == [
        ("envoy.filters.listener.original_dst", False),
        ("envoy.filters.listener.http_inspector", False),
    ]
    assert sniffed.continue_on_listener_filters_timeout
    # connect_terminate takes its routes over RDS; they send misc's VIP:port to the inspector.
    hcm = json_format.MessageToDict(r.listeners["connect_terminate"])["filterChains"][0]["filters"][0]
    assert hcm["typedConfig"]["rds"]["routeConfigName"] == "connect_terminate"
    routes = _targets(r.routes["connect_terminate"])
    # misc's port (of unknown protocol) and every port of the waypoint's workload but its known one.
    assert routes["main_internal_sniffed"] == ["10.0.0.3:*", "10.96.0.12:9000"]
    assert routes["main_internal"][0] == "*"


LISTENERS = {"connect_terminate", "main_internal", "main_internal_sniffed", "connect_originate"}


def _targets(routes: object) -> dict[str, list[str]]:
    """connect_terminate's routes: internal listener -> the CONNECT targets sent to it."""
    doc = routes if isinstance(routes, dict) else json_format.MessageToDict(routes)  # type: ignore[arg-type]
    out = {}
    for host in doc.get("virtual_hosts", doc.get("virtualHosts", [])):
        (route,) = host["routes"]
        out[route["route"]["cluster"]] = host["domains"]
    return out


def _service_port(i: int, port: int, protocol: str) -> ServicePort:
    return ServicePort(
        hostname=f"s{i}.default.svc.cluster.local",
        vips=(f"10.96.0.{i + 1}", f"fd00::{i + 1}"),
        port=port,
        protocol=protocol,
        endpoints=(Endpoint(ip="10.0.0.2", port=8080),),
    )


def test_only_targets_of_unknown_protocol_meet_the_inspector() -> None:
    services = (_service_port(0, 83, "auto"), _service_port(1, 83, "tcp"), _service_port(2, 80, "http"))
    built = dispatch(
        WaypointInputs(
            trust_domains=("cluster.local",),
            services=services,
            workload_ips=("10.0.0.2", "fd00:10::2"),
            workload_ports={"10.0.0.2": ((9000, "tcp"), (8080, "http"), (7070, "auto"))},
        )
    )
    # By VIP and port, not port number alone: s1 shares port 83 with the sniffed s0 and never
    # meets the inspector. A workload's ports of known protocol are listed; all its others are
    # sniffed (`ip:*`), as istiod sniffs every workload port.
    assert _targets(built.routes) == {
        "main_internal": ["*", "10.0.0.2:8080", "10.0.0.2:9000"],
        "main_internal_sniffed": ["10.0.0.2:*", "10.96.0.1:83", "[fd00:10::2]:*", "[fd00::1]:83"],
    }
    assert authority("fd00::1", 83) == "[fd00::1]:83"
    json_format.ParseDict(built.routes, route_pb2.RouteConfiguration())


def test_no_push_changes_a_listeners_listener_filters() -> None:
    # A listener whose listener filters change is replaced whole, and Envoy closes its tunnels
    # when the drain ends. Whatever the waypoint serves, both internal listeners keep theirs:
    # which targets are sniffed lives in connect_terminate's routes.
    def filters(inputs: WaypointInputs) -> tuple[object, ...]:
        built = dispatch(inputs)
        keep = ("listener_filters", "listener_filters_timeout", "continue_on_listener_filters_timeout")
        return tuple(
            {k: v for k, v in listener.items() if k in keep} for listener in (built.main, built.sniffed)
        )

    empty = filters(WaypointInputs(trust_domains=("cluster.local",), services=(), workload_ips=()))
    protocols = ("auto", "tcp", "http")
    for n in range(8):
        services = tuple(_service_port(i, 80 + i % 3, protocols[(n + i) % 3]) for i in range(n))
        ports = {"10.0.0.2": tuple((7000 + i, protocols[(n * i) % 3]) for i in range(n))}
        inputs = WaypointInputs(
            trust_domains=("cluster.local",),
            services=services,
            workload_ips=("10.0.0.2",) if n % 2 else (),
            workload_ports=ports,
        )
        assert filters(inputs) == empty, n


def test_a_waypoint_nobody_uses_still_terminates_hbone() -> None:
    r = build_resources(WaypointIndex().inputs("ns/none.ns.svc.cluster.local"))
    assert set(r.listeners) == LISTENERS
    assert [c.name for c in r.listeners["main_internal"].filter_chains] == ["blackhole"]
    assert [c.name for c in r.listeners["main_internal_sniffed"].filter_chains] == ["blackhole"]
    # Nothing to sniff: every target goes to main_internal.
    assert _targets(r.routes["connect_terminate"]) == {"main_internal": ["*"]}
    assert r.endpoints == {}


def _resources(index: WaypointIndex, key: str = WAYPOINT) -> dict[str, dict[str, bytes]]:
    snap = index.snapshot(key)
    return {t: {n: v.resource.value for n, v in snap.of(t).items()} for t in snap.resources}


def _followed(case: str, key: str = WAYPOINT):  # type: ignore[no-untyped-def]
    """The case's store, an AmbientIndex and a WaypointIndex following it, and `key`'s snapshot."""
    store = _store(case)
    ambient = AmbientIndex(MeshSettings())
    index = WaypointIndex()
    delta = ambient.update(store)
    index.apply(delta.addresses, delta.removed_addresses)
    return store, ambient, index, index.snapshot(key)


def test_incremental_upkeep_equals_a_fresh_build() -> None:
    store, ambient, index, first = _followed("echo")
    # Take the label off echo: its chain and clusters go, nothing else moves.
    echo = next(s for s in store.services if s.metadata.name == "echo")
    labels = {k: v for k, v in echo.metadata.labels.items() if k != "istio.io/use-waypoint"}
    meta = type(echo.metadata)(**{**_fields(echo.metadata), "labels": labels})
    unlabelled = Service(**{**_fields(echo), "metadata": meta})
    delta = ambient.apply([unlabelled])
    changed = index.apply(delta.addresses, delta.removed_addresses)
    assert changed == {WAYPOINT}
    second = index.snapshot(WAYPOINT)
    assert second.changed is not None
    assert "inbound-vip|80|http|echo.default.svc.cluster.local" in second.changed[CLUSTER_TYPE_URL]
    assert "connect_originate" not in second.changed[LISTENER_TYPE_URL]
    # The listeners' filters never change: the push is an in-place update that keeps the open
    # tunnels.
    for name in ("main_internal", "main_internal_sniffed"):
        assert first_listener_filters(first, name) == first_listener_filters(second, name)
    assert "main_internal" in second.changed[LISTENER_TYPE_URL]
    assert (
        second.of(LISTENER_TYPE_URL)["connect_terminate"] is first.of(LISTENER_TYPE_URL)["connect_terminate"]
    )
    fresh = WaypointIndex()
    fresh.reset(ambient.addresses)
    assert _resources(fresh) == _resources(index)
    # A change that touches no waypoint rebuilds none.
    other = next(s for s in store.services if s.metadata.name == "other")
    meta = type(other.metadata)(**{**_fields(other.metadata), "labels": {"team": "x"}})
    delta = ambient.apply([Service(**{**_fields(other), "metadata": meta})])
    assert index.apply(delta.addresses, delta.removed_addresses) == set()


def first_listener_filters(snapshot: Snapshot, name: str) -> list[bytes]:
    from envoy.config.listener.v3 import listener_pb2

    listener = listener_pb2.Listener()
    snapshot.of(LISTENER_TYPE_URL)[name].resource.Unpack(listener)
    return [f.SerializeToString() for f in listener.listener_filters]


def _fields(obj: object) -> dict[str, object]:
    return {name: getattr(obj, name) for name in obj.__dataclass_fields__}  # type: ignore[attr-defined]


# -- delta ADS for a waypoint's Envoy ------------------------------------------------------------


def _node(gateway: str = "waypoint") -> base_pb2.Node:
    labels = struct_pb2.Struct()
    labels.update({"gateway.networking.k8s.io/gateway-name": gateway})
    metadata = struct_pb2.Struct()
    metadata.update({"NAMESPACE": "default"})
    metadata.fields["LABELS"].struct_value.CopyFrom(labels)
    return base_pb2.Node(
        id="waypoint~10.0.0.100~waypoint-0.default~default.svc.cluster.local", metadata=metadata
    )


def test_waypoint_node_is_parsed() -> None:
    proxy = ProxyInfo.from_node(_node("wp"))
    assert (proxy.node_type, proxy.gateway_name, proxy.namespace) == ("waypoint", "wp", "default")


def test_envoy_delta_ads_wildcard_then_eds_then_incremental_push() -> None:
    store = _store("echo")
    ambient = AmbientIndex(MeshSettings())
    index = WaypointIndex()
    delta = ambient.update(store)
    index.apply(delta.addresses, delta.removed_addresses)
    seen = []

    def snapshot_for(proxy: ProxyInfo, identity: Identity | None) -> Snapshot:
        key = index.key_of(proxy, identity)
        seen.append(key)
        return index.snapshot(key)

    state = DeltaConnectionState(
        Snapshot.empty(),
        identities=["spiffe://cluster.local/ns/default/sa/waypoint"],
        nonce_prefix=lambda: "n",
        waypoint_snapshot=snapshot_for,
    )
    [cds] = state.receive(discovery_pb2.DeltaDiscoveryRequest(type_url=CLUSTER_TYPE_URL, node=_node()))
    assert seen == [WAYPOINT]
    assert "inbound-vip|80|http|echo.default.svc.cluster.local" in {r.name for r in cds.resources}
    assert all(r.version for r in cds.resources)
    # Envoy asks for the endpoints of its EDS clusters by name.
    eds_names = sorted(n for n in (r.name for r in cds.resources) if n.startswith("inbound-vip"))
    [eds] = state.receive(
        discovery_pb2.DeltaDiscoveryRequest(type_url=ENDPOINT_TYPE_URL, resource_names_subscribe=eds_names)
    )
    assert sorted(r.name for r in eds.resources) == eds_names
    [lds] = state.receive(discovery_pb2.DeltaDiscoveryRequest(type_url=LISTENER_TYPE_URL))
    assert len(lds.resources) == 4
    # And for connect_terminate's routes, by name.
    [rds] = state.receive(
        discovery_pb2.DeltaDiscoveryRequest(
            type_url=ROUTE_TYPE_URL, resource_names_subscribe=["connect_terminate"]
        )
    )
    assert [r.name for r in rds.resources] == ["connect_terminate"]
    for resp in (cds, eds, lds, rds):
        assert (
            state.receive(
                discovery_pb2.DeltaDiscoveryRequest(type_url=resp.type_url, response_nonce=resp.nonce)
            )
            == []
        )
    # Address types are not served to Envoy.
    assert (
        state.receive(
            discovery_pb2.DeltaDiscoveryRequest(type_url="type.googleapis.com/istio.workload.Address")
        )
        == []
    )
    # One more echo pod: only echo's endpoints change.
    pod = next(p for p in store.pods if p.metadata.name == "echo-2")
    meta = type(pod.metadata)(**{**_fields(pod.metadata), "name": "echo-3"})
    delta = ambient.apply([type(pod)(**{**_fields(pod), "metadata": meta, "pod_ip": "10.0.1.9"})])
    assert index.apply(delta.addresses, delta.removed_addresses) == {WAYPOINT}
    responses = state.push(index.snapshot(WAYPOINT))
    assert [(r.type_url, [x.name for x in r.resources]) for r in responses] == [
        (
            ENDPOINT_TYPE_URL,
            ["inbound-vip|80|http|echo.default.svc.cluster.local"]
            + (
                [
                    "inbound-vip|9000|http|misc.default.svc.cluster.local",
                    "inbound-vip|9000|tcp|misc.default.svc.cluster.local",
                ]
            ),
        )
    ]


def test_waypoint_is_refused_without_a_generator() -> None:
    state = DeltaConnectionState(Snapshot.empty())
    with pytest.raises(AdsRefused, match="generates no Envoy configuration"):
        state.receive(discovery_pb2.DeltaDiscoveryRequest(type_url=CLUSTER_TYPE_URL, node=_node()))


# -- workload-addressed traffic: direct-http and direct-tcp -------------------------------------

DIRECT = "default/waypoint.default.svc.cluster.local"


def _listener(index: WaypointIndex, name: str = "main_internal") -> dict[str, Any]:
    return json_format.MessageToDict(index.resources(DIRECT).listeners[name])


def _verdict(action: dict[str, Any]) -> object:
    """A matcher entry: the chain it names, ("sniffed", HTTP chains, otherwise) for the
    inspector's verdict, or a port map (port -> verdict, "*" the rest)."""
    if "action" in action:
        return action["action"]["name"]
    tree = action["matcher"]
    if tree["matcherTree"]["input"]["name"] == "application-protocol":
        verdicts = {a["action"]["name"] for a in tree["matcherTree"]["exactMatchMap"]["map"].values()}
        return ("sniffed", sorted(verdicts), _verdict(tree["onNoMatch"]))
    return {
        "*": _verdict(tree["onNoMatch"]),
        **{port: _verdict(a) for port, a in tree["matcherTree"]["exactMatchMap"]["map"].items()},
    }


def _direct_ports(listener: dict[str, Any]) -> dict[str, object]:
    """The port map of the one workload IP of the `direct` case in an internal listener."""
    (entry,) = listener["filterChainMatcher"]["matcherTree"]["customMatch"]["typedConfig"]["rangeMatchers"]
    found = _verdict(entry["onMatch"])
    return found if isinstance(found, dict) else {"*": found}


def test_workload_ports_take_the_protocol_their_services_give() -> None:
    store = _store("direct")
    index = WaypointIndex()
    index.update_l7(store, None)
    index.reset(translate(store, MeshSettings()).addresses)
    main = _listener(index)
    sniffed = ("sniffed", ["direct-http"], "direct-tcp")
    # HTTP (web's `http`) is direct-http and TCP (echo's `tcp-echo`) direct-tcp in main_internal;
    # every other port (misc's of unknown protocol, 8081 disputed by http-alt and tcp-alt, and
    # the ports no Service names) is sniffed.
    assert _direct_ports(main) == {"*": "direct-tcp", "8080": "direct-http"}
    assert _direct_ports(_listener(index, "main_internal_sniffed")) == {"*": sniffed}
    pod = next(
        d for d in _targets(index.resources(DIRECT).routes["connect_terminate"])["main_internal_sniffed"]
    )
    ip = pod.removesuffix(":*")
    assert _targets(index.resources(DIRECT).routes["connect_terminate"]) == {
        "main_internal": ["*", f"{ip}:8080", f"{ip}:9000"],
        "main_internal_sniffed": [f"{ip}:*"],
    }
    # No inspector in main_internal: 9000 (known TCP) never meets one.
    assert [f["name"] for f in main["listenerFilters"]] == ["envoy.filters.listener.original_dst"]  # type: ignore[index]
    chains = {c["name"]: c for c in main["filterChains"]}  # type: ignore[index]
    assert set(chains) == {"direct-http", "direct-tcp", "blackhole"}
    # direct-http: the original destination handed on, then Istio's HCM with the waypoint's
    # L7 policy (the Gateway-bound DENY, not the Service-bound one) and the HTTP access log,
    # routed to encap.
    filters = chains["direct-http"]["filters"]
    assert [f["name"] for f in filters] == [
        "connect_authority",
        "envoy.filters.network.http_connection_manager",
    ]
    hcm = filters[1]["typedConfig"]
    assert hcm["statPrefix"] == "direct-http"
    assert hcm["rds"]["routeConfigName"] == "direct-http"
    routes = json_format.MessageToDict(index.resources(DIRECT).routes["direct-http"])
    assert routes["virtualHosts"][0]["routes"][0]["route"]["cluster"] == "encap"
    assert [f["name"] for f in hcm["httpFilters"]] == ["envoy.filters.http.rbac", "envoy.filters.http.router"]
    policies = hcm["httpFilters"][0]["typedConfig"]["rules"]["policies"]
    assert list(policies) == ["ns[default]-policy[deny-admin]-rule[0]"]
    assert hcm["accessLog"][0]["name"] == "envoy.access_loggers.http_grpc"
    tcp = chains["direct-tcp"]["filters"]
    # The waypoint's DENY (a path only) with TCP semantics: the path is dropped, so it refuses
    # every workload-addressed TCP connection (fail closed, as istiod).
    assert [f["name"] for f in tcp] == [
        "envoy.filters.network.rbac",
        "connect_authority",
        "envoy.filters.network.tcp_proxy",
    ]
    assert tcp[0]["typedConfig"]["rules"]["action"] == "DENY"
    assert tcp[0]["typedConfig"]["rules"]["policies"] == {
        "ns[default]-policy[deny-admin]-rule[0]": {
            "permissions": [{"any": True}],
            "principals": [{"any": True}],
        }
    }
    assert tcp[2]["typedConfig"]["cluster"] == "encap"


def test_workload_port_protocols_reads_each_services_ports() -> None:
    from ambient_mesh.control.waypoint_envoy import workload_port_protocols
    from ambient_mesh.wire.istio.workload import workload_pb2 as wl

    def port(service_port: int, target: int, protocol: int = wl.UNKNOWN) -> wl.Port:
        return wl.Port(service_port=service_port, target_port=target, app_protocol=protocol)

    services = {
        "ns/a.ns.svc.cluster.local": wl.Service(ports=[port(80, 8080, wl.HTTP11), port(90, 0, wl.TCP)]),
        "ns/b.ns.svc.cluster.local": wl.Service(ports=[port(81, 8080, wl.TCP), port(82, 7000, wl.GRPC)]),
    }
    w = wl.Workload()
    w.services["ns/a.ns.svc.cluster.local"].ports.add(service_port=90, target_port=9090)
    assert workload_port_protocols(w, services) == ((8080, "http"), (9090, "tcp"))
    # A port two Services give different known protocols is left to the inspector; a Service the
    # store does not have gives nothing.
    w.services["ns/b.ns.svc.cluster.local"].SetInParent()
    w.services["ns/gone.ns.svc.cluster.local"].SetInParent()
    assert workload_port_protocols(w, services) == ((7000, "http"), (8080, "auto"), (9090, "tcp"))
    # A named target port the pod does not declare (0) is no port.
    w2 = wl.Workload()
    w2.services["ns/a.ns.svc.cluster.local"].SetInParent()
    assert workload_port_protocols(w2, services) == ((8080, "http"),)


def test_known_tcp_workload_ports_need_no_http_chain() -> None:
    # A pod with TCP ports only: direct-tcp and no HCM in main_internal; the sniffed listener
    # has both, for the pod's other ports.
    def built(ports: dict[str, tuple[tuple[int, str], ...]]):  # type: ignore[no-untyped-def]
        return dispatch(
            WaypointInputs(
                trust_domains=("cluster.local",),
                services=(),
                workload_ips=("10.0.0.2", "10.0.0.3"),
                workload_ports=ports,
            )
        )

    none = built({})
    tcp = built({"10.0.0.2": ((9000, "tcp"),), "10.0.0.3": ((5432, "tcp"),)})
    http = built({"10.0.0.2": ((8080, "http"),)})
    assert [c["name"] for c in tcp.main["filter_chains"]] == ["blackhole", "direct-tcp"]
    assert tcp.main["filter_chain_matcher"] == none.main["filter_chain_matcher"]
    assert [c["name"] for c in http.main["filter_chains"]] == ["blackhole", "direct-http", "direct-tcp"]
    assert [c["name"] for c in none.sniffed["filter_chains"]] == ["blackhole", "direct-http", "direct-tcp"]
    assert _targets(tcp.routes)["main_internal"] == ["*", "10.0.0.2:9000", "10.0.0.3:5432"]


def test_a_service_change_rebuilds_the_waypoint_of_a_pod_serving_it() -> None:
    # The Services of the `direct` case use no waypoint; their ports still give the pod's ports
    # their protocols, so a change of one reaches the pod's waypoint.
    store, ambient, index, first = _followed("direct", DIRECT)
    echo = next(s for s in store.services if s.metadata.name == "echo")
    port = echo.ports[0]
    renamed = type(port)(**{**_fields(port), "name": "http-echo"})
    delta = ambient.apply([Service(**{**_fields(echo), "ports": (renamed, *echo.ports[1:])})])
    assert index.apply(delta.addresses, delta.removed_addresses) == {DIRECT}
    second = index.snapshot(DIRECT)
    assert second.changed is not None and "main_internal" in second.changed[LISTENER_TYPE_URL]
    assert first is not second
    fresh = WaypointIndex()
    fresh.reset(ambient.addresses)
    assert _resources(fresh, DIRECT) == _resources(index, DIRECT)
    assert _direct_ports(_listener(fresh))["9000"] == "direct-http"
