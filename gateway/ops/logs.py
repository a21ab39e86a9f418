"""Logging set-up for the gateway process: levels, the line format (text, logfmt or JSON) and rate limiting.

    setup_logging(level="info", fmt="logfmt")

Every record becomes one line on stderr. `logfmt` and `json` lines carry `ts`, `level`, `logger`, `msg`
and any structured fields a record brings in `extra={"fields": {...}}` (the access log does:
gateway/ops/access_log.py); `text` is the classic `time LEVEL logger: message`.

Rate limiting (`RateLimitFilter`): the same message template from the same logger is let through at most
`burst` times per `window_s`; the rest are counted and the next line let through says how many were
dropped (`suppressed=N`). Access-log lines are exempt (one per request is the point), and so is a record
logged with `extra={"unlimited": True}`: a line its caller already emits only on a change (the autoscaler's
`fleet:` line), which a burst of changes must not hide.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from typing import Any

import orjson

FORMATS = ("text", "logfmt", "json")
LEVELS = ("debug", "info", "warning", "error")
ACCESS_LOGGER = "fleetgate.access"
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_HANDLER_MARK = "_fleetgate_handler"


_second: list = [-1, ""]  # the last whole second formatted, and its text (one strftime per second)


def _iso(created: float) -> str:
    sec = int(created)
    if sec != _second[0]:
        _second[0], _second[1] = sec, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec))
    return f"{_second[1]}.{int(created % 1 * 1000):03d}Z"


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    out: dict[str, Any] = {"ts": _iso(record.created), "level": record.levelname.lower(), "logger": record.name,
                           "msg": record.getMessage()}
    extra = getattr(record, "fields", None)
    if extra:
        out.update(extra)
    suppressed = getattr(record, "suppressed", 0)
    if suppressed:
        out["suppressed"] = suppressed
    if record.exc_info:
        out["exc"] = logging.Formatter().formatException(record.exc_info)
    return out


_NEEDS_QUOTES = re.compile(r'[\s"=\\]')


def logfmt_value(v: Any) -> str:
    """One logfmt value: bare when it has no space, quote, backslash or `=`, else a double-quoted string."""
    if v is None:
        return ""
    t = type(v)
    if t is int:
        return str(v)
    if t is bool:
        return "true" if v else "false"
    if t is float:
        return f"{v:.6g}"
    s = str(v)
    if s and not _NEEDS_QUOTES.search(s):
        return s
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t") + '"'


_search_quotes = _NEEDS_QUOTES.search


def _logfmt(fields: dict[str, Any]) -> str:
    # Plain strings and ints inline (most of an access line's fields): logfmt_value's result, without its call.
    return " ".join([k + "=" + (v if type(v) is str and v and not _search_quotes(v)
                                else str(v) if type(v) is int else logfmt_value(v)) for k, v in fields.items()])


# Each formatter also writes an access-log line straight from its fields (`format_access`, the same line `format`
# makes of a record of the access logger): gateway/ops/access_log.py skips the LogRecord on its per-request path.
_ACCESS_HEAD = f"level=info logger={ACCESS_LOGGER} msg=request"


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return _logfmt(_fields(record))

    def format_access(self, created: float, fields: dict[str, Any]) -> str:
        return f"ts={_iso(created)} {_ACCESS_HEAD} {_logfmt(fields)}"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return orjson.dumps(_fields(record), default=str).decode()

    def format_access(self, created: float, fields: dict[str, Any]) -> str:
        return orjson.dumps({"ts": _iso(created), "level": "info", "logger": ACCESS_LOGGER, "msg": "request",
                             **fields}, default=str).decode()


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(_TEXT_FORMAT)
        self._second, self._stamp = -1, ""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = getattr(record, "fields", None)
        if extra:
            line += " " + _logfmt(extra)
        suppressed = getattr(record, "suppressed", 0)
        return f"{line} (suppressed {suppressed} similar)" if suppressed else line

    def format_access(self, created: float, fields: dict[str, Any]) -> str:
        second = int(created)
        if second != self._second:  # the date and time change once a second: format them once a second
            self._second, self._stamp = second, time.strftime(self.default_time_format, time.localtime(created))
        return f"{self._stamp},{int(created % 1 * 1000):03d} INFO {ACCESS_LOGGER}: request {_logfmt(fields)}"


class FleetgateHandler(logging.StreamHandler):
    """The process's one log handler (setup_logging); `emit_access` writes an access line without a LogRecord."""

    def emit_access(self, fields: dict[str, Any]) -> None:
        try:
            line = self.formatter.format_access(time.time(), fields)  # type: ignore[union-attr]
            with self.lock:  # type: ignore[union-attr]
                self.stream.write(line + self.terminator)
                self.flush()
        except Exception:  # noqa: BLE001 - as logging.Handler.emit: never let logging break a request
            self.handleError(logging.makeLogRecord({"msg": "access log line", "fields": fields}))


_active: list[FleetgateHandler] = []  # the handler setup_logging installed (at most one)


def access_sink() -> FleetgateHandler | None:
    """The installed handler while it is still attached to the root logger, else None (use plain logging)."""
    h = _active[0] if _active else None
    return h if h is not None and h in logging.root.handlers else None


def make_formatter(fmt: str) -> logging.Formatter:
    if fmt == "json":
        return JsonFormatter()
    if fmt == "logfmt":
        return LogfmtFormatter()
    if fmt == "text":
        return TextFormatter()
    raise ValueError(f"unknown log format {fmt!r}; expected one of: {', '.join(FORMATS)}")


class RateLimitFilter(logging.Filter):
    """At most `burst` records per (logger, message template) per `window_s`; counts what it drops."""

    def __init__(self, window_s: float = 10.0, burst: int = 5, clock: Any = time.monotonic) -> None:
        super().__init__()
        self.window_s = window_s
        self.burst = burst
        self.clock = clock
        self._seen: dict[tuple[str, str], list[float]] = {}  # key -> [window start, count, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == ACCESS_LOGGER or getattr(record, "unlimited", False):
            return True
        now = self.clock()
        key = (record.name, str(record.msg))
        slot = self._seen.get(key)
        if slot is None or now - slot[0] >= self.window_s:
            dropped = int(slot[2]) if slot is not None else 0
            self._seen[key] = [now, 1, 0]
            if len(self._seen) > 4096:  # bounded: forget the oldest windows
                for k in sorted(self._seen, key=lambda k: self._seen[k][0])[:1024]:
                    del self._seen[k]
            if dropped:
                record.suppressed = dropped
            return True
        slot[1] += 1
        if slot[1] <= self.burst:
            return True
        slot[2] += 1
        return False


def setup_logging_from(cfg: Any) -> logging.Handler:
    """`setup_logging` with a GatewayConfig's `logging:` section."""
    c = cfg.logging
    return setup_logging(c.level, c.format, window_s=c.rate_limit_window_s, burst=c.rate_limit_burst)


def setup_logging(level: str = "info", fmt: str = "text", stream: Any = None, window_s: float = 10.0,
                  burst: int = 5) -> logging.Handler:
    """Send every `fleetgate*` record (and warnings from libraries) to one stderr handler; idempotent."""
    if level.lower() not in LEVELS:
        raise ValueError(f"unknown log level {level!r}; expected one of: {', '.join(LEVELS)}")
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, _HANDLER_MARK, False):
            root.removeHandler(h)
    handler = FleetgateHandler(stream or sys.stderr)
    setattr(handler, _HANDLER_MARK, True)
    _active[:] = [handler]
    handler.setFormatter(make_formatter(fmt))
    handler.addFilter(RateLimitFilter(window_s, burst))
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    # No format here shows thread or process names: skip computing them for every record (the logging module's
    # documented switches, "Optimization" in its HOWTO); the access log writes one record per request.
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging.getLogger("fleetgate").setLevel(getattr(logging, level.upper()))
    return handler
