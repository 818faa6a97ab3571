"""The node proxy as a child process: its command line and its ready line."""

from __future__ import annotations

import asyncio
import re
import sys

AMBIENT = [sys.executable, "-m", "ambient_mesh.cli", "ztunnel"]


async def wait_ready_line(proc: asyncio.subprocess.Process) -> dict[str, str]:
    """Read stderr until the `node proxy ready` line; return its fields."""
    async with asyncio.timeout(20):
        while True:
            line = (await proc.stderr.readline()).decode()
            if not line:
                raise AssertionError("node proxy exited before it was ready")
            if "node proxy ready" in line:
                return dict(re.findall(r"(\w[\w ]*?)=(\S+)", line.split("node proxy ready", 1)[1]))
