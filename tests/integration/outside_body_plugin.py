"""Test-only worker plugin: Celery's failure handling of ``fleet.infer`` raises for some request IDs.

Loaded with ``celery worker --include tests.integration.outside_body_plugin``. For a task ID that
starts with :data:`PREFIX`, ``Task.on_failure`` (which Celery's tracer calls outside the task body,
as it does errbacks and chains) raises, so the exception leaves the tracer the way an unreadable
errback's did. Production workers never import it.
"""

from __future__ import annotations

from typing import Any

from protocol.messages import TASK_NAME
from workers.app import app

__all__ = ["PREFIX"]

PREFIX = "outside-body-"

_task = app.tasks[TASK_NAME]
_on_failure = _task.on_failure


def _raising_on_failure(exc: BaseException, task_id: str, *args: Any, **kwargs: Any) -> Any:
    if str(task_id).startswith(PREFIX):
        raise KeyError("task")  # what Celery's errback handling raised on {"x": 1}
    return _on_failure(exc, task_id, *args, **kwargs)


_task.on_failure = _raising_on_failure
