"""The L4 authorization model: `istio.security.Authorization` as the node proxy holds it.

Counterpart: ztunnel src/rbac.rs (the data types only). Wire form: spec/wire-protocols.md
section 3, where istiod's `groups -> rules -> matches` is ztunnel's `rules -> clauses -> matches`;
we use ztunnel's names. Evaluation (which policies apply, deny-before-allow, dry run) lands with
the authorization issue; this module only describes policies.
"""

from __future__ import annotations

import enum
import ipaddress
from dataclasses import dataclass

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
