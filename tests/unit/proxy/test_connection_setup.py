"""What the proxy works out per connection: a workload's pool key (proxy/pool.py `WorkloadKey`),
the source address bind (proxy/inputs.py `LocalSourceBinder`), a SOCKS5 request already received
(proxy/socks5_server.py), a workload's identity kept per object (state/model.py), the served
workload per state version (proxy/workload_proxy.py), and the batched record of ended connections
(proxy/telemetry.py). Each was reshaped for speed (docs/performance.md, "The per-connection path")
and must mean what the plain version meant."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import socket
import types

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ambient_mesh.config import ProxyWorkloadInfo, ZtunnelConfig
from ambient_mesh.identity.spiffe import Identity
from ambient_mesh.metrics import Metrics
from ambient_mesh.net import SocketAddr, ip_address
from ambient_mesh.proxy import telemetry
from ambient_mesh.proxy.inputs import NOT_LOCAL_RECHECK_S, NOT_LOCAL_SOURCES_MAX_ENTRIES, LocalSourceBinder
from ambient_mesh.proxy.pool import WorkloadKey
from ambient_mesh.proxy.workload_proxy import ServedWorkload, served_workload
from ambient_mesh.state.model import Workload
from ambient_mesh.state.store import ProxyState

_names = st.sampled_from(["a", "b", "default"])
_identities = st.builds(Identity, _names, _names, _names)
_ips = st.sampled_from(["10.0.0.1", "10.0.0.2", "::1", "fd00::1", "::ffff:10.0.0.1"]).map(ip_address)
_addrs = st.builds(SocketAddr, _ips, st.sampled_from([15008, 80]))
_keys = st.tuples(_identities, st.lists(_identities, max_size=3), _addrs, st.none() | _ips)


@given(_keys, _keys)
def test_workload_keys_are_equal_exactly_when_their_fields_are(a, b):
    ka, kb = WorkloadKey.of(*a), WorkloadKey.of(*b)
    fields_a = (ka.src_id, ka.dst_id, ka.dst, ka.src)
    fields_b = (kb.src_id, kb.dst_id, kb.dst, kb.src)
    assert (ka == kb) is (fields_a == fields_b)
    if ka == kb:
        assert hash(ka) == hash(kb)
        assert {ka: 1}[kb] == 1


def test_workload_key_ignores_san_order_and_repeats():
    x, y = Identity("td", "ns", "x"), Identity("td", "ns", "y")
    dst = SocketAddr.parse("10.0.0.3:15008")
    assert WorkloadKey.of(x, [x, y, x], dst, None) == WorkloadKey.of(x, (y, x), dst, None)
    assert WorkloadKey.of(x, [x], dst, None) != WorkloadKey.of(x, [y], dst, None)
    assert WorkloadKey.of(x, [], dst, None) != WorkloadKey.of(x, [], dst, ip_address("10.0.0.1"))


class _Sock:
    """Records binds; refuses the addresses in `refuse` as the kernel does a non-local one."""

    def __init__(self, refuse: set[str]) -> None:
        self.refuse = refuse
        self.binds: list[tuple] = []
        self.options: list[tuple[int, int, int]] = []

    def setsockopt(self, level: int, option: int, value: int) -> None:
        self.options.append((level, option, value))

    def bind(self, address: tuple) -> None:
        self.binds.append(address)
        if address[0] in self.refuse:
            raise OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")


def test_a_source_that_is_not_local_is_not_tried_again_until_the_recheck():
    binder = LocalSourceBinder()
    remote = ip_address("192.0.2.7")
    first = _Sock({"192.0.2.7"})
    assert binder.bind(first, remote, now=100.0) is False and first.binds == [("192.0.2.7", 0)]
    later = _Sock({"192.0.2.7"})
    assert binder.bind(later, remote, now=100.0 + NOT_LOCAL_RECHECK_S - 1) is False
    assert later.binds == []  # no syscall, no exception
    # After the recheck interval it is tried again; now local, it is bound.
    again = _Sock(set())
    assert binder.bind(again, remote, now=100.0 + NOT_LOCAL_RECHECK_S) is True
    assert again.binds == [("192.0.2.7", 0)] and not binder.not_local


def test_local_sources_are_bound_every_time_and_other_errors_are_not_remembered():
    binder = LocalSourceBinder()
    v6 = ip_address("fd00::5")
    for _ in range(3):
        sock = _Sock(set())
        assert binder.bind(sock, v6, now=1.0) is True and sock.binds == [("fd00::5", 0, 0, 0)]

    class InUse(_Sock):
        def bind(self, address: tuple) -> None:
            self.binds.append(address)
            raise OSError(errno.EADDRINUSE, "Address already in use")

    sock = InUse(set())
    assert binder.bind(sock, ip_address("10.1.1.1"), now=1.0) is False
    assert not binder.not_local


def test_the_memo_is_bounded():
    binder = LocalSourceBinder()
    for i in range(NOT_LOCAL_SOURCES_MAX_ENTRIES + 10):
        ip = ip_address(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}")
        binder.bind(_Sock({str(ip)}), ip, now=0.0)
    assert len(binder.not_local) <= NOT_LOCAL_SOURCES_MAX_ENTRIES


def test_a_real_socket_binds_a_loopback_source_and_not_a_foreign_one():
    binder = LocalSourceBinder()
    with socket.socket() as local, socket.socket() as foreign:
        assert binder.bind(local, ip_address("127.0.0.1"), now=0.0) is True
        assert local.getsockname()[0] == "127.0.0.1"
        assert binder.bind(foreign, ip_address("192.0.2.1"), now=0.0) is False  # TEST-NET-1
        assert foreign.getsockname() == ("0.0.0.0", 0) and "192.0.2.1" in binder.not_local


async def test_a_socks5_request_already_received_is_read_without_waiting(monkeypatch):
    """Greeting and request sent together (as clients and the benches send them): the handshake
    reads them at once, without the loop's reader (which waits a turn); a slow client still gets
    the reader, and the deadline."""
    import asyncio

    from ambient_mesh.proxy import socks5_server
    from ambient_mesh.proxy.socks5 import ConnectRequest, Socks5Handshake

    loop = asyncio.get_running_loop()
    waits = []
    real_sock_recv = loop.sock_recv

    async def sock_recv(sock, n):
        waits.append(n)
        return await real_sock_recv(sock, n)

    monkeypatch.setattr(loop, "sock_recv", sock_recv)
    request = b"\x05\x01\x00\x05\x01\x00\x01" + socket.inet_aton("10.0.0.3") + (8080).to_bytes(2, "big")
    peer = SocketAddr.parse("10.0.0.2:1")
    a, b = socket.socketpair()
    with a, b:
        a.setblocking(False)
        b.sendall(request)
        got = await socks5_server._handshake(a, Socks5Handshake(), peer)
        assert isinstance(got, ConnectRequest) and got.port == 8080 and waits == []
        assert b.recv(100) == b"\x05\x00"  # the method reply went out
    a, b = socket.socketpair()
    with a, b:
        a.setblocking(False)
        loop.call_later(0.05, b.sendall, request)
        got = await socks5_server._handshake(a, Socks5Handshake(), peer)
        assert isinstance(got, ConnectRequest) and waits
    monkeypatch.setattr(socks5_server, "SOCKS5_HANDSHAKE_TIMEOUT_S", 0.1)
    a, b = socket.socketpair()
    with a, b:
        a.setblocking(False)
        assert await socks5_server._handshake(a, Socks5Handshake(), peer) is None
        assert b.recv(100) == b"\x05\xff"  # no method acceptable: the refusal a stalled greeting gets


def test_workload_identity_is_kept_per_workload_object_and_follows_replacements():
    import dataclasses
    import pickle

    import pytest

    from ambient_mesh.errors import IdentityError
    from ambient_mesh.proxy import routing
    from ambient_mesh.state.model import Service, Workload

    w = Workload(uid="c//Pod/ns/a", name="a", namespace="ns", trust_domain="td", service_account="a")
    first = w.identity
    assert first == Identity("td", "ns", "a") and w.identity is first
    # The kept Identity is no part of the value: equality, hash and repr as without it.
    fresh = Workload(uid="c//Pod/ns/a", name="a", namespace="ns", trust_domain="td", service_account="a")
    assert fresh == w and hash(fresh) == hash(w) and repr(fresh) == repr(w)
    assert "_identity" not in repr(w)
    assert pickle.loads(pickle.dumps(w)).identity == first
    moved = dataclasses.replace(w, service_account="b")  # a state update replaces the object
    assert moved.identity == Identity("td", "ns", "b")
    assert Workload(uid="u", namespace="ns").identity == Identity("cluster.local", "ns", "default")
    bad = dataclasses.replace(w, namespace="bad/ns")
    for _ in range(2):  # not kept: every read raises again
        with pytest.raises(IdentityError):
            _ = bad.identity
    svc = Service(
        name="s", namespace="ns", hostname="s.ns.svc", subject_alt_names=("spiffe://td/ns/ns/sa/x",)
    )
    assert routing._sans(w, svc) == (first, Identity("td", "ns", "x"))
    other = dataclasses.replace(svc, subject_alt_names=("spiffe://td/ns/ns/sa/y", "not-spiffe"))
    assert routing._sans(w, other) == (first, Identity("td", "ns", "y"))
    assert routing._sans(w, None) == (first,)


def _closed_and_received(metrics) -> tuple[float, float]:
    totals = {"istio_tcp_connections_closed": 0.0, "istio_tcp_received_bytes": 0.0}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        if family.name in totals:
            totals[family.name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return totals["istio_tcp_connections_closed"], totals["istio_tcp_received_bytes"]


def _result(metrics: Metrics) -> telemetry.ConnectionResult:
    return telemetry.ConnectionResult(
        types.SimpleNamespace(metrics=metrics, state=types.SimpleNamespace(version=1)),
        direction="inbound",
        src_addr=SocketAddr.parse("10.0.0.1:40000"),
        dst_addr=SocketAddr.parse("10.0.0.2:80"),
        hbone_addr=None,
        source=None,
        source_identity=None,
        destination=None,
        service=None,
        destination_identity=None,
        mtls=False,
    )


async def test_ended_connections_are_recorded_in_a_batch_with_their_counts_and_end_time(caplog, monkeypatch):
    """ConnectionResult.complete keeps the relay's counts, error and end time; the metrics and
    the access line follow with the batch, or first thing in a scrape (metrics.BEFORE_COLLECT)."""
    caplog.set_level(logging.INFO, logger="ambient_mesh")
    monkeypatch.setattr(telemetry, "ENDED_RECORD_S", 5.0)
    metrics = Metrics(process_metrics=False)
    result = _result(metrics)
    result.started -= 2.0  # opened two seconds ago
    relay = types.SimpleNamespace(bytes_up=3, bytes_down=5)
    result.complete(relay, None)
    relay.bytes_up = 1000  # what the relay does after its end is not the connection's
    assert not result.recorder.closed  # kept
    await asyncio.sleep(0.5)  # the recorded duration is the end's, not the record's
    assert _closed_and_received(metrics) == (1.0, 3.0)  # a scrape records what is kept first
    [line] = [r for r in caplog.records if r.getMessage() == "connection complete"]
    assert line.fields["bytes_recv"] == 3
    # Two seconds and what the test itself took between the two lines above (a loaded machine
    # can add milliseconds), not the half second slept after the end.
    duration = line.fields["duration"]
    assert duration.endswith("ms") and 2000 <= int(duration[:-2]) < 2400, duration
    result.complete(relay, None)  # once only
    telemetry.record_ended_connections()
    assert _closed_and_received(metrics) == (1.0, 3.0)


async def test_kept_connection_ends_are_recorded_within_the_interval():
    metrics = Metrics(process_metrics=False)
    result = _result(metrics)
    result.complete(types.SimpleNamespace(bytes_up=1, bytes_down=1), None)
    assert not result.recorder.closed
    await asyncio.sleep(telemetry.ENDED_RECORD_S * 3)
    assert result.recorder.closed


def test_the_served_workload_is_kept_per_state_version():
    """ServedWorkload (every outbound connection's source) looks again after a state change
    (ProxyState.version) and while nothing is found, not otherwise."""
    state = ProxyState()
    config = ZtunnelConfig(
        proxy_workload_info=ProxyWorkloadInfo(namespace="default", name="client", service_account="client")
    )
    served = ServedWorkload(state, lambda: served_workload(config, state))
    assert served() is None
    first = Workload(
        uid="c1//Pod/default/client", name="client", namespace="default", service_account="client"
    )
    state.workloads.insert(first)
    assert served() is first  # not found was not kept
    second = dataclasses.replace(first, canonical_revision="v2")
    state.workloads.insert(second)
    assert served() is first  # kept: the writer has not announced its batch yet
    state.notify_changed()
    assert served() is second
    state.workloads.remove(second.uid)
    state.notify_changed()
    assert served() is None
