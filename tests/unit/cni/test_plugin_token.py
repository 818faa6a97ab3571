"""The plugin token's timing, without an API server: renew at 80% of the granted lifetime, back
off after refusals but never past the current token's expiry, never show the token."""

from __future__ import annotations

import asyncio
import datetime

from ambient_mesh.cni.plugin_token import PluginToken, PluginTokens, refresh_delay
from ambient_mesh.kube.client import KubeApiError


class Requester:
    def __init__(self, answers):
        self.answers = list(answers)
        self.calls = []

    async def request_token(self, namespace, service_account, *, expiration_s, audiences=()):
        self.calls.append((namespace, service_account, expiration_s, audiences))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def at(seconds: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC)


def test_refresh_at_80_percent_of_the_lifetime():
    token = PluginToken(token="t", issued_at=1000.0, expires_at=4600.0)
    assert refresh_delay(token, 1000.0) == 2880.0
    assert refresh_delay(token, 3000.0) == 880.0
    assert refresh_delay(token, 5000.0) == 1.0  # overdue: soon, not in a busy loop
    assert "t" not in repr(token).replace("PluginToken", "").replace("expires", "")


def test_tokens_follow_the_granted_expiry_and_back_off_without_outliving_it():
    now = [1000.0]
    req = Requester(
        [
            {"token": "secret-a", "expirationTimestamp": at(1600.0)},  # the server granted 600 s of 3600
            KubeApiError("create token: 403 Forbidden", status=403),
            KubeApiError("create token: 403 Forbidden", status=403),
            {"token": "secret-b", "expirationTimestamp": "1970-01-01T01:30:00Z"},
        ]
    )
    tokens = PluginTokens(req, namespace="istio-system", clock=lambda: now[0])
    assert asyncio.run(tokens.refresh()) and tokens.current() == "secret-a"
    assert req.calls == [("istio-system", "istio-cni-plugin", 3600, ())]
    assert tokens.next_delay(0) == 480.0
    now[0] = 1480.0
    assert not asyncio.run(tokens.refresh()) and tokens.current() == "secret-a"  # kept while valid
    assert tokens.next_delay(1) == 1.0 and tokens.next_delay(3) == 4.0
    now[0] = 1590.0
    assert tokens.next_delay(10) == 10.0  # capped at what is left of the current token
    assert not asyncio.run(tokens.refresh())
    now[0] = 1600.0
    assert tokens.current() is None  # expired: never handed out
    assert "secret" not in repr(tokens) and "403" in repr(tokens)
    now[0] = 5000.0
    assert asyncio.run(tokens.refresh()) and tokens.token is not None
    assert tokens.token.expires_at == 5400.0  # the ISO answer parsed
