"""List, then watch from the list's resourceVersion: client-go's Reflector, for one kind.

The API-concepts rules it follows: a list returns a consistent snapshot and its
resourceVersion; a watch from that version delivers every later change in order; BOOKMARK events
(asked for with allowWatchBookmarks) carry only a newer resourceVersion, so a re-watch after the
server's timeoutSeconds starts close to "now" instead of from a version etcd may have compacted;
a watch from a compacted version fails with 410 Gone (as an ERROR event, or as the HTTP status
of the watch request), and the only correct recovery is a new list, whose snapshot replaces the
consumer's state (the consumer diffs it: deletions during the gap are found that way). Other
failures re-watch from the last version seen, with exponential backoff.

The consumer gets two calls: `on_replace(items)` for every list (the first and each relist) and
`on_event(event)` for ADDED/MODIFIED/DELETED. Both are awaited before the next event is read,
so the consumer applies events in the server's order.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ..errors import ProtocolError
from .client import WATCH_TIMEOUT_S, KubeApiError, KubeClient, Resource, WatchEvent

log = logging.getLogger(__name__)

WATCH_RETRY_INITIAL_S = 0.1
WATCH_RETRY_MAX_S = 5.0  # client-go's reflector backs off up to 30 s; our callers want to recover fast
HTTP_GONE = 410

OnReplace = Callable[[list[dict[str, Any]]], Awaitable[None]]
OnEvent = Callable[[WatchEvent], Awaitable[None]]

__all__ = ["Reflector"]


class _Expired(Exception):
    """The watch's resourceVersion has been compacted away (410 Gone): relist."""


class Reflector:
    """Keeps one consumer in step with one kind (optionally filtered by field/label selectors)."""

    def __init__(
        self,
        client: KubeClient,
        resource: Resource,
        *,
        on_replace: OnReplace,
        on_event: OnEvent,
        fields: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
        watch_timeout_s: int = WATCH_TIMEOUT_S,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        self.client = client
        self.resource = resource
        self.fields = dict(fields or {})
        self.labels = dict(labels or {})
        self.watch_timeout_s = watch_timeout_s
        self._on_replace = on_replace
        self._on_event = on_event
        self._sleep = sleep
        self.resource_version = ""
        self.lists = 0
        self.relists = 0
        self.events = 0
        self.bookmarks = 0
        self.last_error = ""

    def __repr__(self) -> str:
        selector = "".join(f" {k}={v}" for k, v in sorted({**self.fields, **self.labels}.items()))
        error = f", last error: {self.last_error}" if self.last_error else ""
        return (
            f"Reflector({self.resource}{selector}: rv {self.resource_version or '-'}, {self.lists} lists, "
            f"{self.relists} relists, {self.events} events, {self.bookmarks} bookmarks{error})"
        )

    async def list(self) -> None:
        """List and hand the snapshot to `on_replace`; the next watch starts from its version."""
        result = await self.client.list(self.resource, fields=self.fields, labels=self.labels)
        await self._on_replace(result.items)
        self.resource_version = result.resource_version
        self.lists += 1

    async def watch_once(self) -> None:
        """One watch request, until the server ends it; raises _Expired on 410 Gone."""
        try:
            async for event in self.client.watch(
                self.resource,
                resource_version=self.resource_version,
                fields=self.fields,
                labels=self.labels,
                timeout_s=self.watch_timeout_s,
            ):
                if event.type == "ERROR":
                    if event.status_code == HTTP_GONE:
                        raise _Expired()
                    raise KubeApiError(
                        f"watch {self.resource}: error event: {str(event.object.get('message', ''))[:300]}",
                        status=event.status_code,
                    )
                if event.resource_version:
                    self.resource_version = event.resource_version
                if event.type == "BOOKMARK":
                    self.bookmarks += 1
                    continue
                self.events += 1
                await self._on_event(event)
        except KubeApiError as exc:
            if exc.status == HTTP_GONE:
                raise _Expired() from None
            raise

    async def run(self) -> None:
        """Watch until cancelled (listing first if `list` has not run)."""
        backoff = WATCH_RETRY_INITIAL_S
        while True:
            try:
                if not self.lists or not self.resource_version:
                    if self.lists:
                        self.relists += 1
                    await self.list()
                await self.watch_once()
                backoff = WATCH_RETRY_INITIAL_S
                continue  # the server ended the watch (timeoutSeconds): resume from the last version
            except _Expired:
                log.info(
                    "watch of %s expired (410 Gone) at rv %s; relisting", self.resource, self.resource_version
                )
                self.resource_version = ""
                self.last_error = "410 Gone"
                continue
            except (KubeApiError, ProtocolError) as exc:  # ProtocolError: the consumer refused an object
                self.last_error = str(exc)
                log.warning("watch of %s failed: %s; retrying in %.1fs", self.resource, exc, backoff)
            await self._sleep(backoff)
            backoff = min(backoff * 2, WATCH_RETRY_MAX_S)
