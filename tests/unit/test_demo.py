"""What the demo reads to decide a step passed (ambient_mesh/demo.py): curl's output with the
reply's headers, and the waypoint's `istio_requests_total`. The steps themselves run on the lab
(`bash scripts/demo.sh`)."""

from __future__ import annotations

from collections.abc import Sequence

from ambient_mesh.demo import (
    CANARY_POD,
    CLIENT,
    MAINTENANCE,
    Reply,
    canary_requests,
    curl_reply,
    requests_by_code,
    waypoint_requests,
)
from ambient_mesh.host.commands import CompletedCommand
from ambient_mesh.kube.load import parse_documents


class FakeLab:
    """Answers `exec` with a canned curl run, and records the argv."""

    def __init__(self, stdout: str, stderr: str = "", returncode: int = 0) -> None:
        self.result = (stdout.encode(), stderr.encode(), returncode)
        self.argv: list[str] = []

    def exec(self, key: str, argv: Sequence[str], *, check: bool = True) -> CompletedCommand:
        assert key == CLIENT and not check
        self.argv = list(argv)
        out, err, rc = self.result
        return CompletedCommand(argv=tuple(argv), returncode=rc, stdout=out, stderr=err)


def test_a_reply_from_the_waypoint_and_the_replica_behind_it():
    lab = FakeLab(
        "GET / HTTP/1.1\nHostname=shop/echo-canary\n\n200",
        "HTTP/1.1 200 OK\r\nserver: istio-envoy\r\n\r\n",
    )
    reply = curl_reply(lab, CLIENT, "http://echo/", ("x-canary: true",))  # type: ignore[arg-type]
    assert reply == Reply(
        status=200,
        server="istio-envoy",
        body="GET / HTTP/1.1\nHostname=shop/echo-canary\n",
        answered_by=CANARY_POD,
    )
    assert reply.by_waypoint
    assert lab.argv[-3:] == ["-H", "x-canary: true", "http://echo/"]


def test_a_reply_the_waypoint_made_itself_and_no_reply():
    lab = FakeLab("RBAC: access denied\n403", "HTTP/1.1 403 Forbidden\r\nServer: istio-envoy\r\n")
    reply = curl_reply(lab, CLIENT, "http://echo/admin")  # type: ignore[arg-type]
    assert (reply.status, reply.body.strip(), reply.answered_by) == (403, "RBAC: access denied", "")
    none = curl_reply(FakeLab("\n000", returncode=28), CLIENT, "http://echo/")  # type: ignore[arg-type]
    assert (none.status, none.by_waypoint, str(none)) == (0, False, "no response from '', Server: -")


def _series(code: str, service: str, workload: str, n: int, reporter: str = "waypoint") -> str:
    namespace = "unknown" if workload == "unknown" else "shop"
    return (
        f'istio_requests_total{{reporter="{reporter}",source_workload="client",source_workload_namespace="shop",'
        f'source_principal="spiffe://cluster.local/ns/shop/sa/client",destination_service_name="{service}",'
        f'destination_workload="{workload}",destination_workload_namespace="{namespace}",response_code="{code}",'
        f'response_flags="-"}} {n}\n'
    )


def test_the_waypoints_requests_by_code_and_the_canarys_share():
    text = (
        "# TYPE istio_requests_total counter\n"
        + _series("200", "echo", "echo-1", 5)
        + _series("200", "echo-canary", "echo-canary", 7)
        # A DENY's 403: the route's service, no endpoint (Istio's labels for a local reply).
        + _series("403", "echo", "unknown", 2)
        + _series("503", "unknown", "unknown", 1)  # a direct response: no service either
        + _series("200", "echo", "echo-1", 9, reporter="destination")  # not the waypoint's
    )
    table = waypoint_requests(text)
    assert len(table.rows) == 4
    assert requests_by_code(table, CLIENT) == {"200": 12, "403": 2, "503": 1}
    assert (
        "shop/client",
        "spiffe://cluster.local/ns/shop/sa/client",
        "echo",
        "unknown",
        "403",
        "-",
        "2",
    ) in (table.rows)
    assert (
        "shop/client",
        "spiffe://cluster.local/ns/shop/sa/client",
        "echo",
        "shop/echo-1",
        "200",
        "-",
        "5",
    ) in (table.rows)
    assert canary_requests(table, CLIENT) == 7
    assert requests_by_code(table, "legacy/client") == {}
    assert waypoint_requests("").rows == ()


def test_the_demos_l7_objects_are_read_without_complaint():
    from ambient_mesh.demo import CANARY, CANARY_POD_OBJECT, CANARY_ROUTE, DENY_ADMIN

    for text in (CANARY, CANARY_POD_OBJECT, CANARY_ROUTE, DENY_ADMIN, MAINTENANCE):
        assert not parse_documents(text, "demo").errors, text


def test_what_counts_as_the_waypoints_own_answer_and_as_a_replicas():
    from ambient_mesh.demo import made_by_waypoint, served_by_replica

    denied = Reply(status=403, server="istio-envoy", body="RBAC: access denied\n", answered_by="")
    assert made_by_waypoint(403, "RBAC: access denied")(denied)
    assert not made_by_waypoint(403, "RBAC: access denied")(
        Reply(status=403, server="istio-envoy", body="RBAC: access denied", answered_by="shop/echo-1")
    )
    assert not made_by_waypoint(503, "closed")(Reply(status=503, server="", body="closed", answered_by=""))
    assert served_by_replica(Reply(status=200, server="istio-envoy", body="", answered_by="shop/echo-2"))
    assert not served_by_replica(Reply(status=200, server="istio-envoy", body="", answered_by=CANARY_POD))
    assert not served_by_replica(Reply(status=200, server="", body="", answered_by="shop/echo-2"))
