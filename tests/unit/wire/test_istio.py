"""Generated wire types: reproducible, and numbered as Istio numbers them.

The descriptor checks cover docs/istio-behaviour.md, "Wire types" (the details easy to get wrong); the
hand-built byte strings check the numbers against bytes we wrote ourselves rather than bytes protoc made.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FieldDescriptor

from ambient_mesh.errors import AmbientError
from ambient_mesh.wire import regenerate
from ambient_mesh.wire.istio.security import authorization_pb2 as auth
from ambient_mesh.wire.istio.v1.auth import ca_pb2, ca_pb2_grpc
from ambient_mesh.wire.istio.workload import workload_pb2 as wl
from ambient_mesh.wire.istio.workload.zds import zds_pb2 as zds


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def length_delimited(number: int, payload: bytes) -> bytes:
    return tag(number, 2) + varint(len(payload)) + payload


def field(message: type, name: str) -> FieldDescriptor:
    return message.DESCRIPTOR.fields_by_name[name]


# ---------------------------------------------------------------------------- regeneration


def test_committed_generated_code_matches_protos() -> None:
    meta_path, path = list(sys.meta_path), list(sys.path)
    assert regenerate.check() == []
    # protoc ran in an interpreter of its own: this one's import system is as it was.
    assert (sys.meta_path, sys.path) == (meta_path, path)
    assert "grpc_tools.protoc" not in sys.modules


def test_protoc_errors_name_the_file_and_the_problem(tmp_path: Path) -> None:
    (tmp_path / "protos").mkdir()
    (tmp_path / "protos" / "broken.proto").write_text('syntax = "proto3";\nmessage Broken {\n')
    with pytest.raises(AmbientError, match=r"protoc failed with exit code 1: .*broken\.proto:3"):
        regenerate.render(tmp_path / "protos")


def test_check_reports_edited_missing_and_stale_files(tmp_path: Path) -> None:
    shutil.copytree(regenerate.PROTO_ROOT, tmp_path / "protos")
    assert regenerate.write(tmp_path) != []
    assert regenerate.check(tmp_path) == []
    generated = tmp_path / regenerate.GENERATED_DIR
    (generated / "workload" / "workload_pb2.py").write_text("# edited\n")
    (generated / "security" / "authorization_pb2.pyi").unlink()
    (generated / "leftover_pb2.py").write_text("")
    assert regenerate.check(tmp_path) == [
        "ambient_mesh/wire/istio/leftover_pb2.py",
        "ambient_mesh/wire/istio/security/authorization_pb2.pyi",
        "ambient_mesh/wire/istio/workload/workload_pb2.py",
    ]
    regenerate.write(tmp_path)
    assert regenerate.check(tmp_path) == []
    assert not (generated / "leftover_pb2.py").exists()


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert regenerate.main(["--check"]) == 0
    shutil.copytree(regenerate.PROTO_ROOT, tmp_path / "protos")
    assert regenerate.main(["--check"], repo_root=tmp_path) == 1
    assert "out of date: ambient_mesh/wire/istio/workload/workload_pb2.py" in capsys.readouterr().err
    assert regenerate.main([], repo_root=tmp_path) == 0
    assert "wrote ambient_mesh/wire/istio/v1/auth/ca_pb2_grpc.py" in capsys.readouterr().out
    assert regenerate.main(["--check"], repo_root=tmp_path) == 0


def test_generated_files_are_the_expected_set() -> None:
    assert sorted(regenerate.existing()) == [
        "ambient_mesh/wire/istio/__init__.py",
        "ambient_mesh/wire/istio/security/__init__.py",
        "ambient_mesh/wire/istio/security/authorization_pb2.py",
        "ambient_mesh/wire/istio/security/authorization_pb2.pyi",
        "ambient_mesh/wire/istio/v1/__init__.py",
        "ambient_mesh/wire/istio/v1/auth/__init__.py",
        "ambient_mesh/wire/istio/v1/auth/ca_pb2.py",
        "ambient_mesh/wire/istio/v1/auth/ca_pb2.pyi",
        "ambient_mesh/wire/istio/v1/auth/ca_pb2_grpc.py",
        "ambient_mesh/wire/istio/workload/__init__.py",
        "ambient_mesh/wire/istio/workload/workload_pb2.py",
        "ambient_mesh/wire/istio/workload/workload_pb2.pyi",
        "ambient_mesh/wire/istio/workload/zds/__init__.py",
        "ambient_mesh/wire/istio/workload/zds/zds_pb2.py",
        "ambient_mesh/wire/istio/workload/zds/zds_pb2.pyi",
    ]


# ---------------------------------------------------------------------------- full names


@pytest.mark.parametrize(
    ("message", "full_name"),
    [
        (wl.Address, "istio.workload.Address"),
        (wl.Workload, "istio.workload.Workload"),
        (wl.Service, "istio.workload.Service"),
        (auth.Authorization, "istio.security.Authorization"),
        (ca_pb2.IstioCertificateRequest, "istio.v1.auth.IstioCertificateRequest"),
        (ca_pb2.IstioCertificateResponse, "istio.v1.auth.IstioCertificateResponse"),
        (zds.WorkloadRequest, "istio.workload.zds.WorkloadRequest"),
        (zds.WorkloadResponse, "istio.workload.zds.WorkloadResponse"),
        (zds.ZdsHello, "istio.workload.zds.ZdsHello"),
    ],
)
def test_full_names(message: type, full_name: str) -> None:
    assert message.DESCRIPTOR.full_name == full_name


def test_ca_service_grpc_path() -> None:
    service = ca_pb2.DESCRIPTOR.services_by_name["IstioCertificateService"]
    method = service.methods_by_name["CreateCertificate"]
    assert f"/{service.full_name}/{method.name}" == "/istio.v1.auth.IstioCertificateService/CreateCertificate"
    assert method.input_type is ca_pb2.IstioCertificateRequest.DESCRIPTOR
    assert method.output_type is ca_pb2.IstioCertificateResponse.DESCRIPTOR

    class Recorder:
        def __init__(self) -> None:
            self.paths: list[str] = []

        def unary_unary(self, path: str, **_: object) -> object:
            self.paths.append(path)
            return object()

    channel = Recorder()
    ca_pb2_grpc.IstioCertificateServiceStub(channel)
    assert channel.paths == ["/istio.v1.auth.IstioCertificateService/CreateCertificate"]


# ---------------------------------------------------------------------------- checklist numbers


@pytest.mark.parametrize(
    ("message", "name", "number"),
    [
        (wl.Workload, "uid", 20),
        (wl.Workload, "hostname", 21),
        (wl.Workload, "services", 22),
        (wl.Workload, "application_tunnel", 23),
        (wl.Workload, "locality", 24),
        (wl.Workload, "network_mode", 25),
        (wl.Workload, "extensions", 26),
        (wl.Workload, "capacity", 27),
        (wl.Workload, "network_gateway", 19),
        (wl.Workload, "cluster_id", 18),
        (wl.GatewayAddress, "hbone_mtls_port", 3),
        (wl.Service, "visibility", 14),
        (wl.Service, "weighted_waypoints", 13),
        (wl.NetworkAddress, "length", 3),
        (auth.Authorization, "rules", 5),
        (auth.Rule, "clauses", 1),
        (auth.Clause, "matches", 2),
        (auth.Match, "service_accounts", 11),
        (auth.Match, "extensions", 13),
        (auth.ServiceAccountMatch, "serviceAccount", 2),
        (auth.StringMatch, "presence", 4),
        (ca_pb2.IstioCertificateRequest, "csr", 1),
        (ca_pb2.IstioCertificateRequest, "validity_duration", 3),
        (ca_pb2.IstioCertificateRequest, "metadata", 4),
        (ca_pb2.IstioCertificateResponse, "cert_chain", 1),
        (zds.DelWorkload, "uid", 2),
        (zds.KeepWorkload, "uid", 1),
        (zds.AddWorkload, "workload_info", 2),
        (zds.WorkloadRequest, "add", 1),
        (zds.WorkloadRequest, "del", 2),
        (zds.WorkloadRequest, "snapshot_sent", 3),
        (zds.WorkloadRequest, "keep", 5),
    ],
)
def test_field_numbers(message: type, name: str, number: int) -> None:
    assert field(message, name).number == number


def test_unused_numbers_are_absent() -> None:
    assert 15 not in wl.Workload.DESCRIPTOR.fields_by_number
    assert 4 not in wl.GatewayAddress.DESCRIPTOR.fields_by_number
    assert 1 not in auth.Clause.DESCRIPTOR.fields_by_number
    assert 2 not in ca_pb2.IstioCertificateRequest.DESCRIPTOR.fields_by_number
    assert 1 not in zds.DelWorkload.DESCRIPTOR.fields_by_number
    assert 4 not in zds.WorkloadInfo.DESCRIPTOR.fields_by_number
    assert 4 not in zds.WorkloadRequest.DESCRIPTOR.fields_by_number


def test_reserved_ranges_and_names() -> None:
    def reserved(message: type) -> tuple[set[int], set[str]]:
        proto = descriptor_pb2.DescriptorProto()
        message.DESCRIPTOR.CopyToProto(proto)
        numbers = {n for r in proto.reserved_range for n in range(r.start, r.end)}
        return numbers, set(proto.reserved_name)

    assert reserved(wl.Workload) == ({15}, set())
    assert reserved(wl.GatewayAddress) == ({4}, {"hbone_single_tls_port"})
    assert reserved(zds.WorkloadInfo) == ({4}, {"trust_domain"})
    assert reserved(ca_pb2.IstioCertificateRequest)[0] == {2}


def test_types_that_are_easy_to_get_wrong() -> None:
    capacity = field(wl.Workload, "capacity")
    assert capacity.message_type.full_name == "google.protobuf.UInt32Value"
    assert field(wl.NetworkAddress, "length").has_presence
    assert not field(wl.Workload, "uid").has_presence
    assert field(auth.StringMatch, "presence").message_type.full_name == "google.protobuf.Empty"
    assert (
        field(ca_pb2.IstioCertificateRequest, "metadata").message_type.full_name == "google.protobuf.Struct"
    )
    assert field(ca_pb2.IstioCertificateRequest, "validity_duration").type == FieldDescriptor.TYPE_INT64
    assert field(wl.Workload, "services").message_type.GetOptions().map_entry
    assert field(wl.Workload, "addresses").type == FieldDescriptor.TYPE_BYTES
    assert field(auth.Authorization, "extensions").message_type is wl.Extension.DESCRIPTOR
    oneofs = {o.name: sorted(f.number for f in o.fields) for o in zds.WorkloadRequest.DESCRIPTOR.oneofs}
    assert oneofs == {"payload": [1, 2, 3, 5]}
    assert [f.number for f in wl.Address.DESCRIPTOR.oneofs_by_name["type"].fields] == [1, 2]


@pytest.mark.parametrize(
    ("enum", "values"),
    [
        (wl.TunnelProtocol, {"NONE": 0, "HBONE": 1, "LEGACY_ISTIO_MTLS": 2}),
        (wl.WorkloadStatus, {"HEALTHY": 0, "UNHEALTHY": 1}),
        (wl.WorkloadType, {"DEPLOYMENT": 0, "CRONJOB": 1, "POD": 2, "JOB": 3}),
        (wl.NetworkMode, {"STANDARD": 0, "HOST_NETWORK": 1}),
        (wl.IPFamilies, {"AUTOMATIC": 0, "IPV4_ONLY": 1, "IPV6_ONLY": 2, "DUAL": 3}),
        (wl.AppProtocol, {"UNKNOWN": 0, "HTTP11": 1, "HTTP2": 2, "GRPC": 3, "TCP": 4, "TLS": 5}),
        (wl.ApplicationTunnel.Protocol, {"NONE": 0, "PROXY": 1}),
        (
            wl.LoadBalancing.Scope,
            {
                "UNSPECIFIED_SCOPE": 0,
                "REGION": 1,
                "ZONE": 2,
                "SUBZONE": 3,
                "NODE": 4,
                "CLUSTER": 5,
                "NETWORK": 6,
            },
        ),
        (wl.LoadBalancing.Mode, {"UNSPECIFIED_MODE": 0, "STRICT": 1, "FAILOVER": 2, "PASSTHROUGH": 3}),
        (wl.LoadBalancing.HealthPolicy, {"ONLY_HEALTHY": 0, "ALLOW_ALL": 1}),
        (wl.Service.Visibility, {"PUBLIC": 0, "NAMESPACE": 1}),
        (auth.Scope, {"GLOBAL": 0, "NAMESPACE": 1, "WORKLOAD_SELECTOR": 2}),
        (auth.Action, {"ALLOW": 0, "DENY": 1}),
        (zds.Version, {"NOT_USED": 0, "V1": 1}),
    ],
)
def test_enum_values(enum, values: dict[str, int]) -> None:
    assert dict(enum.items()) == values


# ---------------------------------------------------------------------------- bytes


def full_address() -> wl.Address:
    gateway = wl.GatewayAddress(
        address=wl.NetworkAddress(network="net1", address=bytes([10, 0, 0, 9])), hbone_mtls_port=15008
    )
    workload = wl.Workload(
        uid="Kubernetes//Pod/default/app-1",
        name="app-1",
        namespace="default",
        addresses=[bytes([10, 1, 2, 3]), bytes(range(16))],
        hostname="app-1.example.internal",
        network="net1",
        tunnel_protocol=wl.HBONE,
        trust_domain="cluster.local",
        service_account="app",
        waypoint=wl.GatewayAddress(
            hostname=wl.NamespacedHostname(
                namespace="default", hostname="waypoint.default.svc.cluster.local"
            ),
            hbone_mtls_port=15008,
        ),
        network_gateway=gateway,
        node="node-a",
        canonical_name="app",
        canonical_revision="v1",
        workload_type=wl.POD,
        workload_name="app-1",
        native_tunnel=True,
        application_tunnel=wl.ApplicationTunnel(protocol=wl.ApplicationTunnel.PROXY, port=15088),
        services={
            "default/app.default.svc.cluster.local": wl.PortList(
                ports=[wl.Port(service_port=80, target_port=8080, app_protocol=wl.HTTP2)]
            )
        },
        authorization_policies=["default/allow-app"],
        status=wl.UNHEALTHY,
        cluster_id="Kubernetes",
        locality=wl.Locality(region="r1", zone="z1", subzone="s1"),
        network_mode=wl.HOST_NETWORK,
        extensions=[wl.Extension(name="x")],
    )
    workload.capacity.value = 0
    workload.extensions[0].config.Pack(wl.Locality(region="packed"))
    return wl.Address(workload=workload)


def full_service() -> wl.Address:
    waypoint = wl.GatewayAddress(
        hostname=wl.NamespacedHostname(namespace="default", hostname="waypoint"), hbone_mtls_port=15008
    )
    service = wl.Service(
        name="app",
        namespace="default",
        hostname="app.default.svc.cluster.local",
        addresses=[
            wl.NetworkAddress(network="", address=bytes([10, 96, 0, 1])),
            wl.NetworkAddress(network="", address=bytes(16), length=0),
        ],
        ports=[wl.Port(service_port=80, target_port=0, app_protocol=wl.TCP)],
        subject_alt_names=["spiffe://cluster.local/ns/default/sa/app"],
        waypoint=waypoint,
        load_balancing=wl.LoadBalancing(
            routing_preference=[wl.LoadBalancing.NETWORK, wl.LoadBalancing.REGION],
            mode=wl.LoadBalancing.FAILOVER,
            health_policy=wl.LoadBalancing.ALLOW_ALL,
        ),
        ip_families=wl.DUAL,
        canonical=True,
        ingress_use_waypoint=True,
        weighted_waypoints=[wl.WeightedWaypoint(destination=waypoint, weight=7)],
        visibility=wl.Service.NAMESPACE,
        extensions=[wl.Extension(name="opaque")],
    )
    return wl.Address(service=service)


@pytest.mark.parametrize("build", [full_address, full_service])
def test_round_trip_through_bytes(build) -> None:
    original = build()
    (member,) = original.ListFields()
    descriptor, message = member
    # "Fully filled": every field of the workload or service is set, so every number is exercised.
    assert len(message.ListFields()) == len(descriptor.message_type.fields)
    encoded = original.SerializeToString(deterministic=True)
    decoded = wl.Address.FromString(encoded)
    assert decoded == original
    assert decoded.SerializeToString(deterministic=True) == encoded


def test_round_trip_keeps_presence() -> None:
    address = full_address()
    decoded = wl.Address.FromString(address.SerializeToString())
    assert decoded.workload.HasField("capacity")
    assert decoded.workload.capacity.value == 0
    assert decoded.workload.network_gateway.WhichOneof("destination") == "address"
    assert decoded.workload.waypoint.WhichOneof("destination") == "hostname"
    service = wl.Address.FromString(full_service().SerializeToString()).service
    assert not service.addresses[0].HasField("length")
    assert service.addresses[1].HasField("length")
    assert service.addresses[1].length == 0


def test_decode_hand_built_workload() -> None:
    uid = b"Kubernetes//Pod/ns1/pod-a"
    workload_bytes = (
        # uid = 20: (20 << 3 | 2) = 162 needs two varint bytes
        b"\xa2\x01"
        + bytes([len(uid)])
        + uid
        # addresses = 3
        + b"\x1a\x04"
        + bytes([10, 0, 0, 7])
        # capacity = 27, a UInt32Value whose field 1 holds 3
        + b"\xda\x01\x02\x08\x03"
    )
    encoded = b"\x0a" + bytes([len(workload_bytes)]) + workload_bytes
    address = wl.Address.FromString(encoded)
    assert address.WhichOneof("type") == "workload"
    assert address.workload.uid == uid.decode()
    assert list(address.workload.addresses) == [bytes([10, 0, 0, 7])]
    assert address.workload.capacity.value == 3
    assert address.workload.name == ""


def test_decode_hand_built_service_address_with_zero_length_prefix() -> None:
    network_address = length_delimited(2, bytes([10, 96, 0, 0])) + tag(3, 0) + varint(0)
    service = length_delimited(3, b"svc.ns.svc.cluster.local") + length_delimited(4, network_address)
    address = wl.Address.FromString(length_delimited(2, service))
    vip = address.service.addresses[0]
    assert address.service.hostname == "svc.ns.svc.cluster.local"
    assert vip.address == bytes([10, 96, 0, 0])
    assert vip.HasField("length")


def test_decode_hand_built_authorization() -> None:
    service_account = length_delimited(1, b"ns1") + length_delimited(2, b"sa1")
    string_match = length_delimited(4, b"")  # presence: an empty google.protobuf.Empty
    match = (
        length_delimited(11, service_account) + length_delimited(4, string_match) + tag(9, 0) + varint(8080)
    )
    clause = length_delimited(2, match)
    rule = length_delimited(1, clause)
    policy = (
        length_delimited(1, b"allow")
        + length_delimited(2, b"ns1")
        + tag(3, 0)
        + varint(2)
        + tag(4, 0)
        + varint(1)
        + length_delimited(5, rule)
    )
    decoded = auth.Authorization.FromString(policy)
    assert decoded.scope == auth.WORKLOAD_SELECTOR
    assert decoded.action == auth.DENY
    m = decoded.rules[0].clauses[0].matches[0]
    assert m.service_accounts[0].namespace == "ns1"
    assert m.service_accounts[0].serviceAccount == "sa1"
    assert m.not_principals[0].WhichOneof("match_type") == "presence"
    assert list(m.destination_ports) == [8080]


def test_decode_hand_built_zds_messages() -> None:
    delete = zds.WorkloadRequest.FromString(length_delimited(2, length_delimited(2, b"pod-uid")))
    assert delete.WhichOneof("payload") == "del"
    assert getattr(delete, "del").uid == "pod-uid"
    keep = zds.WorkloadRequest.FromString(length_delimited(5, length_delimited(1, b"pod-uid")))
    assert keep.WhichOneof("payload") == "keep"
    assert keep.keep.uid == "pod-uid"
    snapshot = zds.WorkloadRequest.FromString(length_delimited(3, b""))
    assert snapshot.WhichOneof("payload") == "snapshot_sent"
    assert zds.ZdsHello(version=zds.V1).SerializeToString() == tag(1, 0) + varint(1)
    ack = zds.WorkloadResponse(ack=zds.Ack(error="boom")).SerializeToString()
    assert ack == length_delimited(1, length_delimited(1, b"boom"))


def test_encode_ca_request_matches_hand_built_bytes() -> None:
    request = ca_pb2.IstioCertificateRequest(csr="PEM", validity_duration=86400)
    request.metadata["ImpersonatedIdentity"] = "spiffe://cluster.local/ns/a/sa/b"
    value = length_delimited(3, b"spiffe://cluster.local/ns/a/sa/b")  # Value.string_value = 3
    entry = length_delimited(1, b"ImpersonatedIdentity") + length_delimited(2, value)
    expected = (
        length_delimited(1, b"PEM")
        + tag(3, 0)
        + varint(86400)
        + length_delimited(4, length_delimited(1, entry))
    )
    assert request.SerializeToString(deterministic=True) == expected
