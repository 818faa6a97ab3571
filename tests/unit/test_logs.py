"""Istio-style log lines, the access log, and the runtime level filter."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ambient_mesh import logs
from ambient_mesh.errors import ConfigError
from ambient_mesh.identity.spiffe import Identity
from ambient_mesh.logs import (
    AccessLogFields,
    IstioFormatter,
    LevelSpec,
    configure_logging,
    current_levels,
    format_time,
    log_connection_complete,
    log_connection_failed,
    parse_level_spec,
    reset_levels,
    set_levels,
)
from ambient_mesh.net import SocketAddr

# 2024-05-01T12:00:00.123456Z
CREATED = 1714564800.123456


def record(name: str, level: int, msg: str, fields: dict | None = None) -> logging.LogRecord:
    rec = logging.LogRecord(name, level, __file__, 1, msg, None, None)
    rec.created = CREATED
    if fields is not None:
        rec.fields = fields
    return rec


SAMPLE = AccessLogFields(
    src_addr=SocketAddr.of("10.0.0.1", 40000),
    src_workload="sleep-7d9f",
    src_namespace="default",
    src_identity=Identity("cluster.local", "default", "sleep"),
    dst_addr=SocketAddr.of("10.0.0.2", 15008),
    dst_hbone_addr=SocketAddr.of("10.0.0.2", 8080),
    dst_service="echo.default.svc.cluster.local",
    dst_workload="echo-5c4b",
    dst_namespace="default",
    dst_identity=Identity("cluster.local", "default", "echo"),
    direction="outbound",
    bytes_sent=120,
    bytes_recv=4096,
    duration_ms=37,
    mtls=True,
)


@pytest.fixture
def captured():
    stream = io.StringIO()
    yield stream
    logs.unconfigure_logging()


def test_format_time():
    assert format_time(CREATED) == "2024-05-01T12:00:00.123456Z"
    assert format_time(1714564800.9999999) == "2024-05-01T12:00:01.000000Z"


def test_plain_access_log_line_exact():
    rec = record("ambient_mesh.access", logging.INFO, "connection complete", SAMPLE.as_fields())
    assert IstioFormatter().format(rec) == (
        "2024-05-01T12:00:00.123456Z\tinfo\taccess\tconnection complete\t"
        "src.addr=10.0.0.1:40000 src.workload=sleep-7d9f src.namespace=default "
        "src.identity=spiffe://cluster.local/ns/default/sa/sleep "
        "dst.addr=10.0.0.2:15008 dst.hbone_addr=10.0.0.2:8080 "
        "dst.service=echo.default.svc.cluster.local dst.workload=echo-5c4b dst.namespace=default "
        "dst.identity=spiffe://cluster.local/ns/default/sa/echo "
        "direction=outbound bytes_sent=120 bytes_recv=4096 duration=37ms"
    )


def test_json_access_log_line_exact():
    rec = record("ambient_mesh.access", logging.INFO, "connection complete", SAMPLE.as_fields())
    line = IstioFormatter(json_lines=True).format(rec)
    assert line == (
        '{"level":"info","time":"2024-05-01T12:00:00.123456Z","scope":"access",'
        '"message":"connection complete","src.addr":"10.0.0.1:40000","src.workload":"sleep-7d9f",'
        '"src.namespace":"default","src.identity":"spiffe://cluster.local/ns/default/sa/sleep",'
        '"dst.addr":"10.0.0.2:15008","dst.hbone_addr":"10.0.0.2:8080",'
        '"dst.service":"echo.default.svc.cluster.local","dst.workload":"echo-5c4b",'
        '"dst.namespace":"default","dst.identity":"spiffe://cluster.local/ns/default/sa/echo",'
        '"direction":"outbound","bytes_sent":120,"bytes_recv":4096,"duration":"37ms"}'
    )
    assert list(json.loads(line))[:4] == ["level", "time", "scope", "message"]


def test_identities_only_with_mtls_and_missing_values_omitted():
    fields = AccessLogFields(
        src_addr="10.0.0.1:1",
        src_identity=Identity("cluster.local", "a", "b"),
        dst_addr="10.0.0.2:80",
        dst_identity=Identity("cluster.local", "c", "d"),
        direction="inbound",
        src_cluster="",
    ).as_fields()
    assert fields == {"src.addr": "10.0.0.1:1", "dst.addr": "10.0.0.2:80", "direction": "inbound"}


def test_plain_values_with_spaces_are_quoted():
    rec = record(
        "ambient_mesh.proxy.outbound", logging.WARNING, "x", {"error": 'connection "refused" now', "n": 1}
    )
    assert IstioFormatter().format(rec) == (
        '2024-05-01T12:00:00.123456Z\twarn\tproxy.outbound\tx\terror="connection \\"refused\\" now" n=1'
    )


def test_plain_line_without_fields_has_no_trailing_tab():
    assert IstioFormatter().format(record("ambient_mesh.xds", logging.DEBUG, "hello")) == (
        "2024-05-01T12:00:00.123456Z\tdebug\txds\thello"
    )
    assert IstioFormatter().format(record("asyncio", logs.TRACE, "t")).split("\t")[1:3] == [
        "trace",
        "asyncio",
    ]


def test_access_log_through_logging(captured):
    configure_logging("plain", "info", stream=captured)
    log_connection_complete(SAMPLE)
    log_connection_complete(
        AccessLogFields(src_addr="1.1.1.1:1", direction="inbound", error="connection reset")
    )
    lines = captured.getvalue().splitlines()
    assert len(lines) == 2
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", lines[0].split("\t")[0])
    assert lines[0].split("\t")[1:4] == ["info", "access", "connection complete"]
    assert lines[1].split("\t")[1:] == [
        "error",
        "access",
        "connection complete",
        'src.addr=1.1.1.1:1 direction=inbound error="connection reset"',
    ]


def test_connection_failed_is_warn_json(captured):
    configure_logging("json", "info", stream=captured)
    log_connection_failed(
        src_addr=SocketAddr.of("10.0.0.1", 1),
        dst_addr=SocketAddr.of("10.0.0.2", 2),
        direction="outbound",
        error="boom",
    )
    line = json.loads(captured.getvalue())
    del line["time"]
    assert line == {
        "level": "warn",
        "scope": "access",
        "message": "connection failed",
        "src.addr": "10.0.0.1:1",
        "dst.addr": "10.0.0.2:2",
        "direction": "outbound",
        "error": "boom",
    }


def test_opened_line_is_debug_only(captured):
    configure_logging("plain", "info", stream=captured)
    logs.log_connection_opened(SAMPLE)
    assert captured.getvalue() == ""
    set_levels("access=debug")
    logs.log_connection_opened(SAMPLE)
    assert "\tdebug\taccess\tconnection opened\t" in captured.getvalue()


def test_level_spec_parsing():
    assert parse_level_spec("info") == LevelSpec(default="info")
    assert parse_level_spec("warn,access=debug,ztunnel::proxy=trace") == LevelSpec(
        default="warn", targets=(("access", "debug"), ("proxy", "trace"))
    )
    assert str(parse_level_spec("WARNING, xds=off")) == "warn,xds=off"
    for bad in ("", "loud", "access=", "=info", "a b=info", ",,"):
        with pytest.raises(ConfigError):
            parse_level_spec(bad)


def test_set_and_reset_levels(captured):
    configure_logging("plain", "warn,xds=debug", stream=captured)
    assert current_levels() == "warn,xds=debug"
    proxy = logging.getLogger("ambient_mesh.proxy.inbound")
    assert not proxy.isEnabledFor(logging.INFO)
    assert set_levels("proxy=debug") == "warn,xds=debug,proxy=debug"
    assert proxy.isEnabledFor(logging.DEBUG)
    assert set_levels("error") == "error,xds=debug,proxy=debug"
    assert not logging.getLogger("ambient_mesh.state").isEnabledFor(logging.WARNING)
    assert set_levels("proxy=off") == "error,xds=debug,proxy=off"
    assert not proxy.isEnabledFor(logging.CRITICAL)
    assert reset_levels() == "warn,xds=debug"
    assert logging.getLogger("ambient_mesh.proxy").level == logging.NOTSET
    assert logging.getLogger("ambient_mesh.xds").isEnabledFor(logging.DEBUG)


def test_bad_spec_leaves_levels_alone(captured):
    configure_logging("plain", "info", stream=captured)
    with pytest.raises(ConfigError):
        set_levels("access=shout")
    assert current_levels() == "info"


def test_configure_rejects_bad_format(captured):
    with pytest.raises(ConfigError) as info:
        configure_logging("xml", "info", stream=captured)
    assert info.value.source == "LOG_FORMAT"


def test_unconfigure_restores_root():
    root = logging.getLogger()
    before = (root.level, list(root.handlers))
    configure_logging("plain", "debug", stream=io.StringIO())
    logs.unconfigure_logging()
    assert (root.level, list(root.handlers)) == before


def test_exception_goes_into_a_field():
    try:
        raise RuntimeError("bad thing")
    except RuntimeError:
        import sys

        rec = record("ambient_mesh.proxy", logging.ERROR, "crash")
        rec.exc_info = sys.exc_info()
    line = json.loads(IstioFormatter(json_lines=True).format(rec))
    assert "RuntimeError: bad thing" in line["exception"]
    assert "\n" not in IstioFormatter().format(rec)


@given(st.text(alphabet=st.sampled_from(list("abinfowrd=,.:_- TX\u00e9")), max_size=40))
def test_level_spec_parser_total(spec):
    try:
        parsed = parse_level_spec(spec)
    except ConfigError:
        return
    # What it prints parses back to itself.
    assert parse_level_spec(str(parsed)) == parsed


@given(
    st.dictionaries(
        st.from_regex(r"[a-z][a-z_.]{0,10}", fullmatch=True),
        st.text(st.characters(blacklist_categories=("Cs",)), max_size=30),
        max_size=6,
    )
)
def test_plain_fields_read_back_what_the_formatter_wrote(fields):
    """parse_plain_fields is the inverse of the plain format (the lab and tests rely on it)."""
    record = logging.LogRecord(
        "ambient_mesh.access", logging.INFO, __file__, 1, "connection complete", (), None
    )
    record.fields = fields
    line = IstioFormatter().format(record)
    assert logs.parse_plain_fields(line) == fields
    assert logs.access_events(line + "\nother\tline\n") == [fields]


def test_access_record_names_its_caller_like_find_caller():
    """The access line skips Logger.findCaller; its record still names the frame that logged."""
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    keep = Keep()
    access = logs.access_logger()
    assert access is logging.getLogger("ambient_mesh.access")
    access.addHandler(keep)
    old_level = access.level
    access.setLevel(logging.INFO)
    try:
        log_connection_complete(SAMPLE)
    finally:
        access.removeHandler(keep)
        access.setLevel(old_level)
    (rec,) = seen
    assert (rec.funcName, rec.pathname, rec.levelno) == (
        "log_connection_complete",
        logs.__file__,
        logging.INFO,
    )
    assert rec.getMessage() == "connection complete" and rec.fields == SAMPLE.as_fields()
    assert rec.lineno > logs.log_connection_complete.__code__.co_firstlineno


@given(
    st.dictionaries(
        st.from_regex(r"[a-z][a-z_.]{0,10}", fullmatch=True),
        st.one_of(st.text(max_size=12), st.integers(), st.none()),
        max_size=8,
    )
)
def test_plain_fields_quote_each_value_as_plain_value(fields):
    """The one-search fast path writes what quoting value by value writes."""
    record = logging.LogRecord("ambient_mesh.access", logging.INFO, __file__, 1, "m", (), None)
    record.fields = fields
    kept = {k: v for k, v in fields.items() if v is not None}
    expected = " ".join(f"{k}={logs._plain_value(v)}" for k, v in kept.items())
    line = IstioFormatter().format(record)
    assert line.split("\t")[4:] == ([expected] if kept else [])


def _only_ours(monkeypatch, handler: logging.Handler) -> None:
    """The logger chain of a running proxy: our handler on the root, nothing else on the way
    (pytest's capture handlers, and whatever earlier tests left, set aside for the test)."""
    for logger in (logs.access_logger(), logging.getLogger("ambient_mesh")):
        monkeypatch.setattr(logger, "handlers", [])
        monkeypatch.setattr(logger, "filters", [])
        monkeypatch.setattr(logger, "propagate", True)
        monkeypatch.setattr(logger, "disabled", False)
    monkeypatch.setattr(logging.getLogger(), "handlers", [handler])
    monkeypatch.setattr(logging.getLogger(), "filters", [])


@pytest.mark.parametrize("json_lines", [False, True])
def test_access_line_without_a_record_is_the_formatted_record(captured, monkeypatch, json_lines):
    """With only our handler installed the line is written without a LogRecord: the same text."""
    handler = configure_logging("json" if json_lines else "plain", "info", stream=captured)
    _only_ours(monkeypatch, handler)
    monkeypatch.setattr(logs.time, "time", lambda: CREATED)
    made = []
    monkeypatch.setattr(logging.Logger, "makeRecord", lambda *a, **k: made.append(a))
    log_connection_complete(SAMPLE)
    log_connection_complete(AccessLogFields(src_addr="1.1.1.1:1", direction="inbound", error="reset"))
    log_connection_failed(src_addr="a", dst_addr="b", direction="outbound", error="no route")
    monkeypatch.undo()
    assert made == []
    fmt = IstioFormatter(json_lines=json_lines)
    expected = [
        fmt.format(record("ambient_mesh.access", logging.INFO, "connection complete", SAMPLE.as_fields())),
        fmt.format(
            record(
                "ambient_mesh.access",
                logging.ERROR,
                "connection complete",
                {"src.addr": "1.1.1.1:1", "direction": "inbound", "error": "reset"},
            )
        ),
        fmt.format(
            record(
                "ambient_mesh.access",
                logging.WARNING,
                "connection failed",
                {"src.addr": "a", "dst.addr": "b", "direction": "outbound", "error": "no route"},
            )
        ),
    ]
    assert captured.getvalue() == "".join(line + "\n" for line in expected)


def test_access_line_goes_through_logging_when_anything_else_listens(captured, monkeypatch):
    """A filter, or a second handler anywhere on the way up: records, as Logger.log makes them."""
    handler = configure_logging("plain", "info", stream=captured)
    _only_ours(monkeypatch, handler)
    seen: list[logging.LogRecord] = []

    def keep(rec: logging.LogRecord) -> bool:
        seen.append(rec)
        return True

    class Keep(logging.Handler):
        def emit(self, rec: logging.LogRecord) -> None:
            keep(rec)

    access, package, other = logs.access_logger(), logging.getLogger("ambient_mesh"), Keep()
    for attach, detach in (
        (lambda: access.addFilter(keep), lambda: access.removeFilter(keep)),
        (lambda: handler.addFilter(keep), lambda: handler.removeFilter(keep)),
        (lambda: package.addHandler(other), lambda: package.removeHandler(other)),
    ):
        attach()
        try:
            log_connection_complete(SAMPLE)
        finally:
            detach()
    assert [r.funcName for r in seen] == ["log_connection_complete"] * 3
    assert len(captured.getvalue().splitlines()) == 3


def test_access_line_write_failure_is_reported_by_the_handler(captured, monkeypatch):
    handler = configure_logging("plain", "info", stream=captured)
    _only_ours(monkeypatch, handler)
    reported: list[logging.LogRecord] = []
    monkeypatch.setattr(handler, "handleError", reported.append)

    def broken(_text: str) -> int:
        raise OSError("disk full")

    monkeypatch.setattr(captured, "write", broken)
    log_connection_complete(SAMPLE)
    assert [r.getMessage() for r in reported] == ["connection complete"]
    assert reported[0].fields == SAMPLE.as_fields()


_texts = st.one_of(
    st.none(),
    st.sampled_from(["", "a b", 'q"uote', "k=v", "back\\slash", "ünï", "x\ty"]),
    st.text(max_size=6),
)
_addresses = st.one_of(
    st.none(), st.sampled_from([SocketAddr.of("10.0.0.1", 1), SocketAddr.of("fd00::1", 15008)]), _texts
)
_access_fields = st.builds(
    AccessLogFields,
    src_addr=_addresses,
    src_workload=_texts,
    src_namespace=_texts,
    src_identity=st.one_of(st.none(), st.just(Identity("cluster.local", "ns", "sa"))),
    src_cluster=_texts,
    dst_addr=_addresses,
    dst_hbone_addr=_addresses,
    dst_service=_texts,
    dst_workload=_texts,
    dst_namespace=_texts,
    dst_identity=st.one_of(st.none(), st.just(Identity("td", "ns", "sa"))),
    dst_cluster=_texts,
    direction=st.sampled_from(["outbound", "inbound"]),
    bytes_sent=st.integers(0, 10**12),
    bytes_recv=st.integers(0, 10**12),
    duration_ms=st.integers(0, 10**7),
    error=_texts,
    mtls=st.booleans(),
)


def _both_ways(fields: AccessLogFields) -> None:
    logs.log_connection_complete(fields)
    logs.log_access_complete(
        logs.AccessPeers.of(fields),
        src_addr=fields.src_addr,
        dst_addr=fields.dst_addr,
        hbone_addr=fields.dst_hbone_addr,
        bytes_sent=fields.bytes_sent,
        bytes_recv=fields.bytes_recv,
        duration_ms=fields.duration_ms,
        error=fields.error,
    )


@pytest.mark.parametrize("json_lines", [False, True])
@given(fields=_access_fields)
def test_access_line_from_cached_peers_is_the_line_of_its_fields(json_lines, fields):
    """What proxy/telemetry.py writes (the peers' part worked out once) is what
    log_connection_complete writes for the same AccessLogFields, plain and JSON."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        stream = io.StringIO()
        handler = configure_logging("json" if json_lines else "plain", "info", stream=stream)
        try:
            _only_ours(monkeypatch, handler)
            monkeypatch.setattr(logs.time, "time", lambda: CREATED)
            _both_ways(fields)
        finally:
            monkeypatch.undo()
            logs.unconfigure_logging()
    first, second, _end = stream.getvalue().split("\n")  # a value may hold U+0085
    assert first == second


@given(fields=_access_fields)
def test_access_record_from_cached_peers_has_the_fields_of_its_fields(fields):
    """With another handler on the way (a test's capture) the record carries the same fields."""
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    keep = Keep()
    access = logs.access_logger()
    access.addHandler(keep)
    old_level = access.level
    access.setLevel(logging.INFO)
    try:
        _both_ways(fields)
    finally:
        access.removeHandler(keep)
        access.setLevel(old_level)
    first, second = seen
    assert first.fields == second.fields == fields.as_fields()
    assert (first.levelno, first.getMessage()) == (second.levelno, second.getMessage())


def _access_line_of(fields: AccessLogFields, created: float) -> None:
    logs.log_access_complete(
        logs.AccessPeers.of(fields),
        src_addr=fields.src_addr,
        dst_addr=fields.dst_addr,
        hbone_addr=fields.dst_hbone_addr,
        bytes_sent=fields.bytes_sent,
        bytes_recv=fields.bytes_recv,
        duration_ms=fields.duration_ms,
        error=fields.error,
        created=created,
    )


def test_access_lines_of_one_batch_are_written_in_one_write(captured, monkeypatch):
    """To configure_logging's handler, inside `access_lines_together` (telemetry's batch of
    ended connections), access lines are kept and written in one write at its end, each with
    the time it was logged at: the same text as written at once."""
    handler = configure_logging("plain", "info", stream=captured)
    _only_ours(monkeypatch, handler)
    writes = []
    real_write = captured.write
    monkeypatch.setattr(captured, "write", lambda text: writes.append(text) or real_write(text))
    with logs.access_lines_together():
        _access_line_of(SAMPLE, CREATED)
        with logs.access_lines_together():  # nested: the outer batch writes
            _access_line_of(SAMPLE, CREATED + 1)
        assert captured.getvalue() == ""  # kept
    fmt = IstioFormatter()
    expected = [
        fmt.format(record("ambient_mesh.access", logging.INFO, "connection complete", SAMPLE.as_fields())),
        fmt.format(record("ambient_mesh.access", logging.INFO, "connection complete", SAMPLE.as_fields())),
    ]
    expected[1] = expected[1].replace("12:00:00.123456Z", "12:00:01.123456Z")
    assert captured.getvalue() == "".join(line + "\n" for line in expected)
    assert len(writes) == 1


def test_kept_access_lines_go_before_any_other_line_and_on_flush(captured, monkeypatch):
    handler = configure_logging("plain", "info", stream=captured)
    _only_ours(monkeypatch, handler)
    with logs.access_lines_together():
        _access_line_of(SAMPLE, CREATED)
        logging.getLogger("ambient_mesh.proxy").warning("after the access line")
        lines = captured.getvalue().split("\n")
        assert "connection complete" in lines[0] and "after the access line" in lines[1]
        _access_line_of(SAMPLE, CREATED)
        handler.flush()  # logging.shutdown at exit flushes every handler
        assert captured.getvalue().count("connection complete") == 2


def test_kept_access_lines_are_bounded(captured, monkeypatch):
    """A batch never keeps more than MAX_DEFERRED_ACCESS_LINES lines."""
    handler = configure_logging("plain", "info", stream=captured)
    _only_ours(monkeypatch, handler)
    with logs.access_lines_together():
        for _ in range(logs.MAX_DEFERRED_ACCESS_LINES - 1):
            _access_line_of(SAMPLE, CREATED)
        assert captured.getvalue() == ""
        _access_line_of(SAMPLE, CREATED)
        assert captured.getvalue().count("connection complete") == logs.MAX_DEFERRED_ACCESS_LINES
        assert not logs._Deferred.lines


async def test_access_lines_outside_a_batch_are_written_at_once(captured, monkeypatch):
    handler = configure_logging("plain", "info", stream=captured)
    _only_ours(monkeypatch, handler)
    _access_line_of(SAMPLE, CREATED)  # from an event loop too
    assert captured.getvalue().count("connection complete") == 1


def test_an_error_line_is_written_at_once_after_the_kept_ones(captured, monkeypatch):
    handler = configure_logging("plain", "info", stream=captured)
    _only_ours(monkeypatch, handler)
    with logs.access_lines_together():
        _access_line_of(SAMPLE, CREATED)
        assert captured.getvalue() == ""
        _access_line_of(dataclasses.replace(SAMPLE, error="reset"), CREATED + 1)
    first, second, _end = captured.getvalue().split("\n")
    assert "\tinfo\t" in first and "\terror\t" in second and "error=reset" in second
