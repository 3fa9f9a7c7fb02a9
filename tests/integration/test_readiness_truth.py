"""Readiness that tells the truth: a worker that takes requests and cannot serve them says so, at once.

* An engine that fails every run (a real ONNX model whose ``Gather`` fails in ONNX Runtime on every token id
  its start-up runs do not use: :mod:`tests.integration.broken_models`) failed each request it took, at
  once: that counted as progress, so the worker stayed ready while every request failed. Now
  ``worker.not_ready_after_failed_runs`` failed runs in a row (one-step batches or generation steps) turn it
  not ready, naming why, until a run succeeds; requests refused by validation do not count.
* A dead scheduler thread (or stream publisher thread) computed nothing more while the heartbeat said ready:
  held requests made it not ready only after ``worker.stall_after_s``, and an idle worker never. Now the
  thread is named in the heartbeat's ``not_ready``; the scheduler's death is published at once.
* After SIGTERM the not-ready heartbeat went out at the next beat, up to ``heartbeat_s`` later. Now at once.

With ``heartbeat_s`` at 60 s, a beat whose ``heartbeat_unix_s`` is under ``started_unix_s + 60`` cannot be a
scheduled one (the first comes a whole period after the heartbeat thread starts, which is after the runtime
was built): only the immediate write explains it. Tests wait on the heartbeat key's contents, never on time.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from producer.ops_cli import probe
from protocol.errors import FleetError
from protocol.keys import WORKER_KEY_PREFIX
from tests.integration.broken_models import guard_token_ids
from tests.integration.fleet_fixtures import Fleet
from tests.integration.ops_fixtures import scrape, wait_until
from tests.integration.readiness_plugin import HELD_KEY, HOLD_TASK, KILL_SCHEDULER, KILL_STREAMS, RELEASE_KEY
from tests.queue_items import envelope, good_body, raw
from tools.processes import WorkerProcess
from tools.redis_server import free_port

QUEUE = "fleet.demo-lm"
RUNS = 3
"""``worker.not_ready_after_failed_runs`` in these tests."""
LONG_BEAT_S = 60.0
"""A heartbeat period no test waits out: a beat before its first period ends is an immediate one."""
FAILS = [5, 6, 7]
"""Token ids the broken model fails on (at or above :data:`~tests.integration.broken_models.FIRST_BAD_ID`)."""
RUNS_OK = [1, 2, 3]
"""Token ids it computes."""


def _beat(r: redis.Redis[bytes], hostname: str) -> dict[str, Any]:
    return dict(json.loads(r.get(WORKER_KEY_PREFIX + hostname) or b"{}"))


def _small_config(fleet: Fleet, **worker: object) -> Any:
    return fleet.config(worker={"concurrency": 2, **worker}, models={"demo-lm": {"batching": {"max_batch_size": 2}}})


def _plugin_worker(fleet: Fleet, cfg: Path, hostname: str) -> WorkerProcess:
    """A concurrency-2 demo-lm worker with the test plugin's tasks (tests/integration/readiness_plugin.py)."""
    return fleet.worker(cfg, concurrency=2, hostname=hostname, include="tests.integration.readiness_plugin")


def _send_task(r: redis.Redis[bytes], task: str, task_id: str) -> None:
    r.lpush(QUEUE, raw(envelope(QUEUE, json.dumps([[{}], {}, {}]).encode(), task=task, task_id=task_id)))


def _fails(client: Any, input_ids: list[int], **kwargs: Any) -> FleetError:
    """Submit, and return the error the request failed with (it must fail)."""
    with pytest.raises(FleetError) as failed:
        client.result(client.submit("demo-lm", input_ids, **kwargs), wait=True, timeout_s=60)
    return failed.value


def test_an_engine_that_fails_every_run_is_not_ready_until_a_run_succeeds(fleet: Fleet, tmp_path: Path) -> None:
    """One-step requests, then generations, that fail in ONNX Runtime: ``RUNS`` failed runs in a row turn the
    heartbeat, ``fleet probe ready`` and ``fleet_worker_ready`` not ready, naming the engine's failures; one run
    that succeeds makes it ready again. Requests validation refuses between failed runs neither count nor end
    the streak."""
    broken = guard_token_ids(fleet.model_dir / "demo-lm" / "demo-lm-1.0.0.onnx", tmp_path / "broken")
    port = free_port()
    cfg = fleet.config(worker={"concurrency": 2, "metrics_port": port, "not_ready_after_failed_runs": RUNS},
                       models={"demo-lm": {"path": str(broken), "batching": {"max_batch_size": 2}}})
    settings = fleet.settings(cfg)
    worker = fleet.worker(cfg, concurrency=2, hostname="broken-engine@test")
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    gauge = ("fleet_worker_ready", (("model", "demo-lm"),))

    def beat() -> dict[str, Any]:
        return _beat(r, worker.hostname)

    for _ in range(RUNS):  # one request at a time: one engine run each
        assert "Gather" in str(_fails(client, FAILS))
    wait_until(lambda: beat().get("ready") is False, 60, "the heartbeat to say not ready")
    reason = str(beat()["not_ready"])
    assert f"engine failed {RUNS} runs in a row" in reason and "not_ready_after_failed_runs" in reason, reason
    said = probe(settings, "ready", worker=worker.hostname, models=None)
    assert said and f"is not ready: its engine failed {RUNS} runs in a row" in said[0], said
    assert scrape(f"http://127.0.0.1:{port}/metrics")[gauge] == 0

    assert client.result(client.submit("demo-lm", RUNS_OK), wait=True, timeout_s=60) is not None
    wait_until(lambda: beat().get("ready") is True, 60, "ready again after a run that succeeded")
    assert beat()["failed_runs"] == 0 and beat()["not_ready"] is None
    assert probe(settings, "ready", worker=worker.hostname, models=None) == []
    assert scrape(f"http://127.0.0.1:{port}/metrics")[gauge] == 1

    for _ in range(RUNS - 1):
        _fails(client, FAILS)
    wait_until(lambda: beat().get("failed_runs") == RUNS - 1, 60, f"{RUNS - 1} failed runs in the heartbeat")
    for i in range(RUNS):  # refused by validation: never reaches the engine, neither a failed run nor a success
        r.lpush(QUEUE, raw(envelope(QUEUE, good_body({"model": "demo-lm", "input_ids": [-1], "request_id": f"bad-{i}"}),
                                    task_id=f"bad-{i}")))
        with pytest.raises(FleetError) as refused:
            client.result(f"bad-{i}", wait=True, timeout_s=60)
        assert str(refused.value.field).startswith("input_ids"), refused.value
    refused_by = time.time()
    wait_until(lambda: beat().get("heartbeat_unix_s", 0) > refused_by, 60, "a beat after the refusals")
    assert (beat()["failed_runs"], beat()["ready"]) == (RUNS - 1, True), beat()
    _fails(client, FAILS)
    wait_until(lambda: beat().get("ready") is False, 60, "not ready at the streak's last failed run")
    assert client.result(client.submit("demo-lm", RUNS_OK), wait=True, timeout_s=60) is not None
    wait_until(lambda: beat().get("ready") is True, 60, "ready again")

    for _ in range(RUNS):  # generations: each fails at its prefill step
        assert "Gather" in str(_fails(client, FAILS, generation={"max_new_tokens": 4}))
    wait_until(lambda: beat().get("ready") is False, 60, "not ready after failed generation steps")
    assert f"engine failed {RUNS} runs in a row" in str(beat()["not_ready"])
    done = client.result(client.submit("demo-lm", RUNS_OK, generation={"max_new_tokens": 1}), wait=True, timeout_s=60)
    assert done is not None  # one token: the prefill's, from ids the model computes
    wait_until(lambda: beat().get("ready") is True, 60, "ready again after a generation that succeeded")
    assert worker.proc is not None and worker.proc.poll() is None


def test_a_dead_scheduler_thread_is_not_ready_at_once_naming_it(fleet: Fleet) -> None:
    """The scheduler's loop raises an exception it does not catch: the heartbeat says not ready, naming the
    thread, in a beat written at once (``heartbeat_s`` is 60 s), and ``fleet probe ready`` says why."""
    cfg = _small_config(fleet, heartbeat_s=LONG_BEAT_S)
    settings = fleet.settings(cfg)
    proc = _plugin_worker(fleet, cfg, "dead-scheduler@test")
    r = redis.Redis.from_url(fleet.redis_url)
    assert _beat(r, proc.hostname)["ready"] is True

    _send_task(r, KILL_SCHEDULER, "kill-scheduler")
    wait_until(lambda: _beat(r, proc.hostname).get("ready") is False, 2 * LONG_BEAT_S,
               "the heartbeat to say not ready")
    doc = _beat(r, proc.hostname)
    assert "thread fleet-scheduler died" in str(doc["not_ready"]), doc
    assert doc["beat_at_once"] is True, f"a scheduled beat, not the notice's: {doc}"
    said = probe(settings, "ready", worker=proc.hostname, models=None)
    assert said and "thread fleet-scheduler died" in said[0], said
    assert "the scheduler thread died" in proc.log_tail(2_000_000)
    live = probe(settings, "live", worker=proc.hostname, models=None)  # nothing restarts the thread: fail liveness
    assert live and "cannot recover: thread fleet-scheduler died" in live[0] and "restart it" in live[0], live


def test_a_dead_stream_publisher_thread_is_not_ready_naming_it(fleet: Fleet) -> None:
    """A sibling the scheduler's notice does not cover: the stream publisher's thread ends on an item it cannot
    read; the next beat finds it dead (``thread.is_alive()``) and names it."""
    cfg = _small_config(fleet)
    proc = _plugin_worker(fleet, cfg, "dead-streams@test")
    r = redis.Redis.from_url(fleet.redis_url)
    assert _beat(r, proc.hostname)["ready"] is True

    _send_task(r, KILL_STREAMS, "kill-streams")
    wait_until(lambda: _beat(r, proc.hostname).get("ready") is False, 60, "the heartbeat to say not ready")
    assert "thread fleet-streams died" in str(_beat(r, proc.hostname)["not_ready"])
    live = probe(fleet.settings(cfg), "live", worker=proc.hostname, models=None)
    assert live and "thread fleet-streams died" in live[0], live


def test_sigterm_publishes_not_ready_at_once_not_at_the_next_beat(fleet: Fleet) -> None:
    """SIGTERM while the worker holds a request: the heartbeat says ``ready: false``, ``shutting_down`` in a beat
    written at once (``heartbeat_s`` is 60 s); the worker drains the request and exits 0."""
    cfg = _small_config(fleet, heartbeat_s=LONG_BEAT_S)
    proc = _plugin_worker(fleet, cfg, "sigterm-now@test")
    r = redis.Redis.from_url(fleet.redis_url)
    _send_task(r, HOLD_TASK, "held-1")
    wait_until(lambda: r.exists(HELD_KEY.format(id="held-1")), 60, "the worker to hold the request")
    assert _beat(r, proc.hostname)["ready"] is True

    assert proc.proc is not None
    proc.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: _beat(r, proc.hostname).get("ready") is False, 2 * LONG_BEAT_S,
               "the heartbeat to say not ready")
    doc = _beat(r, proc.hostname)
    assert doc["shutting_down"] is True, doc
    assert doc["beat_at_once"] is True, f"a scheduled beat, not the shutdown's: {doc}"
    assert "shutting down" in str(doc.get("not_ready")), doc

    r.set(RELEASE_KEY.format(id="held-1"), 1)
    assert proc.proc.wait(60) == 0, proc.log_tail()
    assert json.loads(r.get("celery-task-meta-held-1") or b"{}").get("status") == "SUCCESS"
