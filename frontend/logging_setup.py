"""Logging for every process: plain text for people, or one JSON object a line for log pipelines.

Request ids travel in a context variable, so every line logged while serving a request carries its
``X-Request-Id``. Prompts and outputs are never logged.
"""

from __future__ import annotations

import contextvars
import logging
import time
from typing import Literal

import orjson

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)

LogFormat = Literal["text", "json"]


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id:
            entry["request_id"] = request_id
        for key in ("event", "endpoint", "status", "latency_ms", "ctx_worker", "gen_worker", "role"):
            if hasattr(record, key):
                entry[key] = getattr(record, key)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry).decode()


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
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # httpx logs every request at INFO: with health checks every few seconds that drowns everything else.
    logging.getLogger("httpx").setLevel(logging.WARNING)
