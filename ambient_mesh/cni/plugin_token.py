"""The CNI plugin's own API credential: a short-lived token the node agent requests for it.

Counterpart: none in istio-cni, whose agent copies its own service-account token into the plugin's kubeconfig
(docs/istio-behaviour.md, "CNI config and kubeconfig installation"). With bound service-account tokens
(Kubernetes 1.21+, or 1.20 with BoundServiceAccountTokenVolume) that token is bound to the agent's pod: when
the pod is deleted, as in every agent upgrade, the API server refuses it after a few seconds, and until the
new agent writes a new kubeconfig every pod on the node stays Pending, pods outside the mesh included, because
the plugin cannot read them and fails closed.

So the agent asks the API server for a token of a narrower service account (`istio-cni-plugin`
by default, allowed only to get pods and namespaces) with a TokenRequest that is not bound to
the agent's pod: it outlives the agent, and expires on its own (PLUGIN_TOKEN_TTL_S). The agent
requests a new one when 80% of the lifetime has passed (the kubelet's rule for projected
tokens) and rewrites the kubeconfig. When the request is refused (the service account or the
agent's right to `create serviceaccounts/token` on it is missing, as with Istio's own charts),
the agent's own token is used, as istio-cni does, and the log says what to grant. A legacy
Secret-based token is never created or read.

`refresh_delay` is the pure decision; `PluginTokens` is the asyncio shell around the API call.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from ..kube.client import KubeApiError

log = logging.getLogger(__name__)

PLUGIN_SERVICE_ACCOUNT = "istio-cni-plugin"
PLUGIN_TOKEN_TTL_S = 3600  # asked for; the API server may shorten it (its minimum is 600 s)
REFRESH_AT_FRACTION = 0.8  # the kubelet's rule for projected tokens
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 60.0
MIN_REFRESH_DELAY_S = 1.0


class TokenRequester(Protocol):
    """kube.client.KubeClient's TokenRequest (a recording fake in tests)."""

    def request_token(
        self, namespace: str, service_account: str, *, expiration_s: int, audiences: tuple[str, ...] = ()
    ) -> Awaitable[dict[str, object]]: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class PluginToken:
    token: str
    issued_at: float  # wall clock, seconds
    expires_at: float  # wall clock, seconds

    def __repr__(self) -> str:  # never the token: this ends up in logs
        return f"PluginToken(expires in {self.expires_at - time.time():.0f}s)"


def refresh_delay(token: PluginToken, now: float) -> float:
    """Seconds until a new token should be requested: at REFRESH_AT_FRACTION of its lifetime."""
    lifetime = max(0.0, token.expires_at - token.issued_at)
    due = token.issued_at + lifetime * REFRESH_AT_FRACTION
    return max(MIN_REFRESH_DELAY_S, due - now)


def _expiry(value: object, issued_at: float) -> float:
    if isinstance(value, datetime.datetime):
        when = value if value.tzinfo else value.replace(tzinfo=datetime.UTC)
        return when.timestamp()
    if isinstance(value, str):
        try:
            return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            pass
    # No expiry in the answer: assume the shortest lifetime the API server grants.
    return issued_at + 600.0


class PluginTokens:
    """The plugin's current token, requested and refreshed by the node agent."""

    def __init__(
        self,
        client: TokenRequester,
        *,
        namespace: str,
        service_account: str = PLUGIN_SERVICE_ACCOUNT,
        ttl_s: int = PLUGIN_TOKEN_TTL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.service_account = service_account
        self.ttl_s = ttl_s
        self.clock = clock
        self.token: PluginToken | None = None
        self.refused: str | None = None  # why the last request failed
        self.requests = 0

    def __repr__(self) -> str:  # never the token: this ends up in logs and the agent's dump
        left = None if self.token is None else self.token.expires_at - self.clock()
        state = f"token valid {left:.0f}s more" if left is not None and left > 0 else "no valid token"
        if self.refused:
            state += f", last request refused: {self.refused}"
        elif self.requests == 0:
            state += ", not requested yet"
        return f"PluginTokens({self.namespace}/{self.service_account}: {state}, {self.requests} requests)"

    def current(self) -> str | None:
        """The token to put in the plugin's kubeconfig, or None (use the agent's own)."""
        token = self.token
        if token is None or token.expires_at <= self.clock():
            return None
        return token.token

    async def refresh(self) -> bool:
        """Request a new token; True when one was issued. A refusal keeps the previous token
        while it is valid and is logged with what to grant."""
        self.requests += 1
        issued_at = self.clock()
        try:
            answer = await self.client.request_token(
                self.namespace, self.service_account, expiration_s=self.ttl_s
            )
        except KubeApiError as exc:
            first = self.refused is None
            self.refused = str(exc)
            (log.warning if first else log.debug)(
                "no token for the CNI plugin's service account %s/%s (%s): the plugin's kubeconfig "
                "carries the node agent's own token, which stops working when the agent's pod is "
                "replaced; grant the agent `create` on serviceaccounts/token for %s",
                self.namespace,
                self.service_account,
                exc,
                self.service_account,
            )
            return False
        token = str(answer.get("token") or "")
        if not token:
            self.refused = "the TokenRequest's answer has no token"
            return False
        self.token = PluginToken(
            token=token, issued_at=issued_at, expires_at=_expiry(answer.get("expirationTimestamp"), issued_at)
        )
        self.refused = None
        log.info(
            "requested a token for the CNI plugin (service account %s/%s, %r)",
            self.namespace,
            self.service_account,
            self.token,
        )
        return True

    def next_delay(self, failures: int) -> float:
        """When to ask again: before expiry after a success, with backoff after failures (but
        never after the current token has expired)."""
        now = self.clock()
        if failures:
            backoff = min(RETRY_MAX_S, RETRY_FIRST_S * 2.0 ** (failures - 1))
            if self.token is not None:
                backoff = min(backoff, max(MIN_REFRESH_DELAY_S, self.token.expires_at - now))
            return backoff
        assert self.token is not None
        return refresh_delay(self.token, now)


__all__ = [
    "PLUGIN_SERVICE_ACCOUNT",
    "PLUGIN_TOKEN_TTL_S",
    "PluginToken",
    "PluginTokens",
    "TokenRequester",
    "refresh_delay",
]
