"""The local (static) xDS file: `LOCAL_XDS_PATH` / `LOCAL_XDS`.

Counterpart: ztunnel src/xds.rs (`LocalConfig`, `LocalWorkload`). The YAML is ztunnel's
(docs/istio-behaviour.md, "Local config file"): camelCase keys, unknown keys rejected. We walk the composed
YAML nodes rather than loaded Python objects so that every error can name `file:line:column`;
`yamlload` composes them with aliases bounded (a 1.9 KB file expanded to 943 MiB before).

As in ztunnel, no xDS defaults are applied to the stored strings (an empty `serviceAccount`
stays empty); `Workload.identity` applies Istio's defaults when an identity is needed.
"""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from .. import yamlload
from ..errors import ConfigError
from ..net import MAX_PORT, IPAddress, ip_address
from ..ports import HBONE_PORT
from ..rbac import (
    Action,
    Authorization,
    Clause,
    IPNetwork,
    Match,
    Rule,
    Scope,
    ServiceAccountMatch,
    StringMatch,
    StringMatchKind,
)
from .model import (
    ApplicationTunnel,
    AppTunnelProtocol,
    Endpoint,
    GatewayAddress,
    HealthPolicy,
    IpFamilies,
    LoadBalancing,
    LoadBalancingMode,
    LoadBalancingScope,
    Locality,
    NamespacedHostname,
    NetworkAddress,
    NetworkMode,
    Service,
    TunnelProtocol,
    Visibility,
    WeightedWaypoint,
    Workload,
    WorkloadStatus,
    WorkloadType,
)

MAX_UINT32 = 2**32 - 1

_TAG = "tag:yaml.org,2002:"
E = TypeVar("E", bound=enum.Enum)
T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalConfig:
    workloads: tuple[Workload, ...] = ()
    services: tuple[Service, ...] = ()
    policies: tuple[Authorization, ...] = ()


def parse_local_config(text: str, source_name: str = "LOCAL_XDS") -> LocalConfig:
    """Parse local-config YAML; any problem is a ConfigError naming `source:line:column`."""
    return _Parser(source_name).document(text)


class _Parser:
    def __init__(self, source: str) -> None:
        self.source = source
        self._scalars = SafeConstructor()

    # -- primitives -----------------------------------------------------------------------------

    def error(self, node: Node | None, message: str) -> ConfigError:
        if node is None or node.start_mark is None:
            return ConfigError(self.source, message)
        mark = node.start_mark
        return ConfigError(f"{self.source}:{mark.line + 1}:{mark.column + 1}", message)

    def document(self, text: str) -> LocalConfig:
        try:
            root = yamlload.compose(text)
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            where = f"{self.source}:{mark.line + 1}:{mark.column + 1}" if mark else self.source
            raise ConfigError(where, f"invalid YAML: {exc.problem or exc}") from None
        except (yaml.YAMLError, ValueError) as exc:
            raise ConfigError(self.source, f"invalid YAML: {exc}") from None
        except RecursionError:
            # PyYAML composes recursively; thousands of nested brackets exhaust the stack.
            raise ConfigError(self.source, "invalid YAML: nested too deeply") from None
        if root is None or self.is_null(root):
            return LocalConfig()
        fields = self.fields(root, "local config", optional={"workloads", "services", "policies"})
        return LocalConfig(
            workloads=tuple(self.list_of(fields.get("workloads"), self.workload, "workloads")),
            services=tuple(self.list_of(fields.get("services"), self.service, "services")),
            policies=tuple(self.list_of(fields.get("policies"), self.policy, "policies")),
        )

    def is_null(self, node: Node) -> bool:
        return isinstance(node, ScalarNode) and node.tag == _TAG + "null"

    def scalar(self, node: Node, what: str) -> object:
        if not isinstance(node, ScalarNode):
            raise self.error(node, f"{what}: expected a scalar, got a {_kind(node)}")
        if node.tag == _TAG + "str":
            return node.value
        try:
            return self._scalars.construct_object(node, deep=True)
        except Exception as exc:
            # PyYAML's scalar constructors fail in assorted ways on odd tagged values
            # (`!!int ''` is an IndexError); this is the one seam where they become ours.
            raise self.error(node, f"{what}: bad value {node.value!r}: {exc}") from None

    def string(self, node: Node, what: str) -> str:
        value = self.scalar(node, what)
        if not isinstance(value, str):
            # YAML reads unquoted `no` or `1.10` as a boolean or a number; say how to keep the text.
            raise self.error(
                node, f"{what}: expected a string, got {node.value!r} (quote it to keep it as text)"
            )
        return value

    def integer(self, node: Node, what: str, maximum: int) -> int:
        value = self.scalar(node, what)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(node, f"{what}: expected an integer, got {node.value!r}")
        if not 0 <= value <= maximum:
            raise self.error(node, f"{what}: {value} is out of range 0-{maximum}")
        return value

    def port(self, node: Node, what: str) -> int:
        return self.integer(node, what, MAX_PORT)

    def boolean(self, node: Node, what: str) -> bool:
        value = self.scalar(node, what)
        if not isinstance(value, bool):
            raise self.error(node, f"{what}: expected true or false, got {node.value!r}")
        return value

    def enum(self, node: Node, cls: type[E], what: str) -> E:
        value = self.string(node, what)
        for member in cls:
            if member.value == value:
                return member
        allowed = "|".join(str(m.value) for m in cls)
        raise self.error(node, f"{what}: unknown value {value!r} (expected {allowed})")

    def ip(self, node: Node, what: str) -> IPAddress:
        text = self.string(node, what)
        try:
            return ip_address(text)
        except ValueError:
            raise self.error(node, f"{what}: {text!r} is not an IP address") from None

    def cidr(self, node: Node, what: str) -> IPNetwork:
        text = self.string(node, what)
        try:
            network = ipaddress.ip_network(text, strict=False)
        except ValueError:
            raise self.error(node, f"{what}: {text!r} is not a CIDR or IP address") from None
        return network

    def sequence(self, node: Node | None, what: str) -> list[Node]:
        if node is None or self.is_null(node):
            return []
        if not isinstance(node, SequenceNode):
            raise self.error(node, f"{what}: expected a list, got a {_kind(node)}")
        return list(node.value)

    def list_of(self, node: Node | None, item: Callable[[Node], T], what: str) -> list[T]:
        return [item(child) for child in self.sequence(node, what)]

    def pairs(self, node: Node, what: str) -> list[tuple[Node, Node]]:
        """Mapping entries; duplicate keys are an error (serde rejects them too)."""
        if not isinstance(node, MappingNode):
            raise self.error(node, f"{what}: expected a mapping, got a {_kind(node)}")
        seen: set[object] = set()
        entries = []
        for key_node, value_node in node.value:
            key = self.scalar(key_node, f"{what} key")
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:
                raise self.error(key_node, f"{what}: unusable key {key_node.value!r}") from None
            if duplicate:
                raise self.error(key_node, f"{what}: duplicate key {key_node.value!r}")
            entries.append((key_node, value_node))
        return entries

    def fields(
        self, node: Node, what: str, *, required: frozenset[str] | set[str] = frozenset(), optional: set[str]
    ) -> dict[str, Node]:
        result: dict[str, Node] = {}
        allowed = set(required) | set(optional)
        for key_node, value_node in self.pairs(node, what):
            key = self.string(key_node, f"{what} key")
            if key not in allowed:
                raise self.error(
                    key_node, f"unknown key {key!r} in {what} (expected one of {_names(allowed)})"
                )
            result[key] = value_node
        missing = sorted(set(required) - result.keys())
        if missing:
            raise self.error(node, f"{what}: missing required key {missing[0]!r}")
        return result

    def opt_string(self, fields: dict[str, Node], key: str, what: str) -> str:
        node = fields.get(key)
        return "" if node is None else self.string(node, f"{what}.{key}")

    # -- workloads ------------------------------------------------------------------------------

    _WORKLOAD_KEYS = {
        "uid", "name", "namespace", "workloadIps", "hostname", "network", "protocol", "networkMode",
        "trustDomain", "serviceAccount", "waypoint", "networkGateway", "node", "canonicalName",
        "canonicalRevision", "workloadType", "workloadName", "nativeTunnel", "applicationTunnel",
        "authorizationPolicies", "status", "clusterId", "locality", "capacity", "services",
    }  # fmt: skip

    def workload(self, node: Node) -> Workload:
        what = "workload"
        f = self.fields(node, what, required={"namespace", "workloadIps"}, optional=self._WORKLOAD_KEYS)

        def text(key: str) -> str:
            return self.opt_string(f, key, what)

        kwargs: dict[str, object] = {}
        if "protocol" in f:
            kwargs["protocol"] = self.enum(f["protocol"], TunnelProtocol, "workload.protocol")
        if "networkMode" in f:
            kwargs["network_mode"] = self.enum(f["networkMode"], NetworkMode, "workload.networkMode")
        if "workloadType" in f:
            kwargs["workload_type"] = self.enum(f["workloadType"], WorkloadType, "workload.workloadType")
        if "status" in f:
            kwargs["status"] = self.enum(f["status"], WorkloadStatus, "workload.status")
        if "nativeTunnel" in f:
            kwargs["native_tunnel"] = self.boolean(f["nativeTunnel"], "workload.nativeTunnel")
        if "capacity" in f:
            kwargs["capacity"] = self.integer(f["capacity"], "workload.capacity", MAX_UINT32)
        if "waypoint" in f and not self.is_null(f["waypoint"]):
            kwargs["waypoint"] = self.gateway(f["waypoint"], "workload.waypoint")
        if "networkGateway" in f and not self.is_null(f["networkGateway"]):
            kwargs["network_gateway"] = self.gateway(f["networkGateway"], "workload.networkGateway")
        if "applicationTunnel" in f and not self.is_null(f["applicationTunnel"]):
            kwargs["application_tunnel"] = self.app_tunnel(f["applicationTunnel"])
        if "locality" in f:
            kwargs["locality"] = self.locality(f["locality"])
        return Workload(
            uid=text("uid"),
            name=text("name"),
            namespace=text("namespace"),
            workload_ips=tuple(
                self.ip(n, "workload.workloadIps") for n in self.sequence(f["workloadIps"], "workloadIps")
            ),
            hostname=text("hostname"),
            network=text("network"),
            trust_domain=text("trustDomain"),
            service_account=text("serviceAccount"),
            node=text("node"),
            canonical_name=text("canonicalName"),
            canonical_revision=text("canonicalRevision"),
            workload_name=text("workloadName"),
            cluster_id=text("clusterId"),
            authorization_policies=tuple(
                self.string(n, "workload.authorizationPolicies")
                for n in self.sequence(f.get("authorizationPolicies"), "authorizationPolicies")
            ),
            services=self.workload_services(f.get("services")),
            **kwargs,  # type: ignore[arg-type]
        )

    def workload_services(self, node: Node | None) -> dict[str, dict[int, int]]:
        if node is None or self.is_null(node):
            return {}
        result: dict[str, dict[int, int]] = {}
        for key_node, value_node in self.pairs(node, "workload.services"):
            key = self.string(key_node, "workload.services key")
            # The key names a service as `namespace/hostname`; ztunnel rejects anything else.
            if "/" not in key:
                raise self.error(
                    key_node, f"workload.services key {key!r} is not of the form namespace/hostname"
                )
            result[key] = self.port_map(value_node, f"workload.services[{key!r}]")
        return result

    def port_map(self, node: Node, what: str) -> dict[int, int]:
        if self.is_null(node):
            return {}
        return {
            self.port(k, f"{what} port"): self.port(v, f"{what} target port")
            for k, v in self.pairs(node, what)
        }

    def locality(self, node: Node) -> Locality:
        f = self.fields(node, "locality", optional={"region", "zone", "subzone"})
        return Locality(
            region=self.opt_string(f, "region", "locality"),
            zone=self.opt_string(f, "zone", "locality"),
            subzone=self.opt_string(f, "subzone", "locality"),
        )

    def app_tunnel(self, node: Node) -> ApplicationTunnel:
        f = self.fields(node, "applicationTunnel", optional={"protocol", "port"})
        return ApplicationTunnel(
            protocol=self.enum(f["protocol"], AppTunnelProtocol, "applicationTunnel.protocol")
            if "protocol" in f
            else AppTunnelProtocol.NONE,
            port=self.port(f["port"], "applicationTunnel.port") if "port" in f else 0,
        )

    def gateway(self, node: Node, what: str) -> GatewayAddress:
        f = self.fields(node, what, required={"destination"}, optional={"hboneMtlsPort"})
        port = self.port(f["hboneMtlsPort"], f"{what}.hboneMtlsPort") if "hboneMtlsPort" in f else HBONE_PORT
        return GatewayAddress(
            destination=self.gateway_destination(f["destination"], what), hbone_mtls_port=port
        )

    def gateway_destination(self, node: Node, what: str) -> NetworkAddress | NamespacedHostname:
        text = self.string(node, f"{what}.destination")
        left, sep, right = text.partition("/")
        if not sep or not right:
            raise self.error(node, f"{what}.destination {text!r}: expected network/ip or namespace/hostname")
        try:
            return NetworkAddress(network=left, address=ip_address(right))
        except ValueError:
            pass
        if not left:
            raise self.error(node, f"{what}.destination {text!r}: a hostname needs a namespace")
        return NamespacedHostname(namespace=left, hostname=right)

    def network_address(self, node: Node, what: str) -> NetworkAddress:
        text = self.string(node, what)
        network, sep, ip_text = text.partition("/")
        if not sep:
            raise self.error(
                node, f"{what} {text!r}: expected network/ip (leading '/' for the default network)"
            )
        try:
            return NetworkAddress(network=network, address=ip_address(ip_text))
        except ValueError:
            raise self.error(node, f"{what} {text!r}: {ip_text!r} is not an IP address") from None

    # -- services -------------------------------------------------------------------------------

    _SERVICE_KEYS = {
        "name", "namespace", "hostname", "vips", "cidrVips", "ports", "endpoints", "subjectAltNames",
        "waypoint", "weightedWaypoints", "loadBalancer", "ipFamilies", "canonical", "visibility",
    }  # fmt: skip

    def service(self, node: Node) -> Service:
        what = "service"
        f = self.fields(
            node,
            what,
            required={"name", "namespace", "hostname", "vips", "ports"},
            optional=self._SERVICE_KEYS,
        )
        kwargs: dict[str, object] = {}
        if "waypoint" in f and not self.is_null(f["waypoint"]):
            kwargs["waypoint"] = self.gateway(f["waypoint"], "service.waypoint")
        if "loadBalancer" in f and not self.is_null(f["loadBalancer"]):
            kwargs["load_balancer"] = self.load_balancer(f["loadBalancer"])
        if "ipFamilies" in f:
            kwargs["ip_families"] = self.enum(f["ipFamilies"], IpFamilies, "service.ipFamilies")
        if "canonical" in f:
            kwargs["canonical"] = self.boolean(f["canonical"], "service.canonical")
        if "visibility" in f:
            kwargs["visibility"] = self.enum(f["visibility"], Visibility, "service.visibility")
        return Service(
            name=self.string(f["name"], "service.name"),
            namespace=self.string(f["namespace"], "service.namespace"),
            hostname=self.string(f["hostname"], "service.hostname"),
            vips=tuple(
                self.network_address(n, "service.vips") for n in self.sequence(f["vips"], "service.vips")
            ),
            cidr_vips=tuple(self.cidr_vip(n) for n in self.sequence(f.get("cidrVips"), "service.cidrVips")),
            ports=self.port_map(f["ports"], "service.ports"),
            endpoints=self.endpoints(f.get("endpoints")),
            subject_alt_names=tuple(
                self.string(n, "service.subjectAltNames")
                for n in self.sequence(f.get("subjectAltNames"), "service.subjectAltNames")
            ),
            weighted_waypoints=tuple(
                self.weighted_waypoint(n)
                for n in self.sequence(f.get("weightedWaypoints"), "weightedWaypoints")
            ),
            **kwargs,  # type: ignore[arg-type]
        )

    def cidr_vip(self, node: Node) -> tuple[str, IPNetwork]:
        f = self.fields(node, "service.cidrVips entry", required={"cidr"}, optional={"network"})
        return (self.opt_string(f, "network", "cidrVips"), self.cidr(f["cidr"], "service.cidrVips.cidr"))

    def endpoints(self, node: Node | None) -> dict[str, Endpoint]:
        if node is None or self.is_null(node):
            return {}
        result: dict[str, Endpoint] = {}
        for key_node, value_node in self.pairs(node, "service.endpoints"):
            key = self.string(key_node, "service.endpoints key")
            f = self.fields(value_node, "endpoint", optional={"workloadUid", "port", "status"})
            uid = self.opt_string(f, "workloadUid", "endpoint") or key
            result[uid] = Endpoint(
                workload_uid=uid,
                port=self.port_map(f["port"], "endpoint.port") if "port" in f else {},
                status=self.enum(f["status"], WorkloadStatus, "endpoint.status")
                if "status" in f
                else WorkloadStatus.HEALTHY,
            )
        return result

    def weighted_waypoint(self, node: Node) -> WeightedWaypoint:
        f = self.fields(node, "weightedWaypoints entry", required={"destination"}, optional={"weight"})
        destination = f["destination"]
        if isinstance(destination, MappingNode):
            gateway = self.gateway(destination, "weightedWaypoints.destination")
        else:
            gateway = GatewayAddress(destination=self.gateway_destination(destination, "weightedWaypoints"))
        weight = self.integer(f["weight"], "weightedWaypoints.weight", MAX_UINT32) if "weight" in f else 0
        return WeightedWaypoint(destination=gateway, weight=weight)

    def load_balancer(self, node: Node) -> LoadBalancing:
        f = self.fields(node, "loadBalancer", optional={"routingPreferences", "mode", "healthPolicy"})
        return LoadBalancing(
            routing_preferences=tuple(
                self.enum(n, LoadBalancingScope, "loadBalancer.routingPreferences")
                for n in self.sequence(f.get("routingPreferences"), "loadBalancer.routingPreferences")
            ),
            mode=self.enum(f["mode"], LoadBalancingMode, "loadBalancer.mode")
            if "mode" in f
            else LoadBalancingMode.STANDARD,
            health_policy=self.enum(f["healthPolicy"], HealthPolicy, "loadBalancer.healthPolicy")
            if "healthPolicy" in f
            else HealthPolicy.ONLY_HEALTHY,
        )

    # -- policies -------------------------------------------------------------------------------

    def policy(self, node: Node) -> Authorization:
        f = self.fields(
            node,
            "policy",
            required={"name", "namespace", "scope", "action", "rules", "dryRun"},
            optional=set(),
        )
        return Authorization(
            name=self.string(f["name"], "policy.name"),
            namespace=self.string(f["namespace"], "policy.namespace"),
            scope=self.enum(f["scope"], Scope, "policy.scope"),
            action=self.enum(f["action"], Action, "policy.action"),
            dry_run=self.boolean(f["dryRun"], "policy.dryRun"),
            rules=tuple(
                Rule(
                    clauses=tuple(
                        Clause(matches=tuple(self.match(m) for m in self.sequence(clause, "clause")))
                        for clause in self.sequence(rule, "rule")
                    )
                )
                for rule in self.sequence(f["rules"], "policy.rules")
            ),
        )

    _STRING_MATCH_LISTS = {
        "namespaces": "namespaces", "notNamespaces": "not_namespaces",
        "principals": "principals", "notPrincipals": "not_principals",
    }  # fmt: skip
    _SA_LISTS = {"serviceAccounts": "service_accounts", "notServiceAccounts": "not_service_accounts"}
    _CIDR_LISTS = {
        "sourceIps": "source_ips", "notSourceIps": "not_source_ips",
        "destinationIps": "destination_ips", "notDestinationIps": "not_destination_ips",
    }  # fmt: skip
    _PORT_LISTS = {"destinationPorts": "destination_ports", "notDestinationPorts": "not_destination_ports"}

    def match(self, node: Node) -> Match:
        keys = self._STRING_MATCH_LISTS | self._SA_LISTS | self._CIDR_LISTS | self._PORT_LISTS
        f = self.fields(node, "match", optional=set(keys))
        kwargs: dict[str, tuple[Any, ...]] = {}
        for key, value in f.items():
            items = self.sequence(value, f"match.{key}")
            if key in self._STRING_MATCH_LISTS:
                kwargs[keys[key]] = tuple(self.string_match(n, f"match.{key}") for n in items)
            elif key in self._SA_LISTS:
                kwargs[keys[key]] = tuple(self.sa_match(n) for n in items)
            elif key in self._CIDR_LISTS:
                kwargs[keys[key]] = tuple(self.cidr(n, f"match.{key}") for n in items)
            else:
                kwargs[keys[key]] = tuple(self.port(n, f"match.{key}") for n in items)
        return Match(**kwargs)

    def string_match(self, node: Node, what: str) -> StringMatch:
        entries = self.pairs(node, what)
        if len(entries) != 1:
            raise self.error(
                node, f"{what}: a string matcher has exactly one of Exact, Prefix, Suffix, Presence"
            )
        key_node, value_node = entries[0]
        kind = self.enum(key_node, StringMatchKind, f"{what} matcher")
        if kind is StringMatchKind.PRESENCE:
            # A unit variant: `{Presence: []}` in ztunnel's files; null and {} mean the same.
            empty = self.is_null(value_node) or (
                isinstance(value_node, SequenceNode | MappingNode) and not value_node.value
            )
            if not empty:
                raise self.error(value_node, f"{what}: Presence takes no value (write {{Presence: []}})")
            return StringMatch.presence()
        return StringMatch(kind=kind, value=self.string(value_node, f"{what}.{kind.value}"))

    def sa_match(self, node: Node) -> ServiceAccountMatch:
        f = self.fields(
            node, "service account match", required={"namespace", "serviceAccount"}, optional=set()
        )
        return ServiceAccountMatch(
            namespace=self.string(f["namespace"], "serviceAccounts.namespace"),
            service_account=self.string(f["serviceAccount"], "serviceAccounts.serviceAccount"),
        )


def _kind(node: Node) -> str:
    if isinstance(node, MappingNode):
        return "mapping"
    if isinstance(node, SequenceNode):
        return "list"
    return "scalar"


def _names(keys: set[str]) -> str:
    return ", ".join(sorted(keys)) if keys else "no keys"
