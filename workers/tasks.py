"""The Celery tasks: thin glue from a message to the scheduler and back.

``fleet.infer`` carries one request (one Celery task per request: Flower sees each, acks are per
request). ``fleet.infer_bulk`` carries many requests in one message for producers that need more
requests/s than one task per request allows; each request still gets its own result under its
own ID (see :mod:`workers.bulk`).

The per-request pipeline both use lives in :mod:`workers.pipeline`. Any
:class:`~protocol.errors.FleetError` becomes the request's FAILURE result (its type name and
``(message, field, limit)`` args, JSON); the worker and the other requests go on. Both tasks are
:class:`~workers.trace_guard.ContainedTask`: whatever Celery's handling around the body raises, the
message is acked (or rejected) and its slot given back.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from celery import Celery, Task, signals
from celery.exceptions import Ignore, Reject

from broker import CANCEL_MARKS, unacked_entry_of
from protocol.celeryconf import consumes_direct_queue
from protocol.errors import (
    DecodeError,
    FleetError,
    InvalidRequest,
    RequestCancelled,
    RequestExpired,
)
from protocol.messages import (
    BULK_TASK_NAME,
    TASK_NAME,
)
from protocol.settings import FleetSettings
from workers.bulk import handle_bulk
from workers.pipeline import handle_request
from workers.run_claims import Delivery, WaitAbandoned
from workers.runtime import WorkerRuntime, current_runtime
from workers.scheduler import Role
from workers.stream_publisher import asks_to_generate
from workers.trace_guard import ContainedTask

__all__ = ["consume_direct_queue", "register_tasks"]

EXPECTED_ERRORS = (InvalidRequest, RequestExpired, RequestCancelled)
CANARY_SUFFIX = ".canary"
"""A model's canary queue is its queue + this suffix (``FleetSettings.canary_queue_for``)."""
RESULT_REPR_MAX = 16_384
"""Characters of a result Celery's events carry to Flower (its default, 1,024, cuts embeddings)."""
ENDING_EVENTS = {"SUCCESS": "task-succeeded", "FAILURE": "task-failed", "REVOKED": "task-revoked"}
"""The task event that ends, in Flower, an ignored copy of a request whose outcome is stored in this state."""

log = logging.getLogger("fleet.worker")


def register_tasks(app: Celery) -> None:
    """Register ``fleet.infer`` and ``fleet.infer_bulk`` on ``app``; its workers consume the canary queues."""
    consume_canary_queues(app)

    # resultrepr_maxsize: Celery's task-succeeded event (what Flower shows) carries a repr of the result,
    # cut at 1 KiB by default; an embedding or a generation's ids need more to stay readable.
    # base=ContainedTask: an exception in Celery's own result handling still acks the message (workers.trace_guard)
    @app.task(  # type: ignore[untyped-decorator]
        name=TASK_NAME, bind=True, throws=EXPECTED_ERRORS, acks_late=True, resultrepr_maxsize=RESULT_REPR_MAX,
        base=ContainedTask,
    )
    def infer(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """One request: ``args=[{"model": ..., "input_ids": [...], ...}]`` (or ``kwargs={"request": {...}}``)."""
        runtime = _runtime()
        if len(args) == 1 and not kwargs:
            payload: Any = args[0]
        elif not args and set(kwargs) == {"request"}:
            payload = kwargs["request"]
        else:
            raise DecodeError(
                f"fleet.infer takes exactly one JSON object (args=[request]); got {len(args)} args and "
                f"kwargs {sorted(kwargs)}",
                "args",
                1,
            )
        started = bool(self.app.conf.task_track_started)
        if asks_to_generate(payload):
            request_id = str(self.request.id)
            try:
                claimed = _claimed(runtime, request_id, _delivery_of(self))  # waits while another delivery runs it
            except WaitAbandoned as exc:  # a warm shutdown: back to the queue, for a worker that stays
                raise Reject(str(exc), requeue=True) from exc
            if not claimed:  # its outcome is stored: acked; nothing run, stored or streamed (workers.run_claims)
                _end_ignored_copy(self, request_id)
                raise Ignore()
            runtime.streams.hold_end(request_id)  # its stream ends once its result is stored
            if not started:
                self.update_state(state="STARTED", meta={"pid": os.getpid(), "hostname": self.request.hostname})
                started = True
        return handle_request(
            runtime, payload, request_id=str(self.request.id), worker=str(self.request.hostname or runtime.hostname),
            role=role_of(self), started=started,
        )

    @app.task(  # type: ignore[untyped-decorator]
        name=BULK_TASK_NAME, bind=True, throws=EXPECTED_ERRORS, acks_late=True, base=ContainedTask
    )
    def infer_bulk(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Many requests: ``args=[{"requests": [{"request_id": ..., "model": ..., "input_ids": [...]}, ...]}]``."""
        runtime = _runtime()
        runtime.scheduler.seen(str(self.request.id))  # its requests reach the scheduler together, or fail
        if len(args) != 1 or kwargs or not isinstance(args[0], dict):
            raise DecodeError("fleet.infer_bulk takes exactly one JSON object {requests: [...]}", "args", 1)
        return handle_bulk(
            runtime, args[0], worker=str(self.request.hostname or runtime.hostname), backend=self.backend,
            role=role_of(self), task_id=str(self.request.id),
        )


def _delivery_of(task: Task) -> Delivery | None:
    """Where the task's message is held unacked, when this worker's channel noted it (:mod:`broker.store_ack`;
    not with a ``global_keyprefix``)."""
    entry = unacked_entry_of(task.request)
    return Delivery(index_key=entry[0], tag=entry[1]) if entry else None


def _end_ignored_copy(task: Task, request_id: str) -> None:
    """End an ignored copy of ``request_id`` in the task events, as its stored outcome: ``task-succeeded``,
    ``task-failed`` or ``task-revoked`` (:data:`ENDING_EVENTS`), with no result or exception in it.

    Celery's ``Ignore`` acks the message and sends no event, so Flower, which had the copy's task-received
    and task-started, showed it running for ever wherever it had missed the first delivery's end (started
    later, or that worker's events lost). Celery's own skip of a redelivered task whose SUCCESS is stored
    (``worker_deduplicate_successful_tasks``) sends task-succeeded; this sends the event of the state stored,
    so Flower's state for the ID is the stored one whatever it saw before (an event of a lower precedence
    never overrides a higher one there). Leaving the result and exception out keeps what Flower showed of
    the first delivery's. Nothing is stored: one ``GET`` reads the state; a Redis error skips the event
    (logged), never the ack.
    """
    if not task.app.conf.worker_send_task_events:
        return
    try:
        state = str(task.AsyncResult(request_id).state)
        event = ENDING_EVENTS.get(state)
        if event is None:  # not terminal any more (its result expired meanwhile): no end to report
            return
        revoked = event == "task-revoked"  # Celery's own task-revoked carries these three
        fields: dict[str, Any] = {"terminated": False, "signum": None, "expired": False} if revoked else {}
        task.send_event(event, retry=False, **fields)
    except Exception as exc:  # a Redis error, kombu's OperationalError: the copy is still acked
        log.warning("generation %s: the end event of its ignored copy was not sent (%s); Flower may show the "
                    "copy running", request_id, exc)  # fmt: skip


def _claimed(runtime: WorkerRuntime, request_id: str, delivery: Delivery | None = None) -> bool:
    """Claim generation ``request_id`` for this delivery (:meth:`workers.run_claims.RunClaims.acquire`): False
    when its outcome is stored. A delivery that waited for another's claim is no request on its way to a batch
    (:meth:`Scheduler.seen <workers.scheduler.Scheduler.seen>`, the scheduler woken so a wait for company ends),
    and the cancel mark read when it was taken is stale once it runs: dropped, so the mark is read again."""
    waited = False

    def on_wait() -> None:
        nonlocal waited
        waited = True
        runtime.scheduler.seen(request_id)
        runtime.scheduler.wake()

    if not runtime.run_claims.acquire(request_id, on_wait=on_wait, delivery=delivery):
        return False
    if waited:
        CANCEL_MARKS.take(request_id)
    return True


def consume_canary_queues(app: Celery) -> None:
    """Make every worker of ``app`` also consume ``<queue>.canary`` for each model queue it consumes
    (whatever ``-Q`` named): canary traffic runs on its canary engine, or on stable when it has none,
    so no request is stranded when a canary is set or dropped."""

    def add(sender: Any = None, instance: Any = None, **_: Any) -> None:
        if getattr(instance, "app", None) is not app:
            return
        queues = instance.app.amqp.queues
        for name in list(queues.consume_from or queues):
            if not name.endswith(CANARY_SUFFIX):
                queues.select_add(name + CANARY_SUFFIX)

    signals.celeryd_after_setup.connect(add, weak=False)


def consume_direct_queue(app: Celery, settings: FleetSettings) -> None:
    """With prefix-aware routing on for the worker's model, make each worker of ``app`` also consume its own
    queue (``FleetSettings.direct_queue_for(model, its node name)``, :mod:`workers.direct_queue`), first in
    kombu's order, so a request routed to it is taken before the shared backlog."""
    model = settings.worker.model
    try:
        settings.model_key(model)
    except FleetError:
        return
    if not consumes_direct_queue(settings, model):
        return

    def add(sender: Any = None, instance: Any = None, **_: Any) -> None:
        if getattr(instance, "app", None) is not app:
            return
        queues = instance.app.amqp.queues
        name = settings.direct_queue_for(model, str(sender))
        queues.select_add(name)
        consume_from = queues.consume_from
        if isinstance(consume_from, dict) and name in consume_from:  # first: taken before the shared backlog
            consume_from.update({k: consume_from.pop(k) for k in [k for k in consume_from if k != name]})

    signals.celeryd_after_setup.connect(add, weak=False)


def role_of(task: Task) -> Role:
    """The role of the queue this message was taken from: ``canary`` for ``<queue>.canary``."""
    info = getattr(task.request, "delivery_info", None) or {}
    routing_key = str(info.get("routing_key") or "")
    return "canary" if routing_key.endswith(CANARY_SUFFIX) else "stable"


def _runtime() -> WorkerRuntime:
    runtime = current_runtime()
    if runtime is None:
        raise FleetError("this process has no model loaded (not started as a fleet worker)", "worker", None)
    return runtime
