"""Traffic capture: the rules that hand a workload's TCP to its node proxy.

Counterparts: ztunnel scripts/ztunnel-redirect.sh (dedicated mode) and istio-cni's in-pod rules.
"""

from .dedicated import (
    CHAIN_OUTPUT,
    CHAIN_PREROUTING,
    apply_dedicated_rules,
    policy_route_commands,
    remove_dedicated_rules,
    render_dedicated_rules,
)

__all__ = [
    "CHAIN_OUTPUT",
    "CHAIN_PREROUTING",
    "apply_dedicated_rules",
    "policy_route_commands",
    "remove_dedicated_rules",
    "render_dedicated_rules",
]
