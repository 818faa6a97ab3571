"""The lab's kubelet and container runtime: pod sandboxes, CNI ADD/DEL, and the pods' app.

Counterpart: what containerd does for kubelet when a pod starts (reference/istio-cni.md 2.1-2.2):
create the sandbox's network namespace, run the network's CNI chain in order with the chained
entry plus `prevResult` on stdin and CNI_* in the environment, and run DEL when the pod goes. The
lab is the primary CNI (topology.py wires the pod before the chain runs), so of the chain in the
node's conflist only the entries after the first are executed: in practice `istio-cni`, which
the node agent installed there.

`plan_cni_call` decides the invocation (pure, unit-tested); `CniRuntime.call` runs it inside the
node's namespace, as a runtime runs plugins in the host's.

`python -m ambient_mesh.lab.runtime --port 8080` is the app every lab pod runs: a TCP echo
server that prints `accepted <ip> <port>` per connection (so a test can see which source address
reached the app: the client pod's, or the node's probe SNAT address).
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


def chained_entries(conflist: Mapping) -> list[Mapping]:
    """The entries a runtime runs after the primary plugin (the lab did the primary's work)."""
    plugins = conflist.get("plugins")
    if not isinstance(plugins, list) or not plugins:
        raise ConfigError("conflist", "no plugins")
    return [p for p in plugins[1:] if isinstance(p, Mapping)]


def prev_result(pod: PodNet, cni_version: str) -> dict:
    """The primary plugin's result, as a bridge plugin reports it."""
    return {
        "cniVersion": cni_version,
        "interfaces": [{"name": POD_IFNAME, "sandbox": pod.netns_path}],
        "ips": [{"address": f"{pod.ip}/{pod.prefixlen}", "gateway": str(pod.gateway), "interface": 0}],
    }


def plan_cni_call(
    command: str,
    *,
    conflist: Mapping,
    entry: Mapping,
    pod: PodNet,
    namespace: str,
    name: str,
    uid: str,
    bin_dir: Path,
    previous: Mapping | None,
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

    def _chain(self) -> tuple[dict, list[Mapping]]:
        conflist = json.loads(find_conflist(self.net_dir).read_text())
        return conflist, chained_entries(conflist)

    def _run(self, call: CniCall, command: str, pod: str) -> dict:
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

    def add(self, pod: PodNet, *, namespace: str, name: str, uid: str) -> dict:
        """CNI ADD through the chain; returns the last result (the sandbox may start)."""
        conflist, entries = self._chain()
        result: Mapping = prev_result(pod, str(conflist.get("cniVersion", "1.0.0")))
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


# --- the app every lab pod runs ------------------------------------------------------------------


def _echo(conn: socket.socket) -> None:
    with conn:
        while True:
            try:
                data = conn.recv(ECHO_READ_BYTES)
            except OSError:
                return
            if not data:
                return
            try:
                conn.sendall(data)
            except OSError:
                return


def serve_echo(port: int) -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", port))
    listener.listen(ECHO_BACKLOG)
    print(f"listening {port}", flush=True)
    while True:
        conn, peer = listener.accept()
        print(f"accepted {ipaddress.ip_address(peer[0])} {peer[1]}", flush=True)
        threading.Thread(target=_echo, args=(conn,), daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ambient_mesh.lab.runtime", description="the lab pods' app: a TCP echo server"
    )
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    serve_echo(args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
