"""The Celery task ``fleet.infer``: thin glue from a message to the scheduler and back.

decode → validate against the model's limits → hand to the scheduler → wait → encode. Any
:class:`~protocol.errors.FleetError` becomes the request's FAILURE result (its type name and
``(message, field, limit)`` args, JSON); the worker and the other requests go on.
"""

from __future__ import annotations

import time
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
from protocol.messages import TASK_NAME, InferenceResult, Timings, TopToken, decode_request
from protocol.validation import check_input, resolve_output
from workers.runtime import WorkerRuntime, current_runtime
from workers.scheduler import Job

__all__ = ["handle_request", "register_tasks"]

EXPECTED_ERRORS = (InvalidRequest, RequestExpired, RequestCancelled)


def register_tasks(app: Celery) -> None:
    """Register ``fleet.infer`` on ``app``."""

    @app.task(name=TASK_NAME, bind=True, throws=EXPECTED_ERRORS, acks_late=True)  # type: ignore[untyped-decorator]
    def infer(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """One request: ``args=[{"model": ..., "input_ids": [...], ...}]`` (or ``kwargs={"request": {...}}``)."""
        runtime = current_runtime()
        if runtime is None:
            raise FleetError(
                "this process has no model loaded (not started as a fleet worker)", "worker", None
            )
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
            runtime,
            payload,
            request_id=str(self.request.id),
            worker=str(self.request.hostname or runtime.hostname),
        )


def handle_request(runtime: WorkerRuntime, payload: Any, *, request_id: str, worker: str) -> dict[str, Any]:
    """Serve one request end to end on this worker; returns the JSON result.

    Raises:
        FleetError: the request is invalid, expired, or meant for another model.
    """
    runtime.token_taken()
    try:
        if runtime.redis.exists(CANCEL_KEY.format(id=request_id)):
            raise RequestCancelled(f"request {request_id} was cancelled before it ran", "request_id", None)
        with runtime.scheduler.arrival() as arrival:
            request = decode_request(payload)
            if runtime.settings.model_key(request.model) != runtime.model_key:
                raise UnknownModel(
                    f"request for model {request.model!r} reached queue {runtime.queue}, which serves "
                    f"{runtime.model_key!r}",
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
        done = future.result()
        queue_wait_ms = done.batch_wait_ms
        if request.submitted_at_unix_s is not None:
            queue_wait_ms = max(0.0, (done.batch_started_unix_s - request.submitted_at_unix_s) * 1000)
        top = None
        if done.top_ids is not None and done.top_logprobs is not None:
            top = [
                TopToken(token_id=t, logprob=lp)
                for t, lp in zip(done.top_ids, done.top_logprobs, strict=True)
            ]
        result = InferenceResult(
            request_id=request_id,
            model=runtime.model_key,
            version=runtime.version,
            kind=output.kind or "next_token",
            input_tokens=len(checked.input_ids),
            truncated=checked.truncated,
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
    finally:
        runtime.token_returned()
