"""An asyncio Kubernetes API client: lightkube underneath, raw JSON objects on top.

Counterpart of client-go's dynamic client as istiod and istio-cni use it. lightkube (on httpx)
does the transport: TLS to the cluster CA, bearer tokens (a token file re-read when the server
answers 401) and client certificates, paged lists (`limit`/`continue`), GET, merge PATCH and POST,
and the API server's Status errors. Every kind is a lightkube *generic* resource, so objects come
back as the API server's JSON (plain dicts): the control plane feeds them to the same parser as
its YAML files, and the node agent to the same pod reader as the CNI plugin.

Watches are streamed here rather than through lightkube's `watch()`, which neither asks for
bookmarks nor lets a 410 Gone reach the caller as a relist (it re-watches from "now", losing the
deletions in between) and reads lines without a length limit. `WatchLines` is the sans-IO line
splitter with that limit; `parse_watch_event` checks each event's shape.

Errors: every failure is a `KubeApiError` with the HTTP status (0 when the server was not reached
or broke protocol), raised once here at the seam.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from ..errors import AmbientError
from .kubeconfig import KubeconfigError, KubeCredentials

log = logging.getLogger(__name__)

API_TIMEOUT_S = 10.0
# The API server ends a watch after timeoutSeconds; a stream silent for longer than that plus
# WATCH_READ_SLACK_S is a dead connection (client-go's watch has the same server-side timeout).
WATCH_TIMEOUT_S = 300
WATCH_READ_SLACK_S = 30.0
LIST_CHUNK_SIZE = 500  # client-go's pager default
MAX_LIST_OBJECTS = 500_000
MAX_WATCH_LINE_BYTES = 16 * 1024 * 1024  # one object; etcd's own limit is 1.5 MiB per value
MAX_ERROR_BODY_BYTES = 64 * 1024
USER_AGENT = "ambient-mesh"

WATCH_EVENT_TYPES = frozenset({"ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR"})

__all__ = [
    "API_TIMEOUT_S",
    "CONFIG_MAPS",
    "DAEMONSETS",
    "NAMESPACES",
    "NODES",
    "PODS",
    "SERVICES",
    "SERVICE_ACCOUNTS",
    "TOKEN_REVIEWS",
    "KubeApiError",
    "KubeClient",
    "ListResult",
    "Resource",
    "WatchEvent",
    "WatchLines",
    "parse_watch_event",
]


class KubeApiError(AmbientError):
    """The API server refused a request, could not be reached, or broke protocol."""

    def __init__(self, message: str, *, status: int = 0, reason: str = "", hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.status = status
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Resource:
    """A kind as the REST API names it."""

    group: str
    version: str
    kind: str
    plural: str
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str | None = None, name: str | None = None, subresource: str = "") -> str:
        """`/api/v1/namespaces/ns/pods/name/status`; namespace None lists across namespaces."""
        parts = ["api", self.version] if not self.group else ["apis", self.group, self.version]
        if self.namespaced and namespace is not None:
            parts += ["namespaces", quote(namespace, safe="")]
        parts.append(self.plural)
        if name is not None:
            parts.append(quote(name, safe=""))
            if subresource:
                parts.append(subresource)
        return "/" + "/".join(parts)

    def __str__(self) -> str:
        return f"{self.plural}.{self.group}" if self.group else self.plural


PODS = Resource("", "v1", "Pod", "pods")
NAMESPACES = Resource("", "v1", "Namespace", "namespaces", namespaced=False)
SERVICES = Resource("", "v1", "Service", "services")
SERVICE_ACCOUNTS = Resource("", "v1", "ServiceAccount", "serviceaccounts")
CONFIG_MAPS = Resource("", "v1", "ConfigMap", "configmaps")
NODES = Resource("", "v1", "Node", "nodes", namespaced=False)
DAEMONSETS = Resource("apps", "v1", "DaemonSet", "daemonsets")
TOKEN_REVIEWS = Resource("authentication.k8s.io", "v1", "TokenReview", "tokenreviews", namespaced=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class ListResult:
    items: list[dict[str, Any]]
    resource_version: str


@dataclass(frozen=True, slots=True, kw_only=True)
class WatchEvent:
    type: str  # ADDED, MODIFIED, DELETED, BOOKMARK, ERROR
    object: dict[str, Any]

    @property
    def resource_version(self) -> str:
        meta = self.object.get("metadata")
        version = meta.get("resourceVersion") if isinstance(meta, dict) else None
        return version if isinstance(version, str) else ""

    @property
    def status_code(self) -> int:
        """An ERROR event's Status code (410: the resourceVersion is too old)."""
        code = self.object.get("code")
        return code if isinstance(code, int) and not isinstance(code, bool) else 0


class WatchLines:
    """Sans-IO: a watch body's bytes in, complete JSON lines out, none longer than the limit."""

    __slots__ = ("_pending", "max_line_bytes")

    def __init__(self, max_line_bytes: int = MAX_WATCH_LINE_BYTES) -> None:
        self._pending = b""
        self.max_line_bytes = max_line_bytes

    def feed(self, data: bytes) -> list[bytes]:
        self._pending += data
        *lines, self._pending = self._pending.split(b"\n")
        if len(self._pending) > self.max_line_bytes or any(len(line) > self.max_line_bytes for line in lines):
            raise KubeApiError(f"watch event longer than {self.max_line_bytes} bytes")
        return [line for line in (raw.strip() for raw in lines) if line]

    @property
    def pending_bytes(self) -> int:
        return len(self._pending.strip())


def parse_watch_event(line: bytes, resource: Resource) -> WatchEvent:
    """One watch line -> WatchEvent; anything that is not `{"type": ..., "object": {...}}` with a
    known type is a KubeApiError (the API server broke protocol)."""
    try:
        doc = json.loads(line)
    except (ValueError, RecursionError):
        raise KubeApiError(f"watch {resource}: an event is not JSON") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("object"), dict):
        raise KubeApiError(f"watch {resource}: an event is not an object with an `object`")
    kind = doc.get("type")
    if kind not in WATCH_EVENT_TYPES:
        raise KubeApiError(f"watch {resource}: unknown event type {str(kind)[:40]!r}")
    obj = doc["object"]
    if kind != "ERROR":
        # Watch events carry kind/apiVersion; set them when a server leaves them out, as for lists.
        obj.setdefault("kind", resource.kind)
        obj.setdefault("apiVersion", resource.api_version)
    return WatchEvent(type=kind, object=obj)


# lightkube registers each generic class process-wide and refuses a second one for a core kind,
# so every client shares one class per Resource.
_GENERIC_CLASSES: dict[Resource, Any] = {}


def _generic_class(resource: Resource) -> Any:
    cls = _GENERIC_CLASSES.get(resource)
    if cls is None:
        from lightkube import generic_resource

        create = (
            generic_resource.create_namespaced_resource
            if resource.namespaced
            else generic_resource.create_global_resource
        )
        cls = _GENERIC_CLASSES[resource] = create(
            resource.group, resource.version, resource.kind, resource.plural
        )
    return cls


def _list_version(pages: Any) -> str:
    """The list's resourceVersion; "" when the server sent none (lightkube raises then)."""
    from lightkube import NotReadyError

    try:
        version: str = pages.resourceVersion
    except NotReadyError:
        return ""
    return version


def _selector(values: Mapping[str, str] | None) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted((values or {}).items()))


def _status_message(status: int, body: bytes) -> tuple[str, str]:
    """(message, reason) from a Status body, else the body's start."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("message"), str):
        reason = doc.get("reason")
        return str(doc["message"])[:500], reason if isinstance(reason, str) else ""
    return body[:300].decode("utf-8", "replace").strip(), ""


def _hint(status: int) -> str | None:
    if status == 401:
        return "the API server does not accept our credentials: is the token current (rotated?)"
    if status == 403:
        return "the service account lacks RBAC for this request: check its ClusterRole"
    return None


class KubeClient:
    """list / get / patch / create through lightkube, and streamed watches."""

    def __init__(
        self, credentials: KubeCredentials, *, timeout_s: float = API_TIMEOUT_S, user_agent: str = USER_AGENT
    ) -> None:
        import httpx2
        import lightkube
        from lightkube.config.client_adapter import AsyncClient as stream_client
        from lightkube.config.client_adapter import ConnectionParams
        from lightkube.config.kubeconfig import KubeConfig
        from lightkube.config.models import Cluster, User

        self.credentials = credentials
        self.timeout_s = timeout_s

        # TLS is ours (KubeCredentials.ssl_context, in memory) rather than lightkube's, which
        # writes the CA and client key to temporary files: the control plane's container has a
        # read-only root filesystem.
        tls = credentials.ssl_context()
        config = KubeConfig.from_one(
            cluster=Cluster(server=credentials.server, insecure=credentials.insecure_skip_tls_verify),
            user=User(token=credentials.token or None, token_file=credentials.token_file or None),
        ).get()
        assert config is not None  # from_one makes its one context the current one
        timeout = httpx2.Timeout(timeout_s)
        # trust_env off: the API server is reached directly, never through HTTP(S)_PROXY.
        self._api = lightkube.AsyncClient(
            config=config, timeout=timeout, trust_env=False, transport=httpx2.AsyncHTTPTransport(verify=tls)
        )
        self._stream = stream_client(
            config,
            ConnectionParams(
                timeout=httpx2.Timeout(timeout_s, read=WATCH_TIMEOUT_S + WATCH_READ_SLACK_S),
                trust_env=False,
                # lightkube annotates a sync transport; its async adapter takes the async one
                transport=httpx2.AsyncHTTPTransport(verify=tls),  # type: ignore[arg-type]
            ),
        )
        self._stream.headers["User-Agent"] = user_agent
        self.requests = 0

    def __repr__(self) -> str:
        return f"KubeClient({self.credentials.server}, {self.requests} requests)"

    @staticmethod
    def _class(resource: Resource) -> Any:
        return _generic_class(resource)

    def _error(self, what: str, exc: BaseException) -> KubeApiError:
        import httpx2

        if isinstance(exc, httpx2.HTTPStatusError):
            status = exc.response.status_code
            try:
                body = exc.response.content[:MAX_ERROR_BODY_BYTES]
            except httpx2.HTTPError:
                body = b""
            message, reason = _status_message(status, body)
            return KubeApiError(
                f"{what}: HTTP {status}: {message}", status=status, reason=reason, hint=_hint(status)
            )
        if isinstance(exc, KubeconfigError | KubeApiError):
            return KubeApiError(f"{what}: {exc}")
        return KubeApiError(
            f"{what}: API server {self.credentials.server} unreachable: {type(exc).__name__}: {exc}",
            hint="is the API server address right and reachable, and its CA the one configured?",
        )

    def _failures(self) -> tuple[type[BaseException], ...]:
        import httpx2
        import lightkube

        return (httpx2.HTTPError, lightkube.ConfigError, KubeconfigError, OSError, ValueError)

    @staticmethod
    def _plain(item: Any, resource: Resource) -> dict[str, Any]:
        obj = dict(item)
        obj.setdefault("kind", resource.kind)
        obj.setdefault("apiVersion", resource.api_version)
        return obj

    async def list(
        self,
        resource: Resource,
        *,
        namespace: str | None = None,
        fields: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> ListResult:
        """Every object (paged), with the list's resourceVersion to watch from."""
        self.requests += 1
        ns = namespace if namespace is not None else ("*" if resource.namespaced else None)
        items: list[dict[str, Any]] = []
        try:
            pages = self._api.list(
                self._class(resource),
                namespace=ns,
                fields=dict(fields) if fields else None,
                labels=dict(labels) if labels else None,
                chunk_size=LIST_CHUNK_SIZE,
            )
            async for item in pages:
                if len(items) >= MAX_LIST_OBJECTS:
                    raise KubeApiError(f"list {resource}: more than {MAX_LIST_OBJECTS} objects")
                items.append(self._plain(item, resource))
            version = _list_version(pages)
        except self._failures() as exc:
            raise self._error(f"list {resource}", exc) from None
        return ListResult(items=items, resource_version=version)

    async def get(self, resource: Resource, namespace: str | None, name: str) -> dict[str, Any] | None:
        """One object, or None when it does not exist (404)."""
        self.requests += 1
        try:
            obj = await self._api.get(self._class(resource), name, namespace=namespace)
        except self._failures() as exc:
            error = self._error(f"get {resource} {namespace + '/' if namespace else ''}{name}", exc)
            if error.status == 404:
                return None
            raise error from None
        return self._plain(obj, resource)

    async def patch_merge(
        self,
        resource: Resource,
        namespace: str | None,
        name: str,
        patch: Mapping[str, Any],
        *,
        subresource: str = "",
    ) -> dict[str, Any] | None:
        """A JSON merge patch (RFC 7386); None when the object does not exist."""
        from lightkube.types import PatchType

        self.requests += 1
        cls = self._class(resource)
        if subresource == "status":
            cls = cls.Status
        elif subresource:
            raise ValueError(f"subresource {subresource!r} is not supported")
        try:
            obj = await self._api.patch(
                cls, name, dict(patch), namespace=namespace, patch_type=PatchType.MERGE
            )
        except self._failures() as exc:
            error = self._error(f"patch {resource} {namespace}/{name}", exc)
            if error.status == 404:
                return None
            raise error from None
        return self._plain(obj, resource)

    async def create(self, resource: Resource, body: Mapping[str, Any]) -> dict[str, Any]:
        """POST an object (or a review such as TokenReview) and return what the server answers."""
        self.requests += 1
        cls = self._class(resource)
        try:
            obj = await self._api.create(cls(dict(body)))
        except self._failures() as exc:
            raise self._error(f"create {resource}", exc) from None
        return self._plain(obj, resource)

    async def request_token(
        self, namespace: str, service_account: str, *, expiration_s: int, audiences: tuple[str, ...] = ()
    ) -> dict[str, Any]:
        """TokenRequest (POST serviceaccounts/NAME/token): a token for the service account, not
        bound to any object, valid `expiration_s` (the server may shorten it); no `audiences`
        means the API server's own. Returns the TokenRequest's `status` (token,
        expirationTimestamp)."""
        from lightkube.models.authentication_v1 import TokenRequestSpec
        from lightkube.models.meta_v1 import ObjectMeta
        from lightkube.resources.core_v1 import ServiceAccountToken

        self.requests += 1
        request = ServiceAccountToken(
            metadata=ObjectMeta(name=service_account, namespace=namespace),
            spec=TokenRequestSpec(audiences=list(audiences), expirationSeconds=expiration_s),
        )
        try:
            obj = await self._api.create(request, service_account, namespace=namespace)
        except self._failures() as exc:
            raise self._error(f"create token for serviceaccount {namespace}/{service_account}", exc) from None
        status = obj.status
        if status is None or not status.token:
            raise KubeApiError(
                f"create token for serviceaccount {namespace}/{service_account}: the answer has no token"
            )
        return {"token": status.token, "expirationTimestamp": status.expirationTimestamp}

    async def replace(self, resource: Resource, body: Mapping[str, Any]) -> dict[str, Any]:
        """PUT a whole object; the server refuses it with 409 when its resourceVersion is stale."""
        self.requests += 1
        cls = self._class(resource)
        meta = body.get("metadata", {})
        try:
            obj = await self._api.replace(cls(dict(body)), meta.get("name"), namespace=meta.get("namespace"))
        except self._failures() as exc:
            raise self._error(f"replace {resource} {meta.get('namespace')}/{meta.get('name')}", exc) from None
        return self._plain(obj, resource)

    async def watch(
        self,
        resource: Resource,
        *,
        resource_version: str,
        namespace: str | None = None,
        fields: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
        timeout_s: int = WATCH_TIMEOUT_S,
    ) -> AsyncIterator[WatchEvent]:
        """Every event after `resource_version`, bookmarks included, until the server ends the
        watch. A 410 Gone comes as an ERROR event (or as an HTTP 410 KubeApiError)."""
        params = {"watch": "true", "allowWatchBookmarks": "true", "timeoutSeconds": str(timeout_s)}
        if resource_version:
            params["resourceVersion"] = resource_version
        if fields:
            params["fieldSelector"] = _selector(fields)
        if labels:
            params["labelSelector"] = _selector(labels)
        path = resource.path(namespace)
        self.requests += 1
        lines = WatchLines()
        try:
            async with self._stream.stream("GET", path, params=params) as response:
                if response.status_code != 200:
                    body = b""
                    async for chunk in response.aiter_bytes():
                        body += chunk
                        if len(body) > MAX_ERROR_BODY_BYTES:
                            break
                    message, reason = _status_message(response.status_code, body)
                    raise KubeApiError(
                        f"watch {resource}: HTTP {response.status_code}: {message}",
                        status=response.status_code,
                        reason=reason,
                        hint=_hint(response.status_code),
                    )
                async for chunk in response.aiter_bytes():
                    for line in lines.feed(chunk):
                        yield parse_watch_event(line, resource)
        except KubeApiError:
            raise
        except self._failures() as exc:
            raise self._error(f"watch {resource}", exc) from None
        if lines.pending_bytes:
            raise KubeApiError(f"watch {resource}: the stream ended inside an event")

    async def close(self) -> None:
        await self._api.close()
        await self._stream.aclose()
