"""Test-only worker plugin (tests/integration/test_readiness_truth.py): kill a thread the worker needs, hold a slot.

Loaded with ``celery worker --include tests.integration.readiness_plugin``, as the other test plugins are
(:mod:`tests.integration.outside_body_plugin`); production workers never import it, and their poison guard
refuses a task name they do not know, so no request can reach these tasks there.

* :data:`KILL_SCHEDULER`: the scheduler's batch policy becomes one whose decision raises, so the exception
  leaves the scheduler's loop (which catches a batch's and a generation step's failures, not its own).
* :data:`KILL_STREAMS`: an item the stream publisher cannot read goes on its queue; its thread ends on the
  ``AttributeError`` (its loop catches Redis errors only).
* :data:`HOLD_TASK`: sets :data:`HELD_KEY` once it runs, then holds its slot until :data:`RELEASE_KEY` exists.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from celery import Task

from workers.app import app
from workers.policy import BatchPolicy, Dispatch, Pending, Wait
from workers.runtime import current_runtime
from workers.worker_runtime import WorkerRuntime

__all__ = ["HELD_KEY", "HOLD_TASK", "KILL_SCHEDULER", "KILL_STREAMS", "RELEASE_KEY"]

KILL_SCHEDULER = "fleet.test.kill_scheduler"
KILL_STREAMS = "fleet.test.kill_streams"
HOLD_TASK = "fleet.test.hold"
HELD_KEY = "fleet:test:held:{id}"
RELEASE_KEY = "fleet:test:release:{id}"


class _RaisingPolicy(BatchPolicy):
    def decide(self, now_s: float, pending: Sequence[Pending], arriving: int = 0) -> Dispatch | Wait:
        raise RuntimeError("test: the scheduler's loop raises an exception it does not catch")


def _runtime() -> WorkerRuntime:
    runtime = current_runtime()
    assert runtime is not None
    return runtime


@app.task(name=KILL_SCHEDULER)  # type: ignore[untyped-decorator]
def kill_scheduler(*_: Any, **__: Any) -> str:
    scheduler = _runtime().scheduler
    policy = scheduler.policy
    scheduler.policy = _RaisingPolicy(policy.max_batch_size, policy.max_wait_s * 1000, policy.max_batch_tokens)
    scheduler.wake()
    return "killed"


@app.task(name=KILL_STREAMS)  # type: ignore[untyped-decorator]
def kill_streams(*_: Any, **__: Any) -> str:
    streams = _runtime().streams
    streams._queue.put(("test", "not an event"))  # type: ignore[arg-type]  # what it cannot read, on purpose
    streams._wake.set()
    return "killed"


@app.task(name=HOLD_TASK, bind=True, acks_late=True)  # type: ignore[untyped-decorator]
def hold(self: Task, *_: Any, **__: Any) -> str:
    """Mark that it runs, then hold the slot until the release key exists (at most 300 s)."""
    runtime = _runtime()
    runtime.redis.set(HELD_KEY.format(id=self.request.id), 1)
    deadline = time.monotonic() + 300
    while not runtime.redis.exists(RELEASE_KEY.format(id=self.request.id)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return "released"
