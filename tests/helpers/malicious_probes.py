"""Probes a malicious workload sends at a node proxy's ports, and what each one must get back."""

from __future__ import annotations

import enum
import errno
import ipaddress
import socket
from dataclasses import dataclass

from ambient_mesh.host.netns import netns_socket
from ambient_mesh.ports import (
    ADMIN_PORT,
    HBONE_PORT,
    READINESS_PORT,
    STATS_PORT,
)

PROBE_TIMEOUT_S = 5.0

READ_BYTES = 65536

SHOWN_BYTES = 80

PEER_RESET_ERRNOS = frozenset({errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN})

# A cleartext HTTP/2 client's first flight: the connection preface and an empty SETTINGS frame.
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"

TLS_ALERT_RECORD = 0x15  # TLS ContentType alert: the only thing a TLS server may answer garbage with

PATH_FOR_PORT = {ADMIN_PORT: "/", STATS_PORT: "/metrics", READINESS_PORT: "/healthz/ready"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """What one raw TCP call saw: did it connect, what came back, how it ended."""

    connect: str  # "ok", an errno name (ECONNREFUSED, ...) or "timeout"
    data: bytes = b""
    end: str = "-"  # "eof", "reset", "timeout", or "-" when it never connected

    @property
    def connected(self) -> bool:
        return self.connect == "ok"

    @property
    def closed_by_peer(self) -> bool:
        return self.end in ("eof", "reset")

    def http_status(self) -> int | None:
        if not self.data.startswith(b"HTTP/1."):
            return None
        fields = self.data.split(b"\r\n", 1)[0].split()
        return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None

    def __str__(self) -> str:
        return (
            f"connect={self.connect} end={self.end} received {len(self.data)} bytes"
            f"{': ' + repr(self.data[:SHOWN_BYTES]) if self.data else ''}"
        )


def probe(
    netns: str,
    host: str,
    port: int,
    payload: bytes,
    *,
    half_close: bool = False,
    mark: int | None = None,
    timeout_s: float = PROBE_TIMEOUT_S,
) -> Outcome:
    """Connect from inside `netns`, send `payload`, read until the peer closes or `timeout_s` passes."""
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    with netns_socket(netns, family) as sock:
        sock.settimeout(timeout_s)
        if mark is not None:
            sock.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_MARK", 36), mark)
        try:
            sock.connect((host, port))
        except TimeoutError:
            return Outcome(connect="timeout")
        except OSError as e:
            return Outcome(connect=errno.errorcode.get(e.errno, str(e)))
        chunks: list[bytes] = []
        try:
            sock.sendall(payload)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
            while chunk := sock.recv(READ_BYTES):
                chunks.append(chunk)
            end = "eof"
        except TimeoutError:
            end = "timeout"
        except OSError as e:
            # The peer's RST can beat our send, shutdown or recv: each reports it differently.
            if e.errno not in PEER_RESET_ERRNOS:
                raise
            end = "reset"
        return Outcome(connect="ok", data=b"".join(chunks), end=end)


def http_request(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n".encode()


def payload_for(port: int) -> bytes:
    if port == HBONE_PORT:
        return H2_PREFACE
    return http_request(PATH_FOR_PORT.get(port, "/"))


class Expect(enum.Enum):
    CLOSED = "accepted, then closed without a single byte"
    NO_H2 = "closed with no HTTP/2 or HTTP response (at most a TLS alert)"
    HTTP_OK = "an HTTP 200 response"
    NOT_LISTENING = "connection refused: nothing listens there"


def check(expect: Expect, outcome: Outcome) -> bool:
    if expect is Expect.NOT_LISTENING:
        return outcome.connect == "ECONNREFUSED"
    if not outcome.connected:
        return False
    if expect is Expect.HTTP_OK:
        return outcome.http_status() == 200
    if not outcome.closed_by_peer:
        return False  # still open after the timeout: the proxy neither refused nor answered
    if expect is Expect.CLOSED:
        return outcome.data == b""
    # NO_H2: a TLS server fed plaintext may send one fatal alert record before closing.
    return outcome.data == b"" or outcome.data[0] == TLS_ALERT_RECORD
