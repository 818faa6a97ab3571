"""Nothing of a key is left after `kill -9` at any point (issue 24): a process that builds HBONE
contexts as fast as it can is killed without warning, in a mount namespace whose /dev/shm and
/tmp are directories of this test, and both are empty afterwards. The older version wrote each
key to /dev/shm for a moment, and a kill in that moment left the file behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and unshare for a mount namespace",
)

CHILD = """
import sys
from datetime import UTC, datetime
from ambient_mesh.identity import CertificateAuthority, Identity
from ambient_mesh.tls.context import client_context, server_context
ca = CertificateAuthority.insecure_test_ca()
cert = ca.issue(Identity("cluster.local", "ns1", "workload"), 3600, now=datetime.now(UTC))
built = 0
while True:
    server_context(cert)
    client_context(cert)
    built += 2
    if built == 20:
        print("building", flush=True)
"""


def test_kill_9_while_contexts_are_built_leaves_no_file(tmp_path: Path) -> None:
    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    tmp.mkdir()
    shell = f'mount --bind "{shm}" /dev/shm && mount --bind "{tmp}" /tmp && exec "$0" -c "$1"'
    for delay_s in (0.05, 0.2, 0.5):
        child = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", shell, sys.executable, CHILD],
            stdout=subprocess.PIPE,
            cwd=Path(__file__).resolve().parents[2],
        )
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == b"building"
            time.sleep(delay_s)
            child.send_signal(signal.SIGKILL)
        finally:
            child.kill()
            child.wait(10)
        assert child.returncode == -signal.SIGKILL
        assert list(shm.iterdir()) == [] and list(tmp.iterdir()) == []
