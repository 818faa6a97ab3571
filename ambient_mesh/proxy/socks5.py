"""SOCKS5 server handshake (RFC 1928), sans-IO, in the subset ztunnel serves on port 15080.

Counterpart: ztunnel src/proxy/socks5.rs. Supported: version 5, method "no authentication
required" only, command CONNECT only, address types IPv4, domain name and IPv6. The shell
feeds bytes to `Socks5Handshake.receive_data`, writes `data_to_send()` after every call,
connects when it gets a `ConnectRequest`, then calls `reply()`. After a `Socks5Error` it
writes `data_to_send()` (the failure reply, if the protocol has one) and closes.

Wire layout (RFC 1928 sections 3, 4, 6):
    greeting  VER=5 NMETHODS METHODS[NMETHODS]          -> VER=5 METHOD
    request   VER=5 CMD RSV ATYP DST.ADDR DST.PORT(be16) -> VER=5 REP RSV=0 ATYP BND.ADDR BND.PORT

Every input gets an answer the client can read: a greeting we cannot accept (wrong version, no
methods, no "no authentication") gets METHOD X'FF' (section 3, the only refusal a greeting has);
a request we cannot serve gets a reply with the matching REP code (section 6), and so does a
client that stalls mid-request (`abort`). Domain names are checked against RFC 1035's limits
(labels of 1-63 octets, at most 253 characters) before anyone tries to resolve them.
"""

from __future__ import annotations

import enum
import errno
import ipaddress
from dataclasses import dataclass

from ..errors import AmbientError, ProtocolError
from ..net import IPAddress, SocketAddr, ip_address

SOCKS_VERSION = 5
METHOD_NO_AUTH = 0x00
METHOD_NO_ACCEPTABLE = 0xFF
CMD_CONNECT = 0x01
ATYP_IPV4 = 0x01
ATYP_DOMAIN = 0x03
ATYP_IPV6 = 0x04

_ADDRESS_BYTES = {ATYP_IPV4: 4, ATYP_IPV6: 16}
_PORT_BYTES = 2

# RFC 1035 2.3.4: a label is at most 63 octets; a name at most 255 octets on the wire, which
# is 253 characters written with dots and without the optional trailing dot.
MAX_DNS_LABEL_BYTES = 63
MAX_DNS_NAME_CHARS = 253
# A greeting is at most 257 bytes and a request 262; what a client pipelines behind them is kept
# for the relay, but only up to this much before we have even connected.
MAX_BUFFERED_BYTES = 64 * 1024


class ReplyCode(enum.IntEnum):
    """The REP field of the server reply (RFC 1928 section 6)."""

    SUCCEEDED = 0
    GENERAL_FAILURE = 1
    NOT_ALLOWED = 2
    NETWORK_UNREACHABLE = 3
    HOST_UNREACHABLE = 4
    CONNECTION_REFUSED = 5
    TTL_EXPIRED = 6
    COMMAND_NOT_SUPPORTED = 7
    ADDRESS_TYPE_NOT_SUPPORTED = 8


class Socks5State(enum.Enum):
    GREETING = "greeting"  # waiting for the method offer
    REQUEST = "request"  # "no auth" selected; waiting for the request
    CONNECTING = "connecting"  # request parsed; the shell connects, then calls reply()
    ESTABLISHED = "established"  # success sent: everything further is application data
    CLOSED = "closed"  # failed or refused: send the outbox and close


class Socks5Error(ProtocolError):
    """The client broke RFC 1928 or asked for something outside ztunnel's subset.

    `reply` is the REP code of the failure reply already queued in the outbox, or None when
    the failure came before a request: then the outbox holds METHOD X'FF' (or nothing, when
    the client has already closed).
    """

    def __init__(self, message: str, *, reply: ReplyCode | None = None) -> None:
        super().__init__(message, hint="the SOCKS5 listener supports CONNECT without authentication only")
        self.reply = reply


@dataclass(frozen=True, slots=True, kw_only=True)
class NeedMoreData:
    """Nothing to act on yet: feed more bytes."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectRequest:
    """The client asks for a connection to `host:port`.

    `host` is an IP address for address types 1 and 4 and the name as sent for type 3
    (resolving it is the shell's business).
    """

    host: str | IPAddress
    port: int


Socks5Event = NeedMoreData | ConnectRequest


def encode_reply(code: ReplyCode, bound: SocketAddr | None = None) -> bytes:
    """The server reply; without a bound address it carries 0.0.0.0:0, as RFC 1928 allows."""
    if bound is None:
        return bytes([SOCKS_VERSION, code, 0, ATYP_IPV4, 0, 0, 0, 0, 0, 0])
    atyp = ATYP_IPV6 if bound.ip.version == 6 else ATYP_IPV4
    return bytes([SOCKS_VERSION, code, 0, atyp]) + bound.ip.packed + bound.port.to_bytes(_PORT_BYTES, "big")


class Socks5Handshake:
    """One server side of a SOCKS5 handshake: bytes in, one event out, reply bytes queued."""

    def __init__(self) -> None:
        self.state = Socks5State.GREETING
        self.request: ConnectRequest | None = None
        self._buffer = bytearray()
        self._outbox = bytearray()
        self._handlers = {
            Socks5State.GREETING: self._on_greeting,
            Socks5State.REQUEST: self._on_request,
        }

    def __repr__(self) -> str:
        target = ""
        if self.request is not None:
            target = f" to {_format_target(self.request)}"
        return f"<Socks5Handshake {self.state.value}{target}, {len(self._buffer)} bytes buffered>"

    def receive_data(self, data: bytes) -> Socks5Event:
        """Feed bytes from the client; raise Socks5Error on input outside the subset."""
        if self.state is Socks5State.CLOSED:
            raise Socks5Error("SOCKS5 handshake already failed")
        self._buffer += data
        if len(self._buffer) > MAX_BUFFERED_BYTES:
            raise self.abort(f"client sent more than {MAX_BUFFERED_BYTES} bytes before its connection was up")
        while (handler := self._handlers.get(self.state)) is not None:
            event = handler()
            if event is not None:
                return event
        # Past the request every byte is the client's application data (clients may pipeline
        # it behind the request); it is kept for trailing_data().
        return NeedMoreData()

    def data_to_send(self) -> bytes:
        """Bytes to write to the client now; empties the outbox."""
        out = bytes(self._outbox)
        self._outbox.clear()
        return out

    def trailing_data(self) -> bytes:
        """Bytes the client sent after its request; empties the buffer."""
        if self.state in (Socks5State.GREETING, Socks5State.REQUEST):
            return b""
        out = bytes(self._buffer)
        self._buffer.clear()
        return out

    def abort(self, reason: str, code: ReplyCode = ReplyCode.GENERAL_FAILURE) -> Socks5Error:
        """Give up (timeout, overflow, a request we will not serve): queue the refusal this
        state has, move to CLOSED, and return the error for the shell to log."""
        if self.state is Socks5State.GREETING:
            self._outbox += bytes([SOCKS_VERSION, METHOD_NO_ACCEPTABLE])
            return self._fail(reason)
        if self.state in (Socks5State.REQUEST, Socks5State.CONNECTING):
            return self._fail(reason, code)
        self.state = Socks5State.CLOSED
        return Socks5Error(reason)

    def client_closed(self) -> Socks5Error:
        """The client sent EOF mid-handshake: nobody is left to read a reply."""
        return self._fail(f"client closed during the SOCKS5 handshake ({self.state.value})")

    def reply(self, code: ReplyCode, bound: SocketAddr | None = None) -> bytes:
        """Answer the ConnectRequest; the bytes are queued in the outbox and returned."""
        if self.state is not Socks5State.CONNECTING:
            raise AmbientError(f"SOCKS5 reply in state {self.state.value}: only after a ConnectRequest")
        data = encode_reply(ReplyCode(code), bound)
        self._outbox += data
        self.state = Socks5State.ESTABLISHED if code == ReplyCode.SUCCEEDED else Socks5State.CLOSED
        return data

    # ------------------------------------------------------------------ state handlers

    def _fail(self, message: str, reply: ReplyCode | None = None) -> Socks5Error:
        self.state = Socks5State.CLOSED
        self._buffer.clear()
        if reply is not None:
            self._outbox += encode_reply(reply)
        return Socks5Error(message, reply=reply)

    def _on_greeting(self) -> Socks5Event | None:
        buf = self._buffer
        if len(buf) < 2:
            return NeedMoreData()
        if buf[0] != SOCKS_VERSION:
            # RFC 1928 defines no reply for another version; X'FF' at least tells a SOCKS5-aware
            # client it was refused, and a SOCKS4 client reads it as "request rejected".
            self._outbox += bytes([SOCKS_VERSION, METHOD_NO_ACCEPTABLE])
            raise self._fail(f"SOCKS version {buf[0]} in greeting, expected 5")
        end = 2 + buf[1]
        if len(buf) < end:
            return NeedMoreData()
        methods = bytes(buf[2:end])
        del buf[:end]
        if METHOD_NO_AUTH not in methods:
            # RFC 1928 section 3: 0xFF tells the client none of its methods is acceptable.
            self._outbox += bytes([SOCKS_VERSION, METHOD_NO_ACCEPTABLE])
            raise self._fail(f"client offers methods {methods.hex() or 'none'}, not 'no authentication' (00)")
        self._outbox += bytes([SOCKS_VERSION, METHOD_NO_AUTH])
        self.state = Socks5State.REQUEST
        return None

    def _on_request(self) -> Socks5Event | None:
        buf = self._buffer
        if len(buf) < 4:
            return NeedMoreData()
        version, command, _reserved, atyp = buf[:4]
        # RSV is ignored: it carries nothing, and rejecting a non-zero value helps no client.
        if version != SOCKS_VERSION:
            raise self._fail(f"SOCKS version {version} in request, expected 5", ReplyCode.GENERAL_FAILURE)
        if command != CMD_CONNECT:
            raise self._fail(
                f"SOCKS command {command} is not supported, only CONNECT (1)", ReplyCode.COMMAND_NOT_SUPPORTED
            )
        if atyp == ATYP_DOMAIN:
            if len(buf) < 5:
                return NeedMoreData()
            addr_start, addr_len = 5, buf[4]
        elif atyp in _ADDRESS_BYTES:
            addr_start, addr_len = 4, _ADDRESS_BYTES[atyp]
        else:
            raise self._fail(
                f"SOCKS address type {atyp} is not supported", ReplyCode.ADDRESS_TYPE_NOT_SUPPORTED
            )
        end = addr_start + addr_len + _PORT_BYTES
        if len(buf) < end:
            return NeedMoreData()
        raw = bytes(buf[addr_start : addr_start + addr_len])
        port = int.from_bytes(buf[end - _PORT_BYTES : end], "big")
        del buf[:end]
        host: str | IPAddress
        if atyp == ATYP_DOMAIN:
            host = self._domain(raw)
        else:
            # 4 bytes IPv4, 16 IPv6, unmapped like every other address in the proxy (so
            # ::ffff:a.b.c.d means a.b.c.d); net's cache of packed addresses returns the same
            # object for the same target, whose text is then cached too (net.ip_text).
            host = ip_address(raw)
        self.request = ConnectRequest(host=host, port=port)
        self.state = Socks5State.CONNECTING
        return self.request

    def _domain(self, raw: bytes) -> str:
        try:
            name = raw.decode("ascii")
        except UnicodeDecodeError:
            # Clients send IDNs in their ASCII (punycode) form; anything else is not a name.
            raise self._fail(f"SOCKS domain name {raw!r} is not ASCII", ReplyCode.GENERAL_FAILURE) from None
        if not name or not name.isprintable() or " " in name:
            raise self._fail(
                f"SOCKS domain name {name!r} is empty or not printable", ReplyCode.GENERAL_FAILURE
            )
        problem = dns_name_problem(name)
        if problem is not None:
            raise self._fail(f"SOCKS domain name {name[:80]!r}: {problem}", ReplyCode.GENERAL_FAILURE)
        return name


def dns_name_problem(name: str) -> str | None:
    """Why `name` cannot be a DNS name (RFC 1035 2.3.4), or None when it can."""
    bare = name[:-1] if name.endswith(".") else name
    if not bare:
        return "empty name"
    if len(bare) > MAX_DNS_NAME_CHARS:
        return f"{len(bare)} characters, more than the {MAX_DNS_NAME_CHARS} a DNS name may have"
    for label in bare.split("."):
        if not label:
            return "empty label (two dots in a row, or a leading dot)"
        if len(label) > MAX_DNS_LABEL_BYTES:
            return f"a label of {len(label)} characters, more than the {MAX_DNS_LABEL_BYTES} DNS allows"
    return None


def _format_target(request: ConnectRequest) -> str:
    host = request.host
    if isinstance(host, ipaddress.IPv6Address):
        return f"[{host}]:{request.port}"
    return f"{host}:{request.port}"


def reply_for_failure(
    response_flag: str, error: BaseException | None = None, *, self_call: bool = False
) -> ReplyCode:
    """The REP code that tells a client why its CONNECT failed (RFC 1928 section 6).

    A refusal by policy or by the proxy itself (a self call) is "not allowed by ruleset"; a
    socket error says what the network said; anything else is a general failure.
    """
    if self_call or response_flag == "DENY":
        return ReplyCode.NOT_ALLOWED
    if isinstance(error, ConnectionRefusedError):
        return ReplyCode.CONNECTION_REFUSED
    if isinstance(error, TimeoutError):
        return ReplyCode.HOST_UNREACHABLE
    if isinstance(error, OSError):
        if error.errno == errno.ENETUNREACH:
            return ReplyCode.NETWORK_UNREACHABLE
        if error.errno in (errno.EHOSTUNREACH, errno.EHOSTDOWN):
            return ReplyCode.HOST_UNREACHABLE
        if error.errno == errno.ECONNREFUSED:
            return ReplyCode.CONNECTION_REFUSED
    return ReplyCode.GENERAL_FAILURE
