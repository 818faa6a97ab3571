"""The owner's sans-IO parts (ambient_mesh/workers/owner.py): the state feed and the one view."""

from __future__ import annotations

from envoy.service.discovery.v3.discovery_pb2 import DeltaDiscoveryResponse
from google.protobuf import any_pb2

from ambient_mesh.config import ZtunnelConfig
from ambient_mesh.net import ip_address
from ambient_mesh.state.store import ProxyState
from ambient_mesh.wire.istio.workload import workload_pb2 as W
from ambient_mesh.workers import owner
from ambient_mesh.workers.codec import LocalConfig, Synced, XdsResponse
from ambient_mesh.workers.owner import RetiredCounters, StateFeed, merge_families
from ambient_mesh.xds.convert import ADDRESS_TYPE_URL
from ambient_mesh.xds.session import XdsSession
from ambient_mesh.xds.updater import StateUpdater


def address(name: str, ip: str, *, bad: bool = False):
    from envoy.service.discovery.v3.discovery_pb2 import Resource

    wl = W.Workload(uid=f"c//Pod/ns/{name}", name=name, namespace="ns", addresses=[ip_address(ip).packed])
    if bad:
        wl.tunnel_protocol = W.LEGACY_ISTIO_MTLS  # refused by our decoder: a NACK
    payload = any_pb2.Any()
    payload.Pack(W.Address(workload=wl))
    return Resource(name=f"c//Pod/ns/{name}", version="1", resource=payload)


class Worker:
    """A worker's state, fed only by what the feed sends (as worker.py applies it)."""

    def __init__(self) -> None:
        self.state = ProxyState()
        self.updater = StateUpdater(self.state)
        self.session = XdsSession.from_config(ZtunnelConfig.from_env({}))

    def apply(self, message) -> None:
        if isinstance(message, XdsResponse):
            outcome = self.session.handle_response(DeltaDiscoveryResponse.FromString(message.data))
            assert not outcome.push.rejected
            self.updater.apply_push(outcome.push)


def owner_applies(feed: StateFeed, session: XdsSession, updater: StateUpdater, response) -> None:
    outcome = session.handle_response(response)
    updater.apply_push(outcome.push)
    feed.on_push(response, outcome.push)


def test_workers_get_what_the_owner_accepted_and_a_late_worker_the_same_from_the_snapshot():
    feed = StateFeed()
    owner_state = ProxyState()
    updater = StateUpdater(owner_state)
    session = XdsSession.from_config(ZtunnelConfig.from_env({}))
    live = Worker()
    feed.subscribers.append(live.apply)
    response = DeltaDiscoveryResponse(
        type_url=ADDRESS_TYPE_URL, resources=[address("a", "10.0.0.1"), address("bad", "10.0.0.2", bad=True)]
    )
    owner_applies(feed, session, updater, response)
    owner_applies(
        feed,
        session,
        updater,
        DeltaDiscoveryResponse(
            type_url=ADDRESS_TYPE_URL, resources=[address("b", "10.0.0.3")], removed_resources=["c//Pod/ns/a"]
        ),
    )
    assert sorted(w.uid for w in owner_state.workloads) == ["c//Pod/ns/b"]
    assert sorted(w.uid for w in live.state.workloads) == ["c//Pod/ns/b"]  # the NACKed one never sent
    late = Worker()
    for message in feed.snapshot():
        late.apply(message)
    assert sorted(w.uid for w in late.state.workloads) == ["c//Pod/ns/b"]


def test_snapshot_comes_in_bounded_chunks_after_the_local_config(monkeypatch):
    monkeypatch.setattr(owner, "SNAPSHOT_CHUNK_BYTES", 200)
    feed = StateFeed()
    feed.set_local_config("workloads: []\n", "LOCAL_XDS")
    session = XdsSession.from_config(ZtunnelConfig.from_env({}))
    updater = StateUpdater(ProxyState())
    resources = [address(f"w{i}", f"10.0.1.{i}") for i in range(20)]
    owner_applies(
        feed, session, updater, DeltaDiscoveryResponse(type_url=ADDRESS_TYPE_URL, resources=resources)
    )
    messages = list(feed.snapshot())
    assert isinstance(messages[0], LocalConfig) and isinstance(messages[-1], Synced)
    chunks = [m for m in messages if isinstance(m, XdsResponse)]
    assert len(chunks) > 1
    assert all(len(c.data) < 200 + 200 for c in chunks)
    late = Worker()
    for message in messages:
        late.apply(message)
    assert len(late.state.workloads) == 20


def test_samples_of_the_same_series_are_summed_into_one_family():
    one = (
        "istio_tcp_connections_opened",
        "counter",
        "h",
        "",
        (("istio_tcp_connections_opened_total", {"r": "a"}, 2.0),),
    )
    two = (
        "istio_tcp_connections_opened",
        "counter",
        "h",
        "",
        (
            ("istio_tcp_connections_opened_total", {"r": "a"}, 3.0),
            ("istio_tcp_connections_opened_total", {"r": "b"}, 1.0),
        ),
    )
    (metric,) = merge_families([one, two])
    assert {(s.name, tuple(s.labels.items()), s.value) for s in metric.samples} == {
        ("istio_tcp_connections_opened_total", (("r", "a"),), 5.0),
        ("istio_tcp_connections_opened_total", (("r", "b"),), 1.0),
    }


def test_a_dead_workers_counters_are_kept_and_its_gauges_dropped():
    retired = RetiredCounters()
    counter = ("c", "counter", "", "", (("c_total", {}, 4.0),))
    gauge = ("g", "gauge", "", "", (("g", {}, 7.0),))
    retired.add([counter, gauge])
    retired.add([counter])
    (metric,) = merge_families(retired.families.values())
    assert metric.name == "c" and [s.value for s in metric.samples] == [8.0]


# -- certificates: the owner answers from its SecretManager, waiting for its rotation -------------


class FakeManager:
    """The owner's SecretManager as _answer_cert sees it: the current certificate per identity."""

    def __init__(self, certs) -> None:
        self.certs = list(certs)
        self.calls = 0

    async def fetch_certificate(self, identity):
        self.calls += 1
        return self.certs[0]


class FakeWorker:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, message) -> bool:
        self.sent.append(message)
        return True


def issued(n: int):
    from datetime import UTC, datetime

    from ambient_mesh.identity.ca import CertificateAuthority
    from ambient_mesh.identity.spiffe import Identity

    ca = CertificateAuthority.insecure_test_ca()
    identity = Identity("cluster.local", "ns", "sa")
    return identity, [ca.issue(identity, 3600, now=datetime.now(UTC)) for _ in range(n)]


def pool_with(manager) -> owner.WorkerPool:
    return owner.WorkerPool(
        config=ZtunnelConfig.from_env({"ZTUNNEL_WORKER_THREADS": "2"}),
        env={},
        feed=StateFeed(),
        cert_manager=manager,  # type: ignore[arg-type]
        metrics=None,  # type: ignore[arg-type]
    )


async def test_a_worker_gets_the_owners_certificate_and_can_rebuild_it():
    from ambient_mesh.identity.certificate import WorkloadCertificate
    from ambient_mesh.workers.codec import CertRequest

    identity, (cert,) = issued(1)
    worker = FakeWorker()
    await pool_with(FakeManager([cert]))._answer_cert(worker, CertRequest(1, str(identity), ""))
    (reply,) = worker.sent
    assert reply.request == 1 and not reply.error
    rebuilt = WorkloadCertificate.from_ca_response(identity, reply.key_pem.encode(), list(reply.chain))
    assert rebuilt.serial_number == cert.serial_number and rebuilt.not_after == cert.not_after


async def test_at_rotation_the_owner_answers_once_it_has_the_new_certificate(monkeypatch):
    import asyncio

    from ambient_mesh.workers.codec import CertRequest

    monkeypatch.setattr(owner, "CERT_ROTATION_POLL_S", 0.01)
    identity, (old, new) = issued(2)
    manager = FakeManager([old])
    worker = FakeWorker()
    task = asyncio.ensure_future(
        pool_with(manager)._answer_cert(worker, CertRequest(2, str(identity), old.serial_number))
    )
    await asyncio.sleep(0.1)
    assert not worker.sent and manager.calls > 1  # the worker holds this one: wait for the next
    manager.certs = [new]  # the owner's SecretManager rotated
    await asyncio.wait_for(task, 2)
    (reply,) = worker.sent
    assert not reply.error and new.leaf_pem.decode() == reply.chain[0]


async def test_a_rotation_that_does_not_come_is_an_error_the_worker_backs_off_on(monkeypatch):
    from ambient_mesh.workers.codec import CertRequest

    monkeypatch.setattr(owner, "CERT_ROTATION_POLL_S", 0.01)
    monkeypatch.setattr(owner, "CERT_ROTATION_WAIT_S", 0.05)
    identity, (old,) = issued(1)
    worker = FakeWorker()
    await pool_with(FakeManager([old]))._answer_cert(worker, CertRequest(3, str(identity), old.serial_number))
    (reply,) = worker.sent
    assert "rotation still pending" in reply.error and reply.key_pem == ""


async def test_a_bad_identity_from_a_worker_is_an_error_reply():
    from ambient_mesh.workers.codec import CertRequest

    worker = FakeWorker()
    await pool_with(FakeManager([]))._answer_cert(worker, CertRequest(4, "not-a-spiffe-id", ""))
    (reply,) = worker.sent
    assert "not a SPIFFE id" in reply.error
