"""HBONE request/response headers: baggage, traceparent, forwarded."""

from __future__ import annotations

import ipaddress
import os
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ambient_mesh.net import SocketAddr
from ambient_mesh.proxy import headers
from ambient_mesh.proxy.headers import (
    TRACEPARENT_LENGTH,
    Baggage,
    baggage_at,
    baggage_for,
    forwarded_for,
    new_traceparent,
    parse_baggage,
    parse_forwarded_host,
    parse_traceparent,
)
from ambient_mesh.state.model import Locality, Workload, WorkloadType


def workload(**overrides) -> Workload:
    fields = dict(
        uid="Kubernetes//Pod/default/app-1",
        namespace="default",
        cluster_id="Kubernetes",
        workload_type=WorkloadType.DEPLOYMENT,
        workload_name="app",
        canonical_name="app-svc",
        canonical_revision="v1",
        locality=Locality(region="eu-west1", zone="eu-west1-b", subzone="rack3"),
    )
    fields.update(overrides)
    return Workload(**fields)


# ---------------------------------------------------------------------------- baggage


def test_baggage_for_full_workload_in_order() -> None:
    assert baggage_for(workload()) == (
        "k8s.cluster.name=Kubernetes,k8s.namespace.name=default,k8s.deployment.name=app,"
        "service.name=app-svc,service.version=v1,cloud.region=eu-west1,cloud.availability_zone=eu-west1-b"
    )


@pytest.mark.parametrize(
    ("workload_type", "key"),
    [
        (WorkloadType.DEPLOYMENT, "k8s.deployment.name"),
        (WorkloadType.CRONJOB, "k8s.cronjob.name"),
        (WorkloadType.POD, "k8s.pod.name"),
        (WorkloadType.JOB, "k8s.job.name"),
    ],
)
def test_baggage_workload_type_key(workload_type: WorkloadType, key: str) -> None:
    value = baggage_for(workload(workload_type=workload_type, workload_name="w"))
    assert f",{key}=w," in value
    assert parse_baggage([value]).workload_type is workload_type


def test_baggage_omits_empty_values() -> None:
    minimal = workload(cluster_id="", workload_name="", canonical_revision="", locality=Locality())
    assert baggage_for(minimal) == "k8s.namespace.name=default,service.name=app-svc"
    assert (
        baggage_for(
            workload(
                namespace="",
                cluster_id="",
                workload_name="",
                canonical_name="",
                canonical_revision="",
                locality=Locality(),
            )
        )
        == ""
    )


def test_parse_baggage_full() -> None:
    assert parse_baggage([baggage_for(workload())]) == Baggage(
        cluster_id="Kubernetes",
        namespace="default",
        workload_name="app",
        workload_type=WorkloadType.DEPLOYMENT,
        service_name="app-svc",
        service_version="v1",
        region="eu-west1",
        zone="eu-west1-b",
    )


def test_parse_baggage_merges_headers_and_skips_junk() -> None:
    parsed = parse_baggage(
        [
            "k8s.cluster.name=c1, k8s.namespace.name = ns1,unknown.key=x,novalue,service.name=",
            "",
            "k8s.pod.name=pod-a,=orphan,service.version=v2;prop=1",
        ]
    )
    assert parsed == Baggage(
        cluster_id="c1",
        namespace="ns1",
        workload_name="pod-a",
        workload_type=WorkloadType.POD,
        service_version="v2;prop=1",
    )


def test_parse_baggage_last_value_wins() -> None:
    parsed = parse_baggage(["k8s.namespace.name=a,k8s.namespace.name=b", "k8s.namespace.name=c"])
    assert parsed.namespace == "c"


def test_parse_baggage_nothing() -> None:
    assert parse_baggage([]) == Baggage()
    assert parse_baggage(["k8s.statefulset.name=x"]) == Baggage()


@given(st.lists(st.text(max_size=80), max_size=4))
def test_parse_baggage_never_raises(values: list[str]) -> None:
    parsed = parse_baggage(values)
    assert isinstance(parsed, Baggage)
    for name in (
        "cluster_id",
        "namespace",
        "workload_name",
        "service_name",
        "service_version",
        "region",
        "zone",
    ):
        value = getattr(parsed, name)
        assert value == value.strip() and "," not in value


label = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-.", max_size=20)


@given(
    cluster=label,
    namespace=label,
    name=label,
    kind=st.sampled_from(list(WorkloadType)),
    service=label,
    version=label,
    region=label,
    zone=label,
)
def test_baggage_round_trip(cluster, namespace, name, kind, service, version, region, zone) -> None:
    w = workload(
        cluster_id=cluster,
        namespace=namespace,
        workload_name=name,
        workload_type=kind,
        canonical_name=service,
        canonical_revision=version,
        locality=Locality(region=region, zone=zone),
    )
    assert parse_baggage([baggage_for(w)]) == Baggage(
        cluster_id=cluster,
        namespace=namespace,
        workload_name=name,
        workload_type=kind if name else None,
        service_name=service,
        service_version=version,
        region=region,
        zone=zone,
    )


# ---------------------------------------------------------------------------- traceparent


def test_new_traceparent_uses_the_random_source() -> None:
    calls: list[int] = []

    def counting(n: int) -> bytes:
        calls.append(n)
        return bytes(range(1, n + 1))

    value = new_traceparent(counting)
    assert value == "00-0102030405060708090a0b0c0d0e0f10-1112131415161718-00"
    assert calls == [24]  # both ids from one draw
    assert len(value) == TRACEPARENT_LENGTH == 55
    assert parse_traceparent(value) == value


def test_new_traceparent_default_is_random() -> None:
    a, b = new_traceparent(), new_traceparent()
    assert parse_traceparent(a) == a
    assert a != b


def test_new_traceparent_is_drawn_from_a_seeded_generator_not_the_os() -> None:
    # One generator seeded per process: no getrandom per CONNECT (os.urandom is not called).
    with mock.patch("os.urandom", side_effect=AssertionError("os.urandom called")):
        values = {new_traceparent() for _ in range(1000)}
    assert len(values) == 1000
    assert all(parse_traceparent(v) == v for v in values)


def test_new_traceparent_in_a_forked_child_differs_from_the_parent() -> None:
    # The generator reseeds after fork: a forked worker would otherwise repeat the parent's ids.
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: write its next id and leave without running the test session's exit
        try:
            os.write(write, new_traceparent().encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        child = os.read(read, 100).decode()
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    assert parse_traceparent(child) == child
    assert child != new_traceparent()


@pytest.mark.parametrize(
    "value",
    [
        "",
        "00-0102030405060708090a0b0c0d0e0f10-0102030405060708-0",
        "00-0102030405060708090a0b0c0d0e0f10-0102030405060708-001",
        "00-0102030405060708090A0B0C0D0E0F10-0102030405060708-00",  # upper case
        "00-0102030405060708090a0b0c0d0e0f1g-0102030405060708-00",
        "00_0102030405060708090a0b0c0d0e0f10-0102030405060708-00",
        "00-0102030405060708090a0b0c0d0e0f10-0102030405060708--0",
        "000102030405060708090a0b0c0d0e0f10-0102030405060708-00-",
        "ff-0102030405060708090a0b0c0d0e0f10-0102030405060708-00",
        "00-00000000000000000000000000000000-0102030405060708-00",
        "00-0102030405060708090a0b0c0d0e0f10-0000000000000000-00",
        "00-0102030405060708090a0b0c0d0e0f10-0102030405060708-0\u0661",  # non-ASCII digit
    ],
)
def test_parse_traceparent_rejects(value: str) -> None:
    assert parse_traceparent(value) is None


def test_parse_traceparent_accepts_sampled_flag() -> None:
    value = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert parse_traceparent(value) == value


@given(st.text(max_size=70))
def test_parse_traceparent_any_text(value: str) -> None:
    result = parse_traceparent(value)
    assert result is None or (result == value and len(value) == 55)


@given(st.binary(min_size=16, max_size=16), st.binary(min_size=8, max_size=8))
def test_traceparent_round_trip(trace_id: bytes, parent_id: bytes) -> None:
    value = new_traceparent(lambda n: trace_id + parent_id)
    assert parse_traceparent(value) == value  # every value sent parses, even from all-zero draws
    trace_hex, parent_hex = value.split("-")[1:3]
    assert trace_hex == (trace_id.hex() if any(trace_id) else "0" * 31 + "1")
    assert parent_hex == (parent_id.hex() if any(parent_id) else "0" * 15 + "1")


# ---------------------------------------------------------------------------- forwarded


def test_forwarded_for_ipv4_with_host() -> None:
    value = forwarded_for(SocketAddr.parse("10.0.0.1:51234"), "echo.default.svc.cluster.local")
    assert value == 'for="10.0.0.1:51234";host=echo.default.svc.cluster.local'
    assert parse_forwarded_host(value) == "echo.default.svc.cluster.local"


def test_forwarded_for_ipv6_without_host() -> None:
    value = forwarded_for(SocketAddr.parse("[fd00::1]:80"), None)
    assert value == 'for="[fd00::1]:80"'
    assert parse_forwarded_host(value) is None
    assert forwarded_for(SocketAddr.parse("[fd00::1]:80"), "") == value


@pytest.mark.parametrize(
    ("value", "host"),
    [
        ('for="10.0.0.1:1";host=a.example', "a.example"),
        ('HOST=a.example;for="10.0.0.1:1"', "a.example"),
        ('host="quoted.example:8080"', "quoted.example:8080"),
        ('for="x;host=fake", for=y;host=b.example', "b.example"),
        ('for=x;host="with\\"escape"', 'with"escape'),
        ("for=x, host=second.example", "second.example"),
        (" host = spaced.example ", "spaced.example"),
        ("host=", None),
        ('host="unterminated', None),
        ('host=bad"token', None),
        ('host="a"b"', None),
        ("for=x", None),
        ("", None),
        ('host="trailing\\', None),
    ],
)
def test_parse_forwarded_host(value: str, host: str | None) -> None:
    assert parse_forwarded_host(value) == host


@given(st.text(max_size=80))
def test_parse_forwarded_host_any_text(value: str) -> None:
    result = parse_forwarded_host(value)
    assert result is None or (isinstance(result, str) and result)


hostnames = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-.", min_size=1, max_size=60)


@given(
    ip=st.one_of(st.ip_addresses(v=4), st.ip_addresses(v=6)),
    port=st.integers(min_value=0, max_value=65535),
    host=hostnames,
)
def test_forwarded_round_trip(ip, port: int, host: str) -> None:
    client = SocketAddr.of(ip, port)
    value = forwarded_for(client, host)
    assert parse_forwarded_host(value) == host
    quoted = value.split(";")[0].removeprefix('for="').removesuffix('"')
    assert SocketAddr.parse(quoted) == client
    if isinstance(client.ip, ipaddress.IPv6Address):
        assert quoted.startswith("[")


@given(st.text(alphabet=st.sampled_from(list('ab=;, "\\\t\u00e9')), max_size=40))
def test_split_unquoted_without_a_character_loop_splits_the_same(value: str) -> None:
    """The split that skips the per-character loop (no backslash escapes) is the loop's split."""
    for separators in (",;", ","):
        expected = headers._split_unquoted_by_character(value, separators)
        assert headers._split_unquoted(value, separators) == expected


_forwarded_pieces = st.sampled_from(
    ["host", "HoSt", "ho", "st", "for", "=", ";", ",", '"', "\\", " ", "x", "a.example", "\u0130", "\u017f"]
)


@given(st.lists(_forwarded_pieces, max_size=12).map("".join) | st.text(max_size=40))
def test_parse_forwarded_host_skips_only_values_without_a_host_name(value: str) -> None:
    """The shortcut for values that cannot name `host` gives what the full parse gives."""
    assert parse_forwarded_host(value) == headers._first_host(value)


# `baggage_at`, the memo of `baggage_for` by state version: always the value of the object named.
_BAGGAGE_UIDS = ("Kubernetes//Pod/default/a", "Kubernetes//Pod/default/b")


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["replace", "bump", "ask"]), st.integers(0, 1), st.data()),
        max_size=40,
    )
)
def test_baggage_at_is_baggage_for_of_the_object_named(steps) -> None:
    headers._baggage_values.clear()
    version = 1
    generations = {uid: [workload(uid=uid)] for uid in _BAGGAGE_UIDS}
    names = st.sampled_from(["", "x", "app", "v2"])
    for op, index, data in steps:
        uid = _BAGGAGE_UIDS[index]
        if op == "replace":  # a push replaces the object; the version moves
            generations[uid].append(
                workload(uid=uid, workload_name=data.draw(names), canonical_revision=data.draw(names))
            )
            version += 1
        elif op == "bump":
            version += 1
        else:  # a caller names the current object, or one it kept from before a push
            for named in data.draw(st.lists(st.sampled_from(generations[uid]), min_size=1, max_size=4)):
                assert baggage_at(version, named) == baggage_for(named)


def test_baggage_at_keeps_one_value_per_version_and_is_bounded() -> None:
    headers._baggage_values.clear()
    w = workload()
    hits = headers._baggage_values.hits
    assert baggage_at(5, w) is baggage_at(5, w)
    assert headers._baggage_values.hits == hits + 1
    for i in range(headers.BAGGAGE_MAX_ENTRIES + 5):
        baggage_at(6, workload(uid=f"Kubernetes//Pod/default/w{i}"))
    assert len(headers._baggage_values) <= headers.BAGGAGE_MAX_ENTRIES
