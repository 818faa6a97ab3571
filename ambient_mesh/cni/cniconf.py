"""The CNI plugin's inputs and outputs, parsed and rendered without I/O.

Counterparts: libcni's skel (environment variables, network-name/container-id/interface-name
checks, version negotiation), types.LoadArgs (CNI_ARGS), the per-version result types
(`prevResult`), types.Error (the error object), and istio-cni's plugin `Config` and
`CNIPluginAddEvent` (cni/pkg/plugin, cni/pkg/nodeagent). Every parser here returns a value or
raises `CniError` carrying a CNI error code (SPEC.md "Error"); nothing else escapes.

The plugin->agent add event is a Go struct without JSON tags, so its keys are capitalized, and
each address is a Go `net.IPNet`: `{"IP": "10.1.2.3", "Mask": "<base64 of the mask bytes>"}`.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from ..errors import AmbientError, ConfigError, ProtocolError
from .enablement import EnablementSelector, parse_enablement_selectors
from .plugin_basics import DEFAULT_CNI_AGENT_RUN_DIR

# Versions whose prevResult has the `ips[]` shape (0.3.0 onwards). 0.1.0/0.2.0 results
# (`ip4`/`ip6`) are not accepted.
SUPPORTED_VERSIONS = ("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")
CURRENT_VERSION = "1.1.0"
# libcni's decoder: a config without `cniVersion` is 0.1.0.
UNSPECIFIED_VERSION = "0.1.0"

PLUGIN_TYPE = "istio-cni"
CNI_EVENT_SOCKET_NAME = "pluginevent.sock"
LOG_SOCKET_NAME = "log.sock"
CNI_ADD_EVENT_PATH = "/cmdadd"
UDS_LOG_PATH = "/log"
CNI_ADD_TIMEOUT_S = 5.0
LOG_UDS_TIMEOUT_S = 1.0
# The node agent's own pod must start even when the plugin cannot see pods (istio/istio#55304).
AGENT_POD_NAME_PREFIX = "istio-cni-node-"
# Linux IFNAMSIZ is 16 including the terminating NUL.
MAX_INTERFACE_NAME_BYTES = 15
PLUGIN_LOG_LEVELS = ("debug", "info", "warn", "error", "none")

_NAME_RE = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.\-]*\Z")


class ErrorCode(IntEnum):
    """SPEC.md "Error" well-known codes, plus libcni's 8 and 999."""

    INCOMPATIBLE_CNI_VERSION = 1
    UNSUPPORTED_FIELD = 2
    UNKNOWN_CONTAINER = 3
    INVALID_ENVIRONMENT_VARIABLES = 4
    IO_FAILURE = 5
    DECODING_FAILURE = 6
    INVALID_NETWORK_CONFIG = 7
    INVALID_NETNS = 8
    TRY_AGAIN_LATER = 11
    INTERNAL = 999


class CniError(AmbientError):
    """A failure the plugin reports to the runtime as a CNI error object."""

    def __init__(self, code: int, msg: str, details: str = "", *, hint: str | None = None) -> None:
        super().__init__(f"{msg}: {details}" if details else msg, hint=hint)
        self.code = int(code)
        self.msg = msg
        self.details = details


# -- environment ----------------------------------------------------------------------------------

# Which variables each command needs (skel's table; GC and STATUS from the 1.1 spec).
_REQUIRED_ENV: dict[str, tuple[str, ...]] = {
    "ADD": ("CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_PATH"),
    "CHECK": ("CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_PATH"),
    "DEL": ("CNI_CONTAINERID", "CNI_IFNAME", "CNI_PATH"),
    "GC": ("CNI_PATH",),
    "STATUS": ("CNI_PATH",),
    "VERSION": (),
}
COMMANDS = tuple(_REQUIRED_ENV)


@dataclass(frozen=True, slots=True, kw_only=True)
class CniEnv:
    command: str
    container_id: str = ""
    netns: str = ""
    ifname: str = ""
    args: str = ""
    path: str = ""


def parse_env(environ: Mapping[str, str]) -> CniEnv:
    """The CNI_* variables; a missing required one is error 4, as skel reports it."""
    command = environ.get("CNI_COMMAND", "")
    missing = [] if command else ["CNI_COMMAND"]
    missing += [name for name in _REQUIRED_ENV.get(command, ()) if not environ.get(name)]
    if missing:
        raise CniError(
            ErrorCode.INVALID_ENVIRONMENT_VARIABLES, f"required env variables [{','.join(missing)}] missing"
        )
    if command not in _REQUIRED_ENV:
        raise CniError(ErrorCode.INVALID_ENVIRONMENT_VARIABLES, f"unknown CNI_COMMAND: {command}")
    return CniEnv(
        command=command,
        container_id=environ.get("CNI_CONTAINERID", ""),
        netns=environ.get("CNI_NETNS", ""),
        ifname=environ.get("CNI_IFNAME", ""),
        args=environ.get("CNI_ARGS", ""),
        path=environ.get("CNI_PATH", ""),
    )


def validate_container_id(container_id: str) -> None:
    if not container_id:
        raise CniError(ErrorCode.UNKNOWN_CONTAINER, "missing containerID")
    if not _NAME_RE.match(container_id):
        raise CniError(
            ErrorCode.INVALID_ENVIRONMENT_VARIABLES, "invalid characters in containerID", container_id
        )


def validate_interface_name(ifname: str) -> None:
    code = ErrorCode.INVALID_ENVIRONMENT_VARIABLES
    if not ifname:
        raise CniError(code, "interface name is empty")
    if len(ifname.encode("utf-8", "surrogatepass")) > MAX_INTERFACE_NAME_BYTES:
        raise CniError(code, "interface name is too long", f"at most {MAX_INTERFACE_NAME_BYTES} bytes")
    if ifname in (".", ".."):
        raise CniError(code, "interface name is . or ..")
    if any(ch in "/:" or ch.isspace() for ch in ifname):
        raise CniError(code, "interface name contains / or : or whitespace characters")


# -- CNI_ARGS ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class K8sArgs:
    """The Kubernetes keys runtimes (containerd, CRI-O) put in CNI_ARGS."""

    pod_name: str = ""
    pod_namespace: str = ""
    pod_infra_container_id: str = ""
    pod_uid: str = ""


_K8S_ARG_FIELDS = {
    "K8S_POD_NAME": "pod_name",
    "K8S_POD_NAMESPACE": "pod_namespace",
    "K8S_POD_INFRA_CONTAINER_ID": "pod_infra_container_id",
    "K8S_POD_UID": "pod_uid",
}


def _parse_bool_arg(value: str) -> bool:
    lowered = value.lower()
    if lowered in ("1", "true"):
        return True
    if lowered in ("0", "false"):
        return False
    raise CniError(
        ErrorCode.INVALID_ENVIRONMENT_VARIABLES,
        "invalid CNI_ARGS",
        f"IgnoreUnknown={value!r} is not a boolean",
    )


def parse_cni_args(args: str) -> K8sArgs:
    """`K=V;K=V` as libcni's LoadArgs reads it: every pair needs exactly one `=`, and a key we do
    not know is an error unless the runtime also passes `IgnoreUnknown=1` (containerd does)."""
    if not args:
        return K8sArgs()
    values: dict[str, str] = {}
    unknown: list[str] = []
    ignore_unknown = False
    for pair in args.split(";"):
        kv = pair.split("=")
        if len(kv) != 2:
            raise CniError(
                ErrorCode.INVALID_ENVIRONMENT_VARIABLES, "invalid CNI_ARGS", f"invalid pair {pair!r}"
            )
        key, value = kv
        if key == "IgnoreUnknown":
            ignore_unknown = _parse_bool_arg(value)
        elif key in _K8S_ARG_FIELDS:
            values[_K8S_ARG_FIELDS[key]] = value
        else:
            unknown.append(pair)
    if unknown and not ignore_unknown:
        raise CniError(
            ErrorCode.INVALID_ENVIRONMENT_VARIABLES, "invalid CNI_ARGS", f"unknown args {unknown!r}"
        )
    return K8sArgs(**values)


# -- prevResult -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class IPConfig:
    """One `ips[]` entry: the address the primary plugin gave the pod."""

    address: str  # the pod's IP (not the network address), canonical text
    prefix_len: int
    interface: int | None = None
    gateway: str = ""

    @property
    def family(self) -> int:
        return 6 if ":" in self.address else 4

    @property
    def mask(self) -> bytes:
        bits = 32 if self.family == 4 else 128
        value = ((1 << bits) - 1) ^ ((1 << (bits - self.prefix_len)) - 1)
        return value.to_bytes(bits // 8, "big")

    def to_go_json(self) -> dict[str, Any]:
        return {
            "Interface": self.interface,
            "Address": {"IP": self.address, "Mask": base64.b64encode(self.mask).decode("ascii")},
            "Gateway": self.gateway,
        }


def _go_ip_text(text: str) -> str:
    """Canonical text as Go's net.IP prints it (a v4-mapped v6 address prints as v4)."""
    if "%" in text:
        raise ValueError("zones are not allowed")
    ip = ipaddress.ip_address(text)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


def parse_cidr(text: str) -> tuple[str, int]:
    """`10.1.2.3/24` -> ("10.1.2.3", 24), keeping the host address as CNI results do."""
    ip_text, sep, prefix_text = text.partition("/")
    if not sep or not prefix_text.isascii() or not prefix_text.isdigit() or len(prefix_text) > 3:
        raise ValueError(f"{text!r} is not an address/prefix")
    if "%" in ip_text:
        raise ValueError(f"{text!r}: zones are not allowed")
    ip = ipaddress.ip_address(ip_text)
    prefix = int(prefix_text)
    if prefix > ip.max_prefixlen:
        raise ValueError(f"{text!r}: prefix longer than {ip.max_prefixlen}")
    return str(ip), prefix


@dataclass(frozen=True, slots=True, kw_only=True)
class PrevResult:
    ips: tuple[IPConfig, ...] = ()
    raw: Mapping[str, Any]


def parse_prev_result(raw: Any) -> PrevResult:
    """The previous plugin's result. 0.3.x, 0.4.0 and 1.x share the `ips[]` shape (0.3/0.4 add a
    `version` per entry, which 1.0 dropped); only what we forward is validated."""
    if not isinstance(raw, dict):
        raise CniError(ErrorCode.INVALID_NETWORK_CONFIG, "could not parse prevResult", "expected an object")
    ips_raw = raw.get("ips")
    if ips_raw is None:
        ips_raw = []
    if not isinstance(ips_raw, list):
        raise CniError(ErrorCode.INVALID_NETWORK_CONFIG, "could not parse prevResult", "ips: expected a list")
    ips: list[IPConfig] = []
    for i, entry in enumerate(ips_raw):
        where = f"ips[{i}]"
        try:
            if not isinstance(entry, dict):
                raise ValueError("expected an object")
            address = entry.get("address")
            if not isinstance(address, str):
                raise ValueError("address: expected an address/prefix string")
            ip, prefix = parse_cidr(address)
            gateway = entry.get("gateway")
            if gateway is None or gateway == "":
                gateway = ""
            elif isinstance(gateway, str):
                gateway = _go_ip_text(gateway)
            else:
                raise ValueError("gateway: expected an address string")
            interface = entry.get("interface")
            if interface is not None and (isinstance(interface, bool) or not isinstance(interface, int)):
                raise ValueError("interface: expected an integer index")
        except ValueError as exc:
            raise CniError(
                ErrorCode.INVALID_NETWORK_CONFIG, "could not parse prevResult", f"{where}: {exc}"
            ) from None
        ips.append(IPConfig(address=ip, prefix_len=prefix, interface=interface, gateway=gateway))
    return PrevResult(ips=tuple(ips), raw=raw)


# -- the plugin's network config (stdin) ---------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class PluginConf:
    """istio-cni's chained entry as the runtime hands it to the plugin, with its prevResult."""

    cni_version: str
    name: str
    type: str = PLUGIN_TYPE
    plugin_log_level: str = "info"
    cni_agent_run_dir: str = DEFAULT_CNI_AGENT_RUN_DIR
    ambient_enabled: bool = False
    enablement_selectors: tuple[EnablementSelector, ...] = ()
    exclude_namespaces: tuple[str, ...] = ()
    pod_namespace: str = ""
    native_nftables: bool = False
    enable_ambient_detection_retry: bool = False
    # Ours: where the plugin reads pods and namespaces (`{"directory": ...}`); istio-cni uses a
    # kubeconfig in the run dir instead.
    pod_source_directory: str = ""
    # istio-cni's `kubernetes.kubeconfig` (up to 1.24; later the plugin uses the run dir's file)
    kubeconfig: str = ""
    prev_result: PrevResult | None = None

    @property
    def cni_event_socket(self) -> str:
        return f"{self.cni_agent_run_dir.rstrip('/')}/{CNI_EVENT_SOCKET_NAME}"

    @property
    def log_socket(self) -> str:
        return f"{self.cni_agent_run_dir.rstrip('/')}/{LOG_SOCKET_NAME}"


def decode_network_config(stdin: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(stdin)
    except (ValueError, RecursionError) as exc:
        raise CniError(ErrorCode.DECODING_FAILURE, "error decoding network config", str(exc)) from None
    if not isinstance(doc, dict):
        raise CniError(ErrorCode.DECODING_FAILURE, "error decoding network config", "expected a JSON object")
    return doc


def config_version(doc: Mapping[str, Any]) -> str:
    """The config's cniVersion after libcni's defaulting, checked against ours (error 1)."""
    version = doc.get("cniVersion")
    if version is None or version == "":
        version = UNSPECIFIED_VERSION
    if not isinstance(version, str):
        raise CniError(
            ErrorCode.DECODING_FAILURE, "error decoding network config", "cniVersion: expected a string"
        )
    if version not in SUPPORTED_VERSIONS:
        raise CniError(
            ErrorCode.INCOMPATIBLE_CNI_VERSION,
            "incompatible CNI versions",
            f"config is {version!r}, plugin supports {list(SUPPORTED_VERSIONS)!r}",
        )
    return version


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def _field(doc: Mapping[str, Any], key: str, kind: type, default: Any) -> Any:
    value = doc.get(key)
    if value is None:
        return default
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise CniError(
            ErrorCode.INVALID_NETWORK_CONFIG, "invalid network config", f"{key}: expected {kind.__name__}"
        )
    return value


def parse_plugin_conf(stdin: bytes) -> PluginConf:
    """The full stdin config: skel's name and version checks, then istio-cni's keys."""
    doc = decode_network_config(stdin)
    name = doc.get("name")
    if name is not None and not isinstance(name, str):
        raise CniError(ErrorCode.DECODING_FAILURE, "error decoding network config", "name: expected a string")
    if not name:
        raise CniError(ErrorCode.INVALID_NETWORK_CONFIG, "missing network name")
    if not _NAME_RE.match(name):
        raise CniError(ErrorCode.INVALID_NETWORK_CONFIG, "invalid characters found in network name", name)
    version = config_version(doc)
    level = _field(doc, "plugin_log_level", str, "") or "info"
    if level.lower() not in PLUGIN_LOG_LEVELS:
        raise CniError(
            ErrorCode.INVALID_NETWORK_CONFIG,
            "invalid network config",
            f"plugin_log_level: {level!r} is not one of {', '.join(PLUGIN_LOG_LEVELS)}",
        )
    excludes = _field(doc, "exclude_namespaces", list, [])
    if not all(isinstance(n, str) for n in excludes):
        raise CniError(
            ErrorCode.INVALID_NETWORK_CONFIG, "invalid network config", "exclude_namespaces: expected strings"
        )
    source = _field(doc, "ambient_pod_source", dict, {})
    directory = source.get("directory")
    if directory is not None and not isinstance(directory, str):
        raise CniError(
            ErrorCode.INVALID_NETWORK_CONFIG,
            "invalid network config",
            "ambient_pod_source.directory: expected str",
        )
    kube = _field(doc, "kubernetes", dict, {})
    kubeconfig = kube.get("kubeconfig")
    if kubeconfig is not None and not isinstance(kubeconfig, str):
        raise CniError(
            ErrorCode.INVALID_NETWORK_CONFIG, "invalid network config", "kubernetes.kubeconfig: expected str"
        )
    try:
        selectors = parse_enablement_selectors(doc.get("enablement_selectors"))
    except ConfigError as exc:
        raise CniError(ErrorCode.INVALID_NETWORK_CONFIG, "invalid network config", str(exc)) from None
    raw_prev = doc.get("prevResult")
    return PluginConf(
        cni_version=version,
        name=name,
        type=_field(doc, "type", str, PLUGIN_TYPE),
        plugin_log_level=level.lower(),
        cni_agent_run_dir=_field(doc, "cni_agent_run_dir", str, "") or DEFAULT_CNI_AGENT_RUN_DIR,
        ambient_enabled=_field(doc, "ambient_enabled", bool, False),
        enablement_selectors=selectors,
        exclude_namespaces=tuple(excludes),
        pod_namespace=_field(doc, "pod_namespace", str, ""),
        native_nftables=_field(doc, "native_nftables", bool, False),
        enable_ambient_detection_retry=_field(doc, "enable_ambient_detection_retry", bool, False),
        pod_source_directory=directory or "",
        kubeconfig=kubeconfig or "",
        prev_result=None if raw_prev is None else parse_prev_result(raw_prev),
    )


# -- output -----------------------------------------------------------------------------------------


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode("utf-8")


def render_result(conf: PluginConf) -> bytes:
    """What a chained plugin that changes nothing prints: prevResult as it came, or an empty
    result in the config's version when there was none."""
    if conf.prev_result is not None:
        return _dumps(conf.prev_result.raw)
    return _dumps({"cniVersion": conf.cni_version, "dns": {}})


def render_error(error: CniError, cni_version: str = CURRENT_VERSION) -> bytes:
    details = error.details
    if error.hint:
        details = f"{details} (hint: {error.hint})" if details else f"hint: {error.hint}"
    return _dumps({"cniVersion": cni_version, "code": error.code, "msg": error.msg, "details": details})


def render_version() -> bytes:
    return _dumps({"cniVersion": CURRENT_VERSION, "supportedVersions": list(SUPPORTED_VERSIONS)})


# -- the add event (plugin -> node agent, POST /cmdadd) ----------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class CniAddEvent:
    netns: str
    pod_name: str
    pod_namespace: str
    # None when the runtime passed no prevResult (Go marshals the nil slice as null).
    ips: tuple[IPConfig, ...] | None = None


def encode_add_event(event: CniAddEvent) -> bytes:
    return _dumps(
        {
            "Netns": event.netns,
            "PodName": event.pod_name,
            "PodNamespace": event.pod_namespace,
            "IPs": None if event.ips is None else [ip.to_go_json() for ip in event.ips],
        }
    )


def _prefix_from_mask(mask: bytes) -> int:
    bits = "".join(f"{byte:08b}" for byte in mask)
    ones = len(bits) - len(bits.lstrip("1"))
    if "1" in bits[ones:]:
        raise ValueError("mask is not a prefix")
    return ones


def _decode_ip_config(raw: Any, where: str) -> IPConfig:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected an object")
    interface = raw.get("Interface")
    if interface is not None and (isinstance(interface, bool) or not isinstance(interface, int)):
        raise ValueError(f"{where}.Interface: expected an integer or null")
    addr = raw.get("Address")
    if (
        not isinstance(addr, dict)
        or not isinstance(addr.get("IP"), str)
        or not isinstance(addr.get("Mask"), str)
    ):
        raise ValueError(f"{where}.Address: expected {{IP, Mask}} strings")
    ip = ipaddress.ip_address(addr["IP"]) if "%" not in addr["IP"] else None
    if ip is None:
        raise ValueError(f"{where}.Address.IP: zones are not allowed")
    try:
        mask = base64.b64decode(addr["Mask"], validate=True)
    except binascii.Error as exc:
        raise ValueError(f"{where}.Address.Mask: {exc}") from None
    prefix = _prefix_from_mask(mask)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None and len(mask) == 4:
        ip = ip.ipv4_mapped
    if ip.version == 4 and len(mask) == 16 and prefix >= 96:
        prefix -= 96  # a v4 address with Go's 16-byte mask form
    elif len(mask) != ip.max_prefixlen // 8:
        raise ValueError(f"{where}.Address.Mask: {len(mask)} bytes does not fit IPv{ip.version}")
    gateway = raw.get("Gateway")
    if gateway is None or gateway == "":
        gateway = ""
    elif isinstance(gateway, str):
        gateway = _go_ip_text(gateway)
    else:
        raise ValueError(f"{where}.Gateway: expected an address string")
    return IPConfig(address=str(ip), prefix_len=prefix, interface=interface, gateway=gateway)


def decode_add_event(body: bytes) -> CniAddEvent:
    """The node agent's side of POST /cmdadd (it answers 400 when this raises)."""
    try:
        doc = json.loads(body)
        if not isinstance(doc, dict):
            raise ValueError("expected a JSON object")
        strings = {}
        for key in ("Netns", "PodName", "PodNamespace"):
            value = doc.get(key)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{key}: expected a string")
            strings[key] = value or ""
        ips_raw = doc.get("IPs")
        if ips_raw is not None and not isinstance(ips_raw, list):
            raise ValueError("IPs: expected a list or null")
        ips = (
            None
            if ips_raw is None
            else tuple(_decode_ip_config(r, f"IPs[{i}]") for i, r in enumerate(ips_raw))
        )
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"bad CNI add event: {exc}") from None
    return CniAddEvent(
        netns=strings["Netns"], pod_name=strings["PodName"], pod_namespace=strings["PodNamespace"], ips=ips
    )
