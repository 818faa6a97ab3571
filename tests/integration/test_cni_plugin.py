"""The CNI plugin end to end: first in-process with recording fakes (decisions, fail-closed paths,
retries, arbitrary input), then as a real subprocess run the way a container runtime runs it,
against a fake node agent (HTTP on a unix socket in a temp dir) that records what it receives."""

from __future__ import annotations

import asyncio
import io
import json
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ambient_mesh.cni.cniconf import ErrorCode
from ambient_mesh.cni.enablement import DEFAULT_ENABLEMENT_SELECTORS
from ambient_mesh.cni.plugin import Plugin, PluginLog
from ambient_mesh.cni.podinfo import NamespaceInfo, PodInfo, PodLookupError
from ambient_mesh.http1 import ClientResponse
from tests.integration.cni_plugin_run import POD_YAML, run_plugin

AMBIENT = {"istio.io/dataplane-mode": "ambient"}
PREV = {
    "cniVersion": "1.0.0",
    "interfaces": [{"name": "eth0", "sandbox": "/var/run/netns/cni-1"}],
    "ips": [
        {"address": "10.244.1.5/24", "gateway": "10.244.1.1", "interface": 0},
        {"address": "fd00::5/64", "interface": 0},
    ],
}


def env(pod="web-0", namespace="apps", command="ADD", **extra) -> dict[str, str]:
    return {
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": "c0ffee",
        "CNI_NETNS": "/var/run/netns/cni-1",
        "CNI_IFNAME": "eth0",
        "CNI_PATH": "/opt/cni/bin",
        "CNI_ARGS": f"IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={pod};K8S_POD_INFRA_CONTAINER_ID=c0ffee;K8S_POD_UID=u1",
        **extra,
    }


def stdin(run_dir="/run/x", version="1.0.0", prev=PREV, **extra) -> bytes:
    doc = {
        "cniVersion": version,
        "name": "k8s-pod-network",
        "type": "istio-cni",
        "cni_agent_run_dir": run_dir,
        "ambient_enabled": True,
        "enablement_selectors": [s.to_json() for s in DEFAULT_ENABLEMENT_SELECTORS],
        "exclude_namespaces": ["kube-system"],
        "pod_namespace": "istio-system",
        **extra,
    }
    if prev is not None:
        doc["prevResult"] = prev
    return json.dumps(doc).encode()


# -- in-process, with fakes -------------------------------------------------------------------


class FakeLookup:
    def __init__(self, pods=(), namespaces=(), broken=False):
        self.pods = {(p.namespace, p.name): p for p in pods}
        self.namespaces = {n.name: n for n in namespaces}
        self.broken = broken

    def get_pod(self, namespace, name):
        if self.broken:
            raise PodLookupError("API server unreachable")
        return self.pods.get((namespace, name))

    def get_namespace(self, name):
        if self.broken:
            raise PodLookupError("API server unreachable")
        return self.namespaces.get(name)


class RecordingTransport:
    def __init__(self, status=200, body=b"", error=None):
        self.status, self.body, self.error = status, body, error
        self.requests: list[tuple[str, str, bytes, float]] = []

    def factory(self, socket_path):
        self.socket_path = socket_path
        return self

    def post(self, path, body, *, timeout_s):
        self.requests.append((self.socket_path, path, body, timeout_s))
        if self.error is not None:
            raise self.error
        return ClientResponse(status=self.status, body=self.body)


def make_plugin(lookup, transport=None, sleeps=None, same_netns=False):
    transport = transport or RecordingTransport()
    return Plugin(
        lookup_factory=lambda conf: lookup,
        transport_factory=transport.factory,
        sleep=(sleeps.append if sleeps is not None else lambda s: None),
        same_netns=lambda path: same_netns,
    ), transport


WORLD = FakeLookup(
    pods=[
        PodInfo(name="web-0", namespace="apps"),
        PodInfo(name="opt-out", namespace="apps", labels={"istio.io/dataplane-mode": "none"}),
        PodInfo(name="db-0", namespace="plain"),
    ],
    namespaces=[NamespaceInfo(name="apps", labels=AMBIENT), NamespaceInfo(name="plain")],
)


def test_ambient_pod_is_posted_and_prev_result_passed_through():
    plugin, transport = make_plugin(WORLD)
    out = plugin.run(env(), stdin())
    assert (out.exit_code, json.loads(out.stdout)) == (0, PREV)
    [(sock, path, body, timeout)] = transport.requests
    assert (sock, path, timeout) == ("/run/x/pluginevent.sock", "/cmdadd", 5.0)
    assert json.loads(body) == {
        "Netns": "/var/run/netns/cni-1",
        "PodName": "web-0",
        "PodNamespace": "apps",
        "IPs": [
            {"Interface": 0, "Address": {"IP": "10.244.1.5", "Mask": "////AA=="}, "Gateway": "10.244.1.1"},
            {"Interface": 0, "Address": {"IP": "fd00::5", "Mask": "//////////8AAAAAAAAAAA=="}, "Gateway": ""},
        ],
    }


@pytest.mark.parametrize(
    ("pod", "namespace"),
    [
        ("opt-out", "apps"),
        ("db-0", "plain"),
        ("anything", "kube-system"),
        ("istio-cni-node-x1", "istio-system"),
    ],
)
def test_non_ambient_pods_are_not_posted(pod, namespace):
    plugin, transport = make_plugin(WORLD)
    out = plugin.run(env(pod=pod, namespace=namespace), stdin())
    assert (out.exit_code, json.loads(out.stdout), transport.requests) == (0, PREV, [])


def test_not_a_kubernetes_pod():
    plugin, transport = make_plugin(FakeLookup(broken=True))
    out = plugin.run(env(CNI_ARGS=""), stdin(prev=None))
    assert (out.exit_code, json.loads(out.stdout), transport.requests) == (
        0,
        {"cniVersion": "1.0.0", "dns": {}},
        [],
    )


def test_agent_own_pod_skips_lookup_entirely():
    plugin, transport = make_plugin(FakeLookup(broken=True))
    out = plugin.run(env(pod="istio-cni-node-abcde", namespace="istio-system"), stdin())
    assert (out.exit_code, transport.requests) == (0, [])


def test_lookup_failure_fails_closed_after_one_retry():
    sleeps: list[float] = []
    plugin, transport = make_plugin(FakeLookup(broken=True), sleeps=sleeps)
    out = plugin.run(env(), stdin())
    err = json.loads(out.stdout)
    assert out.exit_code == 1 and err["code"] == ErrorCode.TRY_AGAIN_LATER and err["cniVersion"] == "1.0.0"
    assert "API server unreachable" in err["details"]
    assert (sleeps, transport.requests) == ([1.0], [])


def test_detection_retry_flag_retries_thirty_times():
    sleeps: list[float] = []
    plugin, _ = make_plugin(FakeLookup(broken=True), sleeps=sleeps)
    assert plugin.run(env(), stdin(enable_ambient_detection_retry=True)).exit_code == 1
    assert sleeps == [1.0] * 29


def test_unknown_pod_in_ambient_namespace_fails_closed():
    plugin, transport = make_plugin(WORLD)
    out = plugin.run(env(pod="not-yet-written"), stdin())
    assert out.exit_code == 1 and "not found in the pod source" in json.loads(out.stdout)["details"]


def test_unknown_pod_where_no_selector_can_match_passes():
    only_ns = [DEFAULT_ENABLEMENT_SELECTORS[1].to_json()]
    plugin, transport = make_plugin(WORLD)
    out = plugin.run(env(pod="not-yet-written", namespace="plain"), stdin(enablement_selectors=only_ns))
    assert (out.exit_code, transport.requests) == (0, [])


def test_agent_errors_fail_the_add():
    for transport in (
        RecordingTransport(status=500, body=b"no ztunnel connection\n"),
        RecordingTransport(error=ConnectionRefusedError(111, "refused")),
    ):
        plugin, _ = make_plugin(WORLD, transport)
        out = plugin.run(env(), stdin())
        err = json.loads(out.stdout)
        assert (out.exit_code, err["code"]) == (1, 999)
        assert err["msg"] == "istio-cni cmdAdd failed to contact node Istio CNI agent"
    assert (
        "(status code 500): no ztunnel connection"
        in json.loads(
            make_plugin(WORLD, RecordingTransport(status=500, body=b"no ztunnel connection"))[0]
            .run(env(), stdin())
            .stdout
        )["details"]
    )


def test_own_netns_refused():
    plugin, transport = make_plugin(WORLD, same_netns=True)
    out = plugin.run(env(), stdin())
    assert (out.exit_code, json.loads(out.stdout)["code"], transport.requests) == (1, 8, [])


def test_ambient_disabled_passes_through():
    plugin, transport = make_plugin(FakeLookup(broken=True))
    out = plugin.run(env(), stdin(ambient_enabled=False))
    assert (out.exit_code, transport.requests) == (0, [])


def test_del_never_fails_and_check_needs_040():
    plugin, transport = make_plugin(FakeLookup(broken=True))
    assert plugin.run({"CNI_COMMAND": "DEL"}, b"garbage").exit_code == 0
    assert plugin.run(env(command="DEL"), stdin()).stdout == b""
    assert plugin.run(env(command="CHECK"), stdin(version="0.4.0")).exit_code == 0
    check_031 = plugin.run(env(command="CHECK"), stdin(version="0.3.1"))
    assert (check_031.exit_code, json.loads(check_031.stdout)["code"]) == (1, 1)
    assert transport.requests == []


def test_version_and_about():
    plugin, _ = make_plugin(WORLD)
    assert json.loads(plugin.run({"CNI_COMMAND": "VERSION"}, b"").stdout)["supportedVersions"][-1] == "1.1.0"
    about = plugin.run({}, b"")
    assert (about.exit_code, about.stdout) == (0, b"")
    assert b"CNI protocol versions supported: 0.3.0, 0.3.1, 0.4.0, 1.0.0, 1.1.0" in about.stderr


def test_log_goes_to_stderr_only_at_debug(tmp_path):
    plugin, _ = make_plugin(WORLD)
    out = plugin.run(env(), stdin(run_dir=str(tmp_path)))
    quiet = io.StringIO()
    plugin.flush_log(out, stderr=quiet)
    assert quiet.getvalue() == ""
    plugin, _ = make_plugin(WORLD)
    out = plugin.run(env(), stdin(run_dir=str(tmp_path), plugin_log_level="debug"))
    loud = io.StringIO()
    plugin.flush_log(out, stderr=loud)
    lines = [json.loads(line) for line in loud.getvalue().splitlines()]
    assert {"level", "time", "msg"} <= set(lines[-1]) and lines[-1]["pod"] == "apps/web-0"
    assert repr(PluginLog()) == "PluginLog(0 records)"


commands = st.sampled_from(["ADD", "DEL", "CHECK", "VERSION", "GC", "STATUS", "BOGUS", ""])


@settings(max_examples=150, deadline=None)
@given(
    commands,
    st.text(max_size=80),
    st.binary(max_size=120)
    | st.builds(
        lambda **kw: stdin(**kw),
        version=st.sampled_from(["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0", "0.2.0", ""]),
        prev=st.none() | st.just(PREV) | st.just({"ips": "x"}),
    ),
)
def test_arbitrary_input_gives_a_result_or_our_error(command, cni_args, data):
    plugin, _ = make_plugin(WORLD)
    out = plugin.run(env(command=command, CNI_ARGS=cni_args), data)
    if out.exit_code:
        err = json.loads(out.stdout)
        assert set(err) == {"cniVersion", "code", "msg", "details"} and isinstance(err["code"], int)
    elif out.stdout:
        assert isinstance(json.loads(out.stdout), dict)


# -- subprocess, against a fake agent socket ------------------------------------------------------


class FakeAgent:
    """The node agent's plugin-facing sockets: /cmdadd on pluginevent.sock, /log on log.sock."""

    def __init__(self, status=200, reply=b""):
        self.status, self.reply = status, reply
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []
        self.servers: list[asyncio.AbstractServer] = []

    async def start(self, run_dir: Path) -> None:
        for name in ("pluginevent.sock", "log.sock"):
            self.servers.append(
                await asyncio.start_unix_server(
                    lambda r, w, n=name: self._serve(n, r, w), path=str(run_dir / name)
                )
            )

    async def _serve(self, sock, reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        method, path, _ = lines[0].split(" ")
        headers = dict(line.split(": ", 1) for line in lines[1:] if line)
        body = await reader.readexactly(int(headers["Content-Length"]))
        self.requests.append((sock, f"{method} {path}", headers, body))
        status = self.status if path == "/cmdadd" else 200
        writer.write(
            f"HTTP/1.1 {status} X\r\nContent-Length: {len(self.reply)}\r\n\r\n".encode() + self.reply
        )
        await writer.drain()
        writer.close()

    def close(self):
        for s in self.servers:
            s.close()

    def posts(self, path):
        return [r for r in self.requests if r[1] == f"POST {path}"]


@pytest.fixture
def run_dir():
    # Short path: unix socket paths are limited to 107 bytes.
    d = Path(tempfile.mkdtemp(prefix="cni-", dir="/tmp"))
    (d / "pods").mkdir()
    (d / "pods" / "objects.yaml").write_text(POD_YAML)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def plugin_stdin(run_dir: Path, **extra) -> bytes:
    return stdin(run_dir=str(run_dir), ambient_pod_source={"directory": str(run_dir / "pods")}, **extra)


async def test_subprocess_ambient_pod(run_dir):
    agent = FakeAgent()
    await agent.start(run_dir)
    try:
        code, out, err = await run_plugin(env(), plugin_stdin(run_dir))
    finally:
        agent.close()
    assert (code, json.loads(out), err) == (0, PREV, b"")
    [(_, _, headers, body)] = agent.posts("/cmdadd")
    assert headers["Content-Type"] == "application/json"
    assert (
        json.loads(body)["PodName"] == "web-0" and json.loads(body)["IPs"][0]["Address"]["IP"] == "10.244.1.5"
    )
    [(_, _, _, log_body)] = agent.posts("/log")
    lines = [json.loads(s) for s in json.loads(log_body)]
    assert lines[-1]["msg"] == "pod added to the ambient mesh by the node agent"


async def test_subprocess_non_ambient_pod(run_dir):
    agent = FakeAgent()
    await agent.start(run_dir)
    try:
        code, out, _ = await run_plugin(env(pod="db-0", namespace="plain"), plugin_stdin(run_dir))
    finally:
        agent.close()
    assert (code, json.loads(out), agent.posts("/cmdadd")) == (0, PREV, [])


async def test_subprocess_agent_down(run_dir):
    code, out, err = await run_plugin(env(), plugin_stdin(run_dir))
    assert code == 1 and err == b""
    error = json.loads(out)
    assert (error["cniVersion"], error["code"]) == ("1.0.0", 999)
    assert "pluginevent.sock" in error["details"] and "is the node agent" in error["details"]


async def test_subprocess_agent_refuses(run_dir):
    agent = FakeAgent(status=500, reply=b"no ztunnel connection")
    await agent.start(run_dir)
    try:
        code, out, _ = await run_plugin(env(), plugin_stdin(run_dir))
    finally:
        agent.close()
    assert code == 1 and json.loads(out)["details"].endswith("(status code 500): no ztunnel connection")


async def test_subprocess_del_always_succeeds(run_dir):
    assert await run_plugin(env(command="DEL"), plugin_stdin(run_dir)) == (0, b"", b"")
    assert await run_plugin({"CNI_COMMAND": "DEL"}, b"not json") == (0, b"", b"")


async def test_subprocess_own_netns_refused(run_dir):
    agent = FakeAgent()
    await agent.start(run_dir)
    try:
        code, out, _ = await run_plugin(env(CNI_NETNS="/proc/self/ns/net"), plugin_stdin(run_dir))
    finally:
        agent.close()
    assert (code, json.loads(out)["code"], agent.posts("/cmdadd")) == (1, 8, [])
