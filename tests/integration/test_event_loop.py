"""The in-process tests run on the event loop the programs use (see conftest.py)."""

import asyncio

import uvloop


async def test_loop_is_uvloop():
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
