"""What the CNI plugin and the node agent need to know about a pod and its namespace.

Counterpart of the pod/namespace GETs in istio-cni's plugin (cni/pkg/plugin) and of the pod
fields its node agent reads. `PodLookup` is the seam: the plugin asks it for one pod and one
namespace. `DirectoryPodLookup` answers from the embedded control plane's YAML directory (the
lab's source of truth); `KubeApiPodLookup` asks the Kubernetes API server with the kubeconfig the
node agent writes (kubeconfig.py), as istio-cni's plugin does. The node agent's own watch of the
API server is pods.py.

`get_pod`/`get_namespace` return None when the object does not exist and raise
`PodLookupError` when the source cannot be read at all: the caller fails closed on the latter
and decides what "absent" means on the former.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import quote, urlsplit

from ..errors import AmbientError, ProtocolError
from ..http1 import deadline, exchange, render_request
from ..kube.kubeconfig import KubeconfigError, KubeCredentials, load_kubeconfig

if TYPE_CHECKING:
    from ..kube.store import KubeStore


class PodLookupError(AmbientError):
    """The pod source (API server, YAML directory) could not be read."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PodInfo:
    name: str
    namespace: str
    uid: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    host_network: bool = False
    # Names only: the enablement decision looks for an injected `istio-proxy` sidecar.
    containers: tuple[str, ...] = ()
    init_containers: tuple[str, ...] = ()
    node_name: str = ""
    ips: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class NamespaceInfo:
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)


class PodLookup(Protocol):
    def get_pod(self, namespace: str, name: str) -> PodInfo | None: ...

    def get_namespace(self, name: str) -> NamespaceInfo | None: ...


class DirectoryPodLookup:
    """Pods and namespaces from a directory of Kubernetes YAML (`ambient control --config-dir`).

    The directory is read once, on first use, so one plugin run sees one consistent snapshot;
    make a new lookup to see later changes.
    """

    __slots__ = ("path", "_store", "_errors")

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._store: KubeStore | None = None
        self._errors = 0

    def __repr__(self) -> str:
        if self._store is None:
            return f"DirectoryPodLookup({str(self.path)!r}: not read yet)"
        return (
            f"DirectoryPodLookup({str(self.path)!r}: {len(self._store.pods)} pods, "
            f"{len(self._store.namespaces)} namespaces, {self._errors} bad objects)"
        )

    def _load(self) -> KubeStore:
        if self._store is None:
            # Imported here: the plugin pays for YAML parsing only when it needs a pod.
            from ..kube.load import load_directory
            from ..kube.store import KubeStore

            if not self.path.is_dir():
                raise PodLookupError(
                    f"pod source directory {self.path} does not exist",
                    hint="is `ambient_pod_source.directory` in the CNI config the control plane's --config-dir?",
                )
            result = load_directory(self.path)
            self._errors = len(result.errors)
            self._store = KubeStore(result.objects)
        return self._store

    def get_pod(self, namespace: str, name: str) -> PodInfo | None:
        from ..kube.model import Pod

        obj = self._load().get("Pod", namespace, name)
        if not isinstance(obj, Pod):
            return None
        return pod_info_from_store(obj)

    def get_namespace(self, name: str) -> NamespaceInfo | None:
        from ..kube.model import Namespace

        obj = self._load().get("Namespace", "", name)
        if not isinstance(obj, Namespace):
            return None
        return NamespaceInfo(
            name=obj.metadata.name,
            labels=dict(obj.metadata.labels),
            annotations=dict(obj.metadata.annotations),
        )


# -- the Kubernetes API, for the plugin --------------------------------------------------------------
#
# istio-cni's plugin builds a client-go client from a kubeconfig the node agent keeps in its run
# dir and GETs the pod and its namespace. A client library would cost the plugin more start-up
# time than the whole lookup takes, so this is two HTTP/1.1 GETs over one `ssl` socket each, with
# the bearer token and CA from the kubeconfig (read by kube.kubeconfig, the agent's and control
# plane's reader too). Nothing here imports asyncio; `ssl` and YAML are imported only when a lookup
# actually happens (and YAML only for a hand-written kubeconfig: the agent writes JSON, which is
# YAML too).

PLUGIN_KUBECONFIG_NAME = "istio-cni-kubeconfig"
# istio-cni's plugin has no timeout of its own beyond client-go's; a kubelet sandbox ADD is
# bounded anyway, and 5 s matches the plugin's other call (the agent POST).
API_LOOKUP_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ApiReply:
    status: int
    body: bytes = b""


def load_plugin_kubeconfig(path: str | Path) -> KubeCredentials:
    """The plugin's kubeconfig (kube.kubeconfig), every failure a PodLookupError: the plugin then
    fails closed, since it cannot tell whether the pod is ambient."""
    try:
        credentials = load_kubeconfig(
            path,
            missing_hint="the node agent (ambient cni-agent) writes it at start: is it running on this node?",
        )
    except KubeconfigError as exc:
        raise PodLookupError(exc.message, hint=exc.hint) from None
    if credentials.client_cert_data:
        raise PodLookupError(
            f"kubeconfig {path}: the plugin authenticates with a bearer token only, not a client certificate",
            hint="the node agent writes a token kubeconfig; is `kubernetes.kubeconfig` in the CNI config another one?",
        )
    return credentials


def _string_map(raw: Any) -> dict[str, str]:
    if not isinstance(raw, dict):
        return {}
    return {str(k): v for k, v in raw.items() if isinstance(v, str)}


def object_field(raw: Any, key: str) -> dict[str, Any]:
    """`raw[key]` when it is a JSON object, else {} (API objects' optional sub-objects)."""
    value = raw.get(key)
    return value if isinstance(value, dict) else {}


def pod_info_from_store(obj: Any, *, uid: str | None = None) -> PodInfo:
    """kube/model.py's Pod (the YAML-directory source) -> PodInfo; `uid` replaces a missing one."""
    meta = obj.metadata
    return PodInfo(
        name=meta.name,
        namespace=meta.namespace,
        uid=uid if uid is not None else meta.uid,
        labels=dict(meta.labels),
        annotations=dict(meta.annotations),
        host_network=obj.host_network,
        containers=tuple(c.name for c in obj.containers),
        init_containers=tuple(c.name for c in obj.init_containers),
        node_name=obj.node_name,
        ips=obj.ips,
    )


def pod_info_from_json(obj: Any) -> PodInfo:
    """A Pod as the API server returns it -> PodInfo. Missing optional fields take zero values;
    a pod without metadata.name/namespace is a PodLookupError (it cannot be the pod asked for)."""
    if not isinstance(obj, dict):
        raise PodLookupError("pod: expected a JSON object")
    meta, spec, status = object_field(obj, "metadata"), object_field(obj, "spec"), object_field(obj, "status")
    name, namespace = meta.get("name"), meta.get("namespace")
    if not isinstance(name, str) or not name or not isinstance(namespace, str) or not namespace:
        raise PodLookupError("pod: metadata.name and metadata.namespace are required")

    def names(key: str) -> tuple[str, ...]:
        items = spec.get(key)
        if not isinstance(items, list):
            return ()
        return tuple(c["name"] for c in items if isinstance(c, dict) and isinstance(c.get("name"), str))

    ips: tuple[str, ...] = ()
    if isinstance(status.get("podIPs"), list):
        ips = tuple(
            p["ip"]
            for p in status["podIPs"]
            if isinstance(p, dict) and isinstance(p.get("ip"), str) and p["ip"]
        )
    if not ips and isinstance(status.get("podIP"), str) and status["podIP"]:
        ips = (status["podIP"],)
    uid, node = meta.get("uid"), spec.get("nodeName")
    return PodInfo(
        name=name,
        namespace=namespace,
        uid=uid if isinstance(uid, str) else "",
        labels=_string_map(meta.get("labels")),
        annotations=_string_map(meta.get("annotations")),
        host_network=spec.get("hostNetwork") is True,
        containers=names("containers"),
        init_containers=names("initContainers"),
        node_name=node if isinstance(node, str) else "",
        ips=ips,
    )


def namespace_info_from_json(obj: Any) -> NamespaceInfo:
    if not isinstance(obj, dict):
        raise PodLookupError("namespace: expected a JSON object")
    meta = object_field(obj, "metadata")
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise PodLookupError("namespace: metadata.name is required")
    return NamespaceInfo(
        name=name, labels=_string_map(meta.get("labels")), annotations=_string_map(meta.get("annotations"))
    )


def render_api_get(*, host_header: str, path: str, token: str) -> bytes:
    headers = [("User-Agent", "istio-cni"), ("Accept", "application/json")]
    if token:
        headers.append(("Authorization", f"Bearer {token}"))
    return render_request("GET", path, host=host_header, headers=tuple(headers))


class ApiTransport(Protocol):
    """One GET against the API server; raises OSError (refused, TLS failure, timeout) or
    ProtocolError (a reply that is not HTTP)."""

    def get(self, path: str, *, timeout_s: float) -> ApiReply: ...


class HttpsApiTransport:
    """One TCP (+TLS) connection per GET: the plugin makes two and exits."""

    __slots__ = ("credentials", "host", "port", "base_path", "_tls", "_ssl_context")

    def __init__(self, credentials: KubeCredentials) -> None:
        self.credentials = credentials
        parts = urlsplit(credentials.server)
        try:
            port = parts.port
        except ValueError:
            port = -1
        if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
            raise PodLookupError(f"kubeconfig: {credentials.server!r} is not an http(s) URL")
        self.host = parts.hostname
        self._tls = parts.scheme == "https"
        self.port = port or (443 if self._tls else 80)
        self.base_path = parts.path.rstrip("/")
        self._ssl_context: Any = None

    def __repr__(self) -> str:
        return f"HttpsApiTransport({self.credentials.server})"

    def _context(self) -> Any:
        if self._ssl_context is None:
            try:
                self._ssl_context = self.credentials.ssl_context()
            except KubeconfigError as exc:
                raise PodLookupError(exc.message) from None
        return self._ssl_context

    def get(self, path: str, *, timeout_s: float) -> ApiReply:
        remaining = deadline(timeout_s, "the API server")

        bracketed = f"[{self.host}]" if ":" in self.host else self.host
        default_port = 443 if self._tls else 80
        host_header = bracketed if self.port == default_port else f"{bracketed}:{self.port}"
        try:
            token = self.credentials.bearer()
        except KubeconfigError as exc:
            raise PodLookupError(exc.message, hint=exc.hint) from None
        request = render_api_get(host_header=host_header, path=self.base_path + path, token=token)
        with socket.create_connection((self.host, self.port), timeout=remaining()) as raw:
            sock = raw
            if self._tls:
                sock = self._context().wrap_socket(raw, server_hostname=self.host)
            try:
                response = exchange(sock, request, remaining)
                return ApiReply(status=response.status, body=response.body)
            finally:
                if sock is not raw:
                    sock.close()


TransportFactory = Callable[[KubeCredentials], ApiTransport]


class KubeApiPodLookup:
    """Pods and namespaces from the Kubernetes API server, as istio-cni's plugin reads them: the
    credentials in `kubeconfig_path` (re-read by each new lookup, so a rotated token is picked
    up), one GET per object.

    404 is "absent" (None); every other failure (kubeconfig missing or broken, connection refused,
    TLS failure, timeout, 401/403, 5xx, a body that is not the object) is a PodLookupError.
    """

    __slots__ = ("kubeconfig_path", "timeout_s", "_transport_factory", "_transport", "requests")

    def __init__(
        self,
        kubeconfig_path: str | Path,
        *,
        timeout_s: float = API_LOOKUP_TIMEOUT_S,
        transport_factory: TransportFactory = HttpsApiTransport,
    ) -> None:
        self.kubeconfig_path = Path(kubeconfig_path)
        self.timeout_s = timeout_s
        self._transport_factory = transport_factory
        self._transport: ApiTransport | None = None
        self.requests = 0

    def __repr__(self) -> str:
        state = "not connected yet" if self._transport is None else f"{self._transport!r}"
        return f"KubeApiPodLookup({str(self.kubeconfig_path)!r}: {state}, {self.requests} requests)"

    def _get(self, path: str, what: str) -> Any:
        if self._transport is None:
            self._transport = self._transport_factory(load_plugin_kubeconfig(self.kubeconfig_path))
        self.requests += 1
        try:
            reply = self._transport.get(path, timeout_s=self.timeout_s)
        except (OSError, ProtocolError) as exc:
            raise PodLookupError(
                f"cannot GET {what} from the API server: {type(exc).__name__}: {exc}",
                hint="is the API server reachable from the node, and the CA in the kubeconfig current?",
            ) from None
        if reply.status == 404:
            return None
        if reply.status != 200:
            text = reply.body[:512].decode("utf-8", "replace").strip()
            hint = (
                "the node agent rewrites the kubeconfig when its service-account token rotates; "
                "may its service account get pods and namespaces?"
                if reply.status in (401, 403)
                else None
            )
            raise PodLookupError(f"GET {what}: API server answered {reply.status}: {text}", hint=hint)
        try:
            return json.loads(reply.body)
        except (ValueError, RecursionError):
            raise PodLookupError(f"GET {what}: the API server's answer is not JSON") from None

    def get_pod(self, namespace: str, name: str) -> PodInfo | None:
        path = f"/api/v1/namespaces/{quote(namespace, safe='')}/pods/{quote(name, safe='')}"
        obj = self._get(path, f"pod {namespace}/{name}")
        return None if obj is None else pod_info_from_json(obj)

    def get_namespace(self, name: str) -> NamespaceInfo | None:
        obj = self._get(f"/api/v1/namespaces/{quote(name, safe='')}", f"namespace {name}")
        return None if obj is None else namespace_info_from_json(obj)
