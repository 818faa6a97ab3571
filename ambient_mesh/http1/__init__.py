"""HTTP/1.1 for every HTTP/1.1 speaker of the mesh: one sans-IO core and two thin shells.

- `core`: request and reply parsing and rendering, pure, with every limit named.
- `client`: the blocking client (the CNI plugin: node agent socket, Kubernetes pod lookup).
- `server`: the asyncio server shell (admin, stats, readiness, the node agent's servers).

This package imports only `core` and `client`: the CNI plugin is started for every pod and does
not pay for asyncio. Import `ambient_mesh.http1.server` where a server is wanted.
"""

from .client import deadline, exchange
from .core import (
    MAX_ERROR_BODY_BYTES,
    MAX_HEADER_COUNT,
    MAX_REQUEST_BODY_BYTES,
    MAX_REQUEST_HEAD_BYTES,
    MAX_RESPONSE_BYTES,
    TEXT_PLAIN,
    ClientResponse,
    Request,
    Response,
    method_not_allowed,
    not_found,
    parse_request,
    parse_response,
    render_request,
    render_response,
)

__all__ = [
    "MAX_ERROR_BODY_BYTES",
    "MAX_HEADER_COUNT",
    "MAX_REQUEST_BODY_BYTES",
    "MAX_REQUEST_HEAD_BYTES",
    "MAX_RESPONSE_BYTES",
    "TEXT_PLAIN",
    "ClientResponse",
    "Request",
    "Response",
    "deadline",
    "exchange",
    "method_not_allowed",
    "not_found",
    "parse_request",
    "parse_response",
    "render_request",
    "render_response",
]
