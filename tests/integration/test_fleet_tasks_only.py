"""Only the fleet's own tasks run on its queues: Celery's built-in tasks are dead-lettered, naming the task.

Every Celery worker registers Celery's built-ins (``celery.chunks``, ``celery.backend_cleanup``,
``celery.chord_unlock``, …). A guard that checked only that a task is registered let them run on
a model's queue; ``celery.chord_unlock`` items even vanished, with no result and no dead-letter
entry. Each item below must end as a dead-letter entry naming its task and a FAILURE under its ID,
and the requests queued around them must be served.
"""

from __future__ import annotations

import json
import time

import redis

from protocol.deadletter import DeadLetter, Reason, read_entry
from protocol.keys import DEAD_LETTER_KEY
from tests.integration.fleet_fixtures import Fleet
from tests.queue_items import envelope, raw

QUEUE = "fleet.demo-lm"
BUILTINS: dict[str, list[object]] = {
    "celery.chunks": [{"task": "fleet.infer"}, [[{"model": "demo-lm", "input_ids": [1]}]], 1],
    "celery.backend_cleanup": [],
    "celery.chord_unlock": ["group-1", [{"task": "fleet.infer"}]],
    "celery.map": [{"task": "fleet.infer"}, [[{"model": "demo-lm", "input_ids": [1]}]]],
    "celery.starmap": [{"task": "fleet.infer"}, [[{"model": "demo-lm", "input_ids": [1]}]]],
    "celery.group": [[]],
    "celery.chain": [[]],
    "celery.accumulate": [1, 2],
}


def test_celery_built_in_tasks_are_dead_lettered_naming_the_task(fleet: Fleet) -> None:
    cfg = fleet.config()
    worker = fleet.worker(cfg)
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    before = client.submit("demo-lm", [1, 2, 3])
    with r.pipeline(transaction=False) as pipe:
        for name, args in BUILTINS.items():
            body = json.dumps([args, {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}])
            pipe.lpush(QUEUE, raw(envelope(QUEUE, body.encode(), task=name, task_id=f"builtin-{name}")))
        pipe.execute()
    after = client.submit("demo-lm", [4, 5, 6])
    assert client.result(before, wait=True, timeout_s=60) is not None
    assert client.result(after, wait=True, timeout_s=60) is not None

    entries: dict[str, DeadLetter] = {}
    deadline = time.monotonic() + 30
    while len(entries) < len(BUILTINS):
        assert time.monotonic() < deadline, (sorted(entries), worker.log_tail())
        entries = {e.task or "": e for e in map(read_entry, r.lrange(DEAD_LETTER_KEY, 0, -1))}
        time.sleep(0.1)
    assert sorted(entries) == sorted(BUILTINS)
    for name, entry in entries.items():
        assert (entry.reason, entry.field, entry.task_id) == (Reason.UNKNOWN_TASK, "headers.task", f"builtin-{name}")
        assert repr(name) in entry.detail and "fleet.*" in entry.detail, entry.detail
        meta = json.loads(r.get(f"celery-task-meta-builtin-{name}") or b"{}")
        assert meta.get("status") == "FAILURE" and name in json.dumps(meta.get("result")), meta
    assert worker.proc is not None and worker.proc.poll() is None
