"""A worker's own queue is moved whole: kombu's priority sibling lists too, each onto the same priority.

A message sent with a Celery priority waits in a sibling list of its queue (``<queue>\\x06\\x16<n>``), and
kombu restores an unacked one there too. Before, :class:`workers.direct_queue.DirectQueue` moved only the
queue's own list: a prioritized message in a dead worker's queue, or in the queue a restarted worker took
over, stayed there for ever. A real redis-server; the messages are written by Celery's own client (no list
name spelled here) and read back by kombu's consumer.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis
from celery import Celery

from broker.priority_lists import queue_depth
from protocol.keys import DIRECT_QUEUES_KEY
from tools.redis_server import EmbeddedRedis
from workers.direct_queue import DirectQueue

MODEL = "demo-lm"
SHARED = "fleet.demo-lm"
PREFIX = SHARED + ".w."


def _send(app: Celery, queue: str, tag: str, priority: int | None) -> None:
    app.send_task("fleet.infer", args=[{"model": MODEL, "input_ids": [5]}], task_id=tag, queue=queue,
                  priority=priority)  # fmt: skip


def _taken_ids(app: Celery, queue: str) -> list[str]:
    """The task IDs kombu's consumer takes from ``queue``, in the order it takes them (highest priority first)."""
    ids: list[str] = []
    with app.connection_for_read() as conn:
        simple = conn.SimpleQueue(queue, no_ack=True, serializer="json")
        try:
            while True:
                try:
                    message = simple.get(timeout=0.2)
                except simple.Empty:
                    return ids
                ids.append(message.headers["id"])
        finally:
            simple.close()


Plain = tuple[Celery, "redis.Redis[bytes]"]


@pytest.fixture
def plain(redis_server: EmbeddedRedis) -> Iterator[Plain]:
    """A plain Celery client and a Redis client on a private redis-server."""
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    app = Celery("plain", broker=url)
    app.conf.update(task_serializer="json", accept_content=["json"], broker_connection_retry_on_startup=False)
    client: redis.Redis[bytes] = redis.Redis.from_url(url)
    yield app, client
    app.close()
    client.close()


def test_a_dead_workers_prioritized_messages_are_rescued_onto_the_model_queue(plain: Plain) -> None:
    app, client = plain
    dead = PREFIX + "w-dead"
    for tag, priority in (("plain-1", None), ("urgent-9", 9), ("mid-6", 6), ("plain-2", None)):
        _send(app, dead, tag, priority)
    assert queue_depth(client, dead) == 4
    client.zadd(DIRECT_QUEUES_KEY.format(model=MODEL), {"w-dead": time.time() - 1})  # its heartbeat expired
    rescuer = DirectQueue(client, model=MODEL, hostname="w-live", name=PREFIX + "w-live", shared=SHARED,
                          linger_s=60.0)  # fmt: skip
    rescuer.beat(time.time() + 30)

    assert rescuer.rescued == 4
    assert queue_depth(client, dead) == 0
    # kombu's order on Redis: priority 0 (its own list) first, then 6, then 9; each list oldest first
    assert _taken_ids(app, SHARED) == ["plain-1", "plain-2", "mid-6", "urgent-9"]


def test_a_restarted_worker_takes_over_its_predecessors_prioritized_messages(plain: Plain) -> None:
    app, client = plain
    own = PREFIX + "w-1"
    for tag, priority in (("left-9", 9), ("left-0", None)):
        _send(app, own, tag, priority)
    for consumed in (True, False):  # start() empties it whether or not this worker consumes its queue
        queue = DirectQueue(client, model=MODEL, hostname="w-1", name=own, shared=SHARED, linger_s=60.0,
                            consumed=consumed)  # fmt: skip
        moved = queue.start()
        assert queue_depth(client, own) == 0
        if consumed:
            assert moved == 2
    _send(app, own, "routed-3", 3)
    queue.beat(time.time() + 30)  # one that does not consume its queue sweeps it every beat
    assert queue.swept == 1 and queue_depth(client, own) == 0
    assert _taken_ids(app, SHARED) == ["left-0", "routed-3", "left-9"]
