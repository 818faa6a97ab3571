"""The kustomize overlays under deploy/ render (`kubectl kustomize`, the kustomize built into
kubectl) into what Istio's ztunnel, istio-cni and istiod charts would deploy for ambient: names,
args, capabilities, host paths, the istio-ca token, the Service istiod's ports, and RBAC no wider
than the charts grant."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from tests.helpers.paths import ROOT

DEPLOY = ROOT / "deploy"
KUBECTL = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl (with its built-in kustomize) is not installed"
)


def render(overlay: str) -> dict[tuple[str, str], dict]:
    out = subprocess.run(
        [KUBECTL, "kustomize", str(DEPLOY / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    objs = {}
    for doc in yaml.safe_load_all(out):
        key = (doc["kind"], doc["metadata"]["name"])
        assert key not in objs, f"{key} rendered twice"
        objs[key] = doc
    return objs


@pytest.fixture(scope="module")
def mesh():
    return render("mesh")


@pytest.fixture(scope="module")
def beside():
    return render("beside-istiod")


def container(objs, kind, name):
    (c,) = objs[(kind, name)]["spec"]["template"]["spec"]["containers"]
    return c


def env(c) -> dict[str, object]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def test_beside_istiod_is_the_data_plane_only(beside):
    assert set(beside) == {
        ("Namespace", "istio-system"),
        ("ServiceAccount", "ztunnel"),
        ("ServiceAccount", "istio-cni"),
        ("ClusterRole", "istio-cni"),
        ("ClusterRole", "istio-cni-ambient"),
        ("ClusterRoleBinding", "istio-cni"),
        ("ClusterRoleBinding", "istio-cni-ambient"),
        ("ConfigMap", "istio-cni-config"),
        ("DaemonSet", "ztunnel"),
        ("DaemonSet", "istio-cni-node"),
        # the plugin's own narrow account, whose tokens the agent requests (plugin_token.py)
        ("ServiceAccount", "istio-cni-plugin"),
        ("ClusterRole", "istio-cni-plugin"),
        ("ClusterRoleBinding", "istio-cni-plugin"),
        ("Role", "istio-cni-plugin-token"),
        ("RoleBinding", "istio-cni-plugin-token"),
    }
    for key, obj in beside.items():
        if key[0] not in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
            assert obj["metadata"]["namespace"] == "istio-system", key


def test_mesh_adds_the_control_plane_as_istiod(mesh, beside):
    assert set(mesh) - set(beside) == {
        ("ServiceAccount", "istiod"),
        ("ClusterRole", "istiod-clusterrole-istio-system"),
        ("ClusterRoleBinding", "istiod-clusterrole-istio-system"),
        ("Service", "istiod"),
        ("Deployment", "istiod"),
    }
    svc = mesh[("Service", "istiod")]
    assert svc["metadata"]["namespace"] == "istio-system"
    assert {(p["name"], p["port"]) for p in svc["spec"]["ports"]} == {
        ("grpc-xds", 15010),
        ("https-dns", 15012),
    }
    pod = mesh[("Deployment", "istiod")]["spec"]["template"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    c = container(mesh, "Deployment", "istiod")
    assert c["command"] == ["ambient"] and c["args"][:2] == ["control", "--kube"]
    assert "--listen=[::]:15012" in c["args"] and "--plaintext-listen=[::]:15010" in c["args"]
    # The CA key's directory is one the control plane creates itself under the emptyDir (whose
    # own root is 0777, root's: host.private refuses it), so it is 0700 and the control plane's.
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    state_dir = next(a.split("=", 1)[1] for a in c["args"] if a.startswith("--state-dir="))
    assert state_dir.startswith(mounts["state"] + "/")
    assert env(c)["ROOT_CA_DIR"] == "/etc/cacerts"
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["cacerts"]["secret"]["secretName"] == "cacerts"


def test_no_component_asks_for_certificates_on_the_plaintext_port(mesh):
    # The control plane serves its CA on 15012 (TLS) only; 15010 is plaintext xDS. A CA_ADDRESS
    # on 15010 would send the node proxy's token in clear text and get UNIMPLEMENTED back.
    ztunnel = env(container(mesh, "DaemonSet", "ztunnel"))
    assert ":15010" not in str(ztunnel.get("CA_ADDRESS", ""))
    for (kind, _name), obj in mesh.items():
        if kind in ("DaemonSet", "Deployment"):
            for c in obj["spec"]["template"]["spec"]["containers"]:
                assert ":15010" not in str(env(c).get("CA_ADDRESS", "")), c["name"]


def test_one_image_everywhere(mesh):
    images = {
        c["image"]
        for (kind, _), obj in mesh.items()
        if kind in ("DaemonSet", "Deployment")
        for c in obj["spec"]["template"]["spec"]["containers"]
    }
    assert images == {"localhost/ambient-mesh:latest"}


def test_ztunnel_as_the_chart_runs_it(mesh):
    ds = mesh[("DaemonSet", "ztunnel")]
    spec = ds["spec"]["template"]["spec"]
    c = container(mesh, "DaemonSet", "ztunnel")
    assert "command" not in c and c["args"] == ["proxy", "ztunnel"]  # the image's entry point
    assert spec["serviceAccountName"] == "ztunnel"
    assert spec["priorityClassName"] == "system-node-critical"
    sc = c["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN", "SYS_ADMIN", "NET_RAW"]}
    assert sc["privileged"] is False and sc["readOnlyRootFilesystem"] is True
    assert c["readinessProbe"]["httpGet"] == {"port": 15021, "path": "/healthz/ready"}
    e = env(c)
    assert e["XDS_ADDRESS"] == e["CA_ADDRESS"] == "istiod.istio-system.svc:15012"
    for name in ("POD_NAME", "POD_NAMESPACE", "NODE_NAME", "INSTANCE_IP", "SERVICE_ACCOUNT"):
        assert "fieldRef" in e[name], name
    volumes = {v["name"]: v for v in spec["volumes"]}
    (token,) = volumes["istio-token"]["projected"]["sources"]
    assert token["serviceAccountToken"] == {
        "path": "istio-token",
        "expirationSeconds": 43200,
        "audience": "istio-ca",
    }
    assert volumes["istiod-ca-cert"]["configMap"]["name"] == "istio-ca-root-cert"
    assert volumes["cni-ztunnel-sock-dir"]["hostPath"]["path"] == "/var/run/ztunnel"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    # the paths our proxy's XDS_ROOT_CA and AUTH_TOKEN defaults resolve to from the image's /
    assert mounts["istiod-ca-cert"] == "/var/run/secrets/istio"
    assert mounts["istio-token"] == "/var/run/secrets/tokens"
    assert mounts["cni-ztunnel-sock-dir"] == "/var/run/ztunnel"


def test_node_agent_as_the_chart_runs_it(mesh):
    spec = mesh[("DaemonSet", "istio-cni-node")]["spec"]["template"]["spec"]
    c = container(mesh, "DaemonSet", "istio-cni-node")
    assert c["name"] == "install-cni" and c["command"] == ["install-cni"]
    assert spec.get("hostNetwork") is not True  # Istio's default since 1.26
    assert spec["serviceAccountName"] == "istio-cni"
    sc = c["securityContext"]
    assert sc["privileged"] is False and sc["runAsUser"] == 0
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert set(sc["capabilities"]["add"]) == {
        "NET_ADMIN",
        "NET_RAW",
        "SYS_PTRACE",
        "SYS_ADMIN",
        "DAC_OVERRIDE",
    }
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": 8000}
    hostpaths = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"]}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    expected = {
        "cni-bin-dir": ("/opt/cni/bin", "/host/opt/cni/bin"),
        "cni-net-dir": ("/etc/cni/net.d", "/host/etc/cni/net.d"),
        "cni-host-procfs": ("/proc", "/host/proc"),
        "cni-socket-dir": ("/var/run/istio-cni", "/var/run/istio-cni"),
        "cni-netns-dir": ("/var/run/netns", "/host/var/run/netns"),
        "cni-ztunnel-sock-dir": ("/var/run/ztunnel", "/var/run/ztunnel"),
    }
    assert {n: (hostpaths[n], mounts[n]["mountPath"]) for n in expected} == expected
    assert mounts["cni-netns-dir"]["mountPropagation"] == "HostToContainer"
    assert mounts["cni-host-procfs"]["readOnly"] is True
    # the container paths are the install-cni entry point's defaults
    from ambient_mesh.cli import INSTALL_CNI_DEFAULTS

    assert INSTALL_CNI_DEFAULTS["MOUNTED_CNI_NET_DIR"] == expected["cni-net-dir"][1]
    assert INSTALL_CNI_DEFAULTS["CNI_BIN_DIR"] == expected["cni-bin-dir"][1]
    config = mesh[("ConfigMap", "istio-cni-config")]["data"]
    assert c["envFrom"] == [{"configMapRef": {"name": "istio-cni-config"}}]
    assert config["AMBIENT_ENABLED"] == "true"


def test_every_env_name_is_one_the_components_read(mesh):
    """A setting we pass must act: the agent knows every name it is given, and the proxy's
    configuration takes what the DaemonSet gives it."""
    from ambient_mesh.cni.agent_config import SETTINGS

    agent = set(env(container(mesh, "DaemonSet", "istio-cni-node"))) | set(
        mesh[("ConfigMap", "istio-cni-config")]["data"]
    )
    assert agent <= SETTINGS, agent - SETTINGS
    downward = {
        "metadata.name": "ztunnel-abcde",
        "metadata.namespace": "istio-system",
        "spec.nodeName": "node-1",
        "status.podIP": "10.244.0.7",
        "spec.serviceAccountName": "ztunnel",
    }
    ztunnel_env = {
        name: value if isinstance(value, str) else downward[value["fieldRef"]["fieldPath"]]
        for name, value in env(container(mesh, "DaemonSet", "ztunnel")).items()
    }
    from ambient_mesh.config import ZtunnelConfig

    cfg = ZtunnelConfig.from_env(ztunnel_env)
    assert cfg.xds_address == cfg.ca_address == "https://istiod.istio-system.svc:15012"
    assert (cfg.node_name, cfg.pod_name, cfg.pod_namespace, cfg.service_account) == (
        "node-1",
        "ztunnel-abcde",
        "istio-system",
        "ztunnel",
    )
    assert cfg.cluster_id == "Kubernetes" and str(cfg.instance_ip) == "10.244.0.7"


def rules(objs, name):
    return [
        (tuple(r.get("apiGroups", [])), tuple(r["resources"]), frozenset(r["verbs"]))
        for r in objs[("ClusterRole", name)]["rules"]
    ]


def test_rbac_no_wider_than_istios_charts(mesh):
    assert rules(mesh, "istio-cni") == [
        (("",), ("pods", "nodes", "namespaces"), frozenset({"get", "list", "watch"}))
    ]
    ambient = mesh[("ClusterRole", "istio-cni-ambient")]["rules"]
    assert ambient[1]["resourceNames"] == ["istio-cni-node"] and ambient[1]["verbs"] == ["get"]
    writes = [
        (groups, resources, verbs)
        for groups, resources, verbs in rules(mesh, "istiod-clusterrole-istio-system")
        if verbs - {"get", "list", "watch"}
    ]
    # istiod's chart grants these writes (and more); we keep the two the CA needs, the status
    # subresource of the kinds it reads (patch only: never the objects themselves), and the
    # waypoints' own objects
    assert writes == [
        (("",), ("configmaps",), frozenset({"create", "get", "list", "watch", "update"})),
        (("security.istio.io",), ("authorizationpolicies/status", "peerauthentications/status"), {"patch"}),
        (("networking.istio.io",), ("serviceentries/status",), {"patch"}),
        (("gateway.networking.k8s.io",), ("gateways/status", "httproutes/status"), {"patch"}),
        (("",), ("services/status",), {"patch"}),
        # waypoints: server-side apply of their three objects; deletion is the garbage collector's
        (("",), ("services", "serviceaccounts"), frozenset({"create", "patch"})),
        (("apps",), ("deployments",), frozenset({"create", "patch"})),
        (("authentication.k8s.io",), ("tokenreviews",), frozenset({"create"})),
    ]
    # The plugin's own account reads one pod and its namespace; the agent may mint tokens of
    # that account only (TokenRequest: no Secret, no other account).
    assert rules(mesh, "istio-cni-plugin") == [(("",), ("pods", "namespaces"), frozenset({"get"}))]
    assert mesh[("ServiceAccount", "istio-cni-plugin")]["automountServiceAccountToken"] is False
    (token_rule,) = mesh[("Role", "istio-cni-plugin-token")]["rules"]
    assert token_rule == {
        "apiGroups": [""],
        "resources": ["serviceaccounts/token"],
        "resourceNames": ["istio-cni-plugin"],
        "verbs": ["create"],
    }
    (subject,) = mesh[("RoleBinding", "istio-cni-plugin-token")]["subjects"]
    assert (subject["name"], subject["namespace"]) == ("istio-cni", "istio-system")
    for (kind, name), obj in mesh.items():
        if kind == "ClusterRoleBinding":
            (subject,) = obj["subjects"]
            assert subject["namespace"] == "istio-system" and obj["roleRef"]["name"] == name
    assert not any(kind == "ClusterRole" and "secrets" in str(obj) for (kind, _), obj in mesh.items())


@pytest.mark.parametrize("overlay", ["mesh", "beside-istiod"])
def test_ztunnel_rolls_new_first_and_drains_within_its_grace(overlay, request):
    """maxSurge 1, maxUnavailable 0 (Istio's ztunnel chart): on a node the new node proxy starts,
    takes every pod from the node agent (the newest ZDS connection), and only then is the old
    one terminated, to drain within its grace period (the deadline is 5 s shorter)."""
    objs = request.getfixturevalue("mesh" if overlay == "mesh" else "beside")
    ds = objs[("DaemonSet", "ztunnel")]
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    spec = ds["spec"]["template"]["spec"]
    e = env(container(objs, "DaemonSet", "ztunnel"))
    # The drain deadline comes from the grace period the kubelet enforces (minus 5 s): both the same.
    assert e["TERMINATION_GRACE_PERIOD_SECONDS"] == str(spec["terminationGracePeriodSeconds"]) == "30"
    # Per-pod listeners must be shareable with the next node proxy: INPOD_PORT_REUSE stays on.
    assert e.get("INPOD_PORT_REUSE", "true") == "true"
