"""SOCKS5 handshake playbooks (bytes in -> event and bytes out) and parser properties."""

from __future__ import annotations

import errno
import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ambient_mesh.errors import AmbientError, ProtocolError
from ambient_mesh.net import SocketAddr
from ambient_mesh.proxy.socks5 import (
    MAX_BUFFERED_BYTES,
    ConnectRequest,
    NeedMoreData,
    ReplyCode,
    Socks5Error,
    Socks5Handshake,
    Socks5State,
    encode_reply,
    reply_for_failure,
)

GREETING = b"\x05\x01\x00"
METHOD_SELECTED = b"\x05\x00"


def connect_v4(ip: str, port: int) -> bytes:
    return b"\x05\x01\x00\x01" + ipaddress.IPv4Address(ip).packed + port.to_bytes(2, "big")


def connect_v6(ip: str, port: int) -> bytes:
    return b"\x05\x01\x00\x04" + ipaddress.IPv6Address(ip).packed + port.to_bytes(2, "big")


def connect_domain(name: bytes, port: int) -> bytes:
    return b"\x05\x01\x00\x03" + bytes([len(name)]) + name + port.to_bytes(2, "big")


def greeted() -> Socks5Handshake:
    hs = Socks5Handshake()
    assert hs.receive_data(GREETING) == NeedMoreData()
    assert hs.data_to_send() == METHOD_SELECTED
    return hs


# ---------------------------------------------------------------------------- success paths


def test_ipv4_connect_playbook() -> None:
    hs = Socks5Handshake()
    assert hs.state is Socks5State.GREETING
    assert hs.receive_data(b"\x05") == NeedMoreData()
    assert hs.data_to_send() == b""
    assert hs.receive_data(b"\x02\x02\x00") == NeedMoreData()
    assert hs.data_to_send() == METHOD_SELECTED
    assert hs.state is Socks5State.REQUEST
    event = hs.receive_data(connect_v4("10.0.0.5", 8080))
    assert event == ConnectRequest(host=ipaddress.IPv4Address("10.0.0.5"), port=8080)
    assert hs.state is Socks5State.CONNECTING
    assert repr(hs) == "<Socks5Handshake connecting to 10.0.0.5:8080, 0 bytes buffered>"
    assert hs.data_to_send() == b""
    reply = hs.reply(ReplyCode.SUCCEEDED, SocketAddr.parse("10.0.0.1:40000"))
    assert reply == b"\x05\x00\x00\x01\x0a\x00\x00\x01\x9c\x40"
    assert hs.data_to_send() == reply
    assert hs.state is Socks5State.ESTABLISHED
    assert hs.trailing_data() == b""


def test_ipv6_connect() -> None:
    hs = greeted()
    event = hs.receive_data(connect_v6("fd00::7", 443))
    assert event == ConnectRequest(host=ipaddress.IPv6Address("fd00::7"), port=443)
    assert repr(hs) == "<Socks5Handshake connecting to [fd00::7]:443, 0 bytes buffered>"
    hs.reply(ReplyCode.SUCCEEDED, SocketAddr.parse("[fd00::1]:1"))
    assert hs.data_to_send() == b"\x05\x00\x00\x04" + ipaddress.IPv6Address("fd00::1").packed + b"\x00\x01"


def test_ipv4_mapped_ipv6_is_unmapped() -> None:
    hs = greeted()
    event = hs.receive_data(connect_v6("::ffff:10.1.2.3", 80))
    assert event == ConnectRequest(host=ipaddress.IPv4Address("10.1.2.3"), port=80)


def test_domain_connect() -> None:
    hs = greeted()
    event = hs.receive_data(connect_domain(b"echo.default.svc.cluster.local", 9000))
    assert event == ConnectRequest(host="echo.default.svc.cluster.local", port=9000)
    assert repr(hs) == "<Socks5Handshake connecting to echo.default.svc.cluster.local:9000, 0 bytes buffered>"


def test_pipelined_greeting_request_and_payload() -> None:
    hs = Socks5Handshake()
    event = hs.receive_data(GREETING + connect_v4("127.0.0.1", 80) + b"GET / HTTP/1.1\r\n")
    assert event == ConnectRequest(host=ipaddress.IPv4Address("127.0.0.1"), port=80)
    assert hs.data_to_send() == METHOD_SELECTED
    # More application data while the shell is still connecting is kept too.
    assert hs.receive_data(b"Host: x\r\n") == NeedMoreData()
    assert hs.trailing_data() == b"GET / HTTP/1.1\r\nHost: x\r\n"
    assert hs.trailing_data() == b""
    hs.reply(ReplyCode.SUCCEEDED)
    assert hs.receive_data(b"more") == NeedMoreData()
    assert hs.trailing_data() == b"more"


def test_several_methods_with_no_auth_last() -> None:
    hs = Socks5Handshake()
    assert hs.receive_data(b"\x05\x03\x02\x01\x00") == NeedMoreData()
    assert hs.data_to_send() == METHOD_SELECTED


def test_nonzero_reserved_byte_is_ignored() -> None:
    hs = greeted()
    event = hs.receive_data(b"\x05\x01\x7f\x01\x01\x02\x03\x04\x00\x50")
    assert event == ConnectRequest(host=ipaddress.IPv4Address("1.2.3.4"), port=80)


def test_request_byte_by_byte() -> None:
    hs = greeted()
    request = connect_domain(b"a.b", 1)
    for b in request[:-1]:
        assert hs.receive_data(bytes([b])) == NeedMoreData()
    assert hs.receive_data(request[-1:]) == ConnectRequest(host="a.b", port=1)


# ---------------------------------------------------------------------------- replies


@pytest.mark.parametrize(
    "code",
    [
        ReplyCode.GENERAL_FAILURE,
        ReplyCode.NOT_ALLOWED,
        ReplyCode.NETWORK_UNREACHABLE,
        ReplyCode.HOST_UNREACHABLE,
        ReplyCode.CONNECTION_REFUSED,
        ReplyCode.TTL_EXPIRED,
    ],
)
def test_failure_reply_closes(code: ReplyCode) -> None:
    hs = greeted()
    hs.receive_data(connect_v4("10.0.0.5", 80))
    assert hs.reply(code) == bytes([5, code, 0, 1, 0, 0, 0, 0, 0, 0])
    assert hs.state is Socks5State.CLOSED
    with pytest.raises(Socks5Error):
        hs.receive_data(b"x")


def test_reply_code_values() -> None:
    assert [(c.name, c.value) for c in ReplyCode] == [
        ("SUCCEEDED", 0),
        ("GENERAL_FAILURE", 1),
        ("NOT_ALLOWED", 2),
        ("NETWORK_UNREACHABLE", 3),
        ("HOST_UNREACHABLE", 4),
        ("CONNECTION_REFUSED", 5),
        ("TTL_EXPIRED", 6),
        ("COMMAND_NOT_SUPPORTED", 7),
        ("ADDRESS_TYPE_NOT_SUPPORTED", 8),
    ]


def test_reply_before_request_is_a_usage_error() -> None:
    hs = greeted()
    with pytest.raises(AmbientError):
        hs.reply(ReplyCode.SUCCEEDED)
    hs.receive_data(connect_v4("10.0.0.5", 80))
    hs.reply(ReplyCode.SUCCEEDED)
    with pytest.raises(AmbientError):
        hs.reply(ReplyCode.SUCCEEDED)


def test_encode_reply_without_bound_address() -> None:
    assert encode_reply(ReplyCode.SUCCEEDED) == b"\x05\x00\x00\x01\x00\x00\x00\x00\x00\x00"


# ---------------------------------------------------------------------------- failure paths


def test_no_acceptable_method() -> None:
    hs = Socks5Handshake()
    with pytest.raises(Socks5Error) as err:
        hs.receive_data(b"\x05\x01\x02")  # username/password only
    assert err.value.reply is None
    assert hs.data_to_send() == b"\x05\xff"
    assert hs.state is Socks5State.CLOSED


def test_zero_methods_offered() -> None:
    hs = Socks5Handshake()
    with pytest.raises(Socks5Error):
        hs.receive_data(b"\x05\x00")
    assert hs.data_to_send() == b"\x05\xff"


@pytest.mark.parametrize("data", [b"\x04\x01\x00", b"GET / HTTP/1.1\r\n", b"\x00\x00"])
def test_wrong_version_in_greeting_gets_no_acceptable_methods(data: bytes) -> None:
    hs = Socks5Handshake()
    with pytest.raises(Socks5Error) as err:
        hs.receive_data(data)
    assert isinstance(err.value, ProtocolError)
    assert err.value.reply is None
    assert hs.data_to_send() == b"\x05\xff"
    assert hs.state is Socks5State.CLOSED
    assert hs.trailing_data() == b""


def test_wrong_version_in_request() -> None:
    hs = greeted()
    with pytest.raises(Socks5Error) as err:
        hs.receive_data(b"\x04\x01\x00\x01\x01\x02\x03\x04\x00\x50")
    assert err.value.reply is ReplyCode.GENERAL_FAILURE
    assert hs.data_to_send() == encode_reply(ReplyCode.GENERAL_FAILURE)


@pytest.mark.parametrize("command", [0x02, 0x03, 0x00, 0xFF])  # BIND, UDP ASSOCIATE, junk
def test_command_not_supported(command: int) -> None:
    hs = greeted()
    with pytest.raises(Socks5Error) as err:
        hs.receive_data(bytes([5, command, 0, 1]))
    assert err.value.reply is ReplyCode.COMMAND_NOT_SUPPORTED
    assert hs.data_to_send() == b"\x05\x07\x00\x01\x00\x00\x00\x00\x00\x00"
    assert hs.state is Socks5State.CLOSED


@pytest.mark.parametrize("atyp", [0x00, 0x02, 0x05, 0xFF])
def test_address_type_not_supported(atyp: int) -> None:
    hs = greeted()
    with pytest.raises(Socks5Error) as err:
        hs.receive_data(bytes([5, 1, 0, atyp]))
    assert err.value.reply is ReplyCode.ADDRESS_TYPE_NOT_SUPPORTED
    assert hs.data_to_send() == encode_reply(ReplyCode.ADDRESS_TYPE_NOT_SUPPORTED)


@pytest.mark.parametrize("name", [b"", b"caf\xc3\xa9.example", b"a b", b"a\x00b", b"\x7f"])
def test_bad_domain_names(name: bytes) -> None:
    hs = greeted()
    with pytest.raises(Socks5Error) as err:
        hs.receive_data(connect_domain(name, 80))
    assert err.value.reply is ReplyCode.GENERAL_FAILURE
    assert hs.data_to_send() == encode_reply(ReplyCode.GENERAL_FAILURE)


@pytest.mark.parametrize(
    "name",
    [
        b"a" * 64 + b".example",  # a label longer than 63
        b"x" * 255,  # one 255-byte label (it crashed the resolver before)
        b".".join([b"a" * 63] * 4),  # 255 characters, over the 253 a name may have
        b"a..b",
        b".a",
        b".",
    ],
)
def test_names_dns_cannot_carry_are_refused_before_resolving(name: bytes) -> None:
    hs = greeted()
    with pytest.raises(Socks5Error) as err:
        hs.receive_data(connect_domain(name, 80))
    assert err.value.reply is ReplyCode.GENERAL_FAILURE
    assert hs.data_to_send() == encode_reply(ReplyCode.GENERAL_FAILURE)


@pytest.mark.parametrize("name", [b"a" * 63 + b".b", b".".join([b"a" * 63] * 3) + b"." + b"a" * 61, b"svc."])
def test_names_at_the_dns_limits_are_accepted(name: bytes) -> None:
    hs = greeted()
    assert hs.receive_data(connect_domain(name, 80)) == ConnectRequest(host=name.decode(), port=80)


@pytest.mark.parametrize(
    ("state_bytes", "expected"),
    [
        (b"", b"\x05\xff"),  # stalled in the greeting
        (b"\x05", b"\x05\xff"),
        (GREETING, METHOD_SELECTED + encode_reply(ReplyCode.GENERAL_FAILURE)),  # stalled in the request
        (GREETING + b"\x05\x01\x00\x03\x05ab", METHOD_SELECTED + encode_reply(ReplyCode.GENERAL_FAILURE)),
    ],
)
def test_abort_queues_the_refusal_of_the_current_state(state_bytes: bytes, expected: bytes) -> None:
    hs = Socks5Handshake()
    if state_bytes:
        hs.receive_data(state_bytes)
    err = hs.abort("timed out")
    assert isinstance(err, Socks5Error)
    assert hs.data_to_send() == expected
    assert hs.state is Socks5State.CLOSED


def test_abort_while_connecting_sends_the_given_code() -> None:
    hs = greeted()
    hs.receive_data(connect_v4("10.0.0.5", 80))
    hs.abort("refused", ReplyCode.CONNECTION_REFUSED)
    assert hs.data_to_send() == encode_reply(ReplyCode.CONNECTION_REFUSED)


def test_client_closed_queues_nothing() -> None:
    hs = greeted()
    err = hs.client_closed()
    assert "closed" in err.message
    assert hs.data_to_send() == b""
    assert hs.state is Socks5State.CLOSED


def test_buffer_is_bounded_before_the_connection_is_up() -> None:
    hs = greeted()
    hs.receive_data(connect_v4("10.0.0.5", 80))
    hs.receive_data(b"x" * MAX_BUFFERED_BYTES)
    with pytest.raises(Socks5Error):
        hs.receive_data(b"x" * 100)
    assert hs.data_to_send() == encode_reply(ReplyCode.GENERAL_FAILURE)
    assert hs.trailing_data() == b""


@pytest.mark.parametrize(
    ("flag", "error", "self_call", "code"),
    [
        (
            "CONNECT",
            ConnectionRefusedError(errno.ECONNREFUSED, "refused"),
            False,
            ReplyCode.CONNECTION_REFUSED,
        ),
        ("CONNECT", OSError(errno.ENETUNREACH, "unreachable"), False, ReplyCode.NETWORK_UNREACHABLE),
        ("CONNECT", OSError(errno.EHOSTUNREACH, "no route"), False, ReplyCode.HOST_UNREACHABLE),
        ("NETWORK_POLICY", TimeoutError(), False, ReplyCode.HOST_UNREACHABLE),
        ("DENY", None, False, ReplyCode.NOT_ALLOWED),
        ("CONNECT", None, True, ReplyCode.NOT_ALLOWED),
        ("TLS_FAILURE", None, False, ReplyCode.GENERAL_FAILURE),
    ],
)
def test_reply_for_failure(flag, error, self_call, code) -> None:
    assert reply_for_failure(flag, error, self_call=self_call) is code


def test_error_carries_a_hint() -> None:
    hs = Socks5Handshake()
    with pytest.raises(Socks5Error) as err:
        hs.receive_data(b"\x05\x01\x02")
    assert "CONNECT without authentication" in str(err.value)


# ---------------------------------------------------------------------------- properties


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, start = [], 0
    for p in [*points, len(data)]:
        pieces.append(data[start:p])
        start = p
    return pieces


def feed(hs: Socks5Handshake, pieces: list[bytes]) -> ConnectRequest | None:
    result = None
    for piece in pieces:
        event = hs.receive_data(piece)
        if isinstance(event, ConnectRequest):
            assert result is None, "a second ConnectRequest"
            result = event
        else:
            assert event == NeedMoreData()
    return result


# Every refused input gets an RFC 1928 answer: X'FF' to a greeting, a REP code to a request.
FAILURE_OUTPUTS = {b"\x05\xff"} | {
    METHOD_SELECTED + encode_reply(code)
    for code in (
        ReplyCode.GENERAL_FAILURE,
        ReplyCode.COMMAND_NOT_SUPPORTED,
        ReplyCode.ADDRESS_TYPE_NOT_SUPPORTED,
    )
}

# Random bytes rarely get past the first byte, so half the inputs start like a real client.
handshake_bytes = st.one_of(
    st.binary(max_size=300),
    st.builds(lambda rest: GREETING + rest, st.binary(max_size=300)),
    st.builds(lambda rest: GREETING + b"\x05\x01\x00" + rest, st.binary(max_size=300)),
)


@given(data=handshake_bytes, cuts=st.lists(st.integers(min_value=0), max_size=8))
def test_arbitrary_bytes_give_a_result_or_socks5_error(data: bytes, cuts: list[int]) -> None:
    hs = Socks5Handshake()
    try:
        request = feed(hs, split(data, cuts))
    except Socks5Error as err:
        assert hs.state is Socks5State.CLOSED
        out = hs.data_to_send()
        assert out in FAILURE_OUTPUTS
        assert out.endswith(encode_reply(err.reply)) if err.reply is not None else out == b"\x05\xff"
    else:
        assert hs.state is not Socks5State.CLOSED
        assert (request is not None) == (hs.state is Socks5State.CONNECTING)


@st.composite
def valid_requests(draw) -> tuple[bytes, ConnectRequest]:
    port = draw(st.integers(min_value=0, max_value=65535))
    kind = draw(st.sampled_from(["v4", "v6", "domain"]))
    if kind == "v4":
        ip = ipaddress.IPv4Address(draw(st.binary(min_size=4, max_size=4)))
        return connect_v4(str(ip), port), ConnectRequest(host=ip, port=port)
    if kind == "v6":
        ip6 = ipaddress.IPv6Address(draw(st.binary(min_size=16, max_size=16)))
        expected = ip6.ipv4_mapped or ip6
        return connect_v6(str(ip6), port), ConnectRequest(host=expected, port=port)
    labels = draw(
        st.lists(
            st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=1, max_size=63),
            min_size=1,
            max_size=4,
        )
    )
    name = ".".join(labels)[:253].rstrip(".")
    return connect_domain(name.encode(), port), ConnectRequest(host=name, port=port)


@given(
    request=valid_requests(),
    methods=st.lists(st.integers(min_value=1, max_value=255), max_size=10),
    trailing=st.binary(max_size=64),
    cuts=st.lists(st.integers(min_value=0), max_size=8),
)
def test_valid_request_split_anywhere(request, methods: list[int], trailing: bytes, cuts: list[int]) -> None:
    wire, expected = request
    offered = [*methods, 0]
    data = bytes([5, len(offered), *offered]) + wire + trailing
    hs = Socks5Handshake()
    assert feed(hs, split(data, cuts)) == expected
    assert hs.data_to_send() == METHOD_SELECTED
    assert hs.trailing_data() == trailing
