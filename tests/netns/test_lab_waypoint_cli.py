"""`ambient waypoint apply|list|status|delete --lab` on a running lab: the Gateway reaches the lab's
API server and its control plane, which deploys it (ServiceAccount, Deployment, Service) and
writes its address and its `Programmed` condition; the namespace is enrolled; `ambient lab get gtw
-o yaml` shows both; delete removes it, and the lab's controller its pod.

Topology: one node, demo/client and demo/server (namespace demo in ambient mode)."""

from __future__ import annotations

import io

import pytest
import yaml

from ambient_mesh.lab.cli import main as lab_main
from ambient_mesh.lab.cluster import parse_pod_spec
from ambient_mesh.lab.lab import Lab, LabConfig, wait_until
from ambient_mesh.waypointctl import main as waypoint_main

pytestmark = pytest.mark.timeout(180)


def run(main, *argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out=out), out.getvalue()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    config = LabConfig(
        state_dir=tmp_path_factory.mktemp("lab-wpcli"),
        nodes=("node-1",),
        pods=tuple(parse_pod_spec(p) for p in ("node-1:demo/client@client", "node-1:demo/server@server")),
        ambient_namespaces=frozenset({"demo"}),
        cluster_dns=False,
    )
    with Lab(config) as running:
        yield running


def test_apply_list_status_delete_on_a_running_lab(lab):
    state = ["--lab", "--state-dir", str(lab.state_dir), "-n", "demo"]
    code, out = run(waypoint_main, "apply", *state, "--name", "wp", "--for", "all", "--enroll-namespace")
    assert code == 0, out
    assert "gateway.gateway.networking.k8s.io/wp created" in out.splitlines()
    assert "namespace/demo configured" in out.splitlines()

    def programmed_gateway():
        lab.supervise()  # the lab's Deployment controller and kubelet run the waypoint's pod
        code, text = run(
            lab_main, "--state-dir", str(lab.state_dir), "get", "gtw", "-n", "demo", "-o", "yaml"
        )
        items = yaml.safe_load(text)["items"] if code == 0 else []
        conditions = (items[0].get("status") or {}).get("conditions", []) if items else []
        return (
            items[0] if any(c["type"] == "Programmed" and c["status"] == "True" for c in conditions) else None
        )

    # the control plane deployed it, wrote its address and its condition
    gw = wait_until(programmed_gateway, timeout_s=60, what="demo/wp deployed and Programmed")
    assert gw["metadata"]["labels"] == {"istio.io/waypoint-for": "all"}
    (cond,) = gw["status"]["conditions"]
    assert (cond["type"], cond["status"], cond["reason"]) == ("Programmed", "True", "Programmed")
    assert "demo/wp-0" in lab.pods
    _, text = run(lab_main, "--state-dir", str(lab.state_dir), "get", "ns", "-o", "yaml")
    (ns,) = [n for n in yaml.safe_load(text)["items"] if n["metadata"]["name"] == "demo"]
    assert ns["metadata"]["labels"]["istio.io/use-waypoint"] == "wp"

    code, out = run(waypoint_main, "list", *state)
    assert out.splitlines() == [
        "NAME  REVISION  PROGRAMMED  FOR  ADDRESS",
        "wp    default   True        all  wp.demo.svc.cluster.local",
    ]
    code, out = run(waypoint_main, "status", *state)
    assert out.splitlines()[1].split()[:5] == ["demo", "wp", "True", "Programmed", "Programmed"]
    print("\n" + out)

    assert run(waypoint_main, "delete", *state, "wp") == (0, "waypoint demo/wp deleted\n")
    code, text = run(lab_main, "--state-dir", str(lab.state_dir), "get", "gtw", "-n", "demo")
    assert text == "No resources found in demo namespace.\n"

    def pod_gone():
        lab.supervise()
        return "demo/wp-0" not in lab.pods

    wait_until(pod_gone, timeout_s=60, what="the waypoint's pod removed with its Gateway")
