"""Tier 2: authorization enforced by the destination proxy, and the metrics both proxies report."""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import UTC, datetime

import pytest

from ambient_mesh.identity.ca import CertificateAuthority
from ambient_mesh.identity.spiffe import Identity
from ambient_mesh.proxy.hbone import HboneConnection
from ambient_mesh.rbac import Action, Authorization, Clause, Match, Rule, Scope, StringMatch
from tests.helpers.proxy_metrics import samples
from tests.helpers.state_writes import upsert
from tests.helpers.tls_stdlib import stdlib_client_context as client_context

from .mesh import ECHO_PORT, SERVER_IP, local_config, running_mesh

CLIENT_PRINCIPAL = "spiffe://cluster.local/ns/default/sa/client"
SERVER_PRINCIPAL = "spiffe://cluster.local/ns/default/sa/server"

ONLY_SOMEONE_ELSE = """
- name: only-someone-else
  namespace: default
  scope: Namespace
  action: Allow
  dryRun: false
  rules:
  - - - principals: [{Exact: "cluster.local/ns/default/sa/someone-else"}]
"""


def connection_labels(reporter: str, *, flag: str = "-", service: bool = False) -> dict:
    labels = {
        "reporter": reporter,
        "source_workload": "client",
        "source_canonical_service": "client",
        "source_canonical_revision": "v1",
        "source_workload_namespace": "default",
        "source_principal": CLIENT_PRINCIPAL,
        "source_app": "client",
        "source_version": "v1",
        "source_cluster": "unknown",
        "destination_service": "echo.default.svc.cluster.local" if service else "unknown",
        "destination_service_namespace": "default" if service else "unknown",
        "destination_service_name": "echo" if service else "unknown",
        "destination_workload": "server",
        "destination_canonical_service": "server",
        "destination_canonical_revision": "v1",
        "destination_workload_namespace": "default",
        "destination_principal": SERVER_PRINCIPAL,
        "destination_app": "server",
        "destination_version": "v1",
        "destination_cluster": "unknown",
        "request_protocol": "tcp",
        "response_flags": flag,
        "connection_security_policy": "mutual_tls",
        "source_region": "unknown",
        "source_zone": "unknown",
        "destination_region": "unknown",
        "destination_zone": "unknown",
    }
    return labels


async def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


async def test_metrics_on_both_reporters_have_exact_labels_and_bytes():
    async with running_mesh() as mesh:
        reader, writer = await mesh.socks_connect(SERVER_IP, ECHO_PORT)
        writer.write(b"0123456789")
        assert await reader.readexactly(10) == b"0123456789"
        # bytes are counted while the connection is live
        received = samples(mesh.client, "istio_tcp_received_bytes_total")
        assert received == [(connection_labels("source"), 10.0)]
        writer.write(b"abcde")
        await reader.readexactly(5)
        writer.write_eof()
        assert await reader.read() == b""
        writer.close()
        await wait_for(lambda: samples(mesh.server, "istio_tcp_connections_closed_total"))
        await wait_for(lambda: samples(mesh.client, "istio_tcp_connections_closed_total"))
        for proxy, reporter in ((mesh.client, "source"), (mesh.server, "destination")):
            expected = connection_labels(reporter, service=reporter == "destination")
            assert samples(proxy, "istio_tcp_connections_opened_total") == [(expected, 1.0)]
            assert samples(proxy, "istio_tcp_connections_closed_total") == [(expected, 1.0)]
            assert samples(proxy, "istio_tcp_received_bytes_total") == [(expected, 15.0)]
            assert samples(proxy, "istio_tcp_sent_bytes_total") == [(expected, 15.0)]
            assert samples(proxy, "istio_tcp_connections_failed_total") == []
            assert ({"reporter": reporter}, 0.0) in samples(proxy, "istio_tcp_sockets_open")


async def test_failed_connect_is_counted_with_connect_flag():
    async with running_mesh(echo=False) as mesh:
        # Nothing listens on 8080: the server proxy answers 503, so SOCKS5 replies a failure
        # (REP 1) instead of "succeeded" (the reply waits for the upstream).
        with pytest.raises(ConnectionRefusedError, match="SOCKS5 reply 1"):
            await mesh.socks_connect(SERVER_IP, ECHO_PORT)
        await wait_for(lambda: samples(mesh.server, "istio_tcp_connections_failed_total"))
        failed = samples(mesh.server, "istio_tcp_connections_failed_total")
        assert [labels["response_flags"] for labels, _ in failed] == ["CONNECT"]
        assert failed[0][0]["source_principal"] == CLIENT_PRINCIPAL
        client_failed = samples(mesh.client, "istio_tcp_connections_failed_total")
        assert [labels["response_flags"] for labels, _ in client_failed] == ["CONNECT"]


async def test_denied_by_policy_gets_401_and_deny_flag():
    config = local_config(policies=ONLY_SOMEONE_ELSE)
    async with running_mesh(config) as mesh:
        ca = CertificateAuthority.insecure_test_ca()
        cert = ca.issue(Identity("cluster.local", "default", "client"), 3600, now=datetime.now(UTC))
        loop = asyncio.get_running_loop()
        _t, conn = await loop.create_connection(
            lambda: HboneConnection(client_side=True),
            SERVER_IP,
            15008,
            ssl=client_context(cert),
            server_hostname="",
        )
        _stream, response = await asyncio.wait_for(conn.open_stream(f"{SERVER_IP}:{ECHO_PORT}", []), 10)
        assert response.status == 401
        failed = samples(mesh.server, "istio_tcp_connections_failed_total")
        assert [(labels["response_flags"], labels["source_principal"]) for labels, _ in failed] == [
            ("DENY", CLIENT_PRINCIPAL)
        ]
        # through the client proxy the connection is refused too, and the client sees it fail:
        # SOCKS5 REP 2, "not allowed by ruleset"
        with pytest.raises(ConnectionRefusedError, match="SOCKS5 reply 2"):
            await mesh.socks_connect(SERVER_IP, ECHO_PORT)
        await wait_for(lambda: samples(mesh.client, "istio_tcp_connections_failed_total"))
        assert [
            labels["response_flags"]
            for labels, _ in samples(mesh.client, "istio_tcp_connections_failed_total")
        ] == ["DENY"]


def deny_client(name: str, scope: Scope) -> Authorization:
    match = Match(principals=(StringMatch.exact("cluster.local/ns/default/sa/client"),))
    return Authorization(
        name=name,
        namespace="default",
        scope=scope,
        action=Action.DENY,
        rules=(Rule(clauses=(Clause(matches=(match,)),)),),
    )


async def open_echo(mesh):
    reader, writer = await mesh.socks_connect(SERVER_IP, ECHO_PORT)
    writer.write(b"ping")
    assert await reader.readexactly(4) == b"ping"
    return reader, writer


async def assert_cut(reader, writer) -> None:
    try:
        assert await asyncio.wait_for(reader.read(), 10) == b""
    except ConnectionResetError:
        pass
    writer.close()


async def test_live_connection_is_cut_when_a_deny_lands():
    async with running_mesh() as mesh:
        reader, writer = await open_echo(mesh)
        upsert(mesh.server.state, deny_client("deny-client", Scope.NAMESPACE))
        await assert_cut(reader, writer)
        await wait_for(lambda: samples(mesh.server, "istio_tcp_connections_closed_total"))
        closed = samples(mesh.server, "istio_tcp_connections_closed_total")
        assert [labels["response_flags"] for labels, _ in closed] == ["DENY"]
        assert mesh.server.pi.connection_manager.closed_by_policy == 1


async def test_live_connection_is_cut_when_its_workload_gains_a_selector_policy():
    async with running_mesh() as mesh:
        state = mesh.server.state
        upsert(state, deny_client("deny-selected", Scope.WORKLOAD_SELECTOR))
        reader, writer = await open_echo(mesh)  # the policy selects no workload yet: allowed
        server = state.workloads.find_uid("cluster1//v1/Pod/default/server")
        upsert(state, dataclasses.replace(server, authorization_policies=("default/deny-selected",)))
        await assert_cut(reader, writer)
        assert mesh.server.pi.connection_manager.closed_by_policy == 1
