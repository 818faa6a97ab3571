"""Installing the chained plugin: the pure JSON transformations (expected JSON spelled out), and
the Installer on temp directories (insert, convert, idempotent, drift and repair, remove/upgrade)."""

from __future__ import annotations

import asyncio
import json
import os
import stat

import pytest

from ambient_mesh.cni.install import (
    Installer,
    InstallError,
    PluginInstall,
    entry_state,
    insert_plugin,
    is_valid_config,
    launcher_script,
    plugin_entry,
    remove_plugin,
    select_primary,
    watch,
)

BRIDGE_CONF = {
    "cniVersion": "1.0.0",
    "name": "dbnet",
    "type": "bridge",
    "bridge": "cni0",
    "ipam": {"type": "host-local", "subnet": "10.1.0.0/16", "gateway": "10.1.0.1"},
}
CALICO_LIST = {
    "name": "k8s-pod-network",
    "cniVersion": "1.0.0",
    "plugins": [
        {"type": "calico", "log_level": "info"},
        {"type": "portmap", "capabilities": {"portMappings": True}},
    ],
}
ENTRY = plugin_entry(cni_agent_run_dir="/var/run/istio-cni", pod_source_directory="/etc/mesh")
OURS = {k: v for k, v in ENTRY.items() if k != "cniVersion"}


def test_entry_keys_like_istio():
    assert sorted(ENTRY) == [
        "ambient_enabled",
        "ambient_pod_source",
        "cniVersion",
        "cni_agent_run_dir",
        "dns",
        "enable_ambient_detection_retry",
        "enablement_selectors",
        "exclude_namespaces",
        "ipam",
        "name",
        "native_nftables",
        "plugin_log_level",
        "pod_namespace",
        "type",
    ]
    assert (ENTRY["type"], ENTRY["name"], ENTRY["cniVersion"]) == ("istio-cni", "istio-cni", "0.3.1")
    assert ENTRY["ambient_pod_source"] == {"directory": "/etc/mesh"}


def test_insert_into_conflist_appends_last():
    assert insert_plugin(CALICO_LIST, ENTRY) == {
        "name": "k8s-pod-network",
        "cniVersion": "1.0.0",
        "plugins": [CALICO_LIST["plugins"][0], CALICO_LIST["plugins"][1], OURS],
    }


def test_insert_replaces_older_entry_and_moves_it_last():
    old = {
        **CALICO_LIST,
        "plugins": [CALICO_LIST["plugins"][0], {"type": "istio-cni", "old": True}, CALICO_LIST["plugins"][1]],
    }
    assert insert_plugin(old, ENTRY)["plugins"] == [
        CALICO_LIST["plugins"][0],
        CALICO_LIST["plugins"][1],
        OURS,
    ]


def test_insert_wraps_lone_conf():
    single = {k: v for k, v in BRIDGE_CONF.items() if k != "cniVersion"}
    assert insert_plugin(BRIDGE_CONF, ENTRY) == {
        "name": "k8s-pod-network",
        "cniVersion": "0.3.1",
        "plugins": [single, OURS],
    }


def test_insert_is_idempotent():
    once = insert_plugin(CALICO_LIST, ENTRY)
    assert insert_plugin(once, ENTRY) == once


def test_insert_rejects_non_list():
    with pytest.raises(InstallError):
        insert_plugin({"name": "x"}, ENTRY)


def test_remove_only_ours():
    assert remove_plugin(insert_plugin(CALICO_LIST, ENTRY)) == CALICO_LIST


def test_entry_state():
    assert entry_state(CALICO_LIST, ENTRY) == "missing"
    assert entry_state(insert_plugin(CALICO_LIST, ENTRY), ENTRY) == "ok"
    changed = plugin_entry(exclude_namespaces=["kube-system"])
    assert entry_state(insert_plugin(CALICO_LIST, ENTRY), changed) == "outdated"
    not_last = {**CALICO_LIST, "plugins": [OURS, *CALICO_LIST["plugins"]]}
    assert entry_state(not_last, ENTRY) == "not-last"


def test_validity_and_primary_selection():
    files = {
        "00-broken.conflist": b"{",
        "05-empty.conflist": json.dumps({"name": "x", "plugins": []}).encode(),
        "07-notype.conf": json.dumps({"name": "x"}).encode(),
        "10-calico.conflist": json.dumps(CALICO_LIST).encode(),
        "20-bridge.conf": json.dumps(BRIDGE_CONF).encode(),
        "99-notes.txt": b"",
    }
    assert not is_valid_config("05-empty.conflist", files["05-empty.conflist"])
    assert select_primary(files) == "10-calico.conflist"
    assert select_primary(files, "20-bridge.conf") == "20-bridge.conf"
    assert select_primary(files, "20-bridge.conflist") == "20-bridge.conf"
    assert select_primary(files, "30-absent.conf") is None
    assert select_primary({"a.json": b"{}"}) is None


def test_launcher_scripts():
    assert (
        launcher_script("/venv/bin/python")
        == '#!/bin/sh\nexec /venv/bin/python -I -m ambient_mesh.cni.plugin_handoff "$@"\n'
    )
    fast = launcher_script("/v/python", sys_path=["/src"])
    assert fast.startswith("#!/bin/sh\nexec /v/python -I -S -c ")
    assert 'sys.path[:0] = ["/src"]' in fast


# -- the Installer on real directories -------------------------------------------------------


@pytest.fixture
def dirs(tmp_path):
    net, bin_ = tmp_path / "net.d", tmp_path / "bin"
    net.mkdir()
    bin_.mkdir()
    return net, bin_


def make(net, bin_, **kw) -> Installer:
    return Installer(
        PluginInstall(cni_net_dir=net, cni_bin_dir=bin_, entry=ENTRY, launcher="#!/bin/sh\nexit 0\n", **kw)
    )


def test_install_into_conflist(dirs):
    net, bin_ = dirs
    (net / "10-calico.conflist").write_text(json.dumps(CALICO_LIST))
    os.chmod(net / "10-calico.conflist", 0o640)
    installer = make(net, bin_)
    path = installer.install()
    assert path == net / "10-calico.conflist"
    assert json.loads(path.read_text())["plugins"][-1] == OURS
    assert stat.S_IMODE(path.stat().st_mode) == 0o640  # the existing mode is kept
    exe = bin_ / "istio-cni"
    assert exe.read_text() == "#!/bin/sh\nexit 0\n" and os.access(exe, os.X_OK)
    assert sorted(p.name for p in net.iterdir()) == ["10-calico.conflist"]  # no temp files left
    assert installer.check_drift().ok
    assert repr(installer) == "Installer(10-calico.conflist, 1 installs, 0 repairs)"


def test_install_converts_lone_conf(dirs):
    net, bin_ = dirs
    (net / "10-bridge.conf").write_text(json.dumps(BRIDGE_CONF))
    path = make(net, bin_).install()
    assert path == net / "10-bridge.conflist"
    assert sorted(p.name for p in net.iterdir()) == ["10-bridge.conflist"]
    doc = json.loads(path.read_text())
    assert doc["cniVersion"] == "0.3.1" and [p["type"] for p in doc["plugins"]] == ["bridge", "istio-cni"]


def test_install_is_idempotent(dirs):
    net, bin_ = dirs
    (net / "10-calico.conflist").write_text(json.dumps(CALICO_LIST))
    installer = make(net, bin_)
    installer.install()
    before = (net / "10-calico.conflist").stat()
    first = (net / "10-calico.conflist").read_bytes()
    installer.install()
    after = (net / "10-calico.conflist").stat()
    assert (net / "10-calico.conflist").read_bytes() == first
    assert before.st_ino == after.st_ino  # not rewritten


def test_install_without_primary_config(dirs):
    net, bin_ = dirs
    with pytest.raises(InstallError, match="no CNI network config"):
        make(net, bin_).install()


def test_drift_detection_and_repair(dirs):
    net, bin_ = dirs
    (net / "10-calico.conflist").write_text(json.dumps(CALICO_LIST))
    installer = make(net, bin_)
    installer.install()
    # The primary CNI rewrites its config without us, and our executable vanishes.
    (net / "10-calico.conflist").write_text(json.dumps(CALICO_LIST))
    (bin_ / "istio-cni").unlink()
    drift = installer.check_drift()
    assert drift.problems == (
        f"executable {bin_ / 'istio-cni'} is missing",
        "our plugin entry in 10-calico.conflist: missing",
    )
    assert installer.repair() == drift
    assert installer.check_drift().ok and installer.repairs == 1


def test_drift_preempted_by_new_primary(dirs):
    net, bin_ = dirs
    (net / "10-calico.conflist").write_text(json.dumps(CALICO_LIST))
    installer = make(net, bin_)
    installer.install()
    (net / "05-cilium.conflist").write_text(json.dumps({**CALICO_LIST, "plugins": [{"type": "cilium-cni"}]}))
    assert installer.check_drift().problems == (
        "CNI config 10-calico.conflist preempted by 05-cilium.conflist",
        "our plugin entry in 05-cilium.conflist: missing",
    )
    installer.repair()
    assert json.loads((net / "05-cilium.conflist").read_text())["plugins"][-1]["type"] == "istio-cni"
    assert installer.check_drift().ok


def test_drift_outdated_entry(dirs):
    net, bin_ = dirs
    (net / "10-calico.conflist").write_text(json.dumps(insert_plugin(CALICO_LIST, plugin_entry())))
    assert make(net, bin_).check_drift().problems[-1] == "our plugin entry in 10-calico.conflist: outdated"


def test_remove_real_shutdown(dirs):
    net, bin_ = dirs
    (net / "10-calico.conflist").write_text(json.dumps(CALICO_LIST))
    installer = make(net, bin_)
    installer.install()
    installer.remove(upgrade=False)
    assert json.loads((net / "10-calico.conflist").read_text()) == CALICO_LIST
    assert not (bin_ / "istio-cni").exists()


def test_remove_upgrade_keeps_everything(dirs):
    net, bin_ = dirs
    (net / "10-calico.conflist").write_text(json.dumps(CALICO_LIST))
    installer = make(net, bin_)
    installer.install()
    installed = (net / "10-calico.conflist").read_bytes()
    installer.remove(upgrade=True)
    assert (net / "10-calico.conflist").read_bytes() == installed
    assert (bin_ / "istio-cni").exists()


def test_stale_temp_executables_removed(dirs):
    net, bin_ = dirs
    (net / "10-calico.conflist").write_text(json.dumps(CALICO_LIST))
    (bin_ / "istio-cni.tmp.abc").write_text("partial")
    make(net, bin_).install()
    assert sorted(p.name for p in bin_.iterdir()) == ["istio-cni"]


async def test_watch_repairs_drift_with_injected_sleep(dirs):
    net, bin_ = dirs
    installer = make(net, bin_)
    seen = []
    rounds = []

    async def fake_sleep(seconds):
        rounds.append(seconds)
        if len(rounds) == 1:
            # The primary config appears after the first (failed) round.
            (net / "10-calico.conflist").write_text(json.dumps(CALICO_LIST))
        if len(rounds) == 3:
            raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await watch(installer, interval_s=0.5, sleep=fake_sleep, on_drift=seen.append)
    assert rounds == [0.5, 0.5, 0.5]
    assert len(seen) == 1 and seen[0].problems[-1] == "our plugin entry in 10-calico.conflist: missing"
    assert installer.check_drift().ok
