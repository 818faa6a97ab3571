"""The `ambient` command line: help on every command, the programs' environment in their help,
--version, `python -m ambient_mesh`."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from ambient_mesh import __version__
from ambient_mesh.cli import build_parser, main
from ambient_mesh.cni import agent_config


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = [prefix]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(sub, (*prefix, name))
    return found


@pytest.mark.parametrize(
    "command", _commands(build_parser()) + [("lab", "up"), ("lab", "status"), ("lab", "logs")]
)
def test_every_command_has_help(command, capsys):
    try:
        code = main([*command, "--help"])
    except SystemExit as exc:
        code = exc.code
    assert code in (0, None)
    assert "usage: ambient" in capsys.readouterr().out


def test_version(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"ambient-mesh {__version__}"


def test_proxy_help_lists_its_environment_with_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["ztunnel", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for expected in (
        "PROXY_MODE shared",
        "XDS_ADDRESS https://localhost:15012",
        "SECRET_TTL 24h",
        "POOL_UNUSED_RELEASE_TIMEOUT 5m",
        "INPOD_UDS /var/run/ztunnel/ztunnel.sock",
        "ADMIN_ADDR 127.0.0.1:15000",
        "ISTIO_META_*",
    ):
        assert expected in out


def test_agent_help_lists_every_setting_it_accepts(capsys):
    assert main(["cni-agent", "--help"]) == 0
    out = capsys.readouterr().out
    names = {line.split()[0] for line in out.splitlines() if line.startswith("  ")}
    assert agent_config.SETTINGS <= names
    flat = " ".join(out.split())
    assert "CNI_AGENT_RUN_DIR /var/run/istio-cni" in flat and "KUBECONFIG_MODE 600" in flat


def test_python_dash_m():
    done = subprocess.run([sys.executable, "-m", "ambient_mesh", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and __version__ in done.stdout
