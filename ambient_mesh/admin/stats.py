"""The node proxy's Prometheus endpoint (15020): `/metrics`, `/stats/prometheus`.

Counterpart: ztunnel src/metrics/server.rs (docs/istio-behaviour.md, "Metrics"). What is rendered comes from
a `MetricsRenderer` (the metrics registry); this module only answers, gzipped when asked.
"""

from __future__ import annotations

import gzip
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Protocol

from ..http1 import Request, Response, not_found
from ..http1.server import HttpServer, HttpService
from ..net import SocketAddr

# Smaller replies are not worth compressing.
MIN_GZIP_BYTES = 1024


class MetricsRenderer(Protocol):
    def render(self, accept_header: str | None = None) -> tuple[bytes, str]: ...


def _accepts_gzip(accept_encoding: str | None) -> bool:
    if not accept_encoding:
        return False
    for item in accept_encoding.split(","):
        coding, _, params = item.strip().partition(";")
        if coding.strip().lower() == "gzip":
            q = params.strip().replace(" ", "")
            return q not in ("q=0", "q=0.0", "q=0.00", "q=0.000")
    return False


class StatsServer(HttpService):
    """Prometheus scrape endpoint (`/metrics`, `/stats/prometheus`)."""

    PATHS = frozenset({"/metrics", "/stats/prometheus"})

    def __init__(
        self,
        address: SocketAddr,
        metrics: MetricsRenderer,
        *,
        refresh: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._metrics = metrics
        # Awaited before each scrape is rendered: worker processes report their counters.
        self._refresh = refresh
        self.http = HttpServer("stats", address, self.handle)

    async def handle(self, request: Request) -> Response:
        if request.path not in self.PATHS:
            return not_found(request.path)
        if self._refresh is not None:
            await self._refresh()
        body, content_type = self._metrics.render(request.header("accept"))
        if len(body) >= MIN_GZIP_BYTES and _accepts_gzip(request.header("accept-encoding")):
            return Response(
                status=HTTPStatus.OK,
                body=gzip.compress(body),
                content_type=content_type,
                headers=(("Content-Encoding", "gzip"), ("Vary", "Accept-Encoding")),
            )
        return Response(status=HTTPStatus.OK, body=body, content_type=content_type)

    def __repr__(self) -> str:
        return f"<StatsServer {self.http!r}>"
