"""What the CNI plugin tests share: a pod directory and a run of the plugin as the runtime runs
it (the installed entry, plugin_handoff, in a subprocess with stdin and CNI_* variables)."""

from __future__ import annotations

import asyncio
import sys

PLUGIN_TIMEOUT_S = 60.0

POD_YAML = """\
apiVersion: v1
kind: Namespace
metadata: {name: apps, labels: {istio.io/dataplane-mode: ambient}}
---
apiVersion: v1
kind: Namespace
metadata: {name: plain}
---
apiVersion: v1
kind: Pod
metadata: {name: web-0, namespace: apps}
spec: {containers: [{name: app}]}
---
apiVersion: v1
kind: Pod
metadata: {name: db-0, namespace: plain}
spec: {containers: [{name: app}]}
"""


async def run_plugin(environ: dict[str, str], data: bytes) -> tuple[int, bytes, bytes]:
    """Exit code, stdout and stderr of one run of `python -I -m ambient_mesh.cni.plugin_handoff`."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-I",
        "-m",
        "ambient_mesh.cni.plugin_handoff",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=environ,
    )
    out, err = await asyncio.wait_for(proc.communicate(data), timeout=PLUGIN_TIMEOUT_S)
    assert proc.returncode is not None
    return proc.returncode, out, err
