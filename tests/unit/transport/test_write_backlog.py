"""The transports' write backlog (write_backlog.py): order, marks, partial sends, bound."""

from __future__ import annotations

import pytest

from ambient_mesh.transport.write_backlog import (
    HELD_VIEW_MIN_SHARE,
    MAX_WRITE_BACKLOG_BYTES,
    BacklogOverflow,
    WriteBacklog,
)


def test_pause_once_above_high_and_resume_once_at_or_below_low():
    b = WriteBacklog(high_water_bytes=100, low_water_bytes=40, max_bytes=1000)
    assert not b.push(b"a" * 60)
    assert not b.push(b"b" * 40)  # 100: not above high
    assert b.push(b"c" * 10)  # 110: pause
    assert not b.push(b"d" * 10)  # already paused: told once
    assert b.paused and b.bytes == 120
    assert b.head() == b"a" * 60
    assert not b.pop()  # 60 left: above low
    assert b.head() == b"b" * 40
    assert b.pop()  # 20: resume
    assert not b.paused
    assert not b.pop() and not b.pop()
    assert b.bytes == 0 and not b.pieces


def test_the_head_stays_until_it_is_written():
    b = WriteBacklog(high_water_bytes=100, low_water_bytes=25)
    first = memoryview(b"first")
    b.push(first)
    b.push(b"second")
    assert b.head() is first
    assert b.head() is first  # a retry after WANT_WRITE gets the same object
    b.pop()
    assert b.head() == b"second"


def test_overflow_is_refused_before_anything_is_queued():
    b = WriteBacklog(high_water_bytes=10, low_water_bytes=5, max_bytes=100)
    b.push(b"x" * 100)
    with pytest.raises(BacklogOverflow, match="exceed 100 bytes"):
        b.push(b"y")
    assert b.bytes == 100 and len(b.pieces) == 1


def test_limits_follow_asyncio_rules():
    b = WriteBacklog(high_water_bytes=2000, low_water_bytes=500)
    assert b.max_bytes == MAX_WRITE_BACKLOG_BYTES
    b.set_limits()
    assert (b.low_water_bytes, b.high_water_bytes) == (500, 2000)  # its own default, not another's
    b.set_limits(high=1000)
    assert (b.low_water_bytes, b.high_water_bytes) == (250, 1000)
    b.set_limits(low=100)
    assert (b.low_water_bytes, b.high_water_bytes) == (100, 400)
    with pytest.raises(ValueError):
        b.set_limits(high=10, low=20)
    b.clear()
    assert b.bytes == 0


def test_a_partial_send_drops_what_went_and_keeps_the_rest_in_order():
    b = WriteBacklog(high_water_bytes=10, low_water_bytes=4)
    b.push(b"abc")
    assert b.push(memoryview(b"defghijk"))  # 11: pause
    assert not b.consume(2)  # within the first piece
    assert bytes(b.head()) == b"c" and b.bytes == 9
    assert not b.consume(4)  # the rest of the first, part of the second: 5 left
    assert bytes(b.head()) == b"ghijk" and len(b.pieces) == 1
    assert b.consume(1)  # 4: resume
    assert not b.paused
    assert not b.consume(4)
    assert b.bytes == 0 and not b.pieces


def test_a_view_is_kept_when_a_large_share_of_its_buffer_and_copied_otherwise():
    # A kept view holds its whole buffer alive: a short one is copied, so what waits pins at most
    # HELD_VIEW_MIN_SHARE times its size; a bytearray is copied since its owner may change it.
    buffer = bytearray(b"x" * 1000)
    scratch = bytearray(b"y" * 10)
    b = WriteBacklog(high_water_bytes=10_000, low_water_bytes=100)
    large = memoryview(buffer)[: 1000 // HELD_VIEW_MIN_SHARE]
    small = memoryview(buffer)[: 1000 // HELD_VIEW_MIN_SHARE - 1]
    b.push(large)
    b.push(small)
    b.push(scratch)
    kept, copied, copied_bytearray = b.pieces
    assert kept is large
    assert type(copied) is bytes and copied == bytes(small)
    assert type(copied_bytearray) is bytes and copied_bytearray == b"y" * 10
    assert b.bytes == len(large) + len(small) + 10
