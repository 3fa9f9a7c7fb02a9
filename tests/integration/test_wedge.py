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
from pathlib import Path

import redis

from protocol.deadletter import Reason, read_entry
from protocol.keys import DEAD_LETTER_KEY
from tests.integration.fleet_fixtures import Fleet
from tests.integration.outside_body_plugin import PREFIX
from tests.queue_items import envelope, raw
from tools.processes import WorkerProcess

QUEUE = "fleet.demo-lm"
CONCURRENCY = 2
EMBEDS: list[dict[str, object]] = [
    {"errbacks": [{"x": 1}]},
    {"chain": [{"x": 1}]},
    {"callbacks": [{"task": "celery.backend_cleanup"}]},
    {"chord": {"task": "celery.chord_unlock"}},
]


def _item(task_id: str, embed: dict[str, object]) -> bytes:
    request = {"model": "demo-lm", "input_ids": [-1], "request_id": task_id}
    return raw(envelope(QUEUE, json.dumps([[request], {}, embed]).encode(), task_id=task_id))


def _small_config(fleet: Fleet) -> Path:
    return fleet.config(worker={"concurrency": CONCURRENCY},
                        models={"demo-lm": {"batching": {"max_batch_size": CONCURRENCY}}})


def test_messages_with_an_embed_the_fleet_does_not_use_never_wedge_the_worker(fleet: Fleet) -> None:
    cfg = _small_config(fleet)
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


def test_an_exception_in_celerys_failure_handling_still_acks_and_frees_the_slot(fleet: Fleet) -> None:
    """Celery's own handling around the body raises (here ``Task.on_failure``, as the errback handling did):
    the message is acked as failed, its FAILURE stored, its slot given back; twice as many such messages
    as the worker has slots, then a valid request, which must be served."""
    cfg = _small_config(fleet)
    n = len(fleet.workers) + 1
    proc = WorkerProcess(model="demo-lm", queue=QUEUE, redis_url=fleet.redis_url, concurrency=CONCURRENCY,
                         hostname=f"ob{n}-demo-lm@test", env={"FLEET_CONFIG": str(cfg)},
                         log_path=fleet.tmp_path / f"worker-{n}.log")
    proc.cmd += ["--include", "tests.integration.outside_body_plugin"]
    fleet.workers.append(proc.start())
    proc.wait_ready(120)
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    ids = [f"{PREFIX}{i}" for i in range(2 * CONCURRENCY)]
    with r.pipeline(transaction=False) as pipe:  # invalid input: the task fails, then its failure handling raises
        for task_id in ids:
            pipe.lpush(QUEUE, _item(task_id, {}))
        pipe.execute()
    good = client.submit("demo-lm", [5, 6, 7])
    assert client.result(good, wait=True, timeout_s=60) is not None, proc.log_tail()
    for task_id in ids:
        meta = json.loads(r.get(f"celery-task-meta-{task_id}") or b"{}")
        assert meta.get("status") == "FAILURE", (task_id, meta)
    deadline = time.monotonic() + 30
    while r.hlen("unacked"):  # every message acked
        assert time.monotonic() < deadline, r.hkeys("unacked")
        time.sleep(0.1)
    assert "Exception raised outside body" in proc.log_tail(2_000_000)
    assert proc.proc is not None and proc.proc.poll() is None
