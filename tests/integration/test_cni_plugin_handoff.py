"""The plugin's handoff of whole runs to the node agent, and falling back when it cannot.

The agent side is the real `CniPluginServer` over a real unix socket, with a YAML pod source and
an add handler that records; the plugin side is the real entry, run as the runtime runs it (a
subprocess with stdin and CNI_* variables), or its functions called directly for the bounds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from ambient_mesh.cni import cni_server
from ambient_mesh.cni.cni_server import MAX_PLUGIN_RUN_ENV_VARS, CniPluginServer, decode_plugin_run
from ambient_mesh.cni.enablement import DEFAULT_ENABLEMENT_SELECTORS
from ambient_mesh.cni.plugin_basics import DEFAULT_CNI_AGENT_RUN_DIR, PLUGIN_RUN_SOCKET_NAME
from ambient_mesh.cni.plugin_handoff import (
    MAX_PLUGIN_RUN_REPLY_BYTES,
    ask_agent,
    decode_reply,
    encode_request,
    plugin_run_socket,
)
from ambient_mesh.cni.pods import DirectoryPodSource
from ambient_mesh.errors import ProtocolError
from tests.integration.cni_plugin_run import POD_YAML, run_plugin

WAIT_S = 10.0


class RecordingAdd:
    def __init__(self) -> None:
        self.events: list = []
        self.answer: str | None = None

    async def __call__(self, event):
        self.events.append(event)
        return self.answer


@pytest.fixture
def work():
    # unix socket paths must stay under 108 bytes; pytest's tmp_path can be longer
    path = Path(tempfile.mkdtemp(prefix="ament-", dir="/tmp"))
    (path / "pods").mkdir()
    (path / "pods" / "objects.yaml").write_text(POD_YAML)
    (path / "run").mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def agent(work):
    source = DirectoryPodSource(work / "pods", node_name="", state_file=work / "state.json")
    await source.start()
    adds = RecordingAdd()
    server = CniPluginServer(
        work / "run" / "pluginevent.sock",
        work / "run" / "log.sock",
        adds,
        run_socket=work / "run" / PLUGIN_RUN_SOCKET_NAME,
        pods=source,
    )
    await server.start()
    yield server, adds
    await server.stop()


def conf(run_dir: Path, **extra) -> bytes:
    doc = {
        "cniVersion": "1.0.0",
        "name": "k8s-pod-network",
        "type": "istio-cni",
        "cni_agent_run_dir": str(run_dir),
        "ambient_enabled": True,
        "enablement_selectors": [s.to_json() for s in DEFAULT_ENABLEMENT_SELECTORS],
        "plugin_log_level": "debug",
        "prevResult": {"cniVersion": "1.0.0", "ips": [{"address": "10.244.1.5/24", "interface": 0}]},
        **extra,
    }
    return json.dumps(doc).encode()


def cni_env(pod: str, namespace: str, command: str = "ADD", netns: str = "/var/run/netns/pod-x") -> dict:
    return {
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": "c0ffee",
        "CNI_NETNS": netns,
        "CNI_IFNAME": "eth0",
        "CNI_PATH": "/opt/cni/bin",
        "CNI_ARGS": f"IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={pod}",
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
    }


# -- through the agent ---------------------------------------------------------------------------


async def test_an_ambient_pod_is_decided_and_added_by_the_agent(agent, work, caplog):
    server, adds = agent
    with caplog.at_level(logging.DEBUG, logger="ambient_mesh.cni-plugin"):
        code, out, err = await run_plugin(cni_env("web-0", "apps"), conf(work / "run"))
    assert code == 0, (out, err)
    result = json.loads(out)
    assert result["cniVersion"] == "1.0.0" and result["ips"][0]["address"] == "10.244.1.5/24"
    assert server.plugin_runs == 1
    assert [(e.pod_namespace, e.pod_name, e.netns) for e in adds.events] == [
        ("apps", "web-0", "/var/run/netns/pod-x")
    ]
    assert [str(ip.address) for ip in adds.events[0].ips] == ["10.244.1.5"]
    # the run's log lines come out of the agent under the plugin's scope
    messages = [r.getMessage() for r in caplog.records if r.name == "ambient_mesh.cni-plugin"]
    assert any("added to the ambient mesh" in m for m in messages), messages


async def test_a_non_ambient_pod_is_passed_through_by_the_agent_without_an_add(agent, work):
    server, adds = agent
    code, out, _ = await run_plugin(cni_env("db-0", "plain"), conf(work / "run"))
    assert code == 0 and json.loads(out)["ips"][0]["address"] == "10.244.1.5/24"
    assert server.plugin_runs == 1 and adds.events == []


async def test_the_agents_add_failure_fails_the_add(agent, work):
    server, adds = agent
    adds.answer = "no ztunnel connection"
    code, out, _ = await run_plugin(cni_env("web-0", "apps"), conf(work / "run"))
    error = json.loads(out)
    assert code == 1 and error["code"] == 999 and "no ztunnel connection" in error["details"]
    assert server.plugin_runs == 1


async def test_a_pod_the_watch_has_not_delivered_is_fetched_by_the_agent(agent, work):
    server, adds = agent
    (work / "pods" / "late.yaml").write_text(
        "apiVersion: v1\nkind: Pod\nmetadata: {name: late-0, namespace: apps}\nspec: {containers: [{name: app}]}\n"
    )
    assert server.pods is not None and server.pods.pod("apps", "late-0") is None
    code, out, err = await run_plugin(cni_env("late-0", "apps"), conf(work / "run"))
    assert code == 0, (out, err)
    assert [e.pod_name for e in adds.events] == ["late-0"]


async def test_del_is_answered_by_the_agent(agent, work):
    server, _ = agent
    code, out, _ = await run_plugin(cni_env("web-0", "apps", command="DEL"), conf(work / "run"))
    assert (code, out) == (0, b"")
    assert server.plugin_runs == 1


async def test_the_plugins_own_netns_is_refused(agent, work):
    server, adds = agent
    environ = cni_env("web-0", "apps", netns="/proc/self/ns/net")
    code, out, _ = await run_plugin(environ, conf(work / "run"))
    assert code == 1 and "should not be the same" in json.loads(out)["msg"]
    assert adds.events == []


# -- falling back: the plugin decides by itself -------------------------------------------------------


async def test_without_an_agent_a_non_ambient_pod_starts_and_an_ambient_one_fails_closed(work):
    pods = {"ambient_pod_source": {"directory": str(work / "pods")}}
    code, out, _ = await run_plugin(cni_env("db-0", "plain"), conf(work / "run", **pods))
    assert code == 0 and json.loads(out)["ips"]
    code, out, _ = await run_plugin(cni_env("web-0", "apps"), conf(work / "run", **pods))
    error = json.loads(out)
    assert code == 1 and "failed to contact node Istio CNI agent" in error["msg"]


async def test_a_refused_run_falls_back_to_the_plugin(agent, work, monkeypatch):
    server, adds = agent
    monkeypatch.setattr(cni_server, "MAX_CONCURRENT_PLUGIN_RUNS", 0)
    pods = {"ambient_pod_source": {"directory": str(work / "pods")}}
    code, out, err = await run_plugin(cni_env("web-0", "apps"), conf(work / "run", **pods))
    # the plugin decided by itself and pushed the add over the event socket
    assert code == 0, (out, err)
    assert server.plugin_runs == 0 and server.plugin_runs_refused == 1
    assert [e.pod_name for e in adds.events] == ["web-0"]


# -- bounds of the exchange ----------------------------------------------------------------------------


def exchange_raw(path: Path, data: bytes, *, half_close: bool = True) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(WAIT_S)
        sock.connect(str(path))
        try:
            sock.sendall(data)
        except BrokenPipeError:
            return b""
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


async def test_an_oversized_request_is_closed_without_a_run(agent, work):
    server, _ = agent
    assert server.run_socket is not None
    huge = b"x" * (cni_server.MAX_PLUGIN_RUN_REQUEST_BYTES + 10)
    assert await asyncio.to_thread(exchange_raw, server.run_socket, huge) == b""
    assert server.plugin_runs == 0


async def test_a_request_that_never_ends_is_closed(agent, work, monkeypatch):
    server, _ = agent
    assert server.run_socket is not None
    monkeypatch.setattr(cni_server, "REQUEST_READ_TIMEOUT_S", 0.2)
    reply = await asyncio.to_thread(exchange_raw, server.run_socket, b'{"env": {', half_close=False)
    assert reply == b"" and server.plugin_runs == 0


@pytest.mark.parametrize(
    "data",
    [
        b"{",
        b"[]",
        b'{"env": {"PATH": "/bin"}, "stdin": "{}", "netns_is_own": false}',
        b'{"env": {"CNI_COMMAND": 1}, "stdin": "{}", "netns_is_own": false}',
        b'{"env": {}, "stdin": 3, "netns_is_own": false}',
        b'{"env": {}, "stdin": "{}", "netns_is_own": "no"}',
        json.dumps(
            {
                "env": {f"CNI_{i}": "x" for i in range(MAX_PLUGIN_RUN_ENV_VARS + 1)},
                "stdin": "",
                "netns_is_own": False,
            }
        ).encode(),
    ],
)
def test_malformed_run_requests_are_rejected(data):
    with pytest.raises(ProtocolError):
        decode_plugin_run(data)


async def test_a_malformed_request_gets_no_reply(agent):
    server, _ = agent
    assert server.run_socket is not None
    assert await asyncio.to_thread(exchange_raw, server.run_socket, b'{"env": []}') == b""
    assert server.plugin_runs == 0


def test_the_request_carries_only_cni_variables():
    environ = {"CNI_COMMAND": "ADD", "CNI_NETNS": "/nonexistent", "HOME": "/root", "SECRET": "x"}
    doc = json.loads(encode_request(environ, b'{"a": 1}') or b"")
    assert doc == {
        "env": {"CNI_COMMAND": "ADD", "CNI_NETNS": "/nonexistent"},
        "stdin": '{"a": 1}',
        "netns_is_own": False,
    }
    assert encode_request(environ, b"\xff\xfe") is None


@pytest.mark.parametrize(
    "data",
    [b"", b"{", b"[]", b'{"exit_code": "0"}', b'{"exit_code": true}', b'{"exit_code": 0, "stdout": 1}'],
)
def test_replies_that_are_not_outcomes_are_refused(data):
    assert decode_reply(data) is None


def test_a_reply_is_an_outcome():
    assert decode_reply(b'{"exit_code": 1, "stdout": "{}", "stderr": "e"}') == (1, b"{}", b"e")


def test_the_socket_is_found_from_the_configs_run_dir():
    assert plugin_run_socket(b'{"cni_agent_run_dir": "/run/x/"}') == f"/run/x/{PLUGIN_RUN_SOCKET_NAME}"
    default = f"{DEFAULT_CNI_AGENT_RUN_DIR}/{PLUGIN_RUN_SOCKET_NAME}"
    for data in (b"", b"{", b"[]", b'{"cni_agent_run_dir": 3}', b'{"cni_agent_run_dir": ""}'):
        assert plugin_run_socket(data) == default


async def test_an_oversized_reply_is_refused(work):
    path = work / "big.sock"

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()
        writer.write(b" " * (MAX_PLUGIN_RUN_REPLY_BYTES + 1))
        await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(answer, path=str(path))
    try:
        assert await asyncio.to_thread(ask_agent, str(path), b"{}") is None
    finally:
        server.close()
        await server.wait_closed()


# -- input nested past the JSON parser's depth (issue 25) -------------------------------------------

NESTED = b"[" * 100_000


@pytest.mark.parametrize("command", ["ADD", "CHECK"])
async def test_deeply_nested_config_gets_a_cni_error_object_not_a_traceback(work, command):
    nested_conf = b'{"cniVersion": "1.0.0", "name": "n", "type": "istio-cni", "x": ' + NESTED + b"}"
    for stdin in (NESTED, nested_conf):
        code, out, err = await run_plugin(cni_env("web-0", "apps", command=command), stdin)
        assert code == 1, (out, err)
        error = json.loads(out)
        assert error["code"] == 6 and error["msg"] == "error decoding network config"
        assert b"Traceback" not in err


async def test_deeply_nested_input_to_the_agent_gets_no_run_and_no_crash(agent, work):
    server, adds = agent
    assert server.run_socket is not None
    request = b'{"env": {}, "stdin": "", "netns_is_own": ' + NESTED + b"}"
    assert await asyncio.to_thread(exchange_raw, server.run_socket, request) == b""
    assert server.plugin_runs == 0
    # Through the agent, the plugin's own decoding answers with the error object.
    code, out, _ = await run_plugin(cni_env("web-0", "apps"), NESTED)
    assert code == 1 and json.loads(out)["code"] == 6 and adds.events == []
    assert decode_reply(NESTED) is None
    assert plugin_run_socket(NESTED).endswith(PLUGIN_RUN_SOCKET_NAME)
