"""`ambient demo` in its netns layout: a namespace per pod, iptables capture, plain connect().

Skipped with the reason when network namespaces are unavailable (conftest). Checks the exit code,
the key lines of the output, and that no namespace, process or temporary file is left behind.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import tempfile
from pathlib import Path

import pytest
from rich.console import Console

from ambient_mesh.demo import CLIENT, SERVER, DemoMode, run_demo
from ambient_mesh.host.netns import list_netns

pytestmark = pytest.mark.timeout(60)

DEMO_BUDGET_S = 10.0


async def test_netns_demo_crosses_hbone_and_leaves_nothing_behind(runner):
    own_prefix = f"am-{os.getpid()}-"
    dirs_before = set(Path(tempfile.gettempdir()).glob("ambient-demo-*"))
    buf = io.StringIO()
    console = Console(file=buf, width=140, color_system=None, force_terminal=False)
    loop = asyncio.get_running_loop()
    started = loop.time()
    rc = await run_demo(verbose=False, mode=DemoMode.NETNS, console=console)
    elapsed = loop.time() - started
    out = buf.getvalue()
    assert rc == 0, out
    assert elapsed < DEMO_BUDGET_S, out
    for expected in (
        "netns",
        "dedicated-mode capture rules",
        "plain connect()",
        "pod IP 10.240.0.12:8080",
        "service VIP 10.96.0.50:80",
        "65536 B echoed intact",
        CLIENT.spiffe_id,
        SERVER.spiffe_id,
        "mutual_tls",
        "Available",
        "signed by this run's operator root",
        "PASS",
    ):
        assert expected in out, f"{expected!r} missing from:\n{out}"
    assert not [ns for ns in list_netns(runner) if ns.startswith(own_prefix)]
    for pid in (int(p) for p in re.findall(r"pid (\d+)", out)):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert set(Path(tempfile.gettempdir()).glob("ambient-demo-*")) == dirs_before
