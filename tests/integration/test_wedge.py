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

from producer.ops_cli import probe
from protocol.deadletter import Reason, read_entry
from protocol.keys import DEAD_LETTER_KEY, WORKER_KEY_PREFIX
from tests.integration.fleet_fixtures import Fleet
from tests.integration.outside_body_plugin import HANG_TASK, PREFIX, RELEASE_KEY
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


def _small_config(fleet: Fleet, **worker: object) -> Path:
    return fleet.config(worker={"concurrency": CONCURRENCY, **worker},
                        models={"demo-lm": {"batching": {"max_batch_size": CONCURRENCY}}})


def _plugin_worker(fleet: Fleet, cfg: Path) -> WorkerProcess:
    """A concurrency-2 demo-lm worker with the misbehaving test tasks (tests/integration/outside_body_plugin.py)."""
    return fleet.worker(cfg, concurrency=CONCURRENCY, hostname=f"ob{len(fleet.workers) + 1}-demo-lm@test",
                        include="tests.integration.outside_body_plugin")


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
    proc = _plugin_worker(fleet, cfg)
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


def test_a_worker_holding_work_it_does_not_progress_is_not_ready_until_it_progresses(fleet: Fleet) -> None:
    """A held request that neither finishes nor lets the engine step: after worker.stall_after_s the heartbeat
    says not ready and `fleet probe ready` fails, naming the stall; past its deadline + slot_grace_s the slot
    is reported; once the request finishes the worker is ready again."""
    cfg = _small_config(fleet, stall_after_s=2, slot_grace_s=0)
    proc = _plugin_worker(fleet, cfg)
    settings = fleet.settings(cfg)
    r = redis.Redis.from_url(fleet.redis_url)

    def beat() -> dict[str, object]:
        return dict(json.loads(r.get(WORKER_KEY_PREFIX + proc.hostname) or b"{}"))

    assert beat().get("ready") is True and probe(settings, "ready", worker=proc.hostname, models=None) == []
    body = json.dumps([[{"deadline_unix_s": time.time() + 1}], {}, {}]).encode()
    r.lpush(QUEUE, raw(envelope(QUEUE, body, task=HANG_TASK, task_id="hang-1")))

    deadline = time.monotonic() + 60
    while beat().get("ready") is not False:
        assert time.monotonic() < deadline, (beat(), proc.log_tail())
        time.sleep(0.1)
    doc = beat()
    assert doc.get("held") == 1 and float(str(doc.get("stalled_s"))) >= 2, doc
    problems = probe(settings, "ready", worker=proc.hostname, models=None)
    assert len(problems) == 1 and "made no progress" in problems[0], problems
    assert probe(settings, "ready", worker=None, models=["demo-lm"]), "the model has no ready worker"
    deadline = time.monotonic() + 30
    while "hang-1 has held a slot" not in proc.log_tail(2_000_000):  # past its deadline + 0 s grace
        assert time.monotonic() < deadline, proc.log_tail()
        time.sleep(0.1)

    r.set(RELEASE_KEY.format(id="hang-1"), 1)
    deadline = time.monotonic() + 60
    while beat().get("ready") is not True:
        assert time.monotonic() < deadline, (beat(), proc.log_tail())
        time.sleep(0.1)
    assert probe(settings, "ready", worker=proc.hostname, models=None) == []
    assert json.loads(r.get("celery-task-meta-hang-1") or b"{}").get("status") == "SUCCESS"
