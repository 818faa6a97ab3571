"""The node agent's configuration: environment variables (and flags) -> one frozen `AgentConfig`.

Counterpart of istio-cni's cni/pkg/config (InstallConfig) and cni/pkg/cmd/root.go, facts from
docs/istio-behaviour.md, "Node agent configuration". As with istio-cni's cobra+viper setup, every setting is
an environment variable, and a flag `--kebab-case-name=value` sets the variable of the same name
upper-cased with `-` -> `_` (flags win over the environment).

Defaults: the keys istio-cni registers as flags take its code defaults; the keys it only reads
from its Helm chart's ConfigMap (AMBIENT_ENABLEMENT_SELECTOR, AMBIENT_DNS_CAPTURE, AMBIENT_IPV6,
AMBIENT_RECONCILE_POD_RULES_ON_STARTUP, EXCLUDE_NAMESPACES) take the chart's defaults, because
that is what every istio-cni install actually runs with. Paths default to where the agent runs
directly on the node (no `/host` mount prefix); HOST_PREFIX adds one for a containerised agent.

Ours, not istio-cni's: CNI_BIN_DIR (istio-cni hard-codes /host/opt/cni/bin), HEALTH_PORT (the
constant 8000), POD_SOURCE_DIRECTORY / POD_SOURCE_POLL_INTERVAL (pods from the embedded control
plane's YAML directory instead of the API server), KUBECONFIG (a kubeconfig instead of the
in-cluster service account), PLUGIN_SERVICE_ACCOUNT (whose short-lived token the plugin's
kubeconfig carries, plugin_token.py), HOST_PREFIX, PROBE_SET_PREFIX and KUBELET_UID (the nftables host
rule's uid when no kubelet process can be found).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..capture.hostprobe import PROBE_SET_PREFIX
from ..capture.inpod import HOST_PROBE_SNAT_IPV4, HOST_PROBE_SNAT_IPV6
from ..env import ISTIO_CNI_BOOLS, EnvReader
from ..errors import ConfigError
from ..ports import CNI_HEALTH_PORT, CNI_MONITORING_PORT
from .cniconf import CNI_EVENT_SOCKET_NAME, LOG_SOCKET_NAME, PLUGIN_LOG_LEVELS
from .enablement import DEFAULT_ENABLEMENT_SELECTORS, EnablementSelector, parse_enablement_selectors
from .plugin_basics import DEFAULT_CNI_AGENT_RUN_DIR, PLUGIN_RUN_SOCKET_NAME

DEFAULT_MOUNTED_CNI_NET_DIR = "/etc/cni/net.d"
DEFAULT_CNI_BIN_DIR = "/opt/cni/bin"
DEFAULT_ZTUNNEL_UDS_ADDRESS = "/var/run/ztunnel/ztunnel.sock"
DEFAULT_SERVICE_ACCOUNT_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
DEFAULT_SYSTEM_NAMESPACE = "istio-system"
DEFAULT_PLUGIN_SERVICE_ACCOUNT = "istio-cni-plugin"
DEFAULT_EXCLUDE_NAMESPACES = ("kube-system",)
DEFAULT_POD_SOURCE_POLL_INTERVAL_S = 1.0
MAX_POD_SOURCE_POLL_INTERVAL_S = 3600.0
DEFAULT_KUBECONFIG_MODE = 0o600
ENROLLMENT_STATE_FILE = "enrolled-pods.json"

# Every setting the agent reads; a flag naming anything else is a mistake, not a new setting.
SETTINGS = frozenset(
    {
        "AMBIENT_DISABLE_SAFE_UPGRADE",
        "AMBIENT_DNS_CAPTURE",
        "AMBIENT_ENABLED",
        "AMBIENT_ENABLEMENT_SELECTOR",
        "AMBIENT_IPV6",
        "AMBIENT_RECONCILE_POD_RULES_ON_STARTUP",
        "CHAINED_CNI_PLUGIN",
        "CNI_AGENT_RUN_DIR",
        "CNI_BIN_DIR",
        "CNI_CONF_GROUP_READ",
        "CNI_CONF_NAME",
        "ENABLE_AMBIENT_DETECTION_RETRY",
        "EXCLUDE_NAMESPACES",
        "FORCE_IPTABLES_BINARY",
        "HEALTH_PORT",
        "HOST_PREFIX",
        "HOST_PROBE_SNAT_IP",
        "HOST_PROBE_SNAT_IPV6",
        "ISTIO_OWNED_CNI_CONFIG",
        "ISTIO_OWNED_CNI_CONFIG_FILENAME",
        "K8S_SERVICE_ACCOUNT_PATH",
        "KUBECONFIG",
        "KUBECONFIG_MODE",
        "KUBELET_UID",
        "KUBERNETES_NODE_NAME",
        "KUBERNETES_SERVICE_HOST",
        "KUBERNETES_SERVICE_PORT",
        "KUBERNETES_SERVICE_PROTOCOL",
        "KUBE_CA_FILE",
        "LOG_AS_JSON",
        "LOG_OUTPUT_LEVEL",
        "MONITORING_PORT",
        "MOUNTED_CNI_NET_DIR",
        "NATIVE_NFTABLES",
        "NODE_NAME",
        "PLUGIN_LOG_LEVEL",
        "PLUGIN_SERVICE_ACCOUNT",
        "POD_NAME",
        "POD_NAMESPACE",
        "POD_SOURCE_DIRECTORY",
        "POD_SOURCE_POLL_INTERVAL",
        "PROBE_SET_PREFIX",
        "REVISION",
        "SKIP_TLS_VERIFY",
        "SYSTEM_NAMESPACE",
        "ZTUNNEL_UDS_ADDRESS",
    }
)


def istio_level_spec(text: str) -> str:
    """Istio's `--log_output_level` (`default:info,cni-plugin:debug`) -> logs.py's
    `info,cni-plugin=debug`; a spec already in logs.py's form passes through."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        scope, sep, level = part.partition(":")
        if not sep:
            out.append(part)
        elif scope == "default":
            out.append(level)
        else:
            out.append(f"{scope}={level}")
    return ",".join(out)


def parse_enablement_selector_env(
    text: str, name: str = "AMBIENT_ENABLEMENT_SELECTOR"
) -> tuple[EnablementSelector, ...]:
    """The chart writes the selector list as YAML (JSON is YAML too); "" means no selector."""
    if not text.strip():
        return ()
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(name, f"not YAML: {exc}") from None
    return parse_enablement_selectors(raw, name)


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentConfig:
    """Everything the node agent needs, resolved once at start and passed down."""

    # installation (docs/istio-behaviour.md, "Node agent configuration" and
    # "CNI config and kubeconfig installation")
    mounted_cni_net_dir: Path = Path(DEFAULT_MOUNTED_CNI_NET_DIR)
    cni_bin_dir: Path = Path(DEFAULT_CNI_BIN_DIR)
    cni_agent_run_dir: Path = Path(DEFAULT_CNI_AGENT_RUN_DIR)
    cni_conf_name: str = ""
    chained_cni_plugin: bool = True
    cni_conf_group_read: bool = False
    kubeconfig_mode: int = DEFAULT_KUBECONFIG_MODE
    plugin_log_level: str = "info"
    # Kubernetes
    kube_ca_file: str = ""
    skip_tls_verify: bool = False
    k8s_service_protocol: str = "https"
    k8s_service_host: str = ""
    k8s_service_port: str = ""
    k8s_service_account_path: Path = Path(DEFAULT_SERVICE_ACCOUNT_PATH)
    kubeconfig: str = ""
    node_name: str = ""
    pod_name: str = ""
    pod_namespace: str = ""
    # ours: whose token the agent requests for the plugin's kubeconfig (plugin_token.py); "" =
    # none, the plugin gets the agent's own token as with istio-cni
    plugin_service_account: str = DEFAULT_PLUGIN_SERVICE_ACCOUNT
    system_namespace: str = DEFAULT_SYSTEM_NAMESPACE
    revision: str = ""
    # our second pod source: the embedded control plane's YAML directory
    pod_source_directory: str = ""
    pod_source_poll_interval_s: float = DEFAULT_POD_SOURCE_POLL_INTERVAL_S
    # servers
    monitoring_port: int = CNI_MONITORING_PORT
    health_port: int = CNI_HEALTH_PORT
    ztunnel_uds_address: Path = Path(DEFAULT_ZTUNNEL_UDS_ADDRESS)
    # ambient
    ambient_enabled: bool = False
    enablement_selectors: tuple[EnablementSelector, ...] = DEFAULT_ENABLEMENT_SELECTORS
    exclude_namespaces: tuple[str, ...] = DEFAULT_EXCLUDE_NAMESPACES
    ambient_dns_capture: bool = True  # the chart's default; the node proxy answers on 15053
    ambient_ipv6: bool = True
    ambient_disable_safe_upgrade: bool = False
    ambient_reconcile_pod_rules_on_startup: bool = True
    enable_ambient_detection_retry: bool = False
    native_nftables: bool = False
    force_iptables_binary: str = ""
    host_probe_snat_ip: ipaddress.IPv4Address = HOST_PROBE_SNAT_IPV4
    host_probe_snat_ipv6: ipaddress.IPv6Address = HOST_PROBE_SNAT_IPV6
    probe_set_prefix: str = PROBE_SET_PREFIX
    kubelet_uid: int | None = None
    # where the node's /proc and the runtime's netns paths are (a containerised agent: "/host")
    host_prefix: str = ""
    # logging
    log_output_level: str = "info"  # our logs.py syntax; Istio's `scope:level` is converted
    log_as_json: bool = False

    # -- derived ---------------------------------------------------------------------------------

    @property
    def cni_event_address(self) -> Path:
        """Since istio 1.24 derived from the run dir (was CNI_EVENT_ADDRESS)."""
        return self.cni_agent_run_dir / CNI_EVENT_SOCKET_NAME

    @property
    def plugin_run_address(self) -> Path:
        """Where the plugin's handoff sends its runs (plugin_handoff.py; ours)."""
        return self.cni_agent_run_dir / PLUGIN_RUN_SOCKET_NAME

    @property
    def log_uds_address(self) -> Path:
        return self.cni_agent_run_dir / LOG_SOCKET_NAME

    @property
    def enrollment_state_file(self) -> Path:
        return self.cni_agent_run_dir / ENROLLMENT_STATE_FILE

    @property
    def proc_root(self) -> Path:
        return Path(f"{self.host_prefix}/proc") if self.host_prefix else Path("/proc")

    @property
    def host_netns_path(self) -> str:
        return f"{self.proc_root}/1/ns/net"

    def host_path(self, path: str) -> str:
        """A node path as the agent sees it (istio-cni opens `/host` + the CNI netns path)."""
        return f"{self.host_prefix}{path}" if self.host_prefix and path.startswith("/") else path

    def __repr__(self) -> str:
        source = f"dir {self.pod_source_directory}" if self.pod_source_directory else "kube api"
        return (
            f"AgentConfig(node={self.node_name!r}, run_dir={str(self.cni_agent_run_dir)!r}, "
            f"ambient={'on' if self.ambient_enabled else 'off'}, pods from {source}, "
            f"{'nftables' if self.native_nftables else 'iptables'})"
        )

    def dump(self) -> dict[str, object]:
        out: dict[str, object] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if name == "enablement_selectors":
                value = [s.to_json() for s in value]
            elif isinstance(value, (Path, ipaddress.IPv4Address, ipaddress.IPv6Address)):
                value = str(value)
            elif isinstance(value, tuple):
                value = list(value)
            out[name] = value
        return out

    # -- parsing ---------------------------------------------------------------------------------

    @classmethod
    def from_env(cls, env: Mapping[str, str], *, hostname: str | None = None) -> AgentConfig:
        """Build from `env` (normally os.environ); raise ConfigError naming the bad variable."""
        # The one env reader (env.py), with istio-cni's boolean spellings and values trimmed.
        e = EnvReader(env, bools=ISTIO_CNI_BOOLS, strip=True)
        node_name = (
            e.text("KUBERNETES_NODE_NAME")
            or e.text("NODE_NAME")
            or (hostname if hostname is not None else socket.gethostname())
        )
        plugin_level = e.text("PLUGIN_LOG_LEVEL", "info").lower()
        if plugin_level not in PLUGIN_LOG_LEVELS:
            raise ConfigError(
                "PLUGIN_LOG_LEVEL", f"{plugin_level!r} is not one of {', '.join(PLUGIN_LOG_LEVELS)}"
            )
        protocol = e.text("KUBERNETES_SERVICE_PROTOCOL", "https")
        if protocol not in ("http", "https"):
            raise ConfigError("KUBERNETES_SERVICE_PROTOCOL", f"{protocol!r} is not http or https")
        # A setting we accept must act: istio-cni's own conflist (02-istio-cni.conflist, a copy
        # of the primary network's with our entry) is not written by this agent, which always
        # inserts its entry into the primary's; asked for, it stops here rather than ignore it.
        if e.boolean("ISTIO_OWNED_CNI_CONFIG", False) or e.text("ISTIO_OWNED_CNI_CONFIG_FILENAME"):
            raise ConfigError(
                "ISTIO_OWNED_CNI_CONFIG",
                "istio-cni's owned config file is not supported: this node agent inserts its entry "
                "into the primary network's conflist (as istio-cni does by default)",
                hint="unset ISTIO_OWNED_CNI_CONFIG and ISTIO_OWNED_CNI_CONFIG_FILENAME "
                "(Helm: istioOwnedCNIConfig=false)",
            )
        force = e.text("FORCE_IPTABLES_BINARY")
        if force not in ("", "legacy", "nft"):
            raise ConfigError("FORCE_IPTABLES_BINARY", f"{force!r} is not legacy or nft")
        selector_text = env.get("AMBIENT_ENABLEMENT_SELECTOR")
        selectors = (
            DEFAULT_ENABLEMENT_SELECTORS
            if selector_text is None
            else parse_enablement_selector_env(selector_text)
        )
        try:
            probe4 = ipaddress.IPv4Address(e.text("HOST_PROBE_SNAT_IP", str(HOST_PROBE_SNAT_IPV4)))
        except ValueError as exc:
            raise ConfigError("HOST_PROBE_SNAT_IP", str(exc)) from None
        if not probe4.is_link_local:
            raise ConfigError("HOST_PROBE_SNAT_IP", f"{probe4} must be a link-local address (169.254/16)")
        try:
            probe6 = ipaddress.IPv6Address(e.text("HOST_PROBE_SNAT_IPV6", str(HOST_PROBE_SNAT_IPV6)))
        except ValueError as exc:
            raise ConfigError("HOST_PROBE_SNAT_IPV6", str(exc)) from None
        kubelet_uid_text = e.text("KUBELET_UID")
        kubelet_uid = e.integer("KUBELET_UID", 0, minimum=0, maximum=0xFFFFFFFF) if kubelet_uid_text else None
        host_prefix = e.text("HOST_PREFIX").rstrip("/")
        if host_prefix and not host_prefix.startswith("/"):
            raise ConfigError("HOST_PREFIX", f"{host_prefix!r} must be an absolute path")
        level = istio_level_spec(e.text("LOG_OUTPUT_LEVEL", "default:info"))
        run_dir = e.text("CNI_AGENT_RUN_DIR", DEFAULT_CNI_AGENT_RUN_DIR)
        for name in ("CNI_AGENT_RUN_DIR", "MOUNTED_CNI_NET_DIR", "CNI_BIN_DIR", "ZTUNNEL_UDS_ADDRESS"):
            value = e.text(name)
            if value and not value.startswith("/"):
                raise ConfigError(name, f"{value!r} must be an absolute path")
        return cls(
            mounted_cni_net_dir=Path(e.text("MOUNTED_CNI_NET_DIR", DEFAULT_MOUNTED_CNI_NET_DIR)),
            cni_bin_dir=Path(e.text("CNI_BIN_DIR", DEFAULT_CNI_BIN_DIR)),
            cni_agent_run_dir=Path(run_dir),
            cni_conf_name=e.text("CNI_CONF_NAME"),
            chained_cni_plugin=e.boolean("CHAINED_CNI_PLUGIN", True),
            cni_conf_group_read=e.boolean("CNI_CONF_GROUP_READ", False),
            kubeconfig_mode=e.integer(
                "KUBECONFIG_MODE", DEFAULT_KUBECONFIG_MODE, minimum=0, maximum=0o777, base=8
            ),
            plugin_log_level=plugin_level,
            kube_ca_file=e.text("KUBE_CA_FILE"),
            skip_tls_verify=e.boolean("SKIP_TLS_VERIFY", False),
            k8s_service_protocol=protocol,
            k8s_service_host=e.text("KUBERNETES_SERVICE_HOST"),
            k8s_service_port=e.text("KUBERNETES_SERVICE_PORT"),
            k8s_service_account_path=Path(e.text("K8S_SERVICE_ACCOUNT_PATH", DEFAULT_SERVICE_ACCOUNT_PATH)),
            kubeconfig=e.text("KUBECONFIG"),
            node_name=node_name,
            pod_name=e.text("POD_NAME"),
            pod_namespace=e.text("POD_NAMESPACE"),
            # set and empty: no account, the agent's own token (raw: empty means something here)
            plugin_service_account=(
                DEFAULT_PLUGIN_SERVICE_ACCOUNT
                if e.raw("PLUGIN_SERVICE_ACCOUNT") is None
                else e.text("PLUGIN_SERVICE_ACCOUNT")
            ),
            system_namespace=e.text("SYSTEM_NAMESPACE", DEFAULT_SYSTEM_NAMESPACE),
            revision=e.text("REVISION"),
            pod_source_directory=e.text("POD_SOURCE_DIRECTORY"),
            pod_source_poll_interval_s=e.duration(
                "POD_SOURCE_POLL_INTERVAL",
                DEFAULT_POD_SOURCE_POLL_INTERVAL_S,
                maximum_s=MAX_POD_SOURCE_POLL_INTERVAL_S,
            ),
            monitoring_port=e.integer("MONITORING_PORT", CNI_MONITORING_PORT, minimum=-1, maximum=65535),
            health_port=e.integer("HEALTH_PORT", CNI_HEALTH_PORT, minimum=-1, maximum=65535),
            ztunnel_uds_address=Path(e.text("ZTUNNEL_UDS_ADDRESS", DEFAULT_ZTUNNEL_UDS_ADDRESS)),
            ambient_enabled=e.boolean("AMBIENT_ENABLED", False),
            enablement_selectors=selectors,
            exclude_namespaces=e.csv("EXCLUDE_NAMESPACES", DEFAULT_EXCLUDE_NAMESPACES),
            ambient_dns_capture=e.boolean("AMBIENT_DNS_CAPTURE", True),
            ambient_ipv6=e.boolean("AMBIENT_IPV6", True),
            ambient_disable_safe_upgrade=e.boolean("AMBIENT_DISABLE_SAFE_UPGRADE", False),
            ambient_reconcile_pod_rules_on_startup=e.boolean("AMBIENT_RECONCILE_POD_RULES_ON_STARTUP", True),
            enable_ambient_detection_retry=e.boolean("ENABLE_AMBIENT_DETECTION_RETRY", False),
            native_nftables=e.boolean("NATIVE_NFTABLES", False),
            force_iptables_binary=force,
            host_probe_snat_ip=probe4,
            host_probe_snat_ipv6=probe6,
            probe_set_prefix=e.text("PROBE_SET_PREFIX", PROBE_SET_PREFIX),
            kubelet_uid=kubelet_uid,
            host_prefix=host_prefix,
            log_output_level=level,
            log_as_json=e.boolean("LOG_AS_JSON", False),
        )


def flags_to_env(argv: Sequence[str]) -> dict[str, str]:
    """`--cni-agent-run-dir=/x` or `--cni-agent-run-dir /x` -> {"CNI_AGENT_RUN_DIR": "/x"};
    a bare boolean flag (`--ambient-enabled`) means true. Istio's `--log_output_level` and
    `--log_as_json` keep their underscores."""
    out: dict[str, str] = {}
    i = 0
    args = list(argv)
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(
                arg or "<empty>",
                "expected a --flag (every setting is --name=value or NAME=value in the environment)",
            )
        name, sep, value = arg[2:].partition("=")
        if not name:
            raise ConfigError(arg, "empty flag name")
        if not sep:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                value = args[i + 1]
                i += 1
            else:
                value = "true"
        key = name.upper().replace("-", "_")
        if key not in SETTINGS:
            raise ConfigError(
                f"--{name}",
                "unknown flag",
                hint="flags are the setting names in kebab-case, "
                "e.g. --cni-agent-run-dir for CNI_AGENT_RUN_DIR",
            )
        out[key] = value
        i += 1
    return out


def load(argv: Sequence[str], env: Mapping[str, str], *, hostname: str | None = None) -> AgentConfig:
    """Flags over environment, as viper's AutomaticEnv + bound flags do."""
    merged = dict(env)
    merged.update(flags_to_env(argv))
    return AgentConfig.from_env(merged, hostname=hostname)
