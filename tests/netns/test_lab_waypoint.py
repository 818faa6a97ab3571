"""A waypoint in the lab: client pod -> node proxy -> waypoint (Envoy) -> node proxy -> pod.

Every program is its own process started by `ambient lab`: the control plane, per node the node
agent and a shared-mode node proxy (pods captured through the real CNI plugin). A user's part is
`lab apply` of the Gateway and the `use-waypoint` labels: the control plane deploys the waypoint
as istiod does (ServiceAccount, Deployment, Service, status.addresses), the lab's Deployment
controller makes its Pod and the kubelet runs it as `ambient waypoint` with the pod's token.

    node-1   demo/client, demo/local
    node-2   demo/server
    either   demo/waypoint-0 (not captured: istio.io/dataplane-mode=none), from the Deployment
"""

from __future__ import annotations

import socket
import time

import pytest
import yaml

from ambient_mesh.errors import AmbientError, ConfigError
from ambient_mesh.lab.lab import APP_PORT, Lab, LabConfig, tcp_roundtrip, wait_until
from tests.helpers.lab_waypoint import (
    LOCAL_VIP,
    SERVER_VIP,
    WAYPOINT,
    WAYPOINT_ID,
    WAYPOINT_POD,
    apply_text,
    delete_text,
    demo_pods,
    namespace,
    services,
)

pytestmark = pytest.mark.timeout(240)

LOG_WAIT_S = 15.0


def wait_waypoint_pod(lab: Lab, *, present: bool, timeout_s: float = 60.0) -> None:
    """The supervisor's passes (Deployment controller, then kubelet) until the waypoint pod is
    running (or gone)."""

    def done():
        lab.supervise()
        return (WAYPOINT_POD in lab.pods) == present

    wait_until(done, timeout_s=timeout_s, what=f"waypoint pod {'running' if present else 'gone'}")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    config = LabConfig(
        state_dir=tmp_path_factory.mktemp("labwp"),
        pods=demo_pods(),
        ambient_namespaces=frozenset({"demo"}),
        cluster_dns=False,
    )
    with Lab(config) as running:
        apply_text(running, services(True))
        t0 = time.monotonic()
        apply_text(running, WAYPOINT)
        wait_waypoint_pod(running, present=True)
        # Printed for the report (pytest -s): apply of the Gateway -> its pod running and ready.
        print(f"\nGateway applied -> waypoint pod ready: {time.monotonic() - t0:.1f} s")
        yield running


def envoy_admin(lab: Lab, path: str) -> str:
    sock_path = lab.config.state_dir / "waypoints" / "demo-waypoint-0" / "admin.sock"  # WAYPOINT_POD's
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(5)
        sock.connect(str(sock_path))
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data.decode(errors="replace")


def via_waypoint(lab: Lab, node: str, since: int, hbone_addr: str) -> dict[str, str]:
    """The client node proxy's outbound event for `hbone_addr` that went to the waypoint."""

    def find():
        for e in lab.access_log(node, since):
            if e.get("direction") == "outbound" and e.get("dst.hbone_addr") == hbone_addr:
                return e
        return None

    try:
        return wait_until(find, timeout_s=LOG_WAIT_S, what=f"outbound event for {hbone_addr} on {node}")
    except AmbientError:
        pytest.fail(
            f"no outbound event for {hbone_addr}:\n" + "\n".join(map(str, lab.access_log(node, since)))
        )


def roundtrip_when(lab: Lab, ip: str, payload: bytes, predicate, what: str) -> None:
    """Send through the client pod until the change has reached the proxies (bounded)."""
    client = lab.pods["demo/client"]
    last: list[object] = []

    def attempt():
        since = lab.proxy_log_offset("node-1")
        try:
            got = tcp_roundtrip(client.netns, ip, 80, payload, timeout_s=5.0)
        except OSError as e:
            last[:] = [repr(e)]
            return None
        if got != payload:
            last[:] = [got]
            return None
        # The access event is written when the proxy has closed its side: give it a moment.
        try:
            return wait_until(lambda: predicate(since), timeout_s=3.0, what="the access event")
        except AmbientError:
            last[:] = [got, *lab.access_log("node-1", since)]
            return None

    try:
        wait_until(attempt, timeout_s=30.0, what=what)
    except AmbientError:
        stats = envoy_admin(lab, "/stats")
        interesting = [
            ln for ln in stats.splitlines()
            if any(k in ln for k in ("inbound-vip", "connect_originate", "main_internal", "ssl", "tcp."))
            and not ln.endswith(": 0") and "No recorded" not in ln and "P0(" not in ln
        ]  # fmt: skip
        clusters = [
            ln for ln in envoy_admin(lab, "/clusters").splitlines() if "::" in ln and "cx_total" in ln
        ]
        pytest.fail(f"{what}: last attempt {last}\n" + "\n".join(interesting + clusters))


def _outbound(lab: Lab, since: int, hbone: str) -> dict[str, str] | None:
    for e in lab.access_log("node-1", since):
        if e.get("direction") == "outbound" and e.get("dst.hbone_addr") == hbone:
            return e
    return None


@pytest.mark.parametrize(
    ("key", "vip"), [("demo/server", SERVER_VIP), ("demo/local", LOCAL_VIP)], ids=["cross-node", "same-node"]
)
def test_service_addressed_through_the_waypoint(lab, key, vip):
    waypoint = lab.pods[WAYPOINT_POD]
    dest = lab.pods[key]
    node = dest.spec.node
    since_dest = lab.proxy_log_offset(node)

    def went_via_waypoint(since):
        e = _outbound(lab, since, f"{vip}:80")
        return e if e is not None and e.get("dst.addr") == f"{waypoint.ip}:15008" else None

    roundtrip_when(
        lab, vip, b"via waypoint " + key.encode(), went_via_waypoint, f"{vip} through the waypoint"
    )
    # The destination's node proxy received it from the waypoint, with the waypoint's identity,
    # on the pod's own address (Envoy's connect_originate).
    inbound = wait_until(
        lambda: next(
            (
                e
                for e in lab.access_log(node, since_dest)
                if e.get("direction") == "inbound"
                and e.get("dst.addr") == f"{dest.ip}:{APP_PORT}"
                and e.get("src.identity") == WAYPOINT_ID
            ),
            None,
        ),
        timeout_s=LOG_WAIT_S,
        what=f"inbound event from the waypoint on {node}",
    )
    assert inbound["src.addr"].startswith(f"{waypoint.ip}:")
    stats = envoy_admin(lab, "/stats?filter=inbound-vip")
    host = key.split("/")[1]
    assert f"cluster.inbound-vip|80|tcp|{host}.demo.svc.cluster.local.upstream_cx_total" in stats


def test_workload_addressed_through_the_waypoint_and_off_again(lab):
    server = lab.pods["demo/server"]
    waypoint = lab.pods[WAYPOINT_POD]
    target = f"{server.ip}:{APP_PORT}"
    client = lab.pods["demo/client"]
    apply_text(lab, namespace(True))
    try:

        def via(since):
            e = _outbound(lab, since, target)
            return e if e is not None and e.get("dst.addr") == f"{waypoint.ip}:15008" else None

        def attempt(check):
            since = lab.proxy_log_offset("node-1")
            try:
                got = tcp_roundtrip(client.netns, server.ip, APP_PORT, b"direct to pod", timeout_s=5.0)
            except OSError:
                return None
            if got != b"direct to pod":
                return None
            try:
                return wait_until(lambda: check(since), timeout_s=3.0, what="the access event")
            except AmbientError:
                return None

        wait_until(lambda: attempt(via), timeout_s=30.0, what="pod-addressed traffic through the waypoint")
    finally:
        apply_text(lab, namespace(False))

    def direct(since):
        e = _outbound(lab, since, target)
        return e if e is not None and e.get("dst.addr") == f"{server.ip}:15008" else None

    # Label removed: traffic goes straight to the pod's node proxy again.
    wait_until(lambda: attempt(direct), timeout_s=30.0, what="pod-addressed traffic off the waypoint")


def test_the_control_plane_deployed_the_waypoint_as_istiod_does(lab):
    names = sorted(p.name for p in lab.objects_dir.glob("*-demo-waypoint.yaml"))
    assert names == [
        "deployment-demo-waypoint.yaml",
        "gateway-demo-waypoint.yaml",
        "service-demo-waypoint.yaml",
        "serviceaccount-demo-waypoint.yaml",
    ], names
    gateway = yaml.safe_load((lab.objects_dir / "gateway-demo-waypoint.yaml").read_text())
    assert gateway["status"]["addresses"] == [
        {"type": "Hostname", "value": "waypoint.demo.svc.cluster.local"}
    ]
    service = yaml.safe_load((lab.objects_dir / "service-demo-waypoint.yaml").read_text())
    assert sorted(p["port"] for p in service["spec"]["ports"]) == [15008, 15021]
    pod = lab.pods[WAYPOINT_POD]
    assert pod.spec.labels["istio.io/dataplane-mode"] == "none" and not lab.enrolled(WAYPOINT_POD)


def test_invalid_gateway_is_refused_with_its_position(lab):
    bad = WAYPOINT.replace("port: 15008, protocol: HBONE", "port: not-a-port, protocol: HBONE")
    with pytest.raises(ConfigError) as e:
        apply_text(lab, bad, "bad.yaml")
    assert "bad.yaml:" in str(e.value) and "nothing applied" in str(e.value)


def test_deleting_the_gateway_removes_the_pod_and_takes_traffic_off(lab):
    # Last in the module: the pod comes back only after the next supervisor passes.
    server = lab.pods["demo/server"]
    delete_text(lab, WAYPOINT)
    try:
        wait_waypoint_pod(lab, present=False)
        deployed = [p.name for p in lab.objects_dir.glob("*-demo-waypoint.yaml")]
        assert deployed == [], deployed

        def direct(since):
            for e in lab.access_log("node-1", since):
                if (
                    e.get("direction") == "outbound"
                    and e.get("dst.service") == "server.demo.svc.cluster.local"
                ):
                    return e if e.get("dst.addr") == f"{server.ip}:15008" else None
            return None

        roundtrip_when(
            lab, SERVER_VIP, b"no waypoint", direct, "the service's traffic off the deleted waypoint"
        )
    finally:
        apply_text(lab, WAYPOINT)
