"""STRICT mTLS on a dedicated-mode node proxy: meshed callers get in, plaintext callers do not.

Counterpart: what istiod does for a STRICT PeerAuthentication (docs/istio-behaviour.md, "STRICT mTLS"): it
sends the static policy `istio-system/istio_converted_static_strict` (scope WorkloadSelector, action Deny,
one match `notPrincipals: [Presence]`) and the STRICT workload lists that key. Evaluation
("Authorization"): a connection without an mTLS identity has principal "" so presence fails, the negated
match holds, and the Deny fires. Plaintext arrives through the inbound passthrough
("Inbound passthrough (15006)"), which closes denied connections and records response flag DENY.

Topology (one Fabric):

    node-a   meshed client pod: dedicated-mode capture + `ambient ztunnel` (HBONE out)
    node-b   "strict" server pod: capture + `ambient ztunnel`, echo on 8080, lists the policy
    node-c   "open" server pod: capture + `ambient ztunnel`, echo on 8080, no policy
    legacy   plain client: no proxy, no capture (a TCP workload in the config, so it has a name)
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ambient_mesh.host.netns import Fabric, Node
from ambient_mesh.ports import ADMIN_PORT, STATS_PORT
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
from tests.helpers.malicious_probes import probe

pytestmark = pytest.mark.timeout(240)

STRICT_POLICY = "istio-system/istio_converted_static_strict"
METRICS_TIMEOUT_S = 10.0
DENIED_PAYLOAD = b"plaintext that must never reach the app\n"


@dataclass(slots=True)
class StrictMesh:
    fabric: Fabric
    client: Node
    strict: Node
    open: Node
    legacy: Node
    strict_proxy: NodeProxy
    open_proxy: NodeProxy
    strict_app: object
    open_app: object


def local_config(client: Node, strict: Node, open_: Node, legacy: Node) -> dict:
    strict_workload = workload("server", "shop", "echo", strict, "HBONE")
    strict_workload["authorizationPolicies"] = [STRICT_POLICY]
    namespace, name = STRICT_POLICY.split("/")
    return {
        "workloads": [
            workload("client", "shop", "frontend", client, "HBONE"),
            strict_workload,
            workload("open", "shop", "echo", open_, "HBONE"),
            workload("plain", "legacy", "plain", legacy, "TCP"),
        ],
        "policies": [
            {
                "name": name,
                "namespace": namespace,
                "scope": "WorkloadSelector",
                "action": "Deny",
                "dryRun": False,
                # One rule, one clause, one match: "no mTLS principal at all".
                "rules": [[[{"notPrincipals": [{"Presence": []}]}]]],
            }
        ],
    }


@pytest.fixture(scope="module")
def smesh(runner, start_echo, get, poll, tmp_path_factory):
    missing = node_proxy_missing()
    if missing:
        pytest.skip(missing)
    tmp = tmp_path_factory.mktemp("dedicated-strict")
    with Fabric(runner=runner) as fabric:
        client = fabric.add_node("node-a")
        strict = fabric.add_node("node-b")
        open_ = fabric.add_node("node-c")
        legacy = fabric.add_node("legacy")
        config = tmp / "local-xds.yaml"
        config.write_text(yaml.safe_dump(local_config(client, strict, open_, legacy), sort_keys=False))
        strict_app = start_echo(fabric, strict, APP_PORT, tmp)
        open_app = start_echo(fabric, open_, APP_PORT, tmp)
        for pod in (client, strict, open_):
            capture(runner, pod)
        client_proxy = start_proxy(fabric, client, "shop/client/frontend", config, tmp / "proxy-a")
        strict_proxy = start_proxy(fabric, strict, "shop/server/echo", config, tmp / "proxy-b")
        open_proxy = start_proxy(fabric, open_, "shop/open/echo", config, tmp / "proxy-c")
        for proxy in (client_proxy, strict_proxy, open_proxy):
            wait_ready(proxy, get, poll)
        yield StrictMesh(
            fabric=fabric,
            client=client,
            strict=strict,
            open=open_,
            legacy=legacy,
            strict_proxy=strict_proxy,
            open_proxy=open_proxy,
            strict_app=strict_app,
            open_app=open_app,
        )


def denied_inbound(netns: str, get) -> float:
    """istio_tcp_connections_failed_total{reporter="destination", response_flags="DENY"}, summed."""
    status, body = get(netns, "127.0.0.1", STATS_PORT, "/metrics")
    assert status == 200, f"/metrics answered {status}"
    total = 0.0
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if (
                sample.name == "istio_tcp_connections_failed_total"
                and sample.labels.get("reporter") == "destination"
                and sample.labels.get("response_flags") == "DENY"
            ):
                total += sample.value
    return total


def test_strict_policy_is_loaded_for_the_server(smesh, get):
    status, body = get(smesh.strict.netns, "127.0.0.1", ADMIN_PORT, "/config_dump")
    assert status == 200
    assert b"istio_converted_static_strict" in body, "the STRICT policy is missing from /config_dump"


def test_meshed_client_reaches_the_strict_server_over_hbone(smesh, roundtrip, poll):
    since = smesh.strict_proxy.offset()
    before = len(smesh.strict_app.peers())
    assert roundtrip(smesh.client.netns, str(smesh.strict.ipv4), APP_PORT, PAYLOAD) == PAYLOAD
    line = wait_access_line(smesh.strict_proxy, since, poll, direction="inbound", src_identity=CLIENT_ID)
    assert "error" not in line, f"allowed connection logged an error: {line}"
    assert len(smesh.strict_app.peers()) == before + 1


def test_plaintext_client_is_denied_by_strict(smesh, get, poll):
    since = smesh.strict_proxy.offset()
    peers_before = list(smesh.strict_app.peers())
    denied_before = denied_inbound(smesh.strict.netns, get)

    outcome = probe(smesh.legacy.netns, str(smesh.strict.ipv4), APP_PORT, DENIED_PAYLOAD, half_close=True)

    # Captured on 15006, authorized with no identity, closed without a byte (a reset or a FIN).
    assert outcome.connected and outcome.closed_by_peer and outcome.data == b"", (
        f"plaintext call to the STRICT server: {outcome}\nproxy log:\n{smesh.strict_proxy.tail()}"
    )
    line = wait_access_line(smesh.strict_proxy, since, poll, direction="inbound", src_workload="plain")
    assert line["src.addr"].startswith(f"{smesh.legacy.ipv4}:"), line
    assert line["dst.addr"] == f"{smesh.strict.ipv4}:{APP_PORT}", line
    assert "src.identity" not in line, f"a plaintext caller has no identity: {line}"
    error = line.get("error", "")
    assert "denied" in error and STRICT_POLICY in error, f"access log does not give the DENY reason: {line}"
    assert smesh.strict_app.peers() == peers_before, "the denied connection reached the app"

    def counted():
        value = denied_inbound(smesh.strict.netns, get)
        return value if value > denied_before else None

    denied_after = poll(
        counted,
        timeout_s=METRICS_TIMEOUT_S,
        what='istio_tcp_connections_failed_total{response_flags="DENY",reporter="destination"}',
    )
    assert denied_after == denied_before + 1


def test_plaintext_client_is_allowed_without_strict(smesh, roundtrip, poll):
    """Inbound plaintext passthrough to a workload without the policy.

    Recorded behaviour: with ENABLE_ORIG_SRC unset the proxy does not keep the client's source
    address, so the app sees the connection coming from its own pod IP (the proxy's socket),
    not from the plain client. test_dedicated_orig_src.py covers ENABLE_ORIG_SRC=true.
    """
    since = smesh.open_proxy.offset()
    before = len(smesh.open_app.peers())
    assert roundtrip(smesh.legacy.netns, str(smesh.open.ipv4), APP_PORT, PAYLOAD) == PAYLOAD
    line = wait_access_line(smesh.open_proxy, since, poll, direction="inbound", src_workload="plain")
    assert "error" not in line, f"allowed connection logged an error: {line}"
    assert line["src.addr"].startswith(f"{smesh.legacy.ipv4}:"), line
    assert line["bytes_recv"] == str(len(PAYLOAD)) and line["bytes_sent"] == str(len(PAYLOAD)), line
    assert smesh.open_app.peers()[before:] == [str(smesh.open.ipv4)]
