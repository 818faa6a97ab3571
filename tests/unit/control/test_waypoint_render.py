"""The one renderer of a waypoint Gateway's objects (control/waypoint_render.py), and that both
deployers, the API server's (waypoint_kube.py) and the lab directory's (waypoint_deployer.py),
write exactly what it renders.

The rendered objects are compared with tests/unit/golden/waypoint_render/waypoint.yaml;
`UPDATE_GOLDEN=1` rewrites it (read the diff before committing it)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml
from hypothesis import given
from hypothesis import strategies as st

from ambient_mesh.control.waypoint_deployer import apply_plan, plan, read_current
from ambient_mesh.control.waypoint_kube import kube_objects
from ambient_mesh.control.waypoint_render import (
    RENDERED_KINDS,
    DeploySettings,
    runs_waypoint,
    status_patch,
    waypoint_objects,
)
from ambient_mesh.kube.load import load_directory, parse_documents
from ambient_mesh.kube.model import Gateway, GatewayAddress, ObjectMeta
from ambient_mesh.lab.deployments import plan as plan_pods

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "waypoint_render" / "waypoint.yaml"
UPDATE_GOLDEN = os.environ.get("UPDATE_GOLDEN") == "1"
SETTINGS = DeploySettings(image="localhost/ambient-mesh:abc", istiod_ip="10.96.0.9")


def gateway(name="waypoint", ns="shop", uid="u-1", addresses=()) -> Gateway:
    return Gateway(
        metadata=ObjectMeta(name=name, namespace=ns, uid=uid),
        gateway_class_name="istio-waypoint",
        status_addresses=tuple(GatewayAddress(type=t, value=v) for t, v in addresses),
    )


def test_the_rendered_objects_match_the_golden_file():
    text = yaml.safe_dump_all(waypoint_objects(gateway(), SETTINGS), sort_keys=False)
    if UPDATE_GOLDEN:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(text)
    assert GOLDEN.exists(), f"golden file {GOLDEN} missing: run with UPDATE_GOLDEN=1 to create it"
    assert text == GOLDEN.read_text(), f"rendered objects differ from {GOLDEN} (UPDATE_GOLDEN=1 regenerates)"


def test_istiods_objects_owned_by_the_gateway_and_never_captured():
    objs = {body["kind"]: body for body in waypoint_objects(gateway(), SETTINGS)}
    assert tuple(objs) == RENDERED_KINDS
    owner = {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "Gateway",
        "name": "waypoint",
        "uid": "u-1",
    }
    for body in objs.values():
        meta = body["metadata"]
        assert (meta["name"], meta["namespace"], meta["ownerReferences"]) == ("waypoint", "shop", [owner])
        assert meta["labels"] == {
            "gateway.networking.k8s.io/gateway-name": "waypoint",
            "gateway.networking.k8s.io/gateway-class-name": "istio-waypoint",
            "gateway.istio.io/managed": "istio.io-mesh-controller",
        }
    template = objs["Deployment"]["spec"]["template"]
    assert template["metadata"]["labels"]["istio.io/dataplane-mode"] == "none"
    pod = template["spec"]
    assert pod["serviceAccountName"] == "waypoint"
    assert pod["hostAliases"] == [{"ip": "10.96.0.9", "hostnames": ["istiod.istio-system.svc"]}]
    (container,) = pod["containers"]
    assert container["command"] == ["ambient"] and container["args"][0] == "waypoint"
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["XDS_ADDRESS"] == env["CA_ADDR"] == "https://istiod.istio-system.svc:15012"
    assert env["GATEWAY_NAME"] == "waypoint"
    token = next(v for v in pod["volumes"] if v["name"] == "istio-token")
    assert token["projected"]["sources"][0]["serviceAccountToken"]["audience"] == "istio-ca"
    ports = {(p["name"], p["port"], p["appProtocol"]) for p in objs["Service"]["spec"]["ports"]}
    assert ports == {("status-port", 15021, "tcp"), ("mesh", 15008, "all")}
    assert objs["Service"]["metadata"]["annotations"] == {
        "networking.istio.io/traffic-distribution": "PreferClose"
    }
    # the control plane reads every one of them without complaint
    parsed = parse_documents(
        json.dumps({"kind": "List", "apiVersion": "v1", "items": list(objs.values())}), "x"
    )
    assert not parsed.errors


def test_a_gateway_without_a_uid_is_owned_by_name_and_no_istiod_address_without_one():
    objs = waypoint_objects(gateway(uid=""), DeploySettings())
    assert objs[0]["metadata"]["ownerReferences"] == [
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway", "name": "waypoint"}
    ]
    pod = objs[1]["spec"]["template"]["spec"]
    assert "hostAliases" not in pod and pod["containers"][0]["image"] == "ambient-mesh"


def test_each_object_has_metadata_of_its_own():
    account, deployment, _ = waypoint_objects(gateway(), SETTINGS)
    account["metadata"]["labels"]["x"] = "y"
    assert "x" not in deployment["metadata"]["labels"]


def test_status_addresses_the_service_hostname_once():
    want = {"status": {"addresses": [{"type": "Hostname", "value": "waypoint.shop.svc.cluster.local"}]}}
    assert status_patch(gateway(), "cluster.local") == want
    assert status_patch(gateway(addresses=[("IPAddress", "10.0.0.1")]), "cluster.local") == want
    done = gateway(addresses=[("Hostname", "waypoint.shop.svc.cluster.local")])
    assert status_patch(done, "cluster.local") is None
    assert status_patch(done, "example.org") is not None


def test_the_api_server_gets_what_is_rendered():
    applied = kube_objects(gateway(), SETTINGS)
    assert [body for _, body in applied] == waypoint_objects(gateway(), SETTINGS)
    assert [(r.kind, r.api_version) for r, _ in applied] == [
        ("ServiceAccount", "v1"),
        ("Deployment", "apps/v1"),
        ("Service", "v1"),
    ]


def test_the_lab_directory_gets_what_is_rendered_and_runs_it(tmp_path: Path):
    gw_doc: dict[str, Any] = {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "Gateway",
        "metadata": {"name": "waypoint", "namespace": "shop"},
        "spec": {
            "gatewayClassName": "istio-waypoint",
            "listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE"}],
        },
    }
    (tmp_path / "gateway-shop-waypoint.yaml").write_text(yaml.safe_dump(gw_doc))
    store = load_directory(tmp_path).store
    apply_plan(tmp_path, plan(store, read_current(tmp_path), SETTINGS))
    (loaded_gw,) = store.gateways
    written = [
        yaml.safe_load((tmp_path / f"{k.lower()}-shop-waypoint.yaml").read_text()) for k in RENDERED_KINDS
    ]
    assert written == waypoint_objects(loaded_gw, SETTINGS)
    # the lab's Deployment controller runs the rendered Deployment as the waypoint's pod
    (pod,) = plan_pods([written[1]], {}, ["node-1"], {}).create
    assert (pod.key, pod.app, pod.service_account) == ("shop/waypoint-0", "waypoint", "waypoint")


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3),
        max_leaves=12,
    )
)
def test_runs_waypoint_takes_any_shape(template: object):
    # a file in the lab's directory can hold anything: a verdict, never an exception
    assert runs_waypoint(template) in (True, False)


def test_runs_waypoint_wants_the_waypoint_command():
    def template(**container: Any) -> dict[str, Any]:
        return {"spec": {"containers": [container]}}

    assert runs_waypoint(waypoint_objects(gateway(), SETTINGS)[1]["spec"]["template"])
    assert runs_waypoint(template(args=["ambient", "waypoint", "--x"]))
    assert not runs_waypoint(template(command=["ambient"], args=["ztunnel"]))
    assert not runs_waypoint(template(args=["proxy", "waypoint"]))
    assert not runs_waypoint(template(command="ambient waypoint"))
    assert not runs_waypoint({"spec": {"containers": []}})
