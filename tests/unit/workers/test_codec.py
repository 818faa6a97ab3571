"""The owner <-> worker codec (ambient_mesh/workers/codec.py): round trips and every bound."""

from __future__ import annotations

import asyncio
import json
import os
import socket

import pytest

from ambient_mesh.workers import codec
from ambient_mesh.workers.channel import Channel
from ambient_mesh.workers.codec import (
    HEADER,
    MAX_FDS_PER_FRAME,
    MAX_PENDING_FDS,
    CertReply,
    CertRequest,
    Drain,
    Hello,
    PodInfo,
    ProxyStart,
    ProxyStats,
    ProxyStop,
    Ready,
    StatsReply,
    WorkerProtocolError,
    XdsResponse,
    encode,
    owner_decoder,
    worker_decoder,
)


def frame(kind: int, payload: bytes, fd_count: int = 0, reserved: int = 0) -> bytes:
    return HEADER.pack(len(payload), kind, fd_count, reserved) + payload


def pipe_fds(n: int) -> list[int]:
    fds = []
    for _ in range(n):
        r, w = os.pipe()
        os.close(w)
        fds.append(r)
    return fds


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


TO_WORKER = [
    Hello({"PROXY_MODE": "dedicated", "X": ""}),
    codec.LocalConfig("workloads: []\n", "LOCAL_XDS"),
    XdsResponse(b"\x0a\x03abc"),
    codec.Synced(),
    ProxyStop("uid-1", True),
    CertReply(7, "KEY", ("LEAF", "ROOTS"), ""),
    codec.StatsRequest(3),
    Drain(2.5),
]
TO_OWNER = [
    Ready(1234),
    CertRequest(1, "spiffe://cluster.local/ns/a/sa/b", ""),
    StatsReply(
        9,
        (("istio_tcp_connections_opened", "counter", "help", "", (("x_total", {"a": "b"}, 3.0),)),),
        {"dedicated": ProxyStats(accepted={"inbound": 2}, inbound=[{"src": "x"}], outbound=[])},
    ),
    codec.ProxyStarted("dedicated", ""),
    codec.ProxyStopped("dedicated"),
    codec.Drained(),
]


@pytest.mark.parametrize("message", TO_WORKER, ids=lambda m: type(m).__name__)
def test_owner_messages_round_trip_even_byte_by_byte(message):
    data, fds = encode(message)
    assert fds == ()
    assert worker_decoder().feed(data) == [message]
    decoder = worker_decoder()
    out = []
    for i in range(len(data)):
        out.extend(decoder.feed(data[i : i + 1]))
    assert out == [message] and decoder.pending_bytes == 0


@pytest.mark.parametrize("message", TO_OWNER, ids=lambda m: type(m).__name__)
def test_worker_messages_round_trip(message):
    data, _ = encode(message)
    assert owner_decoder().feed(data + data) == [message, message]


def test_each_side_refuses_the_other_sides_kinds():
    with pytest.raises(WorkerProtocolError, match="unexpected frame kind"):
        owner_decoder().feed(encode(Drain(1.0))[0])
    with pytest.raises(WorkerProtocolError, match="unexpected frame kind"):
        worker_decoder().feed(encode(Ready(1))[0])
    # A worker cannot send xDS frames to the owner.
    with pytest.raises(WorkerProtocolError, match="unexpected frame kind"):
        owner_decoder().feed(encode(XdsResponse(b""))[0])


def test_descriptors_are_claimed_by_their_frame_in_order():
    fds = pipe_fds(3)
    start = ProxyStart("uid", PodInfo("ns", "pod", "sa"), ("outbound", "inbound"), tuple(fds))
    data, sent = encode(start)
    assert list(sent) == fds
    decoder = worker_decoder()
    # The descriptors arrive with the first byte; the frame completes later.
    assert decoder.feed(data[:3], fds) == []
    (got,) = decoder.feed(data[3:])
    assert got == start and list(got.fds) == fds
    decoder.close()
    assert all(is_open(fd) for fd in fds)  # claimed: the receiver's now
    for fd in fds:
        os.close(fd)


def test_unclaimed_descriptors_are_closed_with_the_decoder():
    fds = pipe_fds(2)
    decoder = worker_decoder()
    decoder.feed(b"", fds)
    decoder.close()
    assert not any(is_open(fd) for fd in fds)


def test_a_frame_naming_more_descriptors_than_arrived_is_refused():
    payload = json.dumps({"key": "k", "pod": None, "listeners": ["a", "b"]}).encode()
    with pytest.raises(WorkerProtocolError, match="names 2 descriptors, 1 arrived"):
        worker_decoder().feed(frame(ProxyStart.KIND, payload, 2), pipe_fds(1))


def test_proxy_start_checks_its_descriptor_count_and_closes_them():
    fds = pipe_fds(1)
    payload = json.dumps({"key": "k", "pod": None, "listeners": ["a", "b"]}).encode()
    with pytest.raises(WorkerProtocolError, match="expected 2"):
        worker_decoder().feed(frame(ProxyStart.KIND, payload, 1), fds)
    assert not is_open(fds[0])


def test_descriptor_bounds():
    with pytest.raises(WorkerProtocolError, match="at most"):
        worker_decoder().feed(frame(ProxyStart.KIND, b"{}", MAX_FDS_PER_FRAME + 1))
    decoder = worker_decoder()
    fds = pipe_fds(MAX_PENDING_FDS + 1)
    with pytest.raises(WorkerProtocolError, match="not claimed"):
        decoder.feed(b"", fds)
    assert not any(is_open(fd) for fd in fds)
    with pytest.raises(WorkerProtocolError, match="descriptors"):
        encode(ProxyStart("k", None, ("a",) * 17, tuple(range(17))))


def test_oversized_frames_are_refused_from_the_header_alone():
    # A worker may send at most 16 MiB: the owner refuses before buffering the body.
    header = HEADER.pack(codec.MAX_WORKER_FRAME_BYTES + 1, Ready.KIND, 0, 0)
    with pytest.raises(WorkerProtocolError, match="exceeds the limit"):
        owner_decoder().feed(header)
    header = HEADER.pack(codec.MAX_OWNER_FRAME_BYTES + 1, XdsResponse.KIND, 0, 0)
    with pytest.raises(WorkerProtocolError, match="exceeds the limit"):
        worker_decoder().feed(header)


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (frame(Ready.KIND, b"{}", reserved=1), "reserved"),
        (frame(Ready.KIND, b"not json"), "not JSON"),
        (frame(Ready.KIND, b"[1]"), "not a JSON object"),
        (frame(Ready.KIND, b"{}"), "missing"),
        (frame(Ready.KIND, b'{"pid": "1"}'), "wrong type"),
        (frame(Ready.KIND, b'{"pid": true}'), "boolean"),
        (frame(Ready.KIND, ('{"pid": 1, "x": ' + "[" * 40 + "]" * 40 + "}").encode()), "nests deeper"),
        (frame(Ready.KIND, b"[" * 100_000), "not JSON|not a JSON object"),
        (frame(codec.ProxyStarted.KIND, b'{"key": 1, "error": ""}'), "wrong type"),
        (frame(StatsReply.KIND, b'{"request": 1, "families": [["a"]], "proxies": {}}'), "metric family"),
        (
            frame(
                StatsReply.KIND,
                b'{"request": 1, "families": [["a","counter","","",[["a",{},"1"]]]], "proxies": {}}',
            ),
            "sample",
        ),
        (
            frame(
                StatsReply.KIND,
                b'{"request": 1, "families": [], "proxies": {"p": {"accepted": {"a": true}}}}',
            ),
            "integers",
        ),
    ],
)
def test_malformed_worker_frames(raw, match):
    with pytest.raises(WorkerProtocolError, match=match):
        owner_decoder().feed(raw)


def test_stats_replies_are_bounded_in_samples(monkeypatch):
    monkeypatch.setattr(codec, "MAX_STATS_SAMPLES", 3)
    samples = [["x_total", {}, 1]] * 4
    payload = json.dumps({"request": 1, "families": [["x", "counter", "", "", samples]], "proxies": {}})
    with pytest.raises(WorkerProtocolError, match="more than 3 metric samples"):
        owner_decoder().feed(frame(StatsReply.KIND, payload.encode()))


def test_hello_env_is_bounded_and_typed():
    with pytest.raises(WorkerProtocolError, match="env"):
        worker_decoder().feed(frame(Hello.KIND, b'{"env": {"A": 1}}'))
    big = {"env": {f"V{i}": "" for i in range(codec.MAX_ENV_ENTRIES + 1)}}
    with pytest.raises(WorkerProtocolError, match="env"):
        worker_decoder().feed(frame(Hello.KIND, json.dumps(big).encode()))


# -- the asyncio shell over a real socketpair ----------------------------------------------------


def owner_end(sock: socket.socket, closed: list, max_queued_bytes: int) -> Channel:
    channel = Channel(
        sock,
        owner_decoder(),
        name="owner",
        on_message=lambda m: None,
        on_close=closed.append,
        max_queued_bytes=max_queued_bytes,
    )
    channel.start()
    return channel


async def test_channel_carries_frames_and_descriptors_across_a_socketpair():
    a, b = socket.socketpair()
    got: list = []
    closed: list = []
    owner = Channel(
        a,
        owner_decoder(),
        name="owner",
        on_message=got.append,
        on_close=closed.append,
        max_queued_bytes=1 << 30,
    )
    received: list = []
    worker = Channel(
        b,
        worker_decoder(),
        name="worker",
        on_message=received.append,
        on_close=closed.append,
        max_queued_bytes=1 << 30,
    )
    owner.start()
    worker.start()
    listener = socket.create_server(("127.0.0.1", 0))
    big = XdsResponse(os.urandom(3 * 1024 * 1024))  # larger than one read and the socket buffer
    owner.send(big)
    owner.send(ProxyStart("dedicated", None, ("inbound",), (listener.fileno(),)))
    worker.send(Ready(42))
    for _ in range(200):
        if len(received) == 2 and got:
            break
        await asyncio.sleep(0.01)
    assert received[0] == big
    start = received[1]
    assert isinstance(start, ProxyStart)
    handed = socket.socket(fileno=start.fds[0])
    assert handed.getsockname() == listener.getsockname()  # the same listening socket, via SCM_RIGHTS
    handed.close()
    listener.close()
    assert got == [Ready(42)]
    owner.close()
    for _ in range(100):
        if len(closed) == 2:
            break
        await asyncio.sleep(0.01)
    assert closed == [None, None]  # the worker saw EOF


async def test_a_peer_that_stops_reading_is_cut_off_at_the_queue_bound():
    a, b = socket.socketpair()
    closed: list = []
    owner = owner_end(a, closed, 4 * 1024 * 1024)
    sent = 0
    while owner.send(XdsResponse(b"x" * 1024 * 1024)):
        sent += 1
        assert sent < 100
    assert owner.closed and isinstance(closed[0], WorkerProtocolError)
    b.close()


async def test_a_hostile_peer_closes_the_channel_and_keeps_no_descriptors():
    a, b = socket.socketpair()
    closed: list = []
    owner = owner_end(a, closed, 1 << 20)
    assert not owner.closed
    b.send(HEADER.pack(1 << 30, Ready.KIND, 0, 0))
    for _ in range(100):
        if closed:
            break
        await asyncio.sleep(0.01)
    assert isinstance(closed[0], WorkerProtocolError) and "exceeds" in str(closed[0])
    b.close()
