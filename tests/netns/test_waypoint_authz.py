"""Tier 3: L7 AuthorizationPolicy (targetRefs) enforced by a real waypoint Envoy.

The mesh and apps are the route tests' (conftest's `rmesh`, tests/helpers/waypoint_routes.py).
The caller is the client pod
(`spiffe://cluster.local/ns/default/sa/client`), whose identity the waypoint takes from the
HBONE connection its node proxy opened; a denied request gets Envoy's own 403
`RBAC: access denied`. On the TCP service (`echo`, a TCP echo app) the same policies apply with
TCP semantics (translate/tcp_authz.py): a denied connection is closed by the waypoint before
its first byte reaches the app.
"""

from __future__ import annotations

import pytest

from tests.helpers.waypoint_mesh import IO_TIMEOUT_S, TCP_VIP
from tests.helpers.waypoint_routes import V2_VIP, request, served, virtual_service

# `rmesh` and `routes` are tests/netns/conftest.py's: a mesh per module and a per-test object writer.

DENIED = b"RBAC: access denied"


def policy(name: str, spec: str, *, namespace: str = "default", annotations: str = "") -> str:
    meta = f"{{name: {name}, namespace: {namespace}{', annotations: {' + annotations + '}' if annotations else ''}}}"
    return f"""
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {meta}
spec:
{spec}
"""


GATEWAY = "  targetRefs: [{group: gateway.networking.k8s.io, kind: Gateway, name: waypoint}]"
ROUTED = '  targetRefs: [{group: "", kind: Service, name: routed}]'
ECHO = '  targetRefs: [{group: "", kind: Service, name: echo}]'
CLIENT = "cluster.local/ns/default/sa/client"


def denied(r) -> bool:  # type: ignore[no-untyped-def]
    return r.status == 403 and r.body == DENIED


def stat(mesh, needle: str) -> int:  # type: ignore[no-untyped-def]
    total = 0
    for line in mesh.envoy_admin("/stats").decode(errors="replace").splitlines():
        name, _, value = line.rpartition(": ")
        if needle in name and value.strip().isdigit():
            total += int(value)
    return total


def test_deny_by_path_answers_envoys_403(rmesh, routes):
    routes(
        policy(
            "deny-admin",
            f"{GATEWAY}\n  action: DENY\n  rules: [{{to: [{{operation: {{paths: [/admin, /admin/*]}}}}]}}]",
        )
    )
    served(rmesh, lambda: denied(request(rmesh, "/admin/users")), "DENY /admin")
    assert denied(request(rmesh, "/admin"))
    assert request(rmesh, "/administrator").status == 200
    assert request(rmesh, "/public").status == 200


def test_allow_by_principal_and_method(rmesh, routes):
    routes(
        policy(
            "allow-client-get",
            f"{GATEWAY}\n  action: ALLOW\n  rules: [{{from: [{{source: {{principals: [cluster.local/ns/default/sa/client]}}}}], "
            "to: [{operation: {methods: [GET]}}]}]",
        )
    )
    served(rmesh, lambda: denied(request(rmesh, "/p", method="POST")), "POST refused by ALLOW GET")
    assert request(rmesh, "/g").status == 200
    # Another identity allowed instead: the client's GET is refused too.
    routes(
        policy(
            "allow-client-get",
            f"{GATEWAY}\n  action: ALLOW\n  rules: [{{from: [{{source: {{principals: [cluster.local/ns/default/sa/other]}}}}]}}]",
        )
    )
    served(rmesh, lambda: denied(request(rmesh, "/g")), "GET refused for another principal")


def test_namespaces_and_ip_blocks(rmesh, routes):
    client_ip = str(rmesh.client.ipv4)
    routes(
        policy(
            "by-source",
            f"{GATEWAY}\n  action: ALLOW\n  rules:\n"
            "  - from: [{source: {namespaces: [default]}}]\n"
            "    to: [{operation: {paths: [/okns]}}]\n"
            f"  - from: [{{source: {{ipBlocks: [{client_ip}/32]}}}}]\n"
            "    to: [{operation: {paths: [/okip]}}]\n"
            "  - from: [{source: {namespaces: [elsewhere]}}]\n"
            "    to: [{operation: {paths: [/ns]}}]\n"
            "  - from: [{source: {ipBlocks: [192.0.2.0/24]}}]\n"
            "    to: [{operation: {paths: [/ip]}}]\n",
        )
    )
    served(rmesh, lambda: denied(request(rmesh, "/ns")), "namespace mismatch refused")
    assert request(rmesh, "/okns").status == 200
    assert request(rmesh, "/okip").status == 200
    assert denied(request(rmesh, "/ip"))


def test_path_templates_hosts_and_ports(rmesh, routes):
    routes(
        policy(
            "ops",
            f"{GATEWAY}\n  action: ALLOW\n  rules:\n"
            "  - to: [{operation: {paths: ['/api/{*}/items'], hosts: ['routed*'], ports: ['80']}}]\n"
            "  - to: [{operation: {paths: ['/any/{**}'], hosts: ['other.example'], ports: ['80']}}]\n"
            "  - to: [{operation: {paths: ['/port'], ports: ['81']}}]\n",
        )
    )
    # Refusals first: before the push everything is allowed.
    served(rmesh, lambda: denied(request(rmesh, "/api/x/y/items")), "a second segment refused")
    assert request(rmesh, "/api/x/items").status == 200
    assert denied(request(rmesh, "/any/a/b/c"))  # host routed is not other.example
    assert request(rmesh, "/any/a/b/c", host="Other.Example").status == 200  # hosts: case-insensitive
    assert denied(request(rmesh, "/port"))


def test_when_request_headers(rmesh, routes):
    routes(
        policy(
            "block-header",
            f"{GATEWAY}\n  action: DENY\n  rules: [{{when: [{{key: 'request.headers[x-block]', values: ['yes', 'pre*']}}]}}]",
        )
    )
    served(rmesh, lambda: denied(request(rmesh, headers={"x-block": "yes"})), "DENY by header")
    assert denied(request(rmesh, headers={"x-block": "prefixed"}))
    assert request(rmesh, headers={"x-block": "no"}).status == 200
    assert request(rmesh).status == 200


def test_service_target_binds_only_that_service(rmesh, routes):
    routes(policy("deny-routed", f"{ROUTED}\n  action: DENY\n  rules: [{{}}]"))
    served(rmesh, lambda: denied(request(rmesh)), "DENY on routed")
    assert request(rmesh, vip=V2_VIP, host="routed-v2").status == 200


def test_gateway_class_policy_from_the_root_namespace(rmesh, routes):
    routes(
        policy(
            "class-deny",
            "  targetRefs: [{group: gateway.networking.k8s.io, kind: GatewayClass, name: istio-waypoint}]\n"
            "  action: DENY\n  rules: [{to: [{operation: {paths: [/cls]}}]}]",
            namespace="istio-system",
        )
    )
    served(rmesh, lambda: denied(request(rmesh, "/cls")), "GatewayClass DENY")
    assert denied(request(rmesh, "/cls", vip=V2_VIP, host="routed-v2"))


def test_a_selector_policy_never_applies_to_the_waypoint(rmesh, routes):
    routes(
        policy(
            "selector-deny",
            "  selector: {matchLabels: {app: server}}\n  action: DENY\n  rules: [{to: [{operation: {methods: [GET]}}]}]",
        )
        + "---"
        + policy(
            "marker", f"{GATEWAY}\n  action: DENY\n  rules: [{{to: [{{operation: {{paths: [/marker]}}}}]}}]"
        ),
    )
    served(rmesh, lambda: denied(request(rmesh, "/marker")), "the marker policy")
    assert request(rmesh, "/get").status == 200


def test_audit_and_dry_run_do_not_refuse(rmesh, routes):
    before_shadow = stat(rmesh, "rbac.istio_dry_run_deny_.shadow_denied")
    # AUDIT (RBAC action LOG) marks the request for the access log in dynamic metadata; a
    # response header shows the mark here.
    hint = virtual_service(
        '  - headers: {response: {set: {x-audit: "%DYNAMIC_METADATA(envoy.common:access_log_hint)%"}}}\n'
        "    route: [{destination: {host: routed}}]"
    )
    routes(
        policy(
            "audit", f"{GATEWAY}\n  action: AUDIT\n  rules: [{{to: [{{operation: {{paths: [/audited]}}}}]}}]"
        )
        + "---"
        + policy(
            "dry",
            f"{GATEWAY}\n  action: DENY\n  rules: [{{to: [{{operation: {{paths: [/audited]}}}}]}}]",
            annotations='istio.io/dry-run: "true"',
        )
        + "---"
        + policy(
            "marker", f"{GATEWAY}\n  action: DENY\n  rules: [{{to: [{{operation: {{paths: [/marker]}}}}]}}]"
        )
        + "---"
        + hint,
    )
    served(rmesh, lambda: denied(request(rmesh, "/marker")), "the marker policy")
    served(rmesh, lambda: "x-audit" in request(rmesh, "/x").headers, "the audit hint header")
    audited = request(rmesh, "/audited")
    assert audited.status == 200
    assert audited.headers["x-audit"] == "true"
    assert request(rmesh, "/not-audited").headers["x-audit"] == "false"
    assert stat(rmesh, "rbac.istio_dry_run_deny_.shadow_denied") > before_shadow, rmesh.envoy_stats("rbac")


@pytest.mark.parametrize("action", ["ALLOW"])
def test_allow_with_no_rules_allows_nothing(rmesh, routes, action):
    routes(policy("nothing", f"{ROUTED}\n  action: {action}"))
    served(rmesh, lambda: denied(request(rmesh)), "allow-nothing")


def test_custom_without_a_provider_denies_what_it_matches(rmesh, routes):
    """No ext_authz provider exists here: as istiod does for a CUSTOM policy whose provider is
    missing, the requests its rules match are refused (fail closed), the rest pass."""
    routes(
        policy(
            "ext",
            f"{GATEWAY}\n  action: CUSTOM\n  provider: {{name: my-ext-authz}}\n"
            "  rules: [{to: [{operation: {paths: [/checked/*]}}]}]",
        )
    )
    served(rmesh, lambda: denied(request(rmesh, "/checked/a")), "CUSTOM /checked")
    assert request(rmesh, "/open").status == 200


# -- TCP: the echo service (TCP_VIP:9000) behind the same waypoint -----------------------------


def tcp_echo(mesh, payload: bytes = b"ping over tcp") -> str:  # type: ignore[no-untyped-def]
    """ "echoed" when the TCP echo app answered through the waypoint, "closed" when the
    connection was closed (or reset) with no answer; a connection left hanging fails."""
    try:
        with mesh.socks(TCP_VIP, 9000) as sock:
            sock.settimeout(IO_TIMEOUT_S)
            sock.sendall(payload)
            data = b""
            while len(data) < len(payload):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
    except TimeoutError:
        pytest.fail(f"the TCP connection neither echoed nor closed in {IO_TIMEOUT_S} s")
    except OSError:  # reset, or the SOCKS5 connect refused
        return "closed"
    if data == payload:
        return "echoed"
    assert data == b"", f"a partial or wrong answer: {data!r}"
    return "closed"


def tcp_served_without_policy(mesh) -> None:  # type: ignore[no-untyped-def]
    """Wait until the previous test's policies are gone from the TCP chain (the `routes` fixture
    waits on HTTP only, and a waypoint-wide CUSTOM or path DENY refuses every TCP connection), so
    a refusal seen next is the new policy's."""
    served(mesh, lambda: tcp_echo(mesh) == "echoed", "TCP served with no policy")


def test_tcp_allow_of_another_principal_refuses_then_the_clients_serves(rmesh, routes):
    tcp_served_without_policy(rmesh)
    denied_before = stat(rmesh, "tcp.rbac.denied")
    routes(
        policy(
            "echo-allow",
            f"{ECHO}\n  action: ALLOW\n  rules: [{{from: [{{source: {{principals: [cluster.local/ns/default/sa/other]}}}}]}}]",
        )
    )
    served(rmesh, lambda: tcp_echo(rmesh) == "closed", "TCP refused: ALLOW of another principal")
    assert tcp_echo(rmesh) == "closed"
    assert stat(rmesh, "tcp.rbac.denied") > denied_before, rmesh.envoy_stats("rbac")
    # The client's own principal (the HBONE peer's identity): served.
    routes(
        policy(
            "echo-allow",
            f"{ECHO}\n  action: ALLOW\n  rules: [{{from: [{{source: {{principals: [{CLIENT}]}}}}], "
            "to: [{operation: {ports: ['9000']}}]}]",
        )
    )
    served(rmesh, lambda: tcp_echo(rmesh) == "echoed", "TCP served: ALLOW of the client")
    assert stat(rmesh, "tcp.rbac.allowed") > 0, rmesh.envoy_stats("rbac")
    # The HTTP service is not bound by echo's policy.
    assert request(rmesh).status == 200


def test_tcp_deny_of_the_client_refuses(rmesh, routes):
    tcp_served_without_policy(rmesh)
    routes(
        policy(
            "echo-deny",
            f"{ECHO}\n  action: DENY\n  rules: [{{from: [{{source: {{namespaces: [default], principals: [{CLIENT}]}}}}]}}]",
        )
    )
    served(rmesh, lambda: tcp_echo(rmesh) == "closed", "TCP refused: DENY of the client")
    assert request(rmesh).status == 200


def test_tcp_allow_with_only_http_fields_allows_nothing(rmesh, routes):
    tcp_served_without_policy(rmesh)
    routes(
        policy(
            "echo-http-only",
            f"{ECHO}\n  action: ALLOW\n  rules: [{{from: [{{source: {{principals: [{CLIENT}]}}}}], "
            "to: [{operation: {methods: [GET]}}]}]",
        )
    )
    served(rmesh, lambda: tcp_echo(rmesh) == "closed", "TCP refused: an ALLOW no connection can match")


def test_gateway_deny_with_http_fields_refuses_tcp_and_keeps_http_rules(rmesh, routes):
    """A waypoint-wide DENY of a path: on HTTP only that path, on TCP (no path) every connection."""
    tcp_served_without_policy(rmesh)
    routes(
        policy(
            "deny-path",
            f"{GATEWAY}\n  action: DENY\n  rules: [{{to: [{{operation: {{paths: [/blocked]}}}}]}}]",
        )
    )
    served(rmesh, lambda: denied(request(rmesh, "/blocked")), "DENY /blocked")
    assert request(rmesh, "/open").status == 200
    served(rmesh, lambda: tcp_echo(rmesh) == "closed", "TCP refused by the path-only DENY")
