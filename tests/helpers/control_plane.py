"""The embedded control plane and a node proxy on loopback, for end-to-end tests: the YAML a test
writes, the proxy's environment, and waiting on a condition."""

from __future__ import annotations

import asyncio
from pathlib import Path

from ambient_mesh.control.plane import mint_token
from ambient_mesh.ztunnel import Ztunnel
from ambient_mesh.ztunnel import build as build_proxy
from tests.integration.mesh import listener_env

NAMESPACE = """
apiVersion: v1
kind: Namespace
metadata: {name: default, labels: {istio.io/dataplane-mode: ambient}}
"""

PODS = """
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: default, uid: uid-client, labels: {app: client}}
spec: {nodeName: node-a, serviceAccountName: client, containers: [{name: app, image: x}]}
status: {phase: Running, podIP: 127.0.0.2, conditions: [{type: Ready, status: "True"}]}
---
apiVersion: v1
kind: Pod
metadata: {name: server, namespace: default, uid: uid-server, labels: {app: echo}}
spec: {nodeName: node-b, serviceAccountName: server, containers: [{name: app, image: x, ports: [{containerPort: 8080, name: http}]}]}
status: {phase: Running, podIP: 127.0.0.3, conditions: [{type: Ready, status: "True"}]}
"""

SERVICE = """
apiVersion: v1
kind: Service
metadata: {name: echo, namespace: default}
spec: {selector: {app: echo}, clusterIP: 127.10.0.1, ports: [{name: http, port: 80, targetPort: 8080}]}
"""


def write(directory: Path, name: str, text: str) -> None:
    path = directory / name
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def proxy_env(tmp: Path, plane_port: int, name: str, ip: str, **extra: str) -> dict[str, str]:
    token = tmp / f"{name}.token"
    token.write_text(mint_token(tmp / "state", account=("default", name), node=None))
    env = {
        "PROXY_MODE": "dedicated",
        "PROXY_WORKLOAD_INFO": f"default/{name}/{name}",
        "XDS_ADDRESS": f"https://127.0.0.1:{plane_port}",
        "CA_ADDRESS": f"https://127.0.0.1:{plane_port}",
        "XDS_ROOT_CA": str(tmp / "state" / "root-cert.pem"),
        "CA_ROOT_CA": str(tmp / "state" / "root-cert.pem"),
        "AUTH_TOKEN": str(token),
        "POD_NAME": name,
        "POD_NAMESPACE": "default",
        **listener_env(ip),
    }
    env.update(extra)
    return env


async def start_proxy(env: dict[str, str]) -> Ztunnel:
    proxy = await build_proxy(env)
    await proxy.start()
    return proxy


async def wait_for(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout

    async def holds() -> bool:
        value = predicate()
        return bool(await value) if asyncio.iscoroutine(value) else bool(value)

    while not await holds():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what} not reached in {timeout}s")
        await asyncio.sleep(0.05)
