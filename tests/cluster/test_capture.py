"""Capture through the real path: kubelet -> containerd -> the CNI chain (bridge, portmap, then
our frozen istio-cni plugin, installed by the node agent DaemonSet) -> the agent -> the node
proxy over ZDS. The node proxy takes pods over only after its first xDS push (as ztunnel); while
the agent has no node proxy to hand a pod to, the plugin fails closed and the kubelet retries."""

from __future__ import annotations

import json
import os

from .kube import CNI_BIN, CNI_NET, wait_for

REDIRECTION = "ambient.istio.io/redirection"


def captured(cluster, ns: str, pod: str) -> bool:
    return cluster.annotations(ns, pod).get(REDIRECTION) == "enabled"


def test_agent_installed_the_frozen_plugin_into_the_nodes_cni(cluster):
    exe = CNI_BIN / "istio-cni"
    target = os.readlink(exe)  # a symlink into the bundle copied from the image, not a launcher
    assert target.startswith(".istio-cni-") and target.endswith("/istio-cni"), target
    assert (CNI_BIN / target.split("/")[0] / "_internal").is_dir()
    (conf,) = CNI_NET.glob("*.conflist")
    plugins = [p["type"] for p in json.loads(conf.read_text())["plugins"]]
    assert plugins == ["bridge", "portmap", "istio-cni"], plugins
    print(f"\n{exe} -> {target}; {conf.name}: {' -> '.join(plugins)}")


def test_ambient_pod_fails_closed_without_the_node_proxy_then_starts_captured(cluster):
    ns = cluster.namespace(ambient=True)

    def refused():
        events = cluster.get("events", "-n", ns)["items"]
        msgs = [e["message"] for e in events if e.get("reason") == "FailedCreatePodSandBox"]
        return [m for m in msgs if 'plugin type="istio-cni"' in m and "no ztunnel connection" in m]

    with cluster.node_proxy_off_the_node():
        cluster.pod(ns, "server", sa="server", serve=True)
        msgs = wait_for(refused, f"the sandbox of {ns}/server refused by istio-cni", 90)
        pod = cluster.get("pod", "-n", ns, "server")
        assert pod["status"].get("phase") == "Pending" and not pod["status"].get("podIP"), pod["status"]
    # the kubelet retries the sandbox; with the node proxy back the pod starts, captured
    cluster.running(ns, "server", timeout_s=180)
    assert captured(cluster, ns, "server"), cluster.annotations(ns, "server")
    print(
        f"\n{ns}/server stayed Pending while no node proxy ran, its sandbox refused by our plugin "
        f"(fail closed):\n{msgs[-1][:400]}\nthen started captured once the node proxy was back"
    )


def test_ambient_pod_is_captured_by_the_chained_plugin(cluster):
    ns = cluster.namespace(ambient=True)
    cluster.pod(ns, "server", sa="server", serve=True)
    cluster.running(ns, "server")
    assert captured(cluster, ns, "server"), cluster.annotations(ns, "server")
    rules = cluster.netns_rules(ns, "server")
    assert "ISTIO_OUTPUT" in rules or "istio" in rules.lower(), rules[:2000]
    # the plugin's own log lines reach the agent (log.sock) under the pod's name: containerd ran it
    logs = cluster.kubectl("logs", "-n", "istio-system", "-l", "k8s-app=istio-cni-node", "--tail=-1")
    plugin_lines = [line for line in logs.splitlines() if "server" in line and ns in line]
    assert plugin_lines, logs[-3000:]
    # the frozen plugin handed its run to the agent (plugin_handoff.py), not deciding by itself
    handed = [line for line in logs.splitlines() if "plugin run handed over: ADD" in line]
    assert handed, logs[-3000:]
    print(f"\n{ns}/server: {REDIRECTION}=enabled; in-pod rules present; agent log:")
    print("\n".join(plugin_lines[-4:] + handed[-1:]))


def test_non_ambient_pod_is_not_captured(cluster):
    ns = cluster.namespace(ambient=False)
    cluster.pod(ns, "plain", sa="plain", serve=True)
    pod = cluster.running(ns, "plain")
    assert not captured(cluster, ns, "plain")
    assert "ISTIO_OUTPUT" not in cluster.netns_rules(ns, "plain")
    print(f"\n{ns}/plain running at {pod['status']['podIP']}, no redirection annotation, no ISTIO_* rules")


def test_non_ambient_pod_not_captured_until_its_namespace_is_labelled(cluster):
    ns = cluster.namespace(ambient=False)
    cluster.pod(ns, "plain", sa="plain", serve=True)
    cluster.running(ns, "plain")
    assert not captured(cluster, ns, "plain")
    assert "ISTIO_OUTPUT" not in cluster.netns_rules(ns, "plain")
    cluster.kubectl("label", "namespace", ns, "istio.io/dataplane-mode=ambient")
    cluster.pod(ns, "later", sa="plain", serve=True)
    cluster.running(ns, "later")
    assert captured(cluster, ns, "later")
    # a running pod of a namespace that becomes ambient is enrolled by the agent's informer
    wait_for(lambda: captured(cluster, ns, "plain"), f"{ns}/plain enrolled after the label", 30)
    print(f"\n{ns}/plain: not captured before the label, enrolled after; {ns}/later captured at start")


def test_restarting_agent_and_proxy_leaves_no_pod_uncaptured(cluster):
    ns = cluster.namespace(ambient=True)
    cluster.pod(ns, "before", sa="before", serve=True)
    cluster.running(ns, "before")
    for label in ("k8s-app=istio-cni-node", "app=ztunnel"):
        (old,) = [p["metadata"]["name"] for p in cluster.system_pods(label)]
        cluster.kubectl("delete", "pod", "-n", "istio-system", old, "--wait=true", timeout=120)

        def replaced(label=label, old=old):
            pods = [p for p in cluster.system_pods(label) if p["metadata"]["name"] != old]
            return pods and all(
                "running" in c.get("state", {})
                for p in pods
                for c in p["status"].get("containerStatuses", [])
            )

        wait_for(replaced, f"a new {label} pod", 180)
        assert captured(cluster, ns, "before")
        assert "ISTIO_OUTPUT" in cluster.netns_rules(ns, "before")
    # pods started after both restarts are captured too
    cluster.pod(ns, "after", sa="after", serve=True)
    cluster.running(ns, "after")
    assert captured(cluster, ns, "after")
    print(f"\nafter restarting istio-cni-node and ztunnel: {ns}/before still captured, {ns}/after captured")
