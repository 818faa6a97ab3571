"""`ambient waypoint apply|generate|list|status|delete` (waypointctl.py): the Gateway written, the
tables, and the lab target on a lab's state directory without a running lab."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import yaml

from ambient_mesh import cli, waypointctl
from ambient_mesh.control.status import Condition, DirectoryStatusWriter
from ambient_mesh.errors import ConfigError
from ambient_mesh.kube.load import parse_documents
from ambient_mesh.lab.lab import STATE_FILE


def test_the_gateway_is_istioctls_and_the_control_plane_reads_it_as_a_waypoint():
    doc = waypointctl.waypoint_gateway("wp", "shop", "all")
    assert doc["metadata"] == {"name": "wp", "namespace": "shop", "labels": {"istio.io/waypoint-for": "all"}}
    assert doc["spec"] == {
        "gatewayClassName": "istio-waypoint",
        "listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE"}],
    }
    parsed = parse_documents(json.dumps(doc), "gw")
    assert not parsed.errors and not parsed.notes
    (gw,) = parsed.objects
    assert gw.gateway_class_name == "istio-waypoint" and gw.listeners[0].protocol == "HBONE"
    with pytest.raises(ConfigError, match="use one of service, workload, all, none"):
        waypointctl.waypoint_gateway("wp", "shop", "pods")


def test_generate_prints_yaml_and_writes_nothing(capsys):
    assert cli.main(["waypoint", "generate", "-n", "shop", "--for", "workload"]) == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    assert doc["metadata"]["name"] == "waypoint" and doc["metadata"]["namespace"] == "shop"
    assert doc["metadata"]["labels"]["istio.io/waypoint-for"] == "workload"
    out = io.StringIO()
    assert waypointctl.main(["apply", "--name", "x", "-o", "yaml"], out=out) == 0
    assert yaml.safe_load(out.getvalue())["metadata"]["name"] == "x"


def _gateway(name: str, namespace: str, status: str | None) -> dict:
    doc = waypointctl.waypoint_gateway(name, namespace, "service")
    if status is not None:
        doc["status"] = {
            "addresses": [{"type": "Hostname", "value": f"{name}.{namespace}.svc.cluster.local"}],
            "conditions": [{"type": "Programmed", "status": status, "reason": "R", "message": "m"}],
        }
    return doc


def test_list_and_status_tables():
    gws = [_gateway("b", "shop", "True"), _gateway("a", "shop", None), _gateway("c", "ops", "False")]
    table = waypointctl.list_table(gws, all_namespaces=True)
    assert table.headers == ("NAMESPACE", "NAME", "REVISION", "PROGRAMMED", "FOR", "ADDRESS")
    assert table.rows == (
        ("ops", "c", "default", "False", "service", "c.ops.svc.cluster.local"),
        ("shop", "a", "default", "Unknown", "service", "<none>"),
        ("shop", "b", "default", "True", "service", "b.shop.svc.cluster.local"),
    )
    assert waypointctl.list_table(gws[:1], all_namespaces=False).rows == (
        ("b", "default", "True", "service", "b.shop.svc.cluster.local"),
    )
    status = waypointctl.status_table(gws)
    assert status.rows[0] == ("ops", "c", "False", "Programmed", "R", "m")
    assert status.rows[1] == ("shop", "a", "Unknown", "Programmed", "Pending", "no status written yet")


@pytest.fixture
def lab_dir(tmp_path: Path) -> Path:
    """A lab's state directory as `ambient lab up` leaves it, without the lab: lab.json and
    the objects directory (the lab's API server) with the namespace `shop`."""
    objects = tmp_path / "objects"
    objects.mkdir()
    (objects / "namespace-_-shop.yaml").write_text(
        yaml.safe_dump({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}})
    )
    (tmp_path / STATE_FILE).write_text(json.dumps({"objects_dir": str(objects), "state_dir": str(tmp_path)}))
    return tmp_path


def _run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return waypointctl.main(list(argv), out=out), out.getvalue()


def test_lab_apply_enroll_list_status_delete(lab_dir: Path):
    state = ["--lab", "--state-dir", str(lab_dir), "-n", "shop"]
    code, out = _run("apply", *state, "--enroll-namespace")
    assert code == 0
    assert out.splitlines()[0] == "gateway.gateway.networking.k8s.io/waypoint created"
    # nothing deploys it here, so `lab apply`'s warning says it has no address yet
    assert out.splitlines()[1].startswith(
        "Warning: Gateway shop/waypoint: Programmed=False (AddressNotAssigned)"
    )
    assert out.splitlines()[2] == "namespace/shop configured"
    ns = yaml.safe_load((lab_dir / "objects" / "namespace-_-shop.yaml").read_text())
    assert ns["metadata"]["labels"] == {"istio.io/use-waypoint": "waypoint"}
    assert _run("apply", *state)[1].splitlines()[0] == "gateway.gateway.networking.k8s.io/waypoint unchanged"

    code, out = _run("list", *state)
    assert code == 0
    assert out.splitlines() == [
        "NAME      REVISION  PROGRAMMED  FOR      ADDRESS",
        "waypoint  default   Unknown     service  <none>",
    ]
    # the control plane's status subresource in the lab: state_dir/control/status
    import asyncio
    from datetime import UTC, datetime

    writer = DirectoryStatusWriter(lab_dir / "control" / "status")
    cond = Condition(type="Programmed", status=True, reason="Programmed", message="node proxies reach it")
    asyncio.run(writer.write({("Gateway", "shop", "waypoint"): (cond,)}, datetime.now(UTC)))
    assert "waypoint  default   True" in _run("list", *state)[1]
    code, out = _run("status", *state)
    assert out.splitlines()[1].split()[:6] == [
        "shop",
        "waypoint",
        "True",
        "Programmed",
        "Programmed",
        "node",
    ]
    out_wait = io.StringIO()
    assert waypointctl.main(["apply", *state, "--wait", "--timeout", "5"], out=out_wait) == 0
    assert "waypoint shop/waypoint programmed in" in out_wait.getvalue()

    assert _run("delete", *state) == (0, "waypoint shop/waypoint deleted\n")
    assert _run("delete", *state) == (1, "waypoint shop/waypoint not found\n")
    assert _run("list", *state)[1] == "No waypoints found in namespace shop.\n"


def test_wait_gives_up_after_its_timeout(lab_dir: Path):
    with pytest.raises(Exception, match="not programmed after 0.5s"):
        _run("apply", "--lab", "--state-dir", str(lab_dir), "--wait", "--timeout", "0.5")


def test_the_agent_is_still_ambient_waypoint_without_a_verb():
    args = cli.build_parser().parse_args(["waypoint", "--pod-name", "p"])
    assert args.func is cli.cmd_waypoint
