"""Test-only worker plugin: a one-step request whose ID starts with ``hold-`` has its batch run, then its result
is held back, unstored, until the test lets it go.

Loaded into a real worker with ``celery worker --include tests.integration.hold_result_plugin``; production
workers never import it. When the batch has run, the worker writes ``test:ran:<id>``; it stores the result once
``test:release:<id>`` exists. That is the moment a cancel can only lose: the engine step is over, the result not
yet stored.
"""

from __future__ import annotations

import time
from typing import Any

import redis

from workers import bulk, pipeline
from workers.app import SETTINGS

__all__ = ["HOLD_PREFIX", "RAN_KEY", "RELEASE_KEY"]

HOLD_PREFIX = "hold-"
RAN_KEY = "test:ran:{id}"
RELEASE_KEY = "test:release:{id}"

_redis = redis.Redis.from_url(SETTINGS.redis_url)


def _hold(request_ids: list[str]) -> None:
    held = [rid for rid in request_ids if rid.startswith(HOLD_PREFIX)]
    for rid in held:
        _redis.set(RAN_KEY.format(id=rid), "1", ex=600)
    while held and not all(_redis.exists(RELEASE_KEY.format(id=rid)) for rid in held):
        time.sleep(0.02)


_finish = pipeline.finish
_store_all = bulk._store_all


def _finish_then_hold(*args: Any, request_id: str, **kwargs: Any) -> Any:
    result = _finish(*args, request_id=request_id, **kwargs)
    _hold([request_id])
    return result


def _hold_then_store(backend: Any, outcomes: list[tuple[str | None, str, Any]]) -> None:
    _hold([rid for rid, _, _ in outcomes if rid is not None])
    _store_all(backend, outcomes)


pipeline.finish = _finish_then_hold
bulk._store_all = _hold_then_store
