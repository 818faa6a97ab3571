"""Callers' Kubernetes service-account tokens, checked by the API server (TokenReview).

Counterparts: istiod's security/pkg/server/ca/authenticate/kubeauth (KubeJWTAuthenticator) and
security/pkg/k8s/tokenreview. With `ambient control --kube`, the bearer token a node proxy sends
(its pod's projected token, audience `istio-ca`) is POSTed to the API server as an
`authentication.k8s.io/v1` TokenReview with `spec.audiences: [istio-ca]`; the review says whether
the token is valid, for which audiences, and for whom:

- `status.authenticated` must be true and `status.error` empty;
- `status.audiences` must include one we asked for (an API server that ignored the audiences, or
  a legacy secret token, is refused: istiod's REQUIRE_3P_TOKEN behaviour);
- the user must be in the `system:serviceaccounts` group, and its username
  `system:serviceaccount:<namespace>:<name>` names the caller;
- a token bound to a pod carries `authentication.kubernetes.io/pod-name` and `pod-uid` in
  `status.user.extra`; node authorization (ca_server.authorize) looks that pod up for the node.

`caller_from_review` is the pure decision; `TokenReviewAuthenticator` makes the call, at most
`MAX_REVIEWS_IN_FLIGHT` at once so a flood of bad tokens cannot flood the API server. Without an
API server (`--dir`, the lab) the control plane checks the tokens it minted itself (tokens.py);
both offer `authenticate(token, now)`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from ..kube.client import TOKEN_REVIEWS, KubeApiError, KubeClient
from .tokens import (
    DEFAULT_AUDIENCE,
    MAX_TOKEN_CHARS,
    SUBJECT_PREFIX,
    AuthenticationError,
    Caller,
    is_kubernetes_name,
)

log = logging.getLogger(__name__)

SERVICE_ACCOUNTS_GROUP = "system:serviceaccounts"
EXTRA_POD_NAME = "authentication.kubernetes.io/pod-name"
EXTRA_POD_UID = "authentication.kubernetes.io/pod-uid"
MAX_REVIEWS_IN_FLIGHT = 16

__all__ = ["Authenticator", "TokenReviewAuthenticator", "caller_from_review"]


class Authenticator(Protocol):
    """Who a bearer token speaks for; raises AuthenticationError when it proves nobody."""

    async def authenticate(self, token: str, now: float) -> Caller: ...


def _single(extra: Mapping[str, Any], key: str) -> str | None:
    values = extra.get(key)
    if values is None:
        return None
    if not isinstance(values, list) or len(values) != 1 or not isinstance(values[0], str) or not values[0]:
        raise AuthenticationError(f"the token review's user.extra {key} is not one string")
    return values[0]


def caller_from_review(status: Any, audiences: Sequence[str]) -> Caller:
    """The caller a TokenReview's `status` names, or AuthenticationError saying why not."""
    if not isinstance(status, dict):
        raise AuthenticationError("the API server's token review has no status")
    if status.get("error"):
        raise AuthenticationError(f"the API server refused the token: {str(status['error'])[:300]}")
    if status.get("authenticated") is not True:
        raise AuthenticationError("the API server did not authenticate the token")
    granted = status.get("audiences")
    if audiences and not (isinstance(granted, list) and any(a in granted for a in audiences)):
        raise AuthenticationError(
            f"the token is not valid for audience {', '.join(audiences)} (valid for: {granted!r})",
            hint="mount a projected service-account token with that audience (istio-token)",
        )
    user = status.get("user")
    if not isinstance(user, dict):
        raise AuthenticationError("the token review has no user")
    groups = user.get("groups")
    if not isinstance(groups, list) or SERVICE_ACCOUNTS_GROUP not in groups:
        raise AuthenticationError(f"the token is not a service account's (not in {SERVICE_ACCOUNTS_GROUP})")
    username = user.get("username")
    parts = username.split(":") if isinstance(username, str) else []
    if len(parts) != 4 or f"{parts[0]}:{parts[1]}:" != SUBJECT_PREFIX:
        raise AuthenticationError(
            f"the token review's username {str(username)[:100]!r} is not a service account"
        )
    namespace, service_account = parts[2], parts[3]
    if not is_kubernetes_name(namespace) or not is_kubernetes_name(service_account):
        raise AuthenticationError(f"the token review's username {username!r} does not name a service account")
    raw_extra = user.get("extra")
    extra: dict[str, Any] = raw_extra if isinstance(raw_extra, dict) else {}
    pod_name, pod_uid = _single(extra, EXTRA_POD_NAME), _single(extra, EXTRA_POD_UID)
    if (pod_name is None) != (pod_uid is None) or (pod_name is not None and not is_kubernetes_name(pod_name)):
        raise AuthenticationError("the token review names a pod without its UID, or an invalid pod name")
    return Caller(namespace=namespace, service_account=service_account, pod_name=pod_name, pod_uid=pod_uid)


class TokenReviewAuthenticator:
    """Asks the API server about each token (one TokenReview per call)."""

    def __init__(
        self,
        client: KubeClient,
        *,
        audiences: Sequence[str] = (DEFAULT_AUDIENCE,),
        max_in_flight: int = MAX_REVIEWS_IN_FLIGHT,
    ) -> None:
        self.client = client
        self.audiences = tuple(audiences)
        self._slots = asyncio.Semaphore(max_in_flight)
        self.reviews = 0
        self.refused = 0

    def __repr__(self) -> str:
        return (
            f"TokenReviewAuthenticator({self.client.credentials.server}, audiences {list(self.audiences)}: "
            f"{self.reviews} reviews, {self.refused} refused)"
        )

    async def authenticate(self, token: str, now: float) -> Caller:
        del now  # the API server checks the token's validity window
        if not token:
            raise AuthenticationError("the token is empty")
        if len(token) > MAX_TOKEN_CHARS:
            raise AuthenticationError(f"the token is longer than {MAX_TOKEN_CHARS} characters")
        review = {
            "apiVersion": TOKEN_REVIEWS.api_version,
            "kind": TOKEN_REVIEWS.kind,
            "spec": {"token": token, "audiences": list(self.audiences)},
        }
        async with self._slots:
            self.reviews += 1
            try:
                answer = await self.client.create(TOKEN_REVIEWS, review)
            except KubeApiError as exc:
                self.refused += 1
                log.warning("token review failed: %s", exc)
                raise AuthenticationError(
                    f"cannot review the token with the API server: {exc.message}",
                    hint=exc.hint or "may the control plane's service account create tokenreviews?",
                ) from None
        try:
            return caller_from_review(answer.get("status"), self.audiences)
        except AuthenticationError:
            self.refused += 1
            raise
