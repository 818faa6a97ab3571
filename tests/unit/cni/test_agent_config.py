"""The node agent's configuration: istio-cni's env vars and defaults, flags, errors naming the variable."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ambient_mesh import logs
from ambient_mesh.cni.agent_config import (
    AgentConfig,
    flags_to_env,
    istio_level_spec,
    load,
    parse_enablement_selector_env,
)
from ambient_mesh.cni.enablement import DEFAULT_ENABLEMENT_SELECTORS
from ambient_mesh.errors import ConfigError


def cfg(**env: str) -> AgentConfig:
    return AgentConfig.from_env(env, hostname="host-a")


def test_defaults_follow_istio_cni_and_its_chart():
    c = cfg()
    assert c.cni_agent_run_dir == Path("/var/run/istio-cni")
    assert c.cni_event_address == Path("/var/run/istio-cni/pluginevent.sock")
    assert c.log_uds_address == Path("/var/run/istio-cni/log.sock")
    assert c.ztunnel_uds_address == Path("/var/run/ztunnel/ztunnel.sock")
    assert c.monitoring_port == 15014 and c.health_port == 8000
    assert c.ambient_enabled is False
    assert c.chained_cni_plugin is True
    # chart ConfigMap defaults for the keys istio-cni only reads from it
    assert c.enablement_selectors == DEFAULT_ENABLEMENT_SELECTORS
    assert c.exclude_namespaces == ("kube-system",)
    assert c.ambient_dns_capture is True and c.ambient_ipv6 is True
    assert c.ambient_reconcile_pod_rules_on_startup is True
    assert str(c.host_probe_snat_ip) == "169.254.7.127"
    assert str(c.host_probe_snat_ipv6) == "fd16:9254:7127:1337:ffff:ffff:ffff:ffff"
    assert c.node_name == "host-a"  # falls back to the hostname
    assert c.kubeconfig_mode == 0o600
    assert c.proc_root == Path("/proc") and c.host_netns_path == "/proc/1/ns/net"


def test_env_values_are_read():
    c = cfg(
        AMBIENT_ENABLED="true",
        CNI_AGENT_RUN_DIR="/run/x",
        MONITORING_PORT="9000",
        NATIVE_NFTABLES="1",
        EXCLUDE_NAMESPACES="kube-system, istio-system,",
        KUBERNETES_NODE_NAME="n7",
        NODE_NAME="ignored",
        HOST_PREFIX="/host/",
        KUBECONFIG_MODE="640",
        POD_SOURCE_POLL_INTERVAL="250ms",
    )
    assert c.ambient_enabled and c.native_nftables
    assert c.cni_event_address == Path("/run/x/pluginevent.sock")
    assert c.monitoring_port == 9000
    assert c.exclude_namespaces == ("kube-system", "istio-system")
    assert c.node_name == "n7"
    assert c.host_path("/var/run/netns/cni-1") == "/host/var/run/netns/cni-1"
    assert c.host_netns_path == "/host/proc/1/ns/net"
    assert c.kubeconfig_mode == 0o640
    assert c.pod_source_poll_interval_s == 0.25
    assert "ambient=on" in repr(c) and "nftables" in repr(c)


def test_empty_selector_matches_nothing_as_in_istio_cni_code():
    assert cfg(AMBIENT_ENABLEMENT_SELECTOR="").enablement_selectors == ()


def test_selector_yaml_as_the_chart_writes_it():
    text = """
- podSelector:
    matchLabels: {istio.io/dataplane-mode: ambient}
- podSelector:
    matchExpressions:
      - {key: istio.io/dataplane-mode, operator: NotIn, values: [none]}
  namespaceSelector:
    matchLabels: {istio.io/dataplane-mode: ambient}
"""
    assert parse_enablement_selector_env(text) == DEFAULT_ENABLEMENT_SELECTORS


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"AMBIENT_ENABLED": "maybe"}, "AMBIENT_ENABLED"),
        ({"MONITORING_PORT": "70000"}, "MONITORING_PORT"),
        ({"MONITORING_PORT": "x"}, "MONITORING_PORT"),
        ({"HOST_PROBE_SNAT_IP": "10.0.0.1"}, "HOST_PROBE_SNAT_IP"),
        ({"HOST_PROBE_SNAT_IPV6": "nope"}, "HOST_PROBE_SNAT_IPV6"),
        (
            {"AMBIENT_ENABLEMENT_SELECTOR": "[{podSelector: {matchExpressions: [{key: a, operator: Bad}]}}]"},
            "AMBIENT_ENABLEMENT_SELECTOR",
        ),
        ({"AMBIENT_ENABLEMENT_SELECTOR": "{"}, "AMBIENT_ENABLEMENT_SELECTOR"),
        ({"FORCE_IPTABLES_BINARY": "old"}, "FORCE_IPTABLES_BINARY"),
        ({"KUBERNETES_SERVICE_PROTOCOL": "ftp"}, "KUBERNETES_SERVICE_PROTOCOL"),
        ({"CNI_AGENT_RUN_DIR": "relative"}, "CNI_AGENT_RUN_DIR"),
        ({"POD_SOURCE_POLL_INTERVAL": "soon"}, "POD_SOURCE_POLL_INTERVAL"),
        ({"PLUGIN_LOG_LEVEL": "loud"}, "PLUGIN_LOG_LEVEL"),
        ({"HOST_PREFIX": "host"}, "HOST_PREFIX"),
        ({"KUBELET_UID": "-1"}, "KUBELET_UID"),
    ],
)
def test_errors_name_the_variable(env, variable):
    with pytest.raises(ConfigError) as info:
        cfg(**env)
    assert info.value.source.startswith(variable)


def test_flags_override_env_like_viper():
    c = load(
        ["--ambient-enabled", "--cni-agent-run-dir", "/run/a", "--monitoring-port=1234"],
        {"CNI_AGENT_RUN_DIR": "/run/env", "AMBIENT_ENABLED": "false"},
        hostname="h",
    )
    assert c.ambient_enabled and c.cni_agent_run_dir == Path("/run/a") and c.monitoring_port == 1234


def test_istio_log_flag_names_keep_underscores():
    assert flags_to_env(["--log_output_level=default:debug", "--log_as_json"]) == {
        "LOG_OUTPUT_LEVEL": "default:debug",
        "LOG_AS_JSON": "true",
    }


@pytest.mark.parametrize("argv", [["--bogus"], ["positional"], ["--"], ["--=x"]])
def test_unknown_or_malformed_flags_are_refused(argv):
    with pytest.raises(ConfigError):
        flags_to_env(argv)


def test_istio_level_spec_is_converted_for_logs_py():
    assert istio_level_spec("default:info,cni-plugin:debug") == "info,cni-plugin=debug"
    assert istio_level_spec("warn") == "warn"
    logs.parse_level_spec(cfg(LOG_OUTPUT_LEVEL="default:debug,cni-agent:warn").log_output_level)


def test_dump_is_json_ready():
    import json

    dumped = cfg(AMBIENT_ENABLED="true").dump()
    json.dumps(dumped)
    assert dumped["ztunnel_uds_address"] == "/var/run/ztunnel/ztunnel.sock"
    assert dumped["enablement_selectors"][0]["podSelector"]["matchLabels"] == {
        "istio.io/dataplane-mode": "ambient"
    }


@given(st.lists(st.text(max_size=20), max_size=6))
def test_flag_parser_returns_env_or_config_error(argv):
    try:
        out = flags_to_env(argv)
    except ConfigError:
        return
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in out.items())


@given(
    st.dictionaries(
        st.sampled_from(
            [
                "AMBIENT_ENABLED",
                "MONITORING_PORT",
                "EXCLUDE_NAMESPACES",
                "HOST_PROBE_SNAT_IP",
                "POD_SOURCE_POLL_INTERVAL",
                "KUBECONFIG_MODE",
                "AMBIENT_ENABLEMENT_SELECTOR",
            ]
        ),
        st.text(max_size=30),
        max_size=4,
    )
)
def test_from_env_returns_config_or_config_error(env):
    try:
        AgentConfig.from_env(env, hostname="h")
    except ConfigError:
        pass


@pytest.mark.parametrize(
    "env",
    [
        {"ISTIO_OWNED_CNI_CONFIG": "true"},
        {"ISTIO_OWNED_CNI_CONFIG": "1"},
        {"ISTIO_OWNED_CNI_CONFIG_FILENAME": "02-istio-cni.conflist"},
    ],
)
def test_istio_owned_cni_config_is_refused_not_ignored(env):
    """A setting we accept must act: the owned conflist is not written, so asking for it stops
    the agent with what to change (it used to be ignored silently)."""
    with pytest.raises(ConfigError, match="owned config file is not supported") as exc:
        cfg(**env)
    assert "istioOwnedCNIConfig=false" in (exc.value.hint or "")


def test_istio_owned_cni_config_off_is_accepted():
    assert cfg(ISTIO_OWNED_CNI_CONFIG="false").chained_cni_plugin
    assert load(["--istio-owned-cni-config=false"], {}, hostname="h").chained_cni_plugin
