"""The node proxy's configuration: one frozen object built once from the environment.

Counterpart: ztunnel src/config.rs (`Config`, `construct_config`). The variables, their
defaults and their validation follow ztunnel (docs/istio-behaviour.md, "Configuration"); every bad value
raises ConfigError whose `source` is the variable's name and whose message lists the accepted
forms.

ambient-mesh extensions (ztunnel has no variables for its listener addresses):

- `OUTBOUND_ADDR` (default `[::]:15001`), `INBOUND_ADDR` (`[::]:15008`),
  `INBOUND_PLAINTEXT_ADDR` (`[::]:15006`), `SOCKS5_ADDR` (`127.0.0.1:15080`),
  `ADMIN_ADDR` (`127.0.0.1:15000`, must be a loopback address), `STATS_ADDR` (`[::]:15020`),
  `READINESS_ADDR` (`[::]:15021`). Each is `ip:port` or `[ipv6]:port`; port 0 asks the kernel
  for a free port (tests use it). With IPv6 disabled the `[::]` defaults become `0.0.0.0`.
- `ROOT_CA_DIR`: an Istio plugged-in CA directory (ca-cert.pem, ca-key.pem, root-cert.pem,
  cert-chain.pem) for the embedded CA.

`ZTUNNEL_WORKER_THREADS` (ztunnel's grammar: a count, `N%` of the CPUs we may run on, or `0` for
all of them) is the number of worker processes (ambient_mesh/workers/); our default is 1, not
ztunnel's 2 (see DEFAULT_WORKER_THREADS).

Not supported (ztunnel features we do not have): the CPU-limit variables, PROXY_CONFIG and the
mesh config file, COMPLIANCE_POLICY. `log_startup` names every
one that is set in one warning at start, then logs the effective configuration as YAML, as
ztunnel logs its config at start.

Values are read with env.py's `EnvReader`, the one reader (and one Go duration grammar) the node
agent's configuration uses too; `from_env` reads ztunnel's variables in sections, one function
per group.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any
from urllib.parse import urlsplit

import yaml

from .env import EnvReader, format_duration
from .env import parse_duration as parse_duration  # re-exported: callers parse durations here
from .errors import ConfigError, ProtocolError
from .logs import parse_level_spec
from .net import IPAddress, SocketAddr, ip_address
from .ports import (
    ADMIN_PORT,
    DNS_CAPTURE_PORT,
    HBONE_PORT,
    INBOUND_PLAINTEXT_PORT,
    OUTBOUND_PORT,
    READINESS_PORT,
    SOCKS5_PORT,
    STATS_PORT,
    XDS_CA_PORT,
)

log = logging.getLogger("ambient_mesh.config")

KIB = 1024
MIB = 1024 * KIB

DEFAULT_LOCAL_ISTIOD = f"https://localhost:{XDS_CA_PORT}"
DEFAULT_CLUSTER_ISTIOD = f"https://istiod.istio-system.svc:{XDS_CA_PORT}"
DEFAULT_ROOT_CERT_PATH = "./var/run/secrets/istio/root-cert.pem"
DEFAULT_TOKEN_PATH = "./var/run/secrets/tokens/istio-token"
DEFAULT_INPOD_UDS = "/var/run/ztunnel/ztunnel.sock"
DEFAULT_CLUSTER_ID = "Kubernetes"
DEFAULT_CLUSTER_DOMAIN = "cluster.local"
DEFAULT_TRUST_DOMAIN = "cluster.local"
DEFAULT_INSTANCE_IP = "1.1.1.1"
DEFAULT_SECRET_TTL_S = 24 * 3600.0
DEFAULT_POOL_MAX_STREAMS_PER_CONNECTION = 100
DEFAULT_POOL_UNUSED_RELEASE_TIMEOUT_S = 5 * 60.0
DEFAULT_HTTP2_STREAM_WINDOW_BYTES = 4 * MIB
# 4x the stream window, so that one stalled stream cannot starve the others (ztunnel's choice).
DEFAULT_HTTP2_CONNECTION_WINDOW_BYTES = 16 * MIB
DEFAULT_HTTP2_FRAME_BYTES = 1 * MIB
DEFAULT_KEEPALIVE_TIME_S = 180.0
DEFAULT_KEEPALIVE_INTERVAL_S = 180.0
DEFAULT_KEEPALIVE_RETRIES = 9
# 0x539: the mark istio-cni's rules use to let the proxy's own traffic through unredirected.
DEFAULT_PACKET_MARK = 1337
DEFAULT_TERMINATION_DEADLINE_S = 5.0
# ZTUNNEL_WORKER_THREADS: ztunnel's default is 2 threads sharing one state in memory. Ours are
# processes (one Python interpreter cannot run two event loops on two cores), each with its own
# copy of the state, its own interpreter's memory and a start-up of about a second, and more
# than one pays only where a second core is free for the proxy. So 1 stays our default: the
# single-process path, no extra hop; set 2 (or more) where the proxy has the cores.
DEFAULT_WORKER_THREADS = 1
MAX_WORKER_THREADS = 64  # a bound on what a typo ("1000") can spawn

# RFC 9113 6.5.2: SETTINGS_MAX_FRAME_SIZE must lie in [2^14, 2^24 - 1]; windows are at most 2^31 - 1.
MIN_HTTP2_FRAME_BYTES = 2**14
MAX_HTTP2_FRAME_BYTES = 2**24 - 1
MAX_HTTP2_WINDOW_BYTES = 2**31 - 1
MAX_U32 = 2**32 - 1

IPV6_LO_DISABLE_PATH = "/proc/sys/net/ipv6/conf/lo/disable_ipv6"

ISTIO_META_PREFIX = "ISTIO_META_"
ISTIO_METAJSON_PREFIX = "ISTIO_METAJSON_"
XDS_HEADER_PREFIX = "XDS_HEADER_"
CA_HEADER_PREFIX = "CA_HEADER_"


class ProxyMode(enum.Enum):
    SHARED = "shared"
    DEDICATED = "dedicated"


@dataclass(frozen=True, slots=True, kw_only=True)
class ProxyWorkloadInfo:
    """The one workload a dedicated-mode proxy serves (PROXY_WORKLOAD_INFO=ns/name/sa)."""

    namespace: str
    name: str
    service_account: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}/{self.service_account}"


class RootCertKind(enum.Enum):
    FILE = "file"
    SYSTEM = "system"  # the operating system's trust store
    STATIC = "static"  # PEM given inline in the variable


@dataclass(frozen=True, slots=True, kw_only=True)
class RootCert:
    """Where the trust anchors for istiod's TLS certificate come from (XDS_ROOT_CA / CA_ROOT_CA)."""

    kind: RootCertKind
    value: str = ""

    def to_dump(self) -> dict[str, str]:
        return {self.kind.value: self.value} if self.kind is not RootCertKind.SYSTEM else {"system": ""}


class AuthKind(enum.Enum):
    NONE = "none"
    TOKEN_FILE = "tokenFile"  # a JWT file, re-read for every request so rotation is picked up
    STATIC = "static"


@dataclass(frozen=True, slots=True, kw_only=True)
class AuthToken:
    kind: AuthKind
    value: str = field(default="", repr=False)

    def to_dump(self) -> dict[str, str] | None:
        if self.kind is AuthKind.NONE:
            return None
        # A static token is a credential: it never goes into /config_dump.
        return {self.kind.value: self.value if self.kind is AuthKind.TOKEN_FILE else "<redacted>"}


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, as a container's cpuset limits it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def read_ipv6_disabled_on_lo() -> bool:
    """True when the kernel has IPv6 off on loopback (or has no IPv6 at all)."""
    try:
        with open(IPV6_LO_DISABLE_PATH) as f:
            return f.read().strip() == "1"
    except OSError:
        return True


# --- value parsers: env.py (EnvReader, one duration grammar shared with the node agent) -------


def _normalize_url(name: str, value: str) -> str:
    url = value.strip()
    if "://" not in url:
        url = "https://" + url
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises ValueError on a bad port
    except ValueError as e:
        raise ConfigError(name, f"{value!r} is not a URL ({e}); use [https://]host:port") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(name, f"{value!r} is not a URL; use [https://]host:port")
    return url


def _root_cert(env: EnvReader, name: str, path_exists: Callable[[str], bool]) -> RootCert:
    value = env.string(name)
    if value is None:
        return RootCert(kind=RootCertKind.FILE, value=DEFAULT_ROOT_CERT_PATH)
    if path_exists(value):
        return RootCert(kind=RootCertKind.FILE, value=value)
    if value == "SYSTEM":
        return RootCert(kind=RootCertKind.SYSTEM)
    if "-----BEGIN CERTIFICATE-----" not in value:
        raise ConfigError(
            name,
            f"{value!r} is neither an existing file, SYSTEM, nor PEM text; "
            "use a path to a PEM file, SYSTEM for the OS trust store, or inline PEM",
        )
    return RootCert(kind=RootCertKind.STATIC, value=value)


def _auth_token(env: EnvReader, path_exists: Callable[[str], bool]) -> AuthToken:
    value = env.string("AUTH_TOKEN")
    if value is None:
        if path_exists(DEFAULT_TOKEN_PATH):
            return AuthToken(kind=AuthKind.TOKEN_FILE, value=DEFAULT_TOKEN_PATH)
        return AuthToken(kind=AuthKind.NONE)
    if path_exists(value):
        return AuthToken(kind=AuthKind.TOKEN_FILE, value=value)
    return AuthToken(kind=AuthKind.STATIC, value=value)


_HEADER_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


def _headers(env: Mapping[str, str], prefix: str) -> dict[str, str]:
    headers: dict[str, str] = {}
    for key in sorted(env):
        if not key.startswith(prefix) or len(key) == len(prefix):
            continue
        # gRPC metadata keys are lower case; env names are usually upper case.
        header = key[len(prefix) :].lower()
        if not _HEADER_NAME.match(header) or header.endswith("-bin"):
            raise ConfigError(
                key, f"{header!r} is not a gRPC metadata key; use letters, digits, '-', '_', '.'"
            )
        headers[header] = env[key]
    return headers


def _workload_info(value: str) -> ProxyWorkloadInfo:
    parts = value.split("/")
    if len(parts) != 3 or not all(parts):
        raise ConfigError("PROXY_WORKLOAD_INFO", f"{value!r} is not namespace/name/serviceaccount")
    return ProxyWorkloadInfo(namespace=parts[0], name=parts[1], service_account=parts[2])


def _termination_deadline(env: EnvReader) -> float:
    deadline = env.optional_duration("CONNECTION_TERMINATION_DEADLINE", allow_zero=True)
    if deadline is not None:
        return deadline
    grace = env.optional_integer("TERMINATION_GRACE_PERIOD_SECONDS", minimum=0, maximum=MAX_U32)
    if grace is None:
        return DEFAULT_TERMINATION_DEADLINE_S
    # Leave the kubelet some of the grace period to deliver SIGKILL after we give up (ztunnel's
    # rule: 5 s off a long grace period, 1 s off a short one, never below 1 s).
    return float(max(1, grace - 5 if grace > 10 else grace - 1))


def _dns_proxy_addr(value: str | None) -> SocketAddr:
    if value is None:
        return SocketAddr.of("127.0.0.1", DNS_CAPTURE_PORT)
    text = value.strip()
    if text.startswith("localhost:"):
        text = "127.0.0.1:" + text[len("localhost:") :]
    try:
        return SocketAddr.parse(text)
    except ProtocolError as e:
        raise ConfigError(
            "ISTIO_META_DNS_PROXY_ADDR", f"{e.message}; use localhost:port or ip:port"
        ) from None


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def _dump_value(value: Any) -> Any:
    if isinstance(value, (RootCert, AuthToken)):
        return value.to_dump()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (SocketAddr, ProxyWorkloadInfo)):
        return str(value)
    if isinstance(value, dict):
        return {k: _dump_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_dump_value(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


# --- the config ---------------------------------------------------------------------------------

# `ZtunnelConfig.illegal_ports`: the proxy's own listener ports (ztunnel's illegal_ports), with
# SOCKS5's when it is enabled.
_ILLEGAL_PORTS = frozenset({OUTBOUND_PORT, INBOUND_PLAINTEXT_PORT, HBONE_PORT})
_ILLEGAL_PORTS_WITH_SOCKS5 = _ILLEGAL_PORTS | {SOCKS5_PORT}


@dataclass(frozen=True, slots=True, kw_only=True)
class ZtunnelConfig:
    """Everything the node proxy reads from its environment. Durations are seconds (`_s`)."""

    proxy_mode: ProxyMode = ProxyMode.SHARED
    proxy_workload_info: ProxyWorkloadInfo | None = None
    enable_proxy: bool = True
    dns_proxy_enabled: bool = True
    dns_proxy_addr: SocketAddr = SocketAddr.of("127.0.0.1", DNS_CAPTURE_PORT)

    xds_address: str | None = DEFAULT_LOCAL_ISTIOD
    ca_address: str | None = DEFAULT_LOCAL_ISTIOD
    fake_ca: bool = False
    root_ca_dir: str | None = None
    local_xds_path: str | None = None
    local_xds: str | None = field(default=None, repr=False)
    xds_on_demand: bool = False
    xds_root_ca: RootCert = RootCert(kind=RootCertKind.FILE, value=DEFAULT_ROOT_CERT_PATH)
    ca_root_ca: RootCert = RootCert(kind=RootCertKind.FILE, value=DEFAULT_ROOT_CERT_PATH)
    alt_xds_hostname: str | None = None
    alt_ca_hostname: str | None = None
    xds_headers: dict[str, str] = field(default_factory=dict)
    ca_headers: dict[str, str] = field(default_factory=dict)
    auth_token: AuthToken = AuthToken(kind=AuthKind.NONE)

    cluster_id: str = DEFAULT_CLUSTER_ID
    cluster_domain: str = DEFAULT_CLUSTER_DOMAIN
    trust_domain: str = DEFAULT_TRUST_DOMAIN
    pod_name: str | None = None
    pod_namespace: str | None = None
    service_account: str | None = None
    instance_ip: IPAddress = ip_address(DEFAULT_INSTANCE_IP)
    node_name: str | None = None
    network: str = ""
    secret_ttl_s: float = DEFAULT_SECRET_TTL_S

    pool_max_streams_per_connection: int = DEFAULT_POOL_MAX_STREAMS_PER_CONNECTION
    pool_unused_release_timeout_s: float = DEFAULT_POOL_UNUSED_RELEASE_TIMEOUT_S
    http2_stream_window_size: int = DEFAULT_HTTP2_STREAM_WINDOW_BYTES
    http2_connection_window_size: int = DEFAULT_HTTP2_CONNECTION_WINDOW_BYTES
    http2_frame_size: int = DEFAULT_HTTP2_FRAME_BYTES
    keepalive_enabled: bool = True
    keepalive_time_s: float = DEFAULT_KEEPALIVE_TIME_S
    keepalive_interval_s: float = DEFAULT_KEEPALIVE_INTERVAL_S
    keepalive_retries: int = DEFAULT_KEEPALIVE_RETRIES
    user_timeout_enabled: bool = False
    packet_mark: int | None = DEFAULT_PACKET_MARK
    inpod_uds: str = DEFAULT_INPOD_UDS
    inpod_port_reuse: bool = True
    enable_orig_src: bool | None = None  # None: try IP_TRANSPARENT and use it if it works
    ipv6_enabled: bool = True
    termination_deadline_s: float = DEFAULT_TERMINATION_DEADLINE_S
    localhost_app_tunnel: bool = True
    enable_response_baggage: bool = True
    prefered_service_namespace: str | None = None
    socks5_enabled: bool = False
    crl_path: str | None = None
    authz_policy_info_logging: bool = False
    tls12_enabled: bool = False
    worker_threads: int = DEFAULT_WORKER_THREADS

    log_format: str = "plain"
    log_level: str = "info"
    istio_meta: dict[str, str] = field(default_factory=dict)
    istio_meta_json: dict[str, Any] = field(default_factory=dict)

    outbound_addr: SocketAddr = SocketAddr.of("::", OUTBOUND_PORT)
    inbound_addr: SocketAddr = SocketAddr.of("::", HBONE_PORT)
    inbound_plaintext_addr: SocketAddr = SocketAddr.of("::", INBOUND_PLAINTEXT_PORT)
    socks5_addr: SocketAddr = SocketAddr.of("127.0.0.1", SOCKS5_PORT)
    admin_addr: SocketAddr = SocketAddr.of("127.0.0.1", ADMIN_PORT)
    stats_addr: SocketAddr = SocketAddr.of("::", STATS_PORT)
    readiness_addr: SocketAddr = SocketAddr.of("::", READINESS_PORT)

    @property
    def illegal_ports(self) -> frozenset[int]:
        """Ports a connection may not target through the proxy itself (loops, trampolines).

        Read per inbound connection: one of two sets made once, not a new set each time."""
        return _ILLEGAL_PORTS_WITH_SOCKS5 if self.socks5_enabled else _ILLEGAL_PORTS

    @property
    def istio_version(self) -> str:
        """The `tag` of the istio_build metric."""
        return self.istio_meta.get("ISTIO_VERSION", "unknown")

    @property
    def self_proxy_enabled(self) -> bool:
        """Shared mode with our own pod known: also serve HBONE as workload `ztunnel` itself."""
        return (
            self.proxy_mode is ProxyMode.SHARED
            and bool(self.pod_name)
            and bool(self.pod_namespace)
            and bool(self.service_account)
        )

    def local_config_source(self) -> tuple[str, str] | None:
        """The local config's text and its name for errors: LOCAL_XDS_PATH's file, read now, else
        LOCAL_XDS; None when neither is set (ztunnel's ConfigSource::read_to_string). The program
        calls this and hands the text to state/ (which reads no files)."""
        if self.local_xds_path:
            try:
                with open(self.local_xds_path, encoding="utf-8") as f:
                    return f.read(), self.local_xds_path
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(self.local_xds_path, f"cannot read local config: {exc}") from None
        if self.local_xds:
            return self.local_xds, "LOCAL_XDS"
        return None

    def to_dump(self) -> dict[str, Any]:
        """The effective config, camelCase and JSON-able, for `/config_dump` under `config`."""
        out: dict[str, Any] = {}
        for f in fields(self):
            name = f.name
            value = getattr(self, name)
            if name.endswith("_s"):
                out[_camel(name[:-2])] = format_duration(value)
            elif name == "local_xds":
                out["localXds"] = None if value is None else "<inline>"
            else:
                out[_camel(name)] = _dump_value(value)
        out["illegalPorts"] = sorted(self.illegal_ports)
        return out

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str],
        *,
        ipv6_disabled_on_lo: Callable[[], bool] = read_ipv6_disabled_on_lo,
        path_exists: Callable[[str], bool] = os.path.exists,
        cpu_count: Callable[[], int] = available_cpus,
    ) -> ZtunnelConfig:
        """Build the config from `env` (normally os.environ); raise ConfigError on any bad value.

        The callables are the only reads outside `env`: whether the kernel has IPv6 off on loopback, whether a
        path names a file (for root certs and the auth token), and how many CPUs we may run on (for
        ZTUNNEL_WORKER_THREADS=0 or N%). Each section below reads one group of ztunnel's variables
        (docs/istio-behaviour.md, "Configuration"), in its order.
        """
        e = EnvReader(env)
        meta = _istio_metadata(env)
        mode = _proxy_mode(e)
        features = _features(e, meta.istio_meta)
        return cls(
            **mode,
            **features,
            **_control_plane(e, env, path_exists, dns_proxy_enabled=features["dns_proxy_enabled"]),
            **_identity_and_node(e, meta.istio_meta),
            **_pool_and_http2(e),
            **_sockets(e, mode["proxy_mode"]),
            **_behaviour(e),
            worker_threads=_worker_threads(e, cpu_count),
            **_logging(e),
            istio_meta=meta.istio_meta,
            istio_meta_json=meta.istio_meta_json,
            **_listeners(e, ipv6_enabled=e.boolean("IPV6_ENABLED", True) and not ipv6_disabled_on_lo()),
        )


# --- from_env's sections: each reads one group of variables and returns ZtunnelConfig fields ------


@dataclass(frozen=True, slots=True, kw_only=True)
class _IstioMetadata:
    istio_meta: dict[str, str]
    istio_meta_json: dict[str, Any]


def _istio_metadata(env: Mapping[str, str]) -> _IstioMetadata:
    """ISTIO_META_<KEY> (text) and ISTIO_METAJSON_<KEY> (JSON), prefixes stripped."""
    istio_meta = {
        k[len(ISTIO_META_PREFIX) :]: v
        for k, v in sorted(env.items())
        if k.startswith(ISTIO_META_PREFIX) and len(k) > len(ISTIO_META_PREFIX)
    }
    istio_meta_json: dict[str, Any] = {}
    for k, v in sorted(env.items()):
        if k.startswith(ISTIO_METAJSON_PREFIX) and len(k) > len(ISTIO_METAJSON_PREFIX):
            try:
                istio_meta_json[k[len(ISTIO_METAJSON_PREFIX) :]] = json.loads(v)
            except ValueError as err:
                raise ConfigError(k, f"not JSON ({err}); use a JSON value") from None
    return _IstioMetadata(istio_meta=istio_meta, istio_meta_json=istio_meta_json)


def _proxy_mode(e: EnvReader) -> dict[str, Any]:
    """PROXY_MODE and, for dedicated mode, the one workload it serves."""
    mode_text = e.string("PROXY_MODE", ProxyMode.SHARED.value)
    try:
        mode = ProxyMode(mode_text)
    except ValueError:
        raise ConfigError(
            "PROXY_MODE", f"{mode_text!r} is not a proxy mode; use shared or dedicated"
        ) from None
    info_text = e.string("PROXY_WORKLOAD_INFO")
    workload_info = _workload_info(info_text) if info_text is not None else None
    if mode is ProxyMode.DEDICATED and workload_info is None:
        raise ConfigError(
            "PROXY_WORKLOAD_INFO",
            "dedicated mode needs the workload it serves; set namespace/name/serviceaccount",
        )
    return {"proxy_mode": mode, "proxy_workload_info": workload_info}


def _features(e: EnvReader, istio_meta: Mapping[str, str]) -> dict[str, Any]:
    """What runs: the proxy (ENABLE_PROXY) and the DNS proxy (ISTIO_META_DNS_CAPTURE)."""
    enable_proxy = e.boolean("ENABLE_PROXY", True)
    # ztunnel's rule: the DNS proxy is on unless DNS_CAPTURE says something other than true.
    dns_capture = istio_meta.get("DNS_CAPTURE")
    dns_proxy_enabled = True if dns_capture is None else dns_capture.strip().lower() == "true"
    if not enable_proxy and not dns_proxy_enabled:
        raise ConfigError(
            "ENABLE_PROXY", "both the proxy and the DNS proxy are disabled; there is nothing to run"
        )
    return {
        "enable_proxy": enable_proxy,
        "dns_proxy_enabled": dns_proxy_enabled,
        "dns_proxy_addr": _dns_proxy_addr(istio_meta.get("DNS_PROXY_ADDR")),
    }


def _control_plane(
    e: EnvReader, env: Mapping[str, str], path_exists: Callable[[str], bool], *, dns_proxy_enabled: bool
) -> dict[str, Any]:
    """Where state and certificates come from: xDS, the CA, local config, their TLS and auth."""
    in_cluster = bool(e.string("KUBERNETES_SERVICE_HOST"))
    default_istiod = DEFAULT_CLUSTER_ISTIOD if in_cluster else DEFAULT_LOCAL_ISTIOD
    xds_raw = e.raw("XDS_ADDRESS")
    if xds_raw is None:
        xds_address: str | None = default_istiod
    elif xds_raw.strip() == "":
        xds_address = None  # explicitly empty: run from local config only
    else:
        xds_address = _normalize_url("XDS_ADDRESS", xds_raw)
    fake_ca = e.boolean("FAKE_CA", False)
    ca_text = e.string("CA_ADDRESS")
    ca_address = None if fake_ca else _normalize_url("CA_ADDRESS", ca_text or default_istiod)
    local_xds_path = e.string("LOCAL_XDS_PATH")
    local_xds = e.string("LOCAL_XDS")
    if local_xds_path is not None and local_xds is not None:
        raise ConfigError("LOCAL_XDS", "cannot be combined with LOCAL_XDS_PATH; set only one of them")
    xds_on_demand = e.boolean("XDS_ON_DEMAND", False)
    if xds_on_demand and dns_proxy_enabled:
        raise ConfigError(
            "XDS_ON_DEMAND",
            "on-demand xDS does not work with the DNS proxy; "
            "set ISTIO_META_DNS_CAPTURE=false or XDS_ON_DEMAND=false",
        )
    return {
        "xds_address": xds_address,
        "ca_address": ca_address,
        "fake_ca": fake_ca,
        "root_ca_dir": e.string("ROOT_CA_DIR"),
        "local_xds_path": local_xds_path,
        "local_xds": local_xds,
        "xds_on_demand": xds_on_demand,
        "xds_root_ca": _root_cert(e, "XDS_ROOT_CA", path_exists),
        "ca_root_ca": _root_cert(e, "CA_ROOT_CA", path_exists),
        "alt_xds_hostname": e.string("ALT_XDS_HOSTNAME"),
        "alt_ca_hostname": e.string("ALT_CA_HOSTNAME"),
        "xds_headers": _headers(env, XDS_HEADER_PREFIX),
        "ca_headers": _headers(env, CA_HEADER_PREFIX),
        "auth_token": _auth_token(e, path_exists),
    }


def _identity_and_node(e: EnvReader, istio_meta: Mapping[str, str]) -> dict[str, Any]:
    """Who this proxy is and where it runs: cluster, trust domain, own pod, node, network."""
    instance_ip_text = e.text("INSTANCE_IP", DEFAULT_INSTANCE_IP)
    try:
        instance_ip = ip_address(instance_ip_text.strip())
    except ValueError:
        raise ConfigError("INSTANCE_IP", f"{instance_ip_text!r} is not an IP address") from None
    return {
        "cluster_id": istio_meta.get("CLUSTER_ID") or e.string("CLUSTER_ID", DEFAULT_CLUSTER_ID),
        "cluster_domain": e.string("CLUSTER_DOMAIN", DEFAULT_CLUSTER_DOMAIN),
        "trust_domain": e.string("TRUST_DOMAIN", DEFAULT_TRUST_DOMAIN),
        "pod_name": e.string("POD_NAME"),
        "pod_namespace": e.string("POD_NAMESPACE"),
        "service_account": e.string("SERVICE_ACCOUNT"),
        "instance_ip": instance_ip,
        "node_name": e.string("NODE_NAME"),
        "network": e.string("NETWORK", "") or "",
        "secret_ttl_s": e.duration("SECRET_TTL", DEFAULT_SECRET_TTL_S),
    }


def _pool_and_http2(e: EnvReader) -> dict[str, Any]:
    """The HBONE connection pool and HTTP/2 settings (windows, frame size)."""
    return {
        "pool_max_streams_per_connection": e.integer(
            "POOL_MAX_STREAMS_PER_CONNECTION",
            DEFAULT_POOL_MAX_STREAMS_PER_CONNECTION,
            minimum=1,
            maximum=MAX_U32,
        ),
        "pool_unused_release_timeout_s": e.duration(
            "POOL_UNUSED_RELEASE_TIMEOUT", DEFAULT_POOL_UNUSED_RELEASE_TIMEOUT_S
        ),
        "http2_stream_window_size": e.integer(
            "HTTP2_STREAM_WINDOW_SIZE",
            DEFAULT_HTTP2_STREAM_WINDOW_BYTES,
            minimum=1,
            maximum=MAX_HTTP2_WINDOW_BYTES,
        ),
        "http2_connection_window_size": e.integer(
            "HTTP2_CONNECTION_WINDOW_SIZE",
            DEFAULT_HTTP2_CONNECTION_WINDOW_BYTES,
            minimum=1,
            maximum=MAX_HTTP2_WINDOW_BYTES,
        ),
        "http2_frame_size": e.integer(
            "HTTP2_FRAME_SIZE",
            DEFAULT_HTTP2_FRAME_BYTES,
            minimum=MIN_HTTP2_FRAME_BYTES,
            maximum=MAX_HTTP2_FRAME_BYTES,
        ),
    }


def _sockets(e: EnvReader, mode: ProxyMode) -> dict[str, Any]:
    """Options on the proxy's sockets: keepalive, user timeout, mark, port reuse, original source."""
    return {
        "keepalive_enabled": e.boolean("KEEPALIVE_ENABLED", True),
        "keepalive_time_s": e.duration("KEEPALIVE_TIME", DEFAULT_KEEPALIVE_TIME_S),
        "keepalive_interval_s": e.duration("KEEPALIVE_INTERVAL", DEFAULT_KEEPALIVE_INTERVAL_S),
        "keepalive_retries": e.integer(
            "KEEPALIVE_RETRIES", DEFAULT_KEEPALIVE_RETRIES, minimum=0, maximum=MAX_U32
        ),
        "user_timeout_enabled": e.boolean("USER_TIMEOUT_ENABLED", False),
        "packet_mark": (
            e.integer("PACKET_MARK", DEFAULT_PACKET_MARK, minimum=0, maximum=MAX_U32)
            if mode is ProxyMode.SHARED
            else e.optional_integer("PACKET_MARK", minimum=0, maximum=MAX_U32)
        ),
        "inpod_uds": e.string("INPOD_UDS", DEFAULT_INPOD_UDS),
        "inpod_port_reuse": e.boolean("INPOD_PORT_REUSE", True),
        "enable_orig_src": e.optional_boolean("ENABLE_ORIG_SRC"),
    }


def _behaviour(e: EnvReader) -> dict[str, Any]:
    """Proxy behaviour switches: drain, tunnels, baggage, SOCKS5, TLS, revocation, authz logging."""
    return {
        "termination_deadline_s": _termination_deadline(e),
        "localhost_app_tunnel": e.boolean("LOCALHOST_APP_TUNNEL", True),
        "enable_response_baggage": e.boolean("ENABLE_RESPONSE_BAGGAGE", True),
        "prefered_service_namespace": e.string("PREFERED_SERVICE_NAMESPACE"),
        "socks5_enabled": e.boolean("UNSTABLE_ENABLE_SOCKS5", False),
        "crl_path": e.string("CRL_PATH"),
        "authz_policy_info_logging": e.boolean("AUTHZ_POLICY_INFO_LOGGING", False),
        "tls12_enabled": e.boolean("TLS12_ENABLED", False),
    }


def _worker_threads(e: EnvReader, cpu_count: Callable[[], int]) -> int:
    """ZTUNNEL_WORKER_THREADS as ztunnel reads it: a count, `N%` of the CPUs, or 0 for all."""
    text = (e.string("ZTUNNEL_WORKER_THREADS", str(DEFAULT_WORKER_THREADS)) or "").strip()
    if not text:
        return DEFAULT_WORKER_THREADS
    hint = f"use a count 1-{MAX_WORKER_THREADS}, N% of the CPUs, or 0 for one per CPU"
    if text.endswith("%"):
        percent = EnvReader.parse_integer("ZTUNNEL_WORKER_THREADS", text[:-1], minimum=1, maximum=100)
        count = max(1, cpu_count() * percent // 100)
    else:
        try:
            count = EnvReader.parse_integer(
                "ZTUNNEL_WORKER_THREADS", text, minimum=0, maximum=MAX_WORKER_THREADS
            )
        except ConfigError as err:
            raise ConfigError("ZTUNNEL_WORKER_THREADS", f"{text!r} is not a worker count; {hint}") from err
        if count == 0:
            count = cpu_count()
    return min(count, MAX_WORKER_THREADS)


def _logging(e: EnvReader) -> dict[str, Any]:
    """LOG_FORMAT and RUST_LOG (validated here, applied by the program)."""
    log_format = (e.string("LOG_FORMAT", "plain") or "plain").strip().lower()
    if log_format not in ("plain", "json"):
        raise ConfigError("LOG_FORMAT", f"{log_format!r} is not a log format; use plain or json")
    log_level = e.text("RUST_LOG", "info")
    try:
        parse_level_spec(log_level)
    except ConfigError as err:
        raise ConfigError("RUST_LOG", err.message.removeprefix("log level: ")) from None
    return {"log_format": log_format, "log_level": log_level}


def _listeners(e: EnvReader, *, ipv6_enabled: bool) -> dict[str, Any]:
    """Listener addresses (ours: ztunnel has no variables for them), `[::]` unless IPv6 is off."""
    wildcard = "::" if ipv6_enabled else "0.0.0.0"
    admin_addr = e.address("ADMIN_ADDR", SocketAddr.of("127.0.0.1", ADMIN_PORT))
    if not admin_addr.ip.is_loopback:
        raise ConfigError(
            "ADMIN_ADDR", f"{admin_addr} is not a loopback address; the admin API is local only"
        )
    return {
        "ipv6_enabled": ipv6_enabled,
        "outbound_addr": e.address("OUTBOUND_ADDR", SocketAddr.of(wildcard, OUTBOUND_PORT)),
        "inbound_addr": e.address("INBOUND_ADDR", SocketAddr.of(wildcard, HBONE_PORT)),
        "inbound_plaintext_addr": e.address(
            "INBOUND_PLAINTEXT_ADDR", SocketAddr.of(wildcard, INBOUND_PLAINTEXT_PORT)
        ),
        "socks5_addr": e.address("SOCKS5_ADDR", SocketAddr.of("127.0.0.1", SOCKS5_PORT)),
        "admin_addr": admin_addr,
        "stats_addr": e.address("STATS_ADDR", SocketAddr.of(wildcard, STATS_PORT)),
        "readiness_addr": e.address("READINESS_ADDR", SocketAddr.of(wildcard, READINESS_PORT)),
    }


# --- at start: what we do not support, and the effective configuration (ztunnel logs both) --------

# Istio ztunnel variables (docs/istio-behaviour.md, "Configuration") this proxy does not implement, and what
# happens instead.
UNSUPPORTED_VARIABLES: dict[str, str] = {
    "PROXY_CONFIG": "ProxyConfig overlays (and the mesh config file) are not read",
    "ZTUNNEL_CPU_LIMIT": "the worker count comes from ZTUNNEL_WORKER_THREADS alone",
    "ZTUNNEL_RESOURCE_CPU_LIMIT": "the worker count comes from ZTUNNEL_WORKER_THREADS alone",
    "ZTUNNEL_RESOURCE_CPU_REQUEST": "the worker count comes from ZTUNNEL_WORKER_THREADS alone",
    "COMPLIANCE_POLICY": "key exchange is OpenSSL's default set, not restricted",
}
MESH_CONFIG_PATH = "./etc/istio/config/mesh"
_REDACTED = "<redacted>"


def unsupported_settings(
    env: Mapping[str, str], path_exists: Callable[[str], bool] = os.path.exists
) -> list[str]:
    """The unsupported variables that are set, and the mesh config file if present, with why."""
    found = [f"{name} ({why})" for name, why in UNSUPPORTED_VARIABLES.items() if env.get(name)]
    if path_exists(MESH_CONFIG_PATH):
        found.append(f"{MESH_CONFIG_PATH} (the mesh config file is not read)")
    return found


def effective_config_yaml(config: ZtunnelConfig) -> str:
    """The configuration in effect as YAML, as ztunnel logs it at start; header values (they can
    carry credentials) redacted, as the static token already is."""
    dump = config.to_dump()
    for key in ("xdsHeaders", "caHeaders"):
        dump[key] = dict.fromkeys(dump[key], _REDACTED)
    dump["unsupported"] = sorted(UNSUPPORTED_VARIABLES)
    return yaml.safe_dump(dump, sort_keys=True, default_flow_style=False)


def log_startup(
    config: ZtunnelConfig, env: Mapping[str, str], path_exists: Callable[[str], bool] = os.path.exists
) -> None:
    """One warning naming every unsupported setting in use, then the effective configuration."""
    unsupported = unsupported_settings(env, path_exists)
    if unsupported:
        log.warning(
            "these Istio ztunnel settings are not supported and have no effect: %s; unset them",
            "; ".join(unsupported),
        )
    log.info("effective configuration:\n%s%s", effective_config_yaml(config), _workers_note(config))


def _workers_note(config: ZtunnelConfig) -> str:
    """A YAML comment under `workerThreads` saying what the count means here (and why 1)."""
    if config.worker_threads == 1:
        return (
            "# workerThreads 1: one process, no worker hop. ztunnel's default is 2, ours is 1: each\n"
            "# worker is a whole Python process with its own copy of the state, worth it only where\n"
            "# the proxy has a second core; ZTUNNEL_WORKER_THREADS=2 runs two.\n"
        )
    return (
        f"# workerThreads {config.worker_threads}: worker processes accept from each listener's one queue;\n"
        "# this process owns xDS, certificates, ZDS and the admin, stats and readiness servers.\n"
    )
