"""A node proxy rollout without a gap, in a whole lab, with traffic running.

Counterpart: the ztunnel DaemonSet rolling with maxSurge 1 and maxUnavailable 0, and ztunnel's upgrade
sequence (docs/istio-behaviour.md, "ZDS" and "Node agent start and shutdown"): the new node proxy connects to
the node agent, which hands it every pod (the newest ZDS connection gets them), it listens in every pod beside
the old one (SO_REUSEPORT), and only then does the old one get SIGTERM, stop accepting and drain its open
connections.

    node-1   demo/client            node-2   demo/server

While both node proxies are rolled (node-1: the client's outbound side, node-2: the server's
inbound side), a long-lived stream sends and reads an echo every STREAM_INTERVAL_S and a
request loop opens one short connection after another. The stream must keep working through
both rollouts (the old proxies keep it until it ends), and no request may fail. The numbers are
printed (`pytest -s`): rollout durations, requests, errors, stream round trips.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field

import pytest

from ambient_mesh.errors import AmbientError
from ambient_mesh.host.netns import netns_socket
from ambient_mesh.lab.cluster import parse_pod_spec
from ambient_mesh.lab.lab import APP_PORT, Lab, LabConfig, tcp_roundtrip, wait_until

pytestmark = pytest.mark.timeout(180)

STREAM_INTERVAL_S = 0.05
REQUEST_INTERVAL_S = 0.02
REQUEST_TIMEOUT_S = 3.0
MAX_LOOP_S = 60.0  # both loops end by then whatever happens
MAX_REQUESTS = 3000


@dataclass
class Counts:
    ok: int = 0
    errors: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    config = LabConfig(
        state_dir=tmp_path_factory.mktemp("lab-rollout"),
        pods=tuple(parse_pod_spec(p) for p in ("node-1:demo/client", "node-2:demo/server")),
        ambient_namespaces=frozenset({"demo"}),
    )
    with Lab(config) as running:
        yield running


def long_lived_stream(
    netns: str, ip: str, stop: threading.Event, counts: Counts, opened: threading.Event
) -> None:
    """One connection for the whole test: a numbered line out, the same line back, again."""
    deadline = time.monotonic() + MAX_LOOP_S
    try:
        with netns_socket(netns) as sock:
            sock.settimeout(REQUEST_TIMEOUT_S)
            sock.connect((ip, APP_PORT))
            opened.set()
            n = 0
            while not stop.is_set() and time.monotonic() < deadline:
                line = f"stream {n:06d}\n".encode()
                sock.sendall(line)
                got = b""
                while len(got) < len(line):
                    chunk = sock.recv(len(line) - len(got))
                    if not chunk:
                        raise ConnectionError(f"closed by the peer after {n} round trips")
                    got += chunk
                if got != line:
                    raise AssertionError(f"round trip {n}: sent {line!r}, read {got!r}")
                counts.ok += 1
                n += 1
                time.sleep(STREAM_INTERVAL_S)
    except (OSError, AssertionError) as e:
        counts.errors.append(f"{time.monotonic():.3f} {e!r}")
    finally:
        opened.set()


def request_loop(netns: str, ip: str, stop: threading.Event, counts: Counts) -> None:
    deadline = time.monotonic() + MAX_LOOP_S
    for i in range(MAX_REQUESTS):
        if stop.is_set() or time.monotonic() >= deadline:
            return
        payload = f"request {i}\n".encode()
        try:
            echoed = tcp_roundtrip(netns, ip, APP_PORT, payload, timeout_s=REQUEST_TIMEOUT_S)
            if echoed == payload:
                counts.ok += 1
            else:
                counts.errors.append(f"{time.monotonic():.3f} request {i}: read {echoed!r}")
        except OSError as e:
            counts.errors.append(f"{time.monotonic():.3f} request {i}: {e!r}")
        time.sleep(REQUEST_INTERVAL_S)


def start_traffic(
    lab: Lab,
) -> tuple[threading.Event, threading.Event, Counts, Counts, list[threading.Thread]]:
    """demo/client -> demo/server: the long-lived stream and the request loop, running."""
    client, server = lab.pods["demo/client"], lab.pods["demo/server"]
    stop, opened = threading.Event(), threading.Event()
    stream, requests = Counts(), Counts()
    threads = [
        threading.Thread(target=long_lived_stream, args=(client.netns, server.ip, stop, stream, opened)),
        threading.Thread(target=request_loop, args=(client.netns, server.ip, stop, requests)),
    ]
    for t in threads:
        t.start()
    return stop, opened, stream, requests, threads


def test_a_long_lived_stream_survives_a_rollout_of_both_node_proxies(lab):
    old = {name: lab.nodes[name].proxy for name in ("node-1", "node-2")}
    stop, opened, stream, requests, threads = start_traffic(lab)
    durations = {}
    try:
        assert opened.wait(10) and not stream.errors, stream.errors
        wait_until(
            lambda: requests.ok >= 20 and stream.ok >= 10, timeout_s=10, what="traffic before the rollout"
        )
        for name in ("node-1", "node-2"):
            started = time.monotonic()
            new = lab.rollout_proxy(name)
            durations[name] = time.monotonic() - started
            assert new is lab.nodes[name].proxy and new is not old[name]
            assert old[name].running, f"the old node proxy on {name} exited at once: it should drain"
            assert lab.served_pods(name) == {"demo/client" if name == "node-1" else "demo/server"}
        before = requests.ok
        wait_until(lambda: requests.ok >= before + 20, timeout_s=10, what="traffic after the rollout")
        # The old proxies still carry the stream: they drain until it ends, not before.
        assert all(p.running for p in old.values())
        assert not stream.errors, stream.errors
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=MAX_LOOP_S)
    print(
        f"\nrollout node-1 {durations.get('node-1', 0):.2f}s, node-2 {durations.get('node-2', 0):.2f}s; "
        f"requests ok {requests.ok}, errors {len(requests.errors)}; "
        f"stream round trips {stream.ok}, errors {len(stream.errors)}"
    )
    assert not requests.errors, requests.errors[:5]
    assert not stream.errors, stream.errors
    # The stream ended (its socket closed): the old proxies have nothing left and exit well
    # before their drain deadline; the supervisor reaps them.
    started = time.monotonic()
    wait_until(
        lambda: not any(p.running for p in old.values()),
        timeout_s=8.0,
        what="the replaced node proxies to exit once their last connection closed",
    )
    drained_s = time.monotonic() - started
    events = lab.supervise()
    assert sum("drained and exited with code 0" in e for e in events) == 2, events
    assert all(p.process.returncode == 0 for p in old.values())
    print(f"old proxies exited {drained_s:.2f}s after the stream closed")
    status = lab.status()
    assert status["ready"], status["not_ready"]
    assert all(n["ztunnel_draining"] == [] for n in status["nodes"].values())


def test_a_new_proxy_that_never_gets_ready_leaves_the_old_one_serving(lab):
    """A rollout that cannot complete (here: a new proxy that exits at once) keeps the old proxy."""
    node = lab.nodes["node-1"]
    old = node.proxy
    slot = node.proxy_slot
    config = lab.config
    # A setting the node proxy refuses at start: the admin API is local only.
    lab.config = dataclasses.replace(config, ztunnel_env={"ADMIN_ADDR": "10.250.0.10:15000"})
    try:
        with pytest.raises(AmbientError, match="exited with code"):
            lab.rollout_proxy("node-1")
    finally:
        lab.config = config
    assert node.proxy is old and old.running and node.proxy_slot == slot
    assert lab.proxy_ready("node-1")
    payload = b"after a failed rollout\n"
    assert (
        tcp_roundtrip(lab.pods["demo/client"].netns, lab.pods["demo/server"].ip, APP_PORT, payload) == payload
    )


def test_a_sigterm_from_outside_starts_the_next_proxy_at_once(lab):
    """Someone SIGTERMs a node proxy (as a kubelet does a container): it closes its listeners and
    drains, and its readiness says `draining`; the supervisor starts the next one beside it at
    once rather than after the old one exits (up to its 10 s deadline with a stream open) and a
    backoff. The stream stays on the old proxy; the request loop sees the short gap, reported."""
    import os
    import signal

    old = lab.nodes["node-2"].proxy
    stop, opened, stream, requests, threads = start_traffic(lab)
    try:
        assert opened.wait(10)
        wait_until(lambda: requests.ok >= 20, timeout_s=10, what="traffic before the SIGTERM")
        before = requests.ok
        os.kill(old.process.pid, signal.SIGTERM)
        started = time.monotonic()
        events: list[str] = []

        def replaced() -> bool:
            events.extend(lab.supervise())
            new = lab.nodes["node-2"].proxy
            return new is not old and lab.proxy_ready("node-2")

        wait_until(replaced, timeout_s=15, what="the next node proxy on node-2, ready")
        replaced_s = time.monotonic() - started
        assert any("is draining: started pid" in e for e in events), events
        assert old.running, "the old proxy keeps the stream while it drains"
        wait_until(lambda: requests.ok >= before + 40, timeout_s=15, what="traffic after the replacement")
        assert not stream.errors, stream.errors
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=MAX_LOOP_S)
    print(
        f"\nSIGTERM of node-2's proxy: the next one ready {replaced_s:.2f}s later; requests ok "
        f"{requests.ok}, errors {len(requests.errors)}; stream round trips {stream.ok}, errors {len(stream.errors)}"
    )
    assert not stream.errors, stream.errors
    wait_until(lambda: not old.running, timeout_s=8, what="the old proxy to exit after the stream closed")
    lab.supervise()
    assert lab.status()["ready"]
