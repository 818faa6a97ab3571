"""`ambient ztunnel-config` as istioctl's: sub-commands and aliases, `-o short`, `--file`,
`connections`, `log`; and `ambient completion bash`."""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import pytest

from ambient_mesh.cli import completion_table, main
from ambient_mesh.completion import bash_script
from ambient_mesh.errors import AmbientError
from ambient_mesh.ztunnel_config import (
    KIND_ALIASES,
    Filters,
    connection_table,
    lab_target,
    log_query,
    read_dump_file,
)

DUMP = {
    "workloads": [
        {"name": "client", "namespace": "shop", "workloadIps": ["10.244.1.10"], "node": "node-1"},
        {"name": "echo-2", "namespace": "shop", "workloadIps": ["10.244.2.10"], "node": "node-2"},
    ],
    "services": [
        {
            "name": "echo",
            "namespace": "shop",
            "hostname": "echo.shop.svc.cluster.local",
            "vips": ["/10.96.0.10"],
        }
    ],
    "workloadState": {
        "uid-1": {
            "info": {"name": "client", "namespace": "shop"},
            "connections": {
                "inbound": [],
                "outbound": [
                    {
                        "src": "10.244.1.10:40000",
                        "originalDst": "10.96.0.10:80",
                        "actualDst": "10.244.2.10:15008",
                        "protocol": "HBONE",
                    }
                ],
            },
        },
        "uid-2": {
            "info": {"name": "echo-2", "namespace": "shop"},
            "connections": {
                "inbound": [
                    {"src": "10.244.1.10:40000", "actualDst": "10.244.2.10:8080", "protocol": "HBONE"}
                ],
                "outbound": [],
            },
        },
    },
}


def test_aliases_are_istioctls():
    for alias, kind in {
        "w": "workloads",
        "svc": "services",
        "s": "services",
        "pol": "policies",
        "p": "policies",
    }.items():
        assert KIND_ALIASES[alias] == kind
    assert KIND_ALIASES["cert"] == KIND_ALIASES["certs"] == "certificates"
    assert KIND_ALIASES["cons"] == "connections"


def test_connections_with_names_and_raw():
    table = connection_table(DUMP)
    assert table.headers == ("WORKLOAD", "DIRECTION", "LOCAL", "REMOTE", "REMOTE TARGET", "PROTOCOL")
    assert table.rows == (
        (
            "client.shop",
            "Outbound",
            "client.shop:40000",
            "echo-2.shop:15008",
            "echo.shop.svc.cluster.local:80",
            "HBONE",
        ),
        ("echo-2.shop", "Inbound", "echo-2.shop:8080", "client.shop:40000", "", "HBONE"),
    )
    raw = connection_table(DUMP, Filters(raw=True, direction="inbound"))
    assert raw.rows == (("echo-2.shop", "Inbound", "10.244.2.10:8080", "10.244.1.10:40000", "", "HBONE"),)


def test_file_and_short_output(tmp_path: Path, capsys):
    path = tmp_path / "dump.json"
    path.write_text(json.dumps(DUMP))
    assert main(["zc", "w", "--file", str(path), "-o", "short"]) == 0
    lines = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
    assert lines[0] == "NAMESPACE POD NAME ADDRESS NODE WAYPOINT PROTOCOL"
    assert "shop echo-2 10.244.2.10 node-2 None" in lines  # no protocol in this dump
    assert main(["ztunnel-config", "cons", "-f", str(path), "-o", "json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 2
    assert main(["zc", "w", "--file", str(path), "--node", "node-1"]) == 1
    assert "at most one of --file, --node or --admin" in capsys.readouterr().err


def test_bad_dump_files(tmp_path: Path):
    (tmp_path / "bad.json").write_text("[1]")
    with pytest.raises(AmbientError, match="not an object"):
        read_dump_file(str(tmp_path / "bad.json"))
    with pytest.raises(AmbientError, match="cannot read"):
        read_dump_file(str(tmp_path / "missing.json"))
    assert read_dump_file("-", stdin=io.StringIO('{"workloads": []}')) == {"workloads": []}


def test_node_picks_the_lab_nodes_proxy(tmp_path: Path):
    (tmp_path / "lab.json").write_text(
        json.dumps({"nodes": {"node-1": {"admin": "127.0.0.1:15000", "netns": "am-1-1-node-1"}}})
    )
    target = lab_target(str(tmp_path), "node-1")
    assert (target.address, target.netns) == ("127.0.0.1:15000", "am-1-1-node-1")
    with pytest.raises(AmbientError, match="no such node; nodes: node-1"):
        lab_target(str(tmp_path), "node-9")
    with pytest.raises(AmbientError, match="no lab is running"):
        lab_target(str(tmp_path / "none"), "node-1")


def test_log_query_is_istioctls():
    assert log_query(None, False) == "/logging"
    assert log_query(None, True) == "/logging?level=info&reset"
    assert log_query("debug", False) == "/logging?level=debug"
    assert log_query("access:warning,info", False) == "/logging?level=access=warn,info"
    with pytest.raises(AmbientError, match="unrecognized logging level: loud"):
        log_query("loud", False)
    with pytest.raises(AmbientError, match="cannot be combined"):
        log_query("info", True)


def test_bash_completion_knows_every_command():
    words = completion_table()
    assert {"lab", "ztunnel-config", "zc", "demo", "completion"} <= set(words[""])
    assert {"up", "down", "status", "apply", "get", "logs"} <= set(words["lab"])
    assert "--cni-agent-run-dir" in words["cni-agent"]
    script = bash_script(words)
    done = subprocess.run(
        [
            "bash",
            "-c",
            script + '\nCOMP_WORDS=(ambient lab ap); COMP_CWORD=2; _ambient; echo "${COMPREPLY[@]}"',
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.split() == ["apply"]
