"""A message that kills its worker is redelivered, kills again, and after max_deliveries is dead-lettered."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis
from celery import Celery

from protocol.deadletter import Reason, read_entry
from protocol.errors import FleetError
from protocol.keys import DEAD_LETTER_KEY, DELIVERIES_KEY
from protocol.messages import InferenceResult
from tests.integration.fleet_fixtures import Fleet
from tests.integration.killer_plugin import DIE_TASK, EXIT_CODE
from tools.processes import WorkerProcess

QUEUE = "fleet.demo-lm"


def killer_worker(fleet: Fleet, config: Path, *, wait: bool) -> WorkerProcess:
    """A real demo-lm worker that also registers the test-only task that kills it."""
    return fleet.worker(config, wait=wait, hostname=f"k{len(fleet.workers) + 1}-demo-lm@test",
                        include="tests.integration.killer_plugin")


def _exit_code(worker: WorkerProcess, timeout_s: float) -> int:
    assert worker.proc is not None
    return worker.proc.wait(timeout_s)


def test_a_worker_killing_message_is_dead_lettered_after_max_deliveries(fleet: Fleet) -> None:
    cfg = fleet.config(visibility_timeout_s=2, worker={"max_deliveries": 2, "heartbeat_s": 0.2})
    r = redis.Redis.from_url(fleet.redis_url)
    plain = Celery(broker=fleet.redis_url, backend=fleet.redis_url)
    try:
        first = killer_worker(fleet, cfg, wait=True)
        killer = plain.send_task(DIE_TASK, queue=QUEUE, task_id="killer-1")
        assert _exit_code(first, 30) == EXIT_CODE  # delivery 1: the worker dies, the message stays unacked

        second = killer_worker(fleet, cfg, wait=False)  # restores it after the visibility timeout: delivery 2
        assert _exit_code(second, 60) == EXIT_CODE, second.log_tail()
        assert int(r.get(DELIVERIES_KEY.format(id=killer.id)) or 0) == 2

        client = fleet.client(cfg)
        ids = [client.submit("demo-lm", [5 + i, 6, 7]) for i in range(4)]
        third = killer_worker(fleet, cfg, wait=True)  # delivery 3 > max_deliveries: dead-lettered, not run
        results = client.wait(ids, 60)
        assert all(isinstance(res, InferenceResult) for res in results), results
        assert {res.timings.worker for res in results if isinstance(res, InferenceResult)} == {third.hostname}

        deadline = time.monotonic() + 30
        while not r.llen(DEAD_LETTER_KEY):
            assert time.monotonic() < deadline, third.log_tail()
            time.sleep(0.1)
        entry = read_entry(r.lindex(DEAD_LETTER_KEY, 0) or b"")
        assert entry.reason is Reason.MAX_DELIVERIES and entry.task_id == killer.id and entry.task == DIE_TASK
        assert entry.deliveries == 3 and entry.queue == QUEUE and entry.worker == third.hostname
        with pytest.raises(FleetError) as info:
            client.result(killer.id, wait=True, timeout_s=10)
        assert info.value.field == "deliveries" and info.value.limit == 2
        assert "max_deliveries=2" in str(info.value)
        assert third.proc is not None and third.proc.poll() is None  # the fleet serves on
        assert r.llen(QUEUE) == 0
    finally:
        plain.close()
