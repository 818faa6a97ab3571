"""Start and stop of the node proxy: bind errors, bad configuration, SIGTERM and /quitquitquit."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import urllib.request

import pytest

from ambient_mesh.errors import BindError
from tests.helpers.ztunnel_process import AMBIENT, wait_ready_line

from .mesh import local_config, proxy_env, start_proxy

IP = "127.0.0.32"


async def test_bind_conflict_names_the_address():
    blocker = socket.socket()
    blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    blocker.bind(("127.0.0.31", 15008))
    blocker.listen(1)
    try:
        with pytest.raises(BindError, match=r"inbound listener could not bind 127\.0\.0\.31:15008"):
            proxy = await start_proxy("server", "127.0.0.31", local_config())
            await proxy.drain(0)
    finally:
        blocker.close()


async def spawn(env_extra: dict[str, str]) -> asyncio.subprocess.Process:
    env = dict(os.environ)
    env.update(proxy_env("server", IP, local_config()))
    env.update(env_extra)
    return await asyncio.create_subprocess_exec(
        *AMBIENT, env=env, stderr=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL
    )


async def stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.kill()
        await proc.wait()


async def test_sigterm_drains_and_exits_zero():
    proc = await spawn({})
    try:
        await wait_ready_line(proc)
        proc.send_signal(signal.SIGTERM)
        rest = (await asyncio.wait_for(proc.stderr.read(), 15)).decode()
        assert await asyncio.wait_for(proc.wait(), 15) == 0
        assert "draining" in rest
    finally:
        await stop(proc)


async def test_quitquitquit_shuts_down():
    proc = await spawn({})
    try:
        fields = await wait_ready_line(proc)
        admin = fields["admin"]

        def post() -> bytes:
            req = urllib.request.Request(f"http://{admin}/quitquitquit", method="POST")
            with urllib.request.urlopen(req, timeout=5) as resp:
                return resp.read()

        assert b"shutdown now" in await asyncio.to_thread(post)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        await stop(proc)


async def test_invalid_configuration_fails_at_start_naming_the_variable():
    proc = await spawn({"PROXY_MODE": "sideways"})
    try:
        err = (await asyncio.wait_for(proc.stderr.read(), 15)).decode()
        assert await proc.wait() != 0
        assert "PROXY_MODE" in err
    finally:
        await stop(proc)


async def test_unreadable_local_config_is_refused_naming_the_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    proc = await spawn({"LOCAL_XDS": "", "LOCAL_XDS_PATH": str(missing)})
    try:
        err = (await asyncio.wait_for(proc.stderr.read(), 15)).decode()
        assert await proc.wait() != 0
        assert str(missing) in err
    finally:
        await stop(proc)
