"""A message sent with a Celery priority counts wherever the fleet counts what waits in a queue.

kombu's Redis transport keeps priorities in sibling lists of a queue (``<queue>\\x06\\x16<n>``). A plain
Celery client that sends with ``priority=`` puts its message there, not in the queue's own list. Before,
the worker's readiness count (what tells a worker that takes nothing while work waits from an idle one)
and ``fleet status``'s canary queue depth read the queue's own list only: a wedged worker with only
prioritized messages waiting reported ready, and the canary's depth read 0. Admission, the gateway's
metrics and the start-together wait already read the siblings (:func:`broker.queue_depth`).

A real redis-server, and the message is written by Celery's own client (no list name spelled here).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis
from celery import Celery

from producer.cli import main as fleet_main
from tests.integration.fleet_fixtures import Fleet
from workers.runtime import WorkerRuntime

MODEL = "demo-lm"


def _send_with_priority(redis_url: str, queue: str, priority: int) -> None:
    app = Celery("plain", broker=redis_url)
    app.conf.update(task_serializer="json", accept_content=["json"], broker_connection_retry_on_startup=False)
    try:
        app.send_task("fleet.infer", args=[{"model": MODEL, "input_ids": [5, 6, 7]}], queue=queue, priority=priority)
    finally:
        app.close()


def _counts(fleet: Fleet, config: Path) -> tuple[int, int, int]:
    """(what the worker's readiness counts, the queue's own list, the canary queue's own list)."""
    settings = fleet.settings(config)
    r: redis.Redis[bytes] = redis.Redis.from_url(fleet.redis_url)
    runtime = SimpleNamespace(redis=r, queue=settings.queue_for(MODEL), canary_queue=settings.canary_queue_for(MODEL),
                              direct_queue=SimpleNamespace(consumed=False))  # fmt: skip
    runtime._own_queues = lambda: WorkerRuntime._own_queues(runtime)  # type: ignore[arg-type]
    queued = WorkerRuntime._queued(runtime)  # type: ignore[arg-type]
    return queued, int(r.llen(settings.queue_for(MODEL))), int(r.llen(settings.canary_queue_for(MODEL)))


def test_a_prioritized_message_counts_for_readiness(fleet: Fleet) -> None:
    config = fleet.config()
    _send_with_priority(fleet.redis_url, fleet.settings(config).queue_for(MODEL), priority=9)
    queued, own_list, _ = _counts(fleet, config)
    assert own_list == 0, "the message should wait in a priority sibling list"
    assert queued == 1


def test_fleet_status_counts_a_prioritized_message_on_the_canary_queue(
    fleet: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    config = fleet.config()
    _send_with_priority(fleet.redis_url, fleet.settings(config).canary_queue_for(MODEL), priority=9)
    assert _counts(fleet, config)[2] == 0, "the message should wait in a priority sibling list"
    assert fleet_main(["status", "--json", "--config", str(config)]) == 0
    row = next(m for m in json.loads(capsys.readouterr().out)["models"] if m["model"] == MODEL)
    assert row["canary_queue_depth"] == 1
