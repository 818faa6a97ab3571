"""Original-source delivery in dedicated mode: the app sees the client's IP, not the proxy's.

Counterpart: ztunnel's transparent inbound (docs/istio-behaviour.md, "Ports": IP_TRANSPARENT on
the inbound listeners and the connection to the app made from the client's address; "Inbound HBONE
(15008)" step 8, "Inbound passthrough (15006)") with the connmark / table 100 return path of the
in-pod rules ("In-pod redirection rules"), here rendered for dedicated mode
by `render_dedicated_rules(transparent=True)` and installed with its policy routes.

Topology (one Fabric):

    node-a   meshed client pod: dedicated-mode capture + `ambient ztunnel` (HBONE out)
    node-b   "transparent" server pod: transparent capture rules + policy routes,
             `ambient ztunnel` with ENABLE_ORIG_SRC=true, echo on 8080
    node-c   "plain" server pod: the same transparent rules, `ambient ztunnel` without
             ENABLE_ORIG_SRC, echo on 8080
    legacy   uncaptured client: no proxy, no capture rules

The echo app logs the peer address of every accepted connection (tests/netns/echo.py); that
address is what these tests assert on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import yaml

from ambient_mesh.capture.dedicated import CONNMARK, ROUTE_TABLE
from ambient_mesh.host.netns import Fabric, Node
from tests.helpers.dedicated_mesh import (
    APP_PORT,
    CLIENT_ID,
    PAYLOAD,
    NodeProxy,
    capture,
    node_proxy_missing,
    start_proxy,
    wait_access_line,
    wait_ready,
    workload,
)

pytestmark = pytest.mark.timeout(240)


@dataclass(slots=True)
class OrigSrcMesh:
    fabric: Fabric
    client: Node
    transparent: Node
    plain: Node
    legacy: Node
    transparent_proxy: NodeProxy
    plain_proxy: NodeProxy
    transparent_app: object
    plain_app: object


@pytest.fixture(scope="module")
def omesh(runner, start_echo, get, poll, tmp_path_factory):
    missing = node_proxy_missing()
    if missing:
        pytest.skip(missing)
    if os.environ.get("ENABLE_ORIG_SRC") is not None:
        pytest.skip("ENABLE_ORIG_SRC is set in the test environment; the 'without' cases need it unset")
    tmp = tmp_path_factory.mktemp("dedicated-orig-src")
    with Fabric(runner=runner) as fabric:
        client = fabric.add_node("node-a")
        transparent = fabric.add_node("node-b")
        plain = fabric.add_node("node-c")
        legacy = fabric.add_node("legacy")
        config = tmp / "local-xds.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "workloads": [
                        workload("client", "shop", "frontend", client, "HBONE"),
                        workload("server", "shop", "echo", transparent, "HBONE"),
                        workload("plain-src", "shop", "echo", plain, "HBONE"),
                        workload("legacy", "legacy", "legacy", legacy, "TCP"),
                    ]
                },
                sort_keys=False,
            )
        )
        transparent_app = start_echo(fabric, transparent, APP_PORT, tmp)
        plain_app = start_echo(fabric, plain, APP_PORT, tmp)
        capture(runner, client)
        for pod in (transparent, plain):
            capture(runner, pod, transparent=True)
        client_proxy = start_proxy(fabric, client, "shop/client/frontend", config, tmp / "proxy-a")
        transparent_proxy = start_proxy(
            fabric,
            transparent,
            "shop/server/echo",
            config,
            tmp / "proxy-b",
            extra_env={"ENABLE_ORIG_SRC": "true"},
        )
        plain_proxy = start_proxy(fabric, plain, "shop/plain-src/echo", config, tmp / "proxy-c")
        for proxy in (client_proxy, transparent_proxy, plain_proxy):
            wait_ready(proxy, get, poll)
        yield OrigSrcMesh(
            fabric=fabric,
            client=client,
            transparent=transparent,
            plain=plain,
            legacy=legacy,
            transparent_proxy=transparent_proxy,
            plain_proxy=plain_proxy,
            transparent_app=transparent_app,
            plain_app=plain_app,
        )


def delivered_from(app, before: int, proxy: NodeProxy) -> list[str]:
    peers = app.peers()[before:]
    assert len(peers) == 1, f"expected exactly one new connection at the app, saw {peers}\n{proxy.tail()}"
    return peers


def test_transparent_pod_has_the_return_path(omesh, runner):
    # Without these, replies to a spoofed source would leave the pod instead of reaching the proxy.
    rules = runner.run(["ip", "-4", "rule", "show"], netns=omesh.transparent.netns).text
    assert f"fwmark {CONNMARK:#x}/0xfff lookup {ROUTE_TABLE}" in rules, rules
    table = runner.run(
        ["ip", "-4", "route", "show", "table", str(ROUTE_TABLE)], netns=omesh.transparent.netns
    ).text
    assert "local default dev lo" in table, table


def test_hbone_delivery_keeps_the_client_ip(omesh, roundtrip, poll):
    proxy, app = omesh.transparent_proxy, omesh.transparent_app
    since, before = proxy.offset(), len(app.peers())
    assert roundtrip(omesh.client.netns, str(omesh.transparent.ipv4), APP_PORT, PAYLOAD) == PAYLOAD
    wait_access_line(proxy, since, poll, direction="inbound", src_identity=CLIENT_ID)
    assert delivered_from(app, before, proxy) == [str(omesh.client.ipv4)], (
        "with ENABLE_ORIG_SRC=true the app must see the client pod's IP, not the server pod's own"
    )


def test_plaintext_delivery_keeps_the_client_ip(omesh, roundtrip, poll):
    proxy, app = omesh.transparent_proxy, omesh.transparent_app
    since, before = proxy.offset(), len(app.peers())
    assert roundtrip(omesh.legacy.netns, str(omesh.transparent.ipv4), APP_PORT, PAYLOAD) == PAYLOAD
    wait_access_line(proxy, since, poll, direction="inbound", src_workload="legacy")
    assert delivered_from(app, before, proxy) == [str(omesh.legacy.ipv4)]


def test_hbone_delivery_without_orig_src_comes_from_the_pod_ip(omesh, roundtrip, poll):
    proxy, app = omesh.plain_proxy, omesh.plain_app
    since, before = proxy.offset(), len(app.peers())
    assert roundtrip(omesh.client.netns, str(omesh.plain.ipv4), APP_PORT, PAYLOAD) == PAYLOAD
    wait_access_line(proxy, since, poll, direction="inbound", src_identity=CLIENT_ID)
    assert delivered_from(app, before, proxy) == [str(omesh.plain.ipv4)]


def test_plaintext_delivery_without_orig_src_comes_from_the_pod_ip(omesh, roundtrip, poll):
    proxy, app = omesh.plain_proxy, omesh.plain_app
    since, before = proxy.offset(), len(app.peers())
    assert roundtrip(omesh.legacy.netns, str(omesh.plain.ipv4), APP_PORT, PAYLOAD) == PAYLOAD
    wait_access_line(proxy, since, poll, direction="inbound", src_workload="legacy")
    assert delivered_from(app, before, proxy) == [str(omesh.plain.ipv4)]
