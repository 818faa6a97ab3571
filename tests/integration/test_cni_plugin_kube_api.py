"""The CNI plugin asking the Kubernetes API server, end to end: the agent's `KubeconfigWriter`
renders the plugin's kubeconfig from a service-account directory; the real plugin runs as a
subprocess (as a container runtime runs it) and GETs the pod and its namespace from a tiny fake
API server over HTTPS on 127.0.0.1 with a self-signed certificate; a fake node agent on unix
sockets records whether the pod was handed over. Every failure must fail the ADD closed."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from ambient_mesh.cni.cniconf import ErrorCode
from ambient_mesh.cni.kubeconfig import KubeconfigInputs, KubeconfigWriter
from ambient_mesh.cni.podinfo import PLUGIN_KUBECONFIG_NAME
from tests.helpers.cni_plugin import (
    AMBIENT,
    PREV,
    FakeAgent,
    cni_env,
    namespace,
    plugin_stdin,
    pod,
    run_plugin_json,
)

from .kube_fake import FakeApiServer, api_tls, self_signed


class Node:
    """One node's worth of files: the agent's service account and run dir."""

    def __init__(self, root: Path, api: FakeApiServer, ca_pem: bytes, token: str) -> None:
        self.run_dir = root / "run"
        self.run_dir.mkdir()
        self.sa = root / "serviceaccount"
        self.sa.mkdir()
        (self.sa / "ca.crt").write_bytes(ca_pem)
        (self.sa / "token").write_text(token)
        self.writer = KubeconfigWriter(
            self.run_dir / PLUGIN_KUBECONFIG_NAME,
            lambda: KubeconfigInputs.from_service_account(
                host="127.0.0.1", port=str(api.port), sa_path=self.sa
            ),
        )


@pytest.fixture
async def world():
    # Short path: unix socket paths are limited to 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="cnik-", dir="/tmp"))
    cert, key = self_signed("kube-apiserver")
    api = FakeApiServer("tok-1", tls=api_tls(cert, key, root))
    await api.put(namespace("apps", AMBIENT))
    await api.put(namespace("plain"))
    await api.put(pod("web-0", "apps"))
    await api.put(pod("opt-out", "apps", {"istio.io/dataplane-mode": "none"}))
    await api.put(pod("db-0", "plain"))
    await api.start()
    node = Node(root, api, cert, "tok-1")
    node.writer.sync()
    agent = FakeAgent()
    await agent.start(node.run_dir)
    try:
        yield api, node, agent
    finally:
        agent.close()
        await api.stop()
        shutil.rmtree(root, ignore_errors=True)


async def test_ambient_pod_is_looked_up_and_handed_to_the_agent(world):
    api, node, agent = world
    code, out, err = await run_plugin_json(cni_env("web-0", "apps"), plugin_stdin(node.run_dir))
    assert (code, out, err) == (0, PREV, b"")
    assert api.gets() == ["/api/v1/namespaces/apps", "/api/v1/namespaces/apps/pods/web-0"]
    assert set(api.authorizations) == {"Bearer tok-1"}
    [add] = agent.adds()
    assert (add["PodName"], add["PodNamespace"], add["Netns"]) == ("web-0", "apps", "/var/run/netns/cni-1")
    assert add["IPs"][0]["Address"]["IP"] == "10.244.1.5"


@pytest.mark.parametrize(("name", "ns"), [("opt-out", "apps"), ("db-0", "plain")])
async def test_non_ambient_pod_is_not_handed_over(world, name, ns):
    api, node, agent = world
    code, out, _ = await run_plugin_json(cni_env(name, ns), plugin_stdin(node.run_dir))
    assert (code, out, agent.adds()) == (0, PREV, [])
    assert api.gets()[-1] == f"/api/v1/namespaces/{ns}/pods/{name}"


async def test_api_server_down_fails_closed(world):
    api, node, agent = world
    await api.stop()
    code, out, _ = await run_plugin_json(cni_env("web-0", "apps"), plugin_stdin(node.run_dir))
    assert code == 1 and agent.adds() == []
    assert (out["cniVersion"], out["code"]) == ("1.0.0", int(ErrorCode.TRY_AGAIN_LATER))
    assert out["msg"] == "istio-cni cmdAdd failed to decide whether the pod is ambient"
    assert "ConnectionRefusedError" in out["details"]


async def test_rotated_token_fails_closed_until_the_agent_rewrites_the_kubeconfig(world):
    api, node, agent = world
    api.token = "tok-2"  # the API server no longer accepts the old token
    code, out, _ = await run_plugin_json(cni_env("web-0", "apps"), plugin_stdin(node.run_dir))
    assert (code, agent.adds()) == (1, []) and "answered 401" in out["details"]
    (node.sa / "token").write_text("tok-2")  # kubelet rotated the projected token
    assert node.writer.sync() is True
    code, out, _ = await run_plugin_json(cni_env("web-0", "apps"), plugin_stdin(node.run_dir))
    assert (code, out, [a["PodName"] for a in agent.adds()]) == (0, PREV, ["web-0"])


async def test_untrusted_api_server_certificate_fails_closed(world):
    api, node, agent = world
    other_ca, _ = self_signed("someone-else")
    (node.sa / "ca.crt").write_bytes(other_ca)
    node.writer.sync()
    code, out, _ = await run_plugin_json(cni_env("web-0", "apps"), plugin_stdin(node.run_dir))
    assert (code, agent.adds()) == (1, []) and "CERTIFICATE_VERIFY_FAILED" in out["details"]
    assert api.gets() == []


async def test_missing_kubeconfig_fails_closed(world):
    api, node, agent = world
    node.writer.remove()
    code, out, _ = await run_plugin_json(cni_env("web-0", "apps"), plugin_stdin(node.run_dir))
    assert (code, agent.adds(), api.requests) == (1, [], [])
    assert "istio-cni-kubeconfig does not exist" in out["details"]
