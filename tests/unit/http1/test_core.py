"""The HTTP/1.1 core (ambient_mesh.http1.core): what the clients send and how replies are read.

The server side (request parsing, the servers' limits) is exercised with the servers, in
tests/integration/test_admin.py and test_cni_server.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ambient_mesh.errors import ProtocolError
from ambient_mesh.http1 import MAX_RESPONSE_BYTES, ClientResponse, parse_response, render_request

# -- the client side -------------------------------------------------------------------


def test_post_request_bytes():
    # What the CNI plugin sends the node agent (cni/plugin.py UnixHttpTransport).
    request = render_request(
        "POST",
        "/cmdadd",
        headers=(("User-Agent", "istio-cni"), ("Content-Type", "application/json")),
        body=b"{}",
    )
    assert request == (
        b"POST /cmdadd HTTP/1.1\r\nHost: unix\r\nUser-Agent: istio-cni\r\n"
        b"Content-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
    )


def test_response_content_length_incremental():
    raw = b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 18\r\n\r\nno ztunnel conn..."
    for cut in range(len(raw)):
        assert parse_response(raw[:cut], eof=False) is None
    assert parse_response(raw, eof=False) == ClientResponse(
        status=500, reason="Internal Server Error", body=b"no ztunnel conn..."
    )
    with pytest.raises(ProtocolError):
        parse_response(raw[:-1], eof=True)


def test_response_chunked_close_delimited_and_interim():
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n"
    assert parse_response(chunked, eof=False) == ClientResponse(status=200, reason="OK", body=b"abcde")
    assert parse_response(chunked[:-7], eof=False) is None
    close = b"HTTP/1.0 200 OK\r\n\r\nrest"
    assert parse_response(close, eof=False) is None
    assert parse_response(close, eof=True) == ClientResponse(status=200, reason="OK", body=b"rest")
    interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    assert parse_response(interim, eof=False) == ClientResponse(status=200, reason="OK")


@pytest.mark.parametrize(
    "raw",
    [
        b"SSH-2.0-x\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nbad\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
    ],
)
def test_response_malformed(raw):
    with pytest.raises(ProtocolError):
        parse_response(raw, eof=False)


@given(st.binary(max_size=300), st.booleans())
def test_response_parser_never_crashes(data, eof):
    try:
        result = parse_response(data, eof=eof)
    except ProtocolError:
        return
    assert result is None or isinstance(result, ClientResponse)


def test_get_request_bytes_with_a_token():
    request = render_request(
        "GET", "/api/v1/pods", host="10.0.0.1:6443", headers=(("Authorization", "Bearer t"),)
    )
    assert request == (
        b"GET /api/v1/pods HTTP/1.1\r\nHost: 10.0.0.1:6443\r\nAuthorization: Bearer t\r\n"
        b"Connection: close\r\n\r\n"
    )


@pytest.mark.parametrize(
    ("path", "headers"),
    [
        ("/ok", (("Authorization", "Bearer t\r\nX-Injected: 1"),)),  # a token file with a line break
        ("/ok", (("Authorization", "Bearer t\x00"),)),
        ("/ok", (("Authorization", "Bearer \u00e9"),)),  # not ASCII
        ("/ok", (("Bad Name", "v"),)),
        ("/a b", ()),  # a space would split the request line
        ("http://x/", ()),  # only origin-form targets
    ],
)
def test_a_request_that_cannot_be_sent_is_refused(path, headers):
    with pytest.raises(ProtocolError):
        render_request("GET", path, headers=headers)


def test_a_reply_over_the_limit_is_refused():
    # The attack: an endless reply from a hostile node agent or API server.
    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (MAX_RESPONSE_BYTES * 2)
    with pytest.raises(ProtocolError, match="response larger than"):
        parse_response(head + b"x" * MAX_RESPONSE_BYTES, eof=False)
    endless_head = b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * (MAX_RESPONSE_BYTES // 6)
    with pytest.raises(ProtocolError, match="response larger than"):
        parse_response(endless_head, eof=False)
