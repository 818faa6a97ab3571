"""The CNI plugin's own API credential across a node agent restart (issue 31).

With bound service-account tokens the agent's token dies with the agent's pod; the plugin's
kubeconfig used to carry it, so while the agent was replaced no pod could start on the node, pods
outside the mesh included. Now the agent requests (TokenRequest) a short-lived token of the
narrow `istio-cni-plugin` account for the plugin and renews it before it expires. Here, against
the fake API server over HTTPS: the agent (its real `PluginTokens`, `KubeconfigWriter` and
`KubeClient`) writes the kubeconfig; then the agent is gone (its token refused, no sockets) and
the real plugin runs as the runtime runs it: a pod outside the mesh starts, an ambient pod fails
closed.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from ambient_mesh.cni.agent_config import AgentConfig
from ambient_mesh.cni.cniconf import ErrorCode
from ambient_mesh.cni.kubeconfig import KubeconfigInputs, KubeconfigWriter
from ambient_mesh.cni.plugin_token import PLUGIN_SERVICE_ACCOUNT, PluginTokens
from ambient_mesh.cni.podinfo import PLUGIN_KUBECONFIG_NAME
from ambient_mesh.kube.client import KubeApiError, KubeClient
from ambient_mesh.kube.kubeconfig import load_kubeconfig
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


class AgentSide:
    """The node agent's side: its own kubeconfig (its token), its client, the plugin's tokens."""

    def __init__(self, root: Path, api: FakeApiServer, ca_pem: bytes, token: str) -> None:
        self.run_dir = root / "run"
        self.run_dir.mkdir()
        own = root / "agent-kubeconfig"
        own.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [
                        {"name": "c", "cluster": {"server": api.url, "certificate-authority-data": ""}}
                    ],
                    "users": [{"name": "u", "user": {"token": token}}],
                    "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                    "current-context": "x",
                }
            )
        )
        import base64

        doc = json.loads(own.read_text())
        doc["clusters"][0]["cluster"]["certificate-authority-data"] = base64.b64encode(ca_pem).decode()
        own.write_text(json.dumps(doc))
        self.cfg = AgentConfig.from_env(
            {"KUBECONFIG": str(own), "POD_NAMESPACE": "istio-system", "CNI_AGENT_RUN_DIR": str(self.run_dir)},
            hostname="node-1",
        )
        self.client = KubeClient(load_kubeconfig(own))
        self.tokens = PluginTokens(self.client, namespace="istio-system")
        self.writer = KubeconfigWriter(
            self.run_dir / PLUGIN_KUBECONFIG_NAME,
            lambda: KubeconfigInputs.for_plugin(self.cfg, self.tokens.current()),
        )

    def plugin_token(self) -> str:
        doc = json.loads((self.run_dir / PLUGIN_KUBECONFIG_NAME).read_text())
        return doc["users"][0]["user"]["token"]


@pytest.fixture
async def world():
    root = Path(tempfile.mkdtemp(prefix="cnit-", dir="/tmp"))  # unix socket paths stay short
    cert, key = self_signed("kube-apiserver")
    api = FakeApiServer("agent-pod-token", tls=api_tls(cert, key, root))
    await api.put(namespace("apps", AMBIENT))
    await api.put(namespace("plain"))
    await api.put(pod("web-0", "apps"))
    await api.put(pod("db-0", "plain"))
    await api.start()
    agent = AgentSide(root, api, cert, "agent-pod-token")
    try:
        yield api, agent
    finally:
        await agent.client.close()
        await api.stop()
        shutil.rmtree(root, ignore_errors=True)


async def test_a_pod_outside_the_mesh_starts_while_the_agent_is_replaced(world):
    api, agent = world
    assert await agent.tokens.refresh() is True
    assert agent.writer.sync() is True
    # One TokenRequest, for the plugin's narrow account, not bound to any object, short-lived.
    (request,) = api.token_requests
    assert (request["namespace"], request["account"]) == ("istio-system", PLUGIN_SERVICE_ACCOUNT)
    assert request["spec"]["expirationSeconds"] == 3600 and "boundObjectRef" not in request["spec"]
    assert agent.plugin_token() == "minted-1" != "agent-pod-token"

    # The agent's pod is deleted: its bound token is refused from now on, its sockets are gone.
    api.token = "the-next-agent-pod-token"
    code, out, _ = await run_plugin_json(cni_env("db-0", "plain"), plugin_stdin(agent.run_dir))
    assert (code, out) == (0, PREV)  # outside the mesh: it starts, the agent is not needed
    # An ambient pod still fails closed: it waits for the agent rather than start unproxied.
    code, out, _ = await run_plugin_json(cni_env("web-0", "apps"), plugin_stdin(agent.run_dir))
    assert code == 1 and out["msg"] == "istio-cni cmdAdd failed to contact node Istio CNI agent"
    # The plugin read with its own token, and only read.
    plugin_requests = [
        (method, target)
        for (method, target, _, _), auth in zip(api.requests, api.authorizations, strict=True)
        if auth == "Bearer minted-1"
    ]
    assert plugin_requests and {m for m, _ in plugin_requests} == {"GET"}

    # When the agent is back it hands the ambient pod over as before.
    fake = FakeAgent()
    await fake.start(agent.run_dir)
    try:
        code, out, _ = await run_plugin_json(cni_env("web-0", "apps"), plugin_stdin(agent.run_dir))
        assert (code, out, [a["PodName"] for a in fake.adds()]) == (0, PREV, ["web-0"])
    finally:
        fake.close()


async def test_the_plugins_token_has_no_rights_beyond_reading_pods_and_namespaces(world):
    api, agent = world
    assert await agent.tokens.refresh() is True
    token = agent.tokens.current()
    assert token is not None
    creds = load_kubeconfig(agent.run_dir.parent / "agent-kubeconfig")
    plugin_client = KubeClient(type(creds)(server=creds.server, token=token, ca_data=creds.ca_data))
    try:
        from ambient_mesh.kube.client import PODS

        assert (await plugin_client.get(PODS, "apps", "web-0"))["metadata"]["name"] == "web-0"
        with pytest.raises(KubeApiError) as exc:
            await plugin_client.list(PODS)
        assert exc.value.status == 403
        with pytest.raises(KubeApiError) as exc:
            await plugin_client.request_token("istio-system", "istio-cni", expiration_s=3600)
        assert exc.value.status == 403
    finally:
        await plugin_client.close()


async def test_without_the_right_to_request_it_the_agents_own_token_is_used(world, caplog):
    """Istio's own charts grant no TokenRequest: the kubeconfig then carries the agent's token
    (istio-cni's behaviour), the log says what to grant, and an agent restart blocks even pods
    outside the mesh until the new agent rewrites it: the problem this feature removes."""
    api, agent = world
    api.token_request_status = 403
    assert await agent.tokens.refresh() is False
    assert "grant the agent `create` on serviceaccounts/token for istio-cni-plugin" in caplog.text
    agent.writer.sync()
    assert agent.plugin_token() == "agent-pod-token"
    api.token = "the-next-agent-pod-token"
    code, out, _ = await run_plugin_json(cni_env("db-0", "plain"), plugin_stdin(agent.run_dir))
    assert code == 1 and out["code"] == int(ErrorCode.TRY_AGAIN_LATER) and "answered 401" in out["details"]


async def test_the_token_is_renewed_before_it_expires_and_the_kubeconfig_rewritten(world):
    api, agent = world
    api.minted_ttl_s = 100.0  # the server shortens what was asked
    assert await agent.tokens.refresh() is True
    agent.writer.sync()
    delay = agent.tokens.next_delay(0)
    assert 75 <= delay <= 81  # at 80% of the lifetime the server granted
    assert await agent.tokens.refresh() is True
    assert agent.writer.sync() is True and agent.plugin_token() == "minted-2"
    # An expired token is never handed out: the kubeconfig falls back to the agent's own.
    api.revoke("minted-2")
    agent.tokens.clock = lambda: 10**10
    assert agent.tokens.current() is None
    agent.writer.sync()
    assert agent.plugin_token() == "agent-pod-token"


def agent_kubeconfig(path: Path, server: str, token: str) -> Path:
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": server}}],
                "users": [{"name": "u", "user": {"token": token}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return path


async def test_the_agent_renews_the_plugins_token_in_the_background(tmp_path):
    """The wiring `build()` makes: the pod source's client requests the token, the renewal task
    asks again at 80% of each lifetime and rewrites the kubeconfig each time."""
    import asyncio

    from ambient_mesh.cni.agent import build

    api = FakeApiServer("agent-pod-token")
    api.minted_ttl_s = 2.0
    await api.start()
    env = {
        "KUBECONFIG": str(agent_kubeconfig(tmp_path / "kc", api.url, "agent-pod-token")),
        "AMBIENT_ENABLED": "true",
        "POD_NAMESPACE": "istio-system",
        "CNI_AGENT_RUN_DIR": str(tmp_path / "run"),
        "KUBELET_UID": "0",
    }
    agent = build(AgentConfig.from_env(env, hostname="node-1"))
    assert agent.plugin_tokens is not None and agent.kubeconfig is not None
    try:
        assert await agent.plugin_tokens.refresh() is True
        agent.kubeconfig.sync()
        renew = asyncio.create_task(agent._renew_plugin_token())
        try:
            await asyncio.sleep(3.6)  # two renewals at about 1.6 s each
        finally:
            renew.cancel()
        assert len(api.token_requests) >= 3
        token = json.loads(agent.kubeconfig.path.read_text())["users"][0]["user"]["token"]
        assert token == f"minted-{len(api.token_requests)}"
        assert "plugin_token" in agent.dump()
    finally:
        if agent.source is not None:
            await agent.source.client.close()  # type: ignore[attr-defined]
        await api.stop()
    # No account named: the plugin gets the agent's own token, as with istio-cni.
    plain = build(AgentConfig.from_env({**env, "PLUGIN_SERVICE_ACCOUNT": ""}, hostname="node-1"))
    assert plain.plugin_tokens is None
