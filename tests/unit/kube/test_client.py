"""kube/client.py: the watch line splitter and event parser, and REST paths. The client and
reflector run against a fake API server in tests/integration/test_kube_api_source.py and
test_control_kube_api.py."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ambient_mesh.kube.client import (
    NAMESPACES,
    PODS,
    TOKEN_REVIEWS,
    KubeApiError,
    Resource,
    WatchLines,
    parse_watch_event,
)

# -- watch streams --------------------------------------------------------------------------------------


def test_watch_lines_across_arbitrary_splits():
    stream = b'{"type":"ADDED"}\n\n{"type":"DELETED"}\r\n{"type":'
    for split in range(1, len(stream)):
        lines = WatchLines()
        out = lines.feed(stream[:split]) + lines.feed(stream[split:])
        assert out == [b'{"type":"ADDED"}', b'{"type":"DELETED"}']
        assert lines.pending_bytes == len(b'{"type":')


def test_watch_line_longer_than_the_limit_is_refused_before_it_ends():
    lines = WatchLines(max_line_bytes=64)
    lines.feed(b"x" * 60)
    with pytest.raises(KubeApiError, match="longer than 64 bytes"):
        lines.feed(b"x" * 10)
    with pytest.raises(KubeApiError):
        WatchLines(max_line_bytes=8).feed(b"0123456789\n")


def test_parse_watch_event():
    event = parse_watch_event(b'{"type":"BOOKMARK","object":{"metadata":{"resourceVersion":"42"}}}', PODS)
    assert (event.type, event.resource_version, event.object["kind"]) == ("BOOKMARK", "42", "Pod")
    gone = parse_watch_event(b'{"type":"ERROR","object":{"kind":"Status","code":410}}', PODS)
    assert gone.status_code == 410 and "apiVersion" not in gone.object
    for bad in (b"[]", b'{"type":"ADDED"}', b'{"type":"SYNC","object":{}}', b"{", b'{"object":{}}'):
        with pytest.raises(KubeApiError):
            parse_watch_event(bad, PODS)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_watch_parsing_returns_events_or_our_error(data):
    lines = WatchLines(max_line_bytes=128)
    try:
        for line in lines.feed(data):
            event = parse_watch_event(line, NAMESPACES)
            assert isinstance(event.object, dict) and isinstance(event.resource_version, str)
            assert isinstance(event.status_code, int)
    except KubeApiError:
        pass


def test_resource_paths():
    assert PODS.path() == "/api/v1/pods"
    assert PODS.path("demo", "a/b", "status") == "/api/v1/namespaces/demo/pods/a%2Fb/status"
    assert NAMESPACES.path("ignored", "demo") == "/api/v1/namespaces/demo"
    assert TOKEN_REVIEWS.path() == "/apis/authentication.k8s.io/v1/tokenreviews"
    ap = Resource("security.istio.io", "v1", "AuthorizationPolicy", "authorizationpolicies")
    assert ap.api_version == "security.istio.io/v1" and str(ap) == "authorizationpolicies.security.istio.io"
    assert ap.path("ns") == "/apis/security.istio.io/v1/namespaces/ns/authorizationpolicies"
