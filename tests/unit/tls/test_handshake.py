"""One HBONE handshake without sockets (tls/handshake.py): two `Handshake`s pass bytes by hand."""

from __future__ import annotations

import gc
import struct
from datetime import UTC, datetime

import pytest
from OpenSSL import SSL

from ambient_mesh.errors import CertificateError
from ambient_mesh.identity import CertificateAuthority, Identity
from ambient_mesh.tls.context import (
    TlsContextCache,
    client_context,
    server_context,
    verify_client_identity,
    verify_server_identity,
)
from ambient_mesh.tls.handshake import Handshake, HandshakeError, PeerTls, TrafficSecrets, on_keylog
from ambient_mesh.tls.records import RecordLayer

CA = CertificateAuthority.insecure_test_ca()
NOW = datetime.now(UTC)
SERVER = Identity("cluster.local", "ns1", "server")
CLIENT = Identity("cluster.local", "ns2", "client")
SERVER_CERT = CA.issue(SERVER, 3600, now=NOW)
CLIENT_CERT = CA.issue(CLIENT, 3600, now=NOW)


def records(data: bytes) -> list[tuple[int, int]]:
    out, pos = [], 0
    while pos + 5 <= len(data):
        kind, _version, length = struct.unpack_from(">BHH", data, pos)
        out.append((kind, length))
        pos += 5 + length
    return out


def handshake(*, tls12: bool = False) -> tuple[Handshake, Handshake, bytes]:
    """(server, client, the client's last flight) after a full handshake."""
    server_ctx = server_context(SERVER_CERT, tls12=tls12)
    if tls12:
        server_ctx.set_max_proto_version(SSL.TLS1_2_VERSION)
    server = Handshake(server_ctx, server_side=True)
    client = Handshake(client_context(CLIENT_CERT, tls12=tls12), server_side=False)
    to_server = client.start()
    last = b""
    for _ in range(6):
        to_client = server.receive(to_server)
        if client.done and server.done:
            break
        to_server = client.receive(to_client)
        last = to_server
        if client.done and server.done:
            break
    assert client.done and server.done
    return server, client, last


def test_a_handshake_gives_both_sides_record_layers_that_talk():
    server, client, _ = handshake()
    server_peer, server_records = server.finish()
    client_peer, client_records = client.finish()
    assert server_records is not None and client_records is not None
    assert verify_client_identity(server_peer, "cluster.local") == CLIENT
    assert verify_server_identity(client_peer, [SERVER]) == SERVER
    assert client_peer.version() == "TLSv1.3" and client_peer.cipher()[0] == "TLS_AES_128_GCM_SHA256"
    assert len(client_peer.get_verified_chain()) == 2
    wire = bytes(client_records.seal(b"ping"))
    buf = memoryview(bytearray(100))
    assert server_records.open_into(memoryview(wire), len(wire), buf, 0)[1] == 4
    assert bytes(buf[:4]) == b"ping"


def test_bytes_behind_the_last_handshake_record_are_left_for_the_record_layer():
    """A client's first records often share a segment with its Finished: OpenSSL is fed record by
    record, so it never reads them; `leftover` hands them over."""
    server = Handshake(server_context(SERVER_CERT), server_side=True)
    client = Handshake(client_context(CLIENT_CERT), server_side=False)
    flight = client.receive(server.receive(client.start()))
    assert client.done and not server.done
    _, client_records = client.finish()
    assert client_records is not None
    early = bytes(client_records.seal(b"early bytes"))
    out = server.receive(flight + early[:3])  # and a partial record after them
    assert server.done and server.leftover() == early[:3]
    assert records(out) == [(23, len_) for _, len_ in records(out)]  # only tickets, sealed


def test_a_tls13_server_counts_the_tickets_openssl_sealed_before_we_took_over():
    """OpenSSL sends NewSessionTickets under the server's first write key even with OP_NO_TICKET
    (pyOpenSSL has no SSL_CTX_set_num_tickets): our write sequence starts after them, or our first
    record would reuse their nonce."""
    server = Handshake(server_context(SERVER_CERT), server_side=True)
    client = Handshake(client_context(CLIENT_CERT), server_side=False)
    flight = client.receive(server.receive(client.start()))
    tickets = server.receive(flight)
    assert server.done and len(records(tickets)) >= 1
    _, server_records = server.finish()
    _, client_records = client.finish()
    assert server_records is not None and client_records is not None
    data = bytes(server_records.seal(b"after the tickets"))
    wire = tickets + data
    buf = memoryview(bytearray(100))
    _used, filled, _status = client_records.open_into(memoryview(wire), len(wire), buf, 0)
    assert bytes(buf[:filled]) == b"after the tickets"


def test_tls12_keeps_the_openssl_connection_for_its_records():
    server, client, _ = handshake(tls12=True)
    peer, layer = server.finish()
    assert layer is None and peer.version() == "TLSv1.2"
    conn = server.take_openssl()
    assert isinstance(conn, SSL.Connection) and conn.get_app_data() is None
    with pytest.raises(RuntimeError):
        server.take_openssl()
    client.release()


def test_finish_releases_openssl_and_wipes_the_secrets():
    server, client, _ = handshake()
    secrets = server.secrets
    server.finish()
    client.finish()
    assert secrets.client is None and secrets.server is None
    gc.collect()
    assert [o for o in gc.get_objects() if isinstance(o, SSL.Connection)] == []


@pytest.mark.parametrize(
    "garbage",
    [b"GET / HTTP/1.1\r\n\r\n", b"\x16\x03\x01\xff\xff" + b"\x00" * 10, b"\x17\x03\x03\x00\x05hello"],
)
def test_what_is_not_a_tls_handshake_is_a_handshake_error(garbage: bytes):
    server = Handshake(server_context(SERVER_CERT), server_side=True)
    with pytest.raises(HandshakeError):
        server.receive(garbage)
    assert isinstance(HandshakeError("x"), OSError)  # callers catch it as a failed connection


def test_a_malformed_handshake_record_is_refused_with_what_openssl_said():
    server = Handshake(server_context(SERVER_CERT), server_side=True)
    with pytest.raises(HandshakeError, match=r"^TLS handshake failed: \w"):
        server.receive(b"\x16\x03\x01\x00\x08\x01\x00\x00\x04\x03\x03\x00\x00")  # a truncated ClientHello


def test_the_keylog_callback_keeps_only_the_application_secrets():
    class Conn:
        def __init__(self, data: object) -> None:
            self.data = data

        def get_app_data(self) -> object:
            return self.data

    secrets = TrafficSecrets()
    conn = Conn(secrets)
    on_keylog(conn, b"CLIENT_HANDSHAKE_TRAFFIC_SECRET aa " + b"11" * 32)  # type: ignore[arg-type]
    on_keylog(conn, b"CLIENT_TRAFFIC_SECRET_0 aa " + b"22" * 32)  # type: ignore[arg-type]
    on_keylog(conn, b"SERVER_TRAFFIC_SECRET_0 aa " + b"zz" * 32)  # type: ignore[arg-type]  # not hex
    on_keylog(conn, b"SERVER_TRAFFIC_SECRET_0 aa " + b"33" * 100)  # type: ignore[arg-type]  # too long
    on_keylog(Conn(None), b"SERVER_TRAFFIC_SECRET_0 aa " + b"44" * 32)  # type: ignore[arg-type]
    assert secrets.client == bytes([0x22]) * 32 and secrets.server is None
    assert "22" not in repr(secrets)


def test_peer_facts_are_copies_without_a_way_to_write():
    server, _client, _ = handshake()
    peer, layer = server.finish()
    assert isinstance(peer, PeerTls) and isinstance(layer, RecordLayer)
    assert not any(hasattr(peer, name) for name in ("write", "send", "do_handshake", "unwrap"))
    assert peer.getpeercert() == {} and isinstance(peer.getpeercert(binary_form=True), bytes)


def test_the_verified_chain_is_copied_only_where_a_crl_check_may_read_it():
    """TlsContextCache without CRL_PATH marks its contexts NO_VERIFIED_CHAIN: the peer's facts
    then hold no chain (a per-connection copy saved), and asking for it fails closed."""
    cache = TlsContextCache()
    server = Handshake(cache.server(SERVER_CERT), server_side=True)
    client = Handshake(client_context(CLIENT_CERT), server_side=False)
    server.receive(client.receive(server.receive(client.start())))
    server_peer, _ = server.finish()
    client_peer, _ = client.finish()
    assert verify_client_identity(server_peer, "cluster.local") == CLIENT  # the leaf is there
    with pytest.raises(CertificateError, match="verified chain was not kept"):
        server_peer.get_verified_chain()
    assert "chain=not kept" in repr(server_peer)
    assert len(client_peer.get_verified_chain()) == 2  # an unmarked context keeps it
