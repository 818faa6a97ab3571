"""`ambient analyze`: each seeded misconfiguration in tests/data/analyze-seeded.yaml is found,
with Istio's code where Istio has one, and a clean mesh has nothing to say."""

from __future__ import annotations

import json
from pathlib import Path

from ambient_mesh.cli import main
from ambient_mesh.diagnostics.analyze import analyze, render
from ambient_mesh.diagnostics.view import directory_view
from tests.helpers.paths import TESTS_DATA

SEEDED = TESTS_DATA / "analyze-seeded.yaml"

EXPECTED = {
    ("IST0101", "Namespace legacy"),  # use-waypoint to a Gateway that does not exist
    ("IST0101", "Service a.demo"),
    ("AMB0104", "Namespace legacy"),  # the waypoint label on a namespace outside ambient
    ("AMB0102", "PeerAuthentication two.demo"),  # two namespace-wide PeerAuthentications
    ("AMB0103", "AuthorizationPolicy l7.demo"),  # HTTP fields at the node proxy
    ("IST0127", "AuthorizationPolicy nobody.demo"),  # a selector that selects nothing
    ("IST0171", "Service a.demo"),  # istio.io/WaypointBound=False
    ("AMB0101", "Service ghost.demo"),  # no endpoints
    ("IST0134", "ServiceEntry db.demo"),  # TCP ServiceEntry without addresses
}


def test_every_seeded_misconfiguration_is_found():
    messages = analyze(directory_view([str(SEEDED)]))
    assert {(m.code, m.resource) for m in messages} == EXPECTED
    # errors first, then warnings (istioctl's order)
    levels = [m.level for m in messages]
    assert levels == sorted(levels, key=["Error", "Warning", "Info"].index)
    assert str(messages[0]).startswith("Error [IST0101] (Namespace legacy) Referenced waypoint not found")


def test_namespace_filter_and_a_clean_mesh(tmp_path: Path):
    only = analyze(directory_view([str(SEEDED)]), namespace="legacy")
    assert {m.code for m in only} == {"IST0101", "AMB0104"}
    clean = tmp_path / "clean.yaml"
    clean.write_text(
        SEEDED.read_text().split("---\napiVersion: v1\nkind: Namespace\nmetadata: {name: legacy")[0]
    )
    messages = analyze(directory_view([str(clean)]))
    assert messages == []
    assert render(messages, "x").endswith("No validation issues found when analyzing x.\n")


def test_cli_exit_code_and_json(capsys):
    assert main(["analyze", str(SEEDED), "-o", "json"]) == 1  # errors found
    out = json.loads(capsys.readouterr().out)
    (found,) = [m for m in out if m["code"] == "IST0127"]
    assert (
        found["name"] == "NoMatchingWorkloadsFound" and found["resource"] == "AuthorizationPolicy nobody.demo"
    )


def test_the_diagnostics_look_for_the_lab_where_it_runs():
    from ambient_mesh.diagnostics.commands import DEFAULT_LAB_STATE_DIR
    from ambient_mesh.lab.lab import DEFAULT_STATE_DIR

    assert DEFAULT_LAB_STATE_DIR == DEFAULT_STATE_DIR
