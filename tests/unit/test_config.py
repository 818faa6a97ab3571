"""ZtunnelConfig.from_env: defaults, every variable's valid and invalid values, validation rules."""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from ambient_mesh.config import (
    AuthKind,
    ProxyMode,
    ProxyWorkloadInfo,
    RootCertKind,
    ZtunnelConfig,
    format_duration,
    parse_duration,
)
from ambient_mesh.errors import ConfigError
from ambient_mesh.net import SocketAddr, ip_address


def build(env: dict[str, str] | None = None, *, lo_v6_off: bool = False, files: tuple[str, ...] = ()):
    return ZtunnelConfig.from_env(
        env or {}, ipv6_disabled_on_lo=lambda: lo_v6_off, path_exists=lambda p: p in files
    )


def fails(env: dict[str, str], variable: str, **kw) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        build(env, **kw)
    assert info.value.source == variable
    assert variable in str(info.value)
    return info.value


def test_defaults_match_ztunnel():
    c = build()
    assert c.proxy_mode is ProxyMode.SHARED
    assert c.proxy_workload_info is None
    assert c.xds_address == "https://localhost:15012"
    assert c.ca_address == "https://localhost:15012"
    assert c.fake_ca is False
    assert c.local_xds_path is None and c.local_xds is None
    assert c.xds_on_demand is False
    assert c.xds_root_ca.kind is RootCertKind.FILE
    assert c.xds_root_ca.value == "./var/run/secrets/istio/root-cert.pem"
    assert c.auth_token.kind is AuthKind.NONE
    assert c.cluster_id == "Kubernetes"
    assert c.cluster_domain == "cluster.local"
    assert c.trust_domain == "cluster.local"
    assert c.instance_ip == ip_address("1.1.1.1")
    assert c.network == ""
    assert c.secret_ttl_s == 24 * 3600
    assert c.pool_max_streams_per_connection == 100
    assert c.pool_unused_release_timeout_s == 300
    assert c.http2_stream_window_size == 4 * 1024 * 1024
    assert c.http2_connection_window_size == 16 * 1024 * 1024
    assert c.http2_frame_size == 1024 * 1024
    assert (c.keepalive_enabled, c.keepalive_time_s, c.keepalive_interval_s, c.keepalive_retries) == (
        True,
        180,
        180,
        9,
    )
    assert c.packet_mark == 1337
    assert c.inpod_uds == "/var/run/ztunnel/ztunnel.sock"
    assert c.inpod_port_reuse is True
    assert c.enable_orig_src is None
    assert c.ipv6_enabled is True
    assert c.termination_deadline_s == 5
    assert c.localhost_app_tunnel is True
    assert c.enable_response_baggage is True
    assert c.socks5_enabled is False
    assert c.tls12_enabled is False
    assert c.dns_proxy_enabled is True
    assert c.log_format == "plain" and c.log_level == "info"
    assert c.istio_meta == {}
    assert str(c.outbound_addr) == "[::]:15001"
    assert str(c.inbound_addr) == "[::]:15008"
    assert str(c.inbound_plaintext_addr) == "[::]:15006"
    assert str(c.socks5_addr) == "127.0.0.1:15080"
    assert str(c.admin_addr) == "127.0.0.1:15000"
    assert str(c.stats_addr) == "[::]:15020"
    assert str(c.readiness_addr) == "[::]:15021"
    assert c.illegal_ports == {15001, 15006, 15008}
    assert c.istio_version == "unknown"
    assert c.self_proxy_enabled is False


def test_istiod_default_inside_kubernetes():
    c = build({"KUBERNETES_SERVICE_HOST": "10.96.0.1"})
    assert c.xds_address == "https://istiod.istio-system.svc:15012"
    assert c.ca_address == "https://istiod.istio-system.svc:15012"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("", None),
        ("istiod.example:15012", "https://istiod.example:15012"),
        ("http://127.0.0.1:15010", "http://127.0.0.1:15010"),
        ("https://[::1]:15012", "https://[::1]:15012"),
    ],
)
def test_xds_address(value, expected):
    assert build({"XDS_ADDRESS": value}).xds_address == expected


@pytest.mark.parametrize("value", ["ftp://x:1", "https://", "https://host:99999", "https://host:abc"])
def test_xds_address_invalid(value):
    fails({"XDS_ADDRESS": value}, "XDS_ADDRESS")


def test_ca_address_and_fake_ca():
    assert build({"CA_ADDRESS": "ca.example:15012"}).ca_address == "https://ca.example:15012"
    c = build({"FAKE_CA": "true", "CA_ADDRESS": "ca.example:15012"})
    assert c.fake_ca is True and c.ca_address is None
    fails({"CA_ADDRESS": "gopher://x:1"}, "CA_ADDRESS")


def test_dedicated_mode():
    c = build({"PROXY_MODE": "dedicated", "PROXY_WORKLOAD_INFO": "ns1/pod-a/sa-a"})
    assert c.proxy_mode is ProxyMode.DEDICATED
    assert c.proxy_workload_info == ProxyWorkloadInfo(namespace="ns1", name="pod-a", service_account="sa-a")
    assert c.packet_mark is None
    assert (
        build({"PROXY_MODE": "dedicated", "PROXY_WORKLOAD_INFO": "a/b/c", "PACKET_MARK": "7"}).packet_mark
        == 7
    )


def test_dedicated_mode_requires_workload_info():
    err = fails({"PROXY_MODE": "dedicated"}, "PROXY_WORKLOAD_INFO")
    assert "namespace/name/serviceaccount" in err.message


@pytest.mark.parametrize("value", ["a/b", "a/b/c/d", "a//c", "/b/c", "abc"])
def test_workload_info_invalid(value):
    fails({"PROXY_WORKLOAD_INFO": value}, "PROXY_WORKLOAD_INFO")


@pytest.mark.parametrize("value", ["Shared", "sidecar", "DEDICATED"])
def test_proxy_mode_invalid(value):
    err = fails({"PROXY_MODE": value}, "PROXY_MODE")
    assert "shared or dedicated" in err.message


BOOLEANS = [
    ("FAKE_CA", "fake_ca"),
    ("KEEPALIVE_ENABLED", "keepalive_enabled"),
    ("USER_TIMEOUT_ENABLED", "user_timeout_enabled"),
    ("INPOD_PORT_REUSE", "inpod_port_reuse"),
    ("ENABLE_ORIG_SRC", "enable_orig_src"),
    ("IPV6_ENABLED", "ipv6_enabled"),
    ("LOCALHOST_APP_TUNNEL", "localhost_app_tunnel"),
    ("ENABLE_RESPONSE_BAGGAGE", "enable_response_baggage"),
    ("UNSTABLE_ENABLE_SOCKS5", "socks5_enabled"),
    ("TLS12_ENABLED", "tls12_enabled"),
    ("AUTHZ_POLICY_INFO_LOGGING", "authz_policy_info_logging"),
    ("ENABLE_PROXY", "enable_proxy"),
]


@pytest.mark.parametrize(("variable", "attr"), BOOLEANS)
@pytest.mark.parametrize(
    ("value", "expected"), [("true", True), ("TRUE", True), ("1", True), ("False", False), ("0", False)]
)
def test_booleans(variable, attr, value, expected):
    assert getattr(build({variable: value}), attr) is expected


@pytest.mark.parametrize(("variable", "attr"), BOOLEANS)
@pytest.mark.parametrize("value", ["yes", "on", "2", "t"])
def test_booleans_invalid(variable, attr, value):
    err = fails({variable: value}, variable)
    assert "true, false, 1 or 0" in err.message


def test_xds_on_demand_needs_dns_proxy_off():
    err = fails({"XDS_ON_DEMAND": "true"}, "XDS_ON_DEMAND")
    assert "DNS" in err.message
    c = build({"XDS_ON_DEMAND": "true", "ISTIO_META_DNS_CAPTURE": "false"})
    assert c.xds_on_demand is True and c.dns_proxy_enabled is False


def test_dns_capture_only_true_enables():
    assert build({"ISTIO_META_DNS_CAPTURE": "TRUE"}).dns_proxy_enabled is True
    assert build({"ISTIO_META_DNS_CAPTURE": "no"}).dns_proxy_enabled is False


def test_proxy_and_dns_both_disabled_is_fatal():
    fails({"ENABLE_PROXY": "false", "ISTIO_META_DNS_CAPTURE": "false"}, "ENABLE_PROXY")


def test_dns_proxy_addr():
    assert str(build({"ISTIO_META_DNS_PROXY_ADDR": "localhost:5353"}).dns_proxy_addr) == "127.0.0.1:5353"
    assert str(build({"ISTIO_META_DNS_PROXY_ADDR": "[::1]:53"}).dns_proxy_addr) == "[::1]:53"
    fails({"ISTIO_META_DNS_PROXY_ADDR": "dns:53"}, "ISTIO_META_DNS_PROXY_ADDR")


def test_local_xds_mutually_exclusive():
    assert build({"LOCAL_XDS_PATH": "/etc/local.yaml"}).local_xds_path == "/etc/local.yaml"
    assert build({"LOCAL_XDS": "workloads: []"}).local_xds == "workloads: []"
    err = fails({"LOCAL_XDS": "workloads: []", "LOCAL_XDS_PATH": "/x.yaml"}, "LOCAL_XDS")
    assert "LOCAL_XDS_PATH" in err.message


def test_root_certs():
    pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    c = build({"XDS_ROOT_CA": "/etc/root.pem", "CA_ROOT_CA": "SYSTEM"}, files=("/etc/root.pem",))
    assert (c.xds_root_ca.kind, c.xds_root_ca.value) == (RootCertKind.FILE, "/etc/root.pem")
    assert c.ca_root_ca.kind is RootCertKind.SYSTEM
    c = build({"CA_ROOT_CA": pem})
    assert (c.ca_root_ca.kind, c.ca_root_ca.value) == (RootCertKind.STATIC, pem)
    fails({"XDS_ROOT_CA": "/no/such/file.pem"}, "XDS_ROOT_CA")
    fails({"CA_ROOT_CA": "/no/such/file.pem"}, "CA_ROOT_CA")


def test_auth_token():
    assert build(files=("./var/run/secrets/tokens/istio-token",)).auth_token.kind is AuthKind.TOKEN_FILE
    c = build({"AUTH_TOKEN": "/tok"}, files=("/tok",))
    assert (c.auth_token.kind, c.auth_token.value) == (AuthKind.TOKEN_FILE, "/tok")
    c = build({"AUTH_TOKEN": "s3cret"})
    assert (c.auth_token.kind, c.auth_token.value) == (AuthKind.STATIC, "s3cret")
    assert "s3cret" not in repr(c)
    assert "s3cret" not in json.dumps(c.to_dump())


def test_cluster_id_precedence():
    assert build({"CLUSTER_ID": "c1"}).cluster_id == "c1"
    assert build({"CLUSTER_ID": "c1", "ISTIO_META_CLUSTER_ID": "c2"}).cluster_id == "c2"


def test_plain_strings():
    env = {
        "CLUSTER_DOMAIN": "example.org",
        "TRUST_DOMAIN": "td.example",
        "POD_NAME": "ztunnel-abc",
        "POD_NAMESPACE": "istio-system",
        "SERVICE_ACCOUNT": "ztunnel",
        "NODE_NAME": "node-1",
        "NETWORK": "net-a",
        "INPOD_UDS": "/tmp/z.sock",
        "ROOT_CA_DIR": "/etc/cacerts",
        "CRL_PATH": "/etc/crl.pem",
        "ALT_XDS_HOSTNAME": "istiod.alt",
        "ALT_CA_HOSTNAME": "ca.alt",
        "PREFERED_SERVICE_NAMESPACE": "prod",
        "INSTANCE_IP": "10.0.0.5",
    }
    c = build(env)
    assert (c.cluster_domain, c.trust_domain) == ("example.org", "td.example")
    assert (c.pod_name, c.pod_namespace, c.service_account) == ("ztunnel-abc", "istio-system", "ztunnel")
    assert (c.node_name, c.network, c.inpod_uds) == ("node-1", "net-a", "/tmp/z.sock")
    assert (c.root_ca_dir, c.crl_path) == ("/etc/cacerts", "/etc/crl.pem")
    assert (c.alt_xds_hostname, c.alt_ca_hostname) == ("istiod.alt", "ca.alt")
    assert c.prefered_service_namespace == "prod"
    assert c.instance_ip == ip_address("10.0.0.5")
    assert c.self_proxy_enabled is True
    assert (
        build(env | {"PROXY_MODE": "dedicated", "PROXY_WORKLOAD_INFO": "a/b/c"}).self_proxy_enabled is False
    )


def test_instance_ip_invalid():
    fails({"INSTANCE_IP": "not-an-ip"}, "INSTANCE_IP")


def test_headers_and_meta():
    c = build(
        {
            "XDS_HEADER_X_TENANT": "t1",
            "CA_HEADER_AUTHORIZATION": "Bearer abc",
            "ISTIO_META_ISTIO_VERSION": "1.26.0",
            "ISTIO_META_FOO": "bar",
            "ISTIO_METAJSON_LABELS": '{"app": "z"}',
        }
    )
    assert c.xds_headers == {"x_tenant": "t1"}
    assert c.ca_headers == {"authorization": "Bearer abc"}
    assert c.istio_meta == {"FOO": "bar", "ISTIO_VERSION": "1.26.0"}
    assert c.istio_meta_json == {"LABELS": {"app": "z"}}
    assert c.istio_version == "1.26.0"
    fails({"ISTIO_METAJSON_LABELS": "{not json"}, "ISTIO_METAJSON_LABELS")
    fails({"XDS_HEADER_BAD@NAME": "x"}, "XDS_HEADER_BAD@NAME")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("24h", 86400),
        ("90m", 5400),
        ("10s", 10),
        ("1h30m", 5400),
        ("500ms", 0.5),
        ("1.5h", 5400),
        ("2h45m30s", 9930),
    ],
)
def test_durations(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)
    assert build({"SECRET_TTL": text}).secret_ttl_s == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "10", "h", "1d", "-5s", "1h 30m", "5 s", "1.h.m"])
def test_durations_invalid(text):
    with pytest.raises(ValueError):
        parse_duration(text)


@pytest.mark.parametrize(
    "variable", ["SECRET_TTL", "POOL_UNUSED_RELEASE_TIMEOUT", "KEEPALIVE_TIME", "KEEPALIVE_INTERVAL"]
)
@pytest.mark.parametrize("value", ["10", "ten seconds", "0s", "0"])
def test_duration_variables_invalid(variable, value):
    err = fails({variable: value}, variable)
    assert "24h" in err.message


def test_duration_variables_valid():
    c = build({"POOL_UNUSED_RELEASE_TIMEOUT": "30s", "KEEPALIVE_TIME": "1m", "KEEPALIVE_INTERVAL": "15s"})
    assert (c.pool_unused_release_timeout_s, c.keepalive_time_s, c.keepalive_interval_s) == (30, 60, 15)


@given(st.text(alphabet=st.sampled_from(list("0123456789.hmsun\u00b5 -x")), max_size=20))
def test_parse_duration_total(text):
    try:
        seconds = parse_duration(text)
    except ValueError:
        return
    assert seconds >= 0


@given(st.floats(min_value=0.001, max_value=10_000_000, allow_nan=False))
@example(10.84375)  # :g formatting kept 6 significant digits and gave 10.8438s
def test_format_duration_round_trips(seconds):
    assert parse_duration(format_duration(seconds)) == pytest.approx(seconds, rel=1e-6, abs=1e-6)


INTEGERS = [
    ("POOL_MAX_STREAMS_PER_CONNECTION", "pool_max_streams_per_connection", "250", 250, ["0", "-1", "x"]),
    ("HTTP2_STREAM_WINDOW_SIZE", "http2_stream_window_size", "65535", 65535, ["0", "2147483648", "1.5"]),
    ("HTTP2_CONNECTION_WINDOW_SIZE", "http2_connection_window_size", "1048576", 1048576, ["0", "big"]),
    ("HTTP2_FRAME_SIZE", "http2_frame_size", "16384", 16384, ["16383", "16777216", "1MiB"]),
    ("KEEPALIVE_RETRIES", "keepalive_retries", "0", 0, ["-1", "nine"]),
    ("PACKET_MARK", "packet_mark", "4096", 4096, ["4294967296", "0x539"]),
    ("TERMINATION_GRACE_PERIOD_SECONDS", "termination_deadline_s", "30", 25, ["-3", "30s"]),
]


@pytest.mark.parametrize(("variable", "attr", "good", "expected", "bad"), INTEGERS)
def test_integers(variable, attr, good, expected, bad):
    assert getattr(build({variable: good}), attr) == expected
    for value in bad:
        fails({variable: value}, variable)


@pytest.mark.parametrize(
    ("grace", "deadline"), [("30", 25), ("11", 6), ("10", 9), ("2", 1), ("1", 1), ("0", 1)]
)
def test_termination_deadline_from_grace_period(grace, deadline):
    assert build({"TERMINATION_GRACE_PERIOD_SECONDS": grace}).termination_deadline_s == deadline


def test_connection_termination_deadline_wins():
    c = build({"CONNECTION_TERMINATION_DEADLINE": "2s", "TERMINATION_GRACE_PERIOD_SECONDS": "30"})
    assert c.termination_deadline_s == 2
    fails({"CONNECTION_TERMINATION_DEADLINE": "soon"}, "CONNECTION_TERMINATION_DEADLINE")


def test_log_settings():
    c = build({"LOG_FORMAT": "JSON", "RUST_LOG": "warn,access=debug,ztunnel::proxy=trace"})
    assert (c.log_format, c.log_level) == ("json", "warn,access=debug,ztunnel::proxy=trace")
    fails({"LOG_FORMAT": "yaml"}, "LOG_FORMAT")
    err = fails({"RUST_LOG": "loud"}, "RUST_LOG")
    assert "target=level" in err.message
    fails({"RUST_LOG": "access=chatty"}, "RUST_LOG")


def test_ipv6_disabled_uses_ipv4_wildcards():
    for c in (build({"IPV6_ENABLED": "false"}), build(lo_v6_off=True)):
        assert c.ipv6_enabled is False
        assert str(c.outbound_addr) == "0.0.0.0:15001"
        assert str(c.inbound_addr) == "0.0.0.0:15008"
        assert str(c.inbound_plaintext_addr) == "0.0.0.0:15006"
        assert str(c.stats_addr) == "0.0.0.0:15020"
        assert str(c.readiness_addr) == "0.0.0.0:15021"
        assert str(c.admin_addr) == "127.0.0.1:15000"


ADDRESSES = [
    ("OUTBOUND_ADDR", "outbound_addr"),
    ("INBOUND_ADDR", "inbound_addr"),
    ("INBOUND_PLAINTEXT_ADDR", "inbound_plaintext_addr"),
    ("SOCKS5_ADDR", "socks5_addr"),
    ("ADMIN_ADDR", "admin_addr"),
    ("STATS_ADDR", "stats_addr"),
    ("READINESS_ADDR", "readiness_addr"),
]


@pytest.mark.parametrize(("variable", "attr"), ADDRESSES)
def test_listener_addresses(variable, attr):
    assert getattr(build({variable: "127.0.0.1:0"}), attr) == SocketAddr.of("127.0.0.1", 0)
    assert getattr(build({variable: "[::1]:1234"}), attr) == SocketAddr.of("::1", 1234)
    for bad in ("localhost:80", "127.0.0.1", "::1:80", "127.0.0.1:70000"):
        err = fails({variable: bad}, variable)
        assert "ip:port" in err.message


def test_admin_addr_must_be_loopback():
    err = fails({"ADMIN_ADDR": "0.0.0.0:15000"}, "ADMIN_ADDR")
    assert "loopback" in err.message


def test_socks5_adds_illegal_port():
    assert build({"UNSTABLE_ENABLE_SOCKS5": "true"}).illegal_ports == {15001, 15006, 15008, 15080}


def test_to_dump_is_camel_case_json():
    c = build({"ISTIO_META_FOO": "bar", "LOCAL_XDS": "workloads: []"})
    dump = c.to_dump()
    assert json.loads(json.dumps(dump)) == dump
    assert dump["proxyMode"] == "shared"
    assert dump["xdsAddress"] == "https://localhost:15012"
    assert dump["secretTtl"] == "24h"
    assert dump["poolUnusedReleaseTimeout"] == "5m"
    assert dump["terminationDeadline"] == "5s"
    assert dump["http2StreamWindowSize"] == 4194304
    assert dump["packetMark"] == 1337
    assert dump["outboundAddr"] == "[::]:15001"
    assert dump["istioMeta"] == {"FOO": "bar"}
    assert dump["localXds"] == "<inline>"
    assert dump["illegalPorts"] == [15001, 15006, 15008]
    assert all("_" not in key for key in dump)


def test_config_is_frozen():
    c = build()
    with pytest.raises(AttributeError):
        c.proxy_mode = ProxyMode.DEDICATED  # type: ignore[misc]


# -- at start: unsupported settings named, effective configuration logged ----------------------------


def test_unsupported_istio_variables_are_named_in_one_warning(caplog):
    from ambient_mesh.config import UNSUPPORTED_VARIABLES, log_startup

    env = {
        "PROXY_CONFIG": "{}",
        "ZTUNNEL_CPU_LIMIT": "2",
        "COMPLIANCE_POLICY": "pqc",
        "ZTUNNEL_WORKER_THREADS": "2",
    }
    caplog.set_level("INFO", logger="ambient_mesh.config")
    log_startup(build(env), env, path_exists=lambda p: p == "./etc/istio/config/mesh")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    (line,) = warnings
    for name in ("PROXY_CONFIG", "ZTUNNEL_CPU_LIMIT", "COMPLIANCE_POLICY", "./etc/istio/config/mesh"):
        assert name in line
    assert "ZTUNNEL_WORKER_THREADS (" not in line  # supported now: never named as unsupported
    assert set(UNSUPPORTED_VARIABLES) == {
        "PROXY_CONFIG",
        "ZTUNNEL_CPU_LIMIT",
        "ZTUNNEL_RESOURCE_CPU_LIMIT",
        "ZTUNNEL_RESOURCE_CPU_REQUEST",
        "COMPLIANCE_POLICY",
    }


def test_no_warning_when_nothing_unsupported_is_set(caplog):
    from ambient_mesh.config import log_startup

    caplog.set_level("INFO", logger="ambient_mesh.config")
    log_startup(build({}), {}, path_exists=lambda p: False)
    assert [r.levelname for r in caplog.records] == ["INFO"]


def test_effective_configuration_is_logged_as_yaml_without_secrets(caplog):
    import yaml

    from ambient_mesh.config import log_startup

    env = {
        "KEEPALIVE_TIME": "1m",
        "AUTH_TOKEN": "s3cret-token",
        "XDS_HEADER_AUTHORIZATION": "Bearer s3cret",
        "CRL_PATH": "/etc/crl.pem",
        "TLS12_ENABLED": "true",
    }
    caplog.set_level("INFO", logger="ambient_mesh.config")
    log_startup(build(env), env, path_exists=lambda p: False)
    (message,) = [r.getMessage() for r in caplog.records]
    head, _, body = message.partition("\n")
    assert head == "effective configuration:"
    dumped = yaml.safe_load(body)
    assert dumped["keepaliveTime"] == "1m" and dumped["crlPath"] == "/etc/crl.pem" and dumped["tls12Enabled"]
    assert dumped["xdsHeaders"] == {"authorization": "<redacted>"}
    assert "s3cret" not in message
    assert "PROXY_CONFIG" in dumped["unsupported"]


@pytest.mark.parametrize(
    ("value", "cpus", "expected"),
    [
        (None, 4, 1),
        ("", 4, 1),
        ("1", 4, 1),
        ("2", 4, 2),
        ("0", 3, 3),
        ("50%", 4, 2),
        ("10%", 4, 1),
        ("64", 1, 64),
    ],
)
def test_worker_threads_follow_ztunnels_grammar(value, cpus, expected):
    env = {} if value is None else {"ZTUNNEL_WORKER_THREADS": value}
    assert ZtunnelConfig.from_env(env, cpu_count=lambda: cpus).worker_threads == expected


@pytest.mark.parametrize("value", ["-1", "65", "two", "0%", "101%", "1.5"])
def test_bad_worker_threads_name_the_variable(value):
    with pytest.raises(ConfigError) as info:
        ZtunnelConfig.from_env({"ZTUNNEL_WORKER_THREADS": value})
    assert info.value.source == "ZTUNNEL_WORKER_THREADS"


def test_one_worker_says_why_at_start(caplog):
    from ambient_mesh.config import log_startup

    caplog.set_level("INFO", logger="ambient_mesh.config")
    log_startup(build({}), {})
    (message,) = [r.getMessage() for r in caplog.records]
    assert "workerThreads: 1" in message and "ztunnel's default is 2, ours is 1" in message
