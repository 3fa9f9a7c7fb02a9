"""JSON log lines and masked broker URLs, as pure functions."""

from __future__ import annotations

import json
import logging

from protocol.log_format import JsonFormatter, request_id_of
from protocol.redis_conn import MaskedConnection


def _record(msg: str, args: object = None, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord("celery.app.trace", logging.INFO, __file__, 1, msg, args, None)  # type: ignore[arg-type]
    record.__dict__.update(extra)
    return record


def test_a_json_line_carries_the_request_id_from_extra_or_celerys_task_arguments() -> None:
    celery_line = _record("Task %(name)s[%(id)s] received", {"name": "fleet.infer", "id": "r-1"})
    doc = json.loads(JsonFormatter().format(celery_line))
    assert doc["message"] == "Task fleet.infer[r-1] received" and doc["request_id"] == "r-1"
    assert doc["level"] == "INFO" and doc["logger"] == "celery.app.trace" and doc["ts"].endswith("+00:00")
    access = _record("GET", None, request_id="r-2", method="GET", status=200, duration_ms=1.5)
    doc = json.loads(JsonFormatter().format(access))
    assert (doc["request_id"], doc["method"], doc["status"], doc["duration_ms"]) == ("r-2", "GET", 200, 1.5)
    assert request_id_of(_record("no request here")) is None
    assert "request_id" not in json.loads(JsonFormatter().format(_record("plain")))


def _shown(url: str, include_password: bool = False) -> str:
    """The URL as Celery shows it (kombu's Connection is untyped)."""
    return MaskedConnection(url).as_uri(include_password=include_password)  # type: ignore[no-untyped-call]


def test_a_broker_url_is_masked_only_where_it_has_a_password() -> None:
    assert _shown("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert _shown("redis://:s3cret@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert _shown("redis://fleet:s3cret@h:1/2") == "redis://fleet:***@h:1/2"
    assert _shown("redis://fleet:s3cret@h:1/2", include_password=True) == "redis://fleet:s3cret@h:1/2"
