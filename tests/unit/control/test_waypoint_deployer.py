"""What the control plane deploys for a waypoint Gateway, and the lab's Deployment controller,
as pure plans."""

from __future__ import annotations

from pathlib import Path

import yaml

from ambient_mesh.control.waypoint_deployer import apply_plan, plan, read_current
from ambient_mesh.control.waypoint_render import DeploySettings
from ambient_mesh.kube.load import load_directory
from ambient_mesh.lab.deployments import DEPLOYMENT_LABEL
from ambient_mesh.lab.deployments import plan as plan_pods

GATEWAY = {
    "apiVersion": "gateway.networking.k8s.io/v1",
    "kind": "Gateway",
    "metadata": {"name": "wp", "namespace": "shop", "labels": {"istio.io/waypoint-for": "all"}},
    "spec": {
        "gatewayClassName": "istio-waypoint",
        "listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE"}],
    },
}
OTHER_CLASS = {
    **GATEWAY,
    "metadata": {"name": "ingress", "namespace": "shop"},
    "spec": {"gatewayClassName": "istio"},
}


def _converge(directory: Path) -> list[list[str]]:
    """Run the control plane's deploy step until the directory stops changing (bounded)."""
    rounds = []
    for _ in range(5):
        loaded = load_directory(directory)
        done = apply_plan(directory, plan(loaded.store, read_current(directory), DeploySettings()))
        if not done:
            return rounds
        rounds.append(done)
    raise AssertionError(f"deploying never settled: {rounds}")


def test_a_waypoint_gateway_gets_istiods_objects_and_its_address(tmp_path: Path) -> None:
    (tmp_path / "gateway-shop-wp.yaml").write_text(yaml.safe_dump(GATEWAY))
    (tmp_path / "gateway-shop-ingress.yaml").write_text(yaml.safe_dump(OTHER_CLASS))
    rounds = _converge(tmp_path)
    assert rounds == [
        [
            "wrote deployment-shop-wp.yaml",
            "wrote gateway-shop-wp.yaml",
            "wrote service-shop-wp.yaml",
            "wrote serviceaccount-shop-wp.yaml",
        ]
    ]
    store = load_directory(tmp_path).store
    gw = next(g for g in store.gateways if g.metadata.name == "wp")
    assert [(a.type, a.value) for a in gw.status_addresses] == [("Hostname", "wp.shop.svc.cluster.local")]
    svc = next(s for s in store.services if s.metadata.name == "wp")
    assert sorted(p.port for p in svc.ports) == [15008, 15021]
    assert svc.metadata.labels["gateway.istio.io/managed"] == "istio.io-mesh-controller"
    deployment = yaml.safe_load((tmp_path / "deployment-shop-wp.yaml").read_text())
    template = deployment["spec"]["template"]
    assert template["metadata"]["labels"]["istio.io/dataplane-mode"] == "none"
    assert template["spec"]["serviceAccountName"] == "wp"
    container = template["spec"]["containers"][0]
    assert [*container["command"], *container["args"]][:2] == ["ambient", "waypoint"]
    assert not (tmp_path / "deployment-shop-ingress.yaml").exists()


def test_deleting_the_gateway_removes_what_it_owned_only(tmp_path: Path) -> None:
    (tmp_path / "gateway-shop-wp.yaml").write_text(yaml.safe_dump(GATEWAY))
    mine = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web", "namespace": "shop"},
        "spec": {"ports": [{"port": 80}]},
    }
    (tmp_path / "service-shop-web.yaml").write_text(yaml.safe_dump(mine))
    _converge(tmp_path)
    (tmp_path / "gateway-shop-wp.yaml").unlink()
    assert _converge(tmp_path) == [
        [
            "removed deployment-shop-wp.yaml",
            "removed service-shop-wp.yaml",
            "removed serviceaccount-shop-wp.yaml",
        ]
    ]
    assert sorted(p.name for p in tmp_path.glob("*.yaml")) == ["service-shop-web.yaml"]


def _deployment(name: str, command: list[str]) -> dict:
    return {
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": "shop"},
        "spec": {
            "template": {
                "metadata": {"labels": {"gateway.networking.k8s.io/gateway-name": name}},
                "spec": {
                    "serviceAccountName": name,
                    "containers": [{"name": "istio-proxy", "command": command[:1], "args": command[1:]}],
                },
            }
        },
    }


def test_lab_deployment_controller_runs_waypoints_on_the_least_loaded_node() -> None:
    deployments = [_deployment("wp", ["ambient", "waypoint"]), _deployment("web", ["serve"])]
    p = plan_pods(deployments, {}, ["node-1", "node-2"], {"node-1": 3, "node-2": 1})
    [pod] = p.create
    assert (pod.key, pod.node, pod.app, pod.service_account) == ("shop/wp-0", "node-2", "waypoint", "wp")
    assert pod.labels[DEPLOYMENT_LABEL] == "shop.wp"
    assert p.skipped == ("deployment shop/web: not run (the lab runs waypoint Deployments only)",)
    # Running already: nothing to do; its Deployment gone: its pod goes.
    assert plan_pods(deployments, {"shop/wp-0": "shop.wp"}, ["node-1"], {}).create == ()
    assert plan_pods([], {"shop/wp-0": "shop.wp"}, ["node-1"], {}).delete == ("shop/wp-0",)
    # A pod of that name that the controller did not make is left alone.
    taken = plan_pods(deployments[:1], {}, ["node-1"], {}, frozenset({"shop/wp-0"}))
    assert taken.create == () and "exists" in taken.skipped[0]
