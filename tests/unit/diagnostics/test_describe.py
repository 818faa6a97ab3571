"""`ambient x describe pod|service` over tests/data/analyze-seeded.yaml: identity, capture, the
policies the node proxy applies and why, the waypoint binding and the endpoints."""

from __future__ import annotations

import pytest

from ambient_mesh.cli import main
from ambient_mesh.diagnostics.describe import describe_pod, describe_service, split_name
from ambient_mesh.diagnostics.mesh_state import proxy_state, translation_of
from ambient_mesh.diagnostics.view import directory_view
from ambient_mesh.errors import AmbientError
from tests.helpers.paths import TESTS_DATA

SEEDED = TESTS_DATA / "analyze-seeded.yaml"


@pytest.fixture(scope="module")
def mesh():
    view = directory_view([str(SEEDED)])
    return view, proxy_state(translation_of(view))


def test_describe_pod(mesh):
    lines = describe_pod(*mesh, "demo", "a")
    text = "\n".join(lines)
    assert lines[0] == "Pod: demo/a"
    assert "Identity: spiffe://cluster.local/ns/demo/sa/default" in text
    assert "Capture: captured in ambient mode (namespace demo's istio.io/dataplane-mode=ambient)" in text
    assert "mTLS: STRICT (from PeerAuthentication demo/one)" in text  # the older of the two wins
    deny, allow = [line.strip() for line in lines if line.strip().startswith(("DENY ", "ALLOW "))]
    assert deny.startswith("DENY istio-system/istio_converted_static_strict: PeerAuthentication demo/one")
    assert allow.startswith("ALLOW demo/l7: AuthorizationPolicy demo/l7; namespace-wide")
    assert "ZtunnelAccepted=True (UnsupportedValue)" in text


def test_describe_service(mesh):
    text = "\n".join(describe_service(*mesh, "demo", "a"))
    assert "VIPs: 10.96.0.8" in text and "demo/a on node-1 10.0.0.5 HBONE (80 -> 80) Healthy" in text
    assert "istio.io/WaypointBound=False (WaypointNotFound)" in text
    assert "Endpoints: none" in "\n".join(describe_service(*mesh, "demo", "ghost"))
    with pytest.raises(AmbientError, match="not found"):
        describe_service(*mesh, "demo", "nope")


def test_names_and_cli(capsys):
    assert split_name("demo/a", "default") == ("demo", "a")
    assert split_name("a.demo", "default") == ("demo", "a")
    assert split_name("a", "x") == ("x", "a")
    assert main(["x", "describe", "pod", "a.demo", "-f", str(SEEDED)]) == 0
    assert capsys.readouterr().out.startswith("Pod: demo/a\n")
