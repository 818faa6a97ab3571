"""Playbooks for the node agent's per-connection ZDS sequencing (no sockets)."""

from __future__ import annotations

import pytest

from ambient_mesh.config import ProxyWorkloadInfo
from ambient_mesh.zds.codec import AckMsg, Add, Del, Hello, Keep, SnapshotSent, ZdsProtocolError
from ambient_mesh.zds.server import (
    Acked,
    CloseConnection,
    SendRequest,
    ServerPhase,
    SnapshotComplete,
    ZdsConnectionState,
    plan_snapshot,
)

INFO = ProxyWorkloadInfo(namespace="default", name="web", service_account="sa")
OK = AckMsg()


def test_plan_sends_add_for_known_netns_and_keep_otherwise():
    assert plan_snapshot([("a", INFO, 7), ("b", INFO, None)]) == [Add.of("a", INFO, 7), Keep(uid="b")]


def test_snapshot_is_sent_one_request_per_ack_then_snapshot_sent():
    s = ZdsConnectionState()
    plan = plan_snapshot([("a", INFO, 7), ("b", INFO, None)])
    assert s.receive_hello(Hello(), plan) == [SendRequest(request=plan[0])]
    assert s.phase is ServerPhase.SNAPSHOT and s.busy
    assert s.receive_ack(OK) == [SendRequest(request=Keep(uid="b"))]
    assert s.receive_ack(OK) == [SendRequest(request=SnapshotSent())]
    assert s.receive_ack(OK) == [SnapshotComplete(sent=2, nacks=())]
    assert s.phase is ServerPhase.STEADY and not s.busy
    assert repr(s) == "<ZdsConnectionState steady>"


def test_snapshot_nacks_are_collected_not_fatal():
    s = ZdsConnectionState()
    s.receive_hello(Hello(), plan_snapshot([("a", INFO, 7)]))
    assert s.receive_ack(AckMsg(error="port in use")) == [SendRequest(request=SnapshotSent())]
    assert s.receive_ack(OK) == [SnapshotComplete(sent=1, nacks=(("a", "port in use"),))]


def test_empty_snapshot_sends_only_snapshot_sent():
    s = ZdsConnectionState()
    assert s.receive_hello(Hello(), []) == [SendRequest(request=SnapshotSent())]
    assert s.receive_ack(OK) == [SnapshotComplete(sent=0, nacks=())]


def test_steady_requests_are_lockstep():
    s = ZdsConnectionState()
    s.receive_hello(Hello(), [])
    s.receive_ack(OK)
    add = Add.of("a", INFO, 7)
    assert s.send(add) == [SendRequest(request=add)]
    assert repr(s) == "<ZdsConnectionState steady, waiting for the ack of Add>"
    with pytest.raises(ZdsProtocolError, match="busy"):
        s.send(Del(uid="a"))
    assert s.receive_ack(AckMsg(error="nope")) == [Acked(request=add, error="nope")]
    assert s.send(Del(uid="a")) == [SendRequest(request=Del(uid="a"))]
    assert s.receive_ack(OK) == [Acked(request=Del(uid="a"), error="")]


def test_unsolicited_ack_closes_the_connection():
    s = ZdsConnectionState()
    s.receive_hello(Hello(), [])
    s.receive_ack(OK)
    assert s.receive_ack(OK) == [CloseConnection(reason="ztunnel protocol error, unexpected message")]
    assert s.phase is ServerPhase.CLOSED


def test_ack_before_hello_and_second_hello_close():
    s = ZdsConnectionState()
    assert isinstance(s.receive_ack(OK)[0], CloseConnection)
    s = ZdsConnectionState()
    s.receive_hello(Hello(), [])
    assert s.receive_hello(Hello(), []) == [CloseConnection(reason="hello while snapshot")]


def test_updates_wait_for_the_snapshot():
    s = ZdsConnectionState()
    with pytest.raises(ZdsProtocolError, match="await hello"):
        s.send(Del(uid="a"))
    s.receive_hello(Hello(), [])
    with pytest.raises(ZdsProtocolError, match="snapshot"):
        s.send(Del(uid="a"))


def test_newer_hello_version_is_served_v1():
    s = ZdsConnectionState()
    s.receive_hello(Hello(version=2), [])
    assert s.version == 2 and s.phase is ServerPhase.SNAPSHOT
