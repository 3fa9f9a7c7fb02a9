"""Readiness says whether the worker makes progress: siblings of the wedge that readiness once missed.

* A worker whose only work is a canary's generation (or one finishing on a loop a swap retired) steps a
  generation loop other than the stable one. Progress counted only the stable loop's steps, so such a
  worker read as holding work it did not progress and turned not ready while it generated fine.
* A warm shutdown (SIGTERM) stops the consumer at once and drains what the worker holds, for as long as
  that takes. The heartbeat said ready until the very end, so ``fleet probe ready`` (and the model's
  readiness) counted a worker that would take nothing more.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import redis

from producer.ops_cli import probe
from protocol.keys import WORKER_KEY_PREFIX
from protocol.messages import GenerationParams
from tests.integration.fleet_fixtures import Fleet
from tests.integration.ops_fixtures import scrape, wait_until
from tests.integration.outside_body_plugin import HANG_TASK, RELEASE_KEY
from tests.queue_items import envelope, raw
from tools.processes import WorkerProcess
from tools.redis_server import free_port
from workers.engines import load_version
from workers.generation.sequence import GenSequence
from workers.progress import Held, ProgressWatch
from workers.worker_runtime import WorkerRuntime

STALL_AFTER_S = 1.0
"""The watch's stall bound in the pure check below; the observations' times are passed in, never waited."""


def test_a_canary_generation_is_progress(fleet: Fleet) -> None:
    """A generation on the canary's loop advances what the progress watch reads; a watch that saw the worker
    hold that generation across more than ``stall_after_s`` (times passed in) finds it progressing."""
    cfg = fleet.config(worker={"model": "demo-llama", "concurrency": 8})
    settings = fleet.settings(cfg)
    runtime = WorkerRuntime(settings, "readiness-canary@test", 8)
    try:
        runtime.swap("canary", load_version(settings, "demo-llama"))
        assert runtime.scheduler.canary is not None and runtime.canary is not None
        runtime.scheduler.start()
        watch = ProgressWatch(stall_after_s=STALL_AFTER_S, slot_grace_s=0, no_deadline_s=3600)
        held = [Held("canary-gen", None)]
        assert not watch.observe(0.0, time.time(), held, runtime._work_done()).stalled
        seq = GenSequence(request_id="canary-gen", prompt=[5, 17, 9, 30], eos_ids=frozenset(), role="canary",
                          params=GenerationParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, stream=False))
        runtime.scheduler.submit_generation(seq).result(timeout=60)
        assert seq.served_role == "canary"  # it ran on the canary's loop, the stable loop never stepped
        assert runtime.scheduler.generation is not None and runtime.scheduler.generation.steps_run == 0
        report = watch.observe(10 * STALL_AFTER_S, time.time(), held, runtime._work_done())
        assert not report.stalled, f"8 canary steps ran and the watch saw no progress: {report}"
    finally:
        runtime.scheduler.stop()
        runtime.heartbeat.stop()


def _plugin_worker(fleet: Fleet, cfg: Path) -> WorkerProcess:
    """A concurrency-2 demo-lm worker with the test plugin's hanging task (tests/integration/outside_body_plugin.py)."""
    return fleet.worker(cfg, concurrency=2, hostname="drain-demo-lm@test",
                        include="tests.integration.outside_body_plugin")


def test_a_worker_in_warm_shutdown_is_not_ready_while_it_drains(fleet: Fleet) -> None:
    """SIGTERM while the worker holds a request: from then on its heartbeat, ``fleet probe ready`` (the worker's and
    the model's) and ``fleet_worker_ready`` say not ready, while it drains; it stores that request and exits."""
    port = free_port()
    cfg = fleet.config(worker={"concurrency": 2, "metrics_port": port},
                       models={"demo-lm": {"batching": {"max_batch_size": 2}}})
    settings = fleet.settings(cfg)
    proc = _plugin_worker(fleet, cfg)
    r = redis.Redis.from_url(fleet.redis_url)

    def beat() -> dict[str, object]:
        return dict(json.loads(r.get(WORKER_KEY_PREFIX + proc.hostname) or b"{}"))

    body = json.dumps([[{}], {}, {}]).encode()
    r.lpush("fleet.demo-lm", raw(envelope("fleet.demo-lm", body, task=HANG_TASK, task_id="drain-1")))
    wait_until(lambda: beat().get("held") == 1, 60, "the worker to hold the request")
    assert beat().get("ready") is True and probe(settings, "ready", worker=proc.hostname, models=None) == []

    assert proc.proc is not None
    proc.proc.send_signal(signal.SIGTERM)  # warm shutdown: the consumer stops, the held request drains
    wait_until(lambda: beat().get("ready") is False, 30, "the draining worker's heartbeat to say not ready")
    assert proc.proc.poll() is None, "still draining"
    said = probe(settings, "ready", worker=proc.hostname, models=None)
    assert said and "is shutting down (draining what it holds" in said[0], said
    assert probe(settings, "ready", worker=None, models=["demo-lm"]), "the model has no worker that takes requests"
    assert scrape(f"http://127.0.0.1:{port}/metrics")[("fleet_worker_ready", (("model", "demo-lm"),))] == 0

    r.set(RELEASE_KEY.format(id="drain-1"), 1)
    assert proc.proc.wait(60) == 0, proc.log_tail()
    assert json.loads(r.get("celery-task-meta-drain-1") or b"{}").get("status") == "SUCCESS"


def test_a_worker_whose_redis_takes_no_writes_is_not_ready_until_it_takes_them_again(fleet: Fleet) -> None:
    """``CLIENT PAUSE … WRITE``: Redis answers reads and holds every write (the consumer's take, the result, the
    beat) unanswered. The probe, which only reads, must fail (the beat lapses), as must the gauge; once writes
    are taken again the worker is ready and serves."""
    port = free_port()
    cfg = fleet.config(worker={"concurrency": 2, "metrics_port": port},
                       models={"demo-lm": {"batching": {"max_batch_size": 2}}})
    settings = fleet.settings(cfg)
    worker = fleet.worker(cfg, concurrency=2)
    client = fleet.client(cfg)
    assert client.result(client.submit("demo-lm", [5, 6, 7]), wait=True, timeout_s=60) is not None
    r = redis.Redis.from_url(fleet.redis_url)
    metrics = f"http://127.0.0.1:{port}/metrics"
    gauge = ("fleet_worker_ready", (("model", "demo-lm"),))
    r.execute_command("CLIENT", "PAUSE", 600_000, "WRITE")
    try:
        wait_until(lambda: probe(settings, "ready", worker=worker.hostname, models=None), 60,
                   "the probe to fail while Redis takes no writes")
        wait_until(lambda: scrape(metrics)[gauge] == 0, 60, "fleet_worker_ready to say 0")
    finally:
        r.execute_command("CLIENT", "UNPAUSE")
    wait_until(lambda: probe(settings, "ready", worker=worker.hostname, models=None) == [], 60,
               "the probe to pass once Redis takes writes again")
    assert client.result(client.submit("demo-lm", [8, 9]), wait=True, timeout_s=60) is not None, worker.log_tail()
    assert worker.proc is not None and worker.proc.poll() is None
