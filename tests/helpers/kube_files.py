"""Kubernetes YAML the kube/ tests write into a directory: one good Pod, one with a field of the
wrong type, and the writer."""

from __future__ import annotations

from pathlib import Path

POD_OK = """
apiVersion: v1
kind: Pod
metadata: {name: ok, namespace: default, labels: {app: ok}}
spec: {nodeName: node-a, serviceAccountName: ok}
status: {phase: Running, podIP: 10.0.0.1, conditions: [{type: Ready, status: "True"}]}
"""

POD_BAD_NODE = """
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: default}
spec: {nodeName: 42}
"""


def write_file(dir_: Path, name: str, text: str) -> Path:
    path = dir_ / name
    path.write_text(text)
    return path
