"""ZDS datagrams: typed messages, their encoding, and the rules for what a datagram may carry.

Counterparts: ztunnel src/inpod/protocol.rs (`get_workload_data`, `maybe_get_fd`) and the
`readProto` / `SendMsgAndWaitForAck` halves of istio-cni cni/pkg/nodeagent/ztunnelserver.go.
Facts: docs/istio-behaviour.md, "ZDS".

Sans-IO: bytes, received fd numbers and `recvmsg` flags in; a typed message out, or
`ZdsProtocolError`. Nothing here opens, closes or reads a descriptor. When decoding fails, every
fd that arrived with the datagram is listed on the error (`fds`) and the caller must close them;
when it succeeds, only an `Add` owns an fd (its `netns_fd`), and the caller takes it over.

One protobuf per datagram, no length prefix, no type tag: the direction and the phase say which
message type to expect (`decode_hello` / `decode_request` on the node agent's and node proxy's
side respectively, `decode_response` for acks).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar, cast

from google.protobuf.message import DecodeError
from google.protobuf.message import Message as ProtoMessage

from ..config import ProxyWorkloadInfo
from ..errors import ProtocolError
from ..wire.istio.workload.zds import zds_pb2

_M = TypeVar("_M", bound=ProtoMessage)

# Both sides read into a 1024-byte buffer; a longer datagram arrives truncated (MSG_TRUNC),
# so we refuse to build one.
RECEIVE_BUFFER_BYTES = 1024
# Room for more fds than the protocol allows, so "2 fds" is reported as such (and both closed)
# instead of surfacing as a truncated control message.
MAX_RECEIVED_FDS = 8
FD_BYTES = 4
ANCILLARY_BUFFER_BYTES = socket.CMSG_SPACE(MAX_RECEIVED_FDS * FD_BYTES)

VERSION_V1 = zds_pb2.V1
VERSION_NOT_USED = zds_pb2.NOT_USED

_TRUNCATED_FLAGS = socket.MSG_TRUNC | socket.MSG_CTRUNC
_HINT = "do the node agent (istio-cni) and the node proxy (ztunnel) speak the same ZDS version?"


class ZdsProtocolError(ProtocolError):
    """A datagram that breaks the ZDS rules.

    `fds` are the descriptors that came with it: they belong to nobody else, and the caller
    must close them.
    """

    def __init__(self, message: str, *, fds: Sequence[int] = ()) -> None:
        super().__init__(message, hint=_HINT)
        self.fds = tuple(fds)


# --- messages ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello:
    """`ZdsHello`: the node proxy's first datagram on every connection."""

    version: int = VERSION_V1


@dataclass(frozen=True, slots=True, kw_only=True)
class Add:
    """`AddWorkload`: start proxying a pod; `netns_fd` is an open handle on its network namespace.

    `uid` is the Kubernetes pod UID (metadata.uid), not the xDS workload uid.
    """

    uid: str
    name: str
    namespace: str
    service_account: str
    netns_fd: int

    @property
    def info(self) -> ProxyWorkloadInfo:
        return ProxyWorkloadInfo(
            namespace=self.namespace, name=self.name, service_account=self.service_account
        )

    @classmethod
    def of(cls, uid: str, info: ProxyWorkloadInfo, netns_fd: int) -> Add:
        return cls(
            uid=uid,
            name=info.name,
            namespace=info.namespace,
            service_account=info.service_account,
            netns_fd=netns_fd,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Keep:
    """`KeepWorkload`: a pod the node agent knows but has no netns for (snapshot phase only)."""

    uid: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Del:
    """`DelWorkload`: stop proxying a pod now."""

    uid: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotSent:
    """`SnapshotSent`: the initial full snapshot is complete."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AckMsg:
    """`Ack`: the answer to exactly one request; a non-empty `error` is a NACK."""

    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


Request = Add | Keep | Del | SnapshotSent
Message = Hello | Request | AckMsg


# --- encoding ------------------------------------------------------------------------------------


def _workload_request(msg: Request) -> zds_pb2.WorkloadRequest:
    match msg:
        case Add():
            info = zds_pb2.WorkloadInfo(
                name=msg.name, namespace=msg.namespace, service_account=msg.service_account
            )
            return zds_pb2.WorkloadRequest(add=zds_pb2.AddWorkload(uid=msg.uid, workload_info=info))
        case Keep():
            return zds_pb2.WorkloadRequest(keep=zds_pb2.KeepWorkload(uid=msg.uid))
        case Del():
            # `del` is a Python keyword: the field is reached by name.
            request = zds_pb2.WorkloadRequest()
            getattr(request, "del").CopyFrom(zds_pb2.DelWorkload(uid=msg.uid))
            return request
        case SnapshotSent():
            return zds_pb2.WorkloadRequest(snapshot_sent=zds_pb2.SnapshotSent())
    raise TypeError(f"not a ZDS request: {msg!r}")


def encode(msg: Message) -> bytes:
    """The datagram payload for `msg`; raises ZdsProtocolError if the peer could not read it whole."""
    match msg:
        case Hello():
            # The generated stubs type enum fields by their wrapper; on the wire it is the number.
            data = zds_pb2.ZdsHello(version=cast("zds_pb2.Version", msg.version)).SerializeToString()
        case AckMsg():
            data = zds_pb2.WorkloadResponse(ack=zds_pb2.Ack(error=msg.error)).SerializeToString()
        case Add() | Keep() | Del() | SnapshotSent():
            data = _workload_request(msg).SerializeToString()
        case _:
            raise TypeError(f"not a ZDS message: {msg!r}")
    if len(data) > RECEIVE_BUFFER_BYTES:
        raise ZdsProtocolError(
            f"{type(msg).__name__} encodes to {len(data)} bytes, more than the {RECEIVE_BUFFER_BYTES}-byte "
            "datagram the peer reads"
        )
    return data


def fds_to_send(msg: Message) -> list[int]:
    """The SCM_RIGHTS payload that goes with `msg`: the netns fd for an Add, nothing otherwise."""
    return [msg.netns_fd] if isinstance(msg, Add) else []


def nack_text(error: str) -> str:
    """An ack error shortened so the Ack datagram stays within the peer's buffer."""
    limit = RECEIVE_BUFFER_BYTES - 16  # tags and lengths of WorkloadResponse{ack{error}}
    raw = error.encode()
    if len(raw) <= limit:
        return error
    return raw[: limit - 3].decode(errors="ignore") + "..."


# --- decoding ------------------------------------------------------------------------------------


def _check_datagram(what: str, data: bytes, fds: Sequence[int], flags: int) -> None:
    # Checked before parsing so that every failure path reports the fds for closing.
    if flags & socket.MSG_TRUNC or len(data) > RECEIVE_BUFFER_BYTES:
        raise ZdsProtocolError(
            f"received truncated {what} (longer than {RECEIVE_BUFFER_BYTES} bytes)", fds=fds
        )
    if flags & socket.MSG_CTRUNC:
        raise ZdsProtocolError(f"received {what} with a truncated control message", fds=fds)


def _parse(message_type: type[_M], what: str, data: bytes, fds: Sequence[int]) -> _M:
    try:
        return message_type.FromString(data)
    except (DecodeError, ValueError, RuntimeError) as e:
        raise ZdsProtocolError(f"cannot parse {what}: {e}", fds=fds) from None


def decode_request(data: bytes, fds: Sequence[int], flags: int = 0) -> Request:
    """A `WorkloadRequest` datagram (node agent -> node proxy) with the fds that came with it.

    An Add needs exactly one fd and its workload_info; every other request carries no fd.
    """
    _check_datagram("request", data, fds, flags)
    if len(fds) > 1:
        raise ZdsProtocolError(f"expected at most 1 fd with a request, got {len(fds)}", fds=fds)
    req = _parse(zds_pb2.WorkloadRequest, "WorkloadRequest", data, fds)
    kind = req.WhichOneof("payload")
    if kind is None:
        raise ZdsProtocolError(
            "WorkloadRequest without a payload (or with one this version does not know)", fds=fds
        )
    if kind == "add":
        if not fds:
            raise ZdsProtocolError("AddWorkload without a netns fd (no SCM_RIGHTS control message)")
        if not req.add.HasField("workload_info"):
            raise ZdsProtocolError(f"AddWorkload for {req.add.uid!r} without workload_info", fds=fds)
        info = req.add.workload_info
        return Add(
            uid=req.add.uid,
            name=info.name,
            namespace=info.namespace,
            service_account=info.service_account,
            netns_fd=fds[0],
        )
    if fds:
        raise ZdsProtocolError(f"unexpected fd with a {kind} request (only AddWorkload carries one)", fds=fds)
    match kind:
        case "keep":
            return Keep(uid=req.keep.uid)
        case "del":
            return Del(uid=getattr(req, "del").uid)
        case "snapshot_sent":
            return SnapshotSent()
    raise ZdsProtocolError(f"WorkloadRequest with unknown payload {kind!r}")  # pragma: no cover - proto has 4


def decode_response(data: bytes, fds: Sequence[int], flags: int = 0) -> AckMsg:
    """A `WorkloadResponse` datagram (node proxy -> node agent): the ack of one request."""
    _check_datagram("response", data, fds, flags)
    if fds:
        raise ZdsProtocolError(f"unexpected fd with a response ({len(fds)} received)", fds=fds)
    resp = _parse(zds_pb2.WorkloadResponse, "WorkloadResponse", data, fds)
    if resp.WhichOneof("payload") != "ack":
        raise ZdsProtocolError("WorkloadResponse without an ack")
    return AckMsg(error=resp.ack.error)


def decode_hello(data: bytes, fds: Sequence[int], flags: int = 0) -> Hello:
    """The node proxy's `ZdsHello`. A hello without a version (NOT_USED) is refused; a newer
    version is returned as is and the node agent decides what to do with it."""
    _check_datagram("hello", data, fds, flags)
    if fds:
        raise ZdsProtocolError(f"unexpected fd with the hello ({len(fds)} received)", fds=fds)
    hello = _parse(zds_pb2.ZdsHello, "ZdsHello", data, fds)
    if hello.version == VERSION_NOT_USED:
        raise ZdsProtocolError("ZdsHello without a protocol version")
    return Hello(version=hello.version)


__all__ = [
    "ANCILLARY_BUFFER_BYTES",
    "MAX_RECEIVED_FDS",
    "RECEIVE_BUFFER_BYTES",
    "VERSION_V1",
    "Add",
    "AckMsg",
    "Del",
    "Hello",
    "Keep",
    "Message",
    "Request",
    "SnapshotSent",
    "ZdsProtocolError",
    "decode_hello",
    "decode_request",
    "decode_response",
    "encode",
    "fds_to_send",
    "nack_text",
]
