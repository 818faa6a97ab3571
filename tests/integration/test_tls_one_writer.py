"""After the handshake, one writer only (issue 24): nothing a TLS connection exposes can seal a
record with its keys but the transport's own record writer.

Before issue 24 the SSLSocket OpenSSL had done the handshake on stayed alive under HBONE's record
layer and was handed out as get_extra_info("ssl_object"): one `send()` through it sealed a
second record under sequence number 0 of our write key (an AES-GCM key and nonce used twice).
Here every object the transport hands out, and everything reachable from them, is searched for a
live OpenSSL connection (pyOpenSSL's, or Python `ssl`'s) and for a way to write; for TLS 1.3 the
process holds no OpenSSL connection at all once both ends are up."""

from __future__ import annotations

import asyncio
import gc
import ssl
import types
from collections.abc import Iterable

import pytest
from OpenSSL import SSL

from ambient_mesh.tls.handshake import PeerTls
from ambient_mesh.tls.records import TlsRecordError
from ambient_mesh.tls.transport import OpenSslTransport, TlsTransport
from tests.helpers.tls_pairs import LAYER, OPENSSL, OWN, tls_pair

# Every name asyncio's transports answer, and then some.
EXTRA_INFO_NAMES = (
    "ssl_object",
    "sslcontext",
    "socket",
    "peercert",
    "cipher",
    "compression",
    "peername",
    "sockname",
    "pipe",
    "subprocess",
)
# What can seal records with a connection's keys: OpenSSL connections, Python's or pyOpenSSL's.
LIVE_TLS = (SSL.Connection, ssl.SSLObject, ssl.SSLSocket)
WRITE_METHODS = (
    "write",
    "send",
    "sendall",
    "sendmsg",
    "do_handshake",
    "unwrap",
    "shutdown",
    "_sslobj",
    "key_update",
)
_NOT_FOLLOWED = (
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    type,
    types.CodeType,
    types.FrameType,
)


def reachable(roots: Iterable[object], depth: int = 8) -> list[object]:
    """Objects reachable from `roots` through references (gc.get_referents), not through modules,
    functions or classes (which reach everything)."""
    seen: dict[int, object] = {}
    frontier = [r for r in roots if r is not None]
    for _ in range(depth):
        nxt = []
        for obj in frontier:
            if id(obj) in seen or isinstance(obj, _NOT_FOLLOWED):
                continue
            if isinstance(obj, dict) and "__builtins__" in obj:  # a module's globals
                continue
            seen[id(obj)] = obj
            nxt.extend(gc.get_referents(obj))
        frontier = nxt
    return list(seen.values())


def live_openssl_connections() -> list[object]:
    gc.collect()
    return [o for o in gc.get_objects() if isinstance(o, LIVE_TLS)]


@pytest.fixture(autouse=True, params=[OWN, OPENSSL])
def layer(request):
    """Both record layers, as tests/integration/test_tls_transport.py runs them."""
    gc.collect()  # nothing left from earlier tests
    LAYER[0] = request.param
    yield request.param
    LAYER[0] = OWN


async def test_nothing_the_connection_exposes_can_write_with_its_keys(layer):
    async with tls_pair() as (server, client):
        for proto in (server, client):
            transport = proto.transport
            assert transport is not None
            exposed = [transport.get_extra_info(name) for name in EXTRA_INFO_NAMES]
            peer = transport.get_extra_info("ssl_object")
            assert isinstance(peer, PeerTls)
            assert [m for m in WRITE_METHODS if hasattr(peer, m)] == []
            assert transport.get_extra_info("sslcontext") is None
            found = [o for o in reachable(exposed) if isinstance(o, LIVE_TLS)]
            assert found == [], found
            if LAYER[0] == OWN:
                # The record layer is the one writer: not even the transport holds OpenSSL.
                assert type(transport) is TlsTransport
                assert [o for o in reachable([transport, proto]) if isinstance(o, LIVE_TLS)] == []
            else:
                # TLS 1.2: OpenSSL's records, its connection held by the transport alone.
                assert type(transport) is OpenSslTransport
                holders = [o for o in gc.get_referrers(transport._ssl) if not isinstance(o, types.FrameType)]
                assert all(h is transport or type(h).__name__ == "_OpenSslRecords" for h in holders), holders
        if LAYER[0] == OWN:
            assert live_openssl_connections() == []  # SSL_free'd after each handshake
        else:
            assert len([o for o in live_openssl_connections() if isinstance(o, SSL.Connection)]) == 2


async def test_bytes_written_past_the_record_layer_are_no_record_under_its_keys(layer):
    """The raw socket is handed out (as asyncio's transports do); what goes through it carries no
    key, and the peer's record layer refuses it instead of reading it."""
    if LAYER[0] == OPENSSL:
        pytest.skip("the TLS 1.3 record layer's answer is what is checked")
    async with tls_pair() as (server, client):
        assert client.transport is not None
        client.transport.write(b"sealed")
        await server.wait_for_bytes(6)
        raw = client.transport.get_extra_info("socket")
        raw.send(b"\x17\x03\x03\x00\x20" + b"\x00" * 32)  # an application-data record of zeros
        async with asyncio.timeout(10):
            exc = await server.lost
        assert isinstance(exc, TlsRecordError) and exc.alert == "bad_record_mac"
        assert bytes(server.data) == b"sealed"
