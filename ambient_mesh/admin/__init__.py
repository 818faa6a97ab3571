"""The node proxy's three small HTTP servers: admin (15000), stats (15020), readiness (15021).

Counterparts: ztunnel src/admin.rs, src/metrics/server.rs, src/readiness.rs and
src/readiness/server.rs. HTTP/1.1 itself is `ambient_mesh.http1`'s; the names below that come
from there (`HttpServer`, `Request`, `Response`, `parse_request`, `render_response`) are
re-exported for callers that reached them here.
"""

from ..http1 import Request, Response, parse_request, render_response
from ..http1.server import HttpServer
from .readiness import Readiness, ReadinessServer, ReadinessToken
from .server import ADMIN_ENDPOINTS, AdminServer, LogControl, StdlibLogControl
from .stats import MetricsRenderer, StatsServer

__all__ = [
    "ADMIN_ENDPOINTS",
    "AdminServer",
    "HttpServer",
    "LogControl",
    "MetricsRenderer",
    "Readiness",
    "ReadinessServer",
    "ReadinessToken",
    "Request",
    "Response",
    "StatsServer",
    "StdlibLogControl",
    "parse_request",
    "render_response",
]
