"""`ambient explain` over tests/data/explain-*.yaml: an allowed, a denied (naming the rule), an
uncaptured, a waypoint-routed and a refused connection; each answer's decision is the node
proxy's own (`PolicyIndex.check`) and its route `build_request`'s."""

from __future__ import annotations

import json

import pytest

from ambient_mesh.cli import main
from ambient_mesh.diagnostics.explain import explain
from ambient_mesh.diagnostics.mesh_state import proxy_state, translation_of
from ambient_mesh.diagnostics.view import directory_view
from ambient_mesh.errors import AmbientError
from ambient_mesh.proxy.routing import RouteKind
from tests.helpers.paths import TESTS_DATA

DATA = TESTS_DATA
MESH = str(DATA / "explain-mesh.yaml")
WAYPOINT = str(DATA / "explain-waypoint.yaml")


@pytest.fixture(scope="module")
def mesh():
    view = directory_view([MESH, WAYPOINT])
    return view, proxy_state(translation_of(view))


def test_allowed_names_the_allow_rule(mesh):
    answer = explain(*mesh, "demo/client", "server.demo")
    assert (answer.verdict, answer.policy, answer.rule) == ("ALLOWED", "demo/only-client", 1)
    assert answer.route is RouteKind.DIRECT_HBONE
    assert [h.step for h in answer.hops] == ["capture", "outbound", "mtls", "authorization"]
    text = "\n".join(answer.lines())
    assert "rules[1]: MATCH, holds: principals=[exact:cluster.local/ns/demo/sa/client]" in text
    assert "CONNECT 10.0.2.5:8080" in text  # the service port 80 became the target port


def test_denied_names_the_deny_rule(mesh):
    answer = explain(*mesh, "demo/other", "server.demo")
    assert (answer.verdict, answer.policy, answer.rule) == ("DENIED", "demo/no-other", 0)
    assert answer.reason == "denied by AuthorizationPolicy demo/no-other rules[0]"
    # by address works the same
    assert explain(*mesh, "10.0.1.6", "10.96.0.10:80").policy == "demo/no-other"


def test_uncaptured_source_has_no_identity(mesh):
    answer = explain(*mesh, "legacy/plain", "demo/server:8080")
    assert answer.hops[0].decision.startswith("not captured")
    assert answer.hops[1].step == "delivery"
    assert answer.verdict == "DENIED" and answer.policy is None
    assert "peer identity: none (plaintext)" in answer.hops[2].decision


def test_waypoint_hop_and_the_waypoints_identity(mesh):
    answer = explain(*mesh, "demo/client", "api.demo")
    assert answer.route is RouteKind.WAYPOINT and answer.waypoint == "demo/waypoint-0"
    assert [h.step for h in answer.hops] == ["capture", "outbound", "waypoint", "mtls", "authorization"]
    assert "peer identity: cluster.local/ns/demo/sa/waypoint" in answer.hops[3].decision
    assert answer.verdict == "DENIED"  # only-client does not allow the waypoint's identity


def test_to_an_uncaptured_destination_and_errors(mesh):
    answer = explain(*mesh, "demo/client", "legacy/plain:8080")
    assert answer.route is RouteKind.DIRECT_TCP and answer.verdict == "ALLOWED"
    with pytest.raises(AmbientError, match="give a port"):
        explain(*mesh, "demo/client", "10.0.2.5")
    with pytest.raises(AmbientError, match="no such pod"):
        explain(*mesh, "demo/nobody", "server.demo")


def test_cli_json(capsys):
    assert main(["explain", "demo/other", "server.demo", "-f", MESH, "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "DENIED" and doc["policy"] == "demo/no-other" and doc["rule"] == 0


def test_a_saved_config_dump_gives_the_same_answers(mesh, tmp_path, capsys):
    from ambient_mesh.state.dump import dump_policies, dump_services, dump_workloads

    view, state = mesh
    dump = {
        "workloads": dump_workloads(state),
        "services": dump_services(state),
        "policies": dump_policies(state),
    }
    path = tmp_path / "dump.json"
    path.write_text(json.dumps(dump))
    for source, destination in (
        ("demo/client", "server.demo"),
        ("demo/other", "server.demo"),
        ("demo/client", "api.demo"),
        ("legacy/plain", "demo/server:8080"),
    ):
        assert main(["explain", source, destination, "--dump", str(path), "-o", "json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        expected = explain(*mesh, source, destination)
        assert (doc["verdict"], doc["policy"]) == (expected.verdict, expected.policy)
        if expected.policy == "demo/only-client":
            # no AuthorizationPolicy in a dump: rules are numbered as the node proxy holds them,
            # after the ALLOW rule with HTTP fields (spec.rules[0]) was dropped
            assert (expected.rule, doc["rule"]) == (1, 0)
        else:
            assert doc["rule"] == expected.rule
        assert [h["step"] for h in doc["hops"]] == [h.step for h in expected.hops]
