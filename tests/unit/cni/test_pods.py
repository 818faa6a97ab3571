"""Pod sources: the YAML-directory source end to end (it is local files), and the pure parts of the
Kubernetes API source (object conversion, the agent's credentials). The API source's
list/watch/patch run against a fake API server in tests/integration/test_kube_api_source.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from ambient_mesh.cni.pods import (
    DirectoryPodSource,
    EnrollmentState,
    EventType,
    NamespaceEvent,
    PodEvent,
    PodSourceError,
    diff_objects,
    namespace_from_json,
    pod_from_json,
    synthesized_uid,
)
from ambient_mesh.errors import ProtocolError
from ambient_mesh.metadata import ANNOTATION_REDIRECTION

NODE = "node-1"


def pod_doc(name, *, uid=None, node=NODE, labels=None, ip="10.0.0.5", phase="Running"):
    meta = {"name": name, "namespace": "demo", "labels": labels or {}}
    if uid is not None:
        meta["uid"] = uid
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"nodeName": node, "serviceAccountName": "sa", "containers": [{"name": "app"}]},
        "status": {"phase": phase, "podIP": ip},
    }


NS_DOC = {
    "apiVersion": "v1",
    "kind": "Namespace",
    "metadata": {"name": "demo", "labels": {"istio.io/dataplane-mode": "ambient"}},
}


def write(dir_: Path, *docs) -> None:
    (dir_ / "objects.yaml").write_text(yaml.safe_dump_all(list(docs)))


@pytest.fixture
def source(tmp_path):
    pods = tmp_path / "pods"
    pods.mkdir()
    write(pods, NS_DOC, pod_doc("a", uid="u-a"), pod_doc("b", uid="u-b", node="node-2"), pod_doc("c"))
    return DirectoryPodSource(
        pods, node_name=NODE, state_file=tmp_path / "run" / "state.json", poll_interval_s=0.01
    )


async def test_directory_source_lists_this_nodes_pods(source):
    await source.start()
    assert [p.name for p in source.pods()] == ["a", "c"]
    a = source.pod("demo", "a")
    assert a.uid == "u-a" and a.ips == ("10.0.0.5",) and a.service_account == "sa" and a.phase == "Running"
    assert source.pod("demo", "c").uid == synthesized_uid("demo", "c")  # stable without metadata.uid
    assert source.namespace("demo").labels == {"istio.io/dataplane-mode": "ambient"}
    assert "2 pods" in repr(source)


async def test_directory_source_reports_changes_with_old_and_new(source, tmp_path):
    await source.start()
    write(
        tmp_path / "pods",
        {**NS_DOC, "metadata": {"name": "demo", "labels": {}}},
        pod_doc("a", uid="u-a", labels={"x": "y"}),
        pod_doc("d", uid="u-d"),
    )
    events = await source.poll_once()
    kinds = {(type(e).__name__, e.type) for e in events}
    assert kinds == {
        ("NamespaceEvent", EventType.UPDATED),
        ("PodEvent", EventType.UPDATED),
        ("PodEvent", EventType.DELETED),
        ("PodEvent", EventType.ADDED),
    }
    updated = next(e for e in events if isinstance(e, PodEvent) and e.type is EventType.UPDATED)
    assert updated.old.labels == {} and updated.new.labels == {"x": "y"}
    deleted = next(e for e in events if isinstance(e, PodEvent) and e.type is EventType.DELETED)
    assert deleted.pod.name == "c"
    ns_event = next(e for e in events if isinstance(e, NamespaceEvent))
    assert ns_event.old.labels and not ns_event.new.labels
    assert await source.poll_once() == []


async def test_directory_marks_live_in_the_state_file_and_survive_a_restart(source, tmp_path):
    await source.start()
    a = source.pod("demo", "a")
    await source.mark_enrolled(a)
    assert source.pod("demo", "a").redirection == "enabled"
    state = json.loads((tmp_path / "run" / "state.json").read_text())
    assert state["pods"]["u-a"] == {"value": "enabled", "namespace": "demo", "name": "a"}
    assert ANNOTATION_REDIRECTION not in (tmp_path / "pods" / "objects.yaml").read_text()  # operator's files

    again = DirectoryPodSource(tmp_path / "pods", node_name=NODE, state_file=tmp_path / "run" / "state.json")
    await again.start()
    assert again.pod("demo", "a").annotations[ANNOTATION_REDIRECTION] == "enabled"
    await again.unmark(again.pod("demo", "a"))
    assert again.pod("demo", "a").redirection == ""
    assert EnrollmentState(tmp_path / "run" / "state.json").marks() == {}


async def test_fetch_pod_rereads_and_keeps_the_events_for_the_watch(source, tmp_path):
    await source.start()
    write(tmp_path / "pods", NS_DOC, pod_doc("a", uid="u-a"), pod_doc("c"), pod_doc("new", uid="u-new"))
    assert (await source.fetch_pod("demo", "new")).uid == "u-new"
    events = await source.poll_once()
    assert [(e.type, e.pod.name) for e in events] == [(EventType.ADDED, "new")]


async def test_run_delivers_events(source, tmp_path):
    import asyncio

    await source.start()
    got: list = []
    seen = asyncio.Event()

    async def on_event(event):
        got.append(event)
        seen.set()

    task = asyncio.create_task(source.run(on_event))
    try:
        write(tmp_path / "pods", NS_DOC, pod_doc("a", uid="u-a"))
        await asyncio.wait_for(seen.wait(), 5)
    finally:
        task.cancel()
    assert got[0].type is EventType.DELETED and got[0].pod.name == "c"


async def test_missing_directory_is_a_pod_source_error(tmp_path):
    src = DirectoryPodSource(tmp_path / "nope", node_name=NODE, state_file=tmp_path / "s.json")
    with pytest.raises(PodSourceError):
        await src.start()


async def test_agent_upgrading_means_the_daemonset_is_in_the_store(source, tmp_path):
    assert not await source.agent_upgrading("istio-system")
    (tmp_path / "pods" / "ds.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "apps/v1",
                "kind": "DaemonSet",
                "metadata": {"name": "istio-cni-node", "namespace": "istio-system"},
            }
        )
    )
    assert await source.agent_upgrading("istio-system")
    assert not await source.agent_upgrading("other")


def test_corrupt_state_file_is_reported(tmp_path):
    (tmp_path / "s.json").write_text("{nope")
    with pytest.raises(PodSourceError):
        EnrollmentState(tmp_path / "s.json")


# -- pure parts ----------------------------------------------------------------------------------


def test_diff_objects():
    assert diff_objects({"a": 1, "b": 2}, {"b": 3, "c": 4}) == [
        (EventType.DELETED, 1, None),
        (EventType.UPDATED, 2, 3),
        (EventType.ADDED, None, 4),
    ]


def test_pod_from_json_reads_what_the_agent_needs():
    obj = {
        "metadata": {
            "name": "w",
            "namespace": "n",
            "uid": "u",
            "resourceVersion": "7",
            "labels": {"a": "b"},
            "annotations": {ANNOTATION_REDIRECTION: "enabled"},
            "deletionTimestamp": "2024-01-01T00:00:00Z",
        },
        "spec": {
            "nodeName": NODE,
            "serviceAccountName": "sa",
            "hostNetwork": True,
            "containers": [{"name": "app"}, {"name": "istio-proxy"}],
            "initContainers": [{"name": "init"}],
        },
        "status": {
            "phase": "Succeeded",
            "podIP": "10.0.0.1",
            "podIPs": [{"ip": "10.0.0.1"}, {"ip": "fd00::1"}],
        },
    }
    pod = pod_from_json(obj)
    assert pod.ips == ("10.0.0.1", "fd00::1") and pod.resource_version == "7"
    assert pod.info.host_network and pod.info.containers == ("app", "istio-proxy")
    assert pod.redirection == "enabled" and pod.terminated and pod.deleting
    assert pod_from_json(
        {"metadata": {"name": "w", "namespace": "n", "uid": "u"}, "status": {"podIP": "10.0.0.2"}}
    ).ips == ("10.0.0.2",)
    with pytest.raises(ProtocolError):
        pod_from_json({"metadata": {"name": "w"}})


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda kids: (
        st.lists(kids, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                [
                    "metadata",
                    "spec",
                    "status",
                    "name",
                    "namespace",
                    "uid",
                    "labels",
                    "podIPs",
                    "ip",
                    "podIP",
                    "containers",
                    "phase",
                    "annotations",
                    "nodeName",
                ]
            ),
            kids,
            max_size=4,
        )
    ),
    max_leaves=20,
)


@given(json_values)
def test_pod_and_namespace_parsers_return_value_or_protocol_error(doc):
    for parse in (pod_from_json, namespace_from_json):
        try:
            parse(doc)
        except ProtocolError:
            pass
