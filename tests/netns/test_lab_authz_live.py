"""Authorization that binds at once, on every stream, on every node: the lab reproductions.

A policy applied while the mesh runs (`ambient lab apply`) must refuse the next call on every
node, including calls that arrive from another node over an HBONE connection that was pooled
before the policy existed, and close the streams that are open when it arrives. The default
lab's topology: shop/client and echo-1 on node-1, echo-2 on node-2 (cross node), legacy/client
outside the mesh on node-1. Each case warms the pooled connections first (a call to each echo
replica), opens a long-lived stream to each, applies the policy, then checks every replica by
its own address; the policy is deleted again and the calls come back. With one worker and with
two (ZTUNNEL_WORKER_THREADS=2: each worker process keeps its own copy of the state).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from ambient_mesh.errors import AmbientError
from ambient_mesh.host.netns import netns_socket
from ambient_mesh.lab import apply as manifests
from ambient_mesh.lab.lab import APP_PORT, Lab, LabConfig, tcp_roundtrip, wait_until
from ambient_mesh.lab.topofile import load_topology

pytestmark = pytest.mark.timeout(240)

BIND_TIMEOUT_S = 10.0  # how long a change may take to bind (it takes milliseconds: a push)
IO_TIMEOUT_S = 3.0
CHECKS_AFTER = 5  # calls after the change that must all be refused


def _selector_policy(action: str, rule: str) -> str:
    """An AuthorizationPolicy `live` in shop selecting the echo replicas, with one rule."""
    return f"""
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: live, namespace: shop}}
spec:
  selector: {{matchLabels: {{app: echo}}}}
  action: {action}
  rules: [{rule}]
"""


POLICIES = {
    "selector-deny": _selector_policy(
        "DENY", '{from: [{source: {principals: ["cluster.local/ns/shop/sa/client"]}}]}'
    ),
    "selector-allow-other": _selector_policy(
        "ALLOW", '{from: [{source: {principals: ["cluster.local/ns/shop/sa/someone-else"]}}]}'
    ),
    "port-allow": _selector_policy("ALLOW", '{to: [{operation: {ports: ["9090"]}}]}'),
    # HTTP fields only: at a node proxy an ALLOW with them allows nothing (istiod drops the rule).
    "l7-allow": _selector_policy("ALLOW", '{to: [{operation: {methods: ["GET"]}}]}'),
}
STRICT = """
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: strict, namespace: shop}
spec:
  mtls: {mode: STRICT}
"""


@pytest.fixture(scope="module", params=["1", "2"], ids=["one-worker", "two-workers"])
def lab(request, tmp_path_factory) -> Iterator[Lab]:
    topo = load_topology(None)
    config = LabConfig(
        state_dir=tmp_path_factory.mktemp(f"lab-authz-{request.param}"),
        nodes=topo.nodes,
        pods=topo.pods,
        objects=topo.objects,
        ambient_namespaces=topo.ambient_namespaces,
        cluster_dns=False,
        ztunnel_env={"ZTUNNEL_WORKER_THREADS": request.param},
    )
    with Lab(config) as running:
        yield running


def served(lab: Lab, client: str, ip: str) -> bool:
    """A new connection from `client` to the echo app at `ip` carries bytes both ways."""
    try:
        return tcp_roundtrip(lab.pods[client].netns, ip, APP_PORT, b"ping", timeout_s=IO_TIMEOUT_S) == b"ping"
    except OSError:
        return False


class OpenStream:
    """A long-lived TCP stream from a pod to the echo app (raw echo), checked by round trips."""

    def __init__(self, lab: Lab, client: str, ip: str) -> None:
        self.sock = netns_socket(lab.pods[client].netns)
        self.sock.settimeout(IO_TIMEOUT_S)
        self.sock.connect((ip, APP_PORT))
        assert self.round_trip(), f"{client} -> {ip}: a new stream did not echo"

    def round_trip(self) -> bool:
        try:
            self.sock.sendall(b"x")
            return self.sock.recv(16) == b"x"
        except OSError:
            return False

    def close(self) -> None:
        self.sock.close()


def apply(lab: Lab, text: str) -> None:
    manifests.apply(lab.objects_dir, manifests.check(text, "test.yaml"))


def delete(lab: Lab, text: str) -> None:
    manifests.delete(lab.objects_dir, manifests.check(text, "test.yaml"))


def echo_ips(lab: Lab) -> dict[str, str]:
    return {key: lab.pods[key].ip for key in ("shop/echo-1", "shop/echo-2")}


def wait_served(lab: Lab, client: str, ips: dict[str, str]) -> None:
    """Every replica serves `client` (a previous case's policy may still be leaving)."""
    for key, ip in ips.items():
        try:
            wait_until(
                lambda ip=ip: served(lab, client, ip), timeout_s=BIND_TIMEOUT_S, what=f"{client} -> {key}"
            )
        except AmbientError:
            pytest.fail(f"{client} -> {key} is not served before the change")


def wait_refused(lab: Lab, client: str, ip: str, what: str) -> float:
    started = time.monotonic()
    try:
        wait_until(lambda: not served(lab, client, ip), timeout_s=BIND_TIMEOUT_S, what=what)
    except AmbientError:
        pytest.fail(f"{what}: still served {BIND_TIMEOUT_S} s after the change")
    return time.monotonic() - started


def wait_closed(stream: OpenStream, what: str) -> float:
    started = time.monotonic()
    try:
        wait_until(lambda: not stream.round_trip(), timeout_s=BIND_TIMEOUT_S, what=what)
    except AmbientError:
        pytest.fail(f"{what}: the open stream still echoes {BIND_TIMEOUT_S} s after the change")
    return time.monotonic() - started


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_policy_applied_while_the_mesh_runs_binds_on_every_replica_and_stream(
    lab: Lab, policy: str
) -> None:
    ips = echo_ips(lab)
    wait_served(lab, "shop/client", ips)  # and the pooled connections (node-1 -> node-2) are warm
    streams = {key: OpenStream(lab, "shop/client", ip) for key, ip in ips.items()}
    try:
        apply(lab, POLICIES[policy])
        for key, ip in ips.items():
            refused_after = wait_refused(lab, "shop/client", ip, f"{policy}: shop/client -> {key}")
            refused = sum(not served(lab, "shop/client", ip) for _ in range(CHECKS_AFTER))
            assert refused == CHECKS_AFTER, (
                f"{policy}: {key} served {CHECKS_AFTER - refused} of {CHECKS_AFTER}"
            )
            closed_after = wait_closed(streams[key], f"{policy}: the open stream to {key}")
            print(
                f"{policy} {key}: refused within {refused_after:.3f} s, open stream closed within {closed_after:.3f} s"
            )
    finally:
        for stream in streams.values():
            stream.close()
        delete(lab, POLICIES[policy])
    wait_served(lab, "shop/client", ips)


def test_strict_mtls_closes_an_open_plaintext_stream_from_outside_the_mesh(lab: Lab) -> None:
    """legacy/client is outside the mesh: its calls reach the echo replicas in plaintext (15006).
    A STRICT PeerAuthentication closes the stream open at the time and refuses the next ones."""
    ips = echo_ips(lab)
    wait_served(lab, "legacy/client", ips)
    streams = {key: OpenStream(lab, "legacy/client", ip) for key, ip in ips.items()}
    try:
        apply(lab, STRICT)
        for key, ip in ips.items():
            wait_refused(lab, "legacy/client", ip, f"STRICT: legacy/client -> {key}")
            wait_closed(streams[key], f"STRICT: the open plaintext stream to {key}")
    finally:
        for stream in streams.values():
            stream.close()
        delete(lab, STRICT)
    wait_served(lab, "legacy/client", ips)


def test_streams_stay_open_through_a_change_that_still_allows_them(lab: Lab) -> None:
    """The re-check closes what the new state refuses, nothing else: an ALLOW naming the client."""
    allow_client = POLICIES["selector-allow-other"].replace("someone-else", "client")
    ips = echo_ips(lab)
    wait_served(lab, "shop/client", ips)
    streams = {key: OpenStream(lab, "shop/client", ip) for key, ip in ips.items()}
    try:
        apply(lab, allow_client)
        time.sleep(1.0)  # a push takes milliseconds; a wrong close would have happened by now
        for key, stream in streams.items():
            assert stream.round_trip(), f"an allowed open stream to {key} was closed"
            assert served(lab, "shop/client", ips[key])
    finally:
        for stream in streams.values():
            stream.close()
        delete(lab, allow_client)
