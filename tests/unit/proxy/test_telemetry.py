"""proxy/telemetry.py's label memo held to the uncached labels: a connection's labels are always
`connection_labels` of the very objects it names, at any state version, whatever callers hold."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from ambient_mesh.identity.spiffe import Identity
from ambient_mesh.metrics import ConnectionLabels, Metrics
from ambient_mesh.net import SocketAddr
from ambient_mesh.proxy import telemetry
from ambient_mesh.proxy.telemetry import ConnectionResult, connection_labels, peer_labels
from ambient_mesh.state.model import Locality, Service, Workload, WorkloadType

UIDS = ("Kubernetes//Pod/ns/a", "Kubernetes//Pod/ns/b", "Kubernetes//Pod/ns/c")
IDENTITIES = (None, Identity("cluster.local", "ns", "sa1"), Identity("cluster.local", "ns", "sa2"))
_text = st.sampled_from(["", "x", "y", "app", "v2"])


@st.composite
def workloads(draw: st.DrawFn, uid: str) -> Workload:
    return Workload(
        uid=uid,
        name=uid.rsplit("/", 1)[1],
        namespace=draw(st.sampled_from(["ns", "other"])),
        cluster_id=draw(_text),
        workload_type=draw(st.sampled_from(list(WorkloadType))),
        workload_name=draw(_text),
        canonical_name=draw(_text),
        canonical_revision=draw(_text),
        locality=Locality(region=draw(_text), zone=draw(_text)),
    )


@st.composite
def services(draw: st.DrawFn) -> Service | None:
    if draw(st.booleans()):
        return None
    name = draw(st.sampled_from(["svc", "web"]))
    return Service(name=name, namespace=draw(st.sampled_from(["ns", "other"])), hostname=f"{name}.ns.svc")


# Steps: replace a workload by a new object (a push: the version moves), move the version with
# nothing replaced, or open a connection naming objects a caller holds: the current ones, or
# one a caller kept from before a push (the state moved on while it waited).
_step = st.one_of(
    st.tuples(st.just("replace"), st.integers(0, 2), st.data()),
    st.tuples(st.just("bump"), st.just(0), st.just(None)),
    st.tuples(st.just("open"), st.integers(0, 2), st.data()),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_step, max_size=40), st.data())
def test_memoized_labels_are_the_labels_of_the_objects_named(steps, data) -> None:
    telemetry._labels.clear()
    version = 1
    current = {uid: [data.draw(workloads(uid))] for uid in UIDS}  # every generation, newest last
    service = data.draw(services())
    for op, index, step_data in steps:
        uid = UIDS[index]
        if op == "replace":
            current[uid].append(step_data.draw(workloads(uid)))
            service = step_data.draw(services())
            version += 1
        elif op == "bump":
            version += 1
        else:
            dest_uid = UIDS[step_data.draw(st.integers(0, 2))]
            destination = step_data.draw(st.sampled_from([None, current[dest_uid][-1]]))
            reporter = step_data.draw(
                st.sampled_from([telemetry.REPORTER_SOURCE, telemetry.REPORTER_DESTINATION])
            )
            src_id, dst_id = (
                step_data.draw(st.sampled_from(IDENTITIES)),
                step_data.draw(st.sampled_from(IDENTITIES)),
            )
            mtls = step_data.draw(st.booleans())
            # Connections between the same peers, each naming the current source object or one a
            # caller kept from before a push (the state moved on while it waited), in any order.
            for source in step_data.draw(st.lists(st.sampled_from(current[uid]), min_size=1, max_size=4)):
                entry = peer_labels(version, reporter, source, src_id, destination, service, dst_id, mtls)
                expected = connection_labels(reporter, source, src_id, destination, service, dst_id, mtls)
                assert entry[1] == expected
                # Asked again with the same objects: the same label object (metrics key on it).
                again = peer_labels(version, reporter, source, src_id, destination, service, dst_id, mtls)
                assert again[1] is entry[1]


def test_labels_are_reused_within_a_version_and_rebuilt_after_it() -> None:
    telemetry._labels.clear()
    src = Workload(uid=UIDS[0], name="a", namespace="ns", workload_name="a", canonical_name="a")
    dst = Workload(uid=UIDS[1], name="b", namespace="ns", workload_name="b", canonical_name="b")
    first = peer_labels(7, "source", src, None, dst, None, None, False)
    assert peer_labels(7, "source", src, None, dst, None, None, False) is first
    # The same workloads at the next version: built again, not answered from an older version.
    later = peer_labels(8, "source", src, None, dst, None, None, False)
    assert later is not first and later[1] == first[1]
    # A new object under the same uid at the same version (a caller's newer copy): its own labels.
    renamed = Workload(uid=UIDS[0], name="a", namespace="ns", workload_name="renamed", canonical_name="a")
    entry = peer_labels(8, "source", renamed, None, dst, None, None, False)
    assert entry[1].source_workload == "renamed"


def test_the_memo_is_bounded() -> None:
    telemetry._labels.clear()
    for i in range(telemetry.LABELS_MAX_ENTRIES + 10):
        src = Workload(uid=f"Kubernetes//Pod/ns/w{i}", name=f"w{i}", namespace="ns")
        peer_labels(1, "source", src, None, None, None, None, False)
    assert len(telemetry._labels) <= telemetry.LABELS_MAX_ENTRIES


def test_connection_results_share_labels_within_a_version() -> None:
    # ConnectionResult reads the version from its ProxyInputs' state: two connections between the
    # same peers count under one label object (the metrics bind its series once), and a push
    # gives the next connection labels built again.
    state = SimpleNamespace(version=3)
    pi = SimpleNamespace(metrics=Metrics(), state=state)
    src = Workload(uid=UIDS[0], name="a", namespace="ns", workload_name="a")
    addr = SocketAddr.parse("10.0.0.1:80")
    telemetry._labels.clear()

    def opened() -> ConnectionLabels:
        result = ConnectionResult(
            pi,  # type: ignore[arg-type]
            direction="outbound",
            src_addr=addr,
            dst_addr=addr,
            hbone_addr=None,
            source=src,
            source_identity=None,
            destination=None,
            service=None,
            destination_identity=None,
            mtls=False,
        )
        return result.recorder.labels

    first = opened()
    assert opened() is first
    state.version = 4
    after = opened()
    assert after is not first and after == first
