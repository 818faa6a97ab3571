"""Playbooks for the node proxy's ZDS state machine: request in, commands out."""

from __future__ import annotations

import pytest

from ambient_mesh.config import ProxyWorkloadInfo
from ambient_mesh.zds.client import (
    ClientPhase,
    CloseFd,
    Disconnect,
    Reconcile,
    SendAck,
    SendHello,
    StartProxy,
    StopProxy,
    ZdsClientState,
)
from ambient_mesh.zds.codec import Add, Del, Keep, SnapshotSent, ZdsProtocolError

NS_A = (1, 100)
NS_B = (1, 200)


def info(name: str) -> ProxyWorkloadInfo:
    return ProxyWorkloadInfo(namespace="default", name=name, service_account="sa")


def add(uid: str, fd: int) -> Add:
    return Add.of(uid, info(uid), fd)


def start(uid: str, fd: int, *, retry: bool = False) -> StartProxy:
    return StartProxy(uid=uid, info=info(uid), netns_fd=fd, retry=retry)


def started(s: ZdsClientState, uid: str, *, now: float = 0.0) -> list:
    return s.start_finished(uid, error=None, now=now)


def connected_state() -> ZdsClientState:
    s = ZdsClientState()
    assert s.connected() == [SendHello()]
    assert s.phase is ClientPhase.HELLO_SENT
    return s


def steady_with(*pods: tuple[str, int, tuple[int, int]]) -> ZdsClientState:
    s = connected_state()
    for uid, fd, ns in pods:
        assert s.receive(add(uid, fd), netns_id=ns) == [start(uid, fd)]
        assert started(s, uid) == [CloseFd(fd=fd), SendAck()]
    s.receive(SnapshotSent())
    assert s.phase is ClientPhase.STEADY
    return s


def test_snapshot_then_ready():
    s = connected_state()
    assert not s.ready
    assert s.receive(add("a", 10), netns_id=NS_A) == [start("a", 10)]
    assert s.phase is ClientPhase.SNAPSHOT
    assert started(s, "a") == [CloseFd(fd=10), SendAck()]
    assert s.receive(Keep(uid="b")) == [SendAck()]
    assert s.receive(SnapshotSent()) == [Reconcile(keep=frozenset({"a", "b"}), stop=()), SendAck()]
    assert s.ready
    assert s.running == {"a": info("a")}
    assert repr(s) == "<ZdsClientState steady: 1 running, 0 pending, ready>"


def test_empty_snapshot_is_ready():
    s = connected_state()
    assert s.receive(SnapshotSent()) == [Reconcile(keep=frozenset(), stop=()), SendAck()]
    assert s.ready


def test_add_same_uid_same_netns_is_idempotent():
    s = steady_with(("a", 10, NS_A))
    assert s.receive(add("a", 11), netns_id=NS_A) == [CloseFd(fd=11), SendAck()]
    assert s.running == {"a": info("a")}


def test_add_same_uid_new_netns_restarts_the_proxy():
    s = steady_with(("a", 10, NS_A))
    assert s.receive(add("a", 11), netns_id=NS_B) == [StopProxy(uid="a", graceful=False), start("a", 11)]
    assert started(s, "a") == [CloseFd(fd=11), SendAck()]
    # the new namespace is now the one an idempotent add is compared with
    assert s.receive(add("a", 12), netns_id=NS_B) == [CloseFd(fd=12), SendAck()]


def test_unknown_netns_never_counts_as_the_same():
    s = steady_with(("a", 10, NS_A))
    assert s.receive(add("a", 11), netns_id=None)[0] == StopProxy(uid="a", graceful=False)


def test_del_stops_at_once_and_is_idempotent():
    s = steady_with(("a", 10, NS_A))
    assert s.receive(Del(uid="a")) == [StopProxy(uid="a", graceful=False), SendAck()]
    assert s.receive(Del(uid="a")) == [SendAck()]
    assert s.running == {}


def test_snapshot_drops_pods_not_mentioned_on_the_new_connection():
    s = steady_with(("a", 10, NS_A), ("b", 11, NS_B))
    assert s.disconnected() == []
    assert s.phase is ClientPhase.CONNECTING and not s.ready
    assert s.running.keys() == {"a", "b"}  # proxies outlive the connection
    assert s.connected() == [SendHello()]
    assert s.receive(add("a", 20), netns_id=NS_A) == [CloseFd(fd=20), SendAck()]
    assert s.receive(SnapshotSent()) == [
        Reconcile(keep=frozenset({"a"}), stop=("b",)),
        StopProxy(uid="b", graceful=False),
        SendAck(),
    ]
    assert s.running.keys() == {"a"}


def test_keep_protects_a_pod_without_netns():
    s = steady_with(("a", 10, NS_A))
    s.disconnected()
    s.connected()
    assert s.receive(Keep(uid="a")) == [SendAck()]
    assert s.receive(SnapshotSent()) == [Reconcile(keep=frozenset({"a"}), stop=()), SendAck()]
    assert s.running.keys() == {"a"}


def test_del_during_snapshot_forgets_the_mention_and_stops():
    s = steady_with(("a", 10, NS_A))
    s.disconnected()
    s.connected()
    s.receive(Keep(uid="a"))
    assert s.receive(Del(uid="a")) == [StopProxy(uid="a", graceful=False), SendAck()]
    assert s.receive(SnapshotSent()) == [Reconcile(keep=frozenset(), stop=()), SendAck()]


def test_keep_after_snapshot_is_a_protocol_error():
    s = steady_with()
    commands = s.receive(Keep(uid="a"))
    assert commands == [
        SendAck(error="pod keep received after snapshot"),
        Disconnect(reason="pod keep received after snapshot"),
    ]
    assert s.phase is ClientPhase.CLOSED and not s.ready
    s.disconnected()
    assert s.connected() == [SendHello()]  # and we reconnect


def test_second_snapshot_is_a_protocol_error():
    s = steady_with()
    assert s.receive(SnapshotSent())[-1] == Disconnect(reason="pod snapshot received already")


def test_undecodable_datagram_nacks_and_disconnects():
    s = steady_with()
    commands = s.receive_invalid(ZdsProtocolError("AddWorkload without a netns fd"))
    assert commands == [
        SendAck(error="failure to read message: AddWorkload without a netns fd"),
        Disconnect(reason="failure to read message: AddWorkload without a netns fd"),
    ]


def test_start_failure_nacks_keeps_connection_and_retries():
    s = steady_with()
    s.receive(add("a", 10), netns_id=NS_A)
    (nack,) = s.start_finished("a", error="port 15008 in use", now=100.0)
    assert nack == SendAck(error="failure to start proxy for a: port 15008 in use")
    assert s.phase is ClientPhase.STEADY  # no Disconnect
    assert s.pending == ("a",) and not s.ready
    assert s.next_retry_at == 105.0
    assert s.retry_due(104.9) == []
    assert s.retry_due(105.0) == [start("a", 10, retry=True)]
    # a retry that fails again stays pending, without an ack
    assert s.start_finished("a", error="still in use", now=105.0) == []
    assert s.next_retry_at == 110.0
    assert s.retry_due(110.0) == [start("a", 10, retry=True)]
    assert s.start_finished("a", error=None, now=110.0) == [CloseFd(fd=10)]
    assert s.ready and s.next_retry_at is None
    assert s.running.keys() == {"a"}


def test_pending_pod_readded_replaces_its_fd():
    s = steady_with()
    s.receive(add("a", 10), netns_id=NS_A)
    s.start_finished("a", error="boom", now=0.0)
    assert s.receive(add("a", 11), netns_id=NS_B) == [CloseFd(fd=10), start("a", 11)]
    assert s.next_retry_at is None
    assert started(s, "a") == [CloseFd(fd=11), SendAck()]
    assert s.ready


def test_del_of_pending_pod_closes_its_fd():
    s = steady_with()
    s.receive(add("a", 10), netns_id=NS_A)
    s.start_finished("a", error="boom", now=0.0)
    assert s.receive(Del(uid="a")) == [CloseFd(fd=10), SendAck()]
    assert s.ready and s.next_retry_at is None


def test_pending_failed_in_snapshot_survives_reconcile_and_blocks_readiness():
    s = connected_state()
    s.receive(add("a", 10), netns_id=NS_A)
    s.start_finished("a", error="boom", now=0.0)
    assert s.receive(SnapshotSent()) == [Reconcile(keep=frozenset({"a"}), stop=()), SendAck()]
    assert s.phase is ClientPhase.STEADY and not s.ready


def test_reconnect_forgets_pending_pods_and_closes_their_fds():
    s = steady_with()
    s.receive(add("a", 10), netns_id=NS_A)
    s.start_finished("a", error="boom", now=0.0)
    s.disconnected()
    assert s.connected() == [CloseFd(fd=10), SendHello()]
    assert s.pending == () and s.next_retry_at is None


def test_disconnect_during_start_releases_the_fd():
    s = steady_with()
    s.receive(add("a", 10), netns_id=NS_A)
    assert s.disconnected() == [CloseFd(fd=10)]


def test_drain_stops_everything_gracefully():
    s = steady_with(("a", 10, NS_A), ("b", 11, NS_B))
    s.receive(add("c", 12), netns_id=(1, 300))
    s.start_finished("c", error="boom", now=0.0)
    assert s.drain() == [StopProxy(uid="a", graceful=True), StopProxy(uid="b", graceful=True), CloseFd(fd=12)]
    assert s.phase is ClientPhase.CLOSED
    s.disconnected()
    assert s.phase is ClientPhase.CLOSED
    with pytest.raises(ZdsProtocolError):
        s.connected()


def test_requests_outside_a_connection_are_a_bug():
    s = ZdsClientState()
    with pytest.raises(ZdsProtocolError) as info_:
        s.receive(add("a", 10))
    assert info_.value.fds == (10,)
    s.connected()
    with pytest.raises(ZdsProtocolError):
        s.connected()
    with pytest.raises(ZdsProtocolError):
        s.start_finished("nobody", error=None, now=0.0)
