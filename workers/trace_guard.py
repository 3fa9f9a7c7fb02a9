"""Every way out of a fleet task ends its message: acked (or requeued), its worker slot given back.

Celery runs a task through a tracer (``celery.app.trace.build_tracer``) that stores the result,
then runs its success or failure handling outside the task body: callbacks, errbacks, chains,
chords, ``Task.on_failure``. When that handling raises, the tracer logs "Exception raised outside
body", tries the failure handling a second time, and when that raises too the exception leaves
the tracer. With the threads pool nothing catches it: the pool never calls the request's
callback, so the message is never acked, its slot of the worker's concurrency is never given back,
and C such messages stop the worker for good while it still looks alive.

:class:`ContainedTask` wraps the tracer Celery installs on each task (``task.__trace__``, set at
every consumer start): an exception that leaves it becomes a failed trace, which Celery's request
handling then acks (``acks_on_failure``) or, for a ``Reject``, rejects as the exception asks. The
request gets a FAILURE result naming what raised when it has no final result yet (Celery may have
stored one before its handling raised; a stored result is never replaced).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from celery import Task, states
from celery.app.trace import TraceInfo, report_internal_error, trace_ok_t
from celery.exceptions import Reject

from protocol.errors import FleetError

__all__ = ["ContainedTask", "contain", "off_traced", "on_traced", "outside_body_errors"]

log = logging.getLogger("fleet.trace")

Tracer = Callable[..., Any]

_count_lock = threading.Lock()
_outside_body_errors = 0


def outside_body_errors() -> int:
    """Exceptions that left a task's tracer in this process (each turned into a failed, acked trace)."""
    return _outside_body_errors


_traced_callbacks: list[Callable[[str], None]] = []


def on_traced(callback: Callable[[str], None]) -> None:
    """Call ``callback(task_id)`` on the task's thread each time a fleet task's trace is done: its result
    stored (a FAILURE too), whatever the outcome, before its message is acked. It must not block."""
    _traced_callbacks.append(callback)


def off_traced(callback: Callable[[str], None]) -> None:
    """Stop calling ``callback`` (a closed worker runtime)."""
    if callback in _traced_callbacks:
        _traced_callbacks.remove(callback)


def _traced(task_id: str) -> None:
    for callback in list(_traced_callbacks):
        try:
            callback(task_id)
        except Exception:  # the ack must happen whatever a callback does
            log.exception("a callback after the trace of %s raised", task_id)


def contain(task: Task, tracer: Tracer) -> Tracer:
    """``tracer`` (Celery's ``__trace__`` of ``task``), except that no exception leaves it; then the
    :func:`on_traced` callbacks."""

    def trace(uuid: str, args: Any, kwargs: Any, request: Any = None) -> Any:
        try:
            return tracer(uuid, args, kwargs, request)
        except Exception as exc:  # Celery's own handling raised: the message must still be acked or rejected
            return _failed_trace(task, uuid, exc)
        finally:
            _traced(str(uuid))

    trace.__wrapped__ = tracer  # type: ignore[attr-defined]
    return trace


def _failed_trace(task: Task, task_id: str, exc: Exception) -> Any:
    """A failed trace Celery's request handling acks (a ``Reject``: rejects), after storing a FAILURE."""
    global _outside_body_errors
    with _count_lock:
        _outside_body_errors += 1
    einfo = report_internal_error(task, exc)  # logs "Exception raised outside body" with the traceback
    if not isinstance(exc, Reject):
        log.error("task %s[%s]: Celery's result handling raised %s: %s; the message is acked as failed",
                  task.name, task_id, type(exc).__name__, exc)
        _store_failure_if_none(task, task_id, FleetError(
            f"the worker's result handling raised {type(exc).__name__}: {exc}"[:500], "message", None))
    return trace_ok_t(einfo, TraceInfo(states.FAILURE, exc), 0.0, None)


def _store_failure_if_none(task: Task, task_id: str, error: FleetError) -> None:
    """FAILURE for ``task_id`` unless a final state is stored already; errbacks and chains are not run."""
    try:
        if task.backend.get_task_meta(task_id, cache=False).get("status") in states.READY_STATES:
            return
        request = SimpleNamespace(
            id=task_id, task=task.name, args=None, kwargs=None, hostname=None, retries=0, delivery_info=None,
            chord=None, chain=None, errbacks=None, group=None, parent_id=None, children=[], stamps=None,
            ignore_result=False,
        )
        task.backend.mark_as_failure(task_id, error, request=request, call_errbacks=False)
    except Exception:  # the ack must happen whatever the result store does
        log.exception("could not store the FAILURE result of %s", task_id)


class ContainedTask(Task):  # type: ignore[misc]
    """A Celery task whose tracer never lets an exception out (see the module doc)."""

    @property
    def __trace__(self) -> Tracer | None:
        return self.__dict__.get("_contained_trace")

    @__trace__.setter
    def __trace__(self, tracer: Tracer | None) -> None:
        self.__dict__["_contained_trace"] = None if tracer is None else contain(self, tracer)
