"""The waypoint route tests' services and apps: requests through the waypoint, waiting until a
route is served, and VirtualService text."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.helpers.waypoint_mesh import (
    IO_TIMEOUT_S,
    WaypointMesh,
    wait_condition,
)

ROUTED_VIP = "10.96.0.20"

V2_VIP = "10.96.0.21"

APP_PORTS = {"v1": 8081, "v2": 8082}

SERVICES = f"""
apiVersion: v1
kind: Service
metadata: {{name: routed, namespace: default, labels: {{istio.io/use-waypoint: waypoint}}}}
spec: {{selector: {{app: server}}, clusterIP: {ROUTED_VIP}, ports: [{{name: http, port: 80, targetPort: 8081}}]}}
---
apiVersion: v1
kind: Service
metadata: {{name: routed-v2, namespace: default, labels: {{istio.io/use-waypoint: waypoint}}}}
spec: {{selector: {{app: server}}, clusterIP: {V2_VIP}, ports: [{{name: http, port: 80, targetPort: 8082}}]}}
"""


class Response:
    def __init__(
        self, status: int, headers: dict[str, str], body: bytes, *, sent: int = 0, received: int = 0
    ) -> None:
        self.status = status
        self.headers = headers
        self.body = body
        self.sent = sent  # the request's bytes, as written to the connection
        self.received = received  # the response's bytes, as read from it

    @property
    def echo(self) -> dict[str, Any]:
        """What the app received (its JSON answer); {} when the app did not answer."""
        try:
            doc = json.loads(self.body)
        except ValueError:
            return {}
        return doc if isinstance(doc, dict) else {}

    def __repr__(self) -> str:
        return f"Response({self.status}, {self.headers}, {self.body[:200]!r})"


def request(
    mesh: WaypointMesh,
    path: str = "/",
    *,
    method: str = "GET",
    headers: dict[str, str] | None = None,
    vip: str = ROUTED_VIP,
    host: str = "routed",
) -> Response:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Connection: close", "Content-Length: 0"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    with mesh.socks(vip, 80) as sock:
        sock.settimeout(IO_TIMEOUT_S)
        raw = ("\r\n".join(lines) + "\r\n\r\n").encode()
        sock.sendall(raw)
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except OSError:
            pass
    head, _, body = data.partition(b"\r\n\r\n")
    first, *rest = head.decode(errors="replace").split("\r\n")
    parts = first.split()
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    hdrs: dict[str, str] = {}
    for line in rest:
        k, _, v = line.partition(":")
        hdrs.setdefault(k.strip().lower(), v.strip())
    return Response(status, hdrs, body, sent=len(raw), received=len(data))


def served(mesh: WaypointMesh, check, what: str, timeout_s: float = 20.0):  # type: ignore[no-untyped-def]
    """Wait until `check()` holds (a route pushed and taken by Envoy); its last result."""

    def attempt():  # type: ignore[no-untyped-def]
        try:
            return check()
        except (AssertionError, OSError, ConnectionError):
            return None

    try:
        return wait_condition(attempt, what, timeout_s, interval_s=0.2)
    except pytest.fail.Exception:
        pytest.fail(f"{what}: not served\n{mesh.tail('control', 20)}\n{mesh.tail('waypoint', 20)}")


def virtual_service(http: str, name: str = "vs") -> str:
    return f"""
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {{name: {name}, namespace: default}}
spec:
  hosts: [routed]
  http:
{http}
"""
