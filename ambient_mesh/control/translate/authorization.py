"""AuthorizationPolicy -> `istio.security.Authorization`, the L4 part ztunnel enforces.

Counterpart of istiod's convertAuthorizationPolicy (pilot/pkg/serviceregistry/kube/controller/
ambient/authorization.go): ALLOW and DENY policies without targetRefs; HTTP attributes cannot be
checked at L4, so ALLOW rules that need them are dropped and DENY rules lose those parts (both
more restrictive than asked), with a note saying so; dry-run policies only when
ENABLE_WDS_DRY_RUN_AUTHZ_POLICY is on.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable
from typing import Any

from ...kube.model import AuthorizationPolicy, AuthorizationRule, Operation, Source
from ...metadata import ANNOTATION_DRY_RUN
from ...wire.istio.security import authorization_pb2 as sec
from .common import MeshSettings


def _string_matches(values: tuple[str, ...]) -> list[sec.StringMatch]:
    out = []
    for v in values:
        if v == "*":
            m = sec.StringMatch()
            m.presence.SetInParent()
        elif v.startswith("*"):
            m = sec.StringMatch(suffix=v[1:])
        elif v.endswith("*"):
            m = sec.StringMatch(prefix=v[:-1])
        else:
            m = sec.StringMatch(exact=v)
        out.append(m)
    return out


def _service_accounts(values: tuple[str, ...], namespace: str) -> list[sec.ServiceAccountMatch]:
    out = []
    for v in values:
        ns, sep, sa = v.partition("/")
        out.append(
            sec.ServiceAccountMatch(namespace=ns, serviceAccount=sa)
            if sep
            else sec.ServiceAccountMatch(namespace=namespace, serviceAccount=v)
        )
    return out


def _ports(values: tuple[str, ...]) -> list[int]:
    # Unparsable ports are dropped, as istiod does (validation would have rejected them).
    return [int(v) for v in values if v.isdigit() and int(v) <= 65535]


def _ips(values: tuple[str, ...]) -> list[sec.Address]:
    out = []
    for v in values:
        if not v:
            continue
        try:
            if "/" in v:
                net = ipaddress.ip_network(v, strict=False)
                # istiod keeps the address as written, with the prefix length beside it.
                ip = ipaddress.ip_address(v.split("/", 1)[0])
                out.append(sec.Address(address=ip.packed, length=net.prefixlen))
            else:
                ip = ipaddress.ip_address(v)
                out.append(sec.Address(address=ip.packed, length=ip.max_prefixlen))
        except ValueError:
            continue
    return out


# `when` keys ztunnel can check, and the Match fields (values, notValues) each one fills;
# anything else is an HTTP attribute.
_WHEN_FIELDS: dict[str, tuple[str, str, Callable[[tuple[str, ...]], list[Any]]]] = {
    "source.namespace": ("namespaces", "not_namespaces", _string_matches),
    "source.principal": ("principals", "not_principals", _string_matches),
    "source.ip": ("source_ips", "not_source_ips", _ips),
    "destination.port": ("destination_ports", "not_destination_ports", _ports),
    "destination.ip": ("destination_ips", "not_destination_ips", _ips),
}
L4_WHEN_KEYS = frozenset(_WHEN_FIELDS)


def _http_operation_fields(op: Operation) -> list[str]:
    names = ("hosts", "notHosts", "methods", "notMethods", "paths", "notPaths")
    values = (op.hosts, op.not_hosts, op.methods, op.not_methods, op.paths, op.not_paths)
    return [n for n, v in zip(names, values, strict=True) if v]


def _http_source_fields(src: Source) -> list[str]:
    names = (
        "remoteIpBlocks",
        "notRemoteIpBlocks",
        "requestPrincipals",
        "notRequestPrincipals",
        "trustDomains",
        "notTrustDomains",
    )
    values = (
        src.remote_ip_blocks,
        src.not_remote_ip_blocks,
        src.request_principals,
        src.not_request_principals,
        src.trust_domains,
        src.not_trust_domains,
    )
    return [n for n, v in zip(names, values, strict=True) if v]


def _convert_rule(
    action: int, rule: AuthorizationRule, namespace: str
) -> tuple[list[sec.Clause] | None, set[str]]:
    """One AuthorizationPolicy rule as the clauses of one wire Rule (istio: Group).

    Returns None for the clauses when the rule must be dropped: an ALLOW rule that needs HTTP
    attributes can never match at L4, so istiod omits it (more restrictive than asked).
    """
    http: set[str] = set()
    to_matches = []
    for op in rule.operations:
        http.update(_http_operation_fields(op))
        to_matches.append(
            sec.Match(destination_ports=_ports(op.ports), not_destination_ports=_ports(op.not_ports))
        )
    from_matches = []
    for src in rule.sources:
        http.update(_http_source_fields(src))
        from_matches.append(
            sec.Match(
                source_ips=_ips(src.ip_blocks),
                not_source_ips=_ips(src.not_ip_blocks),
                namespaces=_string_matches(src.namespaces),
                not_namespaces=_string_matches(src.not_namespaces),
                service_accounts=_service_accounts(src.service_accounts, namespace),
                not_service_accounts=_service_accounts(src.not_service_accounts, namespace),
                principals=_string_matches(src.principals),
                not_principals=_string_matches(src.not_principals),
            )
        )
    clauses = []
    if to_matches:
        clauses.append(sec.Clause(matches=to_matches))
    if from_matches:
        clauses.append(sec.Clause(matches=from_matches))
    for cond in rule.when:
        if cond.key not in L4_WHEN_KEYS:
            http.add(cond.key)
        m = sec.Match()
        # A non-L4 key leaves the match empty: ztunnel skips empty matches, so in a DENY policy
        # the HTTP part is removed (and if nothing else remains, the rule never fires).
        fields = _WHEN_FIELDS.get(cond.key)
        if fields is not None:
            positive, negative, convert = fields
            getattr(m, positive).extend(convert(cond.values))
            getattr(m, negative).extend(convert(cond.not_values))
        clauses.append(sec.Clause(matches=[m]))
    if action == sec.ALLOW and http:
        return None, http
    return clauses, http


def _has_effective_rules(rules: Iterable[Any]) -> bool:
    for rule in rules:
        if not rule.clauses:
            return True
        if all(any(m.ByteSize() for m in clause.matches) for clause in rule.clauses):
            return True
    return False


def convert_authorization_policy(
    policy: AuthorizationPolicy, settings: MeshSettings
) -> tuple[sec.Authorization | None, str | None]:
    """(resource or None when it is not for ztunnel, a status note or None)."""
    meta = policy.metadata
    key = f"AuthorizationPolicy {meta.namespace}/{meta.name}"
    dry_run = meta.annotations.get(ANNOTATION_DRY_RUN, "").lower() in ("1", "t", "true")
    if dry_run and not settings.enable_wds_dry_run:
        return None, f"{key}: dry-run policies are not sent to ztunnel (WDS dry-run support disabled)"
    if policy.target_refs:
        # targetRef(s) bind the policy to a waypoint, not to ztunnel.
        return None, None
    if policy.selector is None:
        scope = sec.GLOBAL if meta.namespace == settings.root_namespace else sec.NAMESPACE
    else:
        scope = sec.WORKLOAD_SELECTOR
    if policy.action not in ("ALLOW", "DENY"):
        return None, f"{key}: ztunnel does not support the {policy.action} action"
    action = sec.ALLOW if policy.action == "ALLOW" else sec.DENY
    out = sec.Authorization(
        name=meta.name, namespace=meta.namespace, scope=scope, action=action, dry_run=dry_run
    )
    http: set[str] = set()
    for rule in policy.rules:
        clauses, found = _convert_rule(action, rule, meta.namespace)
        http |= found
        if clauses is not None:
            out.rules.add().clauses.extend(clauses)
    if not http:
        return out, None
    if action == sec.DENY and not _has_effective_rules(out.rules):
        effect = "with the HTTP attributes removed this DENY policy has no effect at ztunnel"
    elif action == sec.DENY:
        effect = "the DENY policy is enforced without its HTTP parts (more restrictive than asked)"
    else:
        effect = "ALLOW rules using them are omitted (more restrictive than asked)"
    return out, f"{key}: ztunnel does not support HTTP attributes ({', '.join(sorted(http))}); {effect}"
