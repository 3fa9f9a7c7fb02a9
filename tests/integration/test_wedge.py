"""A message whose embed Celery's own failure handling cannot read must not hold a worker's slot.

A ``fleet.infer`` message with ``errbacks: [{"x": 1}]`` (or a ``chain`` of non-signatures) in its
body's embed failed in the task, then Celery's failure handler raised on the errback
("Exception raised outside body: KeyError('task')"): the FAILURE was stored, the message never
acked, and its slot of the worker's concurrency never came back. C such messages stopped a
worker while its heartbeat said ready. These tests send exactly that and then a valid request.
"""

from __future__ import annotations

import json
import time

import redis

from protocol.deadletter import Reason, read_entry
from protocol.keys import DEAD_LETTER_KEY
from tests.integration.fleet_fixtures import Fleet
from tests.queue_items import envelope, raw

QUEUE = "fleet.demo-lm"
CONCURRENCY = 2
EMBEDS = [
    {"errbacks": [{"x": 1}]},
    {"chain": [{"x": 1}]},
    {"callbacks": [{"task": "celery.backend_cleanup"}]},
    {"chord": {"task": "celery.chord_unlock"}},
]


def _item(task_id: str, embed: dict[str, object]) -> bytes:
    request = {"model": "demo-lm", "input_ids": [-1], "request_id": task_id}
    return raw(envelope(QUEUE, json.dumps([[request], {}, embed]).encode(), task_id=task_id))


def test_messages_with_an_embed_the_fleet_does_not_use_never_wedge_the_worker(fleet: Fleet) -> None:
    cfg = fleet.config(worker={"concurrency": CONCURRENCY},
                       models={"demo-lm": {"batching": {"max_batch_size": CONCURRENCY}}})
    worker = fleet.worker(cfg, concurrency=CONCURRENCY)
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    ids = [f"eb-{i}" for i in range(CONCURRENCY * len(EMBEDS))]
    with r.pipeline(transaction=False) as pipe:
        for i, task_id in enumerate(ids):  # more than the worker's slots of each kind
            pipe.lpush(QUEUE, _item(task_id, EMBEDS[i % len(EMBEDS)]))
        pipe.execute()
    good = client.submit("demo-lm", [5, 6, 7])
    result = client.result(good, wait=True, timeout_s=60)
    assert result is not None, worker.log_tail()

    dead: dict[str, str] = {}
    deadline = time.monotonic() + 30
    while len(dead) < len(ids):
        assert time.monotonic() < deadline, (sorted(dead), worker.log_tail())
        dead = {e.task_id or "": e.field or "" for e in map(read_entry, r.lrange(DEAD_LETTER_KEY, 0, -1))}
        time.sleep(0.1)
    for i, task_id in enumerate(ids):  # each refused naming the embed field it carried
        field = next(iter(EMBEDS[i % len(EMBEDS)]))
        assert dead[task_id] == f"body[2].{field}", (task_id, dead[task_id])
        meta = json.loads(r.get(f"celery-task-meta-{task_id}") or b"{}")
        assert meta.get("status") == "FAILURE" and field in json.dumps(meta.get("result")), meta
    assert {e.reason for e in map(read_entry, r.lrange(DEAD_LETTER_KEY, 0, -1))} == {Reason.BAD_BODY}
    assert r.hlen("unacked") == 0
    assert worker.proc is not None and worker.proc.poll() is None
