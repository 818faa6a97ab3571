"""`ambient ztunnel-config`: dump dict -> istioctl's tables, without sockets.

The input is the /config_dump golden file (tests/unit/golden/config_dump.json), so these
tables are what the CLI prints for the proxy state the dump tests pin down.
"""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime

import pytest
import yaml

from ambient_mesh.cli import build_parser
from ambient_mesh.errors import AmbientError
from ambient_mesh.ztunnel_config import (
    Filters,
    certificate_table,
    fetch_config_dump,
    gateway_name,
    policy_table,
    render,
    run,
    selection,
    service_table,
    tables,
    workload_table,
)
from tests.helpers.paths import UNIT_GOLDEN

GOLDEN = UNIT_GOLDEN / "config_dump.json"
NOW = datetime(2025, 6, 1, tzinfo=UTC)


@pytest.fixture
def dump() -> dict:
    return json.loads(GOLDEN.read_text())


def test_workload_rows(dump: dict) -> None:
    table = workload_table(dump)
    assert table.headers == ("NAMESPACE", "POD NAME", "ADDRESS", "NODE", "WAYPOINT", "PROTOCOL")
    assert table.rows == (
        ("shop", "cart-7f9c", "10.0.1.10", "node-a", "waypoint", "HBONE"),  # waypoint by hostname
        ("shop", "remote", "", "", "None", "TCP"),
        ("shop", "waypoint-0", "10.0.1.9", "node-a", "None", "HBONE"),
        ("shop", "web-1a2b", "10.0.1.11", "node-b", "waypoint", "TCP"),  # waypoint by VIP
    )


def test_workload_filters_ignore_case(dump: dict) -> None:
    assert [r[1] for r in workload_table(dump, Filters(node="NODE-A")).rows] == ["cart-7f9c", "waypoint-0"]
    assert [r[1] for r in workload_table(dump, Filters(address="10.0.1.11")).rows] == ["web-1a2b"]
    assert workload_table(dump, Filters(namespace="other")).rows == ()


def test_service_rows_count_healthy_endpoints(dump: dict) -> None:
    table = service_table(dump)
    assert table.headers == ("NAMESPACE", "SERVICE NAME", "SERVICE VIP", "WAYPOINT", "ENDPOINTS")
    assert table.rows == (
        ("shop", "cart", "10.96.7.7", "waypoint", "2/3"),  # web is Unhealthy but kept (AllowAll)
        ("shop", "waypoint", "10.96.0.9", "None", "1/1"),
    )


def test_policy_rows_sorted(dump: dict) -> None:
    table = policy_table(dump)
    assert table.headers == ("NAMESPACE", "POLICY NAME", "ACTION", "SCOPE")
    assert table.rows == (
        ("", "allow-all-from-mesh", "Allow", "Global"),
        ("shop", "no-debug-port", "Deny", "Namespace"),
        ("shop", "only-frontend", "Allow", "WorkloadSelector"),
    )
    assert [r[1] for r in policy_table(dump, Filters(namespace="SHOP")).rows] == [
        "no-debug-port",
        "only-frontend",
    ]


def test_certificate_rows(dump: dict) -> None:
    table = certificate_table(dump, NOW)
    assert table.headers == (
        "CERTIFICATE NAME",
        "TYPE",
        "STATUS",
        "VALID CERT",
        "SERIAL NUMBER",
        "NOT AFTER",
        "NOT BEFORE",
    )
    leaf, root, gone, web = table.rows
    # The golden leaf has a masked serial and expired in January; the test root is valid until 2045.
    assert leaf == (
        "spiffe://cluster.local/ns/shop/sa/cart",
        "Leaf",
        "Available",
        "false",
        "NA",
        "2025-01-02T04:04:05Z",
        "2025-01-02T03:04:05Z",
    )
    assert root[1:4] == ("Root", "Available", "true")
    assert root[4] == format(int(dump["certificates"][0]["rootCerts"][0]["serialNumber"]), "x")
    assert gone == ("spiffe://cluster.local/ns/shop/sa/gone", "NA", "Unavailable", "false", "NA", "NA", "NA")
    assert web[2] == "Initializing"


def test_certificate_rows_legacy_chain_and_intermediates() -> None:
    cert = {
        "serialNumber": "255",
        "validFrom": "2025-01-01T00:00:00Z",
        "expirationTime": "2026-01-01T00:00:00Z",
    }
    legacy = {"certificates": [{"identity": "id", "state": "Available", "certChain": [cert, cert, cert]}]}
    assert [r[1] for r in certificate_table(legacy, NOW).rows] == ["Leaf", "Intermediate", "Root"]
    assert certificate_table(legacy, NOW).rows[0][3:5] == ("true", "ff")
    modern = {
        "certificates": [
            {"identity": "id", "state": "Available", "certChain": [cert, cert], "rootCerts": [cert]}
        ]
    }
    assert [r[1] for r in certificate_table(modern, NOW).rows] == ["Leaf", "Intermediate", "Root"]


def test_gateway_name() -> None:
    services = [{"name": "wp", "namespace": "ns", "hostname": "wp.ns.svc", "vips": ["/1.2.3.4"]}]
    assert gateway_name(None, services) == "None"
    assert gateway_name({"destination": "/1.2.3.4"}, services) == "wp"
    assert gateway_name({"destination": "ns/wp.ns.svc"}, services) == "wp"
    assert gateway_name({"destination": "/9.9.9.9"}, services) == "NA"


def test_older_dump_shapes_keyed_by_address() -> None:
    old = {
        "workloads": {
            "/10.0.0.1": {
                "name": "a",
                "namespace": "ns",
                "workloadIps": ["10.0.0.1"],
                "protocol": "TCP",
                "node": "n",
            }
        },
        "services": {"/10.96.0.1": {"name": "s", "namespace": "ns", "vips": ["/10.96.0.1"], "endpoints": {}}},
    }
    assert workload_table(old).rows == (("ns", "a", "10.0.0.1", "n", "None", "TCP"),)
    assert service_table(old).rows == (("ns", "s", "10.96.0.1", "None", "0/0"),)


def test_table_output_uses_rich_and_shows_every_view(dump: dict) -> None:
    out = io.StringIO()
    render("all", dump, output="table", filters=Filters(), now=NOW, out=out)
    text = out.getvalue()
    for header in ("POD NAME", "SERVICE VIP", "POLICY NAME", "CERTIFICATE NAME", "NOT BEFORE"):
        assert header in text
    assert "spiffe://cluster.local/ns/shop/sa/cart" in text  # not cut: the console is as wide as the rows
    assert [t.title for t in tables("all", dump, Filters(), NOW)] == [
        "workloads",
        "services",
        "policies",
        "certificates",
    ]


def test_json_and_yaml_outputs_select_and_filter(dump: dict) -> None:
    out = io.StringIO()
    render("services", dump, output="json", filters=Filters(), now=NOW, out=out)
    assert [s["name"] for s in json.loads(out.getvalue())] == ["cart", "waypoint"]
    out = io.StringIO()
    render("workloads", dump, output="yaml", filters=Filters(node="node-b"), now=NOW, out=out)
    assert [w["name"] for w in yaml.safe_load(out.getvalue())] == ["web-1a2b"]
    assert selection("all", dump, Filters()) is dump
    assert selection("policies", dump, Filters(namespace="shop"))[0]["name"] == "no-debug-port"


def test_run_with_injected_fetch(dump: dict) -> None:
    asked = []

    def fetch(admin: str) -> dict:
        asked.append(admin)
        return dump

    out = io.StringIO()
    assert run("policies", admin="127.0.0.9:15000", output="table", out=out, fetch=fetch, now=NOW) == 0
    assert asked == ["127.0.0.9:15000"] and "only-frontend" in out.getvalue()
    with pytest.raises(AmbientError, match="unknown view"):
        run("listeners", out=out, fetch=fetch)


def test_fetch_errors_say_what_to_check() -> None:
    with pytest.raises(AmbientError, match="--admin") as bad:
        fetch_config_dump("no-port-here")
    assert "host:port" in str(bad.value)
    # Port 1 on loopback: nothing listens there, the connection is refused at once.
    with pytest.raises(AmbientError, match="cannot reach") as refused:
        fetch_config_dump("127.0.0.1:1", timeout_s=2)
    assert "is the node proxy running? is --admin right?" in str(refused.value)


def test_cli_parses_the_subcommand() -> None:
    args = build_parser().parse_args(
        [
            "ztunnel-config",
            "workloads",
            "--admin",
            "127.0.0.1:15000",
            "-o",
            "json",
            "--namespace",
            "shop",
            "--node",
            "node-a",
        ]
    )
    assert (args.kind, args.admin, args.output, args.namespace, args.node) == (
        "workloads",
        "127.0.0.1:15000",
        "json",
        "shop",
        "node-a",
    )
    assert args.func.__name__ == "cmd_ztunnel_config"
