"""host/cpython.py: each CPython-private behaviour the data path leans on still behaves as relied
on. A failure here means the interpreter changed under us: the named helper must change before
anything else runs on this interpreter."""

from __future__ import annotations

import dataclasses
import socket

import pytest

from ambient_mesh.host.cpython import ReusableBuffer, new_frozen, raw_accept, slot_setter
from ambient_mesh.http2.events import DataReceived


def test_raw_accept_returns_a_descriptor_and_the_peer_and_raises_when_the_backlog_is_empty() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        accept = raw_accept(listener)
        with pytest.raises(BlockingIOError):
            accept()
        with socket.create_connection(listener.getsockname()) as client:
            listener.setblocking(True)
            fd, addr = accept()
            try:
                assert isinstance(fd, int) and addr == client.getsockname()
                with socket.socket(fileno=fd) as accepted:
                    client.sendall(b"x")
                    assert accepted.recv(1) == b"x"
            except BaseException:
                socket.close(fd)
                raise


def test_a_frozen_event_built_through_its_slots_is_the_one_its_constructor_builds() -> None:
    built = new_frozen(DataReceived)
    slot_setter(DataReceived, "stream_id")(built, 7)
    slot_setter(DataReceived, "data")(built, b"abc")
    # http2/connection.py sets exactly these two: a new field would be left unset there.
    assert [f.name for f in dataclasses.fields(DataReceived)] == ["stream_id", "data"]
    reference = DataReceived(stream_id=7, data=b"abc")
    assert built == reference and hash(built) == hash(reference)
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.stream_id = 8  # type: ignore[misc]


def test_a_reusable_buffer_is_handed_out_again_only_while_no_view_of_it_is_alive() -> None:
    reusable = ReusableBuffer(64)
    first = reusable.take()
    assert len(first) == 64
    del first
    again = reusable.take()
    assert again is reusable.buf
    view = memoryview(again)[:8]
    del again
    replaced = reusable.take()
    assert replaced is not view.obj and len(replaced) == 64  # the old one stays with its view
    view.release()
    replaced_id = id(replaced)
    del replaced  # a plain reference counts too: only the holder's attribute may remain
    assert id(reusable.take()) == replaced_id
