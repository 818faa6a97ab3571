"""Where the node agent learns about pods and namespaces, and where it records enrollment.

Counterpart of istio-cni's informers (cni/pkg/nodeagent/informers.go: a Pod informer filtered by
`spec.nodeName`, a Namespace informer) and of its annotation patches (`ambient.istio.io/redirection`
on the `pods/status` subresource, reference/istio-cni.md 5.2-5.4).

`PodSource` is the one small interface; two implementations:

- `KubeApiPodSource`: the Kubernetes REST API. List, then watch from the list's
  resourceVersion (JSON lines); a 410 Gone relists and reports the difference. Credentials from
  the in-cluster service account or a kubeconfig (`KubeAccess`). Plain asyncio streams: no
  client library is needed for four endpoints.
- `DirectoryPodSource`: the embedded control plane's YAML directory (control/kube.py), polled
  by `DirectoryWatcher`. Those files are the operator's, so the enrollment mark lives in a
  state file in the agent's run dir and is overlaid on the pods as the annotation would be.

Both keep a cache of this node's pods and all namespaces, and report changes as `PodEvent` /
`NamespaceEvent` values with the old and new object (the informer needs the old one: Kubernetes
blanks a terminated pod's IP, kubernetes#125370).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import enum
import json
import logging
import os
import ssl
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote, urlencode, urlsplit

import yaml

from ..errors import ConfigError, ProtocolError
from .plugin import parse_http_response
from .podinfo import NamespaceInfo, PodInfo, PodLookupError, namespace_info_from_json, pod_info_from_json

log = logging.getLogger("ambient_mesh.cni-agent")

ANNOTATION_REDIRECTION = "ambient.istio.io/redirection"
REDIRECTION_ENABLED = "enabled"
REDIRECTION_PENDING = "pending"
TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
AGENT_DAEMONSET_NAME = "istio-cni-node"

API_TIMEOUT_S = 10.0
WATCH_TIMEOUT_S = 300  # the server ends a watch after this; we then re-watch from the last version
WATCH_RETRY_INITIAL_S = 0.1
WATCH_RETRY_MAX_S = 5.0
MAX_WATCH_LINE_BYTES = 16 * 1024 * 1024


class PodSourceError(PodLookupError):
    """The pod source (API server, YAML directory, state file) could not be read or written."""


# -- values ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class WatchedPod:
    """A pod as the agent tracks it: the plugin's `PodInfo` plus what only the agent needs."""

    info: PodInfo
    service_account: str = ""
    phase: str = ""
    resource_version: str = ""
    deleting: bool = False

    @property
    def uid(self) -> str:
        return self.info.uid

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def namespace(self) -> str:
        return self.info.namespace

    @property
    def key(self) -> tuple[str, str]:
        return (self.info.namespace, self.info.name)

    @property
    def ips(self) -> tuple[str, ...]:
        return self.info.ips

    @property
    def labels(self) -> Mapping[str, str]:
        return self.info.labels

    @property
    def annotations(self) -> Mapping[str, str]:
        return self.info.annotations

    @property
    def redirection(self) -> str:
        """`enabled`, `pending` or '' (the enrollment annotation)."""
        return self.info.annotations.get(ANNOTATION_REDIRECTION, "")

    @property
    def terminated(self) -> bool:
        return self.phase in TERMINAL_PHASES

    def with_redirection(self, value: str | None) -> WatchedPod:
        annotations = dict(self.info.annotations)
        if value is None:
            annotations.pop(ANNOTATION_REDIRECTION, None)
        else:
            annotations[ANNOTATION_REDIRECTION] = value
        return replace(self, info=replace(self.info, annotations=annotations))

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


class EventType(enum.Enum):
    ADDED = "add"
    UPDATED = "update"
    DELETED = "delete"


@dataclass(frozen=True, slots=True, kw_only=True)
class PodEvent:
    type: EventType
    old: WatchedPod | None = None
    new: WatchedPod | None = None

    @property
    def pod(self) -> WatchedPod:
        pod = self.new if self.new is not None else self.old
        assert pod is not None
        return pod


@dataclass(frozen=True, slots=True, kw_only=True)
class NamespaceEvent:
    type: EventType
    old: NamespaceInfo | None = None
    new: NamespaceInfo | None = None

    @property
    def namespace(self) -> NamespaceInfo:
        ns = self.new if self.new is not None else self.old
        assert ns is not None
        return ns


SourceEvent = PodEvent | NamespaceEvent
OnEvent = Callable[[SourceEvent], Awaitable[None]]


class PodSource(Protocol):
    """This node's pods and all namespaces, kept current, plus the enrollment mark."""

    async def start(self) -> None:
        """List everything; afterwards the cache is synced (istio-cni waits for cache sync)."""

    async def run(self, on_event: OnEvent) -> None:
        """Watch until cancelled, calling `on_event` for every change after `start`."""

    def pods(self) -> tuple[WatchedPod, ...]: ...

    def pod(self, namespace: str, name: str) -> WatchedPod | None: ...

    def namespace(self, name: str) -> NamespaceInfo | None: ...

    async def fetch_pod(self, namespace: str, name: str) -> WatchedPod | None:
        """A fresh read, for a CNI ADD that arrives before the watch has seen the pod."""

    async def mark_enrolled(self, pod: WatchedPod, value: str = REDIRECTION_ENABLED) -> None: ...

    async def unmark(self, pod: WatchedPod) -> None: ...

    async def agent_upgrading(self, pod_namespace: str) -> bool:
        """Whether the agent's DaemonSet still exists (shutdown for an upgrade or a reboot)."""

    async def close(self) -> None: ...


def diff_objects(old: Mapping[Any, Any], new: Mapping[Any, Any]) -> list[tuple[EventType, Any, Any]]:
    """Pure: (type, old, new) for every key added, changed or removed, in key order."""
    out: list[tuple[EventType, Any, Any]] = []
    for key in sorted(set(old) | set(new)):
        before, after = old.get(key), new.get(key)
        if before is None:
            out.append((EventType.ADDED, None, after))
        elif after is None:
            out.append((EventType.DELETED, before, None))
        elif before != after:
            out.append((EventType.UPDATED, before, after))
    return out


class _CachedSource:
    """The cache both sources keep, and the events a new snapshot produces."""

    def __init__(self, node_name: str) -> None:
        self.node_name = node_name
        self._pods: dict[tuple[str, str], WatchedPod] = {}
        self._namespaces: dict[str, NamespaceInfo] = {}
        self.events = 0

    def pods(self) -> tuple[WatchedPod, ...]:
        return tuple(self._pods[k] for k in sorted(self._pods))

    def pod(self, namespace: str, name: str) -> WatchedPod | None:
        return self._pods.get((namespace, name))

    def namespace(self, name: str) -> NamespaceInfo | None:
        return self._namespaces.get(name)

    def _on_node(self, pod: WatchedPod) -> bool:
        return not self.node_name or pod.info.node_name == self.node_name

    def _replace_all(
        self, pods: Mapping[tuple[str, str], WatchedPod], namespaces: Mapping[str, NamespaceInfo]
    ) -> list[SourceEvent]:
        pods = {k: p for k, p in pods.items() if self._on_node(p)}
        events: list[SourceEvent] = [
            NamespaceEvent(type=t, old=o, new=n) for t, o, n in diff_objects(self._namespaces, namespaces)
        ]
        events += [PodEvent(type=t, old=o, new=n) for t, o, n in diff_objects(self._pods, pods)]
        self._pods = dict(pods)
        self._namespaces = dict(namespaces)
        return events

    def _put_pod(self, pod: WatchedPod, deleted: bool = False) -> PodEvent | None:
        old = self._pods.get(pod.key)
        if deleted or not self._on_node(pod):
            if old is None:
                return None
            del self._pods[pod.key]
            return PodEvent(type=EventType.DELETED, old=old)
        self._pods[pod.key] = pod
        if old is None:
            return PodEvent(type=EventType.ADDED, new=pod)
        return None if old == pod else PodEvent(type=EventType.UPDATED, old=old, new=pod)

    def _put_namespace(self, ns: NamespaceInfo, deleted: bool = False) -> NamespaceEvent | None:
        old = self._namespaces.get(ns.name)
        if deleted:
            if old is None:
                return None
            del self._namespaces[ns.name]
            return NamespaceEvent(type=EventType.DELETED, old=old)
        self._namespaces[ns.name] = ns
        if old is None:
            return NamespaceEvent(type=EventType.ADDED, new=ns)
        return None if old == ns else NamespaceEvent(type=EventType.UPDATED, old=old, new=ns)


# -- the YAML directory -----------------------------------------------------------------------------


def synthesized_uid(namespace: str, name: str) -> str:
    """A stable uid for a hand-written pod without `metadata.uid` (ZDS needs one per pod)."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"ambient-mesh://pods/{namespace}/{name}"))


class EnrollmentState:
    """The directory source's enrollment marks: uid -> value, in one JSON file, written atomically."""

    __slots__ = ("path", "_marks")

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._marks: dict[str, dict[str, str]] = {}
        self._load()

    def __repr__(self) -> str:
        return f"EnrollmentState({str(self.path)!r}: {len(self._marks)} pods marked)"

    def _load(self) -> None:
        try:
            doc = json.loads(self.path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            raise PodSourceError(
                f"cannot read enrollment state {self.path}: {exc}",
                hint="delete the file; the agent rebuilds marks from the pods it enrolls",
            ) from None
        pods = doc.get("pods") if isinstance(doc, dict) else None
        if not isinstance(pods, dict):
            raise PodSourceError(f"enrollment state {self.path} has no `pods` object")
        self._marks = {
            uid: dict(v) for uid, v in pods.items() if isinstance(v, dict) and isinstance(v.get("value"), str)
        }

    def value(self, uid: str) -> str:
        mark = self._marks.get(uid)
        return mark["value"] if mark else ""

    def marks(self) -> dict[str, str]:
        return {uid: m["value"] for uid, m in self._marks.items()}

    def set(self, pod: WatchedPod, value: str | None) -> None:
        if value is None:
            if self._marks.pop(pod.uid, None) is None:
                return
        else:
            if self._marks.get(pod.uid, {}).get("value") == value:
                return
            self._marks[pod.uid] = {"value": value, "namespace": pod.namespace, "name": pod.name}
        self._save()

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = json.dumps({"pods": self._marks}, indent=2, sort_keys=True).encode()
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f"{self.path.name}.tmp.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def pod_from_store(obj: Any) -> WatchedPod:
    """control/kube.py's Pod -> WatchedPod."""
    meta = obj.metadata
    return WatchedPod(
        info=PodInfo(
            name=meta.name,
            namespace=meta.namespace,
            uid=meta.uid or synthesized_uid(meta.namespace, meta.name),
            labels=dict(meta.labels),
            annotations=dict(meta.annotations),
            host_network=obj.host_network,
            containers=tuple(c.name for c in obj.containers),
            init_containers=tuple(c.name for c in obj.init_containers),
            node_name=obj.node_name,
            ips=obj.ips,
        ),
        service_account=obj.service_account_name or "default",
        phase=obj.phase,
        deleting=bool(meta.deletion_timestamp),
    )


class DirectoryPodSource(_CachedSource):
    """Pods and namespaces from the embedded control plane's YAML directory."""

    def __init__(
        self,
        path: str | Path,
        *,
        node_name: str,
        state_file: str | Path,
        poll_interval_s: float = 1.0,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        from ..control.kube import DirectoryWatcher

        super().__init__(node_name)
        self.path = Path(path)
        self.poll_interval_s = poll_interval_s
        self.state = EnrollmentState(state_file)
        self._watcher = DirectoryWatcher(self.path, lambda change: None, poll_interval_s)
        self._sleep = sleep
        self._lock = asyncio.Lock()
        # Events of a poll made for fetch_pod, delivered by the next run() round.
        self._held: list[SourceEvent] = []

    def __repr__(self) -> str:
        return (
            f"DirectoryPodSource({str(self.path)!r}, node {self.node_name!r}: {len(self._pods)} pods, "
            f"{len(self._namespaces)} namespaces, {len(self.state.marks())} marked, {self.events} events)"
        )

    def _overlay(self, pod: WatchedPod) -> WatchedPod:
        mark = self.state.value(pod.uid)
        return pod.with_redirection(mark) if mark else pod

    def _poll(self) -> list[SourceEvent] | None:
        from ..control.kube import Namespace, Pod

        if not self.path.is_dir():
            raise PodSourceError(
                f"pod source directory {self.path} does not exist",
                hint="POD_SOURCE_DIRECTORY must be the control plane's --config-dir",
            )
        change = self._watcher.poll()
        if change is None:
            return None
        pods: dict[tuple[str, str], WatchedPod] = {}
        namespaces: dict[str, NamespaceInfo] = {}
        for obj in change.result.objects:
            if isinstance(obj, Pod):
                pod = self._overlay(pod_from_store(obj))
                pods[pod.key] = pod
            elif isinstance(obj, Namespace):
                m = obj.metadata
                namespaces[m.name] = NamespaceInfo(
                    name=m.name, labels=dict(m.labels), annotations=dict(m.annotations)
                )
        return self._replace_all(pods, namespaces)

    async def start(self) -> None:
        async with self._lock:
            self._poll()

    async def poll_once(self) -> list[SourceEvent]:
        async with self._lock:
            events = self._held + (self._poll() or [])
            self._held = []
        self.events += len(events)
        return events

    async def run(self, on_event: OnEvent) -> None:
        while True:
            await self._sleep(self.poll_interval_s)
            try:
                events = await self.poll_once()
            except PodSourceError as exc:
                log.warning("pod source: %s", exc)
                continue
            for event in events:
                await on_event(event)

    async def fetch_pod(self, namespace: str, name: str) -> WatchedPod | None:
        # Re-read now: the plugin read the files itself and may be ahead of our last poll. The
        # events of this read are not lost: the next poll diffs against the same cache.
        async with self._lock:
            self._held += self._poll() or []
        return self.pod(namespace, name)

    async def mark_enrolled(self, pod: WatchedPod, value: str = REDIRECTION_ENABLED) -> None:
        try:
            self.state.set(pod, value)
        except OSError as exc:
            raise PodSourceError(f"cannot record enrollment of {pod}: {exc}") from None
        cached = self._pods.get(pod.key)
        if cached is not None and cached.uid == pod.uid:
            self._pods[pod.key] = cached.with_redirection(value)

    async def unmark(self, pod: WatchedPod) -> None:
        try:
            self.state.set(pod, None)
        except OSError as exc:
            raise PodSourceError(f"cannot clear enrollment of {pod}: {exc}") from None
        cached = self._pods.get(pod.key)
        if cached is not None and cached.uid == pod.uid:
            self._pods[pod.key] = cached.with_redirection(None)

    async def agent_upgrading(self, pod_namespace: str) -> bool:
        # control/kube.py does not model DaemonSets; a raw look for the one object is enough.
        for file in sorted(self.path.glob("*")):
            if file.suffix not in (".yaml", ".yml", ".json"):
                continue
            try:
                docs = list(yaml.safe_load_all(file.read_text()))
            except (OSError, yaml.YAMLError):
                continue
            for doc in docs:
                if (
                    isinstance(doc, dict)
                    and doc.get("kind") == "DaemonSet"
                    and isinstance(doc.get("metadata"), dict)
                    and doc["metadata"].get("name") == AGENT_DAEMONSET_NAME
                    and doc["metadata"].get("namespace", "default") == (pod_namespace or "default")
                    and not doc["metadata"].get("deletionTimestamp")
                ):
                    return True
        return False

    async def close(self) -> None:
        return None


# -- the Kubernetes API -----------------------------------------------------------------------------


def pod_from_json(obj: Any) -> WatchedPod:
    """A Pod object as the API server returns it -> WatchedPod. Missing fields take zero values;
    a non-object or a pod without name/namespace/uid is a ProtocolError."""
    # Checked here, before podinfo's parser: the agent needs a uid for ZDS (the plugin does not),
    # and a bad object in a list or watch is the API server breaking protocol, not a failed lookup.
    if not isinstance(obj, dict):
        raise ProtocolError("pod: expected an object")
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    spec = obj.get("spec") if isinstance(obj.get("spec"), dict) else {}
    status = obj.get("status") if isinstance(obj.get("status"), dict) else {}
    if not all(isinstance(meta.get(k), str) and meta.get(k) for k in ("name", "namespace", "uid")):
        raise ProtocolError("pod: metadata.name, metadata.namespace and metadata.uid are required")
    sa = spec.get("serviceAccountName") or spec.get("serviceAccount") or "default"
    return WatchedPod(
        info=pod_info_from_json(obj),
        service_account=sa if isinstance(sa, str) else "default",
        phase=status.get("phase") if isinstance(status.get("phase"), str) else "",
        resource_version=meta.get("resourceVersion") if isinstance(meta.get("resourceVersion"), str) else "",
        deleting=bool(meta.get("deletionTimestamp")),
    )


def namespace_from_json(obj: Any) -> NamespaceInfo:
    # Checked here for the same reason as in pod_from_json: ProtocolError, not PodLookupError.
    if not isinstance(obj, dict) or not isinstance(obj.get("metadata"), dict):
        raise ProtocolError("namespace: expected an object with metadata")
    if not isinstance(obj["metadata"].get("name"), str) or not obj["metadata"]["name"]:
        raise ProtocolError("namespace: metadata.name is required")
    return namespace_info_from_json(obj)


@dataclass(frozen=True, slots=True, kw_only=True)
class KubeAccess:
    """How to reach the API server: base URL, bearer token, TLS material."""

    server: str
    token: str = ""
    ca_data: bytes = b""  # PEM
    insecure_skip_tls_verify: bool = False
    client_cert_data: bytes = b""
    client_key_data: bytes = b""
    token_file: str = ""  # re-read on each request: service-account tokens rotate

    def __repr__(self) -> str:
        return f"KubeAccess({self.server}, token={'yes' if self.token or self.token_file else 'no'})"

    @classmethod
    def in_cluster(
        cls,
        *,
        host: str,
        port: str,
        protocol: str = "https",
        sa_path: str | Path,
        ca_file: str = "",
        skip_tls_verify: bool = False,
    ) -> KubeAccess:
        if not host:
            raise ConfigError(
                "KUBERNETES_SERVICE_HOST",
                "not set: not running in a cluster",
                hint="set POD_SOURCE_DIRECTORY or KUBECONFIG outside a cluster",
            )
        sa = Path(sa_path)
        ca = b""
        if not skip_tls_verify and protocol == "https":
            ca_path = Path(ca_file) if ca_file else sa / "ca.crt"
            try:
                ca = ca_path.read_bytes()
            except OSError as exc:
                raise ConfigError("KUBE_CA_FILE", f"cannot read {ca_path}: {exc}") from None
        bracketed = f"[{host}]" if ":" in host else host
        return cls(
            server=f"{protocol}://{bracketed}:{port or 443}",
            ca_data=ca,
            insecure_skip_tls_verify=skip_tls_verify,
            token_file=str(sa / "token"),
        )

    @classmethod
    def from_kubeconfig(cls, path: str | Path) -> KubeAccess:
        """The current context's cluster and user (token, token file or client certificate)."""
        try:
            doc = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError("KUBECONFIG", f"cannot read {path}: {exc}") from None
        if not isinstance(doc, dict):
            raise ConfigError("KUBECONFIG", f"{path} is not a kubeconfig")

        def named(section: str, name: str) -> dict[str, Any]:
            for item in doc.get(section) or []:
                if isinstance(item, dict) and item.get("name") == name:
                    inner = item.get(section[:-1])
                    return inner if isinstance(inner, dict) else {}
            raise ConfigError("KUBECONFIG", f"{path}: no {section[:-1]} named {name!r}")

        current = doc.get("current-context")
        contexts = [c for c in doc.get("contexts") or [] if isinstance(c, dict)]
        if not current and len(contexts) == 1:
            current = contexts[0].get("name")
        context = named("contexts", current) if current else {}
        cluster = named("clusters", context.get("cluster", ""))
        user = named("users", context["user"]) if context.get("user") else {}
        base = Path(path).parent

        def data(item: dict[str, Any], key: str) -> bytes:
            if item.get(f"{key}-data"):
                return base64.b64decode(item[f"{key}-data"])
            if item.get(key):
                file = Path(item[key])
                return (file if file.is_absolute() else base / file).read_bytes()
            return b""

        if not isinstance(cluster.get("server"), str):
            raise ConfigError("KUBECONFIG", f"{path}: cluster has no server")
        try:
            return cls(
                server=cluster["server"].rstrip("/"),
                token=str(user.get("token") or ""),
                token_file=str(user.get("tokenFile") or ""),
                ca_data=data(cluster, "certificate-authority"),
                insecure_skip_tls_verify=bool(cluster.get("insecure-skip-tls-verify")),
                client_cert_data=data(user, "client-certificate"),
                client_key_data=data(user, "client-key"),
            )
        except (OSError, ValueError) as exc:
            raise ConfigError("KUBECONFIG", f"{path}: {exc}") from None

    def bearer(self) -> str:
        if self.token_file:
            with contextlib.suppress(OSError):
                return Path(self.token_file).read_text().strip()
        return self.token

    def ssl_context(self) -> ssl.SSLContext | None:
        if not self.server.startswith("https://"):
            return None
        ctx = ssl.create_default_context()
        if self.insecure_skip_tls_verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        elif self.ca_data:
            ctx = ssl.create_default_context(cadata=self.ca_data.decode())
        if self.client_cert_data and self.client_key_data:
            with tempfile.TemporaryDirectory() as tmp:
                cert, key = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
                cert.write_bytes(self.client_cert_data)
                key.write_bytes(self.client_key_data)
                ctx.load_cert_chain(cert, key)
        return ctx


@dataclass(frozen=True, slots=True, kw_only=True)
class ApiResponse:
    status: int
    body: bytes = b""

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError as exc:
            raise ProtocolError(f"API server sent invalid JSON: {exc}") from None


class ChunkDecoder:
    """Incremental HTTP/1.1 chunked transfer decoding (watch responses never end by length)."""

    __slots__ = ("_buf", "done")

    def __init__(self) -> None:
        self._buf = b""
        self.done = False

    def feed(self, data: bytes) -> bytes:
        self._buf += data
        out = bytearray()
        while not self.done:
            line_end = self._buf.find(b"\r\n")
            if line_end < 0:
                if len(self._buf) > 64:
                    raise ProtocolError("chunk size line too long")
                break
            size_text = self._buf[:line_end].split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise ProtocolError(f"bad chunk size {size_text[:20]!r}") from None
            if size == 0:
                self.done = True
                break
            if len(self._buf) < line_end + 2 + size + 2:
                break
            start = line_end + 2
            out += self._buf[start : start + size]
            self._buf = self._buf[start + size + 2 :]
        return bytes(out)


class KubeClient:
    """Just enough of the Kubernetes REST API: GET, PATCH, and streaming watches.

    One connection per request (`Connection: close`): the agent makes a handful of calls per pod
    event, and keeping connections alive would add state for no measurable gain.
    """

    def __init__(self, access: KubeAccess, *, timeout_s: float = API_TIMEOUT_S) -> None:
        self.access = access
        self.timeout_s = timeout_s
        parts = urlsplit(access.server)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError("server", f"{access.server!r} is not an http(s) URL")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.base_path = parts.path.rstrip("/")
        self._ssl = access.ssl_context()
        self.requests = 0

    def __repr__(self) -> str:
        return f"KubeClient({self.access.server}, {self.requests} requests)"

    async def _open(
        self, method: str, path: str, body: bytes | None, content_type: str, accept: str = "application/json"
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        self.requests += 1
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(
                self.host, self.port, ssl=self._ssl, server_hostname=self.host if self._ssl else None
            ),
            self.timeout_s,
        )
        host = f"[{self.host}]" if ":" in self.host else self.host
        head = [
            f"{method} {self.base_path}{path} HTTP/1.1",
            f"Host: {host}:{self.port}",
            "User-Agent: ambient-mesh-cni-agent",
            f"Accept: {accept}",
            "Connection: close",
        ]
        token = self.access.bearer()
        if token:
            head.append(f"Authorization: Bearer {token}")
        if body is not None:
            head += [f"Content-Type: {content_type}", f"Content-Length: {len(body)}"]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + (body or b""))
        await writer.drain()
        return reader, writer

    async def request(
        self, method: str, path: str, body: bytes | None = None, content_type: str = "application/json"
    ) -> ApiResponse:
        try:
            reader, writer = await self._open(method, path, body, content_type)
        except (OSError, TimeoutError) as exc:
            raise PodSourceError(f"API server {self.access.server} unreachable: {exc}") from None
        try:
            data = b""
            async with asyncio.timeout(self.timeout_s):
                while True:
                    chunk = await reader.read(65536)
                    data += chunk
                    parsed = parse_http_response(data, eof=not chunk)
                    if parsed is not None:
                        return ApiResponse(status=parsed.status, body=parsed.body)
        except (OSError, TimeoutError) as exc:
            raise PodSourceError(f"{method} {path}: {exc or type(exc).__name__}") from None
        finally:
            writer.close()

    async def get_json(self, path: str) -> Any:
        response = await self.request("GET", path)
        if response.status != 200:
            raise PodSourceError(f"GET {path}: HTTP {response.status}: {response.body[:300]!r}")
        return response.json()

    async def watch(self, path: str) -> AsyncIterator[Any]:
        """Each JSON line of a watch response, until the server ends it."""
        try:
            reader, writer = await self._open("GET", path, None, "")
        except (OSError, TimeoutError) as exc:
            raise PodSourceError(f"API server {self.access.server} unreachable: {exc}") from None
        try:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = await asyncio.wait_for(reader.read(4096), self.timeout_s)
                if not chunk:
                    raise PodSourceError(f"watch {path}: connection closed before the headers")
                head += chunk
            head, _, rest = head.partition(b"\r\n\r\n")
            status_line = head.split(b"\r\n", 1)[0].split(b" ")
            if len(status_line) < 2 or status_line[1] != b"200":
                body = rest + await asyncio.wait_for(reader.read(65536), self.timeout_s)
                raise PodSourceError(
                    f"watch {path}: {b' '.join(status_line[1:]).decode(errors='replace')}: {body[:300]!r}"
                )
            chunked = b"transfer-encoding: chunked" in head.lower()
            decoder = ChunkDecoder() if chunked else None
            pending = b""
            data = rest
            while True:
                pending += decoder.feed(data) if decoder is not None else data
                while (nl := pending.find(b"\n")) >= 0:
                    line, pending = pending[:nl].strip(), pending[nl + 1 :]
                    if line:
                        try:
                            yield json.loads(line)
                        except ValueError as exc:
                            raise ProtocolError(f"watch {path}: bad JSON line: {exc}") from None
                if len(pending) > MAX_WATCH_LINE_BYTES:
                    raise ProtocolError(f"watch {path}: line longer than {MAX_WATCH_LINE_BYTES} bytes")
                if decoder is not None and decoder.done:
                    return
                data = await reader.read(65536)
                if not data:
                    return
        finally:
            writer.close()


class _Gone(Exception):
    """The watch's resourceVersion is too old (410): relist."""


class KubeApiPodSource(_CachedSource):
    """This node's pods (field selector spec.nodeName) and all namespaces from the API server."""

    def __init__(
        self, client: KubeClient, *, node_name: str, sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep
    ) -> None:
        super().__init__(node_name)
        self.client = client
        self._sleep = sleep
        self._versions = {"pods": "", "namespaces": ""}
        self.relists = 0

    def __repr__(self) -> str:
        return (
            f"KubeApiPodSource({self.client.access.server}, node {self.node_name!r}: {len(self._pods)} pods, "
            f"{len(self._namespaces)} namespaces, rv pods={self._versions['pods'] or '-'}, "
            f"{self.relists} relists, {self.events} events)"
        )

    def _pods_path(self, **params: str) -> str:
        query = {"fieldSelector": f"spec.nodeName={self.node_name}"} if self.node_name else {}
        query.update(params)
        return "/api/v1/pods?" + urlencode(query) if query else "/api/v1/pods"

    @staticmethod
    def _namespaces_path(**params: str) -> str:
        return "/api/v1/namespaces" + ("?" + urlencode(params) if params else "")

    async def _list(self) -> list[SourceEvent]:
        pods_doc = await self.client.get_json(self._pods_path())
        ns_doc = await self.client.get_json(self._namespaces_path())
        pods: dict[tuple[str, str], WatchedPod] = {}
        for item in pods_doc.get("items") or []:
            pod = pod_from_json(item)
            pods[pod.key] = pod
        namespaces = {ns.name: ns for ns in map(namespace_from_json, ns_doc.get("items") or [])}
        self._versions["pods"] = str((pods_doc.get("metadata") or {}).get("resourceVersion") or "")
        self._versions["namespaces"] = str((ns_doc.get("metadata") or {}).get("resourceVersion") or "")
        return self._replace_all(pods, namespaces)

    async def start(self) -> None:
        await self._list()

    async def _watch_once(self, kind: str, on_event: OnEvent) -> None:
        params = {"watch": "1", "allowWatchBookmarks": "true", "timeoutSeconds": str(WATCH_TIMEOUT_S)}
        if self._versions[kind]:
            params["resourceVersion"] = self._versions[kind]
        path = self._pods_path(**params) if kind == "pods" else self._namespaces_path(**params)
        async for line in self.client.watch(path):
            if not isinstance(line, dict):
                raise ProtocolError("watch event is not an object")
            kind_of_event, obj = line.get("type"), line.get("object")
            if kind_of_event == "ERROR":
                code = obj.get("code") if isinstance(obj, dict) else None
                if code == 410:
                    raise _Gone()
                raise PodSourceError(f"watch {kind}: error event {obj!r}")
            version = (obj.get("metadata") or {}).get("resourceVersion") if isinstance(obj, dict) else None
            if isinstance(version, str) and version:
                self._versions[kind] = version
            if kind_of_event == "BOOKMARK":
                continue
            if kind_of_event not in ("ADDED", "MODIFIED", "DELETED"):
                raise ProtocolError(f"watch {kind}: unknown event type {kind_of_event!r}")
            deleted = kind_of_event == "DELETED"
            event: SourceEvent | None = (
                self._put_pod(pod_from_json(obj), deleted)
                if kind == "pods"
                else self._put_namespace(namespace_from_json(obj), deleted)
            )
            if event is not None:
                self.events += 1
                await on_event(event)

    async def _watch_forever(self, kind: str, on_event: OnEvent) -> None:
        backoff = WATCH_RETRY_INITIAL_S
        while True:
            try:
                await self._watch_once(kind, on_event)
                backoff = WATCH_RETRY_INITIAL_S
                continue  # the server ended the watch normally: resume from the last version
            except _Gone:
                log.info("watch of %s expired (410 Gone); relisting", kind)
                self.relists += 1
                try:
                    events = await self._list()
                except (PodSourceError, ProtocolError) as exc:
                    log.warning("relist failed: %s", exc)
                else:
                    self.events += len(events)
                    for event in events:
                        await on_event(event)
                    continue
            except (PodSourceError, ProtocolError) as exc:
                log.warning("watch of %s failed: %s; retrying in %.1fs", kind, exc, backoff)
            await self._sleep(backoff)
            backoff = min(backoff * 2, WATCH_RETRY_MAX_S)

    async def run(self, on_event: OnEvent) -> None:
        # One consumer for both streams keeps events in the order they were received.
        async with asyncio.TaskGroup() as group:
            group.create_task(self._watch_forever("namespaces", on_event))
            group.create_task(self._watch_forever("pods", on_event))

    async def fetch_pod(self, namespace: str, name: str) -> WatchedPod | None:
        response = await self.client.request(
            "GET", f"/api/v1/namespaces/{quote(namespace)}/pods/{quote(name)}"
        )
        if response.status == 404:
            return None
        if response.status != 200:
            raise PodSourceError(f"GET pod {namespace}/{name}: HTTP {response.status}")
        pod = pod_from_json(response.json())
        event = self._put_pod(pod)
        if event is not None:
            self.events += 1
        return self.pod(namespace, name)

    async def _patch(self, pod: WatchedPod, value: str | None) -> None:
        # The pods/status subresource: istio-cni's RBAC grants patch there, not on pods.
        body = json.dumps({"metadata": {"annotations": {ANNOTATION_REDIRECTION: value}}}).encode()
        path = f"/api/v1/namespaces/{quote(pod.namespace)}/pods/{quote(pod.name)}/status"
        response = await self.client.request("PATCH", path, body, "application/merge-patch+json")
        if response.status == 404 and value is None:
            return  # gone already: nothing to unmark
        if response.status != 200:
            raise PodSourceError(f"PATCH {path}: HTTP {response.status}: {response.body[:300]!r}")
        with contextlib.suppress(ProtocolError):
            self._put_pod(pod_from_json(response.json()))

    async def mark_enrolled(self, pod: WatchedPod, value: str = REDIRECTION_ENABLED) -> None:
        await self._patch(pod, value)

    async def unmark(self, pod: WatchedPod) -> None:
        await self._patch(pod, None)

    async def agent_upgrading(self, pod_namespace: str) -> bool:
        path = f"/apis/apps/v1/namespaces/{quote(pod_namespace)}/daemonsets/{AGENT_DAEMONSET_NAME}"
        try:
            response = await self.client.request("GET", path)
        except PodSourceError as exc:
            log.warning("safe-upgrade check failed (%s): treating shutdown as final", exc)
            return False
        if response.status != 200:
            return False
        try:
            doc = response.json()
        except ProtocolError:
            return False
        meta = doc.get("metadata") if isinstance(doc, dict) else None
        return isinstance(meta, dict) and not meta.get("deletionTimestamp")

    async def close(self) -> None:
        return None


def build_pod_source(cfg: Any) -> PodSource:
    """The source the config names: a YAML directory, a kubeconfig, or the in-cluster API."""
    if cfg.pod_source_directory:
        return DirectoryPodSource(
            cfg.pod_source_directory,
            node_name=cfg.node_name,
            state_file=cfg.enrollment_state_file,
            poll_interval_s=cfg.pod_source_poll_interval_s,
        )
    if cfg.kubeconfig:
        access = KubeAccess.from_kubeconfig(cfg.kubeconfig)
    else:
        access = KubeAccess.in_cluster(
            host=cfg.k8s_service_host,
            port=cfg.k8s_service_port,
            protocol=cfg.k8s_service_protocol,
            sa_path=cfg.k8s_service_account_path,
            ca_file=cfg.kube_ca_file,
            skip_tls_verify=cfg.skip_tls_verify,
        )
    return KubeApiPodSource(KubeClient(access), node_name=cfg.node_name)


__all__ = [
    "ANNOTATION_REDIRECTION",
    "REDIRECTION_ENABLED",
    "REDIRECTION_PENDING",
    "DirectoryPodSource",
    "EnrollmentState",
    "EventType",
    "KubeAccess",
    "KubeApiPodSource",
    "KubeClient",
    "NamespaceEvent",
    "PodEvent",
    "PodSource",
    "PodSourceError",
    "SourceEvent",
    "WatchedPod",
    "build_pod_source",
    "diff_objects",
    "namespace_from_json",
    "pod_from_json",
]
