"""The commands Istio's charts run in our image: `ztunnel proxy ztunnel` (ztunnel chart's args)
and `install-cni --log_output_level=...` (istio-cni chart's command), mapped onto ours."""

from __future__ import annotations

import pytest

from ambient_mesh import cli


@pytest.fixture
def calls(monkeypatch):
    seen: list[list[str]] = []

    def fake_main(argv=None):
        seen.append(list(argv))
        return 0

    monkeypatch.setattr(cli, "main", fake_main)
    return seen


@pytest.mark.parametrize("argv", [["proxy", "ztunnel"], ["proxy"]])
def test_ztunnel_proxy_runs_the_node_proxy(calls, argv):
    assert cli.ztunnel_main(argv) == 0
    assert calls == [["ztunnel"]]


@pytest.mark.parametrize("argv", [["proxy", "sidecar"], ["proxy", "router"], ["bogus"]])
def test_ztunnel_refuses_other_proxy_types(calls, capsys, argv):
    assert cli.ztunnel_main(argv) == 2
    assert calls == []
    assert "unsupported arguments" in capsys.readouterr().err


def test_ztunnel_version_and_help(calls, capsys):
    assert cli.ztunnel_main(["version"]) == 0
    assert "ambient-mesh" in capsys.readouterr().out
    assert cli.ztunnel_main([]) == 2
    assert calls == []


def test_install_cni_uses_container_paths_and_passes_flags(calls, monkeypatch):
    for name in cli.INSTALL_CNI_DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CNI_BIN_DIR", "/custom/bin")  # an explicit setting wins over the default
    assert cli.install_cni_main(["--log_output_level=default:info"]) == 0
    assert calls == [["cni-agent", "--log_output_level=default:info"]]
    import os

    assert os.environ["MOUNTED_CNI_NET_DIR"] == "/host/etc/cni/net.d"
    assert os.environ["HOST_PREFIX"] == "/host"
    assert os.environ["CNI_BIN_DIR"] == "/custom/bin"


def test_install_cni_flags_reach_the_agent_config():
    """The chart's flag spelling is one the agent's parser accepts (not only passed along)."""
    from ambient_mesh.cni.agent_config import load

    cfg = load(
        ["--log_output_level=default:debug"],
        {**cli.INSTALL_CNI_DEFAULTS, "AMBIENT_ENABLED": "true", "NODE_NAME": "n1"},
    )
    assert str(cfg.mounted_cni_net_dir) == "/host/etc/cni/net.d"
    assert str(cfg.cni_bin_dir) == "/host/opt/cni/bin"
    assert cfg.host_netns_path == "/host/proc/1/ns/net"
    assert cfg.log_output_level.startswith("debug")
