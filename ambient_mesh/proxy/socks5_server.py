"""The SOCKS5 listener's shell (port 15080): read bytes into the sans-IO `socks5` core, write
what it queues, connect, answer, relay.

Counterpart: ztunnel src/proxy/socks5.rs. The core decides every reply; this shell only moves
bytes and maps what happened while connecting onto RFC 1928's reply codes. Every outcome has a
reply and a one-line log, never a traceback:

- a client that reset before we ran, or that goes away at any point: debug line, socket closed;
- malformed or unsupported input: the core's refusal (X'FF' or a REP code), info line;
- a client that stalls: after SOCKS5_HANDSHAKE_TIMEOUT_S the refusal its state has;
- a name that does not resolve, a self call, a denied or failed connection: a failure reply
  whose REP code says which (`socks5.reply_for_failure`); the connection is counted with its
  response flag by the outbound side, as every outbound connection is.

The success reply goes out only once the upstream is reached, so a client never sees
"succeeded" for a connection that was refused (RFC 1928 section 6 sends the reply after the
server has evaluated the request).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

import dns.exception

from ..net import IPAddress, SocketAddr
from ..transport.relay import wrap_socket
from .outbound import OutboundFailure, OutboundProxy
from .socks5 import ConnectRequest, ReplyCode, Socks5Error, Socks5Handshake, reply_for_failure

log = logging.getLogger("ambient_mesh.proxy.socks5")

SOCKS5_HANDSHAKE_TIMEOUT_S = 10.0
SOCKS5_RECV_BYTES = 4096

Resolver = Callable[[str], Awaitable[list[IPAddress]]]


async def _send(sock: socket.socket, data: bytes, deadline: float | None = None) -> bool:
    """Write `data` (by the loop time `deadline`, if given: TimeoutError after it); False when
    the client is gone (its error is not ours to raise)."""
    if not data:
        return True
    try:
        try:
            sent = sock.send(data)  # a reply is a few bytes: the socket buffer takes it at once
        except (BlockingIOError, InterruptedError):
            sent = 0
        if sent < len(data):
            loop = asyncio.get_running_loop()
            if deadline is None:
                await loop.sock_sendall(sock, data[sent:])
            else:
                async with asyncio.timeout_at(deadline):
                    await loop.sock_sendall(sock, data[sent:])
    except TimeoutError:
        raise
    except OSError as e:
        log.debug("SOCKS5 client gone before our reply: %s", e)
        return False
    return True


async def _recv(sock: socket.socket, deadline: float) -> bytes:
    """What the client sent (b"" at its EOF), waiting until the loop time `deadline` at most.

    The bytes are usually there already (a client sends its greeting and request together,
    right after connecting): read them at once. uvloop's sock_recv always registers a reader
    and waits for a turn of the loop (a future and two epoll_ctl calls per connection), and the
    handshake's deadline needs a timer only when there is something to wait for.
    """
    try:
        return sock.recv(SOCKS5_RECV_BYTES)
    except (BlockingIOError, InterruptedError):
        pass
    async with asyncio.timeout_at(deadline):
        return await asyncio.get_running_loop().sock_recv(sock, SOCKS5_RECV_BYTES)


async def _handshake(sock: socket.socket, hs: Socks5Handshake, peer: SocketAddr) -> ConnectRequest | None:
    deadline = asyncio.get_running_loop().time() + SOCKS5_HANDSHAKE_TIMEOUT_S
    try:
        while True:
            data = await _recv(sock, deadline)
            if not data:
                raise hs.client_closed()
            event = hs.receive_data(data)
            if not await _send(sock, hs.data_to_send(), deadline):
                return None
            if isinstance(event, ConnectRequest):
                return event
    except Socks5Error as e:
        await _send(sock, hs.data_to_send())
        log.info("SOCKS5 handshake from %s refused: %s", peer, e.message)
    except TimeoutError:
        hs.abort(f"no complete request within {SOCKS5_HANDSHAKE_TIMEOUT_S:g} s")
        await _send(sock, hs.data_to_send())
        log.info("SOCKS5 handshake from %s timed out after %g s", peer, SOCKS5_HANDSHAKE_TIMEOUT_S)
    except OSError as e:
        log.debug("SOCKS5 client %s gone during the handshake: %s", peer, e)
    return None


async def _resolve(request: ConnectRequest, peer: SocketAddr, resolve: Resolver | None) -> SocketAddr | str:
    """The target address, or why there is none."""
    if not isinstance(request.host, str):
        return SocketAddr(request.host, request.port)
    if resolve is None:
        return "no DNS proxy to resolve names (ISTIO_META_DNS_CAPTURE=false)"
    try:
        addresses = await resolve(request.host)
    except (dns.exception.DNSException, ValueError, OSError) as e:
        return f"name did not resolve ({e})"
    if not addresses:
        return "name did not resolve"
    # Prefer the family of the client's own connection, as ztunnel picks by family.
    addresses = sorted(addresses, key=lambda ip: ip.version != peer.ip.version)
    return SocketAddr(addresses[0], request.port)


async def serve_socks5(sock: socket.socket, outbound: OutboundProxy) -> None:
    """One SOCKS5 client, from greeting to the end of its relayed connection."""
    try:
        peer = SocketAddr.from_sockaddr(sock.getpeername())
    except OSError as e:
        log.debug("SOCKS5 client gone before its handshake: %s", e)
        sock.close()
        return
    hs = Socks5Handshake()
    request = await _handshake(sock, hs, peer)
    if request is None:
        sock.close()
        return
    target = await _resolve(request, peer, outbound.resolve_name)
    if isinstance(target, str):
        hs.reply(ReplyCode.HOST_UNREACHABLE)
        await _send(sock, hs.data_to_send())
        log.info("SOCKS5 request from %s for %r refused: %s", peer, request.host, target)
        sock.close()
        return
    upstream = await outbound.open(peer, target)
    if isinstance(upstream, OutboundFailure):
        code = reply_for_failure(upstream.response_flag, upstream.error, self_call=upstream.self_call)
        hs.reply(code)
        await _send(sock, hs.data_to_send())
        log.info("SOCKS5 request from %s to %s failed (%s): %s", peer, target, code.name, upstream.reason)
        sock.close()
        return
    trailing = hs.trailing_data()
    try:
        bound = SocketAddr.from_sockaddr(sock.getsockname())
        hs.reply(ReplyCode.SUCCEEDED, bound)
        if not await _send(sock, hs.data_to_send()):
            raise ConnectionResetError("client closed before the SOCKS5 success reply")
        downstream = wrap_socket(sock)
    except OSError as e:
        upstream.abandon(f"SOCKS5 client gone before the success reply: {e}")
        log.debug("SOCKS5 client %s gone before the success reply: %s", peer, e)
        sock.close()
        return
    if trailing:
        downstream._held.insert(0, trailing)
    await outbound.carry(upstream, downstream)
