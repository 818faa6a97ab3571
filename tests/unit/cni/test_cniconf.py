"""CNI plugin inputs and outputs: environment, CNI_ARGS, stdin config per cniVersion, prevResult,
the result/error/version objects, the /cmdadd body, and the HTTP response parser."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ambient_mesh.cni.cniconf import (
    SUPPORTED_VERSIONS,
    CniAddEvent,
    CniError,
    ErrorCode,
    IPConfig,
    K8sArgs,
    decode_add_event,
    encode_add_event,
    parse_cni_args,
    parse_env,
    parse_plugin_conf,
    render_error,
    render_result,
    render_version,
    validate_container_id,
    validate_interface_name,
)
from ambient_mesh.cni.enablement import DEFAULT_ENABLEMENT_SELECTORS
from ambient_mesh.errors import ProtocolError

ADD_ENV = {
    "CNI_COMMAND": "ADD",
    "CNI_CONTAINERID": "abc123",
    "CNI_NETNS": "/var/run/netns/cni-1",
    "CNI_IFNAME": "eth0",
    "CNI_PATH": "/opt/cni/bin",
}


def prev_result(version: str) -> dict:
    """A dual-stack result as a primary plugin of `version` prints it."""
    ips = [
        {"address": "10.244.1.5/24", "gateway": "10.244.1.1", "interface": 2},
        {"address": "fd00:10:244:1::5/64", "gateway": "fd00:10:244:1::1", "interface": 2},
    ]
    if version.startswith("0."):
        ips[0]["version"] = "4"
        ips[1]["version"] = "6"
    return {
        "cniVersion": version,
        "interfaces": [{"name": "eth0", "mac": "aa:bb:cc:dd:ee:ff", "sandbox": "/var/run/netns/cni-1"}],
        "ips": ips,
        "routes": [{"dst": "0.0.0.0/0"}],
        "dns": {},
    }


def conf_bytes(version: str = "1.0.0", **extra) -> bytes:
    doc = {"cniVersion": version, "name": "k8s-pod-network", "type": "istio-cni", **extra}
    return json.dumps(doc).encode()


# -- environment ----------------------------------------------------------------------------------


def test_env_add_complete():
    env = parse_env({**ADD_ENV, "CNI_ARGS": "K8S_POD_NAME=a"})
    assert (env.command, env.container_id, env.netns, env.ifname, env.args) == (
        "ADD",
        "abc123",
        "/var/run/netns/cni-1",
        "eth0",
        "K8S_POD_NAME=a",
    )


def test_env_missing_variables_named_like_skel():
    with pytest.raises(CniError) as err:
        parse_env({"CNI_COMMAND": "ADD", "CNI_IFNAME": "eth0"})
    assert err.value.code == ErrorCode.INVALID_ENVIRONMENT_VARIABLES
    assert err.value.msg == "required env variables [CNI_CONTAINERID,CNI_NETNS,CNI_PATH] missing"


def test_env_del_does_not_need_netns_and_version_needs_nothing():
    assert (
        parse_env({k: v for k, v in ADD_ENV.items() if k != "CNI_NETNS"} | {"CNI_COMMAND": "DEL"}).netns == ""
    )
    assert parse_env({"CNI_COMMAND": "VERSION"}).command == "VERSION"


def test_env_unknown_command():
    with pytest.raises(CniError, match="unknown CNI_COMMAND: FROB"):
        parse_env({"CNI_COMMAND": "FROB"})


@pytest.mark.parametrize(
    ("ifname", "ok"),
    [
        ("eth0", True),
        ("a" * 15, True),
        ("a" * 16, False),
        ("", False),
        (".", False),
        ("..", False),
        ("e/0", False),
        ("e 0", False),
        ("e:0", False),
    ],
)
def test_interface_name(ifname, ok):
    if ok:
        validate_interface_name(ifname)
    else:
        with pytest.raises(CniError) as err:
            validate_interface_name(ifname)
        assert err.value.code == ErrorCode.INVALID_ENVIRONMENT_VARIABLES


def test_container_id():
    validate_container_id("0123abc_def.x-y")
    with pytest.raises(CniError) as err:
        validate_container_id("")
    assert err.value.code == ErrorCode.UNKNOWN_CONTAINER
    with pytest.raises(CniError) as err:
        validate_container_id("-bad")
    assert err.value.code == ErrorCode.INVALID_ENVIRONMENT_VARIABLES


# -- CNI_ARGS ---------------------------------------------------------------------------------------

CONTAINERD_ARGS = (
    "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;"
    "K8S_POD_INFRA_CONTAINER_ID=abc123;K8S_POD_UID=1b2c3d"
)


def test_cni_args_containerd():
    assert parse_cni_args(CONTAINERD_ARGS) == K8sArgs(
        pod_name="web-0", pod_namespace="default", pod_infra_container_id="abc123", pod_uid="1b2c3d"
    )


def test_cni_args_empty_is_not_a_pod():
    assert parse_cni_args("") == K8sArgs()


def test_cni_args_unknown_key_needs_ignore_unknown():
    with pytest.raises(CniError, match="unknown args"):
        parse_cni_args("K8S_POD_NAME=a;FOO=bar")
    assert parse_cni_args("K8S_POD_NAME=a;FOO=bar;IgnoreUnknown=true").pod_name == "a"
    with pytest.raises(CniError, match="unknown args"):
        parse_cni_args("K8S_POD_NAME=a;FOO=bar;IgnoreUnknown=0")


@pytest.mark.parametrize(
    "bad", ["K8S_POD_NAME", "K8S_POD_NAME=a=b", "K8S_POD_NAME=a;", ";", "IgnoreUnknown=maybe"]
)
def test_cni_args_invalid(bad):
    with pytest.raises(CniError) as err:
        parse_cni_args(bad)
    assert err.value.code == ErrorCode.INVALID_ENVIRONMENT_VARIABLES


@given(st.text(max_size=200))
def test_cni_args_never_crash(text):
    try:
        result = parse_cni_args(text)
    except CniError as exc:
        assert exc.code == ErrorCode.INVALID_ENVIRONMENT_VARIABLES
    else:
        assert isinstance(result, K8sArgs)


# -- stdin config, every supported version -----------------------------------------------------


@pytest.mark.parametrize("version", ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"])
def test_conf_with_prev_result_each_version(version):
    prev = prev_result(version)
    conf = parse_plugin_conf(conf_bytes(version, prevResult=prev, ambient_enabled=True))
    assert conf.cni_version == version
    assert conf.ambient_enabled
    assert conf.prev_result is not None
    assert conf.prev_result.ips == (
        IPConfig(address="10.244.1.5", prefix_len=24, interface=2, gateway="10.244.1.1"),
        IPConfig(address="fd00:10:244:1::5", prefix_len=64, interface=2, gateway="fd00:10:244:1::1"),
    )
    # A chained plugin that changes nothing hands the result on as it came.
    assert json.loads(render_result(conf)) == prev


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
def test_conf_without_prev_result_gives_empty_result(version):
    conf = parse_plugin_conf(conf_bytes(version))
    assert conf.prev_result is None
    assert json.loads(render_result(conf)) == {"cniVersion": version, "dns": {}}


def test_conf_istio_keys():
    conf = parse_plugin_conf(
        conf_bytes(
            "0.3.1",
            plugin_log_level="DEBUG",
            cni_agent_run_dir="/run/x/",
            ambient_enabled=True,
            enablement_selectors=[s.to_json() for s in DEFAULT_ENABLEMENT_SELECTORS],
            exclude_namespaces=["kube-system"],
            pod_namespace="istio-system",
            native_nftables=True,
            enable_ambient_detection_retry=True,
            ambient_pod_source={"directory": "/etc/mesh"},
            kubernetes={"kubeconfig": "ignored"},
        )
    )
    assert conf.plugin_log_level == "debug"
    assert conf.cni_event_socket == "/run/x/pluginevent.sock"
    assert conf.log_socket == "/run/x/log.sock"
    assert conf.enablement_selectors == DEFAULT_ENABLEMENT_SELECTORS
    assert conf.exclude_namespaces == ("kube-system",)
    assert (conf.pod_namespace, conf.native_nftables, conf.enable_ambient_detection_retry) == (
        "istio-system",
        True,
        True,
    )
    assert conf.pod_source_directory == "/etc/mesh"


def test_conf_defaults_and_nulls():
    conf = parse_plugin_conf(
        conf_bytes(cni_agent_run_dir=None, exclude_namespaces=None, enablement_selectors=None)
    )
    assert conf.cni_event_socket == "/var/run/istio-cni/pluginevent.sock"
    assert (conf.ambient_enabled, conf.enablement_selectors, conf.exclude_namespaces) == (False, (), ())


@pytest.mark.parametrize(
    ("stdin", "code"),
    [
        (b"", ErrorCode.DECODING_FAILURE),
        (b"{", ErrorCode.DECODING_FAILURE),
        (b"[]", ErrorCode.DECODING_FAILURE),
        (b'{"cniVersion": "1.0.0"}', ErrorCode.INVALID_NETWORK_CONFIG),
        (b'{"cniVersion": "1.0.0", "name": "bad name"}', ErrorCode.INVALID_NETWORK_CONFIG),
        (b'{"cniVersion": 1, "name": "n"}', ErrorCode.DECODING_FAILURE),
        (b'{"name": "n"}', ErrorCode.INCOMPATIBLE_CNI_VERSION),  # defaults to 0.1.0
        (b'{"cniVersion": "0.2.0", "name": "n"}', ErrorCode.INCOMPATIBLE_CNI_VERSION),
        (b'{"cniVersion": "2.0.0", "name": "n"}', ErrorCode.INCOMPATIBLE_CNI_VERSION),
        (conf_bytes(ambient_enabled="yes"), ErrorCode.INVALID_NETWORK_CONFIG),
        (conf_bytes(exclude_namespaces=[1]), ErrorCode.INVALID_NETWORK_CONFIG),
        (conf_bytes(plugin_log_level="loud"), ErrorCode.INVALID_NETWORK_CONFIG),
        (conf_bytes(ambient_pod_source={"directory": 3}), ErrorCode.INVALID_NETWORK_CONFIG),
        (
            conf_bytes(
                enablement_selectors=[{"podSelector": {"matchExpressions": [{"key": "k", "operator": "In"}]}}]
            ),
            ErrorCode.INVALID_NETWORK_CONFIG,
        ),
        (conf_bytes(prevResult=[]), ErrorCode.INVALID_NETWORK_CONFIG),
        (conf_bytes(prevResult={"ips": [{"address": "10.0.0.1"}]}), ErrorCode.INVALID_NETWORK_CONFIG),
        (conf_bytes(prevResult={"ips": [{"address": "10.0.0.1/33"}]}), ErrorCode.INVALID_NETWORK_CONFIG),
        (
            conf_bytes(prevResult={"ips": [{"address": "10.0.0.1/24", "gateway": "x"}]}),
            ErrorCode.INVALID_NETWORK_CONFIG,
        ),
        (
            conf_bytes(prevResult={"ips": [{"address": "10.0.0.1/24", "interface": "0"}]}),
            ErrorCode.INVALID_NETWORK_CONFIG,
        ),
        (conf_bytes(prevResult={"ips": [{"address": "fe80::1%eth0/64"}]}), ErrorCode.INVALID_NETWORK_CONFIG),
    ],
)
def test_conf_invalid(stdin, code):
    with pytest.raises(CniError) as err:
        parse_plugin_conf(stdin)
    assert err.value.code == code


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)
conf_keys = st.sampled_from(
    [
        "cniVersion",
        "name",
        "type",
        "prevResult",
        "ambient_enabled",
        "enablement_selectors",
        "exclude_namespaces",
        "plugin_log_level",
        "cni_agent_run_dir",
        "ambient_pod_source",
        "pod_namespace",
    ]
)


@given(st.dictionaries(conf_keys, json_values, max_size=8), st.binary(max_size=40))
def test_conf_arbitrary_json_is_a_conf_or_our_error(doc, noise):
    for stdin in (json.dumps(doc).encode(), noise):
        try:
            conf = parse_plugin_conf(stdin)
        except CniError as exc:
            assert exc.code in {int(c) for c in ErrorCode}
            json.loads(render_error(exc))
        else:
            json.loads(render_result(conf))


# -- output objects ---------------------------------------------------------------------------------


def test_error_object():
    err = CniError(ErrorCode.TRY_AGAIN_LATER, "busy", "pod not found", hint="wait")
    assert json.loads(render_error(err, "0.4.0")) == {
        "cniVersion": "0.4.0",
        "code": 11,
        "msg": "busy",
        "details": "pod not found (hint: wait)",
    }


def test_version_object():
    assert json.loads(render_version()) == {
        "cniVersion": "1.1.0",
        "supportedVersions": ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"],
    }


# -- the /cmdadd body -------------------------------------------------------------------------------


def test_add_event_golden():
    event = CniAddEvent(
        netns="/var/run/netns/cni-1",
        pod_name="web-0",
        pod_namespace="default",
        ips=(
            IPConfig(address="10.244.1.5", prefix_len=24, interface=2, gateway="10.244.1.1"),
            IPConfig(address="10.244.9.9", prefix_len=32),
            IPConfig(address="fd00::5", prefix_len=64, interface=0),
        ),
    )
    assert encode_add_event(event) == (
        b'{"Netns":"/var/run/netns/cni-1","PodName":"web-0","PodNamespace":"default","IPs":['
        b'{"Interface":2,"Address":{"IP":"10.244.1.5","Mask":"////AA=="},"Gateway":"10.244.1.1"},'
        b'{"Interface":null,"Address":{"IP":"10.244.9.9","Mask":"/////w=="},"Gateway":""},'
        b'{"Interface":0,"Address":{"IP":"fd00::5","Mask":"//////////8AAAAAAAAAAA=="},"Gateway":""}]}'
    )
    assert decode_add_event(encode_add_event(event)) == event


def test_add_event_without_prev_result_has_null_ips():
    event = CniAddEvent(netns="/n", pod_name="p", pod_namespace="ns")
    assert json.loads(encode_add_event(event))["IPs"] is None
    assert decode_add_event(encode_add_event(event)) == event


def test_add_event_decodes_go_sixteen_byte_v4_mask():
    body = b'{"Netns":"/n","PodName":"p","PodNamespace":"ns","IPs":[{"Interface":null,"Address":{"IP":"10.0.0.1","Mask":"/////////////////////w=="},"Gateway":""}]}'
    assert decode_add_event(body).ips == (IPConfig(address="10.0.0.1", prefix_len=32),)


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"[]",
        b'{"Netns": 1}',
        b'{"IPs": {}}',
        b'{"IPs": [{"Address": {"IP": "10.0.0.1", "Mask": "!!"}}]}',
        b'{"IPs": [{"Address": {"IP": "10.0.0.1", "Mask": "/wD/AA=="}}]}',  # not a prefix
        b'{"IPs": [{"Address": {"IP": "10.0.0.1", "Mask": "//////////8AAAAAAAAAAA=="}}]}',  # v6 mask on v4
        b'{"IPs": [{"Interface": true, "Address": {"IP": "10.0.0.1", "Mask": "/////w=="}}]}',
    ],
)
def test_add_event_bad_bodies(body):
    with pytest.raises(ProtocolError):
        decode_add_event(body)


ip_configs = st.one_of(
    st.builds(
        lambda ip, p, i, gw: IPConfig(
            address=str(ip), prefix_len=p, interface=i, gateway=str(gw) if gw else ""
        ),
        st.ip_addresses(v=4),
        st.integers(0, 32),
        st.none() | st.integers(0, 8),
        st.none() | st.ip_addresses(v=4),
    ),
    st.builds(
        lambda ip, p, i: IPConfig(address=str(ip), prefix_len=p, interface=i),
        st.ip_addresses(v=6).filter(lambda a: a.ipv4_mapped is None),
        st.integers(0, 128),
        st.none() | st.integers(0, 8),
    ),
)


@given(
    st.text(max_size=30),
    st.text(max_size=30),
    st.text(max_size=30),
    st.none() | st.lists(ip_configs, max_size=4),
)
def test_add_event_round_trip(netns, name, namespace, ips):
    event = CniAddEvent(
        netns=netns, pod_name=name, pod_namespace=namespace, ips=None if ips is None else tuple(ips)
    )
    assert decode_add_event(encode_add_event(event)) == event


@given(st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()))
def test_add_event_decoder_never_crashes(body):
    try:
        decode_add_event(body)
    except ProtocolError:
        pass
