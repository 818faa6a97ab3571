"""A waypoint mesh on a network-namespace fabric: node proxies, the control plane and Envoy as the
waypoint, the objects they are given, and bounded waits."""

from __future__ import annotations

import contextlib
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from ambient_mesh.control.plane import mint_token
from ambient_mesh.host.netns import Fabric, Node, netns_socket
from tests.interop.envoy import _dechunk

CONTROL_PORT = 15012

READY_PORT = 15021

SOCKS_PORT = 15080

HTTP_PORT = 8080

TCP_PORT = 9000

ALT_HOSTNAME = "istiod.istio-system.svc"

HTTP_VIP = "10.96.0.10"

TCP_VIP = "10.96.0.11"

START_TIMEOUT_S = 60.0

IO_TIMEOUT_S = 10.0

SECRET_TTL_S = 16  # renewed every 8 s


def ambient_argv(*args: str) -> list[str]:
    script = Path(sys.executable).with_name("ambient")
    return [str(script), *args] if script.exists() else [sys.executable, "-m", "ambient_mesh.cli", *args]


def envoy_missing() -> str | None:
    from ambient_mesh.errors import ConfigError
    from ambient_mesh.waypoint.envoy import check_version, find_envoy

    try:
        check_version(find_envoy())
    except ConfigError as e:
        return str(e)
    return None


def objects(client: Node, server: Node, waypoint: Node, *, server_extra_labels: str = "") -> str:
    return f"""
apiVersion: v1
kind: Namespace
metadata: {{name: default, labels: {{istio.io/dataplane-mode: ambient}}}}
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {{name: waypoint, namespace: default, labels: {{istio.io/waypoint-for: all}}}}
spec:
  gatewayClassName: istio-waypoint
  listeners: [{{name: mesh, port: 15008, protocol: HBONE}}]
status:
  addresses: [{{type: Hostname, value: waypoint.default.svc.cluster.local}}]
---
apiVersion: v1
kind: Service
metadata: {{name: waypoint, namespace: default, labels: {{gateway.istio.io/managed: istio.io-mesh-controller, gateway.networking.k8s.io/gateway-name: waypoint}}}}
spec:
  selector: {{gateway.networking.k8s.io/gateway-name: waypoint}}
  clusterIP: 10.96.0.2
  ports: [{{name: status-port, port: 15021}}, {{name: mesh, port: 15008}}]
---
apiVersion: v1
kind: Pod
metadata: {{name: waypoint-0, namespace: default, uid: uid-waypoint, labels: {{gateway.networking.k8s.io/gateway-name: waypoint, istio.io/dataplane-mode: none}}}}
spec: {{nodeName: waypoint, serviceAccountName: waypoint, containers: [{{name: istio-proxy, image: x}}]}}
status: {{phase: Running, podIP: {waypoint.ipv4}, conditions: [{{type: Ready, status: "True"}}]}}
---
apiVersion: v1
kind: Pod
metadata: {{name: client, namespace: default, uid: uid-client, labels: {{app: client}}}}
spec: {{nodeName: client, serviceAccountName: client, containers: [{{name: app, image: x}}]}}
status: {{phase: Running, podIP: {client.ipv4}, conditions: [{{type: Ready, status: "True"}}]}}
---
apiVersion: v1
kind: Pod
metadata: {{name: server, namespace: default, uid: uid-server, labels: {{app: server{server_extra_labels}}}}}
spec: {{nodeName: server, serviceAccountName: server, containers: [{{name: app, image: x}}]}}
status: {{phase: Running, podIP: {server.ipv4}, conditions: [{{type: Ready, status: "True"}}]}}
---
apiVersion: v1
kind: Service
metadata: {{name: web, namespace: default, labels: {{istio.io/use-waypoint: waypoint}}}}
spec: {{selector: {{app: server}}, clusterIP: {HTTP_VIP}, ports: [{{name: http, port: 80, targetPort: {HTTP_PORT}}}]}}
---
apiVersion: v1
kind: Service
metadata: {{name: echo, namespace: default, labels: {{istio.io/use-waypoint: waypoint}}}}
spec: {{selector: {{app: server}}, clusterIP: {TCP_VIP}, ports: [{{name: tcp-echo, port: 9000, targetPort: {TCP_PORT}}}]}}
"""


ALLOW_ONLY_CLIENT = """
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: only-client, namespace: default}
spec:
  selector: {matchLabels: {app: server}}
  action: ALLOW
  rules: [{from: [{source: {principals: ["cluster.local/ns/default/sa/client"]}}]}]
"""

ALLOW_CLIENT_AND_WAYPOINT = ALLOW_ONLY_CLIENT.replace("only-client", "client-and-waypoint").replace(
    '["cluster.local/ns/default/sa/client"]',
    '["cluster.local/ns/default/sa/client", "cluster.local/ns/default/sa/waypoint"]',
)


@dataclass
class WaypointMesh:
    fabric: Fabric
    tmp: Path
    objects_dir: Path
    state: Path
    control: Node
    client: Node
    server: Node
    waypoint: Node
    run_dir: Path
    logs: dict[str, Path]

    def write(self, name: str, text: str) -> None:
        path = self.objects_dir / name
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)

    def remove(self, name: str) -> None:
        (self.objects_dir / name).unlink(missing_ok=True)

    def tail(self, name: str, lines: int = 40) -> str:
        return "\n".join(self.logs[name].read_text(errors="replace").splitlines()[-lines:])

    def envoy_admin(self, path: str) -> bytes:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(IO_TIMEOUT_S)
            sock.connect(str(self.run_dir / "admin.sock"))
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n".encode())
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
                if len(data) > 4 * 1024 * 1024:
                    break
        head, _, body = data.partition(b"\r\n\r\n")
        return _dechunk(body) if b"transfer-encoding: chunked" in head.lower() else body

    def envoy_stats(self, *needles: str) -> str:
        """Envoy's non-zero counters whose names contain one of `needles` (for failure messages)."""
        text = self.envoy_admin("/stats").decode(errors="replace")
        return "\n".join(
            line for line in text.splitlines() if any(n in line for n in needles) and not line.endswith(": 0")
        )

    def socks(self, ip: str, port: int) -> socket.socket:
        """A connection from the client pod through its node proxy's SOCKS5 listener."""
        sock = netns_socket(self.client.netns)
        sock.settimeout(IO_TIMEOUT_S)
        sock.connect(("127.0.0.1", SOCKS_PORT))
        sock.sendall(b"\x05\x01\x00\x05\x01\x00\x01" + socket.inet_aton(ip) + port.to_bytes(2, "big"))
        greeting = recv_exactly(sock, 2)
        reply = recv_exactly(sock, 10)
        if greeting != b"\x05\x00" or reply[1] != 0:
            sock.close()
            raise ConnectionRefusedError(f"SOCKS5 refused: {greeting!r} {reply!r}")
        return sock

    def http_get(self, ip: str, port: int, path: str = "/hello.txt") -> tuple[int, bytes]:
        with self.socks(ip, port) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: web\r\nConnection: close\r\n\r\n".encode())
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        line = head.split(b"\r\n", 1)[0].split()
        return (int(line[1]) if len(line) > 1 and line[1].isdigit() else 0), body


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def wait_condition(predicate, what: str, timeout_s: float = START_TIMEOUT_S, interval_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except (OSError, ValueError) as e:
            last, value = e, None
        if value:
            return value
        time.sleep(interval_s)
    pytest.fail(f"timed out after {timeout_s}s waiting for {what} (last error: {last})")


def _node_proxy_env(mesh_state: Path, control: Node, node: Node, name: str, token: Path) -> dict[str, str]:
    import os

    root = str(mesh_state / "root-cert.pem")
    return {
        **os.environ,
        "PROXY_MODE": "dedicated",
        "PROXY_WORKLOAD_INFO": f"default/{name}/{name}",
        "XDS_ADDRESS": f"https://{control.ipv4}:{CONTROL_PORT}",
        "CA_ADDRESS": f"https://{control.ipv4}:{CONTROL_PORT}",
        "XDS_ROOT_CA": root,
        "CA_ROOT_CA": root,
        "ALT_XDS_HOSTNAME": ALT_HOSTNAME,
        "ALT_CA_HOSTNAME": ALT_HOSTNAME,
        "AUTH_TOKEN": str(token),
        "POD_NAME": name,
        "POD_NAMESPACE": "default",
        "NODE_NAME": node.name,
        "UNSTABLE_ENABLE_SOCKS5": "true",
        "SOCKS5_ADDR": f"127.0.0.1:{SOCKS_PORT}",
        "ADMIN_ADDR": "127.0.0.1:15000",
    }


@contextlib.contextmanager
def running_waypoint_mesh(runner, get, start_echo, tmp: Path, policy: str):
    missing = envoy_missing()
    if missing:
        pytest.skip(missing)
    with Fabric(runner=runner) as fabric:
        control = fabric.add_node("control")
        client = fabric.add_node("client")
        server = fabric.add_node("server")
        waypoint = fabric.add_node("waypoint")
        objects_dir = tmp / "objects"
        objects_dir.mkdir()
        (objects_dir / "mesh.yaml").write_text(objects(client, server, waypoint))
        # In place before the first connection (see test_destination_l4_policy_*).
        (objects_dir / "policy.yaml").write_text(policy)
        state = tmp / "state"
        logs = {name: tmp / f"{name}.log" for name in ("control", "client", "server", "waypoint", "web")}
        with open(logs["control"], "wb") as out:
            fabric.spawn(
                control,
                ambient_argv(
                    "control",
                    "--dir",
                    str(objects_dir),
                    "--state-dir",
                    str(state),
                    "--listen",
                    f"0.0.0.0:{CONTROL_PORT}",
                ),
                stdout=out,
                stderr=out,
            )
        fabric.wait_for_listen(control, CONTROL_PORT, timeout_s=START_TIMEOUT_S)
        # Apps on the server pod: HTTP (a static file) and TCP echo.
        site = tmp / "site"
        site.mkdir()
        (site / "hello.txt").write_text("hello from server\n")
        with open(logs["web"], "wb") as out:
            fabric.spawn(
                server,
                [
                    sys.executable,
                    "-m",
                    "http.server",
                    str(HTTP_PORT),
                    "--bind",
                    "0.0.0.0",
                    "--directory",
                    str(site),
                ],
                stdout=out,
                stderr=out,
            )
        fabric.wait_for_listen(server, HTTP_PORT)
        start_echo(fabric, server, TCP_PORT, tmp)
        for node, name in ((client, "client"), (server, "server")):
            token = tmp / f"{name}.token"
            token.write_text(mint_token(state, account=("default", name), node=None))
            workdir = tmp / f"proxy-{name}"
            workdir.mkdir()
            with open(logs[name], "wb") as out:
                fabric.spawn(
                    node,
                    ambient_argv("ztunnel"),
                    env=_node_proxy_env(state, control, node, name, token),
                    cwd=workdir,
                    stdout=out,
                    stderr=out,
                )
        token = tmp / "waypoint.token"
        token.write_text(mint_token(state, account=("default", "waypoint"), node=None))
        run_dir = tmp / "wp"
        with open(logs["waypoint"], "wb") as out:
            fabric.spawn(
                waypoint,
                ambient_argv(
                    "waypoint",
                    "--pod-name",
                    "waypoint-0",
                    "--namespace",
                    "default",
                    "--pod-ip",
                    str(waypoint.ipv4),
                    "--service-account",
                    "waypoint",
                    "--xds-address",
                    f"https://{control.ipv4}:{CONTROL_PORT}",
                    "--root-cert",
                    str(state / "root-cert.pem"),
                    "--token",
                    str(token),
                    "--alt-hostname",
                    ALT_HOSTNAME,
                    "--run-dir",
                    str(run_dir),
                    "--secret-ttl",
                    str(SECRET_TTL_S),
                    "--envoy-log-level",
                    "info",
                ),
                stdout=out,
                stderr=out,
            )
        mesh = WaypointMesh(
            fabric=fabric,
            tmp=tmp,
            objects_dir=objects_dir,
            state=state,
            control=control,
            client=client,
            server=server,
            waypoint=waypoint,
            run_dir=run_dir,
            logs=logs,
        )
        for node, name in ((client, "client"), (server, "server"), (waypoint, "waypoint")):
            try:
                wait_condition(
                    lambda node=node: get(node.netns, "127.0.0.1", READY_PORT, "/healthz/ready")[0] == 200,
                    f"{name} to be ready",
                )
            except pytest.fail.Exception:
                pytest.fail(f"{name} not ready:\n{mesh.tail(name)}\ncontrol:\n{mesh.tail('control')}")
        yield mesh
