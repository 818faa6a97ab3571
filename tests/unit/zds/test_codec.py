"""ZDS codec: encodings match the protobuf wire format, the fd rules, and hypothesis over any input."""

from __future__ import annotations

import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ambient_mesh.config import ProxyWorkloadInfo
from ambient_mesh.wire.istio.workload.zds import zds_pb2
from ambient_mesh.zds.codec import (
    RECEIVE_BUFFER_BYTES,
    AckMsg,
    Add,
    Del,
    Hello,
    Keep,
    SnapshotSent,
    ZdsProtocolError,
    decode_hello,
    decode_request,
    decode_response,
    encode,
    fds_to_send,
    nack_text,
)

ADD = Add(uid="pod-1", name="web", namespace="default", service_account="web-sa", netns_fd=7)


def test_encodings_are_the_istio_wire_bytes():
    assert encode(Hello()) == zds_pb2.ZdsHello(version=zds_pb2.V1).SerializeToString() == b"\x08\x01"
    # DelWorkload's uid is field 2 (field 1 unused), inside WorkloadRequest field 2.
    assert encode(Del(uid="b")) == b"\x12\x03\x12\x01b"
    assert encode(Keep(uid="a")) == b"\x2a\x03\x0a\x01a"  # keep is field 5
    assert encode(SnapshotSent()) == b"\x1a\x00"
    assert encode(AckMsg()) == b"\x0a\x00"
    req = zds_pb2.WorkloadRequest.FromString(encode(ADD))
    assert req.add.uid == "pod-1"
    assert req.add.workload_info.service_account == "web-sa"


def test_add_carries_its_fd_and_info():
    assert fds_to_send(ADD) == [7]
    assert fds_to_send(Del(uid="x")) == []
    assert ADD.info == ProxyWorkloadInfo(namespace="default", name="web", service_account="web-sa")
    assert Add.of("pod-1", ADD.info, 7) == ADD


@pytest.mark.parametrize("msg", [Keep(uid="k"), Del(uid="d"), SnapshotSent()])
def test_requests_round_trip_without_fds(msg):
    assert decode_request(encode(msg), []) == msg


def test_add_round_trips_with_exactly_one_fd():
    assert decode_request(encode(ADD), [7]) == ADD
    assert decode_request(encode(ADD), [9]).netns_fd == 9


def test_add_without_fd_is_an_error():
    with pytest.raises(ZdsProtocolError, match="without a netns fd") as info:
        decode_request(encode(ADD), [])
    assert info.value.fds == ()


def test_add_with_two_fds_reports_both_for_closing():
    with pytest.raises(ZdsProtocolError, match="at most 1 fd") as info:
        decode_request(encode(ADD), [7, 8])
    assert info.value.fds == (7, 8)


def test_fd_on_other_requests_is_an_error():
    with pytest.raises(ZdsProtocolError, match="unexpected fd") as info:
        decode_request(encode(Del(uid="d")), [5])
    assert info.value.fds == (5,)


def test_add_without_workload_info_is_an_error():
    data = zds_pb2.WorkloadRequest(add=zds_pb2.AddWorkload(uid="u")).SerializeToString()
    with pytest.raises(ZdsProtocolError, match="without workload_info") as info:
        decode_request(data, [3])
    assert info.value.fds == (3,)


def test_unknown_or_missing_payload_is_an_error():
    with pytest.raises(ZdsProtocolError, match="without a payload"):
        decode_request(b"", [])
    # field 4 (unknown to this version), length-delimited, empty
    with pytest.raises(ZdsProtocolError, match="without a payload"):
        decode_request(b"\x22\x00", [])


@pytest.mark.parametrize("flags", [socket.MSG_TRUNC, socket.MSG_CTRUNC])
def test_truncated_datagrams_are_errors_and_return_fds(flags):
    with pytest.raises(ZdsProtocolError, match="truncated") as info:
        decode_request(encode(ADD), [7], flags)
    assert info.value.fds == (7,)
    with pytest.raises(ZdsProtocolError, match="truncated"):
        decode_response(encode(AckMsg()), [], flags)
    with pytest.raises(ZdsProtocolError, match="truncated"):
        decode_hello(encode(Hello()), [], flags)


def test_responses_and_hello():
    assert decode_response(encode(AckMsg(error="nope")), []) == AckMsg(error="nope")
    assert not AckMsg(error="nope").ok and AckMsg().ok
    with pytest.raises(ZdsProtocolError, match="without an ack"):
        decode_response(b"", [])
    with pytest.raises(ZdsProtocolError, match="unexpected fd") as info:
        decode_response(encode(AckMsg()), [4])
    assert info.value.fds == (4,)
    assert decode_hello(encode(Hello()), []) == Hello(version=1)
    assert decode_hello(b"\x08\x02", []) == Hello(version=2)  # newer versions are the agent's call
    with pytest.raises(ZdsProtocolError, match="without a protocol version"):
        decode_hello(b"", [])


def test_messages_the_peer_could_not_read_whole_are_refused():
    with pytest.raises(ZdsProtocolError, match="1024-byte"):
        encode(AckMsg(error="x" * RECEIVE_BUFFER_BYTES))
    short = nack_text("é" * RECEIVE_BUFFER_BYTES)
    assert len(encode(AckMsg(error=short))) <= RECEIVE_BUFFER_BYTES
    assert short.endswith("...")
    assert nack_text("fine") == "fine"


# --- hypothesis ----------------------------------------------------------------------------------

fd_lists = st.lists(st.integers(min_value=3, max_value=1 << 20), max_size=4)
flag_values = st.sampled_from([0, socket.MSG_TRUNC, socket.MSG_CTRUNC, socket.MSG_TRUNC | socket.MSG_CTRUNC])


@given(data=st.binary(max_size=RECEIVE_BUFFER_BYTES + 8), fds=fd_lists, flags=flag_values)
def test_decode_request_returns_a_message_or_our_error(data, fds, flags):
    try:
        msg = decode_request(data, fds, flags)
    except ZdsProtocolError as e:
        # Every fd is either reported for closing or was never the message's (Add without fd).
        assert set(e.fds) <= set(fds)
        assert e.fds == tuple(fds) or not fds
        return
    assert isinstance(msg, Add | Keep | Del | SnapshotSent)
    assert fds_to_send(msg) == list(fds)
    assert flags == 0


@given(data=st.binary(max_size=64), fds=fd_lists, flags=flag_values)
def test_decode_response_and_hello_return_a_message_or_our_error(data, fds, flags):
    for decode, kind in ((decode_response, AckMsg), (decode_hello, Hello)):
        try:
            assert isinstance(decode(data, fds, flags), kind)
        except ZdsProtocolError as e:
            assert e.fds in ((), tuple(fds))


texts = st.text(max_size=60)


@given(uid=texts, name=texts, namespace=texts, sa=texts, fd=st.integers(min_value=0, max_value=1 << 20))
def test_round_trips(uid, name, namespace, sa, fd):
    add = Add(uid=uid, name=name, namespace=namespace, service_account=sa, netns_fd=fd)
    assert decode_request(encode(add), fds_to_send(add)) == add
    for msg in (Keep(uid=uid), Del(uid=uid), SnapshotSent()):
        assert decode_request(encode(msg), []) == msg
    assert decode_response(encode(AckMsg(error=name)), []) == AckMsg(error=name)
