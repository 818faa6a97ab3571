"""`ambient control`: the embedded control plane program.

Counterpart: the part of istiod that ambient needs. It reads Kubernetes objects from the API
server (`--kube`) or from a directory of YAML files (`--dir`, watched for changes; sources.py),
translates them into `istio.workload.Address` and
`istio.security.Authorization` resources, serves them over delta ADS, and signs workload
certificates (IstioCertificateService), both on one TLS port (15012) whose certificate chains to
the mesh root that proxies are given. Callers authenticate with JWTs this control plane signs
(`ambient control token`) with `--dir`; with `--kube` they send their pods' service-account
tokens, which the API server reviews (TokenReview).

State kept in `--state-dir`: the CA (Istio's plugged-in layout, created on first start unless
ROOT_CA_DIR names the operator's), the token signing key, and `root-cert.pem` for proxies.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from cryptography.hazmat.primitives import serialization

from ..errors import BindError, ConfigError
from ..host.private import private_dir, write_private
from ..identity.ca import CertificateAuthority
from ..identity.grpc_tls import (
    DEFAULT_SERVING_DNS_NAMES,
    DEFAULT_SERVING_IPS,
    server_credentials,
    serving_certificate,
)
from ..identity.spiffe import Identity
from ..kube.client import SERVICES, KubeApiError, KubeClient
from ..kube.kubeconfig import KubeCredentials
from ..kube.model import ObjectKey, Pod
from ..kube.store import KubeStore
from ..net import SocketAddr
from ..ports import XDS_CA_PORT
from .ads import SERVER_OPTIONS, AdsServer, Authenticated, Unauthenticated
from .ca_server import BoundPod, CaServer, Refusal
from .caller_gate import CallerGate
from .debug import DebugServer, connections_doc, status_doc, sync_state
from .namespace_controller import NamespaceController
from .sources import (
    AUTHORIZATION_POLICIES,
    GATEWAYS,
    HTTP_ROUTES,
    PEER_AUTHENTICATIONS,
    SERVICE_ENTRIES,
    ConfigSource,
    DirectorySource,
    KubeApiSource,
    SourceChange,
)
from .status import (
    STATUS_INPUT_KINDS,
    DirectoryStatusWriter,
    KubeStatusWriter,
    StatusMap,
    StatusWriter,
    changed_status,
    compute_status,
)
from .tokenreview import Authenticator, TokenReviewAuthenticator
from .tokens import TokenIssuer, load_or_create_issuer
from .translate import AmbientIndex, MeshSettings, Translation
from .waypoint_deployer import apply_plan, read_current
from .waypoint_deployer import plan as plan_waypoints
from .waypoint_index import WaypointIndex
from .waypoint_kube import KubeWaypointDeployer, deploy_settings
from .waypoint_render import DEFAULT_IMAGE, DeploySettings

if TYPE_CHECKING:  # rich is imported only where the tables are drawn
    from rich.console import Console

log = logging.getLogger("ambient_mesh.control")

DEFAULT_LISTEN = f"[::]:{XDS_CA_PORT}"
SERVING_CERT_TTL_S = 365 * 24 * 3600
# `--dir` is polled (a stat per file): a user's apply is seen within this, a third of the
# under-a-second goal from `lab apply` to the first request routed by it.
POLL_INTERVAL_S = 0.2
CA_DIR_NAME = "cacerts"
TOKEN_KEY_FILE = "token-key.pem"
ROOT_CERT_FILE = "root-cert.pem"
# With --dir, the objects' status subresource: one file per object (control/status.py).
STATUS_DIR_NAME = "status"


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlPlaneConfig:
    state_dir: Path
    # Exactly one source: a YAML directory (`--dir`), or the API server (`--kube`).
    directory: Path | None = None
    kube: KubeCredentials | None = None
    listen: SocketAddr = SocketAddr.parse(DEFAULT_LISTEN)
    plaintext_listen: SocketAddr | None = None  # istiod's 15010, for tests and trusted networks
    root_ca_dir: Path | None = None
    mesh: MeshSettings = field(default_factory=MeshSettings)
    trusted_node_accounts: frozenset[str] = frozenset({"istio-system/ztunnel"})
    poll_interval_s: float = POLL_INTERVAL_S
    # With `directory`: create what istiod creates for each waypoint Gateway (its ServiceAccount,
    # Deployment and Service, and its status.addresses) as files there (waypoint_deployer.py).
    deploy_waypoints: bool = False
    # istiod's debug endpoint (control/debug.py): connected proxies and object status; None: off.
    debug_listen: SocketAddr | None = None
    # With the API server: deploy waypoint Gateways as istiod does (control/waypoint_kube.py),
    # in this image (default: the control plane pod's own).
    kube_waypoints: bool = True
    waypoint_image: str = ""

    def __post_init__(self) -> None:
        if (self.directory is None) == (self.kube is None):
            raise ConfigError(
                "--dir/--kube", "give exactly one source: a YAML directory (--dir) or the API server (--kube)"
            )


def build_source(config: ControlPlaneConfig, client: KubeClient | None) -> ConfigSource:
    if client is not None:
        return KubeApiSource(client)
    assert config.directory is not None
    return DirectorySource(config.directory, config.poll_interval_s)


def build_status_writer(config: ControlPlaneConfig, client: KubeClient | None) -> StatusWriter:
    """Where conditions go: the API server's status subresources, or beside a YAML directory."""
    if client is not None:
        kinds = (
            AUTHORIZATION_POLICIES,
            PEER_AUTHENTICATIONS,
            SERVICE_ENTRIES,
            GATEWAYS,
            SERVICES,
            HTTP_ROUTES,
        )
        return KubeStatusWriter(client, {r.kind: r for r in kinds})
    return DirectoryStatusWriter(config.state_dir / STATUS_DIR_NAME)


def load_or_create_ca(config: ControlPlaneConfig) -> CertificateAuthority:
    """The operator's plugged-in CA, else ours (created once, in the plugged-in layout)."""
    if config.root_ca_dir is not None:
        return CertificateAuthority.from_plugged_in_dir(config.root_ca_dir)
    ca_dir = config.state_dir / CA_DIR_NAME
    if not (ca_dir / "ca-key.pem").exists():
        ca = CertificateAuthority.self_signed(config.mesh.trust_domain)
        write_plugged_in_files(ca, ca_dir)
        log.info("created a new mesh root CA in %s", ca_dir)
    return CertificateAuthority.from_plugged_in_dir(ca_dir)


def write_plugged_in_files(ca: CertificateAuthority, directory: Path) -> None:
    """Istio's plugged-in CA files for a self-signed root (the root is also the signer)."""
    private_dir(directory)
    cert_pem = ca.signing_cert.public_bytes(serialization.Encoding.PEM)
    key_pem = ca.signing_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    write_private(directory / "ca-key.pem", key_pem)
    (directory / "ca-cert.pem").write_bytes(cert_pem)
    (directory / "root-cert.pem").write_bytes(ca.root_pem)
    (directory / "cert-chain.pem").write_bytes(cert_pem)


class KubeNodeIndex:
    """The CA's view of pods (istiod's node authorizer: a pod lister and a node+sa index),
    kept from each snapshot so a certificate request costs two dictionary lookups. Given the
    keys that changed, an update touches only those pods (a full rebuild is O(pods) per change)."""

    def __init__(self, trust_domain: str) -> None:
        self.trust_domain = trust_domain
        self._pods: dict[tuple[str, str], BoundPod] = {}
        # node -> identity -> how many pods on the node run as it
        self._by_node: dict[str, dict[Identity, int]] = {}

    def __repr__(self) -> str:
        return f"KubeNodeIndex({len(self._pods)} pods on {len(self._by_node)} nodes)"

    def update(self, store: KubeStore, changed: Iterable[ObjectKey] | None = None) -> None:
        """Follow `store`: only the Pods among `changed` (the keys that may differ from the
        previous update), or every pod when None."""
        if changed is None:
            self._pods, self._by_node = {}, {}
            for p in store.pods:
                self._bind(p)
            return
        for kind, namespace, name in changed:
            if kind != "Pod":
                continue
            self._unbind(namespace, name)
            pod = store.get("Pod", namespace, name)
            if isinstance(pod, Pod):
                self._bind(pod)

    def _bind(self, p: Pod) -> None:
        account = p.service_account_name or "default"
        self._pods[(p.metadata.namespace, p.metadata.name)] = BoundPod(
            uid=p.metadata.uid, service_account=account, node_name=p.node_name
        )
        if p.node_name:
            identities = self._by_node.setdefault(p.node_name, {})
            identity = Identity(self.trust_domain, p.metadata.namespace, account)
            identities[identity] = identities.get(identity, 0) + 1

    def _unbind(self, namespace: str, name: str) -> None:
        old = self._pods.pop((namespace, name), None)
        if old is None or not old.node_name:
            return
        identities = self._by_node[old.node_name]
        identity = Identity(self.trust_domain, namespace, old.service_account)
        identities[identity] -= 1
        if not identities[identity]:
            del identities[identity]
            if not identities:
                del self._by_node[old.node_name]

    def bound_pod(self, namespace: str, name: str) -> BoundPod | None:
        return self._pods.get((namespace, name))

    def identities_on_node(self, node: str) -> set[Identity]:
        return set(self._by_node.get(node, ()))


@dataclass(eq=False)
class ControlPlane:
    config: ControlPlaneConfig
    ca: CertificateAuthority
    issuer: TokenIssuer
    load_errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        mesh = self.config.mesh
        # With the API server: its objects, and callers' tokens reviewed by it (istiod's
        # KubeJWTAuthenticator). With a directory (the lab): the tokens we minted ourselves.
        self.kube_client = (
            KubeClient(self.config.kube, user_agent="ambient-control")
            if self.config.kube is not None
            else None
        )
        self.authenticator: Authenticator = (
            TokenReviewAuthenticator(self.kube_client)
            if self.kube_client is not None
            else self.issuer.verifier()
        )
        self.node_index = KubeNodeIndex(mesh.trust_domain)
        # Waypoints' Envoys are served from the same Addresses (waypoint_index.py).
        self.ads = AdsServer(authenticate=self._authenticate, waypoints=WaypointIndex(mesh))
        # Translated incrementally: a change re-translates only what it affects (index.py).
        self.index = AmbientIndex(mesh)
        self._translation: Translation | None = None
        self._notes_logged: frozenset[str] = frozenset()
        self.ca_server = CaServer(
            self.ca,
            self.authenticator,
            trust_domain=mesh.trust_domain,
            node_index=self.node_index,
            trusted_node_accounts=self.config.trusted_node_accounts,
            cluster_id=mesh.cluster_id,
            # Our own tokens are checked in microseconds, before a CSR is read; a TokenReview
            # is a call to the API server, made once per request by the servicer.
            precheck_in_full=self.kube_client is None,
        )
        self.source = build_source(self.config, self.kube_client)
        # Object status (istiod's status queue): computed per snapshot, written when it changes.
        self.status_writer = build_status_writer(self.config, self.kube_client)
        self.status: StatusMap = {}
        self._status_pending: StatusMap = {}
        self._status_task: asyncio.Task[None] | None = None
        self.debug: DebugServer | None = None
        # istiod's namespace controller: the root bundle as a ConfigMap in every namespace.
        self.namespace_controller = (
            NamespaceController(self.kube_client, self.ca.root_pem.decode())
            if self.kube_client is not None
            else None
        )
        self._namespace_task: asyncio.Task[None] | None = None
        # istiod's waypoint deployment controller (made in start(): it reads its own pod first).
        self.waypoint_deployer: KubeWaypointDeployer | None = None
        self._deployer_task: asyncio.Task[None] | None = None
        self.server: grpc.aio.Server | None = None  # TLS: xDS and the CA
        self.plaintext_server: grpc.aio.Server | None = None  # xDS only (--plaintext-listen)
        self.gate: CallerGate | None = None
        self.bound: dict[str, SocketAddr] = {}
        self._watch_task: asyncio.Task[None] | None = None
        self.loaded = asyncio.Event()

    def __repr__(self) -> str:
        t = self.translation
        counts = (
            f"{len(t.addresses)} addresses, {len(t.authorizations)} authorizations" if t else "nothing loaded"
        )
        return f"ControlPlane({self.source.location}: {counts}; {self.ads!r})"

    @property
    def translation(self) -> Translation | None:
        """The whole current translation (None before the first load); a new object per change."""
        if self._translation is None and self.loaded.is_set():
            self._translation = self.index.translation()
        return self._translation

    # Authentication of xDS callers ------------------------------------------------------
    async def _authenticate(self, metadata: Mapping[str, str]) -> Authenticated | Unauthenticated:
        items = list(metadata.items())
        caller = await self.ca_server.authenticate(items, time.time())
        if isinstance(caller, Refusal):
            return Unauthenticated(reason=caller.reason)
        return Authenticated(identities=(str(caller.identity(self.config.mesh.trust_domain)),))

    # Configuration updates --------------------------------------------------------------
    def _on_change(self, change: SourceChange) -> None:
        # Unchanged objects keep their identity in both sources' caches, so comparing the whole
        # snapshot with the index's objects costs a dict lookup per object.
        self.apply(change.store, [str(e) for e in change.errors], change.summary)

    def apply(
        self,
        store: KubeStore,
        errors: Iterable[str] = (),
        summary: str = "",
        *,
        changed: Iterable[ObjectKey] | None = None,
    ) -> None:
        """Serve the translation of `store`. `changed` names the keys that may differ from the
        previous call; without it every object is compared (by identity first)."""
        self.load_errors = list(errors)
        for error in self.load_errors:
            log.warning("skipped: %s", error)
        delta = self.index.update(store, changed)
        controller = self.namespace_controller
        if controller is not None and (
            not self.loaded.is_set() or any(kind == "Namespace" for kind, _, _ in delta.objects)
        ):
            controller.set_namespaces(ns.metadata.name for ns in store.namespaces)
        deployer = self.waypoint_deployer
        if deployer is not None and (
            not self.loaded.is_set() or any(kind == "Gateway" for kind, _, _ in delta.objects)
        ):
            deployer.set_gateways(store.gateways)
        # The index and the node index follow the same snapshots, so its changed keys are theirs.
        self.node_index.update(store, delta.objects)
        notes = frozenset(self.index.notes)
        for note in sorted(notes - self._notes_logged):
            log.info("note: %s", note)
        self._notes_logged = notes
        self._translation = None
        if self.config.deploy_waypoints and self.config.directory is not None:
            self._deploy_waypoints(store)
        if self.ads.waypoints is not None:  # part 2 hook: routes and L7 policy of waypoints
            self.ads.waypoints.update_l7(store, changed)
        # No condition depends on pods (most of the churn): recomputed only when what it reads changed.
        if not self.loaded.is_set() or any(kind in STATUS_INPUT_KINDS for kind, _, _ in delta.objects):
            self._queue_status(compute_status(store, self.config.mesh))
        queued = self.ads.apply(
            addresses=delta.addresses,
            removed_addresses=delta.removed_addresses,
            authorizations=delta.authorizations,
            removed_authorizations=delta.removed_authorizations,
        )
        log.info(
            "loaded %s: %r; %s; %r; %d pushes queued",
            self.source.location,
            self.index,
            summary or "initial load",
            delta,
            queued,
        )
        self.loaded.set()

    def _deploy_waypoints(self, store: KubeStore) -> None:
        directory = self.config.directory
        assert directory is not None
        mesh = self.config.mesh
        settings = DeploySettings(
            image=self.config.waypoint_image or DEFAULT_IMAGE,
            trust_domain=mesh.trust_domain,
            cluster_id=mesh.cluster_id,
            domain_suffix=mesh.domain_suffix,
            root_namespace=mesh.root_namespace,
        )
        deploy = plan_waypoints(store, read_current(directory), settings)
        if deploy:
            # The writes come back as the next directory change, as an API server's watch would.
            for line in apply_plan(directory, deploy):
                log.info("waypoint deployment: %s", line)

    def _queue_status(self, status: StatusMap) -> None:
        changes = changed_status(self.status, status)
        self.status = status
        if not changes:
            return
        self._status_pending.update(changes)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # applied outside a loop (tests): written with the next change made inside one
        if self._status_task is None or self._status_task.done():
            self._status_task = loop.create_task(self._write_status(), name="status writer")

    async def _write_status(self) -> None:
        while self._status_pending:
            changes, self._status_pending = self._status_pending, {}
            try:
                written = await self.status_writer.write(changes, datetime.now(UTC))
            except OSError as exc:
                log.warning("cannot write object status: %s", exc)
                continue
            log.info("status: %d objects written (%r)", written, self.status_writer)

    async def wait_status(self) -> None:
        """Until the status of the last snapshot is written (tests, `lab apply`)."""
        while self._status_task is not None and not self._status_task.done():
            await asyncio.shield(self._status_task)

    # Lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        now = datetime.now(UTC)
        cert = serving_certificate(
            self.ca,
            list(DEFAULT_SERVING_DNS_NAMES),
            list(DEFAULT_SERVING_IPS),
            SERVING_CERT_TTL_S,
            now,
            trust_domain=self.config.mesh.trust_domain,
        )
        gate = CallerGate(self.ca_server.precheck)
        self.gate = gate
        self.server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=(gate,))
        self.ads.serve(self.server)
        self.ca_server.register(self.server)
        port = self.server.add_secure_port(str(self.config.listen), server_credentials(cert))
        if port == 0:
            raise ConfigError(
                "--listen",
                f"cannot bind {self.config.listen}",
                hint="is another control plane (or istiod) already listening there?",
            )
        self.bound["tls"] = SocketAddr(self.config.listen.ip, port)
        if self.config.plaintext_listen is not None:
            # istiod's 15010 serves xDS only: the CA is on the TLS port alone, so a bearer token
            # never crosses the network in clear text. A server of its own, without the CA.
            self.plaintext_server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=(gate,))
            self.ads.serve(self.plaintext_server)
            port = self.plaintext_server.add_insecure_port(str(self.config.plaintext_listen))
            if port == 0:
                raise ConfigError("--plaintext-listen", f"cannot bind {self.config.plaintext_listen}")
            self.bound["plaintext"] = SocketAddr(self.config.plaintext_listen.ip, port)
            await self.plaintext_server.start()
        await self.server.start()
        await self._start_debug()
        await self._start_waypoint_deployer()
        try:
            self._on_change(await self.source.first())
        except BaseException:
            await self.stop(0)
            raise
        self._watch_task = asyncio.get_running_loop().create_task(
            self.source.run(self._on_change), name=f"source {self.source.location}"
        )
        if self.namespace_controller is not None:
            self._namespace_task = asyncio.get_running_loop().create_task(
                self.namespace_controller.run(), name="namespace controller"
            )

    async def _start_waypoint_deployer(self) -> None:
        if self.kube_client is None or not self.config.kube_waypoints:
            return
        import os

        mesh = self.config.mesh
        try:
            settings = await deploy_settings(
                self.kube_client,
                image=self.config.waypoint_image,
                pod_name=os.environ.get("POD_NAME", ""),
                pod_namespace=os.environ.get("POD_NAMESPACE", ""),
                trust_domain=mesh.trust_domain,
                cluster_id=mesh.cluster_id,
                domain_suffix=mesh.domain_suffix,
                root_namespace=mesh.root_namespace,
            )
        except KubeApiError as exc:
            log.warning("waypoints will not be deployed: %s%s", exc, f" ({exc.hint})" if exc.hint else "")
            return
        self.waypoint_deployer = KubeWaypointDeployer(self.kube_client, settings)
        self._deployer_task = asyncio.get_running_loop().create_task(
            self.waypoint_deployer.run(), name="waypoint deployer (API server)"
        )
        log.info("deploying waypoints with image %s", settings.image)

    async def _start_debug(self) -> None:
        if self.config.debug_listen is None:
            return
        debug = DebugServer(
            self.config.debug_listen,
            lambda: connections_doc(self.ads.connections(), self.ads.snapshot.version),
            lambda: status_doc(self.status),
        )
        try:
            await debug.start()
        except (BindError, OSError) as exc:  # the debug endpoint is optional, serving is not
            log.warning("debug endpoint not served: %s", exc)
            return
        self.debug = debug
        self.bound["debug"] = debug.bound_address

    async def stop(self, grace_s: float = 1.0) -> None:
        for task in (self._watch_task, self._namespace_task, self._status_task, self._deployer_task):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        for server in (self.server, self.plaintext_server):
            if server is not None:
                await server.stop(grace_s)
        if self.debug is not None:
            await self.debug.stop()
        await self.source.close()
        if self.kube_client is not None:
            await self.kube_client.close()


def build(config: ControlPlaneConfig) -> ControlPlane:
    # The CA's key and the token signing key live here: root's alone (0700), checked every start.
    private_dir(config.state_dir)
    ca = load_or_create_ca(config)
    (config.state_dir / ROOT_CERT_FILE).write_bytes(ca.root_pem)
    issuer = load_or_create_issuer(config.state_dir / TOKEN_KEY_FILE)
    return ControlPlane(config=config, ca=ca, issuer=issuer)


def mint_token(
    state_dir: Path,
    *,
    account: tuple[str, str],
    node: str | None,
    pod: str | None = None,
    uid: str | None = None,
    ttl_s: int = 24 * 3600,
) -> str:
    """`ambient control token`: a JWT the control plane at `state_dir` accepts."""
    issuer = load_or_create_issuer(state_dir / TOKEN_KEY_FILE)
    namespace, service_account = account
    return issuer.mint(
        namespace=namespace,
        service_account=service_account,
        node=node,
        pod_name=pod,
        pod_uid=uid,
        ttl_s=ttl_s,
        now=time.time(),
    )


STATUS_INTERVAL_S = 2.0


Rows = list[tuple[str, ...]]


def status_table(plane: ControlPlane) -> tuple[str, tuple[str, ...], Rows]:
    """What each connected proxy has been sent: one row per proxy and type."""
    headers = ("NODE", "PROXY", "IDENTITY", "TYPE", "MODE", "SENT", "ACKED", "NACKED", "SYNC", "LAST ERROR")
    rows: Rows = []
    for info in plane.ads.connections():
        for t in info.types:
            rows.append(
                (
                    info.node_name or "-",
                    info.node_id.split("~")[2] if "~" in info.node_id else info.node_id,
                    info.identity or "-",
                    t.type_url.rsplit(".", 1)[-1],
                    t.mode.value,
                    str(t.resources_sent),
                    str(t.resources_acked),
                    str(t.resources_nacked),
                    sync_state(t),
                    t.last_error or "",
                )
            )
    return "connected node proxies", headers, rows


def loaded_table(plane: ControlPlane) -> tuple[str, tuple[str, ...], Rows]:
    rows: Rows = []
    t = plane.translation
    if t is not None:
        workloads = sum(1 for a in t.addresses.values() if a.WhichOneof("type") == "workload")
        rows.append(("workloads (istio.workload.Address)", str(workloads)))
        rows.append(("services (istio.workload.Address)", str(len(t.addresses) - workloads)))
        rows.append(("authorizations (istio.security.Authorization)", str(len(t.authorizations))))
    rows.append(("objects skipped with errors", str(len(plane.load_errors))))
    return f"loaded from {plane.source.location}", ("RESOURCE", "COUNT"), rows


def print_table(console: Console, title: str, headers: tuple[str, ...], rows: Rows) -> None:
    """A rich table on a terminal; into a file (a log), plain whole lines: the title, then
    space-aligned columns, never cut or boxed (the README's promise for every table we print)."""
    if console.is_terminal:
        from rich.table import Table

        table = Table(title=title, title_justify="left")
        for header in headers:
            table.add_column(header)
        for row in rows:
            table.add_row(*row)
        console.print(table)
        return
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows, strict=True)]
    lines = [title] + [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in (headers, *rows)
    ]
    console.file.write("\n".join(lines) + "\n")
    console.file.flush()


def freeze_loaded_state() -> None:
    """Move every object alive after the first load (the parsed objects, the translation, the
    Envoy snapshots: most of the heap, and long-lived) out of the cyclic garbage collector's
    reach (`gc.freeze`). A full collection otherwise walks all of them and lands inside one
    change's rebuild: with 1,000 HTTPRoutes it was the only reason a change took over 100 ms of CPU
    (bench/l7_control_bench.py runs both ways). Objects freed later by their reference count are
    freed as before; a reference cycle among the frozen objects, once dropped, is not collected
    (the price: the parsed objects and snapshots are trees of values, so few such cycles exist)."""
    gc.collect()
    gc.freeze()


async def run(config: ControlPlaneConfig, *, console: Console | None = None) -> int:
    """Serve until SIGTERM/SIGINT, printing what was loaded and what each proxy was sent."""
    import signal

    from rich.console import Console

    console = console or Console()
    plane = build(config)
    await plane.start()
    freeze_loaded_state()  # the process's own heap: not done by start(), which tests embed
    console.print(
        f"ambient control: serving xDS and CA on {plane.bound['tls']} (TLS)"
        + (f" and {plane.bound['plaintext']} (plaintext)" if "plaintext" in plane.bound else "")
        + f"; mesh root {config.state_dir / ROOT_CERT_FILE}"
        + (
            f"; debug endpoint http://{plane.bound['debug']}/debug/connections"
            if "debug" in plane.bound
            else ""
        ),
        soft_wrap=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    shown: tuple[object, ...] = ()
    try:
        while not stop.is_set():
            view = (id(plane.translation), tuple((c.conn_id, c.types) for c in plane.ads.connections()))
            if view != shown:
                shown = view
                print_table(console, *loaded_table(plane))
                print_table(console, *status_table(plane))
            try:
                await asyncio.wait_for(stop.wait(), STATUS_INTERVAL_S)
            except TimeoutError:
                pass
    finally:
        await plane.stop()
    return 0
