"""AUTHZ_POLICY_INFO_LOGGING: every authorization decision logged at info, naming the policy."""

from __future__ import annotations

import asyncio
import logging

import pytest

from .mesh import ECHO_PORT, SERVER_IP, local_config, running_mesh

ALLOW_CLIENT = """
- name: allow-client
  namespace: default
  scope: Namespace
  action: Allow
  dryRun: false
  rules:
  - - - principals: [{Exact: "cluster.local/ns/default/sa/client"}]
"""


@pytest.mark.parametrize("enabled", [True, False])
async def test_decisions_at_info_only_when_enabled(caplog, enabled: bool):
    caplog.set_level(logging.INFO, logger="ambient_mesh.proxy.rbac")
    env = {"AUTHZ_POLICY_INFO_LOGGING": "true"} if enabled else {}
    async with running_mesh(local_config(policies=ALLOW_CLIENT), server_env=env) as mesh:
        reader, writer = await mesh.socks_connect(SERVER_IP, ECHO_PORT)
        writer.write(b"x")
        assert await asyncio.wait_for(reader.readexactly(1), 10) == b"x"
        writer.close()
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == "ambient_mesh.proxy.rbac" and r.levelno == logging.INFO
    ]
    allowed = [line for line in lines if line.startswith("allowed ")]
    if enabled:
        assert len(allowed) == 1, lines
        assert "spiffe://cluster.local/ns/default/sa/client" in allowed[0] or "client" in allowed[0]
        assert "policy default/allow-client" in allowed[0]
        assert "cluster1//v1/Pod/default/server" in allowed[0]
    else:
        assert allowed == []
