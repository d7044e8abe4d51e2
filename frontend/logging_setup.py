"""Logging for every process: plain text for people, or one JSON object a line for log pipelines.

Request ids travel in a context variable, so every line logged while serving a request carries its
``X-Request-Id``. Prompts and outputs are never logged.
"""

from __future__ import annotations

import contextvars
import logging
import time
from typing import Literal, TextIO

import orjson

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)

LogFormat = Literal["text", "json"]


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True


_FIELDS = ("event", "endpoint", "status", "latency_ms", "ctx_worker", "gen_worker", "role")


def _iso_time(created: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created * 1000) % 1000:03d}Z"


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": _iso_time(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id:
            entry["request_id"] = request_id
        for key in _FIELDS:
            if hasattr(record, key):
                entry[key] = getattr(record, key)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry).decode()


_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The handler ``configure_logging`` installed, and its format.
_installed: tuple[logging.StreamHandler[TextIO], LogFormat] | None = None


class RequestLines:
    """Each answered request's line, at INFO, with its fields: in the text format as ``key=value`` after the
    message, in the JSON format as the entry's keys.

    Written straight to the stream of the handler ``configure_logging`` installed, in its format, without the
    logging machinery (a LogRecord, the filter, the handler's lock, the formatter), which would cost a busy
    orchestrator a noticeable share of its CPU per request. Under any other set-up (a test's ``caplog``, an
    application's own handlers) the line goes through ``logger`` like any other."""

    __slots__ = ("_second", "_stamp", "logger")

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self._second = -1
        self._stamp = ""

    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)

    def write(self, message: str, fields: dict[str, object]) -> None:
        installed = _installed
        if installed is None or logging.getLogger().handlers != [installed[0]] or self.logger.handlers \
                or not self.logger.propagate:
            self.logger.info(message, extra=fields)
            return
        handler, log_format = installed
        now = time.time()
        request_id = request_id_var.get()
        if log_format == "json":
            entry: dict[str, object] = {"ts": _iso_time(now), "level": "info", "logger": self.logger.name,
                                        "message": message}
            if request_id:
                entry["request_id"] = request_id
            entry.update(fields)
            line = orjson.dumps(entry).decode()
        else:
            second = int(now)
            if second != self._second:  # the formatter's asctime, made once a second
                self._second = second
                self._stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second))
            pairs = " ".join(f"{key}={value}" for key, value in fields.items() if value is not None)
            line = (f"{self._stamp},{int(now * 1000) % 1000:03d} INFO {self.logger.name}: {message}"
                    f"{' request_id=' + request_id if request_id else ''} {pairs}")
        handler.acquire()  # another thread may log at the same time (an exporter's, say)
        try:
            stream = handler.stream
            stream.write(line + handler.terminator)
            stream.flush()
        except Exception:  # a closed or broken stream: logging's own error handling reports it, as for any line
            self.logger.info(message, extra=fields)
        finally:
            handler.release()


def configure_logging(level: str = "info", log_format: LogFormat = "text") -> None:
    # Neither format shows where a line was logged from, or which thread or process logged it: the logging HOWTO's
    # optimisations skip finding them (a stack walk and three look-ups per line, on every request's access line).
    logging._srcfile = None  # documented there: "set logging._srcfile to None"
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler = logging.StreamHandler()
    handler.addFilter(_RequestIdFilter())
    if log_format == "json":
        handler.setFormatter(JSONFormatter())
    else:
        handler.setFormatter(logging.Formatter(_TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    global _installed
    _installed = (handler, log_format)
    root.setLevel(level.upper())
    # httpx logs every request at INFO: a worker's calls with it (registration, a hand-off pulled from CTX) would
    # drown everything else.
    logging.getLogger("httpx").setLevel(logging.WARNING)
