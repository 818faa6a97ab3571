"""Local config YAML (ztunnel's LOCAL_XDS_PATH format): key families, defaults, errors with
positions, and a hypothesis check that any YAML-ish document parses or fails as ConfigError."""

from __future__ import annotations

import ipaddress
import textwrap

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from ambient_mesh.config import ZtunnelConfig
from ambient_mesh.errors import ConfigError
from ambient_mesh.rbac import Action, Scope, ServiceAccountMatch, StringMatch, StringMatchKind
from ambient_mesh.state.localconfig import LocalConfig, parse_local_config
from ambient_mesh.state.model import (
    AppTunnelProtocol,
    GatewayAddress,
    HealthPolicy,
    IpFamilies,
    LoadBalancingMode,
    LoadBalancingScope,
    Locality,
    NamespacedHostname,
    NetworkAddress,
    NetworkMode,
    TunnelProtocol,
    Visibility,
    WorkloadStatus,
    WorkloadType,
)
from ambient_mesh.state.store import ProxyState
from tests.helpers.state_writes import load

# A local config in ztunnel's format (docs/istio-behaviour.md, "Local config file") with every kind of entry.
REFERENCE_EXAMPLE = """\
workloads:
- uid: k1//v1/Pod/shop/cart-7f9c
  name: cart-7f9c
  namespace: shop
  serviceAccount: cart
  trustDomain: cluster.local
  workloadIps: ["127.0.0.41"]
  protocol: HBONE              # TCP (default) or HBONE
  node: node-a
  network: ""
  canonicalName: cart          # telemetry only
  canonicalRevision: v2
  workloadName: cart
  workloadType: deployment
  locality: {region: eu-west, zone: eu-west-1a, subzone: ""}
  authorizationPolicies: ["shop/only-frontend"]   # selector-scoped policies by "ns/name"
  services:
    "shop/cart.shop.svc.cluster.local":
      80: 8080                 # service port -> target port for this endpoint
- uid: k1//v1/Pod/shop/web-1a2b
  name: web-1a2b
  namespace: shop
  serviceAccount: frontend
  trustDomain: cluster.local
  workloadIps: ["127.0.0.42"]
  protocol: TCP
  node: node-a
services:
- name: cart
  namespace: shop
  hostname: cart.shop.svc.cluster.local
  vips: ["/10.96.7.7"]
  ports: {80: 8080}
  subjectAltNames: ["spiffe://cluster.local/ns/shop/sa/cart"]
  canonical: true
  loadBalancer:                # optional
    routingPreferences: [Network, Region, Zone]
    mode: Failover             # Standard | Strict | Failover | Passthrough
    healthPolicy: OnlyHealthy  # or AllowAll
  # waypoint: {destination: "/10.0.9.9", hboneMtlsPort: 15008}   # or destination: "shop/wp.shop.svc.cluster.local"
  # ipFamilies: Dual           # IPv4 | IPv6 | Dual
  # visibility: Namespace      # Public (default) | Namespace
policies:
- name: only-frontend
  namespace: shop
  scope: WorkloadSelector      # only applies to workloads listing "shop/only-frontend"
  action: Allow
  dryRun: false
  rules:
  - - - principals: [{Exact: "cluster.local/ns/shop/sa/frontend"}]
        destinationPorts: [8080]
- name: no-debug-port
  namespace: shop
  scope: Namespace
  action: Deny
  dryRun: false
  rules:
  - - - destinationPorts: [9999]
"""


def parse(text: str) -> LocalConfig:
    return parse_local_config(textwrap.dedent(text), "test.yaml")


def parse_error(text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse(text)
    return info.value


# -- the reference example -----------------------------------------------------------------------


def test_reference_example_parses() -> None:
    config = parse_local_config(REFERENCE_EXAMPLE, "example.yaml")
    cart, web = config.workloads
    assert cart.uid == "k1//v1/Pod/shop/cart-7f9c"
    assert cart.workload_ips == (ipaddress.ip_address("127.0.0.41"),)
    assert cart.protocol is TunnelProtocol.HBONE
    assert cart.locality == Locality(region="eu-west", zone="eu-west-1a", subzone="")
    assert cart.authorization_policies == ("shop/only-frontend",)
    assert cart.services == {"shop/cart.shop.svc.cluster.local": {80: 8080}}
    assert str(cart.identity) == "spiffe://cluster.local/ns/shop/sa/cart"
    assert web.protocol is TunnelProtocol.TCP and web.services == {}

    (svc,) = config.services
    assert svc.key == "shop/cart.shop.svc.cluster.local"
    assert svc.vips == (NetworkAddress(network="", address=ipaddress.ip_address("10.96.7.7")),)
    assert svc.ports == {80: 8080}
    assert svc.canonical is True
    assert svc.load_balancer is not None
    assert svc.load_balancer.routing_preferences == (
        LoadBalancingScope.NETWORK,
        LoadBalancingScope.REGION,
        LoadBalancingScope.ZONE,
    )
    assert svc.load_balancer.mode is LoadBalancingMode.FAILOVER
    assert svc.load_balancer.health_policy is HealthPolicy.ONLY_HEALTHY

    only_frontend, no_debug = config.policies
    assert only_frontend.key == "shop/only-frontend"
    assert only_frontend.scope is Scope.WORKLOAD_SELECTOR and only_frontend.action is Action.ALLOW
    (match,) = only_frontend.rules[0].clauses[0].matches
    assert match.principals == (StringMatch.exact("cluster.local/ns/shop/sa/frontend"),)
    assert match.destination_ports == (8080,)
    assert no_debug.action is Action.DENY and no_debug.scope is Scope.NAMESPACE
    assert no_debug.rules[0].clauses[0].matches[0].destination_ports == (9999,)


def test_reference_example_loads_into_state(tmp_path) -> None:
    path = tmp_path / "local.yaml"
    path.write_text(REFERENCE_EXAMPLE)
    source = ZtunnelConfig(local_xds_path=str(path)).local_config_source()
    assert source is not None
    config = parse_local_config(*source)
    state = ProxyState()
    load(state, config.workloads, config.services, config.policies)
    svc = state.services.get("shop/cart.shop.svc.cluster.local")
    assert svc is not None and set(svc.endpoints) == {"k1//v1/Pod/shop/cart-7f9c"}
    assert repr(state) == "<ProxyState v1: 2 workloads, 1 services, 2 policies>"


def test_missing_file_is_config_error(tmp_path) -> None:
    with pytest.raises(ConfigError) as info:
        ZtunnelConfig(local_xds_path=str(tmp_path / "absent.yaml")).local_config_source()
    assert info.value.source.endswith("absent.yaml")


# -- top level and defaults ----------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "# nothing\n", "~\n", "workloads: []\n", "{}\n"])
def test_empty_documents(text: str) -> None:
    assert parse(text) == LocalConfig()


def test_workload_defaults() -> None:
    config = parse(
        """
        workloads:
        - namespace: default
          workloadIps: ["10.0.0.1", "fd00::1"]
        """
    )
    (wl,) = config.workloads
    assert wl.protocol is TunnelProtocol.TCP
    assert wl.status is WorkloadStatus.HEALTHY
    assert wl.capacity == 1
    assert wl.network_mode is NetworkMode.STANDARD
    assert wl.workload_type is WorkloadType.DEPLOYMENT
    # The YAML path keeps empty strings; only the identity property applies Istio's defaults.
    assert wl.service_account == "" and wl.trust_domain == "" and wl.uid == ""
    assert str(wl.identity) == "spiffe://cluster.local/ns/default/sa/default"
    assert wl.workload_ips == (ipaddress.ip_address("10.0.0.1"), ipaddress.ip_address("fd00::1"))
    assert wl.waypoint is None and wl.application_tunnel is None


def test_every_workload_key() -> None:
    config = parse(
        """
        workloads:
        - uid: c//Pod/ns/a
          name: a
          namespace: ns
          workloadIps: ["::ffff:10.0.0.9"]
          hostname: a.example.com
          network: net1
          protocol: HBONE
          networkMode: HostNetwork
          trustDomain: td
          serviceAccount: sa
          waypoint: {destination: "net1/10.0.0.5", hboneMtlsPort: 15009}
          networkGateway: {destination: "istio-system/eastwest.istio-system.svc.cluster.local"}
          node: n1
          canonicalName: app
          canonicalRevision: v1
          workloadType: cronjob
          workloadName: job-a
          nativeTunnel: true
          applicationTunnel: {protocol: PROXY, port: 15088}
          authorizationPolicies: [ns/p]
          status: Unhealthy
          clusterId: c1
          locality: {region: r}
          capacity: 7
          services: {"ns/a.ns.svc.cluster.local": {80: 8080, 443: 8443}}
        """
    )
    (wl,) = config.workloads
    assert wl.workload_ips == (ipaddress.ip_address("10.0.0.9"),)  # v4-mapped is unmapped
    assert wl.hostname == "a.example.com" and wl.network == "net1"
    assert wl.network_mode is NetworkMode.HOST_NETWORK
    assert wl.waypoint == GatewayAddress(
        destination=NetworkAddress(network="net1", address=ipaddress.ip_address("10.0.0.5")),
        hbone_mtls_port=15009,
    )
    assert wl.network_gateway == GatewayAddress(
        destination=NamespacedHostname(
            namespace="istio-system", hostname="eastwest.istio-system.svc.cluster.local"
        )
    )
    assert wl.workload_type is WorkloadType.CRONJOB and wl.native_tunnel is True
    assert wl.application_tunnel is not None
    assert wl.application_tunnel.protocol is AppTunnelProtocol.PROXY and wl.application_tunnel.port == 15088
    assert wl.status is WorkloadStatus.UNHEALTHY and wl.cluster_id == "c1" and wl.capacity == 7
    assert wl.locality == Locality(region="r")
    assert wl.services == {"ns/a.ns.svc.cluster.local": {80: 8080, 443: 8443}}
    assert str(wl.identity) == "spiffe://td/ns/ns/sa/sa"


def test_every_service_key() -> None:
    config = parse(
        """
        services:
        - name: s
          namespace: ns
          hostname: s.ns.svc.cluster.local
          vips: ["/10.96.0.1", "net2/fd00::10"]
          cidrVips: [{network: "", cidr: "10.200.0.0/16"}, {cidr: "fd00:1::/64"}]
          ports: {80: 0}
          endpoints:
            c//Pod/ns/a: {workloadUid: c//Pod/ns/a, port: {80: 9090}, status: Unhealthy}
          subjectAltNames: [spiffe://td/ns/ns/sa/x]
          waypoint: {destination: "ns/wp.ns.svc.cluster.local"}
          weightedWaypoints:
          - {destination: {destination: "/10.0.0.5", hboneMtlsPort: 15008}, weight: 3}
          - {destination: "ns/wp2.ns.svc.cluster.local", weight: 1}
          loadBalancer: {routingPreferences: [Node, Subzone, Cluster], mode: Strict, healthPolicy: AllowAll}
          ipFamilies: Dual
          canonical: false
          visibility: Namespace
        """
    )
    (svc,) = config.services
    assert svc.vips == (
        NetworkAddress(network="", address=ipaddress.ip_address("10.96.0.1")),
        NetworkAddress(network="net2", address=ipaddress.ip_address("fd00::10")),
    )
    assert svc.cidr_vips == (
        ("", ipaddress.ip_network("10.200.0.0/16")),
        ("", ipaddress.ip_network("fd00:1::/64")),
    )
    assert svc.ports == {80: 0}
    ep = svc.endpoints["c//Pod/ns/a"]
    assert ep.port == {80: 9090} and ep.status is WorkloadStatus.UNHEALTHY
    assert svc.waypoint == GatewayAddress(
        destination=NamespacedHostname(namespace="ns", hostname="wp.ns.svc.cluster.local")
    )
    assert [w.weight for w in svc.weighted_waypoints] == [3, 1]
    assert svc.weighted_waypoints[0].destination.destination == NetworkAddress(
        network="", address=ipaddress.ip_address("10.0.0.5")
    )
    assert svc.load_balancer is not None
    assert svc.load_balancer.mode is LoadBalancingMode.STRICT
    assert svc.load_balancer.health_policy is HealthPolicy.ALLOW_ALL
    assert svc.ip_families is IpFamilies.DUAL and svc.visibility is Visibility.NAMESPACE


@pytest.mark.parametrize(
    ("spelling", "expected"),
    [("IPv4", IpFamilies.IPV4_ONLY), ("IPv6", IpFamilies.IPV6_ONLY), ("Automatic", IpFamilies.AUTOMATIC)],
)
def test_ip_families_spellings(spelling: str, expected: IpFamilies) -> None:
    config = parse(
        f"""
        services:
        - {{name: s, namespace: n, hostname: h, vips: [], ports: {{}}, ipFamilies: {spelling}}}
        """
    )
    assert config.services[0].ip_families is expected


def test_every_match_key() -> None:
    config = parse(
        """
        policies:
        - name: p
          namespace: ns
          scope: Global
          action: Allow
          dryRun: true
          rules:
          - - - namespaces: [{Prefix: "team-"}]
                notNamespaces: [{Suffix: "-test"}]
                principals: [{Presence: []}]
                notPrincipals: [{Exact: "td/ns/x/sa/y"}]
                serviceAccounts: [{namespace: a, serviceAccount: b}]
                notServiceAccounts: [{namespace: c, serviceAccount: d}]
                sourceIps: ["10.0.0.0/8", "10.1.2.3"]
                notSourceIps: ["fd00::/8"]
                destinationIps: ["192.168.1.7/24"]
                notDestinationIps: ["::1/128"]
                destinationPorts: [80, 443]
                notDestinationPorts: [22]
              - {}
            - []
          - []
        """
    )
    (policy,) = config.policies
    assert policy.scope is Scope.GLOBAL and policy.dry_run is True
    first, second = policy.rules
    assert second.clauses == ()
    clause_a, clause_b = first.clauses
    assert clause_b.matches == ()
    match, empty = clause_a.matches
    assert empty.principals == () and empty.destination_ports == ()
    assert match.namespaces == (StringMatch(kind=StringMatchKind.PREFIX, value="team-"),)
    assert match.not_namespaces == (StringMatch.suffix("-test"),)
    assert match.principals == (StringMatch.presence(),)
    assert match.not_principals == (StringMatch.exact("td/ns/x/sa/y"),)
    assert match.service_accounts == (ServiceAccountMatch(namespace="a", service_account="b"),)
    assert match.not_service_accounts == (ServiceAccountMatch(namespace="c", service_account="d"),)
    assert match.source_ips == (ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("10.1.2.3/32"))
    assert match.not_source_ips == (ipaddress.ip_network("fd00::/8"),)
    assert match.destination_ips == (ipaddress.ip_network("192.168.1.0/24"),)
    assert match.not_destination_ips == (ipaddress.ip_network("::1/128"),)
    assert match.destination_ports == (80, 443) and match.not_destination_ports == (22,)


# -- errors, with positions -----------------------------------------------------------------------


def test_unknown_top_level_key_names_key_and_position() -> None:
    err = parse_error("workloads: []\nservice: []\n")
    assert err.source == "test.yaml:2:1"
    assert "unknown key 'service'" in err.message


def test_misspelled_workload_key() -> None:
    err = parse_error(
        """
        workloads:
        - namespace: default
          workloadIps: []
          serviceAcount: x
        """
    )
    assert err.source == "test.yaml:5:3"
    assert "'serviceAcount'" in err.message


def test_unknown_key_deep_in_policy() -> None:
    err = parse_error(
        """
        policies:
        - name: p
          namespace: n
          scope: Namespace
          action: Allow
          dryRun: false
          rules:
          - - - destinationPort: [1]
        """
    )
    assert err.source == "test.yaml:9:9"
    assert "'destinationPort'" in err.message


@pytest.mark.parametrize(
    ("text", "needle", "marker"),
    [
        ("workloads:\n- workloadIps: []\n", "missing required key 'namespace'", "workloadIps"),
        ("workloads:\n- namespace: x\n", "missing required key 'workloadIps'", "namespace"),
        (
            "services:\n- {name: s, namespace: n, hostname: h, vips: []}\n",
            "missing required key 'ports'",
            "{",
        ),
        (
            "policies:\n- {name: p, namespace: n, scope: Global, action: Allow, rules: []}\n",
            "missing required key 'dryRun'",
            "{",
        ),
        ("workloads:\n- {namespace: x, workloadIps: [10.0.0.300]}\n", "not an IP address", "10.0.0.300"),
        ("workloads:\n- {namespace: x, workloadIps: [], protocol: hbone}\n", "HBONE", "hbone"),
        ("workloads:\n- {namespace: x, workloadIps: [], capacity: -1}\n", "out of range", "-1"),
        (
            "workloads:\n- {namespace: x, workloadIps: [], nativeTunnel: yes please}\n",
            "true or false",
            "yes please",
        ),
        ("workloads:\n- {namespace: 7, workloadIps: []}\n", "expected a string", "7"),
        ("workloads:\n- {namespace: x, workloadIps: 10.0.0.1}\n", "expected a list", "10.0.0.1"),
        ("workloads: {}\n", "expected a list", "{}"),
        ("- a\n", "expected a mapping", "- a"),
        (
            "workloads:\n- {namespace: x, workloadIps: [], services: {nohost: {80: 80}}}\n",
            "namespace/hostname",
            "nohost",
        ),
        (
            "workloads:\n- {namespace: x, workloadIps: [], services: {a/b: {80: 70000}}}\n",
            "out of range",
            "70000",
        ),
        (
            "workloads:\n- {namespace: x, workloadIps: [], waypoint: {destination: nowhere}}\n",
            "network/ip or namespace/hostname",
            "nowhere",
        ),
        (
            "services:\n- {name: s, namespace: n, hostname: h, vips: [10.0.0.1], ports: {}}\n",
            "network/ip",
            "10.0.0.1",
        ),
        (
            "services:\n- {name: s, namespace: n, hostname: h, vips: [/x], ports: {}}\n",
            "not an IP address",
            "/x",
        ),
        (
            "services:\n- {name: s, namespace: n, hostname: h, vips: [], ports: {}, visibility: Private}\n",
            "Public|Namespace",
            "Private",
        ),
        (
            "services:\n- {name: s, namespace: n, hostname: h, vips: [], ports: {}, "
            "loadBalancer: {mode: Random}}\n",
            "Standard|Strict|Failover|Passthrough",
            "Random",
        ),
        (
            "policies:\n- {name: p, namespace: n, scope: Cluster, action: Allow, rules: [], dryRun: false}\n",
            "Global|Namespace|WorkloadSelector",
            "Cluster",
        ),
        (
            "policies:\n- {name: p, namespace: n, scope: Global, action: Audit, rules: [], dryRun: false}\n",
            "Allow|Deny",
            "Audit",
        ),
        (
            "policies:\n- {name: p, namespace: n, scope: Global, action: Allow, dryRun: false, "
            "rules: [[[{principals: [{Regex: x}]}]]]}\n",
            "Exact|Prefix|Suffix|Presence",
            "Regex",
        ),
        (
            "policies:\n- {name: p, namespace: n, scope: Global, action: Allow, dryRun: false, "
            "rules: [[[{principals: [{Exact: a, Prefix: b}]}]]]}\n",
            "exactly one",
            "{Exact: a",
        ),
        (
            "policies:\n- {name: p, namespace: n, scope: Global, action: Allow, dryRun: false, "
            "rules: [[[{sourceIps: [10.0.0.0/33]}]]]}\n",
            "not a CIDR",
            "10.0.0.0/33",
        ),
        (
            "policies:\n- {name: p, namespace: n, scope: Global, action: Allow, dryRun: false, "
            "rules: [[[{principals: [{Presence: x}]}]]]}\n",
            "Presence takes no value",
            "x}",
        ),
        ("workloads:\n- {namespace: x, namespace: y, workloadIps: []}\n", "duplicate key", "namespace: y"),
        ("workloads: [\n", "invalid YAML", "\n"),
    ],
)
def test_errors_have_positions(text: str, needle: str, marker: str) -> None:
    """The error names the file position of the offending node (marked by `marker` in `text`)."""
    err = parse_error(text)
    assert err.source == _position_of(text, marker), err
    assert needle in err.message


def _position_of(text: str, marker: str) -> str:
    index = text.index(marker)
    if marker == "\n":  # end of input: the position just after the last line
        index += 1
    line = text.count("\n", 0, index) + 1
    column = index - (text.rfind("\n", 0, index) + 1) + 1
    return f"test.yaml:{line}:{column}"


# -- hypothesis: parse or ConfigError, nothing else ----------------------------------------------

_KEYS = [
    "workloads", "services", "policies", "uid", "name", "namespace", "workloadIps", "protocol",
    "waypoint", "destination", "hboneMtlsPort", "vips", "ports", "hostname", "services", "status",
    "capacity", "loadBalancer", "mode", "routingPreferences", "rules", "scope", "action", "dryRun",
    "principals", "Exact", "Presence", "sourceIps", "destinationPorts", "locality", "endpoints",
    "cidrVips", "cidr", "weightedWaypoints", "weight", "applicationTunnel", "port", "bogus",
]  # fmt: skip
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True),
    st.sampled_from(
        [
            "",
            "HBONE",
            "TCP",
            "/10.0.0.1",
            "10.0.0.1",
            "ns/host",
            "fd00::1",
            "10.0.0.0/8",
            "Allow",
            "Global",
            "Strict",
            "Network",
            "x/y/z",
            "spiffe://td/ns/a/sa/b",
        ]
    ),  # fmt: skip
    st.text(max_size=8),
)
_KEY = st.one_of(st.sampled_from(_KEYS), st.integers(min_value=0, max_value=70000), st.text(max_size=6))
_DOCUMENT = st.recursive(
    _SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(_KEY, children, max_size=5),
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        _DOCUMENT,
        st.fixed_dictionaries(
            {},
            optional={
                "workloads": st.lists(st.dictionaries(_KEY, _DOCUMENT, max_size=6), max_size=3),
                "services": st.lists(st.dictionaries(_KEY, _DOCUMENT, max_size=6), max_size=3),
                "policies": st.lists(st.dictionaries(_KEY, _DOCUMENT, max_size=6), max_size=3),
            },
        ),
    )
)
def test_yaml_documents_parse_or_raise_config_error(document: object) -> None:
    text = yaml.safe_dump(document)
    try:
        config = parse_local_config(text, "fuzz.yaml")
    except ConfigError as err:
        assert err.source.startswith("fuzz.yaml")
    else:
        assert isinstance(config, LocalConfig)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.text(max_size=200),
        # YAML punctuation and our own key names, so more inputs get past the scanner.
        st.lists(
            st.sampled_from(
                [
                    " ",
                    "\n",
                    "- ",
                    ": ",
                    "[",
                    "]",
                    "{",
                    "}",
                    ",",
                    "&a ",
                    "*a",
                    "!!int ",
                    "'",
                    '"',
                    "#",
                    "|",
                    "? ",
                    "workloads",
                    "services",
                    "policies",
                    "namespace",
                    "workloadIps",
                    "10.0.0.1",
                    "/1.2.3.4",
                    "80",
                ]
            ),  # fmt: skip
            max_size=40,
        ).map("".join),
    )
)
def test_arbitrary_text_parses_or_raises_config_error(text: str) -> None:
    try:
        parse_local_config(text, "fuzz.yaml")
    except ConfigError:
        pass


# -- round trip: valid documents built from the model's own vocabulary ----------------------------

_NAME = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=10)
_IPV4 = st.ip_addresses(v=4).map(str)
_PORT = st.integers(min_value=0, max_value=65535)


@st.composite
def _workload_document(draw: st.DrawFn) -> dict:
    doc: dict = {"namespace": draw(_NAME), "workloadIps": draw(st.lists(_IPV4, max_size=3))}
    optional = {
        "uid": _NAME,
        "serviceAccount": _NAME,
        "protocol": st.sampled_from(["TCP", "HBONE"]),
        "status": st.sampled_from(["Healthy", "Unhealthy"]),
        "workloadType": st.sampled_from(["deployment", "cronjob", "pod", "job"]),
        "capacity": st.integers(min_value=0, max_value=2**32 - 1),
        "services": st.dictionaries(
            st.tuples(_NAME, _NAME).map("/".join), st.dictionaries(_PORT, _PORT, max_size=3), max_size=3
        ),
        "waypoint": st.fixed_dictionaries({"destination": _IPV4.map(lambda ip: "/" + ip)}),
    }
    for key, strategy in optional.items():
        if draw(st.booleans()):
            doc[key] = draw(strategy)
    return doc


@settings(max_examples=150, deadline=None)
@given(_workload_document())
def test_valid_workloads_round_trip(doc: dict) -> None:
    (wl,) = parse_local_config(yaml.safe_dump({"workloads": [doc]}), "rt.yaml").workloads
    assert wl.namespace == doc["namespace"]
    assert [str(ip) for ip in wl.workload_ips] == doc["workloadIps"]
    assert wl.uid == doc.get("uid", "")
    assert wl.service_account == doc.get("serviceAccount", "")
    assert wl.protocol.value == doc.get("protocol", "TCP")
    assert wl.status.value == doc.get("status", "Healthy")
    assert wl.workload_type.value == doc.get("workloadType", "deployment")
    assert wl.capacity == doc.get("capacity", 1)
    assert wl.services == doc.get("services", {})
    if "waypoint" in doc:
        assert wl.waypoint is not None and wl.waypoint.hbone_mtls_port == 15008
        assert "/" + str(wl.waypoint.destination.address) == doc["waypoint"]["destination"]
    else:
        assert wl.waypoint is None


def test_unquoted_yaml_boolean_for_a_string_says_to_quote_it() -> None:
    err = parse_error("workloads:\n- {namespace: no, workloadIps: []}\n")
    assert "quote it" in err.message


# -- the rbac model as parsed -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("matcher", "value", "expected"),
    [
        ("{Exact: cluster.local/ns/a/sa/b}", "cluster.local/ns/a/sa/b", True),
        ("{Exact: cluster.local/ns/a/sa/b}", "cluster.local/ns/a/sa/bb", False),
        ("{Prefix: team-}", "team-a", True),
        ("{Prefix: team-}", "a-team-", False),
        ("{Suffix: /sa/admin}", "td/ns/x/sa/admin", True),
        ("{Suffix: /sa/admin}", "td/ns/x/sa/admins", False),
        ("{Presence: []}", "anything", True),
        ("{Presence: []}", "", False),
    ],
)
def test_parsed_string_matchers_match(matcher: str, value: str, expected: bool) -> None:
    config = parse(
        f"""
        policies:
        - {{name: p, namespace: ns, scope: Namespace, action: Deny, dryRun: false,
            rules: [[[{{principals: [{matcher}]}}]]]}}
        """
    )
    (policy,) = config.policies
    assert policy.key == "ns/p"
    (string_match,) = policy.rules[0].clauses[0].matches[0].principals
    assert string_match.matches(value) is expected


@pytest.mark.parametrize("text", ["[" * 5000, "- " * 3000, "{a: " * 3000])
def test_deeply_nested_yaml_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_local_config(text, "deep.yaml")


def test_recursive_alias_is_a_config_error_not_a_hang() -> None:
    err = parse_error("workloads:\n- &w {namespace: a, workloadIps: [], locality: *w}\n")
    # The alias points back at the workload mapping it is inside: refused where it stands.
    assert err.source == "test.yaml:2:48"  # the `*w`
    assert "recursive alias" in err.message and "*w" in err.message
