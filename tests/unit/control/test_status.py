"""control/status.py: the conditions written into what the control plane reads, for each case
where the node proxy enforces less or other than asked; and the lab's apply/get showing them."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from ambient_mesh.control.status import (
    Condition,
    changed_status,
    compute_status,
    merge_conditions,
    warnings_for,
)
from ambient_mesh.kube.load import parse_documents
from ambient_mesh.kube.store import KubeStore
from ambient_mesh.lab import apply as verbs

NS = """
apiVersion: v1
kind: Namespace
metadata: {name: demo, labels: {istio.io/dataplane-mode: ambient}}
"""


def status_of(text: str) -> dict:
    result = parse_documents(NS + "---\n" + text, "t.yaml")
    assert not result.errors, result.errors
    return compute_status(KubeStore(result.objects))


def policy(name: str, spec: str) -> str:
    return f"""
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: {name}, namespace: demo}}
spec: {spec}
"""


def one(status: dict, kind: str, name: str, namespace: str = "demo") -> Condition:
    (cond,) = status[(kind, namespace, name)]
    return cond


@pytest.mark.parametrize(
    ("spec", "status", "reason", "says"),
    [
        (
            "{action: ALLOW, rules: [{from: [{source: {namespaces: [demo]}}]}]}",
            True,
            "Accepted",
            "attached to ztunnel",
        ),
        # an ALLOW whose rules all need HTTP: sent with no rules, so it allows nothing
        (
            "{action: ALLOW, rules: [{to: [{operation: {methods: [GET]}}]}]}",
            True,
            "UnsupportedValue",
            "allows nothing",
        ),
        (
            "{action: ALLOW, rules: [{to: [{operation: {methods: [GET]}}]}, {from: [{source: {namespaces: [a]}}]}]}",
            True,
            "UnsupportedValue",
            "omits the ALLOW rules",
        ),
        # a DENY whose rules are all HTTP-only: denies nothing
        (
            "{action: DENY, rules: [{to: [{operation: {paths: [/admin]}}]}]}",
            True,
            "UnsupportedValue",
            "denies nothing",
        ),
        (
            "{action: DENY, rules: [{when: [{key: 'request.headers[x]', values: [y]}]}]}",
            True,
            "UnsupportedValue",
            "denies nothing",
        ),
        # a DENY with L4 parts: enforced on them alone
        (
            "{action: DENY, rules: [{from: [{source: {namespaces: [evil]}}], to: [{operation: {methods: [POST]}}]}]}",
            True,
            "UnsupportedValue",
            "L4 parts alone",
        ),
        ("{action: CUSTOM, provider: {name: ext}, rules: [{}]}", False, "UnsupportedValue", "CUSTOM action"),
        ("{action: AUDIT, rules: [{}]}", False, "UnsupportedValue", "AUDIT action"),
    ],
)
def test_ztunnel_accepted_names_what_the_node_proxy_does(spec, status, reason, says):
    cond = one(status_of(policy("p", spec)), "AuthorizationPolicy", "p")
    assert cond.type == "ZtunnelAccepted"
    assert (cond.status, cond.reason) == (status, reason)
    assert says in cond.message
    assert cond.negative == (reason != "Accepted")


def test_dry_run_is_not_sent_without_wds_dry_run():
    text = """
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: p, namespace: demo, annotations: {istio.io/dry-run: "true"}}
spec: {action: DENY, rules: [{}]}
"""
    cond = one(status_of(text), "AuthorizationPolicy", "p")
    assert not cond.status and "dry-run" in cond.message


def test_waypoint_accepted_for_target_refs():
    text = (
        policy(
            "to-gw",
            "{targetRefs: [{kind: Gateway, group: gateway.networking.k8s.io, name: waypoint}], rules: [{}]}",
        )
        + "---"
        + policy(
            "to-missing",
            "{targetRefs: [{kind: Gateway, group: gateway.networking.k8s.io, name: nope}], rules: [{}]}",
        )
        + "---"
        + policy("to-svc", "{targetRefs: [{kind: Service, group: '', name: plain}], rules: [{}]}")
        + "---"
        + policy(
            "two",
            "{targetRefs: [{kind: Gateway, group: gateway.networking.k8s.io, name: waypoint},"
            " {kind: Service, group: '', name: missing}], rules: [{}]}",
        )
        + """---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: waypoint, namespace: demo}
spec: {gatewayClassName: istio-waypoint, listeners: [{name: mesh, port: 15008, protocol: HBONE}]}
status: {addresses: [{type: IPAddress, value: 10.0.0.9}]}
---
apiVersion: v1
kind: Service
metadata: {name: plain, namespace: demo}
spec: {clusterIP: 10.96.0.3, ports: [{port: 80}]}
"""
    )
    st = status_of(text)
    assert (
        str(one(st, "AuthorizationPolicy", "to-gw"))
        == "WaypointAccepted=True (Accepted): bound to demo/waypoint"
    )
    assert one(st, "AuthorizationPolicy", "to-missing").reason == "TargetNotFound"
    svc = one(st, "AuthorizationPolicy", "to-svc")
    assert (svc.status, svc.reason) == (False, "AncestorNotBound")
    both = one(st, "AuthorizationPolicy", "two")
    assert (both.status, both.reason) == (True, "PartiallyInvalid") and both.negative
    assert both.message == "Invalid targetRefs: Service.core:demo/missing"
    assert one(st, "Gateway", "waypoint").status


def test_waypoint_bound_on_services():
    text = """
apiVersion: v1
kind: Service
metadata: {name: good, namespace: demo, labels: {istio.io/use-waypoint: waypoint}}
spec: {clusterIP: 10.96.0.3, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: bad, namespace: demo, labels: {istio.io/use-waypoint: nowhere}}
spec: {clusterIP: 10.96.0.4, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: none, namespace: demo}
spec: {clusterIP: 10.96.0.5, ports: [{port: 80}]}
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: waypoint, namespace: demo}
spec: {gatewayClassName: istio-waypoint, listeners: [{name: mesh, port: 15008, protocol: HBONE}]}
status: {addresses: [{type: IPAddress, value: 10.0.0.9}]}
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: unready, namespace: demo}
spec: {gatewayClassName: istio-waypoint, listeners: [{name: mesh, port: 15008, protocol: HBONE}]}
"""
    st = status_of(text)
    good = one(st, "Service", "good")
    assert (good.type, good.status, good.reason) == ("istio.io/WaypointBound", True, "WaypointAccepted")
    bad = one(st, "Service", "bad")
    assert (bad.status, bad.reason) == (False, "WaypointNotFound") and "demo/nowhere" in bad.message
    assert ("Service", "demo", "none") not in st
    unready = one(st, "Gateway", "unready")
    assert (unready.type, unready.status, unready.reason) == ("Programmed", False, "AddressNotAssigned")


def test_peer_authentication_conflicts_and_ignored_selector():
    text = """
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: old, namespace: demo, creationTimestamp: "2026-01-01T00:00:00Z"}
spec: {mtls: {mode: STRICT}}
---
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: young, namespace: demo, creationTimestamp: "2026-02-01T00:00:00Z"}
spec: {mtls: {mode: PERMISSIVE}}
---
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: rooted, namespace: istio-system}
spec: {selector: {matchLabels: {app: a}}, mtls: {mode: STRICT}}
"""
    st = status_of(text)
    assert one(st, "PeerAuthentication", "old").status
    young = one(st, "PeerAuthentication", "young")
    assert (young.status, young.reason) == (False, "Conflicted") and "demo/old" in young.message
    assert one(st, "PeerAuthentication", "rooted", "istio-system").reason == "Ignored"


def test_changes_and_merge_keep_others_and_transition_times():
    a = Condition(type="ZtunnelAccepted", status=True, reason="Accepted", message="m")
    b = Condition(type="ZtunnelAccepted", status=True, reason="UnsupportedValue", message="n")
    key = ("AuthorizationPolicy", "demo", "p")
    assert changed_status({key: (a,)}, {key: (a,)}) == {}
    assert changed_status({key: (a,)}, {key: (b,)}) == {key: (b,)}
    assert changed_status({key: (a,)}, {}) == {key: ()}
    other = Condition(type="Theirs", status=True, reason="R", message="", last_transition_time="t0")
    old = Condition(
        type="ZtunnelAccepted", status=True, reason="Accepted", message="m", last_transition_time="t1"
    )
    merged = merge_conditions((other, old), (b,), datetime(2026, 5, 1, tzinfo=UTC))
    assert merged[0] == other and merged[1].last_transition_time == "t1"
    assert warnings_for({key: (b,)}, [key]) == ["Warning: AuthorizationPolicy demo/p: " + str(b)]


def test_lab_apply_warns_and_get_shows_status(tmp_path: Path):
    objects = tmp_path / "objects"
    objects.mkdir()
    text = NS + "---" + policy("get-only", "{action: ALLOW, rules: [{to: [{operation: {methods: [GET]}}]}]}")
    manifests = verbs.check(text, "m.yaml", default_namespace="demo", allow_pods=False)
    lines = verbs.apply(objects, manifests)
    assert lines[-1] == "authorizationpolicy.security.istio.io/get-only created"
    (warning,) = verbs.apply_warnings(objects, manifests)
    assert warning.startswith(
        "Warning: AuthorizationPolicy demo/get-only: ZtunnelAccepted=True (UnsupportedValue)"
    )
    # the control plane's status files (its --state-dir/status) show up in `get -o yaml`
    from ambient_mesh.control.status import DirectoryStatusWriter

    status_dir = tmp_path / "status"
    import asyncio

    st = compute_status(KubeStore(parse_documents(text, "m").objects))
    asyncio.run(DirectoryStatusWriter(status_dir).write(st, datetime(2026, 1, 1, tzinfo=UTC)))
    (doc,) = verbs.get_documents(objects, "AuthorizationPolicy", "demo", status_dir=status_dir)
    (cond,) = doc["status"]["conditions"]
    assert cond["type"] == "ZtunnelAccepted" and cond["reason"] == "UnsupportedValue"
    assert yaml.safe_dump(doc).count("lastTransitionTime: '2026-01-01T00:00:00Z'") == 1


def test_waypoint_bound_reasons_when_the_waypoint_refuses():
    text = """
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: wl-only, namespace: demo, labels: {istio.io/waypoint-for: workload}}
spec: {gatewayClassName: istio-waypoint, listeners: [{name: mesh, port: 15008, protocol: HBONE}]}
status: {addresses: [{type: IPAddress, value: 10.0.0.9}]}
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: private, namespace: infra}
spec: {gatewayClassName: istio-waypoint, listeners: [{name: mesh, port: 15008, protocol: HBONE}]}
status: {addresses: [{type: IPAddress, value: 10.0.0.10}]}
---
apiVersion: v1
kind: Service
metadata: {name: typed, namespace: demo, labels: {istio.io/use-waypoint: wl-only}}
spec: {clusterIP: 10.96.0.3, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata:
  name: far
  namespace: demo
  labels: {istio.io/use-waypoint: private, istio.io/use-waypoint-namespace: infra}
spec: {clusterIP: 10.96.0.4, ports: [{port: 80}]}
"""
    st = status_of(text)
    typed = one(st, "Service", "typed")
    assert (typed.status, typed.reason) == (
        False,
        "TrafficTypeMismatch",
    ) and "workload traffic" in typed.message
    far = one(st, "Service", "far")
    assert (far.status, far.reason) == (False, "NotAllowed") and "infra/private" in far.message


def _gateway(name: str, labels: str = "") -> str:
    return f"""---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {{name: {name}, namespace: demo{labels}}}
spec: {{gatewayClassName: istio-waypoint, listeners: [{{name: mesh, port: 15008, protocol: HBONE}}]}}
status: {{addresses: [{{type: IPAddress, value: 10.0.0.9}}]}}
"""


def _service(name: str, ip: str, port: str, waypoint: str) -> str:
    return f"""---
apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: demo, labels: {{istio.io/use-waypoint: {waypoint}}}}}
spec: {{clusterIP: {ip}, ports: [{port}]}}
"""


def _targets(kind: str, name: str) -> str:
    group = "gateway.networking.k8s.io" if kind == "Gateway" else "''"
    return f"targetRefs: [{{kind: {kind}, group: {group}, name: {name}}}]"


def test_lab_apply_says_what_http_fields_do_on_a_waypoints_tcp_chains():
    paths = "{to: [{operation: {paths: [/admin]}}]}"
    text = (
        _gateway("waypoint")
        + _gateway("http-only")
        + _gateway("for-pods", ", labels: {istio.io/waypoint-for: workload}")
        + _service("web", "10.96.0.3", "{name: http, port: 80}", "waypoint")
        + _service("db", "10.96.0.4", "{name: tcp-db, port: 5432}", "waypoint")
        + _service("web2", "10.96.0.5", "{name: http, port: 80}", "http-only")
        + "---"
        + policy("web-allow", f"{{{_targets('Service', 'web')}, action: ALLOW, rules: [{paths}]}}")
        + "---"
        + policy("db-allow", f"{{{_targets('Service', 'db')}, action: ALLOW, rules: [{paths}]}}")
        + "---"
        + policy(
            "db-mixed",
            f"{{{_targets('Service', 'db')}, action: ALLOW, rules: [{paths},"
            " {from: [{source: {namespaces: [demo]}}]}]}",
        )
        + "---"
        + policy(
            "db-ports",
            f"{{{_targets('Service', 'db')}, action: ALLOW, rules: [{{to: [{{operation: {{ports: ['5432']}}}}]}}]}}",
        )
        + "---"
        + policy("gw-deny", f"{{{_targets('Gateway', 'waypoint')}, action: DENY, rules: [{paths}]}}")
        + "---"
        + policy("gw-audit", f"{{{_targets('Gateway', 'waypoint')}, action: AUDIT, rules: [{paths}]}}")
        + "---"
        + policy("http-gw-deny", f"{{{_targets('Gateway', 'http-only')}, action: DENY, rules: [{paths}]}}")
        + "---"
        + policy("pods-deny", f"{{{_targets('Gateway', 'for-pods')}, action: DENY, rules: [{paths}]}}")
    )
    from ambient_mesh.control.status import tcp_warnings

    store = KubeStore(parse_documents(NS + text, "t.yaml").objects)
    keys = [("AuthorizationPolicy", "demo", p.metadata.name) for p in store.authorization_policies]
    warned = {line.split(": ", 2)[1]: line.split(": ", 2)[2] for line in tcp_warnings(store, keys)}
    # An HTTP-only Service, a waypoint serving only HTTP Services, and AUDIT (which never
    # refuses) say nothing; a rule without HTTP fields says nothing.
    assert set(warned) == {
        "AuthorizationPolicy demo/db-allow",
        "AuthorizationPolicy demo/db-mixed",
        "AuthorizationPolicy demo/gw-deny",
        "AuthorizationPolicy demo/pods-deny",
    }
    assert "on TCP through the waypoint it allows nothing" in warned["AuthorizationPolicy demo/db-allow"]
    assert warned["AuthorizationPolicy demo/db-mixed"].startswith("rule 0 name HTTP-only fields")
    assert "rule 0 are enforced without their HTTP-only fields" in warned["AuthorizationPolicy demo/gw-deny"]
    # Only the policies asked about.
    assert tcp_warnings(store, [("Service", "demo", "db")]) == []


def test_lab_apply_prints_the_tcp_warning(tmp_path: Path):
    objects = tmp_path / "objects"
    objects.mkdir()
    text = (
        NS
        + _gateway("waypoint")
        + _service("db", "10.96.0.4", "{name: tcp-db, port: 5432}", "waypoint")
        + "---"
        + policy(
            "db-allow",
            f"{{{_targets('Service', 'db')}, action: ALLOW, rules: [{{to: [{{operation: {{methods: [GET]}}}}]}}]}}",
        )
    )
    manifests = verbs.check(text, "m.yaml", default_namespace="demo", allow_pods=False)
    verbs.apply(objects, manifests)
    lines = verbs.apply_warnings(objects, manifests)
    assert lines[-1].startswith(
        "Warning: AuthorizationPolicy demo/db-allow: every rule names HTTP-only fields"
    )
