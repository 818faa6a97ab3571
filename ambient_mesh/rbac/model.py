"""The L4 authorization model: `istio.security.Authorization` as the node proxy holds it, the
connection as policies see it, and the decision.

Counterparts: ztunnel src/rbac.rs (`Authorization`, `RbacMatch`, `StringMatch`, `Connection`). Wire form:
docs/istio-behaviour.md, "Authorization", where istiod's `groups -> rules -> matches` is ztunnel's `rules ->
clauses -> matches`; we use ztunnel's names. Behaviour: docs/istio-behaviour.md, "Authorization",
"STRICT mTLS" and "Policy changes on live connections". How a policy is matched: `reference` (the plain
reading), `compiled` (the fast path).
"""

from __future__ import annotations

import enum
import ipaddress
import logging
from dataclasses import dataclass

from ..identity.spiffe import Identity
from ..net import IPAddress, SocketAddr

log = logging.getLogger(__name__)

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class Scope(enum.Enum):
    GLOBAL = "Global"  # wire 0
    NAMESPACE = "Namespace"  # wire 1
    WORKLOAD_SELECTOR = "WorkloadSelector"  # wire 2


class Action(enum.Enum):
    ALLOW = "Allow"  # wire 0
    DENY = "Deny"  # wire 1


class StringMatchKind(enum.Enum):
    EXACT = "Exact"
    PREFIX = "Prefix"
    SUFFIX = "Suffix"
    PRESENCE = "Presence"


@dataclass(frozen=True, slots=True, kw_only=True)
class StringMatch:
    kind: StringMatchKind
    value: str = ""

    def matches(self, candidate: str) -> bool:
        match self.kind:
            case StringMatchKind.EXACT:
                return candidate == self.value
            case StringMatchKind.PREFIX:
                return candidate.startswith(self.value)
            case StringMatchKind.SUFFIX:
                return candidate.endswith(self.value)
            case StringMatchKind.PRESENCE:
                # Istio's `*`: any non-empty value (a peer without identity has none).
                return candidate != ""
        raise AssertionError(self.kind)

    @classmethod
    def exact(cls, value: str) -> StringMatch:
        return cls(kind=StringMatchKind.EXACT, value=value)

    @classmethod
    def prefix(cls, value: str) -> StringMatch:
        return cls(kind=StringMatchKind.PREFIX, value=value)

    @classmethod
    def suffix(cls, value: str) -> StringMatch:
        return cls(kind=StringMatchKind.SUFFIX, value=value)

    @classmethod
    def presence(cls) -> StringMatch:
        return cls(kind=StringMatchKind.PRESENCE)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceAccountMatch:
    namespace: str
    service_account: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Match:
    """One match entry: non-empty lists are AND-ed, values within a list OR-ed."""

    namespaces: tuple[StringMatch, ...] = ()
    not_namespaces: tuple[StringMatch, ...] = ()
    service_accounts: tuple[ServiceAccountMatch, ...] = ()
    not_service_accounts: tuple[ServiceAccountMatch, ...] = ()
    principals: tuple[StringMatch, ...] = ()
    not_principals: tuple[StringMatch, ...] = ()
    source_ips: tuple[IPNetwork, ...] = ()
    not_source_ips: tuple[IPNetwork, ...] = ()
    destination_ips: tuple[IPNetwork, ...] = ()
    not_destination_ips: tuple[IPNetwork, ...] = ()
    destination_ports: tuple[int, ...] = ()
    not_destination_ports: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Clause:
    """Istio's `Rules`: any one of `matches` satisfies the clause."""

    matches: tuple[Match, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Rule:
    """Istio's `Group`: every clause must be satisfied."""

    clauses: tuple[Clause, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Authorization:
    name: str
    namespace: str
    scope: Scope = Scope.GLOBAL  # the proto3 zero value, as on the wire
    action: Action = Action.ALLOW
    rules: tuple[Rule, ...] = ()
    dry_run: bool = False

    @property
    def key(self) -> str:
        """xDS resource name and `Workload.authorization_policies` entry: `namespace/name`."""
        return f"{self.namespace}/{self.name}"


# -- STRICT mTLS as istiod expresses it (docs/istio-behaviour.md, "STRICT mTLS") -------------------

STRICT_MTLS_POLICY_NAME = "istio_converted_static_strict"
DEFAULT_ROOT_NAMESPACE = "istio-system"


def strict_mtls_policy(root_namespace: str = DEFAULT_ROOT_NAMESPACE) -> Authorization:
    """The static policy istiod sends once any PeerAuthentication exists.

    Workloads whose effective mode is STRICT list its key in `authorization_policies`; it denies
    every peer that has no mTLS identity (no principal at all fails `presence`, so the negated
    list holds and the DENY matches).
    """
    return Authorization(
        name=STRICT_MTLS_POLICY_NAME,
        namespace=root_namespace,
        scope=Scope.WORKLOAD_SELECTOR,
        action=Action.DENY,
        rules=(Rule(clauses=(Clause(matches=(Match(not_principals=(StringMatch.presence(),)),)),)),),
    )


# -- what authorization sees of a connection --------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RbacConnection:
    """ztunnel's `rbac::Connection`: the inbound connection as policies see it.

    `dst_ip` is the local pod IP and `dst_port` the resolved target port (the port inside the
    HBONE CONNECT authority, never 15008). `src_identity` is the mTLS-proven peer identity; None
    for plaintext. `dst_network` does not take part in matching; it keys the connection for the
    policy watcher (docs/istio-behaviour.md, "Policy changes on live connections").
    """

    src_identity: Identity | None
    src_ip: IPAddress
    dst_ip: IPAddress
    dst_port: int
    dst_network: str = ""

    def __str__(self) -> str:
        return f"{self.src_ip}({self.src_identity or 'None'})->{SocketAddr(self.dst_ip, self.dst_port)}"


REASON_DENIED = "explicitly denied by: {key}"
REASON_NOT_ALLOWED = "allow policies exist, but none allowed"
REASON_NO_ALLOW_POLICIES = "no allow policies"
REASON_ALLOWED = "allowed by: {key}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """The outcome of authorizing one connection; a denial is a value, not an exception."""

    allowed: bool
    policy: str | None
    reason: str
    dry_run_matches: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{'allow' if self.allowed else 'deny'}: {self.reason}"


def log_dry_run(decision: Decision, conn: RbacConnection) -> None:
    """Log what dry-run policies would have done (docs/istio-behaviour.md, "Authorization": evaluated, logged,
    never enforced)."""
    for key in decision.dry_run_matches:
        log.info("dry-run policy %s matches connection %s", key, conn)
