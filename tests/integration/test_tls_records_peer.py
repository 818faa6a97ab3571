"""HBONE's own TLS 1.3 records (tls/records.py under tls/transport.py) against real OpenSSL peers
of another build than ours (the system OpenSSL that Python's `ssl` and the `openssl` command use;
ours is cryptography's): KeyUpdate with and without update_requested both ways (the `openssl`
command's `k` / `K`), our own KeyUpdate at the records-per-key limit, a ticket-sending server
against our client, close_notify, user_canceled, and broken records from the peer answered with
the alert RFC 8446 names, counted and warned about. The Python `ssl` peer's traffic secrets come
from its keylog file (`SSLContext.keylog_filename`), for records we forge as it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import ssl
import tempfile
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest

from ambient_mesh.identity import CertificateAuthority, Identity, WorkloadCertificate
from ambient_mesh.metrics import TLS_RECORD_FAILURES, Metrics
from ambient_mesh.tls import records as tls_records
from ambient_mesh.tls import transport as transport_module
from ambient_mesh.tls.context import client_context, server_context
from ambient_mesh.tls.handshake import TrafficSecrets
from ambient_mesh.tls.records import TlsPeerAlert, TlsRecordError
from ambient_mesh.tls.transport import TlsTransport, start_tls
from tests.helpers.tls_pairs import Collector, tcp_pair
from tests.helpers.tls_stdlib import stdlib_client_context, stdlib_server_context

CA = CertificateAuthority.insecure_test_ca()
NOW = datetime.now(UTC)
SERVER_CERT = CA.issue(Identity("cluster.local", "ns1", "server"), 3600, now=NOW)
CLIENT_CERT = CA.issue(Identity("cluster.local", "ns2", "client"), 3600, now=NOW)
STEP_TIMEOUT_S = 10.0
OPENSSL = shutil.which("openssl")


def _recv_exact(sock: ssl.SSLSocket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise EOFError(f"peer closed after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)


def _keylog_secrets(path: Path) -> TrafficSecrets:
    secrets = TrafficSecrets()
    for line in path.read_text().splitlines():
        label, _, rest = line.partition(" ")
        if label == "CLIENT_TRAFFIC_SECRET_0":
            secrets.client = bytearray.fromhex(rest.rpartition(" ")[2])
        elif label == "SERVER_TRAFFIC_SECRET_0":
            secrets.server = bytearray.fromhex(rest.rpartition(" ")[2])
    return secrets


class OpenSslPeer:
    """A blocking Python `ssl` peer in a thread: it runs `script(tls)` after its handshake and
    keeps what it raised. Its traffic secrets are read from its keylog file (for records we forge
    as it)."""

    def __init__(
        self, sock: socket.socket, ctx: ssl.SSLContext, *, server_side: bool, script: Callable
    ) -> None:
        self.sock, self.ctx, self.server_side, self.script = sock, ctx, server_side, script
        self.error: BaseException | None = None
        self.result: object = None
        self.secrets: TrafficSecrets | None = None
        self.tls: ssl.SSLSocket | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="tls-peer-")
        self._keylog = Path(self._dir.name) / "keys.log"
        ctx.keylog_filename = str(self._keylog)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.sock.settimeout(STEP_TIMEOUT_S)
            tls = self.ctx.wrap_socket(self.sock, server_side=self.server_side, do_handshake_on_connect=False)
            self.tls = tls
            tls.do_handshake()
            self.secrets = _keylog_secrets(self._keylog)
            self.result = self.script(tls)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            self.error = e

    def join(self) -> object:
        self.thread.join(STEP_TIMEOUT_S)
        assert not self.thread.is_alive(), "the OpenSSL peer did not finish"
        self._dir.cleanup()
        if self.error is not None:
            raise self.error
        return self.result


def peer_contexts(*, tickets: int = 0) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) Python `ssl` contexts for the peer, with tickets on when asked."""
    server = stdlib_server_context(SERVER_CERT)
    if tickets:
        server.num_tickets = tickets
    else:
        server.options |= ssl.OP_NO_TICKET
        server.num_tickets = 0
    return server, stdlib_client_context(CLIENT_CERT)


async def ours_against(
    peer_script: Callable, *, our_side: str, tickets: int = 0, proto: Collector | None = None, **kwargs
):
    """Our transport on one end of a loopback pair, the Python `ssl` peer on the other."""
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
        **kwargs,
    )
    assert type(transport) is TlsTransport
    return transport, proto, peer


async def join(peer: OpenSslPeer) -> object:
    return await asyncio.wait_for(asyncio.to_thread(peer.join), STEP_TIMEOUT_S + 1)


@pytest.mark.parametrize("our_side", ["client", "server"])
async def test_our_own_key_updates_at_the_record_limit_are_followed_by_openssl(our_side):
    total = 40 * 16 * 1024 + 123

    def script(tls: ssl.SSLSocket) -> bytes:
        data = _recv_exact(tls, total)
        tls.sendall(b"done")
        return data

    # RFC 8446 5.5 exercised: a KeyUpdate every 3 records.
    transport, proto, peer = await ours_against(script, our_side=our_side, records_per_key=4)
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


def _forged(peer: OpenSslPeer, content: bytes, kind: int, seq: int = 0) -> bytes:
    """A record protected as the peer would, with its captured write secret (its first), as its
    record number `seq`."""
    assert peer.secrets is not None
    write = peer.secrets.server if peer.server_side else peer.secrets.client
    assert write is not None
    assert peer.tls is not None
    fake = tls_records.RecordLayer(
        peer.tls.cipher()[0],
        client_side=not peer.server_side,
        read_secret=bytes(len(write)),
        write_secret=write,
        write_sequence=seq,
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
async def test_a_broken_record_from_openssl_is_answered_with_its_alert(breakage, alert, reported, caplog):
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
    before = TLS_RECORD_FAILURES.labels(alert)._value.get()
    transport_module.LAST_LOGGED.clear()
    with caplog.at_level(logging.WARNING, logger="ambient_mesh.tls"):
        peer, exc = await _our_client_fails(script, holder)
    assert isinstance(exc, TlsRecordError) and exc.alert == alert
    assert reported in str(await join(peer)).upper().replace(" ", "_")
    # Counted, and one warning naming the failure and the peer's address (issue 24).
    assert TLS_RECORD_FAILURES.labels(alert)._value.get() == before + 1
    served = Metrics(process_metrics=False).render()[0].decode()  # what /metrics shows
    assert f'istio_tls_record_failures_total{{reason="{alert}"}} {before + 1:.1f}' in served
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"({alert}) with peer ('127.0.0.1', " in warnings[0], warnings


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


async def test_user_canceled_then_close_notify_is_a_clean_end():
    # RFC 8446 6.1: user_canceled is a closure alert, not an error.
    def script(tls: ssl.SSLSocket) -> None:
        tls.sendall(b"data")
        _raw_send(tls, _forged(holder[0], bytes((1, 90)), tls_records.ALERT, seq=1))
        _raw_send(tls, _forged(holder[0], bytes((1, 0)), tls_records.ALERT, seq=2))
        with contextlib.suppress(OSError):
            tls.recv(10)

    holder: list[OpenSslPeer] = []
    s, c = tcp_pair()
    server_ctx, _ = peer_contexts()
    peer = OpenSslPeer(c, server_ctx, server_side=True, script=script)
    holder.append(peer)
    proto = Collector()
    await start_tls(
        s, client_context(CLIENT_CERT), proto, server_side=False, handshake_timeout_s=STEP_TIMEOUT_S
    )
    async with asyncio.timeout(STEP_TIMEOUT_S):
        await proto.eof
        assert await proto.lost is None
    assert bytes(proto.data) == b"data"
    await join(peer)


# The `openssl` command as the peer: KeyUpdate both ways --------------------------------------
class OpenSslCommand:
    """`openssl s_server` or `s_client` (the system OpenSSL) with our CA's certificates: what we
    type goes to it line by line, `k` and `K` are its KeyUpdate commands (without and with
    update_requested), everything else is data it sends; what it prints is kept."""

    def __init__(self, directory: Path, cert: WorkloadCertificate) -> None:
        self.dir = directory
        (directory / "key.pem").write_bytes(cert.private_key_pem)
        (directory / "chain.pem").write_bytes(b"".join(cert.chain_pem))
        (directory / "roots.pem").write_bytes(cert.roots_pem)
        self.out = directory / "out.txt"
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self, *args: str) -> None:
        assert OPENSSL is not None
        common = ["-key", "key.pem", "-cert", "chain.pem", "-CAfile", "roots.pem", "-tls1_3", "-alpn", "h2"]
        with self.out.open("wb") as out:
            self.proc = await asyncio.create_subprocess_exec(
                OPENSSL, *args, *common, stdin=asyncio.subprocess.PIPE, stdout=out, stderr=out, cwd=self.dir
            )

    def output(self) -> bytes:
        return self.out.read_bytes()

    async def wait_for_output(self, text: bytes) -> None:
        async with asyncio.timeout(STEP_TIMEOUT_S):
            while text not in self.output():
                await asyncio.sleep(0.05)

    async def type(self, line: str) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        await self.proc.stdin.drain()
        await asyncio.sleep(0.3)  # one line per read: a command is a line of its own

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


@pytest.mark.skipif(OPENSSL is None, reason="the openssl command is not installed")
@pytest.mark.parametrize("our_side", ["client", "server"])
@pytest.mark.parametrize("command", ["k", "K"])
async def test_a_peer_key_update_is_followed_and_answered(our_side, command, tmp_path):
    """The peer rotates its write key (RFC 8446 4.6.3); with update_requested (K) we answer with a
    KeyUpdate of ours before our next record and rotate our write key; data stays intact both ways."""
    loop = asyncio.get_running_loop()
    peer = OpenSslCommand(tmp_path, CLIENT_CERT if our_side == "server" else SERVER_CERT)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    proto = Collector()
    try:
        if our_side == "client":
            listener.close()  # its port is the peer's to take
            await peer.start("s_server", "-accept", f"127.0.0.1:{port}", "-naccept", "1", "-Verify", "2")
            await peer.wait_for_output(b"ACCEPT")
            sock = socket.socket()
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", port))
            ctx = client_context(CLIENT_CERT)
        else:
            await peer.start(
                "s_client", "-connect", f"127.0.0.1:{port}", "-noservername", "-verify_return_error"
            )
            sock, _ = await asyncio.wait_for(loop.sock_accept(listener), STEP_TIMEOUT_S)
            ctx = server_context(SERVER_CERT)
        transport = await start_tls(
            sock, ctx, proto, server_side=our_side == "server", handshake_timeout_s=STEP_TIMEOUT_S
        )
        assert type(transport) is TlsTransport
        records = transport._records
        first_read, first_write = records._read, records._write
        await peer.type("one")
        await proto.wait_for_bytes(4)
        await peer.type(command)
        await peer.type("two")
        await proto.wait_for_bytes(8)
        assert bytes(proto.data) == b"one\ntwo\n"
        assert records._read is not first_read  # the peer's KeyUpdate rotated our read key
        transport.write(b"three-from-us\n")
        await peer.wait_for_output(b"three-from-us")  # readable under whichever key we use
        assert (records._write is not first_write) == (command == "K")
        transport.close()
        async with asyncio.timeout(STEP_TIMEOUT_S):
            assert await proto.lost is None or our_side == "server"
    finally:
        await peer.stop()
        listener.close()
