"""The client proxy keeps a directly addressed workload's route for the state version
(proxy/outbound.py `OutboundProxy._plan`): a state change reaches the very next connection."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from ambient_mesh.net import ip_address
from tests.helpers.state_writes import upsert

from .mesh import ECHO_PORT, SERVER_IP, running_mesh

STEP_TIMEOUT_S = 15.0


async def test_a_state_change_reaches_the_next_connections_route():
    async with running_mesh() as mesh:
        state = mesh.client.state
        server = state.workloads.find_address("", ip_address(SERVER_IP))
        assert server is not None
        await mesh.echo_once()
        await mesh.echo_once()  # the kept route, on the pooled HBONE connection
        pool = mesh.client.pi.pool
        assert pool is not None and pool.connections_opened == 1
        # The server's workload now has another service account: the client must expect that
        # identity, so the server's certificate (still `server`'s) is refused. A route kept
        # past the change would have gone over the pooled connection and succeeded.
        upsert(state, dataclasses.replace(server, service_account="someone-else"))
        with pytest.raises(ConnectionRefusedError):
            async with asyncio.timeout(STEP_TIMEOUT_S):
                await mesh.socks_connect(SERVER_IP, ECHO_PORT)
        upsert(state, server)  # back as it was: the pooled connection is the one again
        await mesh.echo_once()
        assert pool.connections_opened == 1  # back on the pooled connection (a refused one is not counted)
