"""AuthorizationPolicy with targetRefs -> the Envoy RBAC filters of a waypoint's HTTP chains.

Counterpart: istiod pilot/pkg/model/policyattachment.go (which policies bind to a waypoint) and
pilot/pkg/security/authz/builder (the RBAC translation). A policy applies to a waypoint only
through `targetRefs` (a selector policy never does): kind Gateway naming this waypoint (same
namespace) and kind GatewayClass `istio-waypoint` (policy in the root namespace) bind to every
HTTP chain; kind Service binds to that service's chains (policy in the service's namespace).

One `envoy.filters.http.rbac` per action, in istiod's order: AUDIT (action LOG), DENY, ALLOW.
Dry-run policies (`istio.io/dry-run: "true"`) go to `shadow_rules` only. Each rule is one RBAC
policy named `ns[<ns>]-policy[<name>]-rule[<i>]`. The caller's identity is the HBONE peer's,
recorded by `connect_terminate` in the filter state `io.istio.peer_principal` (the internal
listener has no TLS peer of its own), which is what istiod matches with `useAuthenticated=false`.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

# Types named by an `@type` below must be in the descriptor pool when the listener is parsed.
from envoy.extensions.filters.http.rbac.v3 import rbac_pb2  # noqa: F401
from envoy.extensions.path.match.uri_template.v3 import uri_template_match_pb2  # noqa: F401

from ...kube.model import AuthorizationPolicy, AuthorizationRule, Condition, Operation, Source
from ...metadata import ANNOTATION_DRY_RUN

RBAC_FILTER = "envoy.filters.http.rbac"
PEER_PRINCIPAL_KEY = "io.istio.peer_principal"
WAYPOINT_CLASS = "istio-waypoint"
GATEWAY_GROUP = "gateway.networking.k8s.io"
_T = "type.googleapis.com/"
_ACTIONS = {"AUDIT": "LOG", "DENY": "DENY", "ALLOW": "ALLOW"}
_NEVER: dict[str, Any] = {"not_id": {"any": True}}
_NEVER_PERMISSION: dict[str, Any] = {"not_rule": {"any": True}}


@dataclass(frozen=True, slots=True, kw_only=True)
class Attachment:
    """Where a policy applies: a whole waypoint, or one service's chains."""

    waypoint: tuple[str, str] | None = None  # (namespace, gateway name); ("*", "*") for the class
    service: str = ""  # service hostname


def attachments(policy: AuthorizationPolicy, root_namespace: str, domain_suffix: str) -> list[Attachment]:
    ns = policy.metadata.namespace
    out = []
    for ref in policy.target_refs:
        if ref.namespace and ref.namespace != ns:
            continue  # istiod: a targetRef names an object in the policy's own namespace
        if ref.kind == "Gateway" and ref.group in ("", GATEWAY_GROUP):
            out.append(Attachment(waypoint=(ns, ref.name)))
        elif ref.kind == "GatewayClass" and ref.name == WAYPOINT_CLASS and ns == root_namespace:
            out.append(Attachment(waypoint=("*", "*")))
        elif ref.kind == "Service" and ref.group in ("", "core"):
            out.append(Attachment(service=f"{ref.name}.{ns}.svc.{domain_suffix}"))
    return out


def applies(attached: Iterable[Attachment], waypoint: tuple[str, str], service: str) -> bool:
    return any(
        a.waypoint in (waypoint, ("*", "*")) if a.waypoint is not None else a.service == service
        for a in attached
    )


# ---------------------------------------------------------------------------------------------
# Values


def _string_match(value: str, *, prefix: str = "", ignore_case: bool = False) -> dict[str, Any]:
    """Istio's value forms: exact, `x*` prefix, `*x` suffix, `*` anything present."""
    if value == "*":
        out: dict[str, Any] = {"safe_regex": {"regex": ".+"}}
    elif value.endswith("*"):
        out = {"prefix": prefix + value[:-1]}
    elif value.startswith("*"):
        out = {"suffix": value[1:]}
    else:
        out = {"exact": prefix + value}
    if ignore_case and "safe_regex" not in out:
        out["ignore_case"] = True
    return out


def _or_p(rules: list[dict[str, Any]]) -> dict[str, Any]:
    return rules[0] if len(rules) == 1 else {"or_rules": {"rules": rules}}


def _and_p(rules: list[dict[str, Any]]) -> dict[str, Any]:
    if not rules:
        return {"any": True}
    return rules[0] if len(rules) == 1 else {"and_rules": {"rules": rules}}


def _or_id(ids: list[dict[str, Any]]) -> dict[str, Any]:
    return ids[0] if len(ids) == 1 else {"or_ids": {"ids": ids}}


def _and_id(ids: list[dict[str, Any]]) -> dict[str, Any]:
    if not ids:
        return {"any": True}
    return ids[0] if len(ids) == 1 else {"and_ids": {"ids": ids}}


def _cidr(text: str) -> dict[str, Any]:
    net = ipaddress.ip_network(text, strict=False)
    return {"address_prefix": str(net.network_address), "prefix_len": net.prefixlen}


_TEMPLATE = re.compile(r"\{\*\*?\}")


def _path(value: str) -> dict[str, Any]:
    if _TEMPLATE.search(value):
        return {
            "uri_template": {
                "name": "uri-template",
                "typed_config": {
                    "@type": _T + "envoy.extensions.path.match.uri_template.v3.UriTemplateMatchConfig",
                    # Istio's `{*}` (one segment) and `{**}` (any rest) in Envoy's syntax.
                    "path_template": value.replace("{**}", "**").replace("{*}", "*"),
                },
            }
        }
    return {"url_path": {"path": _string_match(value)}}


def _port(value: str) -> dict[str, Any]:
    if not value.isdigit() or not 0 < int(value) < 65536:
        return _NEVER_PERMISSION  # istiod refuses such a policy; here it matches nothing
    return {"destination_port": int(value)}


def _source_ip(value: str) -> dict[str, Any]:
    # On `main_internal` the direct peer is Envoy's own internal address; `original_dst` put the
    # HBONE peer's address back as the connection's remote address, which `source_ip` reads
    # (unlike `remote_ip`, no X-Forwarded-For header can change it).
    return {"source_ip": _cidr(value)}


def _header(name: str, value: str) -> dict[str, Any]:
    if value == "*":
        return {"header": {"name": name, "present_match": True}}
    return {"header": {"name": name, "string_match": _string_match(value, ignore_case=name == ":authority")}}


def _peer(match: dict[str, Any]) -> dict[str, Any]:
    return {"filter_state": {"key": PEER_PRINCIPAL_KEY, "string_match": match}}


def _principal(value: str) -> dict[str, Any]:
    return _peer(_string_match(value, prefix="spiffe://"))


def _namespace(value: str) -> dict[str, Any]:
    if value == "*":
        return _peer({"safe_regex": {"regex": ".+"}})
    if value.endswith("*"):
        return _peer({"safe_regex": {"regex": f".*/ns/{re.escape(value[:-1])}.*/.*"}})
    if value.startswith("*"):
        return _peer({"safe_regex": {"regex": f".*/ns/.*{re.escape(value[1:])}/.*"}})
    return _peer({"safe_regex": {"regex": f".*/ns/{re.escape(value)}/.*"}})


def _service_account(value: str) -> dict[str, Any]:
    ns, _, sa = value.partition("/")
    return _peer({"suffix": f"/ns/{ns}/sa/{sa}"})


def _field(values: Sequence[str], not_values: Sequence[str], one, *, principal: bool):  # type: ignore[no-untyped-def]
    """The AND parts of one field: its values OR'ed, its not-values negated."""
    out = []
    if values:
        items = [one(v) for v in values]
        out.append(_or_id(items) if principal else _or_p(items))
    if not_values:
        items = [one(v) for v in not_values]
        out.append({"not_id": _or_id(items)} if principal else {"not_rule": _or_p(items)})
    return out


# ---------------------------------------------------------------------------------------------
# Rules


def _operation(op: Operation) -> dict[str, Any]:
    parts: list[dict[str, Any]] = []
    parts += _field(op.hosts, op.not_hosts, lambda v: _header(":authority", v), principal=False)
    parts += _field(op.ports, op.not_ports, _port, principal=False)
    parts += _field(op.methods, op.not_methods, lambda v: _header(":method", v), principal=False)
    parts += _field(op.paths, op.not_paths, _path, principal=False)
    return _and_p(parts)


def source_ids(src: Source) -> list[dict[str, Any]]:
    """The AND parts of one source a connection has too (its peer identity and addresses);
    shared with the TCP translation (tcp_authz.py)."""
    ids: list[dict[str, Any]] = []
    ids += _field(src.principals, src.not_principals, _principal, principal=True)
    ids += _field(src.namespaces, src.not_namespaces, _namespace, principal=True)
    ids += _field(src.service_accounts, src.not_service_accounts, _service_account, principal=True)
    ids += _field(src.ip_blocks, src.not_ip_blocks, _source_ip, principal=True)
    ids += _field(
        src.remote_ip_blocks, src.not_remote_ip_blocks, lambda v: {"remote_ip": _cidr(v)}, principal=True
    )
    return ids


def _source(src: Source, notes: list[str]) -> dict[str, Any]:
    ids = source_ids(src)
    if src.request_principals or src.trust_domains:
        # No RequestAuthentication (jwt_authn) here: a rule needing a JWT identity never matches.
        notes.append(
            "requestPrincipals / trustDomains are not served by the waypoint: the rule never matches"
        )
        ids.append(_NEVER)
    if src.not_request_principals or src.not_trust_domains:
        notes.append("notRequestPrincipals / notTrustDomains are not served by the waypoint: ignored")
    return _and_id(ids)


_WHEN_HEADER = re.compile(r"^request\.headers\[(.+)\]$")


def _when(c: Condition, notes: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(permission parts, principal parts) of one `when` condition."""
    m = _WHEN_HEADER.match(c.key)
    if m is not None:
        name = m.group(1).lower()
        return _field(c.values, c.not_values, lambda v: _header(name, v), principal=False), []
    if c.key == "destination.port":
        return _field(c.values, c.not_values, _port, principal=False), []
    if c.key == "destination.ip":
        return _field(c.values, c.not_values, lambda v: {"destination_ip": _cidr(v)}, principal=False), []
    if c.key == "connection.sni":
        return _field(
            c.values, c.not_values, lambda v: {"requested_server_name": _string_match(v)}, principal=False
        ), []
    if c.key == "source.ip":
        return [], _field(c.values, c.not_values, _source_ip, principal=True)
    if c.key == "remote.ip":
        return [], _field(c.values, c.not_values, lambda v: {"remote_ip": _cidr(v)}, principal=True)
    if c.key == "source.namespace":
        return [], _field(c.values, c.not_values, _namespace, principal=True)
    if c.key == "source.principal":
        return [], _field(c.values, c.not_values, _principal, principal=True)
    notes.append(f"when {c.key!r} is not served by the waypoint: the rule never matches")
    return [_NEVER_PERMISSION], []


def rule_policy(rule: AuthorizationRule, notes: list[str]) -> dict[str, Any]:
    return assemble_policy(rule, notes, _operation, _source, rule.when)


def assemble_policy(
    rule: AuthorizationRule,
    notes: list[str],
    operation: Callable[[Operation], dict[str, Any]],
    source: Callable[[Source, list[str]], dict[str, Any]],
    when: Iterable[Condition],
) -> dict[str, Any]:
    """One rule as an RBAC policy: its operations OR'ed, its sources OR'ed, AND its `when`
    conditions, each part translated by the given functions (HTTP here, TCP in tcp_authz.py)."""
    permissions: list[dict[str, Any]] = []
    principals: list[dict[str, Any]] = []
    if rule.operations:
        permissions.append(_or_p([operation(op) for op in rule.operations]))
    if rule.sources:
        principals.append(_or_id([source(s, notes) for s in rule.sources]))
    for c in when:
        p, i = _when(c, notes)
        permissions += p
        principals += i
    return {"permissions": [_and_p(permissions)], "principals": [_and_id(principals)]}


def policy_key(policy: AuthorizationPolicy, index: int) -> str:
    return f"ns[{policy.metadata.namespace}]-policy[{policy.metadata.name}]-rule[{index}]"


def dry_run(policy: AuthorizationPolicy) -> bool:
    return policy.metadata.annotations.get(ANNOTATION_DRY_RUN, "").lower() in ("1", "t", "true")


def rbac_filters(
    policies: Sequence[AuthorizationPolicy], notes: list[str] | None = None
) -> list[dict[str, Any]]:
    """The RBAC filters (AUDIT, DENY, ALLOW) for the policies bound to one chain."""
    notes = notes if notes is not None else []
    out = []
    ordered = sorted(policies, key=lambda p: (p.metadata.namespace, p.metadata.name))
    custom = _custom_deny(ordered, notes)
    if custom is not None:
        out.append(custom)
    for action, envoy_action in _ACTIONS.items():
        enforced: dict[str, Any] = {}
        shadow: dict[str, Any] = {}
        seen = False
        for p in ordered:
            if p.action != action:
                continue
            target = shadow if dry_run(p) else enforced
            seen = seen or not dry_run(p)
            for i, rule in enumerate(p.rules):
                target[policy_key(p, i)] = rule_policy(rule, notes)
        if not seen and not shadow:
            continue
        config: dict[str, Any] = {"@type": _T + "envoy.extensions.filters.http.rbac.v3.RBAC"}
        if seen:
            # ALLOW with no policies at all denies everything (Istio's allow-nothing).
            config["rules"] = {"action": envoy_action, "policies": enforced}
        if shadow:
            config["shadow_rules"] = {"action": envoy_action, "policies": shadow}
            config["shadow_rules_stat_prefix"] = f"istio_dry_run_{action.lower()}_"
        out.append({"name": RBAC_FILTER, "typed_config": config})
    return out


def _custom_deny(ordered: Sequence[AuthorizationPolicy], notes: list[str]) -> dict[str, Any] | None:
    """CUSTOM policies, first as istiod orders ext_authz. No extension provider exists here, so
    each is what istiod makes of a CUSTOM policy whose provider it cannot find: its rules become
    DENY rules (fail closed), named `istio-ext-authz-<policy key>-deny-due-to-bad-CUSTOM-action`."""
    policies: dict[str, Any] = {}
    for p in ordered:
        if p.action != "CUSTOM":
            continue
        what = f"AuthorizationPolicy {p.metadata.namespace}/{p.metadata.name}"
        if dry_run(p):
            notes.append(
                f"{what}: CUSTOM (ext_authz) is not supported (no extension provider); dry-run: no effect"
            )
            continue
        notes.append(
            f"{what}: CUSTOM (ext_authz) is not supported (no extension provider): as istiod does for a "
            "missing provider, the requests its rules match are denied (403)"
        )
        for i, rule in enumerate(p.rules):
            policies[f"istio-ext-authz-{policy_key(p, i)}-deny-due-to-bad-CUSTOM-action"] = rule_policy(
                rule, notes
            )
    if not policies:
        return None
    config = {
        "@type": _T + "envoy.extensions.filters.http.rbac.v3.RBAC",
        "rules": {"action": "DENY", "policies": policies},
    }
    return {"name": RBAC_FILTER, "typed_config": config}


def policy_notes(policy: AuthorizationPolicy) -> tuple[str, ...]:
    """What a waypoint does not honour as written in one targetRef policy, said at apply time."""
    notes: list[str] = []
    rbac_filters([policy], notes)
    what = f"AuthorizationPolicy {policy.metadata.namespace}/{policy.metadata.name}: "
    return tuple(dict.fromkeys(n if n.startswith("AuthorizationPolicy ") else what + n for n in notes))
