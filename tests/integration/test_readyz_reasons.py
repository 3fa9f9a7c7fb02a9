"""``/readyz`` says which workers are not ready and why: a real gateway, a real demo-lm worker whose scheduler
thread dies (the test plugin :mod:`tests.integration.readiness_plugin`), real Redis.

Reported: with the model's only worker alive but not ready, ``/readyz`` said ``model 'demo-lm' has no ready
worker (1 starting)``: "starting" of a worker whose heartbeat says why it cannot serve (its ``not_ready``, as
``fleet probe ready --worker`` prints it). Now each such worker is named with its reason.
"""

from __future__ import annotations

import json

import httpx
import pytest
import redis

from protocol.keys import WORKER_KEY_PREFIX
from tests.integration.ops_fixtures import ROOT, OpsFleet, ops_fleet, ops_models, ops_redis, wait_until
from tests.integration.readiness_plugin import KILL_SCHEDULER
from tests.queue_items import envelope, raw
from tools.processes import WorkerProcess

__all__ = ["ops_fleet", "ops_models", "ops_redis"]

pytestmark = pytest.mark.timeout(300)

QUEUE = "fleet.demo-lm"


def test_readyz_names_each_worker_that_is_not_ready_and_why(ops_fleet: OpsFleet) -> None:
    config = ops_fleet.config(serve=("demo-lm",))
    hostname = "readyz-dead-scheduler@test"
    proc = WorkerProcess(model="demo-lm", queue=QUEUE, redis_url=ops_fleet.redis_url, concurrency=8,
                         hostname=hostname, env={"FLEET_CONFIG": str(config)},
                         log_path=ops_fleet.tmp_path / "worker-plugin.log", cwd=ROOT)  # fmt: skip
    proc.cmd += ["--include", "tests.integration.readiness_plugin"]
    ops_fleet.workers.append(proc.start())
    proc.wait_ready(120)
    gateway = ops_fleet.gateway(config)
    ready = httpx.get(gateway.url + "/readyz", timeout=30)
    assert ready.status_code == 200 and ready.json()["problems"] == [], ready.text

    r = redis.Redis.from_url(ops_fleet.redis_url)
    r.lpush(QUEUE, raw(envelope(QUEUE, json.dumps([[{}], {}, {}]).encode(), task=KILL_SCHEDULER, task_id="kill")))
    wait_until(lambda: json.loads(r.get(WORKER_KEY_PREFIX + hostname) or b"{}").get("ready") is False, 60,
               "the heartbeat to say not ready")  # fmt: skip

    answer = httpx.get(gateway.url + "/readyz", timeout=30)
    assert answer.status_code == 503, answer.text
    problems = answer.json()["problems"]
    assert problems[0].startswith("model 'demo-lm' has no ready worker"), problems
    assert any(p.startswith(f"worker {hostname!r} is not ready: thread fleet-scheduler died") for p in problems), (
        problems
    )
    only = httpx.get(gateway.url + "/readyz", params={"model": "demo-lm"}, timeout=30).json()["problems"]
    assert only == problems, only
