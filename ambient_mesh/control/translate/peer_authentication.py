"""PeerAuthentication -> the DENY policies that make mTLS modes hold at L4.

Counterpart of istiod's PeerAuthentication handling for ambient
(pilot/pkg/serviceregistry/kube/controller/ambient/authorization.go, convertPeerAuthentication,
and the static `istio_converted_static_strict` policy): STRICT anywhere becomes one static DENY of
peers without an mTLS identity; a workload policy with port-level modes becomes its own converted
DENY policy; `effective_peer_authentication_keys` says which of the two a workload references.
"""

from __future__ import annotations

from collections.abc import Iterable

from ...kube.model import PeerAuthentication
from ...wire.istio.security import authorization_pb2 as sec
from .common import MeshSettings

STATIC_STRICT_POLICY_NAME = "istio_converted_static_strict"  # '_' cannot appear in a Kubernetes name
CONVERTED_PEER_AUTHENTICATION_PREFIX = "converted_peer_authentication_"


def _mode(pa: PeerAuthentication | None) -> str:
    return "UNSET" if pa is None or pa.mtls_mode is None else pa.mtls_mode


def _deny_without_identity(match: sec.Match | None = None) -> sec.Match:
    m = match if match is not None else sec.Match()
    m.not_principals.add().presence.SetInParent()
    return m


def static_strict_policy(settings: MeshSettings) -> sec.Authorization:
    """Deny any peer without an mTLS identity: what STRICT PeerAuthentication means at L4."""
    out = sec.Authorization(
        name=STATIC_STRICT_POLICY_NAME,
        namespace=settings.root_namespace,
        scope=sec.WORKLOAD_SELECTOR,
        action=sec.DENY,
    )
    out.rules.add().clauses.add().matches.append(_deny_without_identity())
    return out


def _oldest(policies: list[PeerAuthentication]) -> PeerAuthentication | None:
    if not policies:
        return None
    return min(policies, key=lambda p: (p.metadata.creation_timestamp, p.metadata.namespace, p.metadata.name))


def _is_workload_pa(pa: PeerAuthentication) -> bool:
    return pa.selector is not None and bool(pa.selector.match_labels)


def convert_peer_authentication(
    pa: PeerAuthentication,
    namespace_pa: PeerAuthentication | None,
    root_pa: PeerAuthentication | None,
    settings: MeshSettings,
) -> sec.Authorization | None:
    """A workload PeerAuthentication with port-level modes as a DENY policy (istiod's rules).

    Only workload-selector policies outside the root namespace with portLevelMtls are converted;
    everything else is covered by the static strict policy.
    """
    if pa.metadata.namespace == settings.root_namespace or pa.selector is None or not pa.port_level_mtls:
        return None
    mode = _mode(pa)
    ns_mode, root_mode = _mode(namespace_pa), _mode(root_pa)
    clauses: list[sec.Clause] = []
    rules: list[sec.Rule] = []
    if mode == "STRICT":
        clauses.append(sec.Clause(matches=[_deny_without_identity()]))
    found_non_strict = False
    for port in sorted(pa.port_level_mtls):
        port_mode = pa.port_level_mtls[port]
        if port_mode == "STRICT":
            parent_strict = mode == "STRICT" or (
                mode == "UNSET"
                and (
                    (namespace_pa is not None and ns_mode == "STRICT")
                    or (
                        (namespace_pa is None or ns_mode == "UNSET")
                        and root_pa is not None
                        and root_mode == "STRICT"
                    )
                )
            )
            if parent_strict:
                continue
            # Rules are OR-ed, so each STRICT port gets its own.
            rule = sec.Rule()
            rule.clauses.add().matches.append(_deny_without_identity(sec.Match(destination_ports=[port])))
            rules.append(rule)
        elif port_mode in ("PERMISSIVE", "DISABLE"):
            if mode in ("PERMISSIVE", "DISABLE"):
                continue
            if mode == "UNSET" and (
                (namespace_pa is not None and ns_mode != "STRICT")
                or (namespace_pa is None and root_pa is not None and root_mode != "STRICT")
                or (namespace_pa is None and root_pa is None)
            ):
                continue
            found_non_strict = True
            # Deny unless the connection is for this port (no identity needed there).
            clauses.append(sec.Clause(matches=[sec.Match(not_destination_ports=[port])]))
    if mode == "STRICT" and not found_non_strict:
        return None
    if not clauses and not rules:
        return None
    merge_strict = (
        root_pa is not None
        and root_mode == "STRICT"
        and (namespace_pa is None or ns_mode in ("UNSET", "STRICT"))
    ) or (namespace_pa is not None and ns_mode == "STRICT")
    if merge_strict and found_non_strict:
        clauses.append(sec.Clause(matches=[_deny_without_identity()]))
    if clauses:
        rule = sec.Rule()
        rule.clauses.extend(clauses)
        rules.append(rule)
    out = sec.Authorization(
        name=CONVERTED_PEER_AUTHENTICATION_PREFIX + pa.metadata.name,
        namespace=pa.metadata.namespace,
        scope=sec.WORKLOAD_SELECTOR,
        action=sec.DENY,
    )
    out.rules.extend(rules)
    return out


def namespace_peer_authentications(policies: Iterable[PeerAuthentication]) -> dict[str, PeerAuthentication]:
    """Namespace -> its oldest selector-less PeerAuthentication (the namespace-wide one)."""
    by_namespace: dict[str, list[PeerAuthentication]] = {}
    for pa in policies:
        if pa.selector is None:
            by_namespace.setdefault(pa.metadata.namespace, []).append(pa)
    return {ns: oldest for ns, pas in by_namespace.items() if (oldest := _oldest(pas)) is not None}


def effective_peer_authentication_keys(
    policies: list[PeerAuthentication], settings: MeshSettings
) -> list[str]:
    """Keys of the static strict policy and/or a converted port-level policy for one workload."""
    root = settings.root_namespace
    mesh_pa = _oldest([p for p in policies if not _is_workload_pa(p) and p.metadata.namespace == root])
    ns_pa = _oldest([p for p in policies if not _is_workload_pa(p) and p.metadata.namespace != root])
    wl_pa = _oldest([p for p in policies if _is_workload_pa(p) and p.metadata.namespace != root])
    strict = False
    port_key = ""
    if mesh_pa is not None:
        strict = _mode(mesh_pa) == "STRICT"
    if ns_pa is not None and _mode(ns_pa) != "UNSET":
        strict = _mode(ns_pa) == "STRICT"
    if wl_pa is not None:
        mode = _mode(wl_pa)
        if mode == "STRICT":
            strict = True
        if mode in ("PERMISSIVE", "DISABLE"):
            strict = False
        ports = list(wl_pa.port_level_mtls.values())
        converted = f"{wl_pa.metadata.namespace}/{CONVERTED_PEER_AUTHENTICATION_PREFIX}{wl_pa.metadata.name}"
        if ports:
            if mode == "STRICT":
                if any(m in ("PERMISSIVE", "DISABLE") for m in ports):
                    # The converted policy carries the STRICT default itself.
                    port_key, strict = converted, False
            elif mode in ("PERMISSIVE", "DISABLE"):
                if "STRICT" in ports:
                    port_key = converted
            elif strict:
                if "PERMISSIVE" in ports:
                    port_key, strict = converted, False
            else:
                strict = False
                if "STRICT" in ports:
                    port_key = converted
    keys = set()
    if strict:
        keys.add(f"{root}/{STATIC_STRICT_POLICY_NAME}")
    if port_key:
        keys.add(port_key)
    return sorted(keys)
