"""Measurement only: the fleet's worker with issue 11's worker-side dispatch changes taken back out.

So that ``fleet bench --only dispatch`` runs the path as it was before issue 11 beside the path as
served, in one run, on one worker of the same code otherwise (the machine is shared: runs an hour
apart are not comparable). Put back, in this process only:

* kombu's own Redis channel habits: a new ``redis.Redis`` client for each command it sends, and the
  ``MULTI``/``EXEC`` transactions around each delivery's bookkeeping (``ZADD``+``HSET``, ``ZREM``+``HDEL``)
  (:mod:`protocol.kombu_channel` removed both);
* Celery's result store: ``GET`` (is a SUCCESS stored?) then ``MULTI``/``SETEX``/``PUBLISH``/``EXEC``
  (:mod:`workers.result_backend` replaced it by one script);
* the drain meter's ``INCRBY``+``EXPIRE`` on every request (:mod:`workers.drain_meter` batches them);
* Celery's ``saferepr`` for the task-succeeded event's result text (:mod:`workers.result_repr`);
* one ``PUBLISH`` per task event on the request's own thread (:mod:`workers.event_buffer` gathers them).

Run: ``python -m bench.legacy_worker worker -P threads …`` (arguments as for ``celery -A workers.app``).
Not for production use.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import redis
from celery.backends.base import BaseKeyValueStoreBackend
from kombu.transport import redis as kombu_redis

from protocol.keys import DRAIN_KEY
from workers import event_buffer, metrics, poison, result_backend, result_repr
from workers.app import app

__all__ = ["LegacyGuardedChannel", "app", "restore_old_worker_path"]

log = logging.getLogger(__name__)


class LegacyGuardedChannel(poison.GuardedChannel):
    """The worker's guarded channel with kombu's own client-per-command and transactional bookkeeping."""

    QoS = kombu_redis.QoS  # type: ignore[assignment]

    def _create_client(self, asynchronous: bool = False) -> Any:
        return kombu_redis.Channel._create_client(self, asynchronous)  # type: ignore[no-untyped-call]


def _dequeued_per_request(self: metrics.WorkerMetrics, count: int = 1) -> None:
    """The drain meter as it was: ``INCRBY`` + ``EXPIRE`` for every dequeue."""
    if count <= 0:
        return
    key = DRAIN_KEY.format(model=self.model, second=int(time.time()))
    try:
        with self.runtime.redis.pipeline(transaction=False) as pipe:
            pipe.incrby(key, count)
            pipe.expire(key, int(self.runtime.settings.admission.drain_window_s) + 5)
            pipe.execute()
    except redis.RedisError as exc:
        log.warning("drain meter update failed: %s", exc)


def restore_old_worker_path() -> None:
    """Patch this process back to the pre-issue-11 worker path (see the module docstring)."""
    poison.GuardedChannel = LegacyGuardedChannel  # type: ignore[misc]  # install() reads the name at worker init
    for backend in (result_backend.RefusalTolerantRedisBackend, result_backend.RefusalTolerantSentinelBackend):
        backend._store_result = BaseKeyValueStoreBackend._store_result  # type: ignore[method-assign]
    metrics.WorkerMetrics.on_dequeued = _dequeued_per_request  # type: ignore[method-assign]
    result_repr.install = lambda: None  # worker_init imports it by name then
    event_buffer.uninstall(app)


restore_old_worker_path()

if __name__ == "__main__":
    app.worker_main(sys.argv[1:])
