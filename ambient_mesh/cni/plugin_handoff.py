"""The CNI plugin executable's entry: hand the run to the node agent, or run it here.

A container runtime starts the plugin once per pod sandbox, and an ADD may take 100 ms of the
plugin's own time. Loading the whole plugin (the config model, the enablement rules, the API
client with ssl) costs about twice that in a frozen interpreter, most of it imports
(bench/cni_plugin_bench.py). The node agent has all of that loaded, and the pods and namespaces
of the node in its cache already. So this module imports only os, sys, socket and json, sends the
run as it came (the CNI_* environment and stdin) to the agent over `<run dir>/pluginrun.sock`,
and prints what the agent answers: the same `Plugin` code decides there, with the agent's pod
cache as its pod lookup and the agent's add handler as its event socket.

When the agent does not answer with an outcome (no socket, refused, too busy, timed out, an
answer that is not one), `plugin.main` runs here as before: it looks the pod up itself and fails
closed for a pod that may be ambient, so no pod starts outside the mesh because the agent is down,
and a pod that is not ambient still starts.

The exchange (ours; istio-cni's Go plugin needs no such thing): one JSON object each way, each
ended by the writer's half-close.
- request: `{"env": {"CNI_COMMAND": ..., ...}, "stdin": "<the config>", "netns_is_own": false}`
  (`netns_is_own`: whether CNI_NETNS is this process's own network namespace, which only the
  plugin's process can tell);
- reply: `{"exit_code": 0, "stdout": "<the CNI result or error object>", "stderr": ""}`.
"""

from __future__ import annotations

import json
import os
import socket
import sys

from .plugin_basics import (
    DEFAULT_CNI_AGENT_RUN_DIR,
    DELEGATED_ENV_PREFIX,
    MAX_PLUGIN_STDIN_BYTES,
    PLUGIN_RUN_SOCKET_NAME,
    netns_is_own,
)

TYPE_CHECKING = False  # typing itself is not imported: it is one of the costs avoided
if TYPE_CHECKING:
    from collections.abc import Mapping

# The agent's run may look a pod up twice a second apart, or 30 times with
# enable_ambient_detection_retry, then wait up to 5 s for the enrolment: 40 s covers both.
PLUGIN_RUN_TIMEOUT_S = 40.0
MAX_PLUGIN_RUN_REPLY_BYTES = 1024 * 1024


def plugin_run_socket(stdin: bytes) -> str:
    """`<cni_agent_run_dir>/pluginrun.sock`, the run dir as the config on stdin names it."""
    run_dir = DEFAULT_CNI_AGENT_RUN_DIR
    try:
        conf = json.loads(stdin) if stdin else {}
    except (ValueError, RecursionError):  # nesting past the parser's depth: not a config either
        conf = {}
    if isinstance(conf, dict):
        named = conf.get("cni_agent_run_dir")
        if isinstance(named, str) and named:
            run_dir = named
    return f"{run_dir.rstrip('/')}/{PLUGIN_RUN_SOCKET_NAME}"


def encode_request(environ: Mapping[str, str], stdin: bytes) -> bytes | None:
    """The request for `environ` and `stdin`; None when stdin is not text (the full plugin then
    answers with the proper error object)."""
    try:
        text = stdin.decode("utf-8")
    except UnicodeDecodeError:
        return None
    env = {k: v for k, v in environ.items() if k.startswith(DELEGATED_ENV_PREFIX)}
    request = {"env": env, "stdin": text, "netns_is_own": netns_is_own(env.get("CNI_NETNS", ""))}
    return json.dumps(request).encode("utf-8")


def decode_reply(data: bytes) -> tuple[int, bytes, bytes] | None:
    """(exit code, stdout, stderr) from the agent's reply; None when it is not one."""
    try:
        reply = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(reply, dict):
        return None
    code, out, err = reply.get("exit_code"), reply.get("stdout", ""), reply.get("stderr", "")
    if type(code) is not int or not isinstance(out, str) or not isinstance(err, str):
        return None
    return code, out.encode("utf-8"), err.encode("utf-8")


def ask_agent(path: str, request: bytes, *, timeout_s: float = PLUGIN_RUN_TIMEOUT_S) -> bytes | None:
    """The agent's raw reply to `request`, or None when it gives none (the caller runs the
    plugin itself)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(path)
            sock.sendall(request)
            sock.shutdown(socket.SHUT_WR)
            chunks: list[bytes] = []
            size = 0
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                size += len(chunk)
                if size > MAX_PLUGIN_RUN_REPLY_BYTES:
                    return None
                chunks.append(chunk)
    except OSError:
        return None
    return b"".join(chunks)


def main() -> int:
    environ = os.environ
    command = environ.get("CNI_COMMAND", "")
    # VERSION's stdin is ignored (skel does the same); reading a terminal by hand would block.
    stdin = sys.stdin.buffer.read(MAX_PLUGIN_STDIN_BYTES + 1) if command and command != "VERSION" else b""
    # VERSION has no config, so no run dir to find the agent in; it is not on a pod's path.
    if command and command != "VERSION" and len(stdin) <= MAX_PLUGIN_STDIN_BYTES:
        request = encode_request(environ, stdin)
        raw = ask_agent(plugin_run_socket(stdin), request) if request is not None else None
        outcome = decode_reply(raw) if raw is not None else None
        if outcome is not None:
            code, out, err = outcome
            if out:
                sys.stdout.buffer.write(out)
                sys.stdout.buffer.flush()
            if err:
                sys.stderr.buffer.write(err)
                sys.stderr.buffer.flush()
            return code
    from .plugin import main as run_here

    return run_here(stdin)


if __name__ == "__main__":
    sys.exit(main())
