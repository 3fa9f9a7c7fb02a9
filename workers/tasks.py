"""The Celery tasks: thin glue from a message to the scheduler and back.

``fleet.infer`` carries one request (one Celery task per request: Flower sees each, acks are per
request). ``fleet.infer_bulk`` carries many requests in one message for producers that need more
requests/s than one task per request allows; each request still gets its own result under its
own ID (see :mod:`workers.bulk`).

decode → validate against the model's limits → hand to the scheduler → wait → encode. Any
:class:`~protocol.errors.FleetError` becomes the request's FAILURE result (its type name and
``(message, field, limit)`` args, JSON); the worker and the other requests go on.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

from celery import Celery, Task

from protocol.errors import (
    DecodeError,
    FleetError,
    InvalidRequest,
    RequestCancelled,
    RequestExpired,
    UnknownModel,
)
from protocol.keys import CANCEL_KEY
from protocol.messages import (
    BULK_TASK_NAME,
    TASK_NAME,
    InferenceRequest,
    InferenceResult,
    Timings,
    TopToken,
    decode_request,
)
from protocol.validation import CheckedInput, check_input, resolve_output
from workers.runtime import WorkerRuntime, current_runtime
from workers.scheduler import Arrival, Job, JobResult

__all__ = ["Prepared", "finish", "handle_request", "prepare", "register_tasks"]

EXPECTED_ERRORS = (InvalidRequest, RequestExpired, RequestCancelled)


def register_tasks(app: Celery) -> None:
    """Register ``fleet.infer`` and ``fleet.infer_bulk`` on ``app``."""

    @app.task(name=TASK_NAME, bind=True, throws=EXPECTED_ERRORS, acks_late=True)  # type: ignore[untyped-decorator]
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
        return handle_request(
            runtime, payload, request_id=str(self.request.id), worker=str(self.request.hostname or runtime.hostname)
        )

    @app.task(name=BULK_TASK_NAME, bind=True, throws=EXPECTED_ERRORS, acks_late=True)  # type: ignore[untyped-decorator]
    def infer_bulk(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Many requests: ``args=[{"requests": [{"request_id": ..., "model": ..., "input_ids": [...]}, ...]}]``."""
        from workers.bulk import handle_bulk

        runtime = _runtime()
        if len(args) != 1 or kwargs or not isinstance(args[0], dict):
            raise DecodeError("fleet.infer_bulk takes exactly one JSON object {requests: [...]}", "args", 1)
        return handle_bulk(
            runtime, args[0], worker=str(self.request.hostname or runtime.hostname), backend=self.backend
        )


def _runtime() -> WorkerRuntime:
    runtime = current_runtime()
    if runtime is None:
        raise FleetError("this process has no model loaded (not started as a fleet worker)", "worker", None)
    return runtime


class Prepared:
    """A validated request handed to the scheduler, waiting for its share of a batch."""

    def __init__(self, request: InferenceRequest, checked: CheckedInput, kind: str, future: Future[JobResult]) -> None:
        self.request = request
        self.checked = checked
        self.kind = kind
        self.future = future


def prepare(
    runtime: WorkerRuntime, payload: Any, arrival: Arrival | Any, *, request_id: str, cancelled: bool = False
) -> Prepared:
    """Decode and validate one request, then submit it to the scheduler through ``arrival``.

    Raises:
        FleetError: invalid, expired, cancelled, or meant for another model.
    """
    if cancelled:
        raise RequestCancelled(f"request {request_id} was cancelled before it ran", "request_id", None)
    request = decode_request(payload)
    if runtime.settings.model_key(request.model) != runtime.model_key:
        raise UnknownModel(
            f"request for model {request.model!r} reached queue {runtime.queue}, which serves {runtime.model_key!r}",
            "model",
            runtime.model_key,
        )
    deadline_mono = None
    if request.deadline_unix_s is not None:
        remaining_s = request.deadline_unix_s - time.time()
        if remaining_s <= 0:
            raise RequestExpired(
                f"deadline passed {-remaining_s * 1000:.0f} ms before the request was dequeued; not run",
                "deadline_unix_s",
                request.deadline_unix_s,
            )
        deadline_mono = time.monotonic() + remaining_s
    limits = runtime.model.limits
    checked = check_input(list(request.input_ids), limits=limits, vocab_size=runtime.card.vocab_size)
    output = resolve_output(request.output, model_kind=runtime.card.kind, limits=limits)
    future = arrival.submit(Job(checked.input_ids, output, deadline_mono))
    return Prepared(request, checked, output.kind or "next_token", future)


def finish(runtime: WorkerRuntime, prepared: Prepared, *, request_id: str, worker: str) -> dict[str, Any]:
    """Wait for the request's batch and encode its JSON result (re-raises the job's error)."""
    done = prepared.future.result()
    request = prepared.request
    queue_wait_ms = done.batch_wait_ms
    if request.submitted_at_unix_s is not None:
        queue_wait_ms = max(0.0, (done.batch_started_unix_s - request.submitted_at_unix_s) * 1000)
    top = None
    if done.top_ids is not None and done.top_logprobs is not None:
        top = [TopToken(token_id=t, logprob=lp) for t, lp in zip(done.top_ids, done.top_logprobs, strict=True)]
    result = InferenceResult(
        request_id=request_id,
        model=runtime.model_key,
        version=runtime.version,
        kind=prepared.kind,  # type: ignore[arg-type]
        input_tokens=len(prepared.checked.input_ids),
        truncated=prepared.checked.truncated,
        top_k=top,
        embedding=done.embedding,
        timings=Timings(
            queue_wait_ms=round(queue_wait_ms, 3),
            batch_wait_ms=round(done.batch_wait_ms, 3),
            inference_ms=round(done.inference_ms, 3),
            batch_size=done.batch_size,
            padded_tokens=done.padded_tokens,
            worker=worker,
        ),
    )
    return result.model_dump(mode="json")


def handle_request(runtime: WorkerRuntime, payload: Any, *, request_id: str, worker: str) -> dict[str, Any]:
    """Serve one request end to end on this worker; returns the JSON result.

    Raises:
        FleetError: the request is invalid, expired, cancelled, or meant for another model.
    """
    runtime.token_taken()
    try:
        with runtime.scheduler.arrival() as arrival:
            cancelled = bool(runtime.redis.exists(CANCEL_KEY.format(id=request_id)))
            prepared = prepare(runtime, payload, arrival, request_id=request_id, cancelled=cancelled)
        return finish(runtime, prepared, request_id=request_id, worker=worker)
    finally:
        runtime.token_returned()
