"""`ambient lab apply/delete/get` against an objects directory, and the control plane's strict
field check on Istio's kinds that they rely on."""

from __future__ import annotations

import json
import textwrap

import pytest
import yaml

from ambient_mesh.errors import ConfigError
from ambient_mesh.kube.load import load_directory, parse_documents
from ambient_mesh.kube.model import AuthorizationPolicy
from ambient_mesh.lab import apply as verbs

DENY = textwrap.dedent(
    """\
    apiVersion: security.istio.io/v1
    kind: AuthorizationPolicy
    metadata:
      name: deny-client
      namespace: shop
    spec:
      action: DENY
      rules:
      - from:
        - source:
            principals: ["cluster.local/ns/shop/sa/client"]
    """
)


def test_a_typo_in_a_policy_is_refused_with_file_line_and_field():
    text = DENY.replace("principals:", "principal:")
    with pytest.raises(ConfigError) as exc:
        verbs.check(text, "deny.yaml")
    message = str(exc.value)
    assert (
        "deny.yaml:11:9: AuthorizationPolicy shop/deny-client: spec.rules[0].from[0].source.principal"
        in message
    )
    assert "unknown field (expected one of" in message and "principals" in message


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        ("  action: DENY", "  actions: DENY", "spec.actions"),
        ("spec:", "specs:", "specs"),
        ("- from:", "- form:", "spec.rules[0].form"),
    ],
)
def test_the_control_plane_refuses_unknown_fields_in_istio_kinds(old, new, field):
    result = parse_documents(DENY.replace(old, new), "p.yaml")
    assert not result.objects
    assert [e.field for e in result.errors] == [field]


def test_unknown_fields_elsewhere_in_kubernetes_kinds_are_still_ignored():
    pod = "apiVersion: v1\nkind: Pod\nmetadata: {name: a, namespace: x}\nspec: {nodeName: n, dnsPolicy: ClusterFirst}\n"
    assert len(parse_documents(pod, "p.yaml").objects) == 1


def test_apply_then_reapply_then_change_then_delete(tmp_path):
    manifests = verbs.check(DENY, "deny.yaml")
    ref = "authorizationpolicy.security.istio.io/deny-client"
    assert verbs.apply(tmp_path, manifests) == [f"{ref} created"]
    assert verbs.apply(tmp_path, manifests) == [f"{ref} unchanged"]
    changed = verbs.check(DENY.replace("DENY", "ALLOW"), "deny.yaml")
    assert verbs.apply(tmp_path, changed) == [f"{ref} configured"]
    (policy,) = load_directory(tmp_path).objects
    assert isinstance(policy, AuthorizationPolicy) and policy.action == "ALLOW"
    assert verbs.delete(tmp_path, changed) == ([f"{ref} deleted"], True)
    lines, ok = verbs.delete(tmp_path, changed)
    assert not ok and "NotFound" in lines[0]
    assert not list(tmp_path.iterdir())


def test_namespace_defaults_and_lists_expand(tmp_path):
    text = yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "List",
            "items": [
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}},
                {
                    "apiVersion": "v1",
                    "kind": "Service",
                    "metadata": {"name": "echo"},
                    "spec": {"selector": {"app": "echo"}, "clusterIP": "10.96.0.20", "ports": [{"port": 80}]},
                },
            ],
        }
    )
    manifests = verbs.check(text, "l.yaml", default_namespace="shop")
    assert [(m.kind, m.namespace) for m in manifests] == [("Namespace", ""), ("Service", "shop")]
    verbs.apply(tmp_path, manifests)
    table = verbs.get_table(tmp_path, verbs.kind_of("svc"), "shop")
    assert table.headers == ("NAMESPACE", "NAME", "CLUSTER-IP", "PORTS", "SELECTOR")
    assert table.rows == (("shop", "echo", "10.96.0.20", "80/TCP", "app=echo"),)
    assert verbs.get_table(tmp_path, "Service", "other").rows == ()
    assert verbs.get_table(tmp_path, verbs.kind_of("ns"), "ignored").rows == (("shop", "<none>"),)
    assert verbs.get_documents(tmp_path, "Service", None)[0]["spec"]["clusterIP"] == "10.96.0.20"


def test_pods_and_unknown_kinds_and_bad_yaml_are_refused():
    pod = "apiVersion: v1\nkind: Pod\nmetadata: {name: a}\nspec: {nodeName: node-1}\n"
    with pytest.raises(ConfigError, match="pods are the lab's own"):
        verbs.check(pod, "p.yaml")
    with pytest.raises(ConfigError, match="not a kind the control plane serves"):
        verbs.check("apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: a}\n", "d.yaml")
    with pytest.raises(ConfigError, match=r"b.yaml:2:\d+"):
        verbs.check("a: b\n c: [\n", "b.yaml")
    with pytest.raises(ConfigError, match="'widgets' is not a kind"):
        verbs.kind_of("widgets")


def test_locate_follows_dotted_keys_and_indexes():
    node = yaml.compose("metadata:\n  labels:\n    istio.io/dataplane-mode: ambient\nitems:\n- a\n- {b: 1}\n")
    assert verbs.locate(node, "metadata.labels.istio.io/dataplane-mode").line == 2
    assert verbs.locate(node, "items[1].b").line == 5
    assert verbs.locate(node, "items[1].missing").line == 5  # the deepest found
    assert verbs.locate(node, "nothing.here").line == 0


def test_read_sources_bounds_file_size(tmp_path, monkeypatch):
    monkeypatch.setattr(verbs, "MAX_MANIFEST_BYTES", 10)
    (tmp_path / "big.yaml").write_text("x" * 11)
    with pytest.raises(ConfigError, match="larger than 10"):
        verbs.read_sources([str(tmp_path)])


def test_an_alias_bomb_is_refused_with_its_line():
    lines = ["a0: &a0 [x, x]"] + [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}]" for i in range(1, 40)]
    with pytest.raises(ConfigError, match=r"bomb.yaml:\d+:\d+"):
        verbs.check("\n".join(lines) + "\n", "bomb.yaml")


VS_WITH_SOURCE_LABELS = textwrap.dedent(
    """\
    apiVersion: networking.istio.io/v1
    kind: VirtualService
    metadata: {name: web, namespace: shop}
    spec:
      hosts: [web]
      http:
      - match: [{sourceLabels: {app: client}}]
        route: [{destination: {host: web}}]
    """
)


def test_lab_apply_takes_routes_and_says_what_a_waypoint_cannot_honour(tmp_path):
    manifests = verbs.check(VS_WITH_SOURCE_LABELS, "vs.yaml")
    lines = verbs.apply(tmp_path, manifests)
    assert lines == [
        "virtualservice.networking.istio.io/web created",
        "Warning: VirtualService shop/web: spec.http[0].match[0].sourceLabels: a waypoint cannot match "
        "on sourceLabels; this match is dropped",
    ]
    assert [o.kind for o in load_directory(tmp_path).objects] == ["VirtualService"]


def test_lab_apply_refuses_a_route_typo_with_its_position():
    text = VS_WITH_SOURCE_LABELS.replace("route:", "routes:")
    with pytest.raises(ConfigError) as exc:
        verbs.check(text, "vs.yaml")
    assert "vs.yaml:8:5:" in str(exc.value) and "spec.http[0].routes" in str(exc.value)


def test_get_selects_by_label_and_wide_adds_labels(tmp_path):
    from ambient_mesh.lab.selectors import parse_selector

    docs = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}},
        *(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": name, "labels": {"app": name, "tier": tier}},
                "spec": {"selector": {"app": name}, "clusterIP": ip, "ports": [{"port": 80}]},
            }
            for name, tier, ip in (("echo", "back", "10.96.0.20"), ("web", "front", "10.96.0.21"))
        ),
    ]
    verbs.apply(
        tmp_path, verbs.check(json.dumps({"kind": "List", "items": docs}), "l.yaml", default_namespace="shop")
    )
    back = parse_selector("tier=back")
    assert [r[1] for r in verbs.get_table(tmp_path, "Service", "shop", selector=back).rows] == ["echo"]
    assert [
        r[1] for r in verbs.get_table(tmp_path, "Service", None, selector=parse_selector("tier")).rows
    ] == [
        "echo",
        "web",
    ]
    assert [d["metadata"]["name"] for d in verbs.get_documents(tmp_path, "Service", None, selector=back)] == [
        "echo"
    ]
    wide = verbs.get_table(
        tmp_path, "Service", "shop", selector=parse_selector("app notin (echo)"), wide=True
    )
    assert wide.headers[-1] == "LABELS" and wide.rows == (
        ("shop", "web", "10.96.0.21", "80/TCP", "app=web", "app=web,tier=front"),
    )
    # Namespaces show their labels already: wide does not repeat them.
    assert verbs.get_table(tmp_path, "Namespace", None, wide=True).headers == ("NAME", "LABELS")
