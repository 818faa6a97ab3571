"""The waypoint agent's pieces without sockets: SDS streams, Envoy's version check, the bootstrap."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
from envoy.extensions.transport_sockets.tls.v3 import secret_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.rpc import status_pb2

from ambient_mesh.errors import ConfigError
from ambient_mesh.identity.ca import CertificateAuthority
from ambient_mesh.identity.spiffe import Identity
from ambient_mesh.waypoint.bootstrap import BootstrapParams, bootstrap
from ambient_mesh.waypoint.envoy import check_version, find_envoy, parse_version
from ambient_mesh.waypoint.sds import SECRET_TYPE_URL, SdsStream, SecretSet

WAYPOINT = Identity("cluster.local", "default", "waypoint")


def _secrets() -> SecretSet:
    cert = CertificateAuthority.insecure_test_ca().issue(WAYPOINT, 3600, now=datetime.now(UTC))
    return SecretSet.from_certificate(cert)


def _request(
    *names: str, nonce: str = "", version: str = "", error: bool = False
) -> discovery_pb2.DiscoveryRequest:
    req = discovery_pb2.DiscoveryRequest(
        type_url=SECRET_TYPE_URL, resource_names=names, response_nonce=nonce, version_info=version
    )
    if error:
        req.error_detail.CopyFrom(status_pb2.Status(code=3, message="bad secret"))
    return req


def test_sds_answers_the_names_asked_acks_are_quiet_and_rotation_is_pushed() -> None:
    first, second = _secrets(), _secrets()
    assert first.version != second.version
    stream = SdsStream("s1")
    [resp] = stream.receive(_request("default"), first)
    assert resp.version_info == first.version
    [any_secret] = resp.resources
    secret = secret_pb2.Secret()
    any_secret.Unpack(secret)
    assert secret.name == "default"
    assert b"PRIVATE KEY" in secret.tls_certificate.private_key.inline_bytes
    assert stream.receive(_request("default", nonce=resp.nonce, version=resp.version_info), first) == []
    assert stream.acked_version == first.version
    # The same secrets again are not re-sent; a rotation is.
    assert stream.push(first) == []
    [rotated] = stream.push(second)
    assert rotated.version_info == second.version and rotated.nonce != resp.nonce
    # An answer to the superseded response is stale; a NACK is counted, not answered.
    assert stream.receive(_request("default", nonce=resp.nonce), second) == []
    assert stream.receive(_request("default", nonce=rotated.nonce, error=True), second) == []
    assert stream.nacks == 1


def test_sds_roots_and_waiting_for_a_certificate() -> None:
    stream = SdsStream("s2")
    assert stream.receive(_request("ROOTCA"), None) == []  # nothing to send yet
    secrets = _secrets()
    [resp] = stream.push(secrets)
    secret = secret_pb2.Secret()
    resp.resources[0].Unpack(secret)
    assert (
        secret.name == "ROOTCA" and b"BEGIN CERTIFICATE" in secret.validation_context.trusted_ca.inline_bytes
    )
    # Unknown names are not served; too many names end the stream.
    assert stream.receive(_request("file-cert:/etc/x"), secrets) == []
    with pytest.raises(ValueError, match="at most"):
        stream.receive(_request(*(f"n{i}" for i in range(20))), secrets)


def test_envoy_version_is_parsed_and_checked(tmp_path: Path) -> None:
    assert parse_version(b"envoy  version: abc/1.40.0/Clean/RELEASE/BoringSSL\n") == (1, 40, 0)
    assert parse_version(b"garbage") is None
    wrong = tmp_path / "envoy"
    wrong.write_text("#!/bin/sh\necho 'envoy  version: abc/1.31.2/Clean/RELEASE/BoringSSL'\n")
    wrong.chmod(0o755)
    with pytest.raises(ConfigError, match=r"Envoy 1\.31\.2; the waypoint configuration is for Envoy 1\.40"):
        check_version(find_envoy(str(wrong)))
    with pytest.raises(ConfigError, match="not an executable"):
        find_envoy(str(tmp_path / "missing"))


def test_the_packaged_envoy_is_the_pinned_version() -> None:
    assert check_version(find_envoy())[:2] == (1, 40)


def test_bootstrap_names_the_waypoint_and_points_at_the_agent(tmp_path: Path) -> None:
    doc = bootstrap(
        BootstrapParams(
            pod_name="waypoint-0",
            namespace="shop",
            pod_ip="10.0.0.7",
            gateway_name="wp",
            xds_socket=tmp_path / "xds.sock",
            sds_socket=tmp_path / "sds.sock",
            admin_socket=tmp_path / "admin.sock",
        )
    )
    assert doc["node"]["id"] == "waypoint~10.0.0.7~waypoint-0.shop~shop.svc.cluster.local"
    assert doc["node"]["metadata"]["LABELS"]["gateway.networking.k8s.io/gateway-name"] == "wp"
    assert doc["dynamic_resources"]["ads_config"]["api_type"] == "DELTA_GRPC"
    clusters = {c["name"]: c for c in doc["static_resources"]["clusters"]}
    pipe = clusters["sds-grpc"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert pipe == {"pipe": {"path": str(tmp_path / "sds.sock")}}
