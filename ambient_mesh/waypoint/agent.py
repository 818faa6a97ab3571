"""`ambient waypoint`: the waypoint pod's agent, with Envoy as its child.

Counterpart: pilot-agent in `proxy waypoint` mode (pkg/istio-agent/agent.go): it checks and
starts Envoy with a bootstrap that points ADS and SDS at two unix sockets it serves, proxies
ADS to the control plane (xds_proxy.py), fetches the waypoint's certificate from the CA with the
pod's token and serves it over SDS (sds.py), re-serving each renewed certificate, and answers
readiness on 15021 (`/healthz/ready`: a certificate is held and Envoy's admin says LIVE, which
Envoy reaches only after its first clusters and listeners arrived).

Ends when Envoy ends (its exit status is the agent's failure) or on SIGTERM/SIGINT, stopping
Envoy first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from dataclasses import dataclass
from pathlib import Path

import grpc

from ..config import AuthKind, AuthToken, RootCert, RootCertKind, ZtunnelConfig
from ..errors import AmbientError, ConfigError, IdentityError
from ..identity.caclient import GrpcCaClient
from ..identity.manager import SecretManager
from ..identity.spiffe import Identity
from ..net import SocketAddr
from ..ports import READINESS_PORT, STATS_PORT
from .bootstrap import BootstrapParams, bootstrap
from .envoy import EnvoyChild, check_version, envoy_argv, find_envoy
from .sds import SDS_SERVER_OPTIONS, SdsServer, SecretSet
from .telemetry import (
    ALS_SERVER_OPTIONS,
    AccessLogReceiver,
    HttpMetrics,
    WorkloadWatch,
    envoy_prometheus,
    serve_metrics,
)
from .xds_proxy import XDS_SERVER_OPTIONS, XdsProxy

log = logging.getLogger("ambient_mesh.waypoint")

# How often the agent asks its SecretManager for the current certificate: a renewal is served
# within this long (the manager renews at half-life, hours ahead of expiry).
CERT_POLL_INTERVAL_S = 1.0
READINESS_REQUEST_MAX_BYTES = 8 * 1024
READINESS_READ_TIMEOUT_S = 5.0
ADMIN_TIMEOUT_S = 2.0
ADMIN_RESPONSE_MAX_BYTES = 64 * 1024
# sun_path holds 108 bytes; the longest socket name below is `admin.sock`.
MAX_RUN_DIR_CHARS = 90


@dataclass(frozen=True, slots=True, kw_only=True)
class WaypointAgentConfig:
    pod_name: str
    namespace: str
    pod_ip: str
    gateway_name: str
    service_account: str
    xds_address: str
    ca_address: str
    root_cert: Path
    token_file: Path | None
    run_dir: Path
    trust_domain: str = "cluster.local"
    domain_suffix: str = "cluster.local"
    cluster_id: str = "Kubernetes"
    # The name checked in the control plane's certificate when the address is an IP (the lab's
    # ALT_XDS_HOSTNAME / ALT_CA_HOSTNAME).
    alt_hostname: str | None = None
    readiness_listen: SocketAddr = SocketAddr.of("0.0.0.0", READINESS_PORT)
    envoy: str | None = None
    concurrency: int = 2
    envoy_log_level: str = "warning"
    secret_ttl_s: float = 24 * 3600.0

    def __post_init__(self) -> None:
        for name in ("pod_name", "namespace", "pod_ip", "gateway_name", "service_account"):
            if not getattr(self, name):
                raise ConfigError(f"--{name.replace('_', '-')}", "is required (or its environment variable)")
        if len(str(self.run_dir)) > MAX_RUN_DIR_CHARS:
            raise ConfigError("--run-dir", f"{self.run_dir} is too long for a unix socket path")

    @property
    def identity(self) -> Identity:
        return Identity(self.trust_domain, self.namespace, self.service_account)


class WaypointAgent:
    def __init__(self, config: WaypointAgentConfig) -> None:
        self.config = config
        run = config.run_dir
        self.xds_socket = run / "xds.sock"
        self.sds_socket = run / "sds.sock"
        self.admin_socket = run / "admin.sock"
        self.als_socket = run / "als.sock"
        self.bootstrap_path = run / "envoy-bootstrap.json"
        self.envoy_log = run / "envoy.log"
        self.sds = SdsServer()
        ca_config = ZtunnelConfig(
            ca_address=config.ca_address,
            ca_root_ca=RootCert(kind=RootCertKind.FILE, value=str(config.root_cert)),
            auth_token=(
                AuthToken(kind=AuthKind.TOKEN_FILE, value=str(config.token_file))
                if config.token_file is not None
                else AuthToken(kind=AuthKind.NONE)
            ),
            cluster_id=config.cluster_id,
            alt_ca_hostname=config.alt_hostname,
            trust_domain=config.trust_domain,
            secret_ttl_s=config.secret_ttl_s,
        )
        self.ca = GrpcCaClient(ca_config, shared_mode=False)
        self.secrets = SecretManager(self.ca)
        self.xds = XdsProxy(
            config.xds_address,
            root_pem=self._read_root,
            token=self._read_token,
            cluster_id=config.cluster_id,
            alt_hostname=config.alt_hostname,
        )
        self.envoy: EnvoyChild | None = None
        self._servers: list[grpc.aio.Server] = []
        # Part 2 hook: Istio's HTTP metrics (telemetry.py), served on 15020 with Envoy's own.
        self.workloads = WorkloadWatch.for_pod(
            xds_address=config.xds_address,
            root_cert=str(config.root_cert),
            token_file=str(config.token_file) if config.token_file is not None else None,
            pod_name=config.pod_name,
            namespace=config.namespace,
            pod_ip=config.pod_ip,
            cluster_id=config.cluster_id,
            trust_domain=config.trust_domain,
            alt_hostname=config.alt_hostname,
        )
        self.metrics = HttpMetrics(self.workloads.state, trust_domain=config.trust_domain)
        self._metrics_server: asyncio.Server | None = None

    def __repr__(self) -> str:
        return f"WaypointAgent({self.config.namespace}/{self.config.gateway_name}: {self.envoy!r}, {self.sds!r}, {self.xds!r})"

    def _read_root(self) -> bytes | None:
        try:
            return self.config.root_cert.read_bytes()
        except OSError as e:
            raise IdentityError(
                f"cannot read the mesh root {self.config.root_cert}: {e.strerror or e}"
            ) from e

    def _read_token(self) -> str | None:
        if self.config.token_file is None:
            return None
        try:
            return self.config.token_file.read_text().strip()
        except OSError as e:
            raise IdentityError(
                f"cannot read the pod token {self.config.token_file}: {e.strerror or e}"
            ) from e

    # -- readiness --------------------------------------------------------------------------------

    async def envoy_live(self) -> bool:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(str(self.admin_socket)), ADMIN_TIMEOUT_S
            )
        except (OSError, TimeoutError):
            return False
        try:
            writer.write(b"GET /ready HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n")
            await writer.drain()
            data = await asyncio.wait_for(reader.read(ADMIN_RESPONSE_MAX_BYTES), ADMIN_TIMEOUT_S)
        except (OSError, TimeoutError):
            return False
        finally:
            writer.close()
        return data.startswith(b"HTTP/1.1 200")

    async def ready(self) -> tuple[bool, str]:
        if self.sds.secrets is None:
            return False, "no certificate yet"
        if self.envoy is None or self.envoy.process is None or self.envoy.process.returncode is not None:
            return False, "Envoy is not running"
        if not await self.envoy_live():
            return False, "Envoy is not LIVE (waiting for its first listeners and clusters)"
        return True, "ready"

    async def _readiness(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READINESS_READ_TIMEOUT_S)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, OSError):
            writer.close()
            return
        parts = head.split(b"\r\n", 1)[0].split()
        path = parts[1].decode(errors="replace") if len(parts) >= 2 else ""
        if path == "/healthz/ready":
            ok, why = await self.ready()
            status = "200 OK" if ok else "503 Service Unavailable"
            body = (why + "\n").encode()
        else:
            status, body = "404 Not Found", b"not found\n"
        writer.write(
            f"HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n".encode()
            + body
        )
        with contextlib.suppress(OSError):
            await writer.drain()
        writer.close()

    # -- certificates -----------------------------------------------------------------------------

    async def _certificates(self) -> None:
        """Serve the current certificate; a renewal is pushed to Envoy as a new SDS version."""
        while True:
            try:
                cert = await self.secrets.fetch_certificate(self.config.identity)
            except IdentityError as e:
                log.warning("no certificate for %s: %s", self.config.identity, e)
            else:
                before = self.sds.secrets
                self.sds.update(SecretSet.from_certificate(cert))
                if self.sds.secrets is not before:
                    log.info("serving certificate %s (valid until %s)", cert.serial_number, cert.not_after)
            await asyncio.sleep(CERT_POLL_INTERVAL_S)

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Check Envoy, serve the sockets and readiness, start Envoy. Errors before anything runs."""
        binary = find_envoy(self.config.envoy)
        version = check_version(binary)
        log.info("Envoy %s at %s", ".".join(map(str, version)), binary)
        self.config.run_dir.mkdir(parents=True, exist_ok=True)
        for sock in (self.xds_socket, self.sds_socket, self.admin_socket, self.als_socket):
            sock.unlink(missing_ok=True)
        xds_server = grpc.aio.server(options=XDS_SERVER_OPTIONS)
        self.xds.serve(xds_server)
        xds_server.add_insecure_port(f"unix:{self.xds_socket}")
        sds_server = grpc.aio.server(options=SDS_SERVER_OPTIONS)
        self.sds.serve(sds_server)
        sds_server.add_insecure_port(f"unix:{self.sds_socket}")
        als_server = grpc.aio.server(options=ALS_SERVER_OPTIONS)
        AccessLogReceiver(self.metrics).serve(als_server)
        als_server.add_insecure_port(f"unix:{self.als_socket}")
        for server in (xds_server, sds_server, als_server):
            await server.start()
            self._servers.append(server)
        # Only the pod's own processes reach the sockets.
        for sock in (self.xds_socket, self.sds_socket, self.als_socket):
            sock.chmod(0o600)
        self.workloads.start()
        self._metrics_server = await serve_metrics(
            str(self.config.readiness_listen.ip),
            STATS_PORT,
            self.metrics.render,
            lambda: envoy_prometheus(str(self.admin_socket)),
        )
        c = self.config
        params = BootstrapParams(
            pod_name=c.pod_name,
            namespace=c.namespace,
            pod_ip=c.pod_ip,
            gateway_name=c.gateway_name,
            domain_suffix=c.domain_suffix,
            cluster_id=c.cluster_id,
            service_account=c.service_account,
            xds_socket=self.xds_socket,
            sds_socket=self.sds_socket,
            admin_socket=self.admin_socket,
            als_socket=self.als_socket,
        )
        self.bootstrap_path.write_text(json.dumps(bootstrap(params), indent=1))
        self.envoy = EnvoyChild(
            envoy_argv(
                binary,
                self.bootstrap_path,
                concurrency=c.concurrency,
                log_level=c.envoy_log_level,
                log_path=self.envoy_log,
            )
        )
        await self.envoy.start()
        log.info("Envoy started (%r), node %s", self.envoy, params.node_id)

    async def run(self) -> int:
        """Run until Envoy exits or a signal arrives; returns the exit status."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        try:
            await self.start()
            readiness = await asyncio.start_server(
                self._readiness,
                str(self.config.readiness_listen.ip),
                self.config.readiness_listen.port,
                limit=READINESS_REQUEST_MAX_BYTES,
            )
            async with readiness:
                certs = asyncio.create_task(self._certificates())
                assert self.envoy is not None
                envoy_done = asyncio.create_task(self.envoy.wait())
                stopped = asyncio.create_task(stop.wait())
                await asyncio.wait({envoy_done, stopped}, return_when=asyncio.FIRST_COMPLETED)
                certs.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await certs
                stopped.cancel()
                if envoy_done.done():
                    code = envoy_done.result()
                    log.error("Envoy exited with status %s; see %s", code, self.envoy_log)
                    return 1
                envoy_done.cancel()
                return 0
        finally:
            await self.close()

    async def close(self) -> None:
        if self.envoy is not None:
            await self.envoy.stop()
        if self._metrics_server is not None:
            self._metrics_server.close()
            self._metrics_server = None
        await self.workloads.close()
        for server in self._servers:
            await server.stop(grace=1.0)
        self._servers.clear()
        await self.xds.close()
        await self.secrets.close()
        with contextlib.suppress(AmbientError, OSError):
            await self.ca.close()
