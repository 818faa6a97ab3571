"""L4 authorization: `istio.security.Authorization` as the node proxy holds and enforces it.

Counterparts: ztunnel src/rbac.rs, src/state/policy.rs (`PolicyStore`) and `assert_rbac` in src/state.rs;
behaviour in docs/istio-behaviour.md, "Authorization", "STRICT mTLS" and "Policy changes on live connections".
The package, top to bottom:

- `model`: the policy tree, the connection as policies see it (`RbacConnection`), the `Decision`.
- `reference`: Istio's semantics stated plainly (walks the tree for every connection).
- `compiled`: the fast path, one generated function per policy; agrees with `reference`.
- `keys`: necessary conditions per rule, which let the index skip policies that cannot match.
- `index`: which policies apply to a workload, and `PolicyIndex` (ztunnel's PolicyStore).

Evaluation is pure: it returns a `Decision` and never does I/O; the caller closes the connection,
records the DENY flag and logs (`log_dry_run`).
"""

from . import reference
from .compiled import CompiledPolicy, compile_policy, evaluate
from .index import GLOBAL_INDEX, MIN_INDEXED_POLICIES, PolicyBucket, PolicyIndex, PolicyTarget, policies_for
from .keys import ALWAYS_KEY, Key, KeyLength, RuleFilter, conn_keys, rule_filters
from .model import (
    DEFAULT_ROOT_NAMESPACE,
    REASON_ALLOWED,
    REASON_DENIED,
    REASON_NO_ALLOW_POLICIES,
    REASON_NOT_ALLOWED,
    STRICT_MTLS_POLICY_NAME,
    Action,
    Authorization,
    Clause,
    Decision,
    IPNetwork,
    Match,
    RbacConnection,
    Rule,
    Scope,
    ServiceAccountMatch,
    StringMatch,
    StringMatchKind,
    log_dry_run,
    strict_mtls_policy,
)

__all__ = [
    "ALWAYS_KEY",
    "DEFAULT_ROOT_NAMESPACE",
    "GLOBAL_INDEX",
    "MIN_INDEXED_POLICIES",
    "REASON_ALLOWED",
    "REASON_DENIED",
    "REASON_NOT_ALLOWED",
    "REASON_NO_ALLOW_POLICIES",
    "STRICT_MTLS_POLICY_NAME",
    "Action",
    "Authorization",
    "Clause",
    "CompiledPolicy",
    "Decision",
    "IPNetwork",
    "Key",
    "KeyLength",
    "Match",
    "PolicyBucket",
    "PolicyIndex",
    "PolicyTarget",
    "RbacConnection",
    "Rule",
    "RuleFilter",
    "Scope",
    "ServiceAccountMatch",
    "StringMatch",
    "StringMatchKind",
    "compile_policy",
    "conn_keys",
    "evaluate",
    "log_dry_run",
    "policies_for",
    "reference",
    "rule_filters",
    "strict_mtls_policy",
]
