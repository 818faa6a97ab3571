"""The kubeconfig the node agent writes for the CNI plugin, and when it rewrites it.

Counterpart of istio-cni's cni/pkg/install/kubeconfig.go (docs/istio-behaviour.md,
"CNI config and kubeconfig installation"). The plugin is run by the container runtime on the host, outside any
pod, so it has no service-account token of its own: the agent renders one kubeconfig from its own token, the
cluster CA and the API server address, into `<CNI_AGENT_RUN_DIR>/istio-cni-kubeconfig` (mode KUBECONFIG_MODE,
0600 by default). The plugin reads it on every ADD (podinfo.KubeApiPodLookup).

Same content as istio-cni's: a v1 `Config` with cluster `local` (server
`<KUBERNETES_SERVICE_PROTOCOL>://<HOST>:<PORT>`, `certificate-authority-data` from KUBE_CA_FILE or
the service account's `ca.crt`, or `insecure-skip-tls-verify` with SKIP_TLS_VERIFY), user
`istio-cni` with the token, context `istio-cni-context`. It is written as JSON (which is YAML, so
kubectl and client-go read it): the plugin then parses it with the `json` module it has loaded
anyway instead of importing a YAML parser on every pod start.

The token is the plugin's own when the agent could get one (plugin_token.py: short-lived, not
bound to the agent's pod, so it outlives an agent restart), else the agent's. Kubelet rotates
projected service-account tokens (hourly by default), and the agent renews the plugin's. `plan_write` is the pure
decision: render from the current token and CA, and rewrite only when the bytes or the file
mode differ, so a rotation is picked up on the next `sync()` and an unchanged file is never
touched. Writes are atomic (temp file and rename): a plugin never reads half a kubeconfig.
"""

from __future__ import annotations

import base64
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..host.files import atomic_write
from ..kube.kubeconfig import KubeconfigError as KubeAccessError
from ..kube.kubeconfig import KubeCredentials, in_cluster, load_kubeconfig, server_url
from .install import InstallError
from .podinfo import PLUGIN_KUBECONFIG_NAME

log = logging.getLogger(__name__)

# istio-cni's names inside the file.
CLUSTER_NAME = "local"
USER_NAME = "istio-cni"
CONTEXT_NAME = "istio-cni-context"
DEFAULT_KUBECONFIG_MODE = 0o600
REDACTED = "REDACTED"

__all__ = [
    "CLUSTER_NAME",
    "CONTEXT_NAME",
    "PLUGIN_KUBECONFIG_NAME",
    "USER_NAME",
    "KubeconfigError",
    "KubeconfigInputs",
    "KubeconfigPlan",
    "KubeconfigWriter",
    "agent_credentials",
    "plan_write",
    "render_kubeconfig",
    "server_url",
]


class KubeconfigError(InstallError):
    """The plugin's kubeconfig cannot be rendered or written (istio-cni counts these installs
    as CREATE_KUBECONFIG_FAILURE)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class KubeconfigInputs:
    """What goes into the plugin's kubeconfig, read fresh for every render."""

    server: str
    token: str
    ca_data: bytes = b""  # PEM
    insecure_skip_tls_verify: bool = False

    def __repr__(self) -> str:
        ca = "insecure" if self.insecure_skip_tls_verify else f"CA {len(self.ca_data)} bytes"
        return f"KubeconfigInputs({self.server}, {ca}, token={'yes' if self.token else 'no'})"

    @classmethod
    def from_service_account(cls, **settings: Any) -> KubeconfigInputs:
        """istio-cni's inputs: KUBERNETES_SERVICE_HOST/PORT/PROTOCOL, the token and `ca.crt`
        of the mounted service account (or KUBE_CA_FILE), SKIP_TLS_VERIFY; `settings` are
        kube.kubeconfig.in_cluster's arguments."""
        try:
            return cls.from_access(in_cluster(**settings))
        except KubeAccessError as exc:
            raise KubeconfigError(exc.message, hint=exc.hint) from None

    @classmethod
    def from_access(cls, access: KubeCredentials) -> KubeconfigInputs:
        """The agent's own credentials when it runs from a KUBECONFIG (outside a pod)."""
        if access.client_cert_data:
            raise KubeconfigError(
                "the agent's kubeconfig authenticates with a client certificate; the plugin's "
                "kubeconfig carries a bearer token only",
                hint="give the agent a token-based kubeconfig, or run it in a pod",
            )
        token = access.bearer()
        if not token:
            raise KubeconfigError("the agent's kubeconfig has no token for the plugin to use")
        return cls(
            server=access.server,
            token=token,
            ca_data=access.ca_data,
            insecure_skip_tls_verify=access.insecure_skip_tls_verify,
        )

    @classmethod
    def for_plugin(cls, cfg: Any, token: str | None) -> KubeconfigInputs:
        """The agent's API server and CA with the plugin's own token (plugin_token.py) when there
        is one, else the agent's token (istio-cni's behaviour)."""
        inputs = cls.for_agent(cfg)
        if not token:
            return inputs
        return cls(
            server=inputs.server,
            token=token,
            ca_data=inputs.ca_data,
            insecure_skip_tls_verify=inputs.insecure_skip_tls_verify,
        )

    @classmethod
    def for_agent(cls, cfg: Any) -> KubeconfigInputs:
        """From the agent's config (AgentConfig), with the agent's own credentials."""
        try:
            return cls.from_access(agent_credentials(cfg))
        except KubeAccessError as exc:
            where = "KUBECONFIG: " if cfg.kubeconfig else ""
            raise KubeconfigError(f"{where}{exc.message}", hint=exc.hint) from None


def agent_credentials(cfg: Any) -> KubeCredentials:
    """How the agent reaches the API server (AgentConfig): its KUBECONFIG when set, else the
    in-cluster service account. Raises kube.kubeconfig.KubeconfigError."""
    if cfg.kubeconfig:
        return load_kubeconfig(cfg.kubeconfig)
    return in_cluster(
        host=cfg.k8s_service_host,
        port=cfg.k8s_service_port,
        protocol=cfg.k8s_service_protocol,
        sa_path=cfg.k8s_service_account_path,
        ca_file=cfg.kube_ca_file,
        skip_tls_verify=cfg.skip_tls_verify,
    )


def kubeconfig_document(inputs: KubeconfigInputs, *, redact: bool = False) -> dict[str, Any]:
    cluster: dict[str, Any] = {"server": inputs.server}
    if inputs.insecure_skip_tls_verify:
        cluster["insecure-skip-tls-verify"] = True
    elif inputs.ca_data:
        cluster["certificate-authority-data"] = (
            REDACTED if redact else base64.b64encode(inputs.ca_data).decode("ascii")
        )
    return {
        "apiVersion": "v1",
        "clusters": [{"cluster": cluster, "name": CLUSTER_NAME}],
        "contexts": [{"context": {"cluster": CLUSTER_NAME, "user": USER_NAME}, "name": CONTEXT_NAME}],
        "current-context": CONTEXT_NAME,
        "kind": "Config",
        "preferences": {},
        "users": [{"name": USER_NAME, "user": {"token": REDACTED if redact else inputs.token}}],
    }


def render_kubeconfig(inputs: KubeconfigInputs, *, redact: bool = False) -> bytes:
    """The file's bytes: deterministic (sorted keys), so equal inputs give equal bytes and a
    byte comparison tells whether anything changed. `redact` is for logs."""
    return (json.dumps(kubeconfig_document(inputs, redact=redact), indent=2, sort_keys=True) + "\n").encode()


@dataclass(frozen=True, slots=True, kw_only=True)
class KubeconfigPlan:
    write: bool
    reason: str


def plan_write(
    *, current: bytes | None, current_mode: int | None, desired: bytes, mode: int
) -> KubeconfigPlan:
    """Whether the file must be (re)written. `current` is None when there is no file."""
    if current is None:
        return KubeconfigPlan(write=True, reason="missing")
    if current != desired:
        return KubeconfigPlan(write=True, reason="content changed (token rotated, CA or server changed)")
    if current_mode is not None and current_mode & 0o777 != mode & 0o777:
        return KubeconfigPlan(write=True, reason=f"mode {current_mode & 0o777:o}, want {mode & 0o777:o}")
    return KubeconfigPlan(write=False, reason="up to date")


class KubeconfigWriter:
    """Keeps `<run dir>/istio-cni-kubeconfig` equal to what `inputs()` renders.

    `sync()` at start and then on every watch tick (or token-directory event); `remove()` on a
    final (non-upgrade) shutdown. Raises KubeconfigError when the inputs cannot be read or the
    file cannot be written; the previous file, if any, is then left as it was.
    """

    __slots__ = ("path", "mode", "_inputs", "writes", "last_reason")

    def __init__(
        self,
        path: str | Path,
        inputs: Callable[[], KubeconfigInputs],
        *,
        mode: int = DEFAULT_KUBECONFIG_MODE,
    ) -> None:
        self.path = Path(path)
        self.mode = mode
        self._inputs = inputs
        self.writes = 0
        self.last_reason = "not synced yet"

    def __repr__(self) -> str:
        return f"KubeconfigWriter({str(self.path)!r}: {self.writes} writes, {self.last_reason})"

    def _current(self) -> tuple[bytes | None, int | None]:
        try:
            with self.path.open("rb") as f:
                return f.read(), os.fstat(f.fileno()).st_mode
        except FileNotFoundError:
            return None, None
        except OSError as exc:
            raise KubeconfigError(f"cannot read {self.path}: {exc.strerror or exc}") from None

    def sync(self) -> bool:
        """Render and write if needed; True when the file was written."""
        inputs = self._inputs()
        desired = render_kubeconfig(inputs)
        current, current_mode = self._current()
        plan = plan_write(current=current, current_mode=current_mode, desired=desired, mode=self.mode)
        self.last_reason = plan.reason
        if not plan.write:
            return False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path, desired, self.mode)
        except OSError as exc:
            raise KubeconfigError(
                f"cannot write the plugin's kubeconfig {self.path}: {exc.strerror or exc}"
            ) from None
        self.writes += 1
        log.info(
            "wrote the CNI plugin's kubeconfig %s (%s): %s",
            self.path,
            plan.reason,
            render_kubeconfig(inputs, redact=True).decode(),
        )
        return True

    def remove(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise KubeconfigError(f"cannot remove {self.path}: {exc.strerror or exc}") from None
        self.last_reason = "removed"
