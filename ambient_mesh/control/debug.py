"""The control plane's debug endpoint: istiod's `/debug/...` on its monitoring port (15014).

Counterpart: istiod's debug handlers (pilot/pkg/xds/debug.go): `/debug/connections` lists every
connected proxy with what it was sent per type, the nonces sent and acknowledged, NACKs and the
last error, and the sync state `ambient proxy-status` prints; `/debug/status` the conditions the
control plane computed for its objects (control/status.py). JSON, read-only, one request per
connection (http1/server.py); it listens on loopback by default, as istiod's debug port is
reached through `kubectl port-forward` or from inside its pod.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from ..http1 import Request, Response
from ..http1.server import HttpServer, HttpService
from ..net import SocketAddr
from ..ports import CNI_MONITORING_PORT
from .ads import ConnectionInfo
from .ads_state import TypeStatus
from .status import StatusMap, status_document

DEBUG_PORT = CNI_MONITORING_PORT  # istiod's monitoring and debug port is 15014 too

SYNCED, NOT_SENT, STALE, NACKED = "SYNCED", "NOT SENT", "STALE", "NACKED"


def sync_state(t: TypeStatus) -> str:
    """istioctl proxy-status's word for one type: SYNCED (the last response acknowledged), STALE
    (sent, not yet acknowledged), NACKED (the last answer was a NACK), NOT SENT."""
    if not t.last_nonce_sent:
        return NOT_SENT
    if t.last_error:
        return NACKED
    if t.last_nonce_acked == t.last_nonce_sent:
        return SYNCED
    return STALE


def connections_doc(connections: tuple[ConnectionInfo, ...], version: str) -> dict[str, Any]:
    proxies = []
    for info in connections:
        doc = info.to_dict()
        for entry, t in zip(doc["types"], info.types, strict=True):
            entry["sync"] = sync_state(t)
        proxies.append(doc)
    return {"version": version, "proxies": proxies}


def status_doc(status: StatusMap) -> list[dict[str, Any]]:
    return [
        # A route's conditions go in `parents[]`, per parentRef, as in its status.
        {"kind": kind, "namespace": ns, "name": name, "conditions": [], **status_document(conditions)}
        for (kind, ns, name), conditions in sorted(status.items())
    ]


class DebugServer(HttpService):
    def __init__(
        self,
        address: SocketAddr,
        connections: Callable[[], dict[str, Any]],
        status: Callable[[], list[dict[str, Any]]],
    ) -> None:
        self._connections = connections
        self._status = status
        self.http = HttpServer("control debug", address, self.handle)

    async def handle(self, request: Request) -> Response:
        if request.method != "GET":
            return Response.text(HTTPStatus.METHOD_NOT_ALLOWED, "GET only\n")
        path = request.path
        if path == "/debug/connections":
            return self._json(self._connections())
        if path == "/debug/status":
            return self._json(self._status())
        return Response.text(HTTPStatus.NOT_FOUND, "endpoints: /debug/connections /debug/status\n")

    @staticmethod
    def _json(doc: object) -> Response:
        body = json.dumps(doc, indent=2, default=str).encode()
        return Response(status=HTTPStatus.OK, body=body, content_type="application/json")

    def __repr__(self) -> str:
        return f"DebugServer({self.http!r})"
