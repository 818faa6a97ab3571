"""control/route_status.py and status.py's `parents[]`: an HTTPRoute's conditions per parent as
istiod's Gateway API controller writes them, where a user looks (the status files `ambient
control` writes beside a directory, `lab apply`'s warnings, `lab get -o yaml`, and the merge
patch the API server would get)."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from pathlib import Path

from ambient_mesh.control.status import (
    GATEWAY_CONTROLLER,
    Condition,
    DirectoryStatusWriter,
    _status_patch,
    compute_status,
    conditions_of_status,
    merge_conditions,
    read_status_dir,
    status_document,
)
from ambient_mesh.kube.load import parse_documents
from ambient_mesh.kube.store import KubeStore
from ambient_mesh.lab import apply as verbs
from tests.helpers.waypoint_manifests import ROUTE_STATUS_MESH

MESH = ROUTE_STATUS_MESH


def route(name: str, parent: str, backend: str, port: int | None = 80) -> str:
    port_field = f", port: {port}" if port else ""
    return f"""
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {{name: {name}, namespace: demo}}
spec:
  parentRefs: [{{group: "", kind: Service, name: {parent}{port_field}}}]
  rules:
  - backendRefs: [{{name: {backend}, port: 80}}]
"""


def conditions(text: str, name: str) -> dict[str, Condition]:
    loaded = parse_documents(MESH + "---" + text, "t.yaml")
    assert not loaded.errors, loaded.errors
    found = compute_status(KubeStore(loaded.objects))[("HTTPRoute", "demo", name)]
    return {c.type: c for c in found}


PARENT = (("group", ""), ("kind", "Service"), ("name", "web"), ("namespace", "demo"), ("port", 80))


def test_an_accepted_route() -> None:
    got = conditions(route("ok", "web", "web"), "ok")
    assert (got["Accepted"].status, got["Accepted"].reason) == (True, "Accepted")
    assert (got["ResolvedRefs"].status, got["ResolvedRefs"].reason) == (True, "ResolvedRefs")
    assert got["Accepted"].parent == PARENT
    (entry,) = status_document(tuple(got.values()))["parents"]
    assert entry["parentRef"] == {
        "group": "",
        "kind": "Service",
        "name": "web",
        "namespace": "demo",
        "port": 80,
    }
    assert entry["controllerName"] == "istio.io/gateway-controller"
    assert [c["type"] for c in entry["conditions"]] == ["Accepted", "ResolvedRefs"]
    assert "conditions" not in status_document(tuple(got.values()))


def test_a_route_to_a_missing_backend() -> None:
    got = conditions(route("lost", "web", "nowhere"), "lost")
    assert got["Accepted"].status
    resolved = got["ResolvedRefs"]
    assert (resolved.status, resolved.reason) == (False, "BackendNotFound")
    assert resolved.message == "backend(nowhere.demo.svc.cluster.local) not found"
    assert resolved.negative


def test_a_route_whose_parent_uses_no_waypoint() -> None:
    got = conditions(route("unbound", "plain", "plain"), "unbound")
    accepted = got["Accepted"]
    assert (accepted.status, accepted.reason) == (False, "NoMatchingParent")
    assert "demo/plain uses no waypoint" in accepted.message and "istio.io/use-waypoint" in accepted.message
    assert got["ResolvedRefs"].status


def test_a_missing_parent_or_port() -> None:
    assert (
        "parent Service demo/ghost not found"
        in conditions(route("g", "ghost", "web"), "g")["Accepted"].message
    )
    wrong_port = conditions(route("p", "web", "web", port=8080), "p")["Accepted"]
    assert (wrong_port.status, wrong_port.reason) == (False, "NoMatchingParent")
    assert "port 8080" in wrong_port.message


def test_directory_status_round_trip_and_transition_times(tmp_path: Path) -> None:
    ours = tuple(conditions(route("ok", "web", "nowhere"), "ok").values())
    writer = DirectoryStatusWriter(tmp_path)
    key = ("HTTPRoute", "demo", "ok")
    asyncio.run(writer.write({key: ours}, datetime(2026, 1, 1, tzinfo=UTC)))
    doc = json.loads((tmp_path / "HTTPRoute.demo.ok.json").read_text())
    assert doc["parents"][0]["controllerName"] == GATEWAY_CONTROLLER
    back = read_status_dir(tmp_path, key)
    assert [(c.type, c.status, c.reason, c.parent) for c in back] == [
        (c.type, c.status, c.reason, c.parent) for c in ours
    ]
    # the backend appears: ResolvedRefs moves, Accepted keeps its transition time
    fixed = tuple(conditions(route("ok", "web", "web"), "ok").values())
    asyncio.run(writer.write({key: fixed}, datetime(2026, 2, 1, tzinfo=UTC)))
    times = {c.type: c.last_transition_time for c in read_status_dir(tmp_path, key)}
    assert times == {"Accepted": "2026-01-01T00:00:00Z", "ResolvedRefs": "2026-02-01T00:00:00Z"}


def test_another_controllers_parents_are_kept() -> None:
    theirs = {
        "parentRef": {"name": "ingress", "kind": "Gateway"},
        "controllerName": "example.com/other",
        "conditions": [{"type": "Accepted", "status": "True", "reason": "Accepted", "message": ""}],
    }
    ours = tuple(conditions(route("ok", "web", "web"), "ok").values())
    existing = conditions_of_status({"parents": [theirs]})
    assert existing == ()
    merged = merge_conditions(existing, ours, datetime(2026, 1, 1, tzinfo=UTC))
    patch = _status_patch("HTTPRoute", {"parents": [theirs]}, merged)
    assert patch["parents"][0] == theirs
    assert patch["parents"][1]["controllerName"] == GATEWAY_CONTROLLER
    assert "conditions" not in patch


def test_lab_apply_warns_and_get_shows_parents(tmp_path: Path) -> None:
    objects = tmp_path / "objects"
    objects.mkdir()
    text = MESH + "---" + route("unbound", "plain", "plain")
    manifests = verbs.check(text, "m.yaml", default_namespace="demo", allow_pods=False)
    verbs.apply(objects, manifests)
    warnings = verbs.apply_warnings(objects, manifests)
    assert any(
        w.startswith(
            "Warning: HTTPRoute demo/unbound: parent Service demo/plain: Accepted=False (NoMatchingParent)"
        )
        for w in warnings
    ), warnings
    status_dir = tmp_path / "status"
    st = compute_status(KubeStore(parse_documents(text, "m").objects))
    asyncio.run(DirectoryStatusWriter(status_dir).write(st, datetime(2026, 1, 1, tzinfo=UTC)))
    (doc,) = verbs.get_documents(objects, "HTTPRoute", "demo", status_dir=status_dir)
    (parent,) = doc["status"]["parents"]
    assert parent["parentRef"]["name"] == "plain"
    assert {c["type"]: c["status"] for c in parent["conditions"]} == {
        "Accepted": "False",
        "ResolvedRefs": "True",
    }


def test_the_debug_status_endpoint_shows_parents() -> None:
    from ambient_mesh.control.debug import status_doc

    loaded = parse_documents(MESH + "---" + route("ok", "web", "web"), "t.yaml")
    entries = {e["name"]: e for e in status_doc(compute_status(KubeStore(loaded.objects)))}
    assert entries["ok"]["conditions"] == []
    assert entries["ok"]["parents"][0]["parentRef"]["name"] == "web"
    assert entries["web"]["conditions"][0]["type"] == "istio.io/WaypointBound"
