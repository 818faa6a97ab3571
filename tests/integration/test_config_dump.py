"""A real node proxy's admin `/config_dump`, and `ambient ztunnel-config` reading it.

One proxy in dedicated mode on 127.0.0.40 (an address no other test uses), every listener on
port 0, state from LOCAL_XDS_PATH so that `staticConfig` is re-read from the file.
"""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import pytest

from ambient_mesh.errors import AmbientError
from ambient_mesh.ztunnel import build
from ambient_mesh.ztunnel_config import fetch_config_dump, run

IP = "127.0.0.40"

LOCAL = f"""
workloads:
- uid: cluster1//v1/Pod/dump/app-0
  name: app-0
  namespace: dump
  serviceAccount: app
  trustDomain: cluster.local
  workloadIps: ["{IP}"]
  protocol: HBONE
  node: node-dump
  waypoint: {{destination: "/10.96.40.9"}}
  services:
    "dump/app.dump.svc.cluster.local": {{80: 8080}}
- uid: cluster1//v1/Pod/dump/waypoint-0
  name: waypoint-0
  namespace: dump
  serviceAccount: waypoint
  trustDomain: cluster.local
  workloadIps: ["127.0.0.41"]
  protocol: HBONE
  node: node-other
services:
- name: app
  namespace: dump
  hostname: app.dump.svc.cluster.local
  vips: ["/10.96.40.1"]
  ports: {{80: 8080}}
- name: waypoint
  namespace: dump
  hostname: waypoint.dump.svc.cluster.local
  vips: ["/10.96.40.9"]
  ports: {{15008: 15008}}
policies:
- name: deny-debug
  namespace: dump
  scope: Namespace
  action: Deny
  dryRun: false
  rules:
  - - - destinationPorts: [9999]
"""


def env(path: Path) -> dict[str, str]:
    return {
        "PROXY_MODE": "dedicated",
        "PROXY_WORKLOAD_INFO": "dump/app-0/app",
        "FAKE_CA": "true",
        "XDS_ADDRESS": "",
        "LOCAL_XDS_PATH": str(path),
        "OUTBOUND_ADDR": f"{IP}:0",
        "INBOUND_ADDR": f"{IP}:0",
        "INBOUND_PLAINTEXT_ADDR": f"{IP}:0",
        "ADMIN_ADDR": f"{IP}:0",
        "STATS_ADDR": f"{IP}:0",
        "READINESS_ADDR": f"{IP}:0",
        "SOCKS5_ADDR": f"{IP}:0",
        "ISTIO_META_DNS_PROXY_ADDR": f"{IP}:0",
        "TERMINATION_GRACE_PERIOD_SECONDS": "1",
    }


async def wait_available(proxy, timeout_s: float = 10.0) -> None:
    """The served identity's certificate is fetched in the background after start."""
    async with asyncio.timeout(timeout_s):
        while not any(c.state == "Available" for c in proxy.cert_manager.certificates()):
            await asyncio.sleep(0.02)


async def test_config_dump_from_a_running_proxy(tmp_path: Path) -> None:
    path = tmp_path / "local.yaml"
    path.write_text(LOCAL)
    proxy = await build(env(path))
    try:
        await proxy.start()
        await wait_available(proxy)
        admin = str(proxy.admin.bound_address)
        dump = await asyncio.to_thread(fetch_config_dump, admin)

        assert list(dump)[:5] == ["workloads", "services", "policies", "stagedServices", "staticConfig"]
        assert [w["uid"] for w in dump["workloads"]] == [
            "cluster1//v1/Pod/dump/app-0",
            "cluster1//v1/Pod/dump/waypoint-0",
        ]
        app = dump["workloads"][0]
        assert app["waypoint"] == {"destination": "/10.96.40.9", "hboneMtlsPort": 15008}
        assert app["services"] == ["dump/app.dump.svc.cluster.local"]
        service = next(s for s in dump["services"] if s["name"] == "app")
        assert service["endpoints"] == {
            "cluster1//v1/Pod/dump/app-0": {
                "workloadUid": "cluster1//v1/Pod/dump/app-0",
                "port": {"80": 8080},
                "status": "Healthy",
            }
        }
        assert dump["policies"]["dump/deny-debug"]["rules"] == [[[{"destinationPorts": [9999]}]]]
        assert dump["stagedServices"] == {}
        assert dump["staticConfig"]["workloads"][0]["services"] == {
            "dump/app.dump.svc.cluster.local": {"80": 8080}
        }
        assert dump["version"]["version"]
        assert dump["config"]["proxyMode"] == "dedicated"
        [cert] = dump["certificates"]
        assert cert["identity"] == "spiffe://cluster.local/ns/dump/sa/app"
        assert cert["state"] == "Available"
        assert cert["certChain"][0]["serialNumber"].isdigit() and cert["rootCerts"]
        state = dump["workloadState"]["cluster1//v1/Pod/dump/app-0"]
        assert state["state"] == "Up"
        assert state["info"] == {"name": "app-0", "namespace": "dump", "serviceAccount": "app"}
        assert state["connections"] == {"inbound": [], "outbound": []}

        out = io.StringIO()
        await asyncio.to_thread(lambda: run("all", admin=admin, out=out))
        text = out.getvalue()
        assert "app-0" in text and "node-dump" in text and "deny-debug" in text
        assert "spiffe://cluster.local/ns/dump/sa/app" in text
        rows = [line.split() for line in text.splitlines()]
        assert ["dump", "app-0", IP, "node-dump", "waypoint", "HBONE"] in rows
        assert ["dump", "app", "10.96.40.1", "None", "1/1"] in rows
    finally:
        await proxy.drain(0.2)


async def test_cli_error_once_the_proxy_is_gone(tmp_path: Path) -> None:
    path = tmp_path / "local.yaml"
    path.write_text(LOCAL)
    proxy = await build(env(path))
    await proxy.start()
    admin = str(proxy.admin.bound_address)
    await proxy.drain(0.2)
    with pytest.raises(AmbientError, match="is the node proxy running"):
        await asyncio.to_thread(fetch_config_dump, admin, timeout_s=2)
