"""One HBONE TLS handshake, sans-IO: OpenSSL (through pyOpenSSL) over memory BIOs, fed one
record at a time, and what is left of it once it is done.

Why memory BIOs and one record at a time: OpenSSL reads and writes only what we hand it, so when
`do_handshake` first succeeds, every received byte after the record that completed it is still
ours (`leftover`), whatever the peer sent behind its last flight (a client's first HTTP/2 bytes
often share a segment with its Finished). Nothing of OpenSSL's read-ahead, pending bytes or
socket BIO needs to be asked about, and none of it is reachable through Python's `ssl`.

What comes out of a TLS 1.3 handshake (`Handshake.finish`):
- the two application traffic secrets, from the context's keylog callback (pyOpenSSL's
  `Context.set_keylog_callback`, OpenSSL's SSL_CTX_set_keylog_callback; tls/context.py sets it).
  Only CLIENT_TRAFFIC_SECRET_0 and SERVER_TRAFFIC_SECRET_0 are kept, in bytearrays the record
  layer wipes; the line itself is an immutable bytes object for the moment it is parsed;
- how many records OpenSSL sealed under our first write key before we took over: a TLS 1.3
  server's NewSessionTickets (OpenSSL sends stateful ones even under SSL_OP_NO_TICKET, and
  pyOpenSSL has no SSL_CTX_set_num_tickets); they are sent as part of the handshake's output
  and our record layer's sequence numbers continue after them;
- `PeerTls`: what the identity and CRL checks read (the peer's certificate and verified chain,
  ALPN, version, suite), copied out of OpenSSL.

Then the OpenSSL connection is released (SSL_free when its last reference goes), so after a TLS
1.3 handshake nothing holds OpenSSL's state on the connection's keys: the record layer
(tls/records.py) is the one writer. TLS 1.2 (TLS12_ENABLED) keeps OpenSSL's records: the
connection is handed to `OpenSslTransport` (tls/transport.py) instead, and it is its only holder.
"""

from __future__ import annotations

import binascii
import ssl
import struct
from typing import Final

from cryptography import x509
from OpenSSL import SSL, crypto

from ..errors import CertificateError
from . import records

# Longest record a handshake peer may send us (RFC 8446 5.2: 2^14 + 256 of ciphertext), and how
# much of a handshake we hold unfed (a few records; a certificate chain spans at most a few).
MAX_HANDSHAKE_RECORD_BYTES: Final = records.MAX_CIPHERTEXT_BYTES
MAX_HANDSHAKE_HELD_BYTES: Final = 256 * 1024
_HEADER = struct.Struct(">BHH")
# Record content types a handshake can carry (RFC 8446 5.1, B.1): change_cipher_spec, alert,
# handshake, application_data (TLS 1.3's encrypted handshake).
_HANDSHAKE_TYPES: Final = frozenset((20, 21, 22, 23))
# Keylog labels kept (NSS key log format, which OpenSSL's keylog callback writes).
_CLIENT_LABEL: Final = b"CLIENT_TRAFFIC_SECRET_0 "
_SERVER_LABEL: Final = b"SERVER_TRAFFIC_SECRET_0 "
_MAX_SECRET_HEX: Final = 96  # SHA-384's 48 bytes (TLS_AES_256_GCM_SHA384), as hex
# OpenSSL's version names, as Python's `ssl` reports them.
TLS13: Final = "TLSv1.3"


class HandshakeError(ssl.SSLError):
    """The TLS handshake failed (an OSError, as Python's `ssl` reports handshake failures)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "TLS handshake failed"


class TrafficSecrets:
    """The application traffic secrets of one handshake, as its keylog lines report them."""

    __slots__ = ("client", "server")

    def __init__(self) -> None:
        self.client: bytearray | None = None
        self.server: bytearray | None = None

    def __repr__(self) -> str:  # never the secrets themselves
        return f"TrafficSecrets(client={self.client is not None}, server={self.server is not None})"

    def wipe(self) -> None:
        for secret in (self.client, self.server):
            if secret is not None:
                secret[:] = bytes(len(secret))
        self.client = self.server = None


def on_keylog(conn: SSL.Connection, line: bytes) -> None:
    """The keylog callback of every HBONE context (tls/context.py): the line's secret goes to
    the `TrafficSecrets` the connection carries as its app data. Runs inside OpenSSL: it never
    raises (a secret that cannot be parsed stays missing, and the record layer refuses to start)."""
    try:
        secrets = conn.get_app_data()
        if not isinstance(secrets, TrafficSecrets):
            return
        if line.startswith(_CLIENT_LABEL):
            client = True
        elif line.startswith(_SERVER_LABEL):
            client = False
        else:
            return
        hex_secret = line.rpartition(b" ")[2]
        if not hex_secret or len(hex_secret) > _MAX_SECRET_HEX:
            return
        value = bytearray(binascii.a2b_hex(hex_secret))
        if client:
            secrets.client = value
        else:
            secrets.server = value
    except Exception:  # noqa: BLE001 - nothing may escape into OpenSSL
        return


class PeerTls:
    """What a finished handshake tells about the peer, copied out of OpenSSL: the object a TLS
    transport hands out as `get_extra_info("ssl_object")`. It holds no OpenSSL state and no key:
    nothing can be read or written through it (see tests/integration/test_tls_one_writer.py).
    Its methods are the part of `ssl.SSLObject` the identity and CRL checks call."""

    __slots__ = ("_cert_der", "_chain", "_alpn", "_version", "_cipher", "_bits")

    def __init__(
        self,
        *,
        cert_der: bytes | None,
        chain: tuple[x509.Certificate, ...] | None,
        alpn: str | None,
        version: str,
        cipher: str,
        bits: int,
    ) -> None:
        self._cert_der = cert_der
        self._chain = chain
        self._alpn = alpn
        self._version = version
        self._cipher = cipher
        self._bits = bits

    def __repr__(self) -> str:
        chain = "not kept" if self._chain is None else len(self._chain)
        return f"PeerTls({self._version}, {self._cipher}, alpn={self._alpn!r}, chain={chain})"

    def getpeercert(self, binary_form: bool = False) -> object:
        """The peer's leaf certificate, DER (binary_form); the dict form is not offered ({})."""
        if binary_form:
            return self._cert_der
        return {} if self._cert_der else None

    def get_verified_chain(self) -> tuple[x509.Certificate, ...]:
        """The chain OpenSSL verified, leaf first, root last. Kept only for contexts that may
        need it (`NO_VERIFIED_CHAIN`); asked for anyway, it refuses (so a CRL check fails
        closed)."""
        if self._chain is None:
            raise CertificateError(
                "the peer's verified chain was not kept for this connection",
                hint="a context whose connections are CRL-checked must not be marked NO_VERIFIED_CHAIN",
            )
        return self._chain

    def selected_alpn_protocol(self) -> str | None:
        return self._alpn

    def version(self) -> str:
        return self._version

    def cipher(self) -> tuple[str, str, int]:
        return (self._cipher, self._version, self._bits)

    @classmethod
    def of(cls, conn: SSL.Connection) -> PeerTls:
        """Copied out of `conn`. The leaf goes out as DER straight from OpenSSL; the verified
        chain, which only CRL_PATH reads, is converted to `cryptography` certificates only when
        the context does not say NO_VERIFIED_CHAIN (about 25 µs of each side's CPU per
        connection otherwise)."""
        leaf = conn.get_peer_certificate()
        keep_chain = conn.get_context().get_app_data() is not NO_VERIFIED_CHAIN
        alpn = conn.get_alpn_proto_negotiated()
        return cls(
            cert_der=crypto.dump_certificate(crypto.FILETYPE_ASN1, leaf) if leaf is not None else None,
            chain=tuple(conn.get_verified_chain(as_cryptography=True) or ()) if keep_chain else None,
            alpn=alpn.decode("ascii", "replace") if alpn else None,
            version=conn.get_protocol_version_name(),
            cipher=conn.get_cipher_name() or "",
            bits=conn.get_cipher_bits() or 0,
        )


# A context's app data (`SSL.Context.set_app_data`) saying its connections' verified chains are
# not needed: tls/context.py's TlsContextCache marks its contexts so when CRL_PATH is not set.
NO_VERIFIED_CHAIN: Final = "no-verified-chain"


def _ssl_error(e: SSL.Error) -> HandshakeError:
    reasons = [str(part[2]) for part in e.args[0]] if e.args and isinstance(e.args[0], list) else [str(e)]
    return HandshakeError(f"TLS handshake failed: {'; '.join(r for r in reasons if r) or type(e).__name__}")


class Handshake:
    """OpenSSL's handshake over memory BIOs: bytes in (`receive`), bytes to send out; `done` once
    OpenSSL has finished. Each received record is fed alone, so the first byte after the record
    that finished the handshake is `leftover`'s first."""

    __slots__ = ("server_side", "secrets", "done", "_conn", "_held", "_last_output_records")

    def __init__(self, ctx: SSL.Context, *, server_side: bool) -> None:
        self.server_side = server_side
        self.secrets = TrafficSecrets()
        conn = SSL.Connection(ctx, None)
        conn.set_app_data(self.secrets)
        if server_side:
            conn.set_accept_state()
        else:
            conn.set_connect_state()
        self._conn: SSL.Connection | None = conn
        self._held = bytearray()  # received, not yet fed to OpenSSL
        self.done = False
        self._last_output_records = 0  # records in the output of the call that finished

    def __repr__(self) -> str:
        side = "server" if self.server_side else "client"
        return f"Handshake({side}, {'done' if self.done else 'running'}, held={len(self._held)}B)"

    def start(self) -> bytes:
        """The client's first flight (a server has nothing to say first)."""
        self._step()
        return self._drain()

    def receive(self, data: bytes | bytearray | memoryview) -> bytes:
        """Feed what the peer sent, one whole record at a time, until the handshake is done;
        returns what to send the peer. Raises HandshakeError."""
        if self.done:
            raise RuntimeError("the handshake is already done")
        held = self._held
        held += data
        pos = 0
        try:
            while len(held) - pos >= records.RECORD_HEADER_BYTES:
                kind, _version, length = _HEADER.unpack_from(held, pos)
                if kind not in _HANDSHAKE_TYPES or length > MAX_HANDSHAKE_RECORD_BYTES:
                    raise HandshakeError(
                        f"TLS handshake failed: the peer sent a record of type {kind} and {length} bytes;"
                        " is it speaking TLS (HBONE, port 15008)?"
                    )
                stop = pos + records.RECORD_HEADER_BYTES + length
                if stop > len(held):
                    break
                assert self._conn is not None
                try:
                    self._conn.bio_write(bytes(held[pos:stop]))
                except SSL.Error as e:
                    raise _ssl_error(e) from None
                pos = stop
                self._step()
                if self.done:
                    break
        finally:
            del held[:pos]
        if not self.done and len(held) > MAX_HANDSHAKE_HELD_BYTES:
            raise HandshakeError(f"TLS handshake failed: more than {MAX_HANDSHAKE_HELD_BYTES} bytes unfed")
        # What OpenSSL wrote, read out once per call rather than after every record (each read
        # of an empty BIO is a raised WantReadError in pyOpenSSL).
        output = self._drain()
        if self.done:
            # A TLS 1.3 server writes nothing between its own flight and the client's Finished,
            # and the client's last flight cannot share a call with anything before the server's
            # flight: all this call's output is what came after the Finished (its tickets).
            self._last_output_records = _count_records(output)
        return output

    def _step(self) -> None:
        conn = self._conn
        assert conn is not None
        try:
            conn.do_handshake()
            self.done = True
        except SSL.WantReadError:
            pass
        except SSL.Error as e:
            # Our alert, if OpenSSL sealed one, still goes out: the caller sends what
            # `failure_output` holds before it closes.
            raise _ssl_error(e) from None

    def failure_output(self) -> bytes:
        """What OpenSSL left to send after a failure (its alert), best effort."""
        if self._conn is None:
            return b""
        return self._drain()

    def _drain(self) -> bytes:
        assert self._conn is not None
        return drain_output(self._conn)

    def leftover(self) -> bytes:
        """The received bytes after the record that finished the handshake."""
        return bytes(self._held)

    def finish(
        self,
        records_per_key: int = records.RECORDS_PER_KEY,
        *,
        openssl_records: bool = False,
        request_peer_update: bool = False,
    ) -> tuple[PeerTls, records.RecordLayer | None]:
        """After `done`: the peer's facts and, for TLS 1.3, HBONE's record layer; the OpenSSL
        connection is released then (see the module docstring). For TLS 1.2 (or TLS 1.3 with
        `openssl_records`, which benchmarks compare against) the record layer is None and the
        connection is still to be taken with `take_openssl`. Raises HandshakeError
        when the traffic secrets are missing or the suite is not one the record layer has."""
        conn = self._conn
        if not self.done or conn is None:
            raise RuntimeError("the handshake is not done")
        peer = PeerTls.of(conn)
        if peer.version() != TLS13 or openssl_records:
            self.secrets.wipe()
            return peer, None
        secrets = self.secrets
        try:
            if secrets.client is None or secrets.server is None:
                raise HandshakeError(
                    "TLS handshake failed: OpenSSL reported no traffic secrets;"
                    " the context must carry HBONE's keylog callback (tls/context.py)"
                )
            read, write = (
                (secrets.client, secrets.server) if self.server_side else (secrets.server, secrets.client)
            )
            # A TLS 1.3 client's last flight is sealed under handshake keys; a server's, after the
            # client's Finished, is NewSessionTickets under its first application key.
            sealed = self._last_output_records if self.server_side else 0
            try:
                layer = records.RecordLayer(
                    peer.cipher()[0],
                    client_side=not self.server_side,
                    read_secret=read,
                    write_secret=write,
                    records_per_key=records_per_key,
                    write_sequence=sealed,
                    request_peer_update=request_peer_update,
                )
            except Exception as e:  # noqa: BLE001 - an unknown suite or a malformed secret
                raise HandshakeError(f"TLS handshake failed: {e}") from None
        finally:
            secrets.wipe()
            self.release()
        return peer, layer

    def take_openssl(self) -> SSL.Connection:
        """TLS 1.2: the OpenSSL connection, now its caller's alone."""
        conn = self._conn
        if conn is None:
            raise RuntimeError("the OpenSSL connection was already released")
        self._conn = None
        conn.set_app_data(None)
        return conn

    def release(self) -> None:
        """Drop our reference to the OpenSSL connection (its SSL is freed with the last one)."""
        self.secrets.wipe()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.set_app_data(None)


def drain_output(conn: SSL.Connection, chunk_bytes: int = 256 * 1024) -> bytes:
    """Everything OpenSSL wrote into `conn`'s outgoing memory BIO."""
    out = bytearray()
    while True:
        try:
            chunk = conn.bio_read(chunk_bytes)
        except SSL.WantReadError:
            break
        if not chunk:
            break
        out += chunk
    return bytes(out)


def _count_records(data: bytes) -> int:
    n = pos = 0
    while len(data) - pos >= records.RECORD_HEADER_BYTES:
        _kind, _version, length = _HEADER.unpack_from(data, pos)
        pos += records.RECORD_HEADER_BYTES + length
        n += 1
    return n
