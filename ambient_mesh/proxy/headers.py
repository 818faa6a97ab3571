"""Headers on HBONE CONNECT requests and responses: baggage, traceparent, forwarded.

Counterparts: ztunnel src/baggage.rs (baggage), src/proxy/outbound.rs (request headers),
src/proxy/inbound.rs (response baggage, reading forwarded). Formats: docs/istio-behaviour.md,
"HBONE" and "Headers"; W3C Trace Context for `traceparent`; RFC 7239 for `forwarded`.
The parsers read what a peer sent, so they never raise: bad input gives empty values or None.
"""

from __future__ import annotations

import functools
import os
import random
import re
import string
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..net import SocketAddr
from ..state.memo import StateMemo
from ..state.model import Workload, WorkloadType

BAGGAGE = "baggage"
TRACEPARENT = "traceparent"
FORWARDED = "forwarded"

_CLUSTER = "k8s.cluster.name"
_NAMESPACE = "k8s.namespace.name"
_SERVICE_NAME = "service.name"
_SERVICE_VERSION = "service.version"
_REGION = "cloud.region"
_ZONE = "cloud.availability_zone"
_WORKLOAD_KEYS = {f"k8s.{t.name.lower()}.name": t for t in WorkloadType}

_TRACE_ID_HEX = 32
_PARENT_ID_HEX = 16
TRACEPARENT_LENGTH = 2 + 1 + _TRACE_ID_HEX + 1 + _PARENT_ID_HEX + 1 + 2
_LOWER_HEX = frozenset(string.hexdigits.lower())


@dataclass(frozen=True, slots=True, kw_only=True)
class Baggage:
    """What a peer says about itself in `baggage`; empty strings for what it left out."""

    cluster_id: str = ""
    namespace: str = ""
    workload_name: str = ""
    workload_type: WorkloadType | None = None
    service_name: str = ""
    service_version: str = ""
    region: str = ""
    zone: str = ""


# `baggage` values built (the text is the same for every CONNECT of one workload object): a
# StateMemo by state version and workload uid, bounded; an entry answers only for the very object
# it was built from, so a caller holding an older copy of a workload gets that copy's value.
BAGGAGE_MAX_ENTRIES = 4096
_baggage_values: StateMemo[str, tuple[Workload, str]] = StateMemo("baggage values", BAGGAGE_MAX_ENTRIES)


def baggage_at(version: int, workload: Workload) -> str:
    """`baggage_for(workload)`, kept while the state is at `version` (docs/architecture.md,
    "Decisions and caches")."""
    kept = _baggage_values.get(version, workload.uid)
    if kept is not None and kept[0] is workload:
        return kept[1]
    return _baggage_values.put(version, workload.uid, (workload, baggage_for(workload)))[1]


def baggage_for(workload: Workload) -> str:
    """The `baggage` value describing `workload`, keys in ztunnel's order, empty values left out.

    Values are not percent-encoded: they are Kubernetes names, which cannot hold `,` or `=`.
    """
    pairs = [
        (_CLUSTER, workload.cluster_id),
        (_NAMESPACE, workload.namespace),
        (f"k8s.{workload.workload_type.name.lower()}.name", workload.workload_name),
        (_SERVICE_NAME, workload.canonical_name),
        (_SERVICE_VERSION, workload.canonical_revision),
        (_REGION, workload.locality.region),
        (_ZONE, workload.locality.zone),
    ]
    return ",".join(f"{key}={value}" for key, value in pairs if value)


def parse_baggage(values: Iterable[str]) -> Baggage:
    """Merge every `baggage` header value; unknown keys and empty values are skipped.

    When a key repeats (within one header or across several) the last value wins.
    """
    fields: dict[str, object] = {}
    for value in values:
        for member in value.split(","):
            key, sep, val = member.partition("=")
            key, val = key.strip(), val.strip()
            if not sep or not val:
                continue
            if key == _CLUSTER:
                fields["cluster_id"] = val
            elif key == _NAMESPACE:
                fields["namespace"] = val
            elif key in _WORKLOAD_KEYS:
                fields["workload_name"] = val
                fields["workload_type"] = _WORKLOAD_KEYS[key]
            elif key == _SERVICE_NAME:
                fields["service_name"] = val
            elif key == _SERVICE_VERSION:
                fields["service_version"] = val
            elif key == _REGION:
                fields["region"] = val
            elif key == _ZONE:
                fields["zone"] = val
    return Baggage(**fields)  # type: ignore[arg-type]


# Trace ids need to be unlikely to collide, not to be unguessable: a generator seeded once per
# process from the OS (as ztunnel's rand::thread_rng is), not two getrandom calls per CONNECT
# (docs/performance.md, "The per-connection path"). A forked child reseeds, so it draws ids of its own.
_TRACE_ID_RNG = random.Random()
os.register_at_fork(after_in_child=_TRACE_ID_RNG.seed)
_IDS_BYTES = (_TRACE_ID_HEX + _PARENT_ID_HEX) // 2
_ZERO_TRACE_ID = "0" * _TRACE_ID_HEX
_ZERO_PARENT_ID = "0" * _PARENT_ID_HEX


def new_traceparent(random_bytes: Callable[[int], bytes] = _TRACE_ID_RNG.randbytes) -> str:
    """A fresh W3C `traceparent` (version 00, flags 00), as ztunnel sends per CONNECT.

    Both ids from one `random_bytes(24)`; an all-zero id, which W3C Trace Context 3.2.2 makes
    invalid, ends in 1 instead, so every value sent parses."""
    ids = random_bytes(_IDS_BYTES).hex()
    trace_id, parent_id = ids[:_TRACE_ID_HEX], ids[_TRACE_ID_HEX:]
    if trace_id == _ZERO_TRACE_ID:
        trace_id = _ZERO_TRACE_ID[:-1] + "1"
    if parent_id == _ZERO_PARENT_ID:
        parent_id = _ZERO_PARENT_ID[:-1] + "1"
    return f"00-{trace_id}-{parent_id}-00"


def parse_traceparent(value: str) -> str | None:
    """`value` if it is a valid 55-character W3C `traceparent`, else None."""
    if len(value) != TRACEPARENT_LENGTH:
        return None
    parts = value.split("-")
    if [len(p) for p in parts] != [2, _TRACE_ID_HEX, _PARENT_ID_HEX, 2]:
        return None
    version, trace_id, parent_id, _flags = parts
    if not all(c in _LOWER_HEX for p in parts for c in p):
        return None
    # W3C Trace Context 3.2.2: version ff and all-zero ids are invalid.
    if version == "ff" or trace_id == "0" * _TRACE_ID_HEX or parent_id == "0" * _PARENT_ID_HEX:
        return None
    return value


def forwarded_for(client: SocketAddr, service_hostname: str | None) -> str:
    """The `forwarded` value ztunnel sends: the client's socket, and the service when known.

    RFC 7239 section 6 requires the quotes around a node with a port (and IPv6 brackets).
    """
    value = f'for="{client}"'
    if service_hostname:
        value += f";host={service_hostname}"
    return value


def parse_forwarded_host(value: str) -> str | None:
    """The first `host=` parameter in a `forwarded` value (RFC 7239), or None."""
    if "host" not in value.lower():
        # No parameter can be named host (the name is matched lowercased): nothing to split.
        # The usual case, every inbound CONNECT to a workload address (ztunnel sends only `for`).
        return None
    return _first_host(value)


def _first_host(value: str) -> str | None:
    for pair in _split_unquoted(value, ",;"):
        name, sep, raw = pair.partition("=")
        if not sep or name.strip().lower() != "host":
            continue
        host = _unquote(raw.strip())
        if host:
            return host
    return None


def _split_unquoted(value: str, separators: str) -> list[str]:
    """Split at separators outside quoted-strings (RFC 7230 3.2.6); quotes are kept."""
    if "\\" not in value:
        # Without escapes the quotes simply alternate: split the text between them, not each
        # character (every inbound CONNECT's `forwarded` header comes through here).
        parts = [""]
        for i, segment in enumerate(value.split('"')):
            if i % 2:  # inside a quoted-string: kept whole, with its quotes
                parts[-1] += f'"{segment}'
                continue
            if i:
                parts[-1] += '"'
            pieces = _separators_pattern(separators).split(segment)
            parts[-1] += pieces[0]
            parts += pieces[1:]
        return parts
    return _split_unquoted_by_character(value, separators)


def _split_unquoted_by_character(value: str, separators: str) -> list[str]:
    """`_split_unquoted` one character at a time: what a backslash escape needs."""
    parts: list[str] = []
    current: list[str] = []
    quoted = escaped = False
    for ch in value:
        if escaped:
            escaped = False
        elif quoted and ch == "\\":
            escaped = True
        elif ch == '"':
            quoted = not quoted
        elif not quoted and ch in separators:
            parts.append("".join(current))
            current = []
            continue
        current.append(ch)
    parts.append("".join(current))
    return parts


@functools.lru_cache(maxsize=8)
def _separators_pattern(separators: str) -> re.Pattern[str]:
    return re.compile(f"[{re.escape(separators)}]")


def _unquote(raw: str) -> str | None:
    """A token as is, a quoted-string without quotes and escapes; None if malformed."""
    if not raw.startswith('"'):
        return None if '"' in raw or "\\" in raw else raw
    if len(raw) < 2 or not raw.endswith('"'):
        return None
    out, escaped = [], False
    for ch in raw[1:-1]:
        if escaped:
            out.append(ch)
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            return None
        else:
            out.append(ch)
    return None if escaped else "".join(out)
