"""Test-only worker plugin: tasks that misbehave the ways a worker must survive and report.

Loaded with ``celery worker --include tests.integration.outside_body_plugin``; production workers
never import it.

* For a task ID that starts with :data:`PREFIX`, ``fleet.infer``'s ``Task.on_failure`` (which
  Celery's tracer calls outside the task body, as it does errbacks and chains) raises, so the
  exception leaves the tracer the way an unreadable errback's did.
* :data:`HANG_TASK` holds its slot and does nothing until the Redis key :data:`RELEASE_KEY` of its
  task ID exists: work a worker holds and does not progress.
"""

from __future__ import annotations

import time
from typing import Any

from celery import Task

from protocol.messages import TASK_NAME
from workers.app import app
from workers.runtime import current_runtime

__all__ = ["HANG_TASK", "PREFIX", "RELEASE_KEY"]

PREFIX = "outside-body-"
HANG_TASK = "fleet.test.hang"
RELEASE_KEY = "fleet:test:release:{id}"

_task = app.tasks[TASK_NAME]
_on_failure = _task.on_failure


def _raising_on_failure(exc: BaseException, task_id: str, *args: Any, **kwargs: Any) -> Any:
    if str(task_id).startswith(PREFIX):
        raise KeyError("task")  # what Celery's errback handling raised on {"x": 1}
    return _on_failure(exc, task_id, *args, **kwargs)


_task.on_failure = _raising_on_failure


@app.task(name=HANG_TASK, bind=True, acks_late=True)  # type: ignore[untyped-decorator]
def hang(self: Task, *_: Any, **__: Any) -> str:
    """Hold the slot until the release key exists (at most 300 s)."""
    runtime = current_runtime()
    assert runtime is not None
    deadline = time.monotonic() + 300
    while not runtime.redis.exists(RELEASE_KEY.format(id=self.request.id)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return "released"
