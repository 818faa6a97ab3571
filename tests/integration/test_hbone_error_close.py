"""An HBONE connection error over the TLS transport: the GOAWAY, then a bounded graceful close.

Counterpart: tests/netns/test_attack_hbone.py's rapid_reset case, which once saw the node proxy
end the attacker's connection without a GOAWAY. The proxy wrote its GOAWAY(ENHANCE_YOUR_CALM)
and aborted at once; with the attacker's frames still unread in its socket, the close was a TCP
reset, and the attacker (still sending) saw only the reset. RFC 9113 5.4.1 / 6.8: the GOAWAY goes
out before the connection is closed; closing with unread data must not destroy it.

Here a raw HTTP/2 peer (tests/interop/h2attack.py) resets streams in one burst, then keeps
sending PINGs after the GOAWAY: the proxy must keep reading (and dropping) them while it closes,
and must cut the peer off once hbone.ERROR_CLOSE_LINGER_S has passed.
"""

from __future__ import annotations

import asyncio
import socket
import time
from datetime import UTC, datetime

from hyperframe.frame import PingFrame

from ambient_mesh.http2.connection import EARLY_RESET_BURST
from ambient_mesh.identity import CertificateAuthority, Identity
from ambient_mesh.proxy import hbone
from ambient_mesh.proxy.hbone import HboneConnection
from ambient_mesh.tls.context import server_context
from ambient_mesh.tls.transport import start_tls
from tests.interop.h2attack import H2Peer, PeerClosed, _rapid_reset

CA = CertificateAuthority.insecure_test_ca()
SERVER_CERT = CA.issue(Identity("cluster.local", "ns1", "server"), 3600, now=datetime.now(UTC))
ATTACKER_CERT = CA.issue(Identity("cluster.local", "ns2", "attacker"), 3600, now=datetime.now(UTC))
STEP_TIMEOUT_S = 10.0
LINGER_S = 0.5  # the test's ERROR_CLOSE_LINGER_S
PING_PAUSE_S = 0.01


def _attack(port: int) -> tuple[str | None, float, str]:
    """Rapid reset, then PINGs until a send fails: (GOAWAY code, seconds the sends after the
    GOAWAY kept succeeding, how they ended)."""
    with H2Peer.open(ATTACKER_CERT, "127.0.0.1", port, timeout_s=STEP_TIMEOUT_S) as peer:
        peer.authority = "127.0.0.1:9"
        peer.poll(0.2)  # the proxy's SETTINGS
        frames = []
        for i in range(EARLY_RESET_BURST * 5):
            frames += _rapid_reset(peer, i)
        peer.send(*frames)
        peer.wait(lambda: peer.goaway is not None, STEP_TIMEOUT_S)
        since = time.monotonic()
        ended = "budget"
        while time.monotonic() - since < STEP_TIMEOUT_S:
            try:
                peer.send(PingFrame(0, opaque_data=b"12345678"))
            except PeerClosed as e:
                ended = str(e)
                break
            time.sleep(PING_PAUSE_S)
        return peer.goaway_code, time.monotonic() - since, ended


async def test_goaway_reaches_a_peer_that_keeps_sending_and_the_close_is_bounded(monkeypatch):
    monkeypatch.setattr(hbone.settings, "ERROR_CLOSE_LINGER_S", LINGER_S)
    loop = asyncio.get_running_loop()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]

        async def serve() -> HboneConnection:
            sock, _ = await loop.sock_accept(listener)
            conn = HboneConnection(client_side=False, on_request=lambda stream: None)
            await start_tls(
                sock, server_context(SERVER_CERT), conn, server_side=True, handshake_timeout_s=STEP_TIMEOUT_S
            )
            return conn

        server = asyncio.ensure_future(serve())
        try:
            code, lingered_s, ended = await asyncio.to_thread(_attack, port)
            conn = await asyncio.wait_for(server, STEP_TIMEOUT_S)
            await asyncio.wait_for(conn.closed, STEP_TIMEOUT_S)
        finally:
            if not server.done():
                server.cancel()
            elif not server.cancelled() and server.exception() is None:
                server.result().abort()
    assert code == "ENHANCE_YOUR_CALM", (code, ended)
    assert conn.error is not None and "rapid reset" in str(conn.error)
    # An abort right after the GOAWAY fails the very next sends (the proxy's socket is gone);
    # a graceful close reads them until the linger bound, then cuts the peer off.
    assert lingered_s >= LINGER_S * 0.8, (lingered_s, ended)
    assert lingered_s < LINGER_S + 3.0 and ended != "budget", (lingered_s, ended)
