"""net.py: socket addresses and host:port parse any text safely, round-trip and sort; packed
addresses and the address text cache."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from ambient_mesh.errors import ProtocolError
from ambient_mesh.net import SocketAddr, split_host_port

# Text that looks like an authority often enough to reach every branch of the parser.
authority_alphabet = st.sampled_from(list("0123456789abcdefABCDEF:.[]%/ -+x\u0661\uff11")) | st.characters()
authority_text = st.one_of(
    st.text(max_size=60),
    st.text(alphabet=authority_alphabet, max_size=60),
    st.builds(
        lambda host, port: f"{host}:{port}",
        st.one_of(
            st.ip_addresses(v=4).map(str),
            st.ip_addresses(v=6).map(lambda ip: f"[{ip}]"),
            st.text(max_size=20),
        ),
        st.one_of(st.integers(min_value=-5, max_value=200000).map(str), st.text(max_size=6)),
    ),
)
ports = st.integers(min_value=0, max_value=65535)


@given(authority_text)
@example("[::1]:80")
@example("[::1]80")
@example("[]:1")
@example("::1:80")
@example("1.2.3.4:065535")
@example("1.2.3.4:99999")
@example("[fe80::1%eth0]:80")
@example("[::ffff:1.2.3.4]:80")
def test_socket_addr_parse_any_text(text: str) -> None:
    try:
        addr = SocketAddr.parse(text)
    except ProtocolError:
        return
    assert 0 <= addr.port <= 65535
    assert isinstance(addr.ip, ipaddress.IPv4Address | ipaddress.IPv6Address)
    # Whatever parses, formats to a form that parses back to the same address.
    assert SocketAddr.parse(str(addr)) == addr


@given(authority_text)
def test_split_host_port_any_text(text: str) -> None:
    try:
        host, port = split_host_port(text)
    except ProtocolError:
        return
    assert 0 <= port <= 65535
    assert isinstance(host, str)
    assert int(text.rpartition(":")[2]) == port


@given(st.ip_addresses(v=4), ports)
def test_socket_addr_v4_round_trip(ip: ipaddress.IPv4Address, port: int) -> None:
    addr = SocketAddr(ip, port)
    assert str(addr) == f"{ip}:{port}"
    assert SocketAddr.parse(str(addr)) == addr
    assert split_host_port(str(addr)) == (str(ip), port)


@given(st.ip_addresses(v=6), ports)
def test_socket_addr_v6_round_trip(ip: ipaddress.IPv6Address, port: int) -> None:
    addr = SocketAddr(ip, port)
    assert str(addr) == f"[{ip}]:{port}"
    assert SocketAddr.parse(str(addr)) == addr
    assert split_host_port(str(addr)) == (str(ip), port)
    assert SocketAddr.from_sockaddr(addr.sockaddr()).port == port


socket_addrs = st.builds(SocketAddr, st.one_of(st.ip_addresses(v=4), st.ip_addresses(v=6)), ports)


@given(st.lists(socket_addrs, max_size=8))
def test_socket_addrs_of_both_families_sort(addrs: list[SocketAddr]) -> None:
    ordered = sorted(addrs)
    assert all(a <= b and not b < a for a, b in zip(ordered, ordered[1:], strict=False))
    versions = [a.ip.version for a in ordered]
    assert versions == sorted(versions)
    assert sorted(addrs, reverse=True) == ordered[::-1]


@pytest.mark.parametrize(
    "text",
    [
        "::1:80",
        "1.2.3.4",
        "1.2.3.4:",
        ":80",
        "[::1]",
        "[::1]80",
        "[::1:80",
        "1.2.3.4:65536",
        "1.2.3.4:-1",
        "1.2.3.4:\u0661",
        "1.2.3.4:+80",
        "name.example:80",
        "1.2.3.4:123456",
    ],
)
def test_socket_addr_parse_rejects(text: str) -> None:
    with pytest.raises(ProtocolError):
        SocketAddr.parse(text)


def test_split_host_port_keeps_hostnames() -> None:
    assert split_host_port("echo.default.svc.cluster.local:8080") == ("echo.default.svc.cluster.local", 8080)
    assert split_host_port("[fd00::1]:0") == ("fd00::1", 0)


def test_packed_addresses_are_kept_and_unmapped():
    """SO_ORIGINAL_DST hands raw bytes: parsed once per address, IPv4-mapped IPv6 unmapped."""
    from ambient_mesh.net import ip_address

    v4 = ip_address(b"\x0a\x00\x00\x01")
    assert v4 == ipaddress.IPv4Address("10.0.0.1") and ip_address(b"\x0a\x00\x00\x01") is v4
    mapped = ip_address(b"\x00" * 10 + b"\xff\xff" + b"\x0a\x00\x00\x01")
    assert mapped == v4 and mapped.version == 4
    assert ip_address(b"\x20\x01" + b"\x00" * 13 + b"\x01") == ipaddress.IPv6Address("2001::1")


def test_address_text_stays_right_past_the_cache_bound():
    """The text cache is keyed by object: every address, new or kept, prints as itself."""
    from ambient_mesh import net

    addresses = [SocketAddr(ipaddress.IPv4Address(n), 80) for n in range(net.IP_TEXT_CACHE_ENTRIES + 50)]
    for _ in range(2):
        assert [str(a) for a in addresses] == [
            f"{ipaddress.IPv4Address(n)}:80" for n in range(len(addresses))
        ]
    assert len(net._ip_texts) <= net.IP_TEXT_CACHE_ENTRIES
    assert str(SocketAddr.parse("[2001:db8::1]:8080")) == "[2001:db8::1]:8080"
