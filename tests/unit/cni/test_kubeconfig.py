"""The plugin's kubeconfig: what the agent renders and when it rewrites it (kubeconfig.py), what
the plugin reads back and how it turns API answers into pods (podinfo.KubeApiPodLookup), and
which pod source the plugin picks from its config. No sockets: the API transport is a fake."""

from __future__ import annotations

import base64
import json
import os
import stat
from dataclasses import dataclass

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from ambient_mesh.cni.cniconf import PluginConf, parse_plugin_conf
from ambient_mesh.cni.kubeconfig import (
    KubeconfigError,
    KubeconfigInputs,
    KubeconfigPlan,
    KubeconfigWriter,
    plan_write,
    render_kubeconfig,
    server_url,
)
from ambient_mesh.cni.plugin import default_lookup
from ambient_mesh.cni.podinfo import (
    PLUGIN_KUBECONFIG_NAME,
    ApiReply,
    DirectoryPodLookup,
    KubeApiPodLookup,
    NamespaceInfo,
    PodInfo,
    PodLookupError,
    load_plugin_kubeconfig,
    namespace_info_from_json,
    pod_info_from_json,
)
from ambient_mesh.cni.pods import credentials_for_agent
from ambient_mesh.errors import ConfigError
from ambient_mesh.kube.kubeconfig import KubeconfigError as KubeAccessError
from ambient_mesh.kube.kubeconfig import KubeCredentials, load_kubeconfig, parse_kubeconfig

CA_PEM = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
INPUTS = KubeconfigInputs(server="https://10.96.0.1:443", token="tok-1", ca_data=CA_PEM)


# -- rendering -------------------------------------------------------------------------------------


def test_render_has_istio_cni_names_and_is_json_yaml():
    data = render_kubeconfig(INPUTS)
    doc = json.loads(data)
    assert doc == {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "local",
                "cluster": {
                    "server": "https://10.96.0.1:443",
                    "certificate-authority-data": base64.b64encode(CA_PEM).decode(),
                },
            }
        ],
        "contexts": [{"name": "istio-cni-context", "context": {"cluster": "local", "user": "istio-cni"}}],
        "current-context": "istio-cni-context",
        "preferences": {},
        "users": [{"name": "istio-cni", "user": {"token": "tok-1"}}],
    }
    # JSON is YAML: kubectl and client-go read the same document.
    assert yaml.safe_load(data) == doc
    assert render_kubeconfig(INPUTS) == data


def test_render_insecure_and_redacted():
    insecure = json.loads(
        render_kubeconfig(KubeconfigInputs(server="https://h:6443", token="t", insecure_skip_tls_verify=True))
    )
    assert insecure["clusters"][0]["cluster"] == {
        "server": "https://h:6443",
        "insecure-skip-tls-verify": True,
    }
    redacted = render_kubeconfig(INPUTS, redact=True).decode()
    assert "tok-1" not in redacted and base64.b64encode(CA_PEM).decode() not in redacted
    assert "tok-1" not in repr(INPUTS)
    assert repr(INPUTS) == f"KubeconfigInputs(https://10.96.0.1:443, CA {len(CA_PEM)} bytes, token=yes)"


@pytest.mark.parametrize(
    ("protocol", "host", "port", "url"),
    [
        ("https", "10.96.0.1", "443", "https://10.96.0.1:443"),
        ("", "api.local", "6443", "https://api.local:6443"),
        ("http", "fd00::1", "8080", "http://[fd00::1]:8080"),
        ("https", "[fd00::1]", "443", "https://[fd00::1]:443"),
    ],
)
def test_server_url(protocol, host, port, url):
    assert server_url(protocol, host, port) == url


# -- inputs ------------------------------------------------------------------------------------------


@pytest.fixture
def sa(tmp_path):
    d = tmp_path / "serviceaccount"
    d.mkdir()
    (d / "token").write_text("tok-1\n")
    (d / "ca.crt").write_bytes(CA_PEM)
    return d


def test_inputs_from_service_account(sa, tmp_path):
    inputs = KubeconfigInputs.from_service_account(host="10.96.0.1", port="443", sa_path=sa)
    assert inputs == INPUTS  # token stripped of its newline
    other_ca = tmp_path / "other.pem"
    other_ca.write_bytes(b"other")
    assert (
        KubeconfigInputs.from_service_account(
            host="10.96.0.1", port="443", sa_path=sa, ca_file=str(other_ca)
        ).ca_data
        == b"other"
    )
    (sa / "ca.crt").unlink()
    insecure = KubeconfigInputs.from_service_account(host="h", port="1", sa_path=sa, skip_tls_verify=True)
    assert (insecure.ca_data, insecure.insecure_skip_tls_verify) == (b"", True)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"host": "", "port": "443"}, "KUBERNETES_SERVICE_HOST not set"),
        ({"host": "h", "port": ""}, "KUBERNETES_SERVICE_PORT not set"),
        ({"host": "h", "port": "443", "ca_file": "/nonexistent/ca.pem"}, "cannot read the cluster CA"),
    ],
)
def test_inputs_errors(sa, kwargs, message):
    with pytest.raises(KubeconfigError, match=message):
        KubeconfigInputs.from_service_account(sa_path=sa, **kwargs)


def test_inputs_without_token(sa):
    (sa / "token").unlink()
    with pytest.raises(KubeconfigError, match="cannot read the token file"):
        KubeconfigInputs.from_service_account(host="h", port="443", sa_path=sa)


@dataclass
class FakeAccess:
    server: str = "https://api:6443"
    ca_data: bytes = CA_PEM
    insecure_skip_tls_verify: bool = False
    client_cert_data: bytes = b""
    token: str = "from-kubeconfig"

    def bearer(self) -> str:
        return self.token


def test_inputs_from_the_agents_own_access():
    assert KubeconfigInputs.from_access(FakeAccess()) == KubeconfigInputs(
        server="https://api:6443", token="from-kubeconfig", ca_data=CA_PEM
    )
    with pytest.raises(KubeconfigError, match="client certificate"):
        KubeconfigInputs.from_access(FakeAccess(client_cert_data=b"cert"))
    with pytest.raises(KubeconfigError, match="no token"):
        KubeconfigInputs.from_access(FakeAccess(token=""))


@dataclass
class FakeAgentConfig:
    kubeconfig: str = ""
    k8s_service_host: str = "10.96.0.1"
    k8s_service_port: str = "443"
    k8s_service_protocol: str = "https"
    k8s_service_account_path: object = None
    kube_ca_file: str = ""
    skip_tls_verify: bool = False


def test_inputs_for_agent(sa, tmp_path):
    assert KubeconfigInputs.for_agent(FakeAgentConfig(k8s_service_account_path=sa)) == INPUTS
    agent_kubeconfig = tmp_path / "agent.kubeconfig"
    agent_kubeconfig.write_text(
        render_kubeconfig(KubeconfigInputs(server="https://dev:6443", token="dev")).decode()
    )
    assert KubeconfigInputs.for_agent(FakeAgentConfig(kubeconfig=str(agent_kubeconfig))) == KubeconfigInputs(
        server="https://dev:6443", token="dev"
    )
    with pytest.raises(KubeconfigError, match="KUBECONFIG"):
        KubeconfigInputs.for_agent(FakeAgentConfig(kubeconfig=str(tmp_path / "missing")))


def test_agent_credentials_from_its_kubeconfig(tmp_path):
    ca = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    (tmp_path / "kubeconfig").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "ctx",
                "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u"}}],
                "clusters": [
                    {
                        "name": "c",
                        "cluster": {
                            "server": "https://10.0.0.1:6443/",
                            "certificate-authority-data": base64.b64encode(ca).decode(),
                        },
                    }
                ],
                "users": [{"name": "u", "user": {"token": "secret"}}],
            }
        )
    )
    access = credentials_for_agent(FakeAgentConfig(kubeconfig=str(tmp_path / "kubeconfig")))
    assert access.server == "https://10.0.0.1:6443" and access.bearer() == "secret" and access.ca_data == ca
    assert "secret" not in repr(access)


def test_agent_kubeconfig_errors_name_kubeconfig(tmp_path):
    (tmp_path / "k").write_text("current-context: x\ncontexts: []\n")
    with pytest.raises(ConfigError) as info:
        credentials_for_agent(FakeAgentConfig(kubeconfig=str(tmp_path / "k")))
    assert info.value.source == "KUBECONFIG"


def test_agent_in_cluster_reads_rotating_token(tmp_path):
    (tmp_path / "ca.crt").write_text("x")
    (tmp_path / "token").write_text("t1\n")
    access = credentials_for_agent(FakeAgentConfig(k8s_service_account_path=tmp_path))
    assert access.server == "https://10.96.0.1:443" and access.bearer() == "t1"
    (tmp_path / "token").write_text("t2")
    assert access.bearer() == "t2"
    with pytest.raises(ConfigError) as info:
        credentials_for_agent(FakeAgentConfig(k8s_service_host="", k8s_service_account_path=tmp_path))
    assert info.value.source == "KUBERNETES_SERVICE_HOST"


# -- when to write ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("current", "mode", "plan"),
    [
        (None, None, KubeconfigPlan(write=True, reason="missing")),
        (b"new", 0o100600, KubeconfigPlan(write=False, reason="up to date")),
        (
            b"old",
            0o100600,
            KubeconfigPlan(write=True, reason="content changed (token rotated, CA or server changed)"),
        ),
        (b"new", 0o100644, KubeconfigPlan(write=True, reason="mode 644, want 600")),
    ],
)
def test_plan_write(current, mode, plan):
    assert plan_write(current=current, current_mode=mode, desired=b"new", mode=0o600) == plan


def test_writer_writes_once_then_on_rotation_then_removes(sa, tmp_path):
    path = tmp_path / "run" / PLUGIN_KUBECONFIG_NAME
    writer = KubeconfigWriter(
        path, lambda: KubeconfigInputs.from_service_account(host="10.96.0.1", port="443", sa_path=sa)
    )
    assert repr(writer) == f"KubeconfigWriter({str(path)!r}: 0 writes, not synced yet)"
    assert writer.sync() is True
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_kubeconfig(path) == KubeCredentials(
        server="https://10.96.0.1:443", token="tok-1", ca_data=CA_PEM
    )
    inode = os.stat(path).st_ino
    assert writer.sync() is False and os.stat(path).st_ino == inode
    assert repr(writer) == f"KubeconfigWriter({str(path)!r}: 1 writes, up to date)"

    (sa / "token").write_text("tok-2")  # kubelet rotated the projected token
    assert writer.sync() is True
    assert load_kubeconfig(path).token == "tok-2"
    assert writer.last_reason.startswith("content changed")
    assert [p.name for p in path.parent.iterdir()] == [PLUGIN_KUBECONFIG_NAME]  # no temp files left

    writer.remove()
    assert not path.exists()
    writer.remove()  # already gone: fine
    assert repr(writer) == f"KubeconfigWriter({str(path)!r}: 2 writes, removed)"


def test_writer_keeps_the_old_file_when_inputs_fail(sa, tmp_path):
    path = tmp_path / PLUGIN_KUBECONFIG_NAME
    writer = KubeconfigWriter(
        path, lambda: KubeconfigInputs.from_service_account(host="h", port="443", sa_path=sa), mode=0o640
    )
    writer.sync()
    before = path.read_bytes()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    (sa / "token").unlink()
    with pytest.raises(KubeconfigError):
        writer.sync()
    assert path.read_bytes() == before


def test_writer_reports_unreadable_and_unwritable_paths(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(KubeconfigError, match="cannot read .*Not a directory"):
        KubeconfigWriter(blocker / "sub" / PLUGIN_KUBECONFIG_NAME, lambda: INPUTS).sync()
    # procfs refuses new directories even to root.
    with pytest.raises(KubeconfigError, match="cannot write"):
        KubeconfigWriter(f"/proc/no-such-dir/{PLUGIN_KUBECONFIG_NAME}", lambda: INPUTS).sync()


# -- what the plugin reads ------------------------------------------------------------------------------

ISTIO_STYLE_YAML = """\
apiVersion: v1
clusters:
- cluster:
    certificate-authority: ca.pem
    server: https://[fd00::1]:6443/prefix/
  name: local
contexts:
- context:
    cluster: local
    user: istio-cni
  name: istio-cni-context
current-context: istio-cni-context
kind: Config
preferences: {}
users:
- name: istio-cni
  user:
    tokenFile: token
"""


def test_plugin_reads_a_hand_written_yaml_kubeconfig(tmp_path):
    (tmp_path / "ca.pem").write_bytes(CA_PEM)
    (tmp_path / "token").write_text("file-token\n")
    (tmp_path / "kc").write_text(ISTIO_STYLE_YAML)
    creds = load_kubeconfig(tmp_path / "kc")
    assert creds == KubeCredentials(
        server="https://[fd00::1]:6443/prefix", token_file=str(tmp_path / "token"), ca_data=CA_PEM
    )
    assert creds.bearer() == "file-token"


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ("[]", "mapping"),
        ('{"contexts": []}', "no current-context"),
        ('{"current-context": "x", "contexts": []}', "no context named 'x'"),
        (
            '{"current-context": "x", "contexts": [{"name": "x", "context": {"cluster": "c"}}]}',
            "no cluster named",
        ),
        (
            '{"current-context": "x", "contexts": [{"name": "x", "context": {"cluster": "c"}}],'
            ' "clusters": [{"name": "c", "cluster": {"server": "ftp://h"}}]}',
            "not an http",
        ),
        (
            '{"current-context": "x", "contexts": [{"name": "x", "context": {"cluster": "c"}}],'
            ' "clusters": [{"name": "c", "cluster": {"server": "https://h", "certificate-authority-data": "!!"}}]}',
            "not base64",
        ),
        ("key: [unclosed", "neither JSON nor YAML"),
    ],
)
def test_bad_kubeconfigs(doc, message):
    with pytest.raises(KubeAccessError, match=message):
        parse_kubeconfig(doc)


def test_missing_kubeconfig_says_who_writes_it(tmp_path):
    with pytest.raises(PodLookupError) as err:
        load_plugin_kubeconfig(tmp_path / PLUGIN_KUBECONFIG_NAME)
    assert "does not exist" in str(err.value) and "node agent" in (err.value.hint or "")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)
kubeconfig_keys = st.sampled_from(
    [
        "current-context",
        "contexts",
        "clusters",
        "users",
        "name",
        "context",
        "cluster",
        "user",
        "server",
        "token",
        "certificate-authority-data",
        "insecure-skip-tls-verify",
        "x",
    ]
)
kubeconfig_like = st.recursive(
    st.none() | st.booleans() | st.sampled_from(["x", "c", "https://h:1", "ftp://h", "dG9r", ""]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(kubeconfig_keys, inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200) | json_values.map(json.dumps) | kubeconfig_like.map(json.dumps))
def test_parse_kubeconfig_returns_credentials_or_our_error(text):
    try:
        creds = parse_kubeconfig(text, base_dir="/nonexistent")
    except KubeAccessError:
        return
    assert creds.server.startswith(("https://", "http://")) and "\n" not in creds.token


POD = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {
        "name": "web-0",
        "namespace": "apps",
        "uid": "u-1",
        "labels": {"app": "web", "n": 3},
        "annotations": {"sidecar.istio.io/status": "{}"},
        "managedFields": [{"manager": "kubelet"}],
    },
    "spec": {
        "nodeName": "node-1",
        "hostNetwork": False,
        "containers": [{"name": "app"}, {"name": "istio-proxy"}, {"bogus": 1}],
        "initContainers": [{"name": "istio-validation"}],
    },
    "status": {"podIP": "10.0.0.5", "podIPs": [{"ip": "10.0.0.5"}, {"ip": "fd00::5"}]},
}


def test_pod_and_namespace_from_api_json():
    assert pod_info_from_json(POD) == PodInfo(
        name="web-0",
        namespace="apps",
        uid="u-1",
        labels={"app": "web"},
        annotations={"sidecar.istio.io/status": "{}"},
        containers=("app", "istio-proxy"),
        init_containers=("istio-validation",),
        node_name="node-1",
        ips=("10.0.0.5", "fd00::5"),
    )
    assert pod_info_from_json(
        {"metadata": {"name": "p", "namespace": "n"}, "status": {"podIP": "10.1.1.1"}}
    ).ips == ("10.1.1.1",)
    assert pod_info_from_json(
        {"metadata": {"name": "p", "namespace": "n"}, "spec": {"hostNetwork": True}}
    ).host_network
    assert namespace_info_from_json({"metadata": {"name": "apps", "labels": {"a": "b"}}}) == NamespaceInfo(
        name="apps", labels={"a": "b"}
    )


@settings(max_examples=300, deadline=None)
@given(
    json_values | st.fixed_dictionaries({"metadata": json_values, "spec": json_values, "status": json_values})
)
def test_api_json_parsers_return_objects_or_our_error(obj):
    for parse in (pod_info_from_json, namespace_info_from_json):
        try:
            parse(obj)
        except PodLookupError:
            pass


# -- the lookup, over a fake transport --------------------------------------------------------------


class FakeApi:
    def __init__(self, replies=None, error=None):
        self.replies = replies or {}
        self.error = error
        self.paths: list[tuple[str, float]] = []
        self.credentials: KubeCredentials | None = None

    def factory(self, credentials):
        self.credentials = credentials
        return self

    def get(self, path, *, timeout_s):
        self.paths.append((path, timeout_s))
        if self.error is not None:
            raise self.error
        status, body = self.replies.get(path, (404, b'{"kind":"Status","code":404}'))
        return ApiReply(status=status, body=body)

    def __repr__(self):
        return "FakeApi"


@pytest.fixture
def kubeconfig(tmp_path):
    path = tmp_path / PLUGIN_KUBECONFIG_NAME
    path.write_bytes(render_kubeconfig(INPUTS))
    return path


def test_lookup_gets_pod_and_namespace(kubeconfig):
    api = FakeApi(
        {
            "/api/v1/namespaces/apps/pods/web-0": (200, json.dumps(POD).encode()),
            "/api/v1/namespaces/apps": (200, b'{"metadata": {"name": "apps", "labels": {"l": "v"}}}'),
        }
    )
    lookup = KubeApiPodLookup(kubeconfig, transport_factory=api.factory)
    assert repr(lookup) == f"KubeApiPodLookup({str(kubeconfig)!r}: not connected yet, 0 requests)"
    assert lookup.get_namespace("apps") == NamespaceInfo(name="apps", labels={"l": "v"})
    assert lookup.get_pod("apps", "web-0").containers == ("app", "istio-proxy")
    assert lookup.get_pod("apps", "gone") is None
    assert lookup.get_namespace("a/b") is None
    assert api.credentials == KubeCredentials(server="https://10.96.0.1:443", token="tok-1", ca_data=CA_PEM)
    assert [p for p, _ in api.paths][-1] == "/api/v1/namespaces/a%2Fb"
    assert {t for _, t in api.paths} == {5.0}
    assert repr(lookup) == f"KubeApiPodLookup({str(kubeconfig)!r}: FakeApi, 4 requests)"


@pytest.mark.parametrize(
    ("api", "message"),
    [
        (FakeApi(error=ConnectionRefusedError(111, "Connection refused")), "ConnectionRefusedError"),
        (FakeApi(error=TimeoutError("no answer")), "TimeoutError"),
        (FakeApi({"/api/v1/namespaces/apps": (403, b"forbidden")}), "answered 403: forbidden"),
        (FakeApi({"/api/v1/namespaces/apps": (500, b"etcd down")}), "answered 500"),
        (FakeApi({"/api/v1/namespaces/apps": (200, b"<html>")}), "not JSON"),
        (FakeApi({"/api/v1/namespaces/apps": (200, b"[1]")}), "expected a JSON object"),
    ],
)
def test_lookup_failures_are_pod_lookup_errors(kubeconfig, api, message):
    lookup = KubeApiPodLookup(kubeconfig, transport_factory=api.factory)
    with pytest.raises(PodLookupError, match=message):
        lookup.get_namespace("apps")


def test_lookup_without_kubeconfig_never_connects(tmp_path):
    api = FakeApi()
    with pytest.raises(PodLookupError, match="does not exist"):
        KubeApiPodLookup(tmp_path / "missing", transport_factory=api.factory).get_pod("a", "b")
    assert api.paths == []


# -- which source the plugin uses -----------------------------------------------------------------------


def conf(**extra) -> PluginConf:
    doc = {"cniVersion": "1.0.0", "name": "k8s-pod-network", "type": "istio-cni", **extra}
    return parse_plugin_conf(json.dumps(doc).encode())


def test_plugin_uses_the_directory_when_configured():
    lookup = default_lookup(conf(ambient_pod_source={"directory": "/etc/mesh"}))
    assert isinstance(lookup, DirectoryPodLookup) and str(lookup.path) == "/etc/mesh"


def test_plugin_defaults_to_the_run_dir_kubeconfig():
    lookup = default_lookup(conf(cni_agent_run_dir="/var/run/x/"))
    assert isinstance(lookup, KubeApiPodLookup)
    assert str(lookup.kubeconfig_path) == "/var/run/x/istio-cni-kubeconfig"


def test_plugin_uses_kubernetes_kubeconfig_when_given():
    lookup = default_lookup(conf(kubernetes={"kubeconfig": "/etc/cni/net.d/ZZZ-istio-cni-kubeconfig"}))
    assert str(lookup.kubeconfig_path) == "/etc/cni/net.d/ZZZ-istio-cni-kubeconfig"
