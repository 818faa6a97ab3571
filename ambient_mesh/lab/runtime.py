"""The lab's kubelet and container runtime: pod sandboxes, CNI ADD/DEL, and the pods' app.

Counterpart: what containerd does for kubelet when a pod starts (docs/istio-behaviour.md, "CNI plugin"):
create the sandbox's network namespace, run the network's CNI chain in order with the chained
entry plus `prevResult` on stdin and CNI_* in the environment, and run DEL when the pod goes. The
lab is the primary CNI (topology.py wires the pod before the chain runs), so of the chain in the
node's conflist only the entries after the first are executed: in practice `istio-cni`, which
the node agent installed there.

`plan_cni_call` decides the invocation (pure, unit-tested); `CniRuntime.call` runs it inside the
node's namespace, as a runtime runs plugins in the host's.

`python -m ambient_mesh.lab.runtime --app echo|sleep` are the apps lab pods run: `echo` answers
HTTP/1.1 requests with who answered and what it saw (as Istio's sample echo server does), and
echoes any other bytes back (the tests' raw TCP); it prints `accepted <ip> <port>` per connection
(so a test can see which source address reached the app: the client pod's, or the node's probe
SNAT address). `sleep` is a client pod (Istio's `sleep`/`curl` sample): `ambient lab exec` runs
curl in its namespace.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import signal
import socket
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import AmbientError, ConfigError
from ..host.commands import CommandRunner
from .topology import POD_IFNAME, PodNet

CNI_TIMEOUT_S = 30.0
ISTIO_CNI_TYPE = "istio-cni"
CONFLIST_SUFFIXES = (".conflist",)
ECHO_READ_BYTES = 65536
ECHO_BACKLOG = 128


class CniCallError(AmbientError):
    """A CNI plugin returned an error object or exited non-zero: the sandbox must not start."""

    def __init__(self, command: str, pod: str, detail: str) -> None:
        super().__init__(
            f"CNI {command} for pod {pod} failed: {detail}",
            hint="the node agent's log says why (is it running and ready?)",
        )
        self.command = command
        self.pod = pod
        self.detail = detail


@dataclass(frozen=True, slots=True, kw_only=True)
class CniCall:
    """One plugin invocation: which binary, its environment, its stdin."""

    plugin: Path
    env: Mapping[str, str]
    stdin: bytes

    def argv(self) -> list[str]:
        """`env K=V ... <plugin>`: the environment rides on the command line, so the call can go
        through a CommandRunner (which runs it inside the node's namespace)."""
        return ["env", *[f"{k}={v}" for k, v in sorted(self.env.items())], str(self.plugin)]


def find_conflist(net_dir: Path) -> Path:
    """The network config a runtime uses: the first `.conflist` in lexical order."""
    candidates = sorted(p for p in net_dir.iterdir() if p.suffix in CONFLIST_SUFFIXES and p.is_file())
    if not candidates:
        raise ConfigError(str(net_dir), "no .conflist network configuration")
    return candidates[0]


def chained_entries(conflist: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The entries a runtime runs after the primary plugin (the lab did the primary's work)."""
    plugins = conflist.get("plugins")
    if not isinstance(plugins, list) or not plugins:
        raise ConfigError("conflist", "no plugins")
    return [p for p in plugins[1:] if isinstance(p, Mapping)]


def prev_result(pod: PodNet, cni_version: str) -> dict[str, Any]:
    """The primary plugin's result, as a bridge plugin reports it."""
    return {
        "cniVersion": cni_version,
        "interfaces": [{"name": POD_IFNAME, "sandbox": pod.netns_path}],
        "ips": [{"address": f"{pod.ip}/{pod.prefixlen}", "gateway": str(pod.gateway), "interface": 0}],
    }


def plan_cni_call(
    command: str,
    *,
    conflist: Mapping[str, Any],
    entry: Mapping[str, Any],
    pod: PodNet,
    namespace: str,
    name: str,
    uid: str,
    bin_dir: Path,
    previous: Mapping[str, Any] | None,
) -> CniCall:
    """The stdin and environment containerd gives a chained plugin (CNI spec, section "Execution")."""
    version = str(conflist.get("cniVersion", "1.0.0"))
    stdin = dict(entry, cniVersion=version, name=conflist.get("name", ""))
    if previous is not None:
        stdin["prevResult"] = dict(previous)
    sandbox = f"sandbox-{uid}"
    env = {
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": sandbox,
        "CNI_NETNS": pod.netns_path,
        "CNI_IFNAME": POD_IFNAME,
        "CNI_PATH": str(bin_dir),
        "CNI_ARGS": (
            f"IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name};"
            f"K8S_POD_INFRA_CONTAINER_ID={sandbox};K8S_POD_UID={uid}"
        ),
    }
    plugin_type = entry.get("type")
    if not isinstance(plugin_type, str) or not plugin_type or "/" in plugin_type:
        raise ConfigError("conflist", f"plugin type {plugin_type!r} is not a binary name")
    return CniCall(plugin=bin_dir / plugin_type, env=env, stdin=json.dumps(stdin).encode())


class CniRuntime:
    """Runs a node's CNI chain for pods, inside the node's namespace."""

    def __init__(self, runner: CommandRunner, *, node_netns: str, net_dir: Path, bin_dir: Path) -> None:
        self.runner = runner
        self.node_netns = node_netns
        self.net_dir = net_dir
        self.bin_dir = bin_dir
        self.calls = 0

    def __repr__(self) -> str:
        return f"CniRuntime({self.node_netns}: {self.calls} calls, conf {self.net_dir})"

    def _chain(self) -> tuple[dict[str, Any], list[Mapping[str, Any]]]:
        conflist = json.loads(find_conflist(self.net_dir).read_text())
        return conflist, chained_entries(conflist)

    def _run(self, call: CniCall, command: str, pod: str) -> dict[str, Any]:
        self.calls += 1
        result = self.runner.run(call.argv(), input=call.stdin, netns=self.node_netns, check=False)
        try:
            out = json.loads(result.stdout or b"{}")
        except ValueError:
            out = {}
        if not result.ok or (isinstance(out, dict) and "code" in out and "msg" in out):
            detail = (
                out.get("msg")
                if isinstance(out, dict) and out.get("msg")
                else result.stderr.decode(errors="replace")
            )
            raise CniCallError(command, pod, f"{call.plugin.name} exit {result.returncode}: {detail}".strip())
        return out if isinstance(out, dict) else {}

    def add(self, pod: PodNet, *, namespace: str, name: str, uid: str) -> dict[str, Any]:
        """CNI ADD through the chain; returns the last result (the sandbox may start)."""
        conflist, entries = self._chain()
        result: Mapping[str, Any] = prev_result(pod, str(conflist.get("cniVersion", "1.0.0")))
        for entry in entries:
            call = plan_cni_call(
                "ADD",
                conflist=conflist,
                entry=entry,
                pod=pod,
                namespace=namespace,
                name=name,
                uid=uid,
                bin_dir=self.bin_dir,
                previous=result,
            )
            result = self._run(call, "ADD", f"{namespace}/{name}") or result
        return dict(result)

    def delete(self, pod: PodNet, *, namespace: str, name: str, uid: str) -> None:
        """CNI DEL through the chain in reverse order (istio-cni's DEL does nothing: removal is
        its agent's job, from the pod watch)."""
        conflist, entries = self._chain()
        for entry in reversed(entries):
            call = plan_cni_call(
                "DEL",
                conflist=conflist,
                entry=entry,
                pod=pod,
                namespace=namespace,
                name=name,
                uid=uid,
                bin_dir=self.bin_dir,
                previous=None,
            )
            self._run(call, "DEL", f"{namespace}/{name}")


# --- the apps lab pods run ------------------------------------------------------------------------

HTTP_METHODS = (b"GET ", b"HEAD ", b"POST ", b"PUT ", b"DELETE ", b"OPTIONS ", b"PATCH ")
MAX_REQUEST_HEAD_BYTES = 16 * 1024  # request line + headers; more is refused with 431
MAX_REQUEST_BODY_BYTES = 1024 * 1024  # echoed back; a larger body is refused with 413
CONNECTION_IDLE_TIMEOUT_S = 60.0
APPS = ("echo", "sleep")


def http_echo_reply(head: bytes, body: bytes, *, pod: str, peer: str) -> bytes:
    """The echo app's answer to one HTTP/1.1 request: who answered and what it saw (like Istio's
    sample echo server), as text, one `key=value` per line."""
    request_line, _, header_block = head.partition(b"\r\n")
    lines = [
        "ServiceVersion=lab-echo",
        f"Hostname={pod}",
        f"RemoteAddr={peer}",
        f"Request={request_line.decode(errors='replace')}",
    ]
    for header in header_block.split(b"\r\n"):
        if b":" in header:
            name, _, value = header.partition(b":")
            lines.append(
                f"RequestHeader={name.decode(errors='replace').strip()}:{value.decode(errors='replace').strip()}"
            )
    if body:
        lines.append(f"Body={body.decode(errors='replace')}")
    text = ("\n".join(lines) + "\n").encode()
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n"
        + f"Content-Length: {len(text)}\r\n\r\n".encode()
        + text
    )


def _error(status: str) -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode()


def _content_length(head: bytes) -> int | None:
    for header in head.split(b"\r\n")[1:]:
        name, _, value = header.partition(b":")
        if name.strip().lower() == b"content-length":
            try:
                return int(value.strip())
            except ValueError:
                return None
    return 0


def _serve_http(conn: socket.socket, first: bytes, *, pod: str, peer: str) -> None:
    """One request per connection (`Connection: close`): enough for curl and probes."""
    data = first
    while b"\r\n\r\n" not in data:
        if len(data) > MAX_REQUEST_HEAD_BYTES:
            conn.sendall(_error("431 Request Header Fields Too Large"))
            return
        chunk = conn.recv(ECHO_READ_BYTES)
        if not chunk:
            return
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    if len(head) > MAX_REQUEST_HEAD_BYTES:
        conn.sendall(_error("431 Request Header Fields Too Large"))
        return
    length = _content_length(head)
    if length is None or length < 0:
        conn.sendall(_error("400 Bad Request"))
        return
    if length > MAX_REQUEST_BODY_BYTES:
        conn.sendall(_error("413 Content Too Large"))
        return
    while len(body) < length:
        chunk = conn.recv(ECHO_READ_BYTES)
        if not chunk:
            return
        body += chunk
    conn.sendall(http_echo_reply(head, body[:length], pod=pod, peer=peer))


def _echo(conn: socket.socket, *, pod: str, peer: str) -> None:
    """HTTP/1.1 when the first bytes are a request line's method, else raw TCP echo (what the
    lab's tests send)."""
    with conn:
        conn.settimeout(CONNECTION_IDLE_TIMEOUT_S)
        try:
            data = conn.recv(ECHO_READ_BYTES)
            if data.startswith(HTTP_METHODS):
                _serve_http(conn, data, pod=pod, peer=peer)
                return
            while data:
                conn.sendall(data)
                data = conn.recv(ECHO_READ_BYTES)
        except OSError:
            return


def serve_echo(port: int, *, pod: str = "") -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", port))
    listener.listen(ECHO_BACKLOG)
    print(f"listening {port}", flush=True)
    while True:
        conn, peer = listener.accept()
        print(f"accepted {ipaddress.ip_address(peer[0])} {peer[1]}", flush=True)
        threading.Thread(
            target=_echo, args=(conn,), kwargs={"pod": pod, "peer": f"{peer[0]}:{peer[1]}"}, daemon=True
        ).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ambient_mesh.lab.runtime",
        description="the lab pods' apps: `echo` (HTTP/1.1 echo, raw TCP echo otherwise) or `sleep` (a "
        "client pod: does nothing, its namespace is where `ambient lab exec` runs curl)",
    )
    parser.add_argument("--app", choices=APPS, default="echo")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--pod", default="", help="namespace/name, for the echo's answer")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if args.app == "sleep":
        print("sleeping", flush=True)
        while True:
            signal.pause()
    serve_echo(args.port, pod=args.pod)
    return 0


if __name__ == "__main__":
    sys.exit(main())
