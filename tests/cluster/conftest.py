"""Tier 4: a one-node Kubernetes cluster (scripts/cluster/): the Debian-built Kubernetes,
containerd as the kubelet's runtime, the bridge plugin as primary CNI, our image loaded and the
whole-mesh overlay applied with `kubectl apply -k`. Every test is marked `cluster`.

The tier runs when AMBIENT_CLUSTER_TIER=1 (scripts/cluster/test.sh sets it after build.sh has
filled the cache); otherwise each test is skipped with the reason. The cluster is brought up once
per session and torn down after it, also when a test fails.
"""

from __future__ import annotations

import functools
import os
import shutil

import pytest

from .kube import K8S_BIN, cluster_session, wait_for

REQUIRED_BINARIES = (
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubelet",
    "kube-proxy",
    "pause",
)


@functools.cache
def cluster_unavailable_reason() -> str | None:
    if os.environ.get("AMBIENT_CLUSTER_TIER") != "1":
        return "cluster tier not enabled (run scripts/cluster/test.sh, which sets AMBIENT_CLUSTER_TIER=1)"
    if os.geteuid() != 0:
        return "the cluster tier needs root"
    missing = [b for b in REQUIRED_BINARIES if not (K8S_BIN / b).exists()]
    if missing:
        return f"Kubernetes binaries not built ({', '.join(missing)}): run scripts/cluster/build.sh"
    if shutil.which("kubectl") is None:
        return "kubectl is not installed"
    return None


def pytest_report_header(config):
    reason = cluster_unavailable_reason()
    return f"cluster tier: {'SKIPPED: ' + reason if reason else 'enabled'}"


def pytest_collection_modifyitems(config, items):
    reason = cluster_unavailable_reason()
    for item in items:
        if "tests/cluster/" in str(item.fspath):
            item.add_marker(pytest.mark.cluster)
            item.add_marker(pytest.mark.timeout(900))
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def cluster():
    with cluster_session() as c:
        yield c


@pytest.fixture(scope="module")
def mesh(cluster):
    """A namespace in the mesh with a `server` pod (HTTP on 8080) and a `client` pod, once the
    client reaches the server: (namespace, the server's URL)."""
    ns = cluster.namespace(ambient=True)
    cluster.pod(ns, "server", sa="server", serve=True)
    cluster.pod(ns, "client", sa="client", serve=False)
    cluster.running(ns, "server")
    wait_for(
        lambda: cluster.get("pod", "-n", ns, "client")["status"].get("phase") == "Running", "client running"
    )
    server_ip = cluster.pod_ip(ns, "server")
    url = f"http://{server_ip}:8080/"
    wait_for(lambda: cluster.http_get(ns, "client", url) == "200", f"GET {url} from {ns}/client", 120)
    return ns, url
