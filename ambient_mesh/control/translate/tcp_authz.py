"""AuthorizationPolicy with targetRefs -> the Envoy network RBAC filters of a waypoint's TCP chains.

Counterpart: istiod pilot/pkg/security/authz/builder (its TCP build) and authz/model (a rule
generated for a TCP filter chain). The policies bound to a TCP chain are the ones its HTTP
sibling would get (l7_authz.py `attachments`); only the translation differs, because a TCP
connection has no method, path, host, header or JWT (docs/istio-behaviour.md, "Waypoint
authorization on TCP"):

- ALLOW: a rule that names any HTTP-only field can never match a connection, so it is left out;
  an ALLOW policy whose rules are all left out allows nothing (fail closed).
- DENY (and CUSTOM, which is a DENY here: no ext_authz provider exists): the HTTP-only fields are
  dropped and the rest of the rule still applies, so it denies more (fail closed).
- AUDIT: translated as DENY is (a wider mark), with Envoy's LOG action; it never refuses.

One `envoy.filters.network.rbac` per action, in istiod's order (CUSTOM, AUDIT, DENY, ALLOW), stats
under `tcp.rbac.` (istiod's prefix); dry-run policies go to `shadow_rules`. A denied connection is
closed by Envoy before its first byte is forwarded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Types named by an `@type` below must be in the descriptor pool when the listener is parsed.
from envoy.extensions.filters.network.rbac.v3 import rbac_pb2  # noqa: F401

from ...kube.model import AuthorizationPolicy, AuthorizationRule, Condition, Operation, Source
from .l7_authz import (
    _NEVER,
    _WHEN_HEADER,
    _and_id,
    _and_p,
    _field,
    _port,
    assemble_policy,
    dry_run,
    policy_key,
    source_ids,
)

NETWORK_RBAC_FILTER = "envoy.filters.network.rbac"
# istiod's stat prefix of every network RBAC filter: `tcp.rbac.allowed`, `tcp.rbac.denied`.
TCP_STAT_PREFIX = "tcp."
_T = "type.googleapis.com/"
_ACTIONS = {"AUDIT": "LOG", "DENY": "DENY", "ALLOW": "ALLOW"}


def _http_operation(op: Operation) -> bool:
    return bool(op.hosts or op.not_hosts or op.methods or op.not_methods or op.paths or op.not_paths)


def _http_source(src: Source) -> bool:
    return bool(src.request_principals or src.not_request_principals)


def _http_condition(c: Condition) -> bool:
    # request.headers[...] and the JWT attributes (request.auth.*) exist only on an HTTP request.
    return _WHEN_HEADER.match(c.key) is not None or c.key.startswith("request.auth.")


def _operation(op: Operation) -> dict[str, Any]:
    """The TCP part of one operation: its ports (hosts, methods and paths are dropped)."""
    return _and_p(_field(op.ports, op.not_ports, _port, principal=False))


def _source(src: Source, notes: list[str]) -> dict[str, Any]:
    """The TCP part of one source: everything but requestPrincipals (dropped)."""
    ids = source_ids(src)
    if src.trust_domains:
        notes.append("trustDomains is not served by the waypoint: the rule never matches")
        ids.append(_NEVER)
    return _and_id(ids)


def needs_http(rule: AuthorizationRule) -> bool:
    """Whether a rule names a field only an HTTP request has (hosts, methods, paths,
    requestPrincipals, request headers, JWT claims)."""
    return (
        any(_http_operation(op) for op in rule.operations)
        or any(_http_source(s) for s in rule.sources)
        or any(_http_condition(c) for c in rule.when)
    )


def tcp_notes(policy: AuthorizationPolicy) -> tuple[str, ...]:
    """What a targetRef policy whose rules name HTTP-only fields does to TCP connections, which
    have none (istiod's TCP semantics, above): said by `lab apply` when the policy binds a TCP
    chain. Empty when no rule names one, or for AUDIT (it never refuses)."""
    http = [i for i, rule in enumerate(policy.rules) if needs_http(rule)]
    if not http or policy.action == "AUDIT":
        return ()
    what = f"AuthorizationPolicy {policy.metadata.namespace}/{policy.metadata.name}: "
    rules = f"rule{'s' if len(http) > 1 else ''} {', '.join(map(str, http))}"
    if policy.action == "ALLOW":
        if len(http) == len(policy.rules):
            effect = (
                "every rule names HTTP-only fields, which a TCP connection does not have, so on TCP "
                "through the waypoint it allows nothing: a TCP connection to its targets is refused "
                "unless another ALLOW policy allows it"
            )
        else:
            effect = f"{rules} name HTTP-only fields and match no TCP connection through the waypoint"
    else:
        effect = (
            f"on TCP through the waypoint, {rules} are enforced without their HTTP-only fields, so "
            "they refuse every TCP connection their other fields match"
        )
    return (what + effect + " (TCP ports, and ports of unknown protocol that do not carry HTTP)",)


def tcp_rule_policy(rule: AuthorizationRule, action: str, notes: list[str]) -> dict[str, Any] | None:
    """One rule as a network RBAC policy with `action`'s TCP semantics; None for an ALLOW rule
    that needs an HTTP-only field (it can never match a connection)."""
    if needs_http(rule) and action == "ALLOW":
        return None
    # DENY, AUDIT: the HTTP-only conditions are dropped, the rest of the rule still applies.
    when = [c for c in rule.when if not _http_condition(c)]
    return assemble_policy(rule, notes, _operation, _source, when)


def _config(action: str, enforced: dict[str, Any] | None, shadow: dict[str, Any] | None) -> dict[str, Any]:
    config: dict[str, Any] = {
        "@type": _T + "envoy.extensions.filters.network.rbac.v3.RBAC",
        "stat_prefix": TCP_STAT_PREFIX,
    }
    if enforced is not None:
        config["rules"] = {"action": action, "policies": enforced}
    if shadow is not None:
        config["shadow_rules"] = {"action": action, "policies": shadow}
        config["shadow_rules_stat_prefix"] = f"istio_dry_run_{action.lower()}_"
    return {"name": NETWORK_RBAC_FILTER, "typed_config": config}


def network_rbac_filters(
    policies: Sequence[AuthorizationPolicy], notes: list[str] | None = None
) -> list[dict[str, Any]]:
    """The network RBAC filters (CUSTOM as DENY, AUDIT, DENY, ALLOW) for the policies bound to
    one TCP chain; none when no policy is bound."""
    notes = notes if notes is not None else []
    ordered = sorted(policies, key=lambda p: (p.metadata.namespace, p.metadata.name))
    out = []
    # CUSTOM without an extension provider: its rules deny, as on the HTTP chain (l7_authz.py).
    custom: dict[str, Any] = {}
    for p in ordered:
        if p.action == "CUSTOM" and not dry_run(p):
            for i, rule in enumerate(p.rules):
                policy = tcp_rule_policy(rule, "DENY", notes)
                if policy is not None:
                    custom[f"istio-ext-authz-{policy_key(p, i)}-deny-due-to-bad-CUSTOM-action"] = policy
    if custom:
        out.append(_config("DENY", custom, None))
    for action, envoy_action in _ACTIONS.items():
        enforced: dict[str, Any] | None = None
        shadow: dict[str, Any] | None = None
        for p in ordered:
            if p.action != action:
                continue
            if dry_run(p):
                target = shadow = shadow if shadow is not None else {}
            else:
                target = enforced = enforced if enforced is not None else {}
            for i, rule in enumerate(p.rules):
                policy = tcp_rule_policy(rule, action, notes)
                if policy is not None:
                    target[policy_key(p, i)] = policy
        if enforced is not None or shadow is not None:
            # An ALLOW (or dry-run ALLOW) left with no usable rule matches nothing: it denies
            # (or would deny) every connection.
            out.append(_config(envoy_action, enforced, shadow))
    return out
