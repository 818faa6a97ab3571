"""proxy/inbound.py `parse_authority`: a CONNECT :authority split and parsed as split_host_port
and ip_address do, its answers kept per value, bounded against a peer that names many."""

from __future__ import annotations

import ipaddress

import pytest

from ambient_mesh.errors import ProtocolError
from ambient_mesh.proxy import inbound
from ambient_mesh.proxy.inbound import MAX_AUTHORITIES_KEPT, MAX_KEPT_AUTHORITY_CHARS, parse_authority


@pytest.mark.parametrize(
    ("authority", "expected"),
    [
        ("10.0.0.3:8080", ("10.0.0.3", 8080, ipaddress.ip_address("10.0.0.3"))),
        ("[fd00::3]:80", ("fd00::3", 80, ipaddress.ip_address("fd00::3"))),
        ("[::ffff:10.0.0.3]:80", ("::ffff:10.0.0.3", 80, ipaddress.ip_address("10.0.0.3"))),
        ("echo.default.svc.cluster.local:80", ("echo.default.svc.cluster.local", 80, None)),
    ],
)
def test_the_same_answer_first_and_from_the_kept_entry(authority, expected):
    assert parse_authority(authority) == expected
    assert parse_authority(authority) == expected


@pytest.mark.parametrize("authority", ["10.0.0.3", "10.0.0.3:99999", "fd00::3:80", "[fd00::3:80", ":80"])
def test_a_bad_authority_raises_every_time_and_is_not_kept(authority):
    for _ in range(2):
        with pytest.raises(ProtocolError):
            parse_authority(authority)
    assert authority not in inbound._authorities


def test_a_peer_naming_many_authorities_cannot_grow_the_entries_past_the_bound():
    for i in range(3 * MAX_AUTHORITIES_KEPT):
        host = f"h{i}.example"
        assert parse_authority(f"{host}:{i % 65536}") == (host, i % 65536, None)
        assert len(inbound._authorities) <= MAX_AUTHORITIES_KEPT


def test_a_long_authority_is_parsed_but_not_kept():
    host = "a" * MAX_KEPT_AUTHORITY_CHARS
    authority = f"{host}:443"
    assert parse_authority(authority) == (host, 443, None)
    assert authority not in inbound._authorities
