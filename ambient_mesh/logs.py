"""Istio-style log lines and the node proxy's access log.

Counterparts: ztunnel src/telemetry.rs (line formats, the runtime log filter behind the admin
`/logging` endpoint) and src/proxy/metrics.rs (access-log fields). Built on the stdlib `logging`
module: each module logs to `logging.getLogger(__name__)`; the scope printed in a line is that
logger's name without the `ambient_mesh.` prefix (`ambient_mesh.proxy.outbound` -> `proxy.outbound`).

Plain lines are tab-separated, `<time>\\t<level>\\t<scope>\\t<message>\\t<k=v k=v>`; JSON lines are
one object per line, `{"level", "time", "scope", "message", <fields>}`. Structured fields travel as
`extra={"fields": {...}}`. `parse_plain_fields` and `access_events` read plain lines back (the
lab, the demo and the netns tests read the access log with them).

Level specs use the RUST_LOG shape ztunnel reads: comma-separated directives, each a level
(`info`) or `target=level` (`access=debug`). Rust-style targets (`ztunnel::proxy`) are accepted
and mapped onto our scopes (`proxy`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TextIO

from .errors import ConfigError

PACKAGE = "ambient_mesh"
ACCESS_SCOPE = "access"

# Rust's `tracing` has one level below DEBUG; stdlib logging does not, so we add it.
TRACE = 5
# Above CRITICAL, so nothing passes: RUST_LOG's `off`.
OFF = logging.CRITICAL + 10

logging.addLevelName(TRACE, "TRACE")

LEVELS: dict[str, int] = {
    "off": OFF,
    "error": logging.ERROR,
    "warn": logging.WARNING,
    "info": logging.INFO,
    "debug": logging.DEBUG,
    "trace": TRACE,
}
# Spellings people type out of habit; they map onto the six levels above.
_LEVEL_ALIASES = {"warning": "warn", "critical": "error", "fatal": "error"}

DEFAULT_LEVEL_SPEC = "info"


def _level_name(levelno: int) -> str:
    """ztunnel's name for a level number (any number: a level between two is the lower's)."""
    if levelno >= OFF:
        return "off"
    if levelno >= logging.ERROR:
        return "error"
    if levelno >= logging.WARNING:
        return "warn"
    if levelno >= logging.INFO:
        return "info"
    if levelno >= logging.DEBUG:
        return "debug"
    return "trace"


_LEVEL_NAMES: dict[int, str] = {
    n: _level_name(n) for n in (OFF, logging.ERROR, logging.WARNING, logging.INFO, logging.DEBUG, TRACE)
}


@dataclass(frozen=True, slots=True, kw_only=True)
class LevelSpec:
    """A parsed level filter: a default level and per-scope overrides, in the order given."""

    default: str | None = None
    targets: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        parts = [self.default] if self.default else []
        parts.extend(f"{target}={level}" for target, level in self.targets)
        return ",".join(parts)

    def merged(self, other: LevelSpec) -> LevelSpec:
        """This spec with `other`'s directives added on top (later ones win per target)."""
        targets = dict(self.targets)
        targets.update(other.targets)
        return LevelSpec(default=other.default or self.default, targets=tuple(targets.items()))


def _normalize_target(target: str) -> str:
    scope = target.replace("::", ".")
    for prefix in (f"{PACKAGE}.", "ztunnel."):
        if scope.startswith(prefix):
            scope = scope[len(prefix) :]
    return scope


def _parse_level(text: str, spec: str) -> str:
    name = text.strip().lower()
    name = _LEVEL_ALIASES.get(name, name)
    if name not in LEVELS:
        raise ConfigError(
            "log level",
            f"{text!r} in {spec!r} is not a level; use one of {', '.join(LEVELS)}, "
            "or target=level directives separated by commas",
        )
    return name


def parse_level_spec(spec: str) -> LevelSpec:
    """Parse `info`, `access=debug` or `warn,proxy=debug,xds=trace`; raise ConfigError otherwise."""
    default: str | None = None
    targets: dict[str, str] = {}
    for raw in spec.split(","):
        directive = raw.strip()
        if not directive:
            continue
        target, sep, level = directive.partition("=")
        if not sep:
            default = _parse_level(directive, spec)
            continue
        scope = _normalize_target(target.strip())
        if not scope or not all(c.isalnum() or c in "._-" for c in scope):
            raise ConfigError("log level", f"{target!r} in {spec!r} is not a log target name")
        targets[scope] = _parse_level(level, spec)
    if default is None and not targets:
        raise ConfigError("log level", f"{spec!r} has no directives; use a level such as info")
    return LevelSpec(default=default, targets=tuple(targets.items()))


# --- formatting -----------------------------------------------------------------------------


_last_second: list[Any] = [None, ""]  # the last whole second formatted, and its text


def format_time(created: float) -> str:
    """RFC 3339 UTC with microseconds, as ztunnel prints it: 2024-05-01T12:00:00.123456Z."""
    seconds = int(created)
    micros = int(round((created - seconds) * 1_000_000))
    if micros == 1_000_000:
        seconds, micros = seconds + 1, 0
    if _last_second[0] != seconds:  # strftime once per second, not once per line
        _last_second[1] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
        _last_second[0] = seconds
    return f"{_last_second[1]}.{micros:06d}Z"


def scope_of(logger_name: str) -> str:
    if logger_name == PACKAGE:
        return PACKAGE
    if logger_name.startswith(PACKAGE + "."):
        return logger_name[len(PACKAGE) + 1 :]
    return logger_name


# Each logger's scope, worked out once per name (IstioFormatter.line); bounded: names are the
# modules' loggers plus whatever a library logs under.
MAX_SCOPES_KEPT = 1024
_SCOPES: dict[str, str] = {}


def _scope_kept(logger_name: str) -> str:
    scope = scope_of(logger_name)
    if len(_SCOPES) >= MAX_SCOPES_KEPT:
        _SCOPES.clear()
    _SCOPES[logger_name] = scope
    return scope


# What makes a plain value need quotes: whitespace (as str.isspace), a quote, a backslash, `=`.
_NEEDS_QUOTES = re.compile(r'[\s"\\=]')


def _plain_value(value: Any) -> str:
    text = value if isinstance(value, str) else str(value)
    # Quoting keeps each line splittable on spaces into k=v pairs.
    if not text or _NEEDS_QUOTES.search(text):
        return json.dumps(text, ensure_ascii=False)
    return text


def _plain_fields(fields: Mapping[str, Any]) -> str:
    """`k=v k=v`, each value quoted as `_plain_value` would.

    One regex search over all the values, joined by NUL (which needs no quotes, so the join adds
    no match), instead of one call and search per value: the access line has 14 values
    (docs/performance.md, "The per-connection path").
    """
    texts = [v if isinstance(v, str) else str(v) for v in fields.values()]
    if "" in texts or _NEEDS_QUOTES.search("\x00".join(texts)):
        texts = [_plain_value(text) for text in texts]
    return " ".join([f"{key}={text}" for key, text in zip(fields, texts, strict=True)])


# A plain line's `key=value` fields: a value is bare, or a JSON string when _plain_value quoted it.
_PLAIN_FIELD = re.compile(r'([\w.]+)=("(?:[^"\\]|\\.)*"|\S+)')


def parse_plain_fields(line: str) -> dict[str, str]:
    """The `key=value` fields of one plain-text line, as IstioFormatter wrote them. Never raises:
    a quoted value that is not a JSON string is kept as written."""
    fields = {}
    for key, value in _PLAIN_FIELD.findall(line):
        if value.startswith('"'):
            try:
                value = json.loads(value)
            except ValueError:
                pass
        fields[key] = value
    return fields


def access_events(text: str) -> list[dict[str, str]]:
    """The fields of every `connection complete` line (the access log) in plain-format output.
    Lines end at "\n" only: a quoted value may hold U+0085 or U+2028, which splitlines() would cut."""
    return [parse_plain_fields(line) for line in text.split("\n") if ACCESS_COMPLETE_MESSAGE in line]


def _json_value(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


class IstioFormatter(logging.Formatter):
    """One line per record, plain (tab-separated) or JSON."""

    def __init__(self, *, json_lines: bool = False) -> None:
        super().__init__()
        self.json_lines = json_lines

    def _fields(self, record: logging.LogRecord) -> dict[str, Any]:
        fields = getattr(record, "fields", None) or {}
        if record.exc_info:
            fields = {**fields, "exception": self.formatException(record.exc_info)}
        return {k: v for k, v in fields.items() if v is not None}

    def format(self, record: logging.LogRecord) -> str:
        return self.line(
            record.levelno, record.created, record.name, record.getMessage(), self._fields(record)
        )

    def line(self, levelno: int, created: float, name: str, message: str, fields: dict[str, Any]) -> str:
        """The line of a record with these attributes; `fields` without None values."""
        # The usual levels and logger names from a dict (a C lookup), not a Python call per line.
        level = _LEVEL_NAMES.get(levelno) or _level_name(levelno)
        when = format_time(created)
        scope = _SCOPES.get(name) or _scope_kept(name)
        if self.json_lines:
            line: dict[str, Any] = {"level": level, "time": when, "scope": scope, "message": message}
            for key, value in fields.items():
                line.setdefault(key, _json_value(value))
            return json.dumps(line, ensure_ascii=False, separators=(",", ":"))
        head = f"{when}\t{level}\t{scope}\t{message}"
        if not fields:
            return head
        return f"{head}\t{_plain_fields(fields)}"


# --- runtime control ------------------------------------------------------------------------


class _Filter:
    """What configure_logging installed, kept so /logging can change and reset it."""

    startup = LevelSpec(default=DEFAULT_LEVEL_SPEC)
    current = LevelSpec(default=DEFAULT_LEVEL_SPEC)
    handler: logging.Handler | None = None
    saved_root_level: int | None = None


def _logger_for(scope: str) -> logging.Logger:
    return logging.getLogger(f"{PACKAGE}.{scope}")


def _apply(spec: LevelSpec) -> None:
    for target, _ in _Filter.current.targets:
        _logger_for(target).setLevel(logging.NOTSET)
    default = LEVELS[spec.default or DEFAULT_LEVEL_SPEC]
    logging.getLogger().setLevel(default)
    logging.getLogger(PACKAGE).setLevel(default)
    for target, level in spec.targets:
        _logger_for(target).setLevel(LEVELS[level])
    _Filter.current = spec


def configure_logging(log_format: str, level_spec: str, stream: TextIO | None = None) -> logging.Handler:
    """Send every log record to `stream` (stderr by default) in the Istio format.

    Replaces the handler an earlier call installed; returns the new handler so a test can
    remove it again with `unconfigure_logging()`.
    """
    if log_format not in ("plain", "json"):
        raise ConfigError("LOG_FORMAT", f"{log_format!r} is not a log format; use plain or json")
    spec = parse_level_spec(level_spec)
    unconfigure_logging()
    handler = IstioStreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(IstioFormatter(json_lines=log_format == "json"))
    root = logging.getLogger()
    _Filter.saved_root_level = root.level
    root.addHandler(handler)
    _Filter.handler = handler
    _Filter.startup = spec
    _apply(spec)
    return handler


def unconfigure_logging() -> None:
    """Remove the handler configure_logging installed and clear the levels it set."""
    if _Filter.handler is not None:
        logging.getLogger().removeHandler(_Filter.handler)
        _Filter.handler = None
    if _Filter.saved_root_level is not None:
        logging.getLogger().setLevel(_Filter.saved_root_level)
        _Filter.saved_root_level = None
    for target, _ in _Filter.current.targets:
        _logger_for(target).setLevel(logging.NOTSET)
    logging.getLogger(PACKAGE).setLevel(logging.NOTSET)
    _Filter.current = _Filter.startup = LevelSpec(default=DEFAULT_LEVEL_SPEC)


def set_levels(spec: str) -> str:
    """Add the directives in `spec` to the running filter (admin `/logging?level=`); return it."""
    _apply(_Filter.current.merged(parse_level_spec(spec)))
    return current_levels()


def reset_levels() -> str:
    """Go back to the filter given at start-up (admin `/logging?reset`)."""
    _apply(_Filter.startup)
    return current_levels()


def current_levels() -> str:
    return str(_Filter.current)


# --- access log -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class AccessLogFields:
    """What ztunnel prints when a connection ends. `None` values are left out of the line.

    Byte counts are from the downstream peer's point of view (ztunnel's orientation, which is
    the opposite of the metrics' received/sent). Identities are printed only when `mtls` is true,
    since a plaintext peer has no proven identity.
    """

    src_addr: object | None = None
    src_workload: str | None = None
    src_namespace: str | None = None
    src_identity: object | None = None
    src_cluster: str | None = None
    dst_addr: object | None = None
    dst_hbone_addr: object | None = None
    dst_service: str | None = None
    dst_workload: str | None = None
    dst_namespace: str | None = None
    dst_identity: object | None = None
    dst_cluster: str | None = None
    direction: str = "outbound"
    bytes_sent: int | None = None
    bytes_recv: int | None = None
    duration_ms: int | None = None
    error: str | None = None
    mtls: bool = False

    def __post_init__(self) -> None:
        if self.direction not in ("outbound", "inbound"):
            raise ValueError(f"direction must be outbound or inbound, not {self.direction!r}")

    def as_fields(self) -> dict[str, Any]:
        """The fields in ztunnel's order with ztunnel's names."""
        ordered: list[tuple[str, Any]] = [
            ("src.addr", self.src_addr),
            ("src.workload", self.src_workload),
            ("src.namespace", self.src_namespace),
            ("src.identity", self.src_identity if self.mtls else None),
            ("src.cluster", self.src_cluster),
            ("dst.addr", self.dst_addr),
            ("dst.hbone_addr", self.dst_hbone_addr),
            ("dst.service", self.dst_service),
            ("dst.workload", self.dst_workload),
            ("dst.namespace", self.dst_namespace),
            ("dst.identity", self.dst_identity if self.mtls else None),
            ("dst.cluster", self.dst_cluster),
            ("direction", self.direction),
            ("bytes_sent", self.bytes_sent),
            ("bytes_recv", self.bytes_recv),
            ("duration", None if self.duration_ms is None else f"{self.duration_ms}ms"),
            ("error", self.error),
        ]
        out: dict[str, Any] = {}
        for key, value in ordered:
            if value is None:
                continue
            if isinstance(value, str):
                if value:  # empty values are left out
                    out[key] = value
            elif isinstance(value, int):
                out[key] = value
            else:  # addresses, identities: an `== ""` on them was a dataclass __eq__ call each
                out[key] = str(value)
        return out


# logging.getLogger takes the logging module's lock on every call; the logger object is the same
# for the life of the process (levels are set on it in place), so it is looked up once.
_ACCESS_LOGGER = _logger_for(ACCESS_SCOPE)


def access_logger() -> logging.Logger:
    return _ACCESS_LOGGER


def _only_our_handler(log: logging.Logger, level: int) -> logging.StreamHandler[TextIO] | None:
    """The handler configure_logging installed, when it is the only place a record of `log` at
    `level` would go: no filter and no other handler on the way up, nothing stops propagation."""
    handler = _Filter.handler
    if handler is None or handler.filters or level < handler.level or log.disabled:
        return None
    logger: logging.Logger | None = log
    while logger is not None:
        if logger.filters:
            return None
        if logger.handlers:
            if logger.parent is not None or logger.handlers != [handler]:
                return None
            break
        if not logger.propagate:
            return None
        logger = logger.parent
    return handler if logger is not None and isinstance(handler, logging.StreamHandler) else None


def _emit(
    log: logging.Logger, level: int, message: str, fields: dict[str, Any], created: float | None = None
) -> None:
    """`log.log(level, message, extra={"fields": fields})` for a caller that checked the level.

    When the only handler it would reach is the one configure_logging installed (a proxy's
    normal state), the line is formatted and written as that handler would write it, without a
    LogRecord: logging's record, handler and filter calls were about two thirds of an access
    line's cost in the running proxy (docs/performance.md, "The per-connection path"). Otherwise (a test's
    capture handler, a filter) the record is made and handled as Logger.log does, naming the
    caller's frame as Logger.findCaller would, without its walk up the stack. `created`: the
    line's time, when it is not now.
    """
    handler = _only_our_handler(log, level)
    formatter = handler.formatter if handler is not None else None
    when = time.time() if created is None else created
    if handler is not None and isinstance(formatter, IstioFormatter):
        kept = {k: v for k, v in fields.items() if v is not None}
        _write_line(
            handler, formatter.line(level, when, log.name, message, kept), log, level, message, fields
        )
        return
    record = _record(log, level, message, fields)
    if created is not None:
        record.created, record.msecs = created, (created - int(created)) * 1000
    log.handle(record)


def _write_line(
    handler: logging.StreamHandler[TextIO],
    line: str,
    log: logging.Logger,
    level: int,
    message: str,
    fields: dict[str, Any],
) -> None:
    """Write one formatted line as StreamHandler.emit would (lock, write, flush). The handler's
    lock taken directly: Handler.acquire and release are two Python calls around it."""
    with handler.lock:  # type: ignore[union-attr]  # Handler.__init__ always makes it
        try:
            stream = handler.stream
            stream.write(line + handler.terminator)
            stream.flush()
        except Exception:  # as StreamHandler.emit does: handleError reports it
            handler.handleError(_record(log, level, message, fields))


def _record(log: logging.Logger, level: int, message: str, fields: dict[str, Any]) -> logging.LogRecord:
    """The record Logger.log would make, naming the frame that called `_emit`'s caller."""
    frame = sys._getframe(2)
    code = frame.f_code
    return log.makeRecord(
        log.name, level, code.co_filename, frame.f_lineno, message, (), None, code.co_name, {"fields": fields}
    )


def log_connection_opened(fields: AccessLogFields, logger: logging.Logger | None = None) -> None:
    """DEBUG `connection opened` with the same fields as the completion line."""
    log = logger or access_logger()
    if log.isEnabledFor(logging.DEBUG):
        _emit(log, logging.DEBUG, "connection opened", fields.as_fields())


ACCESS_COMPLETE_MESSAGE = "connection complete"  # ztunnel's access-log message


def log_connection_complete(fields: AccessLogFields, logger: logging.Logger | None = None) -> None:
    """INFO `connection complete`, or ERROR when the connection ended with an error.

    The reference form of the line, every field from one AccessLogFields. The proxies log through
    `log_access_complete` (the peers' part worked out once); property tests in test_logs.py hold
    the two to the same line and the same record fields."""
    log = logger or access_logger()
    level = logging.ERROR if fields.error else logging.INFO
    if log.isEnabledFor(level):
        _emit(log, level, ACCESS_COMPLETE_MESSAGE, fields.as_fields())


# The access-line fields that one pair of peers always gives, in ztunnel's order: the ones
# after src.addr, and the ones after dst.hbone_addr (see AccessLogFields.as_fields).
_SOURCE_KEYS = ("src.workload", "src.namespace", "src.identity", "src.cluster")
_DESTINATION_KEYS = (
    "dst.service",
    "dst.workload",
    "dst.namespace",
    "dst.identity",
    "dst.cluster",
    "direction",
)


@dataclass(frozen=True, slots=True)
class AccessPeers:
    """The part of a `connection complete` line that is the same for every connection between
    the same peers (workloads, identities, service, direction), with its plain text, worked out
    once: building, filtering and quoting all 17 fields was about 40 µs per line, twice per
    proxied connection (docs/performance.md, "The per-connection path"). proxy/telemetry.py keeps one per set
    of peers; `log_access_complete` adds the per-connection fields.
    """

    source: tuple[tuple[str, Any], ...]  # the src.* fields present, after src.addr
    destination: tuple[tuple[str, Any], ...]  # the dst.* fields present and direction
    source_text: str  # `k=v k=v` of `source`, quoted as _plain_fields quotes
    destination_text: str

    @classmethod
    def of(cls, fields: AccessLogFields) -> AccessPeers:
        """The peer fields of `fields` (its addresses, counts, duration and error are ignored)."""
        present = fields.as_fields()
        source = tuple((k, present[k]) for k in _SOURCE_KEYS if k in present)
        destination = tuple((k, present[k]) for k in _DESTINATION_KEYS if k in present)
        return cls(
            source,
            destination,
            _plain_fields(dict(source)) if source else "",
            _plain_fields(dict(destination)) if destination else "",
        )


# Access lines written together: inside `access_lines_together()` (telemetry's batch of ended
# connections, proxy/telemetry.py, the one timer of this), the clean ends' lines bound for
# configure_logging's handler in plain text are kept and, at the end of the batch, formatted and
# written in one write, at most MAX_DEFERRED_ACCESS_LINES at a time. One connection's line made
# and written on its own took 45-50 µs of CPU in the running proxy, where the same code run line
# after line costs a fraction of that: on a busy core the proxies, the apps and the kernel take
# turns, and a line's code and data are out of the CPU's caches by the next connection's end
# (docs/performance.md, "The per-connection path"). Envoy buffers its file access logs likewise (flushed every
# second by default); ztunnel hands its lines to a writer thread. Any other line through the
# handler and its flush (logging.shutdown flushes every handler at exit) write the kept lines
# first, so lines stay in order; outside a batch, an error line, another handler or the JSON
# format, each line is written at once.
MAX_DEFERRED_ACCESS_LINES = 512


class _Deferred:
    """The access lines kept to be written, and whether a batch keeps them (`access_lines_together`)."""

    lines: list[tuple[Any, ...]] = []
    batching = False


@contextlib.contextmanager
def access_lines_together() -> Iterator[None]:
    """Clean ends' access lines logged inside are written together, in one write, at the end."""
    outer = _Deferred.batching
    _Deferred.batching = True
    try:
        yield
    finally:
        _Deferred.batching = outer
        if not outer:
            write_deferred_access_lines()


def write_deferred_access_lines() -> None:
    """Write the access lines kept so far (`access_lines_together`), in order, one write per handler."""
    lines = _Deferred.lines
    if not lines:
        return
    _Deferred.lines = []
    handler: IstioStreamHandler = lines[0][0]
    texts: list[str] = []
    for entry in lines:
        if entry[0] is not handler:  # reconfigured meanwhile: each handler its own lines
            _write_lines(handler, texts)
            handler, texts = entry[0], []
        texts.append(_plain_access_line(*entry[1:]))
    _write_lines(handler, texts)


def _write_lines(handler: IstioStreamHandler, texts: list[str]) -> None:
    terminator = handler.terminator
    with handler.lock:  # type: ignore[union-attr]  # Handler.__init__ always makes it
        try:
            stream = handler.stream
            stream.write(terminator.join(texts) + terminator)
            stream.flush()
        except Exception:  # as StreamHandler.emit does: handleError reports it
            handler.handleError(_record(_ACCESS_LOGGER, logging.INFO, ACCESS_COMPLETE_MESSAGE, {}))


class IstioStreamHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """configure_logging's handler: it writes the kept access lines (`access_lines_together`)
    before any other line and when it is flushed."""

    def emit(self, record: logging.LogRecord) -> None:
        if _Deferred.lines:
            write_deferred_access_lines()
        super().emit(record)

    def flush(self) -> None:
        if _Deferred.lines:
            write_deferred_access_lines()
        super().flush()


def _plain_access_line(
    formatter: IstioFormatter,
    name: str,
    level: int,
    created: float,
    peers: AccessPeers,
    src: str | None,
    dst: str | None,
    hbone: str | None,
    failure: str | None,
    counts: str,
) -> str:
    """The plain `connection complete` line of these values (`_field_text` of each address)."""
    varying = [t for t in (src, dst, hbone, failure) if t is not None]
    if "" in varying or _NEEDS_QUOTES.search("\x00".join(varying)):
        src, dst, hbone, failure = (
            None if t is None else _plain_value(t) for t in (src, dst, hbone, failure)
        )
    parts = [f"src.addr={src}"] if src is not None else []
    if peers.source_text:
        parts.append(peers.source_text)
    if dst is not None:
        parts.append(f"dst.addr={dst}")
    if hbone is not None:
        parts.append(f"dst.hbone_addr={hbone}")
    if peers.destination_text:
        parts.append(peers.destination_text)
    parts.append(counts)
    if failure is not None:
        parts.append(f"error={failure}")
    head = formatter.line(level, created, name, ACCESS_COMPLETE_MESSAGE, {})
    return f"{head}\t{' '.join(parts)}"


def log_access_complete(
    peers: AccessPeers,
    *,
    src_addr: object,
    dst_addr: object,
    hbone_addr: object,
    bytes_sent: int,
    bytes_recv: int,
    duration_ms: int,
    error: str | None,
    logger: logging.Logger | None = None,
    created: float | None = None,
) -> None:
    """`log_connection_complete` of the AccessLogFields that `peers` and these values make: the
    same line, or for any other handler the same record fields. `created`: the line's time
    (time.time() of the connection's end, when it is recorded later; now by default)."""
    log = logger or _ACCESS_LOGGER
    level = logging.ERROR if error else logging.INFO
    if not log.isEnabledFor(level):
        return
    handler = _only_our_handler(log, level)
    formatter = handler.formatter if handler is not None else None
    # _field_text of each, inline (four Python calls per line otherwise); `type() is str`, not
    # `== ""`, which for an address would be a dataclass __eq__ call.
    src = (src_addr or None) if type(src_addr) is str else None if src_addr is None else str(src_addr)
    dst = (dst_addr or None) if type(dst_addr) is str else None if dst_addr is None else str(dst_addr)
    hbone = (
        (hbone_addr or None) if type(hbone_addr) is str else None if hbone_addr is None else str(hbone_addr)
    )
    failure = error or None
    if handler is not None and isinstance(formatter, IstioFormatter) and not formatter.json_lines:
        counts = f"bytes_sent={bytes_sent} bytes_recv={bytes_recv} duration={duration_ms}ms"
        when = time.time() if created is None else created
        entry = (formatter, log.name, level, when, peers, src, dst, hbone, failure, counts)
        # Kept: a clean end's line to our own handler, inside a batch. An error line goes at
        # once (after the kept ones: lines stay in order), as do lines outside a batch.
        if _Deferred.batching and level == logging.INFO and type(handler) is IstioStreamHandler:
            lines = _Deferred.lines
            lines.append((handler, *entry))
            if len(lines) >= MAX_DEFERRED_ACCESS_LINES:
                write_deferred_access_lines()
            return
        if _Deferred.lines:
            write_deferred_access_lines()
        line = _plain_access_line(*entry)
        _write_line(handler, line, log, level, ACCESS_COMPLETE_MESSAGE, {})
        return
    fields: dict[str, Any] = {}
    if src is not None:
        fields["src.addr"] = src
    fields.update(peers.source)
    if dst is not None:
        fields["dst.addr"] = dst
    if hbone is not None:
        fields["dst.hbone_addr"] = hbone
    fields.update(peers.destination)
    fields["bytes_sent"] = bytes_sent
    fields["bytes_recv"] = bytes_recv
    fields["duration"] = f"{duration_ms}ms"
    if failure is not None:
        fields["error"] = failure
    _emit(log, level, ACCESS_COMPLETE_MESSAGE, fields, created)


def log_connection_failed(
    *,
    src_addr: object,
    dst_addr: object,
    direction: str,
    error: str,
    logger: logging.Logger | None = None,
) -> None:
    """WARN `connection failed`, for failures before the peers' workloads are known."""
    log = logger or access_logger()
    if log.isEnabledFor(logging.WARNING):
        fields: Mapping[str, Any] = {
            "src.addr": str(src_addr),
            "dst.addr": str(dst_addr),
            "direction": direction,
            "error": error,
        }
        _emit(log, logging.WARNING, "connection failed", dict(fields))
