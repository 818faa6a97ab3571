"""HBONE's own TLS 1.3 records (proxy/tls_records.py under proxy/tls_transport.py) against a real
OpenSSL peer: Python's `ssl` on a blocking socket in a thread, with `SSL_key_update` through
ctypes on its `SSL *` (identity/openssl_native.py). KeyUpdate with and without update_requested
both ways, our own KeyUpdate at the records-per-key limit, a ticket-sending server against our
client, close_notify, and broken records from the peer answered with the alert RFC 8446 names."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import threading
from collections.abc import Callable
from datetime import UTC, datetime

import pytest

from ambient_mesh.identity import (
    CertificateAuthority,
    Identity,
    client_context,
    openssl_native,
    server_context,
)
from ambient_mesh.identity.tls_suites import KEYLOG, TrafficSecrets, capture_traffic_secrets
from ambient_mesh.proxy import tls_records
from ambient_mesh.proxy.tls_records import TlsPeerAlert, TlsRecordError
from ambient_mesh.proxy.tls_transport import TlsTransport, start_tls
from tests.integration.test_tls_transport import Collector, tcp_pair

CA = CertificateAuthority.insecure_test_ca()
NOW = datetime.now(UTC)
SERVER_CERT = CA.issue(Identity("cluster.local", "ns1", "server"), 3600, now=NOW)
CLIENT_CERT = CA.issue(Identity("cluster.local", "ns2", "client"), 3600, now=NOW)
STEP_TIMEOUT_S = 10.0
LIB = openssl_native.libssl()
pytestmark = pytest.mark.skipif(LIB is None, reason="no libssl entry points on this interpreter")


def _recv_exact(sock: ssl.SSLSocket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise EOFError(f"peer closed after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)


class OpenSslPeer:
    """A blocking OpenSSL peer in a thread: it runs `script(tls)` after its handshake and keeps
    what it raised. Its own traffic secrets are captured too (for records we forge as it)."""

    def __init__(
        self, sock: socket.socket, ctx: ssl.SSLContext, *, server_side: bool, script: Callable
    ) -> None:
        self.sock, self.ctx, self.server_side, self.script = sock, ctx, server_side, script
        self.error: BaseException | None = None
        self.result: object = None
        self.secrets: TrafficSecrets | None = None
        self.tls: ssl.SSLSocket | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.sock.settimeout(STEP_TIMEOUT_S)
            tls = self.ctx.wrap_socket(self.sock, server_side=self.server_side, do_handshake_on_connect=False)
            self.tls = tls
            assert LIB is not None
            self.secrets = TrafficSecrets(openssl_native.ssl_pointer(LIB, tls) or 0)
            KEYLOG.current = self.secrets
            try:
                tls.do_handshake()
            finally:
                KEYLOG.current = None
            self.result = self.script(tls)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            self.error = e

    def join(self) -> object:
        self.thread.join(STEP_TIMEOUT_S)
        assert not self.thread.is_alive(), "the OpenSSL peer did not finish"
        if self.error is not None:
            raise self.error
        return self.result

    def key_update(self, requested: bool) -> None:
        """SSL_key_update on the peer: its next write sends the KeyUpdate (RFC 8446 4.6.3)."""
        assert LIB is not None and self.tls is not None
        pointer = openssl_native.ssl_pointer(LIB, self.tls)
        assert pointer and LIB.key_update(pointer, int(requested)) == 1


def peer_contexts(*, tickets: int = 0) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) contexts for the OpenSSL peer: ours, with tickets on when asked."""
    server = server_context(SERVER_CERT)
    if tickets:
        server.options &= ~ssl.OP_NO_TICKET
        server.num_tickets = tickets
    return server, client_context(CLIENT_CERT)


async def ours_against(
    peer_script: Callable, *, our_side: str, tickets: int = 0, proto: Collector | None = None
):
    """Our transport on one end of a loopback pair, the OpenSSL peer on the other."""
    s, c = tcp_pair()
    server_ctx, client_ctx = peer_contexts(tickets=tickets)
    ours_sock, peer_sock = (s, c) if our_side == "server" else (c, s)
    peer = OpenSslPeer(
        peer_sock,
        client_ctx if our_side == "server" else server_ctx,
        server_side=our_side != "server",
        script=peer_script,
    )
    proto = proto or Collector()
    transport = await start_tls(
        ours_sock,
        server_context(SERVER_CERT) if our_side == "server" else client_context(CLIENT_CERT),
        proto,
        server_side=our_side == "server",
        handshake_timeout_s=STEP_TIMEOUT_S,
    )
    assert type(transport) is TlsTransport
    return transport, proto, peer


async def join(peer: OpenSslPeer) -> object:
    return await asyncio.wait_for(asyncio.to_thread(peer.join), STEP_TIMEOUT_S + 1)


@pytest.mark.parametrize("our_side", ["client", "server"])
@pytest.mark.parametrize("requested", [False, True])
async def test_a_peer_key_update_is_followed_and_data_stays_intact_both_ways(our_side, requested):
    rounds = 5
    holder: list[OpenSslPeer] = []

    def script(tls: ssl.SSLSocket) -> bytes:
        got = bytearray()
        for i in range(rounds):
            holder[0].key_update(requested)
            tls.sendall(b"p%d" % i + os.urandom(20_000))  # the KeyUpdate goes first
            got += _recv_exact(tls, 2 + 30_000)  # our echo: under our new key if requested
        tls.unwrap()
        return bytes(got)

    class Echo(Collector):
        def buffer_updated(self, nbytes):
            super().buffer_updated(nbytes)
            while len(self.data) >= 20_002 + self.echoed:
                self.transport.write(b"o%d" % (self.echoed // 20_002) + b"e" * 30_000)
                self.echoed += 20_002

    proto = Echo()
    proto.echoed = 0
    s, c = tcp_pair()
    server_ctx, client_ctx = peer_contexts()
    ours_sock, peer_sock = (s, c) if our_side == "server" else (c, s)
    peer = OpenSslPeer(
        peer_sock,
        client_ctx if our_side == "server" else server_ctx,
        server_side=our_side != "server",
        script=script,
    )
    holder.append(peer)
    transport = await start_tls(
        ours_sock,
        server_context(SERVER_CERT) if our_side == "server" else client_context(CLIENT_CERT),
        proto,
        server_side=our_side == "server",
        handshake_timeout_s=STEP_TIMEOUT_S,
    )
    assert type(transport) is TlsTransport
    got = await join(peer)
    assert got == b"".join(b"o%d" % i + b"e" * 30_000 for i in range(rounds))
    async with asyncio.timeout(STEP_TIMEOUT_S):
        await proto.eof  # the peer's close_notify after its KeyUpdates
    assert len(proto.data) == rounds * 20_002
    records = transport._records
    # Each peer KeyUpdate rotated our read key; each requested one our write key too.
    assert records._read.seq <= 3
    assert (records._write.seq <= 3) == requested
    transport.abort()


@pytest.mark.parametrize("our_side", ["client", "server"])
async def test_our_own_key_updates_at_the_record_limit_are_followed_by_openssl(our_side):
    total = 40 * 16 * 1024 + 123

    def script(tls: ssl.SSLSocket) -> bytes:
        data = _recv_exact(tls, total)
        tls.sendall(b"done")
        return data

    transport, proto, peer = await ours_against(script, our_side=our_side)
    transport._records.records_per_key = 4  # RFC 8446 5.5 exercised: a KeyUpdate every 3 records
    payload = os.urandom(total)
    transport.write(payload[:1000])
    transport.writelines([payload[1000:5000], memoryview(payload)[5000:]])
    assert await join(peer) == payload
    await proto.wait_for_bytes(4)
    assert bytes(proto.data) == b"done"
    transport.abort()


async def test_a_server_sending_session_tickets_to_our_client():
    # BoringSSL (Envoy) and OpenSSL servers send NewSessionTickets after the handshake (RFC 8446
    # 4.6.1): our client drops them and carries on.
    def script(tls: ssl.SSLSocket) -> bytes:
        got = _recv_exact(tls, 5)
        tls.sendall(b"world")
        return got

    transport, proto, peer = await ours_against(script, our_side="client", tickets=3)
    transport.write(b"hello")
    assert await join(peer) == b"hello"
    await proto.wait_for_bytes(5)
    assert bytes(proto.data) == b"world" and transport._records._in_a_row == 0
    transport.abort()


async def test_our_close_notify_reaches_openssl_and_its_answer_ends_the_close():
    def script(tls: ssl.SSLSocket) -> bytes:
        got = _recv_exact(tls, 4)
        tls.unwrap()  # reads our close_notify, sends its own
        return got

    transport, proto, peer = await ours_against(script, our_side="server")
    transport.write(b"last")
    transport.close()
    assert await join(peer) == b"last"
    async with asyncio.timeout(STEP_TIMEOUT_S):
        assert await proto.lost is None


async def _our_client_fails(
    script: Callable, holder: list[OpenSslPeer]
) -> tuple[OpenSslPeer, BaseException | None]:
    """Our client against an OpenSSL server running `script`; (the peer, how our side ended)."""
    s, c = tcp_pair()
    server_ctx, _ = peer_contexts()
    peer = OpenSslPeer(c, server_ctx, server_side=True, script=script)
    holder.append(peer)
    proto = Collector()
    await start_tls(
        s, client_context(CLIENT_CERT), proto, server_side=False, handshake_timeout_s=STEP_TIMEOUT_S
    )
    async with asyncio.timeout(STEP_TIMEOUT_S):
        return peer, await proto.lost


def _raw_send(tls: ssl.SSLSocket, data: bytes) -> None:
    socket.socket.sendall(tls, data)  # past OpenSSL: the record exactly as given


def _peer_alert(tls: ssl.SSLSocket) -> str:
    """What OpenSSL reports reading from us after its broken record: our alert's name."""
    try:
        tls.recv(100)
    except ssl.SSLError as e:
        return str(e)
    return "no alert"


def _forged(peer: OpenSslPeer, content: bytes, kind: int) -> bytes:
    """A record protected as the peer would, with its captured write secret (its first)."""
    assert peer.secrets is not None
    write = peer.secrets.server if peer.server_side else peer.secrets.client
    assert write is not None
    fake = tls_records.RecordLayer(
        "TLS_AES_128_GCM_SHA256",
        client_side=not peer.server_side,
        read_secret=bytes(len(write)),
        write_secret=write,
    )
    return fake._seal_control(kind, content)


@pytest.mark.parametrize(
    "breakage,alert,reported",
    [
        ("tampered", "bad_record_mac", "BAD_RECORD_MAC"),
        ("oversized", "record_overflow", "RECORD_OVERFLOW"),
        ("unprotected", "unexpected_message", "UNEXPECTED_MESSAGE"),
    ],
)
async def test_a_broken_record_from_openssl_is_answered_with_its_alert(breakage, alert, reported):
    def script(tls: ssl.SSLSocket) -> str:
        if breakage == "tampered":
            record = bytearray(_forged(holder[0], b"data", tls_records.APPLICATION_DATA))
            record[7] ^= 0x40
            _raw_send(tls, bytes(record))
        elif breakage == "oversized":
            _raw_send(tls, b"\x17\x03\x03\x41\x01" + bytes(2**14 + 257))
        else:
            _raw_send(tls, b"\x15\x03\x03\x00\x02\x02\x28")  # a plaintext alert
        return _peer_alert(tls)

    holder: list[OpenSslPeer] = []
    peer, exc = await _our_client_fails(script, holder)
    assert isinstance(exc, TlsRecordError) and exc.alert == alert
    assert reported in str(await join(peer)).upper().replace(" ", "_")


async def test_a_fatal_alert_from_the_peer_ends_the_connection_with_its_name():
    def script(tls: ssl.SSLSocket) -> None:
        _raw_send(tls, _forged(holder[0], bytes((2, 49)), tls_records.ALERT))  # access_denied
        with contextlib.suppress(OSError):
            tls.recv(10)

    holder: list[OpenSslPeer] = []
    peer, exc = await _our_client_fails(script, holder)
    assert isinstance(exc, TlsPeerAlert) and exc.alert == "access_denied"
    assert "access_denied" in str(exc)
    await join(peer)


async def test_the_keylog_callback_is_on_hbone_contexts_and_a_context_without_it_keeps_openssl():
    from ambient_mesh.identity.tls_suites import captures_traffic_secrets
    from ambient_mesh.proxy.tls_transport import OpenSslTransport

    ctx = server_context(SERVER_CERT)
    assert captures_traffic_secrets(ctx) and ctx.num_tickets == 0
    plain = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    assert not captures_traffic_secrets(plain)
    capture_traffic_secrets(plain)
    assert captures_traffic_secrets(plain)
    # A TLS 1.3 handshake whose secrets nobody reported keeps OpenSSL's records.
    client_ctx = client_context(CLIENT_CERT)
    client_ctx.keylog_filename = os.devnull  # CPython's own callback replaces ours
    assert not captures_traffic_secrets(client_ctx)
    s, c = tcp_pair()
    sp, cp = Collector(), Collector()
    st, ct = await asyncio.gather(
        start_tls(s, server_context(SERVER_CERT), sp, server_side=True, handshake_timeout_s=STEP_TIMEOUT_S),
        start_tls(c, client_ctx, cp, server_side=False, handshake_timeout_s=STEP_TIMEOUT_S),
    )
    assert type(st) is TlsTransport and type(ct) is OpenSslTransport
    ct.write(b"mixed")
    await sp.wait_for_bytes(5)
    st.write(b"ok")
    await cp.wait_for_bytes(2)
    st.abort()
    ct.abort()


def _memory_pair(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext):
    s_in, s_out, c_in, c_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    client = client_ctx.wrap_bio(c_in, c_out, server_side=False)
    return server, client, (s_in, s_out, c_in, c_out)


def _step(obj: ssl.SSLObject) -> bool:
    try:
        obj.do_handshake()
        return True
    except ssl.SSLWantReadError:
        return False


def test_takeover_is_refused_when_openssl_holds_received_bytes():
    # Read-ahead on during the handshake (never so in start_tls) lets OpenSSL read the client's
    # first application record together with its Finished: those bytes would be lost to our
    # record layer, so take_over refuses the connection (SSL_has_pending != 0).
    from ambient_mesh.errors import ProtocolError
    from ambient_mesh.proxy.tls_transport import take_over

    assert LIB is not None
    for read_ahead in (False, True):
        server, client, (s_in, s_out, c_in, c_out) = _memory_pair(
            server_context(SERVER_CERT), client_context(CLIENT_CERT)
        )
        pointer = openssl_native.ssl_pointer(LIB, server)
        assert pointer
        if read_ahead:
            LIB.ctrl(pointer, 41, 1, None)  # SSL_CTRL_SET_READ_AHEAD
        secrets = TrafficSecrets(pointer)
        client_done = False
        for _ in range(10):
            client_done = client_done or _step(client)
            s_in.write(c_out.read())
            if client_done and not s_in.pending:
                break
            if client_done:
                client.write(b"early application data")  # next to the client's Finished
                s_in.write(c_out.read())
            KEYLOG.current = secrets
            try:
                done = _step(server)
            finally:
                KEYLOG.current = None
            c_in.write(s_out.read())
            if done:
                break
        assert secrets.client is not None and secrets.server is not None
        if read_ahead:
            with pytest.raises(ProtocolError, match="holds received TLS bytes"):
                take_over(server, secrets, server_side=True)
        else:
            assert take_over(server, secrets, server_side=True) is not None
