"""`ambient demo`, the lab's guided tour, as `bash scripts/demo.sh` runs it: every step passes,
the exit status is 0, and nothing is left behind (namespaces, processes, the temporary state
directory). The tour's own checks are the assertions: a step that does not behave as shown
makes it exit 1, which this test would report with the whole output.

The 30 s budget is the tour's promise on an idle machine; it is printed, not asserted (timings
belong to bench/, and the suite shares its cores).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ambient_mesh.host.netns import list_netns

pytestmark = pytest.mark.timeout(240)

STEPS = (
    "lab up",
    "same-node call over HBONE",
    "cross-node call over HBONE",
    "call through the Service by name",
    "both identities in the proxies' metrics",
    "DENY refuses the client at every replica",
    "removing it lets the client in again",
    "a pod outside the mesh reaches the Service in plaintext",
    "STRICT mTLS refuses the non-mesh caller at every replica, not the mesh's",
    "removing STRICT restores plaintext at every replica",
    "lab down",
)


def test_the_tour_passes_every_step_and_leaves_nothing(runner):
    demo = subprocess.Popen(
        [sys.executable, "-m", "ambient_mesh", "demo"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = demo.communicate(timeout=200)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    assert demo.returncode == 0, out + err
    for step in STEPS:
        assert "PASS" in out and any(line.startswith("PASS") and step in line for line in out.splitlines()), (
            f"{step!r} did not pass:\n{out}"
        )
    assert "FAIL" not in out
    for expected in (
        "spiffe://cluster.local/ns/shop/sa/client",
        "spiffe://cluster.local/ns/shop/sa/echo",
        "mutual_tls",
        "answered by shop/echo-1, shop/echo-2",
        "authorizationpolicy.security.istio.io/deny-client created",
        "peerauthentication.security.istio.io/strict deleted",
        "all steps behaved as shown",
    ):
        assert expected in out, f"{expected!r} missing from:\n{out}"
    # The table is plain text in a pipe: whole rows, no styling.
    assert "\x1b[" not in out
    # Its own namespaces carry its pid (other tests may be making theirs meanwhile).
    assert [ns for ns in list_netns(runner) if ns.startswith(f"am-{demo.pid}-")] == []
    (state_dir,) = re.findall(r"state in (\S+)", out)
    assert not Path(state_dir).exists()
    print(out)  # shown with -s: the timings


def test_the_tour_refuses_to_run_without_root_and_says_why():
    if os.geteuid() != 0:
        pytest.skip("needs root to drop it")
    done = subprocess.run(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            sys.executable,
            "-m",
            "ambient_mesh",
            "demo",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert done.returncode == 2 and "network namespaces need root" in done.stderr, done.stderr
