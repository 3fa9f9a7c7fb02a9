"""The worker's result backend: Celery's Redis backend, retrying writes Redis refuses for a while.

A result write that fails is worse than a slow one: Celery then acks the message (acks_late acks a
failed task too), so the request is gone with no result. With ``result_backend_always_retry`` Celery
retries a store whose error its backend calls safe to retry; Redis's own backend counts only lost
connections. These classes add Redis's temporary write refusals (``MISCONF``, ``NOREPLICAS``,
``READONLY``, ``OOM``, ``MASTERDOWN``: :func:`workers.redis_refusals.is_write_refusal`), so a task
thread holds its request (and its token) until the result is written, and the request is never
acked without one.

Installed for the worker's app only (:func:`install`): producers keep Celery's behaviour of raising.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.backends.redis import RedisBackend, SentinelBackend

from workers.redis_refusals import is_write_refusal

__all__ = ["RESULT_WRITE_MAX_SLEEP_MS", "RESULT_WRITE_RETRIES", "RefusalTolerantRedisBackend",
           "RefusalTolerantSentinelBackend", "install"]

RESULT_WRITE_RETRIES = 3600
"""Retries of one result write (at most :data:`RESULT_WRITE_MAX_SLEEP_MS` apart: about an hour)."""
RESULT_WRITE_MAX_SLEEP_MS = 1000
"""Longest wait between two tries of a result write, in milliseconds (exponential from 10 ms)."""


class _RetriesWriteRefusals:
    """The retry rule both backends share: Celery's own, plus Redis's temporary write refusals."""

    def exception_safe_to_retry(self, exc: BaseException) -> bool:
        return bool(super().exception_safe_to_retry(exc)) or is_write_refusal(exc)  # type: ignore[misc]


class RefusalTolerantRedisBackend(_RetriesWriteRefusals, RedisBackend):  # type: ignore[misc]
    """Celery's Redis backend; a write Redis refuses for now is retried like a lost connection."""


class RefusalTolerantSentinelBackend(_RetriesWriteRefusals, SentinelBackend):  # type: ignore[misc]
    """Celery's Sentinel backend with the same retry rule (``READONLY`` during a failover, …)."""


def install(app: Celery) -> None:
    """Make ``app`` (the worker's, before its backend is first used) store results through these classes."""
    here = f"{__name__}:"
    overrides: dict[str, Any] = {
        "redis": here + RefusalTolerantRedisBackend.__name__,
        "rediss": here + RefusalTolerantRedisBackend.__name__,
        "sentinel": here + RefusalTolerantSentinelBackend.__name__,
    }
    app.loader.override_backends = {**app.loader.override_backends, **overrides}
    app.conf.result_backend_always_retry = True
    app.conf.result_backend_max_retries = RESULT_WRITE_RETRIES
    app.conf.result_backend_max_sleep_between_retries_ms = RESULT_WRITE_MAX_SLEEP_MS
