"""Readiness (15021): the start-up tasks still pending and `/healthz/ready`.

Counterparts: ztunnel src/readiness.rs and src/readiness/server.rs (docs/istio-behaviour.md,
"Admin and readiness").
"""

from __future__ import annotations

from http import HTTPStatus

from ..http1 import Request, Response, not_found
from ..http1.server import HttpServer, HttpService
from ..net import SocketAddr

# The readiness task pending once shutdown began: `/healthz/ready` then names it, and the lab's
# supervisor starts the next node proxy without waiting for this one to exit.
DRAINING = "draining"


class ReadinessToken:
    """Handle for one start-up task; `mark_ready()` once it is done."""

    __slots__ = ("_readiness", "name")

    def __init__(self, readiness: Readiness, name: str) -> None:
        self._readiness = readiness
        self.name = name

    def mark_ready(self) -> None:
        self._readiness.mark_ready(self.name)

    def __repr__(self) -> str:
        return f"<ReadinessToken {self.name!r}>"


class Readiness:
    """The start-up tasks still pending (ztunnel's: state manager, proxy, dns proxy, workload proxy manager)."""

    def __init__(self) -> None:
        self._pending: set[str] = set()
        self._known: set[str] = set()

    def register(self, name: str) -> ReadinessToken:
        if name in self._known:
            raise ValueError(f"readiness task {name!r} is already registered")
        self._known.add(name)
        self._pending.add(name)
        return ReadinessToken(self, name)

    def mark_ready(self, name: str) -> None:
        """Idempotent; marking a task that was never registered is a bug and raises KeyError."""
        if name not in self._known:
            raise KeyError(f"readiness task {name!r} was never registered")
        self._pending.discard(name)

    def mark_not_ready(self, name: str) -> None:
        """A task that was ready is pending again (e.g. the node agent connection was lost)."""
        if name not in self._known:
            raise KeyError(f"readiness task {name!r} was never registered")
        self._pending.add(name)

    @property
    def pending(self) -> tuple[str, ...]:
        return tuple(sorted(self._pending))

    @property
    def ready(self) -> bool:
        return not self._pending

    def __repr__(self) -> str:
        if self.ready:
            return "<Readiness: ready>"
        return f"<Readiness: pending {', '.join(self.pending)}>"


class ReadinessServer(HttpService):
    """`/healthz/ready`: 200 once every registered task is ready, else 500 naming what is pending."""

    PATH = "/healthz/ready"

    def __init__(self, address: SocketAddr, readiness: Readiness) -> None:
        self.readiness = readiness
        self.http = HttpServer("readiness", address, self.handle)

    async def handle(self, request: Request) -> Response:
        if request.path != self.PATH:
            return not_found(request.path)
        if self.readiness.ready:
            return Response.text(HTTPStatus.OK, "ready\n")
        return Response.text(
            HTTPStatus.INTERNAL_SERVER_ERROR, f"not ready, pending: {', '.join(self.readiness.pending)}\n"
        )

    def __repr__(self) -> str:
        return f"<ReadinessServer {self.http!r}, {self.readiness!r}>"
