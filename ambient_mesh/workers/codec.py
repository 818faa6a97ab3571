"""The owner <-> worker channel: framed messages on a Unix socketpair, sans-IO.

Counterpart: none in ztunnel, whose worker threads share one heap; our workers are processes
(see ambient_mesh/workers/__init__.py), so what ztunnel shares in memory travels here.

A frame is an 8-byte header, then the payload:

    u32 payload length | u8 kind | u8 file descriptor count | u16 zero

The payload of an `XdsResponse` is a serialized `DeltaDiscoveryResponse`; every other payload
is one UTF-8 JSON object whose fields are checked against the message's schema. File
descriptors (listening sockets, a pod's network namespace) travel as SCM_RIGHTS with the
frame's first bytes; the decoder queues what the socket delivered and hands a frame exactly
the count its header names (the kernel delivers descriptors no later than the first byte they
came with, so a complete frame's descriptors are always already queued).

Either side may be broken or hostile, so everything is bounded: a frame's length by the
direction's limit (the owner may send what one xDS response may hold; a worker only small
replies), descriptors per frame and descriptors received but not yet claimed, JSON nesting,
and the number of metric samples in a stats reply. A violation is a `WorkerProtocolError`;
the shell then closes the channel (and the owner restarts that worker).
"""

from __future__ import annotations

import json
import os
import struct
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..errors import ProtocolError
from ..xds.session import MAX_RECEIVE_BYTES

MIB = 1024 * 1024
HEADER = struct.Struct(">IBBH")
HEADER_BYTES = HEADER.size
# Owner -> worker: an xDS response is forwarded whole, so as large as the xDS client accepts.
MAX_OWNER_FRAME_BYTES = MAX_RECEIVE_BYTES + MIB
# Worker -> owner: certificate requests, acknowledgements and stats replies (metric samples and
# the connections in /config_dump): small, and a hostile worker must not grow the owner.
MAX_WORKER_FRAME_BYTES = 16 * MIB
MAX_FDS_PER_FRAME = 16  # a pod's netns and its listeners, N sockets each: 1 + 4 per frame
MAX_PENDING_FDS = 64  # received, not yet claimed by a complete frame
MAX_JSON_DEPTH = 32
MAX_STATS_SAMPLES = 200_000
MAX_LISTENERS_PER_PROXY = 8
MAX_ENV_ENTRIES = 4096


class WorkerProtocolError(ProtocolError):
    """A frame on the owner <-> worker channel that breaks the format or its bounds."""

    def __init__(self, message: str) -> None:
        super().__init__(
            f"worker channel: {message}",
            hint="a worker and its owner must be the same ambient-mesh build; the channel is closed "
            "and the worker restarted",
        )


# -- the messages ---------------------------------------------------------------------------------

JsonObject = dict[str, Any]


def _check(obj: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in obj:
        raise WorkerProtocolError(f"field {name!r} missing")
    value = obj[name]
    # bool is an int in Python; a field typed int must not accept true/false.
    if isinstance(value, bool) and kind is not bool and not (isinstance(kind, tuple) and bool in kind):
        raise WorkerProtocolError(f"field {name!r} is a boolean, not {kind}")
    if not isinstance(value, kind):
        raise WorkerProtocolError(f"field {name!r} has the wrong type ({type(value).__name__})")
    return value


def _strings(value: Any, name: str, limit: int) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > limit or not all(isinstance(v, str) for v in value):
        raise WorkerProtocolError(f"field {name!r} must be a list of at most {limit} strings")
    return tuple(value)


@dataclass(frozen=True, slots=True)
class Message:
    """Base of every message; `KIND` is its frame kind, `FDS` whether it carries descriptors."""

    KIND: ClassVar[int] = 0

    def to_json(self) -> JsonObject:
        raise NotImplementedError

    def fd_list(self) -> Sequence[int]:
        return ()


# Owner -> worker ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello(Message):
    """First message: the node proxy's environment, so the worker builds the owner's config."""

    KIND: ClassVar[int] = 9
    env: dict[str, str] = field(repr=False)

    def to_json(self) -> JsonObject:
        return {"env": self.env}

    @classmethod
    def from_json(cls, obj: JsonObject, fds: Sequence[int]) -> Hello:
        env = _check(obj, "env", dict)
        if len(env) > MAX_ENV_ENTRIES or not all(isinstance(v, str) for v in env.values()):
            raise WorkerProtocolError(f"env must map at most {MAX_ENV_ENTRIES} names to strings")
        return cls(env)


@dataclass(frozen=True, slots=True)
class LocalConfig(Message):
    """LOCAL_XDS / LOCAL_XDS_PATH as the owner read it at start, parsed again by the worker."""

    KIND: ClassVar[int] = 1
    text: str
    source: str

    def to_json(self) -> JsonObject:
        return {"text": self.text, "source": self.source}

    @classmethod
    def from_json(cls, obj: JsonObject, fds: Sequence[int]) -> LocalConfig:
        return cls(_check(obj, "text", str), _check(obj, "source", str))


@dataclass(frozen=True, slots=True)
class XdsResponse(Message):
    """The resources of one xDS response that the owner accepted (and removals), as a
    serialized DeltaDiscoveryResponse; the worker decodes and applies it as the owner did."""

    KIND: ClassVar[int] = 2
    data: bytes = field(repr=False)


@dataclass(frozen=True, slots=True)
class Synced(Message):
    """The initial state (local config, then every resource the owner holds) has been sent."""

    KIND: ClassVar[int] = 3

    def to_json(self) -> JsonObject:
        return {}

    @classmethod
    def from_json(cls, obj: JsonObject, fds: Sequence[int]) -> Synced:
        return cls()


@dataclass(frozen=True, slots=True)
class PodInfo:
    namespace: str
    name: str
    service_account: str


@dataclass(frozen=True, slots=True)
class ProxyStart(Message):
    """Serve one proxy set: `dedicated` (our own workload) or a pod (in-pod mode) by its uid.

    Descriptors: the pod's network namespace first when `pod` is set, then one listening
    socket per name in `listeners`, in order (the same sockets for every worker: one accept queue).
    """

    KIND: ClassVar[int] = 4
    key: str
    pod: PodInfo | None
    listeners: tuple[str, ...]
    fds: tuple[int, ...] = field(default=(), compare=False)

    def to_json(self) -> JsonObject:
        pod = None
        if self.pod is not None:
            pod = {
                "namespace": self.pod.namespace,
                "name": self.pod.name,
                "service_account": self.pod.service_account,
            }
        return {"key": self.key, "pod": pod, "listeners": list(self.listeners)}

    def fd_list(self) -> Sequence[int]:
        return self.fds

    @classmethod
    def from_json(cls, obj: JsonObject, fds: Sequence[int]) -> ProxyStart:
        raw_pod = _check(obj, "pod", (dict, type(None)))
        pod = None
        if raw_pod is not None:
            pod = PodInfo(
                _check(raw_pod, "namespace", str),
                _check(raw_pod, "name", str),
                _check(raw_pod, "service_account", str),
            )
        listeners = _strings(_check(obj, "listeners", list), "listeners", MAX_LISTENERS_PER_PROXY)
        expected = len(listeners) + (1 if pod is not None else 0)
        if len(fds) != expected:
            raise WorkerProtocolError(f"proxy start carries {len(fds)} descriptors, expected {expected}")
        return cls(_check(obj, "key", str), pod, listeners, tuple(fds))


@dataclass(frozen=True, slots=True)
class ProxyStop(Message):
    KIND: ClassVar[int] = 5
    key: str
    graceful: bool

    def to_json(self) -> JsonObject:
        return {"key": self.key, "graceful": self.graceful}

    @classmethod
    def from_json(cls, obj: JsonObject, fds: Sequence[int]) -> ProxyStop:
        return cls(_check(obj, "key", str), _check(obj, "graceful", bool))


@dataclass(frozen=True, slots=True)
class CertReply(Message):
    """The owner's certificate for an identity (key, chain [leaf, intermediates..., roots]),
    or why there is none."""

    KIND: ClassVar[int] = 6
    request: int
    key_pem: str = field(repr=False)
    chain: tuple[str, ...] = field(repr=False)
    error: str

    def to_json(self) -> JsonObject:
        return {
            "request": self.request,
            "key_pem": self.key_pem,
            "chain": list(self.chain),
            "error": self.error,
        }

    @classmethod
    def from_json(cls, obj: JsonObject, fds: Sequence[int]) -> CertReply:
        return cls(
            _check(obj, "request", int),
            _check(obj, "key_pem", str),
            _strings(_check(obj, "chain", list), "chain", 16),
            _check(obj, "error", str),
        )


@dataclass(frozen=True, slots=True)
class StatsRequest(Message):
    KIND: ClassVar[int] = 7
    request: int

    def to_json(self) -> JsonObject:
        return {"request": self.request}

    @classmethod
    def from_json(cls, obj: JsonObject, fds: Sequence[int]) -> StatsRequest:
        return cls(_check(obj, "request", int))


@dataclass(frozen=True, slots=True)
class Drain(Message):
    """Stop accepting, let connections finish for `deadline_s`, answer Drained, exit."""

    KIND: ClassVar[int] = 8
    deadline_s: float

    def to_json(self) -> JsonObject:
        return {"deadline_s": self.deadline_s}

    @classmethod
    def from_json(cls, obj: JsonObject, fds: Sequence[int]) -> Drain:
        return cls(float(_check(obj, "deadline_s", (int, float))))


# Worker -> owner ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ready(Message):
    KIND: ClassVar[int] = 64
    pid: int

    def to_json(self) -> JsonObject:
        return {"pid": self.pid}

    @classmethod
    def from_json(cls, obj: JsonObject, fds: Sequence[int]) -> Ready:
        return cls(_check(obj, "pid", int))


@dataclass(frozen=True, slots=True)
class CertRequest(Message):
    """A certificate for `identity`; `have_serial` is the one the worker holds (the owner then
    answers with a newer one once it has rotated), empty for a first request."""

    KIND: ClassVar[int] = 65
    request: int
    identity: str
    have_serial: str

    def to_json(self) -> JsonObject:
        return {"request": self.request, "identity": self.identity, "have_serial": self.have_serial}

    @classmethod
    def from_json(cls, obj: JsonObject, fds: Sequence[int]) -> CertRequest:
        return cls(_check(obj, "request", int), _check(obj, "identity", str), _check(obj, "have_serial", str))


# One metric family as the owner merges it: (name, type, help, unit, samples), each sample
# (sample name, labels, value).
Sample = tuple[str, dict[str, str], float]
Family = tuple[str, str, str, str, tuple[Sample, ...]]


def families_of(metrics: Iterable[Any], skip_prefixes: tuple[str, ...] = ()) -> tuple[Family, ...]:
    """prometheus-client metric families (a registry's `collect()`) as codec values."""
    out: list[Family] = []
    for metric in metrics:
        if metric.name.startswith(skip_prefixes):
            continue
        samples = tuple((s.name, dict(s.labels), float(s.value)) for s in metric.samples)
        out.append((metric.name, metric.type, metric.documentation, metric.unit, samples))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class ProxyStats:
    """One proxy set in a worker: what each listener accepted and its open connections."""

    accepted: dict[str, int]
    inbound: list[Any]
    outbound: list[Any]


@dataclass(frozen=True, slots=True)
class StatsReply(Message):
    KIND: ClassVar[int] = 66
    request: int
    families: tuple[Family, ...]
    proxies: dict[str, ProxyStats]

    def to_json(self) -> JsonObject:
        return {
            "request": self.request,
            "families": [[n, t, h, u, [list(s) for s in samples]] for n, t, h, u, samples in self.families],
            "proxies": {
                key: {"accepted": p.accepted, "inbound": p.inbound, "outbound": p.outbound}
                for key, p in self.proxies.items()
            },
        }

    @classmethod
    def from_json(cls, obj: JsonObject, fds: Sequence[int]) -> StatsReply:
        families: list[Family] = []
        total = 0
        for raw in _check(obj, "families", list):
            if not isinstance(raw, list) or len(raw) != 5 or not all(isinstance(x, str) for x in raw[:4]):
                raise WorkerProtocolError("a metric family must be [name, type, help, unit, samples]")
            name, kind, help_text, unit, raw_samples = raw
            if not isinstance(raw_samples, list):
                raise WorkerProtocolError(f"samples of {name!r} must be a list")
            total += len(raw_samples)
            if total > MAX_STATS_SAMPLES:
                raise WorkerProtocolError(f"more than {MAX_STATS_SAMPLES} metric samples in one reply")
            samples: list[Sample] = []
            for s in raw_samples:
                if (
                    not isinstance(s, list)
                    or len(s) != 3
                    or not isinstance(s[0], str)
                    or not isinstance(s[1], dict)
                    or not all(isinstance(k, str) and isinstance(v, str) for k, v in s[1].items())
                    or isinstance(s[2], bool)
                    or not isinstance(s[2], int | float)
                ):
                    raise WorkerProtocolError(
                        f"a sample of {name!r} must be [name, {{label: value}}, number]"
                    )
                samples.append((s[0], s[1], float(s[2])))
            families.append((name, kind, help_text, unit, tuple(samples)))
        proxies: dict[str, ProxyStats] = {}
        for key, raw_proxy in _check(obj, "proxies", dict).items():
            if not isinstance(raw_proxy, dict):
                raise WorkerProtocolError(f"proxy {key!r} stats must be an object")
            accepted = _check(raw_proxy, "accepted", dict)
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in accepted.values()):
                raise WorkerProtocolError(f"accepted counts of {key!r} must be integers")
            proxies[key] = ProxyStats(
                accepted=accepted,
                inbound=_check(raw_proxy, "inbound", list),
                outbound=_check(raw_proxy, "outbound", list),
            )
        return cls(_check(obj, "request", int), tuple(families), proxies)


@dataclass(frozen=True, slots=True)
class ProxyStarted(Message):
    KIND: ClassVar[int] = 67
    key: str
    error: str

    def to_json(self) -> JsonObject:
        return {"key": self.key, "error": self.error}

    @classmethod
    def from_json(cls, obj: JsonObject, fds: Sequence[int]) -> ProxyStarted:
        return cls(_check(obj, "key", str), _check(obj, "error", str))


@dataclass(frozen=True, slots=True)
class ProxyStopped(Message):
    KIND: ClassVar[int] = 68
    key: str

    def to_json(self) -> JsonObject:
        return {"key": self.key}

    @classmethod
    def from_json(cls, obj: JsonObject, fds: Sequence[int]) -> ProxyStopped:
        return cls(_check(obj, "key", str))


@dataclass(frozen=True, slots=True)
class Drained(Message):
    KIND: ClassVar[int] = 69

    def to_json(self) -> JsonObject:
        return {}

    @classmethod
    def from_json(cls, obj: JsonObject, fds: Sequence[int]) -> Drained:
        return cls()


Parser = Callable[[JsonObject, Sequence[int]], Message]
TO_WORKER: dict[int, Parser] = {
    m.KIND: m.from_json
    for m in (Hello, LocalConfig, Synced, ProxyStart, ProxyStop, CertReply, StatsRequest, Drain)
}
TO_OWNER: dict[int, Parser] = {
    m.KIND: m.from_json for m in (Ready, CertRequest, StatsReply, ProxyStarted, ProxyStopped, Drained)
}


# -- encoding -------------------------------------------------------------------------------------


def encode(message: Message) -> tuple[bytes, Sequence[int]]:
    """The frame's bytes and the descriptors to send with its first byte."""
    if isinstance(message, XdsResponse):
        payload = message.data
    else:
        payload = json.dumps(message.to_json(), separators=(",", ":"), default=_no_json).encode()
    fds = message.fd_list()
    if len(fds) > MAX_FDS_PER_FRAME:
        raise WorkerProtocolError(f"{type(message).__name__} carries {len(fds)} descriptors")
    return HEADER.pack(len(payload), message.KIND, len(fds), 0) + payload, fds


def _no_json(value: object) -> object:
    return str(value)


# -- decoding -------------------------------------------------------------------------------------


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of parsed JSON, stopping once past `limit`."""
    stack = [(value, 1)]
    deepest = 0
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return deepest


class Decoder:
    """Bytes and descriptors in, messages out. `parsers` are the kinds this side accepts.

    Descriptors that arrive are owned by the decoder until a frame claims them; `close()`
    closes the unclaimed ones (a claimed descriptor belongs to the message's receiver).
    """

    def __init__(
        self, parsers: Mapping[int, Parser], *, max_frame_bytes: int, binary_kinds: Iterable[int] = ()
    ):
        self._parsers = dict(parsers)
        self._binary = frozenset(binary_kinds)
        self._max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()
        self._fds: deque[int] = deque()
        self.frames = 0

    def __repr__(self) -> str:
        return f"Decoder({self.frames} frames, {len(self._buffer)} bytes and {len(self._fds)} descriptors pending)"

    def feed(self, data: bytes, fds: Sequence[int] = ()) -> list[Message]:
        """Take what one read delivered; return the complete messages, in order."""
        if len(self._fds) + len(fds) > MAX_PENDING_FDS:
            for fd in fds:
                os.close(fd)
            raise WorkerProtocolError(f"more than {MAX_PENDING_FDS} descriptors received and not claimed")
        self._fds.extend(fds)
        self._buffer += data
        out: list[Message] = []
        while len(self._buffer) >= HEADER_BYTES:
            length, kind, fd_count, zero = HEADER.unpack_from(self._buffer)
            if zero != 0:
                raise WorkerProtocolError("frame header's reserved bytes are not zero")
            if kind not in self._parsers and kind not in self._binary:
                raise WorkerProtocolError(f"unexpected frame kind {kind}")
            if length > self._max_frame_bytes:
                raise WorkerProtocolError(
                    f"frame of {length} bytes exceeds the limit of {self._max_frame_bytes}"
                )
            if fd_count > MAX_FDS_PER_FRAME:
                raise WorkerProtocolError(f"frame names {fd_count} descriptors (at most {MAX_FDS_PER_FRAME})")
            if len(self._buffer) < HEADER_BYTES + length:
                break
            payload = bytes(self._buffer[HEADER_BYTES : HEADER_BYTES + length])
            del self._buffer[: HEADER_BYTES + length]
            if fd_count > len(self._fds):
                raise WorkerProtocolError(f"frame names {fd_count} descriptors, {len(self._fds)} arrived")
            claimed = [self._fds.popleft() for _ in range(fd_count)]
            try:
                out.append(self._message(kind, payload, claimed))
            except BaseException:
                for fd in claimed:
                    os.close(fd)
                raise
            self.frames += 1
        return out

    def _message(self, kind: int, payload: bytes, fds: Sequence[int]) -> Message:
        if kind in self._binary:
            if fds:
                raise WorkerProtocolError("an xDS frame carries no descriptors")
            return XdsResponse(payload)
        try:
            obj = json.loads(payload)
        except (ValueError, RecursionError) as e:
            raise WorkerProtocolError(f"frame kind {kind} is not JSON: {e}") from None
        if not isinstance(obj, dict):
            raise WorkerProtocolError(f"frame kind {kind} is not a JSON object")
        if _depth(obj, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
            raise WorkerProtocolError(f"frame kind {kind} nests deeper than {MAX_JSON_DEPTH}")
        return self._parsers[kind](obj, fds)

    @property
    def pending_bytes(self) -> int:
        return len(self._buffer)

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.popleft())


def worker_decoder() -> Decoder:
    """What a worker reads: the owner's messages, xDS frames included."""
    return Decoder(TO_WORKER, max_frame_bytes=MAX_OWNER_FRAME_BYTES, binary_kinds=(XdsResponse.KIND,))


def owner_decoder() -> Decoder:
    """What the owner reads from one worker: small replies only."""
    return Decoder(TO_OWNER, max_frame_bytes=MAX_WORKER_FRAME_BYTES)
