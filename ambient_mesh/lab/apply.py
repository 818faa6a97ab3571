"""`ambient lab apply -f`, `delete -f`, `get KIND`: kubectl's verbs against the lab's API server.

Counterpart: `kubectl apply/delete/get` with server-side strict field validation. The lab's API
server is its objects directory, which the control plane watches (one file per object, replaced
atomically: cluster.py). A manifest is checked with the control plane's own parser
(kube/load.py) before anything is written, so what the lab accepts the control plane accepts,
and an error names `file:line:column` (found by walking the YAML node tree along the field path
the parser reports), the object and the field, as the local config's errors do.

A Pod needs a sandbox: `ambient lab apply` of a Pod writes the object, and the lab's kubelet (the
`up` supervisor, Lab.reconcile_pods) creates the sandbox, runs CNI ADD and starts its app, then
reports it Running with its IP; deleting the object tears it down. Without `allow_pods` (the
demo's manifests, for instance) Pods are refused.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import yaml

from .. import yamlload
from ..errors import ConfigError
from ..kube.decode import decode_yaml
from ..kube.load import load_directory, parse_documents
from ..kube.model import (
    AuthorizationPolicy,
    HTTPRoute,
    Namespace,
    PeerAuthentication,
    Pod,
    Service,
    VirtualService,
)
from ..kube.store import KubeStore
from ..ztunnel_config import Table
from .cluster import object_file_name, remove_object, write_objects
from .selectors import Selector

MAX_MANIFEST_BYTES = 4 * 1024 * 1024  # per file; kubectl's own request limit is 3 MiB
MAX_MANIFEST_FILES = 1000
MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")
CLUSTER_SCOPED = frozenset({"Namespace", "Node"})

# kubectl's names and short names for the kinds the control plane reads.
KIND_NAMES: dict[str, str] = {}
for _kind, _names in {
    "Pod": ("pods", "pod", "po"),
    "Service": ("services", "service", "svc"),
    "Namespace": ("namespaces", "namespace", "ns"),
    "ServiceAccount": ("serviceaccounts", "serviceaccount", "sa"),
    "Node": ("nodes", "node", "no"),
    "AuthorizationPolicy": ("authorizationpolicies", "authorizationpolicy", "ap"),
    "PeerAuthentication": ("peerauthentications", "peerauthentication", "pa"),
    "ServiceEntry": ("serviceentries", "serviceentry", "se"),
    "WorkloadEntry": ("workloadentries", "workloadentry", "we"),
    "Gateway": ("gateways", "gateway", "gtw"),
    "HTTPRoute": ("httproutes", "httproute"),
    "VirtualService": ("virtualservices", "virtualservice", "vs"),
}.items():
    for _name in (*_names, _kind.lower()):
        KIND_NAMES[_name] = _kind


def kind_of(text: str) -> str:
    kind = KIND_NAMES.get(text.lower())
    if kind is None:
        raise ConfigError(
            "KIND",
            f"{text!r} is not a kind the lab serves",
            hint=f"use one of {', '.join(sorted(set(KIND_NAMES)))}",
        )
    return kind


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """One object from a file, checked, with its namespace filled in as kubectl does."""

    file: str
    doc: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.doc["kind"])

    @property
    def namespace(self) -> str:
        return str(self.doc["metadata"].get("namespace", ""))

    @property
    def name(self) -> str:
        return str(self.doc["metadata"]["name"])

    @property
    def ref(self) -> str:
        """kubectl's `kind/name` (with the group for Istio's kinds)."""
        group = self.doc["apiVersion"].rpartition("/")[0]
        return f"{self.kind.lower()}{'.' + group if group else ''}/{self.name}"


# -- reading and checking -------------------------------------------------------------------------


def read_sources(paths: Sequence[str], stdin: IO[str] | None = None) -> list[tuple[str, str]]:
    """(name, text) for each `-f` argument: a file, every manifest in a directory, or `-`."""
    out: list[tuple[str, str]] = []
    for arg in paths:
        if arg == "-":
            out.append(("<stdin>", (stdin or sys.stdin).read(MAX_MANIFEST_BYTES + 1)))
            continue
        path = Path(arg)
        files = (
            sorted(p for p in path.iterdir() if p.suffix in MANIFEST_SUFFIXES) if path.is_dir() else [path]
        )
        for file in files:
            try:
                size = file.stat().st_size
                if size > MAX_MANIFEST_BYTES:
                    raise ConfigError(str(file), f"{size} bytes: larger than {MAX_MANIFEST_BYTES}")
                out.append((str(file), file.read_text(encoding="utf-8")))
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(str(file), f"cannot read: {e}") from None
            if len(out) > MAX_MANIFEST_FILES:
                raise ConfigError(arg, f"more than {MAX_MANIFEST_FILES} files")
    for name, text in out:
        if len(text) > MAX_MANIFEST_BYTES:
            raise ConfigError(name, f"larger than {MAX_MANIFEST_BYTES} bytes")
    return out


_PATH_TOKEN = re.compile(r"\[(\d+)\]|([^.\[\]]+)")


def locate(node: yaml.Node, path: str) -> yaml.Mark:
    """Where the field at `path` (`spec.rules[0].from[0].source.principal`) is in a document:
    the key itself when it is the last step (an unknown or missing field), else the deepest
    value found along the path."""
    tokens = [int(i) if i else name for i, name in _PATH_TOKEN.findall(path)]
    mark: yaml.Mark = node.start_mark
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if isinstance(token, int) and isinstance(node, yaml.SequenceNode) and token < len(node.value):
            node = node.value[token]
            mark = node.start_mark
            i += 1
            continue
        if isinstance(token, str) and isinstance(node, yaml.MappingNode):
            # A key may itself contain dots (`istio.io/dataplane-mode`): try the longest first.
            for j in range(len(tokens), i, -1):
                parts = tokens[i:j]
                if not all(isinstance(p, str) for p in parts):
                    continue
                key = ".".join(parts)  # type: ignore[arg-type]
                found = next((kv for kv in node.value if getattr(kv[0], "value", None) == key), None)
                if found is not None:
                    key_node, value_node = found
                    if j == len(tokens):
                        mark = key_node.start_mark
                        return mark
                    node, mark, i = value_node, value_node.start_mark, j
                    break
            else:
                return mark
            continue
        return mark
    return mark


def _label(doc: Mapping[str, Any]) -> str:
    meta: Mapping[str, Any] = doc["metadata"] if isinstance(doc.get("metadata"), dict) else {}
    name = meta.get("name") if isinstance(meta.get("name"), str) else "?"
    ns = meta.get("namespace") if isinstance(meta.get("namespace"), str) else ""
    return f"{doc.get('kind')} {ns}/{name}" if ns else f"{doc.get('kind')} {name}"


def where(file: str, node: yaml.Node, field: str = "") -> str:
    """`file:line:column` of a document's node, or of one of its fields."""
    mark = locate(node, field) if field else node.start_mark
    return f"{file}:{mark.line + 1}:{mark.column + 1}"


def check(
    text: str, file: str, *, default_namespace: str = "default", allow_pods: bool = False
) -> list[Manifest]:
    """Every object in one manifest, checked as the control plane checks it; ConfigError naming
    `file:line:column`, the object and the field of each problem (all of them, one per line)."""
    return check_documents(
        documents(text, file), file, default_namespace=default_namespace, allow_pods=allow_pods
    )


def documents(text: str, file: str) -> list[tuple[yaml.Node, Any]]:
    """Each document (a `kind: List` expanded) with its node tree, for error positions."""
    try:
        nodes = list(yaml.compose_all(text, Loader=yamlload.BoundedSafeLoader))  # aliases bounded
        docs = decode_yaml(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{file}:{mark.line + 1}:{mark.column + 1}" if mark is not None else file
        raise ConfigError(where, getattr(e, "problem", None) or str(e)) from None
    pairs: list[tuple[yaml.Node, Any]] = []
    for node, doc in zip(
        (n for n in nodes if n is not None), (d for d in docs if d is not None), strict=False
    ):
        if isinstance(doc, dict) and doc.get("kind") == "List" and isinstance(doc.get("items"), list):
            items = node.value if isinstance(node, yaml.MappingNode) else []
            item_nodes: list[Any] = next(
                (v.value for k, v in items if getattr(k, "value", None) == "items"), []
            )
            pairs.extend(zip(item_nodes, doc["items"], strict=False))
        else:
            pairs.append((node, doc))
    return pairs


def check_documents(
    pairs: Iterable[tuple[yaml.Node, Any]], file: str, *, default_namespace: str, allow_pods: bool
) -> list[Manifest]:
    problems: list[str] = []
    manifests: list[Manifest] = []
    for node, doc in pairs:
        if not isinstance(doc, dict):
            problems.append(f"{where(file, node)}: expected a mapping (a Kubernetes object)")
            continue
        namespaced = doc.get("kind") not in CLUSTER_SCOPED
        if namespaced and isinstance(doc.get("metadata"), dict) and not doc["metadata"].get("namespace"):
            doc["metadata"]["namespace"] = default_namespace
        result = parse_documents(json.dumps(doc, default=str), file)
        for error in result.errors:
            problems.append(
                f"{where(file, node, error.field)}: {': '.join(p for p in (error.object, error.field) if p)}: "
                f"{error.message}"
            )
        if result.notes:
            from ..control.unserved_kinds import unserved_kind

            meaning = unserved_kind(str(doc.get("kind")))
            problems.append(
                f"{where(file, node)}: {_label(doc)} ({doc.get('apiVersion')}): not a kind the control plane serves"
                + (f": {meaning}" if meaning else "")
            )
        if result.errors or result.notes:
            continue
        if doc.get("kind") == "Pod" and not allow_pods:
            problems.append(
                f"{where(file, node)}: {_label(doc)}: pods are the lab's own (it creates their sandboxes); "
                "add them to the topology file (`ambient lab up -f`)"
            )
            continue
        manifests.append(Manifest(file=file, doc=doc))
    if problems:
        raise ConfigError(file, "refused, nothing applied:\n  " + "\n  ".join(problems))
    return manifests


# -- the verbs ------------------------------------------------------------------------------------


def apply(objects_dir: Path, manifests: Iterable[Manifest]) -> list[str]:
    """Write each object (kubectl's `created` / `configured` / `unchanged`)."""
    lines = []
    for m in manifests:
        if m.kind == "Service":
            assign_cluster_ip(objects_dir, m.doc)
        path = objects_dir / object_file_name(m.doc)
        try:
            before = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError):
            before = None
        if before == m.doc:
            lines.append(f"{m.ref} unchanged")
            continue
        write_objects(objects_dir, [m.doc])
        lines.append(f"{m.ref} {'configured' if before is not None else 'created'}")
        lines.extend(route_warnings(m))
    return lines


def route_warnings(m: Manifest) -> list[str]:
    """What a waypoint cannot honour in an HTTPRoute or VirtualService, as kubectl prints an API
    server's warnings (the object is applied; those fields are not served)."""
    if m.kind not in ("HTTPRoute", "VirtualService"):
        return []
    from ..control.translate.http_routes import notes

    out: list[str] = []
    for obj in parse_documents(json.dumps(m.doc, default=str), m.file).objects:
        if isinstance(obj, HTTPRoute | VirtualService):
            out.extend(f"Warning: {note}" for note in notes(obj))
    return out


def apply_warnings(objects_dir: Path, manifests: Iterable[Manifest]) -> list[str]:
    """The control plane's conditions on what was just applied, as kubectl prints an API
    server's warnings: computed by the control plane's own status code over the objects as they
    now are (its status subresource follows within a second; `get -o yaml` shows it)."""
    from ..control.status import compute_status, tcp_warnings, warnings_for

    loaded = load_directory(objects_dir)
    keys = [(m.kind, m.namespace, m.name) for m in manifests]
    store = KubeStore(loaded.objects)
    return warnings_for(compute_status(store), keys) + tcp_warnings(store, keys)


def assign_cluster_ip(objects_dir: Path, doc: dict[str, Any]) -> None:
    """A Service without `spec.clusterIP` gets one, as the API server allocates it; an update
    keeps the address the stored object has."""
    from .services import allocate_cluster_ip

    spec = doc.setdefault("spec", {})
    if spec.get("clusterIP"):
        return
    stored = load_directory(objects_dir).objects
    ns, name = doc["metadata"].get("namespace", ""), doc["metadata"]["name"]
    for o in stored:
        if isinstance(o, Service) and (o.metadata.namespace, o.metadata.name) == (ns, name) and o.cluster_ip:
            spec["clusterIP"] = o.cluster_ip
            return
    spec["clusterIP"] = allocate_cluster_ip(o.cluster_ip for o in stored if isinstance(o, Service))


def delete(objects_dir: Path, manifests: Iterable[Manifest]) -> tuple[list[str], bool]:
    """Remove each object; (lines, whether all existed) as kubectl reports NotFound."""
    lines, found_all = [], True
    for m in manifests:
        if remove_object(objects_dir, m.kind, m.namespace, m.name):
            lines.append(f"{m.ref} deleted")
        else:
            found_all = False
            lines.append(f'Error from server (NotFound): {m.kind.lower()} "{m.name}" not found')
    return lines, found_all


def _ports(svc: Service) -> str:
    return ",".join(f"{p.port}/{p.protocol}" for p in svc.ports) or "<none>"


def _row(obj: Any) -> tuple[str, ...]:
    if isinstance(obj, Pod):
        return (
            obj.node_name,
            obj.pod_ip or "<none>",
            "True" if obj.ready else "False",
            obj.service_account_name,
        )
    if isinstance(obj, Service):
        selector = ",".join(f"{k}={v}" for k, v in sorted(obj.selector.items())) or "<none>"
        return (obj.cluster_ip or "<none>", _ports(obj), selector)
    if isinstance(obj, Namespace):
        return (labels_text(obj.metadata.labels),)
    if isinstance(obj, AuthorizationPolicy):
        return (obj.action, str(len(obj.rules)))
    if isinstance(obj, PeerAuthentication):
        return (obj.mtls_mode or "UNSET",)
    return ()


_COLUMNS: dict[str, tuple[str, ...]] = {
    "Pod": ("NODE", "IP", "READY", "SERVICE ACCOUNT"),
    "Service": ("CLUSTER-IP", "PORTS", "SELECTOR"),
    "Namespace": ("LABELS",),
    "AuthorizationPolicy": ("ACTION", "RULES"),
    "PeerAuthentication": ("MODE",),
}


def get_objects(
    objects_dir: Path, kind: str, namespace: str | None, selector: Selector | None = None
) -> list[Any]:
    loaded = load_directory(objects_dir)
    return [
        o
        for o in loaded.objects
        if o.kind == kind
        and (namespace is None or kind in CLUSTER_SCOPED or o.metadata.namespace == namespace)
        and (selector is None or selector.matches(o.metadata.labels))
    ]


def labels_text(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "<none>"


def get_table(
    objects_dir: Path,
    kind: str,
    namespace: str | None,
    *,
    selector: Selector | None = None,
    wide: bool = False,
) -> Table:
    """`kubectl get KIND [-n NS | -A] [-l SELECTOR] [-o wide]` as a table (namespace None: every
    namespace); wide adds the objects' labels."""
    objects = get_objects(objects_dir, kind, namespace, selector)
    head: tuple[str, ...] = ("NAME",) if kind in CLUSTER_SCOPED else ("NAMESPACE", "NAME")
    extra: tuple[str, ...] = ("LABELS",) if wide and "LABELS" not in _COLUMNS.get(kind, ()) else ()
    rows = []
    for o in sorted(objects, key=lambda o: (o.metadata.namespace, o.metadata.name)):
        key = (o.metadata.name,) if kind in CLUSTER_SCOPED else (o.metadata.namespace, o.metadata.name)
        rows.append((*key, *_row(o), *((labels_text(o.metadata.labels),) if extra else ())))
    return Table(title=kind, headers=(*head, *_COLUMNS.get(kind, ()), *extra), rows=tuple(rows))


def get_documents(
    objects_dir: Path,
    kind: str,
    namespace: str | None,
    *,
    selector: Selector | None = None,
    status_dir: Path | None = None,
) -> list[dict[str, Any]]:
    """The stored objects themselves (`-o yaml|json`), with the status the control plane wrote
    for them in `status_dir` (its status subresource) where it wrote one."""
    from ..control.status import read_status_dir, status_document

    out = []
    for o in sorted(
        get_objects(objects_dir, kind, namespace, selector),
        key=lambda o: (o.metadata.namespace, o.metadata.name),
    ):
        path = objects_dir / object_file_name(
            {"kind": kind, "metadata": {"namespace": o.metadata.namespace, "name": o.metadata.name}}
        )
        try:
            doc = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError):
            continue  # written under another file name (not by the lab): the table still lists it
        conditions = (
            read_status_dir(status_dir, (kind, o.metadata.namespace, o.metadata.name)) if status_dir else ()
        )
        if conditions and isinstance(doc, dict):
            doc["status"] = {**(doc.get("status") or {}), **status_document(conditions)}
        out.append(doc)
    return out
