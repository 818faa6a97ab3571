"""How to reach the API server: a kubeconfig's current context, or the in-cluster service account.

Counterparts: client-go's clientcmd (the current context's cluster and user; relative file paths
resolved against the kubeconfig's directory) and rest.InClusterConfig (KUBERNETES_SERVICE_HOST /
_PORT, the mounted service account's `token` and `ca.crt`). The one reader for the node agent, the
CNI plugin and the control plane. Standard library only (PyYAML is imported for a hand-written
YAML kubeconfig; the agent writes JSON for the plugin), because the plugin imports this on every
pod start.

Supported users: `token`, `tokenFile` (re-read for every request: kubelet rotates projected
tokens), and client certificates (`client-certificate[-data]`, `client-key[-data]`). `exec` and
`auth-provider` users and basic auth are refused with an error naming them: we run no credential
plugins.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import AmbientError

MAX_KUBECONFIG_BYTES = 1024 * 1024
MAX_TOKEN_BYTES = 64 * 1024
DEFAULT_SERVICE_ACCOUNT_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"

__all__ = [
    "DEFAULT_SERVICE_ACCOUNT_PATH",
    "KubeCredentials",
    "KubeconfigError",
    "credentials",
    "in_cluster",
    "load_kubeconfig",
    "parse_kubeconfig",
    "server_url",
]


class KubeconfigError(AmbientError):
    """A kubeconfig or service-account mount that cannot be used to reach the API server."""


def server_url(protocol: str, host: str, port: str) -> str:
    """`protocol://host:port`, with an IPv6 host in brackets (Go's net.JoinHostPort)."""
    host = host.strip("[]")
    bracketed = f"[{host}]" if ":" in host else host
    return f"{protocol or 'https'}://{bracketed}:{port}"


@dataclass(frozen=True, slots=True, kw_only=True)
class KubeCredentials:
    """The API server's URL, how to trust it, and who we are to it."""

    server: str
    token: str = ""
    token_file: str = ""  # absolute; read by `bearer()` for every request
    ca_data: bytes = b""  # PEM
    insecure_skip_tls_verify: bool = False
    client_cert_data: bytes = b""  # PEM
    client_key_data: bytes = b""  # PEM

    def __repr__(self) -> str:
        # Never the token or the key: this repr ends up in logs.
        auth = "token file" if self.token_file else "token" if self.token else "no token"
        if self.client_cert_data:
            auth += ", client certificate"
        tls = "insecure" if self.insecure_skip_tls_verify else f"CA {len(self.ca_data)} bytes"
        return f"KubeCredentials({self.server}, {auth}, {tls})"

    def bearer(self) -> str:
        """The bearer token now: the token file's current content, else the inline token."""
        if not self.token_file:
            return self.token
        try:
            with open(self.token_file, "rb") as f:
                data = f.read(MAX_TOKEN_BYTES + 1)
        except OSError as exc:
            raise KubeconfigError(
                f"cannot read the token file {self.token_file}: {exc.strerror or exc}",
                hint="is the service-account token mounted (projected volume)?",
            ) from None
        if len(data) > MAX_TOKEN_BYTES:
            raise KubeconfigError(f"token file {self.token_file} is larger than {MAX_TOKEN_BYTES} bytes")
        token = data.decode("utf-8", "replace").strip()
        _check_token(token)
        return token

    def ssl_context(self) -> Any:
        """The TLS client context for this server, built in memory: the CA is loaded from its
        PEM bytes (no temporary file, so a read-only root filesystem is fine); a client
        certificate, which Python's ssl loads only from files, goes through a private temporary
        directory that is removed at once. Imports ssl here: the plugin pays for it only when
        it really connects."""
        import ssl

        try:
            if self.insecure_skip_tls_verify:
                ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            elif self.ca_data:
                ctx = ssl.create_default_context(cadata=self.ca_data.decode("ascii", "replace"))
            else:
                ctx = ssl.create_default_context()
            if self.client_cert_data:
                import tempfile

                with tempfile.TemporaryDirectory(prefix="ambient-kube-") as tmp:
                    cert, key = Path(tmp) / "client.crt", Path(tmp) / "client.key"
                    cert.write_bytes(self.client_cert_data)
                    key.touch(mode=0o600)
                    key.write_bytes(self.client_key_data)
                    ctx.load_cert_chain(cert, key)
        except (ssl.SSLError, ValueError, OSError) as exc:
            raise KubeconfigError(
                f"kubeconfig: the CA or client certificate is not usable PEM: {exc}"
            ) from None
        return ctx


def _check_token(token: str) -> None:
    # A line break would let the token add HTTP headers of its own.
    if any(c in token for c in "\r\n\0"):
        raise KubeconfigError("kubeconfig: token contains a line break")


def _document(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        pass
    try:
        import yaml  # a kubeconfig written by hand, not by the agent

        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        return yaml.load(text, Loader=loader)
    except Exception as exc:  # YAMLError, and recursion on hostile nesting
        raise KubeconfigError(f"kubeconfig is neither JSON nor YAML: {type(exc).__name__}") from None


def parse_kubeconfig(text: str, *, base_dir: str | Path = ".") -> KubeCredentials:
    """The current context's server and credentials from a kubeconfig document.

    A kubeconfig without `current-context` but with exactly one context uses that one. Relative
    paths are relative to `base_dir` (the kubeconfig's directory, as client-go resolves them).
    """
    doc = _document(text)
    if not isinstance(doc, dict):
        raise KubeconfigError("kubeconfig: expected a mapping at the top level")

    def entries(section: str) -> list[dict[str, Any]]:
        items = doc.get(section)
        if items is None:
            return []
        if not isinstance(items, list):
            raise KubeconfigError(f"kubeconfig: {section} is not a list")
        return [item for item in items if isinstance(item, dict)]

    def named(section: str, name: Any) -> dict[str, Any]:
        for item in entries(section):
            if item.get("name") == name:
                inner = item.get(section[:-1])
                if not isinstance(inner, dict):
                    raise KubeconfigError(f"kubeconfig: {section[:-1]} {name!r} has no {section[:-1]} object")
                return inner
        raise KubeconfigError(f"kubeconfig: no {section[:-1]} named {name!r}")

    current = doc.get("current-context")
    if not current:
        contexts = entries("contexts")
        if len(contexts) != 1:
            raise KubeconfigError("kubeconfig: no current-context")
        current = contexts[0].get("name")
    context = named("contexts", current)
    cluster = named("clusters", context.get("cluster"))
    user_name = context.get("user")
    user = named("users", user_name) if user_name else {}
    server = cluster.get("server")
    if not isinstance(server, str) or not server.startswith(("https://", "http://")):
        raise KubeconfigError(f"kubeconfig: cluster server {server!r} is not an http(s) URL")
    for unsupported in ("exec", "auth-provider", "username"):
        if user.get(unsupported):
            raise KubeconfigError(
                f"kubeconfig: user {user_name!r} authenticates with `{unsupported}`, which is not supported",
                hint="use a user with a token, tokenFile or client certificate",
            )
    base = Path(base_dir)

    def text_field(item: dict[str, Any], key: str) -> str:
        value = item.get(key)
        if value is None:
            return ""
        if not isinstance(value, str):
            raise KubeconfigError(f"kubeconfig: {key} is not a string")
        return value

    def path_of(item: dict[str, Any], key: str) -> Path | None:
        value = text_field(item, key)
        if not value:
            return None
        file = Path(value)
        return file if file.is_absolute() else base / file

    def material(item: dict[str, Any], key: str) -> bytes:
        """`<key>-data` (base64) or the file named by `<key>`."""
        if text_field(item, f"{key}-data"):
            try:
                return base64.b64decode(text_field(item, f"{key}-data"), validate=True)
            except ValueError:
                raise KubeconfigError(f"kubeconfig: {key}-data is not base64") from None
        file = path_of(item, key)
        if file is None:
            return b""
        try:
            return file.read_bytes()
        except (OSError, ValueError) as exc:
            raise KubeconfigError(f"kubeconfig: cannot read {key} {file}: {exc}") from None

    token = text_field(user, "token").strip()
    _check_token(token)
    token_file = path_of(user, "tokenFile")
    cert, key = material(user, "client-certificate"), material(user, "client-key")
    if bool(cert) != bool(key):
        raise KubeconfigError("kubeconfig: a client certificate needs both the certificate and its key")
    return KubeCredentials(
        server=server.rstrip("/"),
        token=token,
        # client-go: the token file, when given, wins over an inline token.
        token_file=str(token_file) if token_file is not None else "",
        ca_data=material(cluster, "certificate-authority"),
        insecure_skip_tls_verify=cluster.get("insecure-skip-tls-verify") is True,
        client_cert_data=cert,
        client_key_data=key,
    )


def load_kubeconfig(path: str | Path, *, missing_hint: str | None = None) -> KubeCredentials:
    path = Path(path).expanduser()
    try:
        with path.open("rb") as f:
            data = f.read(MAX_KUBECONFIG_BYTES + 1)
    except FileNotFoundError:
        raise KubeconfigError(f"kubeconfig {path} does not exist", hint=missing_hint) from None
    except OSError as exc:
        raise KubeconfigError(f"cannot read kubeconfig {path}: {exc}") from None
    if len(data) > MAX_KUBECONFIG_BYTES:
        raise KubeconfigError(f"kubeconfig {path} is larger than {MAX_KUBECONFIG_BYTES} bytes")
    return parse_kubeconfig(data.decode("utf-8", "replace"), base_dir=path.parent)


def in_cluster(
    *,
    host: str,
    port: str,
    protocol: str = "https",
    sa_path: str | Path = DEFAULT_SERVICE_ACCOUNT_PATH,
    ca_file: str = "",
    skip_tls_verify: bool = False,
) -> KubeCredentials:
    """rest.InClusterConfig: KUBERNETES_SERVICE_HOST/PORT, the service account's token file
    (re-read per request) and `ca.crt` (or `ca_file`: istio-cni's KUBE_CA_FILE)."""
    if not host:
        raise KubeconfigError(
            "KUBERNETES_SERVICE_HOST not set: not running in a pod",
            hint="outside a cluster, give a kubeconfig (KUBECONFIG or --kubeconfig)",
        )
    if not port:
        raise KubeconfigError("KUBERNETES_SERVICE_PORT not set", hint="is this running in a pod?")
    sa = Path(sa_path)
    ca = b""
    if not skip_tls_verify and protocol != "http":
        ca_path = Path(ca_file) if ca_file else sa / "ca.crt"
        try:
            ca = ca_path.read_bytes()
        except OSError as exc:
            raise KubeconfigError(
                f"cannot read the cluster CA {ca_path}: {exc.strerror or exc}",
                hint="is the service account mounted? KUBE_CA_FILE names another CA file",
            ) from None
    return KubeCredentials(
        server=server_url(protocol, host, port),
        token_file=str(sa / "token"),
        ca_data=ca,
        insecure_skip_tls_verify=skip_tls_verify,
    )


def credentials(kubeconfig: str | Path = "", environ: Mapping[str, str] | None = None) -> KubeCredentials:
    """client-go's usual choice: the kubeconfig given (a flag, else KUBECONFIG), else the
    in-cluster service account."""
    env = os.environ if environ is None else environ
    path = kubeconfig or env.get("KUBECONFIG", "")
    if path:
        return load_kubeconfig(path)
    return in_cluster(
        host=env.get("KUBERNETES_SERVICE_HOST", ""), port=env.get("KUBERNETES_SERVICE_PORT", "")
    )
