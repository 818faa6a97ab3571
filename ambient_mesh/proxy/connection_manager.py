"""Inbound connections under authorization, re-checked when the state changes.

Counterpart: ztunnel src/proxy/connection_manager.rs (ConnectionManager, PolicyWatcher),
docs/istio-behaviour.md, "Policy changes on live connections". Every inbound connection (HBONE stream or
plaintext) is registered before its first check. When the state changes, every tracked connection is checked
again against the destination workload as it is NOW in the state, and closed if it is now denied. ztunnel
re-checks with the workload captured at accept time and only on Authorization pushes, so a workload that gains
a selector-scoped policy keeps its open connections; re-reading the workload closes that gap.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ProxyError, ResponseFlag
from ..rbac import Decision, RbacConnection, log_dry_run
from ..state.model import Workload
from ..state.store import StateReader

log = logging.getLogger("ambient_mesh.proxy.rbac")


class PolicyDenied(ProxyError):
    """A connection refused or closed by authorization; metrics record flag DENY."""

    response_flag = ResponseFlag.DENY

    def __init__(self, decision: Decision, *, closing: bool = False) -> None:
        what = "connection closed due to policy change" if closing else "connection denied by policy"
        super().__init__(f"{what}: {decision.reason}")
        self.decision = decision


@dataclass(eq=False, slots=True)
class TrackedConnection:
    conn: RbacConnection
    workload_uid: str
    close: Callable[[PolicyDenied], None]
    # For the log line when a policy change closes it; formatted then, not per connection.
    src: object
    dst: object


class ConnectionManager:
    """ztunnel's ConnectionManager and PolicyWatcher in one: the authorization of inbound
    connections, at their first check (`authorize`) and again on every state change (`recheck`).

    Its one job is policy. Which connections are open, for draining and /config_dump, is
    `open_connections.OpenConnections`.
    """

    def __init__(self, state: StateReader, *, info_logging: bool = False) -> None:
        self.state = state
        # AUTHZ_POLICY_INFO_LOGGING: every decision at info (ztunnel logs them at debug otherwise).
        self._decision_level = logging.INFO if info_logging else logging.DEBUG
        self._tracked: dict[int, TrackedConnection] = {}
        self._next_id = 0
        self._recheck_scheduled = False
        self._unsubscribe = state.add_listener(self._on_state_change)
        self.closed_by_policy = 0

    def __repr__(self) -> str:
        return f"ConnectionManager({len(self._tracked)} inbound tracked, {self.closed_by_policy} closed by policy)"

    def authorize(self, conn: RbacConnection, workload: Workload) -> Decision:
        """One authorization check against the current policies (docs/istio-behaviour.md, "Authorization")."""
        decision = self.state.policies.check(workload, conn)
        log_dry_run(decision, conn)
        # Denials stay at info whatever the setting, as before; allows follow the setting.
        level = logging.INFO if not decision.allowed else self._decision_level
        if log.isEnabledFor(level):
            log.log(
                level,
                "%s %s to %s: %s (policy %s)",
                "allowed" if decision.allowed else "denied",
                conn,
                workload.uid,
                decision.reason,
                decision.policy or "none",
            )
        return decision

    def register(
        self,
        conn: RbacConnection,
        workload: Workload,
        close: Callable[[PolicyDenied], None],
        src: object,
        dst: object,
    ) -> Callable[[], None]:
        """Track a connection (`src -> dst` in logs); returns the function that stops tracking it."""
        key = self._next_id
        self._next_id += 1
        self._tracked[key] = TrackedConnection(conn, workload.uid, close, src, dst)

        def untrack() -> None:
            self._tracked.pop(key, None)

        return untrack

    def _on_state_change(self, *_args: object) -> None:
        # Coalesce bursts of changes (a push applies many resources) into one re-check.
        if not self._recheck_scheduled and self._tracked:
            self._recheck_scheduled = True
            asyncio.get_running_loop().call_soon(self.recheck)

    def recheck(self) -> int:
        """Check every tracked connection again; close and return the number now denied."""
        self._recheck_scheduled = False
        closed = 0
        for key, tracked in list(self._tracked.items()):
            workload = self.state.workloads.find_uid(tracked.workload_uid)
            if workload is None:
                continue  # the workload is going away; its own removal closes it
            decision = self.state.policies.check(workload, tracked.conn)
            if not decision.allowed:
                log.info(
                    "connection %s -> %s is no longer allowed: %s", tracked.src, tracked.dst, decision.reason
                )
                self._tracked.pop(key, None)
                tracked.close(PolicyDenied(decision, closing=True))
                closed += 1
        self.closed_by_policy += closed
        return closed

    def close(self) -> None:
        self._unsubscribe()
        self._tracked.clear()
