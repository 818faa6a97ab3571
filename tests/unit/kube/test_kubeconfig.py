"""kube/kubeconfig.py: kubeconfig users and clusters, token files, the in-cluster service
account, which credentials are chosen, and the TLS context built from them."""

from __future__ import annotations

import base64
import json

import pytest

from ambient_mesh.kube.kubeconfig import (
    KubeconfigError,
    KubeCredentials,
    credentials,
    in_cluster,
    load_kubeconfig,
    parse_kubeconfig,
)

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
