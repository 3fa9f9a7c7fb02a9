"""Test-only worker plugin: a task whose message kills the worker process that runs it.

Loaded into a real worker with ``celery worker --include tests.integration.killer_plugin`` (see
:func:`tests.integration.test_deliveries.killer_worker`); production workers never import it, so no
message can reach this task there (the guard refuses an unknown task name).
"""

from __future__ import annotations

import os

from workers.app import app

__all__ = ["DIE_TASK", "EXIT_CODE"]

DIE_TASK = "fleet.test.die"
EXIT_CODE = 70


@app.task(name=DIE_TASK)  # type: ignore[untyped-decorator]
def die() -> None:
    """Exit at once, the way a segfault or an OOM kill ends a worker: no cleanup, no ack."""
    os._exit(EXIT_CODE)
