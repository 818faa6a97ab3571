"""kube/load.py and the parsers: errors name file and field, and the rest still loads."""

from __future__ import annotations

from pathlib import Path

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from ambient_mesh.errors import ConfigError
from ambient_mesh.kube.load import LoadResult, load_directory, parse_documents
from ambient_mesh.kube.model import Pod, Service
from ambient_mesh.kube.store import KubeStore
from tests.helpers.kube_files import POD_BAD_NODE, POD_OK, write_file


def test_malformed_object_names_file_and_field_and_the_rest_loads(tmp_path: Path) -> None:
    write_file(tmp_path, "pods.yaml", POD_OK + "---" + POD_BAD_NODE)
    write_file(
        tmp_path,
        "svc.yaml",
        """
apiVersion: v1
kind: Service
metadata: {name: s, namespace: default}
spec: {ports: [{port: 80}, {port: "eighty"}]}
---
apiVersion: v1
kind: Service
metadata: {name: good, namespace: default}
spec: {selector: {app: ok}, ports: [{port: 80, targetPort: http}]}
""",
    )
    result = load_directory(tmp_path)
    assert [str(e) for e in result.errors] == [
        "pods.yaml: Pod default/web: spec.nodeName: expected a string",
        "svc.yaml: Service default/s: spec.ports[1].port: expected an integer",
    ]
    names = sorted(o.metadata.name for o in result.objects)
    assert names == ["good", "ok"]
    good = result.store.get("Service", "default", "good")
    assert isinstance(good, Service) and good.ports[0].target_port == "http"
    err = result.errors[0].as_error()
    assert isinstance(err, ConfigError) and err.source == "pods.yaml: Pod default/web: spec.nodeName"


def test_field_errors_in_policies(tmp_path: Path) -> None:
    write_file(
        tmp_path,
        "policies.yaml",
        """
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: a, namespace: ns}
spec: {action: MAYBE}
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: b, namespace: ns}
spec: {rules: [{from: [{source: {principals: [1]}}]}]}
---
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: c, namespace: ns}
spec: {portLevelMtls: {http: {mode: STRICT}}}
---
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: d, namespace: ns}
spec: {mtls: {mode: STRICT}, portLevelMtls: {8080: {mode: DISABLE}}, selector: {matchLabels: {app: x}}}
""",
    )
    result = load_directory(tmp_path)
    assert [str(e) for e in result.errors] == [
        "policies.yaml: AuthorizationPolicy ns/a: spec.action: 'MAYBE' is not one of ALLOW, DENY, AUDIT, CUSTOM",
        "policies.yaml: AuthorizationPolicy ns/b: spec.rules[0].from[0].source.principals[0]: expected a string",
        "policies.yaml: PeerAuthentication ns/c: spec.portLevelMtls.http: expected a port number as the key",
    ]
    (pa,) = result.store.peer_authentications
    assert pa.mtls_mode == "STRICT" and dict(pa.port_level_mtls) == {8080: "DISABLE"}


def test_unknown_kinds_noted_documents_without_kind_rejected(tmp_path: Path) -> None:
    write_file(
        tmp_path,
        "misc.yml",
        """
apiVersion: apps/v1
kind: Deployment
metadata: {name: d, namespace: default}
---
metadata: {name: nokind}
---
- just
- a list
---
""",
    )
    write_file(tmp_path, "ignored.txt", "kind: Pod")
    result = load_directory(tmp_path)
    assert result.objects == ()
    assert result.notes == (
        "misc.yml: Deployment default/d (apps/v1): kind not used by the control plane, ignored",
    )
    assert [str(e) for e in result.errors] == [
        "misc.yml: document 2: kind: missing",
        "misc.yml: document 3: expected a mapping",
    ]


def test_yaml_syntax_error_skips_only_that_file(tmp_path: Path) -> None:
    write_file(tmp_path, "a.yaml", "apiVersion: v1\nkind: Pod\nmetadata: {name: [\n")
    write_file(tmp_path, "b.yaml", POD_OK)
    result = load_directory(tmp_path)
    assert len(result.objects) == 1
    (error,) = result.errors
    assert error.file == "a.yaml" and error.message.startswith("line ")


def test_duplicates_keep_the_first_and_list_kind_expands(tmp_path: Path) -> None:
    doc = yaml.safe_load(POD_OK)
    write_file(tmp_path, "a.yaml", yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [doc]}))
    write_file(tmp_path, "b.yaml", POD_OK)
    result = load_directory(tmp_path)
    assert len(result.objects) == 1
    assert [str(e) for e in result.errors] == [
        "b.yaml: Pod default/ok: duplicate of the object in a.yaml; the first one is kept"
    ]


def test_pod_fields_and_defaults() -> None:
    result = parse_documents(
        """
apiVersion: v1
kind: Pod
metadata:
  name: p
  creationTimestamp: 2024-01-02T03:04:05Z
spec: {hostNetwork: true, containers: [{name: c, ports: [{containerPort: 80, name: http}]}]}
status: {podIPs: [{ip: 10.0.0.1}, {ip: "fd00::1"}], podIP: 10.0.0.1, conditions: [{type: Ready, status: "False"}]}
""",
        "p.yaml",
    )
    (pod,) = result.objects
    assert isinstance(pod, Pod)
    assert pod.metadata.namespace == "default"
    assert pod.metadata.creation_timestamp == "2024-01-02T03:04:05Z"
    assert pod.ips == ("10.0.0.1", "fd00::1") and pod.host_network and not pod.ready
    assert pod.containers[0].ports[0].protocol == "TCP"


def test_store_indexes_and_repr() -> None:
    store = parse_documents(
        POD_OK + "---\napiVersion: v1\nkind: Namespace\nmetadata: {name: default}\n", "x"
    ).store
    assert repr(store) == "KubeStore(1 Namespace, 1 Pod)"
    assert store.namespace("default") is not None and store.node("none") is None
    assert len(store) == 2 and KubeStore().all() == ()


_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8))
_values = st.recursive(
    _scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
_kinds = st.sampled_from(
    [
        "Pod",
        "Service",
        "Namespace",
        "AuthorizationPolicy",
        "PeerAuthentication",
        "ServiceEntry",
        "WorkloadEntry",
        "Gateway",
        "Node",
        "Widget",
    ]
)
_api = st.sampled_from(
    ["v1", "security.istio.io/v1", "networking.istio.io/v1", "gateway.networking.k8s.io/v1", "x/v1"]
)
_sections = st.dictionaries(st.sampled_from(["metadata", "spec", "status"]), _values, max_size=3)


@settings(max_examples=300, deadline=None)
@given(kind=_kinds, api=_api, body=_sections)
def test_parser_returns_objects_or_errors_never_raises(kind: str, api: str, body: dict) -> None:
    doc = {"apiVersion": api, "kind": kind, **body}
    result = parse_documents(yaml.safe_dump(doc), "f.yaml")
    assert isinstance(result, LoadResult)
    assert len(result.objects) + len(result.errors) + len(result.notes) == 1


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=200))
def test_parser_survives_arbitrary_text(text: str) -> None:
    assert isinstance(parse_documents(text, "f.yaml"), LoadResult)


def test_yaml_constructor_errors_are_load_errors_not_crashes():
    from ambient_mesh.kube.load import parse_documents

    for text in ("a: !!int x\n", "a: !!int \n", "a: !!timestamp \n"):
        result = parse_documents(text, "bad.yaml")
        assert result.objects == ()
        assert len(result.errors) == 1 and result.errors[0].file == "bad.yaml"
