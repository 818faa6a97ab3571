"""Installing the frozen plugin bundle (the image's case): copy under a digest-named directory,
symlink switched by rename, idempotence, upgrade keeping the previous copy, drift, removal, and
the bounds on what `PluginBundle.load` accepts."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from ambient_mesh.cni import install
from ambient_mesh.cni.install import Installer, InstallError, PluginBundle, PluginInstall, plugin_entry

PRIMARY = {"cniVersion": "1.0.0", "name": "k8s", "plugins": [{"type": "bridge"}]}


def make_bundle(root, answer: str):
    """A stand-in bundle: an executable that prints `answer`, and a contents directory."""
    root.mkdir(parents=True)
    exe = root / "istio-cni"
    exe.write_text(f"#!/bin/sh\necho {answer}\n")
    exe.chmod(0o755)
    (root / "_internal").mkdir()
    (root / "_internal" / "lib.so").write_bytes(answer.encode() * 100)
    return PluginBundle.load(root)


@pytest.fixture
def node(tmp_path):
    net, bin_ = tmp_path / "net.d", tmp_path / "bin"
    net.mkdir()
    bin_.mkdir()
    (net / "10-k8s.conflist").write_text(json.dumps(PRIMARY))
    return tmp_path, net, bin_


def installer(net, bin_, bundle) -> Installer:
    return Installer(PluginInstall(cni_net_dir=net, cni_bin_dir=bin_, entry=plugin_entry(), bundle=bundle))


def run(exe) -> str:
    return subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.strip()


def test_install_copies_bundle_and_links_executable(node):
    tmp, net, bin_ = node
    bundle = make_bundle(tmp / "image" / "v1", "v1")
    inst = installer(net, bin_, bundle)
    inst.install()
    exe = bin_ / "istio-cni"
    assert os.readlink(exe) == f".istio-cni-{bundle.digest}/istio-cni"  # relative: mount point agnostic
    assert run(exe) == "v1"
    assert (bin_ / bundle.dir_name / "_internal" / "lib.so").read_bytes() == b"v1" * 100
    assert inst.check_drift().ok
    assert inst.install_executable() is False  # already in place: nothing rewritten
    assert sorted(p.name for p in bin_.iterdir()) == [bundle.dir_name, "istio-cni"]


def test_upgrade_switches_link_and_keeps_only_the_previous_copy(node):
    tmp, net, bin_ = node
    bundles = [make_bundle(tmp / "image" / v, v) for v in ("v1", "v2", "v3")]
    for b in bundles:
        installer(net, bin_, b).install()
        assert run(bin_ / "istio-cni") == b.source.name
    names = sorted(p.name for p in bin_.iterdir())
    assert names == sorted([bundles[1].dir_name, bundles[2].dir_name, "istio-cni"])


def test_drift_is_found_and_repaired(node):
    tmp, net, bin_ = node
    bundle = make_bundle(tmp / "image" / "v1", "v1")
    inst = installer(net, bin_, bundle)
    inst.install()
    (bin_ / "istio-cni").unlink()
    (bin_ / "istio-cni").write_text("#!/bin/sh\necho someone-else\n")
    drift = inst.check_drift()
    assert drift.problems == (
        f"executable {bin_ / 'istio-cni'} does not point at our bundle {bundle.dir_name}",
    )
    inst.repair()
    assert run(bin_ / "istio-cni") == "v1"
    # the copy itself vanishing (a node clean-up) leaves a dangling link: found and repaired
    import shutil

    shutil.rmtree(bin_ / bundle.dir_name)
    assert not inst.check_drift().ok
    inst.repair()
    assert run(bin_ / "istio-cni") == "v1"


def test_interrupted_copy_is_cleaned_up(node):
    tmp, net, bin_ = node
    bundle = make_bundle(tmp / "image" / "v1", "v1")
    leftover = bin_ / f"{bundle.dir_name}.tmp.abc"
    leftover.mkdir()
    (leftover / "half").write_text("x")
    installer(net, bin_, bundle).install()
    assert not leftover.exists()


def test_remove_takes_link_and_copies_upgrade_keeps_them(node):
    tmp, net, bin_ = node
    bundle = make_bundle(tmp / "image" / "v1", "v1")
    inst = installer(net, bin_, bundle)
    inst.install()
    inst.remove(upgrade=True)
    assert run(bin_ / "istio-cni") == "v1"
    inst.remove(upgrade=False)
    assert list(bin_.iterdir()) == []
    assert json.loads((net / "10-k8s.conflist").read_text())["plugins"] == [{"type": "bridge"}]


def test_digest_follows_contents(tmp_path):
    a = make_bundle(tmp_path / "a", "same")
    b = make_bundle(tmp_path / "b", "same")
    c = make_bundle(tmp_path / "c", "other")
    assert a.digest == b.digest != c.digest


def test_load_refuses_what_is_not_a_bundle(tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    with pytest.raises(InstallError, match="has no executable istio-cni"):
        PluginBundle.load(tmp_path / "empty")
    make_bundle(tmp_path / "linked", "x")
    (tmp_path / "linked" / "_internal" / "escape").symlink_to("/etc/passwd")
    with pytest.raises(InstallError, match="not a plain file"):
        PluginBundle.load(tmp_path / "linked")
    make_bundle(tmp_path / "big", "x")
    for i in range(5):
        (tmp_path / "big" / f"f{i}").write_text("x")
    monkeypatch.setattr(install, "MAX_BUNDLE_FILES", 4)
    with pytest.raises(InstallError, match="exceeds 4 files"):
        PluginBundle.load(tmp_path / "big")


def test_packaged_plugin_absent_outside_an_image(tmp_path):
    assert install.packaged_plugin(tmp_path / "nowhere") is None
    make_bundle(tmp_path / "b", "x")
    assert install.packaged_plugin(tmp_path / "b").source == tmp_path / "b"
