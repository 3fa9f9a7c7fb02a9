"""The fleet's log line formats: plain text (the default) or one JSON object per line (``log.format: json``).

A JSON line holds ``ts`` (UTC, ISO 8601, ms), ``level``, ``logger``, ``message``, and ``request_id``
whenever the line concerns one request; access lines add ``method``, ``path``, ``status``,
``duration_ms`` and ``client``; a traceback goes in ``exc``. The request ID of a line comes from, in
order: an explicit ``extra={"request_id": …}``; Celery's own task lines ("Task fleet.infer[<id>]
received/succeeded/failed…", whose arguments carry the task ID, which is the request ID); the Celery
task that is running in the logging thread (every line a task logs).
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, Literal

__all__ = ["ACCESS_FIELDS", "TEXT_FORMAT", "JsonFormatter", "configure_logging", "formatter_for", "request_id_of"]

TEXT_FORMAT = "[%(asctime)s: %(levelname)s/%(name)s] %(message)s"
"""The plain-text line (the workers' and the gateway's own loggers)."""
ACCESS_FIELDS = ("method", "path", "status", "duration_ms", "client")
"""Extra fields an access line carries (``extra=``) and a JSON line repeats as keys."""


def request_id_of(record: logging.LogRecord) -> str | None:
    """The request a log record concerns, if any (see the module docstring for where it is found)."""
    explicit = getattr(record, "request_id", None)
    if explicit:
        return str(explicit)
    if isinstance(record.args, dict) and isinstance(record.args.get("id"), str):  # Celery's trace/strategy lines
        return str(record.args["id"])
    state = sys.modules.get("celery._state")  # never import Celery for the gateway's sake
    if state is not None:
        task = state.get_current_task()
        task_id = getattr(getattr(task, "request", None), "id", None) if task is not None else None
        if isinstance(task_id, str):
            return task_id
    return None


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = request_id_of(record)
        if request_id:
            doc["request_id"] = request_id
        for key in ACCESS_FIELDS:
            if hasattr(record, key):
                doc[key] = getattr(record, key)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            doc["exc"] = record.exc_text
        return json.dumps(doc, default=str, ensure_ascii=False)


def formatter_for(fmt: Literal["text", "json"]) -> logging.Formatter:
    """The formatter of ``fmt``."""
    return JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT)


def configure_logging(fmt: Literal["text", "json"], level: str | int = "INFO") -> None:
    """Send every logger's lines to stderr in ``fmt`` at ``level`` (the root logger's one handler).

    Replaces the root logger's handlers, so a library that set up its own (uvicorn with
    ``log_config=None`` sets none) ends up on the same stream in the same format.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter_for(fmt))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
