"""kube/: the kubeconfig reader, label selectors, the watch line splitter and event parser, and
REST paths. The client and reflector run against a fake API server in
tests/integration/test_kube_api_source.py and test_control_kube_api.py."""

from __future__ import annotations

import base64
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ambient_mesh.kube.client import (
    NAMESPACES,
    PODS,
    TOKEN_REVIEWS,
    KubeApiError,
    Resource,
    WatchLines,
    parse_watch_event,
)
from ambient_mesh.kube.kubeconfig import (
    KubeconfigError,
    KubeCredentials,
    credentials,
    in_cluster,
    load_kubeconfig,
    parse_kubeconfig,
)
from ambient_mesh.kube.labels import LabelSelector, Requirement

PEM = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


def kubeconfig(user: dict, cluster: dict | None = None, **top) -> str:
    return json.dumps(
        {
            "current-context": "ctx",
            "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u"}}],
            "clusters": [{"name": "c", "cluster": cluster or {"server": "https://api:6443"}}],
            "users": [{"name": "u", "user": user}],
            **top,
        }
    )


# -- kubeconfig ---------------------------------------------------------------------------------------


def test_client_certificate_from_files_relative_to_the_kubeconfig(tmp_path):
    (tmp_path / "crt.pem").write_bytes(b"CERT")
    (tmp_path / "key.pem").write_bytes(b"KEY")
    (tmp_path / "ca.pem").write_bytes(PEM)
    (tmp_path / "config").write_text(
        kubeconfig(
            {"client-certificate": "crt.pem", "client-key": "key.pem"},
            {"server": "https://api:6443/", "certificate-authority": "ca.pem"},
        )
    )
    creds = load_kubeconfig(tmp_path / "config")
    assert creds == KubeCredentials(
        server="https://api:6443", ca_data=PEM, client_cert_data=b"CERT", client_key_data=b"KEY"
    )
    assert repr(creds) == "KubeCredentials(https://api:6443, no token, client certificate, CA 59 bytes)"


def test_client_certificate_data_needs_its_key():
    cert = base64.b64encode(b"CERT").decode()
    assert parse_kubeconfig(
        kubeconfig({"client-certificate-data": cert, "client-key-data": cert})
    ).client_key_data == (b"CERT")
    with pytest.raises(KubeconfigError, match="both the certificate and its key"):
        parse_kubeconfig(kubeconfig({"client-certificate-data": cert}))


@pytest.mark.parametrize("field", ["exec", "auth-provider", "username"])
def test_unsupported_users_are_named(field):
    with pytest.raises(KubeconfigError, match=f"`{field}`, which is not supported"):
        parse_kubeconfig(kubeconfig({field: {"command": "x"} if field != "username" else "admin"}))


def test_token_file_wins_over_the_inline_token_and_is_reread(tmp_path):
    (tmp_path / "token").write_text("from-file\n")
    creds = parse_kubeconfig(kubeconfig({"token": "inline", "tokenFile": "token"}), base_dir=tmp_path)
    assert creds.bearer() == "from-file"
    (tmp_path / "token").write_text("rotated")
    assert creds.bearer() == "rotated"
    (tmp_path / "token").write_text("evil\r\nX-Injected: 1")
    with pytest.raises(KubeconfigError, match="line break"):
        creds.bearer()
    (tmp_path / "token").unlink()
    with pytest.raises(KubeconfigError, match="cannot read the token file"):
        creds.bearer()


def test_inline_token_with_a_line_break_is_refused():
    with pytest.raises(KubeconfigError, match="line break"):
        parse_kubeconfig(kubeconfig({"token": "a\nb"}))


def test_oversized_kubeconfig_and_token_file_are_refused(tmp_path):
    (tmp_path / "big").write_bytes(b" " * (1024 * 1024 + 1))
    with pytest.raises(KubeconfigError, match="larger than"):
        load_kubeconfig(tmp_path / "big")
    (tmp_path / "token").write_bytes(b"t" * (64 * 1024 + 1))
    with pytest.raises(KubeconfigError, match="larger than"):
        KubeCredentials(server="https://h", token_file=str(tmp_path / "token")).bearer()


def test_in_cluster(tmp_path):
    (tmp_path / "ca.crt").write_bytes(PEM)
    (tmp_path / "token").write_text("t1")
    creds = in_cluster(host="fd00::1", port="443", sa_path=tmp_path)
    assert creds.server == "https://[fd00::1]:443" and creds.ca_data == PEM and creds.bearer() == "t1"
    assert "t1" not in repr(creds)
    assert in_cluster(host="h", port="80", protocol="http", sa_path=tmp_path / "none").ca_data == b""
    with pytest.raises(KubeconfigError, match="cannot read the cluster CA"):
        in_cluster(host="h", port="443", sa_path=tmp_path / "none")


# -- label selectors ------------------------------------------------------------------------------------


def test_label_selector_semantics():
    sel = LabelSelector(
        match_labels={"app": "web"},
        match_expressions=(
            Requirement(key="tier", operator="In", values=frozenset({"a", "b"})),
            Requirement(key="canary", operator="NotIn", values=frozenset({"true"})),
            Requirement(key="legacy", operator="DoesNotExist"),
        ),
    )
    assert sel.matches({"app": "web", "tier": "a"})
    assert not sel.matches({"app": "web", "tier": "c"})
    assert not sel.matches({"app": "web", "tier": "a", "canary": "true"})
    assert not sel.matches({"app": "web", "tier": "a", "legacy": ""})
    assert LabelSelector().matches({}) and LabelSelector().empty


# -- watch streams --------------------------------------------------------------------------------------


def test_watch_lines_across_arbitrary_splits():
    stream = b'{"type":"ADDED"}\n\n{"type":"DELETED"}\r\n{"type":'
    for split in range(1, len(stream)):
        lines = WatchLines()
        out = lines.feed(stream[:split]) + lines.feed(stream[split:])
        assert out == [b'{"type":"ADDED"}', b'{"type":"DELETED"}']
        assert lines.pending_bytes == len(b'{"type":')


def test_watch_line_longer_than_the_limit_is_refused_before_it_ends():
    lines = WatchLines(max_line_bytes=64)
    lines.feed(b"x" * 60)
    with pytest.raises(KubeApiError, match="longer than 64 bytes"):
        lines.feed(b"x" * 10)
    with pytest.raises(KubeApiError):
        WatchLines(max_line_bytes=8).feed(b"0123456789\n")


def test_parse_watch_event():
    event = parse_watch_event(b'{"type":"BOOKMARK","object":{"metadata":{"resourceVersion":"42"}}}', PODS)
    assert (event.type, event.resource_version, event.object["kind"]) == ("BOOKMARK", "42", "Pod")
    gone = parse_watch_event(b'{"type":"ERROR","object":{"kind":"Status","code":410}}', PODS)
    assert gone.status_code == 410 and "apiVersion" not in gone.object
    for bad in (b"[]", b'{"type":"ADDED"}', b'{"type":"SYNC","object":{}}', b"{", b'{"object":{}}'):
        with pytest.raises(KubeApiError):
            parse_watch_event(bad, PODS)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_watch_parsing_returns_events_or_our_error(data):
    lines = WatchLines(max_line_bytes=128)
    try:
        for line in lines.feed(data):
            event = parse_watch_event(line, NAMESPACES)
            assert isinstance(event.object, dict) and isinstance(event.resource_version, str)
            assert isinstance(event.status_code, int)
    except KubeApiError:
        pass


def test_resource_paths():
    assert PODS.path() == "/api/v1/pods"
    assert PODS.path("demo", "a/b", "status") == "/api/v1/namespaces/demo/pods/a%2Fb/status"
    assert NAMESPACES.path("ignored", "demo") == "/api/v1/namespaces/demo"
    assert TOKEN_REVIEWS.path() == "/apis/authentication.k8s.io/v1/tokenreviews"
    ap = Resource("security.istio.io", "v1", "AuthorizationPolicy", "authorizationpolicies")
    assert ap.api_version == "security.istio.io/v1" and str(ap) == "authorizationpolicies.security.istio.io"
    assert ap.path("ns") == "/apis/security.istio.io/v1/namespaces/ns/authorizationpolicies"


def test_credentials_choose_the_kubeconfig_then_the_service_account(tmp_path):
    (tmp_path / "config").write_text(kubeconfig({"token": "t"}))
    assert credentials(tmp_path / "config", environ={}).server == "https://api:6443"
    env = {"KUBECONFIG": str(tmp_path / "config"), "KUBERNETES_SERVICE_HOST": "10.96.0.1"}
    assert credentials("", environ=env).token == "t"
    with pytest.raises(KubeconfigError, match="KUBERNETES_SERVICE_HOST not set"):
        credentials("", environ={})


def test_tls_context_is_built_in_memory_and_refuses_bad_pem():
    ctx = KubeCredentials(server="https://h", insecure_skip_tls_verify=True).ssl_context()
    assert not ctx.check_hostname
    with pytest.raises(KubeconfigError, match="not usable PEM"):
        KubeCredentials(server="https://h", ca_data=b"not a certificate").ssl_context()
    with pytest.raises(KubeconfigError, match="not usable PEM"):
        KubeCredentials(server="https://h", client_cert_data=b"x", client_key_data=b"y").ssl_context()
